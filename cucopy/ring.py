"""StagingRing: pinned host slots with matching device staging buffers.

A step writes its segments upward from the bottom of one slot and the
snapshots of its eager copies downward from the top. The ring advances once
per step; the host waits only when the slot it is about to reuse is still in
flight (its event, recorded after the last work that reads it, has not
completed). Barriers append segments to the same slot, so they never wait.

A step whose last reader of its slot is a graphed scatter launch needs no event:
that kernel's last act is to write the step's number into the slot's completion
tag (``pack.TAG_AT``, in the slot's headroom: mapped pinned memory), and the ring
reads the tag, a plain load of host memory, where it would ask the driver about
an event (``cuEventRecord`` at the flush and ``cuEventQuery`` at the next turn: a
driver call each, several microseconds each on a host whose caches are cold).
A slot is free once its event (if recorded) has completed and its tag (if armed)
has arrived.

No memory is freed before :meth:`StagingRing.close`: ``cudaFreeHost`` and
``cudaFree`` wait for the whole device, so a free between steps would be the
coarse synchronization cucopy exists to avoid (behind a kernel that waits on the
host, a hang). A slot replaced by a larger or smaller one, and each temporary a
step used, is kept idle and reused by a later step that needs that much.
"""

from __future__ import annotations

import collections
import threading
import time

import numpy as np

from . import pack
from .backends.base import PinnedBuffer
from .deadline import DEFAULT_WAIT_TIMEOUT
from .errors import CopyError
from .segment import RingCore as _CompiledRingCore
from .segment import SlotCore as _CompiledSlotCore
from .segment import WindowMax as _CompiledWindowMax

__all__ = ["StagingRing", "Slot", "WindowMax", "PyWindowMax", "PySlotCore", "PyRingCore"]

# Demand is remembered over this many steps before a slot shrinks back.
DEMAND_WINDOW = 64


# Rings of copiers collected without close(): freed at the next copier made or
# closed, never by the garbage collector (a free, and close()'s wait for in-flight
# slots, wait for the device, at whatever moment a collection happens to run).
_orphans: list = []
# reentrant: orphan() runs from a finalizer, which a collection may start while this
# thread is inside free_orphans()
_orphans_lock = threading.RLock()
# A ring whose free keeps failing (its device gone) is dropped after this many tries.
_ORPHAN_TRIES = 8


def orphan(ring: StagingRing) -> None:
    """Set aside the ring of a copier the garbage collector took (see :func:`free_orphans`)."""
    with _orphans_lock:
        _orphans.append([ring, 0])


def free_orphans(wait: bool = False) -> int:
    """Free the rings :func:`orphan` set aside (a copier is made, closed or trimmed).

    A ring whose slots are still in flight (their work queued behind a held stream,
    say) is kept for a later call unless ``wait``: a copier made inside a hold must
    not wait on held work. A free that fails (on the simulated device, a free while
    another stream is held; cucopy's buffers free retry-safely) is kept and tried
    again later, up to a few times.

    Parameters
    ----------
    wait : bool
        Wait for in-flight slots (``close()`` and ``trim()``, which wait for the
        device anyway).

    Returns
    -------
    int
        Rings still set aside.
    """
    with _orphans_lock:
        entries = _orphans[:]
        del _orphans[:]
    keep = []
    for entry in entries:
        ring = entry[0]
        try:
            if not wait and ring.in_flight():
                keep.append(entry)
                continue
            ring.close()
        except Exception:
            entry[1] += 1
            if entry[1] < _ORPHAN_TRIES:
                keep.append(entry)
    with _orphans_lock:
        _orphans.extend(keep)
        return len(_orphans)


