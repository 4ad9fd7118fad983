"""The twin check: the compiled staging core against its pure-Python reference.

As CPython's ``deccheck`` runs ``_decimal`` against ``_pydecimal`` in one process,
this module loads cucopy a second time under another name (``cucopy_puretwin``)
with ``CUCOPY_PURE_PYTHON=1``, so that one process holds two complete copiers: the
compiled one (``cucopy``: ``cucopy._segment``'s Segment, CopierCore, StepCore,
FastCopy, FastRoute, RingCore, WindowMax, Activation, BufferCore/FastUpdate) and
the pure-Python one (PySegment, PyCopierCore, PyStepCore, PyRingCore, PyWindowMax,
the Python update()). The same seeded random programs
(:class:`test_properties.Program`, and a DeviceCopyBuffer program below) run in
both, and every observable is compared step by step: each call's result or error
(type and message), the copier's staged count and stats after it, every segment
the simulated device executes (header, descriptors, the data each descriptor
reads), every eager copy and fill the backend is asked for, and the device bytes
at the end. The small twins (WindowMax, Activation) are compared directly.

The differences the twins are meant to have are listed in
``cucopy/_core/TWINS.md``; each normalisation below names the entry it relies on
(``D<n>``), or ``H<n>`` for one that only this harness needs (two loaded copies
of one package are not two twins).

``CUCOPY_TWIN_SEEDS=N`` runs N seeds (default 48) per program kind;
``CUCOPY_TWIN_STEPS`` sets the steps per Program (default 40).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.util
import os
import pathlib
import random
import re
import sys

import numpy as np
import pytest
import test_properties

import cucopy
from cucopy import segment

try:
    from cucopy import _segment as compiled
except ImportError:  # no compiler where this runs, or the C file is not built
    compiled = None

TWINS_MD = pathlib.Path(cucopy.__file__).parent / "_core" / "TWINS.md"
PURE_NAME = "cucopy_puretwin"
SEEDS = int(os.environ.get("CUCOPY_TWIN_SEEDS", "48"))
STEPS = int(os.environ.get("CUCOPY_TWIN_STEPS", "40"))
POLICIES = ("lazy", "eager", "random")

needs_compiled = pytest.mark.skipif(
    compiled is None, reason="the compiled twin (cucopy._segment) is not built"
)
# the program checks compare the compiled copier in use with a pure one loaded apart
needs_compiled_in_use = pytest.mark.skipif(
    segment.IMPLEMENTATION != "compiled",
    reason="the compiled twin is not in use (not built, or CUCOPY_PURE_PYTHON=1)",
)

# modules the pure copy imports up front, while CUCOPY_PURE_PYTHON=1 is set (segment,
# buffer and ring pick their twin at import)
_SUBMODULES = (
    "errors pack _layout sites plan stats check deadline adapters segment ring feed "
    "buffer copier backends backends.base backends.sim"
).split()


class World:
    """One copy of cucopy and of ``test_properties`` bound to it."""

    def __init__(self, name, cc, props):
        self.name = name
        self.cc = cc
        self.props = props
        self.pack = cc.pack
        self.sim = sys.modules[cc.__name__ + ".backends.sim"]
        self.copier_module = cc.copier
        self.segment_module = cc.segment


def _load_pure_world() -> World:
    """cucopy again as ``cucopy_puretwin``, pure Python, and test_properties bound to it."""
    if PURE_NAME in sys.modules:
        mod = sys.modules[PURE_NAME]
        return World("python", mod, sys.modules["test_properties_" + PURE_NAME])
    pkg = pathlib.Path(cucopy.__file__).parent
    old = os.environ.get("CUCOPY_PURE_PYTHON")
    os.environ["CUCOPY_PURE_PYTHON"] = "1"
    try:
        spec = importlib.util.spec_from_file_location(
            PURE_NAME, pkg / "__init__.py", submodule_search_locations=[str(pkg)]
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules[PURE_NAME] = mod
        spec.loader.exec_module(mod)
        for sub in _SUBMODULES:
            importlib.import_module(f"{PURE_NAME}.{sub}")
    finally:
        if old is None:
            del os.environ["CUCOPY_PURE_PYTHON"]
        else:
            os.environ["CUCOPY_PURE_PYTHON"] = old
    assert mod.segment.IMPLEMENTATION == "python"
    assert mod.copier._CopierCore is mod.copier.PyCopierCore
    # test_properties once more, its `import cucopy` answered by the pure copy
    real = {k: v for k, v in sys.modules.items() if k == "cucopy" or k.startswith("cucopy.")}
    for k in real:
        del sys.modules[k]
    for k, v in list(sys.modules.items()):
        if k == PURE_NAME or k.startswith(PURE_NAME + "."):
            sys.modules["cucopy" + k[len(PURE_NAME) :]] = v
    try:
        name = "test_properties_" + PURE_NAME
        spec = importlib.util.spec_from_file_location(name, test_properties.__file__)
        props = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(props)
        sys.modules[name] = props
    finally:
        for k in [k for k in sys.modules if k == "cucopy" or k.startswith("cucopy.")]:
            del sys.modules[k]
        sys.modules.update(real)
    assert props.cc is mod and props.SimDevice is mod.backends.sim.SimDevice
    return World("python", mod, props)


@pytest.fixture(scope="module")
def worlds():
    """(compiled, python): the copier in use and its pure-Python twin, in this process."""
    return World("compiled", cucopy, test_properties), _load_pure_world()


# -- normalisations -----------------------------------------------------------------------------


def _addr(world, a: int) -> int:
    # H1: each SimDevice has its own address space (device index * 2**56); the two
    # copies of cucopy number their devices apart, so compare addresses within it
    return int(a) & (world.sim._SPACE - 1)


def _text(s: str) -> str:
    # H2: the pure copy's modules are named cucopy_puretwin.*; a message naming a
    # module or a type's module names it so
    s = s.replace(PURE_NAME, "cucopy")
    # H1 again: a SimArray's repr names its device's index ("sim:3")
    return re.sub(r"\bsim:\d+", "sim:N", s)


def _error(exc: BaseException) -> tuple:
    return ("raised", type(exc).__name__, _text(str(exc)))


def _stats(c) -> dict:
    # D3: the compiled begin/flush and the segment count in C and are folded in when
    # a total is read; as_dict() reads them all, so folded counts are what compare
    return c.stats.as_dict()


# -- recording ------------------------------------------------------------------------------------


@contextlib.contextmanager
def recording(world, log: list):
    """Record into ``log`` every segment the world's simulated device runs and every
    eager copy and fill its backend is asked for."""
    pack, sim = world.pack, world.sim
    orig_scatter = pack.reference_scatter
    orig_copy2d = sim.SimBackend.copy2d
    orig_fill = sim.SimBackend.fill

    def reference_scatter(seg, load, store, order):
        # the exact bytes the kernel runs (read when it runs, in stream order)
        header, descs = pack.decode(bytes(seg))
        descs = descs.copy()
        descs["dst"] = [_addr(world, a) for a in descs["dst"]]
        d2d = descs["kind"] == pack.KIND_D2D
        descs["src"][d2d] = [_addr(world, a) for a in descs["src"][d2d]]
        # the bytes each H2D descriptor reads (padding between them is never read)
        data = [
            bytes(seg[int(d["src"]) + r * int(d["src_pitch"]) :][: int(d["width"])])
            for d in descs
            if d["kind"] in (pack.KIND_H2D, pack.KIND_H2D_2D)
            for r in range(int(d["rows"]))
        ]
        log.append(("segment", header.tobytes(), descs.tobytes(), data))
        return orig_scatter(seg, load, store, order)

    def copy2d(self, h2d, dst, dpitch, src, spitch, width, rows, stream):
        if h2d:
            # an eager H2D copy's source bytes; a segment uploaded for a dma launch
            # holds device addresses (H1): the scatter records it decoded instead
            raw = ctypes.string_at(src, (rows - 1) * spitch + width)
            if rows == 1 and int.from_bytes(raw[:4], "little") == pack.MAGIC:
                what = ("upload", width)
            else:
                what = ("h2d", [raw[r * spitch :][:width] for r in range(rows)])
        else:
            what = ("d2d", _addr(world, src), spitch)
        log.append(("copy2d", _addr(world, dst), dpitch, width, rows, what, stream.name))
        return orig_copy2d(self, h2d, dst, dpitch, src, spitch, width, rows, stream)

    def fill(self, dst, dpitch, width, rows, value, elem, stream):
        log.append(("fill", _addr(world, dst), dpitch, width, rows, int(value), elem, stream.name))
        return orig_fill(self, dst, dpitch, width, rows, value, elem, stream)

    pack.reference_scatter = reference_scatter
    sim.SimBackend.copy2d = copy2d
    sim.SimBackend.fill = fill
    try:
        yield log
    finally:
        pack.reference_scatter = orig_scatter
        sim.SimBackend.copy2d = orig_copy2d
        sim.SimBackend.fill = orig_fill


def _twin_program_class(world, log: list):
    """``world``'s Program, recording each copier call's outcome and each step's end."""
    base = world.props.Program

    class TwinProgram(base):
        def _track(self, site, oid, call):
            c = self.copier
            try:
                ret = base._track(self, site, oid, call)
            except Exception as exc:
                log.append(("call", site.label, _error(exc), c.staged, _stats(c)))
                raise
            log.append(("call", site.label, ret, c.staged, _stats(c)))
            return ret

        def step(self):
            log.append(("step", self.figures["steps"]))
            try:
                base.step(self)
            finally:
                log.append(("stepped", self.copier.staged, _stats(self.copier)))

    return TwinProgram


