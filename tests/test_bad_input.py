"""A catalogue of bad input across the public API.

Each case runs inside a step that already staged a merged copy: the bad call
raises the documented error type with a message naming the site or argument,
stages nothing, loses nothing, and the staged copy still lands at the step's
flush.
"""

from __future__ import annotations

import enum

import numpy as np
import pytest

import cucopy as cc
from cucopy.backends.sim import SimArray, SimDevice


class Site(cc.CopySite):
    POS = cc.H2D
    TABLE = cc.H2D
    PLAIN = cc.H2D
    GATHER = cc.D2D
    TAIL = cc.FILL


class NotASite(enum.Enum):
    POS = 1


PLAN = cc.CopyPlan(merge={Site.POS, Site.TABLE, Site.GATHER, Site.TAIL}, flush_after={Site.TABLE})


class ReadOnlySim(SimArray):
    """A sim array that reports itself immutable (as a JAX array would)."""

    __slots__ = ()

    def __cucopy_array__(self):
        info = super().__cucopy_array__()
        info.readonly = True
        return info


class Ctx:
    """What a case may use: the copier mid-step, arrays, another device, a closed copier."""

    def __init__(self, env, monkeypatch):
        self.env = env
        self.dev = env.dev
        self.mp = monkeypatch
        self.c = env.copier(PLAN)
        self.a = self.dev.empty((8,), np.int32)  # device int32[8]
        self.b = self.dev.empty((8,), np.int32)
        self.h = np.arange(8, dtype=np.int32)  # host int32[8]
        self.other = SimDevice(policy=env.dev.policy)
        self.far = self.other.empty((8,), np.int32)
        self.closed = env.copier(PLAN)
        self.closed.close()
        self.s2 = self.dev.stream()
        self.cap = env.copier(PLAN, stream=self.s2)  # for capture cases
        self.pinned = self.dev.pinned_empty((8,), np.int32)

    def readonly(self):
        v = self.b
        return ReadOnlySim(v.device, v._view, v._alloc, v._base)

    def capture(self, fn):
        with self.dev.capture(self.s2):
            fn()


def case(id, fn, exc, match, xfail=None):
    marks = [pytest.mark.xfail(strict=True, reason=xfail)] if xfail else []
    return pytest.param(fn, exc, match, id=id, marks=marks)


def _site_with(direction):
    def make(k):
        class Bad(cc.CopySite):
            X = direction

    return make


