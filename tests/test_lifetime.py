"""Nothing staged is lost without a word: a copier collected or closed with staged copies."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import cucopy as cc
from cucopy.backends.sim import SimDevice


class Site(cc.CopySite):
    A = cc.H2D
    B = cc.H2D


PLAN = cc.CopyPlan(merge={Site.A, Site.B})


def test_a_collected_copier_warns_and_drops_its_staged_copies():
    dev = SimDevice()
    a, b = dev.zeros((4,), np.int64), dev.zeros((4,), np.int64)
    dropped = []
    c = cc.DeviceCopier(PLAN, device=dev)
    c.begin()
    c.copy(Site.A, a, np.arange(4), on_drop=lambda: dropped.append("a"))
    c.copy(Site.B, b, np.arange(4), on_drop=lambda: dropped.append("b"))
    assert c.staged == 2
    ref = weakref.ref(c)
    with pytest.warns(
        ResourceWarning,
        match=r"collected without close\(\) with 2 staged copies "
        r"\(Site\.A x1, Site\.B x1\).*on_drop",
    ):
        del c
        gc.collect()
    assert ref() is None
    assert sorted(dropped) == ["a", "b"]
    assert dev.to_host(a).tolist() == [0] * 4  # dropped, not half-landed
    cc.DeviceCopier(PLAN, device=dev).close()  # the set-aside ring is freed


def test_a_collected_buffer_record_is_invalidated():
    """A DeviceCopyBuffer's record never claims bytes that never landed."""
    dev = SimDevice()
    a = dev.zeros((4,), np.int64)
    buf = cc.DeviceCopyBuffer(a, site=Site.A)
    c = cc.DeviceCopier(PLAN, device=dev)
    c.begin()
    with c.activate():
        assert buf.update(np.arange(4)) is True
    with pytest.warns(ResourceWarning, match="1 staged copies"):
        del c
        gc.collect()
    c2 = cc.DeviceCopier(PLAN, device=dev)
    with c2.step():
        assert buf.update(np.arange(4)) is True  # not skipped: the record was dropped
    assert dev.to_host(a).tolist() == [0, 1, 2, 3]
    c2.close()


def test_a_collected_copier_with_nothing_staged_says_nothing(recwarn):
    dev = SimDevice()
    a = dev.zeros((4,), np.int64)
    c = cc.DeviceCopier(PLAN, device=dev)
    with c.step():
        c.copy(Site.A, a, np.arange(4))
    del c
    gc.collect()
    assert not [w for w in recwarn if issubclass(w.category, ResourceWarning)]
    assert dev.to_host(a).tolist() == [0, 1, 2, 3]


def test_close_with_staged_copies_lands_them(recwarn):
    dev = SimDevice()
    a = dev.zeros((4,), np.int64)
    c = cc.DeviceCopier(PLAN, device=dev)
    c.begin()
    c.copy(Site.A, a, np.arange(4) + 1)
    c.close()
    assert dev.to_host(a).tolist() == [1, 2, 3, 4]
    assert not [w for w in recwarn if issubclass(w.category, ResourceWarning)]
