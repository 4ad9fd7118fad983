"""Every host wait cucopy makes has a deadline, and reports what it waited for."""

from __future__ import annotations

import gc
import math
import time

import numpy as np
import pytest

import cucopy as cc
from cucopy import deadline
from cucopy.backends.sim import SimDevice


class Site(cc.CopySite):
    POS = cc.H2D
    LENS = cc.H2D


PLAN = cc.CopyPlan(merge={Site.POS, Site.LENS})


def _stalled_ring(_, mode="dma", **kw):
    dev = SimDevice()
    s = dev.stream()
    a = dev.zeros((4,), np.int64)
    b = dev.zeros((4,), np.int32)
    c = cc.DeviceCopier(PLAN, stream=s, device=dev, slots=2, flush_mode=mode, **kw)
    return dev, s, a, b, c


def test_a_stalled_stream_raises_the_diagnostic_and_the_copier_stays_usable():
    dev, s, a, b, c = _stalled_ring(None, wait_timeout=0.05)
    with s.hold(stall=True):
        for i in range(2):  # both slots in flight behind the stall
            with c.step():
                c.copy(Site.POS, a, np.arange(4) + i)
                c.copy(Site.LENS, b, np.arange(4, dtype=np.int32))
        t0 = time.monotonic()
        with pytest.raises(cc.CopyError) as info:
            with c.step():
                raise AssertionError("not reached: begin() waits and raises")
        spent = time.monotonic() - t0
        msg = str(info.value)
        assert 0.05 <= spent < 2.0
        assert "the next ring slot (a step, or an eager copy's snapshot): waited 0.05" in msg
        assert "wait_timeout=0.05 s" in msg
        assert "ring slot 0" in msg and "SimEvent" in msg and "SimStream(s1" in msg
        assert "1 segment(s), 2 copies" in msg
        assert "Site.POS x1" in msg and "Site.LENS x1" in msg
        assert c.staged == 0 and not c.in_step
        with pytest.raises(cc.CopyError, match="waited"):  # still stalled: again
            c.begin()
    with c.step():  # the stall ended: usable, nothing lost
        c.copy(Site.POS, a, np.arange(4) + 7)
    assert dev.to_host(a).tolist() == [7, 8, 9, 10]
    assert dev.to_host(b).tolist() == [0, 1, 2, 3]
    assert c.stats.host_waits >= 1
    c.close()


def test_an_eager_copy_outside_a_step_waits_with_the_deadline():
    dev, s, a, b, c = _stalled_ring(None, wait_timeout=0.03, capacity=4096)
    big = dev.zeros((1024,), np.int64)  # 8 KiB: more than a slot holds
    with s.hold(stall=True):
        with pytest.raises(cc.CopyError, match=r"the next ring slot .*: waited"):
            for i in range(3):  # outside a step: each moves to the next slot
                c.copy(Site.POS, big, np.arange(1024) + i)
    c.copy(Site.POS, big, np.arange(1024) + 3)
    assert dev.to_host(big)[:3].tolist() == [3, 4, 5]
    c.close()


def test_close_behind_a_stall_reports_and_still_closes():
    dev, s, a, b, c = _stalled_ring(None, wait_timeout=0.03)
    with s.hold(stall=True):
        with c.step():
            c.copy(Site.POS, a, np.arange(4) + 1)
        with pytest.raises(cc.CopyError, match=r"close\(\): a ring slot in flight: waited"):
            c.close()
        assert c.closed  # closed; its ring is set aside and freed once its work ran
        with pytest.raises(cc.CopyError, match="closed"):
            c.copy(Site.POS, a, np.arange(4))
    assert dev.to_host(a).tolist() == [1, 2, 3, 4]
    cc.DeviceCopier(PLAN, stream=s, device=dev).close()  # frees the set-aside ring


def test_an_unbounded_wait_behind_a_plain_hold_is_still_a_sim_deadlock():
    """hold() without stall: a wait raises SimDeadlock at once (on a GPU: a hang until the
    deadline), so the existing stall tests cost nothing."""
    dev, s, a, b, c = _stalled_ring(None, wait_timeout=600)
    with s.hold():
        for i in range(2):
            with c.step():
                c.copy(Site.POS, a, np.arange(4) + i)
        t0 = time.monotonic()
        with pytest.raises(cc.CopyError, match="held"):
            c.begin()
        assert time.monotonic() - t0 < 1
    c.close()