def run_program(world, seed: int, steps: int, guarded: bool = False) -> list:
    """One seeded Program in ``world``: the events it logged, in order.

    ``guarded``: some H2D copies read a pinned pool in place through a HostGuard.
    """
    log: list = []
    props = world.props
    with recording(world, log):
        dev = props.SimDevice(policy=POLICIES[seed % len(POLICIES)], seed=seed)
        prog = _twin_program_class(world, log)(dev, props.RandomDraw(seed), guarded=guarded)
        try:
            figs = dict(prog.run(steps=steps))
        except Exception as exc:  # the model check failed: an event like any other
            log.append(("program failed", _error(exc)))
            return log
        log.append(
            (
                "end",
                [dev.to_host(a).tobytes() for a in prog.arrays],
                _stats(prog.copier),
                dict(prog.drops),
                figs,
            )
        )
    return log


def _buffer_program(world, seed: int, log: list) -> None:
    """DeviceCopyBuffer updates and fills through a copier, seeded: prefix updates (the
    compiled FastUpdate's case), keys, exact, force, views, fills, discards, foreign
    writes. Logs each call's answer and the copier's stats."""
    cc = world.cc
    rng = random.Random(seed)
    sites = cc.CopySite("Buf", [("LENS", cc.H2D), ("TABLE", cc.H2D), ("PAD", cc.FILL)])
    # H3: drawn in the sites' order (a set of sites iterates by hash, which differs apart)
    merge = [s for s in sites if rng.random() < 0.8]
    barriers = {s for s in merge if rng.random() < 0.2}
    merge = set(merge)
    dev = world.sim.SimDevice(policy=POLICIES[seed % len(POLICIES)], seed=seed)
    c = cc.DeviceCopier(
        cc.CopyPlan(merge=merge, flush_after=barriers),
        stream=dev.default_stream,
        device=dev,
        backend="sim",
        slots=rng.randint(1, 3),
        capacity=rng.choice((4096, 8192)),
    )
    n, rows, cols = 12, 4, 6
    t, table = dev.zeros((n,), np.int32), dev.zeros((rows, cols), np.int32)
    buf = cc.DeviceCopyBuffer(t, site=sites.LENS)
    tbuf = cc.DeviceCopyBuffer(table, site=sites.TABLE)
    palette = [np.arange(n, dtype=np.int32) % 3, np.arange(n, dtype=np.int32) % 2]
    views = [(slice(0, 2), slice(0, 3)), (slice(1, 3), slice(2, 6)), (slice(0, 4), slice(3, 5))]

    def call(what, fn):
        try:
            r = fn()
        except Exception as exc:
            r = _error(exc)
        log.append((what, r, c.staged, _stats(c)))

    with c.activate():
        for _ in range(60):
            fail = rng.random() < 0.1
            try:
                with c.step():
                    for _ in range(rng.randint(1, 6)):
                        op = rng.randrange(6)
                        if op <= 1:  # the steady state: a prefix of the same values
                            k = rng.choice((3, 4, 5, 8, 12))
                            vals = palette[rng.randrange(2)][:k].copy()
                            call("update", lambda v=vals: buf.update(v))
                        elif op == 2:
                            k = rng.choice((3, 4, 12))
                            vals = palette[rng.randrange(2)][:k].copy()
                            kw = {"key": rng.randrange(2), "exact": rng.random() < 0.3}
                            kw["force"] = rng.random() < 0.1
                            call("update key", lambda v=vals, kw=kw: buf.update(v, **kw))
                        elif op == 3:
                            start, value = rng.choice((2, 5, 12)), rng.randint(-1, 0)
                            call(
                                "fill", lambda s=start, x=value: buf.fill_tail(s, x, site=sites.PAD)
                            )
                        elif op == 4:
                            rs, cs = rng.choice(views)
                            shape = (rs.stop - rs.start, cs.stop - cs.start)
                            vals = np.full(shape, rng.randint(0, 1), np.int32)
                            view = table[rs, cs]
                            call("update view", lambda v=vals, w=view: tbuf.update(v, view=w))
                        else:  # refused: the wrong dtype, too long
                            bad = rng.choice((np.zeros(3, np.float32), np.zeros(n + 1, np.int32)))
                            call("update bad", lambda b=bad: buf.update(b))
                    if fail:
                        raise KeyboardInterrupt  # not an Exception: nothing above takes it
            except KeyboardInterrupt:
                log.append(("discarded", c.staged, _stats(c)))
            if rng.random() < 0.05:
                dev.default_stream.launch(lambda: dev.raw(t).__setitem__(Ellipsis, 1))
                buf.invalidate()
    c.close()
    log.append(("end", dev.to_host(t).tobytes(), dev.to_host(table).tobytes(), _stats(c)))


