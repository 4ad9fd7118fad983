"""DeviceCopyBuffer: owner-side records, on the sim device and, with a GPU, on CUDA."""

import numpy as np
import pytest

import cucopy as cc
from cucopy import check
from cucopy.adapters import ArrayInfo
from cucopy.buffer import is_capturing, routing_copier


class Site(cc.CopySite):
    LENS = cc.H2D
    TABLE = cc.H2D
    PLAIN = cc.H2D
    PAD = cc.FILL
    PAD_PLAIN = cc.FILL


PLAN = cc.CopyPlan(merge={Site.LENS, Site.TABLE, Site.PAD}, flush_after={Site.TABLE})


def i32(*values):
    return np.array(values, np.int32)


# -- skip and prefix rules -------------------------------------------------------------------


def test_unchanged_update_is_skipped_and_counted(env):
    c = env.copier(PLAN)
    t = env.empty((8,))
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    vals = np.arange(1, 9, dtype=np.int32)
    with c.activate():
        for step in range(4):
            with c.step():
                assert buf.update(vals) is (step == 0)
    assert env.to_host(t).tolist() == vals.tolist()
    st = c.stats.sites[Site.LENS]
    assert (st.merged, st.skipped, st.eager) == (1, 3, 0)


def test_prefix_rule_and_exact(env):
    c = env.copier(PLAN)
    t = env.empty((8,))
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    a = np.arange(1, 7, dtype=np.int32)
    with c.activate(), c.step():
        assert buf.update(a) is True
        assert buf.update(a[:4]) is False  # the start of what the record holds
        assert buf.update(a[:4], exact=True) is True  # exact: the lengths differ
        assert buf.update(a[:4], exact=True) is False
        assert buf.update(a[:5]) is True  # longer than the record (now 4)
        assert buf.update(i32(1, 2, 9)) is True  # same length as a prefix, other values
        assert buf.update(i32(1, 2)) is False
    assert env.to_host(t).tolist() == [1, 2, 9, 4, 5, 6, 0, 0]
    assert c.stats.sites[Site.LENS].skipped == 3


def test_force_always_issues(env):
    c = env.copier(PLAN)
    t = env.empty((4,))
    buf = cc.DeviceCopyBuffer(t, site=Site.PLAIN)
    with c.activate(), c.step():
        assert buf.update(i32(1, 2, 3, 4)) is True
        assert buf.update(i32(1, 2, 3, 4), force=True) is True
        assert buf.update(i32(1, 2, 3, 4)) is False
    assert c.stats.sites[Site.PLAIN].eager == 2
    assert c.stats.sites[Site.PLAIN].skipped == 1
    assert env.to_host(t).tolist() == [1, 2, 3, 4]


def test_plain_path_without_an_active_copier(env):
    t = env.empty((5,))
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    plain = routing_copier(t)
    before = plain.stats.sites[Site.LENS].skipped
    assert buf.update([3, 1, 4]) is True  # a list converts to the buffer's dtype
    assert buf.update(i32(3, 1)) is False
    assert env.to_host(t).tolist() == [3, 1, 4, 0, 0]
    assert plain.stats.sites[Site.LENS].skipped == before + 1


def test_host_array_reuse_is_safe_with_snapshot(env):
    t = env.empty((3,))
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    host = i32(1, 2, 3)
    assert buf.update(host) is True
    host[0] = 9  # the record kept its own copy: this is a change
    assert buf.update(host) is True
    assert env.to_host(t).tolist() == [9, 2, 3]


def test_snapshot_false_compares_against_the_callers_array(env, check_mode):
    t = env.empty((3,))
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS, snapshot=False)
    host = i32(1, 2, 3)
    assert buf.update(host) is True
    assert buf.update(host.copy()) is False  # kept promise: behaves as snapshot=True
    host[0] = 9  # promise broken: the record changed with the array ...
    with pytest.raises(cc.CopyError, match=r"Site\.LENS: unchanged copy into"):
        buf.update(host)  # ... so the skip is false, and check mode says so
    assert env.to_host(t).tolist() == [1, 2, 3]


def test_empty_update_writes_nothing(env):
    t = env.empty((3,))
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    assert buf.update(np.zeros(0, np.int32)) is False
    assert buf.records == 0


# -- keys and views -------------------------------------------------------------------------


def test_keys_over_disjoint_rows_alternate_without_reuploading(env):
    c = env.copier(PLAN)
    table = env.empty((2, 4))
    buf = cc.DeviceCopyBuffer(table, site=Site.LENS)
    a, b = i32(1, 2, 3, 4), i32(5, 6, 7, 8)
    issued = []
    with c.activate():
        for _ in range(3):
            with c.step():
                issued.append(buf.update(a, view=table[0], key="a"))
                issued.append(buf.update(b, view=table[1], key="b"))
    assert issued == [True, True, False, False, False, False]
    assert env.to_host(table).tolist() == [a.tolist(), b.tolist()]
    assert c.stats.sites[Site.LENS].skipped == 4


def test_keys_over_the_same_bytes_never_skip_each_other(env):
    """Each key's write drops the other key's record: its bytes are gone."""
    c = env.copier(PLAN)
    t = env.empty((4,))
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    a, b = i32(1, 1, 1), i32(2, 2)
    with c.activate():
        for _ in range(2):
            with c.step():
                assert buf.update(a, key="a") is True
            assert env.to_host(t).tolist() == [1, 1, 1, 0]
            with c.step():
                assert buf.update(b, key="b") is True
            assert env.to_host(t).tolist() == [2, 2, 1, 0]
    assert c.stats.sites[Site.LENS].skipped == 0


def test_views_keep_separate_records_by_geometry(env):
    c = env.copier(PLAN)
    table = env.empty((4, 8))
    buf = cc.DeviceCopyBuffer(table, site=Site.LENS)
    left, right = np.full((4, 3), 1, np.int32), np.full((4, 2), 2, np.int32)
    with c.activate():
        for step in range(3):
            with c.step():
                # interleaved columns: the byte extents overlap, the bytes do not
                assert buf.update(left, view=table[:, :3]) is (step == 0)
                assert buf.update(right, view=table[:, 5:7]) is (step == 0)
        with c.step():
            assert buf.update(np.full((4, 2), 3, np.int32), view=table[:, 2:4]) is True
            assert buf.update(left, view=table[:, :3]) is True  # its column 2 was overwritten
            assert buf.update(right, view=table[:, 5:7]) is False  # untouched
    want = np.zeros((4, 8), np.int32)
    want[:, 2:4] = 3
    want[:, :3] = 1
    want[:, 5:7] = 2
    assert np.array_equal(env.to_host(table), want)
    assert c.stats.sites[Site.LENS].skipped == 5


