"""CuPy ndarrays: device memory, strides already in bytes, described without copying."""

from __future__ import annotations

import cupy

from . import ArrayInfo

__all__ = ["resolve", "current_stream"]


def resolve(x, stream=None) -> ArrayInfo:
    """Describe a CuPy array without copying it.

    Parameters
    ----------
    x : cupy.ndarray
    stream : optional
        Unused: CuPy orders its own work; the copier orders against the stream
        it is given.

    Returns
    -------
    ArrayInfo
        ``device`` is the CUDA ordinal, ``ptr`` the address of element 0
        (``x.data.ptr`` includes the view's offset).

    Raises
    ------
    TypeError
        If ``x`` holds Python objects (never, for CuPy) or is not an ndarray.
    """
    if not isinstance(x, cupy.ndarray):
        raise TypeError(f"expected a cupy.ndarray, got {type(x).__module__}.{type(x).__qualname__}")
    mem = x.data
    dev = mem.device_id
    return ArrayInfo(
        mem.ptr,
        x.shape,
        x.strides,
        x.dtype,
        device=dev,
        pinned=None,
        host=None,
        obj=x,
        readonly=False,
        label=lambda: f"cupy.ndarray(cuda:{dev}, {x.dtype}, shape={x.shape})",
    )


def current_stream(x):
    """CuPy's current stream on ``x``'s device.

    Parameters
    ----------
    x : cupy.ndarray

    Returns
    -------
    cupy.cuda.Stream
    """
    dev = x.data.device_id
    try:
        return cupy.cuda.get_current_stream(dev)
    except TypeError:  # CuPy without the device_id argument
        with cupy.cuda.Device(dev):
            return cupy.cuda.get_current_stream()


def fingerprint(x):
    """What must be unchanged for a cached description of ``x`` to hold.

    A CuPy array's memory never moves, but its shape can be set in place.
    """
    return (x.data.ptr, x.shape, x.strides)


# The same, as attributes the compiled segment reads itself (name, whether to call
# it), instead of calling this function: the array's ``data`` (a MemoryPointer that
# ndarray keeps and never replaces: the same object, the same address), its shape
# and its strides. A hit here is a hit of the function's; a new ``data`` object, if
# ever, is a miss the general path resolves.
fingerprint.__cucopy_spec__ = (("data", False), ("shape", False), ("strides", False))
