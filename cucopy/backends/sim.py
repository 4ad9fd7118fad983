"""A simulated asynchronous device, in NumPy, for testing without a GPU.

It models what makes the copier hard rather than just moving bytes:

- device memory in its own address space (a host pointer used as a device
  pointer is an error), with arrays that slice into views like NumPy's;
- streams as FIFO queues that run *later*, under a policy: ``"lazy"`` runs
  work only when someone waits (stream/event synchronize, a stream waiting on
  an event, :meth:`SimDevice.to_host`), ``"eager"`` runs it at enqueue, and
  ``"random"`` runs a seeded random prefix of the queue after each enqueue;
- events whose :meth:`~SimEvent.query` never runs work, so a ring that merely
  polls cannot pass for one that waits;
- pinned host memory that an async H2D copy reads *when the copy runs*, and
  pageable host memory read at the call (as ``cudaMemcpyAsync`` stages it);
- :meth:`SimStream.hold` to stall a stream the way a long kernel does;
- freeing a backend buffer waits for the whole device, as ``cudaFree`` and
  ``cudaFreeHost`` do (:class:`SimDeadlock` while a stream with queued work is
  held);
- graph capture and replay: captured work is re-run, re-reading its sources;
  a captured kernel node (:meth:`SimStream.launch_node`) takes its parameters
  when a replay is enqueued, from what :meth:`SimGraph.set_params` last set
  (``cuGraphExecKernelNodeSetParams`` semantics: a replay already enqueued
  keeps the parameters it was enqueued with);
- the graph-fed scatter (``cucopy_scatter_feed``): a node with fixed
  parameters that reads its mailbox in mapped pinned memory when it runs and
  counts its replays in device memory;
- the scatter kernel as :func:`cucopy.pack.reference_scatter` over the same
  segment bytes, applying one segment's descriptors in a seeded shuffled order.

``stream.launch(fn)`` enqueues foreign work (a callable run in stream order);
inside it ``dev.raw(arr)`` is a writable NumPy view of the array's bytes.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import functools
import itertools
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar, cast

import numpy as np

from .. import pack
from ..adapters import ArrayInfo
from ..deadline import poll
from ..errors import CopyError
from .base import Backend, DeviceBuffer, PinnedBuffer

__all__ = [
    "SimDevice",
    "SimArray",
    "SimStream",
    "SimEvent",
    "SimGraph",
    "SimNode",
    "SimBackend",
    "SimDeadlock",
    "SimMemoryError",
    "default_device",
]

POLICIES = ("lazy", "eager", "random")

# Device address spaces sit above any user-space host address, one per device,
# with mapped pinned memory in a window of its own.
_SPACE = 1 << 56
_MAPPED = 1 << 52
_device_ids = itertools.count()


_F = TypeVar("_F", bound=Callable[..., Any])


def _serialized(method: _F) -> _F:
    """Run ``method`` under its device's lock: a GPU's streams and allocator are safe to
    use from several host threads, and run each stream's work in order; the sim's
    Python lists and queues are not, so one thread at a time touches a device."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with (self if isinstance(self, SimDevice) else self.device)._lock:
            return method(self, *args, **kwargs)

    return cast(_F, run)


# NumPy 2.1 added reshape's copy argument, and NumPy 2.5 deprecates assigning .shape,
# the older way to reshape without a copy
_RESHAPE_COPY_ARG = np.lib.NumpyVersion(np.__version__) >= "2.1.0"


def _reshaped_view(view: np.ndarray, shape) -> np.ndarray:
    """``view`` reshaped to ``shape`` without a copy (device memory is not copied behind
    the caller's back): raises when the strides allow no such view."""
    if _RESHAPE_COPY_ARG:
        return np.reshape(view, shape, copy=False)
    v = view.view()
    v.shape = shape  # NumPy < 2.1: not deprecated there
    return v


def _rows_of(arr) -> list:
    """``(address, width)`` of each contiguous run of ``arr``'s bytes."""
    from .._layout import blocks

    it = arr.dtype.itemsize
    return [
        (ptr + r * pitch, width)
        for ptr, rows, width, pitch in blocks(arr.ptr, arr.shape, arr.strides, it)
        for r in range(rows)
    ]


def _desc_rows(seg) -> list:
    """The bytes a segment's descriptors write, and the device bytes its D2D copies read."""
    _, descs = pack.decode(seg)
    out = []
    for d in descs:
        w, n = int(d["width"]), int(d["rows"])
        out += [(int(d["dst"]) + r * int(d["dst_pitch"]), w) for r in range(n)]
        if int(d["kind"]) == pack.KIND_D2D:
            out += [(int(d["src"]) + r * int(d["src_pitch"]), w) for r in range(n)]
    return out


class SimDeadlock(CopyError):
    """The host waited for a stream that is held: on a GPU this would hang."""


class SimMemoryError(CopyError):
    """An address is not device memory of this simulated device."""


