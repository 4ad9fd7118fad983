"""The CUDA backend's per-step driver calls made from C (``cucopy.backends._cudacall``).

No GPU here: ctypes callbacks stand in for ``cuLaunchKernel`` and
``cuStreamIsCapturing``, so the tests see exactly what the driver would be handed
(kernel, grid, stream, the parameter buffer's bytes and size). On a GPU the same
calls run for real in every CUDA test (tests/test_backend_cuda.py and the rest).
"""

from __future__ import annotations

import ctypes
import os
import struct

import numpy as np
import pytest

from cucopy import pack

try:
    from cucopy.backends import _cudacall
except ImportError:  # no compiler where this runs
    _cudacall = None

needs_ext = pytest.mark.skipif(_cudacall is None, reason="cucopy.backends._cudacall is not built")

_LAUNCH = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,
    *([ctypes.c_uint] * 7),
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.POINTER(ctypes.c_void_p),
)
_CAPTURING = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))


class FakeDriver:
    """Records launches; answers capture queries from ``status`` / ``result``."""

    def __init__(self):
        self.launches = []
        self.result = 0  # CUresult the next calls return
        self.status = 0
        self._launch = _LAUNCH(self.launch)
        self._capturing = _CAPTURING(self.capturing)
        addr = ctypes.c_void_p
        self.addrs = (
            ctypes.cast(self._launch, addr).value,
            ctypes.cast(self._capturing, addr).value,
        )

    def launch(self, f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra):
        rec = {"f": f, "grid": (gx, gy, gz), "block": (bx, by, bz), "shmem": shmem}
        rec["stream"] = stream or 0
        if params:
            rec["seg"] = ctypes.cast(params[0], ctypes.POINTER(ctypes.c_uint64))[0]
        if extra:
            # {BUFFER_POINTER, buf, BUFFER_SIZE, &size, END}
            assert (extra[0] or 0) == 1 and (extra[2] or 0) == 2 and (extra[4] or 0) == 0
            size = ctypes.cast(extra[3], ctypes.POINTER(ctypes.c_size_t))[0]
            rec["size"] = size
            rec["buffer"] = ctypes.string_at(extra[1], size)
        self.launches.append(rec)
        return self.result

    def capturing(self, stream, out):
        out[0] = self.status
        return self.result


CAPS = [(1008, 0x1000), (2032, 0x2000), (4080, 0x4000), (32736, 0x8000)]


def _driver(fake):
    d = _cudacall.Driver(*fake.addrs)
    d.kernels(0x5CA7, CAPS, pack.THREADS)
    return d


@needs_ext
def test_capture_query_returns_the_status_or_the_negated_error():
    fake = FakeDriver()
    d = _driver(fake)
    for status in (0, 1, 2):
        fake.status = status
        assert d.is_capturing(0x1234) == status
    fake.result = 201  # CUDA_ERROR_INVALID_CONTEXT: the backend then asks CuPy
    assert d.is_capturing(0x1234) == -201


@needs_ext
@pytest.mark.parametrize("nbytes,cap", [(1, 1008), (1008, 1008), (1009, 2032), (4000, 4080)])
def test_a_carried_launch_takes_the_smallest_capacity_and_the_segment_bytes(nbytes, cap):
    fake = FakeDriver()
    d = _driver(fake)
    host = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    rc = d.carried(7, 0xABC, 0xD00D0000, host.ctypes.data, nbytes)
    assert rc == 0
    (rec,) = fake.launches
    assert rec["f"] == dict(CAPS)[cap]
    assert rec["grid"] == (7, 1, 1) and rec["block"] == (pack.THREADS, 1, 1)
    assert rec["stream"] == 0xABC and rec["shmem"] == 0
    assert rec["size"] == pack.CARRY_PREFIX + cap
    buf = rec["buffer"]
    seg, n, reserved = struct.unpack_from("<QII", buf)
    assert (seg, n, reserved) == (0xD00D0000, nbytes, 0)
    assert buf[pack.CARRY_PREFIX : pack.CARRY_PREFIX + nbytes] == host.tobytes()


