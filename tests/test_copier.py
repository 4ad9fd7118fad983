"""The copier's contract (DESIGN.md items 0-6), on the sim device and, with a GPU, on CUDA."""

import subprocess
import sys

import numpy as np
import pytest

import cucopy as cc


class Site(cc.CopySite):
    POS = cc.H2D
    LENS = cc.H2D
    TABLE = cc.H2D
    PLAIN = cc.H2D
    GATHER = cc.D2D
    GATHER2 = cc.D2D
    TAIL = cc.FILL
    TAIL2 = cc.FILL


PLAN = cc.CopyPlan(
    merge={Site.POS, Site.LENS, Site.TABLE, Site.GATHER, Site.TAIL},
    flush_after={Site.TABLE},
)


def test_merged_copies_land_at_flush_in_one_segment(env):
    c = env.copier(PLAN)
    a, b = env.empty((8,)), env.empty((3, 5))
    with c.step():
        assert c.copy(Site.POS, a, np.arange(8, dtype=np.int32)) is True
        assert c.copy(Site.LENS, b[:, 1:4], np.full((3, 3), 9, np.int32)) is True
        assert c.staged == 2
    assert c.staged == 0
    assert env.to_host(a).tolist() == list(range(8))
    assert env.to_host(b)[:, 1:4].tolist() == [[9] * 3] * 3 and env.to_host(b)[:, 0].sum() == 0
    assert c.stats.segments == 1 and c.stats.sites[Site.POS].merged == 1
    assert c.stats.sites[Site.LENS].merged == 1


@pytest.mark.parametrize("site", [Site.POS, Site.PLAIN])
def test_snapshot_on_a_stalled_stream(env, site):
    """A pinned source overwritten right after the call: the call's bytes land."""
    c = env.copier(PLAN)
    stream = env.default_stream
    a = env.empty((16,))
    src = env.pinned((16,))
    with env.hold(stream):
        with c.step():
            src[:] = 5
            c.copy(site, a, src)
            src[:] = -1  # the host refills its buffer while the copy is still queued
        src[:] = -2
    assert env.to_host(a).tolist() == [5] * 16


@pytest.mark.parametrize(
    "dtype", [np.int32, np.float16, np.dtype("datetime64[s]"), np.dtype([("a", "<i4")])]
)
def test_plain_copies_snapshot_every_source_layout(env, dtype):
    """Eager copies of a site outside the plan, on a stalled stream: contiguous and
    strided sources and destinations, and dtypes with no buffer format, land the bytes
    each source held at its call."""
    if env.name != "sim" and dtype is not np.int32:
        pytest.skip("CuPy holds none of these dtypes")
    c = env.copier(PLAN)
    flat, table = env.empty((6,), dtype), env.empty((3, 5), dtype)
    twod, back = env.empty((4, 6), dtype), env.empty((5,), dtype)
    ints = np.arange(64, dtype=np.int32).view(dtype).copy()
    srcs = [ints[:6].copy(), ints[:9].reshape(3, 3), ints[:24].reshape(6, 4).T, ints[::2][:5]]
    want = [s.copy() for s in srcs]
    with env.hold(env.default_stream):
        with c.step():
            c.copy(Site.PLAIN, flat, srcs[0])
            c.copy(Site.PLAIN, table[:, 1:4], srcs[1])
            c.copy(Site.PLAIN, twod, srcs[2])
            c.copy(Site.PLAIN, back[::-1], srcs[3])
            for s in srcs:
                s[...] = ints[-1]  # refilled while the copies are still queued
    assert env.to_host(flat).tobytes() == want[0].tobytes()
    assert env.to_host(table)[:, 1:4].tobytes() == want[1].tobytes()
    assert env.to_host(twod).tobytes() == np.ascontiguousarray(want[2]).tobytes()
    assert env.to_host(back)[::-1].tobytes() == want[3].tobytes()
    assert c.stats.sites[Site.PLAIN].eager == 4 and not c.stats.sites[Site.PLAIN].fallback


def test_slots_replaced_behind_a_stalled_stream_free_nothing(env):
    """Steps outgrow their slots and use temporaries while the stream is stalled: the
    ring replaces slots and takes temporaries back without freeing any memory. A free
    (cudaFreeHost, cudaFree) waits for the whole device, so behind a kernel that waits
    on the host it would never return (the sim raises SimDeadlock instead)."""
    c = env.copier(PLAN, slots=2, capacity=4096)
    stream = env.default_stream
    a = env.empty((16,))
    big = env.empty((3000,))  # 12000 bytes: more than a 4 KiB slot holds
    for step in range(2):  # both slots used and idle
        with c.step():
            c.copy(Site.POS, a, np.full(16, step, np.int32))
    assert env.to_host(a).tolist() == [1] * 16
    with env.hold(stream):
        with c.step():  # slot 0: the snapshot overflows into a pinned temporary
            c.copy(Site.PLAIN, big, np.full(3000, 7, np.int32))
            c.copy(Site.POS, a, np.full(16, 2, np.int32))
            c.copy(Site.GATHER2, a[4:12], a[:8])  # overlapping D2D: a device temporary
        with c.step():  # slot 1 is replaced by a larger one
            c.copy(Site.POS, a[:4], np.full(4, 3, np.int32))
    ref = np.full(16, 2, np.int32)
    ref[4:12] = ref[:8].copy()
    ref[:4] = 3
    assert env.to_host(a).tolist() == ref.tolist()
    assert env.to_host(big).tolist() == [7] * 3000
    with env.hold(stream):
        for step in range(2):  # slot 0 replaced, its temporaries kept and reused
            with c.step():
                c.copy(Site.PLAIN, big, np.full(3000, 10 + step, np.int32))
                c.copy(Site.GATHER2, a[4:12], a[:8])
    ref[4:12] = ref[:8].copy()
    ref[4:12] = ref[:8].copy()
    assert env.to_host(big).tolist() == [11] * 3000
    assert env.to_host(a).tolist() == ref.tolist()
    assert c._ring.spare_bytes() > 0  # the replaced slots and temporaries, kept
    c.close()