def run_buffer_program(world, seed: int) -> list:
    log: list = []
    with recording(world, log):
        _buffer_program(world, seed, log)
    return log


def first_difference(want: list, got: list, label: str) -> str | None:
    """None when the two event logs are equal; else where they part, with context."""

    def show(e):
        s = repr(e)
        return s if len(s) < 1500 else s[:1500] + "..."

    for i, (a, b) in enumerate(zip(want, got)):
        if a != b:
            before = "\n".join(
                f"  [{j}] {show(e)[:200]}"
                for j, e in enumerate(want[max(0, i - 4) : i], max(0, i - 4))
            )
            return (
                f"{label}: the twins part at event {i} ({a[0]!r} vs {b[0]!r})\n"
                f"before:\n{before}\ncompiled: {show(a)}\npython:   {show(b)}\n"
                f"(intended differences: {TWINS_MD.name})"
            )
    if len(want) != len(got):
        return f"{label}: compiled logged {len(want)} events, python {len(got)}"
    return None


def check_program(worlds, seed: int, steps: int = STEPS, guarded: bool = False) -> str | None:
    compiled_world, python_world = worlds
    want = run_program(compiled_world, seed, steps, guarded)
    got = run_program(python_world, seed, steps, guarded)
    kind = "guarded Program" if guarded else "Program"
    return first_difference(want, got, f"{kind} seed {seed}")


