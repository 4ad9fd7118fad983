"""The open segment's two twins: compiled (cucopy._segment) and pure Python (PySegment).

The whole suite runs on whichever :data:`cucopy.segment.Segment` is (CI runs it
twice, once with ``CUCOPY_PURE_PYTHON=1``); the tests here put the two side by
side in one process: the same seeded programs must stage the same bytes, encode
the same segments and count the same, and the fast paths (torch CPU sources,
views made afresh of a known array) must take what they promise to take.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from test_properties import Program, RandomDraw

import cucopy as cc
import cucopy.copier as copier_module
from cucopy import pack, segment
from cucopy.backends.sim import _SPACE, SimDevice

try:
    from cucopy._segment import Segment as CSegment
except ImportError:  # no compiler where this runs: only the reference is tested
    CSegment = None

TWINS = [pytest.param(segment.PySegment, id="python")]
if CSegment is not None:
    TWINS.append(pytest.param(CSegment, id="compiled"))


class Site(cc.CopySite):
    A = cc.H2D
    B = cc.H2D
    C = cc.H2D
    PLAIN = cc.H2D
    TAIL = cc.FILL


PLAN = cc.CopyPlan(merge={Site.A, Site.B, Site.C, Site.TAIL}, flush_after={Site.C})


def test_the_compiled_twin_is_the_one_in_use():
    # CI's normal run must exercise the compiled path; CUCOPY_PURE_PYTHON=1 the reference
    if os.environ.get("CUCOPY_PURE_PYTHON"):
        assert segment.IMPLEMENTATION == "python"
        assert segment.Segment is segment.PySegment
    else:
        assert CSegment is not None, (
            "cucopy._segment is not built (pip install -e . with a C compiler)"
        )
        assert segment.IMPLEMENTATION == "compiled"
        assert segment.Segment is CSegment
        c = cc.DeviceCopier(PLAN, device=SimDevice(), backend="sim")
        assert type(c._seg) is CSegment
        c.close()


class Recorder:
    """Wraps a segment; records every encoded segment's bytes and block count."""

    def __init__(self, seg, log):
        object.__setattr__(self, "_s", seg)
        object.__setattr__(self, "_log", log)

    def __getattr__(self, name):
        return getattr(self._s, name)

    def __setattr__(self, name, value):
        setattr(self._s, name, value)

    def cut(self, inline_max):
        start, end, nblocks, n = self._s.cut(inline_max)
        raw = bytes(self._s.slot.array[start:end])
        header, descs = pack.decode(raw)
        descs = descs.copy()
        # each SimDevice has its own address space: compare addresses within it
        descs["dst"] &= _SPACE - 1
        d2d = descs["kind"] == pack.KIND_D2D
        descs["src"][d2d] &= _SPACE - 1
        # the bytes each H2D descriptor reads (padding between them is never read)
        data = [
            raw[int(d["src"]) + r * int(d["src_pitch"]) :][: int(d["width"])]
            for d in descs
            if d["kind"] in (pack.KIND_H2D, pack.KIND_H2D_2D)
            for r in range(int(d["rows"]))
        ]
        self._log.append((header.tobytes(), descs.tobytes(), data, nblocks, n))
        return start, end, nblocks, n


def _run_program(monkeypatch, cls, seed, steps):
    log = []
    monkeypatch.setattr(copier_module, "Segment", lambda *a: Recorder(cls(*a), log))
    prog = Program(SimDevice(policy="lazy", seed=seed), RandomDraw(seed), check_mode=False)
    figs = prog.run(steps=steps)
    stats = prog.copier.stats.as_dict()
    return log, figs, stats


@pytest.mark.skipif(CSegment is None, reason="the compiled twin is not built")
@pytest.mark.parametrize("seed", range(4))
def test_twins_encode_the_same_segments(monkeypatch, seed):
    py_log, py_figs, py_stats = _run_program(monkeypatch, segment.PySegment, seed, 60)
    c_log, c_figs, c_stats = _run_program(monkeypatch, CSegment, seed, 60)
    assert py_figs["mismatches"] == c_figs["mismatches"] == 0
    assert len(py_log) == len(c_log) > 0
    for i, (a, b) in enumerate(zip(py_log, c_log)):
        assert a == b, f"segment {i} differs"
    assert py_stats == c_stats


@pytest.fixture(params=TWINS)
def twin(request, monkeypatch):
    monkeypatch.setattr(copier_module, "Segment", request.param)
    return request.param


def _sim_copier():
    """A lazy simulated device and a copier on it with PLAN."""
    dev = SimDevice(policy="lazy")
    return dev, cc.DeviceCopier(PLAN, stream=dev.default_stream, device=dev, backend="sim")


def _spy(c):
    """Count copies the general path resolves (the fast path resolves nothing)."""
    calls = []
    orig = c._dst

    def spy(site, dst):
        calls.append(site)
        return orig(site, dst)

    c._dst = spy
    return calls