def test_a_view_write_trims_the_prefix_record(env):
    c = env.copier(PLAN)
    table = env.empty((2, 4))
    buf = cc.DeviceCopyBuffer(table, site=Site.LENS)
    flat = np.arange(1, 9, dtype=np.int32)
    with c.activate(), c.step():
        assert buf.update(flat) is True
        assert buf.update(i32(0, 0), view=table[1, 1:3]) is True  # elements 5 and 6
        assert buf.update(flat[:5]) is False  # before the view: still recorded
        assert buf.update(flat[:6]) is True
    assert env.to_host(table).reshape(-1).tolist() == [1, 2, 3, 4, 5, 6, 0, 8]


def test_bad_views_are_refused(env):
    t, other = env.empty((2, 4)), env.empty((4,))
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    with pytest.raises(ValueError, match=r"Site\.LENS: view .* is not a view of this buffer"):
        buf.update(i32(1, 2, 3, 4), view=other)
    with pytest.raises(ValueError, match=r"Site\.LENS: 3 values for view .* of 4 elements"):
        buf.update(i32(1, 2, 3), view=t[0])
    with pytest.raises(ValueError, match=r"Site\.LENS: update takes host values, got device"):
        buf.update(other)


# -- tail fills --------------------------------------------------------------------------------


def test_tail_records(env):
    c = env.copier(PLAN)
    t = env.empty((8,))
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    a = np.arange(1, 6, dtype=np.int32)
    with c.activate():
        with c.step():
            assert buf.update(a) is True
            assert buf.fill_tail(5, -1, site=Site.PAD) is True
        assert env.to_host(t).tolist() == [1, 2, 3, 4, 5, -1, -1, -1]
        with c.step():
            assert buf.update(a) is False
            assert buf.fill_tail(5, -1, site=Site.PAD) is False
            assert buf.fill_tail(6, -1, site=Site.PAD) is False  # inside the recorded tail
            assert buf.fill_tail(5, -2, site=Site.PAD) is True  # another value
        assert env.to_host(t).tolist() == [1, 2, 3, 4, 5, -2, -2, -2]
        with c.step():
            # an update over the tail's start: the tail record now begins after it
            assert buf.update(np.arange(1, 8, dtype=np.int32)) is True
            assert buf.fill_tail(7, -2, site=Site.PAD) is False
            assert buf.fill_tail(6, -2, site=Site.PAD) is True
        assert env.to_host(t).tolist() == [1, 2, 3, 4, 5, 6, -2, -2]
        with c.step():
            # that fill cut the update record at element 6
            assert buf.update(np.arange(1, 7, dtype=np.int32)) is False
            assert buf.update(np.arange(1, 8, dtype=np.int32)) is True
    assert env.to_host(t).tolist() == [1, 2, 3, 4, 5, 6, 7, -2]
    assert c.stats.sites[Site.PAD].skipped == 3
    assert c.stats.sites[Site.LENS].skipped == 2


def test_tail_of_a_view_and_of_a_fill_only_buffer(env):
    table = env.empty((3, 4))
    buf = cc.DeviceCopyBuffer(table, site=Site.PAD_PLAIN)
    c = env.copier(PLAN)
    with c.activate(), c.step():
        assert buf.fill_tail(1, 7, view=table[:, 2:]) is True  # elements 1..5 of a 3x2 view
        assert buf.fill_tail(1, 7, view=table[:, 2:]) is False
        assert buf.fill_tail(2, 7, view=table[:, 2:]) is False
        assert buf.fill_tail(12, 7) is False  # an empty tail
    got = env.to_host(table)
    want = np.zeros((3, 4), np.int32)
    want[0, 3] = want[1, 2] = want[1, 3] = want[2, 2] = want[2, 3] = 7
    assert np.array_equal(got, want)
    assert c.stats.sites[Site.PAD_PLAIN].skipped == 3
    with pytest.raises(ValueError, match=r"Site\.PAD_PLAIN: update\(\) needs an H2D site"):
        buf.update(i32(1))


def test_fill_tail_through_an_h2d_site_uploads_the_tail(env):
    """DESIGN.md's buffer has an H2D site and calls fill_tail(start, value)."""
    c = env.copier(PLAN)
    t = env.empty((6,))
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    with c.activate():
        with c.step():
            assert buf.update(i32(1, 2, 3, 4, 5, 6)) is True
            assert buf.fill_tail(4, -1) is True
        assert env.to_host(t).tolist() == [1, 2, 3, 4, -1, -1]
        with c.step():
            assert buf.fill_tail(4, -1) is False  # recorded: skipped
            assert buf.fill_tail(5, -1) is False  # inside the recorded tail
            assert buf.update(i32(1, 2, 3, 4)) is False  # the prefix record survived
    assert c.stats.sites[Site.LENS].merged == 2
    assert c.stats.sites[Site.LENS].skipped == 3
    strided = env.empty((4, 4))[:, :2]
    with pytest.raises(ValueError, match=r"Site\.LENS: fill_tail through an H2D site needs"):
        cc.DeviceCopyBuffer(strided, site=Site.LENS).fill_tail(1, 0)
    with pytest.raises(ValueError, match=r"fill_tail\(site=\.\.\.\) takes a FILL CopySite"):
        buf.fill_tail(1, 0, site=Site.TABLE)
    with pytest.raises(ValueError, match=r"Site\.PAD: fill value 300 does not fit dtype int8"):
        cc.DeviceCopyBuffer(env.empty((4,), np.int8), site=Site.PAD).fill_tail(1, 300)


# -- dropped copies -----------------------------------------------------------------------------


def test_a_dropped_merged_copy_invalidates_the_record(env):
    c = env.copier(PLAN)
    t, table = env.empty((6,)), env.empty((2, 3))
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    other = cc.DeviceCopyBuffer(table, site=Site.PLAIN)
    vals = np.arange(1, 7, dtype=np.int32)
    with c.activate():
        with c.step():
            other.update(i32(1, 1, 1), view=table[0])
        with pytest.raises(RuntimeError, match="model failed"), c.step():
            assert buf.update(vals) is True
            assert c.staged == 1
            raise RuntimeError("model failed")
        assert buf.records == 0  # never claims the bytes that did not land
        assert other.records == 1  # another owner's eager copy is not touched
        assert env.to_host(t).tolist() == [0] * 6
        with c.step():
            assert buf.update(vals) is True
            assert other.update(i32(1, 1, 1), view=table[0]) is False
    assert env.to_host(t).tolist() == vals.tolist()
    assert c.stats.sites[Site.LENS].merged == 1
    assert c.stats.sites[Site.LENS].skipped == 0


