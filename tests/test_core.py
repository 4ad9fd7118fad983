"""The compiled core as a module: its state, its foreign reads' fallbacks, its classes.

cucopy/_core/README.md describes the module. These tests need the compiled core
(skipped on the pure-Python run, which has none).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import cucopy as cc
from cucopy import segment
from cucopy.backends.sim import SimDevice

core = pytest.importorskip("cucopy._segment") if segment.IMPLEMENTATION == "compiled" else None
pytestmark = pytest.mark.skipif(core is None, reason="the compiled core is not in use")

NUMPY, NATIVE, WORD, FLAGWORD, ALL = 1, 2, 4, 8, 15


class Site(cc.CopySite):
    A = cc.H2D


def _copier():
    dev = SimDevice(policy="lazy")
    c = cc.DeviceCopier(
        cc.CopyPlan(merge={Site.A}), device=dev, backend="sim", stream=dev.default_stream
    )
    return dev, c


@pytest.fixture
def foreign():
    """Sets the core's foreign-read bits for one test; restores them after."""
    old = core._set_foreign(ALL)
    assert old == ALL  # the default: every read in use
    yield core._set_foreign
    core._set_foreign(old)


def test_a_second_instance_of_the_module_is_refused():
    # its types are static: a second module object would share them, so exec refuses it
    code = (
        "import importlib.util, cucopy._segment as m\n"
        "spec = importlib.util.find_spec('cucopy._segment')\n"
        "try:\n"
        "    spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "except ImportError as e:\n"
        "    print('refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "refused: cucopy._segment is loaded once a process" in out.stdout


def test_set_foreign_rejects_unknown_bits(foreign):
    with pytest.raises(ValueError, match="bits 16 outside 15"):
        foreign(16)
    with pytest.raises(OverflowError):
        foreign(-1)
    assert foreign(ALL) == ALL  # unchanged by the refusals


@pytest.mark.parametrize("cleared", [NUMPY, NATIVE, WORD, FLAGWORD, ALL])
def test_each_foreign_read_has_a_public_path_with_the_same_bytes(foreign, cleared):
    # a copier made with a read turned off takes the public path for it (the buffer
    # protocol, the spec's calls, the handle attribute, the flag methods): same bytes
    torch = pytest.importorskip("torch")
    foreign(ALL & ~cleared)
    dev, c = _copier()
    dst_np, dst_t = dev.zeros((6,), np.int32), dev.zeros((6,), np.int32)
    src_np = np.arange(6, dtype=np.int32)
    src_t = torch.arange(6, dtype=torch.int32)
    words = core._native_word_reads()
    for k in range(4):
        src_np[:] = k
        src_t.fill_(10 + k)
        with c.step():
            c.copy(Site.A, dst_np, src_np)
            c.copy(Site.A, dst_t, src_t)
            src_np[:] = -1  # the bytes of the call land, whichever path staged them
            src_t.fill_(-1)
        assert dev.to_host(dst_np).tolist() == [k] * 6
        assert dev.to_host(dst_t).tolist() == [10 + k] * 6
    read_words = core._native_word_reads() - words
    if cleared & (NATIVE | WORD):
        assert read_words == 0  # no tensor validated through its own word
    elif (ALL & ~cleared) & WORD:
        assert read_words > 0
    assert c.stats.sites[Site.A].merged == 8
    c.close()


def test_without_the_flag_word_a_conjugate_set_in_place_is_still_caught(foreign):
    torch = pytest.importorskip("torch")
    foreign(ALL & ~FLAGWORD)
    dev, c = _copier()
    dst = dev.zeros((2,), np.complex64)
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    for _ in range(3):
        with c.step():
            c.copy(Site.A, dst, x)
    x.data = x.conj()
    with pytest.raises(TypeError, match="conjugate/negative bit"):
        with c.step():
            c.copy(Site.A, dst, x)
    assert dev.to_host(dst).tolist() == [1 + 2j, 3 - 4j]
    c.close()


def test_the_class_methods_the_core_may_skip_are_resolved_when_the_copier_is_made():
    # begin() and flush() are compiled only for a class that leaves them as they are;
    # a subclass's own are called (no look-up of the class on every step)
    calls = []

    class Begins(cc.DeviceCopier):
        def begin(self):
            calls.append("begin")
            super().begin()

    class Flushes(cc.DeviceCopier):
        def flush(self):
            calls.append("flush")
            super().flush()

    dev = SimDevice(policy="lazy")
    kw = dict(device=dev, backend="sim", stream=dev.default_stream)
    plain = cc.DeviceCopier(cc.CopyPlan(merge={Site.A}), **kw)
    assert plain._plain_bits == 3
    for cls, bits in ((Begins, 2), (Flushes, 1)):
        c = cls(cc.CopyPlan(merge={Site.A}), **kw)
        assert c._plain_bits == bits
        dst = dev.zeros((2,), np.int32)
        with c.step():
            c.copy(Site.A, dst, np.array([7, 8], np.int32))
        assert dev.to_host(dst).tolist() == [7, 8]
        c.close()
    assert calls == ["begin", "flush"]
    plain.close()


def test_module_level_copy_reaches_a_subclass_copy():
    # cucopy.copy calls the active copier's compiled copy only when its class keeps it
    seen = []

    class Own(cc.DeviceCopier):
        def copy(self, site, dst, src, **kw):
            seen.append(site)
            return super().copy(site, dst, src, **kw)

    dev = SimDevice(policy="lazy")
    c = Own(cc.CopyPlan(merge={Site.A}), device=dev, backend="sim", stream=dev.default_stream)
    dst = dev.zeros((2,), np.int32)
    with c.step():
        cc.copy(Site.A, dst, np.array([1, 2], np.int32))
    assert seen == [Site.A] and dev.to_host(dst).tolist() == [1, 2]
    c.close()


def test_the_copier_core_fields_are_typed():
    # flags are C booleans, sizes C integers, the owner a thread id: a wrong type is
    # refused where it is assigned, not found later by the compiled step
    dev, c = _copier()
    assert c._closed is False and c._in_step is False and c._owner == 0
    with pytest.raises(TypeError):
        c._closed = 1
    with pytest.raises(TypeError):
        c._cap = "big"
    assert isinstance(c._carry_max, int) and isinstance(c._mapped_max, int)
    c.flush_mode = "inline"
    assert c.flush_mode == "inline"
    with pytest.raises(AttributeError):
        del c.flush_mode
    with c.step():
        assert c._in_step is True and c._owner == core.thread_id()
        c.copy(Site.A, dev.zeros((2,), np.int32), np.array([1, 2], np.int32))
    assert c._in_step is False
    c.close()
    assert c._closed is True


def test_check_mode_reaches_the_core_when_assigned(monkeypatch):
    # cucopy.check pushes every assignment of CHECK_MODE into the core's own flag: the
    # compiled begin() declines (and the Python body runs the checks) while it is on
    from cucopy import check

    dev, c = _copier()
    dst = dev.zeros((2,), np.int32)
    for _ in range(2 * c._ring.slots):  # the ring's slots made: begin() is compiled
        with c.step():
            c.copy(Site.A, dst, np.array([1, 2], np.int32))
    before = c._fast_begins
    assert before > 0
    monkeypatch.setattr(check, "CHECK_MODE", True)
    with c.step():
        c.copy(Site.A, dst, np.array([3, 4], np.int32))
    assert c._fast_begins == before
    monkeypatch.setattr(check, "CHECK_MODE", False)
    for _ in range(2 * c._ring.slots):
        with c.step():
            c.copy(Site.A, dst, np.array([5, 6], np.int32))
    assert c._fast_begins > before
    assert dev.to_host(dst).tolist() == [5, 6]
    c.close()


def test_update_records_are_read_through_their_typed_fields():
    from cucopy import buffer

    assert issubclass(buffer._Update, core.UpdateCore)

    class Renamed(core.UpdateCore):
        @property
        def data(self):  # a subclass that redefines a field is not read through it
            return None

    with pytest.raises(TypeError, match="keeps its data and owned fields"):
        core.FastUpdate(len, len, buffer._copier._active, (None, None), Renamed)
    with pytest.raises(TypeError):
        buffer._Update(np.zeros(2, np.uint8), 1, region=(), base=None)  # owned: a bool
