"""Module-level routing: a step activates its copier; unrouted copies are counted,
shown and, in check mode, refusable (issue 30: no silent bypass)."""

from __future__ import annotations

import io
import threading
import weakref

import numpy as np
import pytest

import cucopy as cc
from cucopy import check
from cucopy import copier as copier_mod
from cucopy.backends.sim import SimDevice


class Site(cc.CopySite):
    A = cc.H2D
    B = cc.H2D
    PAD = cc.FILL


PLAN = cc.CopyPlan(merge={Site.A, Site.B, Site.PAD})


@pytest.fixture
def dev():
    return SimDevice()


def test_cc_copy_inside_a_step_without_activate_merges(dev):
    """The README's recipe names cc.copy: inside copier.step() it goes through the copier."""
    c = cc.DeviceCopier(PLAN, device=dev)
    a = dev.zeros((4,), np.int64)
    b = dev.zeros((8,), np.int32)
    before = sum(copier_mod.unrouted.values())
    with c.step():
        assert cc.active_copier() is c
        assert cc.copy(Site.A, a, np.arange(4)) is True
        assert cc.fill_tail(Site.PAD, b, 4, -1) is True
        assert c.staged == 2  # staged, not issued
        cc.flush()  # the module-level barrier reaches the step's copier too
        assert c.staged == 0
        assert cc.copy(Site.B, b[:4], np.arange(4, dtype=np.int32)) is True
    assert cc.active_copier() is None
    assert c.stats.sites[Site.A].merged == 1
    assert c.stats.sites[Site.PAD].merged == 1
    assert c.stats.sites[Site.B].merged == 1
    assert sum(copier_mod.unrouted.values()) == before
    assert dev.to_host(a).tolist() == [0, 1, 2, 3]
    assert dev.to_host(b).tolist() == [0, 1, 2, 3, -1, -1, -1, -1]
    c.close()


def test_a_device_copy_buffer_in_a_step_routes_to_its_copier(dev):
    c = cc.DeviceCopier(PLAN, device=dev)
    a = dev.zeros((4,), np.int64)
    buf = cc.DeviceCopyBuffer(a, site=Site.A)
    with c.step():
        assert buf.update(np.arange(4)) is True
        assert c.staged == 1
    with c.step():
        assert buf.update(np.arange(4)) is False  # skipped: the record is the copier's
    assert c.stats.sites[Site.A].merged == 1
    assert dev.to_host(a).tolist() == [0, 1, 2, 3]
    c.close()


def test_the_innermost_step_wins_and_the_outer_comes_back(dev):
    outer = cc.DeviceCopier(PLAN, device=dev)
    inner = cc.DeviceCopier(PLAN, device=dev)
    a, b, d = (dev.zeros((4,), np.int64) for _ in range(3))
    with outer.step():
        cc.copy(Site.A, a, np.arange(4))
        with inner.step():
            assert cc.active_copier() is inner
            cc.copy(Site.B, b, np.arange(4) + 1)
            assert inner.staged == 1
        assert cc.active_copier() is outer
        cc.copy(Site.B, d, np.arange(4) + 2)
        assert outer.staged == 2
    assert outer.stats.sites[Site.B].merged == 1 and inner.stats.sites[Site.B].merged == 1
    outer.close()
    inner.close()


def test_an_activated_copier_stays_active_through_its_steps(dev):
    c = cc.DeviceCopier(PLAN, device=dev)
    with c.activate():
        with c.step():
            assert cc.active_copier() is c
        assert cc.active_copier() is c
    assert cc.active_copier() is None
    c.close()


def test_a_step_routes_nothing_of_another_thread(dev):
    c = cc.DeviceCopier(PLAN, device=dev)
    a = dev.zeros((4,), np.int64)
    seen = []
    with c.step():
        t = threading.Thread(
            target=lambda: seen.append((cc.active_copier(), cc.copy(Site.A, a, np.arange(4))))
        )
        t.start()
        t.join()
        assert c.staged == 0
    assert seen == [(None, True)]  # a plain copy, counted as unrouted
    assert dev.to_host(a).tolist() == [0, 1, 2, 3]
    c.close()


def test_a_step_that_raised_deactivates(dev):
    c = cc.DeviceCopier(PLAN, device=dev)
    with pytest.raises(KeyError):
        with c.step():
            raise KeyError("x")
    assert cc.active_copier() is None
    with pytest.raises(cc.CopyError, match="nested"):
        with c.step():
            with c.step():
                pass
    assert cc.active_copier() is None
    c.close()


def test_unrouted_copies_are_counted_and_shown(dev):
    a = dev.zeros((4,), np.int64)
    before = copier_mod.unrouted[Site.A]
    assert cc.copy(Site.A, a, np.arange(4)) is True  # no copier: a plain copy, as before
    cc.fill_tail(Site.PAD, a.view(np.int64), 2, 0)
    assert copier_mod.unrouted[Site.A] == before + 1
    assert copier_mod.unrouted[Site.PAD] >= 1
    out = io.StringIO()
    cc.show_config(out)
    line = [ln for ln in out.getvalue().splitlines() if ln.startswith("unrouted")]
    assert line and "Site.A: " in line[0], out.getvalue()
    assert dev.to_host(a).tolist() == [0, 1, 0, 0]


def test_check_mode_can_refuse_unrouted_copies(dev, monkeypatch):
    monkeypatch.setattr(check, "CHECK_MODE", True)
    monkeypatch.setattr(check, "REFUSE_UNROUTED", True)
    c = cc.DeviceCopier(PLAN, device=dev)
    a = dev.zeros((4,), np.int64)
    with pytest.raises(
        cc.CopyError,
        match=r"Site\.A: cucopy\.copy\(\) into dst=SimArray\(sim:\d+, int64, shape=\(4,\)\) has "
        r"no copier to route to \(\d+ copier\(s\) exist but none is active here.*"
        r"CUCOPY_CHECK_UNROUTED=1",
    ):
        cc.copy(Site.A, a, np.arange(4))
    with pytest.raises(cc.CopyError, match=r"Site\.PAD: cucopy\.fill_tail\(\) into"):
        cc.fill_tail(Site.PAD, a, 0, 0)
    with c.step():  # routed: fine
        cc.copy(Site.A, a, np.arange(4))
    monkeypatch.setattr(check, "CHECK_MODE", False)
    cc.copy(Site.A, a, np.arange(4))  # the refusal is a check-mode one
    c.close()


def test_the_refusal_says_when_no_copier_exists(dev, monkeypatch):
    monkeypatch.setattr(check, "CHECK_MODE", True)
    monkeypatch.setattr(check, "REFUSE_UNROUTED", True)
    monkeypatch.setattr(check, "_live", weakref.WeakSet())
    a = dev.zeros((4,), np.int64)
    with pytest.raises(
        cc.CopyError, match=r"Site\.A: cucopy\.copy\(\) into dst=.* \(no copier exists: "
    ):
        cc.copy(Site.A, a, np.arange(4))


def test_the_refusal_switch_is_read_from_the_environment():
    import subprocess
    import sys

    code = "import cucopy.check as k; print(k.REFUSE_UNROUTED)"
    for raw, want in (("1", "True"), ("0", "False"), ("", "False")):
        env = {"CUCOPY_CHECK_UNROUTED": raw, "PATH": ""}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.stdout.strip() == want, out.stderr