@needs_ext
def test_carried_refuses_what_no_capacity_holds_and_bad_grids_without_launching():
    fake = FakeDriver()
    d = _driver(fake)
    host = np.zeros(40000, np.uint8)
    assert d.carried(1, 0, 0, host.ctypes.data, 32737) == -1
    assert d.carried(0, 0, 0, host.ctypes.data, 16) == -1
    assert d.carried(1 << 31, 0, 0, host.ctypes.data, 16) == -1
    assert d.scatter(0, 0, 0) == -1
    assert fake.launches == []


@needs_ext
def test_the_driver_error_comes_back_as_is():
    fake = FakeDriver()
    d = _driver(fake)
    fake.result = 700
    host = np.zeros(8, np.uint8)
    assert d.carried(1, 0, 0, host.ctypes.data, 8) == 700
    assert d.scatter(3, 5, 0xBEEF) == 700


@needs_ext
def test_a_plain_scatter_passes_the_segment_address_as_its_one_argument():
    fake = FakeDriver()
    d = _driver(fake)
    assert d.scatter(3, 5, 0xBEEF00) == 0
    (rec,) = fake.launches
    assert rec["f"] == 0x5CA7 and rec["grid"] == (3, 1, 1) and rec["stream"] == 5
    assert rec["seg"] == 0xBEEF00 and "buffer" not in rec


@needs_ext
def test_launches_keep_the_gil():
    # PyGILState_Check stands in for cuLaunchKernel: it answers 1 when the calling
    # thread holds the GIL. (Called with the launch's arguments, which it ignores: the
    # caller pops them on every ABI CPython supports.) A launch that let the GIL go would
    # hand the interpreter to any other Python thread and wait to get it back.
    check = ctypes.cast(ctypes.pythonapi.PyGILState_Check, ctypes.c_void_p).value
    fake = FakeDriver()
    d = _cudacall.Driver(check, fake.addrs[1])
    d.kernels(0x5CA7, CAPS, pack.THREADS)
    host = np.zeros(64, np.uint8)
    assert d.carried(1, 0, 0x1000, host.ctypes.data, 64) == 1
    assert d.scatter(1, 0, 0x1000) == 1


@needs_ext
def test_no_launch_before_the_kernels_are_known_and_bad_kernel_tables_are_refused():
    fake = FakeDriver()
    d = _cudacall.Driver(*fake.addrs)
    assert d.scatter(1, 0, 0) == -1
    assert d.carried(1, 0, 0, 0, 0) == -1
    with pytest.raises(ValueError):
        d.kernels(0x1, [(2032, 1), (1008, 2)], 256)  # not ascending
    with pytest.raises(ValueError):
        d.kernels(0x1, [(65536, 1)], 256)  # over the 32 KiB the C buffer holds
    with pytest.raises(ValueError):
        _cudacall.Driver(0, 1)
    assert fake.launches == []


def test_the_compiled_driver_calls_are_built_and_chosen_unless_pure_python():
    # CI's normal run must build them; CUCOPY_PURE_PYTHON=1 keeps CuPy's wrappers
    from cucopy._config import config_dict

    if os.environ.get("CUCOPY_PURE_PYTHON"):
        assert config_dict()["driver_calls"] == "python"
    else:
        assert _cudacall is not None, "cucopy.backends._cudacall is not built"
        assert config_dict()["driver_calls"] == "compiled"


# -- the carried launch as a C function, called by the staging core at flush ---------

try:
    from cucopy._segment import Segment as CSegment
except ImportError:
    CSegment = None

from cucopy.backends.sim import _SPACE, SimDevice  # noqa: E402

needs_both = pytest.mark.skipif(
    _cudacall is None or CSegment is None, reason="both compiled modules are needed"
)


@pytest.fixture(autouse=True)
def _compiled_segment(monkeypatch):
    # the staging core's launcher call is the compiled twin's (the pure-Python run
    # of the suite still tests it, side by side, as test_segment does its twins)
    if CSegment is not None:
        import cucopy.copier as copier_module

        monkeypatch.setattr(copier_module, "Segment", CSegment)