def check_buffer_program(worlds, seed: int) -> str | None:
    compiled_world, python_world = worlds
    want = run_buffer_program(compiled_world, seed)
    got = run_buffer_program(python_world, seed)
    return first_difference(want, got, f"buffer program seed {seed}")


# -- the twin checks ------------------------------------------------------------------------------


def test_the_intended_differences_are_written_down():
    text = TWINS_MD.read_text()
    # every entry a normalisation or a test here names (D<n>: the twins; H<n>: the harness)
    for ref in ("D1", "D2", "D3", "D4", "D5", "D6", "D7", "D8", "D9", "H1", "H2", "H3"):
        assert f"**{ref}**" in text, f"{ref} is not listed in {TWINS_MD.name}"


@needs_compiled_in_use
def test_the_pure_copy_is_the_python_twin(worlds):
    compiled_world, python_world = worlds
    assert compiled_world.segment_module.Segment is compiled.Segment
    assert python_world.segment_module.Segment is python_world.segment_module.PySegment
    assert python_world.cc.ring.WindowMax is python_world.cc.ring.PyWindowMax
    assert python_world.cc.buffer._FastUpdate is None
    assert python_world.cc.DeviceCopier.__mro__[1] is python_world.copier_module.PyCopierCore


@needs_compiled_in_use
@pytest.mark.parametrize("seed", range(SEEDS))
def test_twins_run_the_same_programs(worlds, seed):
    diff = check_program(worlds, seed)
    assert diff is None, diff


