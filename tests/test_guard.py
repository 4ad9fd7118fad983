"""HostGuard: copies that read an owner's pinned buffer in place, and the fence on its writes.

The simulated device reads pinned memory when the stream runs a copy, not at the call:
that is what makes an unsnapshotted copy unsafe without the guard, and what these tests
lean on (lazy policy: nothing runs before a wait or a synchronize).
"""

from __future__ import annotations

import threading
import time
import warnings

import numpy as np
import pytest

import cucopy as cc
from cucopy import check
from cucopy.backends.sim import SimDevice


class Site(cc.CopySite):
    MASK = cc.H2D  # merged, but read in place when guarded
    POS = cc.H2D  # merged
    PLAIN = cc.H2D  # outside the plan
    GATHER = cc.D2D


PLAN = cc.CopyPlan(merge={Site.MASK, Site.POS})


@pytest.fixture(autouse=True)
def _check_mode_off(monkeypatch):
    """Check mode only where a test asks for it (the check_mode fixture), whatever
    CUCOPY_CHECK says: these tests write guarded buffers without the guard on purpose."""
    monkeypatch.setattr(check, "CHECK_MODE", False)


class World:
    """A lazy sim device, a copier on a stream of its own, a guarded pinned buffer."""

    def __init__(self, policy="lazy", **kw):
        self.dev = SimDevice(policy=policy)
        self.s = self.dev.stream()
        kw.setdefault("wait_timeout", 5.0)
        self.c = cc.DeviceCopier(PLAN, stream=self.s, device=self.dev, **kw)
        self.buf = self.dev.pinned_empty((4, 8), np.int32)
        self.buf[...] = np.arange(32, dtype=np.int32).reshape(4, 8)
        self.g = cc.HostGuard(self.buf, label="mask")
        self.dst = self.dev.zeros((4, 8), np.int32)
        self.pos = self.dev.zeros((8,), np.int32)

    def host(self, arr):
        return self.dev.to_host(arr)


def _use(g, copier):
    return g._by_copier[copier]


# -- why the guard is needed, and what it does ------------------------------------------------


def test_an_in_place_copy_reads_the_buffer_when_the_stream_runs():
    """No snapshot: the copy takes the buffer's bytes as of its execution, so an owner
    that refills the buffer before the stream ran it uploads the new bytes. That is the
    race the guard's write() rules out (with check mode off nothing stops this write)."""
    w = World()
    old = w.buf.copy()
    with w.c.step():
        assert w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g) is True
    assert w.s.pending  # lazy: issued, not run
    w.buf[...] = -1  # unguarded: the copy has not run yet
    assert (w.host(w.dst) == -1).all()
    # the same without guard= is snapshotted at the call
    w.buf[...] = old
    with w.c.step():
        w.c.copy(Site.MASK, w.dst, w.buf)
    w.buf[...] = -2
    assert (w.host(w.dst) == old).all()


def test_write_waits_for_the_copy_and_the_device_keeps_the_old_bytes():
    w = World()
    old = w.buf.copy()
    with w.c.step():
        w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g)
    assert w.g.in_flight
    with w.g.write() as g:  # waits for the copy (its event only), then the owner writes
        assert g is w.g
        assert not w.g.in_flight
        w.buf[...] = 7
    assert (w.host(w.dst) == old).all()
    with w.c.step():
        w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g)
    w.g.wait()
    assert (w.host(w.dst) == 7).all()


def test_write_blocks_behind_a_stalled_stream_until_the_copy_ran():
    """The stalled stream (a long kernel) holds the copy; write() blocks until the
    stall ends and the copy has run, then the write goes through."""
    w = World()
    old = w.buf.copy()
    hold = w.s.hold(stall=True)
    hold.__enter__()
    released = []

    def release():
        time.sleep(0.2)
        released.append(True)
        hold.__exit__(None, None, None)

    with w.c.step():
        w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g)
    th = threading.Thread(target=release)
    th.start()
    t0 = time.monotonic()
    try:
        with w.g.write():
            assert released, "write() returned while the copy was still held"
            w.buf[...] = 2
    finally:
        th.join()
    assert time.monotonic() - t0 >= 0.15
    assert (w.host(w.dst) == old).all()  # the copy read the bytes before the write
    assert (w.buf == 2).all()


