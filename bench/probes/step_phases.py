"""Where a merged step's host time goes: ``begin()``, the copies, ``flush()``, and a profile.

Usage:
    python bench/probes/step_phases.py [--n 32] [--steps 2000] [--sim]

Question: after the compiled staging core (issue 13), how much of a step's host time is
per step (``begin``, ``flush``: backend calls) and how much per copy, on the GPU's host?
Times each phase of a step of N merged copies, and the same step as a ``step()``
block, for torch CUDA destinations from NumPy and from pinned torch sources and for
CuPy destinations (sim arrays with ``--sim``); the first variant also with cold caches
(64 MiB written before each step, as an engine's own work between two uploads leaves
them), and the same copies chained with ``copy_`` warm and cold; prints the host cost of each torch
attribute a destination's fingerprint reads, the same N copies at 16 B to 4 KiB each
(what a staged byte adds), the bench's own decode mix through N sites and through one,
then the top of a cProfile of whole steps. Host time only. Answers: ``bench/results/2026-12-01-h200-run23/step_phases.log``
(the first run with it) and every GPU session's since.
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


def _variants(args, sites, sizes, srcs):
    """(label, copier, triples) for each destination/source kind this machine has."""
    plan = cc.CopyPlan(merge=set(sites))
    if args.sim:
        from cucopy.backends.sim import SimDevice

        dev = SimDevice(policy="eager")
        dsts = [dev.zeros((int(k),), np.int32) for k in sizes]
        c = cc.DeviceCopier(plan, stream=dev.default_stream, device=dev, backend="sim")
        yield "sim dst, numpy src", c, list(zip(sites, dsts, srcs))
        return
    import torch

    stream = torch.cuda.Stream()
    dsts = [torch.zeros(int(k), dtype=torch.int32, device="cuda") for k in sizes]
    pinned = [torch.from_numpy(x).pin_memory() for x in srcs]
    c = cc.DeviceCopier(plan, stream=stream)
    yield "torch dst, numpy src", c, list(zip(sites, dsts, srcs))
    yield "torch dst, pinned torch src", c, list(zip(sites, dsts, pinned))
    try:
        import cupy
    except ImportError:
        return
    cdsts = [cupy.zeros(int(k), dtype=cupy.int32) for k in sizes]
    yield "cupy dst, numpy src", c, list(zip(sites, cdsts, srcs))


def _attributes() -> None:
    """Host ns of each attribute a torch CUDA destination's fingerprint reads."""
    import torch

    t = torch.zeros(64, dtype=torch.int32, device="cuda")
    reps = 200000
    for expr in ("t", "t.data_ptr()", "t.shape", "t.stride()", "t.dtype", "t._base"):
        fn = eval(f"lambda: {expr}", {"t": t})  # noqa: S307 - fixed expressions
        for _ in range(1000):
            fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        print(f"  lambda: {expr:14s} {(time.perf_counter() - t0) / reps * 1e9:7.1f} ns")


