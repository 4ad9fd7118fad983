"""Check mode: prove at run time the promises a plan and its owners make.

``CHECK_MODE`` is read once from ``CUCOPY_CHECK=1`` at import (spawned
workers inherit it through the environment); tests may patch it. The copier
reads it at each ``begin()``. In check mode the copier

- snapshots each merged destination (and D2D source) on the stream at the
  call's position, and again right before the segment that lands it; any
  difference means other work wrote it before its barrier;
- checks every ``unchanged=True`` copy or fill against the device bytes as of
  its place in program order (device bytes at the call's stream position, with
  the still-staged copies before it applied);
- lets :func:`expect_landed` find merged bytes still staged;
- fills each merged destination with a sentinel (:func:`sentinel_byte`) at the
  call, until its copy lands, so a reader before the barrier sees garbage;
- asks the backend to watch the destination (the simulated device raises when
  other work touches it before the barrier), and while a torch destination is
  staged, watches torch's operations (``cucopy.adapters.torch.StagedWatch``).

Violations raise :class:`~cucopy.CopyError` naming the site and the first
differing byte range. With check mode off none of this runs.
"""

from __future__ import annotations

import os
import sys
import types
import weakref

import numpy as np

from . import _layout
from .adapters import resolve
from .deadline import DEFAULT_WAIT_TIMEOUT
from .errors import CopyError

__all__ = [
    "CHECK_MODE",
    "REFUSE_UNROUTED",
    "SENTINEL_FLOAT",
    "SENTINEL_INT",
    "expect_landed",
    "Checker",
    "verify_unchanged",
]

CHECK_MODE: bool = os.environ.get("CUCOPY_CHECK", "") not in ("", "0")
#: in check mode, refuse module-level copies with no copier to route to (they would
#: bypass every copier); read once from ``CUCOPY_CHECK_UNROUTED=1`` at import
REFUSE_UNROUTED: bool = os.environ.get("CUCOPY_CHECK_UNROUTED", "") not in ("", "0")

_live = weakref.WeakSet()

#: called with the new value whenever ``CHECK_MODE`` is assigned (the compiled core's
#: ``_set_check_mode``: it keeps check mode as a C flag, never reading it by name)
_on_check_mode: list = []


class _CheckModule(types.ModuleType):
    """This module's type: an assignment to ``CHECK_MODE`` (``monkeypatch.setattr``,
    ``check.CHECK_MODE = True``) also tells :data:`_on_check_mode`'s listeners."""

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name == "CHECK_MODE":
            for listener in _on_check_mode:
                listener(value)


sys.modules[__name__].__class__ = _CheckModule


def register(copier) -> None:
    """Track a live copier for :func:`expect_landed`."""
    _live.add(copier)


def unregister(copier) -> None:
    """Stop tracking a closed copier."""
    _live.discard(copier)


def live_copiers() -> list:
    """The live copiers, a list (safe while other threads make or drop copiers: a
    weak set's iteration fails when the set changes under it, so it is retried)."""
    while True:
        try:
            return list(_live)
        except RuntimeError:  # changed size during iteration (another thread, a collection)
            continue


def _label(site) -> str:
    return getattr(site, "label", None) or repr(site)


def expect_landed(site, dst) -> None:
    """In check mode, raise if merged bytes into ``dst`` are still staged in any live copier.

    Call it in a reader that runs device work on ``dst`` right after a copy
    that should have been a barrier. With check mode off it does nothing (and
    costs one test), so it can stay in engine code.

    Parameters
    ----------
    site : CopySite
        The site of the copy the reader depends on.
    dst : array
        The destination the reader is about to read.

    Raises
    ------
    CopyError
        In check mode, naming the staged site, when bytes into ``dst`` have not
        been flushed.
    """
    if not CHECK_MODE:
        return
    info = resolve(dst)
    lo, hi = _layout.extent(info.ptr, info.shape, info.strides, info.dtype.itemsize)
    for copier in live_copiers():
        for e in copier._seg.entries:
            if (
                e.lo < hi
                and lo < e.hi
                and (info.device is copier.backend.device or info.device == copier.backend.device)
            ):
                raise CopyError(
                    f"{_label(e.site)}: bytes merged into {info.label} are still staged where "
                    f"{_label(site)} expects them landed; make {_label(e.site)} a flush_after "
                    "barrier or flush() before this reader"
                )


