"""The CUDA backend against NumPy references; every test needs a GPU and CuPy."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cucopy import pack  # noqa: E402
from cucopy.backends import cuda as cuda_backend  # noqa: E402
from cucopy.backends.cuda import CudaBackend, gpu_available  # noqa: E402
from cucopy.errors import CopyError  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpu_available(), reason="no CUDA device visible to CuPy"),
]


@pytest.fixture(scope="module")
def be():
    return CudaBackend()


@pytest.fixture
def stream(be):
    s = cupy.cuda.Stream(non_blocking=True)
    yield be.resolve_stream(s)
    s.synchronize()
    del s


def upload(be, dst_ptr, data, stream):
    """Copy host bytes to device memory through a pinned buffer and wait."""
    data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    buf = be.alloc_pinned(data.nbytes)
    buf.array[:] = data
    be.copy2d(True, dst_ptr, 0, buf.ptr, 0, data.nbytes, 1, stream)
    be.synchronize(stream)
    buf.close()


def device_bytes(be, nbytes, stream, pattern=0xA5):
    """A device buffer filled with a known byte pattern (so untouched bytes show)."""
    d = be.alloc_device(nbytes)
    upload(be, d.ptr, np.full(nbytes, pattern, np.uint8), stream)
    return d


def current_bytes(be, d, stream) -> np.ndarray:
    return np.frombuffer(be.read(d.ptr, d.nbytes, stream), np.uint8).copy()


# -- identity -------------------------------------------------------------------------


def test_identity(be):
    assert gpu_available()
    assert be.name == "cuda"
    assert be.device == cupy.cuda.runtime.getDevice()
    assert be.describe() == f"cuda:{be.device}"
    assert isinstance(be.mapped_threshold(), int) and be.mapped_threshold() >= 0


def test_bad_device_is_refused():
    n = cupy.cuda.runtime.getDeviceCount()
    with pytest.raises(ValueError, match=r"device: expected a CUDA ordinal in \[0, "):
        CudaBackend(n)


# -- memory ---------------------------------------------------------------------------


def test_pinned_alloc_is_mapped_and_pinned(be, stream):
    buf = be.alloc_pinned(4096)
    assert buf.nbytes == 4096 and buf.array.dtype == np.uint8
    assert be.is_pinned(buf.ptr) and be.is_pinned(buf.ptr + 100)
    assert not be.is_pinned(np.zeros(64, np.uint8).ctypes.data)
    assert buf.device_ptr != 0
    buf.array[:] = np.arange(4096) % 251
    # the GPU reads the same bytes through the mapped device address
    mem = cupy.cuda.UnownedMemory(buf.device_ptr, 4096, buf, be.device)
    view = cupy.ndarray((4096,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))
    np.testing.assert_array_equal(cupy.asnumpy(view), buf.array)
    # and through a DMA copy
    d = be.alloc_device(4096)
    be.copy2d(True, d.ptr, 0, buf.ptr, 0, 4096, 1, stream)
    out = be.read(d.ptr, 4096, stream)
    assert isinstance(out, bytes) and out == buf.array.tobytes()
    buf.close()
    buf.close()
    assert buf.array is None
    d.close()
    d.close()


def test_pinned_memory_outlives_buffer_while_a_view_lives(be):
    buf = be.alloc_pinned(256)
    view = buf.array[16:32]
    ptr = buf.ptr
    del buf
    view[:] = 7  # still page-locked memory we own
    assert be.is_pinned(ptr)
    del view


def test_zero_byte_allocations(be, stream):
    p = be.alloc_pinned(0)
    d = be.alloc_device(0)
    assert p.nbytes == 0 and d.nbytes == 0
    assert be.read(d.ptr, 0, stream) == b""
    p.close()
    d.close()


# -- copies ---------------------------------------------------------------------------


def test_copy2d_h2d_one_row(be, stream):
    d = device_bytes(be, 256, stream)
    src = be.alloc_pinned(64)
    src.array[:] = np.arange(64)
    be.copy2d(True, d.ptr + 8, 0, src.ptr, 0, 64, 1, stream)
    want = np.full(256, 0xA5, np.uint8)
    want[8:72] = np.arange(64)
    np.testing.assert_array_equal(current_bytes(be, d, stream), want)


def test_copy2d_h2d_two_d_with_pitches(be, stream):
    d = device_bytes(be, 512, stream)
    src = be.alloc_pinned(5 * 24)
    src.array[:] = np.arange(120)
    # 5 rows of 16 bytes: source rows 24 apart, destination rows 100 apart
    be.copy2d(True, d.ptr + 4, 100, src.ptr, 24, 16, 5, stream)
    want = np.full(512, 0xA5, np.uint8)
    for r in range(5):
        want[4 + r * 100 : 4 + r * 100 + 16] = src.array[r * 24 : r * 24 + 16]
    np.testing.assert_array_equal(current_bytes(be, d, stream), want)


def test_copy2d_d2d_one_row_and_two_d(be, stream):
    init = (np.arange(1024) * 7 % 256).astype(np.uint8)
    d = be.alloc_device(1024)
    upload(be, d.ptr, init, stream)
    be.copy2d(False, d.ptr + 600, 0, d.ptr, 0, 50, 1, stream)
    be.copy2d(False, d.ptr + 700, 40, d.ptr + 100, 64, 24, 4, stream)
    want = init.copy()
    want[600:650] = init[0:50]
    for r in range(4):
        want[700 + r * 40 : 700 + r * 40 + 24] = init[100 + r * 64 : 100 + r * 64 + 24]
    np.testing.assert_array_equal(current_bytes(be, d, stream), want)


def test_zero_sized_copy_is_a_no_op(be, stream):
    be.copy2d(False, 0, 0, 0, 0, 0, 1, stream)
    be.copy2d(True, 0, 0, 0, 0, 16, 0, stream)
    be.synchronize(stream)


# -- fill -----------------------------------------------------------------------------


@pytest.mark.parametrize("elem", [1, 2, 4, 8])
@pytest.mark.parametrize("rows,width,pitch", [(1, 64, 0), (3, 48, 80), (2, 9000, 9600)])
def test_fill(be, stream, elem, rows, width, pitch):
    span = (rows - 1) * pitch + width
    d = device_bytes(be, span + 32, stream)
    value = -3 if elem < 8 else 0x0123456789ABCDEF
    be.fill(d.ptr + 16, pitch, width, rows, value, elem, stream)
    want = np.full(span + 32, 0xA5, np.uint8)
    pattern = np.frombuffer((value & (2**64 - 1)).to_bytes(8, "little")[:elem], np.uint8)
    for r in range(rows):
        want[16 + r * pitch : 16 + r * pitch + width] = np.tile(pattern, width // elem)
    np.testing.assert_array_equal(current_bytes(be, d, stream), want)


def test_fill_wider_than_32_bits(be, stream):
    """cucopy_fill takes a 32-bit width: a 4 GiB + 64 B fill used to write width mod 2**32
    bytes (64); every byte must be written."""
    n = (1 << 32) + 64
    d = be.alloc_device(n + 16)
    try:
        upload(be, d.ptr + n - 4096, np.full(4096 + 16, 0xA5, np.uint8), stream)
        upload(be, d.ptr, np.full(4096, 0xA5, np.uint8), stream)
        be.fill(d.ptr, n, n, 1, 0x01020304, 4, stream)
        for off in (0, (1 << 32) - 4096, n - 4096):
            got = np.frombuffer(be.read(d.ptr + off, 4096, stream), np.uint8)
            assert (got.view(np.uint32) == 0x01020304).all(), off
        tail = np.frombuffer(be.read(d.ptr + n, 16, stream), np.uint8)
        assert (tail == 0xA5).all()
    finally:
        d.close()


def test_fill_rejects_bad_element_size(be, stream):
    with pytest.raises(ValueError, match="elem must be 1, 2, 4 or 8"):
        be.fill(0, 0, 12, 1, 0, 3, stream)
    with pytest.raises(ValueError, match="divide width"):
        be.fill(0, 0, 6, 1, 0, 4, stream)


# -- scatter --------------------------------------------------------------------------


def build_segment(out: np.ndarray, dev_base: int, d2d_src: int):
    """Encode one segment of every kind into ``out``; returns (nblocks, total, descs)."""
    rng = np.random.default_rng(5)
    payloads = [
        rng.integers(0, 256, 12, dtype=np.uint8),  # H2D, tiny
        rng.integers(0, 256, 40_000, dtype=np.uint8),  # H2D, several blocks
        rng.integers(0, 256, 3 * 20, dtype=np.uint8),  # H2D_2D, 3 rows of 20
    ]
    ndesc = 7
    data_offset = pack.align(pack.HEADER_BYTES + ndesc * pack.DESC_BYTES)
    offsets = []
    off = data_offset
    for p in payloads:
        offsets.append(off)
        out[off : off + p.nbytes] = p
        off = pack.align(off + p.nbytes)
    total = off
    H2D, H2D_2D, D2D, FILL = pack.KIND_H2D, pack.KIND_H2D_2D, pack.KIND_D2D, pack.KIND_FILL
    # (dst, src, value, dst_pitch, src_pitch, width, rows, kind, elem, block_start)
    descs = [
        (dev_base + 0, offsets[0], 0, 12, 12, 12, 1, H2D, 0, 0),
        (dev_base + 64, offsets[1], 0, 40_000, 40_000, 40_000, 1, H2D, 0, 0),
        (dev_base + 40_100, offsets[2], 0, 32, 20, 20, 3, H2D_2D, 0, 0),
        (dev_base + 40_300, d2d_src, 0, 100, 100, 100, 1, D2D, 0, 0),
        (dev_base + 40_500, d2d_src + 200, 0, 48, 64, 30, 4, D2D, 0, 0),
        (dev_base + 40_800, 0, (-1) & (2**64 - 1), 40, 40, 40, 1, FILL, 4, 0),
        (dev_base + 41_000, 0, 0x1122334455667788, 72, 72, 64, 3, FILL, 8, 0),
    ]
    assert len(descs) == ndesc
    nblocks = pack.encode(out[:data_offset], descs, data_offset, total)
    return nblocks, total


@pytest.mark.parametrize("mode", ["dma", "mapped"])
def test_scatter_matches_reference(be, stream, mode):
    region = 42_000
    dst = device_bytes(be, region, stream)
    src_init = (np.arange(1024) * 13 % 256).astype(np.uint8)
    d2d = be.alloc_device(1024)
    upload(be, d2d.ptr, src_init, stream)

    seg = be.alloc_pinned(64 * 1024)
    nblocks, total = build_segment(seg.array, dst.ptr, d2d.ptr)
    assert nblocks > 7  # the 40 KB descriptor spans several blocks

    # NumPy reference over the same bytes
    mem = {dst.ptr: current_bytes(be, dst, stream), d2d.ptr: src_init.copy()}

    def locate(addr, n):
        for base, arr in mem.items():
            if base <= addr and addr + n <= base + arr.nbytes:
                return arr, addr - base
        raise AssertionError(f"address {addr:#x} outside the test buffers")

    def load(addr, n):
        arr, o = locate(addr, n)
        return arr[o : o + n].tobytes()

    def store(addr, data):
        arr, o = locate(addr, len(data))
        arr[o : o + len(data)] = np.frombuffer(data, np.uint8)

    pack.reference_scatter(seg.array[:total].tobytes(), load, store)

    if mode == "dma":
        staging = be.alloc_device(total)
        be.copy2d(True, staging.ptr, 0, seg.ptr, 0, total, 1, stream)
        be.scatter(staging.ptr, nblocks, stream, False)
    else:
        be.scatter(seg.device_ptr, nblocks, stream, True)
    np.testing.assert_array_equal(current_bytes(be, dst, stream), mem[dst.ptr])
    np.testing.assert_array_equal(current_bytes(be, d2d, stream), src_init)


@pytest.mark.parametrize("calls", ["compiled", "cupy"])
def test_carried_scatter_lands_through_either_driver_path(calls, stream):
    # the compiled driver calls (backends/_cudacall.c) and CuPy's wrappers land the
    # same bytes; the normal run must use the compiled ones
    import os

    be = CudaBackend()
    if calls == "compiled":
        if os.environ.get("CUCOPY_PURE_PYTHON"):
            assert be._fast is None
            pytest.skip("CUCOPY_PURE_PYTHON=1: the compiled driver calls are off")
        assert be._fast is not None, "cucopy.backends._cudacall is not built"
    else:
        be._fast = None
    dst = device_bytes(be, 4096, stream)
    seg = be.alloc_pinned(8192)
    data = np.arange(3000, dtype=np.uint8)
    ndesc = 1
    data_offset = pack.align(pack.HEADER_BYTES + ndesc * pack.DESC_BYTES)
    seg.array[data_offset : data_offset + data.nbytes] = data
    total = data_offset + data.nbytes
    descs = [(dst.ptr + 100, data_offset, 0, 3000, 3000, 3000, 1, pack.KIND_H2D, 0, 0)]
    nblocks = pack.encode(seg.array[:data_offset], descs, data_offset, total)
    be.scatter(seg.device_ptr, nblocks, stream, True, total, seg.ptr)
    seg.array[:] = 0  # the launch took its bytes when it was enqueued
    got = current_bytes(be, dst, stream)
    want = np.full(4096, 0xA5, np.uint8)
    want[100:3100] = data
    np.testing.assert_array_equal(got, want)
    assert be.is_capturing(stream) is False


def test_launch_from_a_fresh_thread(be, stream):
    # a new thread has no CUDA context bound: the driver-API launch must still work
    d = device_bytes(be, 64, stream)
    errors = []

    seg = be.alloc_pinned(4096)
    data = np.full(32, 0x44, np.uint8)
    off = pack.align(pack.HEADER_BYTES + pack.DESC_BYTES)
    seg.array[off : off + 32] = data
    desc = [(d.ptr + 32, off, 0, 32, 32, 32, 1, pack.KIND_H2D, 0, 0)]
    nblocks = pack.encode(seg.array[:off], desc, off, off + 32)

    def work():
        try:
            # first a carried scatter, as a copier's flush issues it (the compiled
            # driver call, with no context bound yet), then the capture query and a fill
            be.scatter(seg.device_ptr, nblocks, stream, True, off + 32, seg.ptr)
            assert not be.is_capturing(stream)
            be.fill(d.ptr, 0, 32, 1, 0x33, 1, stream)
            be.synchronize(stream)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors, errors
    assert be.read(d.ptr, 64, stream) == b"\x33" * 32 + b"\x44" * 32


def test_scatter_of_no_blocks_is_a_no_op(be, stream):
    be.scatter(0, 0, stream, False)
    be.synchronize(stream)


# -- events and holds ------------------------------------------------------------------


def test_event_query_false_while_held(be, stream):
    ev = be.event_create()
    assert be.event_query(ev)  # never recorded: complete
    with be.hold(stream) as h:
        be.event_record(ev, stream)
        assert not be.event_query(ev)
        deadline = time.monotonic() + 5
        while not h.started and time.monotonic() < deadline:
            time.sleep(0.001)
        assert h.started
        assert not be.event_query(ev)
    be.event_synchronize(ev)
    assert be.event_query(ev)
    be.event_destroy(ev)


def test_hold_released_on_exception(be, stream):
    t0 = time.monotonic()
    with pytest.raises(KeyError):
        with be.hold(stream):
            raise KeyError("boom")
    be.synchronize(stream)
    assert time.monotonic() - t0 < 5


def test_hold_times_out_instead_of_hanging(be, stream):
    with pytest.raises(CopyError, match="timed out after 0.05 s"):
        with be.hold(stream, timeout=0.05):
            time.sleep(0.5)
    be.synchronize(stream)


def test_holds_reuse_their_slots(be, stream):
    for _ in range(cuda_backend._HOLD_SLOTS + 8):
        with be.hold(stream):
            pass
        be.synchronize(stream)


# -- capture ---------------------------------------------------------------------------


def test_capture_detection(be):
    s = cupy.cuda.Stream(non_blocking=True)
    h = be.resolve_stream(s)
    d = be.alloc_device(256)
    assert not be.is_capturing(h)
    s.begin_capture()
    try:
        assert be.is_capturing(h)
        be.copy2d(False, d.ptr + 128, 0, d.ptr, 0, 64, 1, h)
    finally:
        graph = s.end_capture()
    assert not be.is_capturing(h)
    graph.launch(stream=s)
    s.synchronize()


# -- streams ---------------------------------------------------------------------------


def test_resolve_stream(be):
    s = cupy.cuda.Stream(non_blocking=True)
    assert be.resolve_stream(s) == s.ptr
    assert be.resolve_stream(12345) == 12345
    assert be.resolve_stream(None) == cupy.cuda.get_current_stream().ptr
    with s:
        assert be.resolve_stream(None) == s.ptr
        assert be.current_stream() == s.ptr

    class Proto:
        def __cuda_stream__(self):
            return (0, s.ptr)

    assert be.resolve_stream(Proto()) == s.ptr
    with pytest.raises(TypeError, match="stream: expected"):
        be.resolve_stream("stream")


def test_resolve_torch_stream(be):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    ts = torch.cuda.Stream(device=be.device)
    assert be.resolve_stream(ts) == ts.cuda_stream


# -- errors ----------------------------------------------------------------------------


def test_errors_name_the_call_and_leave_the_backend_usable(be, stream):
    d = be.alloc_device(256)
    with pytest.raises(CopyError, match=r"cuda:\d+: cudaMemcpy2DAsync failed: cudaError"):
        be.copy2d(False, d.ptr, 4, d.ptr + 128, 64, 64, 2, stream)  # dpitch < width
    be.copy2d(False, d.ptr, 64, d.ptr + 128, 64, 64, 2, stream)
    be.synchronize(stream)


def test_compile_errors_carry_the_log(be):
    with pytest.raises(CopyError, match=r"compiling broken\.cu failed:(.|\n)*error"):
        be._on_device(
            cuda_backend._build,
            'extern "C" __global__ void k() { nope; }',
            ("k",),
            "broken.cu",
            be.device,
        )


def test_crossover_table(be, tmp_path, monkeypatch):
    arch = "sm_" + cupy.cuda.Device(be.device).compute_capability
    path = tmp_path / "crossover.json"
    path.write_text(json.dumps({arch: 12345}))
    monkeypatch.setattr(cuda_backend, "_CROSSOVER_PATH", path)
    assert CudaBackend(be.device).mapped_threshold() == 12345
    path.write_text(json.dumps({"sm_1": 1}))
    assert CudaBackend(be.device).mapped_threshold() == cuda_backend.DEFAULT_MAPPED_THRESHOLD
    path.write_text(json.dumps({arch: "big"}))
    with pytest.raises(CopyError, match="crossover.json"):
        CudaBackend(be.device).mapped_threshold()


# -- several devices -------------------------------------------------------------------


def test_second_device_leaves_the_current_device_alone():
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two CUDA devices")
    with cupy.cuda.Device(0):
        be1 = CudaBackend(1)
        assert be1.device == 1
        with cupy.cuda.Device(1):
            s1 = cupy.cuda.Stream(non_blocking=True)
        h1 = be1.resolve_stream(s1)
        d = be1.alloc_device(4096)
        be1.fill(d.ptr, 0, 4096, 1, 0x5A, 1, h1)
        out = be1.read(d.ptr, 4096, h1)
        assert out == b"\x5a" * 4096
        ev = be1.event_create()
        with be1.hold(s1):
            be1.event_record(ev, h1)
            assert not be1.event_query(ev)
        be1.event_synchronize(ev)
        assert be1.event_query(ev)
        be1.event_destroy(ev)
        assert cupy.cuda.runtime.getDevice() == 0
        s0 = cupy.cuda.Stream(non_blocking=True)
        with pytest.raises(ValueError, match="belongs to cuda:0, not cuda:1"):
            be1.resolve_stream(s0)
        assert cupy.cuda.runtime.getDevice() == 0


_FRESH_PROCESS_STEPS = r"""
import ctypes
import sys
import numpy as np
import cupy
import cucopy as cc
from cucopy.backends import cuda as cuda_backend

