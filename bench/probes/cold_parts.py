"""Which driver calls of a merged step are dear on a cold host, and in which order.

Usage:
    python bench/probes/cold_parts.py [--steps 1500]

Question: (issue 29) on a host whose caches were just evicted, does a driver call made
right after another one (the capture query after the launch, the event record after it)
cost its warm or its cold time? Does a launch carrying the step's whole segment (14 KiB
at N = 32 in ``step_phases.py``) cost more cold than one carrying 1 KiB? How much of a
cold ``begin()`` is its capture query? Each sequence below is timed part by part, every
iteration after a drained stream and 64 MiB written (as ``step_phases.py``'s cold
variant), and warm (drained only): medians of each part in us.

Sequences (through the CUDA backend's compiled ``Driver`` and a torch stream):
``query``; ``carried 1K``; ``carried 14K``; ``query, carried 1K``; ``carried 1K,
query``; ``carried 14K, query``; ``carried 1K, record``; ``graphed, query``; and the
step itself (N = 32 as ``step_phases.py``'s: ``begin``, the copies, ``flush``), also
with a capture query made just before ``begin`` (what ``begin`` costs once its query
is warm) and with ``flush_mode="mapped"`` (the header and table carried, the rest read
mapped, an event recorded after); then the step's GPU time (events around it) in
``auto``, ``mapped`` and ``inline``. Answer: ``bench/results/2026-12-04-h200-run64/``
(``logs/cold_parts.log``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

import cucopy as cc  # noqa: E402

COLD_BYTES = 64 << 20


def _time(label, parts, steps, sync) -> None:
    """Time ``parts`` (name, callable) in order, each iteration warm and cold."""
    clock = time.perf_counter
    for cold in (False, True):
        scratch = np.empty(COLD_BYTES, np.uint8) if cold else None
        n = steps // 3 if cold else steps
        ts = [[] for _ in parts]
        for i in range(n + 100):
            if scratch is not None:
                scratch.fill(i & 255)
            sync()
            t = clock()
            for j, (_, fn) in enumerate(parts):
                rc = fn()
                t2 = clock()
                if i >= 100:
                    ts[j].append(t2 - t)
                if isinstance(rc, int) and rc not in (0, 1) and not isinstance(rc, bool):
                    raise RuntimeError(f"{label}: {parts[j][0]} returned {rc}")
                t = t2
        meds = [statistics.median(x) * 1e6 for x in ts]
        body = ", ".join(f"{name} {m:.2f}" for (name, _), m in zip(parts, meds))
        print(f"{label:34s} {'cold' if cold else 'warm'}: {body}; sum {sum(meds):.2f} us")


def _copies(c, triples):
    """The step's copies through copier ``c``, as one call."""
    copy = c.copy

    def copies():
        for s, d, x in triples:
            copy(s, d, x)

    return copies


def _gpu_time(label, c, triples, stream, be, h, steps: int = 300) -> None:
    """GPU us of the step (events around begin() to flush(), each after a drained
    stream): what the flush's launch path costs the GPU."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    copies = _copies(c, triples)
    for i in range(steps + 50):
        be.synchronize(h)
        start.record(stream)
        c.begin()
        copies()
        c.flush()
        end.record(stream)
        end.synchronize()
        if i >= 50:
            ts.append(start.elapsed_time(end) * 1e3)
    print(f"step ({label}) GPU time, events around it: {statistics.median(ts):.2f} us")


def main(argv=None) -> None:
    """Print each sequence's parts, warm and cold."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1500)
    args = ap.parse_args(argv)
    import torch

    from cucopy import pack

    n = 32
    sites = list(cc.CopySite("P", [(f"s{i}", cc.H2D) for i in range(n)]))
    plan = cc.CopyPlan(merge=set(sites))
    stream = torch.cuda.Stream()
    c = cc.DeviceCopier(plan, stream=stream)
    be = c._backend
    drv = getattr(be, "_bound", None)
    if drv is None:
        print("no compiled driver calls: nothing to measure")
        return
    h = c._stream
    buf = be.alloc_pinned(64 << 10)
    buf.array[:] = 0
    seg, host = buf.device_ptr, buf.ptr
    ev = be.event_create()

    def sync():
        be.synchronize(h)

    def query():
        return drv.is_capturing(h)

    def carried(nbytes):
        return lambda: drv.carried(1, h, seg, host, nbytes)

    def record():
        return drv.event_record(ev, h)

    seqs = [
        ("query", [("query", query)]),
        ("carried 1K", [("carried1K", carried(1024))]),
        ("carried 14K", [("carried14K", carried(14336))]),
        ("query, carried 1K", [("query", query), ("carried1K", carried(1024))]),
        ("carried 1K, query", [("carried1K", carried(1024)), ("query", query)]),
        ("carried 14K, query", [("carried14K", carried(14336)), ("query", query)]),
        ("carried 1K, record", [("carried1K", carried(1024)), ("record", record)]),
    ]
    if drv.graph_cap:
        seqs.append(
            ("graphed, query", [("graphed", lambda: drv.graphed(h, seg)), ("query", query)])
        )
    for label, parts in seqs:
        _time(label, parts, args.steps, sync)

    rng = np.random.default_rng(0)
    sizes = rng.choice([4, 16, 64, 256], size=n)
    srcs = [rng.integers(0, 9, int(k), dtype=np.int32) for k in sizes]
    dsts = [torch.zeros(int(k), dtype=torch.int32, device="cuda") for k in sizes]
    triples = list(zip(sites, dsts, srcs))
    step = [("begin", c.begin), ("copies", _copies(c, triples)), ("flush", c.flush)]
    _time("step (auto)", step, args.steps, sync)
    _time("step, a query first", [("query", query)] + step, args.steps, sync)
    cm = cc.DeviceCopier(plan, stream=stream, flush_mode="mapped")
    stepm = [("begin", cm.begin), ("copies", _copies(cm, triples)), ("flush", cm.flush)]
    _time("step (mapped)", stepm, args.steps, sync)
    ci = cc.DeviceCopier(plan, stream=stream, flush_mode="inline")
    for label, cx in (("auto", c), ("mapped", cm), ("inline", ci)):
        _gpu_time(label, cx, triples, stream, be, h)
    ci.close()
    print(f"auto modes {dict(c.stats.modes)}; mapped modes {dict(cm.stats.modes)}")
    print(
        f"(segment of the step: {sum(x.nbytes for x in srcs)} B of data, "
        f"header {pack.HEADER_BYTES} B, {n} descriptors of {pack.DESC_BYTES} B)"
    )
    sync()
    cm.close()
    c.close()
    buf.close()


if __name__ == "__main__":
    main()
