"""Which graphed launch blocks the host behind a held stream, graphs pooled (needs a GPU).

Usage:
    python bench/probes/graph_hold.py [--hold-s 2]
    python bench/probes/graph_hold.py --program 2 --mode mapped   # replay a property program

Question: with completion tags on (``CUCOPY_TAG=1``), a seeded property program
(``tests/test_properties_env.py``, seed 2, mapped) blocked the host for the hold's whole
10 s inside ``Driver.graphed(stream, seg, cell)`` (a faulthandler stack, run 56), while
the stream was held by a kernel spinning until the host acts: a hang. Runs 57 and 58
(``bench/results/2026-12-04-h200-run58/logs/graph_hold.log``) found the call: making a
new one-node graph behind the hold (create, add node, instantiate) blocked once until
the hold gave up; launching a graph made before never did. So the compiled driver calls
now make their pool of ``GRAPH_POOL`` one-node graphs when the kernels load (before any
hold: ``graph_count`` is the pool's size from then on) and never make one after: a new
segment and tag re-point the least recently launched graph of the stream's
(``cuGraphExecKernelNodeSetParams``, counted by ``graph_updates``). Does anything of that
block behind a hold: re-pointing a graph and launching it, with a tag or without;
launching one as pointed before the hold; re-pointing a graph whose previous launch is
still queued behind the hold (which the CUDA docs leave unaffected: checked by its tag,
written by the old launch)? And does the program that hung now complete, with no graph
made after set-up?

Each scenario runs behind its own hold (a kernel that spins on a mapped flag, giving up
after ``--hold-s``): the calls are timed one by one, and a call that takes most of the
hold's limit blocked until the kernel gave up. Each line says whether the call re-pointed
a graph (``set``) and how many graphs it made (always 0, or the pool is broken). The
segments are zeroed mapped memory (the kernel's header check returns at once; a tagged
launch still writes its tag).
``--program SEED``: the property program of ``tests/test_properties_env.py`` itself, with
tags on, every graphed launch timed (re-pointed or not, behind a hold or not) and any
call that took over 100 ms printed with its context.
Answer (before the pool): ``bench/results/2026-12-04-h200-run58/logs/graph_hold.log``:
alone, no graph made or launched behind a hold blocked; in the program, one new tagged
graph made behind a hold blocked until the hold gave up (three others did not). With
the pool: not run on a GPU yet.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv=None) -> int:
    """Time each graphed launch behind a held stream; print one line a call."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hold-s", type=float, default=2.0)
    ap.add_argument("--program", type=int, default=None, help="replay this seed's program")
    ap.add_argument("--mode", default="mapped")
    args = ap.parse_args(argv)
    if args.program is not None:
        return program(args.program, args.mode, args.hold_s)
    import cupy
    import numpy as np

    import cucopy as cc
    from cucopy import pack
    from cucopy.errors import CopyError

    stream_obj = cupy.cuda.Stream(non_blocking=True)
    c = cc.DeviceCopier(None, device=0, backend="cuda", stream=stream_obj)
    be = c.backend
    drv = be._bound
    if drv is None or not drv.graph_cap:
        print("graph_hold: no compiled driver bound, or no graphs (nothing to probe)")
        return 1
    # made when the copier loaded the kernels, before any hold
    pool = drv.graph_count
    print(f"pool: {pool} graphs made at set-up, {drv.graph_updates} re-pointed so far")
    stream = be.resolve_stream(stream_obj)
    buf = be.alloc_pinned(1 << 20)  # zeroed below: segments the kernel returns from at once
    buf.array[...] = 0
    words = buf.array.view(np.uint64)
    base = buf.device_ptr
    slot = iter(range(0, 1 << 20, 16384))
    armed = iter(range(1, 1 << 20))
    tags = []  # (cell's first word index, what it was armed with) of each tagged launch

    def fresh():
        """A segment address no graph points at yet, and its tag cell."""
        at = base + next(slot) + 256
        return at, at + pack.TAG_AT

    def call(label, seg, cell):
        if cell:  # armed as the copier arms it: the kernel copies word 0 to word 1
            i = (cell - base) // 8
            words[i] = v = next(armed)
            tags.append((i, v))
        made, updates = drv.graph_count, drv.graph_updates
        t0 = time.perf_counter()
        rc = drv.graphed(stream, seg, cell) if cell else drv.graphed(stream, seg)
        dt = time.perf_counter() - t0
        mark = "BLOCKED" if dt > args.hold_s / 2 else "ok"
        how = "set" if drv.graph_updates > updates else "   "
        new = drv.graph_count - made
        print(f"  {label:42s} rc={rc:<4d} {how} made={new} {dt * 1e6:12.1f} us  {mark}")

    def pointed(seg, cell):
        """Point a graph at (seg, cell) and run it, outside any hold."""
        drv.graphed(stream, seg, cell) if cell else drv.graphed(stream, seg)
        stream_obj.synchronize()

    def scenario(name, body):
        print(f"{name}:")
        h = be.hold(stream, timeout=args.hold_s)
        h.__enter__()
        try:
            body()
        finally:
            try:
                h.__exit__(None, None, None)
            except CopyError as e:
                print(f"  (the hold timed out: {e})")
        stream_obj.synchronize()

    a = fresh()
    scenario("A new untagged (seg, 0)", lambda: call("re-point + launch (seg, 0)", a[0], 0))
    b = fresh()
    scenario("B new tagged (seg, cell)", lambda: call("re-point + launch (seg, cell)", *b))
    cc_ = fresh()
    pointed(*cc_)
    scenario(
        "C tagged, pointed before the hold, launched twice",
        lambda: (call("launch (seg, cell)", *cc_), call("launch (seg, cell) again", *cc_)),
    )
    d = fresh()
    pointed(d[0], 0)
    scenario(
        "D untagged, pointed before, launched twice",
        lambda: (call("launch (seg, 0)", d[0], 0), call("launch (seg, 0) again", d[0], 0)),
    )
    e = fresh()
    scenario(
        "E new tagged, then launched again",
        lambda: (call("re-point + launch (seg, cell)", *e), call("launch (seg, cell) again", *e)),
    )
    f = fresh()
    scenario(
        "F new untagged, then launched again",
        lambda: (
            call("re-point + launch (seg, 0)", f[0], 0),
            call("launch (seg, 0) again", f[0], 0),
        ),
    )
    g1, g2 = fresh(), fresh()
    pointed(*g1)
    scenario(
        "G tagged, pointed before, launched; then a new tagged one",
        lambda: (call("launch (seg1, cell1)", *g1), call("re-point + launch (seg2, cell2)", *g2)),
    )
    # every graph of the pool queued behind the hold, then re-pointed again: the first
    # launches' tags must still be written by them (their old parameters)
    h_segs = [fresh() for _ in range(pool + 2)]
    scenario(
        f"H {pool + 2} new tagged, each re-pointing a graph still queued from the first",
        lambda: [call(f"re-point + launch #{k}", *x) for k, x in enumerate(h_segs)],
    )
    stream_obj.synchronize()
    # a cell armed again while its first launch was still queued (C, E: launched twice
    # behind one hold) is copied by both launches from its last arming: only that one
    # can be checked (the copier never re-arms a cell before its tag arrived)
    last = dict(tags)
    wrong = [(i, v, int(words[i + 1])) for i, v in last.items() if int(words[i + 1]) != v]
    print(
        f"tags: {len(last) - len(wrong)} of {len(last)} cells written as last armed"
        + (f"; wrong (word, armed, read): {wrong[:8]}" if wrong else "")
    )
    print(
        f"pool: {drv.graph_count} graphs ({drv.graph_count - pool} made after set-up), "
        f"{drv.graph_updates} re-pointed"
    )
    c.close()
    buf.close()
    return 0