def test_a_dropped_merged_fill_invalidates_the_record(env):
    c = env.copier(PLAN)
    t = env.empty((4,))
    buf = cc.DeviceCopyBuffer(t, site=Site.PAD)
    with c.activate():
        with pytest.raises(KeyError), c.step():
            assert buf.fill_tail(1, 5) is True
            raise KeyError("x")
        with c.step():
            assert buf.fill_tail(1, 5) is True
            assert buf.fill_tail(1, 5) is False
    assert env.to_host(t).tolist() == [0, 5, 5, 5]


# -- capture ----------------------------------------------------------------------------------


def test_capture_always_issues_and_keeps_no_record(env):
    stream = env.stream()
    c = env.copier(PLAN, stream=stream)
    t = env.empty((4,))
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    src = env.pinned((4,))
    src[:] = 3
    with c.activate():
        with c.step():
            assert buf.update(src) is True
        assert buf.records == 1
        with env.capture(stream) as graph:
            with c.step():
                assert is_capturing(t)
                assert buf.update(src) is True  # recorded before: still issued
                assert buf.records == 0
                assert buf.update(src) is True
                assert buf.fill_tail(2, 9, site=Site.PAD) is True
                assert buf.fill_tail(2, 9, site=Site.PAD) is True
                assert buf.records == 0
        assert not is_capturing(t)
        assert env.to_host(t).tolist() == [3] * 4  # captured, not run
        src[:] = 5
        graph.replay(stream)
        assert env.to_host(t).tolist() == [5, 5, 9, 9]
        with c.step():
            assert buf.update(src) is True  # no record survived the capture
    assert env.to_host(t).tolist() == [5] * 4
    assert c.stats.sites[Site.LENS].skipped == 0
    assert c.stats.sites[Site.LENS].fallback["capture"] == 2


def test_capture_without_an_active_copier(sim_env):
    env = sim_env
    t = env.empty((4,))
    stream = routing_copier(t).stream
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    src = env.pinned((4,))
    src[:] = 2
    with env.capture(stream) as graph:
        assert buf.update(src) is True
        assert buf.update(src) is True
        assert buf.records == 0
    graph.replay(stream)
    assert env.to_host(t).tolist() == [2] * 4


def test_record_only_capture_answers_true_and_keeps_nothing(env):
    stream = env.stream()
    c = env.copier(PLAN, stream=stream)
    t = env.empty((4,))
    buf = cc.DeviceCopyBuffer(t, site=None)
    with c.activate():
        assert buf.update(i32(1, 2)) is True
        with env.capture(stream), c.step():
            assert buf.update(i32(1, 2)) is True
            assert buf.fill_tail(2, 0) is True
            assert buf.records == 0
        assert buf.update(i32(1, 2)) is True


# -- record-only buffers --------------------------------------------------------------------


def test_record_only_buffer_answers_and_never_copies(env):
    t = env.empty((6,))
    buf = cc.DeviceCopyBuffer(t, site=None)
    a = i32(4, 5, 6)
    assert buf.update(a) is True  # the owner must copy
    assert env.to_host(t).tolist() == [0] * 6  # ... through its own path
    env.write(env.default_stream, t[:3], a)
    env.synchronize()
    assert buf.update(a) is False
    assert buf.update(a[:2]) is False
    assert buf.update(i32(4, 5, 7)) is True
    assert buf.fill_tail(3, 0) is True
    assert buf.fill_tail(3, 0) is False
    assert buf.fill_tail(4, 0) is False
    assert buf.records == 2
    buf.invalidate()
    assert buf.update(i32(4, 5, 7)) is True
    assert env.to_host(t).tolist() == [4, 5, 6, 0, 0, 0]


def test_record_only_check_mode_verifies_the_device(env, check_mode):
    t = env.empty((4,))
    buf = cc.DeviceCopyBuffer(t, site=None)
    assert buf.update(i32(1, 2)) is True
    env.write(env.default_stream, t[:2], i32(1, 2))
    env.synchronize()
    assert buf.update(i32(1, 2)) is False  # true: verified against the device
    assert buf.fill_tail(2, 3) is True  # the owner "forgets" to fill
    with pytest.raises(cc.CopyError, match=r"DeviceCopyBuffer\(record-only\): skipped upload"):
        buf.fill_tail(2, 3)
    env.write(env.default_stream, t[:2], i32(9, 9))  # a write behind the record
    env.synchronize()
    with pytest.raises(cc.CopyError, match=r"DeviceCopyBuffer\(record-only\): skipped upload"):
        buf.update(i32(1, 2))


# -- check mode ---------------------------------------------------------------------------------


def test_check_mode_catches_a_false_skip_at_the_barrier(env, check_mode):
    c = env.copier(PLAN)
    t = env.empty((4,))
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    vals = i32(1, 2, 3, 4)
    with c.activate():
        with c.step():
            assert buf.update(vals) is True
        env.write(env.default_stream, t, 7)  # foreign work behind the record
        with pytest.raises(cc.CopyError, match=r"Site\.LENS"), c.step():
            assert buf.update(vals) is False
        buf.invalidate()  # what the owner of that foreign write must do
        with c.step():
            assert buf.update(vals) is True
    assert env.to_host(t).tolist() == [1, 2, 3, 4]


def test_check_mode_catches_a_false_skip_on_the_plain_path(env, check_mode):
    t = env.empty((4,))
    buf = cc.DeviceCopyBuffer(t, site=Site.PLAIN)
    assert buf.update(i32(1, 2, 3)) is True
    env.write(env.default_stream, t[1:2], 0)
    env.synchronize()
    assert buf.update(i32(1)) is False  # element 0 is still right
    with pytest.raises(cc.CopyError, match=r"Site\.PLAIN: unchanged copy into .* elements 1\.\.1"):
        buf.update(i32(1, 2))


def test_check_mode_accepts_a_skip_of_bytes_still_staged(env, check_mode):
    c = env.copier(PLAN)
    t = env.empty((4,))
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    with c.activate(), c.step():
        assert buf.update(i32(1, 2, 3, 4)) is True
        assert c.staged == 1
        assert buf.update(i32(1, 2, 3, 4)) is False  # verified in program order at the flush
        assert buf.fill_tail(4, 0, site=Site.PAD) is False  # empty tail
    assert env.to_host(t).tolist() == [1, 2, 3, 4]
    assert c.stats.sites[Site.LENS].checked >= 2