@needs_compiled_in_use
@pytest.mark.parametrize("seed", range(max(1, SEEDS // 4)))
def test_twins_run_the_same_guarded_programs(worlds, seed):
    """Programs with copies read in place through a HostGuard (its Python path is one
    for both twins; the compiled flush must leave the step's end to Python, which
    records the guard's event)."""
    diff = check_program(worlds, seed, guarded=True)
    assert diff is None, diff


@needs_compiled_in_use
@pytest.mark.parametrize("seed", range(SEEDS))
def test_twins_run_the_same_buffer_programs(worlds, seed):
    diff = check_buffer_program(worlds, seed)
    assert diff is None, diff


@needs_compiled_in_use
def test_the_programs_take_the_compiled_fast_paths(worlds):
    # the check is worth what the compiled side runs of its own: its begin() and its
    # copy() fast path must take many of the programs' steps and copies
    compiled_world = worlds[0]
    copier_cls = compiled_world.copier_module.DeviceCopier
    general = []
    orig_general = copier_cls._copy_general
    copiers = []
    orig_begin = copier_cls.begin

    def copy_general(self, *a):
        general.append(a[0])
        return orig_general(self, *a)

    def begin(self):
        copiers.append(self)
        return orig_begin(self)

    log = []
    with _patched(copier_cls, "_copy_general", copy_general), _patched(copier_cls, "begin", begin):
        for seed in range(6):
            log += run_program(compiled_world, seed, STEPS)
    calls = sum(1 for e in log if e[0] == "call")
    assert calls > 0 and len(general) < 0.9 * calls, (len(general), calls)
    assert sum(c._fast_begins for c in set(copiers)) > 0


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


# -- the checker's self-test: drift is reported ---------------------------------------------------


def _first_drift(worlds, check, seeds=range(8)):
    for seed in seeds:
        diff = check(worlds, seed)
        if diff is not None:
            return diff
    return None


@needs_compiled_in_use
def test_the_checker_reports_one_wrong_staged_byte(worlds):
    python_world = worlds[1]
    seg_cls = python_world.segment_module.PySegment
    pack = python_world.pack
    orig_cut = seg_cls.cut

    def cut(self, inline_max):
        # the reference stages one wrong byte: the first byte its first H2D row reads
        out = orig_cut(self, inline_max)
        start, end = out[0], out[1]
        _, descs = pack.decode(bytes(self.slot.array[start:end]))
        for d in descs:
            if d["kind"] in (pack.KIND_H2D, pack.KIND_H2D_2D) and d["width"]:
                self.slot.array[start + int(d["src"])] ^= 0x5A
                break
        return out

    with _patched(seg_cls, "cut", cut):
        diff = _first_drift(worlds, check_program)
    assert diff is not None, "a wrong staged byte went unnoticed"
    assert "'segment' vs 'segment'" in diff


@needs_compiled_in_use
def test_the_checker_reports_a_wrong_counter(worlds):
    python_world = worlds[1]
    seg_cls = python_world.segment_module.PySegment
    orig = seg_cls._count

    def count(self, site):  # one merged copy counted twice
        orig(self, site)
        if site.label.endswith("H1"):
            orig(self, site)

    with _patched(seg_cls, "_count", count):
        diff = _first_drift(worlds, check_program)
    assert diff is not None, "a wrong merged counter went unnoticed"
    assert "'merged'" in diff


@needs_compiled_in_use
def test_the_checker_reports_a_wrong_skip(worlds):
    # the Python update() never finds values unchanged: it answers True (and stages)
    # where the compiled FastUpdate answers False
    buffer = worlds[1].cc.buffer
    with _patched(buffer, "_equal", lambda a, b: False):
        diff = _first_drift(worlds, check_buffer_program)
    assert diff is not None, "a wrong skip went unnoticed"
    assert "'update'" in diff


# -- the small twins, directly ----------------------------------------------------------------------


@needs_compiled
@pytest.mark.parametrize("seed", range(SEEDS))
def test_window_max_twins_report_the_same_values(seed):
    from cucopy.ring import PyWindowMax

    rng = random.Random(seed)
    window = rng.choice((-1, 0, 1, 2, 3, 5, 8, 64))
    twins = (compiled.WindowMax(window), PyWindowMax(window))
    assert twins[0].window == twins[1].window == window
    hi = rng.choice((3, 100, 2**62))  # D8: int64 values only in C
    got = ([], [])
    for _ in range(400):
        op = rng.randrange(4)
        v = rng.randint(-hi, hi)
        for w, out in zip(twins, got):
            if op == 0:
                out.append(w.append(v))
            elif op == 1:
                out.append(w.max())
            elif op == 2:
                out.append(w.max(default=-7))
            else:
                out.append(w.append_max(v))
    assert got[0] == got[1]


@needs_compiled
def test_window_max_refuses_what_int64_cannot_hold():
    # D8: the compiled twin holds 64-bit values; the Python twin any int
    from cucopy.ring import PyWindowMax

    w, p = compiled.WindowMax(4), PyWindowMax(4)
    p.append(2**70)
    assert p.max() == 2**70
    with pytest.raises(OverflowError):
        w.append(2**70)


@needs_compiled
@pytest.mark.parametrize("seed", range(8))
def test_activation_twins_set_and_reset_alike(seed):
    import contextvars

    from cucopy.copier import _PyActivation

    var = contextvars.ContextVar("twin_active", default=None)
    copiers = [object() for _ in range(3)]
    runs = []
    for cls in (compiled.Activation, _PyActivation):
        trace = []
        # the same nesting of activations of random copiers, each left in order
        stack = []
        r = random.Random(seed)  # the same program for each twin
        for _ in range(200):
            if stack and r.random() < 0.45:
                a = stack.pop()
                trace.append(
                    (
                        "exit",
                        a.__exit__(None, None, None),
                        copiers.index(var.get()) if var.get() else None,
                    )
                )
            else:
                k = r.randrange(3)
                a = cls(copiers[k], var)
                trace.append(("enter", a.__enter__() is copiers[k], copiers.index(var.get())))
                stack.append(a)
        while stack:
            a = stack.pop()
            trace.append(("exit", a.__exit__(None, None, None), var.get()))
        # an exit with nothing entered, and a second exit, change nothing
        a = cls(copiers[0], var)
        trace.append(("stray exit", a.__exit__(None, None, None), var.get()))
        a.__enter__()
        a.__exit__(None, None, None)
        trace.append(("second exit", a.__exit__(None, None, None), var.get()))
        runs.append(trace)
    assert runs[0] == runs[1]
