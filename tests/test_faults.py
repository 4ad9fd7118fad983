"""Fault injection through the backend protocol.

A :class:`FaultyBackend` (a :class:`~cucopy.backends.sim.SimBackend` whose
methods can be armed to raise) is handed to the copier as ``backend=``. After
each injected failure: the error is clear (a :class:`cucopy.CopyError` naming
the site, or the backend's own error where the copier lets it through), every
copy that did not land had its ``on_drop`` called exactly once, nothing stale
is left (``staged == 0``, not in a step), and the next step lands correctly.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

import cucopy as cc
from cucopy.backends.sim import SimBackend, SimDevice


class Site(cc.CopySite):
    POS = cc.H2D
    TABLE = cc.H2D  # a barrier
    PLAIN = cc.H2D  # not merged
    GATHER = cc.D2D
    TAIL = cc.FILL


PLAN = cc.CopyPlan(merge={Site.POS, Site.TABLE, Site.GATHER, Site.TAIL}, flush_after={Site.TABLE})


class InjectedError(RuntimeError):
    """What an armed backend method raises."""


class FaultyBackend(SimBackend):
    """The sim backend, with methods that raise on demand.

    ``arm(name, skip=k, times=n)`` makes the call after the next ``k`` calls of
    ``name`` raise, ``n`` times in a row.
    """

    METHODS = (
        "alloc_pinned",
        "alloc_device",
        "copy2d",
        "fill",
        "scatter",
        "event_record",
        "event_query",
        "event_synchronize",
        "event_wait",
    )

    def __init__(self, device):
        super().__init__(device)
        self.calls = collections.Counter()
        self._armed: dict = {}

    def arm(self, name, skip=0, times=1, exc=None) -> None:
        assert name in self.METHODS
        self._armed[name] = [skip, times, exc or InjectedError(f"injected {name} failure")]

    def disarm(self) -> None:
        self._armed.clear()

    def _hit(self, name) -> None:
        self.calls[name] += 1
        a = self._armed.get(name)
        if a is None:
            return
        if a[0] > 0:
            a[0] -= 1
            return
        a[1] -= 1
        if a[1] <= 0:
            del self._armed[name]
        raise a[2]


def _wrap(name):
    base = getattr(SimBackend, name)

    def method(self, *args, **kwargs):
        self._hit(name)
        return base(self, *args, **kwargs)

    method.__name__ = name
    return method


for _name in FaultyBackend.METHODS:
    setattr(FaultyBackend, _name, _wrap(_name))


class Rig:
    """A device, a faulty backend, a copier and a drop log."""

    def __init__(self, policy="lazy", plan=PLAN, **kw):
        self.dev = SimDevice(policy=policy, seed=7)
        self.be = FaultyBackend(self.dev)
        kw.setdefault("stream", self.dev.default_stream)
        self.copier = cc.DeviceCopier(plan, device=self.dev, backend=self.be, **kw)
        self.dropped: list = []

    def drop(self, tag):
        return lambda: self.dropped.append(tag)

    def host(self, arr):
        return self.dev.to_host(arr)

    def live_memory(self):
        return len(self.dev._pinned), len(self.dev._allocs)

    def assert_clean(self):
        c = self.copier
        assert c.staged == 0
        assert not c.in_step

    def assert_next_step_lands(self):
        """A fresh step with a merged, a barrier, a D2D and a fill copy lands exactly."""
        dev, c = self.dev, self.copier
        a, b, g, t = (dev.empty((16,), np.int32) for _ in range(4))
        va = np.arange(16, dtype=np.int32) + 1000
        vb = np.arange(16, dtype=np.int32) - 1000
        with c.step():
            assert c.copy(Site.POS, a, va) is True
            assert c.copy(Site.TABLE, b, vb) is True
            assert c.copy(Site.GATHER, g, b) is True
            assert c.fill_tail(Site.TAIL, t, 4, 7) is True
            assert c.copy(Site.PLAIN, a[:4], va[12:]) is True
        want_a = va.copy()
        want_a[:4] = va[12:]
        assert self.host(a).tolist() == want_a.tolist()
        assert self.host(b).tolist() == vb.tolist()
        assert self.host(g).tolist() == vb.tolist()
        assert self.host(t).tolist() == [0] * 4 + [7] * 12
        assert c.staged == 0


POLICIES = ["lazy", "eager", "random"]


# -- a failing flush -------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(
    "method,flush_mode", [("scatter", "dma"), ("scatter", "mapped"), ("copy2d", "dma")]
)
def test_flush_fails_at_the_final_barrier(policy, method, flush_mode):
    r = Rig(policy, flush_mode=flush_mode)
    dev, c = r.dev, r.copier
    a, b, t = (dev.empty((8,), np.int32) for _ in range(3))
    with c.step():
        c.copy(Site.POS, a, np.full(8, 1, np.int32))
    r.be.arm(method)
    with pytest.raises(cc.CopyError, match=r"Site\.POS: flushing 3 staged copies failed") as ei:
        with c.step():
            c.copy(Site.POS, a, np.full(8, 2, np.int32), on_drop=r.drop("a"))
            c.copy(Site.POS, b, np.full(8, 3, np.int32), on_drop=r.drop("b"))
            c.fill_tail(Site.TAIL, t, 6, 9, on_drop=r.drop("t"))
    assert isinstance(ei.value.__cause__, InjectedError)
    assert sorted(r.dropped) == ["a", "b", "t"]
    r.assert_clean()
    assert r.host(a).tolist() == [1] * 8 and r.host(b).tolist() == [0] * 8
    assert r.host(t).tolist() == [0] * 8
    r.assert_next_step_lands()
    assert sorted(r.dropped) == ["a", "b", "t"]


@pytest.mark.parametrize("policy", POLICIES)
def test_flush_fails_at_a_barrier_site_inside_the_step(policy):
    r = Rig(policy, flush_mode="mapped")
    dev, c = r.dev, r.copier
    a, b = dev.empty((8,), np.int32), dev.empty((8,), np.int32)
    r.be.arm("scatter")
    with pytest.raises(cc.CopyError, match=r"Site\.POS: flushing 2 staged copies failed"):
        with c.step():
            c.copy(Site.POS, a, np.full(8, 2, np.int32), on_drop=r.drop("a"))
            c.copy(Site.TABLE, b, np.full(8, 3, np.int32), on_drop=r.drop("b"))
            raise AssertionError("not reached: the barrier raised")
    assert sorted(r.dropped) == ["a", "b"]
    r.assert_clean()
    assert r.host(a).tolist() == [0] * 8 and r.host(b).tolist() == [0] * 8
    r.assert_next_step_lands()


@pytest.mark.parametrize("policy", POLICIES)
def test_flush_fails_after_earlier_segments_landed(policy):
    """Segments flushed before the failing one stay landed; only the failing one drops."""
    r = Rig(policy, flush_mode="mapped")
    dev, c = r.dev, r.copier
    a, b = dev.empty((8,), np.int32), dev.empty((8,), np.int32)
    with pytest.raises(cc.CopyError):
        with c.step():
            c.copy(Site.TABLE, a, np.full(8, 4, np.int32), on_drop=r.drop("a"))  # lands
            r.be.arm("scatter")
            c.copy(Site.POS, b, np.full(8, 5, np.int32), on_drop=r.drop("b"))
    assert r.dropped == ["b"]
    r.assert_clean()
    assert r.host(a).tolist() == [4] * 8 and r.host(b).tolist() == [0] * 8
    r.assert_next_step_lands()


@pytest.mark.parametrize("policy", POLICIES)
def test_ordering_flush_fails_inside_copy(policy):
    """An overlapping copy forces a flush that fails: the staged copy drops, the new one
    raises from copy() (so it needs no on_drop), and the step can go on."""
    r = Rig(policy, flush_mode="mapped")
    dev, c = r.dev, r.copier
    a, b = dev.empty((8,), np.int32), dev.empty((8,), np.int32)
    with c.step():
        c.copy(Site.POS, a, np.full(8, 1, np.int32), on_drop=r.drop("first"))
        r.be.arm("scatter")
        with pytest.raises(cc.CopyError, match=r"Site\.POS: flushing 1 staged copies failed"):
            c.copy(Site.POS, a[2:6], np.full(4, 2, np.int32), on_drop=r.drop("second"))
        assert r.dropped == ["first"]
        assert c.staged == 0
        c.copy(Site.POS, b, np.full(8, 3, np.int32), on_drop=r.drop("third"))
    assert r.dropped == ["first"]
    assert r.host(a).tolist() == [0] * 8
    assert r.host(b).tolist() == [3] * 8
    r.assert_clean()
    r.assert_next_step_lands()


@pytest.mark.parametrize("policy", POLICIES)
def test_flush_fails_on_close(policy):
    """close() with staged copies and a failing flush: they drop, the ring is still freed,
    and no in-flight segment of the same slot is freed under the stream."""
    r = Rig(policy, flush_mode="mapped")
    dev, c = r.dev, r.copier
    a, b = dev.empty((8,), np.int32), dev.empty((8,), np.int32)
    base = r.live_memory()
    c.begin()
    c.copy(Site.TABLE, a, np.full(8, 6, np.int32), on_drop=r.drop("a"))  # flushed, in flight
    c.copy(Site.POS, b, np.full(8, 7, np.int32), on_drop=r.drop("b"))
    r.be.arm("scatter")
    with pytest.raises(cc.CopyError, match=r"Site\.POS: flushing 1 staged"):
        c.close()
    assert c.closed
    assert r.dropped == ["b"]
    dev.synchronize()  # the in-flight segment must still read valid memory
    assert r.host(a).tolist() == [6] * 8 and r.host(b).tolist() == [0] * 8
    assert r.live_memory() == base
    with pytest.raises(cc.CopyError, match="closed"):
        c.copy(Site.POS, a, np.zeros(8, np.int32))


# -- eager work failing ---------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_eager_copy_fails_mid_step(policy):
    """The backend's error comes straight out of copy() for an eager copy, the step
    unwinds through discard(), and the staged copies before it drop."""
    r = Rig(policy)
    dev, c = r.dev, r.copier
    a, b = dev.empty((8,), np.int32), dev.empty((8,), np.int32)
    with pytest.raises(InjectedError):
        with c.step():
            c.copy(Site.POS, a, np.full(8, 1, np.int32), on_drop=r.drop("a"))
            r.be.arm("copy2d")
            c.copy(Site.PLAIN, b, np.full(8, 2, np.int32), on_drop=r.drop("b"))
    assert r.dropped == ["a"]
    r.assert_clean()
    assert r.host(a).tolist() == [0] * 8 and r.host(b).tolist() == [0] * 8
    r.assert_next_step_lands()


@pytest.mark.parametrize("policy", POLICIES)
def test_eager_snapshot_allocation_fails(policy):
    """A copy too big for the slot needs a temporary pinned buffer; its allocation fails."""
    r = Rig(policy, capacity=4096)
    dev, c = r.dev, r.copier
    a, big = dev.empty((8,), np.int32), dev.empty((4096,), np.int32)
    with pytest.raises(InjectedError):
        with c.step():
            c.copy(Site.POS, a, np.full(8, 1, np.int32), on_drop=r.drop("a"))
            r.be.arm("alloc_pinned")
            c.copy(Site.POS, big, np.ones(4096, np.int32), on_drop=r.drop("big"))
    assert r.dropped == ["a"]
    r.assert_clean()
    assert r.host(a).tolist() == [0] * 8 and int(r.host(big).sum()) == 0
    r.assert_next_step_lands()


# -- slot growth failing ----------------------------------------------------------------------------


def _grow_then_fail(r, method):
    """A big step so the next slot grows, then arm ``method`` for the growth."""
    dev, c = r.dev, r.copier
    big = dev.empty((16384,), np.int32)
    with c.step():
        c.copy(Site.POS, big, np.arange(16384, dtype=np.int32))  # 64 KiB into a 4 KiB slot
    assert c.stats.sites[Site.POS].fallback["slot_full"] == 1
    assert r.host(big).tolist() == list(range(16384))
    r.be.arm(method)
    return big


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("slots", [1, 2])
@pytest.mark.parametrize("method", ["alloc_pinned", "alloc_device"])
def test_slot_growth_allocation_fails(policy, slots, method):
    r = Rig(policy, slots=slots, capacity=4096)
    _grow_then_fail(r, method)
    pinned, allocs = r.live_memory()
    with pytest.raises((InjectedError, cc.CopyError)) as ei:
        with r.copier.step():
            raise AssertionError("not reached: begin() raised")
    if isinstance(ei.value, cc.CopyError):
        assert isinstance(ei.value.__cause__, InjectedError)
    # a half-built slot leaks nothing (the pinned half is freed when the device half fails)
    assert len(r.dev._pinned) <= pinned and len(r.dev._allocs) <= allocs
    r.assert_clean()
    r.assert_next_step_lands()


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("method", ["alloc_pinned", "alloc_device"])
def test_failed_begin_leaves_no_step_open(policy, method):
    """After begin() failed, copy() must not stage into a slot the ring just freed."""
    r = Rig(policy, slots=1, capacity=4096)
    _grow_then_fail(r, method)
    c = r.copier
    with pytest.raises((InjectedError, cc.CopyError)):
        c.begin()
    assert not c.in_step
    a = r.dev.empty((8,), np.int32)
    assert c.copy(Site.POS, a, np.full(8, 3, np.int32)) is True  # eager, outside a step
    assert r.host(a).tolist() == [3] * 8
    r.assert_next_step_lands()


# -- events failing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["event_query", "event_wait"])
def test_ring_wait_fails(method):
    """The ring polls and then waits for a reused slot (lazy: the slot is still in flight).

    Mapped: the launch reads the slot when it runs (an inline one would not need the wait).
    """
    r = Rig("lazy", slots=1, flush_mode="mapped")
    dev, c = r.dev, r.copier
    a = dev.empty((8,), np.int32)
    with c.step():
        c.copy(Site.POS, a, np.full(8, 1, np.int32))
    # the failure persists (a driver's errors are sticky): a failed query in the compiled
    # begin is "no answer", and the Python path that asks again is the one that raises
    r.be.arm(method, times=100)
    with pytest.raises((InjectedError, cc.CopyError)):
        with c.step():
            raise AssertionError("not reached: begin() raised")
    r.be.disarm()
    r.assert_clean()
    assert r.host(a).tolist() == [1] * 8
    r.assert_next_step_lands()


@pytest.mark.parametrize("policy", POLICIES)
def test_event_record_fails_at_flush(policy):
    """The segment was issued, so its copies land and nothing drops; the slot must still be
    waited for before it is reused (its record is retried at the next begin). Mapped: an
    inline launch reads nothing at run time and records no event."""
    r = Rig(policy, slots=1, flush_mode="mapped")
    dev, c = r.dev, r.copier
    a = dev.empty((8,), np.int32)
    src = dev.pinned_empty((8,), np.int32)
    with dev.default_stream.hold() if policy == "lazy" else _nothing():
        r.be.arm("event_record")
        with pytest.raises((InjectedError, cc.CopyError)):
            with c.step():
                src[:] = 5
                c.copy(Site.POS, a, src, on_drop=r.drop("a"))
                src[:] = -1
    r.assert_clean()
    assert r.dropped == []
    # the next step reuses the only slot: it must wait for the first step's scatter
    b = dev.empty((8,), np.int32)
    with c.step():
        c.copy(Site.POS, b, np.full(8, 6, np.int32))
    assert r.host(a).tolist() == [5] * 8
    assert r.host(b).tolist() == [6] * 8
    r.assert_next_step_lands()


# -- on_drop failing ------------------------------------------------------------------------------------


def _raiser(log, tag, exc=ValueError):
    def cb():
        log.append(tag)
        raise exc(f"{tag} refused")

    return cb


def test_on_drop_raises_in_discard():
    r = Rig()
    dev, c = r.dev, r.copier
    a, b, d = (dev.empty((8,), np.int32) for _ in range(3))
    c.begin()
    c.copy(Site.POS, a, np.full(8, 1, np.int32), on_drop=r.drop("a"))
    c.copy(Site.POS, b, np.full(8, 2, np.int32), on_drop=_raiser(r.dropped, "b"))
    c.fill_tail(Site.TAIL, d, 0, 3, on_drop=_raiser(r.dropped, "d", KeyError))
    with pytest.raises(cc.CopyError, match=r"Site\.POS: on_drop raised ValueError\('b refused'\)"):
        c.discard()
    assert r.dropped == ["a", "b", "d"]  # every callback ran, in staging order
    r.assert_clean()
    for arr in (a, b, d):
        assert r.host(arr).tolist() == [0] * 8
    r.assert_next_step_lands()
    assert r.dropped == ["a", "b", "d"]


def test_on_drop_raises_while_a_step_unwinds():
    """Every callback runs and the copier is clean; the step's own exception is not lost."""
    r = Rig()
    dev, c = r.dev, r.copier
    a, b = dev.empty((8,), np.int32), dev.empty((8,), np.int32)
    with pytest.raises(Exception) as ei:
        with c.step():
            c.copy(Site.POS, a, np.full(8, 1, np.int32), on_drop=_raiser(r.dropped, "a"))
            c.copy(Site.POS, b, np.full(8, 2, np.int32), on_drop=r.drop("b"))
            raise LookupError("the step failed")
    chain = [ei.value, ei.value.__cause__, ei.value.__context__]
    assert any(isinstance(e, LookupError) for e in chain)
    assert r.dropped == ["a", "b"]
    r.assert_clean()
    assert r.host(a).tolist() == [0] * 8 and r.host(b).tolist() == [0] * 8
    r.assert_next_step_lands()


