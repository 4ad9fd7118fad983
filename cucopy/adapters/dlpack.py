"""Generic arrays: anything with ``__cuda_array_interface__`` or ``__dlpack__``.

``__cuda_array_interface__`` is preferred: reading a dict is cheaper than
exporting a capsule, and nothing has to be kept alive but the object itself.

**Which device holds a ``__cuda_array_interface__`` array.** The interface
carries a pointer but no device. The ordinal comes, in order, from the
object's ``__dlpack_device__()`` when it has one (cheap: no capsule is made),
else from the CUDA driver (``cuPointerGetAttribute`` through ``ctypes`` on
``libcuda``; no cuda-python needed). Pinned host memory that the driver
reports as host memory resolves as a pinned host array. When neither source
can answer (no driver in the process, or a pointer the driver does not know),
:func:`resolve` raises ``TypeError`` rather than guess a device: the copier
compares devices, and a wrong guess would launch on the wrong GPU. Wrap such
an object with ``cupy.asarray`` or ``torch.as_tensor`` instead. A zero-size
array with a null pointer gets the driver's current device.

The interface's ``stream`` entry (v3) is not acted upon: cucopy reads the
bytes on its own stream, so a producer that leaves writes pending on another
stream must synchronize before handing the array over (or export through
``__dlpack__``, which orders the producer's work before the consumer stream).
The ``mask`` entry must be absent or None.

**DLPack.** ``__dlpack__`` is called with the consumer's stream (``stream=``:
the copier's raw handle, with the raw null stream 0 passed as 1, the legacy
default stream, since DLPack reserves 0; nothing for host devices) and
``max_version=(1, 0), copy=False``; producers that predate those keywords get
a plain ``__dlpack__(stream=...)``. The capsule is parsed with ``ctypes``
(``DLManagedTensorVersioned`` or the legacy ``DLManagedTensor``).

**Ownership.** The capsule is *not* consumed (it is never renamed to
``used_dltensor``): it is kept, with the original object, in a small
:class:`Exported` held by ``ArrayInfo.obj`` (and by the ``host`` view's
buffer), so the exported memory stays valid while either is alive. When the
last reference goes, the capsule's own destructor calls the producer's
deleter, exactly once; no ``__del__`` or finalizer of ours is involved.

Device types: CPU (1) and CUDA host (3, pinned) resolve as host arrays with a
NumPy view; CUDA (2) and CUDA managed (13) as device arrays on their ordinal;
others are refused. A versioned capsule flagged read-only, or flagged as a
copy (writes would land in the copy), resolves as ``readonly``.
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys

import numpy as np

from . import ArrayInfo, extension_dtype, stream_handle

__all__ = ["resolve", "current_stream", "Exported"]


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", _DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", _DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    ]


_FLAG_READ_ONLY = 1 << 0
_FLAG_IS_COPIED = 1 << 1

_CPU, _CUDA, _CUDA_HOST, _CUDA_MANAGED = 1, 2, 3, 13
_DEVICE_NAMES = {
    1: "CPU",
    2: "CUDA",
    3: "CUDAHost",
    4: "OpenCL",
    7: "Vulkan",
    8: "Metal",
    9: "VPI",
    10: "ROCM",
    11: "ROCMHost",
    12: "ExtDev",
    13: "CUDAManaged",
    14: "OneAPI",
    15: "WebGPU",
    16: "Hexagon",
    17: "MAIA",
}

# DLDataTypeCode -> NumPy kind; 4 (bfloat) and 7..14 (float8) are extension dtypes
_KINDS = {0: "i", 1: "u", 2: "f", 5: "c"}
_EXTENSION = {
    4: "bfloat16",
    7: "float8_e3m4",
    8: "float8_e4m3",
    9: "float8_e4m3b11fnuz",
    10: "float8_e4m3fn",
    11: "float8_e4m3fnuz",
    12: "float8_e5m2",
    13: "float8_e5m2fnuz",
    14: "float8_e8m0fnu",
}

_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype = ctypes.c_char_p
_capsule_name.argtypes = [ctypes.py_object]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


class Exported:
    """Keeps a DLPack export alive: the original object and its unconsumed capsule.

    Attributes
    ----------
    array : object
        The object whose ``__dlpack__`` was called.
    capsule : PyCapsule
        The capsule it returned; its destructor runs the producer's deleter.
    """

    __slots__ = ("array", "capsule", "__weakref__")

    def __init__(self, array, capsule):
        self.array = array
        self.capsule = capsule

    def __repr__(self) -> str:
        return f"Exported({type(self.array).__module__}.{type(self.array).__qualname__})"


def _name(x) -> str:
    return f"{type(x).__module__}.{type(x).__qualname__}"


def _label(x, where: str, dtype, shape) -> str:
    return f"{_name(x)}({where}, {dtype}, shape={tuple(shape)})"


def _dtype(x, code: int, bits: int, lanes: int) -> np.dtype:
    where = f"{_name(x)}: DLPack dtype (code={code}, bits={bits}, lanes={lanes})"
    if lanes != 1 or bits % 8:
        raise TypeError(f"{where} is not supported: need one lane and whole bytes")
    kind = _KINDS.get(code)
    if kind is not None:
        try:
            return np.dtype(f"{kind}{bits // 8}")
        except TypeError:
            raise TypeError(f"{where} has no NumPy equivalent") from None
    if code == 6 and bits == 8:
        return np.dtype(np.bool_)
    name = _EXTENSION.get(code)
    if name is not None and bits == (16 if code == 4 else 8):
        return extension_dtype(name, bits // 8)
    raise TypeError(f"{where} is not supported")


def _contiguous(shape, itemsize: int) -> tuple:
    strides = []
    step = itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _host_view(ptr: int, shape, strides, dtype, keep, readonly: bool) -> np.ndarray:
    """A NumPy view of host bytes at ``ptr``; ``keep`` stays alive with the view."""
    if math.prod(shape) == 0:
        return np.empty(shape, dtype)
    lo = hi = 0
    for n, s in zip(shape, strides, strict=True):
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    buf = (ctypes.c_char * (hi - lo + dtype.itemsize)).from_address(ptr + lo)
    buf.keep = keep  # the view's base is buf: it keeps the producer's memory alive
    view = np.ndarray(shape, dtype, buffer=buf, offset=-lo, strides=strides)
    if readonly:
        view.flags.writeable = False
    return view


# -- the CUDA driver, for __cuda_array_interface__ pointers --------------------------------

_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
_CU_MEMORYTYPE_HOST = 1


@functools.cache
def _libcuda():
    names = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.cuInit.argtypes = [ctypes.c_uint]
        lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
        lib.cuCtxGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
        if lib.cuInit(0) != 0:  # no usable GPU: nothing can be CUDA memory
            return None
        return lib
    return None


def _query_pointer(ptr: int):
    """``(is_host, ordinal)`` for a CUDA pointer, or None when the driver cannot say."""
    lib = _libcuda()
    if lib is None:
        return None
    if ptr == 0:
        dev = ctypes.c_int(-1)
        if lib.cuCtxGetDevice(ctypes.byref(dev)) != 0:
            return None
        return False, dev.value
    mem = ctypes.c_uint(0)
    dev = ctypes.c_int(-1)
    if lib.cuPointerGetAttribute(ctypes.byref(mem), _CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr):
        return None
    if lib.cuPointerGetAttribute(ctypes.byref(dev), _CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr):
        return None
    return mem.value == _CU_MEMORYTYPE_HOST, dev.value


def _cai_device(x, ptr: int):
    """``(is_host, ordinal)`` for a ``__cuda_array_interface__`` pointer."""
    dl_device = getattr(x, "__dlpack_device__", None)
    if dl_device is not None:
        kind, ordinal = dl_device()
        if kind in (_CUDA, _CUDA_MANAGED):
            return False, int(ordinal)
        if kind == _CUDA_HOST:
            return True, None
    where = _query_pointer(ptr)
    if where is None:
        raise TypeError(
            f"{_name(x)}: cannot tell which CUDA device holds its __cuda_array_interface__ "
            f"pointer 0x{ptr:x} (the interface names no device and the CUDA driver could not "
            f"be asked): wrap it with cupy.asarray() or torch.as_tensor(), or give it "
            f"__dlpack_device__"
        )
    return where


def _from_cai(x, cai: dict) -> ArrayInfo:
    if cai.get("mask") is not None:
        raise TypeError(f"{_name(x)}: masked __cuda_array_interface__ arrays are not supported")
    ptr, readonly = cai["data"]
    ptr = int(ptr or 0)
    shape = tuple(int(n) for n in cai["shape"])
    dtype = np.dtype(cai["typestr"])
    if dtype.hasobject:
        raise TypeError(f"{_name(x)}: dtype {dtype} holds Python objects, not bytes")
    strides = cai.get("strides")
    strides = _contiguous(shape, dtype.itemsize) if strides is None else tuple(strides)
    is_host, dev = _cai_device(x, ptr)
    if is_host:
        return ArrayInfo(
            ptr,
            shape,
            strides,
            dtype,
            device=None,
            pinned=True,
            host=_host_view(ptr, shape, strides, dtype, x, bool(readonly)),
            obj=x,
            readonly=bool(readonly),
            label=_label(x, "cpu, pinned", dtype, shape),
        )
    return ArrayInfo(
        ptr,
        shape,
        strides,
        dtype,
        device=dev,
        pinned=None,
        host=None,
        obj=x,
        readonly=bool(readonly),
        label=_label(x, f"cuda:{dev}", dtype, shape),
    )


# -- DLPack ---------------------------------------------------------------------------------


def _consumer_stream(stream):
    """The ``stream=`` argument DLPack expects for CUDA from cucopy's stream."""
    if stream is None:
        return None
    try:
        handle = stream_handle(stream)
    except TypeError:  # a simulated stream: no CUDA stream to order against
        return None
    return 1 if handle == 0 else handle  # DLPack reserves 0; the raw null stream is legacy