def test_overlap_scheduler_runs_steps_ahead_of_a_stalled_stream(env):
    """One persistent pinned buffer refilled every step while the GPU is behind."""
    c = env.copier(PLAN, slots=4)
    stream = env.default_stream
    host = env.pinned((32,))
    outs = [env.empty((32,)) for _ in range(3)]
    with env.hold(stream):
        for step, out in enumerate(outs):
            with c.step():
                host[:] = np.arange(32) * (step + 1)
                c.copy(Site.POS, out, host)
                host[:] = 12345
    assert c.stats.host_waits == 0
    for step, out in enumerate(outs):
        assert env.to_host(out).tolist() == (np.arange(32) * (step + 1)).tolist()


def test_ring_reuse_over_many_steps(env):
    c = env.copier(PLAN, slots=2)
    a = env.empty((64,))
    reads = []
    for step in range(40):
        with c.step():
            c.copy(Site.POS, a, np.full(64, step, np.int32))
            c.copy(Site.PLAIN, a[:4], np.full(4, -step, np.int32))
        reads.append(env.read_later(env.default_stream, a))
    for step, get in enumerate(reads):
        got = get()
        assert got[4:].tolist() == [step] * 60 and got[:4].tolist() == [-step] * 4
    assert c.stats.steps == 40
    assert c._ring.slots == 2


def test_barrier_lands_before_the_next_stream_ordered_reader(env):
    c = env.copier(PLAN)
    table, pos = env.empty((4, 4)), env.empty((4,))
    with c.step():
        c.copy(Site.POS, pos, np.arange(4, dtype=np.int32))
        c.copy(Site.TABLE, table, np.full((4, 4), 3, np.int32))
        assert c.staged == 0  # the barrier flushed both
        seen_table = env.read_later(env.default_stream, table)
        seen_pos = env.read_later(env.default_stream, pos)
        c.copy(Site.POS, pos, np.full(4, 8, np.int32))  # staged again after the barrier
        assert c.staged == 1
    assert seen_table().tolist() == [[3] * 4] * 4
    assert seen_pos().tolist() == [0, 1, 2, 3]
    assert env.to_host(pos).tolist() == [8] * 4


def test_unchanged_skips_without_a_barrier(env):
    c = env.copier(PLAN)
    table = env.empty((4,))
    with c.step():
        c.copy(Site.POS, env.empty((2,)), np.ones(2, np.int32))
        assert c.copy(Site.TABLE, table, np.zeros(4, np.int32), unchanged=True) is False
        assert c.staged == 1  # no barrier: the skipped barrier site flushed nothing
        assert c.fill_tail(Site.TAIL, table, 2, 0, unchanged=True) is False
    assert c.stats.sites[Site.TABLE].skipped == 1
    assert c.stats.sites[Site.TAIL].skipped == 1
    assert c.stats.segments == 1


def test_exception_in_step_drops_everything_and_calls_on_drop(env):
    c = env.copier(PLAN)
    a, b, g = env.empty((4,)), env.empty((4,)), env.empty((4,))
    src = env.asarray(np.full(4, 5, np.int32))
    dropped = []
    with pytest.raises(KeyError), c.step():
        c.copy(Site.POS, a, np.full(4, 1, np.int32), on_drop=lambda: dropped.append("pos"))
        c.fill_tail(Site.TAIL, b, 1, 7, on_drop=lambda: dropped.append("tail"))
        c.copy(Site.GATHER, g, src, on_drop=lambda: dropped.append("gather"))
        raise KeyError("boom")
    assert sorted(dropped) == ["gather", "pos", "tail"]
    assert c.staged == 0 and not c.in_step
    for arr in (a, b, g):
        assert env.to_host(arr).tolist() == [0] * 4
    with c.step():  # reusable
        c.copy(Site.POS, a, np.full(4, 2, np.int32))
    assert env.to_host(a).tolist() == [2] * 4
    assert len(dropped) == 3  # not called again by the next step


def test_discard_then_next_step(env):
    c = env.copier(PLAN)
    a = env.empty((4,))
    c.begin()
    c.copy(Site.POS, a, np.full(4, 1, np.int32))
    c.discard()
    c.begin()
    c.copy(Site.LENS, a[1:3], np.full(2, 5, np.int32))
    c.flush()
    assert env.to_host(a).tolist() == [0, 5, 5, 0]


def test_program_order_with_partial_overlaps(env):
    """Staged, eager, D2D and fill on overlapping ranges land as if issued in order."""
    c = env.copier(PLAN)
    a = env.empty((16,))
    b = env.empty((16,))
    model_a = np.zeros(16, np.int32)
    model_b = np.zeros(16, np.int32)
    with c.step():
        c.copy(Site.POS, a[0:8], np.arange(8, dtype=np.int32))
        model_a[0:8] = np.arange(8)
        c.copy(Site.LENS, a[4:12], np.full(8, 50, np.int32))  # partial overlap: order kept
        model_a[4:12] = 50
        c.copy(Site.PLAIN, a[10:14], np.full(4, 70, np.int32))  # eager over a staged range
        model_a[10:14] = 70
        c.copy(Site.GATHER, b[2:10], a[6:14])  # D2D reading staged + eager bytes
        model_b[2:10] = model_a[6:14]
        c.fill_tail(Site.TAIL, a, 12, -3)  # fill over the D2D source
        model_a[12:] = -3
        c.copy(Site.POS, b[0:4], np.full(4, 9, np.int32))  # write over a staged D2D dst
        model_b[0:4] = 9
        c.copy(Site.GATHER2, a[0:2], b[2:4])  # eager D2D from a staged dst
        model_a[0:2] = model_b[2:4]
        c.copy(Site.POS, a[6:8], np.full(2, 11, np.int32))  # overwrite a staged D2D source
        model_a[6:8] = 11
    assert env.to_host(a).tolist() == model_a.tolist()
    assert env.to_host(b).tolist() == model_b.tolist()
    assert c.stats.eager_flushes >= 3


