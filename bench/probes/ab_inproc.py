"""Before and after in one process: two trees' merged steps interleaved, block by block.

Usage:
    python bench/probes/ab_inproc.py --base DIR [--tree DIR] [--n 8,32,128]
                                     [--blocks 200] [--steps 50] [--src numpy|torch] [--plain]

Question: is a change to the staging core's step cheaper or dearer, when the lent host's
speed swings within a run? ``ab_step.py`` alternates processes; on a host that switches
between a fast and a slow state for seconds at a time (``2026-12-03-h200-ab-issue30``:
10.5 against 15-16 µs a step at N = 32), two processes a few seconds apart can land in
different states. This probe imports cucopy twice in one process (each tree's package
and compiled extension under its own module objects: ``cucopy`` is dropped from
``sys.modules`` between the imports), builds the same copier from each, then alternates:
``--steps`` timed steps of the base, the same of the tree, ``--blocks`` times, the order
within a pair swapped every block. Each block pair ran within a millisecond or so of
the other, on the same host state; the answer is the median of the per-pair ratios
(tree / base), with the quartiles of that ratio. The step is ``ab_step.py``'s:
``begin()`` + N merged copies (``bench._common.decode_mix``) + ``flush()`` as a
``step()`` block into torch CUDA tensors, after a drained stream. Host time only.
Prints one JSON line. Answer: ``bench/results/2026-12-03-h200-ab-inproc-issue30/``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path


def _ours(name: str) -> bool:
    return name.split(".")[0] in ("cucopy", "bench")


def _swap(snap: dict) -> None:
    """Make ``snap``'s modules the ones ``sys.modules`` holds for cucopy and bench.

    A function-level ``from . import x`` resolves through ``sys.modules`` at call time,
    so each side's steps run with its own modules there."""
    for name in [m for m in sys.modules if _ours(m)]:
        del sys.modules[name]
    sys.modules.update(snap)


def _load(tree: str):
    """Import cucopy and bench._common from ``tree``; returns (cucopy, decode_mix, impl)."""
    _swap({})
    sys.path.insert(0, tree)
    try:
        cc = importlib.import_module("cucopy")
        common = importlib.import_module("bench._common")
        seg = importlib.import_module("cucopy.segment")
    finally:
        sys.path.remove(tree)
    root = str(Path(tree).resolve())
    mods = [cc] + [sys.modules[m] for m in ("cucopy._segment",) if m in sys.modules]
    for mod in mods:
        if not str(Path(mod.__file__).resolve()).startswith(root):
            raise SystemExit(f"{mod.__name__} came from {mod.__file__}, not from {tree}")
    return cc, common.decode_mix, seg.IMPLEMENTATION


def _make(cc, mix, src, stream, plain=False):
    """A copier of ``cc`` and its step's triples (``plain``: a plan that merges nothing,
    every copy eager); returns (step function, check, copier)."""
    import numpy as np
    import torch

    rng = np.random.default_rng(0)
    srcs = [rng.integers(1, 1 << 30, size=k).astype(dt) for k, dt in mix]
    if src == "torch":
        srcs = [torch.from_numpy(x).pin_memory() for x in srcs]
    dsts = [torch.zeros(k, dtype=getattr(torch, dt), device="cuda") for k, dt in mix]
    site = cc.CopySite("Ab", [("s", cc.H2D)])
    plan = cc.CopyPlan() if plain else cc.CopyPlan(merge=set(site))
    c = cc.DeviceCopier(plan, stream=stream, capacity=1 << 20)
    triples = [(site.s, d, x) for d, x in zip(dsts, srcs)]
    copy = c.copy
    step = c.step
    perf = time.perf_counter_ns
    sync = stream.synchronize

    def run(steps):
        ts = []
        for _ in range(steps):
            sync()
            t0 = perf()
            with step():
                for s, d, x in triples:
                    copy(s, d, x)
            ts.append(perf() - t0)
        return ts

    def check():
        stream.synchronize()
        for d, x in zip(dsts, srcs):
            if not np.array_equal(d.cpu().numpy(), np.asarray(x)):
                raise SystemExit("a destination is wrong")
        return dict(c.stats.modes)

    return run, check, c


def main(argv=None) -> int:
    """Run the probe; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the base tree (extension built in place)")
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parents[2]))
    ap.add_argument("--n", default="8,32,128")
    ap.add_argument("--blocks", type=int, default=200)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--src", choices=("numpy", "torch"), default="numpy")
    ap.add_argument(
        "--plain",
        action="store_true",
        help="a plan that merges nothing: every copy takes the eager path (a plain site)",
    )
    args = ap.parse_args(argv)
    import torch

    stream = torch.cuda.Stream()
    sides, snaps = {}, {}
    for label, tree in (("base", args.base), ("tree", args.tree)):
        cc, decode_mix, impl = _load(tree)
        sides[label] = (cc, decode_mix, impl)
        snaps[label] = {m: mod for m, mod in sys.modules.items() if _ours(m)}
    out = {
        "base": args.base,
        "tree": args.tree,
        "src": args.src,
        "plain": args.plain,
        "staging": {k: v[2] for k, v in sides.items()},
        "n": {},
    }
    for n in (int(x) for x in args.n.split(",")):
        runs = {}
        for label, (cc, decode_mix, _) in sides.items():
            _swap(snaps[label])
            runs[label] = _make(cc, decode_mix(n), args.src, stream, args.plain)
            runs[label][0](200)  # warm
        ratios, meds = [], {"base": [], "tree": []}
        for b in range(args.blocks):
            order = ("base", "tree") if b % 2 == 0 else ("tree", "base")
            got = {}
            for label in order:
                _swap(snaps[label])
                got[label] = statistics.median(runs[label][0](args.steps)) / 1e3
                meds[label].append(got[label])
            ratios.append(got["tree"] / got["base"])
        q = statistics.quantiles(ratios, n=4)
        res = {
            "base_step_us": statistics.median(meds["base"]),
            "tree_step_us": statistics.median(meds["tree"]),
            "ratio_median": statistics.median(ratios),
            "ratio_q1": q[0],
            "ratio_q3": q[2],
        }
        for label, (_, check, c) in runs.items():
            _swap(snaps[label])
            res[f"{label}_modes"] = check()
            c.close()
        out["n"][str(n)] = res
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