def test_a_write_past_the_deadline_names_the_sites_and_the_buffer():
    w = World(wait_timeout=0.05)
    with w.s.hold(stall=True):
        with w.c.step():
            w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g)
            w.c.copy(Site.PLAIN, w.pos, w.buf[1], guard=w.g)
        t0 = time.monotonic()
        with pytest.raises(cc.CopyError) as info:
            with w.g.write():
                raise AssertionError("not reached: the block never runs")
        spent = time.monotonic() - t0
        msg = str(info.value)
        assert 0.05 <= spent < 2.0
        assert msg.startswith("Site.MASK x1, Site.PLAIN x1: HostGuard 'mask'")
        assert "write(): waited" in msg and "wait_timeout=0.05 s" in msg
        assert "do not write the buffer yet" in msg
        assert w.g.in_flight
        with pytest.raises(cc.CopyError, match="waited"):  # still stalled: again
            w.g.wait()
    with w.g.write():  # the stall ended: the fence holds, nothing lost
        w.buf[...] = 0
    assert w.host(w.dst).reshape(-1).tolist() == list(range(32))
    assert w.host(w.pos).tolist() == list(range(8, 16))


def test_one_event_a_step_for_all_of_its_copies():
    w = World()
    with w.c.step():
        for r in range(4):
            w.c.copy(Site.MASK, w.dst[r], w.buf[r], guard=w.g)
        use = _use(w.g, w.c)
        assert use.owed and use.ticket == 0  # recorded at the step's flush, not per copy
    assert not use.owed and use.ticket == 1
    with w.c.step():  # a step without in-place copies records nothing for the guard
        w.c.copy(Site.POS, w.pos, np.ones(8, np.int32))
    assert use.ticket == 1
    w.g.wait()
    assert (w.host(w.dst) == w.buf).all()


def test_a_write_while_the_step_is_open_records_the_event_then():
    w = World()
    old = w.buf.copy()
    with w.c.step():
        w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g)
        with w.g.write():  # the copy is enqueued: the event goes after it now
            w.buf[...] = 5
        use = _use(w.g, w.c)
        assert use.ticket == 1 and not use.owed
        w.c.copy(Site.POS, w.pos, np.ones(8, np.int32))
    assert use.ticket == 1  # nothing owed at the flush
    assert (w.host(w.dst) == old).all()


def test_outside_a_step_the_event_is_recorded_at_the_call():
    w = World()
    old = w.buf.copy()
    assert w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g) is True
    use = _use(w.g, w.c)
    assert use.ticket == 1 and not use.owed
    with w.g.write():
        w.buf[...] = 9
    assert (w.host(w.dst) == old).all()
    st = w.c.stats.sites[Site.MASK]
    assert st.eager == 1 and st.fallback["in_place"] == 1 and st.merged == 0


def test_counted_as_eager_with_its_reason():
    w = World()
    with w.c.step():
        w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g)  # a merged site: in_place
        w.c.copy(Site.PLAIN, w.pos, w.buf[0], guard=w.g)  # outside the plan: no reason
        w.c.copy(Site.POS, w.pos, np.ones(8, np.int32))
    sites = w.c.stats.sites
    assert sites[Site.MASK].as_dict() == {
        "merged": 0,
        "eager": 1,
        "skipped": 0,
        "fallback": {"in_place": 1},
        "checked": 0,
    }
    assert sites[Site.PLAIN].eager == 1 and not sites[Site.PLAIN].fallback
    assert sites[Site.POS].merged == 1


def test_program_order_with_staged_copies():
    w = World()
    row = w.buf[2]
    with w.c.step():
        w.c.copy(Site.POS, w.pos, np.full(8, -3, np.int32))  # staged
        w.c.copy(Site.MASK, w.pos, row, guard=w.g)  # overlaps it: the staged copy lands first
        assert w.c.staged == 0 and w.c.stats.eager_flushes == 1
    assert w.host(w.pos).tolist() == row.tolist()
    with w.c.step():
        w.c.copy(Site.MASK, w.pos, row, guard=w.g)
        w.c.copy(Site.POS, w.pos, np.full(8, 4, np.int32))  # staged after: lands after
    assert w.host(w.pos).tolist() == [4] * 8


def test_a_discarded_step_keeps_its_in_place_copies():
    """An in-place copy is issued at the call: a discard drops none (as any eager copy)."""
    w = World()
    dropped = []
    with pytest.raises(KeyError):
        with w.c.step():
            w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g, on_drop=lambda: dropped.append(1))
            raise KeyError("engine error")
    assert dropped == [] and _use(w.g, w.c).ticket == 1
    w.g.wait()
    assert (w.host(w.dst) == w.buf).all()