def main(argv=None) -> None:
    """Print median microseconds per phase for each variant, then a profile of the first."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--sim", action="store_true")
    args = ap.parse_args(argv)
    sites = list(cc.CopySite("S", [(f"s{i}", cc.H2D) for i in range(args.n)]))
    rng = np.random.default_rng(0)
    sizes = rng.choice([4, 16, 64, 256], size=args.n)
    srcs = [rng.integers(0, 9, int(k), dtype=np.int32) for k in sizes]
    cc.show_config()
    profiled = None
    for label, c, triples in _variants(args, sites, sizes, srcs):
        _phases(args, label, c, triples)
        _phases(args, label, c, triples, drained=True)
        _positions(args, label, c, triples)
        if profiled is None:
            profiled = (c, triples)
            _phases(args, label, c, triples, cold=True)
    if not args.sim:
        _chain(args, sizes, srcs)
        print("torch attribute reads (a lambda call each):")
        _attributes()
        _flush_sizes(args)
        _byte_slope(args, sites)
        _bench_mix(args, sites)
    c, triples = profiled
    copy = c.copy
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


def _chain(args, sizes, srcs) -> None:
    """The same N copies as chained ``copy_(non_blocking=True)`` from pinned tensors, host
    us a step after a drained stream, warm and with cold caches (as ``_phases`` makes them)."""
    import torch

    stream = torch.cuda.Stream()
    dsts = [torch.zeros(int(k), dtype=torch.int32, device="cuda") for k in sizes]
    pinned = [torch.from_numpy(x).pin_memory() for x in srcs]
    pairs = list(zip(dsts, pinned))
    clock = time.perf_counter
    with torch.cuda.stream(stream):
        for cold in (False, True):
            scratch = np.empty(COLD_BYTES, np.uint8) if cold else None
            steps = args.steps // 5 if cold else args.steps
            ts = []
            for i in range(steps + 200):
                if scratch is not None:
                    scratch.fill(i & 255)
                stream.synchronize()
                t0 = clock()
                for d, x in pairs:
                    d.copy_(x, non_blocking=True)
                t1 = clock()
                if i >= 200:
                    ts.append(t1 - t0)
            med = statistics.median(ts) * 1e6
            how = f"cold caches ({COLD_BYTES >> 20} MiB written)" if cold else "warm"
            print(
                f"N={args.n} chained torch copy_ from pinned, each after a drained stream, "
                f"{how}: {med:.1f} us a step = {med / args.n:.2f} us/copy"
            )


def _flush_sizes(args) -> None:
    """Host us of ``flush()``: one carried copy of each size (the launch's own cost), then
    n copies of 16 B (what a flush's count of copies costs)."""
    import torch

    site = cc.CopySite("F", [(f"s{i}", cc.H2D) for i in range(32)])
    dst = torch.zeros(8192, dtype=torch.int32, device="cuda")
    src = np.arange(8192, dtype=np.int32)
    c = cc.DeviceCopier(cc.CopyPlan(merge=set(site)), stream=torch.cuda.Stream())
    clock = time.perf_counter
    cases = [
        (f"one carried copy of {b:5d} B", [(0, b // 4)]) for b in (16, 1024, 6144, 20480, 30720)
    ]
    cases += [(f"{n:2d} copies of 16 B", [(64 * i, 4) for i in range(n)]) for n in (2, 8, 32)]
    for label, spans in cases:
        pairs = [(s, dst[o : o + k], src[o : o + k]) for s, (o, k) in zip(site, spans)]
        tf = []
        for i in range(args.steps // 2 + 100):
            c.begin()
            for s, d, x in pairs:
                c.copy(s, d, x)
            t0 = clock()
            c.flush()
            t1 = clock()
            if i >= 100:
                tf.append(t1 - t0)
        print(
            f"flush of {label}: {statistics.median(tf) * 1e6:.2f} us (modes {dict(c.stats.modes)})"
        )
        c.stats.reset()
    c.close()


def _byte_slope(args, sites) -> None:
    """The same N copies at 16 B to 4 KiB each: what a staged byte adds to a copy."""
    import torch

    plan = cc.CopyPlan(merge=set(sites))
    c = cc.DeviceCopier(plan, stream=torch.cuda.Stream())
    rng = np.random.default_rng(1)
    for nbytes in (16, 256, 1024, 4096):
        k = nbytes // 4
        dsts = [torch.zeros(k, dtype=torch.int32, device="cuda") for _ in sites]
        srcs = [rng.integers(0, 9, k, dtype=np.int32) for _ in sites]
        _phases(args, f"torch dst, numpy src, {nbytes} B a copy", c, list(zip(sites, dsts, srcs)))
    c.close()


def _bench_mix(args, sites) -> None:
    """The bench's own decode mix (``bench._common.decode_mix``: 16 B-8 KiB, int32 and
    int64), through N sites and through one site as the bench's contenders copy it."""
    import torch

    from bench._common import decode_mix

    mix = decode_mix(args.n)
    rng = np.random.default_rng(0)
    srcs = [rng.integers(1, 1 << 30, size=k).astype(dt) for k, dt in mix]
    dsts = [torch.zeros(k, dtype=getattr(torch, dt), device="cuda") for k, dt in mix]
    c = cc.DeviceCopier(cc.CopyPlan(merge=set(sites)), stream=torch.cuda.Stream())
    label = f"torch dst, numpy src, the bench's mix ({sum(x.nbytes for x in srcs)} B)"
    _phases(args, label, c, list(zip(sites, dsts, srcs)), drained=True)
    one = [sites[0]] * len(sites)
    _phases(args, label + ", one site", c, list(zip(one, dsts, srcs)), drained=True)
    c.close()


def _positions(args, label, c, triples) -> None:
    """Median ns of each copy by its place in the step: is the first copy dearer (it opens
    the segment; the launch before it may have left the caches cold)?"""
    copy = c.copy
    clock = time.perf_counter_ns
    per = [[] for _ in triples]
    for i in range(args.steps // 2 + 100):
        c.begin()
        for j, (s, d, x) in enumerate(triples):
            t0 = clock()
            copy(s, d, x)
            t1 = clock()
            if i >= 100:
                per[j].append(t1 - t0)
        c.flush()
    med = [statistics.median(p) for p in per]
    head = " ".join(f"{m:.0f}" for m in med[:6])
    rest = statistics.median(med[6:]) if len(med) > 6 else float("nan")
    print(f"  {label}: ns per copy by place (timer included): {head} ... rest median {rest:.0f}")


#: bytes written before each step of the ``cold`` variant: past the last-level cache
COLD_BYTES = 64 << 20


def _phases(args, label, c, triples, drained: bool = False, cold: bool = False) -> None:
    """Median host us of begin(), the copies and flush(), steps back to back, or (``drained``)
    each issued after the stream has run everything before it, as the bench times steps,
    or (``cold``) drained and after :data:`COLD_BYTES` of other memory were written, as an
    engine's step finds the caches after its own work (a fifth of the steps)."""
    copy = c.copy
    sync = c._backend.synchronize
    stream = c._stream
    tb, tc, tf, tw = [], [], [], []
    clock = time.perf_counter
    scratch = np.empty(COLD_BYTES, np.uint8) if cold else None
    steps = args.steps // 5 if cold else args.steps
    drained = drained or cold
    for i in range(steps + 200):
        if scratch is not None:
            scratch.fill(i & 255)
        if drained:
            sync(stream)
        t0 = clock()
        c.begin()
        t1 = clock()
        for s, d, x in triples:
            copy(s, d, x)
        t2 = clock()
        c.flush()
        t3 = clock()
        if drained:
            sync(stream)
            if scratch is not None:
                scratch.fill(i & 255)
            t3b = clock()
        else:
            t3b = t3
        with c.step():
            for s, d, x in triples:
                copy(s, d, x)
        t4 = clock()
        if i >= 200:
            tb.append(t1 - t0)
            tc.append(t2 - t1)
            tf.append(t3 - t2)
            tw.append(t4 - t3b)
    med = statistics.median
    us = 1e6
    whole = (med(tb) + med(tc) + med(tf)) * us
    how = ", each after a drained stream" if drained else ""
    if cold:
        how = f", each after a drained stream and {COLD_BYTES >> 20} MiB written (cold caches)"
    print(
        f"N={args.n} {label}{how}: begin {med(tb) * us:.2f} us, copies "
        f"{med(tc) * us / args.n:.3f} us each, flush {med(tf) * us:.2f} us; whole step "
        f"{whole:.1f} us = {whole / args.n:.2f} us/copy; as a step() block {med(tw) * us:.1f} us "
        f"= {med(tw) * us / args.n:.2f} us/copy"
    )


if __name__ == "__main__":
    main()
