"""Which graphed launch blocks the host behind a held stream (needs a GPU).

Usage:
    python bench/probes/graph_hold.py [--hold-s 2]
    python bench/probes/graph_hold.py --program 2 --mode mapped   # replay a property program

Question: with completion tags on (``CUCOPY_TAG=1``), a seeded property program
(``tests/test_properties_env.py``, seed 2, mapped) blocked the host for the hold's whole
10 s inside ``Driver.graphed(stream, seg, cell)`` (a faulthandler stack, run 56), while
the stream was held by a kernel spinning until the host acts. A blocked host behind such
a kernel is a hang. Which call blocks: making a new one-node graph (create, add node,
instantiate), or launching one, and only with a tag cell, or without too?

Each scenario runs behind its own hold (a kernel that spins on a mapped flag, giving up
after ``--hold-s``): the calls are timed one by one, and a call that takes most of the
hold's limit blocked until the kernel gave up. The segments are zeroed mapped memory (the
kernel's header check returns at once; a tagged launch still writes its tag).
``--program SEED``: the property program of ``tests/test_properties_env.py`` itself, with
tags on, every graphed launch timed (new graph or not, behind a hold or not) and any
call that took over 100 ms printed with its context.
Answer: ``bench/results/2026-12-04-h200-run58/logs/graph_hold.log``: alone, no graph
made or launched behind a hold blocked; in the program, one new tagged graph made
behind a hold blocked until the hold gave up (three others did not).
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

    import cucopy as cc
    from cucopy.errors import CopyError

    stream_obj = cupy.cuda.Stream(non_blocking=True)
    c = cc.DeviceCopier(None, device=0, backend="cuda", stream=stream_obj)
    be = c.backend
    drv = be._bound
    if drv is None:
        print("graph_hold: no compiled driver bound (nothing to probe)")
        return 1
    stream = be.resolve_stream(stream_obj)
    buf = be.alloc_pinned(1 << 20)  # zeroed below: segments the kernel returns from at once
    buf.array[...] = 0
    base = buf.device_ptr
    slot = iter(range(0, 1 << 20, 16384))

    def fresh():
        """A new segment address (graphs are made per address) and its tag cell."""
        at = base + next(slot) + 256
        return at, at - 64

    def call(label, seg, cell):
        t0 = time.perf_counter()
        rc = drv.graphed(stream, seg, cell) if cell else drv.graphed(stream, seg)
        dt = time.perf_counter() - t0
        mark = "BLOCKED" if dt > args.hold_s / 2 else "ok"
        print(f"  {label:42s} rc={rc:<4d} {dt * 1e6:12.1f} us  {mark}")

    def made(seg, cell):
        """Make (and run) the graph of (seg, cell) outside any hold."""
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
    scenario("A new untagged graph", lambda: call("make + launch (seg, 0)", a[0], 0))
    b = fresh()
    scenario("B new tagged graph", lambda: call("make + launch (seg, cell)", *b))
    cc_ = fresh()
    made(*cc_)
    scenario(
        "C tagged graph made before the hold, launched twice",
        lambda: (call("launch (seg, cell)", *cc_), call("launch (seg, cell) again", *cc_)),
    )
    d = fresh()
    made(d[0], 0)
    scenario(
        "D untagged graph made before, launched twice",
        lambda: (call("launch (seg, 0)", d[0], 0), call("launch (seg, 0) again", d[0], 0)),
    )
    e = fresh()
    scenario(
        "E new tagged graph, then launched again",
        lambda: (call("make + launch (seg, cell)", *e), call("launch (seg, cell) again", *e)),
    )
    f = fresh()
    scenario(
        "F new untagged graph, then launched again",
        lambda: (call("make + launch (seg, 0)", f[0], 0), call("launch (seg, 0) again", f[0], 0)),
    )
    g1, g2 = fresh(), fresh()
    made(*g1)
    scenario(
        "G a tagged graph made before launched, then a new tagged one",
        lambda: (call("launch (seg1, cell1)", *g1), call("make + launch (seg2, cell2)", *g2)),
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

    def timed(self, seg, nblocks, stream, cell=0):
        drv = self._bound
        before = drv.graph_count if drv is not None else -1
        t0 = time.perf_counter()
        try:
            return orig(self, seg, nblocks, stream, cell)
        finally:
            dt = time.perf_counter() - t0
            made = (drv.graph_count if drv is not None else -1) - before
            state["n"] += 1
            log.append(("graphed", state["n"], state["held"], seg, cell, made, dt))

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
        f"  graphed launches {len(calls)}, behind a hold {len(held)}, graphs made "
        f"{sum(x[5] for x in calls)} ({sum(x[5] for x in held)} behind a hold)"
    )
    for x in log:
        if x[0] != "graphed":
            print("  ", *x)
        elif x[6] > 0.1:
            _, n, h, seg, cell, made, dt = x
            print(
                f"   SLOW call {n}: held={h} seg={seg:#x} cell={cell:#x} graphs made={made} "
                f"{dt * 1e3:.1f} ms"
            )
    slow_new = [x for x in held if x[5]]
    if slow_new:
        print(
            "  behind a hold, calls that made a graph: "
            + ", ".join(f"{x[6] * 1e6:.0f} us" for x in slow_new)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
