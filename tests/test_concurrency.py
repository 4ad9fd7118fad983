"""Threads and asyncio tasks: activate() keeps copiers apart; sharing one is refused."""

from __future__ import annotations

import asyncio
import sys
import threading

import numpy as np
import pytest

import cucopy as cc
import cucopy.copier as copier_module
from cucopy.backends.sim import SimBackend, SimDevice


class Site(cc.CopySite):
    POS = cc.H2D
    TABLE = cc.H2D
    PLAIN = cc.H2D
    GATHER = cc.D2D
    TAIL = cc.FILL


PLAN = cc.CopyPlan(merge={Site.POS, Site.TABLE, Site.GATHER, Site.TAIL}, flush_after={Site.TABLE})


def _run_threads(targets):
    errors = []

    def wrap(fn, i):
        try:
            fn(i)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(fn, i)) for i, fn in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a worker thread hung"
    if errors:
        raise errors[0]


# -- one copier per thread -----------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lazy", "eager", "random"])
def test_threads_each_activate_their_own_copier(policy):
    """Module-level cc.copy in each thread reaches that thread's copier, never another's.

    Every thread has its own device, so a copy routed to another thread's copier would be
    refused as a foreign-device destination rather than pass unnoticed.
    """
    nthreads, steps = 4, 60
    barrier = threading.Barrier(nthreads)
    results = {}

    def worker(i):
        dev = SimDevice(policy=policy, seed=i)
        c = cc.DeviceCopier(PLAN, device=dev, backend="sim", slots=2)
        pos = dev.empty((steps, 8), np.int32)
        table = dev.empty((steps,), np.int64)
        gathered = dev.empty((steps, 8), np.int32)
        tail = dev.empty((16,), np.int16)
        src = np.empty(8, np.int32)
        with c.activate():
            assert cc.active_copier() is c
            for k in range(steps):
                barrier.wait()  # all threads inside a step at once
                with c.step():
                    assert cc.active_copier() is c
                    src[:] = i * 1000 + k
                    assert cc.copy(Site.POS, pos[k], src) is True
                    src[:] = -1  # snapshot: the buffer is reused at once
                    cc.copy(Site.TABLE, table[k : k + 1], np.array([i * 10**6 + k], np.int64))
                    cc.copy(Site.GATHER, gathered[k], pos[k])
                    cc.fill_tail(Site.TAIL, tail, k % 16, i)
                    cc.copy(Site.PLAIN, tail[:1], np.array([k], np.int16))
        assert cc.active_copier() is None
        results[i] = (
            dev.to_host(pos),
            dev.to_host(table),
            dev.to_host(gathered),
            dev.to_host(tail),
            c.stats.steps,
        )
        c.close()

    _run_threads([worker] * nthreads)
    for i in range(nthreads):
        pos, table, gathered, tail, nsteps = results[i]
        want = i * 1000 + np.arange(steps, dtype=np.int32)[:, None].repeat(8, axis=1)
        assert (pos == want).all() and (gathered == want).all()
        assert table.tolist() == [i * 10**6 + k for k in range(steps)]
        last = steps - 1
        assert tail[0] == last and (tail[max(1, last % 16) :] == i).all()
        assert nsteps == steps


def test_threads_share_a_device_with_a_copier_each():
    """Same device, one stream and one copier per thread, interleaved steps."""
    dev = SimDevice(policy="eager")
    nthreads, steps = 3, 40
    streams = [dev.stream() for _ in range(nthreads)]
    copiers = [cc.DeviceCopier(PLAN, stream=s, device=dev, backend="sim") for s in streams]
    outs = [dev.empty((steps, 4), np.int32) for _ in range(nthreads)]
    barrier = threading.Barrier(nthreads)

    def worker(i):
        c = copiers[i]
        with c.activate():
            for k in range(steps):
                barrier.wait()
                with c.step():
                    cc.copy(Site.POS, outs[i][k], np.full(4, i * 100 + k, np.int32))

    _run_threads([worker] * nthreads)
    for i in range(nthreads):
        got = dev.to_host(outs[i])
        assert (got == (i * 100 + np.arange(steps))[:, None]).all()
    for c in copiers:
        c.close()