class SimArray:
    """An array in simulated device memory; basic indexing returns views."""

    __slots__ = ("device", "_view", "_alloc", "_base", "_ptr", "_info", "_root", "__weakref__")

    def __init__(self, device, view, alloc, base, root=None):
        self.device = device
        self._view = view
        self._alloc = alloc
        self._base = base
        self._root = root  # the array this is a view of (None: not a view)
        self._ptr = base + (view.__array_interface__["data"][0] - alloc.ctypes.data)
        self._info = None

    @property
    def ptr(self) -> int:
        """Device address of element ``[0, ..., 0]``."""
        return self._ptr

    shape = property(lambda self: self._view.shape)
    dtype = property(lambda self: self._view.dtype)
    strides = property(lambda self: self._view.strides)
    ndim = property(lambda self: self._view.ndim)
    size = property(lambda self: self._view.size)
    nbytes = property(lambda self: self._view.nbytes)

    def __len__(self) -> int:
        return len(self._view)

    def __getitem__(self, idx) -> SimArray:
        v = self._view[idx]
        if not isinstance(v, np.ndarray) or not np.may_share_memory(v, self._alloc):
            raise TypeError(f"{self!r}: only basic indexing (views) is supported, got {idx!r}")
        return SimArray(self.device, v, self._alloc, self._base, self._root or self)

    def __setitem__(self, idx, value) -> None:
        # a blocking write, as cudaMemcpy on the legacy default stream
        dev = self.device
        dev.synchronize()
        if dev._watches:
            sub = self._view[(idx if isinstance(idx, tuple) else (idx,)) + (Ellipsis,)]
            ptr = self._base + (sub.__array_interface__["data"][0] - self._alloc.ctypes.data)
            rows = _rows_of(
                SimArray(dev, sub.reshape(-1) if sub.ndim == 0 else sub, self._alloc, self._base)
            )
            dev._touch(rows, f"a host write into {self!r}[{idx!r}] (at {ptr:#x})")
        self._view[idx] = value

    @property
    def T(self) -> SimArray:  # noqa: N802 (NumPy's name)
        """The transposed view."""
        return SimArray(self.device, self._view.T, self._alloc, self._base, self._root or self)

    def reshape(self, *shape) -> SimArray:
        """A reshaped view (no copy; raises if one is impossible)."""
        want = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        v = _reshaped_view(self._view, want)
        return SimArray(self.device, v, self._alloc, self._base, self._root or self)

    def view(self, dtype) -> SimArray:
        """Reinterpret the bytes with another dtype."""
        return SimArray(
            self.device, self._view.view(dtype), self._alloc, self._base, self._root or self
        )

    @staticmethod
    def __cucopy_fingerprint__(x) -> None:
        """A view's geometry never changes: nothing to revalidate (see ``fingerprint_fn``)."""
        return None

    # for the compiled segment: nothing to read, and how to read a view made afresh
    # (``d[:n]``) of an array seen before (cucopy.segment, view protocol)
    __cucopy_fingerprint__.__func__.__cucopy_spec__ = ()
    __cucopy_fingerprint__.__func__.__cucopy_view__ = (
        "_root",
        "ptr",
        False,
        "shape",
        "strides",
        False,
        False,
        "dtype",
        (),
    )

    def __cucopy_array__(self) -> ArrayInfo:
        # a view's geometry never changes, so one description serves every call
        info = self._info
        if info is None:
            v = self._view
            info = self._info = ArrayInfo(
                self._ptr,
                v.shape,
                v.strides,
                v.dtype,
                device=self.device,
                obj=self,
                label=lambda: f"SimArray(sim:{self.device.index}, {v.dtype}, shape={v.shape})",
            )
        return info

    def __cucopy_current_stream__(self):
        return self.device.default_stream

    def __repr__(self) -> str:
        return f"SimArray(sim:{self.device.index}, {self.dtype}, shape={self.shape}, ptr={self.ptr:#x})"


class SimEvent:
    """An event: complete once its stream has run past the point it was recorded."""

    __slots__ = ("device", "_stream", "_ticket", "_done", "__weakref__")

    def __init__(self, device):
        self.device = device
        self._stream = None
        self._ticket = 0
        self._done = 0

    def record(self, stream) -> None:
        """Record on ``stream``: completes when the work enqueued before it has run."""
        stream._record(self)

    def query(self) -> bool:
        """True when complete. Never runs any work."""
        return self._done >= self._ticket

    def synchronize(self) -> None:
        """Run the recording stream until the event completes."""
        if self._stream is not None and not self.query():
            self._stream._run_until(lambda: self.query())

    def wait(self, timeout: float) -> bool:
        """Run the recording stream until the event completes, for at most ``timeout`` s.

        Behind a stalled stream (:meth:`SimStream.hold` with ``stall=True``) the host
        sleeps between queries until the hold ends (another thread) or the deadline
        passes, as on a GPU whose kernel never ends; behind a plain hold it raises
        :class:`SimDeadlock` at once, as :meth:`synchronize` does.

        Returns
        -------
        bool
            True when the event completed, False when the deadline passed first.
        """
        stream = self._stream
        if stream is None or self.query():
            return True
        return poll(lambda _: stream._advance_until(self.query), None, timeout)


