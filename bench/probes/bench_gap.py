"""Why does the bench's N = 8 step cost the host more than ``step_phases``' same step?

Usage:
    python bench/probes/bench_gap.py [--n 8,32] [--steps 200] [--rounds 5] [--json PATH]

Question: in runs 41, 43 and session 11's first call, the bench's ``cucopy_auto`` step at
N = 8 took 11.7-13.1 µs of host time, and ``step_phases`` timed the same step (the
bench's decode mix, torch destinations, NumPy sources, each after a drained stream) at
7.6-8.6 µs in the same run; at N = 32 the two agree within 15 %. This probe builds the
bench's own contender (``bench._device.CucopyAuto`` on the bench's context and
workload) and times its ``step()`` several ways in one process, the variants
alternating round by round so the host's spells weigh on each alike:

- ``bench``: as the bench times it (``bench._device.host_us``: the context's
  ``cudaStreamSynchronize`` through CuPy, then the step);
- ``backend_sync``: the copier's own backend synchronizing the stream instead;
- ``back_to_back``: no synchronize between steps;
- ``sync_spin50``: the bench's synchronize, then 50 µs of busy waiting before the step
  (is the cost the first calls after a wait, or the drained stream itself?);
- ``phases``: ``begin()``, the copies and ``flush()`` called directly, as ``step_phases``
  does, after the bench's synchronize;
- the same ``bench`` / ``back_to_back`` / ``sync_spin50`` for ``one_launch`` (one carried
  launch of one 4-byte copy: the driver's share).

It first runs ``step_phases``' bench-mix variant in this process, then prints the
median host µs a step per variant and N, and a profile of the bench's step. Needs a GPU.
Answer (``bench/results/2026-12-02-h200-probes-session11/``): no variant explains it. Timed the
bench's way, with the copier's own synchronize, back to back, as phases, or on a copier
of the probe's own, the step costs the same in one process (11-14 µs at N = 8), and
``step_phases`` itself, run right after in a fresh process, measured 12.0 µs where it
had measured 7.7 an hour before on the same lent machine: the gap is the host's slow
and fast spells falling on different processes, not the bench's way of timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cucopy as cc  # noqa: E402
from bench import _common as common  # noqa: E402
from bench import _device as devmod  # noqa: E402

perf_ns = time.perf_counter_ns


def _spin(us: float) -> None:
    end = perf_ns() + int(us * 1e3)
    while perf_ns() < end:
        pass


def _timed(step, reps: int, before) -> list:
    out = []
    for _ in range(reps):
        before()
        t0 = perf_ns()
        step()
        t1 = perf_ns()
        out.append((t1 - t0) / 1e3)
    return out


def _phases(copier, pairs, site, reps: int, before) -> list:
    copy = copier.copy
    out = []
    for _ in range(reps):
        before()
        t0 = perf_ns()
        copier.begin()
        for d, v in pairs:
            copy(site, d, v)
        copier.flush()
        t1 = perf_ns()
        out.append((t1 - t0) / 1e3)
    return out


def _measure(ctx, n: int, args) -> dict | None:
    """Every variant's samples at N = ``n``, the variants alternating round by round."""
    wl = devmod.Workload(ctx, common.decode_mix(n, 0), 0)
    notes: list = []
    auto = devmod.build(devmod.CucopyAuto, ctx, wl, notes)
    one = devmod.build(devmod.OneLaunch, ctx, wl, notes)
    if auto is None or one is None:
        print(f"N={n}: a contender did not build: {notes}")
        return None
    copier = auto.copier
    backend_sync = copier._backend.synchronize
    stream = copier._stream
    steps = args.steps

    def sync_spin():
        ctx.sync()
        _spin(50)

    import torch

    own = cc.DeviceCopier(devmod.PLAN, stream=torch.cuda.Stream())
    own_ctx = cc.DeviceCopier(devmod.PLAN, stream=ctx.stream_obj)
    site = devmod.Site.INPUT
    pairs = auto._pairs

    def stepper(c):
        def step():
            with c.step():
                for d, v in pairs:
                    c.copy(site, d, v)

        return step

    variants = {
        "bench": lambda: devmod.host_us(ctx, auto.step, steps, 5),
        "backend_sync": lambda: _timed(auto.step, steps, lambda: backend_sync(stream)),
        "back_to_back": lambda: _timed(auto.step, steps, lambda: None),
        "sync_spin50": lambda: _timed(auto.step, steps, sync_spin),
        "phases": lambda: _phases(copier, auto._pairs, devmod.Site.INPUT, steps, ctx.sync),
        "own_copier": lambda: devmod.host_us(ctx, stepper(own), steps, 5),
        "own_copier_ctx_stream": lambda: devmod.host_us(ctx, stepper(own_ctx), steps, 5),
        "one_launch_bench": lambda: devmod.host_us(ctx, one.step, steps, 5),
        "one_launch_back_to_back": lambda: _timed(one.step, steps, lambda: None),
        "one_launch_sync_spin50": lambda: _timed(one.step, steps, sync_spin),
    }
    samples: dict = {k: [] for k in variants}
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(variants)[::-1]
        for k in order:
            samples[k].extend(variants[k]())
            ctx.sync()
    res = {}
    for k, s in samples.items():
        med = statistics.median(s)
        res[k] = {"median": med, "p10": common.summarize(s)["p10"], "samples": s}
        print(f"N={n:3d} {k:26s} median {med:7.2f} us a step = {med / n:5.2f} us/copy")
    import cProfile
    import pstats

    for label, fn in (("bench", auto.step), ("own_copier", stepper(own))):
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(300):
            fn()
            ctx.sync()
        pr.disable()
        print(f"N={n} cProfile of 300 {label} steps (each after the bench's synchronize):")
        pstats.Stats(pr).sort_stats("tottime").print_stats(12)
    print("auto:", auto.copier.stats)
    print("own:", own.stats)
    auto.close()
    one.close()
    own.close()
    own_ctx.close()
    return res


def main(argv=None) -> int:
    """Time the variants; print medians; optionally write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=common.parse_ints, default=[8, 32])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    ctx = devmod.make_context(False, 0)
    if ctx.kind != "gpu":
        print("bench_gap: needs a GPU")
        return 2
    out: dict = {"probe": "bench_gap", "units": "us per step", "results": {}}
    out["environment"] = common.environment(ctx)
    for n in args.n:
        from bench.probes import step_phases

        sites = list(cc.CopySite("S", [(f"s{i}", cc.H2D) for i in range(n)]))
        ns = argparse.Namespace(n=n, steps=1000, sim=False)
        print(f"N={n}: step_phases' bench-mix variant, in this process:")
        step_phases._bench_mix(ns, sites)
        res = _measure(ctx, n, args)
        if res is not None:
            out["results"][str(n)] = res
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