def test_check_mode_off_costs_no_device_reads(sim_env, monkeypatch):
    env = sim_env
    monkeypatch.setattr(check, "CHECK_MODE", False)
    c = env.copier(PLAN)
    t = env.empty((64,))
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    vals = np.arange(64, dtype=np.int32)
    with c.activate():
        for _ in range(50):
            with c.step():
                buf.update(vals)
                buf.update(vals[:10])
                buf.fill_tail(64, 0, site=Site.PAD)
    assert c.stats.sites[Site.LENS].skipped == 99
    assert env.dev.device_reads == 0
    monkeypatch.setattr(check, "CHECK_MODE", True)  # the counter does see check mode's reads
    with c.activate(), c.step():
        assert buf.update(vals) is False
    assert env.dev.device_reads > 0
    assert env.to_host(t).tolist() == vals.tolist()


# -- errors ---------------------------------------------------------------------------------------


class Gather(cc.CopySite):
    IDS = cc.D2D


class _ReadOnly:
    """A device array that describes itself as immutable (as a JAX array does)."""

    def __init__(self, arr):
        self.arr = arr

    def __cucopy_array__(self):
        info = self.arr.__cucopy_array__()
        return ArrayInfo(
            info.ptr,
            info.shape,
            info.strides,
            info.dtype,
            device=info.device,
            readonly=True,
            obj=self,
            label="jax.Array(int32, shape=(4,))",
        )


def test_errors_name_the_site_and_the_value(env):
    t = env.empty((8,))
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    with pytest.raises(TypeError, match=r"Site\.LENS: dtype mismatch: host values are int64"):
        buf.update(np.arange(3))
    with pytest.raises(ValueError, match=r"Site\.LENS: 9 values do not fit the buffer's 8"):
        buf.update(np.zeros(9, np.int32))
    with pytest.raises(ValueError, match=r"Site\.LENS: values \[1099511627776\] do not fit"):
        buf.update([1 << 40])
    with pytest.raises(ValueError, match=r"Site\.LENS: values \[1\.5\] do not fit dtype int32"):
        buf.update([1.5])
    with pytest.raises(ValueError, match=r"Site\.PAD: start must be an int >= 0, got -1"):
        cc.DeviceCopyBuffer(t, site=Site.PAD).fill_tail(-1, 0)
    with pytest.raises(ValueError, match=r"Site\.LENS: the buffer must be device memory"):
        cc.DeviceCopyBuffer(np.zeros(4, np.int32), site=Site.LENS)
    with pytest.raises(ValueError, match=r"Gather\.IDS: .* takes an H2D site"):
        cc.DeviceCopyBuffer(t, site=Gather.IDS)
    with pytest.raises(TypeError, match=r"site: expected a CopySite member or None"):
        cc.DeviceCopyBuffer(t, site="LENS")
    assert buf.records == 0


def test_readonly_destination_is_refused(sim_env):
    t = sim_env.empty((4,))
    with pytest.raises(TypeError, match=r"Site\.LENS: jax\.Array.* is immutable"):
        cc.DeviceCopyBuffer(_ReadOnly(t), site=Site.LENS)


def test_non_contiguous_buffer_needs_a_view(env):
    table = env.empty((4, 4))
    buf = cc.DeviceCopyBuffer(table[:, :2], site=Site.LENS)
    with pytest.raises(ValueError, match=r"Site\.LENS: update\(view=None\) .* pass view="):
        buf.update(i32(1, 2))
    assert buf.update(np.ones((4, 2), np.int32), view=table[:, :2]) is True
    assert buf.fill_tail(6, 5, site=Site.PAD) is True  # the flattened tail of any layout
    want = np.zeros((4, 4), np.int32)
    want[:, :2] = 1
    want[3, :2] = 5
    assert np.array_equal(env.to_host(table), want)


def test_repr(sim_env):
    buf = cc.DeviceCopyBuffer(sim_env.empty((4,)), site=Site.LENS)
    buf.update(i32(1))
    assert repr(buf).startswith("DeviceCopyBuffer(Site.LENS, SimArray(")
    assert "records=1" in repr(buf)
    assert "record-only" in repr(cc.DeviceCopyBuffer(sim_env.empty((4,)), site=None))


# -- randomized steps against a NumPy model -----------------------------------------------------


class _StepFailed(Exception):
    """The model's step raised (not a CopyError: that must fail the test)."""


def test_randomized_steps_against_a_numpy_model(sim_env, check_mode):
    """Updates, keys, views, fills, discards and foreign writes; check mode proves every skip.

    Few distinct values, lengths and views, so that records collide often.
    """
    env = sim_env
    rng = np.random.default_rng(11)
    c = env.copier(PLAN, slots=3, capacity=8192)
    stream = env.default_stream
    n, rows, cols = 12, 4, 6
    t, table = env.empty((n,)), env.empty((rows, cols))
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    tbuf = cc.DeviceCopyBuffer(table, site=Site.TABLE)
    model, tmodel = np.zeros(n, np.int32), np.zeros((rows, cols), np.int32)
    palette = [np.arange(n, dtype=np.int32) % 3, np.arange(n, dtype=np.int32) % 2]
    views = [
        (slice(0, 2), slice(0, 3)),
        (slice(1, 3), slice(2, 6)),
        (slice(0, 4), slice(3, 5)),
        (slice(2, 3), slice(0, 6)),
    ]
    issued = skipped = 0
    with c.activate():
        for step in range(200):
            fail = rng.random() < 0.1
            try:
                with c.step():
                    for _ in range(int(rng.integers(1, 6))):
                        op = int(rng.integers(0, 4))
                        if op == 0:
                            k = int(rng.choice([3, 4, 5, 8, 12]))
                            vals = palette[int(rng.integers(0, 2))][:k]
                            key = int(rng.integers(0, 2))
                            r = buf.update(vals, key=key, exact=bool(rng.random() < 0.2))
                            model[:k] = vals
                        elif op == 1:
                            start, value = (
                                int(rng.choice([2, 4, 5, 8, 12])),
                                int(rng.integers(-1, 1)),
                            )
                            r = buf.fill_tail(start, value, site=Site.PAD)
                            model[start:] = value
                        elif op == 2:
                            rs, cs = views[int(rng.integers(0, len(views)))]
                            shape = (rs.stop - rs.start, cs.stop - cs.start)
                            vals = np.full(shape, rng.integers(0, 2), np.int32)
                            r = tbuf.update(vals, view=table[rs, cs])
                            tmodel[rs, cs] = vals
                        else:
                            start = int(rng.choice([6, 12, 18]))
                            r = tbuf.fill_tail(start, 0, site=Site.PAD_PLAIN)
                            tmodel.reshape(-1)[start:] = 0
                        issued += r is True
                        skipped += r is False
                    if fail:
                        raise _StepFailed()
            except _StepFailed:
                # what landed depends on which copies were still staged: read it back
                model[:] = env.to_host(t)
                tmodel[:] = env.to_host(table)
            if rng.random() < 0.05:
                env.write(stream, t, 1)
                model[:] = 1
                buf.invalidate()
            if step % 10 == 9 or rng.random() < 0.2:
                assert np.array_equal(env.to_host(t), model), step
                assert np.array_equal(env.to_host(table), tmodel), step
    assert np.array_equal(env.to_host(t), model)
    assert np.array_equal(env.to_host(table), tmodel)
    assert issued > 100 and skipped > 100


