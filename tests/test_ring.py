"""StagingRing: slots, growth, and resource hygiene (pinned and device memory come back)."""

from __future__ import annotations

import gc
import os
import sys
import weakref

import numpy as np
import pytest

import cucopy as cc
from cucopy.backends.sim import SimBackend


@pytest.fixture(autouse=True)
def _tags_on(monkeypatch):
    """Completion tags on (the default; ``CUCOPY_TAG=0`` turns them off), for the ring's
    tag tests, whatever the environment says."""
    from cucopy import copier as copier_mod

    monkeypatch.setattr(copier_mod, "TAGS", True)


SOAK = os.environ.get("CUCOPY_SOAK", "") not in ("", "0")


class Site(cc.CopySite):
    POS = cc.H2D
    PLAIN = cc.H2D
    GATHER = cc.D2D
    TAIL = cc.FILL


PLAN = cc.CopyPlan(merge={Site.POS, Site.GATHER, Site.TAIL}, flush_after=set())


def live(dev) -> tuple[int, int]:
    """Live pinned buffers and device allocations of a sim device."""
    return len(dev._pinned), len(dev._allocs)


def busy_steps(c, dev, n=6):
    """Steps that use every kind of ring memory: merged data, eager snapshots in the slot,
    temporary pinned buffers (too big for the slot), device temporaries (overlapping D2D)."""
    a = dev.empty((64,), np.int32)
    big = dev.empty((4096,), np.int32)
    for i in range(n):
        with c.step():
            c.copy(Site.POS, a[:16], np.full(16, i, np.int32))
            c.copy(Site.PLAIN, a[16:32], np.full(16, i + 1, np.int32))
            c.copy(Site.POS, big, np.full(4096, i, np.int32))  # 16 KiB: past a 4 KiB slot
            c.copy(Site.GATHER, a[33:49], a[32:48])  # overlaps its source: a device temporary
            c.fill_tail(Site.TAIL, a, 60, -1)
    return a, big


# -- close and context manager ----------------------------------------------------------------


def test_ring_close_releases_pinned_and_device_memory(sim_env):
    dev = sim_env.dev
    before = live(dev)
    c = sim_env.copier(PLAN, slots=3, capacity=4096)
    arrays = busy_steps(c, dev)
    after_arrays = (before[0], before[1] + len(arrays))
    assert live(dev)[0] > before[0] and live(dev)[1] > after_arrays[1]
    c.close()
    assert c.closed
    assert live(dev) == after_arrays
    assert c._ring.pinned_bytes() == 0
    a, big = arrays
    assert sim_env.to_host(big).tolist() == [5] * 4096  # close waited; nothing freed early


def test_ring_context_manager_releases_memory(sim_env):
    dev = sim_env.dev
    with sim_env.copier(PLAN, slots=2, capacity=4096) as c:
        before = live(dev)
        arrays = busy_steps(c, dev, n=3)
        assert live(dev)[0] > before[0]
    assert c.closed
    assert live(dev) == (before[0], before[1] + len(arrays))


def test_ring_close_flushes_staged_copies_and_waits(sim_env):
    """close() in the middle of a step lands what is staged before freeing the slot."""
    dev = sim_env.dev
    a = dev.empty((8,), np.int32)
    before = live(dev)
    c = sim_env.copier(PLAN, slots=1, flush_mode="mapped")
    c.begin()
    c.copy(Site.POS, a, np.arange(8, dtype=np.int32))
    c.close()
    assert live(dev) == before
    assert sim_env.to_host(a).tolist() == list(range(8))


def test_ring_close_is_idempotent(sim_env):
    dev = sim_env.dev
    before = live(dev)
    c = sim_env.copier(PLAN)
    busy_steps(c, dev, n=1)
    c.close()
    c.close()
    assert live(dev)[0] == before[0]


def test_ring_of_an_unclosed_copier_is_freed_when_the_next_copier_is_made(sim_env):
    dev = sim_env.dev
    before = live(dev)
    c = sim_env.copier(PLAN, slots=2, capacity=4096)
    arrays = busy_steps(c, dev, n=3)
    ref = weakref.ref(c)
    del c
    gc.collect()
    assert ref() is None
    assert live(dev) > (before[0], before[1] + len(arrays))  # set aside, not freed
    sim_env.copier(PLAN).close()  # made and closed: the set-aside ring goes too
    assert live(dev) == (before[0], before[1] + len(arrays))


def test_collecting_an_unclosed_copier_behind_a_stalled_stream_waits_for_nothing(
    sim_env, monkeypatch
):
    """The garbage collector may run anywhere, inside a stream hold too: freeing the ring
    there (a wait for in-flight slots, then frees that wait for the device) would hang.
    The ring is set aside and freed when the next copier is made."""
    raised = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: raised.append(info.exc_value))
    dev = sim_env.dev
    a = dev.empty((16,), np.int32)
    before = live(dev)
    c = sim_env.copier(PLAN, slots=2, capacity=4096)
    stream = dev.default_stream
    with stream.hold():
        with c.step():
            c.copy(Site.POS, a, np.full(16, 4, np.int32))
        held = live(dev)
        del c
        gc.collect()
        assert raised == []  # a finalizer that waited would have raised SimDeadlock here
        assert live(dev) == held
    assert sim_env.to_host(a).tolist() == [4] * 16
    c2 = sim_env.copier(PLAN)  # frees the set-aside ring (its slots come at begin())
    assert live(dev) == before
    c2.close()
    assert raised == []