@pytest.mark.parametrize(
    "dst_of,src_of",
    [
        (lambda d: d[:2, :3], lambda b: b[:2, :3]),  # row-strided both sides
        (lambda d: d.reshape(-1)[:6].reshape(2, 3), lambda b: b[:2, :3]),  # into dense rows
        (lambda d: d[1:3, 2:5], lambda b: b.reshape(-1)[:6]),  # flat into row-strided
        (lambda d: d[:, ::2], lambda b: b.reshape(-1)[:16]),  # flat into a stepped view
        (lambda d: d[:, 1::2], lambda b: b[:, ::2]),  # stepped (rows of one element) both
        (lambda d: d[::-1, :3], lambda b: b[:4, 1:4]),  # row-strided into a reversed view
        (lambda d: d, lambda b: b),
    ],
    ids=["2d-2d", "2d-dense", "flat-2d", "flat-stepped", "stepped-stepped", "2d-reversed", "whole"],
)
def test_layouts_give_the_bytes_a_snapshot_would(dst_of, src_of):
    w = World()
    dst = dst_of(w.dst)
    src = src_of(w.buf)
    want = np.zeros((4, 8), np.int32)
    dst_of(want)[...] = np.asarray(src).reshape(dst_of(want).shape)
    with w.c.step():
        w.c.copy(Site.MASK, dst, src, guard=w.g)
    w.g.wait()
    assert (w.host(w.dst) == want).all()


def test_unchanged_with_a_guard_skips_as_usual():
    w = World()
    with w.c.step():
        assert w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g, unchanged=True) is False
    assert w.c.stats.sites[Site.MASK].skipped == 1
    assert w.c not in w.g._by_copier


# -- module-level routing ----------------------------------------------------------------------


def test_module_level_copy_takes_the_guard():
    w = World()
    old = w.buf.copy()
    with w.c.activate():
        assert cc.copy(Site.MASK, w.dst, w.buf, guard=w.g) is True  # outside a step
    with w.c.step():  # the step's copier (no activate())
        assert cc.copy(Site.MASK, w.dst[0], w.buf[1], guard=w.g) is True
    assert w.c.stats.sites[Site.MASK].fallback["in_place"] == 2
    with w.g.write():
        w.buf[...] = -1
    want = old.copy()
    want[0] = old[1]
    assert (w.host(w.dst) == want).all()


def test_module_level_copy_with_no_active_copier_is_a_plain_copy_fenced_too():
    dev = SimDevice()
    buf = dev.pinned_empty((8,), np.int32)
    buf[:] = 3
    g = cc.HostGuard(buf)
    dst = dev.zeros((8,), np.int32)
    before = cc.copier.unrouted[Site.PLAIN]
    assert cc.copy(Site.PLAIN, dst, buf, guard=g) is True
    assert cc.copier.unrouted[Site.PLAIN] == before + 1
    assert g.in_flight
    with g.write():
        buf[:] = 4
    assert dev.to_host(dst).tolist() == [3] * 8


# -- check mode ------------------------------------------------------------------------------------


def test_check_mode_catches_a_write_that_skipped_the_guard_at_write(check_mode):
    w = World()
    with w.c.step():
        w.c.copy(Site.MASK, w.dst[:2, :3], w.buf[:2, :3], guard=w.g)
    w.buf[1, 2] = 99  # read by the copy: element 10, byte 40 of the buffer
    with pytest.raises(cc.CopyError) as info:
        with w.g.write():
            raise AssertionError("not reached")
    msg = str(info.value)
    assert msg.startswith("Site.MASK: HostGuard 'mask'")
    assert "byte 40 of the guarded buffer" in msg
    assert "written without HostGuard.write() while a copy read it" in msg
    with w.g.write():  # reported once; the guarded write goes through
        w.buf[...] = 0


def test_check_mode_catches_it_at_the_next_copy_through_the_guard(check_mode):
    w = World()
    want = np.arange(8, dtype=np.int32) * 5
    with w.c.step():
        w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g)
    w.buf[3, 7] = -1
    with w.c.step():
        w.c.copy(Site.POS, w.pos, want)
        with pytest.raises(cc.CopyError, match=r"^Site\.MASK: HostGuard 'mask'.*byte 124 "):
            w.c.copy(Site.PLAIN, w.pos, w.buf[0], guard=w.g)
        assert w.c.staged == 1  # nothing issued, nothing staged lost
    assert w.host(w.pos).tolist() == want.tolist()