# -- byte-region geometry ------------------------------------------------------------------------


def test_region_overlap_matches_brute_force():
    from cucopy.buffer import _first_in, _forms_overlap, _last_in

    rng = np.random.default_rng(5)

    def form():
        rows = int(rng.integers(1, 4))
        width = int(rng.integers(1, 9))
        pitch = width if rows == 1 else int(rng.choice([width, width + 3, 16]))
        pitch = max(pitch, width)
        return (int(rng.integers(0, 40)), rows, width, pitch)

    def bytes_of(f):
        ptr, rows, width, pitch = f
        return {ptr + r * pitch + x for r in range(rows) for x in range(width)}

    for _ in range(3000):
        f, g = form(), form()
        bf, bg = bytes_of(f), bytes_of(g)
        exact = bool(bf & bg)
        got = _forms_overlap(f, g)
        if f[1] > 1 and g[1] > 1 and f[3] != g[3]:
            assert got or not exact  # different pitches: conservative
        else:
            assert got == exact, (f, g)
        a = int(rng.integers(0, 50))
        b = a + int(rng.integers(1, 30))
        inside = sorted(x for x in bf if a <= x < b)
        assert _first_in(f, a, b) == (inside[0] if inside else None), (f, a, b)
        assert _last_in(f, a, b) == (inside[-1] if inside else None), (f, a, b)


def test_values_compare_as_bytes(env):
    t = env.empty((2,), np.float32)
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    assert buf.update(np.array([0.0, np.nan], np.float32)) is True
    assert buf.update(np.array([0.0, np.nan], np.float32)) is False  # NaN equals itself
    assert buf.update(np.array([-0.0, np.nan], np.float32)) is True  # -0.0 is other bytes
    assert np.signbit(env.to_host(t)[0])


# -- records of views whose dtype differs from the buffer's ----------------------------------------


def test_a_fill_through_a_wider_view_is_trimmed_in_its_own_elements(env):
    """A fill through an int32 view of an int8 buffer, then a 4-byte update inside its tail:
    the fill's record must move past the update in int32 elements (it used to count the
    view's elements in the buffer's bytes and keep claiming element 5)."""
    c = env.copier(PLAN)
    x = env.empty((64,), np.int8)
    buf = cc.DeviceCopyBuffer(x, site=Site.LENS)
    with c.activate():
        with c.step():
            assert buf.fill_tail(0, 7, view=x.view(np.int32), site=Site.PAD) is True
            assert buf.update(np.full(4, 9, np.int8), view=x[20:24]) is True
        with c.step():
            assert buf.fill_tail(0, 7, view=x.view(np.int32), site=Site.PAD) is True
            assert buf.fill_tail(0, 7, view=x.view(np.int32), site=Site.PAD) is False
    assert env.to_host(x).view(np.int32).tolist() == [7] * 16


def test_a_fill_through_a_narrower_view_is_trimmed_in_its_own_elements(env):
    """The reverse: an int8 view of an int32 buffer, a one-element prefix update, then a
    fill from byte 2 must be issued (the update overwrote bytes 2 and 3)."""
    c = env.copier(PLAN)
    x = env.empty((16,), np.int32)
    buf = cc.DeviceCopyBuffer(x, site=Site.LENS)
    with c.activate():
        with c.step():
            assert buf.fill_tail(0, 7, view=x.view(np.int8), site=Site.PAD) is True
            assert buf.update(i32(0x01010101)) is True
        with c.step():
            assert buf.fill_tail(2, 7, view=x.view(np.int8), site=Site.PAD) is True
            assert buf.fill_tail(4, 7, view=x.view(np.int8), site=Site.PAD) is False
    got = env.to_host(x).view(np.int8)
    assert got[:4].tolist() == [1, 1, 7, 7] and (got[4:] == 7).all()


def test_update_values_that_are_strings_or_complex_are_refused(env):
    c = env.copier(PLAN)
    t = env.empty((4,))
    f = env.empty((4,), np.float32)
    buf, fbuf = cc.DeviceCopyBuffer(t, site=Site.LENS), cc.DeviceCopyBuffer(f, site=Site.LENS)
    with c.activate(), c.step():
        assert buf.update(i32(1, 2, 3, 4)) is True
        with pytest.raises(ValueError, match=r"Site\.LENS: values \['7', '8'\] do not convert"):
            buf.update(["7", "8"])
        with pytest.raises(ValueError, match=r"Site\.LENS: values '7' do not convert"):
            buf.update("7")
        with pytest.raises(ValueError, match=r"Site\.LENS: values \[\(1\+2j\)\] do not convert"):
            fbuf.update([1 + 2j])
        assert buf.records == 1 and fbuf.records == 0 and c.staged == 1
    assert env.to_host(t).tolist() == [1, 2, 3, 4]


def test_a_prefix_update_takes_host_values_of_any_shape(env):
    """A prefix is flat: a 2-D host array fills it in C order (copy() itself refuses a
    2-D source into a 1-D destination)."""
    c = env.copier(PLAN)
    t = env.empty((8,))
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    with c.activate(), c.step():
        assert buf.update(np.arange(6, dtype=np.int32).reshape(2, 3)) is True
        assert buf.update(np.arange(6, dtype=np.int32)) is False
    assert env.to_host(t).tolist() == [0, 1, 2, 3, 4, 5, 0, 0]


