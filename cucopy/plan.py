"""CopyPlan: which sites a model lets the copier merge, and where it must land them."""

from __future__ import annotations

from collections.abc import Iterable

from .sites import CopySite

__all__ = ["CopyPlan"]


def _members(name: str, sites: Iterable[CopySite]) -> frozenset[CopySite]:
    if sites is None or isinstance(sites, (str, bytes)):
        raise TypeError(f"CopyPlan: {name} takes a set of CopySite members, got {sites!r}")
    if isinstance(sites, CopySite):
        raise TypeError(f"CopyPlan: {name} takes a set of sites, got the single site {sites.label}")
    out = frozenset(sites)
    for site in out:
        if not isinstance(site, CopySite):
            raise TypeError(f"CopyPlan: {name} holds {site!r}, which is not a CopySite member")
    return out


class CopyPlan:
    """A model's promise about its copy sites.

    Parameters
    ----------
    merge : set of CopySite
        Sites whose copies may be staged into the step's pack. Listing a site
        asserts that no device work outside the copier reads or writes its
        destination (or writes its D2D source) before the copy's barrier.
    flush_after : set of CopySite
        Barrier sites, a subset of ``merge``: when a call through one stages its
        copy, the pack is flushed right after that call.

    Raises
    ------
    TypeError
        If a member is not a :class:`~cucopy.CopySite`.
    ValueError
        If ``flush_after`` names a site that is not in ``merge``.
    """

    __slots__ = ("merge", "flush_after")

    merge: frozenset[CopySite]
    flush_after: frozenset[CopySite]

    def __init__(self, merge: Iterable[CopySite] = (), flush_after: Iterable[CopySite] = ()):
        merge = _members("merge", merge)
        flush_after = _members("flush_after", flush_after)
        stray = flush_after - merge
        if stray:
            names = ", ".join(sorted(s.label for s in stray))
            raise ValueError(
                f"CopyPlan: flush_after must be a subset of merge; not merged: {names}"
            )
        object.__setattr__(self, "merge", merge)
        object.__setattr__(self, "flush_after", flush_after)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("CopyPlan is immutable")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CopyPlan):
            return NotImplemented
        return self.merge == other.merge and self.flush_after == other.flush_after

    def __hash__(self) -> int:
        return hash((self.merge, self.flush_after))

    def __repr__(self) -> str:
        m = ", ".join(sorted(s.label for s in self.merge))
        f = ", ".join(sorted(s.label for s in self.flush_after))
        return f"CopyPlan(merge={{{m}}}, flush_after={{{f}}})"