def test_check_mode_catches_it_at_the_copiers_flush(check_mode):
    w = World()
    with pytest.raises(cc.CopyError, match=r"found at the copier's flush"):
        with w.c.step():
            w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g)
            w.c.copy(Site.POS, w.pos, np.ones(8, np.int32))
            w.buf[0, 0] = 42
    assert w.host(w.pos).tolist() == [1] * 8  # the segment landed before the report
    with w.c.step():  # and the copier goes on
        w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g)
    w.g.wait()
    assert w.host(w.dst)[0, 0] == 42


def test_check_mode_lets_unread_bytes_and_guarded_writes_through(check_mode):
    w = World()
    with w.c.step():
        w.c.copy(Site.MASK, w.dst[:2, :3], w.buf[:2, :3], guard=w.g)
    w.buf[0, 3:] = -7  # never read by a copy: no fence needed
    w.buf[2:] = -8
    with w.c.step():
        w.c.copy(Site.POS, w.pos, np.ones(8, np.int32))
    with w.g.write():
        w.buf[...] = 1
    with w.c.step():
        w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g)
    w.g.wait()
    assert (w.host(w.dst) == 1).all()


def test_without_check_mode_nothing_is_verified():
    w = World()
    with w.c.step():
        w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g)
    w.g.wait()
    w.buf[...] = 3  # after the copy completed, unguarded: not verified with check mode off
    with w.c.step():
        w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g)
    w.g.wait()
    assert w.g._watch is None


# -- bad input: nothing staged is lost -----------------------------------------------------------


def _torch():
    return pytest.importorskip("torch")


def _pinned_tensor(dev, n):
    """A torch CPU tensor the simulated device reads as pinned memory."""
    torch = _torch()
    t = torch.empty(n, dtype=torch.int32)  # (a resizable storage, as the owner's)
    t.copy_(torch.arange(n, dtype=torch.int32))
    raw = t.numpy().reshape(-1).view(np.uint8)
    dev._register_pinned(raw)
    return t, raw


BAD = [
    pytest.param(
        lambda w: w.c.copy(
            Site.MASK,
            w.dst,
            np.zeros((4, 8), np.int32),
            guard=cc.HostGuard(np.zeros((4, 8), np.int32), label="pageable"),
        ),
        ValueError,
        r"^Site\.MASK: guard=HostGuard 'pageable' .*: the buffer is not pinned",
        id="not_pinned",
    ),
    pytest.param(
        lambda w: w.c.copy(Site.MASK, w.dst, w.dev.pinned_empty((4, 8), np.int32), guard=w.g),
        ValueError,
        r"^Site\.MASK: src numpy\.ndarray\(int32, shape=\(4, 8\)\) at .* does not lie inside "
        r"guard=HostGuard 'mask'",
        id="src_outside_the_buffer",
    ),
    pytest.param(
        lambda w: w.c.copy(Site.MASK, w.dev.zeros((8, 4), np.int32), w.buf.T, guard=w.g),
        ValueError,
        r"^Site\.MASK: guard=: the source must be contiguous or one 2-D row-strided view",
        id="src_not_one_2d_form",
    ),
    pytest.param(
        lambda w: w.c.copy(Site.GATHER, w.pos, w.dev.zeros((8,), np.int32), guard=w.g),
        ValueError,
        r"^Site\.GATHER: guard= reads a host source in place; a D2D site has none",
        id="d2d_site",
    ),
    pytest.param(
        lambda w: w.c.copy(Site.MASK, w.dst, w.buf, guard=w.buf),
        TypeError,
        r"^Site\.MASK: guard: expected a cucopy\.HostGuard, got ndarray",
        id="not_a_guard",
    ),
    pytest.param(
        lambda w: w.c.copy(Site.MASK, w.dst, w.buf[0], guard=w.g),
        ValueError,
        r"^Site\.MASK: shape mismatch|^Site\.MASK: size mismatch",
        id="size_mismatch",
    ),
    pytest.param(
        lambda w: (w.g.close(), w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g)),
        cc.CopyError,
        r"^Site\.MASK: guard=HostGuard 'mask' .* is closed; make a new HostGuard",
        id="closed_guard",
    ),
    pytest.param(
        lambda w: w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g, on_drop=3),
        TypeError,
        r"^Site\.MASK: on_drop must be callable",
        id="on_drop_not_callable",
    ),
]