def _no_free_and_no_growth(dev, step, warm=4, more=10):
    """Run ``step`` ``warm`` times, then ``more``: the live allocations never fall (no free
    mid-run) and stop growing once the ring's pools hold what a step needs."""
    for i in range(warm):
        step(i)
    before = live(dev)
    seen = [before]
    for i in range(warm, warm + more):
        step(i)
        seen.append(live(dev))
    assert all(x <= y for x, y in zip(seen, seen[1:])), "memory freed mid-run"
    assert seen[-1] == before, "check mode's snapshot memory keeps growing"


def test_ring_check_mode_reuses_snapshots_of_discarded_copies(sim_env, check_mode):
    dev = sim_env.dev
    a = dev.empty((16,), np.int32)
    c = sim_env.copier(PLAN, slots=2)

    def step(i):
        # snapshot copies may still be queued at discard: their buffers go back to the
        # ring with the slot, for a later step's snapshots
        c.begin()
        c.copy(Site.POS, a, np.ones(16, np.int32))
        c.copy(Site.GATHER, a[8:], a[:8])
        c.discard()
        with c.step():
            c.copy(Site.POS, a, np.ones(16, np.int32))

    _no_free_and_no_growth(dev, step)
    c.close()


def test_ring_check_mode_reuses_snapshots_of_flushed_copies(sim_env, check_mode):
    dev = sim_env.dev
    a = dev.empty((16,), np.int32)
    c = sim_env.copier(PLAN, slots=2)

    def step(i):
        with c.step():
            c.copy(Site.POS, a[:8], np.full(8, i, np.int32))
            c.copy(Site.GATHER, a[8:], a[:8])
            c.copy(Site.POS, a[:8], np.full(8, i, np.int32), unchanged=True)

    _no_free_and_no_growth(dev, step)
    before = live(dev)
    c.close()
    assert live(dev)[1] < before[1]


# -- a closed copier refuses work --------------------------------------------------------------


def _closed_calls():
    def copy(c, a):
        c.copy(Site.POS, a, np.ones(4, np.int32))

    def copy_d2d(c, a):
        c.copy(Site.GATHER, a[:2], a[2:])

    def fill(c, a):
        c.fill_tail(Site.TAIL, a, 0, 1)

    def unchanged(c, a):
        c.copy(Site.POS, a, np.ones(4, np.int32), unchanged=True)

    def begin(c, a):
        c.begin()

    def step(c, a):
        with c.step():
            pass

    def flush(c, a):
        c.flush()

    def routed(c, a):
        with c.activate():
            cc.copy(Site.POS, a, np.ones(4, np.int32))

    def routed_fill(c, a):
        with c.activate():
            cc.fill_tail(Site.TAIL, a, 1, 3)

    def routed_flush(c, a):
        with c.activate():
            cc.flush()

    return [copy, copy_d2d, fill, unchanged, begin, step, flush, routed, routed_fill, routed_flush]


@pytest.mark.parametrize("call", _closed_calls(), ids=lambda f: f.__name__)
def test_ring_closed_copier_refuses_work(sim_env, call):
    dev = sim_env.dev
    a = dev.empty((4,), np.int32)
    c = sim_env.copier(PLAN)
    with c.step():
        c.copy(Site.POS, a, np.full(4, 9, np.int32))
    c.close()
    with pytest.raises(cc.CopyError, match="closed"):
        call(c, a)
    assert sim_env.to_host(a).tolist() == [9] * 4


# -- bounded pinned memory over many steps ----------------------------------------------------------


