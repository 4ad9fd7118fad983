"""JAX arrays, as copy sources only: JAX arrays are immutable.

Every JAX array resolves with ``readonly=True``; the copier refuses it as a
destination with :func:`cucopy.adapters.readonly_hint` (write into a CuPy or
torch buffer and view it from JAX through DLPack).

A single-device GPU array resolves through ``__dlpack__(stream=...)`` when the
caller names a stream (JAX then makes that stream wait for the computation
producing the array, without blocking the host), else through
``__cuda_array_interface__`` (for which JAX blocks the host until the array is
ready), falling back to DLPack for dtypes the interface cannot describe
(``bfloat16``). The ordinal is the device's ``local_hardware_id``. A CPU
array resolves to a NumPy view of its bytes (``np.asarray``, zero-copy when
JAX allows it; a copy is harmless for a source). Tracers, deleted arrays,
arrays sharded over several devices and non-CUDA accelerators are refused.
"""

from __future__ import annotations

import numpy as np

from . import ArrayInfo
from . import dlpack as _dlpack

__all__ = ["resolve", "current_stream"]


def _label(x, where: str) -> str:
    return f"jax.Array({where}, {x.dtype}, shape={tuple(x.shape)})"


def _device(x):
    try:
        devices = x.devices()
    except Exception:  # tracers raise a ConcretizationTypeError (or AttributeError)
        raise TypeError(
            f"{type(x).__module__}.{type(x).__qualname__}: a traced JAX value (inside jit, "
            f"grad or vmap) has no bytes to copy"
        ) from None
    if len(devices) != 1:
        raise TypeError(
            f"{_label(x, f'{len(devices)} devices')}: sharded over several devices: "
            f"copy one shard (x.addressable_data(i))"
        )
    return next(iter(devices))


def resolve(x, stream=None) -> ArrayInfo:
    """Describe a JAX array (a copy source) without copying it.

    Parameters
    ----------
    x : jax.Array
        A concrete array on one CPU or CUDA device.
    stream : optional
        The consumer's stream. Given, a GPU array is exported through
        ``__dlpack__(stream=...)`` so JAX orders its pending work before that
        stream instead of blocking the host.

    Returns
    -------
    ArrayInfo
        ``readonly`` is always True; ``label`` starts with ``jax.Array(``.

    Raises
    ------
    TypeError
        For a tracer, a deleted or sharded array, or an array on a device
        other than CPU or a CUDA GPU.
    """
    dev = _device(x)
    if x.is_deleted():
        raise TypeError(f"{_label(x, str(dev))}: the array has been deleted")
    platform = dev.platform
    if platform == "cpu":
        host = np.asarray(x)
        return ArrayInfo(
            host.__array_interface__["data"][0],
            host.shape,
            host.strides,
            host.dtype,
            device=None,
            pinned=None,
            host=host,
            obj=x,
            readonly=True,
            label=lambda: _label(x, "cpu"),
        )
    if platform not in ("gpu", "cuda"):
        raise TypeError(
            f"{_label(x, str(dev))}: cucopy handles JAX arrays on CPU and CUDA GPUs, "
            f"got one on {platform}"
        )
    ordinal = getattr(dev, "local_hardware_id", None)
    if ordinal is None:
        ordinal = dev.id
    info = None
    if stream is None:
        try:
            cai = x.__cuda_array_interface__
        except Exception:  # dtypes the interface cannot describe, e.g. bfloat16
            cai = None
        if cai is not None:
            ptr = int(cai["data"][0] or 0)
            dtype = np.dtype(cai["typestr"])
            if dtype.itemsize != x.dtype.itemsize:
                raise AssertionError(f"internal: {cai['typestr']} for a {x.dtype} JAX array")
            dtype = x.dtype  # typestr may be a bare V2 for extension dtypes
            strides = cai.get("strides")
            if strides is None:
                strides = _dlpack._contiguous(tuple(cai["shape"]), dtype.itemsize)
            info = ArrayInfo(ptr, cai["shape"], strides, dtype, device=ordinal, obj=x)
    if info is None:
        info = _dlpack._from_dlpack(x, stream)
        if info.device != ordinal:
            raise AssertionError(f"internal: DLPack says cuda:{info.device}, JAX {dev}")
    info.readonly = True
    info.label = lambda: _label(x, f"cuda:{ordinal}")
    return info


def current_stream(x):
    """None: JAX exposes no current stream (the backend's default is used)."""
    return None
