"""Where the benchmarks run (a GPU or the simulated device), their inputs, and the contenders.

A :class:`Context` hides the device: arrays, the one stream every contender uses, a
way to stall that stream (GPU) and GPU timing events. A :class:`Workload` is one step's
inputs: pageable host values, pinned copies of them, device destinations. A
:class:`Contender` issues one step's copies in one particular way; each is built
once per workload, checked byte for byte, then timed.
"""

from __future__ import annotations

import contextlib

import numpy as np

import cucopy as cc

from ._common import perf_ns, summarize

#: How long a GPU hold may stall the stream before the spin kernel gives up. A held
#: step takes milliseconds; a hold that times out means the host blocked while
#: enqueueing behind it (the launch queue filled up), and the sample is dropped.
HOLD_TIMEOUT_S = 2.0


class Site(cc.CopySite):
    """The benchmark's only site: every input is an H2D copy."""

    INPUT = cc.H2D


PLAN = cc.CopyPlan(merge={Site.INPUT})


class Unavailable(Exception):
    """A contender cannot run here (missing library, API, or a GPU)."""


class HoldTimeout(Exception):
    """The stream hold gave up before release: the host blocked while enqueueing."""


# -- contexts --------------------------------------------------------------------------------


class Context:
    """The device the benchmarks run on."""

    kind = "base"
    torch = None

    def empty(self, count: int, dtype: str):
        """A device array of ``count`` elements."""
        raise NotImplementedError

    def pinned(self, count: int, dtype: str):
        """A pinned host array; returns ``(object, numpy view)``."""
        raise NotImplementedError

    def to_numpy(self, arr) -> np.ndarray:
        """The device array's bytes (after :meth:`sync`)."""
        raise NotImplementedError

    def zero(self, arrays) -> None:
        """Zero device arrays and wait for it."""
        raise NotImplementedError

    def sync(self) -> None:
        """Wait for everything queued on the stream."""
        raise NotImplementedError

    def copier(self, plan, flush_mode: str, capacity: int) -> cc.DeviceCopier:
        """A copier on this context's device and stream."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the context holds."""


class SimContext(Context):
    """The simulated device (lazy policy): host time and stream operations only."""

    kind = "sim"

    def __init__(self, seed: int = 0):
        from cucopy.backends.sim import SimDevice

        self.dev = SimDevice(policy="lazy", seed=seed)
        self.stream = self.dev.stream("bench")
        self.device = self.dev

    def empty(self, count, dtype):
        return self.dev.empty((count,), np.dtype(dtype))

    def pinned(self, count, dtype):
        a = self.dev.pinned_empty((count,), np.dtype(dtype))
        return a, a

    def to_numpy(self, arr):
        return self.dev.to_host(arr)

    def zero(self, arrays):
        for a in arrays:
            a[...] = 0
        self.dev.synchronize()

    def sync(self):
        self.stream.synchronize()

    @property
    def ops(self) -> int:
        """Operations enqueued on the stream so far."""
        return self.stream.ops

    def copier(self, plan, flush_mode, capacity):
        return cc.DeviceCopier(
            plan,
            stream=self.stream,
            device=self.dev,
            backend="sim",
            flush_mode=flush_mode,
            capacity=capacity,
        )

    def mapped_threshold(self) -> int:
        from cucopy.backends.sim import SimBackend

        return SimBackend(self.dev).mapped_threshold()