def test_capture_refuses_arrays_of_the_buffers_making_by_name(env):
    """Under capture, an H2D-site fill_tail used to fail with "H2D source must be pinned
    ... got pageable numpy.ndarray", naming an array the buffer made; it is refused with
    a message about the buffer, and nothing is issued or forgotten."""
    stream = env.stream()
    c = env.copier(PLAN, stream=stream)
    t = env.empty((2, 3))
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    src = env.pinned((6,))
    src[:] = 4
    with c.activate():
        with c.step():
            assert buf.update(src) is True
        with env.capture(stream) as graph, c.step():
            with pytest.raises(ValueError, match=r"Site\.LENS: fill_tail through this buffer's"):
                buf.fill_tail(4, -1)
            with pytest.raises(ValueError, match=r"Site\.LENS: update\(\) during graph capture"):
                buf.update([1, 2])
            assert buf.records == 1  # nothing was issued: the record still holds
            assert buf.fill_tail(4, -1, site=Site.PAD) is True  # a FILL site is captured
        graph.replay(stream)
    assert env.to_host(t).reshape(-1).tolist() == [4, 4, 4, 4, -1, -1]


# -- update()'s fast path ----------------------------------------------------------------------
#
# A NumPy prefix update through the active copier's fast step skips or stages without the
# general path (compiled FastUpdate, or its Python twin under CUCOPY_PURE_PYTHON=1). These
# tests count the general path's calls to cucopy.copier.copy to know which path ran, and
# compare whole random programs against the general path alone.


class _CopySpy:
    """Counts the general path's calls (it issues and skips through cucopy.copier.copy)."""

    def __init__(self, monkeypatch):
        import cucopy.copier as copier_module

        self.calls = 0
        real = copier_module.copy

        def spy(*args, **kw):
            self.calls += 1
            return real(*args, **kw)

        monkeypatch.setattr(copier_module, "copy", spy)


def test_the_compiled_fast_path_is_the_one_in_use():
    import os

    from cucopy import buffer, segment

    if os.environ.get("CUCOPY_PURE_PYTHON"):
        assert buffer.IMPLEMENTATION == "python"
        assert buffer._FastUpdate is None
        assert cc.DeviceCopyBuffer.__mro__[1] is buffer._PyBufferCore
    else:
        from cucopy import _segment

        assert segment.IMPLEMENTATION == "compiled"
        assert buffer.IMPLEMENTATION == "compiled"
        assert isinstance(cc.DeviceCopyBuffer.__dict__["update"], _segment.FastUpdate)
        assert cc.DeviceCopyBuffer.__mro__[1] is _segment.BufferCore


def test_update_keeps_its_signature_and_doc():
    import inspect

    params = list(inspect.signature(cc.DeviceCopyBuffer.update).parameters)
    assert params == ["self", "host", "force", "view", "key", "exact"]
    assert "unless it already holds those values" in cc.DeviceCopyBuffer.update.__doc__


def test_the_general_path_is_looked_up_on_the_instance(sim_env):
    class Counting(cc.DeviceCopyBuffer):
        calls = 0

        def _update(self, *args, **kw):
            Counting.calls += 1
            return super()._update(*args, **kw)

    c = sim_env.copier(PLAN)
    buf = Counting(sim_env.empty((4,)), site=Site.LENS)
    with c.activate(), c.step():
        assert buf.update(i32(1, 2)) is True
        assert buf.update(i32(1, 2)) is False  # the fast path
        assert buf.update([1, 2]) is False  # a list: the general path
    assert Counting.calls == 2


def test_steady_state_takes_the_fast_path(sim_env, monkeypatch):
    env = sim_env
    c = env.copier(PLAN)
    t = env.empty((8,))
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    a, b = np.arange(1, 9, dtype=np.int32), np.arange(11, 19, dtype=np.int32)
    spy = _CopySpy(monkeypatch)
    with c.activate():
        with c.step():
            assert buf.update(a) is True  # first sight: the general path
        assert spy.calls == 1
        for _ in range(6):
            with c.step():
                assert buf.update(a) is False  # skipped: one lookup, one compare
                assert buf.update(a[:5]) is False  # a prefix of the record
                assert buf.update(a, exact=True) is False
            assert env.to_host(t).tolist() == a.tolist()
        assert spy.calls == 1  # none of those reached the general path
        for step in range(4):
            with c.step():
                v = b if step % 2 == 0 else a
                assert buf.update(v) is True  # changed: staged on the fast path
                assert buf.update(v) is False  # the record holds what was staged
                assert c.staged == 1
            assert env.to_host(t).tolist() == v.tolist()
        assert spy.calls == 1
    st = c.stats.sites[Site.LENS]
    assert (st.merged, st.skipped, st.eager) == (5, 22, 0)


def test_the_record_is_the_buffers_own_copy(env):
    """The fast upload overwrites the record's private bytes, never the caller's array."""
    c = env.copier(PLAN)
    t = env.empty((4,))
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    host = i32(1, 2, 3, 4)
    with c.activate():
        with c.step():
            assert buf.update(host) is True
        for step in range(6):
            with c.step():
                assert buf.update(host) is False
                host[1] = step  # refilled in place, passed again
                assert buf.update(host) is True
                assert buf.update(host) is False
                host[1] = 9  # after the call: not what landed, nor what the record holds
            assert env.to_host(t).tolist() == [1, step, 3, 4]
            host[1] = step


def test_fast_path_refuses_what_the_general_path_refuses(env, monkeypatch):
    c = env.copier(PLAN)
    t = env.empty((4,))
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    a = i32(1, 2, 3, 4)
    with c.activate():
        with c.step():
            assert buf.update(a) is True
        spy = _CopySpy(monkeypatch)
        with c.step():
            # the same bytes as another dtype: a dtype mismatch, not a skip
            with pytest.raises(TypeError, match="dtype mismatch"):
                buf.update(a.view(np.uint32))
            with pytest.raises(TypeError, match="dtype mismatch"):
                buf.update(a.view(np.float32))
            with pytest.raises(ValueError, match="do not fit"):
                buf.update(np.zeros(5, np.int32))
            assert buf.update(np.zeros(0, np.int32)) is False  # empty: nothing written
            assert buf.update(np.repeat(a, 2)[::2]) is False  # non-contiguous: general path
            assert buf.update(a, force=True) is True
            assert buf.update(a[:2], exact=True) is True  # the record is longer
        assert spy.calls == 3  # the last three: the general path's
    assert env.to_host(t).tolist() == [1, 2, 3, 4]


def test_every_byte_counts_on_the_fast_path(env):
    c = env.copier(PLAN)
    t = env.empty((3,), np.int64)
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    a = np.array([1, -2, 3], np.int64)
    with c.activate():
        with c.step():
            assert buf.update(a) is True
        for i in range(a.nbytes):
            b = a.copy()
            b.view(np.uint8)[i] ^= 0x80
            with c.step():
                assert buf.update(b) is True, i
                assert buf.update(a[:2]) is (i < 16), i  # a prefix of the record?
                assert buf.update(a) is True, i
                assert buf.update(a) is False, i
    assert env.to_host(t).tolist() == [1, -2, 3]
    assert c.stats.sites[Site.LENS].skipped == 24 + 8