def test_identical_range_is_replaced_in_place(env):
    c = env.copier(PLAN)
    a = env.empty((8,))
    with c.step():
        for v in range(5):
            c.copy(Site.POS, a, np.full(8, v, np.int32))
    assert env.to_host(a).tolist() == [4] * 8
    assert c.stats.eager_flushes == 0 and c.stats.segments == 1
    assert c.stats.sites[Site.POS].merged == 5


def test_slot_overflow_runs_eagerly_then_the_ring_grows(env):
    c = env.copier(PLAN, slots=2, capacity=4096)
    big = [env.empty((512,)) for _ in range(6)]  # 2 KiB each: the step needs ~12 KiB
    for step in range(4):
        with c.step():
            for i, arr in enumerate(big):
                c.copy(Site.POS, arr, np.full(512, step * 10 + i, np.int32))
        for i, arr in enumerate(big):
            assert env.to_host(arr).tolist() == [step * 10 + i] * 512
        if step == 0:
            assert c.stats.sites[Site.POS].fallback["slot_full"] > 0
            full0 = c.stats.sites[Site.POS].fallback["slot_full"]
    assert c.stats.sites[Site.POS].fallback["slot_full"] == full0  # later steps fit
    assert c._ring.pinned_bytes() >= 2 * 12 * 1024


def test_layouts_that_cannot_merge_run_eagerly(env):
    c = env.copier(PLAN)
    a = env.empty((6, 4))
    with c.step():
        c.copy(Site.POS, a.T, np.arange(24, dtype=np.int32).reshape(4, 6))
        assert c.staged == 0
    assert env.to_host(a).T.tolist() == np.arange(24).reshape(4, 6).tolist()
    assert c.stats.sites[Site.POS].fallback["layout"] == 1


def test_copy_outside_a_step_is_eager_and_snapshotted(env):
    c = env.copier(PLAN)
    a = env.empty((4,))
    src = env.pinned((4,))
    with env.hold(env.default_stream):
        src[:] = 6
        assert c.copy(Site.POS, a, src) is True
        src[:] = 0
        assert c.staged == 0
    assert env.to_host(a).tolist() == [6] * 4
    assert c.stats.sites[Site.POS].fallback["outside_step"] == 1


def test_module_level_routing(env):
    c = env.copier(PLAN)
    a, b = env.empty((4,)), env.empty((4,))
    with c.activate():
        assert cc.active_copier() is c
        with c.step():
            cc.copy(Site.POS, a, np.full(4, 3, np.int32))
            cc.fill_tail(Site.TAIL, b, 2, 4)
            assert c.staged == 2
            cc.flush()
            assert c.staged == 0
    assert cc.active_copier() is None
    assert env.to_host(a).tolist() == [3] * 4 and env.to_host(b).tolist() == [0, 0, 4, 4]
    # no active copier: a plain (still snapshotted) async copy
    src = np.full(4, 8, np.int32)
    assert cc.copy(Site.POS, a, src) is True
    src[:] = 0
    assert env.to_host(a).tolist() == [8] * 4


def test_fill_tail_rules(env):
    c = env.copier(PLAN)
    t = env.empty((3, 4))
    with c.step():
        assert c.fill_tail(Site.TAIL, t[:, :3], 4, -1) is True  # tail of a 2-D view
        assert c.fill_tail(Site.TAIL, t, 12, 5) is False  # empty tail
    want = np.zeros((3, 4), np.int32)
    want[:, :3].reshape(-1)  # noqa: B018 (the flattened view's elements 4: are rows 1.. col 1..)
    flat = want[:, :3].copy().reshape(-1)
    flat[4:] = -1
    want[:, :3] = flat.reshape(3, 3)
    assert env.to_host(t).tolist() == want.tolist()
    with pytest.raises(ValueError, match=r"Site.TAIL: fill value 300 does not fit dtype int8"):
        c.fill_tail(Site.TAIL, env.empty((4,), np.int8), 0, 300)


def test_an_empty_tail_of_a_known_destination_is_skipped_on_the_fast_path(env, monkeypatch):
    """``fill_tail`` at or past the end (an engine's pad of a full buffer) is counted
    skipped by the staging fast path, with no trip through the general path; a value the
    dtype cannot hold still raises there."""
    c = env.copier(PLAN)
    t = env.empty((8,))
    v = t[:4]  # a view made once, as an engine caches its views (CuPy's are new objects)
    with c.step():
        assert c.fill_tail(Site.TAIL, v, 0, 1) is True  # v known from here on
    calls = []
    general = type(c)._site

    def counting(self, site, fill):
        calls.append(site)
        return general(self, site, fill)

    monkeypatch.setattr(type(c), "_site", counting)
    with c.step():
        for start in (4, 5, 9):
            assert c.fill_tail(Site.TAIL, v, start, 7) is False
        assert c.staged == 0
    assert calls == []  # every empty tail stayed on the fast path
    assert c.stats.sites[Site.TAIL].skipped == 3
    assert c.stats.sites[Site.TAIL].merged == 1
    with c.step():
        with pytest.raises(ValueError, match=r"Site\.TAIL: fill value 1099511627776 does not fit"):
            c.fill_tail(Site.TAIL, v, 4, 2**40)  # int32 cannot hold it
        with pytest.raises(ValueError, match=r"Site\.TAIL: start must be an int >= 0"):
            c.fill_tail(Site.TAIL, v, -1, 7)
    assert calls  # the general path raised both
    assert env.to_host(t).tolist() == [1] * 4 + [0] * 4