def _staged_at(device, lo: int, hi: int) -> str | None:
    """What is staged in device bytes ``[lo, hi)`` of CUDA ordinal ``device`` (the torch
    watch's lookup): the site and the range of the first staged copy there, or None."""
    for copier in live_copiers():
        if copier.backend.device != device or type(device) is not int:
            continue
        for e in copier._seg.entries:
            if e.lo < hi and lo < e.hi:
                return (
                    f"{_label(e.site)}: merged destination bytes [{e.lo:#x}, {e.hi:#x}) on "
                    f"{copier.backend.describe()}"
                )
    return None


class _Snap:
    """Device bytes ``[lo, hi)`` copied on the stream at one point of program order."""

    __slots__ = ("buf", "lo", "hi", "data", "owned", "timeout")

    def __init__(self, backend, stream, lo, hi, alloc=None, timeout=DEFAULT_WAIT_TIMEOUT):
        self.lo, self.hi = lo, hi
        self.timeout = timeout  # the copier's wait_timeout: reading waits for the stream
        self.data = None
        # a step's snapshots come from its ring slot (``alloc``), which takes them back
        # when the slot comes round; others are freed once read (a free waits for the
        # whole device, so a step never does it)
        self.owned = alloc is None
        self.buf = (backend.alloc_device if alloc is None else alloc)(max(hi - lo, 1))
        if hi > lo:
            backend.copy2d(False, self.buf.ptr, hi - lo, lo, hi - lo, hi - lo, 1, stream)

    def read(self, backend, stream) -> np.ndarray:
        if self.data is None:
            # the read synchronizes the stream: wait for it with the deadline first
            if self.hi > self.lo and not backend.stream_wait(stream, self.timeout):
                raise CopyError(
                    f"check mode: waited {self.timeout:g} s (wait_timeout) for stream "
                    f"{stream!r} to reach its snapshot of device bytes [{self.lo:#x}, "
                    f"{self.hi:#x}); it never did (a hung or stalled kernel on it?)"
                )
            raw = (
                backend.read(self.buf.ptr, self.hi - self.lo, stream) if self.hi > self.lo else b""
            )
            self.data = np.frombuffer(raw, np.uint8).copy()
            if self.owned:
                self.buf.close()
        return self.data


def _elements(buf: np.ndarray, lo: int, ptr: int, shape, strides, itemsize) -> np.ndarray:
    """The element bytes of a view, in C order, from extent bytes starting at ``lo``."""
    view = np.lib.stride_tricks.as_strided(
        buf[ptr - lo :],
        shape=tuple(shape) + (itemsize,),
        strides=tuple(strides) + (1,),
        writeable=False,
    )
    return view.reshape(-1, itemsize)


def _first_diff(site, what, info, got, want) -> None:
    bad = np.flatnonzero((got != want).any(axis=1))
    if bad.size == 0:
        return
    i = int(bad[0])
    j = i
    while j + 1 < len(bad) and bad[j - i + 1] == j + 1:
        j += 1
    it = info.dtype.itemsize
    raise CopyError(
        f"{_label(site)}: {what} {info.label}: elements {i}..{j} differ (first at byte offset "
        f"{i * it} of the view); device has {got[i].tobytes().hex()}, expected "
        f"{want[i].tobytes().hex()}"
    )


#: the byte check mode writes over a merged destination at the call, until its copy
#: lands: floats read NaN, integers a large odd value (0xA5A5...), so a reader that
#: runs before the barrier sees garbage a test notices
SENTINEL_FLOAT = 0xFF
SENTINEL_INT = 0xA5


def sentinel_byte(dtype) -> int:
    """The sentinel byte for a destination of ``dtype`` (None: an unknown dtype)."""
    kind = getattr(dtype, "kind", "f")
    return SENTINEL_FLOAT if kind in "fc" else SENTINEL_INT


