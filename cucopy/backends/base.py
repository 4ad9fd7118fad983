"""The backend protocol: what the copier needs from a device.

A backend is bound to one device. The copier calls only these methods and
never asks which backend it has; ``cuda.py`` implements them with CuPy and
cuda-python, ``sim.py`` with NumPy on a simulated asynchronous device.

Addresses are plain ints: device addresses in the device's own address space,
host addresses as the process sees them. Streams are whatever
:meth:`Backend.resolve_stream` returns.
"""

from __future__ import annotations

import numpy as np

from .. import pack
from ..deadline import poll

__all__ = ["Backend", "PinnedBuffer", "DeviceBuffer"]


class PinnedBuffer:
    """Page-locked host memory, also mapped into the device's address space.

    Attributes
    ----------
    array : numpy.ndarray
        ``uint8`` view of the whole buffer.
    ptr : int
        Host address of the first byte.
    device_ptr : int
        Device address of the first byte (mapped memory), for ``mapped`` flushes.
    nbytes : int
    """

    __slots__ = ("array", "ptr", "device_ptr", "nbytes", "_free")

    def __init__(self, array, ptr: int, device_ptr: int, free):
        self.array = array
        self.ptr = ptr
        self.device_ptr = device_ptr
        self.nbytes = array.nbytes
        self._free = free

    def close(self) -> None:
        """Release the memory; safe to call twice, and again after a free that raised."""
        free = self._free
        if free is not None:
            free()
            self._free = None
            self.array = None


class DeviceBuffer:
    """Device memory owned by the copier (staging buffers, check snapshots).

    Attributes
    ----------
    ptr : int
        Device address of the first byte.
    nbytes : int
    """

    __slots__ = ("ptr", "nbytes", "_free")

    def __init__(self, ptr: int, nbytes: int, free):
        self.ptr = ptr
        self.nbytes = nbytes
        self._free = free

    def close(self) -> None:
        """Release the memory; safe to call twice, and again after a free that raised."""
        free = self._free
        if free is not None:
            free()
            self._free = None


#: coherence probes' answers by device (Backend.mapped_coherent), and their buffers
_coherent: dict = {}
_kept: list = []
_PROBE_BYTES = 64
_encode = pack.encode  # bound here: the probe is not a segment the copier encodes


def _probe(backend, pin, out, stream) -> bool:
    """One coherence probe: a one-copy segment in ``pin``, read mapped by the scatter
    kernel into ``out``, read back; True when the bytes arrived intact."""
    pattern = (np.arange(_PROBE_BYTES, dtype=np.uint8) * 37 + 91).astype(np.uint8)
    arr = pin.array
    arr[:] = 0
    data = pack.align(pack.HEADER_BYTES + pack.DESC_BYTES, 16)
    total = data + _PROBE_BYTES
    desc = (out.ptr, data, 0, _PROBE_BYTES, _PROBE_BYTES, _PROBE_BYTES, 1, pack.KIND_H2D, 0, 0)
    nblocks = _encode(arr, [desc], data, total)
    arr[data:total] = pattern
    try:
        backend.fill(out.ptr, _PROBE_BYTES, _PROBE_BYTES, 1, 0, 1, stream)
        backend.scatter(pin.device_ptr, nblocks, stream, True)
        got = np.frombuffer(backend.read(out.ptr, _PROBE_BYTES, stream), np.uint8)
    except Exception:  # the kernel refused what it read (a bad header): not coherent
        return False
    return bool(np.array_equal(got, pattern))


