"""Array and stream resolution, one module per array library.

:func:`resolve` turns any supported array into an :class:`ArrayInfo` without
copying. The library is found from ``type(x).__module__`` and its adapter is
imported only then, so importing cucopy imports none of torch, cupy or jax.
Objects that carry ``__cucopy_array__`` (the simulated device's arrays)
describe themselves. A subclass defined elsewhere (``class MyTensor(torch.Tensor)``
in user code) is routed by the first class in its MRO that belongs to a known
library, so it gets the library's adapter rather than the generic DLPack one.
"""

from __future__ import annotations

import importlib
import math

import numpy as np

__all__ = [
    "ArrayInfo",
    "resolve",
    "stream_handle",
    "current_stream",
    "describe",
    "readonly_hint",
    "fingerprint_fn",
    "extension_dtype",
]


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
        The original array, kept alive while the info is (for an array read
        through ``__dlpack__``, a :class:`cucopy.adapters.dlpack.Exported`
        holding the array and its capsule).
    readonly : bool
        True for immutable arrays (JAX), refused as destinations.
    label : str
        A short description for error messages. Adapters may pass a zero-argument
        callable instead: it is called on first read (formatting a dtype costs
        microseconds, and most infos never appear in a message).
    """

    __slots__ = (
        "ptr",
        "shape",
        "strides",
        "dtype",
        "device",
        "pinned",
        "host",
        "obj",
        "readonly",
        "_label",
    )

    def __init__(
        self,
        ptr,
        shape,
        strides,
        dtype,
        device=None,
        pinned=None,
        host=None,
        obj=None,
        readonly=False,
        label="",
    ):
        self.ptr = ptr
        self.shape = tuple(shape)
        self.strides = tuple(strides)
        self.dtype = np.dtype(dtype)
        self.device = device
        self.pinned = pinned
        self.host = host
        self.obj = obj
        self.readonly = readonly
        self._label = label

    @property
    def label(self) -> str:
        """A short description for error messages."""
        label = self._label
        if not isinstance(label, str):
            label = self._label = label()
        return label

    @label.setter
    def label(self, value) -> None:
        self._label = value

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


class _HostInfo(ArrayInfo):
    """A NumPy array's info; the address is read only when asked for.

    Staging a host source needs its bytes, not its address, and reading
    ``__array_interface__`` costs about a microsecond per call.
    """

    __slots__ = ()

    @property
    def ptr(self) -> int:  # noqa: D102 (documented on ArrayInfo)
        return self.host.ctypes.data


_new_info = object.__new__


def _resolve_numpy(x, stream=None) -> ArrayInfo:
    dt = x.dtype
    if dt.hasobject:
        raise TypeError(f"numpy array of dtype {dt} holds Python objects, not bytes")
    info = _new_info(_HostInfo)
    info.shape = x.shape
    info.strides = x.strides
    info.dtype = dt
    info.device = None
    info.pinned = None
    info.host = x
    info.obj = x
    info.readonly = not x.flags.writeable
    info._label = lambda: _host_label("numpy.ndarray", x)
    return info


def _refuse_masked(x, stream=None) -> ArrayInfo:
    raise TypeError(
        f"{type(x).__module__}.{type(x).__qualname__} of dtype {x.dtype}, shape "
        f"{x.shape}: a masked array's masked elements have no defined values; copy "
        "x.filled(value), or x.data for the bytes as they are"
    )


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


def _library(tp) -> str | None:
    """The adapter module for type ``tp``: its own library's, else its nearest base's."""
    for base in tp.__mro__:
        mod = _LIBS.get(base.__module__.split(".")[0])
        if mod is not None:
            return mod
    return None


def _lookup(tp):
    fn = _by_type.get(tp)
    if fn is not None:
        return fn
    if hasattr(tp, "__cucopy_array__"):
        fn = _resolve_self
    elif issubclass(tp, np.ndarray):
        fn = _refuse_masked if issubclass(tp, np.ma.MaskedArray) else _resolve_numpy
    else:
        mod = _library(tp)
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
    if fn is None and (hasattr(x, "__cuda_array_interface__") or hasattr(x, "__dlpack__")):
        # set on the instance rather than the class: not cached by type
        fn = importlib.import_module(".dlpack", __name__).resolve
    if fn is None:
        raise TypeError(
            f"expected an array (numpy, torch, cupy, jax, __cuda_array_interface__ or "
            f"__dlpack__), got {type(x).__module__}.{type(x).__qualname__}"
        )
    return fn(x, stream)


def _immutable(x):
    return None


_immutable.__cucopy_spec__ = ()  # nothing to read: the geometry never changes


def fingerprint_fn(x):
    """A cheap ``f(x)`` whose value changes whenever ``x``'s geometry may have.

    Lets a caller cache a device array's :class:`ArrayInfo` by identity and
    revalidate it for a fraction of a :func:`resolve`. Returns None for arrays
    that must be resolved every time.
    """
    tp = type(x)
    try:
        return _fp_by_type[tp]
    except KeyError:
        pass
    if hasattr(tp, "__cucopy_array__"):
        fn = getattr(tp, "__cucopy_fingerprint__", _immutable)
    else:
        lib = tp.__module__.split(".")[0]
        fn = None
        if lib in ("torch", "cupy"):
            fn = importlib.import_module(_LIBS[lib], __name__).fingerprint
    _fp_by_type[tp] = fn
    return fn


# type -> fingerprint function (or None); looked up once per type, as _by_type is
_fp_by_type: dict = {}


def describe(x) -> str:
    """A short description of ``x`` for error messages."""
    try:
        return resolve(x).label
    except Exception:
        return f"{type(x).__module__}.{type(x).__qualname__}"


def stream_handle(stream) -> int:
    """Return the raw ``cudaStream_t`` of a CuPy, torch, ``__cuda_stream__`` or int stream.

    Parameters
    ----------
    stream : int or stream object
        A raw handle (int), an object with ``__cuda_stream__`` (the CUDA stream
        protocol: a method returning ``(version, handle)``), a torch stream
        (``.cuda_stream``), a CuPy stream (``.ptr``), or a cuda-python
        ``CUstream`` (``.getPtr()``).

    Returns
    -------
    int

    Raises
    ------
    TypeError
        If ``stream`` is none of those.
    """
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        version, handle = proto() if callable(proto) else proto
        return int(handle)
    for attr in ("cuda_stream", "ptr", "handle"):  # torch, cupy, numba/cuda.core
        h = getattr(stream, attr, None)
        if isinstance(h, int) and not isinstance(h, bool):
            return h
    get_ptr = getattr(stream, "getPtr", None)  # cuda-python CUstream / cudaStream_t
    if callable(get_ptr):
        return int(get_ptr())
    raise TypeError(
        f"stream: expected a CuPy or torch stream, an object with __cuda_stream__ or a "
        f"raw handle, got {type(stream).__module__}.{type(stream).__qualname__}"
    )


def readonly_hint(label: str) -> str:
    """Why an immutable array cannot be a destination, and what to do instead.

    The copier prefixes the site: ``TypeError(f"{site}: {readonly_hint(info.label)}")``.

    Parameters
    ----------
    label : str
        The destination's ``ArrayInfo.label``.

    Returns
    -------
    str
    """
    if label.startswith("jax."):
        return (
            f"{label} is immutable (a JAX array): write into a CuPy or torch buffer and "
            f"view it from JAX with jax.dlpack.from_dlpack"
        )
    return f"{label} is read-only: pass a writable array as the destination"


def extension_dtype(name: str, itemsize: int) -> np.dtype:
    """The NumPy dtype cucopy uses for a type NumPy lacks (``bfloat16``, ``float8_*``).

    ``ml_dtypes.<name>`` when ``ml_dtypes`` is importable (JAX's own choice, so
    a torch and a JAX ``bfloat16`` compare equal); otherwise an opaque
    structured dtype ``[(name, "V<itemsize>")]``, which has the right size,
    equals itself and differs from every integer type. Copies are byte-exact,
    so nothing else about the dtype matters to them.

    Parameters
    ----------
    name : str
        The type's name, as ``ml_dtypes`` spells it (``"bfloat16"``).
    itemsize : int
        Bytes per element.

    Returns
    -------
    numpy.dtype
    """
    dt = _extension.get(name)
    if dt is None:
        try:
            import ml_dtypes

            dt = np.dtype(getattr(ml_dtypes, name))
        except (ImportError, AttributeError):
            dt = np.dtype([(name, f"V{itemsize}")])
        if dt.itemsize != itemsize:
            raise AssertionError(f"internal: {name} is {dt.itemsize} bytes, expected {itemsize}")
        _extension[name] = dt
    return dt


_extension: dict = {}


def current_stream(x):
    """The current stream of the library that owns array ``x``.

    Parameters
    ----------
    x : array

    Returns
    -------
    stream object or None
        torch's or CuPy's current stream on ``x``'s device; None for host
        arrays, JAX arrays and generic objects (the backend's default stream).
    """
    fn = getattr(x, "__cucopy_current_stream__", None)
    if fn is not None:
        return fn()
    mod = _library(type(x))
    if mod is None:
        return None
    return importlib.import_module(mod, __name__).current_stream(x)
