"""Reliability properties: nothing lost, nothing reordered.

Random plans and random step programs run on the simulated device and are
checked byte for byte against a NumPy model of device memory. A program mixes
H2D, D2D and FILL copies through merged, barrier and plain sites into
contiguous, row-strided and other strided views of three device arrays (so
destinations overlap partially all the time), D2D chains whose source is an
earlier destination, ``unchanged=True`` claims that the model says are true,
explicit flushes, copies outside a step, exceptions raised inside ``step()``
(whatever was staged and unflushed never lands, and its ``on_drop`` runs once),
host sources overwritten with garbage right after each call (snapshot
semantics), and stream stalls (``stream.hold()`` around at most ``slots``
steps, which the copier must get through without waiting).

After every step a callable launched on the copier's stream compares device
memory with the model as of that point of program order, so the check does not
synchronize and the lazy policy keeps several steps in flight; the device is
also synchronized and compared from time to time and at the end.

CI runs the hypothesis profile below (``max_examples`` per stream policy).
``CUCOPY_SOAK=1`` runs the long profile instead: a seeded loop of at least
10**6 steps (``CUCOPY_SOAK_STEPS``, ``CUCOPY_SOAK_JOBS`` processes) that writes
its figures to ``bench/results/soak-<date>.json``.
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import pathlib
import random
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cucopy as cc
from cucopy import check, pack
from cucopy.backends.sim import SimDevice

SOAK = os.environ.get("CUCOPY_SOAK", "") not in ("", "0")

DTYPES = tuple(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64, np.float32))
FLUSH_MODES = ("auto", "dma", "mapped", "inline")
# two small arrays so that views collide often, one large enough for 64 KiB copies
BASES = (4096, 4096, 81920)
POOL = 2 * 65536 + 64  # host source pools: room for a 64 KiB source at stride 2


class Site(cc.CopySite):
    H0 = cc.H2D
    H1 = cc.H2D
    H2 = cc.H2D
    D0 = cc.D2D
    D1 = cc.D2D
    D2 = cc.D2D
    F0 = cc.FILL
    F1 = cc.FILL
    F2 = cc.FILL


H_SITES = (Site.H0, Site.H1, Site.H2)
D_SITES = (Site.D0, Site.D1, Site.D2)
F_SITES = (Site.F0, Site.F1, Site.F2)


class InjectedFault(Exception):
    """Raised by a program inside ``copier.step()``."""


# -- sources of randomness: hypothesis (shrinks) or a seeded generator (fast) ------------------


class HypothesisDraw:
    """Choices drawn from hypothesis, so failures shrink to short programs."""

    def __init__(self, data):
        self._data = data

    def int(self, lo: int, hi: int) -> int:
        return self._data.draw(st.integers(lo, hi))

    def chance(self, pct: int) -> bool:
        return self._data.draw(st.integers(0, 99)) < pct

    def pick(self, seq):
        return self._data.draw(st.sampled_from(seq))

    def bytes(self, n: int) -> np.ndarray:
        # bulk bytes from a drawn seed: hypothesis's own buffer is small
        seed = self._data.draw(st.integers(0, 2**32 - 1))
        return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


class RandomDraw:
    """The same choices from :class:`random.Random` (the soak)."""

    def __init__(self, seed: int):
        self._rng = random.Random(seed)
        self._np = np.random.default_rng(seed)

    def int(self, lo: int, hi: int) -> int:
        return self._rng.randint(lo, hi)

    def chance(self, pct: int) -> bool:
        return self._rng.random() * 100 < pct

    def pick(self, seq):
        return seq[self._rng.randrange(len(seq))]

    def bytes(self, n: int) -> np.ndarray:
        return self._np.integers(0, 256, n, dtype=np.uint8)


# -- views: one recipe builds the device view and the model's view -------------------------------

View = collections.namedtuple("View", "base dtype kind off rows width pitch col n")


def make_view(arr, v: View):
    """The view ``v`` of a 1-D uint8 array (a SimArray or its NumPy model)."""
    a = arr.view(v.dtype)
    if v.kind == "slice":
        return a[v.off : v.off + v.n]
    if v.kind == "step":
        return a[v.off : v.off + (v.n - 1) * v.pitch + 1 : v.pitch]
    if v.kind == "rev":
        return a[v.off : v.off + v.n][::-1]
    rows, width, pitch, col = v.rows, v.width, v.pitch, v.col
    if v.kind == "rows":
        return a[v.off : v.off + rows * pitch].reshape(rows, pitch)[:, col : col + width]
    if v.kind == "rows_step":
        t = a[v.off : v.off + rows * pitch].reshape(rows, pitch)
        return t[:, col : col + 2 * (width - 1) + 1 : 2]
    if v.kind == "rows_rev":
        return a[v.off : v.off + rows * pitch].reshape(rows, pitch)[::-1, col : col + width]
    if v.kind == "rows_skip":
        t = a[v.off : v.off + 2 * rows * pitch].reshape(2 * rows, pitch)
        return t[::2, col : col + width]
    raise AssertionError(f"internal: unknown view kind {v.kind}")


def _span(kind: str, n: int, rows: int, width: int, pitch: int) -> int:
    """Elements of the base a view of this kind needs from its offset."""
    if kind == "step":
        return (n - 1) * pitch + 1
    if kind in ("slice", "rev"):
        return n
    if kind == "rows_skip":
        return 2 * rows * pitch
    return rows * pitch


def _shapes_fit(dshape, sshape) -> bool:
    """The copier's shape rule: a flat source (one dimension once leading dimensions of
    size 1 are dropped), or the destination's shape up to leading dimensions of size 1."""

    def core(shape):
        shape = list(shape)
        while shape and shape[0] == 1:
            del shape[0]
        return shape

    return len(core(sshape)) <= 1 or core(sshape) == core(dshape)