def test_waits_sleep_between_queries():
    calls = []

    def query(_):
        calls.append(time.monotonic())
        return False

    t0 = time.monotonic()
    assert deadline.poll(query, None, 0.05) is False
    assert 0.05 <= time.monotonic() - t0 < 1
    assert 5 <= len(calls) <= 120  # 20 us doubling to 1 ms: ~55 queries in 50 ms
    gaps = np.diff(calls)
    assert gaps.max() >= 0.0008  # the longest sleep
    assert deadline.poll(lambda _: True, None, 1e-9) is True


def test_the_deadline_comes_from_the_argument_the_environment_or_the_default(monkeypatch):
    dev = SimDevice()
    monkeypatch.delenv("CUCOPY_WAIT_TIMEOUT", raising=False)
    assert cc.DeviceCopier(device=dev).wait_timeout == deadline.DEFAULT_WAIT_TIMEOUT == 300
    monkeypatch.setenv("CUCOPY_WAIT_TIMEOUT", "2.5")
    assert cc.DeviceCopier(device=dev).wait_timeout == 2.5
    c = cc.DeviceCopier(device=dev, wait_timeout=7)
    assert c.wait_timeout == 7.0 and c._ring.timeout == 7.0
    assert cc.DeviceCopier(device=dev, wait_timeout=math.inf).wait_timeout == math.inf
    gc.collect()


@pytest.mark.parametrize(
    ("value", "exc", "match"),
    [
        (0, ValueError, r"wait_timeout: expected seconds > 0, got 0\.0"),
        (-1.5, ValueError, r"wait_timeout: expected seconds > 0, got -1\.5"),
        (math.nan, ValueError, r"wait_timeout: expected seconds > 0, got nan"),
        ("5", TypeError, r"wait_timeout: expected seconds as an int or float, got str '5'"),
        (True, TypeError, r"wait_timeout: expected seconds as an int or float, got bool True"),
    ],
)
def test_a_bad_deadline_is_refused_naming_it(value, exc, match):
    with pytest.raises(exc, match=match):
        cc.DeviceCopier(device=SimDevice(), wait_timeout=value)


@pytest.mark.parametrize("raw", ["0", "-3", "soon", "nan"])
def test_a_bad_deadline_in_the_environment_is_refused_naming_it(monkeypatch, raw):
    monkeypatch.setenv("CUCOPY_WAIT_TIMEOUT", raw)
    with pytest.raises(ValueError, match=f"CUCOPY_WAIT_TIMEOUT: expected seconds > 0, got '{raw}'"):
        cc.DeviceCopier(device=SimDevice())


@pytest.mark.gpu
def test_a_held_cuda_stream_times_out_with_the_diagnostic():
    """On the GPU: a stream held by a spinning kernel; the ring's wait polls the event
    (compiled cuEventQuery with sleeps), raises at its deadline, and the copier is usable
    once the hold ends."""
    import cupy

    from cucopy.backends.cuda import CudaBackend

    stream = cupy.cuda.Stream(non_blocking=True)
    a = cupy.zeros(4, np.int64)
    cupy.cuda.get_current_stream().synchronize()
    c = cc.DeviceCopier(
        PLAN, stream=stream, device=0, backend="cuda", slots=2, flush_mode="dma", wait_timeout=0.2
    )
    be = CudaBackend(0)
    with be.hold(stream.ptr, timeout=20):
        for i in range(2):
            with c.step():
                c.copy(Site.POS, a, np.arange(4) + i)
        t0 = time.monotonic()
        with pytest.raises(cc.CopyError, match=r"ring slot 0: its event 0x[0-9a-f]+"):
            c.begin()
        assert 0.2 <= time.monotonic() - t0 < 5
        ev = c._ring.event_at(0)
        t0 = time.monotonic()
        assert c.backend.event_wait(ev, 0.05) is False
        assert time.monotonic() - t0 < 2
    with c.step():
        c.copy(Site.POS, a, np.arange(4) + 9)
    stream.synchronize()
    assert a.get().tolist() == [9, 10, 11, 12]
    c.close()


def test_check_modes_reads_wait_with_the_deadline(monkeypatch):
    """Check mode reads its snapshots back at the barrier: a wait on the stream, bounded."""
    from cucopy import check

    monkeypatch.setattr(check, "CHECK_MODE", True)
    dev, s, a, b, c = _stalled_ring(None, wait_timeout=0.03)
    with s.hold(stall=True):
        with pytest.raises(cc.CopyError, match=r"check mode: waited 0\.03 s \(wait_timeout\)"):
            with c.step():
                c.copy(Site.POS, a, np.arange(4) + 1)
    with c.step():  # usable once the stall ends
        c.copy(Site.POS, a, np.arange(4) + 2)
    assert dev.to_host(a).tolist() == [2, 3, 4, 5]
    c.close()
