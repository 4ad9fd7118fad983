"""The open segment: the staging hot path, in pure Python.

A step's merged copies are staged into the current ring slot as one *segment*
(``header | descriptors | data``, :mod:`cucopy.pack`). This module owns that
segment while it is open: the bytes staged into the slot, the write and read
byte ranges that keep program order, the descriptors and their entries (site,
``on_drop``, ranges), the cut and encode at flush, and the per-site ``merged``
counters. It knows :mod:`cucopy.pack` and nothing above it: each call answers
with an outcome (staged, no room, overlaps), and the copier runs barriers,
fallbacks and ``on_drop``.

``cucopy._segment`` is its compiled twin (same bytes, same descriptors, same
counters); :data:`Segment` is the compiled class when the extension is built and
``CUCOPY_PURE_PYTHON`` is not set, else :class:`PySegment`, which stays the
reference. :data:`IMPLEMENTATION` says which (``"compiled"`` or ``"python"``).
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import os
import threading
import weakref

import numpy as np
from numpy import ndarray as _ndarray

from . import pack
from ._layout import form as _form
from ._layout import tail_blocks as _tail_blocks
from .pack import fits as _fits

__all__ = [
    "PySegment",
    "Segment",
    "IMPLEMENTATION",
    "MISS",
    "STAGED",
    "BARRIER",
    "SKIPPED",
    "FULL",
    "ORDER",
    "DCACHE_MAX",
]

# try_h2d outcomes
MISS = 0  # not taken: the copier's general path handles the copy
STAGED = 1  # staged
BARRIER = 2  # staged through a barrier site (or in check mode): the copier follows up
SKIPPED = 3  # try_fill: an empty tail (start past the end), nothing to stage
# stage outcomes
FULL = -1  # the slot cannot hold it: run it eagerly
ORDER = -2  # it overlaps staged work: flush the open segment, then stage again

DCACHE_MAX = 4096
_KIND_H2D, _KIND_H2D_2D, _KIND_D2D = pack.KIND_H2D, pack.KIND_H2D_2D, pack.KIND_D2D
_DESC, _HEADER, _ALIGN, _BLOCK = pack.DESC_BYTES, pack.HEADER_BYTES, pack.ALIGN, pack.BLOCK_BYTES


def core_shape(shape) -> tuple:
    """``shape`` without its leading dimensions of size 1."""
    i = 0
    while i < len(shape) and shape[i] == 1:
        i += 1
    return tuple(shape[i:])


def fits_shape(dshape, sshape) -> bool:
    """The copier's shape rule: whether a source of shape ``sshape`` may fill a
    destination of ``dshape`` (same element count): the same shape once leading
    dimensions of size 1 are dropped, or a flat source (one dimension left), whose
    elements fill ``dst`` in C order."""
    core = core_shape(sshape)
    return len(core) <= 1 or core == core_shape(dshape)


class RangeSet:
    """Byte ranges as sorted disjoint intervals, for overlap queries in O(log n)."""

    __slots__ = ("lo", "hi")

    def __init__(self):
        self.lo: list[int] = []
        self.hi: list[int] = []

    def clear(self) -> None:
        """Forget every range."""
        self.lo.clear()
        self.hi.clear()

    def overlaps(self, lo: int, hi: int) -> bool:
        """Whether ``[lo, hi)`` overlaps a range held."""
        i = bisect.bisect_right(self.lo, lo)
        if i and self.hi[i - 1] > lo:
            return True
        return i < len(self.lo) and self.lo[i] < hi

    def claim(self, lo: int, hi: int) -> bool:
        """Insert ``[lo, hi)`` (non-empty) unless it overlaps a range held: one search.

        Returns False, having changed nothing, on an overlap. Merges with the
        ranges it touches, as :meth:`add` does.
        """
        los, his = self.lo, self.hi
        i = bisect.bisect_right(los, lo)
        if i and his[i - 1] >= lo:
            if his[i - 1] > lo:
                return False
            # touches the range before it
            if i < len(los) and los[i] <= hi:
                if los[i] < hi:
                    return False
                his[i - 1] = his[i]  # and the one after: the three become one
                del los[i], his[i]
            else:
                his[i - 1] = hi
            return True
        if i < len(los) and los[i] <= hi:
            if los[i] < hi:
                return False
            los[i] = lo  # touches the range after it
            return True
        los.insert(i, lo)
        his.insert(i, hi)
        return True

    def add(self, lo: int, hi: int) -> None:
        """Insert, merging with any interval it touches."""
        i = bisect.bisect_left(self.hi, lo)  # first interval ending at or after lo
        j = bisect.bisect_right(self.lo, hi)  # past the last starting at or before hi
        if i < j:
            lo = min(lo, self.lo[i])
            hi = max(hi, self.hi[j - 1])
        self.lo[i:j] = [lo]
        self.hi[i:j] = [hi]


class Entry:
    """One staged copy's bookkeeping: site, drop callbacks, ranges, check data.

    ``index`` is the copy's descriptor (an int) or descriptors (a list); ``geom``
    its destination's 2-D form when it has one; ``data``, ``snap``, ``ssnap`` and
    ``value`` belong to check mode.
    """

    __slots__ = (
        "site",
        "on_drop",
        "lo",
        "hi",
        "slo",
        "shi",
        "index",
        "geom",
        "data",
        "snap",
        "ssnap",
        "value",
    )

    def __init__(self, site, on_drop, lo, hi, index):
        self.site = site
        self.on_drop = on_drop
        self.lo = lo
        self.hi = hi
        self.slo = self.shi = 0
        self.index = index
        self.geom = None
        self.data = None
        self.snap = None
        self.ssnap = None
        self.value = None


class PySegment:
    """The open segment of one copier (pure Python; the reference implementation).

    Parameters
    ----------
    merge : frozenset
        The plan's merged H2D sites (the only ones :meth:`try_h2d` takes).
    barriers : frozenset
        The plan's ``flush_after`` sites.
    fills : frozenset
        The plan's merged FILL sites (the only ones :meth:`try_fill` takes).

    The flush counts each landed copy as merged under its site; :meth:`fold` hands
    the counts over (``CopyStats`` folds them in when its ``sites`` are read).
    """

    __slots__ = (
        "merge",
        "fills",
        "barriers",
        "counts",
        "_fast",
        "owner",
        "slot",
        "mv",
        "top",
        "bottom",
        "cursor",
        "seg",
        "data0",
        "reserve",
        "peak",
        "nt_from",
        "wide",
        "descs",
        "entries",
        "writes",
        "reads",
        "exact",
        "dcache",
        "scache",
        "vtypes",
        "capq",
        "caparg",
    )

    def __init__(self, merge, barriers, fills=frozenset()):
        self.merge = merge
        self.fills = fills
        self.barriers = barriers
        self.counts: dict = {}  # site -> merged copies not yet folded
        self._fast = False
        self.owner = None
        self.slot = None
        self.mv = None
        self.top = self.bottom = self.cursor = 0
        self.seg = -1
        self.data0 = 0
        self.reserve = 16  # descriptors a new segment reserves room for (settable unopened)
        self.peak = 0  # the largest table cut since the copier last set it
        # the compiled twin's cache hint (streaming stores for data staged this far into
        # a segment, -1: never); the same bytes land either way, so it is kept, not used
        self.nt_from = -1
        self.wide = False  # a destination wider than one block is staged
        self.descs: list = []
        self.entries: list = []
        self.writes = RangeSet()
        self.reads = RangeSet()
        self.exact: dict = {}
        self.dcache: dict = {}
        self.scache: dict = {}
        self.vtypes: dict = {}  # type -> view protocol (see _view)
        self.capq = self.caparg = None  # the stream's capture query (set_capture_query)

    def set_capture_query(self, fn, arg) -> None:
        """Ask ``fn(arg)`` (false or 0: not capturing) before a fast copy opens a segment.

        A graph capture that began on the copier's stream after ``begin()`` would leave
        the copies staged during it out of the graph (they would land once, outside it,
        at the flush); asked once a segment, the fast path then leaves such a copy to
        the general path, which refuses it. ``fn`` None: never asked.
        """
        self.capq = fn
        self.caparg = arg

    def _capturing(self) -> bool:
        """Whether the stream is capturing (or cannot tell), before a segment opens."""
        q = self.capq
        return q is not None and bool(q(self.caparg))

    @property
    def fast(self) -> bool:
        """The fast path may be taken, by the thread that set this.

        The copier sets it at ``begin()`` when the step is open, not capturing and
        not checked, and clears it when the step ends.
        """
        return self._fast

    @fast.setter
    def fast(self, value: bool) -> None:
        self._fast = bool(value)
        self.owner = thread_id()

    # -- the slot ------------------------------------------------------------------------

    def bind(self, slot) -> None:
        """Start staging into ``slot`` (fresh from the ring: nothing staged)."""
        self.slot = slot
        self.mv = mv = slot.mv
        # clamped to the slot's bytes: a slot whose top claims more is not trusted
        self.top = top = max(0, min(slot.top, mv.nbytes))
        self.bottom = max(0, min(slot.bottom, top))
        self.cursor = 0
        self.seg = -1

    def unbind(self) -> None:
        """Forget the slot (the ring may replace it); nothing may be staged."""
        self.slot = self.mv = None
        self.seg = -1
        self.cursor = 0

    def set_cursor(self, end: int) -> None:
        """Move the segment cursor to ``end`` (after a failed flush: the bytes stay used)."""
        self.cursor = end

    def room(self, nbytes: int) -> bool:
        """Whether an eager snapshot of ``nbytes`` fits below the slot's top."""
        return self.top - nbytes >= max(self.bottom, self.cursor)

    def take_top(self, nbytes: int) -> int:
        """Space for an eager snapshot at the slot's top: its offset, or -1 when full."""
        if self.slot is None or nbytes < 0:
            return -1  # no slot bound, or nothing to take
        top = (self.top - nbytes) & -_ALIGN
        tail = self._reserve_tail() if self.entries else 0
        if top >= max(self.cursor, self.bottom) + tail:
            self.top = self.slot.top = top
            return top
        return -1

    # -- destinations --------------------------------------------------------------------

    def remember(self, dst, fp, f, dtype, size, shape) -> None:
        """Cache a merged destination's geometry by identity (revalidated by ``fp(dst)``).

        Parameters
        ----------
        dst : array
            The destination (held by weak reference).
        fp : callable
            Returns a value that changes whenever ``dst``'s geometry may have. When
            it has ``__cucopy_view__`` (the view protocol, see :meth:`_view`), views
            of ``dst`` made afresh are read from their own attributes.
        f : tuple or None
            ``(ptr, rows, width, pitch)``, its 2-D form (None: it has none, and is
            cached only as the base of its views).
        dtype : numpy.dtype
        size : int
            Elements.
        shape : tuple of int
            Its shape (a source must fit it: :func:`fits_shape`).
        """
        try:  # by weak reference: the cache must not keep a user's device memory alive
            ref = weakref.ref(dst)
        except TypeError:
            return
        cache = self.dcache
        if len(cache) >= DCACHE_MAX:
            cache.clear()
        view = getattr(fp, "__cucopy_view__", None)
        vdtype = None
        if view is not None:
            vdtype = getattr(dst, view[7])
            self.vtypes[type(dst)] = view
        if f is None:
            cache[id(dst)] = (ref, fp, fp(dst), None, 0, 0, 0, dtype, size, 0, vdtype, shape)
            return
        ptr, rows, width, pitch = f
        kind = _KIND_H2D if rows == 1 else _KIND_H2D_2D
        cache[id(dst)] = (
            ref,
            fp,
            fp(dst),
            f,
            ptr,
            ptr + (rows - 1) * pitch + width,
            rows * width,
            dtype,
            size,
            kind,
            vdtype,
            tuple(shape),
        )

    def _view(self, dst):
        """The cache entry of a view of a cached array, read from its own attributes.

        The view protocol (a fingerprint function's ``__cucopy_view__``) is
        ``(base, ptr, ptr_call, shape, strides, strides_call, strides_in_elements,
        dtype, flags)``: the attribute naming the array a view is of, how to read
        its address, shape and strides, its dtype attribute (must equal the
        base's), and methods that must return False (torch's ``is_neg``). Returns
        None when ``dst`` is not such a view (the general path then resolves it).
        """
        view = self.vtypes.get(type(dst))
        if view is None:
            return None
        base_name, ptr_name, ptr_call, shape_name, st_name, st_call, elems, dt_name, flags = view
        base = getattr(dst, base_name, None)
        b = self.dcache.get(id(base)) if base is not None else None
        if b is None or b[0]() is not base or b[10] is None:
            return None
        try:
            if getattr(dst, dt_name) != b[10] or any(getattr(dst, m)() for m in flags):
                return None
            ptr = getattr(dst, ptr_name)
            ptr = ptr() if ptr_call else ptr
            shape = tuple(getattr(dst, shape_name))
            strides = getattr(dst, st_name)
            strides = tuple(strides() if st_call else strides)
        except Exception:
            return None
        dtype = b[7]
        if elems:
            strides = tuple(s * dtype.itemsize for s in strides)
        size = 1
        for n in shape:
            size *= n
        if size <= 0 or len(strides) != len(shape):
            return None
        f = _form(ptr, shape, strides, dtype.itemsize)
        if f is None or not _fits(*f[1:]):  # a field too wide for a descriptor
            return None
        ptr, rows, width, pitch = f
        kind = _KIND_H2D if rows == 1 else _KIND_H2D_2D
        hi = ptr + (rows - 1) * pitch + width
        return (None, None, None, f, ptr, hi, rows * width, dtype, size, kind, None, shape)

    def remember_src(self, src, fp, host, dtype) -> None:
        """Cache a host source that is not a NumPy array (a torch CPU tensor) by identity.

        Parameters
        ----------
        src : array
            The source (held by weak reference).
        fp : callable
            As for :meth:`remember`.
        host : numpy.ndarray
            A view of ``src``'s bytes; only a C-contiguous one is cached.
        dtype : numpy.dtype
        """
        if not host.flags.c_contiguous or not host.nbytes:
            return
        cache = self.scache
        key = id(src)

        def gone(ref, cache=cache, key=key):  # the source was collected: drop its entry
            ent = cache.get(key)
            if ent is not None and ent[0] is ref:
                del cache[key]

        try:
            ref = weakref.ref(src, gone)
        except TypeError:
            return
        if len(cache) >= DCACHE_MAX:
            cache.clear()
        cache[key] = (ref, fp, fp(src), _unowned(host), dtype)

    def forget(self) -> None:
        """Clear the destination and source caches."""
        self.dcache.clear()
        self.scache.clear()

    # -- staging -------------------------------------------------------------------------

    def _dst_entry(self, dst):
        """``dst``'s cache entry, still valid and with a 2-D form, or a fresh view's
        (``buf[:n]`` of a cached array, see :meth:`_view`); None otherwise."""
        ent = self.dcache.get(id(dst))
        if ent is None:
            return self._view(dst)
        try:  # an Exception from the fingerprint is a miss (the general path asks again)
            if ent[0]() is not dst or ent[1](dst) != ent[2] or ent[3] is None:
                return None
        except Exception:
            return None
        return ent

    def try_fill(self, site, dst, start, value, on_drop) -> int:
        """Stage a ``fill_tail`` on the fast path, or say :data:`MISS`.

        Taken for a merged FILL site (``fills``), a cached destination with a 2-D
        form and 1, 2, 4 or 8-byte elements of an integer dtype, an int ``start``
        inside it and an int ``value`` the dtype holds; the tail's descriptors are
        placed as the general path places them. A ``start`` at or past the end (an
        empty tail) passes the same checks and stages nothing. Anything else, an
        overlap with staged work and a full slot included, is the general path's.

        Returns
        -------
        int
            :data:`STAGED`, :data:`BARRIER`, :data:`SKIPPED` (an empty tail: the
            copier counts it skipped) or :data:`MISS`.
        """
        if (
            not self._fast
            or self.owner != thread_id()
            or site not in self.fills
            or type(start) is not int
            or type(value) is not int
            or (on_drop is not None and not callable(on_drop))
        ):
            return MISS
        ent = self._dst_entry(dst)
        if ent is None or not self._fast or self.owner != thread_id():
            return MISS
        dtype = ent[7]
        it = dtype.itemsize
        if dtype.kind not in "iu" or it not in (1, 2, 4, 8) or start < 0:
            return MISS
        if it > 1 and not dtype.isnative:
            return MISS  # the pattern below is little-endian: NumPy's for the general path
        bits = 8 * it
        lo_v, hi_v = (-(1 << (bits - 1)), 1 << (bits - 1)) if dtype.kind == "i" else (0, 1 << bits)
        if not lo_v <= value < hi_v:
            return MISS
        pattern = value & ((1 << bits) - 1)
        if start >= ent[8]:
            return SKIPPED  # an empty tail: nothing staged (the general path's skip)
        parts = _tail_blocks(ent[3], start, it)
        lo = parts[0][0]
        last = parts[-1]
        hi = last[0] + (last[1] - 1) * last[3] + last[2]
        descs = [(p[0], 0, pattern, p[3], 0, p[2], p[1], pack.KIND_FILL, it, 0) for p in parts]
        if self.seg < 0 and self.slot is not None:
            if self._capturing() or not self._fast:
                return MISS  # the general path refuses it (a capture began after begin())
            self._open()
        r = self.stage(site, on_drop, lo, hi, parts[0] if len(parts) == 1 else None, 0, descs)
        if not isinstance(r, tuple):
            return MISS  # FULL or ORDER: the general path notes the overflow or flushes
        r[0].value = (start, pattern.to_bytes(it, "little"))
        return BARRIER if site in self.barriers else STAGED

    def try_skip(self, site, dst, src) -> int:
        """Whether an ``unchanged=True`` H2D copy passes :meth:`try_h2d`'s checks.

        Returns
        -------
        int
            :data:`STAGED` when it does (the copier skips it), else :data:`MISS`
            (the general path validates it).
        """
        return self.try_h2d(site, dst, src, None, True)

    def try_h2d(self, site, dst, src, on_drop, skip=False) -> int:
        """Stage an H2D copy on the fast path, or say :data:`MISS`.

        Taken only for a merged site, a cached destination, and a C-contiguous
        host source of the same dtype and size, staged into the open segment with
        room and no overlap; anything else (and any bad input) is left to the
        copier's general path. ``fast`` must be set.

        Returns
        -------
        int
            :data:`STAGED`, :data:`BARRIER` (staged; the site is a barrier) or :data:`MISS`.
        """
        if (
            not self._fast
            or self.owner != thread_id()
            or site not in self.merge
            or (on_drop is not None and not callable(on_drop))
        ):
            return MISS
        ent = self._dst_entry(dst)
        if ent is None:
            return MISS
        if type(src) is not _ndarray:
            # a source seen before (a torch CPU tensor), still what it was
            s = self.scache.get(id(src))
            try:
                if s is None or s[0]() is not src or s[1](src) != s[2]:
                    return MISS
            except Exception:
                return MISS
            dtype, src = s[4], s[3]
        else:
            dtype = src.dtype
        if not self._fast or self.owner != thread_id():
            return MISS  # the code just run (a fingerprint) closed the copier or its step
        if self.seg < 0 and self.slot is not None:
            if self._capturing() or not self._fast:
                return MISS  # the general path refuses it (a capture began after begin())
            self._open()
        if dtype != ent[7] or src.size != ent[8] or not fits_shape(ent[11], src.shape):
            return MISS
        if skip:
            return STAGED
        if self.append_h2d(site, on_drop, ent[3], ent[4], ent[5], ent[6], ent[9], src):
            return BARRIER if site in self.barriers else STAGED
        return MISS

    def append_h2d(self, site, on_drop, f, lo, hi, nbytes, kind, host) -> bool:
        """Stage ``host``'s bytes into the open segment: the common case, kept lean.

        Returns False, having changed nothing, when there is no open segment, the
        bytes do not fit, they overlap anything staged, or ``host`` is not
        C-contiguous; the general path then takes the copy.
        """
        if self.seg < 0:
            return False
        reads = self.reads
        if reads.lo and reads.overlaps(lo, hi):
            return False
        descs = self.descs
        off = (self.cursor + 15) & -16
        grow = len(descs) + 2 - self.reserve
        if off + nbytes + (grow * _DESC + 16 if grow > 0 else 0) > self.top:
            return False
        try:  # a typed memoryview assignment is the cheapest byte copy from Python
            self.mv[off : off + nbytes] = host.data.cast("B")
        except (TypeError, ValueError, NotImplementedError, BufferError):
            return False
        # bytes written past the cursor change nothing until the cursor moves
        if not self.writes.claim(lo, hi):
            return False
        entries = self.entries
        ptr, rows, width, pitch = f
        index = len(descs)
        descs.append((ptr, off, 0, pitch, width, width, rows, kind, 0, 0))
        e = Entry(site, [on_drop] if on_drop is not None else None, lo, hi, index)
        e.geom = f
        if hi - lo > _BLOCK:
            self.wide = True  # the flush cuts it before encoding (pack.split)
        self.exact[(lo, hi)] = len(entries)
        entries.append(e)
        self.cursor = off + nbytes
        return True

    def _open(self) -> None:
        self.seg = pack.align(max(self.bottom, self.cursor), 256)
        self.data0 = pack.align(self.seg + _HEADER + self.reserve * _DESC)
        self.cursor = self.data0

    def _reserve_tail(self) -> int:
        """Bytes the descriptor table may still grow into past the reservation."""
        extra = len(self.descs) + 2 - self.reserve
        return extra * _DESC + _ALIGN if extra > 0 else 0

    def stage(self, site, on_drop, lo, hi, geom, nbytes, descs, h2d=False):
        """Reserve ``nbytes`` of data and place ``descs`` (a tuple, or a list of them).

        With ``h2d`` the descriptor's ``src`` field is set to the data's offset.

        Returns
        -------
        (Entry, int) or int
            The entry and the data's offset; :data:`FULL` when the slot cannot
            hold it; :data:`ORDER` when it overlaps staged work (flush, then
            stage again).
        """
        if self.seg < 0:
            self._open()
        n = len(descs) if isinstance(descs, list) else 1
        off = pack.align(self.cursor)
        grow = len(self.descs) + n + 1 - self.reserve
        if off + nbytes + (grow * _DESC + _ALIGN if grow > 0 else 0) > self.top:
            return FULL
        if h2d:
            d = descs
            descs = (d[0], off) + d[2:]
        e = self._place(site, on_drop, lo, hi, geom, descs)
        if e is None:
            return ORDER
        if nbytes:
            self.cursor = off + nbytes
        return e, off

    def _place(self, site, on_drop, lo, hi, geom, desc):
        """Append a descriptor (or a list of them); None if it overlaps staged work."""
        w = self.writes
        if self.entries and (w.overlaps(lo, hi) or self.reads.overlaps(lo, hi)):
            i = self.exact.get((lo, hi))
            if (
                i is not None
                and geom is not None
                and not isinstance(desc, list)
                and self.entries[i].geom == geom
                and not self.reads.overlaps(lo, hi)
            ):
                # the same destination again: the later copy replaces the staged one
                e = self.entries[i]
                old = e.index
                if isinstance(old, int) and self.descs[old][7] != _KIND_D2D:
                    self.descs[old] = desc
                    if on_drop is not None:
                        e.on_drop = (e.on_drop or []) + [on_drop]
                    self._count(e.site)  # the superseded copy
                    e.site = site  # counted at flush
                    return e
            return None
        n = len(self.descs)
        if isinstance(desc, list):
            self.descs.extend(desc)
            index = list(range(n, n + len(desc)))
        else:
            self.descs.append(desc)
            index = n
        e = Entry(site, [on_drop] if on_drop is not None else None, lo, hi, index)
        e.geom = geom
        if hi - lo > _BLOCK:
            self.wide = True
        self.entries.append(e)
        w.add(lo, hi)
        self.exact[(lo, hi)] = len(self.entries) - 1
        return e

    def add_read(self, lo: int, hi: int) -> None:
        """Record a staged D2D copy's source range."""
        self.reads.add(lo, hi)

    def overlaps(self, lo: int, hi: int, reads: bool = True) -> bool:
        """Whether ``[lo, hi)`` overlaps a staged destination (or, with ``reads``, source)."""
        if not self.entries:
            return False
        return self.writes.overlaps(lo, hi) or (reads and self.reads.overlaps(lo, hi))

    def desc(self, i: int) -> tuple:
        """Descriptor ``i`` of the open segment, in :data:`pack.DESC_DTYPE` field order."""
        return self.descs[i]

    @property
    def staged(self) -> int:
        """Copies staged in the open segment."""
        return len(self.entries)

    # -- cut, encode, finish ---------------------------------------------------------------

    def flush_carried(self, launcher, stream: int, inline_max: int, device_base: int):
        """:meth:`cut`, then launch the segment carried through ``launcher`` when it fits.

        ``launcher`` is the compiled carried launch (a capsule from the CUDA backend's
        ``carried_launcher()``), which only the compiled twin can call: this one never
        launches and returns :meth:`cut`'s tuple, so the caller lands the segment
        through its own path (the same bytes and launch as the compiled twin's).

        Parameters
        ----------
        launcher : object
            The capsule.
        stream : int
            The raw stream to launch on.
        inline_max : int
            The largest segment a launch may carry (bytes).
        device_base : int
            The device address of the slot's first byte.

        Returns
        -------
        int or tuple
            The bytes carried when the launch went through; otherwise ``(seg, end,
            nblocks, ndesc)`` as :meth:`cut` returns.
        """
        return self.cut(inline_max)

    def cut(self, inline_max: int) -> tuple:
        """Encode the open segment's header and descriptors into the slot.

        Wide descriptors are cut (:func:`pack.split`) when the longer table fits,
        and the data moves when the table outgrew its reservation, or, for a
        segment an inline launch may carry whole (``<= inline_max`` bytes), to
        close the gap a larger reservation left.

        Returns
        -------
        tuple
            ``(seg, end, nblocks, ndesc)``: the segment's slot offset and end, the
            launch's block count and the descriptor count.
        """
        slot = self.slot
        descs = self.descs
        seg, data0, end = self.seg, self.data0, pack.align(self.cursor)
        shift = 0
        top = self.top
        if self.wide:  # a destination wider than one block was staged: cut first
            pieces = pack.split(descs)
            grow = pack.align(seg + _HEADER + len(pieces) * _DESC)
            if end + max(0, grow - data0) <= top:
                descs = pieces
        while True:
            n = len(descs)
            need0 = pack.align(seg + _HEADER + n * _DESC)
            # > 0: the table outgrew its reservation, move the data up. < 0: space
            # reserved for a larger step's table lies between table and data; an
            # inline launch would carry it, so close the gap (a move of at most the
            # carry limit); other launches do not carry it, so leave it.
            move = need0 - data0
            if move < 0 and not (end - seg + move <= inline_max):
                move = 0
            if move:
                slot.array[need0 : end + move] = slot.array[data0:end].copy()
                end += move
                shift += move
                data0 = need0
            # H2D rows carry slot offsets; the wire format wants segment offsets
            nblocks = pack.encode(self.mv[seg:data0], descs, data0 - seg, end - seg, shift - seg)
            if nblocks == n:
                break
            # a descriptor spans several blocks: cut it so that block b runs
            # descriptor b (the carried kernel then searches no table), if the
            # longer table fits below the slot's eager snapshots
            pieces = pack.split(descs)
            grow = pack.align(seg + _HEADER + len(pieces) * _DESC)
            if len(pieces) == n or end + max(0, grow - data0) > top:
                break
            descs = pieces
        self.reserve = max(self.reserve, n)
        self.peak = max(self.peak, n)
        self.cursor = end
        return seg, end, nblocks, n

    def finish(self) -> None:
        """The cut segment was launched: count its copies, close it."""
        end = self.cursor
        self.bottom = self.slot.bottom = end
        for e in self.entries:
            self._count(e.site)
        self.reset()

    def _count(self, site) -> None:
        self.counts[site] = self.counts.get(site, 0) + 1

    def fold(self) -> dict:
        """Merged copies per site since the last fold; the counts restart at 0."""
        out, self.counts = {k: v for k, v in self.counts.items() if v}, {}
        return out

    def fold_eager(self) -> dict:
        """Eager copies counted here: none (the copier counts its own eager copies; the
        compiled segment counts those its compiled copy issues)."""
        return {}

    def set_eager(self, site_type, h2d) -> None:
        """Which sites the compiled copy issues eagerly itself; nothing here (the
        copier's Python path issues every eager copy)."""

    def reset(self) -> list:
        """Close the open segment without landing it; returns its entries (for ``on_drop``)."""
        entries = self.entries
        self.wide = False
        self.descs = []
        self.entries = []
        self.writes.clear()
        self.reads.clear()
        self.exact.clear()
        self.seg = -1
        return entries