@pytest.mark.parametrize("exc", [LookupError, KeyboardInterrupt])
def test_step_reraises_its_own_exception_when_on_drop_fails(exc):
    """``step()`` documents "on an exception discard() and re-raise"."""
    r = Rig()
    a = r.dev.empty((8,), np.int32)
    with pytest.raises(exc):
        with r.copier.step():
            r.copier.copy(Site.POS, a, np.ones(8, np.int32), on_drop=_raiser(r.dropped, "a"))
            raise exc("the step failed")
    assert r.dropped == ["a"]


def test_on_drop_raises_during_a_failed_flush():
    """The flush's CopyError wins; every on_drop still ran."""
    r = Rig(flush_mode="mapped")
    dev, c = r.dev, r.copier
    a, b = dev.empty((8,), np.int32), dev.empty((8,), np.int32)
    r.be.arm("scatter")
    with pytest.raises(cc.CopyError, match="flushing 2 staged copies failed"):
        with c.step():
            c.copy(Site.POS, a, np.full(8, 1, np.int32), on_drop=_raiser(r.dropped, "a"))
            c.copy(Site.POS, b, np.full(8, 2, np.int32), on_drop=r.drop("b"))
    assert r.dropped == ["a", "b"]
    r.assert_clean()
    r.assert_next_step_lands()


