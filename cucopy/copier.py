"""DeviceCopier: stage, order and flush a step's copies; module-level routing."""

from __future__ import annotations

import collections
import contextvars
import os
import threading
import warnings
import weakref
from typing import NoReturn

import numpy as np

from . import _layout, check, pack
from .adapters import ArrayInfo, fingerprint_fn, readonly_hint, resolve
from .deadline import resolve_timeout
from .errors import CopyError
from .feed import GraphFeed
from .guard import HostGuard
from .plan import CopyPlan
from .ring import DEMAND_WINDOW, StagingRing, WindowMax, free_orphans, orphan
from .segment import BARRIER, FULL, ORDER, SKIPPED, Segment, fits_shape
from .segment import Activation as _CompiledActivation
from .segment import CopierCore as _CompiledCopierCore
from .segment import FastCopy as _FastCopy
from .segment import FastRoute as _FastRoute
from .segment import StepCore as _CompiledStepCore
from .segment import context_id as _context_id
from .segment import set_check_mode as _set_check_mode
from .segment import thread_id as _thread_id
from .sites import CopySite, Direction
from .stats import CopyStats

__all__ = ["DeviceCopier", "copy", "fill_tail", "flush", "active_copier"]

_H2D, _D2D, _FILL = Direction.H2D, Direction.D2D, Direction.FILL
FLUSH_MODES = ("auto", "dma", "mapped", "inline")

#: ``CUCOPY_NO_NT=1`` at import: no streaming stores (see DeviceCopier._nt_from)
_NT_OFF = os.environ.get("CUCOPY_NO_NT", "") not in ("", "0")
#: Whether a copier made from now on has its graphed launches write their slot's
#: completion tag (``cucopy.ring``) instead of the slot's event being recorded after
#: them and queried at the slot's next turn. Read when a copier is made
#: (``DeviceCopier._tags``). On by default; ``CUCOPY_TAG=0`` in the environment at import
#: turns it off. (Opt-in until the graphs of graphed launches were made at set-up: a
#: graph made mid-run behind a held stream blocked the host, bench/results run 54-58;
#: with the pool, every GPU test passes with tags on, run 62.)
TAGS = os.environ.get("CUCOPY_TAG", "1") not in ("", "0")
_EMPTY_PLAN = CopyPlan()
_FILL_ELEMS = (1, 2, 4, 8)
# Without a carried header and table (a backend that carries nothing), "auto"
# reads a segment from mapped memory only while every block's descriptor reads
# stay few: on the H200, 8 and 32 descriptors ran 10.1 and 13.5 us mapped against
# 20.4 us through an upload; 128 ran 38.6 mapped against 20.7
# (bench/results/2026-11-30-h200-run1, step_cost), and mapped segments up to
# 134 KB were not slower than an upload (size_sweep there).
_MAPPED_MAX_DESCS = 64
_UNCARRIED_MAPPED_MAX = 128 * 1024


def _label(site) -> str:
    return site.label if isinstance(site, CopySite) else repr(site)


def make_backend(backend=None, device=None):
    """Build the backend for ``backend`` (``"cuda"``, ``"sim"``, None) and ``device``."""
    from .backends.base import Backend

    if isinstance(backend, Backend):
        return backend
    from .backends import sim

    if backend is None:
        if isinstance(device, sim.SimDevice):
            backend = "sim"
        else:
            from .backends import pick_default

            backend = pick_default()  # logs once when it falls back to the simulator
    if backend == "sim":
        if device is not None and not isinstance(device, sim.SimDevice):
            raise TypeError(f"device: the sim backend takes a SimDevice, got {device!r}")
        return sim.SimBackend(device)
    if backend == "cuda":
        from .backends.cuda import CudaBackend

        if device is not None and not isinstance(device, int):
            raise TypeError(f"device: the cuda backend takes a CUDA ordinal, got {device!r}")
        return CudaBackend(device)
    raise ValueError(f"backend: expected 'cuda', 'sim' or None, got {backend!r}")


class PyStepCore:
    """:class:`_Step`'s fields and its ``with`` protocol (the pure-Python reference).

    ``cucopy._segment.StepCore`` is its compiled twin: its ``__enter__`` opens a plain
    step with the compiled ``_begin_fast`` when that takes it, and its
    ``__exit__`` of a step that raised nothing calls ``flush()`` and closes the step;
    anything else goes to :meth:`_Step._enter` / :meth:`_Step._exit`, which this
    reference always calls.
    """

    __slots__ = ("_copier", "_graph", "_token")

    def __init__(self, copier: DeviceCopier, graph=None):
        self._copier = copier
        self._graph = graph
        self._token = None

    def __enter__(self) -> DeviceCopier:
        # the step activates its copier for the block (module-level cucopy.copy routes
        # to it), unless it already is the active one; reset when the step ends. (The
        # compiled twin records the step's context instead, which costs the step less:
        # see _step_copier.)
        if _active.get() is not self._copier:
            self._token = _active.set(self._copier)
        try:
            return self._enter()  # type: ignore[attr-defined]
        except BaseException:
            self._deactivate()
            raise

    def __exit__(self, tp, exc, tb) -> bool:
        try:
            return self._exit(tp, exc, tb)  # type: ignore[attr-defined]
        finally:
            self._deactivate()

    def _deactivate(self) -> None:
        token = self._token
        if token is None:
            return
        try:
            _active.reset(token)
        except ValueError:
            # made in another context: another thread's refused exit, or a step left in
            # another task; the token stays for the exit in the step's own context
            return
        self._token = None


_StepCore = PyStepCore if _CompiledStepCore is None else _CompiledStepCore


class _Step(_StepCore):  # type: ignore[misc,valid-type]
    """What :meth:`DeviceCopier.step` returns: ``begin()`` on entry; on exit ``flush()``
    (a graph step: left for its replay), ``discard()`` on an exception (a class, not a
    generator: about a microsecond a step less on the GPU's host; its common case is
    compiled, see :class:`PyStepCore`)."""

    __slots__ = ()

    def _enter(self) -> DeviceCopier:
        c = self._copier
        graph = self._graph
        if c._closed or (c._in_step and c._owner != _thread_id()):
            c._live()  # raises
        if graph is not None and (not isinstance(graph, GraphFeed) or graph._copier is not c):
            raise ValueError(
                f"step(graph=...): expected a GraphFeed made by this copier's "
                f"capture_inputs(), got {graph!r}"
            )
        if c._stepping:
            raise CopyError(
                "step(): a step() block of this copier is already open; nested step() "
                "blocks are refused (the inner exit would end the outer step). Use "
                "flush() for a barrier inside the step (after a step() block that an "
                "interrupt cut short, discard() ends it)"
            )
        c._stepping = True  # first: an interrupt anywhere below leaves it to the except
        try:
            c.begin()
            if graph is not None:
                if c._capturing:
                    c.discard()
                    raise CopyError(
                        "step(graph=...): the copier's stream is capturing; a graph step "
                        "feeds a replay, so run it outside the capture"
                    )
                c._feed = graph
        except BaseException:
            c._stepping = False
            raise
        return c

    def _exit(self, tp, exc, tb) -> bool:
        c = self._copier
        if c._in_step and c._owner != _thread_id():
            c._live()  # raises: another thread's exit must not end the owner's step
        c._stepping = False
        if tp is not None:
            try:
                c.discard()
            except CopyError as drop_error:
                # the body's exception wins; the failing on_drop rides along as a note
                if exc is not None and hasattr(exc, "add_note"):
                    exc.add_note(f"cucopy: while discarding: {drop_error}")
            return False
        try:
            if self._graph is None:
                c.flush()
            else:
                c._end_graph_step()
        finally:
            c._in_step = c._seg.fast = False
        return False


class _PyActivation:
    """What :meth:`DeviceCopier.activate` returns: the copier active inside the block
    (``var``, the context variable :func:`cucopy.copy` routes through, set on entry and
    reset on exit). The pure-Python reference; ``cucopy._segment.Activation`` is its
    compiled twin."""

    __slots__ = ("_copier", "_var", "_token")

    def __init__(self, copier: DeviceCopier, var: contextvars.ContextVar):
        self._copier = copier
        self._var = var
        self._token = None

    def __enter__(self) -> DeviceCopier:
        self._token = self._var.set(self._copier)
        return self._copier

    def __exit__(self, *exc) -> bool:
        token, self._token = self._token, None
        if token is not None:
            self._var.reset(token)
        return False


_Activation = _PyActivation if _CompiledActivation is None else _CompiledActivation


class PyCopierCore:
    """The copier's per-step fields (the pure-Python reference; :class:`DeviceCopier`
    subclasses it).

    ``cucopy._segment.CopierCore`` is its compiled twin: the same fields as C members,
    and a ``_begin_fast`` that opens the common step in one call (the Python
    copier has no such stand-in: its begin() runs its body).
    """

    __slots__ = (
        "_closed",
        "_in_step",
        "_owner",
        "_seg",
        "_checker",
        "_feed",
        "_feed_pending",
        "_capturing",
        "_ring",
        "_slot",
        "_tables",
        "_cap_for",
        "_cap",
        "_stepping",
        "_guarded",
        "_watching",
        "stats",
        "_cap_query",
        "_cap_arg",
        "_launcher",
        "_handle",
        "_carry_max",
        "flush_mode",
        "_mapped_max",
        "_graph_cap",
        "_tags",
        "wait_timeout",
        "_guards_owed",
        "__dict__",
        "__weakref__",
    )

    @property
    def _fast_begins(self) -> int:
        """Steps :meth:`_begin_fast` opened (always 0 here: it opens none)."""
        return 0

    @property
    def _fast_flushes(self) -> int:
        """Segments :meth:`_flush_fast` landed (always 0 here: it lands none)."""
        return 0

    @property
    def _fast_guarded(self) -> int:
        """Guarded copies the compiled case issued (always 0 here: there is none)."""
        return 0

    @property
    def _fast_fenced(self) -> int:
        """Guard events the compiled flush recorded (always 0 here: there is none)."""
        return 0

    # No _begin_fast, _flush_fast or _take_counts: where the core is not compiled,
    # begin() and flush() run their Python bodies (_COMPILED below), whole; the
    # compiled twins' contract is in cucopy/_core/copier.c and TWINS.md (D2).


#: the copier's per-step state: compiled when the staging core is built
_CopierCore = PyCopierCore if _CompiledCopierCore is None else _CompiledCopierCore
#: whether begin(), flush() and the ring's step have compiled common cases to try
_COMPILED = _CompiledCopierCore is not None
if _set_check_mode is not None:  # the compiled core keeps check mode as a flag of its own
    _set_check_mode(check.CHECK_MODE)
    check._on_check_mode.append(_set_check_mode)