class Backend:
    """One device as the copier sees it.

    Every method marked "implemented by the backend" must be supplied.
    """

    name = "base"

    #: The device identity arrays are compared with (``ArrayInfo.device``).
    device = None

    # -- streams and capture -------------------------------------------------

    def resolve_stream(self, stream):
        """Return the backend's stream for a user-supplied stream (None: default)."""
        # implemented by the backend
        raise NotImplementedError

    def current_stream(self):
        """The stream a plain copy goes on when the caller named none."""
        # implemented by the backend
        raise NotImplementedError

    def is_capturing(self, stream) -> bool:
        """Whether ``stream`` is capturing a graph right now."""
        # implemented by the backend
        raise NotImplementedError

    def synchronize(self, stream) -> None:
        """Block the host until ``stream`` has run everything queued on it."""
        # implemented by the backend
        raise NotImplementedError

    # -- memory ----------------------------------------------------------------

    def alloc_pinned(self, nbytes: int) -> PinnedBuffer:
        """Allocate mapped, page-locked host memory."""
        # implemented by the backend
        raise NotImplementedError

    def alloc_device(self, nbytes: int) -> DeviceBuffer:
        """Allocate device memory."""
        # implemented by the backend
        raise NotImplementedError

    def is_pinned(self, host_ptr: int) -> bool:
        """Whether the host address lies in page-locked memory."""
        # implemented by the backend
        raise NotImplementedError

    def read(self, ptr: int, nbytes: int, stream) -> bytes:
        """Synchronize ``stream`` and return ``nbytes`` device bytes (check mode)."""
        # implemented by the backend
        raise NotImplementedError

    # -- work ------------------------------------------------------------------

    def copy2d(
        self, h2d: bool, dst: int, dpitch: int, src: int, spitch: int, width: int, rows: int, stream
    ) -> None:
        """Enqueue a (possibly 2-D) copy of ``rows`` rows of ``width`` bytes.

        ``h2d`` selects a host source (``src`` a host address, pinned memory
        read when the copy runs); otherwise both addresses are on the device.
        """
        # implemented by the backend
        raise NotImplementedError

    def fill(
        self, dst: int, dpitch: int, width: int, rows: int, value: int, elem: int, stream
    ) -> None:
        """Enqueue writing the ``elem``-byte pattern ``value`` over a 2-D region."""
        # implemented by the backend
        raise NotImplementedError

    def scatter(
        self,
        segment_ptr: int,
        nblocks: int,
        stream,
        mapped: bool,
        carry: int = 0,
        host_ptr: int = 0,
    ) -> None:
        """Enqueue one scatter launch decoding the segment at ``segment_ptr``.

        ``mapped`` says ``segment_ptr`` is the device address of mapped pinned
        memory (read by the kernel when it runs) rather than device memory.
        ``carry`` > 0 puts the segment's first ``carry`` bytes, read from host
        memory at ``host_ptr`` during this call, into the launch's parameters:
        at least the header and the whole descriptor table, at most the largest
        of :meth:`carry_capacities`. The kernel reads those bytes from the
        parameters and only the rest from ``segment_ptr``; when ``carry`` covers
        the whole segment it reads nothing from it.
        """
        # implemented by the backend
        raise NotImplementedError

    # -- graph feeds -----------------------------------------------------------

    def alloc_feed(self, nbytes: int) -> PinnedBuffer:
        """Mapped, page-locked memory for a graph feed's mailbox.

        Called while the copier's stream captures a graph: a backend whose
        allocation is illegal during capture makes it legal here.
        """
        return self.alloc_pinned(nbytes)

    def feed_capture(self, box_ptr: int, entries: int, blocks: int, status_ptr: int, stream) -> int:
        """Enqueue the graph-fed scatter into the graph ``stream`` is capturing.

        The node (``cucopy_scatter_feed``, ``blocks`` thread blocks, parameters
        fixed at capture) counts its replays on the device; replay ``r`` reads
        mailbox entry ``r % entries`` at device address ``box_ptr`` (mapped pinned
        memory, laid out as ``pack.FEED_ENTRY_DTYPE`` heads each followed by
        carried segment bytes), applies the segment only when the entry's tag is
        ``r``, then stores ``r`` at ``status_ptr`` (a mapped device address, or 0).

        Returns
        -------
        int
            The feed's index (its replay counter on the device).
        """
        # implemented by the backend
        raise NotImplementedError

    def graph_launch(self, graph, stream) -> None:
        """Enqueue one replay of ``graph`` on ``stream``.

        ``graph`` is whatever the backend's graphs are (a sim graph; a CuPy graph,
        a torch ``CUDAGraph`` replayed on torch's current stream, which must be
        ``stream``, or a raw ``cudaGraphExec_t``), or a callable that launches it.
        """
        # implemented by the backend
        raise NotImplementedError

    # -- events ----------------------------------------------------------------

    def event_create(self):
        """Create an event (timing disabled)."""
        # implemented by the backend
        raise NotImplementedError

    def event_record(self, event, stream) -> None:
        """Record ``event`` on ``stream``."""
        # implemented by the backend
        raise NotImplementedError

    def event_query(self, event) -> bool:
        """True when all work before the event's record has run. Never runs work."""
        # implemented by the backend
        raise NotImplementedError

    def event_synchronize(self, event) -> None:
        """Block the host until the event has completed."""
        # implemented by the backend
        raise NotImplementedError

    def event_destroy(self, event) -> None:
        """Release an event."""
        # implemented by the backend
        raise NotImplementedError

    def event_wait(self, event, timeout: float) -> bool:
        """Block the host until ``event`` completes or ``timeout`` seconds pass.

        Every wait the copier makes goes through here with its deadline
        (:mod:`cucopy.deadline`). This one polls :meth:`event_query`, sleeping between
        queries (20 µs doubling to 1 ms), never spinning.

        Parameters
        ----------
        event : object
            An event from :meth:`event_create`.
        timeout : float
            Seconds (``math.inf``: no bound).

        Returns
        -------
        bool
            True when the event completed, False when the deadline passed first.
        """
        return poll(self.event_query, event, timeout)

    def stream_wait(self, stream, timeout: float) -> bool:
        """Block until the work queued on ``stream`` has run, or ``timeout`` seconds pass.

        A bounded :meth:`synchronize`: records a new event and waits for it
        (:meth:`event_wait`).

        Returns
        -------
        bool
            True when the stream drained, False when the deadline passed first.
        """
        event = self.event_create()
        try:
            self.event_record(event, stream)
            return self.event_wait(event, timeout)
        finally:
            self.event_destroy(event)

    # -- check mode --------------------------------------------------------------

    def watch(self, rows, label: str, stream):
        """Check mode: from this point of ``stream`` on, raise when other work touches ``rows``.

        ``rows`` are ``(device address, bytes)`` runs of a merged destination whose
        copy is staged; ``label`` starts the error (the site and the destination).
        Work issued through this backend instance (its copier's own) is exempt. A
        backend that cannot see other work returns None (the sentinel the copier
        writes into the destination is then what a premature reader sees).

        Returns
        -------
        object
            A token for :meth:`unwatch`, or None.
        """
        return None

    def unwatch(self, tokens, stream) -> None:
        """Check mode: stop the watches ``tokens`` at this point of ``stream`` (after the
        launch that lands their copies, or when they are dropped)."""

    # -- mapped memory -----------------------------------------------------------

    def mapped_coherent(self) -> bool:
        """Whether the device reads mapped pinned memory as the host wrote it.

        Under GPU confidential computing a pinned mapping may read stale or zero
        bytes; ``mapped`` and graphed flushes (and graph feeds) read the segment
        through one. The first call for a device runs :meth:`coherence_probe`; its
        answer is kept for the device.
        """
        key = self.describe()
        got = _coherent.get(key)
        if got is None:
            got = _coherent[key] = self.coherence_probe()
        return got

    def coherence_probe(self) -> bool:
        """Write a pattern into pinned memory and have the scatter kernel read it through
        the mapping into device memory; True when the device bytes match.

        Runs on :meth:`probe_stream` (None: nothing to probe with, assumed coherent)
        and keeps its two small buffers for the process: a free waits for the whole
        device, which must not happen while another stream is held.
        """
        stream = self.probe_stream()
        if stream is None:
            return True
        pin = self.alloc_pinned(4096)
        out = self.alloc_device(_PROBE_BYTES)
        _kept.append((pin, out))
        return _probe(self, pin, out, stream)

    def probe_stream(self):
        """A stream of the backend's own for :meth:`coherence_probe`, or None."""
        return None

    # -- tuning ----------------------------------------------------------------

    def mapped_threshold(self) -> int:
        """Segments of at most this many bytes use ``mapped`` under ``flush_mode="auto"``."""
        return 0

    def carry_capacities(self) -> tuple:
        """Ascending byte counts a scatter launch can carry in its parameters (none: ``()``)."""
        return ()

    def graph_capacity(self) -> int:
        """Bytes a graphed scatter (:meth:`scatter_graphed`) reads at its segment; 0: none.

        A graphed scatter is a mapped launch through a one-node graph, which costs the
        host less than a kernel launch. The graphs are made when the backend sets up (a
        small pool, each re-pointed at a segment address as needed; none is made later,
        as making one may wait for the device). The copier uses it for
        ``flush_mode="mapped"`` segments of at most ``pack.graph_max`` of this many
        bytes and ``"auto"`` ones of at most twice it (the kernel reads this many in
        one round, the rest of a longer segment in a second), and keeps the bytes read
        (``pack.graph_reach``) readable and unwritten until the launch completes.
        """
        return 0

    def scatter_graphed(self, segment_ptr: int, nblocks: int, stream, cell: int = 0) -> bool:
        """Enqueue the scatter of the segment at ``segment_ptr`` (mapped pinned memory) as
        a graphed launch, which reads :meth:`graph_capacity` bytes there when it runs
        (``pack.graph_reach``: all of a segment of up to ``pack.graph_max`` bytes).

        ``nblocks`` is the segment's, for a backend that launches it another way (no
        graph may launch on ``stream``: the backend's graphs are all other streams').

        ``cell``: the device address of a completion tag (``pack.TAG_BYTES`` of mapped
        pinned memory, a ring slot's, ``pack.TAG_AT``), or 0 for none. With one, the
        kernel's last act, once its reads of the segment are done, is to copy the tag's
        first u64 (what the host armed it with) to its second: what the host reads
        instead of an event (see :meth:`tag_wait`).

        Returns
        -------
        bool
            True when the launch will write the tag: ``cell`` was given and the segment
            was launched as a tagged graph. False when no tag will be written (no
            ``cell``, or the backend launched the segment another way): an event must
            follow the launch.
        """
        raise NotImplementedError

    def tag_wait(self, cell, want: int, stream, timeout: float) -> bool:
        """Block until the completion tag ``cell`` says ``want`` (or later), or ``timeout``
        seconds pass.

        Polls the tag's second word (host memory: no driver call) and sleeps between
        reads as :meth:`event_wait` does (:func:`cucopy.deadline.poll`).

        Parameters
        ----------
        cell : numpy.ndarray
            The tag as two ``uint64`` words of pinned host memory (``Slot.cell``).
        want : int
            The step the host armed the tag with before the launch it waits for.
        stream : object
            The stream the launch was enqueued on (the simulated device runs it).
        timeout : float
            Seconds (``math.inf``: no bound).

        Returns
        -------
        bool
            True when the tag arrived, False when the deadline passed first.
        """
        return poll(lambda c: int(c[1]) >= want, cell, timeout)

    def carried_launcher(self):
        """The carried scatter launch as a compiled function, or None.

        A capsule the compiled staging core calls at flush (``Segment.flush_carried``)
        to launch a segment carried whole, in the same call that cuts it: the launch
        :meth:`scatter` makes for ``carry`` equal to the segment's size, with no trip
        through Python. None when the backend has no such function (then the copier
        calls :meth:`scatter`).
        """
        return None

    def capture_query(self, stream) -> tuple:
        """The cheapest form of :meth:`is_capturing` for ``stream``, for a step's begin.

        Returns
        -------
        fn, arg : callable, object
            ``fn(arg)`` is false or 0 when ``stream`` is not capturing, and anything
            else (true, a nonzero int) when it is or when it cannot tell; the caller
            then asks :meth:`is_capturing`, which reports errors. This one is
            ``(self.is_capturing, stream)``.
        """
        return self.is_capturing, stream

    def describe(self) -> str:
        """A short name for messages, e.g. ``cuda:0`` or ``sim:0``."""
        return self.name
