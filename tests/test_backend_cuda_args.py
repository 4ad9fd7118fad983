"""The CUDA backend's launch arguments, checked without a GPU.

Each launch of ``cucopy_fill`` passes ``width`` and ``rows`` in 32-bit fields: a wider
fill must become several launches that cover exactly its bytes (a ctypes field keeps
``width mod 2**32`` silently). ``_launch`` is replaced by a recorder; the GPU run of the
same fill is ``test_backend_cuda.py::test_fill_wider_than_32_bits``.
"""

from __future__ import annotations

import types

import pytest

from cucopy.backends import cuda as cuda_backend
from cucopy.backends.cuda import CudaBackend

U32 = (1 << 32) - 1


@pytest.fixture
def launches(monkeypatch):
    """A CudaBackend on device 0 whose launches are recorded, not run."""
    be = object.__new__(CudaBackend)
    be.device = 0
    be._kern = types.SimpleNamespace(fill=0x1234)
    be._scratch = types.SimpleNamespace(fill=cuda_backend._Params(cuda_backend._FillArgs))
    out = []

    def launch(fn, gx, gy, gz, bx, by, bz, shmem, stream, params, extra):
        a = be._scratch.fill.args
        out.append((a.dst, a.dpitch, a.width, a.rows, a.value, a.elem, gx))

    monkeypatch.setattr(cuda_backend, "_launch", launch)
    monkeypatch.setattr(cuda_backend, "_getDevice", lambda: 0)
    return be, out


def covered(calls, base, dpitch, width, rows):
    """The byte ranges the recorded launches write, merged; and the expected ones."""
    got = []
    for dst, pitch, w, r, *_ in calls:
        assert 0 < w <= U32 and 0 < r <= U32
        got += [(dst + i * pitch, dst + i * pitch + w) for i in range(min(r, 4))]
        if r > 4:  # rows in between follow the same pitch; the last one closes the run
            got.append((dst + (r - 1) * pitch, dst + (r - 1) * pitch + w))
    got.sort()
    merged = []
    for a, b in got:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    want = sorted((base + i * dpitch, base + i * dpitch + width) for i in range(rows))
    return merged, want


@pytest.mark.parametrize(
    "width, rows, dpitch",
    [(64, 3, 128), (U32 + 1 - 8, 1, 0), ((1 << 32) + 64, 1, 0), ((1 << 33) + 8, 2, 1 << 34)],
)
@pytest.mark.parametrize("elem", [1, 4, 8])
def test_a_fill_wider_than_32_bits_is_cut_into_launches(launches, width, rows, dpitch, elem):
    be, calls = launches
    base = 1 << 40
    be.fill(base, dpitch, width, rows, 7, elem, 0)
    merged, want = covered(calls, base, dpitch, width, rows)
    if dpitch and dpitch > width:
        assert merged == want
    else:
        assert merged == [(base, base + width)]
    for dst, _, w, _, value, e, grid in calls:
        assert (dst - base) % elem == 0 and w % elem == 0  # each piece starts in phase
        assert value == 7 and e == elem and 1 <= grid <= 1024
    if width <= U32:
        assert len(calls) == 1


def test_fill_pieces_cut_rows_past_32_bits():
    pieces = cuda_backend._fill_pieces(16, (1 << 32) + 5)
    assert [(r, n) for r, n, _, _ in pieces] == [(0, U32), (U32, 6)]
    assert all(c == 0 and w == 16 for _, _, c, w in pieces)


def test_a_2d_copy_with_pitches_past_the_devices_maximum_is_cut_into_rows(monkeypatch):
    # cudaMemcpy2DAsync refuses (or mishandles) pitches over cudaDevAttrMaxPitch
    be = object.__new__(CudaBackend)
    be.device = 0
    calls = []
    rt = types.SimpleNamespace(
        memcpyAsync=lambda *a: calls.append(("1d",) + a),
        memcpy2DAsync=lambda *a: calls.append(("2d",) + a),
    )
    monkeypatch.setattr(cuda_backend, "_rt", rt)
    monkeypatch.setattr(cuda_backend, "_getDevice", lambda: 0)
    monkeypatch.setattr(cuda_backend, "_H2D", 1)
    monkeypatch.setattr(cuda_backend, "_D2D", 3)
    far = (1 << 32) + 64
    be.copy2d(True, 1 << 40, far, 4096, 8, 8, 3, 7)
    assert calls == [("1d", (1 << 40) + r * far, 4096 + r * 8, 8, 1, 7) for r in range(3)]
    calls.clear()
    be.copy2d(False, 1 << 40, 64, 1 << 41, 128, 8, 3, 7)  # small pitches: one 2-D copy
    assert calls == [("2d", 1 << 40, 64, 1 << 41, 128, 8, 3, 3, 7)]


