"""Array and stream resolution on a CUDA GPU: torch, CuPy, JAX, DLPack and CAI objects.

Every test is marked ``gpu`` and skips cleanly when the library or a GPU is missing.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from cucopy import adapters
from cucopy.adapters import readonly_hint, resolve, stream_handle

# JAX would otherwise take 75% of the GPU's memory at its first array
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA GPU")
    return torch


@pytest.fixture(scope="module")
def cupy():
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("CuPy sees no CUDA GPU")
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip("CuPy sees no CUDA GPU")
    return cupy


@pytest.fixture(scope="module")
def jax():
    jax = pytest.importorskip("jax")
    try:
        jax.devices("gpu")
    except RuntimeError:
        pytest.skip("JAX sees no GPU")
    return jax


def two_gpus(n: int) -> None:
    if n < 2:
        pytest.skip("needs two GPUs")


# -- torch -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "view",
    [lambda t: t, lambda t: t[3:], lambda t: t[:, 1:3], lambda t: t.T, lambda t: t[1:, ::2]],
    ids=["whole", "offset", "columns", "transposed", "strided"],
)
def test_torch_cuda(torch, view):
    base = torch.arange(40, dtype=torch.int32, device="cuda").reshape(5, 8)
    v = view(base)
    info = resolve(v)
    assert info.ptr == v.data_ptr()
    assert info.device == 0 == v.device.index
    assert info.shape == tuple(v.shape)
    assert info.strides == tuple(s * 4 for s in v.stride())
    assert info.dtype == np.int32
    assert info.host is None and not info.is_host and not info.readonly
    assert info.obj is v
    assert info.label == f"torch.Tensor(cuda:0, torch.int32, shape={tuple(v.shape)})"


def test_torch_cuda_bfloat16_matches_cpu(torch):
    g = resolve(torch.zeros(4, dtype=torch.bfloat16, device="cuda"))
    c = resolve(torch.zeros(4, dtype=torch.bfloat16))
    assert g.dtype == c.dtype and g.dtype.itemsize == 2


def test_torch_pinned(torch):
    t = torch.empty(16, dtype=torch.int64, pin_memory=True)
    info = resolve(t)
    assert info.pinned is True and info.device is None
    assert info.ptr == t.data_ptr()
    assert info.label == "torch.Tensor(cpu, pinned, torch.int64, shape=(16,))"
    assert resolve(torch.empty(16)).pinned is False


def test_torch_second_gpu(torch):
    two_gpus(torch.cuda.device_count())
    t = torch.zeros(4, device="cuda:1")
    info = resolve(t)
    assert info.device == 1
    assert adapters.current_stream(t) == torch.cuda.current_stream(1)


def test_torch_streams(torch):
    t = torch.zeros(2, device="cuda")
    cur = adapters.current_stream(t)
    assert cur == torch.cuda.current_stream()
    s = torch.cuda.Stream()
    assert stream_handle(s) == s.cuda_stream
    with torch.cuda.stream(s):
        assert stream_handle(adapters.current_stream(t)) == s.cuda_stream


def test_torch_bool_refused_on_gpu(torch):
    with pytest.raises(TypeError, match=r"torch\.Tensor\(cuda:0, torch\.bool, shape=\(2,\)\)"):
        resolve(torch.zeros(2, dtype=torch.bool, device="cuda"))


# -- CuPy ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "view",
    [lambda a: a, lambda a: a[3:], lambda a: a[:, 1:3], lambda a: a.T, lambda a: a[::-1, 2]],
    ids=["whole", "offset", "columns", "transposed", "reversed"],
)
def test_cupy(cupy, view):
    base = cupy.arange(40, dtype=cupy.float32).reshape(5, 8)
    v = view(base)
    info = resolve(v)
    assert info.ptr == v.data.ptr
    assert info.device == v.device.id == 0
    assert info.shape == v.shape and info.strides == v.strides
    assert info.dtype == np.float32
    assert info.label == f"cupy.ndarray(cuda:0, float32, shape={v.shape})"


def test_cupy_streams(cupy):
    a = cupy.zeros(3)
    assert adapters.current_stream(a) == cupy.cuda.get_current_stream()
    s = cupy.cuda.Stream(non_blocking=True)
    assert stream_handle(s) == s.ptr
    with s:
        assert adapters.current_stream(a) == s


def test_cupy_second_gpu(cupy):
    two_gpus(cupy.cuda.runtime.getDeviceCount())
    with cupy.cuda.Device(1):
        a = cupy.zeros(4)
    assert resolve(a).device == 1


# -- JAX -------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [None, 0], ids=["interface", "dlpack"])
def test_jax_gpu(jax, stream):
    x = jax.numpy.arange(12, dtype=jax.numpy.int32).reshape(3, 4)
    x.block_until_ready()
    info = resolve(x, stream=stream)
    assert info.ptr == x.unsafe_buffer_pointer()
    assert info.device == 0
    assert info.shape == (3, 4) and info.strides == (16, 4)
    assert info.dtype == np.int32
    assert info.readonly
    assert info.label == "jax.Array(cuda:0, int32, shape=(3, 4))"
    assert "jax.dlpack.from_dlpack" in readonly_hint(info.label)


def test_jax_gpu_bfloat16(jax, torch):
    x = jax.numpy.zeros(4, dtype=jax.numpy.bfloat16)
    info = resolve(x)
    assert info.ptr == x.unsafe_buffer_pointer()
    assert info.dtype == resolve(torch.zeros(4, dtype=torch.bfloat16, device="cuda")).dtype


def test_jax_view_of_torch_buffer(jax, torch):
    t = torch.arange(4, dtype=torch.int32, device="cuda")
    x = jax.dlpack.from_dlpack(t)
    assert resolve(x).ptr == resolve(t).ptr


# -- generic DLPack and __cuda_array_interface__ objects ----------------------------------------


class DL:
    def __init__(self, a):
        self.a = a
        self.streams = []

    def __dlpack__(self, **kw):
        self.streams.append(kw.get("stream"))
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


class CAI:
    def __init__(self, cai):
        self.__cuda_array_interface__ = cai


def test_dlpack_object_on_gpu(torch):
    t = torch.arange(40, dtype=torch.int16, device="cuda").reshape(5, 8)[1:, 2:6]
    s = torch.cuda.Stream()
    obj = DL(t)
    info = resolve(obj, stream=s)
    assert info.ptr == t.data_ptr()
    assert info.device == 0
    assert info.strides == (16, 2) and info.shape == (4, 4)
    assert info.dtype == np.int16
    assert obj.streams == [s.cuda_stream]


def test_dlpack_cupy_object(cupy):
    a = cupy.arange(10, dtype=cupy.int64)[2:]
    info = resolve(DL(a))
    assert info.ptr == a.data.ptr and info.device == 0


def test_cai_object_device_from_driver(torch):
    t = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4)[:, 1:]
    info = resolve(CAI(t.__cuda_array_interface__))
    assert info.ptr == t.data_ptr()
    assert info.device == 0
    assert info.strides == (16, 4) and info.shape == (3, 3)


def test_cai_object_second_gpu(torch):
    two_gpus(torch.cuda.device_count())
    t = torch.zeros(4, device="cuda:1")
    assert resolve(CAI(t.__cuda_array_interface__)).device == 1


def test_cai_pinned_host_memory(torch):
    t = torch.arange(6, dtype=torch.int32).pin_memory()
    cai = {
        "version": 3,
        "data": (t.data_ptr(), False),
        "shape": (6,),
        "typestr": "<i4",
        "strides": None,
        "stream": None,
    }
    info = resolve(CAI(cai))
    assert info.device is None and info.pinned is True
    assert info.host.tolist() == list(range(6))


def test_cai_unknown_pointer_refused(torch):
    torch.zeros(1, device="cuda")  # a context exists
    host = np.zeros(4, np.int32)  # pageable: not CUDA memory
    cai = {"version": 3, "data": (host.ctypes.data, False), "shape": (4,), "typestr": "<i4"}
    with pytest.raises(TypeError, match="cannot tell which CUDA device"):
        resolve(CAI(cai))


def test_numba_device_array():
    cuda = pytest.importorskip("numba.cuda")
    if not cuda.is_available():
        pytest.skip("numba sees no GPU")
    d = cuda.to_device(np.arange(8, dtype=np.int32))
    info = resolve(d)
    assert info.ptr == d.__cuda_array_interface__["data"][0]
    assert info.device == 0
    assert info.shape == (8,) and info.dtype == np.int32


def test_cai_object_from_a_thread_without_context(torch):
    import threading

    t = torch.zeros(4, device="cuda")
    box = []
    th = threading.Thread(target=lambda: box.append(resolve(CAI(t.__cuda_array_interface__))))
    th.start()
    th.join()
    assert box and box[0].device == 0