def test_d2d_between_views(env):
    c = env.copier(PLAN)
    src = env.asarray(np.arange(20, dtype=np.int32).reshape(4, 5))
    dst = env.empty((4, 3))
    with c.step():
        c.copy(Site.GATHER, dst, src[:, 1:4])
        c.copy(Site.GATHER, env.empty((2,)), src[0, :2])
    assert env.to_host(dst).tolist() == np.arange(20).reshape(4, 5)[:, 1:4].tolist()
    assert c.stats.sites[Site.GATHER].merged == 2


@pytest.mark.parametrize("mode", ["dma", "mapped", "auto", "inline"])
def test_flush_modes_agree(env, mode):
    c = env.copier(PLAN, flush_mode=mode)
    a = env.empty((3000,))
    with c.step():
        c.copy(Site.POS, a[:10], np.arange(10, dtype=np.int32))
        c.copy(Site.LENS, a[100:], np.arange(2900, dtype=np.int32))
    got = env.to_host(a)
    assert got[:10].tolist() == list(range(10)) and got[100:].tolist() == list(range(2900))


def test_bad_input_names_the_site_and_keeps_staged_copies(env):
    c = env.copier(PLAN)
    a = env.empty((4,))
    with c.step():
        c.copy(Site.POS, a, np.full(4, 1, np.int32))
        with pytest.raises(ValueError, match="Site.GATHER: D2D site needs a device source"):
            c.copy(Site.GATHER, a, np.zeros(4, np.int32))
        with pytest.raises(ValueError, match="Site.LENS: H2D site needs a host source"):
            c.copy(Site.LENS, a, env.empty((4,)))
        with pytest.raises(TypeError, match="Site.LENS: dtype mismatch"):
            c.copy(Site.LENS, a, np.zeros(4, np.int64))
        with pytest.raises(ValueError, match="Site.LENS: size mismatch: dst has 4 elements"):
            c.copy(Site.LENS, a, np.zeros(5, np.int32))
        with pytest.raises(ValueError, match="Site.LENS: destination must be device memory"):
            c.copy(Site.LENS, np.zeros(4, np.int32), np.zeros(4, np.int32))
        with pytest.raises(ValueError, match="Site.TAIL: copy\\(\\) does not take a FILL site"):
            c.copy(Site.TAIL, a, np.zeros(4, np.int32))
        with pytest.raises(TypeError, match="site: expected a CopySite member, got 'POS'"):
            c.copy("POS", a, np.zeros(4, np.int32))
        assert c.staged == 1
    assert env.to_host(a).tolist() == [1] * 4
    c.close()
    with pytest.raises(cc.CopyError, match="Site.POS: the copier is closed"):
        c.copy(Site.POS, a, np.zeros(4, np.int32))


def test_capture_issues_plain_copies_and_refuses_unchanged(env):
    stream = env.stream()
    c = env.copier(PLAN, stream=stream)
    a, t = env.empty((4,)), env.empty((4,))
    src = env.pinned((4,))
    with env.capture(stream) as graph:
        with c.step():
            c.copy(Site.POS, a, src)
            c.fill_tail(Site.TAIL, t, 1, 6)
            with pytest.raises(ValueError, match="Site.LENS: unchanged=True is refused during"):
                c.copy(Site.LENS, a, src, unchanged=True)
            with pytest.raises(
                ValueError, match="Site.POS: during graph capture an H2D source must be pinned"
            ):
                c.copy(Site.POS, a, np.zeros(4, np.int32))
    assert c.stats.sites[Site.POS].fallback["capture"] == 1
    for v in (3, 4):
        src[:] = v  # the graph re-reads its source at each replay
        graph.replay(stream)
        assert env.to_host(a).tolist() == [v] * 4
    assert env.to_host(t).tolist() == [0, 6, 6, 6]


def test_randomized_steps_against_a_numpy_model(sim_env):
    env = sim_env
    rng = np.random.default_rng(7)
    c = env.copier(PLAN, slots=3, capacity=8192)
    n = 256
    arrs = [env.empty((n,)) for _ in range(3)]
    model = [np.zeros(n, np.int32) for _ in range(3)]
    host = env.pinned((n,))
    sites_h2d = [Site.POS, Site.LENS, Site.TABLE, Site.PLAIN]
    for _ in range(120):
        with c.step():
            for _ in range(rng.integers(1, 12)):
                k = rng.integers(0, 3)
                lo = int(rng.integers(0, n - 1))
                hi = int(rng.integers(lo + 1, min(n, lo + 80) + 1))
                op = rng.integers(0, 3)
                if op == 0:
                    vals = rng.integers(-1000, 1000, hi - lo).astype(np.int32)
                    host[: hi - lo] = vals
                    c.copy(sites_h2d[rng.integers(0, 4)], arrs[k][lo:hi], host[: hi - lo])
                    host[:] = 0
                    model[k][lo:hi] = vals
                elif op == 1:
                    j = (k + 1) % 3
                    slo = int(rng.integers(0, n - (hi - lo) + 1))
                    c.copy(Site.GATHER, arrs[k][lo:hi], arrs[j][slo : slo + hi - lo])
                    model[k][lo:hi] = model[j][slo : slo + hi - lo]
                else:
                    v = int(rng.integers(-5, 5))
                    c.fill_tail(Site.TAIL, arrs[k][lo:hi], 0, v)
                    model[k][lo:hi] = v
        for k in range(3):
            assert env.to_host(arrs[k]).tolist() == model[k].tolist()


