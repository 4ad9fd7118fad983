"""DeviceCopyBuffer: an owner's record of what its persistent device buffer holds.

The copier decides *when* a copy lands (the plan); the owner of a buffer
decides *whether* the copy is needed at all. :class:`DeviceCopyBuffer` is that
owner-side record: it remembers the bytes its last issued copy wrote and
passes ``unchanged=True`` to :func:`cucopy.copy` when a new update would write
the same bytes again. Every copy goes through :func:`cucopy.copy` /
:func:`cucopy.fill_tail`, so through the active copier if there is one.

A record never claims bytes that did not land: it is dropped *before* its copy
is issued and set only after the call returned, a merged copy discarded with
its pack drops every record (``on_drop=self.invalidate``), and any write
through the buffer that overlaps another record trims or drops that record.
"""

from __future__ import annotations

import weakref

import numpy as np

from . import _layout, check
from . import copier as _copier
from . import segment as _segment
from .adapters import ArrayInfo, fingerprint_fn, readonly_hint, resolve
from .sites import CopySite, Direction

__all__ = ["DeviceCopyBuffer", "routing_copier", "is_capturing"]

# A view whose layout needs more 2-D blocks than this is tracked by its byte
# extent (conservative: it may drop records it does not really touch).
_MAX_BLOCKS = 8

# how check mode reports a record-only buffer's skip (see check.verify_unchanged)
_SKIPPED = {"count": False, "what": "skipped upload into"}


def routing_copier(dst):
    """The copier that ``cucopy.copy(site, dst, ...)`` would use right now.

    The active copier (see :meth:`DeviceCopier.activate
    <cucopy.DeviceCopier.activate>`) if there is one, else the plan-less copier
    on ``dst``'s device and its array library's current stream.

    Parameters
    ----------
    dst : array
        A device array.

    Returns
    -------
    DeviceCopier
    """
    c = _copier.active_copier()
    return c if c is not None else _copier._plain_copier(dst)


def is_capturing(dst) -> bool:
    """Whether a copy into ``dst`` issued now would be captured into a CUDA graph.

    Parameters
    ----------
    dst : array
        A device array.

    Returns
    -------
    bool
        True while the stream of :func:`routing_copier` is capturing.
    """
    c = routing_copier(dst)
    return c.backend.is_capturing(c.stream)


# -- byte regions ---------------------------------------------------------------------------
#
# A region is a list of 2-D forms ``(ptr, rows, width, pitch)`` (see _layout.form):
# the exact bytes a write touches, or one contiguous form over its extent when
# the layout is too irregular to list.


def _region(ptr, shape, strides, itemsize, start=0) -> list:
    """The bytes of elements ``start:`` of a view, in C order."""
    if start == 0:
        f = _layout.form(ptr, shape, strides, itemsize)
        if f is not None:
            return [f]
    blocks = _layout.blocks(ptr, shape, strides, itemsize)
    if len(blocks) <= _MAX_BLOCKS:
        out = []
        skip = start
        for blk in blocks:
            count = blk[1] * blk[2] // itemsize
            if skip >= count:
                skip -= count
                continue
            out.extend(_layout.tail_blocks(blk, skip, itemsize) if skip else [blk])
            skip = 0
        return out
    lo, hi = _layout.extent(ptr, shape, strides, itemsize)
    return [(lo, 1, hi - lo, hi - lo)]