def _staged_copier(sizes):
    """A sim copier with the compiled segment, a step open and len(sizes) copies staged."""
    import cucopy as cc

    sites = list(cc.CopySite("L", [(f"s{i}", cc.H2D) for i in range(len(sizes))]))
    dev = SimDevice()
    c = cc.DeviceCopier(cc.CopyPlan(merge=set(sites)), device=dev, backend="sim")
    assert type(c._seg) is CSegment
    c.begin()
    rng = np.random.default_rng(len(sizes))
    for s, k in zip(sites, sizes):
        c.copy(s, dev.zeros((k,), np.int32), rng.integers(0, 1 << 30, k, dtype=np.int32))
    return c


@needs_both
def test_the_staging_core_launches_what_cut_encodes_through_the_launcher():
    # the same program staged twice: one segment cut as the Python path cuts it, the
    # other cut and launched in one call; the launch carries exactly the cut bytes
    fake = FakeDriver()
    launcher = _driver(fake).launcher()
    sizes = [3, 40, 1, 200, 17]
    a, b = _staged_copier(sizes), _staged_copier(sizes)
    start, end, nblocks, n = b._seg.cut(4096)
    total = a._seg.flush_carried(launcher, 0xABC, 4096, 0x7000000)
    assert total == end - start
    (rec,) = fake.launches
    assert rec["grid"] == (nblocks, 1, 1) and rec["stream"] == 0xABC
    buf = rec["buffer"]
    seg, nbytes, _ = struct.unpack_from("<QII", buf)
    assert seg == 0x7000000 + start and nbytes == total
    carried = buf[pack.CARRY_PREFIX : pack.CARRY_PREFIX + nbytes]
    assert carried == bytes(a._seg.slot.array[start:end])
    # the same bytes as the Python path's cut (destinations compared within each
    # simulated device's own address space)
    ha, da = pack.decode(carried)
    hb, db = pack.decode(bytes(b._seg.slot.array[start:end]))
    assert ha == hb and da.shape == db.shape
    for f in da.dtype.names:
        x, y = da[f], db[f]
        if f == "dst":
            x, y = x & (_SPACE - 1), y & (_SPACE - 1)
        assert np.array_equal(x, y), f
    assert a._seg.cursor == b._seg.cursor and a._seg.peak == b._seg.peak
    for c in (a, b):
        c.discard()
        c.close()


@needs_both
def test_what_the_launcher_cannot_launch_comes_back_cut_for_the_python_path():
    fake = FakeDriver()
    launcher = _driver(fake).launcher()
    sizes = [5, 9]
    # too large to carry: cut only, nothing launched
    a, b = _staged_copier(sizes), _staged_copier(sizes)
    assert a._seg.flush_carried(launcher, 1, 16, 0x7000000) == b._seg.cut(16)
    assert fake.launches == []
    # the driver refused the launch: the same cut comes back (the backend's scatter()
    # then launches again and reports the error)
    c, d = _staged_copier(sizes), _staged_copier(sizes)
    fake.result = 700
    assert c._seg.flush_carried(launcher, 1, 4096, 0x7000000) == d._seg.cut(4096)
    assert len(fake.launches) == 1
    with pytest.raises((TypeError, ValueError)):
        c._seg.flush_carried(object(), 1, 4096, 0)  # not a launcher capsule
    for x in (a, b, c, d):
        x.discard()
        x.close()


_CTX_CURRENT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))


@needs_ext
def test_a_bound_driver_calls_nothing_from_another_context():
    fake = FakeDriver()
    d = _driver(fake)
    current = {"ctx": 0x1111}

    @_CTX_CURRENT
    def ctx_current(out):
        out[0] = current["ctx"]
        return 0

    d.bind(ctypes.cast(ctx_current, ctypes.c_void_p).value, 0x1111)
    host = np.zeros(32, np.uint8)
    assert d.carried(1, 0, 0x1000, host.ctypes.data, 32) == 0
    assert d.scatter(1, 0, 0x1000) == 0
    fake.status = 1
    assert d.is_capturing(0) == 1
    assert len(fake.launches) == 2
    current["ctx"] = 0x2222  # another device's context is current on this thread
    assert d.carried(1, 0, 0x1000, host.ctypes.data, 32) == _cudacall.OTHER_CONTEXT
    assert d.scatter(1, 0, 0x1000) == _cudacall.OTHER_CONTEXT
    assert d.is_capturing(0) == _cudacall.OTHER_CONTEXT_STATUS < 0
    assert len(fake.launches) == 2  # nothing reached the driver
    with pytest.raises(ValueError):
        d.bind(0, 0x1111)


