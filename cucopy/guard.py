"""HostGuard: a pinned host buffer its owner fences, read in place by copies.

Every other copy cucopy issues snapshots its host source at the call (into the
ring slot), so the host may refill its buffer at once. For a large source the
owner already keeps for its own uploads (a mask, a big page table) that memcpy
is waste: ``copier.copy(site, dst, src, guard=g)`` copies from ``src`` in place,
one DMA from its pinned address, no snapshot. The race the snapshot rules out
(an asynchronous copy reading a pinned buffer the host has already refilled) is
then the guard's to rule out, and it does so by making the owner's next write go
through it:

- ``with g.write(): ...`` (or :meth:`HostGuard.wait`) waits, bounded by the
  copier's ``wait_timeout``, for the copies that read the buffer and no more: an
  event per copier the guard was read through, recorded after the step's last
  in-place copy (at the step's flush, or at the call outside a step; at the wait
  itself when the step is still open). Never a stream or device synchronization.
- In check mode (:data:`cucopy.check.CHECK_MODE`) each in-place copy remembers
  the bytes it read; the next ``g.write()``, the next copy through ``g`` and the
  copier's next flush raise :class:`~cucopy.CopyError`, naming the site and the
  buffer, if any of them changed without ``g.write()`` in between.
- A buffer freed or reallocated under the guard (a torch tensor whose storage was
  swapped by ``set_()`` or ``.data =``; torch refuses to resize a storage NumPy has
  seen) is refused at its next copy and its next ``write()``, before anything is
  issued, as is a closed guard, a buffer that is not pinned, and a source that
  does not lie inside the buffer.

A guarded copy is always issued at the call (eagerly), never staged: a merged
site's guarded copy counts as ``eager`` with ``fallback["in_place"]``. It keeps
program order with the step's staged copies (a staged copy into an overlapping
destination lands first). During graph capture ``guard=`` is refused: a graph
re-reads its sources at every replay, which no event recorded once can fence.
"""

from __future__ import annotations

import ctypes
import threading
import time
import weakref
from typing import Any

import numpy as np

from . import _layout, check
from .adapters import resolve
from .errors import CopyError
from .segment import GuardCore as _CompiledGuardCore
from .segment import UseCore as _CompiledUseCore

__all__ = ["HostGuard"]

#: most distinct read ranges a check-mode watch names (their bytes are all watched)
_WATCH_NAMES = 64


def _site_label(site: Any) -> str:
    return getattr(site, "label", None) or repr(site)


def _raw(lo: int, hi: int) -> np.ndarray:
    """The host bytes ``[lo, hi)`` as a writable NumPy view (no copy)."""
    if hi <= lo:
        return np.zeros(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_ubyte * (hi - lo)).from_address(lo))


#: the fields a guarded copy's compiled case and the compiled flush write and read
#: (``cucopy._segment.UseCore``'s, typed there: ``owed`` and ``recorded`` C booleans,
#: ``ticket`` a C integer, ``event`` and ``stream`` read as raw handles when they are
#: ints), or a plain base
_UseBase = object if _CompiledUseCore is None else _CompiledUseCore
_TYPED = ("timeout", "owed", "sites", "event", "stream", "recorded", "ticket")


class _Use(_UseBase):  # type: ignore[misc,valid-type]
    """What a guard knows of one copier's copies reading it.

    Holds the stream and backend itself (not the copier): a copier collected while
    its copies are in flight still has them waited for.
    """

    __slots__ = tuple(
        name
        for name in (
            "backend",
            "stream",
            "stream_obj",
            "timeout",
            "event",
            "owed",
            "recorded",
            "ticket",
            "sites",
            "pinned",
            "where",
            "__weakref__",
        )
        if _CompiledUseCore is None or name not in _TYPED
    )

    def __init__(self, copier: Any) -> None:
        be = copier.backend
        self.backend = be
        self.stream = copier.stream
        self.stream_obj = copier._ring.stream  # what error messages show
        self.timeout = copier.wait_timeout
        self.event = be.event_create()
        # destroyed with the use (never at exit: the driver may be gone by then)
        weakref.finalize(self, be.event_destroy, self.event).atexit = False
        self.owed = False  # copies issued since the event was last recorded
        self.recorded = False  # the event was recorded after copies not known complete
        self.ticket = 0  # records made (a wait clears what it covered, no more)
        self.sites: dict = {}  # site -> copies not known complete
        self.pinned = False  # the buffer was found pinned on this backend
        self.where = be.describe()

    def names(self) -> str:
        by_label: dict = {}
        for site, n in self.sites.items():
            label = _site_label(site)
            by_label[label] = by_label.get(label, 0) + n
        return ", ".join(f"{k} x{v}" for k, v in by_label.items()) or "none"