def program(seed: int, mode: str, hold_s: float) -> int:
    """Replay the property program of ``seed`` with tags on, each graphed launch timed."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    import conftest
    import test_properties_env as t

    from cucopy import copier as copier_mod
    from cucopy.backends import cuda

    copier_mod.TAGS = True
    env = conftest.CudaEnv()
    state = {"held": False, "n": 0}
    log = []
    hold = env.hold

    class Held:
        def __init__(self, stream):
            self.h = env.backend.hold(env.backend.resolve_stream(stream), timeout=hold_s)

        def __enter__(self):
            state["held"] = True
            log.append(("hold", state["n"]))
            return self.h.__enter__()

        def __exit__(self, *exc):
            state["held"] = False
            log.append(("release", state["n"]))
            try:
                return self.h.__exit__(*exc)
            except Exception as e:  # the hold timed out: report it below
                log.append(("hold timed out", repr(e)[:120]))

    env.hold = Held
    orig = cuda.CudaBackend.scatter_graphed

    def counts(drv):
        return (drv.graph_count, drv.graph_updates) if drv is not None else (0, 0)

    def timed(self, seg, nblocks, stream, cell=0):
        drv = self._bound
        made0, set0 = counts(drv)
        t0 = time.perf_counter()
        try:
            return orig(self, seg, nblocks, stream, cell)
        finally:
            dt = time.perf_counter() - t0
            made, reset = (a - b for a, b in zip(counts(drv), (made0, set0)))
            state["n"] += 1
            log.append(("graphed", state["n"], state["held"], seg, cell, reset, made, dt))

    cuda.CudaBackend.scatter_graphed = timed
    try:
        t._run(env, seed, 60, mode)
        result = "completed"
    except Exception as e:
        result = f"raised {e!r}"[:300]
    finally:
        cuda.CudaBackend.scatter_graphed = orig
        env.hold = hold
    calls = [x for x in log if x[0] == "graphed"]
    held = [x for x in calls if x[2]]
    print(f"program seed {seed} {mode}, tags on: {result}")
    print(
        f"  graphed launches {len(calls)}, behind a hold {len(held)}, re-pointed "
        f"{sum(x[5] for x in calls)} ({sum(x[5] for x in held)} behind a hold), graphs "
        f"made by a launch {sum(x[6] for x in calls)} (the pool's are made at set-up)"
    )
    for x in log:
        if x[0] != "graphed":
            print("  ", *x)
        elif x[7] > 0.1:
            _, n, h, seg, cell, reset, made, dt = x
            print(
                f"   SLOW call {n}: held={h} seg={seg:#x} cell={cell:#x} re-pointed={reset} "
                f"graphs made={made} {dt * 1e3:.1f} ms"
            )
    slow_set = [x for x in held if x[5]]
    if slow_set:
        print(
            "  behind a hold, calls that re-pointed a graph: "
            + ", ".join(f"{x[7] * 1e6:.0f} us" for x in slow_set)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