def test_views_made_afresh_take_the_fast_path(twin):
    dev, c = _sim_copier()
    buf = dev.zeros((64,), np.int32)
    table = dev.zeros((8, 16), np.int32)
    with c.step():  # first sight: resolved, and the arrays they are views of cached
        c.copy(Site.A, buf[:5], np.arange(5, dtype=np.int32))
        c.copy(Site.B, table[:2, :3], np.arange(6, dtype=np.int32).reshape(2, 3))
    calls = _spy(c)
    for n in (3, 7, 9):
        with c.step():
            c.copy(Site.A, buf[:n], np.arange(n, dtype=np.int32) + n)
            c.copy(Site.B, table[1 : n // 2 + 1, 2:5], np.full((n // 2, 3), n, np.int32))
        host = dev.to_host(buf)
        assert host[:n].tolist() == list(range(n, 2 * n))
        assert dev.to_host(table)[1 : n // 2 + 1, 2:5].tolist() == [[n] * 3] * (n // 2)
    assert calls == []  # never resolved again
    # a view of another dtype is not the base's: the general path checks it
    with c.step():
        c.copy(Site.A, buf.view(np.float32)[:2], np.ones(2, np.float32))
    assert calls and set(calls) == {Site.A}
    assert dev.to_host(buf)[:2].view(np.float32).tolist() == [1.0, 1.0]
    # a strided view with no 2-D form, and a mismatched source, go the general way too
    with pytest.raises(ValueError, match="size mismatch"):
        with c.step():
            c.copy(Site.A, buf[:4], np.arange(5, dtype=np.int32))
    assert c.stats.sites[Site.A].merged == 5
    c.close()


def _cached_torch_source():
    """A sim copier that copied a torch CPU tensor into a 6-int32 destination once (both
    cached), its general path spied on: ``(torch, dev, c, dst, src, calls)``."""
    torch = pytest.importorskip("torch")
    dev, c = _sim_copier()
    dst = dev.zeros((6,), np.int32)
    src = torch.arange(6, dtype=torch.int32)
    with c.step():
        c.copy(Site.A, dst, src)
    return torch, dev, c, dst, src, _spy(c)


def test_torch_cpu_sources_take_the_fast_path(twin):
    torch, dev, c, dst, src, calls = _cached_torch_source()
    for k in range(3):
        src.fill_(k)  # refilled in place, as an engine's staging tensor is
        with c.step():
            c.copy(Site.A, dst, src)
            src.fill_(99)  # snapshot: the bytes of the call land, not these
        assert dev.to_host(dst).tolist() == [k] * 6
        src.fill_(k)
    assert calls == []
    # another dtype swapped in through .data: the fingerprint catches it
    src.data = torch.zeros(6, dtype=torch.float32)
    with pytest.raises(TypeError, match="dtype mismatch"):
        with c.step():
            c.copy(Site.A, dst, src)
    assert calls and set(calls) == {Site.A}
    c.close()


@pytest.mark.parametrize(
    "change",
    ["resize_", "set_", "as_strided_", "transpose_", "data_same_dtype", "data_other_dtype"],
)
def test_a_cached_torch_tensor_whose_geometry_changed_in_place_is_read_afresh(twin, change):
    # the fast path validates a cached tensor by address, shape, strides and dtype
    # (in C through torch's native getters, __cucopy_native__, where declared): a
    # change made in place, the Python object the same, must not reuse the old geometry
    torch = pytest.importorskip("torch")
    dev, c = _sim_copier()
    dst = dev.zeros((2, 3), np.int32)
    src = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    with c.step():
        c.copy(Site.A, dst, src)
    calls = _spy(c)
    with c.step():
        c.copy(Site.A, dst, src)
    assert calls == []  # cached
    other = torch.arange(100, 112, dtype=torch.int32)
    want = None
    if change == "resize_":
        src.resize_(6)  # same storage and numel, flat now: a flat source fits any shape
        want = list(range(6))
    elif change == "set_":
        src.set_(other.untyped_storage(), 2, (2, 3), (3, 1))  # other bytes, same shape
        want = list(range(102, 108))
    elif change == "as_strided_":
        src.as_strided_((2, 3), (1, 2))  # same address and shape, other strides
        want = [0, 2, 4, 1, 3, 5]
    elif change == "transpose_":
        src.transpose_(0, 1)  # (3, 2): the shape rule refuses it into (2, 3)
    elif change == "data_same_dtype":
        src.data = torch.arange(200, 206, dtype=torch.int32).reshape(2, 3)
        want = list(range(200, 206))
    else:
        src.data = torch.zeros(2, 3, dtype=torch.float32)
    if want is None:
        with pytest.raises((TypeError, ValueError)):
            with c.step():
                c.copy(Site.A, dst, src)
    else:
        with c.step():
            c.copy(Site.A, dst, src)
        assert dev.to_host(dst).reshape(-1).tolist() == want
    assert calls and set(calls) == {Site.A}  # the general path looked again
    c.close()


def test_torch_declares_native_getters_that_agree_with_its_attributes():
    # the compiled segment's cheap validation; its self-check ran at import
    pytest.importorskip("torch")
    from cucopy.adapters import torch as torch_adapter

    native = getattr(torch_adapter.fingerprint, "__cucopy_native__", None)
    assert native is not None, "torch's aoti_torch_get_* getters were not usable"
    assert native[0] == "_cdata" and len(native) == 9 and all(native[1:6])
    assert torch_adapter._native_getters() == native


def test_torch_flag_word_holds_the_conjugate_and_negative_bits():
    # the declared flag word (8th and 9th fields): clear on plain tensors, set on lazy
    # conjugate and negative views, followed in place through .data =; the compiled core
    # reads it instead of asking is_conj() and is_neg() of each cached tensor
    torch = pytest.importorskip("torch")
    import ctypes

    from cucopy.adapters import torch as torch_adapter

    off, mask = torch_adapter.fingerprint.__cucopy_native__[7:9]
    assert (off, mask) == torch_adapter._flag_word() and off >= 0 and mask

    def bits(t):
        return ctypes.c_uint64.from_address(t._cdata + off).value & mask

    x = torch.ones(4, dtype=torch.complex64)
    assert not bits(x) and not bits(torch.zeros(3)) and not bits(x[1:])
    assert bits(x.conj()) and bits(torch._neg_view(torch.zeros(2)))
    x.data = x.conj()
    assert bits(x)
    x.data = x.resolve_conj()
    assert not bits(x)


def test_without_the_flag_word_cached_tensors_ask_the_flag_methods(monkeypatch):
    # the guard's fallback: where the key set is not found (-1, 0), the compiled core asks
    # __cucopy_flags__ (is_conj, is_neg) of a cached tensor instead, with the same result
    torch = pytest.importorskip("torch")
    from cucopy import adapters
    from cucopy.adapters import torch as torch_adapter
    from cucopy.backends.sim import SimDevice

    base = torch_adapter.fingerprint

    def fp(x):
        return base(x)

    fp.__cucopy_spec__ = base.__cucopy_spec__
    fp.__cucopy_flags__ = base.__cucopy_flags__
    native = getattr(base, "__cucopy_native__", None)
    if native is not None:
        fp.__cucopy_native__ = (*native[:7], -1, 0)
    monkeypatch.setitem(adapters._fp_by_type, torch.Tensor, fp)

    class S(cc.CopySite):
        A = cc.H2D

    dev = SimDevice(policy="lazy")
    c = cc.DeviceCopier(
        cc.CopyPlan(merge={S.A}), device=dev, backend="sim", stream=dev.default_stream
    )
    dst = dev.zeros((2,), np.complex64)
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    for _ in range(3):
        with c.step():
            c.copy(S.A, dst, x)
    x.data = x.conj()
    with pytest.raises(TypeError, match="conjugate/negative bit"):
        with c.step():
            c.copy(S.A, dst, x)
    assert dev.to_host(dst).tolist() == [1 + 2j, 3 - 4j]


def test_torch_tensors_hold_their_handle_where_the_adapter_says():
    # the declared word offset (the 7th field): a tensor object holds its _cdata there,
    # whichever way it was made; the compiled core reads it there for a cached tensor
    torch = pytest.importorskip("torch")
    import ctypes

    from cucopy.adapters import torch as torch_adapter

    off = torch_adapter.fingerprint.__cucopy_native__[6]
    assert off == torch_adapter._handle_word([]) and off >= 16
    made = [
        torch.zeros(7, dtype=torch.int64),
        torch.arange(12).reshape(3, 4).t(),
        torch.from_numpy(np.zeros(3, np.float32)),
        torch.ones(4)[::2],
        torch.nn.Parameter(torch.ones(2)),
        torch.zeros(2, 2).pin_memory() if torch.cuda.is_available() else torch.empty(0),
    ]
    for t in made:
        assert ctypes.c_void_p.from_address(id(t) + off).value == t._cdata


@pytest.mark.skipif(CSegment is None, reason="the compiled twin is not built")
def test_a_cached_torch_tensor_is_validated_through_the_handle_it_holds(monkeypatch):
    # the compiled core validates a cached torch source and destination from the word
    # the tensor holds (no _cdata int built), and still sees changes made in place
    from cucopy import _segment

    monkeypatch.setattr(copier_module, "Segment", CSegment)
    torch, dev, c, dst, src, calls = _cached_torch_source()
    before = _segment._native_word_reads()
    for k in range(4):
        src.fill_(k)
        with c.step():
            c.copy(Site.A, dst, src)
        assert dev.to_host(dst).tolist() == [k] * 6
    assert calls == [] and _segment._native_word_reads() - before == 4
    src.set_(torch.arange(50, 56, dtype=torch.int32).untyped_storage())  # in place
    with c.step():
        c.copy(Site.A, dst, src)
    assert dev.to_host(dst).tolist() == list(range(50, 56)) and calls == [Site.A]
    c.close()


def test_counts_survive_a_stats_reset(twin):
    dev, c = _sim_copier()
    dst = dev.zeros((4,), np.int32)
    with c.step():
        c.copy(Site.A, dst, np.arange(4, dtype=np.int32))
    c.stats.reset()
    with c.step():
        c.copy(Site.A, dst, np.arange(4, dtype=np.int32))
        c.copy(Site.A, dst, np.arange(4, dtype=np.int32))  # replaces the staged one
    assert c.stats.sites[Site.A].merged == 2
    c.close()


def test_a_descriptor_field_too_wide_fails_the_flush_with_its_site(twin):
    # a row pitch of 2**32 bytes does not fit the wire format: the flush names the site
    dev, c = _sim_copier()
    dropped = []
    with c.step():
        desc = (1 << 40, 1 << 41, 0, 1 << 32, 4, 4, 2, pack.KIND_D2D, 0, 0)
        c._seg.stage(Site.A, lambda: dropped.append(1), 0, 1 << 33, None, 0, desc)
        with pytest.raises(cc.CopyError, match=r"Site\.A: flushing 1 staged copies failed"):
            c.flush()
        assert dropped == [1] and c.staged == 0
    c.close()


def test_an_unchanged_copy_of_a_known_destination_is_skipped_cheaply(twin):
    dev, c = _sim_copier()
    dst = dev.zeros((4,), np.int32)
    src = np.arange(4, dtype=np.int32)
    with c.step():
        c.copy(Site.A, dst, src)
    calls = _spy(c)
    with c.step():
        assert c.copy(Site.A, dst, src, unchanged=True) is False
        assert c.staged == 0
    assert calls == [] and c.stats.sites[Site.A].skipped == 1
    # bad input is still refused, by the general path
    with c.step():
        with pytest.raises(TypeError, match="dtype mismatch"):
            c.copy(Site.A, dst, src.astype(np.float32), unchanged=True)
        with pytest.raises(ValueError, match="size mismatch"):
            c.copy(Site.A, dst, src[:3], unchanged=True)
    assert c.stats.sites[Site.A].skipped == 1
    c.close()


def test_copy_keeps_its_signature_whichever_path_runs(twin):
    # DeviceCopier.copy is the compiled FastCopy when the extension is built: the same
    # arguments, errors, docstring and signature as the Python method
    import inspect

    if segment.FastCopy is not None:
        assert isinstance(cc.DeviceCopier.__dict__["copy"], segment.FastCopy)
    assert "through ``site``" in cc.DeviceCopier.copy.__doc__
    params = list(inspect.signature(cc.DeviceCopier.copy).parameters)
    assert params == ["self", "site", "dst", "src", "unchanged", "on_drop", "guard"]
    dev, c = _sim_copier()
    dst = dev.zeros((4,), np.int32)
    src = np.arange(4, dtype=np.int32)
    drops = []
    with c.step():
        assert c.copy(Site.A, dst, src) is True  # first sight: the general path
        assert c.copy(Site.B, dst[:2], src[:2] + 10, unchanged=False) is True
        assert c.copy(Site.C, dst[2:], src[2:] + 20, on_drop=lambda: drops.append(1))
        assert c.staged == 0  # Site.C is a barrier: its copy flushed the segment
        with pytest.raises(TypeError):
            c.copy(Site.A, dst, src, True)  # unchanged is keyword-only
        with pytest.raises(TypeError):
            c.copy(Site.A, dst, src, bogus=1)
        with pytest.raises(TypeError, match="on_drop must be callable"):
            c.copy(Site.A, dst, src, on_drop=3)
        bound = c.copy
        assert bound(Site.A, dst, src) is True
    assert dev.to_host(dst).tolist() == [0, 1, 2, 3] and drops == []
    c.close()


def test_module_level_copy_routes_to_the_active_copier(twin):
    dev, c = _sim_copier()
    dst = dev.zeros((4,), np.int32)
    with c.activate():
        with c.step():
            assert cc.copy(Site.A, dst, np.arange(4, dtype=np.int32)) is True
        calls = _spy(c)
        with c.step():
            assert cc.copy(Site.A, dst, np.arange(4, dtype=np.int32) + 5) is True
            assert c.staged == 1  # staged in the active copier, on its fast path
            assert cc.copy(Site.A, dst, np.arange(4, dtype=np.int32) + 7, unchanged=True) is False
        assert calls == []
    assert dev.to_host(dst).tolist() == [5, 6, 7, 8]
    # no active copier: a plain copy on the device's stream
    assert cc.copy(Site.PLAIN, dst, np.full(4, 3, np.int32)) is True
    dev.synchronize()
    assert dev.to_host(dst).tolist() == [3] * 4
    c.close()


def test_merged_counts_are_folded_whenever_they_are_read(twin):
    # the segment counts merged copies itself (in C: no per-copy Python work at flush);
    # stats.sites and a SiteStats held from before see them
    dev, c = _sim_copier()
    dst = dev.zeros((4,), np.int32)
    held = c.stats.sites[Site.A]
    for k in range(3):
        with c.step():
            c.copy(Site.A, dst, np.arange(4, dtype=np.int32) + k)
            c.copy(Site.B, dst[:1], np.zeros(1, np.int32))
    assert held.merged == 3 and c.stats.sites[Site.B].merged == 3
    assert c.stats.as_dict()["sites"]["Site.A"]["merged"] == 3
    c.close()


def test_fills_of_a_known_destination_take_the_fast_path(twin):
    dev, c = _sim_copier()
    buf = dev.zeros((16,), np.int16)
    table = dev.zeros((4, 8), np.int32)
    with c.step():  # first sight: the general path, which caches the destinations
        c.fill_tail(Site.TAIL, buf, 3, -1)
        c.fill_tail(Site.TAIL, table[:, :6], 5, 7)
    calls = _spy(c)
    for n in (2, 9, 15):
        with c.step():
            assert c.fill_tail(Site.TAIL, buf, n, n) is True
            assert c.fill_tail(Site.TAIL, table[:, :6], n, -n) is True  # row-strided tail
        assert dev.to_host(buf).tolist()[n:] == [n] * (16 - n)
        flat = dev.to_host(table)[:, :6].reshape(-1)
        assert flat[n:].tolist() == [-n] * (24 - n)
    assert calls == []
    # a value the dtype cannot hold goes the general way (which raises), even for an
    # empty tail; a tail past the end is skipped on the fast path
    with c.step():
        with pytest.raises(ValueError, match="does not fit"):
            c.fill_tail(Site.TAIL, buf, 0, 1 << 20)
        with pytest.raises(ValueError, match="does not fit"):
            c.fill_tail(Site.TAIL, buf, 16, 1 << 20)
        assert c.fill_tail(Site.TAIL, buf, 16, 0) is False
        assert c.fill_tail(Site.TAIL, table[:, :6], 24, 0) is False
    assert calls == [Site.TAIL, Site.TAIL]
    assert c.stats.sites[Site.TAIL].merged == 8
    assert c.stats.sites[Site.TAIL].skipped == 2
    c.close()


def test_a_missing_extension_is_said_once_and_the_python_twin_runs():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['cucopy._segment'] = None\n"  # as if it was never built
        "import cucopy, cucopy.segment as s\n"
        "assert s.IMPLEMENTATION == 'python' and s.Segment is s.PySegment\n"
        "import cucopy.copier\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CUCOPY_PURE_PYTHON"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("compiled staging core (cucopy._segment) is not built") == 1
    env["CUCOPY_PURE_PYTHON"] = "1"  # chosen on purpose: nothing said
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and "not built" not in out.stderr


def test_entries_someone_holds_are_not_recycled_by_the_next_steps(twin):
    # the compiled twin reuses the entries of a landed segment that nothing else
    # holds; a list or an entry kept by the caller must keep what it said
    dev, c = _sim_copier()
    dsts = [dev.zeros((4,), np.int32) for _ in range(3)]
    with c.step():
        for d in dsts:
            c.copy(Site.A, d, np.arange(4, dtype=np.int32))
        held_list = c._seg.entries
        held_one = held_list[1]
    for k in range(3):  # later steps take entries from the pool
        with c.step():
            for d in dsts:
                c.copy(Site.B, d, np.full(4, k, np.int32))
    assert [e.site for e in held_list] == [Site.A] * 3
    assert held_one.site is Site.A and held_one.on_drop is None
    with c.step():
        c.copy(Site.A, dsts[0], np.arange(4, dtype=np.int32))
        one = c._seg.entries[0]
    with c.step():
        c.copy(Site.C, dsts[0], np.arange(4, dtype=np.int32))  # a barrier site
    assert one.site is Site.A
    assert dev.to_host(dsts[0]).tolist() == [0, 1, 2, 3]
    assert c.stats.sites[Site.B].merged == 9
    c.close()


def test_more_live_arrays_than_the_front_cache_holds_stay_on_the_fast_path(twin):
    # the compiled twin keeps a table (512 sets of 4) in front of its dict caches:
    # arrays that share a full set evict each other and are found again in the dict;
    # every copy lands, none takes the general path once seen
    dev = SimDevice(policy="lazy")
    sites = cc.CopySite("Many", [(f"s{i}", cc.H2D) for i in range(4)])
    c = cc.DeviceCopier(
        cc.CopyPlan(merge=set(sites)), stream=dev.default_stream, device=dev, backend="sim"
    )
    dsts = [dev.zeros((2,), np.int32) for _ in range(1200)]
    srcs = [np.array([i, -i], np.int32) for i in range(1200)]
    site = next(iter(sites))
    with c.step():
        for d, x in zip(dsts, srcs):
            c.copy(site, d, x)
    calls = _spy(c)
    for k in range(2):
        with c.step():
            for i, (d, x) in enumerate(zip(dsts, srcs)):
                x[:] = (i + k, k)
                c.copy(site, d, x)
        for i in (0, 1, 511, 512, 513, 1199):
            assert dev.to_host(dsts[i]).tolist() == [i + k, k]
    assert calls == []
    assert all(dev.to_host(d).tolist() == [i + 1, 1] for i, d in enumerate(dsts))
    c.close()


@pytest.mark.skipif(
    CSegment is None or segment.Segment is not CSegment, reason="the compiled twin is not in use"
)
def test_a_step_of_512_destinations_is_found_in_the_front_table():
    # 512 sets of 4 ways: a step's 512 destinations seldom overflow a set, so nearly
    # every lookup after the first step is a front hit (a direct-mapped table of the
    # same size missed about a quarter of them, each a dict probe and a new int)
    dev = SimDevice(policy="lazy")
    sites = cc.CopySite("Front", [("s", cc.H2D)])
    c = cc.DeviceCopier(
        cc.CopyPlan(merge=set(sites)), stream=dev.default_stream, device=dev, backend="sim"
    )
    assert type(c._seg) is CSegment
    srcs = [np.array([i, 1], np.int32) for i in range(512)]
    # The sets are picked by the objects' addresses, which the allocator hands out: in
    # one full-suite run (session 11) a layout missed a quarter of the lookups here, and
    # the next run did not. Up to three sets of destinations, each in fresh objects;
    # the old direct-mapped table missed about a third on every one.
    tries = []
    for _ in range(3):
        dsts = [dev.zeros((2,), np.int32) for _ in range(512)]
        with c.step():
            for d, x in zip(dsts, srcs):
                c.copy(sites.s, d, x)
        before = c._seg.front_misses
        for _ in range(4):
            with c.step():
                for d, x in zip(dsts, srcs):
                    c.copy(sites.s, d, x)
        tries.append(c._seg.front_misses - before)
        if tries[-1] < 0.05 * 4 * 512:
            break
    assert tries[-1] < 0.05 * 4 * 512, f"front misses in 4 steps of 512, per try: {tries}"
    assert c.stats.sites[sites.s].merged == 5 * 512 * len(tries)
    c.close()


def test_a_numpy_column_slice_source_is_gathered_on_the_fast_path(twin):
    # table[:, :n] (rows packed, not packed together): the compiled twin gathers the
    # rows into the slot without the general path; every twin lands the same bytes
    dev, c = _sim_copier()
    dst_table = dev.zeros((4, 10), np.int32)
    host = np.arange(40, dtype=np.int32).reshape(4, 10)
    with c.step():
        c.copy(Site.A, dst_table[:, :6], host[:, :6])  # remembers the destination
    calls = _spy(c)
    for k in range(3):
        host += 100
        with c.step():
            c.copy(Site.A, dst_table[:, :6], host[:, :6])
            host[:] = -1  # snapshot at the call
        host[:] = np.arange(40, dtype=np.int32).reshape(4, 10) + 100 * (k + 1)
        got = dev.to_host(dst_table)
        assert got[:, :6].tolist() == host[:, :6].tolist()
        assert got[:, 6:].tolist() == [[0] * 4] * 4
    if twin is not segment.PySegment:
        assert calls == []  # gathered on the fast path
    # columns not packed (a stride between elements): the general path, same bytes
    with c.step():
        c.copy(Site.A, dst_table[:, :5], host[:, ::2])
    assert dev.to_host(dst_table)[:, :5].tolist() == host[:, ::2].tolist()
    assert calls and calls[-1] == Site.A
    c.close()


class _FakeSlot:
    """What ``bind`` reads of a ring slot: its bytes (``array``, ``mv``), ``top``, ``bottom``."""

    def __init__(self, nbytes):
        self.array = np.zeros(nbytes, np.uint8)
        self.mv = memoryview(self.array)
        self.top = nbytes
        self.bottom = 0


def _stage_one_into(seg, slot):
    """Bind ``slot`` as the ring hands it out (reset), stage one H2D copy, cut, finish."""
    slot.top, slot.bottom = slot.array.nbytes, 0
    seg.bind(slot)
    desc = (0x1000, 0, 0, 16, 16, 16, 1, pack.KIND_H2D, 0, 0)
    r = seg.stage(Site.A, None, 0x1000, 0x1010, None, 16, desc, True)
    assert isinstance(r, tuple)
    start, end, _, _ = seg.cut(-1)
    seg.finish()
    return start, end


@pytest.mark.parametrize("cls", TWINS)
def test_bind_writes_into_the_slot_bound_now(cls):
    """The compiled bind keeps a slot's exported bytes from one step to the next; a
    slot replaced by another (the ring grows or shrinks one) or whose array changed
    must be written afresh, never through the view of the one bound before."""
    seg = cls(frozenset({Site.A}), frozenset())
    a, b = _FakeSlot(4096), _FakeSlot(8192)
    for slot in (a, a, b, a, b, b, a):
        for s in (a, b):
            s.array[:] = 0
        start, end = _stage_one_into(seg, slot)
        other = b if slot is a else a
        assert slot.array[start:end].any() and not other.array.any()
        assert seg.slot is slot and slot.bottom == end
        header, _ = pack.decode(bytes(slot.array[start:end]))
        assert int(header["ndesc"]) == 1
    # the same slot object, a new array (as a Slot never does, but bind must not care)
    old = a.array
    a.array = np.zeros(4096, np.uint8)
    a.mv = memoryview(a.array)
    old[:] = 0
    start, end = _stage_one_into(seg, a)
    assert a.array[start:end].any() and not old.any()


def test_the_python_twin_never_launches_and_cuts_as_cut_does(monkeypatch):
    # flush_carried's contract on the reference twin: the caller's own path lands
    # the segment, so it returns cut()'s tuple (only the compiled twin can call the
    # compiled launcher)
    monkeypatch.setattr(copier_module, "Segment", segment.PySegment)
    out = []
    for launcher in ("not called", None):
        dev, c = _sim_copier()
        c.begin()
        for i, k in enumerate((3, 70, 1)):
            c.copy(
                (Site.A, Site.B)[i % 2],
                dev.zeros((k,), np.int32),
                np.arange(k, dtype=np.int32),
            )
        if launcher is None:
            out.append(c._seg.cut(4096))
        else:
            out.append(c._seg.flush_carried(launcher, 0, 4096, 0x1000))
        c.discard()
        c.close()
    assert isinstance(out[0], tuple) and out[0] == out[1]


@pytest.mark.parametrize("mode", ["auto", "inline", "mapped", "dma"])
def test_each_step_says_where_streaming_stores_begin(twin, mode):
    # the compiled begin() and the Python twin's set the segment's cache hint alike:
    # mapped and dma from the segment's first byte (the GPU reads all of it), auto and
    # inline past the largest carry (a carried launch's driver copies it on the host)
    dev = SimDevice(policy="lazy")
    c = cc.DeviceCopier(PLAN, stream=dev.default_stream, device=dev, backend="sim", flush_mode=mode)
    assert c._carry_max > 0
    want = 0 if mode in ("mapped", "dma") else c._carry_max
    a = dev.zeros((8,), np.int32)
    for k in range(3):
        with c.step():
            assert c._seg.nt_from == want
            c.copy(Site.A, a, np.full(8, k, np.int32))
        assert dev.to_host(a).tolist() == [k] * 8
    c.flush_mode = "mapped" if mode != "mapped" else "auto"  # read again each step
    with c.step():
        assert c._seg.nt_from == (0 if mode != "mapped" else c._carry_max)
    c.close()


@pytest.mark.skipif(CSegment is None, reason="the compiled twin is not built")
@pytest.mark.parametrize("nt_from", [-1, 0, 100, 5000])
def test_streaming_stores_stage_the_same_bytes(monkeypatch, nt_from):
    # the compiled segment's streaming stores (x86-64: 16-byte aligned runs of 64 bytes
    # and more, the tail cached) land every byte as memcpy does: sizes around the
    # store widths, packed and gathered (table[:, :n]) sources, unaligned source starts
    monkeypatch.setattr(copier_module, "Segment", CSegment)
    dev, c = _sim_copier()
    rng = np.random.default_rng(nt_from + 7)
    sizes = [1, 3, 4, 15, 16, 17, 63, 64, 65, 100, 128, 129, 1000, 1024, 1500]
    dsts = [dev.zeros((n,), np.int32) for n in sizes]
    table = dev.zeros((6, 40), np.int32)
    for _ in range(3):
        wants = []
        with c.step():
            c._seg.nt_from = nt_from
            for d in dsts:
                n = d.shape[0]
                big = rng.integers(-(2**31), 2**31, n + 1, dtype=np.int64).astype(np.int32)
                src = big[1:]  # starts 4 bytes into its buffer: not 16-byte aligned
                c.copy(Site.A, d, src)
                wants.append(src.copy())
            host = rng.integers(-99, 99, (6, 48), dtype=np.int32)
            c.copy(Site.B, table[:, :33], host[:, :33])  # rows gathered
        for d, w in zip(dsts, wants):
            assert dev.to_host(d).tolist() == w.tolist()
        assert dev.to_host(table)[:, :33].tolist() == host[:, :33].tolist()
    assert c.stats.sites[Site.A].merged == 3 * len(sizes)
    c.close()


def test_no_streaming_stores_with_cucopy_no_nt():
    # CUCOPY_NO_NT=1 at import: the hint stays -1 whatever the mode (both twins)
    code = (
        "import numpy as np, cucopy as cc\n"
        "from cucopy.backends.sim import SimDevice\n"
        "S = cc.CopySite('S', [('a', cc.H2D)])\n"
        "dev = SimDevice(policy='lazy')\n"
        "c = cc.DeviceCopier(cc.CopyPlan(merge={S.a}), stream=dev.default_stream,\n"
        "                    device=dev, backend='sim', flush_mode='mapped')\n"
        "with c.step():\n"
        "    print(c._seg.nt_from)\n"
        "    c.copy(S.a, dev.zeros((4,), np.int32), np.arange(4, dtype=np.int32))\n"
    )
    import subprocess
    import sys

    for off, want in (("1", "-1"), ("0", "0")):
        env = dict(os.environ, CUCOPY_NO_NT=off)
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == [want]


def test_an_empty_step_flushes_in_the_compiled_call():
    # every copy of the step skipped (unchanged buffers): the compiled flush returns
    # at once, as flush()'s body would; with the slot's event owed it leaves the body
    # to record it. The Python twin has no compiled flush: its body runs.
    if not copier_module._COMPILED:
        pytest.skip("the compiled core is not in use")
    dev, c = _sim_copier()
    a = dev.zeros((8,), np.int32)
    with c.step():
        c.copy(Site.A, a, np.arange(8, dtype=np.int32))
    c.begin()
    assert c._flush_fast() is True  # nothing staged, the new slot clean
    c._ring.current.dirty = True  # as if an eager copy had used the slot
    assert c._flush_fast() is False
    c.flush()  # the body records the slot's event
    assert not c._ring.current.dirty
    c.close()
    assert dev.to_host(a).tolist() == list(range(8))


def test_the_flush_mode_is_kept_as_the_interned_literal():
    # a mode built at run time (read from a config file) is stored as FLUSH_MODES' own
    # string (the compiled core reads it once, as its enum, when it is set)
    dev = SimDevice(policy="lazy")
    mode = "".join(["map", "ped"])
    assert mode == "mapped" and mode is not copier_module.FLUSH_MODES[2]
    c = cc.DeviceCopier(PLAN, stream=dev.default_stream, device=dev, backend="sim", flush_mode=mode)
    assert c.flush_mode is copier_module.FLUSH_MODES[2]
    c.close()


def _entries_program(cls, monkeypatch):
    """Fast copies, a fill (the general staging path), more copies: the entries as read
    mid-segment, that list again after one more copy, and the merged counts after."""
    monkeypatch.setattr(copier_module, "Segment", cls)
    dev, c = _sim_copier()
    a = [dev.zeros((4 + i,), np.int32) for i in range(3)]
    b = [dev.zeros((2, 8), np.int64) for _ in range(2)]
    tail = dev.zeros((16,), np.int32)
    table = dev.zeros((8, 16), np.int32)
    late = dev.zeros((3,), np.int32)
    for _ in range(2):  # the first step caches the destinations
        with c.step():
            for i, d in enumerate(a):
                c.copy(Site.A, d, np.arange(4 + i, dtype=np.int32))
            c.fill_tail(Site.TAIL, tail, 5, -1)
            for d in b:
                c.copy(Site.B, d, np.ones((2, 8), np.int64))
            c.copy(Site.B, table[1:3, 2:5], np.full((2, 3), 7, np.int32))
            held = c._seg.entries
            first = [(e.site, e.lo, e.hi, e.index, e.geom) for e in held]
            c.copy(Site.A, late, np.ones(3, np.int32))  # a cached destination: fast
            after = [(e.site, e.lo, e.hi) for e in held]
    counts = {s: c.stats.sites[s].merged for s in (Site.A, Site.B, Site.TAIL)}
    assert dev.to_host(table)[1:3, 2:5].tolist() == [[7] * 3] * 2
    assert dev.to_host(tail).tolist() == [0] * 5 + [-1] * 11
    c.close()
    base = first[0][1]  # addresses relative to the first destination's

    def rel(g):
        return g if g is None else (g[0] - base, *g[1:])

    return (
        [(s, lo - base, hi - base, i, rel(g)) for s, lo, hi, i, g in first],
        [(s, lo - base, hi - base) for s, lo, hi in after],
        counts,
    )


def test_entries_read_mid_segment_are_the_staged_copies_in_order(monkeypatch):
    # the compiled twin keeps a fast copy's entry as a C record until something reads
    # the list: what is read is what the Python twin holds, in staging order, and a
    # list read mid-segment takes the copies staged after it, as the Python twin's does
    want, want_after, want_counts = _entries_program(segment.PySegment, monkeypatch)
    assert [s for s, *_ in want] == [Site.A] * 3 + [Site.TAIL] + [Site.B] * 3
    assert [i for *_, i, _ in want[:3]] == [0, 1, 2]
    assert want_after[: len(want)] == [w[:3] for w in want]
    assert len(want_after) == len(want) + 1 and want_after[-1][0] is Site.A
    assert want_counts == {Site.A: 8, Site.B: 6, Site.TAIL: 2}
    if CSegment is None:
        return
    assert _entries_program(CSegment, monkeypatch) == (want, want_after, want_counts)