class PyWindowMax:
    """The largest of the last ``window`` values appended, in O(1) a step.

    A step's ``max()`` over the whole window cost about a microsecond on the GPU's
    host; this keeps the candidates (decreasing) with the step each came from.
    The pure-Python reference; :data:`WindowMax` is its compiled twin
    (``cucopy._segment.WindowMax``, 64-bit integer values) when the staging core is
    built and ``CUCOPY_PURE_PYTHON`` is not set.

    Parameters
    ----------
    window : int
        Values the maximum is over (the newest ``window`` appended).
    """

    __slots__ = ("window", "_q", "_n")

    def __init__(self, window: int):
        self.window = window
        self._q: collections.deque = collections.deque()
        self._n = 0

    def append(self, value: int) -> None:
        """Add the newest value (the oldest leaves the window).

        Parameters
        ----------
        value : int
        """
        q = self._q
        n = self._n
        self._n = n + 1
        if q:
            if q[-1][1] <= value:  # the usual step: the same value again
                q.pop()
                while q and q[-1][1] <= value:
                    q.pop()
            if q and q[0][0] <= n - self.window:
                q.popleft()
        q.append((n, value))

    def append_max(self, value: int) -> int:
        """:meth:`append` ``value``, then return :meth:`max` (one call a step).

        Parameters
        ----------
        value : int

        Returns
        -------
        int
            The largest value in the window, ``value`` included.
        """
        self.append(value)
        return self._q[0][1]

    def max(self, default: int = 0) -> int:
        """The largest value in the window, or ``default`` before the first.

        Parameters
        ----------
        default : int

        Returns
        -------
        int
        """
        return self._q[0][1] if self._q else default


#: :class:`PyWindowMax`, or its compiled twin when the staging core is built
WindowMax = PyWindowMax if _CompiledWindowMax is None else _CompiledWindowMax


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class PySlotCore:
    """A slot's per-step fields (the pure-Python reference; :class:`Slot` subclasses it).

    ``cucopy._segment.SlotCore`` is its compiled twin: the same fields as C members,
    which the compiled ``RingCore.advance_fast`` reads and writes directly.
    """

    __slots__ = (
        "size",
        "bottom",
        "top",
        "recorded",
        "dirty",
        "temps",
        "frees",
        "base",
        "stamp",
        "tag",
        "tag_host",
        "array",
        "headroom",
    )


class PyRingCore:
    """The ring's per-step state (the pure-Python reference; :class:`StagingRing`
    subclasses it).

    ``cucopy._segment.RingCore`` is its compiled twin: ``current``, ``_slots``,
    ``_events``, ``_demand``, ``_index``, ``_want``, ``acquires``, ``_target_size``,
    ``_peak``, ``capacity``, ``_launcher``, ``_certified``, ``_newest``, ``_newest_stamp`` and
    ``_probe`` as C members, and an ``advance_fast`` that runs the common step
    (``DeviceCopier._advance`` with :meth:`StagingRing.acquire`) in one call.
    """

    __slots__ = ()

    @property
    def fast_advances(self) -> int:
        """Steps the compiled ``advance_fast`` took (always 0 here: there is none)."""
        return 0

    # No advance_fast: without the compiled core, DeviceCopier._advance runs its Python
    # path, whole (its compiled twin: cucopy/_core/ring.c).


#: the per-step state's classes: compiled when the staging core is built
SlotCore = PySlotCore if _CompiledSlotCore is None else _CompiledSlotCore
RingCore = PyRingCore if _CompiledRingCore is None else _CompiledRingCore


#: bytes allocated before each slot's first byte (see :class:`Slot`); a multiple of 256,
#: so segments keep their alignment
SLOT_HEADROOM = 256