def test_ring_pinned_memory_stays_bounded_as_slots_grow_and_shrink(sim_env):
    """Phases of big steps (slots grow) and small steps (they shrink back) many times over:
    nothing is freed before close() (a free waits for the whole device), and the memory
    the first phases allocated is reused by every later one."""
    steps = 10**5 if SOAK else 2 * 10**4
    if sim_env.dev.policy != "lazy" and not SOAK:
        steps //= 4  # lazy keeps the most slots in flight; the others are a lighter check
    phase = 250  # longer than the ring's 64-step demand window, so slots shrink in between
    dev = sim_env.dev
    slots, capacity = 3, 4096
    a = dev.empty((32,), np.int32)
    big = dev.empty((6000,), np.int32)  # 24000 bytes: a 32 KiB slot holds it (64 KiB today)
    small_src = np.arange(32, dtype=np.int32)
    big_src = np.arange(6000, dtype=np.int32)
    base = live(dev)
    c = sim_env.copier(PLAN, slots=slots, capacity=capacity)
    ring = c._ring
    peak_bytes = 0
    grown = shrunk = 0
    prev = 0
    history = []
    for i in range(steps):
        big_phase = (i // phase) % 2 == 0
        with c.step():
            small_src[0] = i
            c.copy(Site.POS, a, small_src)
            if big_phase and i % 2:
                big_src[0] = i
                c.copy(Site.POS, big, big_src)
        now = ring.pinned_bytes()
        grown += now > prev
        shrunk += now < prev
        prev = now
        peak_bytes = max(peak_bytes, now)
        history.append(live(dev))
    assert sim_env.to_host(a)[0] == steps - 1
    assert sim_env.to_host(big)[0] == max(
        i for i in range(steps) if (i // phase) % 2 == 0 and i % 2
    )
    # the slots in use grew in every big phase and shrank back in every small one
    phases = steps // phase
    assert grown >= phases // 2 and shrunk >= phases // 2 - 1
    assert peak_bytes <= slots * 65536
    assert ring.pinned_bytes() == slots * capacity  # the last phase is small
    # never a free (the live counts never fall) ...
    assert all(x <= y for x, y in zip(history, history[1:])), "memory freed mid-run"
    # ... and after the first big and small phases, never a new allocation: replaced
    # slots and spare temporaries are reused
    assert history[-1] == history[2 * phase - 1]
    pinned, allocs = history[-1][0] - base[0], history[-1][1] - base[1]
    # small and big slots (pinned + staging each), plus at most one spare temporary
    # snapshot per slot from the steps that overflowed before their slot grew
    assert pinned <= 3 * slots and allocs <= 2 * slots
    assert ring.spare_bytes() <= (slots + 1) * 32768  # three 32 KiB slots, one temporary
    c.close()
    assert live(dev) == base


def test_ring_grows_once_for_an_overflowing_copy(sim_env):
    dev = sim_env.dev
    big = dev.empty((6000,), np.int32)  # 24000 bytes
    c = sim_env.copier(PLAN, slots=1, capacity=4096)
    with c.step():
        c.copy(Site.POS, big, np.arange(6000, dtype=np.int32))
    assert c.stats.sites[Site.POS].fallback["slot_full"] == 1
    with c.step():
        c.copy(Site.POS, big, np.arange(6000, dtype=np.int32))
    assert c.stats.sites[Site.POS].merged == 1  # the grown slot holds it
    assert c._ring.pinned_bytes() == 32768  # 24000 bytes plus a header: the next power of two


def test_trim_frees_what_the_ring_kept_and_the_copier_goes_on(sim_env):
    dev = sim_env.dev
    a = dev.empty((16,), np.int32)
    big = dev.empty((6000,), np.int32)  # 24000 bytes: more than a 4 KiB slot holds
    c = sim_env.copier(PLAN, slots=2, capacity=4096)
    assert c.trim() == 0  # nothing kept yet
    for i in range(4):  # the big copies overflow, the slots grow: old slots kept
        with c.step():
            c.copy(Site.POS, big, np.full(6000, i, np.int32))
            c.copy(Site.PLAIN, a, np.full(16, i, np.int32))
    sim_env.to_host(a)
    kept = c._ring.spare_bytes()
    before = live(dev)
    assert kept > 0
    freed = c.trim()
    assert freed >= kept and live(dev) < before
    assert c._ring.spare_bytes() == 0
    with c.step():  # still works
        c.copy(Site.POS, big, np.full(6000, 9, np.int32))
    assert sim_env.to_host(big).tolist() == [9] * 6000
    c.close()
    with pytest.raises(cc.CopyError, match="closed"):
        c.trim()


def test_an_orphan_behind_a_held_stream_is_kept_and_freed_later(sim_env):
    """A copier collected without close(), then a new copier made inside a hold of the
    stream its last step is queued on: freeing the orphan then would wait on held work
    (SimDeadlock here, a host wait on CUDA). It used to be tried, fail silently and be
    dropped, its memory never freed; it is now kept and freed once its work has run."""
    from cucopy import ring as ring_mod

    dev = sim_env.dev
    a = dev.empty((16,), np.int32)
    before = live(dev)
    c = sim_env.copier(PLAN, slots=2, capacity=4096)
    stream = dev.default_stream
    with stream.hold():
        with c.step():
            c.copy(Site.POS, a, np.full(16, 4, np.int32))
        ring, ref = c._ring, weakref.ref(c)
        del c
        gc.collect()
        assert ref() is None
        held = live(dev)
        c2 = sim_env.copier(PLAN)  # inside the hold: the orphan's work cannot have run
        assert any(e[0] is ring for e in ring_mod._orphans)
        assert live(dev) == held  # nothing freed (c2's slots come at its first begin())
    assert sim_env.to_host(a).tolist() == [4] * 16
    c3 = sim_env.copier(PLAN)  # the orphan's work has run: freed now
    assert not any(e[0] is ring for e in ring_mod._orphans)
    c2.close()
    c3.close()
    assert live(dev) == before


def test_a_failed_orphan_free_is_retried(sim_env):
    """The orphan's own work is done but another stream is held with work queued: its
    frees wait for the whole device, so they fail on the sim and are retried later."""
    from cucopy import ring as ring_mod

    dev = sim_env.dev
    before = live(dev)
    c = sim_env.copier(PLAN, slots=2, capacity=4096)
    busy_steps(c, dev, n=3)
    dev.synchronize()
    ring = c._ring
    del c
    gc.collect()
    other = dev.stream()
    with other.hold():
        other.launch(lambda: None)  # held work elsewhere on the device
        c2 = sim_env.copier(PLAN)
        assert any(e[0] is ring for e in ring_mod._orphans)
    c2.close()  # retried: freed
    assert not any(e[0] is ring for e in ring_mod._orphans)
    assert live(dev)[0] == before[0]


def test_the_table_reservation_shrinks_back_with_the_slot(sim_env):
    """4 steps of 2,000 merged copies, 70 empty steps, then steps of 8 tiny copies: the
    reservation for the descriptor table used to stay at 2,000 descriptors (96,000 B)
    while the slot shrank back to 64 KiB, so every later copy ran eagerly (slot_full)."""
    dev = sim_env.dev
    c = sim_env.copier(PLAN, slots=2, capacity=1 << 16)
    xs = dev.empty((2000 * 4,), np.int32)
    for _ in range(4):
        with c.step():
            for i in range(2000):
                c.copy(Site.POS, xs[i * 4 : i * 4 + 1], np.array([i], np.int32))
    for _ in range(70):
        with c.step():
            pass
    st = c.stats.sites[Site.POS]
    merged, full = st.merged, st.fallback["slot_full"]
    for k in range(200):
        with c.step():
            for i in range(8):
                c.copy(Site.POS, xs[i * 4 : i * 4 + 1], np.array([k], np.int32))
    assert st.fallback["slot_full"] == full
    assert st.merged - merged == 1600
    assert c._ring.pinned_bytes() == 2 * (1 << 16)  # the slots did shrink back
    assert sim_env.to_host(xs)[:32:4].tolist() == [199] * 8
    assert sim_env.to_host(xs)[32::4].tolist() == list(range(8, 2000))
    c.close()


class _Counting(SimBackend):
    """Counts allocations (each one a cudaMalloc / cudaHostAlloc on a GPU)."""

    def __init__(self, device):
        super().__init__(device)
        self.allocs = 0

    def alloc_device(self, nbytes):
        self.allocs += 1
        return super().alloc_device(nbytes)

    def alloc_pinned(self, nbytes):
        self.allocs += 1
        return super().alloc_pinned(nbytes)


@pytest.mark.parametrize("kind", ["d2d_through_a_temporary", "fill_of_16_byte_elements", "h2d"])
def test_copies_outside_a_step_reuse_their_temporaries(sim_env, kind):
    """Copies outside a step that need a temporary (a transposed D2D source, a fill of
    16-byte elements through pinned memory, a snapshot larger than the slot) used to take
    a new one per call: 400 calls, 403 allocations. Memory now stays bounded."""
    dev = sim_env.dev
    be = _Counting(dev)
    c = cc.DeviceCopier(PLAN, device=dev, backend=be, stream=dev.default_stream, slots=2,
                        capacity=4096)  # fmt: skip
    x, y = dev.empty((8, 8), np.int32), dev.asarray(np.arange(64, dtype=np.int32).reshape(8, 8))
    z = dev.empty((512,), np.complex128)  # 8 KiB: past a 4 KiB slot
    big = dev.empty((2048,), np.int32)
    before = be.allocs
    for i in range(400):
        if kind == "d2d_through_a_temporary":
            assert c.copy(Site.GATHER, x, y.T) is True
        elif kind == "fill_of_16_byte_elements":
            assert c.fill_tail(Site.TAIL, z, i % 7, 1 + i * 1j) is True
        else:
            assert c.copy(Site.PLAIN, big, np.full(2048, i, np.int32)) is True
    assert be.allocs - before <= 8
    if kind == "d2d_through_a_temporary":
        assert sim_env.to_host(x).tolist() == np.arange(64).reshape(8, 8).T.tolist()
    elif kind == "fill_of_16_byte_elements":
        got = sim_env.to_host(z)
        assert (got[399 % 7 :] == 1 + 399j).all()
    else:
        assert (sim_env.to_host(big) == 399).all()
    c.close()


def test_a_close_that_fails_leaves_its_ring_to_be_freed_later(sim_env):
    """close() inside a hold of its stream cannot wait for its slots (SimDeadlock here);
    the ring used to be dropped half-freed. It is kept and freed with the orphans."""
    dev = sim_env.dev
    a = dev.empty((16,), np.int32)
    before = live(dev)
    c = sim_env.copier(PLAN, slots=2, capacity=4096)
    with dev.default_stream.hold():
        with c.step():
            c.copy(Site.POS, a, np.full(16, 4, np.int32))
        with pytest.raises(cc.CopyError, match="held"):
            c.close()
        assert c.closed
    assert sim_env.to_host(a).tolist() == [4] * 16
    sim_env.copier(PLAN).close()
    assert live(dev) == before


def test_window_max_matches_max_over_the_window():
    import collections
    import random

    from cucopy.ring import WindowMax

    rng = random.Random(3)
    for window in (1, 3, 64):
        wm, ref = WindowMax(window), collections.deque(maxlen=window)
        assert wm.max() == 0
        for _ in range(500):
            v = rng.randrange(0, 50)
            wm.append(v)
            ref.append(v)
            assert wm.max() == max(ref)


@pytest.mark.parametrize("window", [1, 2, 3, 7, 64])
def test_window_max_twins_agree_on_random_sequences(window):
    """The compiled WindowMax (when built) answers as the Python one, call for call."""
    import collections
    import random

    from cucopy import ring

    impls = [ring.PyWindowMax]
    if ring.WindowMax is not ring.PyWindowMax:
        impls.append(ring.WindowMax)
    rng = random.Random(window)
    for trial in range(20):
        wms = [impl(window) for impl in impls]
        ref: collections.deque = collections.deque(maxlen=window)
        assert all(wm.window == window for wm in wms)
        assert all(
            wm.max() == 0 and wm.max(-5) == -5 and wm.max(default=None) is None for wm in wms
        )
        # runs of one value (the usual step), steps up and down, negatives, large values
        hi = rng.choice([3, 50, 1 << 40])
        for _ in range(300):
            v = rng.randrange(-hi, hi) if rng.random() < 0.5 else rng.choice([0, hi, 7])
            ref.append(v)
            if rng.random() < 0.5:
                got = [wm.append_max(v) for wm in wms]
            else:
                for wm in wms:
                    wm.append(v)
                got = [wm.max() for wm in wms]
            assert got == [max(ref)] * len(wms), (trial, v, got)
            assert [wm.max(default=-1) for wm in wms] == [max(ref)] * len(wms)


# -- the ring's common step, compiled (RingCore.advance_fast) ------------------------------------


def _ring_state(c) -> tuple:
    """What a step leaves in the ring and the copier's table reservation."""
    ring = c._ring
    slots = ring._slots
    return (
        ring.index,
        ring.acquires,
        ring._want,
        ring._peak,
        ring._target_size,
        ring._demand.max(),
        tuple(
            None if s is None else (s.size, s.bottom, s.top, s.recorded, s.stamp, s.tag)
            for s in slots
        ),
        (ring._newest, ring._newest_stamp),
        # what was seen complete depends on when the device ran the work: the same
        # under a deterministic policy only
        None if c._backend.device.policy == "random" else (ring._certified, ring._probe),
        ring.current is (slots[ring.index] if ring.index >= 0 else None),
        c._seg.reserve,
        c._cap_for,
        c._cap,
        c._tables.max(),
    )


def _python_begin(c) -> None:
    """Make ``c.begin()`` run its Python body, never the compiled core's common step
    (which takes the ring's step in C, whatever ``advance_fast`` says)."""

    class PythonBegin(type(c)):
        def begin(self):
            self._begin_body()

    c.__class__ = PythonBegin


def _program(c, dev, seed: int) -> list:
    """Random steps (small and large, merged and eager, a discard, a copy outside a step):
    the ring state after each, then every destination's bytes."""
    rng = np.random.default_rng(seed)
    a = dev.empty((64,), np.int32)
    big = dev.empty((8192,), np.int32)
    states = []
    for i in range(120):
        n = int(rng.choice([4, 16, 64, 2048, 8192]))
        dst = a[:n] if n <= 64 else big[:n]
        c.begin()  # not step(): its compiled __enter__ would not see a patched begin
        c.copy(Site.POS, dst, np.full(n, i, np.int32))
        if rng.random() < 0.3:
            c.copy(Site.PLAIN, a[32:48], np.full(16, -i, np.int32))
        if rng.random() < 0.2:
            c.fill_tail(Site.TAIL, a, 60, i)
        c.flush()
        if rng.random() < 0.05:
            c.begin()
            c.copy(Site.POS, a[:4], np.zeros(4, np.int32))
            c.discard()
        if rng.random() < 0.05:
            c.copy(Site.PLAIN, a[:4], np.full(4, i, np.int32))  # outside a step
        states.append(_ring_state(c))
    return states


@pytest.mark.parametrize("mode", ["inline", "mapped", "dma", "auto"])
def test_the_compiled_ring_step_leaves_what_the_python_one_does(sim_env, mode):
    from cucopy import ring

    fast = sim_env.copier(PLAN, slots=3, capacity=4096, flush_mode=mode)
    slow = sim_env.copier(PLAN, slots=3, capacity=4096, flush_mode=mode)
    slow._ring.advance_fast = lambda *a: None  # declines: the Python path runs
    _python_begin(slow)  # (the compiled begin takes the ring's step directly)
    got, want = _program(fast, sim_env.dev, 7), _program(slow, sim_env.dev, 7)
    assert got == want
    assert slow._ring.fast_advances == 0
    if ring.RingCore is not ring.PyRingCore:
        # the compiled twin took the steps whose next slot was idle: every one when the
        # device runs work at once, some when it runs it late (slots still in flight)
        assert fast._ring.fast_advances > (110 if sim_env.dev.policy == "eager" else 0)
    fast.close()
    slow.close()


@pytest.mark.skipif(
    __import__("cucopy.ring").ring.RingCore is __import__("cucopy.ring").ring.PyRingCore,
    reason="the compiled staging core is not in use",
)
@pytest.mark.parametrize("why", ["dirty", "temps", "frees", "peak", "in_flight", "size"])
def test_advance_fast_declines_without_changing_anything(sim_env, monkeypatch, why):
    c = sim_env.copier(PLAN, slots=3, capacity=4096, flush_mode="mapped")
    a = sim_env.dev.empty((16,), np.int32)
    for i in range(5):
        with c.step():
            c.copy(Site.POS, a, np.full(16, i, np.int32))
    ring = c._ring
    c._backend.synchronize(c._stream)  # every slot idle: the next step would take it
    taken = ring.fast_advances
    c.begin()
    c.flush()
    assert ring.fast_advances == taken + 1
    c._backend.synchronize(c._stream)
    nxt = ring._slots[(ring.index + 1) % ring.slots]
    if why == "dirty":
        ring.current.dirty = True
    elif why == "temps":
        nxt.temps.append(object())
    elif why == "frees":
        nxt.frees.append(object())
    elif why == "peak":
        # the peak moved and asks for a larger slot (a moved peak whose size the slot
        # still fits is taken: test_copier's growing decode loop)
        ring._peak = ring._peak + 1
        ring.capacity = nxt.size * 4
    elif why == "in_flight":
        nxt.recorded = True
        monkeypatch.setattr(ring.backend, "event_query", lambda event: False)
    else:
        nxt.size = ring._target_size * 4  # past twice the size the ring sized for
    before, fast = _ring_state(c), ring.fast_advances
    assert ring.advance_fast(c._seg, c._tables, c._cap_for, c._cap) is None
    assert _ring_state(c) == before and ring.fast_advances == fast
    for s in (nxt.temps, nxt.frees):
        s.clear()
    monkeypatch.undo()
    nxt.size = ring._target_size
    ring.capacity = 4096
    c.close()


# -- what the ring knows of its events (StagingRing._idle) ----------------------------------------


def _counting_queries(c) -> list:
    """Wrap the copier's backend's event_query: returns the list of events it was asked."""
    asked: list = []
    be = c._backend
    query = be.event_query

    def counted(ev):
        asked.append(ev)
        return query(ev)

    be.event_query = counted
    return asked


def test_a_loop_that_waits_for_each_step_asks_one_event_a_turn_of_the_ring(sim_env):
    # every step's event is recorded (mapped) and the host waits for each step: the
    # newest event, seen complete, vouches for the slots recorded before it, so a turn
    # of the ring asks one event instead of one a step (compiled and Python alike)
    c = sim_env.copier(PLAN, slots=4, capacity=4096, flush_mode="mapped")
    a = sim_env.dev.empty((16,), np.int32)
    asked = _counting_queries(c)
    turns = 6
    for i in range(4 * turns):
        with c.step():
            c.copy(Site.POS, a, np.full(16, i, np.int32))
        c._backend.synchronize(c._stream)
        assert sim_env.dev.to_host(a).tolist() == [i] * 16
    assert c.stats.modes["mapped"] == 4 * turns
    # the first turn's slots were new (nothing to ask); then one query a turn
    assert len(asked) == turns - 1
    assert c._ring._certified >= 4 * turns - 4
    c.close()


def test_a_gpu_behind_the_host_asks_each_slots_own_event_and_reuses_none_early(sim_env):
    # the host never waits: the newest event is not complete when a slot comes round,
    # so the ring asks each slot's own (and the newest again once a turn), waits where
    # one is still in flight, and every step lands what it staged
    c = sim_env.copier(PLAN, slots=4, capacity=4096, flush_mode="mapped")
    dev = sim_env.dev
    dsts = [dev.empty((16,), np.int32) for _ in range(24)]
    probes = []
    for i, d in enumerate(dsts):
        with c.step():
            c.copy(Site.POS, d, np.full(16, i, np.int32))
        probes.append(c._ring._probe)
    dev.synchronize()
    for i, d in enumerate(dsts):
        assert dev.to_host(d).tolist() == [i] * 16
    if dev.policy == "lazy":  # nothing runs until the ring waits: the newest never done
        # the newest event asked once a turn of the ring, each slot's own in between
        assert probes[4:] == [4, 3, 2, 1, 0] * 4
    c.close()


def test_an_event_newer_than_a_slots_is_not_taken_for_it_before_it_is_recorded(sim_env):
    # a slot recorded after the newest event seen complete is asked for itself: its
    # reuse waits for its own work, however many older events completed
    c = sim_env.copier(PLAN, slots=2, capacity=4096, flush_mode="mapped")
    dev = sim_env.dev
    a = dev.empty((16,), np.int32)
    for i in range(4):
        with c.step():
            c.copy(Site.POS, a, np.full(16, i, np.int32))
        c._backend.synchronize(c._stream)
    ring = c._ring
    certified = ring._certified
    with dev.default_stream.hold() if c._stream is dev.default_stream else c._stream.hold():
        for i in range(4, 6):  # both slots in flight behind the hold
            with c.step():
                c.copy(Site.POS, a, np.full(16, i, np.int32))
        assert all(s.stamp > certified for s in ring._slots)
        # nothing recorded behind the hold is known complete
        assert ring._certified < min(s.stamp for s in ring._slots)
    with c.step():  # the slot's own work must land first: the ring waits for it
        c.copy(Site.POS, a, np.full(16, 6, np.int32))
    c._backend.synchronize(c._stream)
    assert dev.to_host(a).tolist() == [6] * 16
    c.close()


# -- the completion tag: graphed launches need no event ---------------------------------------


def _graphed_copier(sim_env, **kw):
    """A sim copier whose small segments launch graphed (``SimDevice.graph_capacity``),
    with the backend's event records counted: ``(copier, records)``."""
    from cucopy import pack

    sim_env.dev.graph_capacity = pack.GRAPH_CAPACITY
    kw.setdefault("flush_mode", "mapped")
    c = sim_env.copier(PLAN, **kw)
    records: list = []
    be = c._backend
    record = be.event_record

    def counted(ev, stream):
        records.append(ev)
        return record(ev, stream)

    be.event_record = counted
    return c, records


def test_a_graphed_step_writes_its_tag_and_records_no_event(sim_env):
    # the step's one reader of its slot is the graphed launch: it arms the slot's tag
    # with the step, its kernel writes it back when done, and no event is recorded or
    # asked for, this step or when the slot comes round
    c, records = _graphed_copier(sim_env, slots=3)
    asked = _counting_queries(c)
    dev = sim_env.dev
    a = dev.empty((16,), np.int32)
    for i in range(10):
        with c.step():
            c.copy(Site.POS, a, np.full(16, i, np.int32))
        slot = c._ring.current
        assert slot.tag == c._ring.acquires == i + 1
        assert not slot.recorded and not slot.dirty
        assert int(slot.cell[0]) == i + 1  # armed
        if dev.policy == "lazy":
            assert int(slot.cell[1]) < slot.tag  # nothing ran: not yet written back
        c._backend.synchronize(c._stream)
        assert int(slot.cell[1]) == slot.tag
        assert dev.to_host(a).tolist() == [i] * 16
    assert records == [] and asked == []
    assert c.stats.modes["mapped"] == 10 and c.stats.host_waits == 0
    c.close()


def test_a_slot_is_reused_only_once_its_tag_arrived(sim_env):
    # the host runs ahead of the device: a slot that comes round before its tag was
    # written is waited for (the simulated stream runs until the tag arrives, as a GPU
    # does on its own), never rewritten early; reading the tag alone runs no work
    c, records = _graphed_copier(sim_env, slots=2)
    dev = sim_env.dev
    dsts = [dev.empty((16,), np.int32) for _ in range(8)]
    for i, d in enumerate(dsts):
        with c.step():
            c.copy(Site.POS, d, np.full(16, i, np.int32))
        if i >= 2 and dev.policy == "lazy":
            # the slot's previous step (i - 2) landed before its bytes were rewritten;
            # the step in between still waits in the stream
            assert dev.raw(dsts[i - 2]).tolist() == [i - 2] * 16
            assert c._stream.pending > 0
    dev.synchronize()
    for i, d in enumerate(dsts):
        assert dev.to_host(d).tolist() == [i] * 16
    assert records == []
    if dev.policy == "lazy":
        assert c.stats.host_waits == 6  # every reuse waited for its tag
    c.close()


def test_work_reading_the_slot_after_the_tagged_launch_has_the_slot_s_event(sim_env):
    # an eager copy's snapshot in the slot after the graphed launch: the tag no longer
    # covers the slot's last reader, so the flush records its event too, and the slot
    # is free once both arrived; a second graphed segment (a barrier) likewise
    c, records = _graphed_copier(sim_env, slots=2)
    dev = sim_env.dev
    a, b = dev.empty((16,), np.int32), dev.empty((16,), np.int32)
    c.begin()
    c.copy(Site.POS, a, np.full(16, 1, np.int32))
    c.flush()  # the tagged launch
    tagged = c._ring.current
    assert tagged.tag == 1 and not tagged.dirty and records == []
    c.copy(Site.PLAIN, b, np.full(16, 2, np.int32))  # eager: its snapshot is in the slot
    assert tagged.dirty
    c.flush()
    assert tagged.recorded and tagged.tag == 1 and len(records) == 1
    with c.step():  # a barrier mid-step: two graphed segments
        c.copy(Site.POS, a, np.full(16, 3, np.int32))
        c.flush()
        c.copy(Site.POS, b, np.full(16, 4, np.int32))
    second = c._ring.current
    assert second.tag == 2 and second.recorded and len(records) == 2
    with c.step():  # an eager copy first: the graphed launch after it is not tagged
        c.copy(Site.PLAIN, b, np.full(16, 5, np.int32))
        c.copy(Site.POS, a, np.full(16, 6, np.int32))
    third = c._ring.current
    assert third is tagged and third.tag == -1 and third.recorded and len(records) == 3
    dev.synchronize()
    assert dev.to_host(a).tolist() == [6] * 16 and dev.to_host(b).tolist() == [5] * 16
    assert int(second.cell[1]) == 2
    c.close()


def test_steps_with_no_graphed_launch_keep_their_events(sim_env):
    # inline (carried whole: the slot is not read), dma and an uncarried mapped launch
    # are not tagged: the slot's event follows every launch that reads it
    c, records = _graphed_copier(sim_env, slots=2, flush_mode="dma")
    a = sim_env.dev.empty((16,), np.int32)
    for i in range(3):
        with c.step():
            c.copy(Site.POS, a, np.full(16, i, np.int32))
        assert c._ring.current.tag == -1 and c._ring.current.recorded
    assert len(records) == 3
    c.flush_mode = "inline"
    with c.step():
        c.copy(Site.POS, a, np.full(16, 9, np.int32))
    assert c._ring.current.tag == -1 and not c._ring.current.recorded and len(records) == 3
    assert sim_env.to_host(a).tolist() == [9] * 16
    c.close()


def test_with_tags_off_graphed_launches_record_events(sim_env, monkeypatch):
    # tags off (copier.TAGS; CUCOPY_TAG=0 at import), read when a copier is made
    from cucopy import copier as copier_mod

    monkeypatch.setattr(copier_mod, "TAGS", False)
    c, records = _graphed_copier(sim_env, slots=2)
    assert c._tags is False
    a = sim_env.dev.empty((16,), np.int32)
    for i in range(4):
        with c.step():
            c.copy(Site.POS, a, np.full(16, i, np.int32))
        assert c._ring.current.tag == -1 and c._ring.current.recorded
    assert len(records) == 4 and c.stats.modes["mapped"] == 4
    assert sim_env.to_host(a).tolist() == [3] * 16
    c.close()


def test_a_tag_that_never_arrives_is_reported_at_the_deadline():
    # behind a stalled stream the slot's tag never comes: the wait sleeps to its
    # deadline and says which tag it waited for; the copier stays usable afterwards
    from cucopy import pack
    from cucopy.backends.sim import SimDevice

    dev = SimDevice()
    dev.graph_capacity = pack.GRAPH_CAPACITY
    s = dev.stream()
    a = dev.zeros((4,), np.int32)
    c = cc.DeviceCopier(PLAN, stream=s, device=dev, slots=2, flush_mode="mapped", wait_timeout=0.05)
    with s.hold(stall=True):
        for i in range(2):
            with c.step():
                c.copy(Site.POS, a, np.arange(4, dtype=np.int32) + i)
        assert c._ring.in_flight()
        with pytest.raises(cc.CopyError) as info:
            c.begin()
        msg = str(info.value)
        assert "waited 0.05" in msg and "ring slot 0: its completion tag" in msg
        assert "armed with step 1 of 2; reads 0" in msg and "Site.POS x1" in msg
        assert not c.in_step and c.staged == 0
    with c.step():
        c.copy(Site.POS, a, np.arange(4, dtype=np.int32) + 7)
    assert dev.to_host(a).tolist() == [7, 8, 9, 10]
    assert not c._ring.in_flight()
    c.close()


def test_close_waits_for_tags_and_an_orphan_behind_one_is_kept(sim_env):
    # close() waits for a slot whose tag has not arrived; a collected copier's ring
    # behind a held stream is kept until its tags came
    c, _ = _graphed_copier(sim_env, slots=2)
    dev = sim_env.dev
    a = dev.empty((16,), np.int32)
    with c.step():
        c.copy(Site.POS, a, np.full(16, 5, np.int32))
    c.close()  # waited (lazy: ran the stream until the tag arrived)
    assert dev.raw(a).tolist() == [5] * 16
    c2, _ = _graphed_copier(sim_env, slots=2)
    with dev.default_stream.hold():
        with c2.step():
            c2.copy(Site.POS, a, np.full(16, 6, np.int32))
        ring = c2._ring
        assert ring.in_flight()
        del c2
        gc.collect()
        from cucopy import ring as ring_mod

        assert ring_mod.free_orphans() >= 1  # its tag is owed: kept, nothing waited
    assert sim_env.to_host(a).tolist() == [6] * 16
    assert not ring.in_flight()
    sim_env.copier(PLAN).close()  # frees the set-aside ring


@pytest.mark.parametrize("tags", [True, False], ids=["tags", "no-tags"])
def test_the_compiled_ring_step_waits_for_tags_as_the_python_one(sim_env, monkeypatch, tags):
    # the ring's compiled step reads the tag where the Python one does, and declines
    # (changing nothing) while it has not arrived: the same ring state either way
    from cucopy import copier as copier_mod
    from cucopy import pack

    monkeypatch.setattr(copier_mod, "TAGS", tags)
    sim_env.dev.graph_capacity = pack.GRAPH_CAPACITY
    fast = sim_env.copier(PLAN, slots=3, capacity=4096, flush_mode="auto")
    slow = sim_env.copier(PLAN, slots=3, capacity=4096, flush_mode="auto")
    for c in (fast, slow):
        c._mapped_max = 1 << 20  # the sim's threshold is 4 KiB: graphed up to 8 KiB
    slow._ring.advance_fast = lambda *a: None
    _python_begin(slow)
    got, want = _program(fast, sim_env.dev, 11), _program(slow, sim_env.dev, 11)
    assert got == want
    tagged = any(sl is not None and sl[5] >= 0 for state in got for sl in state[6])
    assert tagged == tags  # some step's slot was tagged (with tags on)
    fast.close()
    slow.close()