class GpuContext(Context):
    """One CUDA device through CuPy (and torch, when it imports), one non-blocking stream.

    The stream is made current for both torch and CuPy, so every contender's work,
    and the zeroing and read-back around it, go on it.
    """

    kind = "gpu"

    def __init__(self, device: int = 0):
        import cupy

        from cucopy.backends.cuda import CudaBackend, cupy_stream

        self.cp = cupy
        self.rt = cupy.cuda.runtime
        self.device = device
        cupy.cuda.Device(device).use()
        self.notes = []
        self.torch = None
        try:
            import torch

            if torch.cuda.is_available():
                self.torch = torch
            else:
                self.notes.append("torch sees no CUDA device: torch contenders skipped")
        except ImportError as e:
            self.notes.append(f"torch does not import ({e}): torch contenders skipped")
        if self.torch is not None:
            self.torch.cuda.set_device(device)
            self.stream_obj = self.torch.cuda.Stream(device=device)
            self.handle = int(self.stream_obj.cuda_stream)
            self.torch.cuda.set_stream(self.stream_obj)
        else:
            self.stream_obj = cupy.cuda.Stream(non_blocking=True)
            self.handle = int(self.stream_obj.ptr)
        self.cp_stream = cupy_stream(cupy, self.handle, device)
        self.cp_stream.use()
        self.backend = CudaBackend(device)
        self._events = []

    # arrays: torch when it is there (what an engine hands cucopy), else CuPy
    def empty(self, count, dtype):
        if self.torch is not None:
            return self.torch.zeros(count, dtype=getattr(self.torch, dtype), device="cuda")
        return self.cp.zeros(count, dtype=dtype)

    def pinned(self, count, dtype):
        if self.torch is not None:
            t = self.torch.zeros(count, dtype=getattr(self.torch, dtype), pin_memory=True)
            return t, t.numpy()
        import cupyx

        a = cupyx.zeros_pinned((count,), dtype=dtype)
        return a, a

    def dptr(self, arr) -> int:
        """Device address of a device array."""
        return int(arr.data_ptr()) if self.torch is not None else int(arr.data.ptr)

    @staticmethod
    def hptr(view: np.ndarray) -> int:
        """Host address of a pinned array's NumPy view."""
        return int(view.ctypes.data)

    def to_numpy(self, arr):
        self.sync()
        if self.torch is not None:
            return arr.cpu().numpy()
        return self.cp.asnumpy(arr, stream=self.cp_stream)

    def zero(self, arrays):
        for a in arrays:
            if self.torch is not None:
                a.zero_()
            else:
                a.fill(0)
        self.sync()

    def sync(self):
        self.rt.streamSynchronize(self.handle)

    def copier(self, plan, flush_mode, capacity):
        return cc.DeviceCopier(
            plan,
            stream=self.stream_obj,
            device=self.device,
            backend="cuda",
            flush_mode=flush_mode,
            capacity=capacity,
        )

    def mapped_threshold(self) -> int:
        return self.backend.mapped_threshold()

    # GPU time of enqueued work
    def event(self) -> int:
        """A timing event (raw handle), destroyed by :meth:`close`."""
        ev = self.rt.eventCreate()
        self._events.append(ev)
        return ev

    def record(self, event: int) -> None:
        """Record ``event`` on the stream."""
        self.rt.eventRecord(event, self.handle)

    def elapsed_us(self, start: int, end: int) -> float:
        """Microseconds between two recorded events (waits for ``end``)."""
        self.rt.eventSynchronize(end)
        return self.rt.eventElapsedTime(start, end) * 1e3

    def hold(self):
        """Stall the stream with a spin kernel until the block exits."""
        return self.backend.hold(self.handle, timeout=HOLD_TIMEOUT_S)

    def close(self):
        self.sync()
        for ev in self._events:
            self.rt.eventDestroy(ev)
        self._events.clear()


def make_context(force_sim: bool = False, seed: int = 0) -> Context:
    """A GPU context when ``cucopy.backends.cuda.gpu_available()``, else the simulated device.

    Parameters
    ----------
    force_sim : bool
        Use the simulated device even when a GPU is visible.
    seed : int
        Seeds the simulated device.

    Returns
    -------
    Context
    """
    if not force_sim:
        from cucopy.backends.cuda import gpu_available

        if gpu_available():
            return GpuContext(0)
    return SimContext(seed)


# -- workload -------------------------------------------------------------------------------------