class Slot(SlotCore):  # type: ignore[misc,valid-type]
    """One pinned host buffer, its device staging twin, its event and its completion tag.

    Attributes
    ----------
    pinned : PinnedBuffer
        The slot's bytes (``SLOT_HEADROOM`` more are allocated before them).
    staging : DeviceBuffer
    event : object
        Backend event recorded after the last work reading this slot.
    size : int
        Bytes of each buffer.
    bottom : int
        Next free byte for segments (grows upward).
    top : int
        Lowest byte used by eager snapshots (grows downward).
    headroom : int
        Bytes allocated before ``pinned``'s first byte that no segment uses.
    temps : list
        Buffers (overflow snapshots, temporaries) the slot's step used; the ring
        takes them back, idle, when the slot is reused.
    frees : list
        Check mode's unread snapshot buffers that did not come from the ring (none
        while a slot is current), freed when the slot is reused.
    cell : numpy.ndarray
        The completion tag (``pack.TAG_BYTES`` of the headroom at ``pack.TAG_AT``) as
        two ``uint64``: the step the host armed it with, and the step a graphed
        scatter's kernel wrote back once its reads of the slot were done.
    tag : int
        The step whose tagged launch is the slot's last reader without an event after
        it (-1: none since the slot was acquired): the slot is in flight until
        ``cell[1]`` says it.
    tag_host : int
        ``cell``'s host address (0 once closed), for the compiled ring step.
    """

    __slots__ = ("pinned", "staging", "event", "mv", "cell")  # and SlotCore's

    def __init__(self, backend, size: int):
        # SLOT_HEADROOM bytes before the slot's first byte, allocated with it and never
        # used by a segment: a carried launch of a segment at offset 0 writes its
        # parameter prefix there and hands the driver the slot's own bytes, instead of
        # copying the segment into a parameter buffer first (the staging core)
        whole = backend.alloc_pinned(size + SLOT_HEADROOM)
        h = SLOT_HEADROOM
        self.pinned = PinnedBuffer(
            whole.array[h : h + size], whole.ptr + h, whole.device_ptr + h, whole.close
        )
        self.headroom = h
        # the completion tag, in the headroom too (before the carried prefix's bytes)
        at = h + pack.TAG_AT
        self.cell = whole.array[at : at + pack.TAG_BYTES].view(np.uint64)
        self.cell[:] = 0
        self.tag_host = whole.ptr + at
        self.tag = -1
        try:
            self.staging = backend.alloc_device(size)
        except BaseException:
            self.pinned.close()
            raise
        self.array = self.pinned.array
        self.base = self.pinned.device_ptr  # where a launch reads the slot
        self.mv = memoryview(self.array)
        self.event = None
        self.stamp = -1  # the ring's acquires when its event was last recorded
        self.size = size
        self.bottom = 0
        self.top = size
        self.temps = []
        self.frees = []
        self.recorded = False
        self.dirty = False

    def release_temps(self) -> None:
        """Free the temporaries (teardown only: a free waits for the whole device).

        Each leaves the slot once freed, so a failed call can be retried.
        """
        for bufs in (self.frees, self.temps):
            while bufs:
                bufs[-1].close()
                bufs.pop()

    def close(self) -> None:
        """Free the slot's memory (retry-safe: a failed call can be repeated)."""
        self.release_temps()
        if self.mv is not None:
            self.mv.release()
            self.array = self.mv = None
        self.tag_host = 0  # the compiled step never reads a freed tag
        self.cell = None
        self.pinned.close()
        self.staging.close()