def test_activate_does_not_leak_into_new_threads():
    """A thread started while a copier is active does not inherit it (contextvars)."""
    dev = SimDevice()
    c = cc.DeviceCopier(PLAN, device=dev, backend="sim")
    seen = []
    with c.activate():
        t = threading.Thread(target=lambda: seen.append(cc.active_copier()))
        t.start()
        t.join()
        assert cc.active_copier() is c
    assert seen == [None]
    c.close()


# -- asyncio tasks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lazy", "eager", "random"])
def test_asyncio_tasks_each_activate_their_own_copier(policy):
    """Tasks interleave at every await, inside their steps; each routes to its own copier."""
    dev = SimDevice(policy=policy, seed=3)
    ntasks, steps = 5, 30
    outs = [dev.empty((steps, 4), np.int32) for _ in range(ntasks)]
    copiers = [
        cc.DeviceCopier(PLAN, stream=dev.stream(), device=dev, backend="sim", slots=2)
        for _ in range(ntasks)
    ]
    outer = cc.DeviceCopier(PLAN, device=dev, backend="sim")

    async def task(i):
        assert cc.active_copier() is outer  # inherited from the creating context
        c = copiers[i]
        with c.activate():
            for k in range(steps):
                with c.step():
                    await asyncio.sleep(0)
                    assert cc.active_copier() is c
                    cc.copy(Site.POS, outs[i][k, :2], np.full(2, i * 100 + k, np.int32))
                    await asyncio.sleep(0)
                    cc.copy(Site.TABLE, outs[i][k, 2:], np.full(2, -(i * 100 + k), np.int32))
                    await asyncio.sleep(0)
        assert cc.active_copier() is outer

    async def main():
        with outer.activate():
            await asyncio.gather(*(task(i) for i in range(ntasks)))
            assert cc.active_copier() is outer

    asyncio.run(main())
    assert cc.active_copier() is None
    for i in range(ntasks):
        got = dev.to_host(outs[i])
        k = np.arange(steps)
        assert (got[:, :2] == (i * 100 + k)[:, None]).all()
        assert (got[:, 2:] == -(i * 100 + k)[:, None]).all()
        assert copiers[i].stats.steps == steps
    assert outer.stats.steps == 0
    for c in copiers + [outer]:
        c.close()


def test_asyncio_task_without_activate_uses_plain_copies():
    """A task that activates nothing gets plain copies, even while another task's copier
    is active in that other task."""
    dev = SimDevice(policy="lazy")
    c = cc.DeviceCopier(PLAN, device=dev, backend="sim")
    a, b = dev.empty((4,), np.int32), dev.empty((4,), np.int32)
    order = []

    async def active():
        with c.activate(), c.step():
            cc.copy(Site.POS, a, np.full(4, 1, np.int32))
            order.append("staged")
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            assert c.staged == 1  # the other task's copy did not join this step

    async def plain():
        await asyncio.sleep(0)
        assert cc.active_copier() is None
        cc.copy(Site.POS, b, np.full(4, 2, np.int32))
        order.append("plain")

    async def main():
        await asyncio.gather(active(), plain())

    asyncio.run(main())
    assert order == ["staged", "plain"]
    assert dev.to_host(a).tolist() == [1] * 4 and dev.to_host(b).tolist() == [2] * 4
    c.close()


# -- one copier, two threads: refused ------------------------------------------------------------------


def _two_threads(during):
    """Thread A opens a step and stages a copy, then thread B runs ``during(c, dev)``;
    returns (what B raised, A's destination after A's step)."""
    dev = SimDevice(policy="lazy")
    c = cc.DeviceCopier(PLAN, device=dev, backend="sim")
    a = dev.empty((8,), np.int32)
    opened, done = threading.Event(), threading.Event()
    seen = {}

    def owner(_):
        with c.step():
            c.copy(Site.POS, a, np.full(8, 7, np.int32))
            opened.set()
            assert done.wait(30)
            assert c.staged == 1
        seen["a"] = dev.to_host(a).tolist()

    def intruder(_):
        assert opened.wait(30)
        try:
            during(c, dev)
        except Exception as exc:
            seen["error"] = exc
        finally:
            done.set()

    _run_threads([owner, intruder])
    c.close()
    return seen.get("error"), seen["a"]