@pytest.mark.parametrize("fn,exc,match", BAD)
def test_bad_guarded_copies_lose_nothing(fn, exc, match):
    w = World()
    want = np.arange(8, dtype=np.int32) * 3
    with w.c.step():
        assert w.c.copy(Site.POS, w.pos, want.copy()) is True
        with pytest.raises(exc, match=match):
            fn(w)
        assert w.c.staged == 1, "the bad call staged something or lost the staged copy"
        assert w.c.in_step
    assert w.host(w.pos).tolist() == want.tolist()
    assert (w.host(w.dst) == 0).all()  # nothing was issued
    with w.c.step():
        w.c.copy(Site.POS, w.pos, want[::-1].copy())
    assert w.host(w.pos).tolist() == want[::-1].tolist()


def test_a_freed_buffer_is_refused_naming_the_site_and_the_buffer():
    torch = _torch()
    w = World()
    t, raw = _pinned_tensor(w.dev, 32)
    g = cc.HostGuard(t, label="lens")
    dst = w.dev.zeros((32,), np.int32)
    with w.c.step():
        w.c.copy(Site.MASK, dst, t, guard=g)
    g.wait()
    assert w.host(dst).tolist() == list(range(32))
    w.dev._unregister_pinned(raw)
    # the owner swaps in another storage, and the old one is freed (torch refuses to
    # resize a storage NumPy has seen, as cucopy's resolve does, so set_ is the way)
    t.set_(torch.zeros(64, dtype=torch.int32))
    want = np.arange(8, dtype=np.int32) + 1
    with w.c.step():
        w.c.copy(Site.POS, w.pos, want)
        with pytest.raises(
            cc.CopyError,
            match=r"^Site\.MASK: guard=HostGuard 'lens' \(torch\.Tensor\(cpu, torch\.int32, "
            r"shape=\(32,\)\)\): copy\(\): the guarded buffer was freed or reallocated .*"
            r"shape \(32,\) -> \(64,\)",
        ):
            w.c.copy(Site.MASK, dst, t, guard=g)
        assert w.c.staged == 1
    assert w.host(w.pos).tolist() == want.tolist()
    with pytest.raises(cc.CopyError, match="freed or reallocated"):
        g.wait()
    assert torch.is_tensor(g.buffer)


def test_a_buffer_reallocated_while_a_copy_reads_it_is_refused_at_its_next_use():
    torch = _torch()
    w = World()
    t, raw = _pinned_tensor(w.dev, 32)
    g = cc.HostGuard(t, label="lens")
    dst = w.dev.zeros((32,), np.int32)
    want = np.arange(8, dtype=np.int32) + 1
    with w.s.hold():
        with w.c.step():
            w.c.copy(Site.MASK, dst, t, guard=g)
        old = t.untyped_storage()  # (keeps the old bytes valid: the held copy reads them)
        t.set_(torch.full((32,), 5, dtype=torch.int32))  # the owner swaps the storage
        with w.c.step():
            w.c.copy(Site.POS, w.pos, want)
            with pytest.raises(
                cc.CopyError,
                match=r"^Site\.MASK: guard=HostGuard 'lens' .*freed or reallocated .*"
                r"copies not known complete: Site\.MASK\)",
            ):
                w.c.copy(Site.MASK, dst, t, guard=g)
            assert w.c.staged == 1
    w.dev.synchronize()
    assert w.host(dst).tolist() == list(range(32))  # the held copy read the old buffer
    assert w.host(w.pos).tolist() == want.tolist()
    w.dev._unregister_pinned(raw)
    del old


def test_guarded_copies_are_refused_during_capture():
    w = World()
    s2 = w.dev.stream()
    c2 = cc.DeviceCopier(PLAN, stream=s2, device=w.dev)
    with w.dev.capture(s2):
        with pytest.raises(
            ValueError, match=r"^Site\.MASK: guard= is refused during graph capture"
        ):
            c2.copy(Site.MASK, w.dst, w.buf, guard=w.g)
        with c2.step():
            with pytest.raises(ValueError, match="refused during graph capture"):
                c2.copy(Site.MASK, w.dst, w.buf, guard=w.g)
    assert c2 not in w.g._by_copier


