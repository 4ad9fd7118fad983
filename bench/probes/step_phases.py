"""Where a merged step's host time goes: ``begin()``, the copies, ``flush()``, and a profile.

Usage:
    python bench/probes/step_phases.py [--n 32] [--steps 2000] [--sim]

Question: after the compiled staging core (issue 13), how much of a step's host time is
per step (``begin``, ``flush``: backend calls) and how much per copy, on the GPU's host?
Times each phase of a step of N merged copies (torch CUDA destinations when torch sees a
GPU, else sim arrays; NumPy sources), prints medians, then the top of a cProfile of whole
steps. Host time only. Answer: ``bench/results/2026-12-01-h200-run23/step_phases.log``
(the first run with it).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

import cucopy as cc  # noqa: E402


def main(argv=None) -> None:
    """Print median microseconds per phase and a profile."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--sim", action="store_true")
    args = ap.parse_args(argv)
    sites = cc.CopySite("S", [(f"s{i}", cc.H2D) for i in range(args.n)])
    plan = cc.CopyPlan(merge=set(sites))
    rng = np.random.default_rng(0)
    sizes = rng.choice([4, 16, 64, 256], size=args.n)
    srcs = [rng.integers(0, 9, int(k), dtype=np.int32) for k in sizes]
    if args.sim:
        from cucopy.backends.sim import SimDevice

        dev = SimDevice(policy="eager")
        dsts = [dev.zeros((int(k),), np.int32) for k in sizes]
        c = cc.DeviceCopier(plan, stream=dev.default_stream, device=dev, backend="sim")
    else:
        import torch

        stream = torch.cuda.Stream()
        dsts = [torch.zeros(int(k), dtype=torch.int32, device="cuda") for k in sizes]
        c = cc.DeviceCopier(plan, stream=stream)
    cc.show_config()
    triples = list(zip(sites, dsts, srcs))
    copy = c.copy
    tb, tc, tf = [], [], []
    clock = time.perf_counter
    for i in range(args.steps + 200):
        t0 = clock()
        c.begin()
        t1 = clock()
        for s, d, x in triples:
            copy(s, d, x)
        t2 = clock()
        c.flush()
        t3 = clock()
        if i >= 200:
            tb.append(t1 - t0)
            tc.append(t2 - t1)
            tf.append(t3 - t2)
    med = statistics.median
    us = 1e6
    whole = (med(tb) + med(tc) + med(tf)) * us
    print(
        f"N={args.n}: begin {med(tb) * us:.2f} us, copies {med(tc) * us / args.n:.3f} us each, "
        f"flush {med(tf) * us:.2f} us; whole step {whole:.1f} us = {whole / args.n:.2f} us/copy"
    )
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(500):
        c.begin()
        for s, d, x in triples:
            copy(s, d, x)
        c.flush()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    print(c.stats)
    c.close()


if __name__ == "__main__":
    main()
