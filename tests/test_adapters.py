"""Array and stream resolution on the host: numpy, torch CPU, JAX CPU, generic objects."""

from __future__ import annotations

import ctypes
import gc
import subprocess
import sys
import textwrap
import weakref

import numpy as np
import pytest

from cucopy import adapters
from cucopy.adapters import ArrayInfo, dlpack, readonly_hint, resolve, stream_handle


def addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


# -- numpy -----------------------------------------------------------------------------------


def test_numpy_contiguous():
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    info = resolve(a)
    assert info.ptr == addr(a)
    assert info.shape == (3, 4)
    assert info.strides == (16, 4)
    assert info.dtype == np.int32
    assert info.device is None and info.is_host
    assert info.host is a and info.obj is a
    assert not info.readonly
    assert info.size == 12 and info.nbytes == 48
    assert info.label == "numpy.ndarray(int32, shape=(3, 4))"


@pytest.mark.parametrize(
    "view",
    [
        lambda a: a[3:],
        lambda a: a[1:, 2:5],
        lambda a: a[::2, 1::3],
        lambda a: a.T,
        lambda a: a[::-1, 2],
    ],
    ids=["offset", "block", "strided", "transposed", "reversed"],
)
def test_numpy_views_point_at_element_zero(view):
    base = np.arange(60, dtype=np.int64).reshape(6, 10)
    v = view(base)
    info = resolve(v)
    assert info.ptr == addr(v)
    first = ctypes.c_int64.from_address(info.ptr).value
    assert first == v[(0,) * v.ndim]
    assert info.strides == v.strides
    assert info.shape == v.shape


def test_numpy_readonly():
    a = np.zeros(4, np.float32)
    a.flags.writeable = False
    assert resolve(a).readonly


def test_numpy_object_dtype_refused():
    with pytest.raises(TypeError, match="Python objects"):
        resolve(np.array([object()]))


def test_arrayinfo_passes_through():
    info = resolve(np.zeros(3))
    assert resolve(info) is info


def test_unknown_object_refused():
    with pytest.raises(TypeError, match=r"expected an array .* got builtins\.list"):
        resolve([1, 2, 3])


