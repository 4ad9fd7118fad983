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