def test_torch_cpu_tensors_take_the_fast_path(sim_env, monkeypatch):
    torch = pytest.importorskip("torch")
    c = sim_env.copier(PLAN)
    t = sim_env.empty((4,))
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    host = torch.tensor([1, 2, 3, 4], dtype=torch.int32)  # an engine's staging tensor
    spy = _CopySpy(monkeypatch)
    with c.activate():
        with c.step():
            assert buf.update(host) is True  # first sight: the general path caches it
        for step in range(4):
            with c.step():
                assert buf.update(host) is False
                host[0] = step  # refilled in place
                assert buf.update(host) is True
                assert buf.update(host) is False
            assert sim_env.to_host(t).tolist() == [step, 2, 3, 4]
        assert spy.calls == 1
        with c.step():
            with pytest.raises(TypeError, match="dtype mismatch"):
                buf.update(host.to(torch.int64))
            host.set_(torch.tensor([7, 8, 9, 10], dtype=torch.int32))  # new storage
            assert buf.update(host) is True  # the segment's cache sees the new geometry
            assert buf.update(host[:2]) is False  # a fresh view: the general path
            assert buf.update(host) is False
        assert spy.calls == 3  # the dtype mismatch is refused before any copy
    assert sim_env.to_host(t).tolist() == [7, 8, 9, 10]
    assert c.stats.sites[Site.LENS].skipped == 10


def test_a_fast_upload_dropped_with_its_step_invalidates_the_record(env):
    c = env.copier(PLAN)
    t = env.empty((4,))
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    a, b = i32(1, 2, 3, 4), i32(5, 6, 7, 8)
    with c.activate():
        with c.step():
            assert buf.update(a) is True
        with pytest.raises(RuntimeError), c.step():
            assert buf.update(b) is True  # the fast path: staged, the record holds b
            raise RuntimeError("model failed")
        assert buf.records == 0  # on_drop: b never landed
        with c.step():
            assert buf.update(b) is True
    assert env.to_host(t).tolist() == [5, 6, 7, 8]


def test_fast_path_after_invalidate_fill_and_view_writes(env):
    c = env.copier(PLAN)
    t = env.empty((6,))
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    a = np.arange(1, 7, dtype=np.int32)
    with c.activate():
        with c.step():
            assert buf.update(a) is True
        with c.step():
            buf.invalidate()
            assert buf.update(a) is True
            assert buf.fill_tail(4, 0, site=Site.PAD) is True  # trims the record to 4
            assert buf.update(a) is True
            assert buf.update(a[:4]) is False
            assert buf.update(i32(9, 9), view=t[1:3]) is True  # trims it to 1
            assert buf.update(a[:2]) is True
            assert buf.update(a[:1]) is False
    assert env.to_host(t).tolist() == [1, 2, 9, 4, 5, 6]


def test_a_barrier_site_update_lands_on_the_fast_path(env):
    c = env.copier(PLAN)
    t = env.empty((4,))
    buf = cc.DeviceCopyBuffer(t, site=Site.TABLE)
    a, b = i32(1, 2, 3, 4), i32(4, 3, 2, 1)
    with c.activate():
        with c.step():
            assert buf.update(a) is True
        for v in (b, a, b):
            with c.step():
                assert buf.update(v) is True
                assert c.staged == 0  # flushed right after: a barrier
                assert buf.update(v) is False
            assert env.to_host(t).tolist() == v.tolist()
    st = c.stats.sites[Site.TABLE]
    assert (st.merged, st.skipped) == (4, 3)
    assert c.stats.segments == 4


def test_unmerged_sites_and_record_only_buffers_take_the_general_path(env, monkeypatch):
    c = env.copier(PLAN)
    t, u = env.empty((4,)), env.empty((4,))
    plain = cc.DeviceCopyBuffer(t, site=Site.PLAIN)
    owner = cc.DeviceCopyBuffer(u, site=None)
    a = i32(1, 2, 3, 4)
    spy = _CopySpy(monkeypatch)
    with c.activate():
        for step in range(3):
            with c.step():
                assert plain.update(a) is (step == 0)
                assert owner.update(a) is (step == 0)
    assert spy.calls == 3  # plain's, every time (owner copies nothing)
    assert plain._froute is None and owner._froute is None
    st = c.stats.sites[Site.PLAIN]
    assert (st.eager, st.skipped, st.merged) == (1, 2, 0)


def test_capture_and_check_mode_take_the_general_path(env, monkeypatch):
    stream = env.stream()
    c = env.copier(PLAN, stream=stream)
    t = env.empty((4,))
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    src = env.pinned((4,))
    src[:] = 3
    with c.activate():
        with c.step():
            assert buf.update(src) is True
        with c.step():
            assert buf.update(src) is False  # the route is known
        with env.capture(stream) as graph, c.step():
            assert buf.update(src) is True  # captured: always issued, no record
            assert buf.records == 0
        graph.replay(stream)
        with c.step():
            assert buf.update(src) is True
        env.write(stream, t, 7)  # foreign work behind the record
        monkeypatch.setattr(check, "CHECK_MODE", True)
        with pytest.raises(cc.CopyError, match=r"Site\.LENS"), c.step():
            assert buf.update(src) is False  # check mode: verified, not fast
    assert c.stats.sites[Site.LENS].fallback["capture"] == 1


def test_another_copier_or_thread_takes_the_general_path(sim_env):
    import gc
    import threading

    env = sim_env
    c1, c2 = env.copier(PLAN), env.copier(PLAN)
    t = env.empty((4,))
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    a = i32(1, 2, 3, 4)
    with c1.activate(), c1.step():
        assert buf.update(a) is True
        assert buf.update(a) is False
    with c2.activate(), c2.step():
        assert buf.update(a) is False  # counted by c2, the copier it went through
        assert buf.update(a) is False
    assert c1.stats.sites[Site.LENS].skipped == 1
    assert c2.stats.sites[Site.LENS].skipped == 2
    # a step of c1 open in this thread: another thread's update through c1 is refused
    errors = []

    def other():
        with c1.activate():
            try:
                buf.update(a)
            except cc.CopyError as e:
                errors.append(e)

    with c1.activate(), c1.step():
        assert buf.update(a) is False
        th = threading.Thread(target=other)
        th.start()
        th.join()
    assert len(errors) == 1 and "another thread" in str(errors[0])
    # a copier collected: the buffer forgets its route (and the copier's segment)
    with c2.activate(), c2.step():
        assert buf.update(a) is False
    assert buf._froute is not None
    c2.close()
    del c2
    gc.collect()
    assert buf._froute is None


