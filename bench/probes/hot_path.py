"""Break one merged copy's host cost into its pieces (torch CUDA dst, NumPy src).

Usage:
    python bench/probes/hot_path.py [--n 32]      # needs torch with CUDA

Question: what does one merged copy cost the host, piece by piece (array resolution,
layout, the memoryview copy into the slot, the copier's own work)? Still open: the
target is 0.5 µs a copy; the pure-Python path took 3.55 µs on the H200 host
(``bench/results/2026-12-01-h200-run20/hot_path.log``), the compiled staging core 0.99
(``bench/results/2026-12-01-h200-run21/hot_path.log``; every GPU session since run 2
stores one). Times each piece of the staged-H2D fast path in isolation, then the whole
``copier.copy`` with the garbage collector on and off. Host time only.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``cucopy`` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

import cucopy as cc  # noqa: E402
from cucopy import _layout  # noqa: E402
from cucopy.adapters import resolve  # noqa: E402


class Site(cc.CopySite):
    INPUT = cc.H2D


def _t(fn, reps=20000) -> float:
    for _ in range(200):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def main(argv=None) -> None:
    """Print microseconds per piece."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=32)
    args = ap.parse_args(argv)
    import torch

    d = torch.zeros(256, dtype=torch.int32, device="cuda")
    s = np.arange(256, dtype=np.int32)
    di = resolve(d)
    c = cc.DeviceCopier(cc.CopyPlan(merge={Site.INPUT}), stream=torch.cuda.Stream())
    c.begin()
    mv = c._slot.mv
    rows = {
        "empty loop": _t(lambda: None),
        "resolve torch cuda": _t(lambda: resolve(d)),
        "resolve numpy": _t(lambda: resolve(s)),
        "form": _t(lambda: _layout.form(di.ptr, di.shape, di.strides, 4)),
        "mv assign 1 KiB": _t(lambda: mv.__setitem__(slice(64, 64 + 1024), s.data.cast("B"))),
        "site in merge": _t(lambda: Site.INPUT in c._merge),
        "is_capturing": _t(lambda: c._backend.is_capturing(c._stream)),
    }

    dsts = [torch.zeros(64, dtype=torch.int32, device="cuda") for _ in range(args.n)]
    srcs = [np.arange(64, dtype=np.int32) for _ in range(args.n)]
    pre = [(resolve(a), resolve(b)) for a, b in zip(dsts, srcs)]
    pairs = list(zip(dsts, srcs))

    def copy_n():
        c.begin()
        for a, b in pairs:
            c.copy(Site.INPUT, a, b)
        c.discard()

    def copy_n_pre():
        c.begin()
        for a, b in pre:
            c.copy(Site.INPUT, a, b)
        c.discard()

    rows["copy (gc on), per copy"] = _t(copy_n, 300) / args.n
    rows["copy pre-resolved, per copy"] = _t(copy_n_pre, 300) / args.n
    gc.disable()
    rows["copy (gc off), per copy"] = _t(copy_n, 300) / args.n
    gc.enable()
    for k, v in rows.items():
        print(f"{k:32s} {v:8.3f} us")


if __name__ == "__main__":
    main()