class DeviceCopier(_CopierCore):  # type: ignore[misc,valid-type]
    """Routes a step's copies through named sites and merges what the plan allows.

    Parameters
    ----------
    plan : CopyPlan, optional
        Which sites to merge and which are barriers. None merges nothing.
    stream : stream, optional
        The stream every copy goes on: a CuPy or torch stream, anything with
        ``__cuda_stream__``, a raw handle, or a sim stream. None: the
        backend's current stream at construction.
    device : int or SimDevice, optional
        The device the copier belongs to (a CUDA ordinal or a simulated device).
    backend : {"cuda", "sim", None}
        None picks cuda when a GPU is visible, else sim.
    slots : int
        Pinned staging slots in the ring (steps that may be in flight at once).
    capacity : int
        Bytes of one slot; a step that overflows it runs the rest eagerly and
        the ring grows the slot at the next :meth:`begin` (and shrinks it back
        after a long run of smaller steps). Replaced slots and temporaries are
        kept for reuse and freed only by :meth:`close`: ``cudaFreeHost`` and
        ``cudaFree`` wait for the whole device, which a step must never do.
    flush_mode : {"auto", "dma", "mapped", "inline"}
        How a segment reaches the scatter kernel: uploaded with one H2D copy
        (``dma``), read from mapped pinned memory (``mapped``), carried whole in
        the launch's parameters (``inline``), or chosen by segment size
        (``auto``). ``mapped`` carries the header and descriptor table in the
        launch when they fit, so the kernel's only read of host memory is the
        data; ``inline`` falls back to ``auto`` for a segment larger than the
        backend's largest parameter buffer (32 KiB on CUDA 12.1 or later). Where
        the backend launches graphs (CUDA, with the compiled driver calls),
        ``mapped`` launches a segment of at most 32 KiB, and ``auto`` one of at
        most 16 KiB, through a one-node CUDA graph (made with the copier,
        re-pointed at a ring slot's segment as needed), whose kernel reads the
        segment from the slot: half a kernel launch's host time, for about 1-2
        µs more GPU time than ``inline``'s carried launch (more past 16 KiB: one
        block scatters it). ``mapped`` suits a stream whose work overlaps other
        work (an engine's upload stream), where the host's time is what counts.
    wait_timeout : float, optional
        Seconds any host wait of this copier may last (a ring slot still in flight,
        :meth:`close`, the slot an eager copy or a larger step needs) before it raises
        :class:`CopyError` saying what it waited for. None: ``CUCOPY_WAIT_TIMEOUT``
        from the environment, else 300. Waits poll the event and sleep between
        queries (20 µs doubling to 1 ms); see :mod:`cucopy.deadline`.

    Raises
    ------
    ValueError
        On a bad ``slots``, ``capacity``, ``flush_mode`` or ``wait_timeout`` (zero or
        below), or a bad ``CUCOPY_WAIT_TIMEOUT``.
    TypeError
        On a ``wait_timeout`` that is not a number.
    """

    def __init__(
        self,
        plan: CopyPlan | None = None,
        stream=None,
        device=None,
        backend=None,
        slots: int = 4,
        capacity: int = 1 << 20,
        flush_mode: str = "auto",
        *,
        wait_timeout: float | None = None,
    ):
        if plan is None:
            plan = _EMPTY_PLAN
        if not isinstance(plan, CopyPlan):
            raise TypeError(f"plan: expected a CopyPlan, got {type(plan).__qualname__}")
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots: expected an int >= 1, got {slots!r}")
        if not isinstance(capacity, int) or capacity < 4096:
            raise ValueError(f"capacity: expected an int >= 4096 bytes, got {capacity!r}")
        if flush_mode not in FLUSH_MODES:
            raise ValueError(f"flush_mode: expected one of {FLUSH_MODES}, got {flush_mode!r}")
        #: seconds any host wait of this copier may last (cucopy.deadline)
        self.wait_timeout = resolve_timeout(wait_timeout)
        self.plan = plan
        self._merge = plan.merge
        self._barriers = plan.flush_after
        self._backend = make_backend(backend, device)
        self._stream_obj = stream  # keeps a user's stream object alive
        self._stream = self._backend.resolve_stream(stream)
        self._handle = self._stream if isinstance(self._stream, int) else None
        # the tuple's own (interned) string: the compiled flush and begin compare the
        # mode by identity first (a mode read from a config file is another object)
        self.flush_mode = FLUSH_MODES[FLUSH_MODES.index(flush_mode)]
        self._mapped_max = self._backend.mapped_threshold()
        # The largest carry a launch takes. Asked here, not at the first flush: the
        # CUDA backend builds and loads its kernels to answer, and loading a kernel
        # may wait for the whole device (CUDA's lazy loading), which deadlocks behind
        # a kernel that spins until the host acts (a stream hold; a custom all-reduce
        # waiting for its peers). A copier is made before such phases.
        caps = self._backend.carry_capacities()
        self._carry_max = caps[-1] if caps else 0
        # "mapped" segments of at most pack.graph_max(this) bytes, and "auto" ones of at
        # most AUTO_GRAPH_ROUNDS times this, are launched graphed (a one-node graph of a
        # pool the backend makes now, re-pointed at a segment address as needed: about
        # half a kernel launch's host time, for ~2 us more GPU time at 6 KB than
        # carrying them, which "inline" does: bench/README.md, session 12; its kernel
        # reads this many bytes, and the rest of a longer segment in a second round);
        # 0: the backend has no graphs
        self._graph_cap = self._backend.graph_capacity()
        if flush_mode != "dma" and not self._backend.mapped_coherent():
            # mapped memory proven incoherent (GPU confidential computing): every
            # segment is uploaded (dma), never read through the mapping
            _say_incoherent(self._backend.describe(), flush_mode)
            self.flush_mode = "dma"
            self._graph_cap = 0
        # the capture query begin() makes (compiled on CUDA once the kernels are loaded)
        self._cap_query, self._cap_arg = self._backend.capture_query(self._stream)
        # the compiled carried launch the staging core makes in the call that cuts a
        # segment (None: cut, then the backend's scatter())
        self._launcher = self._backend.carried_launcher() if self._handle is not None else None
        # rings of copiers collected without close(), freed here once their work is
        # done (never waited for: a copier may be made inside a stream hold)
        free_orphans()
        self._ring = StagingRing(self._backend, slots, capacity)
        # the compiled step asks the next slot's event through the launcher when it can
        self._ring._launcher = self._launcher
        self._ring.work_stream = self._stream  # what a wait for a slot's tag hands the backend
        # graphed launches write their slot's completion tag: no event after them
        self._tags = bool(TAGS)
        # what a wait past its deadline reports (ring.wait_slot)
        self._ring.timeout = self.wait_timeout
        self._ring.stream = self._stream_obj if stream is not None else self._stream
        self._sites_at: dict = {}  # destination address -> the last site staged there
        self._ring.sites_at = self._sites_at
        self.stats = CopyStats()
        self._closed = False
        self._in_step = False
        self._stepping = False  # a step() block is open
        self._capturing = False
        self._owner = 0  # the thread whose step is open (thread_id; 0: none)
        self._slot = None
        self._checker = None
        self._cap_for = self._cap = -1  # slot size -> most descriptors reserved (_advance)
        self._feeds: list[GraphFeed] = []  # nodes captured by capture_inputs()
        self._feed = None  # the feed of the open step(graph=...)
        self._feed_pending = None  # a graph step ended: its segment waits for this feed's replay
        # the open segment: staging, ordering, encoding (compiled when built)
        merge_h2d = frozenset(s for s in self._merge if s.direction is _H2D)
        merge_fill = frozenset(s for s in self._merge if s.direction is _FILL)
        self._seg = Segment(merge_h2d, self._barriers, merge_fill)
        # asked before a fast copy opens a segment: a capture begun after begin()
        self._seg.set_capture_query(self._cap_query, self._cap_arg)
        self.stats.pending.append(self._seg.fold)  # its merged counts, read with stats.sites
        # H2D sites outside the plan: the compiled copy issues their common case itself
        # (_core/copier.c, core_eager), counting them apart
        self._seg.set_eager(CopySite, _H2D)
        self.stats.pending_eager.append(self._seg.fold_eager)
        if _COMPILED:  # the totals its begin() and flush() count in C, read with stats'
            self.stats.pending_totals.append(self._take_counts)
        self._tables = WindowMax(DEMAND_WINDOW)  # largest table per step
        # guards read in place by this step's copies, whose events the flush records
        # (HostGuard._issued appends (guard, use) once per step), and, in check mode,
        # the guards whose read bytes each flush verifies
        self._guards_owed: list = []
        self._guarded = False  # guards owed (the compiled flush records their events)
        self._guards_watched: weakref.WeakSet = weakref.WeakSet()
        self._watching = False  # guards watched (the compiled flush declines while set)
        self._try_h2d = self._seg.try_h2d
        # collected without close(): the ring is set aside, not freed by the collector
        self._finalizer = weakref.finalize(
            self, _collected, self._ring, self._seg, self._backend.describe()
        )
        check.register(self)

    # -- properties -----------------------------------------------------------------

    @property
    def backend(self):
        """The backend (device) this copier runs on."""
        return self._backend

    @property
    def stream(self):
        """The stream every copy goes on, as the backend sees it."""
        return self._stream

    @property
    def in_step(self) -> bool:
        """True between :meth:`begin` and the end of the step."""
        return self._in_step

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    @property
    def staged(self) -> int:
        """Copies staged and not yet flushed."""
        return self._seg.staged

    def __repr__(self) -> str:
        return (
            f"DeviceCopier({self._backend.describe()}, slots={self._ring.slots}, "
            f"flush_mode={self.flush_mode!r}, staged={self._seg.staged})"
        )

    # -- lifetime ---------------------------------------------------------------------

    def trim(self) -> int:
        """Free the memory the ring keeps for reuse: replaced slots and idle temporaries.

        A step never frees memory (a free waits for the whole device); after a phase
        of unusually large steps or eager copies, call this where such a wait is
        harmless (between phases, not while another stream waits on the host).

        Returns
        -------
        int
            Bytes freed (pinned and device).
        """
        self._live()
        free_orphans(wait=True)
        return self._ring.trim()

    def close(self) -> None:
        """Flush what is staged, wait for in-flight slots and free the ring. Idempotent.

        A copier the garbage collector takes without ``close()`` frees nothing then
        (the collector may run inside a stream hold, where a wait never returns): its
        ring is set aside and freed when the next copier is made (once the ring's work
        has completed: a copier made inside a hold does not wait on held work), closed
        or trimmed; a free that fails is tried again then.
        """
        if self._closed:
            return
        if self._in_step and self._owner != _thread_id():
            # flushing, forgetting and freeing under a step another thread has open
            # would pull the slot from under its copies
            raise CopyError(
                "close(): this copier's step belongs to another thread; close it from "
                "that thread, after its step (one copier per thread)"
            )
        try:
            if self._seg.staged:
                self._flush_segment()
            elif self._checker is not None and self._checker.pending:
                self._checker.verify_pending()
        finally:
            if self._guards_owed:
                try:
                    self._fence_guards(False)
                except Exception:
                    pass  # still owed: the guard's write() records them
            try:
                self._ring.record(self._stream)
            except Exception:
                # no event to wait on: wait for the stream itself before freeing the ring
                if not self._backend.stream_wait(self._stream, self.wait_timeout):
                    raise CopyError(
                        f"close(): waited {self.wait_timeout:g} s (wait_timeout) for stream "
                        f"{self._ring.stream!r} to drain before freeing the ring; it "
                        "never did"
                    ) from None
            self._closed = True
            self._in_step = False
            self._seg.fast = False
            self._seg.forget()
            check.unregister(self)
            if self._finalizer.detach() is not None:
                try:
                    self._ring.close()
                except BaseException:
                    orphan(self._ring)  # what was not freed is retried with the orphans
                    raise
            for feed in self._feeds:  # the ring's close waited for the device
                feed.close()
            free_orphans(wait=True)

    def __enter__(self) -> DeviceCopier:
        """Return the copier; leaving the ``with`` block closes it.

        ``with copier:`` is the copier's lifetime, not a step (that is :meth:`step`)
        nor routing (:meth:`activate`): on exit, also by an exception, :meth:`close`
        flushes what is staged, waits for the slots in flight and frees the ring, and
        the copier takes no more copies.
        """
        return self

    def __exit__(self, *exc) -> None:
        """Close the copier (:meth:`close`), whether or not the block raised."""
        self.close()

    def _live(self, site=None) -> None:
        if self._closed:
            who = f"{_label(site)}: " if site is not None else ""
            raise CopyError(f"{who}the copier is closed")
        if self._in_step and self._owner != _thread_id():
            who = f"{_label(site)}: " if site is not None else ""
            raise CopyError(
                f"{who}this copier's step belongs to another thread; use one copier "
                "per thread (activate() keeps them apart)"
            )

    # -- steps ------------------------------------------------------------------------

    def begin(self) -> None:
        """Start a step: advance the ring (waiting only if the next slot is in flight).

        Anything still staged from the previous step is flushed first, and in check
        mode its ``unchanged`` claims are verified.

        Raises
        ------
        CopyError
            From that flush (nothing staged is lost), or a false claim in check mode.
        """
        if _COMPILED and self._begin_fast():  # the common step, compiled (core/copier.c)
            return
        self._begin_body()

    def _begin_body(self) -> None:
        """:meth:`begin` past its compiled common case (which the compiled core's own
        ``begin`` calls when ``_begin_fast`` declined), or the whole of it in pure Python."""
        me = _thread_id()
        if self._closed or (self._in_step and self._owner != me):
            self._live()  # raises
        seg = self._seg
        checker = self._checker
        if seg.staged or (checker is not None and checker.pending):
            # also staged copies left by a step whose final flush raised, and check
            # mode's deferred claims: a new checker must not forget them
            self.flush()
        self._in_step = seg.fast = False
        self._feed = self._feed_pending = None
        self._checker = checker = check.Checker(self) if check.CHECK_MODE else None
        self._capturing = capturing = bool(self._backend.is_capturing(self._stream))
        if not capturing:
            try:
                self._advance()
            except BaseException:
                self._slot = None  # the ring may have replaced it; the next begin() starts afresh
                seg.unbind()
                raise
        self._owner = me
        self._in_step = True
        seg.fast = not capturing and checker is None
        self.stats.add_step()

    def _advance(self) -> None:
        ring = self._ring
        self._seg.nt_from = self._nt_from()  # (the compiled begin sets it as well)
        fast = (
            ring.advance_fast(self._seg, self._tables, self._cap_for, self._cap)
            if _COMPILED
            else None
        )
        if fast is not None:
            # the common step, compiled (core/ring.c, RingCore.advance_fast): as below
            self._slot, self._cap_for, self._cap = fast
            return
        prev = ring.current
        if prev is not None and prev.dirty:
            ring.record(self._stream)
        slot, waited = ring.acquire()
        if waited:
            self.stats.host_waits += 1
        self._slot = slot
        seg = self._seg
        seg.bind(slot)
        # The table reservation follows the largest table of recent steps (the window
        # the ring sizes slots by), never three quarters of the slot: kept at its
        # all-time peak, one large step left every later segment's data past the
        # top of a slot that had shrunk back, and every copy ran eagerly.
        want = self._tables.append_max(seg.peak)
        seg.peak = 0
        size = slot.size
        if size != self._cap_for:  # the reservation's cap follows the slot's size
            self._cap_for = size
            self._cap = (size * 3 // 4 - pack.HEADER_BYTES) // pack.DESC_BYTES
        if want > self._cap:
            want = self._cap
        seg.reserve = want if want > 16 else 16  # max(16, min(largest table, cap))

    def _nt_from(self) -> int:
        """Where a step's segment starts staging with streaming stores (a cache hint).

        The compiled segment writes data staged this many bytes or more into a segment
        with streaming stores, which bypass the host's caches: the GPU then reads it
        from memory instead of snooping lines the host just wrote. ``mapped`` and
        ``dma``: the GPU reads every byte. ``auto`` and ``inline``: what lies past the
        largest carry (the rest may travel in a launch, which the driver copies on the
        host). -1 (never) with ``CUCOPY_NO_NT=1`` in the environment at import.
        """
        if _NT_OFF:
            return -1
        mode = self.flush_mode
        if mode == "mapped" or mode == "dma":
            return 0
        if mode == "auto" or mode == "inline":
            return self._carry_max
        return -1

    def flush(self) -> None:
        """Barrier: land everything staged (one upload + one launch per open segment).

        Also records the slot's event. Does nothing while the stream is capturing.
        """
        try:
            # the common case, compiled (core/copier.c); else the body below, whole
            done = self._flush_fast() if _COMPILED else False
        except BaseException as exc:
            self._flush_failed(exc)
        if done is not True:
            self._flush_rest(done)

    def _flush_failed(self, exc: BaseException) -> NoReturn:
        """Raise what :meth:`flush` reports for ``exc``, raised by ``_flush_fast``.

        (The compiled step's exit calls ``_flush_fast`` itself, then this on an error.)
        """
        err = self._flush_error(self._seg.entries, exc)
        if err is exc:
            raise exc
        raise err from exc

    def _flush_rest(self, done) -> None:
        """:meth:`flush` after ``_flush_fast`` returned ``done`` (False, or a cut).

        (The compiled step's exit calls ``_flush_fast`` itself, then this when it did
        not land the step.)
        """
        if done is not False:  # cut, not launched carried whole: land it by its mode's path
            self._flush_segment(done)
            slot = self._ring.current
            if slot is not None and slot.dirty:
                self._ring.record(self._stream)
            if self._guards_owed or self._guards_watched:
                self._fence_guards()
            return
        if self._closed or (self._in_step and self._owner != _thread_id()):
            self._live()  # raises
        seg = self._seg
        if not seg.staged and self._checker is None and not self._guards_owed:
            slot = self._ring.current
            if slot is None or not slot.dirty:
                return  # nothing to land, no event to record: no capture query either
        if self._backend.is_capturing(self._stream):
            if seg.staged:
                raise CopyError(
                    f"{_label(seg.entries[0].site)}: capture began on the copier's stream while "
                    "copies were staged; begin the step inside the capture"
                )
            return
        if seg.staged:
            self._flush_segment()
        elif self._checker is not None:
            self._checker.verify_pending()
        slot = self._ring.current
        if slot is not None and slot.dirty:
            self._ring.record(self._stream)
        if self._guards_owed or self._guards_watched:
            self._fence_guards()

    def _fence_guards(self, verify: bool = True) -> None:
        """The step's in-place copies are issued: record each guard's event once.

        Then (``verify``), in check mode, verify that the bytes they read are unchanged
        since, naming the site when not (:class:`~cucopy.HostGuard`). (The compiled
        flush records the events itself when it can: ``_core/guard.c``,
        ``fence_guards``; else, and for check mode's guards (``_watching``), it leaves
        the step's end to :meth:`_flush_rest`, which calls this.)
        """
        owed, self._guards_owed = self._guards_owed, []
        try:
            for i, (guard, use) in enumerate(owed):
                try:
                    if not guard._record_owed(use):
                        self._guards_owed.append((guard, use))  # capturing: recorded later
                except BaseException:
                    self._guards_owed.extend(owed[i:])
                    raise
        finally:
            self._guarded = bool(self._guards_owed)
        if not check.CHECK_MODE:
            self._guards_watched.clear()  # (check mode was turned off)
        elif verify:
            for guard in list(self._guards_watched):
                if guard._watch is None or guard.closed:
                    self._guards_watched.discard(guard)
                    continue
                with guard._lock:
                    guard._verify("the copier's flush", None)
        self._watching = bool(self._guards_watched)

    def discard(self) -> None:
        """Drop everything staged and not yet flushed, calling each copy's ``on_drop``.

        The step ends; the copier is ready for the next :meth:`begin`.

        Raises
        ------
        CopyError
            If an ``on_drop`` callback raised (every callback still runs).
        """
        if self._in_step and self._owner != _thread_id():
            self._live()
        entries = self._seg.reset()
        try:
            # also the step() block's mark: discard() repairs a block an interrupt cut short
            self._in_step = self._seg.fast = self._stepping = False
            if self._checker is not None and self._slot is not None:
                # snapshot copies may still be queued: free their buffers when the slot
                # comes round (check mode synchronizes anyway)
                self._slot.frees.extend(self._checker.release())
                self._slot.dirty = True
            if self._slot is not None:
                self._ring.record(self._stream)
            if self._guards_owed:  # in-place copies are issued: a discard drops none
                self._fence_guards(False)
        finally:  # the dropped copies' owners hear of it, whatever happened above
            self._run_drops(entries)

    @staticmethod
    def _run_drops(entries) -> None:
        first = None
        for e in entries:
            for cb in e.on_drop or ():
                try:
                    cb()
                except Exception as exc:  # every callback runs; the first error is reported
                    if first is None:
                        first = (e.site, exc)
        if first is not None:
            site, exc = first
            raise CopyError(f"{_label(site)}: on_drop raised {exc!r}") from exc

    def step(self, graph: GraphFeed | None = None) -> _Step:
        """``begin()``; on exit ``flush()``; on an exception ``discard()`` and re-raise.

        Parameters
        ----------
        graph : GraphFeed, optional
            A graph step: on exit the copies still staged are not launched but left
            for ``graph``'s next :meth:`GraphFeed.replay`, whose scatter node lands
            them inside the engine's graph. Barriers (``flush_after`` sites,
            :meth:`flush`) inside the step land at once, as in any step. If the
            copier's next step, flush, eager copy or close comes first, the copies
            land then, through an ordinary launch. See :mod:`cucopy.feed`.

        Raises
        ------
        CopyError
            When a ``step()`` block of this copier is already open: the inner block's
            exit would end the outer step. The open step is left as it was. (Use
            :meth:`flush` for a barrier inside a step; :meth:`begin` ends the step and
            starts the next.) Also for a graph step while the stream captures.
        ValueError
            When ``graph`` is not a feed of this copier.
        """
        return _Step(self, graph)

    # -- graph feeds ------------------------------------------------------------------

    def capture_inputs(self, *, blocks: int = 128) -> GraphFeed:
        """Capture the scatter as a node of the graph the copier's stream is capturing.

        Call it inside the engine's capture, before the nodes that read the copies'
        destinations. Then each step runs as ``with copier.step(graph=feed):`` and the
        graph replays with ``feed.replay(graph)``: the node lands that step's merged
        copies inside the replay (no launch of their own). A replay with no step
        posted for it (none since the last replay, an empty or discarded one, or one
        whose copies all landed at barriers) lands nothing. See :mod:`cucopy.feed`.

        Parameters
        ----------
        blocks : int
            Thread blocks of the node, fixed at capture; a segment needing more is
            run in rounds by the same blocks (a step of N = 32 copies of the
            decode mix needs about 40).

        Returns
        -------
        GraphFeed

        Raises
        ------
        CopyError
            When the stream is not capturing, a step is open, or copies are staged.
        ValueError
            On a bad ``blocks``.
        """
        self._live()
        if isinstance(blocks, bool) or not isinstance(blocks, int) or not 1 <= blocks <= 65535:
            raise ValueError(f"blocks: expected an int in [1, 65535], got {blocks!r}")
        if self._in_step:
            raise CopyError(
                "capture_inputs(): a step of this copier is open; call it inside the "
                "graph capture, outside any step"
            )
        if self._seg.staged:
            raise CopyError(
                f"capture_inputs(): {self._seg.staged} copies are staged; land them "
                "(flush()) before the capture begins"
            )
        if not self._backend.is_capturing(self._stream):
            raise CopyError(
                "capture_inputs(): the copier's stream is not capturing a graph; call it "
                "inside the capture, where the scatter node belongs (before the nodes "
                "that read the copies' destinations)"
            )
        if not self._backend.mapped_coherent():
            raise CopyError(
                f"capture_inputs(): mapped pinned memory on {self._backend.describe()} "
                "failed the coherence probe; a graph feed's node reads its mailbox through "
                "the mapping, so it is refused: use the ordinary step()"
            )
        feed = GraphFeed(self, blocks)
        self._feeds.append(feed)
        return feed

    def _end_graph_step(self) -> None:
        """A graph step's end: its open segment waits for its feed's next replay."""
        self._live()
        seg = self._seg
        if seg.staged:
            self._refuse_capture_change(seg.entries[0].site)
            self._feed_pending = self._feed
        else:
            if self._checker is not None:
                self._checker.verify_pending()
            self._feed_pending = None
        if self._guards_owed:
            self._fence_guards(False)

    def _replay_feed(self, feed: GraphFeed, graph) -> None:
        """:meth:`GraphFeed.replay`: post the pending graph step (if any), then replay."""
        self._live()
        if self._in_step:
            raise CopyError(
                f"graph feed {feed.index}: replay() while a step of this copier is open; "
                "leave the step(graph=feed) block first (its end leaves the copies for "
                "this replay)"
            )
        feed._check_replays()
        pending, self._feed_pending = self._feed_pending, None
        if pending is not None and self._seg.staged:
            if pending is feed:
                self._post_feed(feed, graph)
                return
            self._flush_segment()  # another feed's step: it lands first, in program order
        try:
            self._backend.graph_launch(graph, self._stream)
        except CopyError:
            raise
        except Exception as exc:
            raise CopyError(
                f"graph feed {feed.index}: replaying {graph!r} failed: {exc!r}"
            ) from exc
        feed._replays += 1

    def _post_feed(self, feed: GraphFeed, graph) -> None:
        """Cut the open segment, write it to ``feed``'s mailbox for the next replay, replay."""
        seg = self._seg
        entries = seg.entries
        slot = self._slot
        be = self._backend
        tag = feed._replays + 1
        posted = False
        try:
            if self._checker is not None:
                self._checker.before_flush(entries)
            start, end, nblocks, n = seg.cut(-1)
            total = end - start
            head = pack.HEADER_BYTES + n * pack.DESC_BYTES
            pin = slot.pinned
            turn = self._ring.acquires
            if pack.align(head) <= pack.FEED_CAPACITY and not feed._busy(tag, turn):
                # the header and table ride in the entry (one read for the node); the
                # data stays in the slot, which the ring keeps until the replay ran
                feed._post(
                    tag,
                    pin.device_ptr + start,
                    slot.mv[start : start + min(total, pack.align(head))],
                    turn,
                )
                posted = True
                how = "graph"
            else:
                # an ordinary launch right before the replay (a table larger than an
                # entry, or an entry an earlier replay may still read): carried whole,
                # or read mapped
                feed.fallbacks += 1
                cmax = self._carry_max
                mode = "inline" if total <= cmax else "mapped"
                how = self._land(start, end, nblocks, n, mode, cmax, slot, pin)
            slot.dirty = True  # read when the replay runs: the slot's event follows it
            if self._checker is not None:
                # the watches end where the replay starts: its feed node, first in the
                # graph, lands the copies before the graph's readers run
                self._checker.landed()
            be.graph_launch(graph, self._stream)
        except BaseException as exc:
            if posted:
                feed._unpost(tag)
            self._drop_segment(entries)
            if isinstance(exc, CopyError) or not isinstance(exc, Exception):
                raise
            raise CopyError(
                f"graph feed {feed.index}: replaying with {len(entries)} staged copies "
                f"failed: {exc!r}; their on_drop callbacks ran"
            ) from exc
        feed._replays += 1
        self.stats.add_segment(how, total)
        seg.finish()

    def activate(self) -> _PyActivation:
        """Make this the active copier for :func:`cucopy.copy` in this thread / task.

        Use it as ``with copier.activate():``; leaving the block restores the copier
        that was active before (a class, not a generator: cheaper per step).
        """
        return _Activation(self, _active)

    # -- validation ----------------------------------------------------------------------

    def _dst(self, site, dst) -> ArrayInfo:
        try:
            info = resolve(dst, self._handle)
        except TypeError as exc:
            raise TypeError(f"{_label(site)}: dst: {exc}") from None
        if info.device is None:
            raise ValueError(
                f"{_label(site)}: destination must be device memory, got host memory {info.label}"
            )
        if info.readonly:
            raise TypeError(f"{_label(site)}: {readonly_hint(info.label)}")
        if info.device is not self._backend.device and info.device != self._backend.device:
            raise ValueError(
                f"{_label(site)}: destination {info.label} is not on this copier's "
                f"device {self._backend.describe()}"
            )
        return info

    def _src(self, site, src, direction) -> ArrayInfo:
        try:
            info = resolve(src, self._handle)
        except TypeError as exc:
            raise TypeError(f"{_label(site)}: src: {exc}") from None
        if direction is _H2D:
            if info.device is not None:
                raise ValueError(
                    f"{_label(site)}: H2D site needs a host source, got device array {info.label}"
                )
        elif info.device is None:
            raise ValueError(
                f"{_label(site)}: D2D site needs a device source, got host array {info.label}"
            )
        elif info.device is not self._backend.device and info.device != self._backend.device:
            raise ValueError(
                f"{_label(site)}: source {info.label} is not on this copier's "
                f"device {self._backend.describe()}"
            )
        return info

    def _site(self, site, want_fill: bool):
        direction = getattr(site, "direction", None)
        if direction is None or not isinstance(site, CopySite):
            raise TypeError(f"site: expected a CopySite member, got {site!r}")
        if want_fill != (direction is _FILL):
            call = "fill_tail" if want_fill else "copy"
            raise ValueError(f"{site.label}: {call}() does not take a {direction.name} site")
        return direction

    # -- copy -------------------------------------------------------------------------------

    def copy(
        self,
        site: CopySite,
        dst,
        src,
        *,
        unchanged: bool = False,
        on_drop=None,
        guard: HostGuard | None = None,
    ) -> bool:
        """Copy ``src`` into ``dst`` through ``site``.

        Parameters
        ----------
        site : CopySite
            An ``H2D`` or ``D2D`` site.
        dst : array
            Device destination on the copier's device.
        src : array
            Host source (``H2D``) or device source (``D2D``): the same dtype and
            number of elements as ``dst``, and ``dst``'s shape, as torch's ``copy_``
            asks (without broadcasting; leading dimensions of size 1 aside: ``(1, 8)``
            fills ``(8,)``). One exception: a flat source (one dimension, leading
            dimensions of size 1 aside) fills any ``dst`` of as many elements in C
            order, as ``dst.reshape(-1)[:] = src`` would. So ``(8,)`` fills
            ``(2, 4)``, while ``(2, 4)`` into ``(8,)`` or ``(4, 2)`` is refused.
        unchanged : bool
            The caller asserts ``dst`` already holds these values; nothing is issued.
        on_drop : callable, optional
            Called if the staged copy is discarded before it lands.
        guard : HostGuard, optional
            Read ``src`` in place: ``src`` is a view of ``guard``'s pinned buffer
            (contiguous, or one 2-D row-strided view such as ``buf[:r, :c]``), and the
            copy is one asynchronous DMA from it, issued at the call (never merged,
            never snapshotted: it reads the bytes as they are when the stream runs
            it). The owner writes the buffer again only inside ``with
            guard.write():``. An ``H2D`` site only; refused during graph capture.
            With ``unchanged=True`` nothing is read and the guard is not used.

        Returns
        -------
        bool
            True when issued or staged, False when skipped.

        Raises
        ------
        TypeError, ValueError, CopyError
            Bad input, naming the site and the offending value; nothing staged is lost.
        """
        if guard is not None:
            return self._copy_guarded(site, dst, src, unchanged, on_drop, guard)
        if not unchanged:
            # the fast path: a merged H2D copy into a known destination, staged by the
            # segment (it checks the step, the thread and on_drop itself)
            r = self._try_h2d(site, dst, src, on_drop)
            if r:
                if r == BARRIER:
                    self._after_barrier(site)
                return True
        elif self._seg.try_skip(site, dst, src):
            # a valid unchanged copy of a known destination (not in check mode or
            # under capture: the segment's fast path is off then)
            self.stats.sites[site].skipped += 1
            return False
        return self._copy_general(site, dst, src, unchanged, on_drop)

    if _FastCopy is not None:
        # the compiled segment's fast path runs with no Python frame (it calls back
        # _copy_general on a miss, and the Python copy above for anything unusual)
        copy = _FastCopy(copy, lambda self, *a: self._copy_general(*a))

    def _after_barrier(self, site) -> None:
        """A copy through a barrier site was staged: land the open segment."""
        self._refuse_capture_change(site)
        self._flush_segment()

    def _copy_general(self, site, dst, src, unchanged, on_drop) -> bool:
        """``copy()`` past the fast path: validate, resolve, cache, then dispatch."""
        if self._closed or (self._in_step and self._owner != _thread_id()):
            self._live(site)
        direction = self._site(site, False)
        d = self._dst(site, dst)
        s = self._src(site, src, direction)
        if direction is _H2D and dst is not d:
            # cached for the fast paths: the merged one, and the eager one of a site
            # outside the plan
            fp = self._remember_dst(site, dst, d)
            if (
                fp is not None
                and type(src) is not np.ndarray
                and s.host is not None
                and src is not s
            ):
                fp = fingerprint_fn(src)  # a torch CPU tensor: its bytes found by identity
                if fp is not None:
                    self._seg.remember_src(src, fp, s.host, s.dtype)
        n = _pair_checked(site, d, s, on_drop)
        if unchanged:
            return self._skip(site, d, s, None)
        if n == 0:
            return False
        if direction is _H2D:
            return self._h2d(site, d, s, on_drop)
        return self._d2d(site, d, s, on_drop)

    def _copy_guarded(self, site, dst, src, unchanged, on_drop, guard) -> bool:
        """``copy(..., guard=guard)``: validate everything, then issue the copy in place.

        Every check runs before anything is issued or a staged segment is flushed, so
        an error leaves the copier as it was.
        """
        if self._closed or (self._in_step and self._owner != _thread_id()):
            self._live(site)
        direction = self._site(site, False)
        if not isinstance(guard, HostGuard):
            raise TypeError(
                f"{site.label}: guard: expected a cucopy.HostGuard, got {type(guard).__qualname__}"
            )
        if direction is not _H2D:
            raise ValueError(
                f"{site.label}: guard= reads a host source in place; a {direction.name} "
                "site has none"
            )
        if unchanged:  # nothing is read: the plain path skips (and verifies in check mode)
            return self._copy_general(site, dst, src, True, on_drop)
        guard._admit(site)  # closed, or its buffer freed: src (a view of it) is stale too
        d = self._dst(site, dst)
        s = self._src(site, src, direction)
        n = _pair_checked(site, d, s, on_drop)
        if n == 0:
            return False
        if dst is not d:
            # cached, as the general path caches it: the compiled copy takes the next
            # guarded copies into it without a Python call (_core/guard.c)
            self._remember_dst(site, dst, d)
        if self._backend.is_capturing(self._stream):
            raise ValueError(
                f"{site.label}: guard= is refused during graph capture: the graph would "
                "re-read the buffer at every replay, which no guard can fence; copy "
                "without guard= (a captured copy reads its pinned source at each replay)"
            )
        self._refuse_capture_change(site)
        use = guard._use(self, site)  # not pinned; check mode's bytes
        it = d.dtype.itemsize
        slo, shi = _layout.extent(s.ptr, s.shape, s.strides, it)
        guard._inside(site, s, slo, shi)
        copies = _in_place(site, d, s)
        dlo, dhi = _layout.extent(d.ptr, d.shape, d.strides, it)
        copy2d, stream = self._backend.copy2d, self._stream
        reads = [(sp, spitch, width, rows) for _, _, sp, spitch, width, rows in copies]
        if self._in_step:
            seg = self._seg
            if seg.staged and seg.overlaps(dlo, dhi):
                self._order_flush()  # staged copies into (or reading) dst land first
            for dp, dpitch, sp, spitch, width, rows in copies:
                copy2d(True, dp, dpitch, sp, spitch, width, rows, stream)
            # the slot's event then follows the step's work, and the guard's after it
            # (the compiled flush's, else _flush_rest's: _fence_guards)
            self._slot.dirty = True
            guard._issued(self, use, site, reads, True)
            self._guarded = bool(self._guards_owed)
        else:
            if self._seg.staged:  # a graph step not replayed yet: it comes first
                self._flush_segment()
            for dp, dpitch, sp, spitch, width, rows in copies:
                copy2d(True, dp, dpitch, sp, spitch, width, rows, stream)
            guard._issued(self, use, site, reads, False)
        return self._count_eager(site, "in_place" if site in self._merge else None)

    def _remember_dst(self, site, dst, d):
        """Cache a merged destination for the fast paths; returns its fingerprint function."""
        fp = fingerprint_fn(dst)
        f = _layout.form(d.ptr, d.shape, d.strides, d.dtype.itemsize) if fp else None
        # never cached: an empty copy (it stages nothing), a form too wide to stage
        if f is not None and d.size and pack.fits(*f[1:]):
            self._note_site(d.ptr, site)
            self._seg.remember(dst, fp, f, d.dtype, d.size, d.shape)
            self._remember_base(site, dst, fp)
        return fp

    def _remember_base(self, site, dst, fp) -> None:
        """Cache the array ``dst`` is a view of, so views made afresh each step are fast."""
        view = getattr(fp, "__cucopy_view__", None)
        base = getattr(dst, view[0], None) if view is not None else None
        if base is None:
            return
        try:
            b = self._dst(site, base)
        except (TypeError, ValueError):
            return
        f = _layout.form(b.ptr, b.shape, b.strides, b.dtype.itemsize)
        if f is not None and not pack.fits(*f[1:]):
            f = None  # too wide to stage whole: cached only as the base of its views
        self._seg.remember(base, fp, f, b.dtype, b.size, b.shape)

    def fill_tail(
        self, site: CopySite, dst, start: int, value, *, unchanged: bool = False, on_drop=None
    ) -> bool:
        """Write ``value`` into elements ``start:`` of the flattened ``dst``.

        Parameters
        ----------
        site : CopySite
            A ``FILL`` site.
        dst : array
            Device destination on the copier's device.
        start : int
            First element of the tail (0 <= start).
        value : scalar
            A number that ``dst``'s dtype holds exactly (``0.1`` does not fit
            float32; NaN and infinities fit every float dtype). Strings, and
            complex values into a real dtype, are refused.
        unchanged : bool
            The caller asserts the tail already holds ``value``.
        on_drop : callable, optional
            Called if the staged fill is discarded before it lands.

        Returns
        -------
        bool
            True when issued or staged, False when skipped or the tail is empty.
        """
        if not unchanged:
            # the fast path: a merged fill of a known destination, staged by the segment
            r = self._seg.try_fill(site, dst, start, value, on_drop)
            if r == SKIPPED:  # an empty tail of a known destination
                self.stats.add_skipped(site)
                return False
            if r:
                if r == BARRIER:
                    self._after_barrier(site)
                return True
        self._live(site)
        self._site(site, True)
        d = self._dst(site, dst)
        if dst is not d and site in self._merge:
            self._remember_dst(site, dst, d)
        if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
            raise ValueError(f"{site.label}: start must be an int >= 0, got {start!r}")
        start = int(start)
        pattern = _pattern(site, d.dtype, value)
        if on_drop is not None and not callable(on_drop):
            raise TypeError(f"{site.label}: on_drop must be callable, got {on_drop!r}")
        if unchanged:
            return self._skip(site, d, None, (start, pattern))
        if start >= d.size:
            self.stats.sites[site].skipped += 1
            return False
        return self._fill(site, d, start, pattern, on_drop)

    # -- skip --------------------------------------------------------------------------------

    def _skip(self, site, d, s, fill) -> bool:
        capturing = self._backend.is_capturing(self._stream)
        if self._in_step and capturing != self._capturing:
            self._refuse_capture_change(site)
        if capturing:
            raise ValueError(
                f"{site.label}: unchanged=True is refused during graph capture "
                "(a replay cannot know the values are unchanged)"
            )
        self.stats.sites[site].skipped += 1
        if check.CHECK_MODE:
            check.verify_unchanged(self, site, d, s, fill)
        return False

    # -- H2D ------------------------------------------------------------------------------

    def _h2d(self, site, d, s, on_drop) -> bool:
        if self._in_step and self._capturing:
            return self._capture_h2d(site, d, s)
        if not self._in_step:
            if self._backend.is_capturing(self._stream):
                return self._capture_h2d(site, d, s)
            return self._outside(site, d, s, None)
        if site not in self._merge:
            return self._eager_h2d(site, d, s, None)
        f = _layout.form(d.ptr, d.shape, d.strides, d.dtype.itemsize)
        if f is None or not pack.fits(*f[1:]):
            return self._eager_h2d(site, d, s, "layout")
        ptr, rows, width, pitch = f
        nbytes = rows * width
        lo, hi = ptr, ptr + (rows - 1) * pitch + width  # a form's strides are positive
        kind = pack.KIND_H2D if rows == 1 else pack.KIND_H2D_2D
        seg = self._seg
        if seg.append_h2d(site, on_drop, f, lo, hi, nbytes, kind, s.host):
            if self._checker is None and site not in self._barriers:
                return True
            return self._landed_by_barrier(site, seg.entries[-1], d, None)
        desc = (ptr, 0, 0, pitch, width, width, rows, kind, 0, 0)
        e, off = self._stage(site, on_drop, lo, hi, f, nbytes, desc, True)
        if e is None:
            return self._eager_h2d(site, d, s, "slot_full")
        slot = self._slot
        _snapshot(slot.array, off, s, nbytes, slot.mv)
        return self._landed_by_barrier(site, e, d, None)

    def _count_eager(self, site, reason) -> bool:
        """Count an eager copy, with its fallback reason for a merged site."""
        # the counters themselves: stats.sites would fold the pending merged counts first,
        # which an eager count neither needs nor changes
        st = self.stats._sites[site]
        st._eager += 1
        if reason is not None:
            st.fallback[reason] += 1
        return True

    def _landed_by_barrier(self, site, e, d, s) -> bool:
        """After staging entry ``e``: check mode's snapshot, then the site's barrier."""
        if self._checker is not None:
            self._checker.on_stage(e, d, s)
        if site in self._barriers:
            self._refuse_capture_change(site)
            self._flush_segment()
        return True

    def _refuse_capture_change(self, site) -> None:
        """Raise when the stream's capture state is no longer the one ``begin()`` saw.

        A step follows the capture state it began in: begun outside a capture, it
        stages into the ring slot, and work captured from the slot would replay bytes
        later steps wrote there; begun inside one, it issues plain copies of the
        caller's buffers, which, once the capture has ended, run late and read them
        refilled. Checked where a step issues work or skips (eager copies, barriers,
        the general path's skips); merged copies stay staged and the flush refuses them.
        """
        if not self._in_step:
            return
        capturing = self._backend.is_capturing(self._stream)
        if capturing == self._capturing:
            return
        if capturing:
            raise CopyError(
                f"{_label(site)}: a graph capture began on the copier's stream after "
                "begin(): this step's copies would be captured reading the ring slot, "
                "which later steps overwrite. End the step (flush) before the capture "
                "begins, or begin the step inside it; copies staged so far stay staged"
            )
        raise CopyError(
            f"{_label(site)}: the graph capture this step began in has ended: its copies "
            "would run as plain copies reading the caller's buffers late. End the step "
            "before the capture ends, and begin() the next one after it"
        )

    def _capture_h2d(self, site, d, s) -> bool:
        self._refuse_capture_change(site)
        pinned = s.pinned if s.pinned is not None else self._backend.is_pinned(s.ptr)
        if not pinned:
            raise ValueError(
                f"{site.label}: during graph capture an H2D source must be pinned "
                f"(the graph re-reads it at each replay), got pageable {s.label}"
            )
        if s.host is not None and not s.host.flags.c_contiguous:
            raise ValueError(
                f"{site.label}: during graph capture an H2D source must be "
                f"contiguous, got {s.label}"
            )
        off = 0
        for ptr, rows, width, pitch in _layout.blocks(d.ptr, d.shape, d.strides, d.dtype.itemsize):
            self._backend.copy2d(True, ptr, pitch, s.ptr + off, width, width, rows, self._stream)
            off += rows * width
        return self._count_eager(site, "capture" if site in self._merge else None)

    def _eager_h2d(self, site, d, s, reason) -> bool:
        self._refuse_capture_change(site)
        it = d.dtype.itemsize
        dptr, shape, strides = d.ptr, d.shape, d.strides
        # one 2-D form (most destinations): its strides are positive, so its bytes span
        # exactly the view's extent, and it is the view's one block
        f = _layout.form(dptr, shape, strides, it)
        if f is not None:
            ptr, rows, width, pitch = f
            nbytes = rows * width
            lo, hi = ptr, ptr + (rows - 1) * pitch + width
        else:
            nbytes = d.nbytes
            lo, hi = _layout.extent(dptr, shape, strides, it)
        seg = self._seg
        if seg.staged and seg.overlaps(lo, hi):  # (nothing staged overlaps nothing)
            self._order_flush()
        slot = self._slot
        top = seg.take_top(nbytes)
        if top >= 0:  # _eager_space's common case: the slot's top
            host_ptr = slot.pinned.ptr + top
            _snapshot(slot.array, top, s, nbytes, slot.mv)
        else:
            host_ptr, buf, off = self._eager_space(nbytes)
            _snapshot(buf, off, s, nbytes)
        copy2d, stream = self._backend.copy2d, self._stream
        if f is not None:
            copy2d(True, ptr, pitch, host_ptr, width, width, rows, stream)
        else:
            pos = 0
            for ptr, rows, width, pitch in _layout.blocks(dptr, shape, strides, it):
                copy2d(True, ptr, pitch, host_ptr + pos, width, width, rows, stream)
                pos += rows * width
        slot.dirty = True
        return self._count_eager(site, reason)

    def _eager_space(self, nbytes):
        """Pinned space for an eager snapshot: the slot's top, else a temporary buffer."""
        slot = self._slot
        top = self._seg.take_top(nbytes)
        if top >= 0:
            return slot.pinned.ptr + top, slot.array, top
        self._ring.note_overflow(nbytes)
        tmp = self._ring.temp_pinned(nbytes)  # kept by the ring: never freed mid-run
        return tmp.ptr, tmp.array, 0

    # -- D2D ------------------------------------------------------------------------------

    def _d2d(self, site, d, s, on_drop) -> bool:
        if not self._in_step:
            if self._backend.is_capturing(self._stream):
                return self._capture_d2d(site, d, s)
            return self._outside(site, d, s, None)
        if self._capturing:
            return self._capture_d2d(site, d, s)
        it = d.dtype.itemsize
        lo, hi = _layout.extent(d.ptr, d.shape, d.strides, it)
        slo, shi = _layout.extent(s.ptr, s.shape, s.strides, it)
        pair = _pair(d, s)
        if site not in self._merge:
            return self._eager_d2d(site, d, s, None)
        if pair is None or not (pack.fits(*pair[0][1:]) and pack.fits(*pair[1][1:])):
            return self._eager_d2d(site, d, s, "layout")
        if lo < shi and slo < hi:
            return self._eager_d2d(site, d, s, "overlap")
        if self._seg.overlaps(slo, shi, False):
            self._order_flush()  # the source is a staged destination: land it first
        (dptr, rows, width, dpitch), (sptr, _, _, spitch) = pair
        desc = (dptr, sptr, 0, dpitch, spitch, width, rows, pack.KIND_D2D, 0, 0)
        e, _ = self._stage(site, on_drop, lo, hi, pair[0], 0, desc)
        if e is None:
            return self._eager_d2d(site, d, s, "slot_full")
        e.slo, e.shi = slo, shi
        self._seg.add_read(slo, shi)
        return self._landed_by_barrier(site, e, d, s)

    def _capture_d2d(self, site, d, s) -> bool:
        self._refuse_capture_change(site)
        pair = _pair(d, s)
        if pair is None:
            raise ValueError(
                f"{site.label}: during graph capture a D2D copy needs contiguous or "
                f"matching 2-D layouts, got dst {d.label}, src {s.label}"
            )
        (dptr, rows, width, dpitch), (sptr, _, _, spitch) = pair
        self._backend.copy2d(False, dptr, dpitch, sptr, spitch, width, rows, self._stream)
        return self._count_eager(site, "capture" if site in self._merge else None)

    def _eager_d2d(self, site, d, s, reason) -> bool:
        self._refuse_capture_change(site)
        it = d.dtype.itemsize
        lo, hi = _layout.extent(d.ptr, d.shape, d.strides, it)
        slo, shi = _layout.extent(s.ptr, s.shape, s.strides, it)
        seg = self._seg
        if seg.overlaps(lo, hi) or seg.overlaps(slo, shi, False):
            self._order_flush()
        pair = _pair(d, s)
        be, stream = self._backend, self._stream
        if pair is not None and not (lo < shi and slo < hi):
            (dptr, rows, width, dpitch), (sptr, _, _, spitch) = pair
            be.copy2d(False, dptr, dpitch, sptr, spitch, width, rows, stream)
        else:
            # through a dense temporary: any layout on either side, overlap included
            tmp = self._ring.temp_device(d.nbytes)
            pos = 0
            for ptr, rows, width, pitch in _layout.blocks(s.ptr, s.shape, s.strides, it):
                be.copy2d(False, tmp.ptr + pos, width, ptr, pitch, width, rows, stream)
                pos += rows * width
            pos = 0
            for ptr, rows, width, pitch in _layout.blocks(d.ptr, d.shape, d.strides, it):
                be.copy2d(False, ptr, pitch, tmp.ptr + pos, width, width, rows, stream)
                pos += rows * width
        self._slot.dirty = True
        return self._count_eager(site, reason)

    # -- fill ------------------------------------------------------------------------------

    def _fill(self, site, d, start, pattern, on_drop) -> bool:
        it = d.dtype.itemsize
        if not self._in_step:
            if self._backend.is_capturing(self._stream):
                return self._capture_fill(site, d, start, pattern)
            return self._outside(site, d, None, (start, pattern))
        if self._capturing:
            return self._capture_fill(site, d, start, pattern)
        f = _layout.form(d.ptr, d.shape, d.strides, it)
        if site not in self._merge:
            return self._eager_fill(site, d, start, pattern, None)
        if f is None or it not in _FILL_ELEMS:
            return self._eager_fill(site, d, start, pattern, "layout")
        parts = _layout.tail_blocks(f, start, it)
        if not all(pack.fits(*p[1:]) for p in parts):  # wider than a descriptor's fields
            return self._eager_fill(site, d, start, pattern, "layout")
        lo = min(p[0] for p in parts)
        last = parts[-1]
        hi = last[0] + (last[1] - 1) * last[3] + last[2]
        value = int.from_bytes(pattern, "little")
        descs = [(p[0], 0, value, p[3], 0, p[2], p[1], pack.KIND_FILL, it, 0) for p in parts]
        geom = parts[0] if len(parts) == 1 else None
        e, _ = self._stage(site, on_drop, lo, hi, geom, 0, descs)
        if e is None:
            return self._eager_fill(site, d, start, pattern, "slot_full")
        e.value = (start, pattern)
        return self._landed_by_barrier(site, e, d, None)

    def _capture_fill(self, site, d, start, pattern) -> bool:
        self._refuse_capture_change(site)
        it = d.dtype.itemsize
        if it not in _FILL_ELEMS:
            raise ValueError(
                f"{site.label}: during graph capture fill_tail needs 1, 2, 4 or "
                f"8-byte elements, got {d.label}"
            )
        self._issue_fill(d, start, pattern)
        return self._count_eager(site, "capture" if site in self._merge else None)

    def _issue_fill(self, d, start, pattern) -> None:
        it = d.dtype.itemsize
        value = int.from_bytes(pattern, "little")
        f = _layout.form(d.ptr, d.shape, d.strides, it)
        if f is not None:
            parts = _layout.tail_blocks(f, start, it)
        else:
            flat = _flat_tail_blocks(d, start)
            parts = flat
        for ptr, rows, width, pitch in parts:
            self._backend.fill(ptr, pitch, width, rows, value, it, self._stream)

    def _eager_fill(self, site, d, start, pattern, reason) -> bool:
        self._refuse_capture_change(site)
        it = d.dtype.itemsize
        lo, hi = _layout.extent(d.ptr, d.shape, d.strides, it)
        if self._seg.overlaps(lo, hi):
            self._order_flush()
        if it in _FILL_ELEMS:
            self._issue_fill(d, start, pattern)
        else:
            # an element the fill kernel does not take: upload the tail's bytes instead
            count = d.size - start
            nbytes = count * it
            host_ptr, buf, off = self._eager_space(nbytes)
            buf[off : off + nbytes] = np.frombuffer(pattern * count, np.uint8)
            pos = 0
            for ptr, rows, width, pitch in _flat_tail_blocks(d, start):
                self._backend.copy2d(
                    True, ptr, pitch, host_ptr + pos, width, width, rows, self._stream
                )
                pos += rows * width
        self._slot.dirty = True
        return self._count_eager(site, reason)

    # -- outside a step -------------------------------------------------------------------

    def _outside(self, site, d, s, fill) -> bool:
        """An eager copy outside a step, snapshotted through the current slot."""
        if self._seg.staged:  # a graph step not replayed yet: it comes first in program order
            self._flush_segment()
        nbytes = d.nbytes if fill is None else (d.size - fill[0]) * d.dtype.itemsize
        slot = self._slot
        # pinned bytes the copy writes at the call: an H2D snapshot, or the tail of a
        # fill whose elements the fill kernel does not take
        snap = s.device is None if s is not None else d.dtype.itemsize not in _FILL_ELEMS
        # Temporaries go back to the ring only when their slot comes round, which a
        # copy outside a step never brought about: the slot would collect one per call
        # (a D2D through a device temporary, a snapshot larger than the slot). Move on
        # when the slot holds any (the ring waits only for a slot still in flight).
        if slot is None or slot.temps or (snap and not self._seg.room(nbytes)):
            self._advance()
        self._in_step = True
        self._capturing = False  # the caller saw the stream not capturing
        self._owner = _thread_id()
        try:
            if fill is not None:
                self._eager_fill(site, d, fill[0], fill[1], None)
            elif s.device is None:
                self._eager_h2d(site, d, s, None)
            else:
                self._eager_d2d(site, d, s, None)
        finally:
            self._in_step = False
        self._ring.record(self._stream)
        if site in self._merge:
            self.stats.sites[site].fallback["outside_step"] += 1
        return True

    # -- the open segment ---------------------------------------------------------------------

    def _stage(self, site, on_drop, lo, hi, geom, nbytes, descs, h2d=False):
        """Stage descriptor(s) ``descs`` with ``nbytes`` of data, flushing first for order.

        Returns ``(entry, offset)``, or ``(None, -1)`` when the slot is full.
        """
        seg = self._seg
        if seg.seg < 0:
            # a segment opens: a capture that began since begin() would leave what is
            # staged now out of its graph (the fast path asks here too)
            self._refuse_capture_change(site)
        self._note_site(descs[0][0] if isinstance(descs, list) else descs[0], site)
        for _ in range(2):
            r = seg.stage(site, on_drop, lo, hi, geom, nbytes, descs, h2d)
            if r == ORDER:
                self._order_flush()
                continue
            if r == FULL:
                # the data is counted where the eager fallback puts its snapshot
                n = len(descs) if isinstance(descs, list) else 1
                self._ring.note_overflow(n * pack.DESC_BYTES + pack.ALIGN)
                return None, -1
            return r
        raise AssertionError("internal: a fresh segment refused a descriptor")

    def _note_site(self, ptr: int, site) -> None:
        """Remember the site staging into ``ptr`` (named by a wait past its deadline).

        Called where a destination is first cached and on the general staging path,
        never on the compiled fast path."""
        at = self._sites_at
        if len(at) >= 4096:
            at.clear()
        at[ptr] = site

    def _order_flush(self) -> None:
        if self._seg.staged:
            self._refuse_capture_change(self._seg.entries[0].site)
        self.stats.eager_flushes += 1
        self._flush_segment()

    def _flush_error(self, entries, exc: BaseException) -> BaseException:
        """A flush of ``entries`` failed with ``exc``: drop the segment, return what to raise."""
        self._drop_segment(entries)
        if isinstance(exc, CopyError) or not isinstance(exc, Exception):
            return exc  # re-raised as it is
        return CopyError(
            f"{_label(entries[0].site)}: flushing {len(entries)} staged copies "
            f"failed: {exc!r}; their on_drop callbacks ran"
        )

    def _drop_segment(self, entries) -> None:
        """A segment whose launch failed: drop it (the slot stays usable), run its ``on_drop``."""
        seg = self._seg
        seg.reset()
        seg.set_cursor(pack.align(seg.cursor))
        self._slot.dirty = True
        if self._checker is not None:
            self._checker.dropped()  # the sentinel's bytes back, the watches off
        try:
            self._run_drops(entries)
        except CopyError:
            pass  # the launch's own error is the one reported

    def _flush_segment(self, cut=None) -> None:
        """Issue the open segment: header + descriptors, then one upload and one launch.

        ``cut``: the segment already cut (:meth:`_flush_fast` could not launch it carried
        whole), landed by its mode's path.
        """
        seg = self._seg
        entries = seg.entries
        if not entries:
            return
        slot = self._slot
        checker = self._checker
        mode = self.flush_mode
        cmax = self._carry_max
        landed = False
        try:
            pin = slot.pinned
            if cut is None:
                if checker is not None:
                    checker.before_flush(entries)
                if mode in ("inline", "auto"):
                    launcher = self._launcher
                    # (auto with graphed launches: _land picks graphed or carried)
                    if launcher is not None and not (mode == "auto" and self._graph_cap):
                        # cut and, when the whole segment fits, the carried launch, in one call
                        cut = seg.flush_carried(launcher, self._handle, cmax, pin.device_ptr)
                    else:
                        cut = seg.cut(cmax)
                elif mode == "mapped" and self._graph_cap:
                    # its table compacted when the segment then fits a graphed launch's
                    # read (a table reserved for a longer step leaves a gap)
                    cut = seg.cut(pack.graph_max(self._graph_cap))
                else:
                    cut = seg.cut(-1)
            if cut.__class__ is int:
                total = cut
                how = "inline"
            else:
                start, end, nblocks, n = cut
                how = self._land(start, end, nblocks, n, mode, cmax, slot, pin)
                total = end - start
            landed = True
            if checker is not None:
                checker.landed()  # its watches end after the launch that lands the copies
            # (_land marked the slot: an event owed, or its tag armed; an inline launch
            # took its bytes at enqueue, so it needs neither, and the slot may be
            # rewritten)
            self.stats.add_segment(how, total)
            entries = None  # the segment recycles entries no one else holds (compiled twin)
            seg.finish()
        except BaseException as exc:
            if landed:
                # launched, then interrupted (KeyboardInterrupt) before the segment was
                # closed: close it now, or the next flush would cut it again
                slot.dirty = True
                if seg.seg >= 0:
                    seg.finish()
                raise
            err = self._flush_error(entries, exc)
            if err is exc:
                raise  # a CopyError already names the site; KeyboardInterrupt stays one
            raise err from exc

    def _land(self, start, end, nblocks, n, mode, cmax, slot, pin) -> str:
        """Launch a cut segment by ``mode``'s path; returns the path taken.

        A launch that reads the slot when it runs leaves the slot's event owed
        (``slot.dirty``), or, a graphed launch that is the step's first reader of the
        slot, the slot's completion tag armed with the step (``slot.tag``): the kernel
        writes it back when done, and no event need follow unless more work reads the
        slot later in the step (which marks it dirty)."""
        be = self._backend
        # the header and the table (past the table's end may lie reserved space)
        head = pack.HEADER_BYTES + n * pack.DESC_BYTES
        total = end - start
        gcap = self._graph_cap
        # (0: no graphs, or too long for one, or for auto's choice of one)
        reach = pack.graph_reach(gcap, total, mode == "auto")
        if (
            reach
            and (mode == "mapped" or (mode == "auto" and total <= self._mapped_max))
            and start + reach <= min(slot.size, slot.top)
        ):
            # graphed: the kernel reads gcap bytes at the segment when it runs (all of a
            # longer segment), so the slot's next segment starts past them
            # (its event or tag guards them till then).
            # auto too: a graph launch costs the host half a carried launch (the GPU
            # about 2 us more, reading mapped memory: bench/README.md, session 12)
            # The step's first reader of the slot is tagged: when it is also the last,
            # the flush records no event and the slot's next turn asks none
            seg_at = pin.device_ptr + start
            if self._tags and not slot.dirty and slot.tag < 0:
                step = self._ring.acquires
                slot.cell[0] = step  # armed: what the kernel writes back when done
                cell = pin.device_ptr + pack.TAG_AT
                tagged = be.scatter_graphed(seg_at, nblocks, self._stream, cell)
            else:
                tagged = be.scatter_graphed(seg_at, nblocks, self._stream)
            if tagged:
                slot.tag = step
            else:
                # read when the launch runs: the slot's event follows it. (Where no graph
                # may launch on the stream, the backend launched it mapped, uncarried;
                # the compiled flush carries it instead. Either reads at most the
                # segment, and the armed cell[0] is never copied: slot.tag stays -1.)
                slot.dirty = True
            if end < start + reach:
                self._seg.set_cursor(start + reach)
            return "mapped"
        if mode in ("inline", "auto") and total <= cmax:
            # the whole segment travels in the launch: nothing read at run time
            be.scatter(pin.device_ptr + start, nblocks, self._stream, True, total, pin.ptr + start)
            return "inline"
        slot.dirty = True  # read when the launch runs: the slot's event follows it
        if mode == "mapped" or (
            mode != "dma"
            and total <= self._mapped_max
            and (head <= cmax or (n <= _MAPPED_MAX_DESCS and total <= _UNCARRIED_MAPPED_MAX))
        ):
            # the header and the table travel (not the reserved space after it)
            carry = pack.align(head) if head <= cmax else 0
            be.scatter(pin.device_ptr + start, nblocks, self._stream, True, carry, pin.ptr + start)
            return "mapped"
        be.copy2d(
            True, slot.staging.ptr + start, total, pin.ptr + start, total, total, 1, self._stream
        )
        be.scatter(slot.staging.ptr + start, nblocks, self._stream, False)
        return "dma"


_active: contextvars.ContextVar = contextvars.ContextVar("cucopy_active_copier", default=None)


_incoherent_said: set = set()


def _pair_checked(site, d, s, on_drop) -> int:
    """A copy's destination and source agree (dtype, size, shape) and ``on_drop`` is
    callable or None; returns the elements copied. Raises naming the site."""
    if d.dtype != s.dtype:
        raise TypeError(f"{site.label}: dtype mismatch: dst {d.label}, src {s.label}")
    n = d.size
    if n != s.size:
        raise ValueError(
            f"{site.label}: size mismatch: dst has {n} elements ({d.label}), "
            f"src has {s.size} ({s.label})"
        )
    if d.shape != s.shape and len(s.shape) != 1 and not fits_shape(d.shape, s.shape):
        raise ValueError(
            f"{site.label}: shape mismatch: dst {d.label}, src {s.label}; src must "
            "have dst's shape (leading dimensions of size 1 aside) or be flat"
        )
    if on_drop is not None and not callable(on_drop):
        raise TypeError(f"{site.label}: on_drop must be callable, got {on_drop!r}")
    return n


def _say_incoherent(where: str, mode: str) -> None:
    """Log once per device that its mapped memory failed the coherence probe."""
    if where in _incoherent_said:
        return
    _incoherent_said.add(where)
    import logging

    logging.getLogger("cucopy").warning(
        "cucopy: %s: mapped pinned memory failed the coherence probe (the device read "
        "other bytes than the host wrote through the mapping, as under GPU confidential "
        "computing): copiers on it use flush_mode='dma' instead of %r, and graph feeds "
        "are refused",
        where,
        mode,
    )


def _collected(ring, seg, where: str) -> None:
    """The finalizer of a copier the garbage collector took without :meth:`close`.

    Nothing staged is lost without a word: copies still staged cannot land here (a
    collection may run anywhere, inside a stream hold too, and a launch from a
    finalizer would race the thread that dropped the copier), so they are dropped
    through their ``on_drop`` callbacks, with a :class:`ResourceWarning` naming them.
    The ring is set aside and freed later (:func:`cucopy.ring.free_orphans`).
    """
    try:
        entries = seg.reset() if seg.staged else []
        if entries:
            sites: dict = {}
            for e in entries:
                sites[_label(e.site)] = sites.get(_label(e.site), 0) + 1
            warnings.warn(
                f"cucopy: a DeviceCopier on {where} was collected without close() with "
                f"{len(entries)} staged copies ("
                + ", ".join(f"{k} x{v}" for k, v in sites.items())
                + "): they never land; dropped, their on_drop callbacks called. Close the "
                "copier (`with copier:`) or end its step to land them",
                ResourceWarning,
                stacklevel=2,
            )
            for e in entries:
                for cb in e.on_drop or ():
                    try:
                        cb()
                    except Exception as exc:  # every callback runs; each failure is said
                        warnings.warn(
                            f"cucopy: {_label(e.site)}: on_drop raised {exc!r} while a "
                            "collected copier dropped its staged copies",
                            ResourceWarning,
                            stacklevel=2,
                        )
    finally:
        orphan(ring)


if _COMPILED:
    # begin() and flush() are the compiled core's own (CopierCore.begin and .flush: the
    # common step with no Python frame, the rest through _begin_body and _flush_rest);
    # the Python definitions above are the pure-Python twin's
    del DeviceCopier.begin, DeviceCopier.flush

if _CompiledStepCore is not None:
    # step()'s compiled entry opens the step itself only for this begin(); a subclass
    # that overrides begin() has its own called
    _CompiledStepCore._plain_begin(DeviceCopier.begin)
    # and its exit calls _flush_fast itself only for this flush()
    _CompiledStepCore._plain_flush(DeviceCopier.flush)


_patterns: dict = {}


def _pattern(site, dtype, value) -> bytes:
    """The bytes of ``value`` as one element of ``dtype`` (checked to be exact)."""
    # int fills (-1, 0) repeat every step; converting through NumPy costs microseconds
    key = (dtype, value) if type(value) is int else None
    if key is not None:
        hit = _patterns.get(key)
        if hit is not None:
            return hit
    try:
        with np.errstate(over="raise", invalid="raise"):
            arr = np.asarray(value)
            if arr.ndim != 0:
                raise ValueError("not a scalar")
            if arr.dtype.kind in "USV" or isinstance(value, (str, bytes)):
                raise TypeError("not a number")
            if arr.dtype.kind == "c" and dtype.kind != "c":
                raise TypeError("a complex value into a real dtype")
            cast = arr.astype(dtype)
            if dtype.kind in "biufc" and not _same_number(arr.item(), cast.item()):
                raise ValueError("not representable")
    except (ValueError, TypeError, OverflowError, FloatingPointError) as exc:
        raise ValueError(
            f"{_label(site)}: fill value {value!r} does not fit dtype {dtype} ({exc})"
        ) from None
    out = cast.tobytes()
    if key is not None and len(_patterns) < 4096:
        _patterns[key] = out
    return out


def _same_number(a, b) -> bool:
    """Exact equality of two Python numbers, NaN equal to NaN (Python compares an int
    and a float exactly, so ``2**53 + 1`` does not equal ``2.0**53``)."""
    return a == b or (a != a and b != b)


def _snapshot(buf, off, s, nbytes, mv=None) -> None:
    """Copy the host source's bytes into pinned memory at ``buf[off:]`` (C order).

    ``mv``: a memoryview of ``buf``, the cheaper target for a C-contiguous source.
    """
    host = s.host
    if mv is not None:
        try:
            m = host.data  # no buffer format for some dtypes (datetime64): the path below
            flat = m.cast("B") if m.c_contiguous else None
        except (ValueError, TypeError, BufferError):
            flat = None
        if flat is not None:
            mv[off : off + nbytes] = flat
            return
    if host.flags.c_contiguous:
        buf[off : off + nbytes] = host.reshape(-1).view(np.uint8)
    else:
        np.copyto(buf[off : off + nbytes].view(host.dtype).reshape(host.shape), host)


def _in_place(site, d, s) -> list:
    """The 2-D copies of an in-place H2D copy from host view ``s`` into ``d``:
    ``(dst, dpitch, src, spitch, width, rows)`` each, in C order."""
    it = d.dtype.itemsize
    fs = _layout.form(s.ptr, s.shape, s.strides, it)
    if fs is None:
        raise ValueError(
            f"{site.label}: guard=: the source must be contiguous or one 2-D row-strided "
            f"view (such as buf[:r, :c]), got {s.label} with strides {s.strides}"
        )
    pair = _pair(d, s)
    if pair is not None:
        (dp, rows, width, dpitch), (sp, _, _, spitch) = pair
        return [(dp, dpitch, sp, spitch, width, rows)]
    sp, srows, swidth, spitch = fs
    blocks = _layout.blocks(d.ptr, d.shape, d.strides, it)
    out = []
    if srows == 1 or spitch == swidth:  # a contiguous source: a copy per block of dst
        for ptr, rows, width, pitch in blocks:
            out.append((ptr, pitch, sp, width, width, rows))
            sp += rows * width
        return out
    # a row-strided source into a destination of other rows: walk both in C order
    r = soff = 0
    for ptr, rows, width, pitch in blocks:
        for k in range(rows):
            dp, left = ptr + k * pitch, width
            while left:
                take = min(left, swidth - soff)
                out.append((dp, take, sp + r * spitch + soff, take, take, 1))
                dp += take
                left -= take
                soff += take
                if soff == swidth:
                    r, soff = r + 1, 0
    return out


def _pair(d, s):
    """Matching 2-D forms of a D2D copy's two sides, or None."""
    it = d.dtype.itemsize
    fd = _layout.form(d.ptr, d.shape, d.strides, it)
    fs = _layout.form(s.ptr, s.shape, s.strides, it)
    if fd is None or fs is None:
        return None
    if fd[1:3] == fs[1:3]:
        return fd, fs
    if fs[1] == 1 and fd[1] * fd[2] == fs[2]:
        return fd, (fs[0], fd[1], fd[2], fd[2])
    if fd[1] == 1 and fs[1] * fs[2] == fd[2]:
        return (fd[0], fs[1], fs[2], fs[2]), fs
    return None


def _flat_tail_blocks(d, start) -> list:
    """2-D forms covering elements ``start:`` of any view, in C order."""
    it = d.dtype.itemsize
    out = []
    skip = start
    for blk in _layout.blocks(d.ptr, d.shape, d.strides, it):
        ptr, rows, width, pitch = blk
        count = rows * width // it
        if skip >= count:
            skip -= count
            continue
        out.extend(_layout.tail_blocks(blk, skip, it) if skip else [blk])
        skip = 0
    return out


# -- module-level routing ----------------------------------------------------------------

# Plan-less copiers for copies made with no active copier, by (device, stream): each
# call takes an idle one (or makes one) for its duration, so threads that activated
# nothing (a pool's threads never inherit the active copier) never share one: a
# copier's step state is set per call, and its ring slot is written at the call.
_plain: dict = {}
_plain_lock = threading.Lock()


#: module-level copies and fills made with no copier to route to (plain copies), by site
unrouted: collections.Counter = collections.Counter()


def active_copier() -> DeviceCopier | None:
    """The copier :func:`cucopy.copy` routes to here, if any.

    The copier active in this thread / task: the one whose ``step()`` block is open
    (a step activates its copier for the block; the innermost, when several are), or
    the one :func:`activate <DeviceCopier.activate>` made active.
    """
    c = _active.get()
    return c if c is not None else _step_copier()


def _step_copier() -> DeviceCopier | None:
    """With the compiled step: the copier whose ``step()`` block is open in this context.

    The compiled step records the context it was entered in rather than setting the
    context variable (``_core/copier.c``, "a step activates its copier"), so a module-level
    call that finds no copier activated looks here: a scan of the live copiers, on a
    path the steady step never takes. (The pure-Python step sets the variable.)
    """
    if _context_id is None:
        return None
    ctx = _context_id()
    best = None
    for c in check.live_copiers():
        if c._step_ctx == ctx and (best is None or c._step_seq > best._step_seq):
            best = c
    return best


def _unrouted(site, dst, call: str) -> None:
    """A module-level call with no active copier: count it as unrouted (a plain copy).

    Raises :class:`CopyError` for an unrouted call when check mode refuses them
    (``cucopy.check.REFUSE_UNROUTED``).
    """
    if check.CHECK_MODE and check.REFUSE_UNROUTED:
        try:
            what = resolve(dst).label
        except Exception:
            what = repr(dst)
        others = [c for c in check.live_copiers() if not c.__dict__.get("_plain")]
        why = (
            "no copier exists"
            if not others
            else f"{len(others)} copier(s) exist but none is active here"
        )
        raise CopyError(
            f"{_label(site)}: cucopy.{call}() into dst={what} has no copier to route to "
            f"({why}: no activate() block and no step() block open in this thread); check "
            f"mode refuses unrouted copies (cucopy.check.REFUSE_UNROUTED, from "
            f"CUCOPY_CHECK_UNROUTED=1). Open the copier's step() or activate() it around "
            "this call"
        )
    unrouted[site] += 1


def _plain_key(dst, site):
    """``(key, device, stream)`` of the plain copiers for ``dst``'s device and stream."""
    from .adapters import current_stream, stream_handle

    try:
        info = resolve(dst)
    except TypeError as exc:
        raise TypeError(f"{_label(site)}: dst: {exc}") from None
    if info.device is None:
        raise ValueError(
            f"{_label(site)}: destination must be device memory, got host memory {info.label}"
        )
    stream = current_stream(dst)
    # by handle: torch builds a new Stream object for the same stream on every call
    try:
        skey = stream_handle(stream) if stream is not None else None
    except TypeError:
        skey = id(stream)
    return (info.device if isinstance(info.device, int) else id(info.device), skey), info, stream


def _lease(dst, site=None):
    """An idle plain copier for ``dst`` (made when none is idle), taken from the pool:
    ``(key, copier)``; hand it back with :func:`_give_back`."""
    key, info, stream = _plain_key(dst, site)
    with _plain_lock:
        idle = _plain.setdefault(key, [])
        while idle:
            c = idle.pop()
            if not c.closed:
                return key, c
    from .backends import sim

    backend = "sim" if isinstance(info.device, sim.SimDevice) else "cuda"
    c = DeviceCopier(
        None, stream=stream, device=info.device, backend=backend, slots=4, capacity=1 << 16
    )
    c._plain = True  # not an engine's copier (the refusal's message counts those)
    return key, c


def _give_back(key, c) -> None:
    if not c.closed:
        with _plain_lock:
            _plain[key].append(c)


def _plain_copier(dst, site=None) -> DeviceCopier:
    """A plan-less copier for ``dst``'s device and its library's current stream.

    For its backend and stream (a copy goes through one taken for the call alone).
    """
    key, c = _lease(dst, site)
    _give_back(key, c)
    return c


def copy(
    site: CopySite,
    dst,
    src,
    *,
    unchanged: bool = False,
    on_drop=None,
    guard: HostGuard | None = None,
) -> bool:
    """Copy through the active copier, or as a plain async copy when none is active.

    The active copier is the one whose ``step()`` block is open here, or the one
    activated here (:func:`active_copier`). A plain copy is counted in
    ``cucopy.copier.unrouted`` (shown by :func:`cucopy.show_config`), and refused in
    check mode when ``cucopy.check.REFUSE_UNROUTED`` is set. A plain copy goes on the
    array library's current stream and is still snapshotted (the caller may overwrite
    a host source right after), unless ``guard=`` reads it in place
    (:class:`~cucopy.HostGuard`). Threads (and
    tasks) with no active copier may make plain copies at the same time: each call
    has a plan-less copier to itself.
    See :meth:`DeviceCopier.copy` for the parameters.
    """
    if guard is not None:  # (passed on only when given: the compiled copy takes it apart)
        return _copy_guarded(site, dst, src, unchanged, on_drop, guard)
    c = _active.get()
    if c is None:
        c = _step_copier()
    if c is not None:
        return c.copy(site, dst, src, unchanged=unchanged, on_drop=on_drop)
    _unrouted(site, dst, "copy")
    key, c = _lease(dst, site)
    try:
        return c.copy(site, dst, src, unchanged=unchanged, on_drop=on_drop)
    finally:
        _give_back(key, c)


def _copy_guarded(site, dst, src, unchanged, on_drop, guard) -> bool:
    """:func:`copy` with ``guard=``: through the active copier, or a plain copier."""
    c = active_copier()
    if c is not None:
        return c.copy(site, dst, src, unchanged=unchanged, on_drop=on_drop, guard=guard)
    _unrouted(site, dst, "copy")
    key, c = _lease(dst, site)
    try:
        return c.copy(site, dst, src, unchanged=unchanged, on_drop=on_drop, guard=guard)
    finally:
        _give_back(key, c)


if _FastRoute is not None:
    # to the active copier's compiled copy with no Python frame; the function above
    # for a plain copy (no active copier) and anything else
    copy = _FastRoute(_active, copy)


def fill_tail(
    site: CopySite, dst, start: int, value, *, unchanged: bool = False, on_drop=None
) -> bool:
    """Fill a tail through the active copier, or plainly when none is active.

    See :meth:`DeviceCopier.fill_tail` for the parameters.
    """
    c = _active.get()
    if c is None:
        c = _step_copier()
    if c is not None:
        return c.fill_tail(site, dst, start, value, unchanged=unchanged, on_drop=on_drop)
    _unrouted(site, dst, "fill_tail")
    key, c = _lease(dst, site)
    try:
        return c.fill_tail(site, dst, start, value, unchanged=unchanged, on_drop=on_drop)
    finally:
        _give_back(key, c)


def flush() -> None:
    """Flush the active copier (a barrier); nothing to do when none is active.

    The active copier: see :func:`active_copier` (a step activates its copier).
    """
    c = active_copier()
    if c is not None:
        c.flush()
