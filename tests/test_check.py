"""Check mode: each promise of a plan, broken on purpose, is caught and named."""

import numpy as np
import pytest

import cucopy as cc
from cucopy import check


class Site(cc.CopySite):
    POS = cc.H2D
    TABLE = cc.H2D
    GATHER = cc.D2D
    TAIL = cc.FILL
    PLAIN = cc.H2D


PLAN = cc.CopyPlan(merge={Site.POS, Site.TABLE, Site.GATHER, Site.TAIL})


def test_check_mode_reads_the_module_switch(monkeypatch):
    monkeypatch.setattr(check, "CHECK_MODE", True)
    assert cc.CHECK_MODE is True
    monkeypatch.setattr(check, "CHECK_MODE", False)
    assert cc.CHECK_MODE is False


def test_env_switch_is_read_at_import(monkeypatch):
    import subprocess
    import sys

    code = "import cucopy; print(cucopy.CHECK_MODE)"
    env = {"CUCOPY_CHECK": "1", "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "True", out.stderr
    env["CUCOPY_CHECK"] = "0"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def test_false_unchanged_claim_is_caught(env, check_mode):
    c = env.copier(PLAN)
    a = env.asarray(np.arange(8, dtype=np.int32))
    with c.step():
        assert c.copy(Site.POS, a, np.arange(8, dtype=np.int32), unchanged=True) is False
    with pytest.raises(cc.CopyError, match=r"Site.POS: unchanged copy into .*elements 3\.\.3"):
        with c.step():
            wrong = np.arange(8, dtype=np.int32)
            wrong[3] = 99
            c.copy(Site.POS, a, wrong, unchanged=True)
    assert c.stats.sites[Site.POS].checked == 2
    with c.step():  # still usable
        c.copy(Site.POS, a, np.zeros(8, np.int32))
    assert env.to_host(a).tolist() == [0] * 8


def test_unchanged_sees_staged_copies_in_program_order(env, check_mode):
    c = env.copier(PLAN)
    a = env.empty((8,))
    with c.step():
        c.copy(Site.POS, a[:4], np.full(4, 5, np.int32))  # staged, not landed yet
        # true in program order although the device still holds zeros
        c.copy(Site.TABLE, a[:4], np.full(4, 5, np.int32), unchanged=True)
        c.fill_tail(Site.TAIL, a, 4, 0, unchanged=True)
    with pytest.raises(cc.CopyError, match="Site.TAIL: unchanged fill_tail"):
        with c.step():
            c.fill_tail(Site.TAIL, a, 2, 0, unchanged=True)  # elements 2, 3 hold 5


def test_unchanged_d2d_and_outside_a_step(env, check_mode):
    c = env.copier(PLAN)
    src = env.asarray(np.arange(4, dtype=np.int32))
    dst = env.asarray(np.arange(4, dtype=np.int32))
    assert c.copy(Site.GATHER, dst, src, unchanged=True) is False  # verified at once
    with pytest.raises(cc.CopyError, match="Site.GATHER: unchanged copy"):
        c.copy(Site.GATHER, dst, env.asarray(np.zeros(4, np.int32)), unchanged=True)


def test_merged_destination_written_before_its_barrier(env, check_mode):
    c = env.copier(PLAN)
    a = env.empty((8,))
    with pytest.raises(
        cc.CopyError, match="Site.TABLE: merged destination bytes .* written by other work"
    ):
        with c.step():
            c.copy(Site.TABLE, a, np.ones(8, np.int32))
            env.write(env.default_stream, a[2:3], 7)  # a model kernel, before the barrier
    assert c.staged == 0


def test_merged_d2d_source_changed_before_its_barrier(env, check_mode):
    c = env.copier(PLAN)
    src = env.asarray(np.arange(8, dtype=np.int32))
    dst = env.empty((8,))
    with pytest.raises(cc.CopyError, match="Site.GATHER: merged D2D source bytes"):
        with c.step():
            c.copy(Site.GATHER, dst, src)
            env.write(env.default_stream, src[5:], 0)


def test_missing_barrier_found_by_expect_landed(env, check_mode):
    c = env.copier(PLAN)
    table = env.empty((4, 4))
    with c.step():
        c.copy(Site.TABLE, table, np.ones((4, 4), np.int32))
        with pytest.raises(
            cc.CopyError,
            match=r"Site.TABLE: bytes merged into .* still staged.*"
            r"make Site.TABLE a flush_after barrier",
        ):
            cc.expect_landed(Site.TABLE, table[1])
        c.flush()
        cc.expect_landed(Site.TABLE, table)  # landed: no error


def test_expect_landed_is_a_no_op_without_check_mode(env, monkeypatch):
    """It stays in engine code: with check mode off it checks nothing, even staged bytes."""
    monkeypatch.setattr(check, "CHECK_MODE", False)
    c = env.copier(PLAN)
    table = env.empty((4, 4))
    with c.step():
        c.copy(Site.TABLE, table, np.ones((4, 4), np.int32))
        assert cc.expect_landed(Site.TABLE, table) is None
        assert cc.expect_landed(Site.POS, "not even an array") is None


def test_clean_run_passes_and_lands(env, check_mode):
    c = env.copier(cc.CopyPlan(merge={Site.POS, Site.GATHER, Site.TAIL}, flush_after={Site.POS}))
    a, b = env.empty((8,)), env.empty((8,))
    for step in range(3):
        with c.step():
            c.copy(Site.POS, a, np.full(8, step, np.int32))
            c.copy(Site.GATHER, b, a)
            c.fill_tail(Site.TAIL, b, 6, -1)
            env.write(env.default_stream, env.empty((2,)), 1)  # unrelated foreign work
    assert env.to_host(b).tolist() == [2] * 6 + [-1] * 2


def test_check_mode_off_costs_no_device_reads(monkeypatch):
    from conftest import SimEnv

    monkeypatch.setattr(check, "CHECK_MODE", False)
    env = SimEnv()
    c = env.copier(PLAN)
    a = env.empty((8,))
    for _ in range(20):
        with c.step():
            c.copy(Site.POS, a, np.ones(8, np.int32))
            c.copy(Site.TABLE, a, np.ones(8, np.int32), unchanged=True)
    env.synchronize()
    assert env.dev.device_reads == 0
    assert c.stats.sites[Site.POS].checked == 0
    monkeypatch.setattr(check, "CHECK_MODE", True)
    with c.step():
        c.copy(Site.POS, a, np.ones(8, np.int32))
    assert env.dev.device_reads > 0


def test_a_false_claim_is_not_forgotten_by_the_next_begin(env, check_mode):
    """begin() with nothing staged used to replace the checker without running the
    claims it deferred to the flush."""
    c = env.copier(PLAN)
    a = env.empty((4,))
    c.begin()
    assert c.copy(Site.POS, a, np.ones(4, np.int32), unchanged=True) is False  # false
    with pytest.raises(cc.CopyError, match=r"Site\.POS: unchanged copy into .*elements 0\.\.3"):
        c.begin()
    c.begin()  # the claim was reported once; the copier goes on
    c.copy(Site.POS, a, np.full(4, 2, np.int32))
    c.flush()
    assert env.to_host(a).tolist() == [2] * 4
    c.begin()
    c.fill_tail(Site.TAIL, a, 0, 3, unchanged=True)  # false again
    with pytest.raises(cc.CopyError, match=r"Site\.TAIL: unchanged fill_tail of"):
        c.close()
    assert c.closed


def test_record_only_skip_sees_the_owners_staged_copy(env, check_mode):
    """A record-only buffer whose owner copies through a merged site: repeating the same
    update in the step is a true skip, although the copy has not landed yet (it used to
    raise "skipped upload ... differ", reading the device without the staged copy)."""
    c = env.copier(PLAN)
    a = env.empty((4,))
    buf = cc.DeviceCopyBuffer(a, site=None)
    v = np.arange(1, 5, dtype=np.int32)
    with c.activate():
        with c.step():
            assert buf.update(v) is True
            cc.copy(Site.POS, a, v)  # the owner's copy, staged
            assert buf.update(v) is False
            assert buf.fill_tail(2, 7) is True
            cc.fill_tail(Site.TAIL, a, 2, 7)
            assert buf.fill_tail(2, 7) is False
            assert buf.fill_tail(3, 7) is False
        assert env.to_host(a).tolist() == [1, 2, 7, 7]
        with c.step():
            env.write(env.default_stream, a, np.zeros(4, np.int32))  # behind the record
            assert buf.update(v[:2]) is False
            with pytest.raises(cc.CopyError, match=r"record-only\): skipped upload into"):
                c.flush()


# -- a reader before its barrier (issue 30) --------------------------------------------------


def _staged(policy="lazy"):
    from cucopy.backends.sim import SimDevice

    dev = SimDevice(policy=policy)
    c = cc.DeviceCopier(PLAN, device=dev, stream=dev.default_stream)
    a = dev.asarray(np.arange(4, dtype=np.int32))
    return dev, c, a


@pytest.mark.parametrize("policy", ["lazy", "eager", "random"])
def test_a_reader_before_its_barrier_is_caught(check_mode, policy):
    """A missing flush_after: a launched reader sees the destination before the merged
    copy lands. Check mode names the site, the destination and the operation."""
    dev, c, a = _staged(policy)
    seen = []
    with pytest.raises(
        cc.CopyError,
        match=r"Site\.POS: merged destination bytes of SimArray\(sim:\d+, int32, shape=\(4,\)\) "
        r"\[0x[0-9a-f]+, 0x[0-9a-f]+\) were read or written by other work before its barrier: "
        r"dev\.raw\(SimArray.*\) in work launched on stream default",
    ):
        with c.step():
            c.copy(Site.POS, a, np.full(4, 7, np.int32))
            dev.default_stream.launch(lambda: seen.append(dev.raw(a).copy()))
    assert seen == []  # the reader never ran past the check
    with c.step():  # usable, and the next reader after the barrier is fine
        c.copy(Site.POS, a, np.full(4, 8, np.int32))
        c.flush()
        dev.default_stream.launch(lambda: seen.append(dev.raw(a).copy()))
    dev.synchronize()
    assert [x.tolist() for x in seen] == [[8] * 4]
    c.close()


def test_a_foreign_write_on_another_stream_is_caught(check_mode):
    dev, c, a = _staged()
    other = dev.stream()
    with pytest.raises(cc.CopyError, match=r"Site\.POS: merged destination bytes .* other work"):
        with c.step():
            c.copy(Site.POS, a, np.full(4, 7, np.int32))
            other.launch(lambda: dev.raw(a).__setitem__(0, 5))
            other.synchronize()  # it runs before the barrier
    c.close()


def test_a_foreign_write_of_the_bytes_already_there_is_caught(check_mode):
    """The snapshot comparison cannot see it (nothing changed); the watch does."""
    dev, c, a = _staged()
    with pytest.raises(cc.CopyError, match=r"Site\.POS: merged destination bytes .* other work"):
        with c.step():
            c.copy(Site.POS, a, np.full(4, 7, np.int32))
            dev.default_stream.launch(lambda: dev.raw(a).__setitem__(Ellipsis, dev.raw(a).copy()))
    c.close()


def test_another_copiers_copy_into_a_staged_destination_is_caught(check_mode):
    dev, c, a = _staged()
    c2 = cc.DeviceCopier(device=dev, stream=dev.stream())
    with pytest.raises(cc.CopyError, match=r"Site\.POS: .* other work .*: a H2D copy into"):
        with c.step():
            c.copy(Site.POS, a, np.full(4, 7, np.int32))
            c2.copy(Site.PLAIN, a, np.full(4, 1, np.int32))  # its own stream, eager
            c2.stream.synchronize()
    with pytest.raises(cc.CopyError, match=r"Site\.POS: .* host write into"):
        with c.step():
            c.copy(Site.POS, a, np.full(4, 7, np.int32))
            a[1] = 3  # a blocking host write before the barrier
    c.close()
    c2.close()


def test_a_merged_destination_holds_the_sentinel_until_its_copy_lands(check_mode):
    """Readers check mode cannot watch (CuPy, JAX, raw kernels on a GPU) see garbage."""
    dev, c, a = _staged()
    f = dev.asarray(np.zeros(4, np.float32))
    with c.step():
        c.copy(Site.POS, a[1:3], np.array([7, 8], np.int32))
        c.copy(Site.TABLE, f, np.ones(4, np.float32))
        dev.default_stream.synchronize()  # the sentinel fills have run, the copies not
        assert a._view.view(np.uint8)[4:12].tolist() == [check.SENTINEL_INT] * 8
        assert a._view.tolist()[0] == 0 and a._view.tolist()[3] == 3  # only the copy's bytes
        assert np.isnan(f._view).all()
    assert dev.to_host(a).tolist() == [0, 7, 8, 3]
    assert dev.to_host(f).tolist() == [1.0] * 4


def test_a_discarded_copy_leaves_the_old_bytes_not_the_sentinel(check_mode):
    dev, c, a = _staged()
    dropped = []
    with pytest.raises(KeyError):
        with c.step():
            c.copy(Site.POS, a, np.full(4, 7, np.int32), on_drop=lambda: dropped.append(1))
            dev.default_stream.synchronize()
            assert a._view.tolist() != [0, 1, 2, 3]  # the sentinel
            raise KeyError("x")
    assert dropped == [1]
    assert dev.to_host(a).tolist() == [0, 1, 2, 3]
    c.close()


def test_the_sentinel_and_the_watches_cost_nothing_without_check_mode(monkeypatch):
    monkeypatch.setattr(check, "CHECK_MODE", False)
    dev, c, a = _staged()
    with c.step():
        c.copy(Site.POS, a, np.full(4, 7, np.int32))
        dev.default_stream.launch(lambda: dev.raw(a).copy())  # unchecked: the plan's risk
        dev.default_stream.synchronize()
        assert a._view.tolist() == [0, 1, 2, 3]
        assert dev._watches == {}
    c.close()


@pytest.mark.parametrize("site", [Site.POS, None])
@pytest.mark.parametrize("view_dtype", [np.int64, np.int16, np.uint8])
def test_a_wrong_buffer_skip_through_a_view_of_another_item_size_is_caught(
    check_mode, site, view_dtype
):
    """Two owners of one storage, one through a view of another item size: the first
    one's record cannot know the second one's write, and check mode says so."""
    dev, c, a = _staged()
    a8 = dev.asarray(np.arange(8, dtype=np.int32))
    other = a8.view(view_dtype)
    first = cc.DeviceCopyBuffer(a8, site=site)
    second = cc.DeviceCopyBuffer(other, site=site)
    with c.activate(), c.step():
        assert first.update(np.arange(8, dtype=np.int32)) is True
    with pytest.raises(cc.CopyError, match=r"(unchanged copy|skipped upload) into .*differ"):
        with c.activate(), c.step():
            if second.update(np.full(other.size, 9, view_dtype)) and site is None:
                dev.default_stream.synchronize()
                dev.raw(other)[...] = 9  # the record-only owner's own write
            first.update(np.arange(8, dtype=np.int32))  # a skip: its record is stale
    c.close()


@pytest.mark.gpu
def test_a_cuda_reader_before_its_barrier_sees_the_sentinel(check_mode):
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    a = cupy.arange(4, dtype=cupy.int32)
    f = cupy.zeros(4, dtype=cupy.float32)
    cupy.cuda.get_current_stream().synchronize()
    c = cc.DeviceCopier(PLAN, device=0, backend="cuda", stream=stream)
    with c.step():
        c.copy(Site.POS, a, np.full(4, 7, np.int32))
        c.copy(Site.TABLE, f, np.ones(4, np.float32))
        with stream:
            early_a, early_f = a.copy(), f.copy()  # a premature reader (no barrier)
    stream.synchronize()
    assert early_a.get().view(np.uint32).tolist() == [0xA5A5A5A5] * 4
    assert np.isnan(early_f.get()).all()
    assert a.get().tolist() == [7] * 4 and f.get().tolist() == [1.0] * 4
    c.close()


# -- torch operations on staged bytes --------------------------------------------------------


def test_torch_operations_on_staged_bytes_raise_naming_the_operation():
    """The dispatch mode check mode enters while a torch destination is staged, on CPU
    tensors (a staged range of its own making: a copier's destinations are CUDA)."""
    torch = pytest.importorskip("torch")
    from cucopy.adapters.torch import StagedWatch

    x = torch.zeros(8, dtype=torch.int32)
    y = torch.zeros(8, dtype=torch.int32)
    lo, hi = x.data_ptr(), x.data_ptr() + 32

    def find(device, a, b):
        if device == "cpu" and a < hi and lo < b:
            return f"Site.POS: merged destination bytes [{lo:#x}, {hi:#x})"
        return None

    w = StagedWatch(find)
    w.enter()
    try:
        y.add_(1)  # other bytes: fine
        x[:4].view(torch.int16)  # views touch no bytes
        with pytest.raises(
            cc.CopyError,
            match=r"Site\.POS: merged destination bytes \[0x[0-9a-f]+, 0x[0-9a-f]+\) was touched "
            r"by torch operation aten::add_\.Tensor \(on torch\.int32 tensor shape=\(8,\) on cpu",
        ):
            x.add_(1)
        with pytest.raises(cc.CopyError, match=r"aten::sum"):
            x[6:].sum()  # a read of part of it
        with pytest.raises(cc.CopyError, match=r"aten::copy_"):
            y.copy_(x)  # a read through the source
        with pytest.raises(cc.CopyError, match=r"shape=\(2,\)"):
            torch.add(y[:2], 1, out=x[3:5])  # a write through out=
    finally:
        assert w.exit() is True
    assert x.tolist() == [0] * 8  # nothing the refused operations would have done
    x.add_(1)  # not watched any more


def test_the_torch_watch_leaves_a_mode_pushed_above_it_alone():
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode

    from cucopy.adapters.torch import StagedWatch

    class Other(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    w = StagedWatch(lambda *a: None)
    w.enter()
    with Other():
        assert w.exit() is False  # not the top mode: still entered, nothing popped
        torch.ones(2).sum()
    assert w.exit() is True


@pytest.mark.gpu
def test_a_torch_reader_before_its_barrier_is_caught_on_the_gpu(check_mode):
    torch = pytest.importorskip("torch")
    t = torch.zeros(8, dtype=torch.int32, device="cuda")
    other = torch.zeros(8, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    c = cc.DeviceCopier(PLAN, backend="cuda", stream=stream)
    with torch.cuda.stream(stream):
        with pytest.raises(
            cc.CopyError, match=r"Site\.POS: merged destination bytes .* torch operation aten::sum"
        ):
            with c.step():
                c.copy(Site.POS, t[:4], np.arange(4, dtype=np.int32))
                other.add_(1)  # other bytes: fine
                t.sum()  # a reader before the barrier
        with c.step():
            c.copy(Site.POS, t[:4], np.arange(4, dtype=np.int32))
            c.flush()
            assert int(t.sum()) == 6  # after the barrier: fine
    c.close()
