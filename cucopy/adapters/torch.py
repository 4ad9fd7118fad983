"""torch tensors: CPU (pinned or pageable) and CUDA, described without copying.

``data_ptr()`` already includes the storage offset, so views (``t[3:]``,
``t[:, 1:3]``, ``t.T``) resolve to the address of their element 0 with their
own strides. Dtypes NumPy lacks (``bfloat16``, the ``float8`` family) map to
the ``ml_dtypes`` type of the same name when ``ml_dtypes`` is importable, else
to an opaque structured dtype of the same size (see
:func:`cucopy.adapters.extension_dtype`): copies are byte-exact, so the dtype
only has to carry the item size and compare equal between two tensors of the
same torch dtype, and unequal to every other one (a ``bfloat16`` tensor never
passes for ``int16``).

Refused with a ``TypeError`` that names the tensor: ``bool`` and ``complex32``
tensors, quantized and sub-byte dtypes, sparse, nested and meta tensors,
tensors with the lazy conjugate or negative bit set (their bytes are not their
values), and tensors on devices other than CPU and CUDA.
"""

from __future__ import annotations

import ctypes
import os
import sys

import numpy as np
import torch

from ..errors import CopyError
from . import ArrayInfo, extension_dtype

__all__ = ["resolve", "current_stream"]