@needs_ext
def test_a_launcher_keeps_its_driver_alive():
    import gc

    fake = FakeDriver()
    launcher = _driver(fake).launcher()  # the Driver itself is dropped here
    gc.collect()
    if CSegment is None:
        return
    a = _staged_copier([4])
    assert isinstance(a._seg.flush_carried(launcher, 1, 4096, 0x1000), int)
    assert len(fake.launches) == 1
    a.discard()
    a.close()


@pytest.mark.gpu
@needs_both
def test_on_a_gpu_inline_segments_launch_from_the_staging_core(env):
    import cucopy as cc

    if os.environ.get("CUCOPY_PURE_PYTHON") or not hasattr(env, "cp"):
        pytest.skip("the compiled launcher is the CUDA backend's")
    site = cc.CopySite("G", [("a", cc.H2D), ("b", cc.H2D)])
    c = env.copier(cc.CopyPlan(merge=set(site)), flush_mode="auto")
    assert c._launcher is not None
    calls = []
    scatter = c._backend.scatter

    def spy(*args, **kw):
        calls.append(args)
        return scatter(*args, **kw)

    c._backend.scatter = spy
    a, b = env.empty((5,)), env.empty((300,))
    for step in range(3):
        with c.step():
            c.copy(site.a, a, np.arange(5, dtype=np.int32) + step)
            c.copy(site.b, b, np.arange(300, dtype=np.int32) * step)
        assert env.to_host(a).tolist() == list(range(step, step + 5))
        assert env.to_host(b).tolist() == [i * step for i in range(300)]
    assert calls == []  # every launch came from the staging core
    assert c.stats.modes["inline"] == 3 and c.stats.segments == 3
    c.close()


@needs_both
def _landing_copier(mode: str, plan_sites=("A", "B"), eager_site: bool = False):
    """A sim copier given a fake launcher that lands what it is handed.

    The fake driver checks the launch carries the slot's bytes, then lands them with
    the sim backend's own scatter (as the carried kernel would). Returns
    ``(copier, site class, device, fake driver, problems)``.
    """
    import cucopy as cc

    members = [(name, cc.H2D) for name in plan_sites] + ([("E", cc.H2D)] if eager_site else [])
    site = cc.CopySite("Site", members)
    dev = SimDevice(policy="lazy")
    c = cc.DeviceCopier(
        cc.CopyPlan(merge={getattr(site, n) for n in plan_sites}),
        stream=dev.default_stream,
        device=dev,
        backend="sim",
        flush_mode=mode,
    )
    be = c._backend
    problems: list = []

    class Landing(FakeDriver):
        def launch(self, f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra):
            super().launch(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra)
            try:
                buf = self.launches[-1]["buffer"]
                seg, n, _ = struct.unpack_from("<QII", buf)
                pin = c._slot.pinned
                start = seg - pin.device_ptr
                if buf[pack.CARRY_PREFIX : pack.CARRY_PREFIX + n] != bytes(
                    c._slot.array[start : start + n]
                ):
                    problems.append("the launch carried other bytes than the slot's")
                be.scatter(seg, gx, dev.default_stream, True, n, pin.ptr + start)
            except Exception as e:  # a callback's exception would be lost
                problems.append(repr(e))
            return 0

    fake = Landing()
    d = _cudacall.Driver(*fake.addrs)
    caps = be.carry_capacities()
    d.kernels(0x5CA7, [(cap, 0x1000 + i) for i, cap in enumerate(caps)], pack.THREADS)
    c._launcher, c._handle = d.launcher(), 77
    return c, site, dev, fake, problems