def _export(x, kind: int, stream):
    s = _consumer_stream(stream) if kind in (_CUDA, _CUDA_MANAGED) else None
    try:
        try:
            return x.__dlpack__(stream=s, max_version=(1, 0), copy=False)
        except TypeError:  # a producer older than DLPack 1.0's keywords
            return x.__dlpack__(stream=s)
    except BufferError as e:
        raise TypeError(f"{_name(x)}: cannot be exported through DLPack: {e}") from None


def _from_dlpack(x, stream) -> ArrayInfo:
    dl_device = getattr(x, "__dlpack_device__", None)
    kind = int(dl_device()[0]) if dl_device is not None else _CPU
    capsule = _export(x, kind, stream)
    name = _capsule_name(capsule)
    if name == b"dltensor_versioned":
        managed = _DLManagedTensorVersioned.from_address(_capsule_pointer(capsule, name))
        if managed.version.major != 1:
            raise TypeError(
                f"{_name(x)}: DLPack {managed.version.major}.{managed.version.minor} capsule, "
                f"cucopy reads 1.x"
            )
        flags = managed.flags
    elif name == b"dltensor":
        managed = _DLManagedTensor.from_address(_capsule_pointer(capsule, name))
        flags = 0
    else:
        raise TypeError(f"{_name(x)}: __dlpack__ returned a capsule named {name!r}")
    t = managed.dl_tensor
    kind, ordinal = t.device.device_type, t.device.device_id
    dtype = _dtype(x, t.dtype.code, t.dtype.bits, t.dtype.lanes)
    shape = tuple(t.shape[i] for i in range(t.ndim))
    if t.strides:
        strides = tuple(t.strides[i] * dtype.itemsize for i in range(t.ndim))
    else:
        strides = _contiguous(shape, dtype.itemsize)
    ptr = (t.data or 0) + t.byte_offset
    readonly = bool(flags & (_FLAG_READ_ONLY | _FLAG_IS_COPIED))
    owner = Exported(x, capsule)
    if kind in (_CPU, _CUDA_HOST):
        pinned = True if kind == _CUDA_HOST else None
        where = "cpu, pinned" if pinned else "cpu"
        return ArrayInfo(
            ptr,
            shape,
            strides,
            dtype,
            device=None,
            pinned=pinned,
            host=_host_view(ptr, shape, strides, dtype, owner, readonly),
            obj=owner,
            readonly=readonly,
            label=_label(x, where, dtype, shape),
        )
    if kind in (_CUDA, _CUDA_MANAGED):
        return ArrayInfo(
            ptr,
            shape,
            strides,
            dtype,
            device=ordinal,
            pinned=None,
            host=None,
            obj=owner,
            readonly=readonly,
            label=_label(x, f"cuda:{ordinal}", dtype, shape),
        )
    raise TypeError(
        f"{_name(x)}: DLPack device {_DEVICE_NAMES.get(kind, kind)} is not supported "
        f"(cucopy handles CPU, CUDA, CUDA host and CUDA managed memory)"
    )