IMPLEMENTATION = "python"
Segment = PySegment


def _unowned(host):
    """``host``'s bytes as an array that holds no reference to their owner.

    A cached source's entry must not keep the caller's tensor alive (a fresh input
    each step would pile up); it is read only while its weak reference still names
    the source, whose bytes are then alive at the address its fingerprint still gives.
    """
    raw = (ctypes.c_char * host.nbytes).from_address(host.ctypes.data)
    return np.frombuffer(raw, dtype=host.dtype).reshape(host.shape)


_thread_ids = itertools.count(1)
_thread_local = threading.local()


def py_thread_id() -> int:
    """The calling thread's id for step ownership (the twin of ``_segment.thread_id``).

    Unlike :func:`threading.get_ident`, which CPython hands to a new thread once the
    old one has ended, this id is never reused: a step left open by a thread that
    died is never taken to be a new thread's.
    """
    try:
        return _thread_local.id
    except AttributeError:
        i = _thread_local.id = next(_thread_ids)
        return i


#: the calling thread's id for step ownership (compiled with the compiled segment)
thread_id = py_thread_id

#: ``DeviceCopier.copy``'s compiled fast path (None with the pure-Python segment)
FastCopy = None
#: ``cucopy.copy``'s compiled routing to the active copier (None with the pure-Python segment)
FastRoute = None
#: ``cucopy.ring.WindowMax``'s compiled twin (None with the pure-Python segment)
WindowMax = None
#: ``cucopy.ring.PySlotCore`` and ``PyRingCore``'s compiled twins (None with the pure-Python segment)
SlotCore = None
RingCore = None
#: ``cucopy.copier.PyCopierCore`` and ``PyStepCore``'s compiled twins (None with the
#: pure-Python segment)
CopierCore = None
StepCore = None
#: ``cucopy.copier._PyActivation``'s compiled twin (None with the pure-Python segment)
Activation = None
#: the calling thread's current Context's address, which the compiled step records
#: (``cucopy.copier._step_copier``; None with the pure-Python segment)
context_id = None
#: sets the compiled core's check-mode flag (None with the pure-Python segment)
set_check_mode = None
#: ``cucopy.buffer._PyUpdateCore``'s compiled twin (None with the pure-Python segment)
UpdateCore = None
#: ``cucopy.guard.HostGuard``'s and ``_Use``'s compiled bases (None: plain classes)
GuardCore = None
UseCore = None
if not os.environ.get("CUCOPY_PURE_PYTHON"):
    try:
        from . import _segment as _compiled
    except ImportError:
        # pip hides a build's warnings: say it here, once, where a user sees it
        import logging

        logging.getLogger("cucopy").warning(
            "cucopy: the compiled staging core (cucopy._segment) is not built; using the "
            "pure-Python staging path: same results, more host time per copy. Reinstall "
            "cucopy where a C compiler is present (from a checkout: pip install .), or set "
            "CUCOPY_PURE_PYTHON=1 to choose the pure-Python path and silence this."
        )
    else:
        Segment = _compiled.Segment
        FastCopy = _compiled.FastCopy
        FastRoute = _compiled.FastRoute
        WindowMax = _compiled.WindowMax
        SlotCore = _compiled.SlotCore
        RingCore = _compiled.RingCore
        CopierCore = _compiled.CopierCore
        StepCore = _compiled.StepCore
        Activation = _compiled.Activation
        thread_id = _compiled.thread_id
        context_id = _compiled._context_id
        set_check_mode = _compiled._set_check_mode
        UpdateCore = _compiled.UpdateCore
        GuardCore = _compiled.GuardCore
        UseCore = _compiled.UseCore
        IMPLEMENTATION = "compiled"