def _flat_assign(view: np.ndarray, values: np.ndarray) -> None:
    view[...] = values.reshape(view.shape)


# -- one program ----------------------------------------------------------------------------------


class Program:
    """A random plan and step program on one device, checked against a NumPy model.

    Parameters
    ----------
    dev : SimDevice
    draw : HypothesisDraw or RandomDraw
    bases : tuple of int
        Bytes of each device array.
    max_ops : int
        Most copier calls in one step.
    check_mode : bool or None
        None draws it.
    guarded : bool
        Some H2D copies read a pinned pool in place through a :class:`cucopy.HostGuard`
        (the pool written only inside ``guard.write()``). False draws nothing for them,
        so the programs of a seed are the ones they were before guards existed.
    """

    def __init__(
        self, dev: SimDevice, draw, bases=BASES, max_ops=10, check_mode=None, guarded=False
    ):
        # the sim moves single bytes through CPython's cached 1-byte bytes objects; if
        # anything wrote into an immutable bytes object, every check below would fail
        # for a reason that has nothing to do with the copier
        assert bytes([0x20])[0] == 0x20, (
            "CPython's cached bytes b' ' reads as b'\\x00': something in this process wrote "
            "into an immutable bytes object (e.g. an NVRTC log buffer made with b' ' * size)"
        )
        self.dev = dev
        self.d = draw
        self.max_ops = max_ops
        self.arrays = [dev.empty((n,), np.uint8) for n in bases]
        self.model = []
        for arr in self.arrays:
            init = draw.bytes(arr.size)
            arr[...] = init  # a blocking write
            self.model.append(init.copy())
        self.pinned = dev.pinned_empty((POOL,), np.uint8)
        self.pageable = np.zeros(POOL, np.uint8)
        self.guarded = dev.pinned_empty((POOL,), np.uint8) if guarded else None
        self.guard = cc.HostGuard(self.guarded, label="pool") if guarded else None
        self.holding = False  # inside a stream hold: a guard's write() would wait on it
        self.recent: list = []  # recent ops, for D2D chains and true unchanged claims
        self.drops: collections.Counter = collections.Counter()
        self.live: set = set()  # ids of copies staged and not yet flushed, as calls show it
        self.bad: list = []  # mismatches found by stream-order checks
        self.log: collections.deque = collections.deque(maxlen=60)
        self.figures = collections.Counter()
        self._ids = 0

        merge, barriers = set(), set()
        for site in Site:
            mode = draw.int(0, 2)
            if mode:
                merge.add(site)
            if mode == 2:
                barriers.add(site)
        self.plan = cc.CopyPlan(merge=merge, flush_after=barriers)
        self.slots = draw.int(1, 4)
        capacity = draw.pick((4096, 4096, 8192, 65536))
        flush_mode = draw.pick(FLUSH_MODES)
        self.stream = dev.default_stream if draw.chance(50) else dev.stream()
        self.check_mode = draw.chance(20) if check_mode is None else check_mode
        self.routed = draw.chance(30)  # calls go through cc.copy with the copier active
        # graphed launches of small mapped segments, as the CUDA backend offers them
        dev.graph_capacity = pack.GRAPH_CAPACITY if draw.chance(50) else 0
        self.copier = cc.DeviceCopier(
            self.plan,
            stream=self.stream,
            device=dev,
            backend="sim",
            slots=self.slots,
            capacity=capacity,
            flush_mode=flush_mode,
        )
        self.log.append(
            f"plan={self.plan!r} slots={self.slots} capacity={capacity} "
            f"flush_mode={flush_mode} stream={self.stream.name} "
            f"check={self.check_mode} routed={self.routed}"
        )

    # -- random pieces ------------------------------------------------------------------------

    def size(self):
        d = self.d
        dt = d.pick(DTYPES)
        r = d.int(0, 99)
        if r < 70:
            nbytes = d.int(1, 64)
        elif r < 90:
            nbytes = d.int(65, 1024)
        elif r < 98:
            nbytes = d.int(1025, 8192)
        else:
            nbytes = d.int(8193, 65536)
        return max(1, nbytes // dt.itemsize), dt

    def view(self, n: int, dt, rows: int = 0) -> View:
        """A view of ``n`` elements; ``rows`` > 0: a 2-D one of that many rows."""
        d = self.d
        it = dt.itemsize
        # strided layouts run per row or per element in the sim: keep them short
        kinds = ["slice", "rows", "rows_skip"]
        if n <= 256:
            kinds += ["step", "rev", "rows_step", "rows_rev"]
        if rows:
            kinds = [k for k in kinds if k.startswith("rows")]
        kind = d.pick(kinds)
        rows, width, pitch, col = rows or 1, n, 1, 0
        if kind.startswith("rows"):
            divs = [k for k in range(1, min(n, 16) + 1) if n % k == 0]
            rows = rows if rows > 1 else d.pick(divs)
            width = n // rows
            span = width if kind != "rows_step" else 2 * (width - 1) + 1
            col = d.int(0, 3)
            pitch = span + col + d.int(0, 4)
        elif kind == "step":
            pitch = d.int(2, 3)
        need = _span(kind, n, rows, width, pitch)
        fits = [i for i, b in enumerate(self.arrays) if b.size // it >= need]
        if not fits:  # too big for any layout but a dense one in the large array
            if rows > 1 and kind.startswith("rows"):
                kind, width, col = "rows", n // rows, 0
                pitch = width
            else:
                kind, rows, width, pitch, col = "slice", 1, n, 1, 0
            need = n
            fits = [len(self.arrays) - 1]
        base = d.pick(fits)
        room = self.arrays[base].size // it - need
        off = d.int(0, min(room, 24)) if d.chance(80) else d.int(0, room)
        return View(base, dt, kind, off, rows, width, pitch, col, n)

    def again(self) -> View:
        """A recent destination again (the same range twice in one segment), or a new view."""
        if self.recent and self.d.chance(20):
            return self.d.pick(self.recent[-3:])[1]
        return self.view(*self.size())

    def host_source(self, n: int, dt, shape, values=None):
        """A host array of ``n`` elements (pageable or pinned, maybe strided) and its pool."""
        d = self.d
        it = dt.itemsize
        pool = self.pinned if d.chance(40) else self.pageable
        if d.chance(25):
            src = pool[: 2 * n * it].view(dt)[::2]
        else:
            src = pool[: n * it].view(dt)
            if d.chance(50):
                src = src.reshape(shape)
        if values is None:
            values = d.bytes(n * it).view(dt)
        src[...] = np.asarray(values).reshape(src.shape)
        return src, pool[: 2 * n * it]

    def fill_value(self, dt):
        d = self.d
        if dt.kind == "f":
            return d.int(-4000, 4000) / 4
        info = np.iinfo(dt)
        return d.pick((0, -1 if info.min < 0 else 1, info.min, info.max, d.int(info.min, info.max)))

    def new_id(self) -> int:
        self._ids += 1
        return self._ids

    def dropper(self, oid: int):
        drops = self.drops

        def on_drop():
            drops[oid] += 1

        return on_drop

    # -- the model --------------------------------------------------------------------------------

    def apply(self, model, op) -> None:
        kind = op[0]
        if kind == "h2d":
            _, v, values = op
            _flat_assign(make_view(model[v.base], v), values)
        elif kind == "d2d":
            _, dv, sv = op
            src = make_view(model[sv.base], sv).copy()
            _flat_assign(make_view(model[dv.base], dv), src)
        elif kind == "fill":
            _, v, start, value = op
            view = make_view(model[v.base], v)
            view.flat[start:] = np.asarray(value).astype(v.dtype)
        else:
            raise AssertionError(f"internal: unknown op {kind}")

    # -- calls ------------------------------------------------------------------------------------

    def _copy(self, site, dst, src, oid=None, **kw):
        fn = cc.copy if self.routed else self.copier.copy
        return self._track(site, oid, lambda: fn(site, dst, src, **kw))

    def _fill(self, site, dst, start, value, oid=None, **kw):
        fn = cc.fill_tail if self.routed else self.copier.fill_tail
        return self._track(site, oid, lambda: fn(site, dst, start, value, **kw))

    def _track(self, site, oid, call):
        """Make a call and update :attr:`live`, the copies staged and not yet flushed.

        Told apart through the copier's counters: a site's ``eager`` count grows when
        its copy ran eagerly, ``segments`` grows when a segment was flushed.
        """
        c = self.copier
        st = c.stats
        segments, eager = st.segments, st.sites[site].eager
        ret = call()
        if not c.in_step:
            return ret
        if c.staged == 0:
            self.live.clear()
        else:
            if st.segments != segments:
                self.live.clear()  # an ordering flush landed the earlier copies
            if oid is not None and ret and st.sites[site].eager == eager:
                self.live.add(oid)
        assert bool(self.live) == bool(c.staged), (
            f"live {sorted(self.live)} vs staged {c.staged}\n{self.trace()}"
        )
        return ret

    def op(self, ops: list, in_step: bool) -> None:
        """One random copier call; appends ``(id, op)`` for calls that may land."""
        d = self.d
        r = d.int(0, 99)
        if r < 40:
            op = self.op_guarded() if self.guard is not None and d.chance(35) else self.op_h2d()
        elif r < 61:
            op = self.op_d2d()
        elif r < 76:
            op = self.op_fill()
        elif r < 88:
            self.op_unchanged()
            return
        elif r < 94:
            op = self.op_foreign()
        else:
            if in_step:
                self.log.append("flush()")
                if self.routed:
                    cc.flush()
                else:
                    self.copier.flush()
                assert self.copier.staged == 0
                self.live.clear()
                self.stream_check("after flush()")
            return
        if op is not None:
            ops.append(op)
            self.apply(self.model, op[1])
            self.recent.append(op[1])
            if len(self.recent) > 12:
                del self.recent[0]
        if in_step and self.copier.staged == 0 and d.chance(30):
            # nothing staged (a barrier or an ordering flush just ran): a reader on the
            # stream must see every copy so far
            self.stream_check("with nothing staged")

    def op_foreign(self):
        """The model's own kernel writes a view, in stream order, while nothing is staged
        (the plan allows it then: no merged destination is waiting for its barrier)."""
        if self.copier.staged:
            return None
        v = self.view(*self.size())
        values = self.d.bytes(v.n * v.dtype.itemsize).view(v.dtype)
        arr, dev = self.arrays[v.base], self.dev
        self.log.append(f"foreign write {v}")
        self.stream.launch(lambda: _flat_assign(make_view(dev.raw(arr), v), values))
        self.figures["foreign"] += 1
        return 0, ("h2d", v, values)  # id 0: never dropped

    def op_h2d(self):
        site = self.d.pick(H_SITES)
        v = self.again()
        n, dt = v.n, v.dtype
        dst = make_view(self.arrays[v.base], v)
        src, pool = self.host_source(n, dt, dst.shape)
        values = np.array(src, copy=True)
        oid = self.new_id()
        self.log.append(f"#{oid} copy({site.label}, {v}, host {src.shape}{src.strides})")
        assert self._copy(site, dst, src, oid, on_drop=self.dropper(oid)) is True
        np.invert(pool, out=pool)  # snapshot semantics: the caller reuses its buffer at once
        self.figures["copies"] += 1
        self.figures["bytes"] += n * dt.itemsize
        return oid, ("h2d", v, values)

    def op_guarded(self):
        """An H2D copy read in place from the guarded pool, written inside ``write()``."""
        d = self.d
        if self.holding:  # write() waits for the copies that read the pool: not while held
            return self.op_h2d()
        site = d.pick(H_SITES)
        v = self.again()
        n, dt = v.n, v.dtype
        it = dt.itemsize
        dst = make_view(self.arrays[v.base], v)
        values = d.bytes(n * it).view(dt)
        pool = self.guarded
        rows = dst.shape[0] if len(dst.shape) == 2 else 0
        pad = d.int(1, 3)
        with self.guard.write():  # waits for the copies still reading the pool
            if rows and n * it + rows * pad * it <= POOL and d.chance(50):
                # a 2-D row-strided view of the pool (buf[:r, :c])
                cols = n // rows
                off = d.int(0, (POOL - rows * (cols + pad) * it) // it) * it
                src = pool[off : off + rows * (cols + pad) * it].view(dt)
                src = src.reshape(rows, cols + pad)[:, :cols]
            else:
                off = d.int(0, (POOL - n * it) // it) * it
                src = pool[off : off + n * it].view(dt)
                if d.chance(50):
                    src = src.reshape(dst.shape)
            src[...] = values.reshape(src.shape)
        oid = self.new_id()
        self.log.append(f"#{oid} copy({site.label}, {v}, guarded {src.shape}{src.strides})")
        assert self._copy(site, dst, src, oid, on_drop=self.dropper(oid), guard=self.guard)
        self.figures["copies"] += 1
        self.figures["guarded"] += 1
        self.figures["bytes"] += n * it
        return oid, ("h2d", v, values)

    def op_d2d(self):
        d = self.d
        chain = [op[1] for op in self.recent]
        if chain and d.chance(45):
            sv = d.pick(chain)  # an earlier copy's destination as the source
            n, dt = sv.n, sv.dtype
        else:
            n, dt = self.size()
            sv = self.view(n, dt)
        same = [op[1] for op in self.recent if op[1].n == n and op[1].dtype == dt]
        dv = d.pick(same) if same and d.chance(25) else self.view(n, dt)
        site = d.pick(D_SITES)
        oid = self.new_id()
        self.log.append(f"#{oid} copy({site.label}, {dv}, {sv})")
        dst = make_view(self.arrays[dv.base], dv)
        src = make_view(self.arrays[sv.base], sv)
        if not _shapes_fit(dst.shape, src.shape):
            # refused at the call, with nothing staged lost; then into a view of the
            # source's shape
            staged = self.copier.staged
            with pytest.raises(ValueError, match=rf"{site.label}: shape mismatch"):
                self._copy(site, dst, src, oid, on_drop=self.dropper(oid))
            assert self.copier.staged == staged
            self.figures["refused"] += 1
            dv = self.view(n, dt, rows=src.shape[0])
            self.log.append(f"  refused; #{oid} copy({site.label}, {dv}, {sv})")
            dst = make_view(self.arrays[dv.base], dv)
        assert self._copy(site, dst, src, oid, on_drop=self.dropper(oid)) is True
        self.figures["copies"] += 1
        self.figures["bytes"] += n * dt.itemsize
        return oid, ("d2d", dv, sv)

    def op_fill(self):
        d = self.d
        site = d.pick(F_SITES)
        v = self.again()
        n, dt = v.n, v.dtype
        start = d.pick((0, 0, d.int(0, n - 1), d.int(0, n - 1), n, n + d.int(1, 3)))
        value = self.fill_value(dt)
        oid = self.new_id()
        self.log.append(f"#{oid} fill_tail({site.label}, {v}, {start}, {value!r})")
        dst = make_view(self.arrays[v.base], v)
        got = self._fill(site, dst, start, value, oid, on_drop=self.dropper(oid))
        assert got is (start < n), f"fill_tail returned {got} for start={start} of {n}"
        if start >= n:
            return None
        self.figures["copies"] += 1
        self.figures["bytes"] += (n - start) * dt.itemsize
        return oid, ("fill", v, start, value)

    def op_unchanged(self) -> None:
        """A claim the model says is true: the call must skip and return False."""
        d = self.d
        kind = d.pick(("h2d", "h2d", "d2d", "fill"))
        if kind == "fill":
            fills = [op for op in self.recent if op[0] == "fill"]
            if not fills:
                return
            _, v, start, value = d.pick(fills)
            tail = make_view(self.model[v.base], v).flatten()[start:]
            want = np.asarray(value).astype(v.dtype).tobytes()
            if tail.tobytes() != want * tail.size:
                return
            self.log.append(f"unchanged fill_tail({v}, {start}, {value!r})")
            dst = make_view(self.arrays[v.base], v)
            assert self._fill(d.pick(F_SITES), dst, start, value, unchanged=True) is False
        elif kind == "d2d":
            pairs = [op for op in self.recent if op[0] == "d2d"]
            if pairs and d.chance(60):
                _, dv, sv = d.pick(pairs)
                a = make_view(self.model[dv.base], dv)
                b = make_view(self.model[sv.base], sv)
                if a.tobytes() != b.tobytes():
                    return
            else:
                n, dt = self.size()
                dv = sv = self.view(n, dt)
            self.log.append(f"unchanged copy(D, {dv}, {sv})")
            dst = make_view(self.arrays[dv.base], dv)
            src = make_view(self.arrays[sv.base], sv)
            assert self._copy(d.pick(D_SITES), dst, src, unchanged=True) is False
        else:
            dests = [op[1] for op in self.recent]
            if dests and d.chance(60):
                v = d.pick(dests)
            else:
                v = self.view(*self.size())
            values = make_view(self.model[v.base], v).copy()
            dst = make_view(self.arrays[v.base], v)
            src, pool = self.host_source(v.n, v.dtype, dst.shape, values)
            self.log.append(f"unchanged copy(H, {v})")
            assert self._copy(d.pick(H_SITES), dst, src, unchanged=True) is False
            np.invert(pool, out=pool)
        self.figures["claims"] += 1

    # -- steps -----------------------------------------------------------------------------------------

    def step(self) -> None:
        d = self.d
        nops = d.int(0, self.max_ops)
        fault_at = d.int(0, nops) if d.chance(15) else -1
        before = [m.copy() for m in self.model] if fault_at >= 0 else None
        ops: list = []
        self.log.append(f"-- step {self.figures['steps']} ({nops} ops, fault at {fault_at})")
        faulted = False
        try:
            with self.copier.activate() if self.routed else _nothing(), self.copier.step():
                assert not self.live
                for j in range(nops):
                    if j == fault_at:
                        raise InjectedFault(j)
                    self.op(ops, in_step=True)
                if fault_at == nops:
                    raise InjectedFault(nops)
        except InjectedFault:
            faulted = True
            staged = self.live
            self.figures["faults"] += 1
        self.figures["steps"] += 1
        self.live = set()
        assert self.copier.staged == 0, "staged copies left after the step"
        assert not self.copier.in_step
        for oid, _ in ops:
            n = self.drops.get(oid, 0)
            assert n <= 1, f"on_drop of #{oid} ran {n} times\n{self.trace()}"
            assert n == 0 or faulted, (
                f"on_drop of #{oid} ran in a step that flushed\n{self.trace()}"
            )
        if faulted:
            # the model: copies that were dropped never happened
            dropped = [oid for oid, _ in ops if self.drops.get(oid, 0)]
            assert set(dropped) == staged, (
                f"dropped {sorted(dropped)}, but staged and unflushed were {sorted(staged)}"
                f"\n{self.trace()}"
            )
            self.figures["dropped"] += len(dropped)
            self.log.append(f"dropped {dropped}")
            self.model = before
            for oid, op in ops:
                if not self.drops.get(oid, 0):
                    self.apply(self.model, op)
            self.recent = [op for op in self.recent if all(op is not o for _, o in ops)]
            self.recent += [op for oid, op in ops if not self.drops.get(oid, 0)]
        self.stream_check(f"after step {self.figures['steps'] - 1}")

    def outside(self) -> None:
        """Copies outside any step: eager, snapshotted, never dropped."""
        ops: list = []
        with self.copier.activate() if self.routed else _nothing():
            for _ in range(self.d.int(1, 3)):
                self.op(ops, in_step=False)
        for oid, _ in ops:
            assert not self.drops.get(oid, 0), f"on_drop ran for #{oid} outside a step"
        self.stream_check("after copies outside a step")

    # -- checks -----------------------------------------------------------------------------------------

    def trace(self) -> str:
        return "\n".join(self.log)

    def stream_check(self, label: str) -> None:
        """Compare device memory with the model at this point of the copier's stream."""
        want = [m.copy() for m in self.model]
        arrays, dev, bad = self.arrays, self.dev, self.bad
        trace = self.trace()

        def compare():
            for i, (arr, w) in enumerate(zip(arrays, want)):
                got = dev.raw(arr)
                if not np.array_equal(got, w):
                    k = int(np.flatnonzero(got != w)[0])
                    bad.append(
                        f"{label}: array {i} byte {k}: device {got[k]:#04x}, model "
                        f"{w[k]:#04x}\n{trace}"
                    )

        self.stream.launch(compare)
        self.raise_bad()

    def raise_bad(self) -> None:
        if self.bad:
            self.figures["mismatches"] += len(self.bad)
            raise AssertionError(self.bad[0])

    def full_check(self) -> None:
        for i, (arr, m) in enumerate(zip(self.arrays, self.model)):
            got = self.dev.to_host(arr)
            if not np.array_equal(got, m):
                k = int(np.flatnonzero(got != m)[0])
                self.figures["mismatches"] += 1
                raise AssertionError(
                    f"array {i} byte {k}: device {got[k]:#04x}, model {m[k]:#04x}\n{self.trace()}"
                )
        self.raise_bad()

    # -- the whole program -------------------------------------------------------------------------------

    def run(self, steps: int, full_every: int = 0) -> collections.Counter:
        """Run ``steps`` steps; compare fully every ``full_every`` (0: at random)."""
        d = self.d
        saved = check.CHECK_MODE
        check.CHECK_MODE = self.check_mode
        try:
            done = 0
            while done < steps:
                if not self.check_mode and d.chance(12):
                    # at most `slots` steps under a stall: the ring never has to wait
                    k = min(d.int(1, self.slots), steps - done)
                    self.stream.synchronize()
                    self.log.append(f"== hold for {k} steps")
                    self.holding = True
                    try:
                        with self.stream.hold():
                            for _ in range(k):
                                self.step()
                    finally:
                        self.holding = False
                    self.log.append("== release")
                    self.figures["holds"] += 1
                    done += k
                else:
                    if d.chance(20):
                        self.outside()
                    self.step()
                    done += 1
                if (full_every and done % full_every == 0) or (not full_every and d.chance(15)):
                    self.full_check()
            self.full_check()
            self.copier.close()
            self.full_check()
        finally:
            check.CHECK_MODE = saved
        self.figures["host_waits"] += self.copier.stats.host_waits
        return self.figures


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# -- the CI profile ------------------------------------------------------------------------------------

EXAMPLES = 400 if SOAK else 120


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)
@given(data=st.data())
def test_programs_match_the_model(sim_env, data):
    draw = HypothesisDraw(data)
    dev = SimDevice(policy=sim_env.dev.policy, seed=draw.int(0, 2**16))
    Program(dev, draw, max_ops=8).run(steps=draw.int(1, 8))


@settings(
    max_examples=EXAMPLES // 4,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
@given(data=st.data())
def test_programs_match_the_model_in_check_mode(sim_env, data):
    """Check mode on: true ``unchanged`` claims pass verification, and the bytes still match."""
    draw = HypothesisDraw(data)
    dev = SimDevice(policy=sim_env.dev.policy, seed=draw.int(0, 2**16))
    Program(dev, draw, max_ops=8, check_mode=True).run(steps=draw.int(1, 6))


def test_seeded_programs(sim_env):
    """Longer seeded programs than hypothesis draws: the ring wraps and grows many times."""
    for seed in range(3):
        draw = RandomDraw(seed)
        dev = SimDevice(policy=sim_env.dev.policy, seed=seed)
        figs = Program(dev, draw, check_mode=False).run(steps=150)
        assert figs["mismatches"] == 0


@pytest.mark.parametrize("checked", [False, True], ids=["plain", "check_mode"])
def test_seeded_programs_with_guarded_copies(sim_env, checked):
    """Copies read in place through a HostGuard, among the rest: the model still holds
    (each write of the guarded pool waits for the copies reading it), and check mode
    finds no unguarded write where there is none."""
    guarded = 0
    for seed in range(2):
        draw = RandomDraw(1000 + seed)
        dev = SimDevice(policy=sim_env.dev.policy, seed=seed)
        figs = Program(dev, draw, check_mode=checked, guarded=True).run(steps=60)
        assert figs["mismatches"] == 0
        guarded += figs["guarded"]
    assert guarded > 0


# -- the long profile ------------------------------------------------------------------------------------


def soak_chunk(seed: int, steps: int) -> dict:
    """Run seeded programs of ~2000 steps until ``steps`` steps; return the figures."""
    figs = collections.Counter()
    rng = random.Random(seed)
    done = 0
    while done < steps:
        s = rng.getrandbits(48)
        n = min(steps - done, 2000)
        policy = ("lazy", "eager", "random")[s % 3]
        prog = Program(SimDevice(policy=policy, seed=s), RandomDraw(s), check_mode=False)
        try:
            figs.update(prog.run(steps=n, full_every=97))
        except AssertionError as exc:
            figs["mismatches"] += 1
            figs["failures"] += 1
            return {"figures": dict(figs), "failure": f"seed {s} ({policy}): {exc}"[:20000]}
        figs["programs"] += 1
        figs[f"steps_{policy}"] += n
        done += n
    return {"figures": dict(figs), "failure": None}


@pytest.mark.slow
@pytest.mark.skipif(not SOAK, reason="long profile: set CUCOPY_SOAK=1")
def test_soak():
    total = int(os.environ.get("CUCOPY_SOAK_STEPS", str(10**6)))
    jobs = max(1, int(os.environ.get("CUCOPY_SOAK_JOBS", "2")))
    seed = int(os.environ.get("CUCOPY_SOAK_SEED", "20260501"))
    t0 = time.perf_counter()
    per = -(-total // jobs)
    if jobs == 1:
        results = [soak_chunk(seed, per)]
    else:
        import concurrent.futures
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            results = list(pool.map(soak_chunk, [seed + j for j in range(jobs)], [per] * jobs))
    figs = collections.Counter()
    for r in results:
        figs.update(r["figures"])
    failures = [r["failure"] for r in results if r["failure"]]
    elapsed = time.perf_counter() - t0
    record = {
        "date": datetime.date.today().isoformat(),
        "seconds": round(elapsed, 1),
        "jobs": jobs,
        "seed": seed,
        "steps": figs["steps"],
        "copies": figs["copies"],
        "bytes": figs["bytes"],
        "faults_injected": figs["faults"],
        "copies_dropped": figs["dropped"],
        "unchanged_claims": figs["claims"],
        "holds": figs["holds"],
        "host_waits": figs["host_waits"],
        "programs": figs["programs"],
        "steps_by_policy": {p: figs[f"steps_{p}"] for p in ("lazy", "eager", "random")},
        "mismatches": figs["mismatches"],
        "failures": failures[:3],
    }
    out = pathlib.Path(__file__).resolve().parent.parent / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"soak-{record['date']}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    assert not failures, failures[0]
    assert record["mismatches"] == 0
    assert record["steps"] >= total
