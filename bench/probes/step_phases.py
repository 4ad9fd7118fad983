"""Where a merged step's host time goes: ``begin()``, the copies, ``flush()``, and a profile.

Usage:
    python bench/probes/step_phases.py [--n 32] [--steps 2000] [--sim] [--no-floors]

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

The cold step against its floors (issue 29): one launch of an empty kernel through
cucopy's own launch path (the backend's compiled ``Driver``: a carried launch of an
empty segment, ``cuLaunchKernel`` with a 1 KiB parameter buffer, and a graphed one,
``cuGraphLaunch`` of the one-node graph whose kernel finds no segment), and one capture
query (``cuStreamIsCapturing``, which begin() and flush() each make), warm and cold as
the steps are timed; the same N copies of 16 B each, a step small enough to launch
graphed, cold with the slot's completion tag (no event recorded or queried) and without
(``copier.TAGS`` off, as ``CUCOPY_TAG=0`` makes it); then a summary of the cold rows side by
side with the two targets: ``begin()`` + flush at most 1.2x the empty carried launch,
the whole cold step at most 0.15x the cold chained ``copy_`` step.
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
    ap.add_argument(
        "--no-floors",
        action="store_true",
        help="skip the cold step's floors (empty launches, tagged steps) and the summary",
    )
    args = ap.parse_args(argv)
    sites = list(cc.CopySite("S", [(f"s{i}", cc.H2D) for i in range(args.n)]))
    rng = np.random.default_rng(0)
    sizes = rng.choice([4, 16, 64, 256], size=args.n)
    srcs = [rng.integers(0, 9, int(k), dtype=np.int32) for k in sizes]
    cc.show_config()
    profiled = None
    cold = {}
    for label, c, triples in _variants(args, sites, sizes, srcs):
        _phases(args, label, c, triples)
        _phases(args, label, c, triples, drained=True)
        _positions(args, label, c, triples)
        if profiled is None:
            profiled = (c, triples)
            cold["step"] = (label, _phases(args, label, c, triples, cold=True))
    if not args.sim:
        cold["chain"] = _chain(args, sizes, srcs)
        if not args.no_floors:
            cold["launch"] = _launches(args, profiled[0])
            cold["tags"] = _tagged_steps(args, sites)
            _summary(args, cold)
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


def _chain(args, sizes, srcs) -> dict:
    """The same N copies as chained ``copy_(non_blocking=True)`` from pinned tensors, host
    us a step after a drained stream, warm and with cold caches (as ``_phases`` makes them).

    Returns ``{"warm": us, "cold": us}`` (medians of a step)."""
    import torch

    stream = torch.cuda.Stream()
    dsts = [torch.zeros(int(k), dtype=torch.int32, device="cuda") for k in sizes]
    pinned = [torch.from_numpy(x).pin_memory() for x in srcs]
    pairs = list(zip(dsts, pinned))
    clock = time.perf_counter
    out = {}
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
            out["cold" if cold else "warm"] = med
            how = f"cold caches ({COLD_BYTES >> 20} MiB written)" if cold else "warm"
            print(
                f"N={args.n} chained torch copy_ from pinned, each after a drained stream, "
                f"{how}: {med:.1f} us a step = {med / args.n:.2f} us/copy"
            )
    return out


def _launches(args, c) -> dict:
    """One launch of an empty kernel through cucopy's own launch path, host us of the call
    after a drained stream, warm and cold (as ``_phases`` times a step): the backend's
    compiled ``Driver`` launching the carried scatter on an empty segment (nothing
    carried: the kernel returns at once) and the one-node graph of the graphed scatter on
    a slot of zeros (no segment there: it returns once it read them).

    Returns ``{(path, "warm" or "cold"): us}`` (medians; empty without the compiled
    driver calls)."""
    from cucopy import pack

    be = c._backend
    drv = getattr(be, "_bound", None)
    if drv is None:
        print("empty launches: no compiled driver calls (CUCOPY_PURE_PYTHON?): not measured")
        return {}
    stream = c._stream
    buf = be.alloc_pinned(2 * pack.GRAPH_CAPACITY)
    buf.array[:] = 0
    seg, host = buf.device_ptr, buf.ptr
    paths = {"carried": lambda: drv.carried(1, stream, seg, host, 0)}
    if drv.graph_cap:
        paths["graphed"] = lambda: drv.graphed(stream, seg)
    # not a launch: the capture query begin() and flush() each make (cuStreamIsCapturing)
    paths["capture query"] = lambda: drv.is_capturing(stream)
    sync = be.synchronize
    clock = time.perf_counter
    out = {}
    for path, launch in paths.items():
        for cold in (False, True):
            scratch = np.empty(COLD_BYTES, np.uint8) if cold else None
            steps = args.steps // 5 if cold else args.steps
            ts = []
            for i in range(steps + 200):
                if scratch is not None:
                    scratch.fill(i & 255)
                sync(stream)
                t0 = clock()
                rc = launch()
                t1 = clock()
                if rc != 0:
                    raise RuntimeError(f"{path}: CUresult or status {rc}")
                if i >= 200:
                    ts.append(t1 - t0)
            out[path, "cold" if cold else "warm"] = med = statistics.median(ts) * 1e6
            how = f"cold caches ({COLD_BYTES >> 20} MiB written)" if cold else "warm"
            if path == "capture query":
                print(
                    f"one capture query through cucopy's driver calls (cuStreamIsCapturing), "
                    f"each after a drained stream, {how}: {med:.2f} us"
                )
                continue
            what = "cuLaunchKernel, 1 KiB parameters" if path == "carried" else "cuGraphLaunch"
            print(
                f"one {path} launch of an empty kernel through cucopy's launch path ({what}), "
                f"each after a drained stream, {how}: {med:.2f} us"
            )
    sync(stream)
    buf.close()
    return out


def _tagged_steps(args, sites) -> dict:
    """The same N merged copies at 16 B each (a segment small enough to launch graphed),
    warm, drained and cold, with the slot's completion tag (the flush records no event,
    the ring queries none) and without it (``copier.TAGS`` off when the copier is made,
    as ``CUCOPY_TAG=0`` at import makes it; tags are the default).

    Returns ``{"tags" or "events": _phases' cold medians}``."""
    import torch

    from cucopy import copier as copier_mod

    plan = cc.CopyPlan(merge=set(sites))
    dsts = [torch.zeros(4, dtype=torch.int32, device="cuda") for _ in sites]
    srcs = [np.arange(4, dtype=np.int32) + i for i in range(len(sites))]
    triples = list(zip(sites, dsts, srcs))
    out = {}
    for name, on in (("tags", True), ("events", False)):
        saved = copier_mod.TAGS
        copier_mod.TAGS = on
        try:
            c = cc.DeviceCopier(plan, stream=torch.cuda.Stream())
        finally:
            copier_mod.TAGS = saved
        label = f"torch dst, numpy src, 16 B a copy, graphed, {name}"
        _phases(args, label, c, triples, drained=True)
        out[name] = _phases(args, label, c, triples, cold=True)
        slot = c._ring.current
        print(
            f"  ({label}: modes {dict(c.stats.modes)}, slot tag {slot.tag}, "
            f"event recorded {slot.recorded})"
        )
        c.close()
    return out


def _summary(args, cold: dict) -> None:
    """The cold rows side by side, with the two targets' ratios."""
    label, step = cold["step"]
    chain = cold["chain"].get("cold")
    launch = cold["launch"]
    bf = step["begin"] + step["flush"]
    print(f"cold step against its floors (N={args.n}, {label}; median us, cold caches):")
    print(
        f"  begin {step['begin']:.2f} + flush {step['flush']:.2f} = {bf:.2f}; whole step "
        f"{step['whole']:.1f}; chained copy_ step {chain:.1f}"
    )
    for path in ("carried", "graphed"):
        if (path, "cold") in launch:
            print(
                f"  one empty {path} launch through cucopy's launch path: warm "
                f"{launch[path, 'warm']:.2f}, cold {launch[path, 'cold']:.2f}"
            )
    if ("capture query", "cold") in launch:
        print(
            f"  one capture query (begin and flush make one each): warm "
            f"{launch['capture query', 'warm']:.2f}, cold {launch['capture query', 'cold']:.2f}"
        )
    for name, row in cold["tags"].items():
        print(
            f"  N={args.n} x 16 B graphed, {name}: begin {row['begin']:.2f} + flush "
            f"{row['flush']:.2f} = {row['begin'] + row['flush']:.2f}; whole {row['whole']:.1f}"
        )
    if ("carried", "cold") in launch:
        r = bf / launch["carried", "cold"]
        print(f"  target: (begin + flush) / empty carried launch, cold = {r:.2f} (<= 1.2)")
    if ("graphed", "cold") in launch:
        r = bf / launch["graphed", "cold"]
        print(f"          (begin + flush) / empty graphed launch, cold = {r:.2f}")
    if chain:
        r = step["whole"] / chain
        print(f"  target: whole step / chained copy_ step, cold = {r:.3f} (<= 0.15)")


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


def _phases(args, label, c, triples, drained: bool = False, cold: bool = False) -> dict:
    """Median host us of begin(), the copies and flush(), steps back to back, or (``drained``)
    each issued after the stream has run everything before it, as the bench times steps,
    or (``cold``) drained and after :data:`COLD_BYTES` of other memory were written, as an
    engine's step finds the caches after its own work (a fifth of the steps).

    Returns the medians in us: ``begin``, ``copies`` (all of them), ``flush``, ``whole``
    (their sum) and ``block`` (the step as a ``step()`` block)."""
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
    return {
        "begin": med(tb) * us,
        "copies": med(tc) * us,
        "flush": med(tf) * us,
        "whole": whole,
        "block": med(tw) * us,
    }


if __name__ == "__main__":
    main()