def _copy(c, dev):
    c.copy(Site.POS, dev.empty((4,), np.int32), np.ones(4, np.int32))


def _d2d(c, dev):
    x = dev.empty((4,), np.int32)
    c.copy(Site.GATHER, x[:2], x[2:])


def _fill(c, dev):
    c.fill_tail(Site.TAIL, dev.empty((4,), np.int32), 0, 1)


def _plain(c, dev):
    c.copy(Site.PLAIN, dev.empty((4,), np.int32), np.ones(4, np.int32))


def _unchanged(c, dev):
    c.copy(Site.POS, dev.empty((4,), np.int32), np.zeros(4, np.int32), unchanged=True)


def _begin(c, dev):
    c.begin()


def _step(c, dev):
    with c.step():
        pass


def _flush(c, dev):
    c.flush()


def _routed(c, dev):
    with c.activate():
        cc.copy(Site.POS, dev.empty((4,), np.int32), np.ones(4, np.int32))


@pytest.mark.parametrize(
    "during",
    [_copy, _d2d, _fill, _plain, _unchanged, _begin, _step, _flush, _routed],
    ids=lambda f: f.__name__.strip("_"),
)
def test_one_copier_from_two_threads_is_refused(during):
    err, landed = _two_threads(during)
    assert isinstance(err, cc.CopyError), f"second thread was not refused: {err!r}"
    assert "another thread" in str(err)
    assert landed == [7] * 8  # the owner's staged copy still lands


def test_discard_from_another_thread_is_refused():
    err, landed = _two_threads(lambda c, dev: c.discard())
    assert isinstance(err, cc.CopyError), f"discard from another thread: {err!r}"
    assert landed == [7] * 8


class _PausingBackend(SimBackend):
    """Blocks the first ``copy2d`` until released, to hold a thread inside an eager copy."""

    def __init__(self, device):
        super().__init__(device)
        self.entered, self.release = threading.Event(), threading.Event()
        self.armed = False

    def copy2d(self, *args):
        if self.armed:
            self.armed = False
            self.entered.set()
            assert self.release.wait(30)
        return super().copy2d(*args)


def test_one_copier_from_two_threads_outside_steps_is_refused():
    """Thread A is inside an eager copy outside any step when thread B, which ran the last
    step, calls copy(): B must be refused (or at least its copy must land, unstaged)."""
    dev = SimDevice(policy="lazy")
    be = _PausingBackend(dev)
    c = cc.DeviceCopier(PLAN, device=dev, backend=be, stream=dev.default_stream)
    a, b = dev.empty((8,), np.int32), dev.empty((8,), np.int32)
    seen = {}

    def thread_b(_):
        with c.step():  # B owns the last step
            c.copy(Site.POS, b, np.zeros(8, np.int32))
        be.armed = True
        t = threading.Thread(target=lambda: c.copy(Site.PLAIN, a, np.full(8, 1, np.int32)))
        t.start()  # A: an eager copy outside a step, paused inside the backend
        assert be.entered.wait(30)
        try:
            seen["ret"] = c.copy(Site.POS, b, np.full(8, 2, np.int32))
        except cc.CopyError as exc:
            seen["error"] = exc
        seen["staged"] = c.staged
        be.release.set()
        t.join(30)

    _run_threads([thread_b])
    if "error" not in seen:
        # not refused: then it must have been issued, not left staged outside a step
        assert seen["staged"] == 0, "B's copy was staged outside any step, and never flushed"
        assert dev.to_host(b).tolist() == [2] * 8
    assert dev.to_host(a).tolist() == [1] * 8
    c.close()


# -- plain copies from threads that activated nothing ------------------------------------------------