def test_import_cucopy_imports_no_framework():
    code = (
        "import sys, numpy as np, cucopy as cc\n"
        "from cucopy.backends.sim import SimDevice\n"
        "class S(cc.CopySite):\n    A = cc.H2D\n"
        "d = SimDevice(); a = d.empty((4,), np.int32)\n"
        "c = cc.DeviceCopier(cc.CopyPlan(merge={S.A}), device=d, backend='sim')\n"
        "with c.step(): c.copy(S.A, a, np.ones(4, np.int32))\n"
        "bad = [m for m in ('torch', 'cupy', 'jax', 'jaxlib') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


class _Rebindable:
    """A device array whose storage can be swapped in place (as torch's set_ does)."""

    def __init__(self, arr):
        self.arr = arr

    def __cucopy_array__(self):
        return self.arr.__cucopy_array__()

    @staticmethod
    def __cucopy_fingerprint__(x):
        return x.arr.ptr


def test_a_destination_rebound_in_place_is_not_served_from_the_cache():
    from conftest import SimEnv

    env = SimEnv()
    c = env.copier(PLAN)
    first, second = env.empty((4,)), env.empty((4,))
    dst = _Rebindable(first)
    for step in range(3):
        with c.step():
            c.copy(Site.POS, dst, np.full(4, step, np.int32))
    dst.arr = second  # same object, new storage
    with c.step():
        c.copy(Site.POS, dst, np.full(4, 9, np.int32))
    assert env.to_host(first).tolist() == [2] * 4
    assert env.to_host(second).tolist() == [9] * 4


def test_the_destination_cache_keeps_nothing_alive():
    import gc
    import weakref

    from conftest import SimEnv

    env = SimEnv()
    c = env.copier(PLAN)
    a = env.empty((4,))
    ref = weakref.ref(a)
    with c.step():
        c.copy(Site.POS, a, np.ones(4, np.int32))
        c.copy(Site.LENS, a, np.ones(4, np.int32))
    assert env.to_host(a).tolist() == [1] * 4
    del a
    gc.collect()
    assert ref() is None


def test_fill_values_convert_exactly_every_time(env):
    c = env.copier(PLAN)
    a = env.empty((4,), np.float32)
    b = env.empty((4,), np.int8)
    for _ in range(2):  # the second round is served from the conversion cache
        with c.step():
            c.fill_tail(Site.TAIL, a, 0, -1)
            c.fill_tail(Site.TAIL, b, 0, -1)
        assert env.to_host(a).tolist() == [-1.0] * 4
        assert env.to_host(b).tolist() == [-1] * 4
        with pytest.raises(ValueError, match="fill value 300 does not fit dtype int8"):
            c.fill_tail(Site.TAIL, b, 0, 300)


def test_a_cached_destination_still_refuses_a_non_callable_on_drop(env):
    c = env.copier(PLAN)
    a = env.empty((4,))
    with c.step():
        c.copy(Site.POS, a, np.ones(4, np.int32))  # first sight: the destination is cached
    with c.step():
        with pytest.raises(TypeError, match="Site.POS: on_drop must be callable, got 5"):
            c.copy(Site.POS, a, np.full(4, 2, np.int32), on_drop=5)
        c.copy(Site.POS, a, np.full(4, 3, np.int32))
    assert env.to_host(a).tolist() == [3] * 4


def test_range_set_claim_matches_a_byte_model():
    # the staging fast path's one-search overlap check and insert, against sets of bytes
    from cucopy.segment import RangeSet as _RangeSet

    rng = np.random.default_rng(7)
    for _ in range(200):
        rs, held = _RangeSet(), set()
        for _ in range(40):
            lo = int(rng.integers(0, 200))
            hi = lo + int(rng.integers(1, 24))
            span = set(range(lo, hi))
            free = not (span & held)
            assert rs.overlaps(lo, hi) == (not free)
            assert rs.claim(lo, hi) == free
            if free:
                held |= span
            # disjoint, sorted, and touching ranges merged: exactly the held bytes
            pairs = list(zip(rs.lo, rs.hi))
            assert all(a < b for a, b in pairs)
            assert all(b1 < a2 for (_, b1), (a2, _) in zip(pairs, pairs[1:]))
            assert set().union(*(range(a, b) for a, b in pairs)) == held


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_nan_and_infinities_fill_a_float_destination(env, dtype):
    """NaN and +-inf are exactly representable in every float dtype: filled, not refused."""
    c = env.copier(PLAN)
    a = env.empty((12,), dtype)
    with c.step():
        assert c.fill_tail(Site.TAIL, a[:4], 0, float("nan")) is True
        assert c.fill_tail(Site.TAIL, a[4:8], 0, np.inf) is True
        assert c.fill_tail(Site.TAIL2, a[8:], 0, -np.inf) is True  # eager
    got = env.to_host(a)
    assert np.isnan(got[:4]).all()
    assert (got[4:8] == np.inf).all() and (got[8:] == -np.inf).all()


def test_zero_size_copies_stage_nothing_on_any_path(env):
    """Empty copies return False and stage nothing, also once the destination is cached
    for the fast path (three merged ones used to return [False, True, True] and stage two
    0-byte descriptors)."""
    c = env.copier(PLAN)
    a, e = env.empty((4,)), env.empty((0,))
    e2 = env.empty((3, 0))
    with c.step():
        assert c.copy(Site.POS, a, np.arange(4, dtype=np.int32)) is True  # a segment is open
        got = [c.copy(Site.POS, e, np.zeros(0, np.int32)) for _ in range(3)]
        got += [c.copy(Site.LENS, e2, np.zeros((3, 0), np.int32)) for _ in range(2)]
        got += [c.copy(Site.PLAIN, e, np.zeros(0, np.int32))]
        got += [c.copy(Site.GATHER, e, e), c.copy(Site.GATHER2, e, e)]
        got += [c.fill_tail(Site.TAIL, e, 0, 1), c.fill_tail(Site.TAIL2, e2, 0, 1)]
        assert got == [False] * len(got)
        assert c.staged == 1
    assert c.copy(Site.POS, e, np.zeros(0, np.int32)) is False  # outside a step
    assert c.stats.sites[Site.POS].merged == 1 and c.stats.sites[Site.POS].eager == 0
    assert c.stats.sites[Site.LENS].merged == 0 and c.stats.sites[Site.PLAIN].eager == 0
    assert env.to_host(a).tolist() == [0, 1, 2, 3]


def test_a_nested_step_block_is_refused_and_the_outer_step_goes_on(env):
    """The inner ``with step():`` used to end the outer step at its exit."""
    c = env.copier(PLAN)
    a, b = env.empty((4,)), env.empty((4,))
    with c.step():
        c.copy(Site.POS, a, np.arange(4, dtype=np.int32))
        with pytest.raises(cc.CopyError, match=r"step\(\): a step\(\) block .* already open"):
            with c.step():
                raise AssertionError("the nested block must not run")
        assert c.in_step and c.staged == 1
        c.copy(Site.LENS, b, np.full(4, 5, np.int32))
        assert c.staged == 2
    assert not c.in_step and c.staged == 0
    assert env.to_host(a).tolist() == [0, 1, 2, 3] and env.to_host(b).tolist() == [5] * 4
    with c.step():  # not nested: fine again, as is begin() inside a block (the next step)
        c.copy(Site.POS, a, np.full(4, 1, np.int32))
        c.begin()
        assert c.staged == 0 and c.in_step
    assert env.to_host(a).tolist() == [1] * 4
    with pytest.raises(KeyError), c.step():  # an exception in the block still closes it
        raise KeyError("x")
    with c.step():
        pass


@pytest.mark.parametrize(
    "dshape, sshape",
    [((8,), (8,)), ((2, 4), (2, 4)), ((2, 4), (8,)), ((2, 4), (1, 8)), ((8,), (1, 8)),
     ((1, 8), (8,)), ((1, 2, 4), (2, 4)), ((2, 4), (1, 2, 4))],
)  # fmt: skip
def test_shapes_that_fill_a_destination(env, dshape, sshape):
    """Equal shapes (leading 1s aside), or a flat source filling ``dst`` in C order."""
    c = env.copier(PLAN)
    a, dsrc = env.empty(dshape), env.asarray(np.arange(8, dtype=np.int32).reshape(sshape))
    want = np.arange(8).reshape(dshape).tolist()
    for site in (Site.POS, Site.PLAIN):
        with c.step():
            assert c.copy(site, a, np.arange(8, dtype=np.int32).reshape(sshape)) is True
        assert env.to_host(a).tolist() == want
        assert c.copy(Site.PLAIN, a, np.zeros(sshape, np.int32)) is True
    for site in (Site.GATHER, Site.GATHER2):
        with c.step():
            assert c.copy(site, a, dsrc) is True
        assert env.to_host(a).tolist() == want
        assert c.copy(Site.PLAIN, a, np.zeros(sshape, np.int32)) is True


@pytest.mark.parametrize(
    "dshape, sshape", [((8,), (2, 4)), ((2, 4), (4, 2)), ((8,), (8, 1)), ((2, 4), (2, 2, 2))]
)
def test_shapes_that_differ_are_refused_as_torch_copy_does(env, dshape, sshape):
    """``(2, 4)`` into ``(8,)`` used to land silently reshaped; torch's copy_ refuses it."""
    c = env.copier(PLAN)
    a, keep = env.empty(dshape), env.empty((4,))
    host = np.arange(8, dtype=np.int32).reshape(sshape)
    dev_src = env.asarray(host)
    with c.step():
        c.copy(Site.POS, keep, np.full(4, 3, np.int32))
        for site, src in [(Site.POS, host), (Site.POS, host), (Site.PLAIN, host),
                          (Site.GATHER, dev_src), (Site.GATHER2, dev_src)]:  # fmt: skip
            with pytest.raises(ValueError, match=rf"{site.label}: shape mismatch: dst .* src"):
                c.copy(site, a, src)
        assert c.staged == 1
    assert env.to_host(keep).tolist() == [3] * 4
    assert not env.to_host(a).any()
    with pytest.raises(ValueError, match=r"Site\.POS: shape mismatch"):
        c.copy(Site.POS, a, host)  # outside a step too


def test_the_fast_path_follows_the_shape_rule_for_fresh_views(env):
    """Views made afresh each call (``buf[:8]``) of a known array take the fast path:
    it must refuse a source of another shape as the general path does."""
    c = env.copier(PLAN)
    buf = env.empty((16,))
    with c.step():
        assert c.copy(Site.POS, buf[:8], np.arange(8, dtype=np.int32)) is True  # now known
        assert c.copy(Site.POS, buf[8:], np.full(8, 9, np.int32)) is True  # a fresh view
        for _ in range(2):
            with pytest.raises(ValueError, match=r"Site\.POS: shape mismatch"):
                c.copy(Site.POS, buf[:8], np.zeros((2, 4), np.int32))
        assert c.copy(Site.POS, buf[:8], np.ones((1, 8), np.int32)) is True
        assert c.staged == 2
    assert env.to_host(buf).tolist() == [1] * 8 + [9] * 8


def test_copies_wider_than_a_descriptors_fields_run_eagerly_and_lose_nothing(env):
    """A descriptor's pitches, width and rows are 32-bit. A merged fill at 2**32 of a
    4 GiB + 64 B buffer (its row pitch was the whole buffer) and views with a row pitch
    of 4 GiB or more used to make the flush raise struct.error and drop an unrelated
    staged copy (its on_drop ran, its bytes never landed)."""
    c = env.copier(PLAN)
    n = (1 << 32) + 64
    big = env.empty((n,), np.int8)
    wide = env.empty((2, n), np.int8)  # rows 4 GiB + 64 B apart
    a, b = env.empty((4,)), env.empty((2, 8), np.int8)
    dropped = []
    with c.step():
        c.copy(Site.POS, a, np.arange(4, dtype=np.int32), on_drop=lambda: dropped.append(1))
        assert c.fill_tail(Site.TAIL, big, 1 << 32, 5) is True  # merged: its row is 64 B
        assert c.copy(Site.LENS, wide[:, :8], np.full((2, 8), 3, np.int8)) is True
        assert c.copy(Site.GATHER, b, wide[:, :8]) is True
        assert c.fill_tail(Site.TAIL, wide[:, 8:16], 0, 7) is True
        assert c.copy(Site.POS, wide[1, 24:32], np.full(8, 1, np.int8)) is True  # merged
        for _ in range(2):  # a view made afresh of a known base: not on the fast path
            assert c.copy(Site.POS, wide[:, 16:24], np.full((2, 8), 9, np.int8)) is True
    assert dropped == []
    assert env.to_host(a).tolist() == [0, 1, 2, 3]
    assert (env.to_host(big[-72:]) == [0] * 8 + [5] * 64).all()
    for r in range(2):
        row = env.to_host(wide[r, :32])
        assert row.tolist() == [3] * 8 + [7] * 8 + [9] * 8 + [r] * 8
    st = c.stats.sites
    assert st[Site.TAIL].merged == 1 and st[Site.TAIL].fallback["layout"] == 1
    assert st[Site.LENS].fallback["layout"] == 1 and st[Site.GATHER].fallback["layout"] == 1
    assert st[Site.POS].fallback["layout"] == 2 and st[Site.POS].merged == 2


def test_a_capture_that_begins_inside_a_step_is_refused(env):
    """A step begun, then a capture begun on its stream: an unmerged H2D copy used to be
    captured reading the ring slot, so a replay after later steps landed their bytes.
    Every copy that would issue work is refused; staged copies stay staged and land at
    the first flush after the capture."""
    stream = env.stream()
    c = env.copier(PLAN, stream=stream)
    a, b, t, g = env.empty((4,)), env.empty((4,)), env.empty((4,)), env.empty((4,))
    dsrc = env.asarray(np.arange(8, 12, dtype=np.int32))
    src = env.pinned((4,))
    src[:] = 5
    c.begin()
    c.copy(Site.POS, a, np.full(4, 1, np.int32))  # staged before the capture
    began = r"a graph capture began on the copier's stream after begin\(\)"
    with env.capture(stream):
        for call in (
            lambda: c.copy(Site.PLAIN, b, src),  # eager H2D
            lambda: c.copy(Site.TABLE, b, src),  # a barrier
            lambda: c.copy(Site.GATHER2, g, dsrc),  # eager D2D
            lambda: c.fill_tail(Site.TAIL2, t, 0, 2),  # eager fill
            lambda: c.copy(Site.LENS, t, src, unchanged=True),  # (a cached dst: not seen)
        ):
            with pytest.raises(cc.CopyError, match=began):
                call()
        with pytest.raises(cc.CopyError, match="capture began on the copier's stream while"):
            c.flush()
        assert c.staged == 2  # POS, and TABLE (staged before its barrier was refused)
    c.flush()
    assert env.to_host(a).tolist() == [1] * 4 and env.to_host(b).tolist() == [5] * 4
    assert not env.to_host(g).any() and not env.to_host(t).any()
    with c.step():  # the copier goes on
        c.copy(Site.PLAIN, b, np.full(4, 7, np.int32))
    assert env.to_host(b).tolist() == [7] * 4


def test_a_capture_that_ends_inside_a_step_is_refused(env):
    """A step begun inside a capture and continued after it: a pinned source used to be
    copied plainly (not snapshotted, so the refilled value landed) and a pageable one
    refused as "during graph capture ... must be pinned" with nothing capturing."""
    stream = env.stream()
    c = env.copier(PLAN, stream=stream)
    a, t = env.empty((4,)), env.empty((4,))
    src = env.pinned((4,))
    src[:] = 3
    with env.capture(stream) as graph:
        c.begin()
        c.copy(Site.POS, a, src)  # captured
    ended = r"the graph capture this step began in has ended"
    for call in (
        lambda: c.copy(Site.POS, a, src),
        lambda: c.copy(Site.PLAIN, a, np.zeros(4, np.int32)),  # pageable
        lambda: c.copy(Site.GATHER, t, a),
        lambda: c.fill_tail(Site.TAIL, t, 0, 1),
        lambda: c.copy(Site.LENS, a, src, unchanged=True),
    ):
        with pytest.raises(cc.CopyError, match=ended):
            call()
    c.flush()  # nothing staged: the step ends
    src[:] = 4
    with c.step():
        c.copy(Site.POS, t, src)
        src[:] = -1  # snapshotted again: the call's bytes land
    assert env.to_host(t).tolist() == [4] * 4
    src[:] = 6
    graph.replay(stream)
    assert env.to_host(a).tolist() == [6] * 4


def test_activate_nests_and_restores_the_previous_copier_even_on_errors():
    from cucopy.backends.sim import SimDevice
    from cucopy.copier import _active

    class S(cc.CopySite):
        A = cc.H2D

    dev = SimDevice()
    plan = cc.CopyPlan(merge={S.A})
    one = cc.DeviceCopier(plan, stream=dev.default_stream, device=dev, backend="sim")
    two = cc.DeviceCopier(plan, stream=dev.default_stream, device=dev, backend="sim")
    assert _active.get() is None
    with one.activate() as got:
        assert got is one and _active.get() is one
        with pytest.raises(KeyError):
            with two.activate():
                assert _active.get() is two
                raise KeyError("inner")
        assert _active.get() is one
        act = two.activate()
        assert _active.get() is one  # nothing happens before the block is entered
        with act:
            assert _active.get() is two
        assert _active.get() is one
    assert _active.get() is None
    one.close()
    two.close()


def test_flush_with_nothing_staged_queries_nothing():
    # an empty step's flush has nothing to land and no event to record
    from cucopy.backends.sim import SimDevice

    class S(cc.CopySite):
        A = cc.H2D

    dev = SimDevice()
    c = cc.DeviceCopier(
        cc.CopyPlan(merge={S.A}), stream=dev.default_stream, device=dev, backend="sim"
    )
    calls = []
    query = c._backend.is_capturing
    c._backend.is_capturing = lambda s: calls.append(s) or query(s)
    with c.step():
        pass
    assert len(calls) == 1  # begin()'s own
    dst = dev.zeros((4,), np.int32)
    with c.step():
        c.copy(S.A, dst, np.arange(4, dtype=np.int32))
    # begin(), the segment's opening (a capture begun since begin() is refused) and a
    # flush with a segment to land
    assert len(calls) == 4
    assert dev.to_host(dst).tolist() == [0, 1, 2, 3]
    c.close()


# -- begin()'s common case, compiled (CopierCore._begin_fast) -----------------------------------


def _step_state(c) -> tuple:
    """What begin() leaves in the copier, its segment and ring."""
    ring = c._ring
    return (
        c._in_step,
        c._owner,
        c._capturing,
        c._checker,
        c._feed,
        c._feed_pending,
        c._slot,
        c._cap_for,
        c._cap,
        c.stats.steps,
        c._seg.fast,
        c._seg.reserve,
        ring.index,
        ring.acquires,
    )


def _compiled_core() -> bool:
    from cucopy import copier

    return copier._CopierCore is not copier.PyCopierCore


def test_begin_opens_the_common_step_in_one_compiled_call(sim_env):
    c = sim_env.copier(PLAN, flush_mode="inline", slots=2)
    a = sim_env.empty((8,))
    for i in range(10):
        with c.step():
            c.copy(Site.POS, a, np.full(8, i, np.int32))
    assert sim_env.to_host(a).tolist() == [9] * 8
    assert c.stats.steps == 10 and c.stats.segments == 10
    # the Python body makes each of the ring's 2 slots the first time round
    assert c._fast_begins == (8 if _compiled_core() else 0)
    c.close()


def _growing_decode_loop(c, a, steps: int) -> list:
    """Steps whose merged bytes grow a little each time (a decode loop's read index):
    the ring's demand peak moves every step. Returns, after each step, the ring's
    (peak, target) and whether the compiled begin opened the step."""
    seen = []
    for i in range(steps):
        n = 8 + 37 * i  # past the 4096-byte capacity later on: the slot target moves too
        fast = c._fast_begins
        with c.step():
            c.copy(Site.POS, a[:n], np.arange(i, i + n, dtype=np.int32))
        seen.append((c._ring._peak, c._ring._target_size, c._fast_begins - fast))
    return seen


def test_a_demand_peak_that_moves_every_step_keeps_the_compiled_begin(sim_env):
    # In a decode loop the read index grows each step, so the ring's demand window
    # gets a new largest value each step. The compiled begin sizes the next slot for it
    # itself (StagingRing._target) instead of handing every such step to Python.
    c = sim_env.copier(PLAN, flush_mode="inline", slots=2, capacity=4096)
    a = sim_env.empty((4096,))
    seen = _growing_decode_loop(c, a, 40)
    n = 8 + 37 * 39
    assert sim_env.to_host(a)[:n].tolist() == list(range(39, 39 + n))
    assert len({p for p, _, _ in seen}) == 40  # the peak moved every step
    assert seen[0][1] == 4096 and seen[-1][1] == 8192  # and the slots' target grew
    if _compiled_core():
        # Python: the first turn of the ring (each slot made), and the steps whose data
        # overflowed a 4096-byte slot (temporaries) until the slots were replaced; every
        # other step in the compiled call, peak moved or not
        fast = [f for _, _, f in seen]
        assert fast[:2] == [0, 0]
        assert fast[2:23] == [1] * 21
        assert fast[31:] == [1] * 9
    # each target as the Python twin's StagingRing._target computes it for its peak
    from cucopy import pack
    from cucopy.ring import _pow2

    assert [t for _, t, _ in seen] == [max(4096, _pow2(pack.align(p, 4096))) for p, _, _ in seen]
    c.close()


@pytest.mark.skipif(not _compiled_core(), reason="the compiled staging core is not in use")
@pytest.mark.parametrize("why", ["staged", "check_mode", "capturing", "other_thread", "ring"])
def test_begin_fast_declines_without_changing_anything(sim_env, monkeypatch, why):
    import threading

    from cucopy import check

    c = sim_env.copier(PLAN, flush_mode="inline")
    a = sim_env.empty((8,))
    for i in range(3):
        with c.step():
            c.copy(Site.POS, a, np.full(8, i, np.int32))
    if why == "staged":
        c.begin()
        c.copy(Site.POS, a, np.full(8, 7, np.int32))
    elif why == "check_mode":
        monkeypatch.setattr(check, "CHECK_MODE", True)
    elif why == "capturing":
        monkeypatch.setattr(c, "_cap_query", lambda arg: True)
    elif why == "other_thread":
        t = threading.Thread(target=c.begin)
        t.start()
        t.join()
    else:
        c._ring.current.dirty = True  # the ring's step would record its event first
    before, fast = _step_state(c), c._fast_begins
    assert c._begin_fast() is False
    assert _step_state(c) == before and c._fast_begins == fast
    if why == "other_thread":
        with pytest.raises(cc.CopyError, match="belongs to another thread"):
            c.begin()  # the Python body reports it
        c._in_step = False
    monkeypatch.undo()
    c.begin()  # the Python body opens the step
    c.flush()
    c.close()


def test_step_calls_a_subclass_own_begin_and_flush(sim_env):
    # step()'s compiled entry and exit run the copier's begin() and flush() when a
    # subclass overrides them
    calls = []

    class Logged(cc.DeviceCopier):
        def begin(self):
            calls.append("begin")
            super().begin()

        def flush(self):
            calls.append("flush")
            super().flush()

    c = Logged(PLAN, stream=sim_env.default_stream, device=sim_env.dev, backend="sim")
    a = sim_env.empty((8,))
    for i in range(3):
        with c.step():
            c.copy(Site.POS, a, np.full(8, i, np.int32))
    assert calls == ["begin", "flush"] * 3
    assert sim_env.to_host(a).tolist() == [2] * 8
    c.close()
