"""Where the host time of one cucopy step goes (torch CUDA destinations, NumPy sources).

Usage:
    python bench/probes/profile_host.py [--n 32] [--steps 300] [--json PATH]   # torch CUDA

Question: which calls dominate a whole step's host time (begin, staging, flush)?
Answered for the pure-Python path in ``bench/results/2026-11-30-h200-host/profile_host.json``;
kept while the host path is still being moved into compiled code (the answer changes
with it). Prints per-call costs of the pieces (array resolution, begin, staging copies,
flush) and a cProfile of whole steps, sorted by own time. Host time only: no GPU
timing here (see ``bench/step_cost.py``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``cucopy`` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

import cucopy as cc  # noqa: E402
from cucopy.adapters import resolve  # noqa: E402


class Site(cc.CopySite):
    INPUT = cc.H2D


def _per_call(fn, reps=20000) -> float:
    for _ in range(100):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def main(argv=None) -> dict:
    """Run the profile and return its figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch

    rng = np.random.default_rng(0)
    sizes = rng.integers(4, 512, args.n)
    dsts = [torch.zeros(int(k), dtype=torch.int32, device="cuda") for k in sizes]
    srcs = [rng.integers(0, 1000, int(k)).astype(np.int32) for k in sizes]
    stream = torch.cuda.Stream()
    copier = cc.DeviceCopier(cc.CopyPlan(merge={Site.INPUT}), stream=stream, flush_mode="dma")
    out = {
        "n": args.n,
        "resolve_torch_cuda_us": _per_call(lambda: resolve(dsts[0])),
        "resolve_numpy_us": _per_call(lambda: resolve(srcs[0])),
        "resolve_torch_cpu_us": _per_call(lambda: resolve(torch.zeros(4)), 5000),
    }

    def stage_only():
        copier.begin()
        for d, s in zip(dsts, srcs):
            copier.copy(Site.INPUT, d, s)
        copier.discard()

    def step():
        with copier.step():
            for d, s in zip(dsts, srcs):
                copier.copy(Site.INPUT, d, s)

    out["stage_only_us_per_copy"] = _per_call(stage_only, args.steps) / args.n
    out["step_us"] = _per_call(step, args.steps)
    out["step_us_per_copy"] = out["step_us"] / args.n
    copier.begin()
    out["begin_flush_empty_us"] = _per_call(lambda: (copier.flush(), copier.begin()), 2000)
    copier.flush()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    text = buf.getvalue()
    for k, v in out.items():
        print(f"{k:28s} {v:10.3f}" if isinstance(v, float) else f"{k:28s} {v}")
    print(text)
    out["profile"] = text
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    copier.close()
    return out


if __name__ == "__main__":
    main()