def test_importing_cucopy_imports_no_array_library():
    code = textwrap.dedent(
        """
        import sys
        import numpy as np
        import cucopy
        import cucopy.adapters
        info = cucopy.adapters.resolve(np.arange(4))
        assert info.ptr == np.asarray(info.host).__array_interface__["data"][0]
        cucopy.adapters.stream_handle(7)
        loaded = sorted(m for m in ("torch", "cupy", "jax", "jaxlib", "ml_dtypes")
                        if m in sys.modules)
        print(loaded)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- torch (CPU) -----------------------------------------------------------------------------


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def test_torch_pageable(torch):
    t = torch.arange(8, dtype=torch.int32)
    info = resolve(t)
    assert info.ptr == t.data_ptr()
    assert info.shape == (8,) and info.strides == (4,)
    assert info.dtype == np.int32
    assert info.device is None and info.pinned is False
    assert info.obj is t
    assert addr(info.host) == t.data_ptr()
    info.host[2] = 99  # a view, not a copy
    assert t[2].item() == 99
    assert info.label == "torch.Tensor(cpu, torch.int32, shape=(8,))"


def test_torch_pinned_detected(torch, monkeypatch):
    # pin_memory=True needs a CUDA build and a GPU: patch the query instead
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    info = resolve(torch.zeros(4))
    assert info.pinned is True
    assert "pinned" in info.label


@pytest.mark.parametrize(
    "view",
    [lambda t: t[3:], lambda t: t[:, 1:3], lambda t: t.T, lambda t: t[1:, ::2]],
    ids=["offset", "columns", "transposed", "strided"],
)
def test_torch_views(torch, view):
    base = torch.arange(40, dtype=torch.int64).reshape(5, 8)
    v = view(base)
    info = resolve(v)
    assert info.ptr == v.data_ptr()
    assert info.ptr == base.data_ptr() + v.storage_offset() * 8
    assert info.strides == tuple(s * 8 for s in v.stride())
    assert info.shape == tuple(v.shape)
    assert addr(info.host) == info.ptr
    np.testing.assert_array_equal(info.host, v.numpy())


def test_torch_requires_grad_and_parameter(torch):
    p = torch.nn.Parameter(torch.ones(3))
    info = resolve(p)
    assert info.ptr == p.data_ptr()
    assert info.host.tolist() == [1.0, 1.0, 1.0]


def test_torch_subclass_defined_elsewhere_uses_torch_adapter(torch):
    class MyTensor(torch.Tensor):
        pass

    t = torch.zeros(3).as_subclass(MyTensor)
    info = resolve(t)
    assert info.label.startswith("torch.Tensor(")
    assert info.ptr == t.data_ptr()


def test_torch_bfloat16_identity(torch):
    src = torch.zeros(4, dtype=torch.bfloat16)
    dst = torch.ones(2, 4, dtype=torch.bfloat16)[1]
    s, d = resolve(src), resolve(dst)
    assert s.dtype == d.dtype
    assert s.dtype.itemsize == 2
    for other in (torch.int16, torch.uint16, torch.float16):
        assert resolve(torch.zeros(4, dtype=other)).dtype != s.dtype
    assert "torch.bfloat16" in s.label
    assert addr(s.host) == src.data_ptr()
    assert s.host.view(np.uint16).tolist() == [0, 0, 0, 0]
    assert d.host.view(np.uint16).tolist() == [0x3F80] * 4  # bf16 1.0


def test_bfloat16_without_ml_dtypes(torch):
    code = textwrap.dedent(
        """
        import sys
        sys.modules["ml_dtypes"] = None  # import fails
        import numpy as np, torch
        from cucopy.adapters import resolve
        a = resolve(torch.zeros(3, dtype=torch.bfloat16))
        b = resolve(torch.ones(3, dtype=torch.bfloat16))
        assert a.dtype == b.dtype and a.dtype.itemsize == 2, a.dtype
        assert a.dtype != np.uint16 and a.dtype != np.int16 and a.dtype != np.float16
        assert a.host.view(np.uint16).tolist() == [0, 0, 0]
        assert b.host.view(np.uint16).tolist() == [0x3F80] * 3
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda torch: torch.zeros(3, dtype=torch.bool),
            r"torch\.Tensor\(cpu, torch\.bool, shape=\(3,\)\): bool tensors are not supported",
        ),
        (
            lambda torch: torch.zeros(3, dtype=torch.uint8).view(torch.bool),
            r"torch\.bool.*not supported",
        ),
        (
            lambda torch: torch.zeros(3, dtype=torch.complex32),
            r"torch\.Tensor\(cpu, torch\.complex32, shape=\(3,\)\): complex32",
        ),
        (
            lambda torch: torch.zeros(3).to_sparse(),
            r"torch\.Tensor\(cpu, torch\.float32, shape=\(3,\)\): torch\.sparse_coo tensors",
        ),
        (lambda torch: torch.zeros(3, device="meta"), r"meta tensors have no data"),
        (lambda torch: torch.ones(3, dtype=torch.complex64).conj(), r"conjugate/negative bit"),
    ],
    ids=["bool", "bool-view", "complex32", "sparse", "meta", "conj"],
)
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_torch_refusals(torch, make, match):
    with pytest.raises(TypeError, match=match):
        resolve(make(torch))


def test_torch_current_stream_cpu(torch):
    assert adapters.current_stream(torch.zeros(2)) is None


# -- JAX (CPU) -------------------------------------------------------------------------------


def test_jax_cpu_is_readonly_source():
    jax = pytest.importorskip("jax")
    x = jax.device_put(jax.numpy.arange(6, dtype="int32").reshape(2, 3), jax.devices("cpu")[0])
    info = resolve(x)
    assert info.readonly
    assert info.device is None
    assert info.dtype == np.int32 and info.shape == (2, 3)
    assert info.label == "jax.Array(cpu, int32, shape=(2, 3))"
    assert addr(info.host) == info.ptr
    np.testing.assert_array_equal(info.host, np.arange(6).reshape(2, 3))
    assert adapters.current_stream(x) is None
    assert "jax.dlpack.from_dlpack" in readonly_hint(info.label)


def test_jax_tracer_refused():
    jax = pytest.importorskip("jax")

    def f(x):
        resolve(x)
        return x

    with pytest.raises(TypeError, match="traced JAX value"):
        jax.jit(f)(jax.numpy.zeros(3))


