"""How a step's copies should reach a scatter node inside the engine's CUDA graph.

Usage:
    python bench/probes/graph_feed.py [--n 32] [--launches 300] [--work-us 33] [--json PATH]

Question: which mechanism (issue 15)? A graph of ``--work-us`` of work is launched ``--launches`` times
back to back behind a stalled stream, so the figures are GPU periods, not host gaps.
Each launch carries one step of N merged copies (the decode mix, NumPy sources) by:

- ``none``: no copies (the floor);
- ``inline``: today's path, a separate carried scatter launch before each graph launch
  (``copier.step()``, ``flush_mode="inline"``);
- ``feed``: cucopy's graph feed, the scatter a node of the graph with fixed parameters
  reading a mapped mailbox entry tagged for its replay (``copier.capture_inputs()``,
  ``step(graph=feed)``, ``feed.replay(graph)``): no driver call per step;
- ``params_payload``: the node's parameters replaced before each launch
  (``cuGraphExecKernelNodeSetParams``) with the whole segment's bytes (a 1 KB and a
  20 KB payload, the seed probe's kernel);
- ``params_address``: the node's parameters replaced with only the address of a ring
  slot in mapped memory the host filled (the kernel reads the bytes from there);
- ``node_empty``: an empty kernel node (no parameters) before the work, nothing updated:
  what any extra kernel node costs the graph's period, the floor under every mechanism
  that lands copies through a node of the graph;
- ``node_1k_static``: the 1 KB payload node, its parameters never updated (the node's
  GPU cost without the host's update);
- ``params_payload_1k_branch``: the 1 KB payload node updated per step, on a branch of
  the graph forked before the work and joined after it (the overlap mechanism at its
  best: nothing in the work reads what the node writes; an engine joins before the
  first kernel that reads its inputs, which hides at most the work before it).

Per mechanism it prints the GPU period per launch (median of 5 runs), its excess over
``none``, and the host microseconds per step (median; the host's whole step: staging,
parameter update or mailbox write, launch). It also checks the landed bytes of the last
step and, for ``params_*``, that a launch already enqueued keeps the parameters it had
(the stalled stream sees tags 7 then 9 after an update between the two launches). Needs
a GPU (CuPy and cuda-python). Answer: ``graph_feed.log`` / ``graph_feed.json`` in the
first ``bench/results/`` run with it (``gpu_session.sh`` runs it; none stored yet).
Extends issue 15's throwaway probe (``graph_params.py``), whose measurements are the
``params_*`` rows.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics as st
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

import cucopy as cc  # noqa: E402
from bench import _common as common  # noqa: E402

_SRC = r"""
template<int CAP> struct P { unsigned long long dst; unsigned long long log; int n; int pad;
                             unsigned char data[CAP]; };