CASES = [
    # -- CopyPlan ------------------------------------------------------------------------------
    case(
        "plan_flush_after_not_merged",
        lambda k: cc.CopyPlan(merge={Site.POS}, flush_after={Site.TABLE}),
        ValueError,
        r"flush_after must be a subset of merge; not merged: Site\.TABLE",
    ),
    case(
        "plan_merge_holds_a_string",
        lambda k: cc.CopyPlan(merge={"POS"}),
        TypeError,
        r"merge holds 'POS', which is not a CopySite",
    ),
    case(
        "plan_merge_holds_a_plain_enum",
        lambda k: cc.CopyPlan(merge={NotASite.POS}),
        TypeError,
        r"merge holds <NotASite\.POS: 1>",
    ),
    case(
        "plan_merge_is_a_single_site",
        lambda k: cc.CopyPlan(merge=Site.POS),
        TypeError,
        r"merge takes a set of sites, got the single site Site\.POS",
    ),
    case(
        "plan_flush_after_holds_an_int",
        lambda k: cc.CopyPlan(merge={Site.POS}, flush_after={3}),
        TypeError,
        r"flush_after holds 3",
    ),
    case(
        "plan_merge_is_none",
        lambda k: cc.CopyPlan(merge=None),
        TypeError,
        r"merge takes a set of CopySite members, got None",
    ),
    case(
        "plan_is_immutable",
        lambda k: setattr(cc.CopyPlan(), "merge", frozenset()),
        AttributeError,
        r"CopyPlan is immutable",
    ),
    # -- CopySite --------------------------------------------------------------------------------
    case(
        "site_declared_with_a_string",
        _site_with("h2d"),
        TypeError,
        r"Bad: a site is declared with a Direction .* got 'h2d'",
    ),
    case(
        "site_declared_with_an_int",
        _site_with(1),
        TypeError,
        r"Bad: a site is declared with a Direction .* got 1",
    ),
    # -- DeviceCopier construction -------------------------------------------------------------------
    case(
        "copier_plan_is_a_set",
        lambda k: k.env.copier({Site.POS}),
        TypeError,
        r"plan: expected a CopyPlan, got set",
    ),
    case(
        "copier_slots_zero",
        lambda k: k.env.copier(PLAN, slots=0),
        ValueError,
        r"slots: expected an int >= 1, got 0",
    ),
    case(
        "copier_slots_string",
        lambda k: k.env.copier(PLAN, slots="4"),
        ValueError,
        r"slots: expected an int >= 1, got '4'",
    ),
    case(
        "copier_capacity_too_small",
        lambda k: k.env.copier(PLAN, capacity=100),
        ValueError,
        r"capacity: expected an int >= 4096 bytes, got 100",
    ),
    case(
        "copier_capacity_float",
        lambda k: k.env.copier(PLAN, capacity=65536.0),
        ValueError,
        r"capacity: expected an int >= 4096 bytes, got 65536\.0",
    ),
    case(
        "copier_flush_mode_unknown",
        lambda k: k.env.copier(PLAN, flush_mode="fast"),
        ValueError,
        r"flush_mode: expected one of \('auto', 'dma', 'mapped', 'inline'\), got 'fast'",
    ),
    case(
        "copier_backend_unknown",
        lambda k: cc.DeviceCopier(PLAN, device=k.dev, backend="tpu"),
        ValueError,
        r"backend: expected 'cuda', 'sim' or None, got 'tpu'",
    ),
    case(
        "copier_sim_backend_with_an_ordinal",
        lambda k: cc.DeviceCopier(PLAN, device=0, backend="sim"),
        TypeError,
        r"device: the sim backend takes a SimDevice, got 0",
    ),
    case(
        "copier_stream_is_an_int",
        lambda k: k.env.copier(PLAN, stream=12345),
        TypeError,
        r"stream: the sim backend takes a SimStream, got int",
    ),
    case(
        "copier_stream_is_a_string",
        lambda k: k.env.copier(PLAN, stream="default"),
        TypeError,
        r"stream: the sim backend takes a SimStream, got str",
    ),
    case(
        "copier_stream_of_another_device",
        lambda k: k.env.copier(PLAN, stream=k.other.stream()),
        ValueError,
        r"stream: .* belongs to sim:\d+, not sim:\d+",
    ),
    # -- sites and directions -------------------------------------------------------------------------
    case(
        "copy_through_a_fill_site",
        lambda k: k.c.copy(Site.TAIL, k.a, k.h),
        ValueError,
        r"Site\.TAIL: copy\(\) does not take a FILL site",
    ),
    case(
        "fill_through_an_h2d_site",
        lambda k: k.c.fill_tail(Site.POS, k.a, 0, 1),
        ValueError,
        r"Site\.POS: fill_tail\(\) does not take a H2D site",
    ),
    case(
        "fill_through_a_d2d_site",
        lambda k: k.c.fill_tail(Site.GATHER, k.a, 0, 1),
        ValueError,
        r"Site\.GATHER: fill_tail\(\) does not take a D2D site",
    ),
    case(
        "site_is_a_plain_enum_member",
        lambda k: k.c.copy(NotASite.POS, k.a, k.h),
        TypeError,
        r"site: expected a CopySite member, got <NotASite\.POS: 1>",
    ),
    case(
        "site_is_a_string",
        lambda k: k.c.copy("POS", k.a, k.h),
        TypeError,
        r"site: expected a CopySite member, got 'POS'",
    ),
    case(
        "site_is_none_in_fill",
        lambda k: k.c.fill_tail(None, k.a, 0, 1),
        TypeError,
        r"site: expected a CopySite member, got None",
    ),
    case(
        "h2d_with_a_device_source",
        lambda k: k.c.copy(Site.POS, k.a, k.b),
        ValueError,
        r"Site\.POS: H2D site needs a host source, got device array SimArray",
    ),
    case(
        "d2d_with_a_host_source",
        lambda k: k.c.copy(Site.GATHER, k.a, k.h),
        ValueError,
        r"Site\.GATHER: D2D site needs a device source, got host array numpy",
    ),
    # -- destinations and sources ----------------------------------------------------------------------
    case(
        "host_destination",
        lambda k: k.c.copy(Site.POS, k.h.copy(), k.h),
        ValueError,
        r"Site\.POS: destination must be device memory, got host memory numpy",
    ),
    case(
        "host_destination_of_a_fill",
        lambda k: k.c.fill_tail(Site.TAIL, k.h.copy(), 0, 1),
        ValueError,
        r"Site\.TAIL: destination must be device memory",
    ),
    case(
        "dtype_mismatch",
        lambda k: k.c.copy(Site.POS, k.a, k.h.astype(np.int64)),
        TypeError,
        r"Site\.POS: dtype mismatch: dst SimArray\(sim:\d+, int32.*src numpy.*int64",
    ),
    case(
        "dtype_mismatch_d2d",
        lambda k: k.c.copy(Site.GATHER, k.a, k.b.view(np.float32)),
        TypeError,
        r"Site\.GATHER: dtype mismatch",
    ),
    case(
        "size_mismatch",
        lambda k: k.c.copy(Site.POS, k.a, k.h[:7]),
        ValueError,
        r"Site\.POS: size mismatch: dst has 8 elements .* src has 7",
    ),
    case(
        "size_mismatch_d2d",
        lambda k: k.c.copy(Site.GATHER, k.a[:4], k.b[:5]),
        ValueError,
        r"Site\.GATHER: size mismatch: dst has 4 elements",
    ),
    case(
        "foreign_device_destination",
        lambda k: k.c.copy(Site.POS, k.far, k.h),
        ValueError,
        r"Site\.POS: destination SimArray\(sim:\d+.* is not on this copier's device sim:\d+",
    ),
    case(
        "foreign_device_d2d_source",
        lambda k: k.c.copy(Site.GATHER, k.a, k.far),
        ValueError,
        r"Site\.GATHER: source SimArray\(sim:\d+.* is not on this copier's device",
    ),
    case(
        "foreign_device_fill",
        lambda k: k.c.fill_tail(Site.TAIL, k.far, 0, 1),
        ValueError,
        r"Site\.TAIL: destination .* is not on this copier's device",
    ),
    case(
        "readonly_destination",
        lambda k: k.c.copy(Site.POS, k.readonly(), k.h),
        TypeError,
        r"Site\.POS: SimArray\(.*\) is read-only: pass a writable array",
    ),
    case(
        "unknown_destination_type",
        lambda k: k.c.copy(Site.POS, [0] * 8, k.h),
        TypeError,
        r"Site\.POS: .*expected an array.*got builtins\.list",
    ),
    case(
        "unknown_source_type",
        lambda k: k.c.copy(Site.POS, k.a, {"x": 1}),
        TypeError,
        r"Site\.POS: .*expected an array.*got builtins\.dict",
    ),
    case(
        "object_dtype_source",
        lambda k: k.c.copy(Site.POS, k.a, np.array([object()] * 8)),
        TypeError,
        r"Site\.POS: .*holds Python objects",
    ),
    # -- fill_tail arguments ------------------------------------------------------------------------------
    case(
        "fill_negative_start",
        lambda k: k.c.fill_tail(Site.TAIL, k.a, -1, 0),
        ValueError,
        r"Site\.TAIL: start must be an int >= 0, got -1",
    ),
    case(
        "fill_float_start",
        lambda k: k.c.fill_tail(Site.TAIL, k.a, 1.5, 0),
        ValueError,
        r"Site\.TAIL: start must be an int >= 0, got 1\.5",
    ),
    case(
        "fill_bool_start",
        lambda k: k.c.fill_tail(Site.TAIL, k.a, True, 0),
        ValueError,
        r"Site\.TAIL: start must be an int >= 0, got True",
    ),
    case(
        "fill_value_overflows_int8",
        lambda k: k.c.fill_tail(Site.TAIL, k.a.view(np.int8), 0, 300),
        ValueError,
        r"Site\.TAIL: fill value 300 does not fit dtype int8",
    ),
    case(
        "fill_value_negative_into_uint",
        lambda k: k.c.fill_tail(Site.TAIL, k.a.view(np.uint32), 0, -1),
        ValueError,
        r"Site\.TAIL: fill value -1 does not fit dtype uint32",
    ),
    case(
        "fill_value_fraction_into_int",
        lambda k: k.c.fill_tail(Site.TAIL, k.a, 0, 0.5),
        ValueError,
        r"Site\.TAIL: fill value 0\.5 does not fit dtype int32",
    ),
    case(
        "fill_value_inexact_float32",
        lambda k: k.c.fill_tail(Site.TAIL, k.a.view(np.float32), 0, 0.1),
        ValueError,
        r"Site\.TAIL: fill value 0\.1 does not fit dtype float32",
    ),
    case(
        "fill_value_overflows_float32",
        lambda k: k.c.fill_tail(Site.TAIL, k.a.view(np.float32), 0, 1e40),
        ValueError,
        r"Site\.TAIL: fill value 1e\+40 does not fit dtype float32",
    ),
    case(
        "fill_value_not_a_scalar",
        lambda k: k.c.fill_tail(Site.TAIL, k.a, 0, [1, 2]),
        ValueError,
        r"Site\.TAIL: fill value \[1, 2\] does not fit dtype int32",
    ),
    case(
        "fill_value_a_string",
        lambda k: k.c.fill_tail(Site.TAIL, k.a, 0, "x"),
        ValueError,
        r"Site\.TAIL: fill value 'x' does not fit dtype int32",
    ),
    case(
        "fill_value_a_numeric_string",
        lambda k: k.c.fill_tail(Site.TAIL, k.a, 0, "7"),
        ValueError,
        r"Site\.TAIL: fill value '7' does not fit dtype int32 \(not a number\)",
    ),
    case(
        "fill_value_a_float_string",
        lambda k: k.c.fill_tail(Site.TAIL, k.a.view(np.float32), 0, "1e3"),
        ValueError,
        r"Site\.TAIL: fill value '1e3' does not fit dtype float32 \(not a number\)",
    ),
    case(
        "fill_value_bytes",
        lambda k: k.c.fill_tail(Site.TAIL, k.a, 0, b"7"),
        ValueError,
        r"Site\.TAIL: fill value b'7' does not fit dtype int32 \(not a number\)",
    ),
    case(
        "fill_value_complex_into_float",
        lambda k: k.c.fill_tail(Site.TAIL, k.a.view(np.float32), 0, 1 + 2j),
        ValueError,
        r"Site\.TAIL: fill value \(1\+2j\) does not fit dtype float32 \(a complex value",
    ),
    case(
        "fill_value_complex_with_no_imaginary_part_into_float",
        lambda k: k.c.fill_tail(Site.TAIL, k.a.view(np.float32), 0, 1 + 0j),
        ValueError,
        r"Site\.TAIL: fill value \(1\+0j\) does not fit dtype float32 \(a complex value",
    ),
    case(
        "fill_value_int_inexact_in_float64",
        lambda k: k.c.fill_tail(Site.TAIL, k.b.view(np.float64), 0, 2**53 + 1),
        ValueError,
        r"Site\.TAIL: fill value 9007199254740993 does not fit dtype float64",
    ),
    # -- state: closed, capture, check mode --------------------------------------------------------------
    case(
        "closed_copier_copy",
        lambda k: k.closed.copy(Site.POS, k.a, k.h),
        cc.CopyError,
        r"Site\.POS: the copier is closed",
    ),
    case(
        "closed_copier_fill",
        lambda k: k.closed.fill_tail(Site.TAIL, k.a, 0, 1),
        cc.CopyError,
        r"Site\.TAIL: the copier is closed",
    ),
    case("closed_copier_step", lambda k: k.closed.begin(), cc.CopyError, r"the copier is closed"),
    case(
        "unchanged_during_capture",
        lambda k: k.capture(lambda: k.cap.copy(Site.POS, k.a, k.pinned, unchanged=True)),
        ValueError,
        r"Site\.POS: unchanged=True is refused during graph capture",
    ),
    case(
        "unchanged_fill_during_capture",
        lambda k: k.capture(lambda: k.cap.fill_tail(Site.TAIL, k.a, 0, 1, unchanged=True)),
        ValueError,
        r"Site\.TAIL: unchanged=True is refused during graph capture",
    ),
    case(
        "pageable_source_during_capture",
        lambda k: k.capture(lambda: k.cap.copy(Site.POS, k.a, k.h)),
        ValueError,
        r"Site\.POS: during graph capture an H2D source must be pinned",
    ),
    case(
        "strided_d2d_during_capture",
        lambda k: k.capture(lambda: k.cap.copy(Site.GATHER, k.a[::2], k.b[::-2])),
        ValueError,
        r"Site\.GATHER: during graph capture a D2D copy needs contiguous",
    ),
    case(
        "on_drop_not_callable",
        lambda k: k.c.copy(Site.POS, k.b, k.h, on_drop=5),
        TypeError,
        r"Site\.POS: on_drop",
    ),
    # -- module-level routing -------------------------------------------------------------------------------
    case(
        "routed_host_destination_with_no_active_copier",
        lambda k: cc.copy(Site.POS, k.h.copy(), k.h),
        ValueError,
        r"Site\.POS: destination must be device memory",
    ),
    case(
        "routed_wrong_direction",
        lambda k: cc.fill_tail(Site.POS, k.b, 0, 1),
        ValueError,
        r"Site\.POS: fill_tail\(\) does not take a H2D site",
    ),
]