# -- readonly hint ---------------------------------------------------------------------------


def test_readonly_hint():
    msg = readonly_hint("jax.Array(cuda:0, int32, shape=(4,))")
    assert msg == (
        "jax.Array(cuda:0, int32, shape=(4,)) is immutable (a JAX array): write into a CuPy "
        "or torch buffer and view it from JAX with jax.dlpack.from_dlpack"
    )
    assert readonly_hint("numpy.ndarray(int32, shape=(4,))").endswith(
        "is read-only: pass a writable array as the destination"
    )


# -- __cuda_array_interface__ objects ---------------------------------------------------------


class CAI:
    """A foreign device array: the interface dict and nothing else."""

    def __init__(self, ptr, shape, typestr="<i4", strides=None, readonly=False, **extra):
        self.__cuda_array_interface__ = {
            "version": 3,
            "data": (ptr, readonly),
            "shape": shape,
            "typestr": typestr,
            "strides": strides,
            "stream": 1,
            **extra,
        }


class CAIWithDevice(CAI):
    def __init__(self, *args, device=(2, 0), **kw):
        super().__init__(*args, **kw)
        self._device = device

    def __dlpack_device__(self):
        return self._device


def test_cai_device_from_driver(monkeypatch):
    asked = []

    def query(ptr):
        asked.append(ptr)
        return False, 3

    monkeypatch.setattr(dlpack, "_query_pointer", query)
    info = resolve(CAI(0x7F0000001000, (4, 5), "<f4"))
    assert asked == [0x7F0000001000]
    assert info.ptr == 0x7F0000001000
    assert info.device == 3
    assert info.shape == (4, 5) and info.strides == (20, 4)  # strides None: C-contiguous
    assert info.dtype == np.float32
    assert info.host is None and not info.readonly
    assert info.label == "test_adapters.CAI(cuda:3, float32, shape=(4, 5))"


def test_cai_strided_and_readonly(monkeypatch):
    monkeypatch.setattr(dlpack, "_query_pointer", lambda ptr: (False, 0))
    info = resolve(CAI(0x1000, (3, 2), "<i8", strides=(64, 8), readonly=True))
    assert info.strides == (64, 8)
    assert info.readonly
    assert readonly_hint(info.label).endswith(
        "is read-only: pass a writable array as the destination"
    )


def test_cai_device_from_dlpack_device(monkeypatch):
    def query(ptr):
        raise AssertionError("the driver must not be asked when __dlpack_device__ answers")

    monkeypatch.setattr(dlpack, "_query_pointer", query)
    assert resolve(CAIWithDevice(0x1000, (4,), device=(2, 5))).device == 5
    assert resolve(CAIWithDevice(0x1000, (4,), device=(13, 1))).device == 1  # managed


def test_cai_pinned_host_memory(monkeypatch):
    backing = np.arange(8, dtype=np.int32)
    monkeypatch.setattr(dlpack, "_query_pointer", lambda ptr: (True, 0))
    obj = CAI(backing.ctypes.data, (2, 3), "<i4", strides=(16, 4))
    info = resolve(obj)
    assert info.device is None and info.pinned is True
    assert info.host.tolist() == [[0, 1, 2], [4, 5, 6]]
    assert addr(info.host) == backing.ctypes.data
    info.host[1, 0] = -4
    assert backing[4] == -4


def test_cai_device_unknown_refused(monkeypatch):
    monkeypatch.setattr(dlpack, "_query_pointer", lambda ptr: None)
    with pytest.raises(
        TypeError, match=r"test_adapters\.CAI: cannot tell which CUDA device.*0x1000"
    ):
        resolve(CAI(0x1000, (4,)))


def test_cai_mask_refused(monkeypatch):
    monkeypatch.setattr(dlpack, "_query_pointer", lambda ptr: (False, 0))
    with pytest.raises(TypeError, match="masked"):
        resolve(CAI(0x1000, (4,), mask=object()))


# -- __dlpack__ objects ----------------------------------------------------------------------


class DL:
    """Forwards DLPack to a numpy array and records what the consumer asked for."""

    def __init__(self, a):
        self.a = a
        self.calls = []

    def __dlpack__(self, **kw):
        self.calls.append(kw)
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


