"""Before and after on one host: a merged step's host time from one source tree.

Usage:
    python bench/probes/ab_step.py [--tree DIR] [--n 8,32,128] [--steps 3000] [--label L]
                                   [--src numpy|torch]

Question: did a change to the staging core make a step cheaper on the GPU's host? The
lent host's speed swings by up to 2x within a run (``host_cpus.py``), so two runs, or
two scenarios of one run, cannot answer it. Run this alternately from two trees (each
with its extension built in place), several rounds, in fresh processes: the medians of
each tree's rounds are then compared on the same host and the same spells. Times
``begin()`` + N merged copies + ``flush()`` as a ``step()`` block, the bench's decode
mix (``bench._common.decode_mix``), NumPy sources into torch CUDA tensors, each step
after a drained stream, as ``step_cost`` times it. Prints one JSON line: the label,
the staging path and, per N, the median µs a step and a copy. Host time only.
Answer: ``bench/results/2026-12-01-h200-ab-session10/`` (session 10's changes against
ca5732e).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    """Run the probe; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parents[2]))
    ap.add_argument("--n", default="8,32,128")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--label", default="")
    ap.add_argument(
        "--src",
        choices=("numpy", "torch"),
        default="numpy",
        help="the sources: NumPy arrays, or pinned torch CPU tensors",
    )
    args = ap.parse_args(argv)
    sys.path.insert(0, args.tree)
    import numpy as np
    import torch

    import cucopy as cc
    from bench._common import decode_mix
    from cucopy import segment

    stream = torch.cuda.Stream()
    out = {
        "label": args.label,
        "tree": args.tree,
        "src": args.src,
        "staging": segment.IMPLEMENTATION,
        "n": {},
    }
    for n in (int(x) for x in args.n.split(",")):
        mix = decode_mix(n)
        rng = np.random.default_rng(0)
        srcs = [rng.integers(1, 1 << 30, size=k).astype(dt) for k, dt in mix]
        if args.src == "torch":
            srcs = [torch.from_numpy(x).pin_memory() for x in srcs]
        dsts = [torch.zeros(k, dtype=getattr(torch, dt), device="cuda") for k, dt in mix]
        site = cc.CopySite("Ab", [("s", cc.H2D)])
        c = cc.DeviceCopier(cc.CopyPlan(merge=set(site)), stream=stream, capacity=1 << 20)
        triples = [(site.s, d, x) for d, x in zip(dsts, srcs)]
        copy = c.copy
        ts = []
        for i in range(args.steps + 200):
            stream.synchronize()
            t0 = time.perf_counter_ns()
            with c.step():
                for s, d, x in triples:
                    copy(s, d, x)
            t1 = time.perf_counter_ns()
            if i >= 200:
                ts.append((t1 - t0) / 1e3)
        stream.synchronize()
        for d, x in zip(dsts, srcs):
            if not np.array_equal(d.cpu().numpy(), np.asarray(x)):
                raise SystemExit(f"N={n}: a destination is wrong")
        med = statistics.median(ts)
        out["n"][str(n)] = {"step_us": med, "us_per_copy": med / n, "modes": dict(c.stats.modes)}
        c.close()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
