"""StagingRing: pinned host slots with matching device staging buffers.

A step writes its segments upward from the bottom of one slot and the
snapshots of its eager copies downward from the top. The ring advances once
per step; the host waits only when the slot it is about to reuse is still in
flight (its event, recorded after the last work that reads it, has not
completed). Barriers append segments to the same slot, so they never wait.

No memory is freed before :meth:`StagingRing.close`: ``cudaFreeHost`` and
``cudaFree`` wait for the whole device, so a free between steps would be the
coarse synchronization cucopy exists to avoid (behind a kernel that waits on the
host, a hang). A slot replaced by a larger or smaller one, and each temporary a
step used, is kept idle and reused by a later step that needs that much.
"""

from __future__ import annotations

import collections
import threading

from . import pack

__all__ = ["StagingRing", "Slot"]

# Demand is remembered over this many steps before a slot shrinks back.
_DEMAND_WINDOW = 64


# Rings of copiers collected without close(): freed at the next copier made or
# closed, never by the garbage collector (a free, and close()'s wait for in-flight
# slots, wait for the device, at whatever moment a collection happens to run).
_orphans: list = []
_orphans_lock = threading.Lock()


def orphan(ring: StagingRing) -> None:
    """Set aside the ring of a copier the garbage collector took (see :func:`free_orphans`)."""
    _orphans.append(ring)


def free_orphans() -> None:
    """Wait for and free the rings :func:`orphan` set aside (a copier is made or closed)."""
    with _orphans_lock:
        rings = _orphans[:]
        del _orphans[:]
    for ring in rings:
        try:
            ring.close()
        except Exception:  # its device may be gone: nothing left to free
            pass


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class Slot:
    """One pinned host buffer, its device staging twin and its event.

    Attributes
    ----------
    pinned : PinnedBuffer
    staging : DeviceBuffer
    event : object
        Backend event recorded after the last work reading this slot.
    size : int
        Bytes of each buffer.
    bottom : int
        Next free byte for segments (grows upward).
    top : int
        Lowest byte used by eager snapshots (grows downward).
    temps : list
        Buffers (overflow snapshots, temporaries) the slot's step used; the ring
        takes them back, idle, when the slot is reused.
    frees : list
        Check mode's unread snapshot buffers that did not come from the ring (none
        while a slot is current), freed when the slot is reused.
    """

    __slots__ = (
        "pinned",
        "staging",
        "event",
        "size",
        "bottom",
        "top",
        "temps",
        "frees",
        "recorded",
        "dirty",
        "array",
        "mv",
    )

    def __init__(self, backend, size: int):
        self.pinned = backend.alloc_pinned(size)
        try:
            self.staging = backend.alloc_device(size)
        except BaseException:
            self.pinned.close()
            raise
        self.array = self.pinned.array
        self.mv = memoryview(self.array)
        self.event = None
        self.size = size
        self.bottom = 0
        self.top = size
        self.temps = []
        self.frees = []
        self.recorded = False
        self.dirty = False

    def release_temps(self) -> None:
        """Free the temporaries (teardown only: a free waits for the whole device)."""
        temps, self.temps = self.temps + self.frees, []
        self.frees = []
        for t in temps:
            t.close()

    def close(self) -> None:
        """Free the slot's memory."""
        self.release_temps()
        self.mv.release()
        self.array = self.mv = None
        self.pinned.close()
        self.staging.close()


class StagingRing:
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
        self._demand = collections.deque(maxlen=_DEMAND_WINDOW)
        self._want = 0
        self.current: Slot | None = None
        # idle memory kept for reuse until close(): replaced slots by size, and the
        # temporaries of steps whose slots came round again (pinned, device)
        self._spare_slots: list[Slot] = []
        # spare temporaries by size (every one is a power of two, see _size)
        self._spare_pinned: dict[int, list] = {}
        self._spare_device: dict[int, list] = {}

    @property
    def slots(self) -> int:
        """Number of slots."""
        return len(self._slots)

    def note_overflow(self, nbytes: int) -> None:
        """Record ``nbytes`` a step wanted but its slot could not hold (grows the next one)."""
        self._want += nbytes

    def _target(self) -> int:
        peak = max(self._demand, default=0)
        return max(self.capacity, _pow2(pack.align(peak, 4096)))

    def acquire(self) -> tuple[Slot, bool]:
        """Advance to the next slot, waiting if it is still in flight.

        Returns
        -------
        slot : Slot
        waited : bool
            True when the host had to wait for the slot's event.
        """
        prev = self.current
        if prev is not None:
            self._demand.append(self._want + prev.bottom + prev.size - prev.top)
        self._want = 0
        self._index = (self._index + 1) % len(self._slots)
        event = self._events[self._index]
        slot = self._slots[self._index]
        waited = False
        if slot is not None and slot.recorded and not self.backend.event_query(event):
            self.backend.event_synchronize(event)
            waited = True
        target = self._target()
        if slot is not None:
            # idle now (its event completed above): its step's temporaries are spare
            self._keep_temps(slot)
        if slot is None or slot.size < target or slot.size > 2 * target:
            self.current = None
            if slot is not None:  # kept, not freed: a free would wait for the device
                self._slots[self._index] = None
                self._spare_slots.append(slot)
            slot = self._take_slot(target)
            slot.event = event
            self._slots[self._index] = slot
        slot.bottom = 0
        slot.top = slot.size
        slot.recorded = False
        slot.dirty = False
        self.current = slot
        return slot, waited

    def record(self, stream) -> None:
        """Record the current slot's event after the work enqueued so far."""
        slot = self.current
        if slot is not None and slot.dirty:
            self.backend.event_record(slot.event, stream)
            slot.recorded = True
            slot.dirty = False

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

        Each free waits for the whole device: call it where a wait is harmless.
        """
        spares = self._spare_slots + self._spares(self._spare_pinned)
        spares += self._spares(self._spare_device)
        self._spare_slots, self._spare_pinned, self._spare_device = [], {}, {}
        freed = 0
        for spare in spares:
            freed += 2 * spare.size if isinstance(spare, Slot) else spare.nbytes
            spare.close()
        return freed

    def pinned_bytes(self) -> int:
        """Pinned bytes held by the slots in use (spares and temporaries excluded)."""
        return sum(s.size for s in self._slots if s is not None)

    def spare_bytes(self) -> int:
        """Pinned bytes kept idle for reuse: replaced slots and spare temporaries."""
        kept = self._spare_slots + self._spares(self._spare_pinned)
        return sum(s.size if isinstance(s, Slot) else s.nbytes for s in kept)

    def close(self) -> None:
        """Wait for in-flight slots and free all memory."""
        for slot in self._slots:
            if slot is not None and slot.recorded:
                self.backend.event_synchronize(slot.event)
        for i, slot in enumerate(self._slots):
            if slot is not None:
                slot.close()
                self._slots[i] = None
        self.trim()
        for ev in self._events:
            self.backend.event_destroy(ev)
        self._events = []
        self.current = None