class LegacyDL(DL):
    """A producer from before DLPack 1.0: no max_version, no copy."""

    def __dlpack__(self, stream=None):
        self.calls.append({"stream": stream})
        return self.a.__dlpack__(stream=stream)


@pytest.mark.parametrize("cls", [DL, LegacyDL])
@pytest.mark.parametrize(
    "view",
    [lambda a: a, lambda a: a[1:, 2:], lambda a: a[::2, 1::3], lambda a: a.T, lambda a: a[2, 3]],
    ids=["whole", "offset", "strided", "transposed", "scalar"],
)
def test_dlpack_matches_numpy(cls, view):
    v = view(np.arange(48, dtype=np.float32).reshape(6, 8))
    v = np.asarray(v)
    obj = cls(v)
    info = resolve(obj)
    assert info.ptr == addr(v)
    assert info.shape == v.shape
    assert info.strides == v.strides
    assert info.dtype == v.dtype
    assert info.device is None and info.pinned is None
    assert addr(info.host) == addr(v)
    np.testing.assert_array_equal(info.host, v)
    assert info.obj.array is obj
    assert obj.calls[-1]["stream"] is None  # host memory: DLPack wants no stream
    if cls is DL:
        assert obj.calls == [{"stream": None, "max_version": (1, 0), "copy": False}]


def test_dlpack_host_view_writes_through():
    a = np.zeros((3, 4), np.int16)
    info = resolve(DL(a[1:, 1:3]))
    info.host[:] = 7
    assert a.tolist() == [[0, 0, 0, 0], [0, 7, 7, 0], [0, 7, 7, 0]]


def test_dlpack_readonly_flag():
    a = np.arange(4)
    a.flags.writeable = False
    info = resolve(DL(a))
    assert info.readonly
    assert not info.host.flags.writeable


def test_dlpack_legacy_readonly_refused():
    a = np.arange(4)
    a.flags.writeable = False
    with pytest.raises(TypeError, match=r"LegacyDL: cannot be exported through DLPack"):
        resolve(LegacyDL(a))


def test_dlpack_capsule_kept_not_consumed_and_freed_once():
    class Temporary(DL):
        """Exports a fresh copy: only the capsule keeps that memory alive."""

        def __dlpack__(self, **kw):
            tmp = self.a.copy()
            self.ref = weakref.ref(tmp)
            return tmp.__dlpack__(**kw)

    obj = Temporary(np.arange(5, dtype=np.int64))
    info = resolve(obj)
    del obj
    gc.collect()
    assert dlpack._capsule_name(info.obj.capsule) == b"dltensor_versioned"  # not "used_"
    ref = info.obj.array.ref
    assert ref() is not None
    host = info.host
    del info
    gc.collect()
    assert ref() is not None  # the host view keeps the export alive too
    assert host.tolist() == [0, 1, 2, 3, 4]
    del host
    gc.collect()
    assert ref() is None  # the capsule's destructor ran the producer's deleter


# A hand-made capsule: lets CI exercise the CUDA branch, dtypes numpy cannot export,
# flags and device types without a GPU.

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class FakeDevice:
    def __init__(
        self,
        *,
        ptr=0x7F00_0000_0000,
        shape=(4,),
        strides=None,
        code=0,
        bits=32,
        lanes=1,
        device=(2, 1),
        offset=0,
        flags=0,
        versioned=True,
    ):
        self.device = device
        self.calls = []
        n = len(shape)
        self._shape = (ctypes.c_int64 * n)(*shape)
        self._strides = (ctypes.c_int64 * n)(*strides) if strides is not None else None
        t = dlpack._DLTensor(
            data=ptr,
            device=dlpack._DLDevice(*device),
            ndim=n,
            dtype=dlpack._DLDataType(code, bits, lanes),
            shape=ctypes.cast(self._shape, ctypes.POINTER(ctypes.c_int64)),
            strides=(
                ctypes.cast(self._strides, ctypes.POINTER(ctypes.c_int64))
                if self._strides is not None
                else None
            ),
            byte_offset=offset,
        )
        if versioned:
            self._managed = dlpack._DLManagedTensorVersioned(
                version=dlpack._DLPackVersion(1, 0), flags=flags, dl_tensor=t
            )
            self._name = b"dltensor_versioned"
        else:
            self._managed = dlpack._DLManagedTensor(dl_tensor=t)
            self._name = b"dltensor"

    def __dlpack__(self, *, stream=None, max_version=None, copy=None):
        self.calls.append(stream)
        return _capsule_new(ctypes.addressof(self._managed), self._name, None)

    def __dlpack_device__(self):
        return self.device