def _first_in(f, a: int, b: int):
    """The lowest byte of form ``f`` in ``[a, b)``, or None."""
    ptr, rows, width, pitch = f
    r = max(0, (a - ptr - width) // pitch + 1)
    if r >= rows:
        return None
    x = max(a, ptr + r * pitch)
    return x if x < b else None


def _last_in(f, a: int, b: int):
    """The highest byte of form ``f`` in ``[a, b)``, or None."""
    ptr, rows, width, pitch = f
    r = min(rows - 1, (b - 1 - ptr) // pitch)
    if r < 0:
        return None
    x = min(b - 1, ptr + r * pitch + width - 1)
    return x if x >= a else None


def _forms_overlap(f, g) -> bool:
    if f[1] == 1:
        return _first_in(g, f[0], f[0] + f[2]) is not None
    if g[1] == 1:
        return _first_in(f, g[0], g[0] + g[2]) is not None
    fp, fr, fw, p = f
    gp, gr, gw, q = g
    if p != q:  # different pitches: compare extents (conservative)
        return fp < gp + (gr - 1) * q + gw and gp < fp + (fr - 1) * p + fw
    # row i of f meets row j of g when d + k*p lies in (-gw, fw), k = j - i
    d = gp - fp
    kmin = max(-(fr - 1), (-gw - d) // p + 1)
    kmax = min(gr - 1, -((d - fw) // p) - 1)
    return kmin <= kmax


def _overlap(r1, r2) -> bool:
    return any(_forms_overlap(f, g) for f in r1 for g in r2)


# -- records --------------------------------------------------------------------------------


class _PyUpdateCore:
    """A record's fields update()'s fast path reads (twin of ``cucopy._segment.UpdateCore``,
    whose typed fields the compiled fast path reads without a look-up)."""

    __slots__ = ("data", "owned")


_UpdateCore = _segment.UpdateCore or _PyUpdateCore


class _Update(_UpdateCore):  # type: ignore[misc,valid-type]
    """What an issued update wrote: ``data`` (uint8) at ``region``.

    ``owned``: ``data`` is a private copy this buffer made (never the caller's
    memory), so :meth:`DeviceCopyBuffer.update`'s fast path may overwrite it in
    place with the next upload of as many bytes.
    """

    __slots__ = ("region", "base")

    def __init__(self, data, owned, region, base):
        self.data = data
        self.region = region
        self.base = base  # prefix records: first byte of the storage; None for views
        self.owned = owned

    def after_write(self, region, itemsize) -> bool:
        """Account for a write over ``region``; False when the record is gone."""
        if not _overlap(self.region, region):
            return True
        if self.base is None:
            return False
        a, b = self.base, self.base + self.data.nbytes
        firsts = [x for f in region if (x := _first_in(f, a, b)) is not None]
        if not firsts:
            return True
        keep = (min(firsts) - a) // itemsize * itemsize
        if keep <= 0:
            return False
        self.data = self.data[:keep]
        self.owned = False
        self.region = [(a, 1, keep, keep)]
        return True


class _Fill:
    """What an issued tail fill wrote: ``pattern`` over elements ``start:``.

    ``start`` and ``dense`` count elements of the filled view, whose element size
    (``len(pattern)``) may differ from the buffer's.
    """

    __slots__ = ("start", "pattern", "region", "dense")

    def __init__(self, start, pattern, region, dense):
        self.start = start
        self.pattern = pattern
        self.region = region
        self.dense = dense  # (ptr, size) when the filled view is contiguous, else None

    def after_write(self, region, itemsize) -> bool:
        if not _overlap(self.region, region):
            return True
        if self.dense is None:
            return False
        # the view's elements, not the buffer's (``itemsize``): a fill through an
        # int32 view of an int8 buffer counts 4-byte elements
        itemsize = len(self.pattern)
        ptr, size = self.dense
        a, b = ptr + self.start * itemsize, ptr + size * itemsize
        lasts = [x for f in region if (x := _last_in(f, a, b)) is not None]
        if not lasts:
            return True
        self.start = (max(lasts) - ptr) // itemsize + 1
        if self.start >= size:
            return False
        a = ptr + self.start * itemsize
        self.region = [(a, 1, b - a, b - a)]
        return True


class _Name:
    """Stands in for a site in messages about a record-only buffer."""

    __slots__ = ("label",)

    def __init__(self, label: str):
        self.label = label

    def __repr__(self) -> str:
        return self.label


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Byte equality (so -0.0 differs from 0.0 and a NaN equals itself)."""
    if a.nbytes != b.nbytes:
        return False
    # small: bytes compare is ~10x faster than array_equal; large: avoids two copies
    return a.tobytes() == b.tobytes() if a.nbytes <= 4096 else bool(np.array_equal(a, b))


def _short(x) -> str:
    """``repr(x)``, cut short for a message."""
    r = repr(x)
    return r if len(r) <= 60 else r[:57] + "..."


def _bytes(arr: np.ndarray) -> np.ndarray:
    """C-order bytes of ``arr`` as a flat uint8 array (a view when already contiguous)."""
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8)


# -- update()'s fast path -------------------------------------------------------------------
#
# The steady state of an engine's loop: a NumPy array of the buffer's dtype, C-contiguous,
# written as a prefix (no view, no key, not forced) through the active copier in a step
# that may take the segment's fast path (open, not capturing, not in check mode: the
# capture and check state begin() saw). There update() is one record lookup and one byte
# compare; a skip is counted by a per-copier SkipCounts, folded into
# copier.stats.sites[site].skipped when read. A changed update of as many bytes as the
# record holds is staged through the segment's try_h2d and overwrites the record's own
# copy in place. Anything else takes the general path (DeviceCopyBuffer._update), which
# is the definition: the fast path gives the same results and the same counters.
#
# The compiled twin (cucopy._segment: BufferCore, SkipCounts, FastUpdate) does the same
# with no Python frame; the classes below are its reference, used when the segment is
# the pure-Python one (CUCOPY_PURE_PYTHON=1, or no compiler).


class _PrefixSlot:
    """The record slot of prefix updates without a key: a singleton whose hash is its
    identity's (the compiled update looks it up in the records on every call; a tuple's
    hash would be computed afresh each time)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<prefix>"


_PREFIX = _PrefixSlot()


class _PyBufferCore:
    """The fields update()'s fast path reads (twin of ``cucopy._segment.BufferCore``).

    ``_fsite`` is the buffer's site when it is an H2D site (else None: no fast path),
    ``_fdtype``, ``_fitem`` and ``_fsize`` its dtype, element size and element count,
    ``_updates`` and ``_fills`` its records, ``_pn`` and ``_pdst`` the last prefix
    made (``_prefix``), ``_froute`` ``(weakref to a copier, its SkipCounts, its
    segment)`` once a prefix update through that active copier went through the
    general path (so the copier takes this buffer's destination), else None.
    """

    __slots__ = (
        "_fsite",
        "_fdtype",
        "_fitem",
        "_fsize",
        "_updates",
        "_fills",
        "_pn",
        "_pdst",
        "_froute",
    )


class _PySkipCounts:
    """Skips a copier's buffers counted on the fast path (twin of ``_segment.SkipCounts``)."""

    __slots__ = ("counts",)

    def __init__(self):
        self.counts: dict = {}

    def count(self, site) -> None:
        """Count one more skip of ``site``."""
        self.counts[site] = self.counts.get(site, 0) + 1

    def fold(self) -> dict:
        """Skips per site since the last fold; the counts restart at 0."""
        out, self.counts = self.counts, {}
        return out


def _py_fast_update(buf, host, exact) -> bool | None:
    """update()'s fast path; None: not taken (the general path runs, nothing changed)."""
    route = buf._froute
    if route is None:
        return None
    c = _copier._active.get()
    if c is None or route[0]() is not c:
        return None
    seg = route[2]
    if type(seg) is not _segment.PySegment or not seg._fast or seg.owner != _segment.thread_id():
        return None
    if type(host) is np.ndarray:
        if not host.flags.c_contiguous:
            return None
        arr = host
    else:  # a source the segment knows (a torch CPU tensor), still what it was
        ent = seg.scache.get(id(host))
        try:  # an Exception from the fingerprint is a miss, as in the segment
            if ent is None or ent[0]() is not host or ent[1](host) != ent[2]:
                return None
        except Exception:
            return None
        if not seg._fast or seg.owner != _segment.thread_id():
            return None  # the fingerprint closed the copier or ended its step
        arr = ent[3]
    dtype = buf._fdtype
    if arr.dtype is not dtype and arr.dtype != dtype:
        return None
    n = arr.size
    if not 0 < n <= buf._fsize:
        return None
    updates = buf._updates
    rec = updates.get(_PREFIX)
    if rec is None:
        return None
    have = rec.data
    nb = n * buf._fitem
    hn = have.nbytes
    data = arr.reshape(-1).view(np.uint8)
    if (hn == nb or (hn > nb and not exact)) and _equal(have[:nb], data):
        route[1].count(buf._fsite)
        return False
    if (
        hn != nb
        or not rec.owned
        or arr.ndim != 1
        or len(updates) != 1
        or buf._fills
        or buf._pn != n
    ):
        return None
    site = buf._fsite
    r = seg.try_h2d(site, buf._pdst, host, buf.invalidate)
    if r == _segment.STAGED:
        have[:] = data  # the record now holds what was staged
        return True
    if r == _segment.BARRIER:
        del updates[_PREFIX]  # as the general path: no record while the barrier flushes
        have[:] = data
        c._after_barrier(site)
        updates[_PREFIX] = rec
        return True
    return None


_Core = _PyBufferCore
_SkipCounts = _PySkipCounts
_FastUpdate = None
#: which update() fast path runs: "compiled" or "python" (follows cucopy.segment)
IMPLEMENTATION = "python"
if _segment.IMPLEMENTATION == "compiled":
    try:
        from ._segment import BufferCore as _Core
        from ._segment import FastUpdate as _FastUpdate
        from ._segment import SkipCounts as _SkipCounts
    except ImportError:  # an extension built from older sources: the Python twin runs
        _Core, _SkipCounts, _FastUpdate = _PyBufferCore, _PySkipCounts, None
    else:
        IMPLEMENTATION = "compiled"

# a copier's SkipCounts, made the first time a buffer learns the route to it
_skip_counts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _forget_route(bref):
    """A weakref callback: the copier died, so its buffer drops the route (and segment)."""

    def forget(ref):
        buf = bref()
        if buf is not None and buf._froute is not None and buf._froute[0] is ref:
            buf._froute = None

    return forget


def _counts_of(c):
    counts = _skip_counts.get(c)
    if counts is None:
        counts = _SkipCounts()
        c.stats.pending_skipped.append(counts.fold)
        _skip_counts[c] = counts
    return counts


class DeviceCopyBuffer(_Core):
    """Skip-if-unchanged uploads into a persistent device buffer, routed through a site.

    Parameters
    ----------
    tensor : array
        The device buffer (torch, CuPy, sim, ``__cuda_array_interface__`` or
        ``__dlpack__``; not JAX: JAX arrays are immutable).
    site : CopySite or None
        An ``H2D`` site for :meth:`update` (or a ``FILL`` site for a buffer that
        is only filled). None makes a *record-only* buffer for an owner that
        writes the buffer through its own path: :meth:`update` then never
        copies, it answers whether the owner must.
    pin_memory : bool
        Accepted for compatibility with the engine this API comes from, where
        each buffer kept a pinned host mirror. It changes nothing here: the
        copier snapshots every host source into its pinned ring (merged copies
        into the pack, eager ones into the slot), so a pinned array per owner
        would only add a copy. Non-NumPy inputs are converted with
        :func:`numpy.ascontiguousarray`.
    snapshot : bool
        True: the record keeps a private copy of the bytes last issued, so the
        caller may reuse its host array. False: the caller promises never to
        mutate an array after passing it, and the record keeps a reference
        (no copy). The bytes that *land* are always the call's bytes; this only
        concerns what the record compares against.

    Notes
    -----
    Records are keyed by ``(key, geometry)``. ``view=None`` updates write the
    first ``n`` elements of the flattened buffer; their record is keyed by
    ``key`` alone and compared by prefix (a shorter update equal to the start
    of the record is unchanged). ``view=`` updates write the whole view; the
    geometry is the view's byte offset in the storage, shape, strides and
    dtype, and the values must match exactly. A write through this buffer
    trims or drops every other record it overlaps, so two keys (or views)
    skip each other's uploads only when they write disjoint bytes.

    During CUDA graph capture every update and fill is issued and no record
    is kept (existing ones are dropped): the graph re-runs the copy at each
    replay, re-reading its host source. So a captured update needs the caller's
    own pinned, contiguous array (values this buffer would have to convert are
    refused), and a ``fill_tail`` through an ``H2D`` site is refused (its tail
    would be an array of the buffer's making): fill through a ``FILL`` site. A
    replay that writes this buffer changes it behind the record, so call
    :meth:`invalidate` after such a replay, or give the graph's copies a buffer
    of their own.

    The record knows only writes made through this object. Anything else that
    writes the buffer must be followed by :meth:`invalidate`; check mode
    (``CUCOPY_CHECK=1``) catches the skips that would otherwise go wrong.

    Host cost: :meth:`update` has a fast path for the steady state of an
    engine's loop: a NumPy array of the buffer's dtype, C-contiguous, written as
    a prefix (no ``view``, ``key`` or ``force``) through the active copier
    inside a step (not capturing, not in check mode, the state ``begin()`` saw)
    on a site the copier merges, once one such update went through the general
    path. An unchanged update is then one record lookup and one byte compare; a
    changed one of the record's length is staged as ``copier.copy`` stages it
    and copied into the record. Anything else takes the general path, with the
    same results and counters.
    """

    def __init__(
        self, tensor, *, site: CopySite | None, pin_memory: bool = True, snapshot: bool = True
    ):
        if site is not None:
            direction = getattr(site, "direction", None)
            if not isinstance(site, CopySite) or direction is None:
                raise TypeError(f"site: expected a CopySite member or None, got {site!r}")
            if direction is Direction.D2D:
                raise ValueError(
                    f"{site.label}: a DeviceCopyBuffer uploads host values; it takes "
                    "an H2D site (or a FILL site, or None), got a D2D site"
                )
        self.site = site
        self._label = site.label if site is not None else "DeviceCopyBuffer(record-only)"
        info = resolve(tensor)
        if info.device is None:
            raise ValueError(
                f"{self._label}: the buffer must be device memory, got host memory {info.label}"
            )
        if info.readonly:
            raise TypeError(f"{self._label}: {readonly_hint(info.label)}")
        self.tensor = tensor
        self._info = info
        self.pin_memory = bool(pin_memory)
        self.snapshot = bool(snapshot)
        self._it = info.dtype.itemsize
        self._lo, self._hi = _layout.extent(info.ptr, info.shape, info.strides, self._it)
        self._dense = _layout.form(info.ptr, info.shape, info.strides, self._it)
        if self._dense is not None and self._dense[1] != 1:
            self._dense = None
        self._flat = None
        self._pn, self._pdst = 0, None  # the last prefix made (_prefix)
        self._updates: dict = {}
        self._fills: dict = {}
        # update()'s fast path (see _py_fast_update)
        self._fsite = site if site is not None and site.direction is Direction.H2D else None
        self._fdtype = info.dtype
        self._fitem = self._it
        self._fsize = info.size
        self._froute = None
        self._name = _Name(self._label)  # names a record-only buffer in check-mode errors

    # -- properties -----------------------------------------------------------------------

    @property
    def dtype(self) -> np.dtype:
        """The buffer's dtype."""
        return self._info.dtype

    @property
    def size(self) -> int:
        """Elements in the buffer."""
        return self._info.size

    @property
    def records(self) -> int:
        """Update and fill records held now."""
        return len(self._updates) + len(self._fills)

    def __repr__(self) -> str:
        return (
            f"DeviceCopyBuffer({self._label}, {self._info.label}, "
            f"records={self.records}, snapshot={self.snapshot})"
        )

    # -- records ----------------------------------------------------------------------------

    def invalidate(self) -> None:
        """Forget every record: the next update or fill is issued."""
        self._updates.clear()
        self._fills.clear()

    def _written(self, region) -> None:
        """Trim or drop the records a write over ``region`` changes."""
        it = self._it
        for table in (self._updates, self._fills):
            for slot in [s for s, r in table.items() if not r.after_write(region, it)]:
                del table[slot]

    # -- targets ----------------------------------------------------------------------------

    def _prefix(self, n: int):
        """The first ``n`` elements of the flattened buffer, as the tensor's own library's view."""
        if self._pn == n:
            return self._pdst
        if self._dense is None:
            raise ValueError(
                f"{self._label}: update(view=None) writes a prefix of the flattened "
                f"buffer, which needs a contiguous buffer; {self._info.label} is "
                "not: pass view="
            )
        if self._flat is None:
            flat = None
            reshape = getattr(self.tensor, "reshape", None)
            if reshape is not None:
                flat = reshape(-1)
                fi = resolve(flat)
                if fi.ptr != self._info.ptr or fi.shape != (self.size,):
                    flat = None
            self._flat = flat if flat is not None else False
        if self._flat is False:
            # no library view: describe the prefix directly (generic objects have
            # no current stream of their own, so nothing is lost)
            info = self._info
            v = ArrayInfo(
                info.ptr,
                (n,),
                (self._it,),
                info.dtype,
                device=info.device,
                obj=self.tensor,
                label=f"{info.label}[:{n}]",
            )
        else:
            v = self._flat[:n]
        self._pn, self._pdst = n, v
        return v

    def _view(self, view):
        """Resolve and validate ``view``; returns ``(info, geometry)``."""
        try:
            v = resolve(view)
        except TypeError as exc:
            raise TypeError(f"{self._label}: view: {exc}") from None
        dev = self._info.device
        if v.device is None or not (v.device is dev or v.device == dev):
            raise ValueError(f"{self._label}: view {v.label} is not on the buffer's device")
        lo, hi = _layout.extent(v.ptr, v.shape, v.strides, v.dtype.itemsize)
        if v.size and not (self._lo <= lo and hi <= self._hi):
            raise ValueError(
                f"{self._label}: view {v.label} (bytes [{lo:#x}, {hi:#x})) is not a "
                f"view of this buffer's storage {self._info.label} (bytes "
                f"[{self._lo:#x}, {self._hi:#x}))"
            )
        if v.readonly:
            raise TypeError(f"{self._label}: {readonly_hint(v.label)}")
        return v, (v.ptr - self._info.ptr, v.shape, v.strides, v.dtype.str)

    def _host(self, host, dtype):
        """``host`` as a NumPy array of ``dtype``, and whether it is the caller's memory."""
        if isinstance(host, np.ndarray):
            arr = host
        else:
            try:
                info = resolve(host)
            except TypeError:
                info = None
            if info is None:
                try:
                    raw = np.asarray(host)
                    if raw.dtype.kind in "USV":
                        raise TypeError("not numbers")
                    if raw.dtype.kind == "c" and dtype.kind != "c":
                        raise TypeError("complex values into a real dtype")
                    arr = raw.astype(dtype) if raw.dtype != dtype else raw
                except (TypeError, ValueError, OverflowError) as exc:
                    raise ValueError(
                        f"{self._label}: values {host!r} do not convert to {dtype} ({exc})"
                    ) from None
                if (
                    dtype.kind in "biu"
                    and raw.dtype.kind in "biuf"
                    and not np.array_equal(arr, raw)
                ):
                    raise ValueError(f"{self._label}: values {host!r} do not fit dtype {dtype}")
                out = np.ascontiguousarray(arr)
                # a buffer-protocol object (array.array, memoryview) is read in place:
                # then it is the caller's memory, which the record must not alias
                return out, not out.flags.owndata
            if info.device is not None:
                raise ValueError(
                    f"{self._label}: update takes host values, got device array {info.label}"
                )
            if info.host is None:
                raise TypeError(f"{self._label}: cannot read host values from {info.label}")
            arr = info.host
        if arr.dtype != dtype:
            raise TypeError(
                f"{self._label}: dtype mismatch: host values are {arr.dtype} "
                f"(shape {arr.shape}), the buffer is {dtype} ({self._info.label})"
            )
        return arr, True

    # -- update ---------------------------------------------------------------------------------

    def _update(self, host, force=False, view=None, key=None, exact=False) -> bool:
        """:meth:`update` past its fast path: the definition of what an update does."""
        if self.site is not None and self.site.direction is not Direction.H2D:
            raise ValueError(
                f"{self._label}: update() needs an H2D site; this buffer's site is "
                f"{self.site.direction.name}"
            )
        if view is None:
            arr, borrowed = self._host(host, self._info.dtype)
            n = arr.size
            if n > self.size:
                raise ValueError(
                    f"{self._label}: {n} values do not fit the buffer's {self.size} "
                    f"elements ({self._info.label})"
                )
            if n == 0:
                return False
            dst = self._prefix(n)
            src = arr if arr.ndim == 1 else arr.reshape(-1)  # a prefix is flat
            base = self._info.ptr
            region = [(base, 1, n * self._it, n * self._it)]
            slot = _PREFIX if key is None else (key, None)
        else:
            v, geom = self._view(view)
            arr, borrowed = self._host(host, v.dtype)
            n = arr.size
            if n != v.size:
                raise ValueError(
                    f"{self._label}: {n} values for view {v.label} of {v.size} "
                    "elements (a view is written as a whole)"
                )
            if n == 0:
                return False
            dst, src = view, arr
            base = None
            region = _region(v.ptr, v.shape, v.strides, v.dtype.itemsize)
            slot = (key, geom)
        data = _bytes(arr)
        if is_capturing(dst):
            if self.site is not None and not (borrowed and np.may_share_memory(src, arr)):
                # the copier's own "must be pinned" error would name an array the
                # caller never saw
                raise ValueError(
                    f"{self._label}: update() during graph capture needs the caller's own "
                    f"pinned, contiguous host array (the graph re-reads it at every "
                    f"replay); values {_short(host)} became a copy this buffer made"
                )
            self.invalidate()
            if self.site is None:
                return True
            return _copier.copy(self.site, dst, src)
        rec = self._updates.get(slot)
        same = False
        if rec is not None and not force:
            have = rec.data
            if base is None or exact:
                same = _equal(have, data)
            else:
                same = have.nbytes >= data.nbytes and _equal(have[: data.nbytes], data)
        if self.site is None:
            if same:
                if check.CHECK_MODE:
                    # in program order: the owner's own copy may still be staged
                    d = resolve(dst)
                    check.verify_unchanged(
                        routing_copier(dst), self._name, d, resolve(src), None, **_SKIPPED
                    )
                return False
            self._updates.pop(slot, None)
            self._written(region)
            self._updates[slot] = _Update(*self._own(arr, data, borrowed), region=region, base=base)
            return True
        if same:
            _copier.copy(self.site, dst, src, unchanged=True, on_drop=self.invalidate)
            if slot is _PREFIX:
                self._learn_route(host, arr, borrowed)
            return False
        # drop first: a copy that raises leaves no record claiming its bytes
        self._updates.pop(slot, None)
        self._written(region)
        issued = _copier.copy(self.site, dst, src, on_drop=self.invalidate)
        if issued:
            self._updates[slot] = _Update(*self._own(arr, data, borrowed), region=region, base=base)
        if slot is _PREFIX:
            self._learn_route(host, arr, borrowed)
        return issued

    def update(self, host, force: bool = False, view=None, key=None, exact: bool = False) -> bool:
        """Write ``host`` into the buffer unless it already holds those values.

        Parameters
        ----------
        host : array_like
            Host values: a NumPy array (or a host array of another library) of
            the destination's dtype, or a sequence converted to it.
        force : bool
            Issue even when the record says the values are unchanged.
        view : array, optional
            A view of the buffer's storage to write as a whole (e.g.
            ``buf[:, :n]``); its record is keyed by its geometry. None writes
            the first ``host.size`` elements of the flattened buffer.
        key : hashable, optional
            Names the record, so that several contents written to different
            parts of the buffer each keep theirs.
        exact : bool
            Prefix updates: skip only when the record has exactly this length
            (not merely starts with these values).

        Returns
        -------
        bool
            True when a copy was issued or staged (record-only buffers: when
            the owner must copy); False when skipped as unchanged, or when
            ``host`` is empty.

        Raises
        ------
        TypeError
            Dtype mismatch, or a read-only view.
        ValueError
            ``host`` longer than the buffer, a size that does not match
            ``view``, or a ``view`` that is not of this buffer's storage; during
            graph capture, values this buffer had to convert or copy.
        CopyError
            In check mode, a skip whose bytes are not on the device (raised
            at the call, or at the active copier's next flush).
        """
        if view is None and key is None and force is False:
            r = _py_fast_update(self, host, exact)
            if r is not None:
                return r
        return self._update(host, force, view, key, exact)

    if _FastUpdate is not None:
        # the compiled twin of the fast path above, with no Python frame; it calls
        # self._update for anything it does not take
        update = _FastUpdate(
            update, lambda self, *a, **kw: self._update(*a, **kw), _copier._active, _PREFIX, _Update
        )

    def _learn_route(self, host, arr, borrowed) -> None:
        """A prefix update went through the active copier: later ones may take the fast path.

        Only for a site the copier merges (the fast path skips as the segment's
        ``try_skip`` does, and stages through its ``try_h2d``). A host array of
        another library (a torch CPU tensor) is cached by the segment, as
        ``copier.copy`` caches its sources, so that it is found again by identity.
        """
        c = _copier._active.get()
        if c is None or self._fsite is None or self._fsite not in c._merge:
            return
        route = self._froute
        if route is None or route[0]() is not c:
            ref = weakref.ref(c, _forget_route(weakref.ref(self)))
            self._froute = route = (ref, _counts_of(c), c._seg)
        if borrowed and type(host) is not np.ndarray and host is not arr:
            fp = fingerprint_fn(host)
            if fp is not None:
                route[2].remember_src(host, fp, arr, arr.dtype)

    def _own(self, arr: np.ndarray, data: np.ndarray, borrowed: bool) -> tuple:
        """The bytes a record keeps: a private copy of the caller's, unless ``snapshot=False``.

        Returns ``(data, owned)``; ``owned``: a copy made here (see :class:`_Update`).
        """
        if borrowed and self.snapshot:
            if np.may_share_memory(data, arr):
                return data.copy(), True
            return data, True  # _bytes already copied a non-contiguous array
        return data, False

    # -- fill_tail --------------------------------------------------------------------------------

    def fill_tail(self, start: int, value, view=None, key=None, *, site=None) -> bool:
        """Write ``value`` into elements ``start:`` unless they already hold it.

        Parameters
        ----------
        start : int
            First element of the tail, in the flattened buffer (or ``view``).
        value : scalar
            A number the destination's dtype holds exactly, as for
            :meth:`DeviceCopier.fill_tail <cucopy.DeviceCopier.fill_tail>`.
        view : array, optional
            A view of the buffer's storage; None fills the whole buffer's tail.
        key : hashable, optional
            Names the record, as in :meth:`update`.
        site : CopySite, optional
            The ``FILL`` site to issue through. None uses the buffer's site: a
            ``FILL`` site fills in place, an ``H2D`` site uploads the tail's values
            (contiguous destinations only), None keeps a record only.

        Returns
        -------
        bool
            True when issued or staged (record-only: when the owner must fill);
            False when skipped as unchanged or the tail is empty.

        Raises
        ------
        ValueError
            An H2D site with a strided destination or during graph capture, a bad
            ``start`` or ``value``, or a bad ``view``.
        CopyError
            In check mode, a skip whose bytes are not on the device.
        """
        if site is None:
            site = self.site  # an H2D site uploads the tail's values instead
        elif (
            not isinstance(site, CopySite) or getattr(site, "direction", None) is not Direction.FILL
        ):
            raise ValueError(
                f"{self._label}: fill_tail(site=...) takes a FILL CopySite, got {site!r}"
            )
        label = site.label if site is not None else self._label
        if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
            raise ValueError(f"{label}: start must be an int >= 0, got {start!r}")
        start = int(start)
        if view is None:
            v, geom, dst = self._info, None, self.tensor
        else:
            v, geom = self._view(view)
            dst = view
        it = v.dtype.itemsize
        pattern = _copier._pattern(site if site is not None else self._name, v.dtype, value)
        if site is not None and site.direction is not Direction.FILL:
            f = _layout.form(v.ptr, v.shape, v.strides, it)
            if f is None or f[1] != 1:
                raise ValueError(
                    f"{site.label}: fill_tail through an H2D site needs a contiguous "
                    f"destination, got {v.label}: pass fill_tail(..., site=<a FILL site>)"
                )

        def issue(unchanged=False):
            if site.direction is Direction.FILL:
                return _copier.fill_tail(
                    site, dst, start, value, unchanged=unchanged, on_drop=self.invalidate
                )
            # the tail's values, uploaded through the buffer's own H2D site
            tail = np.frombuffer(pattern * (v.size - start), dtype=v.dtype)
            flat = dst.reshape(-1)[start:]
            return _copier.copy(site, flat, tail, unchanged=unchanged, on_drop=self.invalidate)

        if start >= v.size:
            if site is None:
                return False
            return issue() if site.direction is Direction.FILL else False
        if is_capturing(dst):
            if site is not None and site.direction is not Direction.FILL:
                raise ValueError(
                    f"{site.label}: fill_tail through this buffer's H2D site cannot be "
                    "captured: the tail's values would be a host array of the buffer's "
                    "making, which the graph re-reads at every replay; pass "
                    "fill_tail(..., site=<a FILL site>) during capture"
                )
            self.invalidate()
            if site is None:
                return True
            return issue()
        slot = (key, geom)
        rec = self._fills.get(slot)
        same = rec is not None and rec.pattern == pattern and rec.start <= start
        if site is None:
            if same:
                if check.CHECK_MODE:
                    check.verify_unchanged(
                        routing_copier(dst), self._name, v, None, (start, pattern), **_SKIPPED
                    )
                return False
        elif same:
            issue(unchanged=True)
            return False
        region = _region(v.ptr, v.shape, v.strides, it, start)
        f = _layout.form(v.ptr, v.shape, v.strides, it)
        dense = (v.ptr, v.size) if f is not None and f[1] == 1 else None
        self._fills.pop(slot, None)
        self._written(region)
        if site is not None and not issue():
            return False
        self._fills[slot] = _Fill(start, pattern, region, dense)
        return True
