"""Uses of the compiled core as cucopy's Python code makes them, for the type checker.

cucopy's modules pick a twin at import (``cucopy.segment.Segment`` is the compiled
``cucopy._segment.Segment`` or the pure ``PySegment``), so mypy sees the pure twin at
their call sites; this file (not collected by pytest, never run) makes the same calls
on the compiled types, so a stub in cucopy/_segment.pyi that stops accepting them fails
``mypy``.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

import numpy as np
from typing_extensions import assert_type

from cucopy import _segment as c


def calls(site: object, dst: Any, src: np.ndarray, slot: object, launcher: object) -> None:
    seg = c.Segment(frozenset({site}), frozenset(), fills=frozenset())
    seg.bind(slot)
    seg.set_capture_query(None, None)
    seg.reserve = 16
    seg.fast = True
    assert_type(seg.try_h2d(site, dst, src, None), int)
    assert_type(seg.try_skip(site, dst, src), int)
    assert_type(seg.try_fill(site, dst, 0, 1.5, None), int)
    seg.remember(dst, None, (0, 1, 8, 8), src.dtype, src.size, src.shape)
    seg.remember_src(src, None, src, src.dtype)
    f = (0x1000, 1, 8, 8)
    assert_type(seg.append_h2d(site, None, f, 0x1000, 0x1008, 8, 1, src), bool)
    r = seg.stage(site, None, 0x1000, 0x1008, f, 8, (0, 0, 0, 8, 8, 8, 1, 1, 0, 0), True)
    if not isinstance(r, int):
        entry, off = r
        assert_type(entry.lo, int)
        assert_type(off, int)
    assert_type(seg.overlaps(0, 8), bool)
    assert_type(seg.desc(0)[7], int)
    cut = seg.flush_carried(launcher, 0, 4096, 0x2000)
    if isinstance(cut, tuple):
        start, end, nblocks, ndesc = cut
    assert_type(seg.cut(4096), tuple[int, int, int, int])
    seg.finish()
    assert_type(seg.fold(), dict[Any, int])
    for e in seg.reset():
        assert_type(e, c.Entry)

    tables = c.WindowMax(4)
    assert_type(tables.append_max(3), int)
    assert_type(tables.max(), int)
    assert_type(tables.max(None), int | None)

    ring = c.RingCore()
    fast = ring.advance_fast(seg, tables, 0, 0)
    if fast is not None:
        assert_type(fast[0], c.SlotCore)
    core = c.CopierCore()
    assert_type(core._take_counts()[0], int)
    done = core._flush_fast()
    if done is not True and done is not False:
        assert_type(done, tuple[int, int, int, int])

    active: ContextVar[Any] = ContextVar("active")
    copy = c.FastCopy(lambda *a: None, lambda self, *a: None)
    assert_type(copy.__wrapped__, Any)
    c.FastRoute(active, copy)
    c.StepCore._plain_begin(lambda self: None)
    with c.StepCore(core, graph=None), c.Activation(core, active):
        pass
    skips = c.SkipCounts()
    skips.count(site)
    assert_type(c.thread_id(), int)
    assert_type(c._context_id(), int)