def test_close_waits_for_the_copies_then_refuses_more():
    w = World(wait_timeout=0.05)
    with w.s.hold(stall=True):
        with w.c.step():
            w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g)
        with pytest.raises(cc.CopyError, match=r"^Site\.MASK x1: HostGuard 'mask' .*close\(\)"):
            w.g.close()
        assert not w.g.closed  # still guarding: the copy may still read the buffer
    w.g.close()
    assert w.g.closed and w.g.buffer is None
    w.g.close()  # idempotent
    assert (w.host(w.dst) == w.buf).all()
    with pytest.raises(cc.CopyError, match=r"write\(\): the guard is closed"):
        with w.g.write():
            pass


def test_a_guard_is_made_over_host_memory_only():
    dev = SimDevice()
    with pytest.raises(ValueError, match=r"^HostGuard: buf must be host memory .*SimArray"):
        cc.HostGuard(dev.zeros((4,), np.int32))
    with pytest.raises(TypeError, match=r"^HostGuard: buf: "):
        cc.HostGuard([1, 2, 3])
    with pytest.raises(TypeError, match=r"^HostGuard: label must be a str"):
        cc.HostGuard(np.zeros(4), label=3)
    g = cc.HostGuard(np.zeros(4, np.int32))  # pinnedness is asked when a copier uses it
    assert "numpy.ndarray(int32, shape=(4,))" in repr(g) and g.label.startswith("numpy")


# -- the twins ---------------------------------------------------------------------------------------


_fast_guarded: list = []  # the guarded copies each scenario's compiled case issued


def _scenario(cc_mod, sim_mod, policy: str) -> tuple:
    """Guarded copies among merged ones, written through the guard: the device bytes and
    the stats, in one copy of cucopy (compiled or pure)."""

    class S(cc_mod.CopySite):
        MASK = cc_mod.H2D
        POS = cc_mod.H2D

    dev = sim_mod.SimDevice(policy=policy, seed=7)
    c = cc_mod.DeviceCopier(
        cc_mod.CopyPlan(merge={S.MASK, S.POS}, flush_after={S.POS}),
        stream=dev.stream(),
        device=dev,
        backend="sim",
        slots=2,
        capacity=4096,
    )
    buf = dev.pinned_empty((16, 24), np.int32)
    g = cc_mod.HostGuard(buf, label="twin")
    table = dev.zeros((16, 24), np.int32)
    pos = dev.zeros((64,), np.int32)
    rng = np.random.default_rng(3)
    for step in range(30):
        r, k = int(rng.integers(1, 17)), int(rng.integers(1, 25))
        with g.write():
            buf[:r, :k] = rng.integers(-100, 100, (r, k))
        with c.step():
            c.copy(S.POS, pos[: 2 * r], rng.integers(0, 9, 2 * r).astype(np.int32))
            c.copy(S.MASK, table[:r, :k], buf[:r, :k], guard=g)
            if step % 3 == 0:
                c.copy(S.MASK, pos[:k], buf[r - 1, :k], guard=g)
            c.copy(S.MASK, table[r - 1 :, 0], np.full(17 - r, step, np.int32))
    c.close()
    _fast_guarded.append(c._fast_guarded)
    return dev.to_host(table).tobytes(), dev.to_host(pos).tobytes(), c.stats.sites[S.MASK].as_dict()


@pytest.mark.parametrize("policy", ["lazy", "eager", "random"])
def test_both_cores_give_the_same_bytes(policy, monkeypatch):
    import test_twins

    compiled = _scenario(cc, cc.backends.sim, policy)
    pure = test_twins._load_pure_world()
    monkeypatch.setattr(pure.cc.check, "CHECK_MODE", False)  # its own copy of the switch
    python = _scenario(pure.cc, pure.sim, policy)
    assert python == compiled
    assert compiled[2]["fallback"]["in_place"] == 40
    if cc.copier._COMPILED:  # the compiled guarded copy took most of them
        assert _fast_guarded[-2] > 20 and _fast_guarded[-1] == 0