def test_keyboard_interrupt_during_flush_stays_a_keyboard_interrupt():
    r = Rig(flush_mode="mapped")
    a = r.dev.empty((8,), np.int32)
    r.be.arm("scatter", exc=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        with r.copier.step():
            r.copier.copy(Site.POS, a, np.ones(8, np.int32), on_drop=r.drop("a"))
    assert r.dropped == ["a"]


# -- a faulty backend can be shared by the module-level API ------------------------------------------


def test_faulty_backend_through_activate():
    r = Rig(flush_mode="dma")
    dev, c = r.dev, r.copier
    a = dev.empty((8,), np.int32)
    r.be.arm("copy2d")
    with c.activate():
        with pytest.raises(cc.CopyError, match=r"Site\.POS: flushing 1 staged"):
            with c.step():
                cc.copy(Site.POS, a, np.ones(8, np.int32), on_drop=r.drop("a"))
        assert r.dropped == ["a"]
        with c.step():
            cc.copy(Site.POS, a, np.full(8, 4, np.int32))
    assert r.host(a).tolist() == [4] * 8
    r.assert_clean()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("flush_mode", ["dma", "mapped"])
def test_a_copy_error_from_the_flush_is_raised_as_it_is(flush_mode):
    # a CopyError (it names the site already) comes out of flush() as raised, not
    # chained to itself; the segment is dropped and the copier goes on
    r = Rig("eager", flush_mode=flush_mode)
    dev, c = r.dev, r.copier
    a = dev.empty((8,), np.int32)
    boom = cc.CopyError("Site.POS: the backend refused the launch")

    def refuse(*args, **kw):
        raise boom

    real = r.be.scatter
    r.be.scatter = refuse
    with pytest.raises(cc.CopyError) as ei:
        with c.step():
            c.copy(Site.POS, a, np.full(8, 2, np.int32), on_drop=r.drop("a"))
    assert ei.value is boom and ei.value.__cause__ is None
    assert r.dropped == ["a"]
    r.be.scatter = real
    r.assert_next_step_lands()
