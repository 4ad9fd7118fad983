"""Uses of the public API as a user writes them, for the type checker (not collected by pytest).

``mypy`` (configured in pyproject.toml, run by ``.ci/run``) checks this file against the
annotations cucopy ships with ``py.typed``: a signature that stops accepting what the
README shows, or an attribute the type checker cannot see, fails CI.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from typing_extensions import assert_type

import cucopy as cc
from cucopy.backends.sim import SimArray, SimDevice, SimStream


class Site(cc.CopySite):
    POSITIONS = cc.H2D
    KV_LENS = cc.H2D
    GATHER_IDS = cc.D2D
    UNUSED_SLOT = cc.FILL


def program() -> None:
    assert_type(cc.__version__, str)
    assert_type(Site.POSITIONS.direction, cc.Direction)
    assert_type(Site.POSITIONS.label, str)

    plan = cc.CopyPlan(merge={Site.POSITIONS, Site.KV_LENS}, flush_after={Site.KV_LENS})
    assert_type(plan.merge, frozenset[cc.CopySite])
    assert_type(plan.flush_after, frozenset[cc.CopySite])

    dev = SimDevice(policy="random", seed=0)
    stream = dev.stream()
    assert_type(stream, SimStream)
    positions = dev.zeros((8,), np.int32)
    assert_type(positions, SimArray)

    with cc.DeviceCopier(plan=plan, stream=stream, device=dev, slots=2) as copier:
        assert_type(copier, cc.DeviceCopier)
        with copier.step():
            issued = copier.copy(Site.POSITIONS, positions, np.arange(8, dtype=np.int32))
            assert_type(issued, bool)
            assert_type(copier.fill_tail(Site.UNUSED_SLOT, positions, 6, -1), bool)
        with copier.activate():
            assert_type(cc.active_copier(), cc.DeviceCopier | None)
            assert_type(cc.copy(Site.POSITIONS, positions, np.ones(8, np.int32)), bool)
            assert_type(cc.fill_tail(Site.UNUSED_SLOT, positions, 4, 0), bool)
            cc.flush()
        mask = dev.pinned_empty((4, 8), np.int32)
        guard = cc.HostGuard(mask, label="mask")
        with copier.step():
            assert_type(copier.copy(Site.POSITIONS, positions, mask[0], guard=guard), bool)
            assert_type(cc.copy(Site.POSITIONS, positions, mask[1], guard=guard), bool)
        with guard.write() as g:
            assert_type(g, cc.HostGuard)
        guard.wait()
        assert_type(guard.in_flight, bool)
        assert_type(guard.label, str)
        guard.close()
        assert_type(guard.closed, bool)
        buf = cc.DeviceCopyBuffer(positions, site=Site.POSITIONS)
        assert_type(buf.update(np.zeros(8, np.int32)), bool)
        buf.invalidate()
        stats = copier.stats
        assert_type(stats, cc.CopyStats)
        assert_type(stats.sites[Site.POSITIONS], cc.SiteStats)
        assert_type(stats.segments, int)
        assert_type(stats.modes, dict[str, int])
        assert_type(copier.trim(), int)
    assert_type(dev.to_host(positions), np.ndarray)

    try:
        cc.expect_landed(Site.POSITIONS, positions)
    except cc.CopyError as e:
        assert_type(e.status, int | None)

    cc.show_config(file=io.StringIO())
    assert_type(cc._config.config_dict(), dict[str, Any])