template<int CAP> __device__ void carry(const P<CAP>& p) {
  for (int i = threadIdx.x + blockIdx.x * blockDim.x; i < p.n; i += blockDim.x * gridDim.x)
    ((unsigned char*)p.dst)[i] = p.data[i];
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    unsigned int k = atomicAdd((unsigned int*)p.log, 1u);
    if (k < 4000) ((unsigned char*)p.log)[16 + k] = p.data[0];
  }
}
extern "C" __global__ void c1k(const __grid_constant__ P<1024> p) { carry(p); }
extern "C" __global__ void c20k(const __grid_constant__ P<20480> p) { carry(p); }
struct A { unsigned long long dst; unsigned long long src; int n; int pad; };
extern "C" __global__ void by_address(const __grid_constant__ A p) {
  for (int i = threadIdx.x + blockIdx.x * blockDim.x; i < p.n; i += blockDim.x * gridDim.x)
    ((unsigned char*)p.dst)[i] = ((const volatile unsigned char*)p.src)[i];
}
extern "C" __global__ void work(float* x, int n, int reps) {
  for (int r = 0; r < reps; r++)
    for (int i = threadIdx.x + blockIdx.x * blockDim.x; i < n; i += blockDim.x * gridDim.x)
      x[i] = x[i] * 0.999f + 1.0f;
}
extern "C" __global__ void empty() {}
extern "C" __global__ void spin(long long cycles) {
  long long t = clock64(); while (clock64() - t < cycles) {}
}
"""


class Site(cc.CopySite):
    """One merged H2D site for the whole mix."""

    INPUT = cc.H2D


def _ok(r):
    from cuda.bindings import driver as cu

    err = r[0] if isinstance(r, tuple) else r
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(err)
    if isinstance(r, tuple):
        return r[1] if len(r) == 2 else r[1:]
    return None


class Rig:
    """A stream, a work kernel (``--work-us``), a stall, GPU period measurement."""

    def __init__(self, args):
        import cupy as cp

        self.cp = cp
        self.args = args
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.mod = cp.RawModule(code=_SRC, options=("-std=c++17",))
        self.work = self.mod.get_function("work")
        self.spin = self.mod.get_function("spin")
        self.x = cp.ones(1 << 22, dtype=cp.float32)
        self.reps = 1
        self.reps = self._calibrate(args.work_us)

    def work_body(self) -> None:
        self.work(
            (264,), (256,), (self.x, np.int32(self.x.size), np.int32(self.reps)), stream=self.stream
        )

    def _calibrate(self, us: float) -> int:
        cp = self.cp
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        for reps in (1, 2, 4, 8, 16, 32, 64):
            self.reps = reps
            self.work_body()
            e0.record(self.stream)
            self.work_body()
            e1.record(self.stream)
            e1.synchronize()
            if cp.cuda.get_elapsed_time(e0, e1) * 1e3 >= us:
                return reps
        return 64

    def capture(self, body):
        s = self.stream
        s.begin_capture()
        try:
            body()
        finally:
            graph = s.end_capture()
        return graph

    def period(self, step, launches: int, host: list) -> float:
        """GPU µs per launch of ``launches`` ``step()`` calls enqueued behind a stall."""
        cp, s = self.cp, self.stream
        s.synchronize()
        for _ in range(launches + 4):  # every ring slot allocated before the timed runs
            step()
        s.synchronize()
        self.spin((1,), (1,), (np.int64(200_000_000),), stream=s)  # ~100 ms
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(s)
        for _ in range(launches):
            t0 = time.perf_counter_ns()
            step()
            host.append((time.perf_counter_ns() - t0) / 1e3)
        e1.record(s)
        e1.synchronize()
        return cp.cuda.get_elapsed_time(e0, e1) * 1e3 / launches


def _cucopy_rows(rig, args, out):
    """none, inline and feed, on the same work graph and copies."""
    cp = rig.cp
    mix = common.decode_mix(args.n, 0)
    rng = np.random.default_rng(0)
    values = [rng.integers(1, 1 << 30, k).astype(dt) for k, dt in mix]
    dsts = [cp.zeros(k, dtype=dt) for k, dt in mix]
    plan = cc.CopyPlan(merge={Site.INPUT})
    # a slot per launch in flight: the stall holds every launch, and a ring that came
    # round would wait for it (steady state runs with the default 4)
    slots = args.launches + 16
    rows = {}
    g0 = rig.capture(rig.work_body)

    def none():
        g0.launch(rig.stream)

    inline = cc.DeviceCopier(
        plan, stream=rig.stream, backend="cuda", slots=slots, capacity=1 << 16, flush_mode="inline"
    )

    def step_inline():
        with inline.step():
            for d, v in zip(dsts, values):
                inline.copy(Site.INPUT, d, v)
        g0.launch(rig.stream)

    fed = cc.DeviceCopier(plan, stream=rig.stream, backend="cuda", slots=slots, capacity=1 << 16)
    box = {}

    def body():
        box["feed"] = fed.capture_inputs(blocks=args.blocks)
        rig.work_body()

    g1 = rig.capture(body)
    feed = box["feed"]

    def step_feed():
        with fed.step(graph=feed):
            for d, v in zip(dsts, values):
                fed.copy(Site.INPUT, d, v)
        feed.replay(g1)

    def replay_empty():  # the node with nothing posted for its replay: its fixed cost
        feed.replay(g1)

    empty = rig.mod.get_function("empty")

    def body_empty():
        empty((1,), (32,), (), stream=rig.stream)
        rig.work_body()

    g2 = rig.capture(body_empty)

    def node_empty():  # any extra kernel node, no parameters, nothing updated
        g2.launch(rig.stream)

    rows_of = (("none", none), ("inline", step_inline), ("feed", step_feed))
    rows_of += (("feed_empty", replay_empty), ("node_empty", node_empty))
    for name, fn in rows_of:
        host: list = []
        periods = [rig.period(fn, args.launches, host) for _ in range(5)]
        rows[name] = {"period_us": st.median(periods), "host_us": st.median(host)}
    for d in dsts:
        d.fill(0)
    rig.stream.synchronize()
    step_feed()
    rig.stream.synchronize()
    ok = all(np.array_equal(cp.asnumpy(d), v) for d, v in zip(dsts, values))
    out["feed_landed_ok"] = bool(ok)
    out["feed_stats"] = {
        "posts": feed.posts,
        "fallbacks": feed.fallbacks,
        "host_waits": fed.stats.host_waits,
    }
    inline.close()
    fed.close()
    out["segment_bytes"] = int(sum(v.nbytes for v in values))
    return rows


def _param_rows(rig, args, out):
    """params_payload (1 KB, 20 KB) and params_address, through cuda-python."""
    cp = rig.cp
    dst = cp.zeros(32768, dtype=cp.uint8)
    log = cp.zeros(4096, dtype=cp.uint8)
    rows = {}
    for name, cap, n in (("params_payload_1k", 1024, 1000), ("params_payload_20k", 20480, 20000)):
        k = rig.mod.get_function("c1k" if cap == 1024 else "c20k")
        dt = np.dtype(
            [("dst", "<u8"), ("log", "<u8"), ("n", "<i4"), ("pad", "<i4"), ("data", "u1", cap)]
        )

        def payload(tag, dt=dt, n=n):
            a = np.zeros(1, dt)
            a["dst"], a["log"], a["n"] = dst.data.ptr, log.data.ptr, n
            a["data"][0, :n] = (np.arange(n) + tag) % 251
            a["data"][0, 0] = tag
            return a

        rows[name] = _setparams_row(rig, args, k, payload, log)
        if cap == 1024:
            rows["node_1k_static"] = _setparams_row(rig, args, k, payload, update=False)
            rows["params_payload_1k_branch"] = _setparams_row(rig, args, k, payload, branch=True)
    # only the address: the kernel reads the step's bytes from mapped memory
    import cupyx

    ring = [cupyx.empty_pinned(20000, dtype=np.uint8) for _ in range(args.launches + 16)]
    k = rig.mod.get_function("by_address")
    dt = np.dtype([("dst", "<u8"), ("src", "<u8"), ("n", "<i4"), ("pad", "<i4")])
    turn = [0]

    def payload_addr(tag):
        buf = ring[turn[0] % len(ring)]
        turn[0] += 1
        buf[:] = (np.arange(20000) + tag) % 251  # the host fills the slot, as staging does
        a = np.zeros(1, dt)
        a["dst"], a["n"] = dst.data.ptr, 20000
        a["src"] = buf.ctypes.data  # unified addressing: pinned memory is mapped at its address
        return a

    rows["params_address"] = _setparams_row(rig, args, k, payload_addr)
    return rows


def _setparams_row(rig, args, kernel, payload, log=None, update=True, branch=False):
    """Capture [kernel node, work], then time launches with a parameter update before each
    (``update=False``: the launches alone, the node keeping its captured parameters;
    ``branch``: the node on a branch forked before the work and joined after it)."""
    from cuda.bindings import driver as cu

    s = rig.stream
    keep: list = []

    def launch_args(a):
        buf = np.ascontiguousarray(a.view(np.uint8))
        ptrs = (ctypes.c_void_p * 1)(buf.ctypes.data)
        keep.append((buf, ptrs))
        if len(keep) > 64:
            keep.pop(0)
        return ctypes.addressof(ptrs)

    first = payload(1)
    _ok(
        cu.cuStreamBeginCapture(
            cu.CUstream(s.ptr), cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        )
    )
    try:
        on = s
        if branch:
            on = rig.cp.cuda.Stream(non_blocking=True)
            fork, join = (
                rig.cp.cuda.Event(disable_timing=True),
                rig.cp.cuda.Event(disable_timing=True),
            )
            fork.record(s)
            on.wait_event(fork)
        _ok(
            cu.cuLaunchKernel(
                cu.CUfunction(kernel.kernel.ptr),
                32,
                1,
                1,
                256,
                1,
                1,
                0,
                cu.CUstream(on.ptr),
                launch_args(first),
                0,
            )
        )
        if branch:
            join.record(on)
        rig.work_body()
        if branch:
            s.wait_event(join)
    finally:
        graph = _ok(cu.cuStreamEndCapture(cu.CUstream(s.ptr)))
    ex = _ok(cu.cuGraphInstantiate(graph, 0))
    nodes, count = _ok(cu.cuGraphGetNodes(graph, 16))
    knode = kprm = None
    for nd in nodes[:count]:
        if _ok(cu.cuGraphNodeGetType(nd)) == cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            prm = _ok(cu.cuGraphKernelNodeGetParams(nd))
            if int(prm.gridDimX) == 32:
                knode, kprm = nd, prm
    pl = [payload(t % 200 + 2) for t in range(16)]
    turn = [0]

    def step():
        if update:
            kprm.kernelParams = launch_args(pl[turn[0] % 16])
            turn[0] += 1
            _ok(cu.cuGraphExecKernelNodeSetParams(ex, knode, kprm))
        _ok(cu.cuGraphLaunch(ex, cu.CUstream(s.ptr)))

    host: list = []
    periods = [rig.period(step, args.launches, host) for _ in range(5)]
    # an enqueued launch keeps its parameters: the payload kernels log their tag
    snap = None
    if log is not None:
        s.synchronize()
        log.fill(0)
        s.synchronize()
        rig.spin((1,), (1,), (np.int64(200_000_000),), stream=s)
        for tag in (7, 9):
            kprm.kernelParams = launch_args(payload(tag))
            _ok(cu.cuGraphExecKernelNodeSetParams(ex, knode, kprm))
            _ok(cu.cuGraphLaunch(ex, cu.CUstream(s.ptr)))
        s.synchronize()
        snap = [int(x) for x in rig.cp.asnumpy(log[16:18])]
    return {"period_us": st.median(periods), "host_us": st.median(host), "snapshot": snap}


def main(argv=None) -> int:
    """Print one row per mechanism; write JSON with ``--json``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=32, help="copies per step (decode mix)")
    ap.add_argument("--launches", type=int, default=300)
    ap.add_argument("--work-us", type=float, default=33.0)
    ap.add_argument("--blocks", type=int, default=64, help="the feed node's thread blocks")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    from cucopy.backends.cuda import gpu_available

    if not gpu_available():
        print("graph_feed: needs a GPU (CuPy sees none): nothing measured")
        return 0
    rig = Rig(args)
    out: dict = {"config": vars(args), "reps": rig.reps}
    rows = _cucopy_rows(rig, args, out)
    try:
        rows.update(_param_rows(rig, args, out))
    except Exception as e:  # cuda-python missing or an API change: the cucopy rows stand
        out["params_error"] = repr(e)
    floor = rows["none"]["period_us"]
    print(
        f"graph_feed: N={args.n} ({out['segment_bytes']} bytes), {args.launches} launches of a "
        f"{args.work_us:.0f} us graph behind a stall, periods are GPU us per launch"
    )
    print(f"{'mechanism':22} {'period us':>10} {'over none':>10} {'host us/step':>13}")
    for name, r in rows.items():
        print(
            f"{name:22} {r['period_us']:10.2f} {r['period_us'] - floor:10.2f} {r['host_us']:13.2f}"
        )
    print(f"feed landed the last step's bytes: {out['feed_landed_ok']}; {out['feed_stats']}")
    if "params_error" in out:
        print(f"params rows skipped: {out['params_error']}")
    out["rows"] = rows
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if out["feed_landed_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