def test_feed_capture_launches_the_feed_kernel_with_its_mailbox(monkeypatch):
    """capture_inputs() enqueues cucopy_scatter_feed(box, entries, feed, status) once, on
    the capturing stream; each call gets a new replay counter."""
    be = object.__new__(CudaBackend)
    be.device = 0
    be._kern = types.SimpleNamespace(feed=0x4321)
    out = []

    def launch(fn, gx, gy, gz, bx, by, bz, shmem, stream, params, extra):
        args = cuda_backend._FeedArgs.from_address(
            cuda_backend.ctypes.c_void_p.from_address(params).value
        )
        out.append((fn, gx, bx, stream, args.box, args.entries, args.feed, args.status))

    monkeypatch.setattr(cuda_backend, "_launch", launch)
    monkeypatch.setattr(cuda_backend, "_getDevice", lambda: 0)
    monkeypatch.setattr(cuda_backend, "_feed_ids", {})
    first = be.feed_capture(0x1000, 4, 64, 0x2000, 0x77)
    second = be.feed_capture(0x3000, 2, 8, 0, 0x77)
    assert (first, second) == (0, 1)
    assert out[0] == (0x4321, 64, 256, 0x77, 0x1000, 4, 0, 0x2000)
    assert out[1][4:] == (0x3000, 2, 1, 0)
    with pytest.raises(ValueError, match=r"blocks must be in \[1, 65535\], got 0"):
        be.feed_capture(0x1000, 4, 0, 0, 0x77)


def test_graph_launch_dispatches_by_kind(monkeypatch):
    be = object.__new__(CudaBackend)
    be.device = 0
    calls = []
    monkeypatch.setattr(
        cuda_backend, "_rt", types.SimpleNamespace(graphLaunch=lambda g, s: calls.append((g, s)))
    )
    be.graph_launch(0xABC, 0x77)  # a raw cudaGraphExec_t
    be.graph_launch(lambda: calls.append("callable"), 0x77)
    assert calls == [(0xABC, 0x77), "callable"]
    with pytest.raises(TypeError, match="graph: expected a cudaGraphExec_t"):
        be.graph_launch(object(), 0x77)


class _FakeCupy:
    """Just enough of ``cupy.cuda`` to see which stream constructor a backend calls."""

    def __init__(self, new_api: bool):
        calls = self.calls = []

        class Device:
            def __init__(self, ordinal):
                self.ordinal = ordinal

            def __enter__(self):
                calls.append(("device", self.ordinal))

            def __exit__(self, *exc):
                calls.append(("device_exit", self.ordinal))

        class Stream:
            pass

        if new_api:

            def from_external(obj):
                calls.append(("from_external", obj.__cuda_stream__()))
                return "stream"

            Stream.from_external = staticmethod(from_external)

        def external_stream(ptr, device):
            calls.append(("ExternalStream", ptr, device))
            return "old stream"

        self.cuda = types.SimpleNamespace(
            Device=Device, Stream=Stream, ExternalStream=external_stream
        )


def test_cupy_stream_prefers_from_external_over_the_deprecated_external_stream():
    fake = _FakeCupy(new_api=True)
    assert cuda_backend.cupy_stream(fake, 0xABC, 1) == "stream"
    assert fake.calls == [("device", 1), ("from_external", (0, 0xABC)), ("device_exit", 1)]


def test_cupy_stream_falls_back_to_external_stream_on_older_cupy():
    fake = _FakeCupy(new_api=False)
    assert cuda_backend.cupy_stream(fake, 0xABC, 1) == "old stream"
    assert fake.calls == [("ExternalStream", 0xABC, 1)]
