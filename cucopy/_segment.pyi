"""Type stubs for the compiled staging core ``cucopy._segment`` (built from cucopy/_core/).

Members the C declares as Python objects (``T_OBJECT``, ``T_OBJECT_EX``, a
``PyObject *`` field) hold whatever Python code stores there: they are typed
``object``. Integer members (``T_LONGLONG``, ``T_ULONGLONG``, ``T_PYSSIZET``) are
``int``; read-only members are properties. Parameters follow the C's argument
parsing: positional-only unless the C accepts keywords. Types without
``Py_TPFLAGS_BASETYPE`` are ``@final``; the base classes with C fields are
``@disjoint_base`` (no class derives from two of them). tests/test_stubs.py checks this file
against the built module, name by name.
"""

from collections.abc import Callable, Container, Hashable
from contextvars import ContextVar
from types import TracebackType
from typing import Any, Literal, TypeVar, final, overload

from typing_extensions import disjoint_base

_T = TypeVar("_T")

#: a descriptor in ``cucopy.pack.DESC_DTYPE`` field order (ten integers)
_Desc = tuple[int, int, int, int, int, int, int, int, int, int]
#: ``cut()``'s ``(seg, end, nblocks, ndesc)``
_Cut = tuple[int, int, int, int]

def thread_id() -> int: ...
def _context_id() -> int: ...
def _native_word_reads() -> int: ...
def _set_foreign(bits: int, /) -> int: ...
def _set_check_mode(on: object, /) -> None: ...

@final
class Entry:
    """One staged copy's bookkeeping (made by the segment only: no constructor)."""

    site: object
    on_drop: object
    index: object
    geom: object
    data: object
    snap: object
    ssnap: object
    value: object
    lo: int
    hi: int
    slo: int
    shi: int

@final
class Segment:
    def __init__(
        self,
        merge: Container[Any],
        barriers: Container[Any],
        fills: Container[Any] = ...,
    ) -> None: ...
    @property
    def staged(self) -> int: ...
    @property
    def entries(self) -> list[Entry]: ...
    @property
    def slot(self) -> object: ...
    @property
    def seg(self) -> int: ...
    @property
    def cursor(self) -> int: ...
    @property
    def reserve(self) -> int: ...
    @reserve.setter
    def reserve(self, value: int) -> None: ...
    @property
    def peak(self) -> int: ...
    @peak.setter
    def peak(self, value: int) -> None: ...
    @property
    def nt_from(self) -> int: ...
    @nt_from.setter
    def nt_from(self, value: int) -> None: ...
    @property
    def fast(self) -> bool: ...
    @fast.setter
    def fast(self, value: object) -> None: ...
    @property
    def front_misses(self) -> int: ...
    def bind(self, slot: object, /) -> None: ...
    def set_capture_query(self, fn: Callable[[Any], object] | None, arg: object, /) -> None: ...
    def flush_carried(
        self, launcher: object, stream: int, inline_max: int, device_base: int, /
    ) -> int | _Cut: ...
    def unbind(self) -> None: ...
    def set_cursor(self, end: int, /) -> None: ...
    def room(self, nbytes: int, /) -> bool: ...
    def take_top(self, nbytes: int, /) -> int: ...
    def remember(
        self,
        dst: object,
        fp: object,
        f: tuple[int, int, int, int] | None,
        dtype: Any,
        size: int,
        shape: tuple[int, ...],
        /,
    ) -> None: ...
    def remember_src(self, src: object, fp: object, host: Any, dtype: Any, /) -> None: ...
    def forget(self) -> None: ...
    def try_h2d(self, site: object, dst: object, src: object, on_drop: object, /) -> int: ...
    def try_fill(
        self, site: object, dst: object, start: int, value: object, on_drop: object, /
    ) -> int: ...
    def try_skip(self, site: object, dst: object, src: object, /) -> int: ...
    def append_h2d(
        self,
        site: object,
        on_drop: object,
        f: tuple[int, int, int, int],
        lo: int,
        hi: int,
        nbytes: int,
        kind: int,
        host: Any,
        /,
    ) -> bool: ...
    def stage(
        self,
        site: object,
        on_drop: object,
        lo: int,
        hi: int,
        geom: object,
        nbytes: int,
        descs: tuple[int, ...] | list[tuple[int, ...]],
        h2d: bool = False,
        /,
    ) -> tuple[Entry, int] | int: ...
    def add_read(self, lo: int, hi: int, /) -> None: ...
    def overlaps(self, lo: int, hi: int, reads: bool = True, /) -> bool: ...
    def desc(self, i: int, /) -> _Desc: ...
    def cut(self, inline_max: int, /) -> _Cut: ...
    def finish(self) -> None: ...
    def fold(self) -> dict[Any, int]: ...
    def fold_eager(self) -> dict[Any, int]: ...
    def set_eager(self, site_type: type, h2d: object, /) -> None: ...
    def reset(self) -> list[Entry]: ...