class _Watch:
    """Check mode: the bytes in-place copies read since the last ``write()``."""

    __slots__ = ("lo", "hi", "snap", "mask", "reads")

    def __init__(self) -> None:
        self.lo = self.hi = 0
        self.snap = np.zeros(0, np.uint8)
        self.mask = np.zeros(0, bool)
        self.reads: list = []  # (site label, ptr, rows, width, pitch)


class _Write:
    """What :meth:`HostGuard.write` returns: waits on entry; the block is the write."""

    __slots__ = ("_guard",)

    def __init__(self, guard: HostGuard) -> None:
        self._guard = guard

    def __enter__(self) -> HostGuard:
        self._guard._fence("write()")
        return self._guard

    def __exit__(self, *exc: object) -> None:
        return None


#: the fields a guarded copy's compiled case reads (``cucopy._segment.GuardCore``'s,
#: typed there: ``_closed`` a C boolean, ``_lo`` / ``_hi`` C integers), or a plain base
_GuardBase = object if _CompiledGuardCore is None else _CompiledGuardCore


class HostGuard(_GuardBase):  # type: ignore[misc,valid-type]
    """An owner's pinned host buffer, read in place by copies and written through the guard.

    Pass it as ``guard=`` to :meth:`DeviceCopier.copy <cucopy.DeviceCopier.copy>` or
    :func:`cucopy.copy` with a source that is a view of the buffer: the copy reads the
    buffer where it is, when the stream runs it (one DMA, no snapshot). Before writing
    the buffer again, the owner enters ``with guard.write():``, which waits for exactly
    the copies that read it. See :mod:`cucopy.guard`.

    Parameters
    ----------
    buf : array
        The owner's host buffer: a NumPy array over pinned memory, a pinned torch CPU
        tensor, or anything :func:`cucopy.adapters.resolve` reads as host memory. The
        guard keeps a reference to it. Whether it is pinned is asked of each copier's
        backend when that copier first reads it.
    label : str, optional
        The name errors give the buffer (default: a description of ``buf``).

    Raises
    ------
    TypeError
        If ``buf`` is not an array cucopy reads, or ``label`` is not a string.
    ValueError
        If ``buf`` is device memory.

    Notes
    -----
    Every write to bytes an in-place copy read must go through :meth:`write` (or
    follow :meth:`wait`), even when you know the copy has run: that is the promise
    check mode verifies. Bytes of the buffer no copy read may be written freely. The
    copies and writes through one guard are its owner's to order: issue them from one
    thread, or order them with your own lock.
    """

    def __init__(self, buf: Any, *, label: str | None = None) -> None:
        if label is not None and not isinstance(label, str):
            raise TypeError(f"HostGuard: label must be a str, got {label!r}")
        try:
            info = resolve(buf)
        except TypeError as exc:
            raise TypeError(f"HostGuard: buf: {exc}") from None
        if info.device is not None:
            raise ValueError(
                f"HostGuard: buf must be host memory (a pinned buffer), got device array "
                f"{info.label}"
            )
        self._buf = buf
        self._what = info.label
        self._label = label
        self._geom = (info.ptr, info.shape, info.strides, info.dtype)
        lo, hi = _layout.extent(info.ptr, info.shape, info.strides, info.dtype.itemsize)
        self._lo, self._hi = lo, hi
        self._closed = False
        self._lock = threading.RLock()
        # copier -> _Use, for the copies' bookkeeping; the uses with copies that may be
        # in flight are also held here, strongly, until a wait has seen them complete
        self._by_copier: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._active: list[_Use] = []
        self._watch: _Watch | None = None
        # the use the last copier found the buffer pinned through (the compiled copy
        # takes that copier's guarded copies without a Python call)
        self._fast_use: _Use | None = None

    # -- what it is --------------------------------------------------------------------

    @property
    def buffer(self) -> Any:
        """The guarded buffer (None once closed)."""
        return self._buf

    @property
    def label(self) -> str:
        """The name errors give the buffer."""
        return self._label if self._label is not None else self._what

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    @property
    def in_flight(self) -> bool:
        """Whether copies that read the buffer may not have completed (never waits)."""
        with self._lock:
            for use in self._active:
                if use.owed or (use.recorded and not use.backend.event_query(use.event)):
                    return True
            return False

    def __repr__(self) -> str:
        name = f"{self._label!r}, " if self._label is not None else ""
        state = ", closed" if self._closed else ""
        return f"HostGuard({name}{self._what}, [{self._lo:#x}, {self._hi:#x}){state})"

    def _name(self) -> str:
        if self._label is not None:
            return f"HostGuard {self._label!r} ({self._what})"
        return f"HostGuard({self._what})"

    # -- the owner's side ------------------------------------------------------------------

    def write(self) -> _Write:
        """Fence the owner's write: ``with guard.write(): buf[...] = new``.

        Entering the block waits until every copy that read the buffer through the
        guard has completed (their events only: never the whole stream or device),
        then the block may write the buffer. A copy through the guard inside the block
        reads the bytes as they are when its stream runs it: write first, then copy,
        and write again only through a new ``write()``.

        Returns
        -------
        context manager
            Its ``__enter__`` returns the guard.

        Raises
        ------
        CopyError
            On entry, before the block runs: a wait past a copier's ``wait_timeout``
            (naming the sites whose copies read the buffer, and the buffer; nothing is
            changed, the next ``write()`` waits afresh), a closed guard, a buffer freed
            or reallocated, or, in check mode, bytes a copy read that were written
            without the guard (reported once).
        """
        return _Write(self)

    def wait(self) -> None:
        """Wait for the copies that read the buffer; then the owner may write it.

        What entering :meth:`write` does, for owners that write elsewhere.

        Raises
        ------
        CopyError
            As :meth:`write`.
        """
        self._fence("wait()")

    def close(self) -> None:
        """Wait for the copies reading the buffer, then drop it. Idempotent.

        Raises
        ------
        CopyError
            If the wait passes its deadline (the guard stays open: close it again
            once the stream has moved), or as :meth:`write` in check mode.
        """
        if self._closed:
            return
        self._fence("close()", alive=False)
        with self._lock:
            self._closed = True
            self._buf = None
            self._watch = None
            self._active.clear()
            self._by_copier.clear()
            self._fast_use = None

    def _fence(self, what: str, alive: bool = True) -> None:
        """Wait for every copy that read the buffer (recording events still owed)."""
        if self._closed:
            raise CopyError(f"{self._name()}: {what}: the guard is closed")
        with self._lock:
            if self._watch is not None and check.CHECK_MODE and self._alive():
                self._verify(what, None)  # (a freed buffer is reported after the wait)
            waits = []
            for use in self._active:
                if use.owed:
                    self._record(use, what)
                if use.recorded:
                    waits.append((use, use.ticket))
        for use, ticket in waits:
            # (an error names the sites whose copies it waited for: use.sites, which only
            # a fence clears, read when it is raised)
            t0 = time.monotonic()
            try:
                done = use.backend.event_wait(use.event, use.timeout)
            except CopyError as exc:
                raise CopyError(
                    f"{use.names()}: {self._name()}: {what}: waiting for the copies that read it "
                    f"in place failed: {exc}"
                ) from exc
            if not done:
                spent = time.monotonic() - t0
                raise CopyError(
                    f"{use.names()}: {self._name()}: {what}: waited {spent:.3g} s "
                    f"(wait_timeout={use.timeout:g} s) for the copies that read the buffer "
                    f"in place on stream {use.stream_obj!r} ({use.where}); they have not "
                    "completed (a hung or stalled kernel on that stream?). Nothing was "
                    "changed: do not write the buffer yet; the next write() waits afresh"
                )
            with self._lock:
                if use.ticket == ticket and not use.owed:
                    use.recorded = False
                    use.sites.clear()
        with self._lock:
            self._active = [u for u in self._active if u.owed or u.recorded]
            if alive:
                self._check_alive(None, what)
            self._watch = None  # the owner's write is fenced: what copies read may change

    # -- the copier's side (cucopy.copier calls these) ---------------------------------------

    def _admit(self, site: Any) -> None:
        """Raise for a closed guard or a buffer freed or reallocated (before anything is
        issued, and before the copy's source is looked at: it is a view of the buffer)."""
        if self._closed:
            raise CopyError(
                f"{_site_label(site)}: guard={self._name()} is closed; make a new HostGuard"
            )
        with self._lock:
            self._check_alive(site, "copy()")

    def _use(self, copier: Any, site: Any) -> _Use:
        """The bookkeeping of ``copier``'s copies, after :meth:`_admit`: raises for a
        buffer not pinned on the copier's backend, or, in check mode, bytes an earlier
        copy read that changed without ``write()`` (before anything is issued)."""
        with self._lock:
            use = self._by_copier.get(copier)
            if use is None:
                use = self._by_copier[copier] = _Use(copier)
            if not use.pinned:
                be = copier.backend
                hi = max(self._hi - 1, self._lo)
                if not (be.is_pinned(self._lo) and be.is_pinned(hi)):
                    raise ValueError(
                        f"{_site_label(site)}: guard={self._name()}: the buffer is not "
                        f"pinned (page-locked) memory on {be.describe()}: an in-place copy "
                        "reads it when the stream runs, which pageable memory cannot give. "
                        "Allocate it pinned (torch pin_memory=True, cupyx.zeros_pinned), or "
                        "copy without guard= (the copy is then snapshotted at the call)"
                    )
                use.pinned = True
            self._fast_use = use
            if self._watch is not None and check.CHECK_MODE:
                self._verify("a copy through the guard", site)
            return use

    def _inside(self, site: Any, s: Any, slo: int, shi: int) -> None:
        """Raise unless source ``s`` (bytes ``[slo, shi)``) lies in the buffer."""
        if not (self._lo <= slo and shi <= self._hi):
            raise ValueError(
                f"{_site_label(site)}: src {s.label} at [{slo:#x}, {shi:#x}) does not lie "
                f"inside guard={self._name()}'s buffer [{self._lo:#x}, {self._hi:#x}); "
                "pass a view of the guarded buffer as src"
            )

    def _issued(
        self, copier: Any, use: _Use, site: Any, reads: list[tuple[int, int, int, int]], step: bool
    ) -> None:
        """In-place copies reading ``reads`` (``(ptr, pitch, width, rows)``) were issued.

        ``step``: inside a step, the event is owed (recorded once, at the step's flush,
        by ``copier``); outside one it is recorded now.
        """
        label = _site_label(site)
        with self._lock:
            use.sites[site] = use.sites.get(site, 0) + 1
            use.timeout = copier.wait_timeout
            if not any(u is use for u in self._active):
                self._active.append(use)
            if step:
                if not use.owed:
                    use.owed = True
                    copier._guards_owed.append((self, use))
            else:
                use.owed = True
                self._record(use, "copy()")
            if check.CHECK_MODE:
                self._watch_reads(label, reads)
                copier._guards_watched.add(self)
                copier._watching = True  # (the compiled flush leaves these to Python)

    def _record(self, use: _Use, what: str) -> None:
        """Record ``use``'s event after the copies issued so far (lock held)."""
        if not use.owed:
            return
        if use.backend.is_capturing(use.stream):
            names = use.names()
            raise CopyError(
                f"{names}: {self._name()}: {what}: the stream its copies went on, "
                f"{use.stream_obj!r}, is capturing a graph, so no event can fence them now; "
                "end the step (flush) before the capture begins"
            )
        use.backend.event_record(use.event, use.stream)
        use.owed = False
        use.recorded = True
        use.ticket += 1

    def _record_owed(self, use: _Use) -> bool:
        """The copier's flush: record ``use``'s event once for the step's copies.

        Returns False when it is still owed (the stream is capturing: a later flush,
        or the owner's ``write()``, records it). The compiled flush records the common
        case itself, as :meth:`_record` does, without the lock (``_core/guard.c``,
        ``fence_guards``): the copies and writes through a guard are its owner's to
        order, from one thread.
        """
        with self._lock:
            if not use.owed:
                return True
            if use.backend.is_capturing(use.stream):
                return False
            self._record(use, "flush()")
            return True

    def _alive(self) -> bool:
        """Whether the buffer is still the one the guard was made over."""
        try:
            info = resolve(self._buf)
        except Exception:
            return False
        return (info.ptr, info.shape, info.strides, info.dtype) == self._geom

    def _check_alive(self, site: Any, what: str) -> None:
        """Raise when the buffer was freed or reallocated since the guard was made."""
        try:
            info = resolve(self._buf)
        except Exception as exc:
            raise CopyError(
                f"{self._who(site)}guard={self._name()}: {what}: the guarded buffer can no "
                f"longer be read ({exc!r}): freed while copies read it? (copies not known "
                f"complete: {self._readers()})"
            ) from None
        geom = (info.ptr, info.shape, info.strides, info.dtype)
        if geom != self._geom:
            raise CopyError(
                f"{self._who(site)}guard={self._name()}: {what}: the guarded buffer was "
                f"freed or reallocated since the guard was made (its address went "
                f"{self._geom[0]:#x} -> {info.ptr:#x}, shape {self._geom[1]} -> "
                f"{info.shape}): copies that read it in place may have read freed memory "
                f"(copies not known complete: {self._readers()}). Make a new HostGuard "
                "for the new buffer"
            )

    @staticmethod
    def _who(site: Any) -> str:
        return f"{_site_label(site)}: " if site is not None else ""

    def _readers(self) -> str:
        """The sites whose copies may still read the buffer, for an error."""
        names = sorted({_site_label(k) for u in self._active for k in u.sites})
        return ", ".join(names) if names else "none"

    # -- check mode ----------------------------------------------------------------------------

    def _watch_reads(self, label: str, reads: list[tuple[int, int, int, int]]) -> None:
        """Remember the bytes in-place copies just read (lock held)."""
        w = self._watch
        if w is None:
            w = self._watch = _Watch()
        lo, hi = (w.lo, w.hi) if w.hi > w.lo else (reads[0][0], reads[0][0])
        for ptr, pitch, width, rows in reads:
            lo = min(lo, ptr)
            hi = max(hi, ptr + (rows - 1) * pitch + width)
        if (lo, hi) != (w.lo, w.hi):
            mask = np.zeros(hi - lo, bool)
            if w.hi > w.lo:
                mask[w.lo - lo : w.hi - lo] = w.mask
            w.lo, w.hi, w.mask = lo, hi, mask
        for ptr, pitch, width, rows in reads:
            for r in range(rows):
                a = ptr + r * pitch - lo
                w.mask[a : a + width] = True
            key = (label, ptr, rows, width, pitch)
            if len(w.reads) < _WATCH_NAMES and key not in w.reads:
                w.reads.append(key)
        w.snap = _raw(lo, hi).copy()

    def _verify(self, where: str, site: Any) -> None:
        """Raise if bytes an in-place copy read changed since (check mode; lock held)."""
        w = self._watch
        if w is None or w.hi <= w.lo:
            return
        self._check_alive(site, where)
        now = _raw(w.lo, w.hi).copy()
        bad = np.flatnonzero((now != w.snap) & w.mask)
        if bad.size == 0:
            return
        k = int(bad[0])
        addr = w.lo + k
        old, new = int(w.snap[k]), int(now[k])
        w.snap = now  # reported once: the next check compares with these bytes
        readers = []
        for label, ptr, rows, width, pitch in w.reads:
            off = addr - ptr
            if off >= 0 and off // pitch < rows and off % pitch < width and label not in readers:
                readers.append(label)
        names = ", ".join(readers) or "an in-place copy"
        raise CopyError(
            f"{names}: {self._name()}: byte {addr - self._lo} of the guarded buffer "
            f"({addr:#x}) was written without HostGuard.write() while a copy read it "
            f"({old:#04x} -> {new:#04x}; found at {where}). Write the buffer inside "
            "`with guard.write():`, which waits for the copies reading it"
        )