class SimStream:
    """A FIFO queue of work that runs later, according to the device's policy."""

    def __init__(self, device, name=""):
        self.device = device
        self.name = name
        self._queue = deque()
        self._holds = 0
        self._stalls = 0  # holds that stall (hold(stall=True)): bounded waits time out
        self._graph = None
        self.ops = 0  # operations enqueued, for benchmarks

    # -- work ---------------------------------------------------------------

    @_serialized
    def _enqueue(self, fn) -> None:
        self.ops += 1
        if self._graph is not None:
            self._graph._ops.append(fn)
            return
        dev = self.device
        dev._epoch += 1
        self._queue.append((fn, dev._epoch))
        if dev.policy == "eager":
            self._run(len(self._queue))
        elif dev.policy == "random":
            self._run(int(dev.rng.integers(0, len(self._queue) + 1)))

    def _exec(self) -> None:
        """Run the oldest queued operation (the device knows which stream runs it)."""
        fn, epoch = self._queue.popleft()
        dev = self.device
        prev = dev._running, dev._running_epoch
        dev._running, dev._running_epoch = self, epoch
        try:
            fn()
        finally:
            dev._running, dev._running_epoch = prev

    @_serialized
    def _run(self, n) -> None:
        q = self._queue
        while n > 0 and q and not self._holds:
            self._exec()
            n -= 1

    @_serialized
    def _run_until(self, done) -> None:
        while not done():
            if not self._queue:
                raise AssertionError("internal: waited for work that was never enqueued")
            if self._holds:
                raise SimDeadlock(
                    f"waited on sim stream {self.name or id(self):} while it is held: "
                    "on a GPU the host would hang here"
                )
            self._exec()

    @_serialized
    def _advance_until(self, done) -> bool:
        """Run queued work until ``done()`` or a stall; whether ``done()`` (see SimEvent.wait)."""
        while not done():
            if not self._queue:
                raise AssertionError("internal: waited for work that was never enqueued")
            if self._holds:
                if self._holds > self._stalls:
                    raise SimDeadlock(
                        f"waited on sim stream {self.name or id(self)} while it is held: "
                        "on a GPU the host would hang here"
                    )
                return False
            self._exec()
        return True

    def launch(self, fn) -> None:
        """Enqueue foreign work: ``fn()`` runs in stream order (a stand-in for a kernel)."""
        self._enqueue(fn)

    @_serialized
    def launch_node(self, fn, params) -> SimNode:
        """Enqueue a kernel taking ``params``: ``fn(params)`` runs in stream order.

        During capture it becomes a :class:`SimNode` of the graph, whose parameters
        :meth:`SimGraph.set_params` may replace between replays; otherwise it runs
        with ``params`` as given (a plain launch).
        """
        node = SimNode(fn, params)
        if self._graph is not None:
            self.ops += 1
            self._graph._ops.append(node)
            return node
        self._enqueue(node.bind())
        return node

    @_serialized
    def _record(self, event) -> None:
        if self._graph is not None:
            raise CopyError("sim: recording an event during capture is not modelled")
        event._stream = self
        event._ticket += 1
        ticket = event._ticket

        def mark():
            event._done = max(event._done, ticket)

        self._enqueue(mark)

    def wait_event(self, event) -> None:
        """Make later work on this stream wait for ``event``."""
        if event._stream is None or event.query():
            return
        ticket = event._ticket

        def wait():
            event._stream._run_until(lambda: event._done >= ticket)

        self._enqueue(wait)

    @_serialized
    def synchronize(self) -> None:
        """Run everything queued (raises :class:`SimDeadlock` while held)."""
        if self._queue and self._holds:
            raise SimDeadlock(
                f"synchronize on sim stream {self.name or id(self)} while it is held: "
                "on a GPU the host would hang here"
            )
        self._run(len(self._queue) + 1 << 60)

    @property
    def pending(self) -> int:
        """Operations queued and not yet run."""
        return len(self._queue)

    @contextlib.contextmanager
    def hold(self, *, stall: bool = False):
        """Stall the stream, as a long-running kernel does, until the block exits.

        Parameters
        ----------
        stall : bool
            False: a host wait on the held work raises :class:`SimDeadlock` at once
            (on a GPU it would hang). True: a stream that never completes, as behind
            a hung kernel: a bounded wait (:meth:`SimEvent.wait`, the copier's waits)
            sleeps until its deadline and reports it; an unbounded one still raises
            :class:`SimDeadlock`.
        """
        self._holds += 1
        self._stalls += bool(stall)
        try:
            yield self
        finally:
            self._holds -= 1
            self._stalls -= bool(stall)
            if not self._holds and self.device.policy == "eager":
                self._run(len(self._queue))

    @property
    def is_capturing(self) -> bool:
        """True inside :meth:`SimDevice.capture`."""
        return self._graph is not None

    def __repr__(self) -> str:
        return f"SimStream({self.name or hex(id(self))}, pending={len(self._queue)})"


class SimNode:
    """A captured kernel launch: ``fn(params)``, its parameters replaceable per replay.

    Parameters are copied when set (as the driver copies a launch's parameter
    buffer), so the caller may change its own object afterwards.
    """

    __slots__ = ("fn", "params")

    def __init__(self, fn, params):
        self.fn = fn
        self.params = _freeze(params)

    def bind(self):
        """The launch with the parameters as they are now (what a replay enqueues)."""
        fn, params = self.fn, self.params
        return lambda: fn(params)