# torch dtype -> numpy dtype; torch.bool and complex32 are refused by request of the
# copy contract (a bool view of integer bytes is a reinterpretation, not a value).
_NUMPY = {
    torch.float16: np.dtype(np.float16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.complex64: np.dtype(np.complex64),
    torch.complex128: np.dtype(np.complex128),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.uint8: np.dtype(np.uint8),
}
for _name, _np in (("uint16", np.uint16), ("uint32", np.uint32), ("uint64", np.uint64)):
    if hasattr(torch, _name):  # torch >= 2.3
        _NUMPY[getattr(torch, _name)] = np.dtype(_np)

# dtypes NumPy lacks: resolved on first use (ml_dtypes is imported only then)
_EXTENSION = (
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
)
_EXTENSION = {getattr(torch, n): n for n in _EXTENSION if hasattr(torch, n)}

# same-size integer dtype used to take a NumPy view of an extension-dtype tensor
_VIEW_AS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _numpy_dtype(x) -> np.dtype:
    tdt = x.dtype
    dt = _NUMPY.get(tdt)
    if dt is not None:
        return dt
    name = _EXTENSION.get(tdt)
    if name is not None:
        dt = extension_dtype(name, tdt.itemsize)
        _NUMPY[tdt] = dt
        return dt
    if tdt is torch.bool:
        why = "bool tensors are not supported: copy a torch.uint8 view (t.view(torch.uint8))"
    elif tdt is getattr(torch, "complex32", None):
        why = "complex32 has no byte-exact NumPy equivalent: use complex64"
    elif x.is_quantized:
        why = "quantized tensors are not supported: copy t.int_repr()"
    else:
        why = f"dtype {tdt} is not supported"
    raise TypeError(f"{_label(x)}: {why}")


def _label(x) -> str:
    try:
        dev = str(x.device)
    except Exception:  # tensor subclasses without a device
        dev = "?"
    try:
        shape = tuple(x.shape)
    except Exception:  # nested tensors have no single shape
        shape = "?"
    return f"torch.Tensor({dev}, {x.dtype}, shape={shape})"


def _fake(x) -> bool:
    """Whether ``x`` is a FakeTensor (no data: a tracing stand-in)."""
    mod = sys.modules.get("torch._subclasses.fake_tensor")
    return mod is not None and isinstance(x, mod.FakeTensor)


def _refuse(x) -> None:
    """Raise TypeError when ``x``'s bytes are not a strided array cucopy can copy."""
    if x.layout is not torch.strided:
        raise TypeError(f"{_label(x)}: {x.layout} tensors are not supported, only strided ones")
    if x.is_nested:
        raise TypeError(f"{_label(x)}: nested tensors are not supported")
    if _fake(x):
        raise TypeError(f"{_label(x)}: a FakeTensor has no data to copy")
    if x.is_conj() or x.is_neg():
        raise TypeError(
            f"{_label(x)}: the tensor has its lazy conjugate/negative bit set, so its bytes "
            f"are not its values: copy t.resolve_conj().resolve_neg()"
        )
    kind = x.device.type
    if kind == "meta":
        raise TypeError(f"{_label(x)}: meta tensors have no data")
    raise TypeError(f"{_label(x)}: cucopy handles CPU and CUDA tensors, got a {kind} tensor")


def resolve(x, stream=None) -> ArrayInfo:
    """Describe a torch tensor without copying it.

    Parameters
    ----------
    x : torch.Tensor
        A strided CPU or CUDA tensor (views and tensors requiring grad included).
    stream : optional
        Unused: torch orders its own work; the copier orders against the stream
        it is given.

    Returns
    -------
    ArrayInfo
        For a CUDA tensor ``device`` is its ordinal; for a CPU tensor ``device``
        is None, ``pinned`` is ``x.is_pinned()`` and ``host`` a NumPy view of the
        same bytes.

    Raises
    ------
    TypeError
        For an unsupported dtype (bool, complex32, quantized, sub-byte), layout
        (sparse, nested), device (meta, mps, ...) or a tensor with its
        conjugate/negative bit set; the message names the tensor.
    """
    is_cuda = x.is_cuda
    if (
        (not is_cuda and not x.is_cpu)
        or x.layout is not torch.strided
        or x.is_nested
        or x.is_conj()
        or x.is_neg()
        or (type(x) is not torch.Tensor and _fake(x))
    ):
        _refuse(x)
    dt = _numpy_dtype(x)
    item = dt.itemsize
    shape = tuple(x.shape)
    strides = tuple([s * item for s in x.stride()])
    try:
        ptr = x.data_ptr()
    except RuntimeError as e:  # wrapper subclasses (FakeTensor, functional) have no storage
        raise TypeError(f"{_label(x)}: the tensor has no data pointer ({e})") from None
    if is_cuda:
        # the label closures capture locals, never ``info``: a cycle per call would
        # leave every resolve to the cyclic garbage collector
        dev = x.get_device()
        info = _new_info(ArrayInfo)
        info.device = dev
        info.pinned = None
        info.host = None
        info._label = lambda: f"torch.Tensor(cuda:{dev}, {x.dtype}, shape={shape})"
    else:
        t = x.detach() if x.requires_grad else x
        try:
            if t.dtype in _EXTENSION:
                host = t.view(_VIEW_AS[item]).numpy().view(dt)
            else:
                host = t.numpy()
        except RuntimeError as e:  # a subclass whose bytes NumPy cannot read
            raise TypeError(f"{_label(x)}: NumPy cannot read the tensor's bytes ({e})") from None
        info = _new_info(_HostTensorInfo)
        info.device = None
        info.host = host
        info._label = lambda: (
            f"torch.Tensor({'cpu, pinned' if x.is_pinned() else 'cpu'}, {x.dtype}, shape={shape})"
        )
    info.ptr = ptr
    info.shape = shape
    info.strides = strides
    info.dtype = dt
    info.obj = x
    info.readonly = False
    return info


_new_info = object.__new__


class _HostTensorInfo(ArrayInfo):
    """A CPU tensor's info; whether it is pinned is asked only when needed.

    ``Tensor.is_pinned()`` asks the CUDA driver and costs microseconds, while
    staging a source only needs its bytes.
    """

    __slots__ = ("_pinned",)

    @property
    def pinned(self) -> bool:  # noqa: D102 (documented on ArrayInfo)
        p = getattr(self, "_pinned", None)
        if p is None:
            p = self._pinned = bool(self.obj.is_pinned())
        return p


def current_stream(x):
    """torch's current stream on ``x``'s CUDA device, or None for a CPU tensor.

    Parameters
    ----------
    x : torch.Tensor

    Returns
    -------
    torch.cuda.Stream or None
    """
    if x.is_cuda:
        return torch.cuda.current_stream(x.device)
    return None


def fingerprint(x):
    """What must be unchanged for a cached description of ``x`` to hold.

    ``resize_``, ``set_`` and ``as_strided_`` change a tensor's geometry in place,
    and ``.data =`` may swap in a tensor of another dtype, or a lazy conjugate or
    negative view of the same bytes (``x.data = x.conj()``); each changes one of these.
    """
    return (x.data_ptr(), x.shape, x.stride(), x.dtype, x.is_conj(), x.is_neg())


# The same, as attributes to read (name, whether to call it): the compiled segment
# evaluates them directly instead of calling this function.
fingerprint.__cucopy_spec__ = (
    ("data_ptr", True),
    ("shape", False),
    ("stride", True),
    ("dtype", False),
    ("is_conj", True),
    ("is_neg", True),
)
# Methods that must return False for a cached tensor read through the native getters
# (below), which do not see these bits: a conjugate or negative view's bytes are not
# its values.
fingerprint.__cucopy_flags__ = ("is_conj", "is_neg")
# How to read a view made afresh (``buf[:n]``) of a tensor seen before: its base
# (``_base``), address (``data_ptr()``), ``shape`` and ``stride()`` in elements, and
# its ``dtype``, which must be the base's; ``is_neg()`` and ``is_conj()`` must be
# False (their bytes are not their values). See cucopy.segment.
fingerprint.__cucopy_view__ = (
    "_base",
    "data_ptr",
    True,
    "shape",
    "stride",
    True,
    True,
    "dtype",
    ("is_neg", "is_conj"),
)


# Native getters for the compiled staging core (cucopy/_core/foreign.c, ``native_read``):
# torch's stable C shim (``aoti_torch_get_*``, which take an ``at::Tensor*``: one
# word holding the TensorImpl that ``_cdata`` names) reads a tensor's address,
# shape, strides and dtype without building a Python int or tuple. Declared only
# when the library exports them and they agree with the Python attributes on a few
# tensors here; otherwise the segment reads ``__cucopy_spec__``, as the pure-Python
# twin always does.
_NATIVE_NAMES = (
    "aoti_torch_get_data_ptr",
    "aoti_torch_get_dim",
    "aoti_torch_get_sizes",
    "aoti_torch_get_strides",
    "aoti_torch_get_dtype",
)


def _native_getters():
    """``("_cdata", *addresses)`` of the shim functions, checked; None when unusable."""
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    names = {"win32": "torch_cpu.dll", "darwin": "libtorch_cpu.dylib"}
    path = os.path.join(lib_dir, names.get(sys.platform, "libtorch_cpu.so"))
    try:
        lib = ctypes.CDLL(path)
        fns = [getattr(lib, name) for name in _NATIVE_NAMES]
        tensors = [
            torch.zeros(3, dtype=torch.int32),
            torch.arange(60, dtype=torch.float64).reshape(3, 4, 5)[1:, ::2, 1:4],
            torch.zeros((), dtype=torch.int16),
            torch.zeros(2, 3, dtype=torch.uint8).t(),
        ]
        seen = set()
        for t in tensors:
            word = ctypes.c_void_p(t._cdata)
            h = ctypes.byref(word)
            ptr, dim, dtype = ctypes.c_void_p(), ctypes.c_int64(), ctypes.c_int32()
            sizes = ctypes.POINTER(ctypes.c_int64)()
            strides = ctypes.POINTER(ctypes.c_int64)()
            rcs = (
                fns[0](h, ctypes.byref(ptr)),
                fns[1](h, ctypes.byref(dim)),
                fns[2](h, ctypes.byref(sizes)),
                fns[3](h, ctypes.byref(strides)),
                fns[4](h, ctypes.byref(dtype)),
            )
            n = dim.value
            if (
                any(rcs)
                or (ptr.value or 0) != t.data_ptr()
                or n != t.dim()
                or tuple(sizes[i] for i in range(n)) != tuple(t.shape)
                or tuple(strides[i] for i in range(n)) != t.stride()
            ):
                return None
            seen.add((t.dtype, dtype.value))
        if len({d for _, d in seen}) != len({t for t, _ in seen}):
            return None  # the dtype codes must tell the dtypes apart
        addrs = tuple(ctypes.cast(f, ctypes.c_void_p).value for f in fns)
        return ("_cdata", *addrs, _handle_word(tensors), *_flag_word())
    except Exception:  # any surprise: the Python attributes serve
        return None


def _flag_word() -> tuple:
    """Where a TensorImpl keeps its conjugate and negative bits: ``(offset, mask)``, or
    ``(-1, 0)``.

    The shim's getters do not read them, and ``x.data = x.conj()`` sets one in place on
    a tensor the compiled core has cached (the bytes then no longer are the values).
    Asking ``is_conj()`` and ``is_neg()`` of each cached tensor costs about 0.1 us a
    call on the GPU's host, a quarter of a merged copy, so the core reads the word
    instead: the dispatch key set, found here as the one word in which a lazy
    conjugate view and a negative view each differ from their base by one bit. It is
    declared only when those bits are clear on every plain tensor tried, set on every
    conjugate or negative one, and follow ``.data =`` both ways; otherwise the core
    asks the two methods (``__cucopy_flags__``).
    """
    try:
        words = 48  # of the TensorImpl (torch 2.13: the key set at byte 168)

        def read(t):
            p = t._cdata
            return [ctypes.c_uint64.from_address(p + 8 * i).value for i in range(words)]

        base = torch.zeros(4, dtype=torch.complex64)
        real = torch.zeros(4)
        wb, wc = read(base), read(base.conj())
        wr, wn = read(real), read(torch._neg_view(real))
        for i in range(words):
            conj, neg = wb[i] ^ wc[i], wr[i] ^ wn[i]
            if not (conj and neg and conj != neg):
                continue
            if bin(conj).count("1") != 1 or bin(neg).count("1") != 1:
                continue
            if not (wc[i] & conj and wn[i] & neg):
                continue
            mask = conj | neg
            plain = [
                base,
                real,
                torch.arange(60, dtype=torch.float64).reshape(3, 4, 5)[1:, ::2],
                torch.zeros(2, 3, dtype=torch.uint8).t(),
                torch.ones(3, requires_grad=True),
                torch.nn.Parameter(torch.zeros(2)),
                torch.from_numpy(__import__("numpy").arange(4)),
                base.conj().resolve_conj(),
            ]
            flagged = [
                base.conj(),
                torch._neg_view(real),
                torch.ones(3, dtype=torch.complex128).conj().imag,
            ]
            moved = torch.zeros(2, dtype=torch.complex64)
            moved.data = moved.conj()  # the bit set in place
            flagged.append(moved)
            back = torch.zeros(2, dtype=torch.complex64).conj()
            back.data = back.resolve_conj()  # and cleared
            plain.append(back)
            off = 8 * i
            if all(read(t)[i] & mask == 0 for t in plain) and all(
                read(t)[i] & mask for t in flagged
            ):
                return off, mask
        return -1, 0
    except Exception:  # any surprise: the two methods serve
        return -1, 0


def _handle_word(tensors) -> int:
    """Where a tensor object holds the ``_cdata`` handle itself, or -1.

    After CPython's object header, torch's ``THPVariable`` holds its ``at::Tensor``: one
    word naming the TensorImpl (torch 2.13: at offset 16; where it is a
    ``c10::MaybeOwned``, after a "borrowed" flag). The offset is declared only when that
    word is ``_cdata`` on every tensor tried (owned ones, views, NumPy's, parameters);
    the compiled core reads it for a cached tensor only after reading ``_cdata`` there
    on that very object.
    """
    try:
        import numpy as np

        tried = [
            *tensors,
            torch.from_numpy(np.arange(4, dtype=np.int64)),
            torch.ones(5)[1:],
            torch.nn.Parameter(torch.zeros(2)),
            torch.empty(0, dtype=torch.int8),
        ]
        for off in range(16, 64, 8):
            if all(
                type(t).__basicsize__ >= off + 8
                and ctypes.c_void_p.from_address(id(t) + off).value == t._cdata
                for t in tried
            ):
                return off
        return -1
    except Exception:  # any surprise: the getters' attribute read serves
        return -1


_native = _native_getters()
if _native is not None:
    fingerprint.__cucopy_native__ = _native


# -- check mode: torch operations on a staged destination ------------------------------------

# operations that touch no tensor's bytes (views, metadata): never a read before a barrier
_METADATA_OPS = frozenset(
    {
        "aten::is_pinned",
        "aten::size",
        "aten::stride",
        "aten::sym_size",
        "aten::sym_stride",
        "aten::sym_numel",
        "aten::storage_offset",
        "aten::sym_storage_offset",
        "aten::is_contiguous",
        "aten::dim",
        "aten::numel",
        "aten::detach",
        "aten::alias",
        "aten::lift_fresh",
        "aten::empty_like",
        "aten::empty.memory_format",
        "aten::empty_strided",
    }
)


def _extent(t) -> tuple[int, int] | None:
    """``[lo, hi)``: the bytes a tensor's view spans (None: no storage, or empty)."""
    try:
        if t.numel() == 0:
            return None
        it = t.element_size()
        ptr = t.untyped_storage().data_ptr() + t.storage_offset() * it
    except (RuntimeError, NotImplementedError):  # fake, meta or sparse tensors
        return None
    lo = hi = ptr
    for n, s in zip(t.shape, t.stride()):
        if n > 1:
            if s >= 0:
                hi += (n - 1) * s * it
            else:
                lo += (n - 1) * s * it
    return lo, hi + it


def _device_key(t):
    d = t.device
    return d.index if d.type == "cuda" else d.type


class StagedWatch:
    """Check mode: a torch dispatch mode that refuses operations on staged bytes.

    While it is entered, every torch operation's tensor arguments (outputs
    included: ``out=`` and in-place ones) are looked up with ``find(device, lo,
    hi)``; a hit (a description of the staged copy: its site and byte range) raises
    :class:`~cucopy.CopyError` naming it, the operation and the tensor. Views and
    metadata queries touch no bytes and pass.

    Parameters
    ----------
    find : callable
        ``find(device, lo, hi) -> str | None``: ``device`` is the CUDA ordinal (or
        ``"cpu"``, ``"meta"``...), ``[lo, hi)`` the tensor's byte span.
    """

    def __init__(self, find):
        from torch.utils._python_dispatch import TorchDispatchMode

        watch = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if not (getattr(func, "is_view", False) or func.name() in _METADATA_OPS):
                    watch._check(func, args, kwargs)
                return func(*args, **kwargs)

        self._find = find
        self._mode = _Mode()
        self._entered = False

    def _check(self, func, args, kwargs) -> None:
        for x in _flat((args, kwargs)):
            if isinstance(x, torch.Tensor):
                span = _extent(x)
                if span is None:
                    continue
                hit = self._find(_device_key(x), *span)
                if hit is not None:
                    raise CopyError(
                        f"{hit} was touched by torch operation {func.name()} (on "
                        f"{x.dtype} tensor shape={tuple(x.shape)} on {x.device}, bytes "
                        f"[{span[0]:#x}, {span[1]:#x})) before its barrier: the merged copy "
                        "into it has not landed. Make the site a flush_after barrier, or "
                        "flush() before this operation"
                    )

    def enter(self) -> None:
        """Start watching (idempotent)."""
        if not self._entered:
            self._mode.__enter__()
            self._entered = True

    def exit(self) -> bool:
        """Stop watching; False (still entered) when another mode was pushed above it."""
        if not self._entered:
            return True
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        if _get_current_dispatch_mode() is not self._mode:
            return False
        self._mode.__exit__(None, None, None)
        self._entered = False
        return True


def _flat(obj):
    if isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _flat(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _flat(x)
    else:
        yield obj