class Workload:
    """One step's inputs on ``ctx``: values, pinned copies of them, device destinations.

    Parameters
    ----------
    ctx : Context
    mix : list of (int, str)
        ``(elements, dtype)`` per input (see :func:`bench._common.decode_mix`).
    seed : int
        Seeds the values (all non-zero, so a zeroed destination never passes a check).
    """

    def __init__(self, ctx: Context, mix, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.ctx = ctx
        self.mix = list(mix)
        self.values = [rng.integers(1, 1 << 30, size=k).astype(dt) for k, dt in self.mix]
        self.dsts = [ctx.empty(k, dt) for k, dt in self.mix]
        pins = [ctx.pinned(k, dt) for k, dt in self.mix]
        self.pinned = [p for p, _ in pins]
        self.pinned_np = [v for _, v in pins]
        for view, v in zip(self.pinned_np, self.values):
            view[:] = v
        self.n = len(self.mix)
        self.nbytes = sum(v.nbytes for v in self.values)

    def capacity(self) -> int:
        """A ring slot that holds the whole step twice over (no overflow fallbacks)."""
        need = 2 * self.nbytes + 64 * self.n + (64 << 10)
        return max(1 << 20, 1 << (need - 1).bit_length())

    def verify(self, contender: Contender) -> str | None:
        """Run one step into zeroed destinations; None when every byte landed, else why not."""
        ctx = self.ctx
        ctx.zero(self.dsts)
        contender.step()
        contender.land()
        ctx.sync()
        bad = [
            i
            for i, (d, v) in enumerate(zip(self.dsts, self.values))
            if not np.array_equal(ctx.to_numpy(d).view(np.uint8), v.view(np.uint8))
        ]
        if bad:
            return f"{len(bad)}/{self.n} destinations wrong after one step (first: input {bad[0]})"
        return None


# -- contenders --------------------------------------------------------------------------------------


class Contender:
    """One way of issuing a step's copies.

    Subclasses set ``name`` and ``description`` and implement :meth:`step`;
    ``__init__`` raises :class:`Unavailable` when the contender cannot run here.
    """

    name = "base"
    description = ""
    copier = None
    #: False for a contender that writes nothing (a baseline): :func:`build` skips the check
    writes = True

    def __init__(self, ctx: Context, wl: Workload):
        self.ctx = ctx
        self.wl = wl

    def step(self) -> None:
        """Issue one step's copies (asynchronously)."""
        raise NotImplementedError

    def land(self) -> None:
        """Whatever lands a step's copies after :meth:`step` besides the step itself
        (nothing, except for a contender whose copies ride in a graph replay)."""

    def work_ops(self, steps: int) -> float | None:
        """Copies and launches enqueued per step (event records not counted)."""
        return float(self.wl.n)

    def close(self) -> None:
        """Release resources."""
        if self.copier is not None:
            self.copier.close()


class CucopyContender(Contender):
    """All inputs through one :class:`cucopy.DeviceCopier` step."""

    def __init__(self, ctx, wl, plan, flush_mode):
        super().__init__(ctx, wl)
        self.flush_mode = flush_mode
        self.copier = ctx.copier(plan, flush_mode, wl.capacity())
        self._pairs = list(zip(wl.dsts, wl.values))

    def step(self):
        copier = self.copier
        copy = copier.copy
        site = Site.INPUT
        with copier.step():
            for d, v in self._pairs:
                copy(site, d, v)

    def work_ops(self, steps):
        return copier_ops(self.copier)


def copier_ops(copier) -> float | None:
    """Copies and launches a copier enqueued per step, from its stats.

    A segment is one upload + one launch (``dma``) or one launch (``mapped`` or
    ``inline``), as the copier's ``stats.modes`` counted them; each eager copy is
    one copy.

    Parameters
    ----------
    copier : cucopy.DeviceCopier

    Returns
    -------
    float or None
        None before the copier's first step.
    """
    st = copier.stats
    if not st.steps:
        return None
    eager = sum(s.eager for s in st.sites.values())
    m = st.modes
    # a segment landed by a graph's own node ("graph") costs no operation of its own
    return (2 * m["dma"] + m["mapped"] + m["inline"] + eager) / st.steps


def _cucopy(name, plan, mode, description):
    class _C(CucopyContender):
        def __init__(self, ctx, wl):
            super().__init__(ctx, wl, plan, mode)

    _C.name = name
    _C.description = description
    _C.__name__ = _C.__qualname__ = f"Cucopy_{name}"
    return _C


CucopyChained = _cucopy(
    "cucopy_chained",
    None,
    "dma",
    "DeviceCopier(None): one eager (snapshotted) copy per input, nothing merged",
)
CucopyDma = _cucopy("cucopy_dma", PLAN, "dma", "merged: one H2D of the segment + one scatter")
CucopyMapped = _cucopy(
    "cucopy_mapped", PLAN, "mapped", "merged: one scatter reading mapped pinned memory"
)
CucopyInline = _cucopy(
    "cucopy_inline",
    PLAN,
    "inline",
    "merged: one scatter carrying the whole segment in its parameters (up to 32 KiB)",
)
CucopyAuto = _cucopy(
    "cucopy_auto", PLAN, "auto", "merged: graphed, inline, mapped or dma by segment size"
)


class CucopyAutoPinned(CucopyAuto):
    """``cucopy_auto`` from the pinned tensors ``torch_chain`` reads (what a torch engine holds)."""

    name = "cucopy_pinned_src"
    description = (
        "cucopy_auto from the pinned torch tensors torch_chain copies (sim: pinned arrays)"
    )

    def __init__(self, ctx, wl):
        super().__init__(ctx, wl)
        for p, v in zip(wl.pinned_np, wl.values):
            p[:] = v
        self._pairs = list(zip(wl.dsts, wl.pinned))


class OneLaunch(Contender):
    """One carried scatter launch of a single 4-byte copy: the floor under any merged step.

    No ``begin()``, no staging, no Python beyond one backend call: the launch a merged
    step of any N ends with, through the same compiled call (``CudaBackend.scatter``
    carrying the whole segment). A step of copies through one launch cannot cost the
    host less than this row in the same run, whatever N is.
    """

    name = "one_launch"
    description = "one carried scatter launch of one 4-byte copy (the floor of a merged step)"
    writes = False  # a baseline: it writes its own scratch word, not the step's inputs

    def __init__(self, ctx, wl):
        super().__init__(ctx, wl)
        if ctx.kind != "gpu":
            raise Unavailable("needs a GPU")
        from cucopy import pack

        self._be = be = ctx.backend
        self._dst = ctx.empty(4, "int32")
        data = pack.align(pack.HEADER_BYTES + pack.DESC_BYTES)
        self._total = total = data + pack.ALIGN
        self._seg, seg = ctx.pinned(total, "uint8")
        seg[data : data + 4] = np.frombuffer(np.int32(7).tobytes(), np.uint8)
        desc = (ctx.dptr(self._dst), data, 0, 4, 4, 4, 1, pack.KIND_H2D, 0, 0)
        self._nblocks = pack.encode(seg, [desc], data, total)
        self._host = ctx.hptr(seg)
        self._stream = ctx.handle
        if not be.carry_capacities():
            raise Unavailable("no carried scatter kernel on this device")
        be.scatter(self._host, self._nblocks, self._stream, True, total, self._host)
        if int(ctx.to_numpy(self._dst)[0]) != 7:
            raise Unavailable("one_launch: the launch did not land its copy")

    def step(self):
        self._be.scatter(self._host, self._nblocks, self._stream, True, self._total, self._host)

    def work_ops(self, steps):
        return 1.0


class CucopyGraphFeed(CucopyContender):
    """The step's merged copies landed by a scatter node inside the replayed graph.

    Not a step-cost contender (its copies need a graph to ride in): the decode loop
    captures its replay graph with this contender's :attr:`feed` node first
    (``body`` launches the graph's own work into the capture), and replays it with
    :meth:`launch`.
    """

    name = "cucopy_graph"
    description = (
        "merged: landed inside the replayed graph by its captured scatter node "
        "(copier.capture_inputs, step(graph=feed), feed.replay): no launch of its own"
    )
    embeds_graph = True

    def __init__(self, ctx, wl, body=None):
        if ctx.kind != "gpu":
            raise Unavailable("needs a GPU (the replay graph is a CUDA graph)")
        super().__init__(ctx, wl, PLAN, "auto")
        stream = ctx.cp_stream
        stream.begin_capture()
        try:
            self.feed = self.copier.capture_inputs(blocks=64)
            if body is not None:
                body(stream)
        finally:
            self.graph = stream.end_capture()

    def step(self):
        copier = self.copier
        copy = copier.copy
        site = Site.INPUT
        with copier.step(graph=self.feed):
            for d, v in self._pairs:
                copy(site, d, v)

    def launch(self) -> None:
        """Replay the graph on the context's stream, landing the last step's copies."""
        self.feed.replay(self.graph)

    def land(self) -> None:
        self.launch()


class TorchChain(Contender):
    """Chained ``dst.copy_(src, non_blocking=True)`` from pinned tensors that hold the values."""

    name = "torch_chain"
    description = "torch copy_(non_blocking=True) per input, from pinned tensors"

    def __init__(self, ctx, wl):
        super().__init__(ctx, wl)
        if ctx.torch is None:
            raise Unavailable("needs torch with CUDA")
        self._pairs = list(zip(wl.dsts, wl.pinned))

    def step(self):
        for d, s in self._pairs:
            d.copy_(s, non_blocking=True)


class TorchForeach(Contender):
    """``torch._foreach_copy_`` over all inputs from pinned tensors."""

    name = "torch_foreach"
    description = "torch._foreach_copy_(dsts, pinned srcs, non_blocking=True)"

    def __init__(self, ctx, wl):
        super().__init__(ctx, wl)
        if ctx.torch is None:
            raise Unavailable("needs torch with CUDA")
        self._fn = getattr(ctx.torch, "_foreach_copy_", None)
        if self._fn is None:
            raise Unavailable(f"torch {ctx.torch.__version__} has no _foreach_copy_")
        self._dsts = list(wl.dsts)
        self._srcs = list(wl.pinned)

    def step(self):
        self._fn(self._dsts, self._srcs, non_blocking=True)


class MemcpyChain(Contender):
    """Chained raw ``cudaMemcpyAsync`` (CuPy's runtime wrapper) from pinned memory."""

    name = "memcpy_chain"
    description = "cupy.cuda.runtime.memcpyAsync per input, from pinned memory"

    def __init__(self, ctx, wl):
        super().__init__(ctx, wl)
        if ctx.kind != "gpu":
            raise Unavailable("needs a GPU")
        self._memcpy = ctx.rt.memcpyAsync
        self._h = ctx.handle
        self._args = [(ctx.dptr(d), ctx.hptr(p), p.nbytes) for d, p in zip(wl.dsts, wl.pinned_np)]

    def step(self):
        memcpy, h = self._memcpy, self._h
        for d, s, n in self._args:
            memcpy(d, s, n, 1, h)  # 1: cudaMemcpyHostToDevice


class BatchMemcpy(Contender):
    """One ``cudaMemcpyBatchAsync`` (CUDA >= 12.8) through cuda-python.

    cuda-python 12.8/12.9 returns ``(err, failIdx)``, 13.x returns ``(err,)`` (CUDA 13
    dropped ``failIdx``); the argument lists are the same. Tries the runtime binding,
    then the driver's ``cuMemcpyBatchAsync``.
    """

    name = "batch_memcpy"
    description = "one cudaMemcpyBatchAsync (cuda-python) for all inputs"

    def __init__(self, ctx, wl):
        super().__init__(ctx, wl)
        if ctx.kind != "gpu":
            raise Unavailable("needs a GPU")
        dsts = [ctx.dptr(d) for d in wl.dsts]
        srcs = [ctx.hptr(p) for p in wl.pinned_np]
        sizes = [p.nbytes for p in wl.pinned_np]
        errors = []
        self._call = None
        for build in (self._runtime, self._driver):
            try:
                call = build(dsts, srcs, sizes, ctx.handle)
                call()  # one real call: an unsupported driver answers here
                ctx.sync()
                self._call = call
                break
            except Unavailable as e:
                errors.append(str(e))
            except Exception as e:
                errors.append(f"{build.__name__.strip('_')}: {e!r}")
        if self._call is None:
            raise Unavailable("; ".join(errors))

    @staticmethod
    def _runtime(dsts, srcs, sizes, handle):
        try:
            from cuda.bindings import runtime as crt
        except ImportError as e:
            raise Unavailable(f"cuda.bindings.runtime does not import ({e})") from None
        fn = getattr(crt, "cudaMemcpyBatchAsync", None)
        if fn is None:
            raise Unavailable("cuda.bindings.runtime has no cudaMemcpyBatchAsync (CUDA < 12.8)")
        attr = crt.cudaMemcpyAttributes()
        attr.srcAccessOrder = crt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        attrs, idxs, n = [attr], [0], len(dsts)
        stream = crt.cudaStream_t(handle)
        ok = crt.cudaError_t.cudaSuccess

        def call():
            err = fn(dsts, srcs, sizes, n, attrs, idxs, 1, stream)[0]
            if err != ok:
                raise RuntimeError(f"cudaMemcpyBatchAsync: {err!r}")

        return call

    @staticmethod
    def _driver(dsts, srcs, sizes, handle):
        try:
            from cuda.bindings import driver as drv
        except ImportError as e:
            raise Unavailable(f"cuda.bindings.driver does not import ({e})") from None
        fn = getattr(drv, "cuMemcpyBatchAsync", None)
        if fn is None:
            raise Unavailable("cuda.bindings.driver has no cuMemcpyBatchAsync")
        attr = drv.CUmemcpyAttributes()
        attr.srcAccessOrder = drv.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        d = [drv.CUdeviceptr(p) for p in dsts]
        s = [drv.CUdeviceptr(p) for p in srcs]
        attrs, idxs, n = [attr], [0], len(dsts)
        stream = drv.CUstream(handle)
        ok = drv.CUresult.CUDA_SUCCESS

        def call():
            err = fn(d, s, sizes, n, attrs, idxs, 1, stream)[0]
            if err != ok:
                raise RuntimeError(f"cuMemcpyBatchAsync: {err!r}")

        return call

    def step(self):
        self._call()

    def work_ops(self, steps):
        return 1.0


class BatchMemcpyRefill(BatchMemcpy):
    """The batch API on sources the host refills each step, as an engine stages its inputs.

    ``batch_memcpy`` reads pinned buffers written once at set-up. An engine writes
    each step's values first; a GPU read of host memory the CPU has just written (its
    cache lines still dirty) is slower than one of settled memory
    (bench/results/2026-11-30-h200-variants3: 7.7 -> 9.7 us for the N = 128 scatter),
    and cucopy's steps always pay it, since they stage the values.
    """

    name = "batch_refill"
    description = "refill the pinned sources, then one cudaMemcpyBatchAsync"

    def step(self):
        for view, v in zip(self.wl.pinned_np, self.wl.values):
            view[:] = v
        self._call()


class PinnedBuffers(Contender):
    """vLLM's ``CpuGpuBuffer`` pattern: a persistent pinned array per input.

    Each step refills the pinned array from the (pageable) values and copies the used
    prefix: ``buf.np[:n] = values; buf.gpu[:n].copy_(buf.cpu[:n], non_blocking=True)``.
    """

    name = "pinned_buffers"
    description = "persistent pinned buffer per input: refill, then copy_ (vLLM CpuGpuBuffer)"

    def __init__(self, ctx, wl):
        super().__init__(ctx, wl)
        if ctx.torch is None:
            raise Unavailable("needs torch with CUDA")
        self._bufs = []
        for (k, dt), d, v in zip(wl.mix, wl.dsts, wl.values):
            cpu, np_view = ctx.pinned(k, dt)
            self._bufs.append((np_view, cpu, d, k, v))

    def step(self):
        for np_view, cpu, gpu, n, v in self._bufs:
            np_view[:n] = v
            gpu[:n].copy_(cpu[:n], non_blocking=True)


#: Every contender of the step-cost scenario, in table order.
ALL = (
    TorchChain,
    MemcpyChain,
    TorchForeach,
    BatchMemcpy,
    BatchMemcpyRefill,
    PinnedBuffers,
    CucopyChained,
    CucopyDma,
    CucopyMapped,
    CucopyInline,
    CucopyAuto,
    CucopyAutoPinned,
    OneLaunch,
)


def build(cls, ctx, wl, notes: list):
    """Build a contender and check its bytes once.

    Parameters
    ----------
    cls : type
        A :class:`Contender` subclass.
    ctx : Context
    wl : Workload
    notes : list of str
        Receives why the contender was skipped, if it was.

    Returns
    -------
    Contender or None
        None when it cannot run here, failed to set up, or wrote wrong bytes.
    """
    try:
        c = cls(ctx, wl)
    except Unavailable as e:
        notes.append(f"skipped: {e}")
        return None
    except Exception as e:  # one broken contender must not stop the suite
        notes.append(f"skipped: failed to set up: {e!r}")
        return None
    try:
        why = wl.verify(c) if c.writes else None
    except Exception as e:
        why = f"raised {e!r}"
    if why is not None:
        notes.append(f"skipped: correctness check failed: {why}")
        with contextlib.suppress(Exception):
            c.close()
        return None
    return c


# -- measurement --------------------------------------------------------------------------------------


def host_us(ctx, step, reps: int, warmup: int) -> list[float]:
    """Host microseconds to issue one ``step()``, the stream drained before each.

    Parameters
    ----------
    ctx : Context
    step : callable
    reps, warmup : int

    Returns
    -------
    list of float
    """
    for _ in range(warmup):
        step()
        ctx.sync()
    out = []
    for _ in range(reps):
        t0 = perf_ns()
        step()
        t1 = perf_ns()
        out.append((t1 - t0) / 1e3)
        ctx.sync()
    return out


def host_passes(ctx, contenders: list, reps: int, warmup: int) -> tuple[list, list]:
    """Host samples of several contenders, taken in two passes: in order, then reversed.

    The lent machine's host speeds up or slows down during a run (run 34: a chained
    ``copy_`` cost 6.0 µs a copy early in the run and 3.6 later), so contenders timed one
    after another would each see another host. Half the repetitions go in each pass,
    the second in reverse order, so a steady drift weighs on every contender alike.
    Each contender's copier counters restart first, and count exactly these steps.

    Parameters
    ----------
    ctx : Context
    contenders : list of Contender
    reps, warmup : int
        Timed and untimed repetitions per contender, over both passes.

    Returns
    -------
    samples : list of list of float
        Per contender (in the order given), host µs of each timed step (``reps``).
    ops : list
        Per contender, stream operations per step (simulated device; None on a GPU).
    """
    samples: list = [[] for _ in contenders]
    ops: list = [0] * len(contenders)
    for c in contenders:
        if c.copier is not None:
            c.copier.stats.reset()
    first = reps // 2
    order = list(range(len(contenders)))
    for pass_order, n, warm in ((order, first, warmup), (order[::-1], reps - first, 0)):
        for i in pass_order:
            ops0 = ctx.ops if ctx.kind == "sim" else 0
            samples[i].extend(host_us(ctx, contenders[i].step, n, warm))
            if ctx.kind == "sim":
                ops[i] += ctx.ops - ops0
    per = [o / (reps + warmup) if ctx.kind == "sim" else None for o in ops]
    return samples, per


def host_by_contender(ctx, contenders: list, reps: int, warmup: int, notes: list, label: str):
    """:func:`host_passes` keyed by contender, for :func:`measure`'s ``host``/``ops``.

    If the passes fail, a note (prefixed ``label``) says so and both dicts come back
    empty: :func:`measure` then times each contender on its own.

    Returns
    -------
    host, ops : dict
        ``id(contender) ->`` host samples, and stream operations per step.
    """
    try:
        samples, per_step = host_passes(ctx, contenders, reps, warmup)
    except Exception as e:
        notes.append(f"{label}: host passes failed ({e!r}); contenders timed one by one")
        return {}, {}
    return (
        {id(c): x for c, x in zip(contenders, samples)},
        {id(c): x for c, x in zip(contenders, per_step)},
    )


def held_gpu_us(ctx: GpuContext, step, reps: int, warmup: int = 3) -> list[float]:
    """GPU microseconds of one step's work, enqueued behind a spin kernel.

    The stream is stalled, the start event, the step and the end event are enqueued,
    then the stall is released: the events bracket the step's operations running back
    to back, without the host's launch gaps.

    Raises
    ------
    HoldTimeout
        If the host blocked while enqueueing behind the hold (the launch queue was full).
    """
    start, end = ctx.event(), ctx.event()
    out = []
    for i in range(warmup + reps):
        try:
            with ctx.hold():
                ctx.record(start)
                step()
                ctx.record(end)
        except cc.CopyError as e:
            if "timed out" not in str(e):
                raise
            ctx.sync()
            raise HoldTimeout(str(e)) from e
        us = ctx.elapsed_us(start, end)
        if i >= warmup:
            out.append(us)
    ctx.sync()
    return out


def measure(
    ctx,
    contender: Contender,
    reps: int,
    warmup: int,
    gpu: bool = True,
    host: list | None = None,
    ops: float | None = None,
) -> dict:
    """Host time, work ops and (on a GPU) held GPU time of one contender's step.

    Parameters
    ----------
    ctx : Context
    contender : Contender
    reps, warmup : int
        Timed and untimed repetitions, for each of the two measurements.
    gpu : bool
        Also measure held GPU time (on a GPU context).
    host : list of float, optional
        Host samples already taken (:func:`host_passes`): the host loop is not run
        again, and the copier's counters are those of the steps that took them.
    ops : float, optional
        With ``host``, on the simulated device: the stream operations those steps
        enqueued, per step.

    Returns
    -------
    dict
        ``host_us`` and ``gpu_us`` (:func:`bench._common.summarize` results, ``gpu_us``
        None on the simulated device or when the hold timed out), ``work_ops_per_step``,
        ``stream_ops_per_step`` (measured, simulated device only) and ``notes``.
    """
    notes = []
    copier = contender.copier
    if host is None:
        if copier is not None:
            copier.stats.reset()
        ops0 = ctx.ops if ctx.kind == "sim" else None
        host = host_us(ctx, contender.step, reps, warmup)
        if ops0 is not None:
            ops = (ctx.ops - ops0) / (reps + warmup)
    res = {"host_us": summarize(host), "gpu_us": None, "notes": notes}
    res["stream_ops_per_step"] = ops if ctx.kind == "sim" else None
    res["work_ops_per_step"] = contender.work_ops(reps + warmup)
    if copier is not None:
        st = copier.stats
        res["segments_per_step"] = st.segments / max(st.steps, 1)
        res["bytes_staged_per_step"] = st.bytes_staged / max(st.steps, 1)
        res["host_waits"] = st.host_waits
        res["segment_modes"] = dict(st.modes)
        fb = {}
        for s in st.sites.values():
            for k, v in s.fallback.items():
                fb[k] = fb.get(k, 0) + v
        if fb:
            notes.append(f"fallbacks: {fb}")
    if gpu and ctx.kind == "gpu":
        try:
            res["gpu_us"] = summarize(held_gpu_us(ctx, contender.step, reps))
        except HoldTimeout as e:
            notes.append(f"no GPU time: {e}")
    return res
