"""Copy directions and the site enum a model declares its copies with."""

from __future__ import annotations

import enum
import itertools

__all__ = ["Direction", "H2D", "D2D", "FILL", "CopySite"]


class Direction(enum.Enum):
    """Which way a site's copies go."""

    H2D = "h2d"
    """Host (pinned or pageable) to device."""
    D2D = "d2d"
    """Device to device on the copier's device."""
    FILL = "fill"
    """Write a scalar into a tail of the destination (``fill_tail``)."""


H2D = Direction.H2D
D2D = Direction.D2D
FILL = Direction.FILL

# Unique values keep members with equal directions distinct: a plain Enum would
# alias ``KV_LENS = H2D`` to ``POSITIONS = H2D`` and merge a site nobody merged.
_site_ids = itertools.count(1)


class CopySite(enum.Enum):
    """Base class for a model's named copy sites.

    Subclass it and declare each member with its :class:`Direction`::

        class Site(cucopy.CopySite):
            POSITIONS = cucopy.H2D
            KV_LENS = cucopy.H2D

    Members stay distinct even when their directions repeat; ``site.direction``
    is the declared direction.
    """

    direction: Direction
    """The :class:`Direction` the member was declared with."""

    def __new__(cls, direction: Direction) -> CopySite:
        if not isinstance(direction, Direction):
            raise TypeError(
                f"{cls.__name__}: a site is declared with a Direction "
                f"(cucopy.H2D, D2D or FILL), got {direction!r}"
            )
        obj = object.__new__(cls)
        obj._value_ = next(_site_ids)
        obj.direction = direction
        return obj

    # Enum hashes by name in Python; sites are looked up on every copy.
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self.name}: {self.direction.name}>"

    @property
    def label(self) -> str:
        """``Class.MEMBER``, the name used in error messages."""
        return f"{type(self).__name__}.{self.name}"