class StagingRing(RingCore):  # type: ignore[misc,valid-type]
    """``slots`` pinned buffers of ``capacity`` bytes each, reused in turn.

    Parameters
    ----------
    backend : Backend
    slots : int
        Number of slots (steps that may be in flight at once).
    capacity : int
        Bytes of one slot: headers, descriptors, merged data and eager snapshots.
    """

    def __init__(self, backend, slots: int, capacity: int):
        self.backend = backend
        self.capacity = capacity
        self._slots: list[Slot | None] = [None] * slots
        self._events = [backend.event_create() for _ in range(slots)]
        self._index = -1
        #: slots acquired so far: acquire ``n`` waited for the work of acquire ``n - slots``
        self.acquires = 0
        self._demand = WindowMax(DEMAND_WINDOW)
        self._peak = -1  # the demand _target_size was computed for
        self._target_size = capacity
        self._want = 0
        self.current: Slot | None = None
        # What is known of the events, for :meth:`_idle`: every event recorded at or
        # before acquire ``_certified`` has completed; the slot recorded last is at
        # ``_newest``, recorded at acquire ``_newest_stamp``; ``_probe`` > 0: steps left
        # that ask a slot's own event first
        self._certified = -1
        self._newest = -1
        self._newest_stamp = -1
        self._probe = 0
        #: the compiled launcher whose event query the compiled step uses (a capsule
        #: from the backend's ``carried_launcher()``, set by the copier; None: the
        #: backend's ``event_query``)
        self._launcher = None
        # idle memory kept for reuse until close(): replaced slots by size, and the
        # temporaries of steps whose slots came round again (pinned, device)
        self._spare_slots: list[Slot] = []
        # spare temporaries by size (every one is a power of two, see _size)
        self._spare_pinned: dict[int, list] = {}
        self._spare_device: dict[int, list] = {}
        #: seconds a wait for a slot may last (the copier's ``wait_timeout``)
        self.timeout = DEFAULT_WAIT_TIMEOUT
        #: the stream the events are recorded on, for the wait's error
        self.stream = None
        #: the same stream as the backend takes it (what a tag wait hands the backend)
        self.work_stream = None
        #: a destination address -> the site that last staged into it (the wait's error;
        #: the copier's dict: the ring must not hold the copier)
        self.sites_at: dict = {}

    @property
    def slots(self) -> int:
        """Number of slots."""
        return len(self._slots)

    @property
    def index(self) -> int:
        """Index of the current slot (-1 before the first :meth:`acquire`)."""
        return self._index

    def event_at(self, index: int):
        """The event of slot ``index``: recorded after the last work of that slot's step."""
        return self._events[index]

    def note_overflow(self, nbytes: int) -> None:
        """Record ``nbytes`` a step wanted but its slot could not hold (grows the next one)."""
        self._want += nbytes

    def _target(self, peak: int) -> int:
        """The slot size for a window whose largest demand is ``peak``, kept for the next
        step (:meth:`acquire` calls this only when ``peak`` changed: it rarely does)."""
        self._peak = peak
        self._target_size = max(self.capacity, _pow2(pack.align(peak, 4096)))
        return self._target_size

    def acquire(self) -> tuple[Slot, bool]:
        """Advance to the next slot, waiting if it is still in flight.

        Returns
        -------
        slot : Slot
        waited : bool
            True when the host had to wait for the slot's event.
        """
        # Once a step on the GPU's host, where every ~0.1 us counts: the common case
        # (the slot exists, idle or complete, no temporaries, the right size) reads
        # each attribute once and calls nothing it need not.
        prev = self.current
        slots = self._slots
        index = self._index + 1
        if index >= len(slots):
            index = 0
        slot = slots[index]
        waited = False
        if slot is not None and (slot.recorded or slot.tag >= 0) and not self._idle(index, slot):
            # before anything changes: a wait past its deadline raises and leaves the
            # ring as it was (the next step waits for the same slot again)
            self.wait_slot(index, "the next ring slot (a step, or an eager copy's snapshot)")
            waited = True
            if slot.stamp > self._certified:  # it and every event before it completed
                self._certified = slot.stamp
        if prev is not None:
            peak = self._demand.append_max(self._want + prev.bottom + prev.size - prev.top)
        else:
            peak = self._demand.max()
        self._want = 0
        self.acquires += 1
        self._index = index
        target = self._target_size if peak == self._peak else self._target(peak)
        if slot is not None:
            if slot.temps or slot.frees:
                # idle now (its event completed above): its step's temporaries are spare
                self._keep_temps(slot)
            size = slot.size
            if target <= size <= 2 * target:
                slot.bottom = 0
                slot.top = size
                slot.recorded = slot.dirty = False
                slot.tag = -1
                self.current = slot
                return slot, waited
            # kept, not freed: a free would wait for the device
            self.current = None
            slots[index] = None
            self._spare_slots.append(slot)
        self.current = None
        event = self._events[index]  # (none after close(): raises before allocating)
        slot = self._take_slot(target)
        slot.event = event
        slots[index] = slot
        slot.bottom = 0
        slot.top = slot.size
        slot.recorded = False
        slot.dirty = False
        slot.tag = -1
        self.current = slot
        return slot, waited

    def _idle(self, index: int, slot: Slot) -> bool:
        """Whether slot ``index``'s tag has arrived (if armed) and its event has completed
        (if recorded): False while either has not.

        The tag, a load of host memory, is read first. Every event the ring records is
        recorded on the copier's one stream, in the order of the steps, so once one is
        seen complete, all recorded before it are.
        A slot recorded at or before what is known complete is idle without asking.
        Otherwise the newest event is asked first: in a loop whose host waits for each
        step, it has completed, and the next ``slots - 1`` steps then ask nothing. When
        it has not (the GPU runs behind the host), each slot's own event is asked first
        for a turn of the ring, then the newest again (the compiled step,
        ``RingCore.advance_fast``, decides the same from the same fields).
        """
        tag = slot.tag
        if tag >= 0 and int(slot.cell[1]) < tag:
            return False
        if not slot.recorded:
            return True
        stamp = slot.stamp
        certified = self._certified
        if 0 <= stamp <= certified:
            return True
        query = self.backend.event_query
        newest = self._newest
        if self._probe <= 0 and 0 <= newest < len(self._events) and newest != index:
            if self._newest_stamp > stamp:
                if query(self._events[newest]):
                    self._certified = self._newest_stamp
                    return True
                self._probe = len(self._events)
        elif self._probe > 0:
            self._probe -= 1
        if not query(self._events[index]):
            return False
        if stamp > self._certified:
            self._certified = stamp
        return True

    def wait_slot(self, index: int, what: str) -> None:
        """Wait for slot ``index``'s tag (if armed) and event (if recorded), at most
        :attr:`timeout` seconds in all.

        Parameters
        ----------
        index : int
        what : str
            What the wait is for, for the error.

        Raises
        ------
        CopyError
            Past the deadline, saying what it waited for: the slot, its event, the
            stream, the copies and sites in flight in it, and how long. Nothing is
            changed: the copier stays usable.
        """
        slot = self._slots[index]
        t0 = time.monotonic()
        tag = slot.tag
        if tag >= 0 and not self.backend.tag_wait(slot.cell, tag, self.work_stream, self.timeout):
            spent = time.monotonic() - t0
            raise CopyError(
                f"{what}: waited {spent:.3g} s (wait_timeout={self.timeout:g} s) for ring "
                f"slot {index}: its completion tag (at {slot.tag_host:#x}, armed with step "
                f"{tag} of {self.acquires}; reads {int(slot.cell[1])}), which the graphed "
                f"scatter launched on stream {self.stream!r} writes when done, has not "
                f"arrived. In flight in that slot: {self.in_slot(index)}. The device never "
                "finished the work queued before that launch, or the launch itself (a hung "
                "or stalled kernel on that stream?); nothing was changed, the copier stays "
                "usable and its next wait starts afresh"
            )
        if not slot.recorded:
            return
        event = self._events[index]
        shown = f"{event:#x}" if isinstance(event, int) else repr(event)
        left = self.timeout - (time.monotonic() - t0)
        if self.backend.event_wait(event, max(left, 0.0)):
            return
        spent = time.monotonic() - t0
        raise CopyError(
            f"{what}: waited {spent:.3g} s (wait_timeout={self.timeout:g} s) for ring slot "
            f"{index}: its event {shown}, recorded on stream {self.stream!r} after "
            f"step {slot.stamp} of {self.acquires}, has not completed. In "
            f"flight in that slot: {self.in_slot(index)}. The device never finished the "
            "work queued before that event (a hung or stalled kernel on that stream?); "
            "nothing was changed, the copier stays usable and its next wait starts afresh"
        )

    def in_slot(self, index: int) -> str:
        """What slot ``index`` holds for the device: segments, copies, sites, eager bytes."""
        slot = self._slots[index]
        if slot is None or slot.array is None:
            return "nothing"
        buf = slot.array
        segs = copies = 0
        nbytes = 0
        sites: dict = {}
        off, end = 0, min(slot.bottom, slot.size)
        while off + pack.HEADER_BYTES <= end:
            try:
                header, descs = pack.decode(buf[off:end])
            except ValueError:
                off += 256  # a gap (a graphed segment's reserve): the next 256-byte start
                continue
            total = int(header["total_bytes"])
            segs += 1
            copies += len(descs)
            nbytes += total
            for dst in descs["dst"].tolist():
                site = self.sites_at.get(int(dst))
                name = getattr(site, "label", None) or f"dst {int(dst):#x}"
                sites[name] = sites.get(name, 0) + 1
            off += max(pack.align(total, 256), 256)
        eager = slot.size - slot.top
        out = f"{segs} segment(s), {copies} copies, {nbytes} bytes"
        if sites:
            out += " (sites: " + ", ".join(f"{k} x{v}" for k, v in sites.items()) + ")"
        if eager:
            out += f", and {eager} bytes of eager copies' snapshots"
        return out

    def record(self, stream) -> None:
        """Record the current slot's event after the work enqueued so far."""
        slot = self.current
        if slot is not None and slot.dirty:
            self.backend.event_record(slot.event, stream)
            slot.recorded = True
            slot.dirty = False
            slot.stamp = self._newest_stamp = self.acquires
            self._newest = self._index

    def _take_slot(self, size: int) -> Slot:
        """A spare slot of ``size`` bytes, else a new one."""
        for i, s in enumerate(self._spare_slots):
            if s.size == size:
                return self._spare_slots.pop(i)
        return Slot(self.backend, size)

    def _keep_temps(self, slot: Slot) -> None:
        frees, slot.frees = slot.frees, []
        for f in frees:  # check mode's, from outside the pool: it synchronizes anyway
            f.close()
        temps, slot.temps = slot.temps, []
        for t in temps:
            spares = self._spare_pinned if hasattr(t, "array") else self._spare_device
            spares.setdefault(t.nbytes, []).append(t)

    @staticmethod
    def _size(nbytes: int) -> int:
        """A temporary's size: a power of two of at least 4 KiB, so steps share them."""
        return _pow2(pack.align(max(nbytes, 1), 4096))

    @staticmethod
    def _spares(spares: dict) -> list:
        return [t for bucket in spares.values() for t in bucket]

    def _temp(self, spares: dict, alloc, nbytes: int):
        size = self._size(nbytes)
        bucket = spares.get(size)
        buf = bucket.pop() if bucket else alloc(size)
        self.current.temps.append(buf)
        return buf

    def temp_pinned(self, nbytes: int):
        """Pinned memory of at least ``nbytes`` for the current slot's step.

        Handed back idle when that slot comes round again, then reused by a later
        request of the same power-of-two size (:meth:`_size`).
        """
        return self._temp(self._spare_pinned, self.backend.alloc_pinned, nbytes)

    def temp_device(self, nbytes: int):
        """Device memory of at least ``nbytes`` for the current slot's step (as
        :meth:`temp_pinned`)."""
        return self._temp(self._spare_device, self.backend.alloc_device, nbytes)

    def trim(self) -> int:
        """Free the spare slots and temporaries (idle by construction); return the bytes
        freed (a slot counts its pinned buffer and its device staging twin).

        Each free waits for the whole device: call it where a wait is harmless. A spare
        leaves the ring once freed, so a failed call can be retried.
        """
        freed = 0
        lists = [self._spare_slots]
        lists += list(self._spare_pinned.values()) + list(self._spare_device.values())
        for spares in lists:
            while spares:
                spare = spares[-1]
                spare.close()
                spares.pop()
                freed += 2 * spare.size if isinstance(spare, Slot) else spare.nbytes
        self._spare_pinned, self._spare_device = {}, {}
        return freed

    def pinned_bytes(self) -> int:
        """Pinned bytes held by the slots in use (spares and temporaries excluded)."""
        return sum(s.size for s in self._slots if s is not None)

    def spare_bytes(self) -> int:
        """Pinned bytes kept idle for reuse: replaced slots and spare temporaries."""
        kept = self._spare_slots + self._spares(self._spare_pinned)
        return sum(s.size if isinstance(s, Slot) else s.nbytes for s in kept)

    def in_flight(self) -> bool:
        """Whether a slot's work may still be running (an event not yet complete, a tag
        not yet arrived).

        Never waits and never runs work.
        """
        return any(
            slot is not None
            and (
                (slot.tag >= 0 and int(slot.cell[1]) < slot.tag)
                or (slot.recorded and not self.backend.event_query(slot.event))
            )
            for slot in self._slots
        )

    def close(self) -> None:
        """Wait for in-flight slots and free all memory.

        Retry-safe: after a failure (a wait or a free that raised) the memory not yet
        freed stays with the ring and a second call frees it.
        """
        for i, slot in enumerate(self._slots):
            if slot is not None and (slot.recorded or slot.tag >= 0):
                self.wait_slot(i, "close(): a ring slot in flight")
                slot.recorded = False
                slot.tag = -1
        self.current = None
        for i, slot in enumerate(self._slots):
            if slot is not None:
                slot.close()
                self._slots[i] = None
        self.trim()
        while self._events:
            self.backend.event_destroy(self._events[-1])
            self._events.pop()