def resolve(x, stream=None) -> ArrayInfo:
    """Describe an object with ``__cuda_array_interface__`` or ``__dlpack__``.

    Parameters
    ----------
    x : object
        Anything exposing ``__cuda_array_interface__`` (v2 or v3), or
        ``__dlpack__`` (with ``__dlpack_device__``).
    stream : optional
        The consumer's stream (raw handle or stream object), passed to
        ``__dlpack__`` for CUDA memory so the producer orders its pending work
        before it.

    Returns
    -------
    ArrayInfo
        ``obj`` is ``x`` for the interface path and an :class:`Exported`
        (``x`` plus its capsule) for the DLPack path.

    Raises
    ------
    TypeError
        For an unsupported dtype or device, a masked array, a producer that
        cannot export, or a ``__cuda_array_interface__`` pointer whose device
        cannot be determined.
    """
    has_dlpack = hasattr(x, "__dlpack__")
    try:
        cai = x.__cuda_array_interface__
    except AttributeError:
        cai = None
    except Exception as e:  # a producer that cannot describe this array through the interface
        if not has_dlpack:
            raise TypeError(f"{_name(x)}: __cuda_array_interface__ failed: {e}") from e
        cai = None
    if cai is not None:
        return _from_cai(x, cai)
    if has_dlpack:
        return _from_dlpack(x, stream)
    raise TypeError(f"expected __cuda_array_interface__ or __dlpack__, got {_name(x)}")


def current_stream(x):
    """None: a generic array names no current stream (the backend's default is used)."""
    return None