def _freeze(params):
    if isinstance(params, (bytes, bytearray, memoryview, np.ndarray)):
        return bytes(params)
    return tuple(params) if isinstance(params, list) else params


class SimGraph:
    """Captured work; :meth:`replay` enqueues it again, re-reading its sources."""

    def __init__(self):
        self._ops = []

    def __len__(self) -> int:
        return len(self._ops)

    @property
    def nodes(self) -> list:
        """The captured kernel nodes (:meth:`SimStream.launch_node`), in capture order."""
        return [op for op in self._ops if isinstance(op, SimNode)]

    def set_params(self, node: SimNode, params) -> None:
        """Replace ``node``'s parameters for the replays enqueued from now on.

        A replay already enqueued keeps the parameters it was enqueued with, as
        ``cuGraphExecKernelNodeSetParams`` leaves a launched graph alone.
        """
        if not any(op is node for op in self._ops):
            raise ValueError(f"set_params: {node!r} is not a node of this graph")
        node.params = _freeze(params)

    def replay(self, stream) -> None:
        """Enqueue the captured operations on ``stream`` (nodes with their current parameters)."""
        for op in self._ops:
            stream._enqueue(op.bind() if isinstance(op, SimNode) else op)


class SimDevice:
    """A simulated device: its memory, streams, pinned host memory and policy.

    Parameters
    ----------
    policy : {"lazy", "eager", "random"}
        When queued work runs (see the module docstring).
    seed : int
        Seeds the ``random`` policy and the scatter's descriptor order.

    Attributes
    ----------
    carry_capacities : tuple of int
        What a scatter launch may carry in its parameters, as the CUDA backend
        offers (``pack.CARRY_CAPACITIES``); set ``()`` to model a driver that
        carries nothing, or a prefix to model one without large parameters.
    mapped_coherent : bool
        False models a device whose reads of mapped pinned memory return zeros (a
        pinned mapping under GPU confidential computing may read stale or zero
        bytes): the copier's coherence probe then fails and it uses ``dma``.
    graph_capacity : int
        Bytes a graphed scatter reads at its segment, as the CUDA backend offers
        (``pack.GRAPH_CAPACITY``) when the driver's graph calls are there; 0 (the
        default) models a backend without them. Set it before making a copier.
    """

    def __init__(self, policy: str = "lazy", seed: int = 0, *, mapped_coherent: bool = True):
        if policy not in POLICIES:
            raise ValueError(f"SimDevice: policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self._lock = threading.RLock()  # see _serialized
        self.rng = np.random.default_rng(seed)
        self.index = next(_device_ids)
        self._space = _SPACE * (1 + self.index % 200)
        self._next = self._space + 0x1000
        self._bases: list[int] = []
        self._allocs: list[np.ndarray] = []
        self._pinned_ptrs: list[int] = []
        self._pinned: list[np.ndarray] = []
        self._streams: list = []
        self.default_stream = self.stream("default")
        self.device_reads = 0  # reads of device memory by the host (check mode's cost)
        self.carry_capacities = pack.CARRY_CAPACITIES
        self.graph_capacity = 0
        self._feeds = 0  # graph feeds captured (SimBackend.feed_capture)
        #: check mode's watches (SimBackend.watch): token -> (rows, label, owner backend,
        #: stream, the host-order epoch of the call, [armed on the stream])
        self._watches: dict = {}
        self._watch_ids = itertools.count(1)
        self._running = None  # the stream whose operation runs now
        self._running_epoch = 0  # and when (in host order) that operation was enqueued
        self._epoch = 0  # operations enqueued on any stream so far (host order)
        #: False: the device reads zeros through mapped pinned memory (as under GPU
        #: confidential computing, where a mapping may not be coherent); set before
        #: making a copier
        self.mapped_coherent = mapped_coherent
        self._coherence = None  # the coherence probe's answer (SimBackend.mapped_coherent)

    # -- memory ---------------------------------------------------------------

    @_serialized
    def _alloc(self, nbytes: int):
        mem = np.zeros(max(nbytes, 1), np.uint8)
        base = self._next
        self._next += pack.align(max(nbytes, 1), 256) + 256
        self._bases.append(base)
        self._allocs.append(mem)
        return base, mem

    @_serialized
    def _free(self, base: int) -> None:
        i = bisect.bisect_left(self._bases, base)
        if i < len(self._bases) and self._bases[i] == base:
            del self._bases[i]
            del self._allocs[i]

    def empty(self, shape, dtype=np.float32) -> SimArray:
        """Uninitialized (zeroed) device array."""
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        base, mem = self._alloc(n)
        view = mem[:n].view(dtype).reshape(shape)
        return SimArray(self, view, mem, base)

    zeros = empty

    def asarray(self, host) -> SimArray:
        """A new device array holding a copy of ``host`` (blocking)."""
        host = np.ascontiguousarray(host)
        arr = self.empty(host.shape, host.dtype)
        arr._view[...] = host
        return arr

    def to_host(self, arr: SimArray) -> np.ndarray:
        """Synchronize the device and return a copy of the array's values."""
        self.synchronize()
        return np.array(arr._view, copy=True)

    def raw(self, arr: SimArray) -> np.ndarray:
        """Writable NumPy view of the array's device bytes (for work run in stream order).

        In check mode, work that asks for bytes of a merged destination whose copy has
        not landed yet raises :class:`~cucopy.CopyError` (a reader or writer before
        its barrier).
        """
        if self._watches and self._running is not None:
            self._touch(
                _rows_of(arr),
                f"dev.raw({arr!r}) in work launched on stream {self._running.name}",
            )
        return arr._view

    def _touch(self, rows, op: str, owner=None) -> None:
        """Raise if ``rows`` ((address, width) pairs) meet a watched destination.

        ``owner``: the backend issuing the operation (its own copier's watches do not
        apply: it orders its own work).
        """
        running, epoch = self._running, self._running_epoch
        for wrows, label, wowner, wstream, wepoch, armed in list(self._watches.values()):
            if owner is not None and wowner is owner:
                continue
            if running is wstream or running is None:
                if not armed[0]:  # the copier's stream has not reached the call yet
                    continue
            elif epoch <= wepoch:  # another stream's work, issued before the call
                continue
            for a, w in rows:
                for b, v in wrows:
                    if a < b + v and b < a + w:
                        lo, hi = max(a, b), min(a + w, b + v)
                        raise CopyError(
                            f"{label} [{lo:#x}, {hi:#x}) were read or written by "
                            f"other work before its barrier: {op}. The plan promises that "
                            "nothing touches a merged destination before its barrier: make "
                            "the site a flush_after barrier, or flush() before this work"
                        )

    def pinned_empty(self, shape, dtype=np.float32) -> np.ndarray:
        """A page-locked host array: async copies read it when they run."""
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        mem = np.zeros(max(n, 1) + 64, np.uint8)
        off = (-mem.ctypes.data) % 64
        buf = mem[off : off + max(n, 1)]
        self._register_pinned(buf)
        return buf[:n].view(dtype).reshape(shape)

    @_serialized
    def _register_pinned(self, buf: np.ndarray) -> None:
        ptr = buf.ctypes.data
        i = bisect.bisect_left(self._pinned_ptrs, ptr)
        self._pinned_ptrs.insert(i, ptr)
        self._pinned.insert(i, buf)

    @_serialized
    def _unregister_pinned(self, buf: np.ndarray) -> None:
        ptr = buf.ctypes.data
        i = bisect.bisect_left(self._pinned_ptrs, ptr)
        if i < len(self._pinned_ptrs) and self._pinned_ptrs[i] == ptr:
            del self._pinned_ptrs[i]
            del self._pinned[i]

    @_serialized
    def _pinned_at(self, ptr: int, nbytes: int):
        i = bisect.bisect_right(self._pinned_ptrs, ptr) - 1
        if i >= 0:
            buf = self._pinned[i]
            if ptr + nbytes <= self._pinned_ptrs[i] + buf.nbytes:
                return buf, ptr - self._pinned_ptrs[i]
        return None

    def is_pinned(self, ptr: int) -> bool:
        """Whether ``ptr`` lies in pinned memory of this device."""
        return self._pinned_at(ptr, 1) is not None

    @_serialized
    def _mem(self, addr: int, nbytes: int) -> np.ndarray:
        """The device bytes ``[addr, addr + nbytes)`` as a writable view."""
        if self._space + _MAPPED <= addr < self._space + 2 * _MAPPED:
            if not self.mapped_coherent and self._running is not None:
                # device work reading through an incoherent mapping: zeros
                return np.zeros(nbytes, np.uint8)
            host = addr - self._space - _MAPPED
            hit = self._pinned_at(host, nbytes)
            if hit is None:
                raise SimMemoryError(f"sim:{self.index}: {addr:#x} is not mapped pinned memory")
            buf, off = hit
            return buf[off : off + nbytes]
        i = bisect.bisect_right(self._bases, addr) - 1
        if i >= 0:
            mem = self._allocs[i]
            off = addr - self._bases[i]
            if off + nbytes <= mem.nbytes:
                return mem[off : off + nbytes]
        raise SimMemoryError(
            f"sim:{self.index}: [{addr:#x}, +{nbytes}) is not device memory of this device"
        )

    def mapped_pointer(self, host_ptr: int) -> int:
        """Device address of pinned host memory at ``host_ptr``."""
        return self._space + _MAPPED + host_ptr

    # -- streams ----------------------------------------------------------------

    @_serialized
    def stream(self, name: str = "") -> SimStream:
        """A new stream."""
        s = SimStream(self, name or f"s{len(self._streams)}")
        self._streams.append(s)
        return s

    def event(self) -> SimEvent:
        """A new event."""
        return SimEvent(self)

    @_serialized
    def synchronize(self) -> None:
        """Run every stream's queued work."""
        busy = True
        while busy:
            busy = False
            for s in self._streams:
                if s._queue:
                    s.synchronize()
                    busy = True

    @contextlib.contextmanager
    def capture(self, stream: SimStream):
        """Capture the work enqueued on ``stream`` into a :class:`SimGraph`."""
        if stream._graph is not None:
            raise CopyError(f"sim: {stream!r} is already capturing")
        graph = SimGraph()
        stream._graph = graph
        try:
            yield graph
        finally:
            stream._graph = None

    def __repr__(self) -> str:
        return f"SimDevice(sim:{self.index}, policy={self.policy!r})"


_default = None


def default_device() -> SimDevice:
    """The process-wide simulated device used when none is named."""
    global _default
    if _default is None:
        _default = SimDevice()
    return _default


class SimBackend(Backend):
    """The backend protocol on a :class:`SimDevice`."""

    name = "sim"

    def __init__(self, device: SimDevice | None = None):
        self.device = device if device is not None else default_device()

    # -- streams -----------------------------------------------------------------

    def resolve_stream(self, stream):
        if stream is None:
            return self.device.default_stream
        if isinstance(stream, SimStream):
            if stream.device is not self.device:
                raise ValueError(
                    f"stream: {stream!r} belongs to sim:{stream.device.index}, "
                    f"not {self.describe()}"
                )
            return stream
        raise TypeError(
            f"stream: the sim backend takes a SimStream, got {type(stream).__qualname__}"
        )

    def current_stream(self):
        return self.device.default_stream

    def is_capturing(self, stream) -> bool:
        return stream._graph is not None

    def synchronize(self, stream) -> None:
        stream.synchronize()

    # -- memory --------------------------------------------------------------------

    def alloc_pinned(self, nbytes: int) -> PinnedBuffer:
        dev = self.device
        buf = dev.pinned_empty((nbytes,), np.uint8)
        ptr = buf.ctypes.data

        def free():
            dev.synchronize()  # cudaFreeHost waits for the whole device
            dev._unregister_pinned(buf)

        return PinnedBuffer(buf, ptr, dev.mapped_pointer(ptr), free)

    def alloc_device(self, nbytes: int) -> DeviceBuffer:
        dev = self.device
        base, _ = dev._alloc(nbytes)

        def free():
            dev.synchronize()  # cudaFree waits for the whole device
            dev._free(base)

        return DeviceBuffer(base, nbytes, free)

    def is_pinned(self, host_ptr: int) -> bool:
        return self.device.is_pinned(host_ptr)

    def read(self, ptr: int, nbytes: int, stream) -> bytes:
        stream.synchronize()
        self.device.device_reads += 1
        return self.device._mem(ptr, nbytes).tobytes()

    # -- work ------------------------------------------------------------------------

    def copy2d(self, h2d, dst, dpitch, src, spitch, width, rows, stream) -> None:
        dev = self.device
        span = (rows - 1) * dpitch + width
        dev._mem(dst, span)  # a host pointer as destination fails here, at the call
        if h2d:
            sspan = (rows - 1) * spitch + width
            if dev._pinned_at(src, sspan) is not None:

                def load():
                    return np.frombuffer(ctypes.string_at(src, sspan), np.uint8)
            else:
                if stream._graph is not None:
                    raise CopyError("sim: an H2D copy from pageable memory cannot be captured")
                snap = np.frombuffer(ctypes.string_at(src, sspan), np.uint8)

                def load():
                    return snap
        else:
            sspan = (rows - 1) * spitch + width
            dev._mem(src, sspan)

            def load(pitch=spitch):
                # the rows only, packed (a wide pitch may leave gigabytes between them)
                rows_of = np.lib.stride_tricks.as_strided(
                    dev._mem(src, sspan), shape=(rows, width), strides=(pitch, 1)
                )
                return rows_of.copy().reshape(-1)

            srows = [(src + r * spitch, width) for r in range(rows)]
            spitch = width  # of the packed rows load() returns

        def run():
            if dev._watches:  # check mode: another copier's merged destination?
                dst_rows = [(dst + r * dpitch, width) for r in range(rows)]
                dev._touch(
                    dst_rows if h2d else dst_rows + srows,
                    f"a {'H2D' if h2d else 'D2D'} copy into [{dst:#x}, +{span}) on stream "
                    f"{stream.name}",
                    self,
                )
            data = load()
            for r in range(rows):
                dev._mem(dst + r * dpitch, width)[:] = data[r * spitch : r * spitch + width]

        stream._enqueue(run)

    def fill(self, dst, dpitch, width, rows, value, elem, stream) -> None:
        dev = self.device
        dev._mem(dst, (rows - 1) * dpitch + width)
        row = np.frombuffer(int(value).to_bytes(8, "little")[:elem] * (width // elem), np.uint8)

        def run():
            if dev._watches:
                dev._touch(
                    [(dst + r * dpitch, width) for r in range(rows)],
                    f"a fill of [{dst:#x}, +{(rows - 1) * dpitch + width}) on stream {stream.name}",
                    self,
                )
            for r in range(rows):
                dev._mem(dst + r * dpitch, width)[:] = row

        stream._enqueue(run)

    def scatter(self, segment_ptr, nblocks, stream, mapped, carry=0, host_ptr=0) -> None:
        dev = self.device
        dev._mem(segment_ptr, pack.HEADER_BYTES)
        head = b""  # the launch's parameters: copied now, as cuLaunchKernel copies them
        if carry:
            caps = self.carry_capacities()
            if not pack.carry_capacity(carry, caps):
                raise ValueError(
                    f"scatter: carry={carry} exceeds the largest capacity {caps[-1] if caps else 0}"
                )
            head = dev._mem(dev.mapped_pointer(host_ptr), carry).tobytes()
            carried, _ = pack.decode(head[: pack.HEADER_BYTES])
            table_end = int(carried["desc_offset"]) + int(carried["ndesc"]) * pack.DESC_BYTES
            if carry < table_end:
                raise AssertionError(
                    f"internal: carry={carry} bytes do not hold the descriptor table "
                    f"(ends at {table_end})"
                )

        def run():
            if head:
                header = carried
            else:
                header, _ = pack.decode(dev._mem(segment_ptr, pack.HEADER_BYTES).tobytes())
            total = int(header["total_bytes"])
            seg = head[:total]
            if total > len(seg):  # the rest is read from the segment when the kernel runs
                seg += dev._mem(segment_ptr + len(seg), total - len(seg)).tobytes()
            n = int(header["ndesc"])
            if int(header["nblocks"]) != nblocks:
                raise AssertionError(
                    f"internal: launch of {nblocks} blocks for a segment of "
                    f"{int(header['nblocks'])}"
                )
            order = dev.rng.permutation(n)
            if dev._watches:
                dev._touch(
                    _desc_rows(seg), f"another copier's scatter on stream {stream.name}", self
                )

            def store(addr, data):
                dev._mem(addr, len(data))[:] = np.frombuffer(data, np.uint8)

            pack.reference_scatter(seg, lambda a, k: dev._mem(a, k).tobytes(), store, order)

        stream._enqueue(run)

    def graph_capacity(self) -> int:
        return self.device.graph_capacity

    def scatter_graphed(self, segment_ptr, nblocks, stream, cell: int = 0) -> bool:
        """A one-node graph's launch: its kernel reads ``graph_capacity`` bytes at the
        segment when it runs, and the rest of a segment of up to ``pack.graph_max``
        bytes (``pack.graph_reach``; all of them must lie in one allocation), as a mapped
        scatter reads the segment then; with ``cell``, its last act is to copy the tag's
        first word (read when it runs) to its second, as ``cucopy_scatter_w8k`` does."""
        dev = self.device
        cap = dev.graph_capacity
        if not cap:
            raise CopyError("sim: no graphed launches (SimDevice.graph_capacity is 0)")
        dev._mem(segment_ptr, cap)  # the kernel's first read: all cap bytes
        header = dev._mem(segment_ptr, pack.HEADER_BYTES).view(pack.HEADER_DTYPE)[0]
        reach = pack.graph_reach(cap, int(header["total_bytes"]))
        if int(header["magic"]) == pack.MAGIC and reach > cap:
            dev._mem(segment_ptr, reach)  # and its second
        if cell:
            dev._mem(cell, pack.TAG_BYTES)  # mapped memory, checked at the call
        self.scatter(segment_ptr, nblocks, stream, True)
        if not cell:
            return False

        def tag():
            # the kernel's last act (a stream that runs part of its queue may have run
            # the scatter and not yet this: a kernel still finishing)
            words = dev._mem(cell, pack.TAG_BYTES).view(np.uint64)
            words[1] = words[0]

        stream._enqueue(tag)
        return True

    def tag_wait(self, cell, want: int, stream, timeout: float) -> bool:
        """Run ``stream``'s queued work until the tag says ``want`` (what a GPU does on its
        own), for at most ``timeout`` seconds; as :meth:`SimEvent.wait` behind a hold."""
        if int(cell[1]) >= want:
            return True
        return poll(lambda _: stream._advance_until(lambda: int(cell[1]) >= want), None, timeout)

    # -- graph feeds -----------------------------------------------------------------

    def feed_capture(self, box_ptr, entries, blocks, status_ptr, stream) -> int:
        dev = self.device
        if stream._graph is None:
            raise CopyError("sim: the feed node must be captured (the stream is not capturing)")
        if not 0 < blocks <= 65535:
            raise ValueError(f"feed_capture: blocks must be in [1, 65535], got {blocks}")
        # mapped memory (the entries and their lanes), checked now
        dev._mem(box_ptr, entries * (pack.FEED_ENTRY_BYTES + blocks * pack.FEED_LANE_BYTES))
        state, _ = dev._alloc(16)  # the replay counter, zero (as the kernel module's array)
        index = dev._feeds
        dev._feeds += 1

        def run(params):
            box, k, counter, status = params
            r = int.from_bytes(dev._mem(counter, 8).tobytes(), "little") + 1
            entry = box + (r % k) * pack.FEED_ENTRY_BYTES
            head = dev._mem(entry, pack.FEED_HEAD_BYTES).view(pack.FEED_ENTRY_DTYPE)[0]
            have = int(head["nbytes"])
            if int(head["tag"]) == r and pack.HEADER_BYTES <= have <= pack.FEED_CAPACITY:
                # read when the node runs, as the kernel reads mapped memory
                carried = dev._mem(entry + pack.FEED_HEAD_BYTES, have).tobytes()
                header, _ = pack.decode(carried[: pack.HEADER_BYTES])
                # the kernel's block b reads its own lane (pack.py, Graph feeds): a lane
                # not posted for this replay would leave block b's work undone
                first = dev._mem(entry, pack.FEED_LANE_BYTES).tobytes()
                lanes = box + k * pack.FEED_ENTRY_BYTES
                for b in range(min(int(header["nblocks"]), blocks)):
                    at = lanes + ((r % k) * blocks + b) * pack.FEED_LANE_BYTES
                    if dev._mem(at, pack.FEED_LANE_BYTES).tobytes() != first:
                        raise SimMemoryError(
                            f"sim: feed {index}: lane {b} of replay {r} does not hold the "
                            "entry's head: the kernel's block would land nothing"
                        )
                total = int(header["total_bytes"])
                seg = carried[:total]
                if total > len(seg):
                    seg += dev._mem(int(head["seg"]) + len(seg), total - len(seg)).tobytes()
                order = dev.rng.permutation(int(header["ndesc"]))

                def store(addr, data):
                    dev._mem(addr, len(data))[:] = np.frombuffer(data, np.uint8)

                pack.reference_scatter(seg, lambda a, n: dev._mem(a, n).tobytes(), store, order)
            dev._mem(counter, 8)[:] = np.frombuffer(r.to_bytes(8, "little"), np.uint8)
            if status:
                dev._mem(status, 8)[:] = np.frombuffer(r.to_bytes(8, "little"), np.uint8)

        stream.launch_node(run, (box_ptr, entries, state, status_ptr))
        return index

    def graph_launch(self, graph, stream) -> None:
        if isinstance(graph, SimGraph):
            graph.replay(stream)
        elif callable(graph):
            graph()
        else:
            raise TypeError(
                f"graph: the sim backend replays a SimGraph (or calls a callable), "
                f"got {type(graph).__qualname__}"
            )

    # -- events ----------------------------------------------------------------------

    def event_create(self):
        return SimEvent(self.device)

    def event_record(self, event, stream) -> None:
        stream._record(event)

    def event_query(self, event) -> bool:
        return event.query()

    def event_synchronize(self, event) -> None:
        event.synchronize()

    def event_destroy(self, event) -> None:
        pass

    def event_wait(self, event, timeout: float) -> bool:
        return event.wait(timeout)

    def mapped_coherent(self) -> bool:
        """The coherence probe's answer, kept on the device (see the base class)."""
        dev = self.device
        got = dev._coherence
        if got is None:
            got = dev._coherence = self.coherence_probe()
        return got

    def coherence_probe(self) -> bool:
        """The base class's probe, on a stream of its own, leaving no trace: its buffers
        are freed directly once its stream has run (no wait for the whole device,
        which may be held) and its stream is forgotten."""
        from .base import _PROBE_BYTES, _probe

        dev = self.device
        stream = SimStream(dev, "cucopy-probe")
        with dev._lock:
            dev._streams.append(stream)
        buf = np.zeros(4096 + 64, np.uint8)
        off = (-buf.ctypes.data) % 64
        mem = buf[off : off + 4096]
        dev._register_pinned(mem)
        base, _ = dev._alloc(_PROBE_BYTES)
        ptr = mem.ctypes.data
        pin = PinnedBuffer(mem, ptr, dev.mapped_pointer(ptr), None)
        rng, reads = dev.rng.bit_generator.state, dev.device_reads
        try:
            return _probe(self, pin, DeviceBuffer(base, _PROBE_BYTES, None), stream)
        finally:
            # the seeded shuffles and policies, and check mode's read count, as they were
            dev.rng.bit_generator.state, dev.device_reads = rng, reads
            stream._queue.clear()  # (run already, unless a probe op raised)
            with dev._lock:
                dev._streams.remove(stream)
            dev._free(base)
            dev._unregister_pinned(mem)

    def watch(self, rows, label: str, stream):
        """Check mode: from this point of ``stream`` on, other work touching ``rows``
        raises (see :meth:`cucopy.backends.base.Backend.watch`)."""
        dev = self.device
        token = next(dev._watch_ids)
        armed = [False]
        # from the call on for work another stream issues after it (in host order);
        # on the copier's own stream, from the call's position in it on
        dev._watches[token] = (list(rows), label, self, stream, dev._epoch, armed)

        def arm():
            armed[0] = True

        stream._enqueue(arm)
        return token

    def unwatch(self, tokens, stream) -> None:
        """Check mode: stop watching ``tokens`` at this point of ``stream``."""
        dev = self.device
        tokens = [t for t in tokens if t is not None]
        if not tokens:
            return

        def disarm():
            for t in tokens:
                dev._watches.pop(t, None)

        stream._enqueue(disarm)

    def mapped_threshold(self) -> int:
        return 4096

    def carry_capacities(self) -> tuple:
        return tuple(self.device.carry_capacities)

    def describe(self) -> str:
        return f"sim:{self.device.index}"

    def hold(self, stream):
        """Stall ``stream`` until the returned context exits."""
        return stream.hold()
