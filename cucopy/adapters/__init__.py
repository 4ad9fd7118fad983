"""Array and stream resolution, one module per array library.

:func:`resolve` turns any supported array into an :class:`ArrayInfo` without
copying. The library is found from ``type(x).__module__`` and its adapter is
imported only then, so importing cucopy imports none of torch, cupy or jax.
Objects that carry ``__cucopy_array__`` (the simulated device's arrays)
describe themselves.
"""

from __future__ import annotations

import importlib
import math

import numpy as np

__all__ = ["ArrayInfo", "resolve", "stream_handle", "current_stream", "describe"]


class ArrayInfo:
    """Where an array's bytes are and how they are laid out.

    Attributes
    ----------
    ptr : int
        Address of element ``[0, ..., 0]`` (host or device address space).
    shape : tuple of int
    strides : tuple of int
        In bytes.
    dtype : numpy.dtype
    device : object
        ``None`` for host memory; a CUDA ordinal (int) or a simulated device.
    pinned : bool or None
        Host arrays: page-locked or not; ``None`` when the adapter cannot tell
        (the backend is asked).
    host : numpy.ndarray or None
        Host arrays: a NumPy view of the same bytes.
    obj : object
        The original array, kept alive while the info is.
    readonly : bool
        True for immutable arrays (JAX), refused as destinations.
    label : str
        A short description for error messages.
    """

    __slots__ = ("ptr", "shape", "strides", "dtype", "device", "pinned", "host", "obj",
                 "readonly", "label")

    def __init__(self, ptr, shape, strides, dtype, device=None, pinned=None, host=None,
                 obj=None, readonly=False, label=""):
        self.ptr = ptr
        self.shape = tuple(shape)
        self.strides = tuple(strides)
        self.dtype = np.dtype(dtype)
        self.device = device
        self.pinned = pinned
        self.host = host
        self.obj = obj
        self.readonly = readonly
        self.label = label

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the elements (not of the extent)."""
        return self.size * self.dtype.itemsize

    @property
    def is_host(self) -> bool:
        """True for host memory."""
        return self.device is None

    def __repr__(self) -> str:
        return f"ArrayInfo({self.label})"


def _host_label(lib: str, a) -> str:
    return f"{lib}({a.dtype}, shape={tuple(a.shape)})"


def _resolve_numpy(x, stream=None) -> ArrayInfo:
    if x.dtype.hasobject:
        raise TypeError(f"numpy array of dtype {x.dtype} holds Python objects, not bytes")
    return ArrayInfo(x.__array_interface__["data"][0], x.shape, x.strides, x.dtype,
                     device=None, pinned=None, host=x, obj=x,
                     readonly=not x.flags.writeable, label=_host_label("numpy.ndarray", x))


def _resolve_self(x, stream=None) -> ArrayInfo:
    return x.__cucopy_array__()


# library name -> (adapter module, resolver name); imported on first use
_LIBS = {
    "torch": ".torch",
    "cupy": ".cupy",
    "jax": ".jax",
    "jaxlib": ".jax",
}

_by_type: dict = {np.ndarray: _resolve_numpy}


def _lookup(tp):
    fn = _by_type.get(tp)
    if fn is not None:
        return fn
    if hasattr(tp, "__cucopy_array__"):
        fn = _resolve_self
    elif issubclass(tp, np.ndarray):
        fn = _resolve_numpy
    else:
        lib = tp.__module__.split(".")[0]
        mod = _LIBS.get(lib)
        if mod is not None:
            fn = importlib.import_module(mod, __name__).resolve
        elif hasattr(tp, "__cuda_array_interface__") or hasattr(tp, "__dlpack__"):
            fn = importlib.import_module(".dlpack", __name__).resolve
        else:
            fn = None
    if fn is not None:
        _by_type[tp] = fn
    return fn


def resolve(x, stream=None) -> ArrayInfo:
    """Describe an array without copying it.

    Parameters
    ----------
    x : array
        NumPy, torch, CuPy or JAX array, a simulated-device array, or anything
        with ``__cuda_array_interface__`` or ``__dlpack__``.
    stream : int, optional
        The consumer's stream handle, passed to ``__dlpack__`` so the producer's
        pending work is ordered before the copy.

    Returns
    -------
    ArrayInfo

    Raises
    ------
    TypeError
        If ``x`` is not an array cucopy knows.
    """
    if isinstance(x, ArrayInfo):
        return x
    fn = _by_type.get(type(x)) or _lookup(type(x))
    if fn is None:
        raise TypeError(
            f"expected an array (numpy, torch, cupy, jax, __cuda_array_interface__ or "
            f"__dlpack__), got {type(x).__module__}.{type(x).__qualname__}"
        )
    return fn(x, stream)


def describe(x) -> str:
    """A short description of ``x`` for error messages."""
    try:
        return resolve(x).label
    except Exception:
        return f"{type(x).__module__}.{type(x).__qualname__}"


def stream_handle(stream) -> int:
    """Return the raw ``cudaStream_t`` of a CuPy, torch, ``__cuda_stream__`` or int stream.

    Raises
    ------
    TypeError
        If ``stream`` is none of those.
    """
    if isinstance(stream, int):
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        version, handle = proto() if callable(proto) else proto
        return int(handle)
    for attr in ("cuda_stream", "ptr", "handle"):  # torch, cupy, cuda.core
        h = getattr(stream, attr, None)
        if isinstance(h, int):
            return h
    raise TypeError(
        f"stream: expected a CuPy or torch stream, an object with __cuda_stream__ or a "
        f"raw handle, got {type(stream).__module__}.{type(stream).__qualname__}"
    )


def current_stream(x):
    """The current stream of the library that owns array ``x`` (None: backend default)."""
    fn = getattr(x, "__cucopy_current_stream__", None)
    if fn is not None:
        return fn()
    lib = type(x).__module__.split(".")[0]
    mod = _LIBS.get(lib)
    if mod is None:
        return None
    return importlib.import_module(mod, __name__).current_stream(x)