def test_check_mode_names_the_site_whose_copy_read_the_byte(check_mode):
    w = World()
    with w.c.step():
        w.c.copy(Site.MASK, w.dst[:2], w.buf[:2], guard=w.g)
        w.c.copy(Site.PLAIN, w.pos, w.buf[3], guard=w.g)
    w.buf[3, 5] = -5  # read by Site.PLAIN's copy only
    with pytest.raises(cc.CopyError, match=r"^Site\.PLAIN: HostGuard 'mask'.*byte 116 "):
        w.g.wait()
    w.g.wait()  # reported once


def test_a_graph_steps_in_place_copies_are_fenced_at_its_end():
    """A graph step's end is no flush (its copies wait for the replay), but its in-place
    copies were issued at the call: the guard's event is recorded at the step's end."""
    w = World()
    with w.dev.capture(w.s) as graph:
        feed = w.c.capture_inputs()
    old = w.buf.copy()
    with w.c.step(graph=feed):
        w.c.copy(Site.POS, w.pos, np.full(8, 6, np.int32))  # waits for the replay
        w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g)
    use = _use(w.g, w.c)
    assert use.ticket == 1 and not use.owed
    with w.g.write():
        w.buf[...] = 0
    feed.replay(graph)
    assert w.host(w.pos).tolist() == [6] * 8
    assert (w.host(w.dst) == old).all()


def test_write_waits_for_the_guards_event_not_for_the_stream():
    """Work enqueued after the step (the engine's graph replay) does not hold up the
    owner's write: the wait ends at the guard's event, recorded at the step's flush."""
    w = World()
    ran = []
    with w.c.step():
        w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g)
    w.s.launch(lambda: ran.append("model"))  # later work on the same stream
    with w.g.write():
        assert ran == []  # not run: the write waited for the copy alone
        w.buf[...] = 1
    w.s.synchronize()
    assert ran == ["model"]


# -- the compiled common case (cucopy/_core/guard.c) -------------------------------------------

needs_compiled = pytest.mark.skipif(
    not getattr(cc.copier, "_COMPILED", False) or cc.guard._CompiledGuardCore is None,
    reason="the compiled staging core is not in use (not built, or CUCOPY_PURE_PYTHON=1)",
)


def _python_copies_refused(monkeypatch, after: int = 0) -> list:
    """Make DeviceCopier._copy_guarded (the Python path) raise after ``after`` calls;
    returns the list of the sites it was called for."""
    calls: list = []
    body = cc.DeviceCopier._copy_guarded

    def spy(self, site, *a):
        calls.append(site)
        if len(calls) > after:
            raise AssertionError(f"{site}: the guarded copy ran in Python")
        return body(self, site, *a)

    monkeypatch.setattr(cc.DeviceCopier, "_copy_guarded", spy)
    return calls


@needs_compiled
def test_guarded_copies_after_the_first_run_compiled_and_fence_as_the_python_path(monkeypatch):
    """The first copy per (guard, copier) and destination goes through Python (pinned
    verified, the destination cached); the rest run in C: one copy from the buffer
    itself, the event owed once a step and recorded by flush()'s Python body, so that
    write() waits for exactly those copies (a stalled stream holds them)."""
    w = World()
    with w.c.step():
        w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g)  # Python: pinned, dst cached
        w.c.copy(Site.PLAIN, w.pos, w.buf[1], guard=w.g)
    w.g.wait()
    calls = _python_copies_refused(monkeypatch)
    use = _use(w.g, w.c)
    rows = w.dst[:3, 2:7]  # a view of a cached destination, made afresh
    for k in range(6):
        with w.g.write():
            w.buf[...] = np.arange(32, dtype=np.int32).reshape(4, 8) + 100 * k
        want = w.buf.copy()
        hold = w.s.hold(stall=True)
        hold.__enter__()
        with w.c.step():
            assert w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g) is True
            assert w.c.copy(Site.PLAIN, w.pos, w.buf[1], guard=w.g) is True
            cc.copy(Site.MASK, rows, w.buf[:3, 1:6], guard=w.g)  # module level: routed
            assert use.owed and w.c._guarded and len(w.c._guards_owed) == 1
            assert w.g._active == [use] and use.timeout == w.c.wait_timeout
            assert use.sites == {Site.MASK: 2, Site.PLAIN: 1}
        assert not use.owed and not w.c._guarded and w.c._guards_owed == []
        assert w.g.in_flight  # held: the copies have not run
        done = []

        def release(hold=hold, done=done):
            time.sleep(0.05)
            done.append(True)
            hold.__exit__(None, None, None)

        th = threading.Thread(target=release)
        th.start()
        with w.g.write():
            assert done, "write() returned before the held copies ran"
            got = w.host(w.dst).copy()
            w.buf[...] = -1  # the copies read the buffer already
        th.join()
        want_dst = want.copy()
        want_dst[:3, 2:7] = want[:3, 1:6]
        assert (got == want_dst).all()
        assert (w.host(w.dst) == want_dst).all()
        assert w.host(w.pos).tolist() == want[1].tolist()
        assert use.sites == {}
    assert calls == [] and w.c._fast_guarded == 18
    st = w.c.stats.sites
    assert st[Site.MASK].eager == 13 and st[Site.MASK].fallback["in_place"] == 13
    assert st[Site.PLAIN].eager == 7 and not st[Site.PLAIN].fallback