class Checker:
    """One step's check-mode bookkeeping for a copier."""

    def __init__(self, copier):
        self.copier = copier
        self.backend = copier.backend
        self.stream = copier.stream
        self.pending = []
        self.snaps = []
        # the staged entries' sentinel rows (id -> (entry, byte, rows)) and the
        # backend's watches over them, until their segment lands or is dropped
        self.marks: dict = {}
        self.tokens: list = []
        # torch's operations are watched while a torch destination is staged
        self.torch_watch = None

    def _mark(self, e, d, payload) -> None:
        """Write the sentinel over ``e``'s destination rows and watch them (at the call's
        position on the stream, right after the call's snapshot)."""
        be, stream = self.backend, self.stream
        byte = sentinel_byte(d.dtype if d is not None else None)
        rows = []
        for desc, _ in payload:
            dst, dpitch, width, nrows = desc[0], desc[3], desc[5], desc[6]
            be.fill(dst, dpitch, width, nrows, byte, 1, stream)
            rows += [(dst + r * dpitch, width) for r in range(nrows)]
        self.marks[id(e)] = (e, byte, rows)
        what = d.label if d is not None else f"[{e.lo:#x}, {e.hi:#x})"
        label = f"{_label(e.site)}: merged destination bytes of {what}"
        self.tokens.append(be.watch(rows, label, stream))

    def _expected(self, e, before: np.ndarray) -> np.ndarray:
        """``e``'s call snapshot with the sentinels written since (any entry's, in its extent)."""
        want = before.copy()
        for _, byte, rows in self.marks.values():
            for a, w in rows:
                x0, x1 = max(a, e.lo), min(a + w, e.hi)
                if x0 < x1:
                    want[x0 - e.lo : x1 - e.lo] = byte
        return want

    def landed(self) -> None:
        """The staged copies' launch is enqueued: stop watching them after it."""
        tokens, self.tokens = self.tokens, []
        self.marks.clear()
        self.backend.unwatch(tokens, self.stream)
        if self.torch_watch is not None and self.torch_watch.exit():
            self.torch_watch = None

    def _watch_torch(self, d) -> None:
        """A torch destination is staged: watch torch's operations until it lands."""
        if self.torch_watch is None and type(getattr(d, "obj", None)).__module__.startswith(
            "torch"
        ):
            from .adapters.torch import StagedWatch

            self.torch_watch = StagedWatch(_staged_at)
        if self.torch_watch is not None:
            self.torch_watch.enter()

    def dropped(self) -> None:
        """The staged copies were dropped: put back the bytes the sentinel covered (from
        each entry's call snapshot, on the stream) and stop watching them."""
        be, stream = self.backend, self.stream
        for e, _, rows in self.marks.values():
            snap = e.snap
            if snap is None or (snap.owned and snap.data is not None):
                continue  # (a snapshot freed once read: nothing to copy back from)
            for a, w in rows:
                if e.lo <= a and a + w <= e.hi:
                    be.copy2d(False, a, w, snap.buf.ptr + (a - e.lo), w, w, 1, stream)
        self.landed()

    def snap(self, lo, hi) -> _Snap:
        """Snapshot device bytes at the current stream position."""
        ring = self.copier._ring
        alloc = ring.temp_device if ring.current is not None else None
        snap = _Snap(self.backend, self.stream, lo, hi, alloc, self.copier.wait_timeout)
        self.snaps.append(snap)
        return snap

    def release(self) -> list:
        """Hand over the snapshots never read (the step's copies were discarded).

        Returns their device buffers, to be freed once the stream has passed
        the copies that fill them.
        """
        self.dropped()
        snaps, self.snaps, self.pending = self.snaps, [], []
        return [snap.buf for snap in snaps if snap.data is None and snap.owned]

    def on_stage(self, e, d, s) -> None:
        """A copy was staged into entry ``e`` (dst ``d``, D2D source ``s``)."""
        c = self.copier
        if e.snap is None:
            e.snap = self.snap(e.lo, e.hi)
        idx = e.index if isinstance(e.index, list) else [e.index]
        payload = []
        for i in idx:
            desc = c._seg.desc(i)
            if desc[7] <= 2:  # H2D: the staged bytes, as snapshotted into the slot
                n = desc[5] * desc[6]
                payload.append((desc, c._slot.array[desc[1] : desc[1] + n].copy()))
            else:
                payload.append((desc, None))
        e.data = payload
        if s is not None and e.ssnap is None:
            e.ssnap = self.snap(e.slo, e.shi)
        self._mark(e, d, payload)
        if d is not None and "torch" in sys.modules:
            self._watch_torch(d)
        c.stats.sites[e.site].checked += 1

    def before_flush(self, entries) -> None:
        """Right before a segment lands: compare each merged range with its call snapshot."""
        afters = [
            (e, self.snap(e.lo, e.hi), self.snap(e.slo, e.shi) if e.ssnap else None)
            for e in entries
        ]
        for e, after, safter in afters:
            before = self._expected(e, e.snap.read(self.backend, self.stream))
            now = after.read(self.backend, self.stream)
            if not np.array_equal(before, now):
                k = int(np.flatnonzero(before != now)[0])
                raise CopyError(
                    f"{_label(e.site)}: merged destination bytes [{e.lo + k:#x}, ...) were "
                    f"written by other work between the copy and its barrier (byte {k} of "
                    f"[{e.lo:#x}, {e.hi:#x}) went {before[k]:#04x} -> {now[k]:#04x}); the plan "
                    "promises nobody touches a merged destination before its barrier"
                )
            if safter is not None:
                sb = e.ssnap.read(self.backend, self.stream)
                sn = safter.read(self.backend, self.stream)
                if not np.array_equal(sb, sn):
                    k = int(np.flatnonzero(sb != sn)[0])
                    raise CopyError(
                        f"{_label(e.site)}: merged D2D source bytes [{e.slo + k:#x}, ...) were "
                        f"written by other work between the copy and its barrier (byte {k} "
                        f"went {sb[k]:#04x} -> {sn[k]:#04x})"
                    )
        self.verify_pending()

    def verify_pending(self) -> None:
        """Check the ``unchanged`` claims made since the last flush, then free the snapshots."""
        pending, self.pending = self.pending, []
        try:
            for fn in pending:
                fn()
        finally:
            self.snaps = [snap for snap in self.snaps if snap.data is None]