def test_skip_counts_fold_into_the_stats(sim_env):
    env = sim_env
    c = env.copier(PLAN)
    t = env.empty((4,))
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    a = i32(1, 2, 3, 4)
    with c.activate():
        with c.step():
            buf.update(a)
        st = c.stats.sites[Site.LENS]  # held across the skips: reads fold them in
        with c.step():
            for _ in range(5):
                buf.update(a)
        assert st.skipped == 5
        assert c.stats.as_dict()["sites"]["Site.LENS"]["skipped"] == 5
        c.stats.reset()  # pending skips are dropped too
        assert c.stats.sites[Site.LENS].skipped == 0
        with c.step():
            buf.update(a)
    assert c.stats.sites[Site.LENS].skipped == 1


def _random_program(env, seed, fast: bool, monkeypatch):
    """Random updates on three buffers and two copiers; returns what every call answered,
    the device after each step and the final counters."""
    from cucopy.buffer import DeviceCopyBuffer

    if not fast:  # the route is never learnt: every update takes the general path
        monkeypatch.setattr(DeviceCopyBuffer, "_learn_route", lambda self, *a: None)
    rng = np.random.default_rng(seed)
    copiers = [env.copier(PLAN, slots=2, capacity=8192), env.copier(PLAN)]
    ts = [env.empty((8,)), env.empty((8,)), env.empty((8,))]
    bufs = [
        cc.DeviceCopyBuffer(ts[0], site=Site.LENS),
        cc.DeviceCopyBuffer(ts[1], site=Site.TABLE),
        cc.DeviceCopyBuffer(ts[2], site=Site.LENS, snapshot=False),
    ]
    palette = [np.arange(8, dtype=np.int32) % k for k in (2, 3)] + [np.ones(8, np.int32)]
    scratch = np.zeros(8, np.int32)  # refilled in place by the caller
    try:
        import torch

        tscratch = torch.from_numpy(scratch)  # the same bytes, as a torch CPU tensor
    except ImportError:
        tscratch = None
    trace = []
    spy = _CopySpy(monkeypatch)

    def call(fn, *a, **kw):
        try:
            trace.append(fn(*a, **kw))
        except Exception as e:  # noqa: BLE001 - the error's type is part of the trace
            trace.append(type(e).__name__)

    for _ in range(120):
        c = copiers[int(rng.random() < 0.2)]
        mode = rng.random()
        fail = rng.random() < 0.08
        with c.activate():
            try:
                if mode < 0.9:
                    c.begin()
                for _ in range(int(rng.integers(1, 7))):
                    i = int(rng.integers(0, 3))
                    buf, t = bufs[i], ts[i]
                    k = int(rng.choice([2, 5, 8, 8, 8]))
                    vals = palette[int(rng.integers(0, 3))][:k]
                    op = rng.random()
                    if i == 2:  # snapshot=False: a fresh array every time
                        vals = vals.copy()
                    elif op < 0.3:
                        scratch[:k] = vals
                        vals = scratch[:k]
                    if op < 0.1 and i != 2 and tscratch is not None:
                        scratch[:] = palette[int(rng.integers(0, 3))]
                        call(buf.update, tscratch if k == 8 else tscratch[:k])
                    elif op < 0.6:
                        call(buf.update, vals)
                    elif op < 0.68:
                        call(buf.update, vals, exact=True)
                    elif op < 0.72:
                        call(buf.update, vals, force=True)
                    elif op < 0.75:
                        call(buf.update, vals.astype(np.int64))
                    elif op < 0.78:
                        call(buf.update, np.repeat(vals, 2)[::2])
                    elif op < 0.81:
                        call(buf.update, vals.tolist())
                    elif op < 0.85:
                        call(buf.fill_tail, int(rng.integers(0, 9)), 0, site=Site.PAD)
                    elif op < 0.89:
                        call(buf.update, vals[:2], view=t[3:5])
                    elif op < 0.92:
                        call(buf.invalidate)
                    elif op < 0.95:
                        call(buf.update, np.zeros(9, np.int32))
                    else:
                        call(buf.update, vals.reshape(1, -1))
                if fail:
                    raise _StepFailed()
                if c.in_step:
                    c.flush()
            except _StepFailed:
                c.discard()
        trace.append([env.to_host(x).tolist() for x in ts])
    stats = [
        {s.label: v.as_dict() for s, v in sorted(c.stats.sites.items(), key=lambda kv: kv[0].label)}
        for c in copiers
    ]
    for c in copiers:
        c.close()
    return trace, stats, spy.calls


def test_random_programs_answer_as_the_general_path(monkeypatch):
    from conftest import SimEnv

    for seed in range(6):
        with monkeypatch.context() as m:
            fast = _random_program(SimEnv("random", seed), seed, True, m)
        with monkeypatch.context() as m:
            slow = _random_program(SimEnv("random", seed), seed, False, m)
        assert fast[0] == slow[0], seed
        assert fast[1] == slow[1], seed
        assert fast[2] < slow[2] * 0.85, (seed, fast[2], slow[2])  # the fast path ran
        answers = [x for x in fast[0] if not isinstance(x, list)]
        assert {True, False, "TypeError", "ValueError"} <= set(answers)


@pytest.mark.parametrize("kind", ["array.array", "memoryview", "bytearray view"])
def test_host_values_numpy_reads_in_place_are_snapshotted_too(env, kind):
    # np.asarray shares the memory of buffer-protocol objects: the record must still
    # hold its own copy (snapshot=True), or refilling the caller's object in place
    # would make the record agree with values the device never received
    import array

    c = env.copier(PLAN)
    t = env.empty((4,))
    buf = cc.DeviceCopyBuffer(t, site=Site.LENS)
    a = array.array("i", [1, 2, 3, 4])
    host = {
        "array.array": a,
        "memoryview": memoryview(a),
        "bytearray view": memoryview(bytearray(np.array([1, 2, 3, 4], np.int32).tobytes())).cast(
            "i"
        ),
    }[kind]
    with c.activate():
        with c.step():
            assert buf.update(host) is True
        host[0] = 9  # refilled in place
        with c.step():
            assert buf.update(host) is True  # changed: uploaded, not skipped
        with c.step():
            assert buf.update(host) is False
    assert env.to_host(t).tolist() == [9, 2, 3, 4]