@pytest.mark.parametrize("mode", ["auto", "inline", "mapped", "dma"])
def test_a_copier_given_a_launcher_lands_what_scatter_would(mode):
    # CI has no GPU, so the copier's launcher branch runs here against the simulated
    # device (see _landing_copier)
    from cucopy import copier as copier_mod

    c, Site, dev, fake, problems = _landing_copier(mode)
    rng = np.random.default_rng(7)
    dsts = [dev.zeros((k,), np.int32) for k in (3, 100, 5000, 1)]
    for _ in range(4):
        want = [rng.integers(-9, 9, d_.shape[0], dtype=np.int32) for d_ in dsts]
        with c.step():
            for i, (d_, w) in enumerate(zip(dsts, want)):
                c.copy(Site.A if i % 2 else Site.B, d_, w)
                if i == 1:
                    c.flush()  # a barrier: the step's second segment starts past the first
        dev.synchronize()
        for d_, w in zip(dsts, want):
            assert np.array_equal(dev.to_host(d_), w)
    assert problems == []
    # inline segments went through the launcher, the others through scatter()
    assert len(fake.launches) == c.stats.modes["inline"]
    assert c.stats.segments == 8
    if mode in ("auto", "inline"):  # at most 20 KB a segment: carried whole
        assert len(fake.launches) == 8
        # each through flush()'s compiled common case (CopierCore._flush_fast)
        compiled = copier_mod._CopierCore is not copier_mod.PyCopierCore
        assert c._fast_flushes == (8 if compiled else 0)
    if mode in ("mapped", "dma"):
        assert fake.launches == []
        assert c._fast_flushes == 0
    c.close()


def _compiled_copier_core() -> bool:
    from cucopy import copier

    return copier._CopierCore is not copier.PyCopierCore


@needs_both
@pytest.mark.skipif(not _compiled_copier_core(), reason="the compiled staging core is not in use")
@pytest.mark.parametrize("why", ["dma", "no_launcher", "check_mode", "capturing"])
def test_flush_fast_declines_without_cutting(monkeypatch, why):
    from cucopy import check

    mode = "dma" if why == "dma" else "auto"
    c, Site, dev, fake, problems = _landing_copier(mode)
    a = dev.zeros((64,), np.int32)
    with c.step():
        c.copy(Site.A, a, np.arange(64, dtype=np.int32))
    if why == "no_launcher":
        c._launcher = None
    elif why == "check_mode":
        monkeypatch.setattr(check, "CHECK_MODE", True)
    c.begin()
    c.copy(Site.A, a, np.full(64, 5, np.int32))
    if why == "capturing":
        monkeypatch.setattr(c, "_cap_query", lambda arg: 1)
    staged, cursor, flushes = c.staged, c._seg.cursor, c._fast_flushes
    assert c._flush_fast() is False
    assert (c.staged, c._seg.cursor, c._fast_flushes) == (staged, cursor, flushes)
    c.flush()  # flush()'s Python body lands it
    dev.synchronize()
    assert dev.to_host(a).tolist() == [5] * 64 and problems == []
    c.close()


@needs_both
@pytest.mark.skipif(not _compiled_copier_core(), reason="the compiled staging core is not in use")
def test_flush_fast_lands_what_it_cut_through_the_python_path_when_too_large():
    c, Site, dev, fake, problems = _landing_copier("auto")
    big = dev.zeros((16384,), np.int32)  # 64 KiB: past every carry capacity
    want = np.arange(16384, dtype=np.int32)
    with c.step():
        c.copy(Site.A, big, want)
    dev.synchronize()
    assert np.array_equal(dev.to_host(big), want) and problems == []
    assert fake.launches == [] and c._fast_flushes == 0
    assert c.stats.segments == 1 and c.stats.modes["inline"] == 0
    assert c._ring.current.recorded  # mapped or dma: its event follows the launch
    c.close()


@needs_both
@pytest.mark.skipif(not _compiled_copier_core(), reason="the compiled staging core is not in use")
def test_flush_fast_leaves_an_eager_copys_event_to_the_python_body():
    c, Site, dev, fake, problems = _landing_copier("auto", eager_site=True)
    a, b = dev.zeros((16,), np.int32), dev.zeros((16,), np.int32)
    with c.step():
        c.copy(Site.A, a, np.full(16, 3, np.int32))
    with c.step():
        c.copy(Site.E, b, np.full(16, 4, np.int32))  # not merged: an eager copy, slot dirty
        c.copy(Site.A, a, np.full(16, 6, np.int32))
    assert c._fast_flushes == 2 and len(fake.launches) == 2
    assert c._ring.current.recorded and not c._ring.current.dirty
    dev.synchronize()
    assert dev.to_host(a).tolist() == [6] * 16 and dev.to_host(b).tolist() == [4] * 16
    assert problems == []
    c.close()