class Site(cc.CopySite):
    POS = cc.H2D

plan = cc.CopyPlan(merge={Site.POS})
stream = cupy.cuda.Stream(non_blocking=True)
outs = []
for mode in ("inline", "mapped", "dma"):
    c = cc.DeviceCopier(plan, device=0, backend="cuda", stream=stream, flush_mode=mode)
    is_loaded = cuda_backend._driver_entry("cuFuncIsLoaded")  # CUDA 12.4 and later
    if is_loaded is not None:  # every kernel loaded when the copier is made
        k = c._backend._get_kernels()
        for h in (k.scatter, k.fill, *k.carried.values()):
            state = ctypes.c_int(-1)
            assert is_loaded(ctypes.byref(state), ctypes.c_void_p(h)) == 0
            assert state.value == 1, f"{mode}: kernel {h:#x} not loaded: {state.value}"
    a = cupy.zeros(3000, np.int32)
    # the first launch of each kernel in this process happens behind a held stream
    with c._backend.hold(stream.ptr, timeout=5.0):
        with c.step():
            c.copy(Site.POS, a, np.arange(3000, dtype=np.int32))
    stream.synchronize()
    outs.append(cupy.asnumpy(a).tolist() == list(range(3000)))
    c.close()
print("ok" if all(outs) else f"wrong bytes: {outs}")
"""


@pytest.mark.parametrize("cache", ["as_configured", "cold"])
def test_first_launches_behind_a_held_stream_do_not_wait_for_the_device(cache, tmp_path):
    # In a fresh process (no kernel built or loaded yet), a copier's first steps run
    # behind a stalled stream. A kernel built, or lazily loaded (CUDA's default), at
    # its first launch may wait for the whole device, which a spinning kernel never
    # frees: the copier builds its kernels when it is made, and loads them then. With
    # a cold kernel cache, the worker threads that build them compile them too.
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    if cache == "cold":
        env["CUPY_CACHE_DIR"] = str(tmp_path)  # empty: NVRTC compiles every kernel
    r = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS_STEPS],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("ok"), r.stdout[-2000:]