@final
class FastCopy:
    """``DeviceCopier.copy`` with its fast path compiled; other attributes are the
    wrapped function's (``__doc__``, ``__name__``, ``__wrapped__`` ...)."""

    def __new__(cls, full: Callable[..., Any], rest: Callable[..., Any], /) -> FastCopy: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def __get__(self, instance: object, owner: type | None = None, /) -> Any: ...
    def __getattr__(self, name: str) -> Any: ...

@final
class FastRoute:
    """``cucopy.copy`` with its fast path compiled; other attributes are the
    fallback's (``__doc__``, ``__name__``, ``__wrapped__`` ...)."""

    def __new__(cls, var: ContextVar[Any], fallback: Callable[..., Any], /) -> FastRoute: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def __getattr__(self, name: str) -> Any: ...

@final
class WindowMax:
    def __new__(cls, window: int) -> WindowMax: ...
    @property
    def window(self) -> int: ...
    def append(self, value: int, /) -> None: ...
    def append_max(self, value: int, /) -> int: ...
    @overload
    def max(self) -> int: ...
    @overload
    def max(self, default: _T) -> int | _T: ...

@disjoint_base
class SlotCore:
    size: object
    bottom: object
    top: object
    recorded: object
    dirty: object
    temps: object
    frees: object
    base: object
    stamp: int
    tag: int
    tag_host: int
    headroom: int
    array: object

@disjoint_base
class RingCore:
    current: object
    _slots: object
    _events: object
    _demand: object
    _index: object
    _want: object
    acquires: object
    _target_size: object
    _peak: object
    _launcher: object
    capacity: int
    @property
    def fast_advances(self) -> int: ...
    _certified: int
    _newest: int
    _newest_stamp: int
    _probe: int
    def advance_fast(
        self, seg: Segment, tables: WindowMax, cap_for: int, cap: int, /
    ) -> tuple[SlotCore, int, int] | None: ...

@disjoint_base
class CopierCore:
    _closed: bool
    _in_step: bool
    _tags: bool
    _owner: int
    _seg: object
    _checker: object
    _feed: object
    _feed_pending: object
    _capturing: bool
    _ring: object
    _slot: object
    _tables: object
    _cap_for: int
    _cap: int
    _stepping: bool
    _guarded: bool
    _watching: bool
    stats: object
    _cap_query: object
    _cap_arg: object
    _launcher: object
    _handle: object
    _carry_max: int
    _mapped_max: int
    _graph_cap: int
    flush_mode: str
    wait_timeout: object
    _guards_owed: object
    @property
    def _fast_begins(self) -> int: ...
    @property
    def _fast_flushes(self) -> int: ...
    @property
    def _fast_guarded(self) -> int: ...
    @property
    def _fast_fenced(self) -> int: ...
    @property
    def _serial(self) -> int: ...
    @property
    def _step_ctx(self) -> int: ...
    @property
    def _step_seq(self) -> int: ...
    @property
    def _plain_bits(self) -> int: ...
    def begin(self) -> None: ...
    def flush(self) -> None: ...
    def _flush_fast(self) -> bool | _Cut: ...
    def _begin_fast(self) -> bool: ...
    def _take_counts(self) -> tuple[int, int, int, int, int]: ...

@disjoint_base
class StepCore:
    _copier: object
    _graph: object
    def __init__(self, copier: object, graph: object = None) -> None: ...
    @classmethod
    def _plain_begin(cls, func: Callable[..., Any], /) -> None: ...
    @classmethod
    def _plain_flush(cls, func: Callable[..., Any], /) -> None: ...
    def __enter__(self) -> Any: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
        /,
    ) -> bool: ...

@disjoint_base
class Activation:
    def __init__(self, copier: object, var: ContextVar[Any], /) -> None: ...
    def __enter__(self) -> Any: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
        /,
    ) -> Literal[False]: ...

@disjoint_base
class UseCore:
    owed: bool
    recorded: bool
    ticket: int
    event: object
    stream: object
    timeout: object
    sites: object
    @property
    def _serial(self) -> int: ...

@disjoint_base
class GuardCore:
    _closed: bool
    _lo: int
    _hi: int
    _buf: object
    _geom: object
    _active: object
    _fast_use: object

@disjoint_base
class UpdateCore:
    data: object
    owned: bool

@disjoint_base
class BufferCore:
    _fsite: object
    _fdtype: object
    _fitem: int
    _fsize: int
    _updates: object
    _fills: object
    _pn: int
    _pdst: object
    _froute: object

@final
class SkipCounts:
    def count(self, site: object, /) -> None: ...
    def fold(self) -> dict[Any, int]: ...

@final
class FastUpdate:
    """``DeviceCopyBuffer.update`` with its fast path compiled; other attributes are
    the wrapped function's (``__doc__``, ``__name__``, ``__wrapped__`` ...)."""

    def __new__(
        cls,
        full: Callable[..., Any],
        rest: Callable[..., Any],
        var: ContextVar[Any],
        prefix: Hashable,
        rectype: type,
        /,
    ) -> FastUpdate: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def __get__(self, instance: object, owner: type | None = None, /) -> Any: ...
    def __getattr__(self, name: str) -> Any: ...
