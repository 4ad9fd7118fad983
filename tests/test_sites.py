import pytest

import cucopy as cc


class Site(cc.CopySite):
    POSITIONS = cc.H2D
    KV_LENS = cc.H2D
    GATHER = cc.D2D
    TAIL = cc.FILL


def test_members_with_equal_directions_stay_distinct():
    assert Site.POSITIONS is not Site.KV_LENS
    assert Site.POSITIONS != Site.KV_LENS
    assert len(list(Site)) == 4
    assert len({Site.POSITIONS, Site.KV_LENS}) == 2


def test_direction_and_label():
    assert Site.POSITIONS.direction is cc.H2D
    assert Site.GATHER.direction is cc.D2D
    assert Site.TAIL.direction is cc.FILL
    assert Site.KV_LENS.label == "Site.KV_LENS"
    assert "H2D" in repr(Site.POSITIONS)


def test_hash_is_identity():
    assert hash(Site.POSITIONS) == object.__hash__(Site.POSITIONS)
    assert {Site.POSITIONS: 1}[Site.POSITIONS] == 1


def test_two_enums_do_not_alias():
    class Other(cc.CopySite):
        POSITIONS = cc.H2D

    assert Other.POSITIONS is not Site.POSITIONS
    assert Other.POSITIONS != Site.POSITIONS


def test_declaring_without_a_direction_fails():
    with pytest.raises(TypeError, match="Bad: a site is declared with a Direction"):

        class Bad(cc.CopySite):
            X = 1
