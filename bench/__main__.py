"""The standard benchmark suite: ``python -m bench`` (what ``./run bench`` runs).

Usage:
    python -m bench [--quick] [--out DIR] [--scenarios a,b,c,d] [--n 8,32,128,512]
                    [--reps N] [--warmup N] [--sim] [--no-plots] [--no-progress]

On a GPU (``cucopy.backends.cuda.gpu_available()``) it runs ``step_cost``,
``decode_loop``, ``size_sweep`` and ``skip_unchanged``; without one, ``step_cost``
and ``skip_unchanged`` on the simulated device, where only host time and stream
operation counts are real. It prints one table per scenario and writes
``<out>/<YYYY-MM-DD>-<gpu-or-sim>.json`` (environment, configuration, every raw
sample, medians and p10/p90) with one PNG plot per scenario next to it. The JSON is
rewritten after each scenario, so a run cut short keeps what it finished.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

from bench import SCENARIOS, decode_loop, size_sweep, skip_unchanged, step_cost
from bench import _common as common
from bench import _device as devmod

MODULES = {
    "step_cost": step_cost,
    "decode_loop": decode_loop,
    "size_sweep": size_sweep,
    "skip_unchanged": skip_unchanged,
}
DEFAULT = {"gpu": SCENARIOS, "sim": ("step_cost", "skip_unchanged")}
LETTERS = dict(zip("abcd", SCENARIOS))  # --scenarios a,c: the (a)-(d)


def parse_args(argv=None) -> argparse.Namespace:
    """The suite's command line."""
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="a tiny configuration (CI)")
    p.add_argument("--out", default=str(common.RESULTS), help="directory for JSON and plots")
    p.add_argument(
        "--scenarios",
        default=None,
        help=f"comma-separated, from {','.join(SCENARIOS)} or a-d (default: all that fit the device)",
    )
    p.add_argument("--n", type=common.parse_ints, default=None, help="step_cost copies per step")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per measurement")
    p.add_argument("--warmup", type=int, default=None, help="untimed repetitions first")
    p.add_argument("--seed", type=int, default=0, help="seeds the size mixes and values")
    p.add_argument("--sim", action="store_true", help="the simulated device even with a GPU")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.scenarios is not None:
        names = [LETTERS.get(s, s) for s in args.scenarios.split(",") if s]
        bad = [s for s in names if s not in SCENARIOS]
        if bad:
            p.error(f"--scenarios: unknown {bad}; expected some of {','.join(SCENARIOS)}")
        args.scenarios = names
    return args


def _n_list(args) -> list[int]:
    return list(args.n or (common.QUICK_N if args.quick else common.DEFAULT_N))


def _sizes(args) -> list[int]:
    return size_sweep.table_sizes(1024, 16 << 10 if args.quick else 1 << 20)


def _fractions(args) -> tuple:
    return (0.0, 1.0) if args.quick else skip_unchanged.DEFAULT_CHANGED


def planned_jobs(name: str, ctx, args) -> int:
    """The jobs scenario ``name`` will report, known before it starts (the progress total)."""
    if name == "step_cost":
        return step_cost.jobs(ctx, _n_list(args))
    if name == "decode_loop":
        return decode_loop.jobs(ctx)
    if name == "size_sweep":
        return size_sweep.jobs(ctx, _sizes(args))
    if name == "skip_unchanged":
        return skip_unchanged.jobs(ctx, _fractions(args))
    raise ValueError(f"scenario: unknown {name!r}")


def run_scenario(name: str, ctx, args, reps: int, warmup: int, progress) -> dict:
    """Run one scenario with the suite's configuration."""
    if name == "step_cost":
        return step_cost.run(ctx, _n_list(args), reps, warmup, progress, seed=args.seed)
    if name == "decode_loop":
        steps = 20 if args.quick else max(200, reps)
        return decode_loop.run(ctx, 32, steps, 1000.0, decode_loop.MODES, progress, seed=args.seed)
    if name == "size_sweep":
        return size_sweep.run(ctx, _sizes(args), 32, reps, warmup, progress, seed=args.seed)
    if name == "skip_unchanged":
        fractions = _fractions(args)
        return skip_unchanged.run(ctx, 32, fractions, reps, warmup, progress, seed=args.seed)
    raise ValueError(f"scenario: unknown {name!r}")


def main(argv=None) -> int:
    """Run the suite; print the tables; write the JSON and the plots.

    Returns
    -------
    int
        0, or 1 when a scenario raised (the others still ran and were written).
    """
    args = parse_args(argv)
    t0 = time.perf_counter()
    ctx = devmod.make_context(args.sim, args.seed)
    reps, warmup = common.reps_for(ctx, args)
    names = args.scenarios or list(DEFAULT[ctx.kind])
    env = common.environment(ctx)
    out_dir = Path(args.out)
    stem = out_dir / f"{common.today()}-{common.device_slug(env)}"
    json_path = stem.with_suffix(".json")
    doc = {
        "schema": 1,
        "created": common.now_iso(),
        "device": ctx.kind,
        "environment": env,
        "config": {
            "quick": args.quick,
            "scenarios": names,
            "n": _n_list(args),
            "reps": reps,
            "warmup": warmup,
            "seed": args.seed,
        },
        "notes": list(getattr(ctx, "notes", [])),
        "scenarios": {},
        "plots": [],
    }
    if ctx.kind == "sim":
        doc["notes"].append(
            "no GPU: ran on the simulated device; host µs and stream operation counts are "
            "real, GPU times need a GPU"
        )
    where = env.get("gpu", {}).get("name", "GPU") if ctx.kind == "gpu" else "the simulated device"
    print(f"cucopy bench on {where}: {', '.join(names)}; reps={reps}, warmup={warmup}", flush=True)
    failed = False
    progress = common.Progress(enabled=not args.no_progress)
    planned = {name: planned_jobs(name, ctx, args) for name in names}
    progress.plan(sum(planned.values()))  # the total is known up front: it never jumps
    done = 0
    try:
        for name in names:
            try:
                result = run_scenario(name, ctx, args, reps, warmup, progress)
            except Exception as e:  # keep the other scenarios and what was written
                failed = True
                result = {"error": repr(e), "traceback": traceback.format_exc(), "notes": []}
                progress.write(f"{name}: failed: {e!r}")
            done += planned[name]
            progress.skip_to(done)  # a scenario that stopped early
            doc["scenarios"][name] = result
            doc["elapsed_s"] = round(time.perf_counter() - t0, 1)
            common.write_json(json_path, doc)
    finally:
        progress.close()
    for name, result in doc["scenarios"].items():
        print(f"\n== {name} ==")
        if "error" in result:
            print(f"failed: {result['error']}")
            continue
        print(MODULES[name].report(result))
    if not args.no_plots:
        if common.pyplot() is None:
            doc["notes"].append("matplotlib is not installed: no plots")
        for name, result in doc["scenarios"].items():
            if "error" in result:
                continue
            try:
                doc["plots"] += [p.name for p in MODULES[name].plot(result, stem)]
            except Exception as e:
                doc["notes"].append(f"{name}: plot failed: {e!r}")
    doc["elapsed_s"] = round(time.perf_counter() - t0, 1)
    common.write_json(json_path, doc)
    for note in doc["notes"]:
        print(f"note: {note}")
    print(f"\nwrote {json_path}" + "".join(f"\n      {out_dir / p}" for p in doc["plots"]))
    print(f"elapsed {doc['elapsed_s']} s")
    ctx.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