@pytest.mark.parametrize("fn,exc,match", CASES)
def test_bad_input(sim_env, monkeypatch, fn, exc, match):
    k = Ctx(sim_env, monkeypatch)
    c = k.c
    dropped = []
    want = np.arange(8, dtype=np.int32) * 3
    with c.step():
        assert c.copy(Site.POS, k.a, want.copy(), on_drop=lambda: dropped.append(1)) is True
        assert c.staged == 1
        with pytest.raises(exc, match=match):
            fn(k)
        assert c.staged == 1, "the bad call staged something or lost the staged copy"
        assert c.in_step
    assert dropped == []
    assert sim_env.to_host(k.a).tolist() == want.tolist()
    # and the copier takes the next step as usual
    with c.step():
        c.copy(Site.POS, k.a, want[::-1].copy())
    assert sim_env.to_host(k.a).tolist() == want[::-1].tolist()


def test_catalogue_is_large_enough():
    assert len(CASES) >= 30


def test_h2d_outside_a_step_during_capture_is_captured(sim_env):
    """DESIGN 6: during capture copies are plain copies into the graph, re-read at replay."""
    dev = sim_env.dev
    s = dev.stream()
    c = sim_env.copier(PLAN, stream=s)
    dst = dev.empty((4,), np.int32)
    src = dev.pinned_empty((4,), np.int32)
    src[:] = 1
    with dev.capture(s) as graph:
        assert c.copy(Site.POS, dst, src) is True
    src[:] = 5
    graph.replay(s)
    assert sim_env.to_host(dst).tolist() == [5] * 4