@needs_compiled
def test_what_the_compiled_case_leaves_to_python(monkeypatch, check_mode):
    """Check mode, a copy outside a step, another copier and a destination over staged
    bytes go to the Python path, which does what it always did."""
    w = World()
    with w.c.step():
        w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g)
    calls = _python_copies_refused(monkeypatch, after=99)
    with w.c.step():
        w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g)  # check mode: Python's
    assert calls == [Site.MASK] and w.c._fast_guarded == 0
    w.buf[0, 0] = 99  # without write(): check mode catches it
    with pytest.raises(cc.CopyError, match=r"^Site\.MASK: HostGuard 'mask'.*byte 0 "):
        w.g.wait()
    check.CHECK_MODE = False
    w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g)  # outside a step
    assert len(calls) == 2
    c2 = cc.DeviceCopier(PLAN, stream=w.dev.stream(), device=w.dev)
    with c2.step():
        c2.copy(Site.MASK, w.dst, w.buf, guard=w.g)  # another copier: its use is Python's
    with w.c.step():
        w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g)  # the last copier's use is c2's now
        w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g)  # C
        w.c.copy(Site.POS, w.pos, np.ones(8, np.int32))  # staged
        w.c.copy(Site.MASK, w.pos, w.buf[2], guard=w.g)  # over it: Python lands it first
        assert w.c.staged == 0 and w.c.stats.eager_flushes == 1
    assert len(calls) == 5 and w.c._fast_guarded == 1
    w.g.wait()
    assert w.host(w.pos).tolist() == w.buf[2].tolist()
    c2.close()


@needs_compiled
@pytest.mark.parametrize("fn,exc,match", BAD)
def test_bad_guarded_copies_are_refused_as_before_once_the_compiled_case_is_warm(fn, exc, match):
    w = World()
    with w.c.step():
        w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g)
        w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g)
    assert w.c._fast_guarded == 1
    w.g.wait()
    w.dst[...] = 0
    want = np.arange(8, dtype=np.int32) * 3
    with w.c.step():
        assert w.c.copy(Site.POS, w.pos, want.copy()) is True
        with pytest.raises(exc, match=match):
            fn(w)
        assert w.c.staged == 1 and w.c.in_step
    assert w.c._fast_guarded == 1
    assert w.host(w.pos).tolist() == want.tolist()
    assert (w.host(w.dst) == 0).all()  # nothing was issued


@needs_compiled
def test_a_buffer_changed_under_a_warm_guard_and_a_capture_are_refused_by_python():
    w = World()
    with w.c.step():
        w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g)
        w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g)
    assert w.c._fast_guarded == 1
    w.g.wait()
    with warnings.catch_warnings():  # (NumPy 2.5 deprecates setting .shape)
        warnings.simplefilter("ignore", DeprecationWarning)
        w.buf.shape = (8, 4)  # the array the guard was made over, reshaped in place
    with w.c.step():
        with pytest.raises(
            cc.CopyError,
            match=r"^Site\.MASK: guard=HostGuard 'mask' .*"
            r"freed or reallocated .*shape \(4, 8\) -> \(8, 4\)",
        ):
            w.c.copy(Site.MASK, w.dst, w.buf.reshape(4, 8), guard=w.g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        w.buf.shape = (4, 8)
    with w.c.step():
        w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g)
        with w.dev.capture(w.s):  # a capture begun after begin()
            with pytest.raises(ValueError, match=r"^Site\.MASK: guard= is refused during"):
                w.c.copy(Site.MASK, w.dst, w.buf, guard=w.g)
    assert w.c._fast_guarded == 2