def test_dlpack_cuda_device_fields():
    obj = FakeDevice(shape=(3, 4), strides=(8, 2), code=1, bits=16, offset=64, device=(2, 1))
    info = resolve(obj)
    assert info.device == 1
    assert info.ptr == 0x7F00_0000_0000 + 64
    assert info.shape == (3, 4) and info.strides == (16, 4)
    assert info.dtype == np.uint16
    assert info.host is None and not info.readonly
    assert info.label == "test_adapters.FakeDevice(cuda:1, uint16, shape=(3, 4))"


def test_dlpack_cuda_managed_and_legacy_capsule():
    info = resolve(FakeDevice(device=(13, 2), versioned=False))
    assert info.device == 2
    assert info.strides == (4,)  # NULL strides: C-contiguous


@pytest.mark.parametrize(
    ("stream", "expected"),
    [(None, None), (0, 1), (1, 1), (2, 2), (0xABC0, 0xABC0)],
    ids=["none", "null-is-legacy", "legacy", "per-thread", "handle"],
)
def test_dlpack_stream_passed_to_producer(stream, expected):
    obj = FakeDevice()
    resolve(obj, stream=stream)
    assert obj.calls == [expected]


def test_dlpack_stream_objects_and_sim_streams():
    class TorchLike:
        cuda_stream = 0x5000

    obj = FakeDevice()
    resolve(obj, stream=TorchLike())
    resolve(obj, stream=object())  # not a CUDA stream (a sim stream): producer gets None
    assert obj.calls == [0x5000, None]


def test_dlpack_bfloat16_matches_torch(torch):
    info = resolve(FakeDevice(code=4, bits=16))
    assert info.dtype == resolve(torch.zeros(1, dtype=torch.bfloat16)).dtype


@pytest.mark.parametrize(
    ("flags", "readonly"), [(0, False), (1, True), (2, True)], ids=["none", "read-only", "copied"]
)
def test_dlpack_flags(flags, readonly):
    assert resolve(FakeDevice(flags=flags)).readonly is readonly


def test_dlpack_cuda_host_is_pinned_host():
    backing = np.arange(6, dtype=np.int32)
    info = resolve(FakeDevice(ptr=backing.ctypes.data, shape=(2, 3), device=(3, 0)))
    assert info.device is None and info.pinned is True
    assert info.host.tolist() == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"code": 2, "bits": 32, "lanes": 4}, r"code=2, bits=32, lanes=4\) is not supported"),
        ({"code": 17, "bits": 4}, r"code=17, bits=4"),
        ({"code": 3, "bits": 64}, r"code=3, bits=64, lanes=1\) is not supported"),
        ({"device": (10, 0)}, r"DLPack device ROCM is not supported"),
    ],
    ids=["lanes", "fp4", "opaque", "rocm"],
)
def test_dlpack_refusals(kw, match):
    with pytest.raises(TypeError, match=match):
        resolve(FakeDevice(**kw))


# -- streams ---------------------------------------------------------------------------------


def test_stream_handle():
    class CudaStreamProtocol:
        def __cuda_stream__(self):
            return (0, 0x1234)

    class TorchLike:
        cuda_stream = 0x2000

    class CupyLike:
        ptr = 0x3000

    class CUstreamLike:
        def getPtr(self):
            return 0x4000

    assert stream_handle(0) == 0
    assert stream_handle(0xDEAD) == 0xDEAD
    assert stream_handle(CudaStreamProtocol()) == 0x1234
    assert stream_handle(TorchLike()) == 0x2000
    assert stream_handle(CupyLike()) == 0x3000
    assert stream_handle(CUstreamLike()) == 0x4000


@pytest.mark.parametrize("bad", [True, "stream", object()], ids=["bool", "str", "object"])
def test_stream_handle_refuses(bad):
    with pytest.raises(TypeError, match=r"stream: expected a CuPy or torch stream"):
        stream_handle(bad)


def test_arrayinfo_repr():
    assert repr(ArrayInfo(0, (1,), (4,), np.int32, label="x")) == "ArrayInfo(x)"