def _overlay(buf, lo, hi, staged, backend, stream) -> None:
    """Apply still-staged descriptors to extent bytes ``buf`` = device ``[lo, hi)``."""
    for e, payload, ssnap in staged:
        for desc, data in payload:
            dst, src, value, dpitch, spitch, width, rows, kind, elem = desc[:9]
            for r in range(rows):
                a = dst + r * dpitch
                b = a + width
                if b <= lo or a >= hi:
                    continue
                if kind <= 2:
                    row = data[r * width : (r + 1) * width]
                elif kind == 3:
                    sb = ssnap.read(backend, stream)
                    o = src + r * spitch - e.slo
                    row = sb[o : o + width]
                else:
                    row = np.frombuffer(
                        int(value).to_bytes(8, "little")[:elem] * (width // elem), np.uint8
                    )
                x0, x1 = max(a, lo), min(b, hi)
                buf[x0 - lo : x1 - lo] = row[x0 - a : x1 - a]


def verify_unchanged(copier, site, d, s, fill, *, count: bool = True, what=None) -> None:
    """Check an ``unchanged=True`` claim against the device in program order.

    In a step of ``copier`` the check runs at its next flush (or :meth:`begin`), with
    the copies staged before the claim applied; outside a step, at once. Owners that
    skip an upload through their own copy path (a record-only
    :class:`~cucopy.DeviceCopyBuffer`) check their skips here too.

    Parameters
    ----------
    copier : DeviceCopier
        The copier whose stream and staged copies give program order.
    site : CopySite
        Names the claim in errors (anything with a ``label``).
    d : ArrayInfo
        The destination.
    s : ArrayInfo or None
        The source of a copy (host or device), None for a fill.
    fill : tuple or None
        ``(start, pattern_bytes)`` of a fill.
    count : bool
        Count the check in ``copier.stats.sites[site]`` (False for a ``site`` that
        is not a copy site).
    what : str, optional
        What the error calls the claim (default: ``"unchanged copy into"`` or
        ``"unchanged fill_tail of"``).
    """
    backend, stream = copier.backend, copier.stream
    it = d.dtype.itemsize
    lo, hi = _layout.extent(d.ptr, d.shape, d.strides, it)
    staged = [(e, e.data, e.ssnap) for e in copier._seg.entries if e.data is not None]
    checker = copier._checker if copier.in_step else None
    timeout = copier.wait_timeout
    take = (
        checker.snap
        if checker is not None
        else (lambda a, b: _Snap(backend, stream, a, b, None, timeout))
    )
    dsnap = take(lo, hi)
    ssnap = None
    if s is not None and s.device is not None:
        slo, shi = _layout.extent(s.ptr, s.shape, s.strides, it)
        ssnap = (take(slo, shi), slo, shi)
    host = None
    if s is not None and s.device is None:
        host = np.ascontiguousarray(s.host).reshape(-1).view(np.uint8).reshape(-1, it).copy()
    if count:
        copier.stats.sites[site].checked += 1

    def run():
        buf = dsnap.read(backend, stream).copy()
        _overlay(buf, lo, hi, staged, backend, stream)
        got = _elements(buf, lo, d.ptr, d.shape, d.strides, it)
        if fill is not None:
            start, pattern = fill
            got = got[start:]
            want = np.broadcast_to(np.frombuffer(pattern, np.uint8), got.shape)
            _first_diff(site, what or "unchanged fill_tail of", d, got, want)
            return
        if host is not None:
            want = host
        else:
            snap, slo, shi = ssnap
            sbuf = snap.read(backend, stream).copy()
            _overlay(sbuf, slo, shi, staged, backend, stream)
            want = _elements(sbuf, slo, s.ptr, s.shape, s.strides, it)
        _first_diff(site, what or "unchanged copy into", d, got, want)

    if checker is not None:
        checker.pending.append(run)
    else:
        run()
