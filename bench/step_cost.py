"""Cost of one step's N tiny H2D copies, per contender: host µs per copy and GPU µs per step.

Usage:
    python bench/step_cost.py [--n 8,32,128,512] [--reps 200] [--warmup 20]
                              [--contenders a,b,...] [--sim] [--quick] [--json PATH]

Each N is a fixed, seeded decode-like mix of inputs of 16 B-8 KiB (its total is
printed). Contenders, all on one stream in one process: chained torch
``copy_(non_blocking=True)`` from pinned tensors, chained raw ``cudaMemcpyAsync``,
``torch._foreach_copy_``, one ``cudaMemcpyBatchAsync``, vLLM's persistent pinned
buffer per input, cucopy with nothing merged, and cucopy ``dma``, ``mapped`` and
``auto``. Each contender's result is checked byte for byte once before timing.

Measured:
- host µs per copy: wall time of issuing the step / N, the stream drained first
  (no hold), median and p10-p90 over ``--reps``, taken in four rounds over all N
  (alternating direction), each N's contenders in two passes, the second in reverse
  order (the host's drift during a run weighs on every contender and every N alike);
- GPU µs per step: CUDA events around the step, enqueued while a spin kernel stalls
  the stream, so the interval is the step's operations running back to back, without
  the host's launch gaps (GPU only);
- work ops per step: copies and kernel launches enqueued (event records excluded);
  on the simulated device also ``stream.ops`` as measured.

On the simulated device only host time and operation counts are real; GPU times
need a GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` and ``cucopy`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _common as common  # noqa: E402
from bench import _device as devmod  # noqa: E402

NAME = "step_cost"

#: rounds over all N of the host-time passes (see :func:`run`)
ROUNDS = 4


def contender_classes(ctx, contenders=None) -> list:
    """The contenders that run on ``ctx`` (only cucopy's on the simulated device)."""
    classes = [c for c in devmod.ALL if contenders is None or c.name in contenders]
    if ctx.kind == "sim":
        classes = [c for c in classes if issubclass(c, devmod.CucopyContender)]
    return classes


def jobs(ctx, n_list, contenders=None) -> int:
    """Measurement jobs :func:`run` reports to the progress bar."""
    return len(contender_classes(ctx, contenders)) * len(n_list)


def run(ctx, n_list, reps: int, warmup: int, progress=None, contenders=None, seed: int = 0) -> dict:
    """Measure every contender for every N.

    Parameters
    ----------
    ctx : bench._device.Context
    n_list : sequence of int
        Copies per step.
    reps, warmup : int
        Timed and untimed repetitions per measurement.
    progress : bench._common.Progress, optional
    contenders : sequence of str, optional
        Names to run (default: all that can run here).
    seed : int

    Returns
    -------
    dict
        ``mix`` (per N: sizes and total bytes), ``results`` (one row per contender and
        N), ``notes``.
    """
    classes = contender_classes(ctx, contenders)
    progress = progress or common.Progress(enabled=False)
    progress.add(jobs(ctx, n_list, contenders))
    out = {
        "device": common.device_label(ctx),
        "mix": {},
        "results": [],
        "notes": [],
        "contenders": {},
    }
    for c in classes:
        out["contenders"][c.name] = c.description
    groups = []  # (n, total, built) for every N, all built before any timing
    for n in n_list:
        mix = common.decode_mix(n, seed)
        total = common.mix_bytes(mix)
        out["mix"][str(n)] = {
            "total_bytes": total,
            "bytes": [k * (4 if dt == "int32" else 8) for k, dt in mix],
            "dtypes": [dt for _, dt in mix],
        }
        progress.write(f"{NAME}: N={n}: {total} bytes in {n} inputs (16 B-8 KiB, seed {seed})")
        wl = devmod.Workload(ctx, mix, seed)
        built = []
        for cls in classes:
            notes: list = []
            built.append((cls, devmod.build(cls, ctx, wl, notes), notes))
        groups.append((n, total, built))
    # every contender's host time, every N alike: ROUNDS rounds over the N (the
    # direction alternating), each N's contenders in two passes, the second reversed
    # (devmod.host_passes). The host's drift during the run weighs on all contenders
    # and all N alike; up to session 9 each N was timed in one block, and a lent
    # host's slow spell could fall on one N alone (run 41: N = 8 only).
    host: dict = {}
    ops: dict = {}
    rounds = ROUNDS if reps >= 4 * ROUNDS else 1
    for r in range(rounds):
        share = reps // rounds + (1 if r < reps % rounds else 0)
        for n, _, built in groups if r % 2 == 0 else groups[::-1]:
            live = [c for _, c, _ in built if c is not None]
            h, o = devmod.host_by_contender(
                ctx, live, share, warmup if r == 0 else max(2, warmup // 4), out["notes"], f"N={n}"
            )
            for k, v in h.items():
                host.setdefault(k, []).extend(v)
            for k, v in o.items():
                if v is not None:
                    ops.setdefault(k, []).append(v)
    for n, total, built in groups:
        for cls, c, notes in built:
            row = {"contender": cls.name, "n": n, "total_bytes": total, "verified": c is not None}
            if c is not None:
                try:
                    h = host.get(id(c))
                    o = ops.get(id(c))
                    r = devmod.measure(
                        ctx,
                        c,
                        reps,
                        warmup,
                        host=h if h is not None and len(h) == reps else None,
                        ops=sum(o) / len(o) if o else None,
                    )
                    r["host_us_per_copy"] = common.summarize(
                        [x / n for x in r["host_us"]["samples"]]
                    )
                    notes.extend(r.pop("notes"))
                    row.update(r)
                except Exception as e:  # report and go on with the next contender
                    notes.append(f"measurement failed: {e!r}")
                    row["verified"] = False
                finally:
                    c.close()
            row["notes"] = notes
            for note in notes:
                out["notes"].append(f"N={n}: {cls.name}: {note}")
            out["results"].append(row)
            progress.advance(f"{NAME} N={n} {cls.name}")
    if ctx.kind == "sim":
        out["notes"].append(
            "simulated device: host time and stream operations only; GPU times need a GPU"
        )
    return out


def rows(result: dict) -> list[list[str]]:
    """Table rows: contender, N, bytes, host µs/copy, GPU µs/step, ops/step."""
    out = []
    for r in result["results"]:
        ops = r.get("stream_ops_per_step")
        work = r.get("work_ops_per_step")
        ops_txt = f"{work:.0f}" if work is not None else "-"
        if ops is not None:
            ops_txt += f" ({ops:.0f})"
        out.append(
            [
                r["contender"],
                str(r["n"]),
                str(r["total_bytes"]),
                common.fmt_stat(r.get("host_us_per_copy")) if r["verified"] else "skipped",
                common.fmt_stat(r.get("gpu_us"), digits=1),
                ops_txt,
            ]
        )
    return out


HEADER = ["contender", "N", "bytes", "host us/copy [p10-p90]", "GPU us/step [p10-p90]", "ops/step"]


def report(result: dict) -> str:
    """The scenario's table and notes as text."""
    lines = [common.table(rows(result), HEADER)]
    lines.append(
        "ops/step: copies + launches enqueued per step (in parentheses: sim stream.ops, "
        "event records included)"
    )
    lines.append(common.legend(result.get("contenders", {})))
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(line for line in lines if line)


def plot(result: dict, stem: Path) -> list[Path]:
    """``<stem>-step_cost.png``: host µs per copy, GPU µs per step and ops per step vs N."""
    plt = common.pyplot()
    if plt is None:
        return []
    by = {}
    for r in result["results"]:
        if r["verified"]:
            by.setdefault(r["contender"], []).append(r)
    has_gpu = any(r.get("gpu_us") for rs in by.values() for r in rs)
    panels = [("host_us_per_copy", "host time per copy", "host µs per copy (median, p10-p90)")]
    if has_gpu:
        panels.append(
            ("gpu_us", "GPU time per step, stream held", "GPU µs per step (median, p10-p90)")
        )
    panels.append(("work_ops_per_step", "stream operations per step", "copies + launches"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.8), squeeze=False)
    for ax, (key, title, ylabel) in zip(axes[0], panels):
        for i, (name, rs) in enumerate(by.items()):
            xs, ys, lo, hi = [], [], [], []
            for r in rs:
                v = r.get(key)
                if v is None:
                    continue
                if isinstance(v, dict):
                    if v.get("median") is None:
                        continue
                    xs.append(r["n"])
                    ys.append(v["median"])
                    lo.append(v["median"] - v["p10"])
                    hi.append(v["p90"] - v["median"])
                else:
                    xs.append(r["n"])
                    ys.append(v)
                    lo.append(0)
                    hi.append(0)
            if xs:
                xs = common.dodge(xs, i, len(by))
                ax.errorbar(xs, ys, yerr=[lo, hi], label=name, **common.line_style(i))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ns = sorted({r["n"] for rs in by.values() for r in rs})
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("copies per step (N)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    device = result.get("device", "")
    fig.suptitle(common.plot_title("step_cost: N tiny H2D copies", device), fontsize=11)
    return common.save_plot(fig, stem, NAME)


def add_args(p: argparse.ArgumentParser) -> None:
    """This scenario's options."""
    p.add_argument("--n", type=common.parse_ints, default=None, help="copies per step, e.g. 8,32")
    p.add_argument(
        "--contenders",
        type=lambda s: [t for t in s.split(",") if t],
        default=None,
        help="names to run: " + ",".join(c.name for c in devmod.ALL),
    )


def main(argv=None) -> int:
    """Run the scenario alone; print its table; optionally write JSON."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_args(p)
    common.add_run_args(p)
    args = p.parse_args(argv)
    ctx = devmod.make_context(args.sim, args.seed)
    reps, warmup = common.reps_for(ctx, args)
    n_list = args.n or (common.QUICK_N if args.quick else common.DEFAULT_N)
    return common.run_script(
        ctx,
        args,
        NAME,
        lambda prog: run(ctx, n_list, reps, warmup, prog, args.contenders, args.seed),
        report,
    )


if __name__ == "__main__":
    sys.exit(main())
