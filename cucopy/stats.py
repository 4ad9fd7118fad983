"""Counters a copier keeps, to compare two configurations after a run."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .sites import CopySite

__all__ = ["SiteStats", "CopyStats"]


class SiteStats:
    """Counters of one site.

    Attributes
    ----------
    merged : int
        Copies staged into a segment.
    eager : int
        Copies issued eagerly (sites outside the plan, and fallbacks).
    skipped : int
        Copies skipped as ``unchanged`` (and empty tails).
    fallback : collections.Counter
        Merged-site copies that ran eagerly, by reason: ``"layout"``,
        ``"slot_full"``, ``"outside_step"``, ``"capture"``, ``"overlap"``,
        ``"in_place"`` (read in place through a :class:`~cucopy.HostGuard`).
    checked : int
        Copies verified by check mode.
    """

    __slots__ = ("_merged", "_owner", "_eager", "_skipped", "fallback", "checked")

    def __init__(self, owner: CopyStats | None = None) -> None:
        self._owner = owner  # folds the counts still pending before merged/skipped is read
        self._merged = 0
        self._eager = 0
        self._skipped = 0
        self.fallback: collections.Counter[str] = collections.Counter()
        self.checked = 0

    @property
    def merged(self) -> int:
        """Copies staged into a segment (and landed, or landing)."""
        if self._owner is not None:
            self._owner.fold()
        return self._merged

    @merged.setter
    def merged(self, value: int) -> None:
        self._merged = value

    @property
    def eager(self) -> int:
        """Copies issued eagerly (sites outside the plan, and fallbacks)."""
        if self._owner is not None:
            self._owner.fold()
        return self._eager

    @eager.setter
    def eager(self, value: int) -> None:
        self._eager = value

    @property
    def skipped(self) -> int:
        """Copies skipped as ``unchanged`` (and empty tails)."""
        if self._owner is not None:
            self._owner.fold()
        return self._skipped

    @skipped.setter
    def skipped(self, value: int) -> None:
        self._skipped = value

    def as_dict(self) -> dict:
        """The counters as plain values."""
        return {
            "merged": self.merged,
            "eager": self.eager,
            "skipped": self.skipped,
            "fallback": dict(self.fallback),
            "checked": self.checked,
        }

    def __repr__(self) -> str:
        return f"SiteStats({self.as_dict()})"


class CopyStats:
    """Per-site counters and totals of one copier.

    Attributes
    ----------
    sites : dict
        ``site -> SiteStats``, created on first use (merged counts kept by the
        copier's segment are folded in when this is read).
    pending : list
        Callables returning ``{site: merged copies}`` counted elsewhere since their
        last call (the copier's segment counts in C); folded into ``sites``.
    pending_eager : list
        The same for eager copies (the compiled copy issues a site's eager copies
        itself and counts them in C); a count may be ``(n, reason)``, a merged site's
        eager copies with their fallback reason.
    pending_skipped : list
        The same for skipped copies (``DeviceCopyBuffer.update``'s fast path counts
        its skips apart, see :mod:`cucopy.buffer`).
    pending_totals : list
        Callables returning ``(steps, segments, bytes_staged, inline, mapped)``
        counted elsewhere since their last call (the copier's compiled ``begin()``
        and ``flush()`` count in C); folded into the totals below whenever one of
        them is read.
    steps : int
        Steps begun.
    segments : int
        Segments flushed (one upload + one launch each, or one launch when mapped).
    bytes_staged : int
        Bytes of all flushed segments.
    host_waits : int
        Times the host waited for a ring slot still in flight.
    eager_flushes : int
        Segments closed before their barrier to keep program order.
    modes : dict
        Segments by how they reached the kernel: ``"dma"`` (uploaded),
        ``"mapped"`` (read from mapped pinned memory) and ``"inline"`` (carried
        whole in the launch's parameters).
    """

    pending: list[Callable[[], dict]]
    pending_eager: list[Callable[[], dict]]
    pending_skipped: list[Callable[[], dict]]
    pending_totals: list[Callable[[], tuple]]
    host_waits: int
    eager_flushes: int

    def __init__(self) -> None:
        self._sites: collections.defaultdict[CopySite, SiteStats] = collections.defaultdict(
            lambda: SiteStats(self)
        )
        self.pending = []
        self.pending_eager = []
        self.pending_skipped = []
        self.pending_totals = []
        self._zero()

    def _fold_totals(self) -> None:
        for take in self.pending_totals:
            steps, segments, nbytes, inline, mapped = take()
            self._steps += steps
            self._segments += segments
            self._bytes_staged += nbytes
            if inline or mapped:
                modes = self._modes
                modes["inline"] += inline
                modes["mapped"] += mapped

    def add_step(self) -> None:
        """Count one step begun (what the Python paths of ``begin()`` call)."""
        self._steps += 1

    def add_skipped(self, site: CopySite) -> None:
        """Count one copy of ``site`` skipped, with no fold first (the counts pending in C
        are added whenever read, so the sum is the same).

        Parameters
        ----------
        site : CopySite
        """
        self._sites[site]._skipped += 1

    def add_segment(self, how: str, nbytes: int) -> None:
        """Count one flushed segment of ``nbytes`` bytes that reached the kernel ``how``.

        Parameters
        ----------
        how : str
            ``"dma"``, ``"mapped"``, ``"inline"`` or ``"graph"``.
        nbytes : int
            The segment's bytes (header, descriptors and data).

        Notes
        -----
        Sums need no fold first (the counts pending in C are added whenever read), so
        this adds to the totals directly; assigning a total folds first.
        """
        self._segments += 1
        modes = self._modes
        modes[how] = modes.get(how, 0) + 1
        self._bytes_staged += nbytes

    @property
    def steps(self) -> int:
        """Steps begun."""
        self._fold_totals()
        return self._steps

    @steps.setter
    def steps(self, value: int) -> None:
        self._fold_totals()
        self._steps = value

    @property
    def segments(self) -> int:
        """Segments flushed."""
        self._fold_totals()
        return self._segments

    @segments.setter
    def segments(self, value: int) -> None:
        self._fold_totals()
        self._segments = value

    @property
    def bytes_staged(self) -> int:
        """Bytes of all flushed segments."""
        self._fold_totals()
        return self._bytes_staged

    @bytes_staged.setter
    def bytes_staged(self, value: int) -> None:
        self._fold_totals()
        self._bytes_staged = value

    @property
    def modes(self) -> dict[str, int]:
        """Segments by how they reached the kernel (``dma``, ``mapped``, ``inline``)."""
        self._fold_totals()
        return self._modes

    @modes.setter
    def modes(self, value: dict[str, int]) -> None:
        self._fold_totals()
        self._modes = value

    def fold(self) -> None:
        """Add the counts still pending (the copier's segment keeps them) to ``sites``."""
        sites = self._sites
        for fold in self.pending:
            for site, n in fold().items():
                sites[site]._merged += n
        for fold in self.pending_eager:
            for site, n in fold().items():
                if type(n) is tuple:  # (n, reason): a merged site's, with its fallback
                    n, reason = n
                    sites[site].fallback[reason] += n
                sites[site]._eager += n
        for fold in self.pending_skipped:
            for site, n in fold().items():
                sites[site]._skipped += n

    @property
    def sites(self) -> collections.defaultdict[CopySite, SiteStats]:
        """``site -> SiteStats``, with the counts still pending folded in."""
        self.fold()
        return self._sites

    def reset(self) -> None:
        """Zero every counter (counts still pending are dropped too)."""
        for fold in (
            *self.pending,
            *self.pending_eager,
            *self.pending_skipped,
            *self.pending_totals,
        ):
            fold()
        self._sites.clear()
        self._zero()

    def _zero(self) -> None:
        self._steps = 0
        self._segments = 0
        self._bytes_staged = 0
        self.host_waits = 0
        self.eager_flushes = 0
        self._modes = {"dma": 0, "mapped": 0, "inline": 0}

    def as_dict(self) -> dict:
        """Counters as plain values, sites keyed by ``Class.MEMBER``."""
        return {
            "steps": self.steps,
            "segments": self.segments,
            "bytes_staged": self.bytes_staged,
            "host_waits": self.host_waits,
            "eager_flushes": self.eager_flushes,
            "modes": dict(self.modes),
            "sites": {s.label: v.as_dict() for s, v in self.sites.items()},
        }

    def __str__(self) -> str:
        lines = [
            f"steps={self.steps} segments={self.segments} bytes_staged={self.bytes_staged} "
            f"host_waits={self.host_waits} eager_flushes={self.eager_flushes} "
            + " ".join(f"{k}={n}" for k, n in self.modes.items()),
            f"{'site':32} {'merged':>8} {'eager':>8} {'skipped':>8} {'checked':>8}  fallback",
        ]
        for site, v in sorted(self.sites.items(), key=lambda kv: kv[0].label):
            fb = ", ".join(f"{k}={n}" for k, n in sorted(v.fallback.items()))
            lines.append(
                f"{site.label:32} {v.merged:8} {v.eager:8} {v.skipped:8} {v.checked:8}  {fb}"
            )
        return "\n".join(lines)