@pytest.fixture
def busy_switching():
    """Threads switch every microsecond, so calls interleave inside one another."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


@pytest.mark.parametrize("policy", ["lazy", "eager", "random"])
def test_threads_without_an_active_copier_get_independent_plain_copies(policy, busy_switching):
    """Threads of a pool never inherit the active copier: their cc.copy calls are plain
    copies. They used to share one plan-less copier whose step state is set per call,
    so threads got "this copier's step belongs to another thread" and some copies
    landed another call's bytes."""
    dev = SimDevice(policy=policy, seed=3)
    nthreads, n = 4, 120
    outs = [dev.empty((n, 16), np.int32) for _ in range(nthreads)]
    tails = [dev.empty((n, 4), np.complex128) for _ in range(nthreads)]  # via pinned memory
    gathered = [dev.empty((n, 16), np.int32) for _ in range(nthreads)]
    barrier = threading.Barrier(nthreads)

    def worker(i):
        assert cc.active_copier() is None
        src = np.empty(16, np.int32)
        barrier.wait()
        for k in range(n):
            src[:] = i * 1000 + k
            assert cc.copy(Site.POS, outs[i][k], src) is True
            src[:] = -1  # snapshot: reused at once
            assert cc.fill_tail(Site.TAIL, tails[i][k], 1, complex(i, k)) is True
            assert cc.copy(Site.GATHER, gathered[i][k], outs[i][k]) is True

    _run_threads([worker] * nthreads)
    for i in range(nthreads):
        want = i * 1000 + np.arange(n, dtype=np.int32)[:, None].repeat(16, axis=1)
        assert (dev.to_host(outs[i]) == want).all()
        assert (dev.to_host(gathered[i]) == want).all()
        t = dev.to_host(tails[i])
        assert (t[:, 0] == 0).all() and (t[:, 1:] == (i + 1j * np.arange(n))[:, None]).all()
    # one plain copier per call in flight at once, kept for the next calls
    pools = [p for k, p in copier_module._plain.items() if k[0] == id(dev)]
    assert len(pools) == 1 and 1 <= len(pools[0]) <= nthreads


@pytest.mark.parametrize("policy", ["lazy", "random"])
def test_two_devices_run_a_decode_loop_each_from_two_threads(policy):
    """What the two-GPU run checks, on two simulated devices: a decode-like loop per
    device (a copier, a stream and a thread each; merged uploads into fresh views, a
    barrier, a D2D gather, tail fills), bit-identical to the same work done as plain
    copies on that device, and an array of the other device refused by each copier."""
    devs = [SimDevice(policy=policy, seed=7 + i) for i in range(2)]
    steps, width = 50, 16
    mismatches = {}

    def work(pos, table, gathered, n, p, t):
        cc.copy(Site.POS, pos[:n], p)
        cc.copy(Site.TABLE, table[:n], t)  # a barrier: lands before the gather
        cc.copy(Site.GATHER, gathered[:n], table[:n])
        cc.fill_tail(Site.TAIL, pos, n, -1)

    def loop(i):
        dev = devs[i]
        c = cc.DeviceCopier(PLAN, stream=dev.stream(), device=dev, backend="sim")
        rng = np.random.default_rng(i)
        got = [dev.zeros((width,), np.int32) for _ in range(3)]  # pos, table, gathered
        ref = [dev.zeros((width,), np.int32) for _ in range(3)]
        other = devs[1 - i].zeros((4,), np.int32)
        bad = 0
        for _ in range(steps):
            n = int(rng.integers(1, width))
            p = rng.integers(0, 1 << 20, n).astype(np.int32)
            t = rng.integers(0, 1 << 20, n).astype(np.int32)
            p0, t0 = p.copy(), t.copy()
            with c.activate(), c.step():
                work(*got, n, p, t)
                with pytest.raises(ValueError, match="not on this copier's device"):
                    cc.copy(Site.POS, other, p[:4])
                p[:] = t[:] = 0  # refilled right after the calls: changes nothing
            work(*ref, n, p0, t0)  # no copier active: plain copies on the device
            dev.synchronize()
            bad += sum(not np.array_equal(dev.to_host(g), dev.to_host(r)) for g, r in zip(got, ref))
        mismatches[i] = bad
        assert c.stats.sites[Site.POS].merged == steps
        c.close()

    _run_threads([loop, loop])
    assert mismatches == {0: 0, 1: 0}
