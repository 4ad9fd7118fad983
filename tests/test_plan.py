import enum

import pytest

import cucopy as cc


class Site(cc.CopySite):
    A = cc.H2D
    B = cc.H2D
    C = cc.D2D


def test_plan_holds_frozensets():
    plan = cc.CopyPlan(merge={Site.A, Site.B}, flush_after={Site.B})
    assert plan.merge == frozenset({Site.A, Site.B})
    assert isinstance(plan.merge, frozenset)
    assert plan.flush_after == frozenset({Site.B})
    assert Site.C not in plan.merge


def test_flush_after_must_be_merged():
    with pytest.raises(ValueError, match=r"flush_after must be a subset of merge.*Site\.C"):
        cc.CopyPlan(merge={Site.A}, flush_after={Site.C})


def test_unknown_members_rejected():
    class Plain(enum.Enum):
        A = 1

    with pytest.raises(TypeError, match="merge holds <Plain.A: 1>"):
        cc.CopyPlan(merge={Plain.A})
    with pytest.raises(TypeError, match="merge holds 'A'"):
        cc.CopyPlan(merge={"A"})
    with pytest.raises(TypeError, match="single site Site.A"):
        cc.CopyPlan(merge=Site.A)


def test_plan_is_immutable_and_hashable():
    plan = cc.CopyPlan(merge={Site.A})
    with pytest.raises(AttributeError):
        plan.merge = frozenset()
    assert plan == cc.CopyPlan(merge=[Site.A])
    assert len({plan, cc.CopyPlan(merge=[Site.A])}) == 1


def test_a_site_may_belong_to_several_plans():
    p1 = cc.CopyPlan(merge={Site.A}, flush_after={Site.A})
    p2 = cc.CopyPlan(merge={Site.A, Site.B})
    assert Site.A in p1.merge and Site.A in p2.merge
