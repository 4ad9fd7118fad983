"""The backend protocol on a CUDA GPU, through CuPy's runtime and driver wrappers.

Importing this module imports neither cupy nor cuda-python: :class:`CudaBackend`
imports cupy when it is constructed, and :func:`gpu_available` tries to.

Which API for which call
------------------------
Every call goes through ``cupy.cuda.runtime`` / ``cupy.cuda.driver``: they are
``cpdef`` Cython functions that take plain ints and return plain ints, so one
call costs the C call plus one Python-to-C dispatch. ``cuda.bindings`` (cuda-python)
wraps each argument in a typed object and returns a tuple. The backend_calls probe
timed both; on an H200 (CuPy 14.2, cuda-bindings 13.3, host µs per call, medians,
``bench/results/backend_calls_h200.json``) CuPy won every hot call: memcpyAsync
2.7 vs 3.1-3.4, eventRecord 0.26 vs 0.47-0.51, eventQuery 1.34 vs 1.59-1.61,
cudaGetDevice 0.08 vs 0.32, kernel launch 4.5 vs 5.4-6.4.

Kernel launches skip ``RawKernel.__call__`` (it converts each argument to a
CuPy ``CPointer`` and needs a stream *object*; 6.4 µs with a cached
``ExternalStream``, 9.2 µs with a new one per call): each thread keeps a
ctypes argument block per kernel, the launch writes the fields and hands its
address to ``cupy.cuda.driver.launchKernel`` (``cuLaunchKernel``, GIL
released), 4.5 µs. The backend's own checks (current device, error mapping)
add about 0.1-0.5 µs per call over the bare wrapper.

Device
------
A backend is bound to one ordinal. Every call that depends on the current
device checks it with ``cudaGetDevice`` (a thread-local read) and, only when
it differs, switches for the call and switches back, so the caller's current
device is never changed behind its back.

Streams
-------
Streams are raw ``cudaStream_t`` ints. :meth:`CudaBackend.resolve_stream`
turns a CuPy or torch stream, an object with ``__cuda_stream__``, or an int
into its handle; it does not keep the object alive, so whoever passed a stream
object (the copier) must hold it while the handle is in use. ``None`` means
CuPy's current stream on this device (the legacy default stream, handle 0,
unless CuPy was told otherwise), as the backend cannot know which array
library the caller uses; the copier resolves a library's current stream
itself where it can.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import json
import os
import sys
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .. import pack
from ..adapters import stream_handle
from ..deadline import poll
from ..errors import CopyError
from .base import Backend, DeviceBuffer, PinnedBuffer

__all__ = [
    "CudaBackend",
    "gpu_available",
    "gpu_status",
    "cudacall_module",
    "DEFAULT_MAPPED_THRESHOLD",
]

# CUDA runtime constants (ABI-stable values from driver_types.h).
_HOST_ALLOC_PORTABLE = 0x01
_HOST_ALLOC_MAPPED = 0x02
_EVENT_DISABLE_TIMING = 0x02
_H2D = 1  # cudaMemcpyHostToDevice
_D2H = 2  # cudaMemcpyDeviceToHost
_D2D = 3  # cudaMemcpyDeviceToDevice
_MEMORY_TYPE_HOST = 1  # cudaMemoryTypeHost (page-locked or registered)
_SUCCESS = 0
_ERROR_NOT_READY = 600  # cudaErrorNotReady
_probe_streams: dict = {}  # the coherence probe's stream by device (CudaBackend.probe_stream)

#: Segments of at most this many bytes are flushed ``mapped`` under
#: ``flush_mode="auto"`` when ``crossover.json`` has no entry for the device.
#: Measured on the H200 (bench/results/2026-11-30-h200-run4, size_sweep: one table
#: plus tiny vectors, the header and table carried in the launch): reading the
#: segment from mapped memory was faster than an upload plus launch at every size
#: measured, up to a 1 MiB segment (38 vs 46 us there). Without a carried table
#: the copier caps mapped segments lower (copier.py).
DEFAULT_MAPPED_THRESHOLD = 1 << 20

_CROSSOVER_PATH = Path(__file__).with_name("crossover.json")

# The fill kernel's grid: one block per 4 KiB of a row, at most 1024 blocks.
_FILL_BYTES_PER_BLOCK = 4096
_FILL_MAX_BLOCKS = 1024
# cucopy_fill takes width and rows as unsigned int; wider fills are cut into pieces
# of at most this many bytes (a multiple of every element size) or rows.
_FILL_MAX_FIELD = (1 << 32) - 1
_FILL_PIECE = (1 << 32) - 4096
# cuLaunchKernel's gridDim.x is at most 2**31 - 1
_MAX_GRID = (1 << 31) - 1


_MAX_2D_PITCH = (1 << 31) - 1


def _fill_pieces(width: int, rows: int) -> list:
    """``(row, rows, byte offset, width)`` pieces of a fill whose every field fits 32 bits."""
    if width <= _FILL_MAX_FIELD:
        return [
            (r, min(_FILL_MAX_FIELD, rows - r), 0, width) for r in range(0, rows, _FILL_MAX_FIELD)
        ]
    return [
        (r, 1, c, min(_FILL_PIECE, width - c))
        for r in range(rows)
        for c in range(0, width, _FILL_PIECE)
    ]


_HOLD_TIMEOUT_S = 10.0
_HOLD_SLOT_INTS = 4  # [release, timed_out, started, pad] per hold
_HOLD_SLOTS = 256

# The stall kernel behind CudaBackend.hold(): test support, not part of the
# wire format, so it lives here rather than in kernels/scatter.cu. It spins on
# a flag in mapped pinned memory and gives up after ``timeout_ns`` (read off
# %globaltimer) so that a test that never releases cannot wedge the GPU.
_HOLD_SOURCE = r"""
extern "C" __global__ void cucopy_hold(volatile int* flag, unsigned long long timeout_ns)
{
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    flag[2] = 1;
    __threadfence_system();
    while (flag[0] == 0) {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - start > timeout_ns) {
            flag[1] = 1;
            __threadfence_system();
            return;
        }
        __nanosleep(1000);
    }
}
"""

# Bound by _load() on first use, so that importing this module needs no cupy.
_cupy = None
_rt = None
_drv = None
_RuntimeError = None  # cupy.cuda.runtime.CUDARuntimeError
_DriverError = None  # cupy.cuda.driver.CUDADriverError
_CompileError = None  # cupy.cuda.compiler.CompileException
_getDevice = None
_launch = None


class _NoSuchError(Exception):
    pass


class _StreamHandle:
    """A raw stream handle offered through the CUDA stream protocol (``__cuda_stream__``)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple:
        return (0, self.ptr)


def cupy_stream(cupy, handle: int, device: int):
    """A CuPy stream object over a raw stream handle of ``device`` (not owned).

    ``cupy.cuda.Stream.from_external`` where CuPy has it: CuPy 14 deprecates
    ``ExternalStream`` and warns at each construction (the GPU suite printed ten
    thousand such warnings from graph replays). Older CuPy: ``ExternalStream``.

    Parameters
    ----------
    cupy : module
        The ``cupy`` module.
    handle : int
        A ``cudaStream_t``.
    device : int
        The ordinal the stream belongs to.
    """
    stream_cls = cupy.cuda.Stream
    if hasattr(stream_cls, "from_external"):
        with cupy.cuda.Device(device):  # from_external takes the current device's id
            return stream_cls.from_external(_StreamHandle(handle))
    return cupy.cuda.ExternalStream(handle, device)


def _load():
    global _cupy, _rt, _drv, _RuntimeError, _DriverError, _CompileError, _getDevice, _launch
    if _cupy is None:
        import cupy

        try:
            from cupy.cuda.compiler import CompileException as _CompileError
        except ImportError:  # moved: compile failures are then caught as plain errors
            _CompileError = _NoSuchError
        _rt = cupy.cuda.runtime
        _drv = cupy.cuda.driver
        _RuntimeError = _rt.CUDARuntimeError
        _DriverError = _drv.CUDADriverError
        _getDevice = _rt.getDevice
        _launch = _drv.launchKernel
        _cupy = cupy
    return _cupy


@functools.cache
def gpu_status() -> tuple[bool, str]:
    """Whether CuPy imports and sees at least one CUDA device, and why; never raises.

    Returns
    -------
    available : bool
    why : str
        What was found, e.g. ``"CuPy sees 1 CUDA device"`` or ``"CuPy is not
        installed (No module named 'cupy')"``.
    """
    try:
        _load()
    except ImportError as e:
        return False, f"CuPy is not installed ({e})"
    except Exception as e:  # a broken install: CuPy imports but cannot load CUDA
        return False, f"CuPy does not import ({type(e).__name__}: {e})"
    try:
        count = _rt.getDeviceCount()
    except Exception as e:
        return False, f"CuPy sees no usable CUDA device ({type(e).__name__}: {e})"
    if count <= 0:
        return False, "CuPy sees no CUDA device"
    return True, f"CuPy sees {count} CUDA device{'s' if count > 1 else ''}"


def gpu_available() -> bool:
    """Whether CuPy imports and sees at least one CUDA device; never raises.

    Returns
    -------
    bool
    """
    return gpu_status()[0]


# -- kernel arguments --------------------------------------------------------------


class _ScatterArgs(ctypes.Structure):
    _fields_ = [("seg", ctypes.c_uint64)]


class _FillArgs(ctypes.Structure):
    _fields_ = [
        ("dst", ctypes.c_uint64),
        ("dpitch", ctypes.c_uint64),
        ("width", ctypes.c_uint32),
        ("rows", ctypes.c_uint32),
        ("value", ctypes.c_uint64),
        ("elem", ctypes.c_uint32),
    ]


class _FeedArgs(ctypes.Structure):
    # scatter.cu's cucopy_scatter_feed(box, entries, feed, status)
    _fields_ = [
        ("box", ctypes.c_uint64),
        ("entries", ctypes.c_uint32),
        ("feed", ctypes.c_uint32),
        ("status", ctypes.c_uint64),
    ]


# cuStreamCaptureMode (cuda.h)
_CAPTURE_MODE_RELAXED = 2


class _HoldArgs(ctypes.Structure):
    _fields_ = [("flag", ctypes.c_uint64), ("timeout_ns", ctypes.c_uint64)]


class _CarryArgs(ctypes.Structure):
    # scatter.cu's CucopyCarried<CAP> at the largest capacity; a launch passes
    # its first CARRY_PREFIX + cap bytes.
    _fields_ = [
        ("seg", ctypes.c_uint64),
        ("nbytes", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("bytes", ctypes.c_ubyte * pack.CARRY_CAPACITIES[-1]),
    ]


# cuLaunchKernel's ``extra`` keys (cuda.h): CU_LAUNCH_PARAM_END/BUFFER_POINTER/BUFFER_SIZE
_PARAM_END, _PARAM_BUFFER_POINTER, _PARAM_BUFFER_SIZE = 0, 1, 2

# Parameter buffers over 4 KiB need a driver of CUDA 12.1 or later.
_LARGE_PARAMS_DRIVER = 12010
_SMALL_PARAMS_MAX = 4096 - pack.CARRY_PREFIX


class _Carry:
    """A carried launch's parameter buffer and the ``extra`` array naming it."""

    __slots__ = ("args", "size", "extra", "extra_addr", "addr", "bytes_addr")

    def __init__(self):
        self.args = _CarryArgs()
        self.size = ctypes.c_size_t(0)
        self.addr = ctypes.addressof(self.args)
        self.bytes_addr = self.addr + _CarryArgs.bytes.offset
        extra = (ctypes.c_void_p * 5)(
            _PARAM_BUFFER_POINTER,
            self.addr,
            _PARAM_BUFFER_SIZE,
            ctypes.addressof(self.size),
            _PARAM_END,
        )
        self.extra = extra
        self.extra_addr = ctypes.addressof(extra)


class _Params:
    """One kernel's argument block and the ``void*[]`` that ``cuLaunchKernel`` reads."""

    __slots__ = ("args", "ptrs", "addr")

    def __init__(self, struct):
        self.args = struct()
        base = ctypes.addressof(self.args)
        offsets = [getattr(struct, name).offset for name, _ in struct._fields_]
        self.ptrs = (ctypes.c_void_p * len(offsets))(*[base + off for off in offsets])
        self.addr = ctypes.addressof(self.ptrs)


class _Scratch(threading.local):
    # Per thread: cuLaunchKernel reads the block during the call, with the GIL
    # released, so a block shared between threads could be overwritten mid-launch.
    def __init__(self, device: int):
        self.scatter = _Params(_ScatterArgs)
        self.fill = _Params(_FillArgs)
        self.carry = _Carry()
        # cuLaunchKernel is a driver call: it needs a context bound to this
        # thread, which cudaGetDevice alone does not bind (a fresh thread reads
        # device 0 with no context). cudaSetDevice binds the primary context.
        if _getDevice() == device and _drv.ctxGetCurrent() == 0:
            _rt.setDevice(device)


# -- kernels -----------------------------------------------------------------------


class _Kernels:
    __slots__ = ("scatter", "fill", "carried", "caps", "feed", "whole", "_keep")

    def __init__(self, scatter: int, fill: int, carried: dict, keep, feed: int = 0, whole: int = 0):
        self.scatter = scatter
        self.fill = fill
        self.carried = carried  # capacity -> CUfunction of cucopy_scatter_c*
        self.caps = tuple(sorted(carried))
        self.feed = feed  # cucopy_scatter_feed (0: it did not build)
        self.whole = whole  # cucopy_scatter_w8k, graphed launches' kernel (0: did not build)
        self._keep = keep  # the RawKernels own the CUmodule the handles point into


def _build(source: str, names, what: str, device: int) -> list:
    """Compile ``source`` with NVRTC and return its ``RawKernel`` objects in order.

    Must run with ``device`` current. The error keeps NVRTC's log. CuPy keeps the
    compiled module in its disk cache (``CUPY_CACHE_DIR``), keyed by the source, the
    options and the architecture: only a cold cache compiles. Every build uses the same
    options (a kernel selection is written into the source): CuPy compiles an empty
    program once per set of options and process to key its cache.
    """
    cupy = _load()
    try:
        module = cupy.RawModule(code=source, options=("-std=c++17",))
        kernels = [module.get_function(n) for n in names]
        for k in kernels:
            _ = k.kernel  # compile and load the module now, for this device
            _force_load(k)
    except _CompileError as e:
        raise CopyError(f"cuda:{device}: compiling {what} failed:\n{e}") from e
    except Exception as e:  # NVRTC missing, module load failure
        raise CopyError(f"cuda:{device}: building {what} failed: {e}") from e
    return kernels


def _force_load(kernel) -> None:
    """Load ``kernel``'s code now rather than at its first launch.

    Under CUDA's lazy loading (the default since 12.2) a function is loaded at its
    first launch or attribute query, and that load may wait for the whole device: a
    first launch behind a kernel that spins until the host acts (a stream hold, a
    custom all-reduce) would then never return. Querying an attribute loads it here,
    at build time; ``cuFuncLoad`` (CUDA 12.4) says so explicitly where it exists. The
    driver entry is called straight from the library CuPy already loaded: importing
    cuda-python's driver module for one call would make it resolve every entry point,
    and the ones this driver lacks show up as API errors under compute-sanitizer.
    """
    try:
        _ = kernel.max_threads_per_block  # cuFuncGetAttribute: loads the function
    except Exception:
        pass  # best effort: the first launch loads it as before
    load = _driver_entry("cuFuncLoad")
    if load is not None:
        load(ctypes.c_void_p(kernel.kernel.ptr))  # CUresult ignored: best effort too


@functools.cache
def _driver_entry(name: str):
    """Return the CUDA driver's C function ``name`` (returning a ``CUresult``), or None."""
    for lib in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            fn = getattr(ctypes.CDLL(lib), name)
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        return fn
    return None


def cudacall_module():
    """The compiled per-step driver calls' module (``_cudacall``), or None.

    None when the extension was not built or ``CUCOPY_PURE_PYTHON`` is set (the
    CuPy/ctypes paths are then the ones used; they stay the reference).
    ``cucopy.show_config()`` reports the same answer.
    """
    if os.environ.get("CUCOPY_PURE_PYTHON"):
        return None
    try:
        from . import _cudacall
    except ImportError:
        return None
    return _cudacall


def _current_context() -> int:
    """The calling thread's current CUDA context (its handle), 0 when none."""
    try:
        return int(_drv.ctxGetCurrent())
    except Exception:  # an old CuPy without it: the compiled calls stay unbound
        return 0


def _compiled_driver():
    """The compiled per-step driver calls (``_cudacall.Driver``), or None.

    None when :func:`cudacall_module` is, or when the driver library lacks an entry
    point. Its event calls (``cuEventRecord`` and ``cuEventQuery``, which the staging
    core makes through the launcher) are set when the driver has both, and so is its
    eager copy (``cuMemcpyHtoDAsync_v2`` and ``cuMemcpy2DAsync_v2``); without them
    they answer -1 and the staging core records and queries through the backend.
    (A runtime event handle, as :meth:`CudaBackend.event_create` returns, is the
    driver's ``CUevent``.)
    """
    _cudacall = cudacall_module()
    if _cudacall is None:
        return None
    launch = _driver_entry("cuLaunchKernel")
    capturing = _driver_entry("cuStreamIsCapturing")
    if launch is None or capturing is None:
        return None
    addr = ctypes.c_void_p
    fast = _cudacall.Driver(ctypes.cast(launch, addr).value, ctypes.cast(capturing, addr).value)
    record = _driver_entry("cuEventRecord")
    query = _driver_entry("cuEventQuery")
    if record is not None and query is not None:
        fast.events(ctypes.cast(record, addr).value, ctypes.cast(query, addr).value)
    # the eager path's one driver copy (the launcher's copy(): _core/copy.c)
    htod = _driver_entry("cuMemcpyHtoDAsync_v2")
    copy2d = _driver_entry("cuMemcpy2DAsync_v2")
    if htod is not None and copy2d is not None:
        fast.copies(ctypes.cast(htod, addr).value, ctypes.cast(copy2d, addr).value)
    return fast


def _build_entry(name: str, device: int):
    """Build one entry point of ``scatter.cu`` as a module of its own; returns its ``RawKernel``.

    Runs on a worker thread of :func:`_kernels`: binds ``device``'s primary context
    first (a fresh thread has none, and CuPy loads the module into the current one).
    """
    from .. import kernels as kernel_sources

    try:
        _rt.setDevice(device)
    except _RuntimeError as e:
        raise CopyError(f"cuda:{device}: building {name} failed: cudaSetDevice: {e}") from e
    what = f"cucopy/kernels/scatter.cu ({name})"
    (k,) = _build(kernel_sources.source((name,)), (name,), what, device)
    return k


def _workers(jobs: int) -> int:
    """Threads that build ``jobs`` kernels: one per CPU this process may use, at most.

    ``CUCOPY_BUILD_THREADS=n`` caps it (``1`` builds one kernel after another, as
    ``bench/cold_start.py`` does to show what the threads save).
    """
    try:
        cpus = len(os.sched_getaffinity(0))  # what this process may run on
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    cap = os.environ.get("CUCOPY_BUILD_THREADS", "")
    if cap.strip():
        try:
            cpus = min(cpus, int(cap))
        except ValueError:
            raise ValueError(f"CUCOPY_BUILD_THREADS: expected an int, got {cap!r}") from None
    return max(1, min(jobs, cpus))


@functools.cache
def _kernels(device: int) -> _Kernels:
    """Build and load every kernel a copier may launch on ``device``; called when one is made.

    Built here, not at a first launch: loading a kernel may wait for the whole device
    (CUDA's lazy loading), which never comes behind a kernel that spins until the host
    acts (see :func:`_force_load`). Each entry point is compiled as a module of its own
    (``kernels.source([name])``), on up to one thread per CPU: NVRTC releases the GIL and
    compiles in parallel, so a cold kernel cache waits for the slowest entry point
    rather than all nineteen in a row (to an sm_90 cubin on a CI-class CPU: the whole
    file 3.4 s, one entry point 0.08-0.24 s). With CuPy's disk cache warm, this only
    loads the modules.
    """
    from .. import kernels as kernel_sources

    try:
        large = _rt.driverGetVersion() >= _LARGE_PARAMS_DRIVER
    except _RuntimeError:
        large = False
    # an NVRTC older than 12.1 compiles only the small carried kernels (#if in scatter.cu)
    caps = [
        (cap, name)
        for cap, name in zip(pack.CARRY_CAPACITIES, pack.CARRY_ENTRY_POINTS)
        if large or cap <= _SMALL_PARAMS_MAX
    ]
    names = [
        "cucopy_scatter",
        "cucopy_fill",
        *(name for _, name in caps),
        pack.FEED_ENTRY_POINT,
        pack.GRAPH_ENTRY_POINT,
    ]
    assert set(names) <= set(kernel_sources.ENTRY_POINTS), "internal: unknown entry point"
    built: dict = {}
    failed: dict = {}
    with ThreadPoolExecutor(_workers(len(names)), thread_name_prefix="cucopy-build") as pool:
        futures = {name: pool.submit(_build_entry, name, device) for name in names}
        for name, future in futures.items():
            try:
                built[name] = future.result()
            except CopyError as e:
                failed[name] = e
            except Exception as e:  # anything else a worker raised, with its cause kept
                failed[name] = CopyError(f"cuda:{device}: building {name} failed: {e}")
                failed[name].__cause__ = e
    small = {name for cap, name in caps if cap <= _SMALL_PARAMS_MAX}
    for name in names:
        if name in failed and (name in small or name in ("cucopy_scatter", "cucopy_fill")):
            raise failed[name]
    if any(name in failed for _, name in caps):
        # a large carried kernel did not build: offer the small ones only, as before
        caps = [(cap, name) for cap, name in caps if cap <= _SMALL_PARAMS_MAX]
    carried = {cap: built[name].kernel.ptr for cap, name in caps}
    keep = tuple(built[name] for name in names if name in built)
    feed = built[pack.FEED_ENTRY_POINT].kernel.ptr if pack.FEED_ENTRY_POINT in built else 0
    whole = built[pack.GRAPH_ENTRY_POINT].kernel.ptr if pack.GRAPH_ENTRY_POINT in built else 0
    return _Kernels(
        built["cucopy_scatter"].kernel.ptr,
        built["cucopy_fill"].kernel.ptr,
        carried,
        keep,
        feed,
        whole,
    )


#: the driver's graph calls a graphed launch needs (Driver.graphs(), in this order)
_GRAPH_ENTRIES = (
    "cuGraphCreate",
    "cuGraphAddKernelNode_v2",
    "cuGraphInstantiateWithFlags",
    "cuGraphLaunch",
    "cuGraphDestroy",
    "cuGraphExecDestroy",
    "cuGraphExecKernelNodeSetParams_v2",
)


def _graph_entries() -> tuple | None:
    """Addresses of :data:`_GRAPH_ENTRIES`, or None when the driver lacks one."""
    found = [_driver_entry(name) for name in _GRAPH_ENTRIES]
    if any(f is None for f in found):
        return None
    return tuple(ctypes.cast(f, ctypes.c_void_p).value for f in found)


# Graph feeds handed out per device (each index is the feed kernel module's replay
# counter for one captured node; never reused while the module lives).
_feed_ids: dict = {}
_feed_lock = threading.Lock()


def _next_feed(device: int) -> int:
    with _feed_lock:
        counter = _feed_ids.setdefault(device, itertools.count())
        index = next(counter)
    if index >= pack.FEED_MAX:
        raise CopyError(
            f"cuda:{device}: graph feeds: all {pack.FEED_MAX} replay counters of this "
            "process are taken (one per capture_inputs())"
        )
    return index


class _RelaxedCapture:
    """Let this thread make calls a global-mode capture forbids (``cudaHostAlloc``),
    as torch's allocator does while a graph captures."""

    def __enter__(self):
        self.mode = ctypes.c_int(_CAPTURE_MODE_RELAXED)
        fn = _driver_entry("cuThreadExchangeStreamCaptureMode")
        self.fn = fn if fn is not None and fn(ctypes.byref(self.mode)) == 0 else None
        return self

    def __exit__(self, *exc):
        if self.fn is not None:
            self.fn(ctypes.byref(self.mode))


@functools.cache
def _hold_kernel(device: int):
    (k,) = _build(_HOLD_SOURCE, ("cucopy_hold",), "the hold kernel", device)
    return k


def _free_pinned(ptr: int) -> None:
    try:
        _rt.freeHost(ptr)
    except Exception:  # the context is gone (interpreter exit, device reset)
        pass


def _free_device(ptr: int, device: int) -> None:
    try:
        prev = _getDevice()
        if prev != device:
            _rt.setDevice(device)
        try:
            _rt.free(ptr)
        finally:
            if prev != device:
                _rt.setDevice(prev)
    except Exception:
        pass


class _CudaDeviceBuffer(DeviceBuffer):
    # No __slots__: weakref.finalize needs a weak reference to the buffer.
    pass


# -- the backend -------------------------------------------------------------------


class CudaBackend(Backend):
    """The backend protocol on one CUDA device, through CuPy.

    Parameters
    ----------
    device : int, optional
        CUDA ordinal; ``None`` takes the current device.

    Raises
    ------
    ImportError
        If CuPy is not installed.
    ValueError
        If ``device`` is not a visible CUDA ordinal.
    CopyError
        If the CUDA driver cannot be used at all.

    Notes
    -----
    Every CUDA failure surfaces as :class:`~cucopy.errors.CopyError` naming
    the call and CUDA's error name and string, with the CUDA status code in
    its ``status`` attribute. A failure inside a kernel is reported by the
    next call that notices it, not by the launch that caused it.
    """

    name = "cuda"
    #: the compiled driver calls once bound (set per backend by _get_kernels)
    _bound = None

    def __init__(self, device: int | None = None):
        _load()
        try:
            count = _rt.getDeviceCount()
            if device is None:
                device = _getDevice()
        except _RuntimeError as e:
            raise CopyError(f"cuda: no usable CUDA device: {e}") from e
        if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < count:
            raise ValueError(f"device: expected a CUDA ordinal in [0, {count}), got {device!r}")
        self.device = device
        self._scratch = _Scratch(device)
        self._threshold = None
        self._kern = None
        # cuLaunchKernel / cuStreamIsCapturing (and, for the staging core, cuEventRecord /
        # cuEventQuery) straight from C (None: CuPy's wrappers)
        self._fast = _compiled_driver()
        # the same, once it checks the current context itself (_get_kernels)
        self._bound = None
        self._hold_lock = threading.Lock()
        self._hold_page = None
        self._hold_free = []
        self._hold_busy = []  # (slot, event) of holds whose kernel may still run

    # -- plumbing ------------------------------------------------------------------

    def _on_device(self, fn, *args):
        """Call ``fn(*args)`` with this backend's device current, then restore the caller's."""
        prev = _getDevice()
        try:
            _rt.setDevice(self.device)
        except _RuntimeError as e:
            raise self._error("cudaSetDevice", e) from e
        try:
            return fn(*args)
        finally:
            _rt.setDevice(prev)

    def _error(self, call: str, err, detail: str = "") -> CopyError:
        e = CopyError(f"{self.describe()}: {call} failed: {err}{detail}")
        e.status = getattr(err, "status", None)
        return e

    def _get_kernels(self) -> _Kernels:
        k = self._kern
        if k is None:
            k = self._on_device(_kernels, self.device)
            fast = self._fast
            if fast is not None:
                fast.kernels(k.scatter, sorted(k.carried.items()), pack.THREADS)
                graphs = _graph_entries() if k.whole else None
                if graphs is not None and not os.environ.get("CUCOPY_NO_GRAPHS"):
                    # graphed launches: graphs() makes its pool of one-node graphs of the
                    # whole-segment kernel now, with the device's context current (none
                    # is made later: making a graph mid-run may wait for the device to
                    # drain, bench/probes/graph_hold.py)
                    try:
                        self._on_device(fast.graphs, *graphs, k.whole, pack.GRAPH_CAPACITY)
                    except RuntimeError as e:
                        if getattr(e, "status", None) is None:
                            raise
                        # the driver made no graph: no graphed launches (graph_cap 0)
                get = _driver_entry("cuCtxGetCurrent")
                ctx = self._on_device(_current_context)
                if get is not None and ctx:
                    # from now on the compiled calls check the current context
                    # themselves: no asking CuPy which device is current first
                    fast.bind(ctypes.cast(get, ctypes.c_void_p).value, ctx)
                    self._bound = fast
            self._kern = k
        return k

    def graph_capacity(self) -> int:
        """Bytes a graphed scatter reads at its segment: ``pack.GRAPH_CAPACITY`` once the
        kernels are loaded with the compiled driver calls and the driver's graph calls;
        else 0 (``CUCOPY_NO_GRAPHS=1`` in the environment when they load says 0 too)."""
        self._kern or self._get_kernels()
        fast = self._bound
        return 0 if fast is None else fast.graph_cap

    def scatter_graphed(self, segment_ptr: int, nblocks: int, stream, cell: int = 0) -> bool:
        """Launch a one-node graph of the compiled driver's pool (made when the kernels
        load) pointed at ``segment_ptr`` and ``cell``, re-pointing one there when none is:
        with ``cell``, its kernel writes the completion tag there when done.

        Where no graph launches (another device current, every graph of the pool last
        launched on another stream, no graphs), the segment is launched as an uncarried
        mapped scatter instead, which reads the same bytes when it runs and writes no
        tag (False returned).

        Raises
        ------
        CopyError
            If the driver refused to re-point or launch the graph.
        """
        fast = self._bound
        if fast is None:
            rc = -1
        elif cell:
            rc = fast.graphed(stream, segment_ptr, cell)
        else:
            rc = fast.graphed(stream, segment_ptr)
        if rc == 0:
            return bool(cell)
        if rc > 0:
            e = CopyError(
                f"{self.describe()}: cuGraphLaunch or cuGraphExecKernelNodeSetParams (a "
                f"graphed scatter, segment="
                f"{segment_ptr:#x}) failed: CUresult {rc}"
            )
            e.status = rc
            raise e
        self.scatter(segment_ptr, nblocks, stream, True)
        return False

    def carried_launcher(self):
        """The compiled carried launch (a capsule), once the kernels are loaded; else None."""
        fast = self._bound
        return None if fast is None else fast.launcher()

    def capture_query(self, stream) -> tuple:
        """The compiled capture query on ``stream`` (a raw handle) once the kernels are
        loaded: its status (0: not capturing; negative: another device current or a
        failure, which :meth:`is_capturing` then reports); else :meth:`is_capturing`."""
        fast = self._bound
        if fast is not None and isinstance(stream, int):
            return fast.is_capturing, stream
        return self.is_capturing, stream

    # -- streams and capture -------------------------------------------------------

    def resolve_stream(self, stream):
        """Return the raw ``cudaStream_t`` for ``stream`` (``None``: :meth:`current_stream`).

        Parameters
        ----------
        stream : None, int, cupy.cuda.Stream, torch.cuda.Stream or object
            Objects with ``__cuda_stream__``, ``cuda_stream`` or ``ptr`` work too.
            The object is not kept alive: the caller holds it while the handle is used.

        Returns
        -------
        int

        Raises
        ------
        TypeError
            If ``stream`` is none of those.
        ValueError
            If a stream object says it belongs to another device.
        """
        if stream is None:
            return self.current_stream()
        handle = stream_handle(stream)
        if not isinstance(stream, int):
            dev = getattr(stream, "device_id", None)  # CuPy (-1: whichever is current)
            if not isinstance(dev, int):
                dev = getattr(stream, "device_index", None)  # torch
            if isinstance(dev, int) and dev >= 0 and dev != self.device:
                raise ValueError(f"stream: {stream!r} belongs to cuda:{dev}, not {self.describe()}")
        return handle

    def current_stream(self):
        """CuPy's current stream on this device, as a raw handle."""
        return _cupy.cuda.get_current_stream(self.device).ptr

    def is_capturing(self, stream) -> bool:
        """Whether ``stream`` is capturing a graph (an invalidated capture counts).

        Raises
        ------
        CopyError
            If the query itself is illegal, e.g. the legacy default stream while
            another stream captures in global mode.
        """
        bound = self._bound
        if bound is not None:
            status = bound.is_capturing(stream)  # < 0: another device current, or failed
            if status >= 0:
                return status != 0
        if _getDevice() != self.device:
            return self._on_device(self.is_capturing, stream)
        # the compiled call once: a bound one that answered < 0 would again (CuPy reports)
        fast = self._fast if bound is None else None
        if fast is not None:
            status = fast.is_capturing(stream)  # < 0: failed; CuPy's call reports it
            if status >= 0:
                return status != 0
        try:
            return bool(_rt.streamIsCapturing(stream))
        except _RuntimeError as e:
            raise self._error("cudaStreamIsCapturing", e, f" (stream={stream:#x})") from e
        except RuntimeError:  # CuPy's "capture sequence invalidated": still capturing
            return True

    def synchronize(self, stream) -> None:
        """Block the host until ``stream`` has run everything queued on it."""
        if _getDevice() != self.device:
            return self._on_device(self.synchronize, stream)
        try:
            _rt.streamSynchronize(stream)
        except _RuntimeError as e:
            raise self._error("cudaStreamSynchronize", e, f" (stream={stream:#x})") from e

    # -- memory --------------------------------------------------------------------

    def alloc_pinned(self, nbytes: int) -> PinnedBuffer:
        """Allocate portable, mapped page-locked memory (``cudaHostAlloc``).

        The memory is freed by ``close()``, or once the buffer's NumPy array and
        every view of it are gone. ``cudaFreeHost`` synchronizes the device:
        free at teardown, not per step.
        """
        if _getDevice() != self.device:
            return self._on_device(self.alloc_pinned, nbytes)
        size = max(1, int(nbytes))
        try:
            ptr = _rt.hostAlloc(size, _HOST_ALLOC_PORTABLE | _HOST_ALLOC_MAPPED)
        except _RuntimeError as e:
            raise self._error("cudaHostAlloc", e, f" ({nbytes} bytes)") from e
        try:
            # With unified addressing this is ``ptr`` itself; ask rather than assume.
            dptr = _rt.pointerGetAttributes(ptr).devicePointer
        except _RuntimeError as e:
            _rt.freeHost(ptr)
            raise self._error("cudaPointerGetAttributes", e, f" (ptr={ptr:#x})") from e
        raw = (ctypes.c_ubyte * size).from_address(ptr)
        array = np.frombuffer(raw, dtype=np.uint8, count=int(nbytes))
        # Every NumPy view leads back to ``raw``: free when the last one dies,
        # or at close(); finalize runs once either way.
        free = weakref.finalize(raw, _free_pinned, ptr)
        free.atexit = False  # the process exit frees it; CUDA may be torn down first
        return PinnedBuffer(array, ptr, dptr, free)

    def alloc_device(self, nbytes: int) -> DeviceBuffer:
        """Allocate device memory with ``cudaMalloc``.

        Staging buffers live as long as the copier, so raw ``cudaMalloc`` is used
        rather than CuPy's pool (whose blocks the pool, not us, would own and
        which a user may have limited or swapped for its own). ``cudaFree``
        synchronizes the device: free at teardown.
        """
        if _getDevice() != self.device:
            return self._on_device(self.alloc_device, nbytes)
        size = max(1, int(nbytes))
        try:
            ptr = _rt.malloc(size)
        except _RuntimeError as e:
            raise self._error("cudaMalloc", e, f" ({nbytes} bytes)") from e
        buf = _CudaDeviceBuffer(ptr, int(nbytes), None)
        free = weakref.finalize(buf, _free_device, ptr, self.device)
        free.atexit = False
        buf._free = free
        return buf

    def is_pinned(self, host_ptr: int) -> bool:
        """Whether ``host_ptr`` is page-locked (``cudaHostAlloc`` or registered)."""
        try:
            return _rt.pointerGetAttributes(host_ptr).type == _MEMORY_TYPE_HOST
        except _RuntimeError:  # not an address CUDA knows: pageable
            return False

    def read(self, ptr: int, nbytes: int, stream) -> bytes:
        """Synchronize ``stream`` and copy ``nbytes`` device bytes to the host.

        The copy goes on ``stream`` itself, not the legacy default stream, so a
        stalled unrelated stream cannot block it.
        """
        if _getDevice() != self.device:
            return self._on_device(self.read, ptr, nbytes, stream)
        out = np.empty(int(nbytes), dtype=np.uint8)
        call = "cudaStreamSynchronize"
        try:
            _rt.streamSynchronize(stream)
            if nbytes:
                call = "cudaMemcpyAsync"
                _rt.memcpyAsync(out.ctypes.data, ptr, nbytes, _D2H, stream)
                call = "cudaStreamSynchronize"
                _rt.streamSynchronize(stream)
        except _RuntimeError as e:
            raise self._error(call, e, f" (reading {nbytes} bytes at {ptr:#x})") from e
        return out.tobytes()

    # -- work ----------------------------------------------------------------------

    def copy2d(
        self, h2d: bool, dst: int, dpitch: int, src: int, spitch: int, width: int, rows: int, stream
    ) -> None:
        """Enqueue ``cudaMemcpyAsync`` (one row) or ``cudaMemcpy2DAsync``.

        An H2D copy goes through the compiled driver once it is bound (one
        ``cuMemcpyHtoDAsync`` or ``cuMemcpy2DAsync`` from C, the GIL kept); with
        another device current, a pitch past the 2-D limit or a failed call, the copy
        is made (and its failure reported) through CuPy below.
        """
        if width <= 0 or rows <= 0:
            return
        fast = self._bound
        if fast is not None and h2d and type(stream) is int:
            if not fast.copy(dst, dpitch, src, spitch, width, rows, stream):
                return
        if _getDevice() != self.device:
            return self._on_device(self.copy2d, h2d, dst, dpitch, src, spitch, width, rows, stream)
        kind = _H2D if h2d else _D2D
        try:
            if rows == 1:
                _rt.memcpyAsync(dst, src, width, kind, stream)
            elif max(dpitch, spitch) > _MAX_2D_PITCH:
                # cudaMemcpy2DAsync takes pitches up to the device's maximum pitch
                # (cudaDevAttrMaxPitch, 2**31 - 1): rows that far apart are few, one copy each
                for r in range(rows):
                    _rt.memcpyAsync(dst + r * dpitch, src + r * spitch, width, kind, stream)
            else:
                _rt.memcpy2DAsync(dst, dpitch, src, spitch, width, rows, kind, stream)
        except _RuntimeError as e:
            call = "cudaMemcpyAsync" if rows == 1 else "cudaMemcpy2DAsync"
            raise self._error(
                call,
                e,
                f" ({'H2D' if h2d else 'D2D'} dst={dst:#x} "
                f"dpitch={dpitch} src={src:#x} spitch={spitch} "
                f"width={width} rows={rows})",
            ) from e

    def fill(
        self, dst: int, dpitch: int, width: int, rows: int, value: int, elem: int, stream
    ) -> None:
        """Enqueue ``cucopy_fill``: the ``elem``-byte pattern ``value`` over a 2-D region.

        A region wider or taller than the kernel's 32-bit ``width`` and ``rows`` is
        filled by several launches.

        Raises
        ------
        ValueError
            If ``elem`` is not 1, 2, 4 or 8, or ``width`` is not a multiple of it.
        """
        if elem not in (1, 2, 4, 8) or width % elem:
            raise ValueError(
                f"fill: elem must be 1, 2, 4 or 8 and divide width, got elem={elem}, width={width}"
            )
        if width <= 0 or rows <= 0:
            return
        if width > _FILL_MAX_FIELD or rows > _FILL_MAX_FIELD:
            # the kernel's width and rows are 32-bit: a wider fill is several launches
            # (a ctypes field would silently keep width mod 2**32)
            for r0, nr, c0, w in _fill_pieces(width, rows):
                self.fill(dst + r0 * dpitch + c0, dpitch, w, nr, value, elem, stream)
            return
        if _getDevice() != self.device:
            return self._on_device(self.fill, dst, dpitch, width, rows, value, elem, stream)
        fn = (self._kern or self._get_kernels()).fill
        blocks = min(
            _FILL_MAX_BLOCKS, rows * ((width + _FILL_BYTES_PER_BLOCK - 1) // _FILL_BYTES_PER_BLOCK)
        )
        p = self._scratch.fill
        a = p.args
        a.dst = dst
        a.dpitch = dpitch
        a.width = width
        a.rows = rows
        a.value = value & 0xFFFFFFFFFFFFFFFF
        a.elem = elem
        try:
            _launch(fn, blocks, 1, 1, pack.THREADS, 1, 1, 0, stream, p.addr, 0)
        except _DriverError as e:
            raise self._error(
                "cuLaunchKernel(cucopy_fill)",
                e,
                f" (dst={dst:#x} width={width} rows={rows} grid={blocks})",
            ) from e

    def scatter(
        self,
        segment_ptr: int,
        nblocks: int,
        stream,
        mapped: bool,
        carry: int = 0,
        host_ptr: int = 0,
    ) -> None:
        """Enqueue one scatter launch of ``nblocks`` blocks.

        ``mapped`` needs nothing different here: ``segment_ptr`` is already the
        device address of the mapped pinned segment. With ``carry`` > 0 the
        launch is ``cucopy_scatter_c*`` of the smallest capacity that holds
        ``carry`` bytes, copied from ``host_ptr`` into its parameter buffer
        here (the driver snapshots that buffer when the launch is enqueued);
        otherwise ``cucopy_scatter``, which reads the whole segment at
        ``segment_ptr`` when it runs.

        Raises
        ------
        ValueError
            If ``carry`` exceeds every capacity on offer (:meth:`carry_capacities`),
            or ``nblocks`` the grid's limit (2**31 - 1).
        """
        fast = self._bound
        if fast is not None:
            # one C call, which checks the current context itself; on any failure
            # (another device current, a bad argument: a grid of no blocks or too
            # many) the path below checks the arguments, runs the launch again on
            # the right device and reports it
            if carry:
                if not fast.carried(nblocks, stream, segment_ptr, host_ptr, carry):
                    return
            elif not fast.scatter(nblocks, stream, segment_ptr):
                return
        if nblocks <= 0:
            return
        if nblocks > _MAX_GRID:
            raise ValueError(f"scatter: {nblocks} blocks exceed the grid's {_MAX_GRID}")
        if _getDevice() != self.device:
            return self._on_device(
                self.scatter, segment_ptr, nblocks, stream, mapped, carry, host_ptr
            )
        k = self._kern or self._get_kernels()
        if carry:
            cap = pack.carry_capacity(carry, k.caps)
            if not cap:
                raise ValueError(
                    f"scatter: carry={carry} bytes exceed the largest parameter buffer "
                    f"({k.caps[-1] if k.caps else 0} bytes) on {self.describe()}"
                )
            c = self._scratch.carry
            c.args.seg = segment_ptr
            c.args.nbytes = carry
            ctypes.memmove(c.bytes_addr, host_ptr, carry)
            c.size.value = pack.CARRY_PREFIX + cap
            fn, params, extra = k.carried[cap], 0, c.extra_addr
        else:
            p = self._scratch.scatter
            p.args.seg = segment_ptr
            fn, params, extra = k.scatter, p.addr, 0
        try:
            _launch(fn, nblocks, 1, 1, pack.THREADS, 1, 1, 0, stream, params, extra)
        except _DriverError as e:
            raise self._error(
                "cuLaunchKernel(cucopy_scatter" + (f"_c, {carry} bytes carried)" if carry else ")"),
                e,
                f" (segment={segment_ptr:#x} grid={nblocks} {'mapped' if mapped else 'dma'})",
            ) from e

    # -- graph feeds ------------------------------------------------------------------

    def alloc_feed(self, nbytes: int) -> PinnedBuffer:
        """:meth:`alloc_pinned`, legal while this thread's stream captures in global mode."""
        with _RelaxedCapture():
            return self.alloc_pinned(nbytes)

    def feed_capture(self, box_ptr, entries, blocks, status_ptr, stream) -> int:
        """Launch ``cucopy_scatter_feed`` on the capturing ``stream`` (it becomes a node).

        Raises
        ------
        CopyError
            If the feed kernel did not build, or the launch fails.
        """
        if _getDevice() != self.device:
            return self._on_device(self.feed_capture, box_ptr, entries, blocks, status_ptr, stream)
        k = self._kern or self._get_kernels()
        if not k.feed:
            raise CopyError(f"{self.describe()}: the graph feed kernel did not build")
        if not 0 < blocks <= 65535:
            raise ValueError(f"feed_capture: blocks must be in [1, 65535], got {blocks}")
        index = _next_feed(self.device)
        p = _Params(_FeedArgs)
        p.args.box = box_ptr
        p.args.entries = entries
        p.args.feed = index
        p.args.status = status_ptr
        try:
            _launch(k.feed, blocks, 1, 1, pack.THREADS, 1, 1, 0, stream, p.addr, 0)
        except _DriverError as e:
            raise self._error(
                "cuLaunchKernel(cucopy_scatter_feed)", e, f" (stream={stream:#x} grid={blocks})"
            ) from e
        return index

    def graph_launch(self, graph, stream) -> None:
        """Enqueue one replay of ``graph`` on ``stream``.

        ``graph``: a raw ``cudaGraphExec_t`` (int), a CuPy graph (``launch``), a torch
        ``CUDAGraph`` (``replay()``, which launches on torch's current stream: make
        the copier's stream current), or a callable that launches it.
        """
        if isinstance(graph, int):
            try:
                _rt.graphLaunch(graph, stream)
            except _RuntimeError as e:
                raise self._error("cudaGraphLaunch", e, f" (exec={graph:#x})") from e
            return
        mod = type(graph).__module__.split(".")[0]
        if mod == "torch" and hasattr(graph, "replay"):
            torch = sys.modules["torch"]
            current = torch.cuda.current_stream(self.device).cuda_stream
            if current != stream:
                raise ValueError(
                    f"graph: torch replays on its current stream {current:#x}, not the "
                    f"copier's {stream:#x}: replay inside torch.cuda.stream(<the copier's stream>)"
                )
            graph.replay()
        elif mod == "cupy" and hasattr(graph, "launch"):
            graph.launch(cupy_stream(_cupy, stream, self.device))
        elif callable(graph):
            graph()
        else:
            raise TypeError(
                "graph: expected a cudaGraphExec_t, a CuPy graph, a torch CUDAGraph or a "
                f"callable, got {type(graph).__qualname__}"
            )

    def carry_capacities(self) -> tuple:
        """Byte counts a scatter launch can carry, ascending (needs the kernels built).

        ``pack.CARRY_CAPACITIES``, less those over 4 KiB on a driver older than
        CUDA 12.1.
        """
        return (self._kern or self._get_kernels()).caps

    # -- events --------------------------------------------------------------------

    def event_create(self):
        """Create an event with timing disabled; returns its raw handle."""
        if _getDevice() != self.device:
            return self._on_device(self.event_create)
        try:
            return _rt.eventCreateWithFlags(_EVENT_DISABLE_TIMING)
        except _RuntimeError as e:
            raise self._error("cudaEventCreateWithFlags", e) from e

    def event_record(self, event, stream) -> None:
        """Record ``event`` on ``stream``.

        Through the compiled driver once it is bound (``cuEventRecord`` from C, the GIL
        kept); with another device current or a failed call, through CuPy below, which
        records it or reports the failure.
        """
        fast = self._bound
        if fast is not None and type(event) is int and type(stream) is int:
            if not fast.event_record(event, stream):
                return
        if _getDevice() != self.device:
            return self._on_device(self.event_record, event, stream)
        try:
            _rt.eventRecord(event, stream)
        except _RuntimeError as e:
            raise self._error(
                "cudaEventRecord", e, f" (event={event:#x} stream={stream:#x})"
            ) from e

    def event_query(self, event) -> bool:
        """True when the event has completed (or was never recorded); never blocks."""
        status = _rt.eventQuery(event)
        if status == _SUCCESS:
            return True
        if status == _ERROR_NOT_READY:
            return False
        raise self._error("cudaEventQuery", _RuntimeError(status), f" (event={event:#x})")

    def event_synchronize(self, event) -> None:
        """Block the host until the event has completed."""
        try:
            _rt.eventSynchronize(event)
        except _RuntimeError as e:
            raise self._error("cudaEventSynchronize", e, f" (event={event:#x})") from e

    def probe_stream(self):
        """A non-blocking stream of the backend's own for the coherence probe (kept for
        the process: destroying it could wait), so the probe runs beside a held one."""
        st = _probe_streams.get(self.device)
        if st is None:
            st = _probe_streams[self.device] = self._on_device(
                lambda: _cupy.cuda.Stream(non_blocking=True)
            )
        return st.ptr

    def event_wait(self, event, timeout: float) -> bool:
        """Wait for ``event`` at most ``timeout`` seconds; True when it completed.

        Polls ``cuEventQuery`` and sleeps between queries (20 µs doubling to 1 ms),
        in C with the GIL released while asleep once the compiled driver calls are
        bound; else the same loop in Python (:func:`cucopy.deadline.poll`). Never
        ``cudaEventSynchronize``, which has no bound.

        Raises
        ------
        CopyError
            When the query fails.
        """
        fast = self._bound
        if fast is not None and isinstance(event, int):
            ns = int(min(timeout, 1e9) * 1e9)
            rc = fast.event_wait(event, ns)
            if rc == 0:
                return True
            if rc == _ERROR_NOT_READY:
                return False
            # another context current, or no compiled query: the Python loop below
        return poll(self.event_query, event, timeout)

    def event_destroy(self, event) -> None:
        """Release an event (pending work still completes)."""
        try:
            _rt.eventDestroy(event)
        except _RuntimeError as e:
            raise self._error("cudaEventDestroy", e, f" (event={event:#x})") from e

    # -- tuning --------------------------------------------------------------------

    def mapped_threshold(self) -> int:
        """Largest segment flushed ``mapped`` under ``flush_mode="auto"``, in bytes.

        Read once from ``crossover.json`` (``{"sm_90": bytes}``) beside this file,
        keyed by the device's compute capability; :data:`DEFAULT_MAPPED_THRESHOLD`
        when the file or the key is missing.
        """
        t = self._threshold
        if t is None:
            t = self._threshold = self._load_threshold()
        return t

    def _load_threshold(self) -> int:
        arch = "sm_" + _cupy.cuda.Device(self.device).compute_capability
        try:
            table = json.loads(_CROSSOVER_PATH.read_text())
        except FileNotFoundError:
            return DEFAULT_MAPPED_THRESHOLD
        except (OSError, ValueError) as e:
            raise CopyError(
                f"{_CROSSOVER_PATH.name}: cannot read the mapped/dma crossover table: {e}"
            ) from e
        value = table.get(arch, DEFAULT_MAPPED_THRESHOLD) if isinstance(table, dict) else None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CopyError(
                f'{_CROSSOVER_PATH.name}: expected {{"{arch}": bytes}} with a '
                f"non-negative int, got {table!r}"
            )
        return value

    def describe(self) -> str:
        """``cuda:<ordinal>``."""
        return f"cuda:{self.device}"

    # -- test support --------------------------------------------------------------

    def hold(self, stream, timeout: float = _HOLD_TIMEOUT_S) -> _Hold:
        """Stall ``stream``, as a long kernel does, for the duration of a ``with`` block.

        Entering the block enqueues a one-thread kernel that spins on a flag in
        mapped pinned memory; leaving it (also by an exception) sets the flag.
        Mirrors ``SimStream.hold()``, so test bodies can stall a stream on both
        backends.

        Parameters
        ----------
        stream : int or stream object
            A handle from :meth:`resolve_stream`, or anything it takes.
        timeout : float
            Seconds after which the kernel gives up by itself, so a bug cannot
            wedge the GPU. Leaving the block after that raises :class:`CopyError`.

        Returns
        -------
        context manager
        """
        if not isinstance(stream, int):
            stream = self.resolve_stream(stream)
        return _Hold(self, stream, timeout)

    def _hold_acquire(self) -> int:
        with self._hold_lock:
            if self._hold_page is None:
                self._hold_page = self.alloc_pinned(_HOLD_SLOTS * _HOLD_SLOT_INTS * 4)
                self._hold_free = list(range(_HOLD_SLOTS - 1, -1, -1))
            busy = []
            for slot, event in self._hold_busy:
                if self.event_query(event):
                    self.event_destroy(event)
                    self._hold_free.append(slot)
                else:
                    busy.append((slot, event))
            self._hold_busy = busy
            if not self._hold_free:
                raise CopyError(f"{self.describe()}: hold: {_HOLD_SLOTS} holds still in flight")
            return self._hold_free.pop()

    def _hold_flags(self, slot: int) -> np.ndarray:
        flags = self._hold_page.array.view(np.int32)
        return flags[slot * _HOLD_SLOT_INTS : (slot + 1) * _HOLD_SLOT_INTS]


class _Hold:
    """The context manager returned by :meth:`CudaBackend.hold`."""

    __slots__ = ("_backend", "_stream", "_timeout", "_slot")

    def __init__(self, backend: CudaBackend, stream, timeout: float):
        self._backend = backend
        self._stream = stream
        self._timeout = float(timeout)
        self._slot = None

    @property
    def started(self) -> bool:
        """Whether the spinning kernel has begun running on the GPU."""
        return self._slot is not None and bool(self._backend._hold_flags(self._slot)[2])

    def __enter__(self) -> _Hold:
        if self._slot is not None:
            raise CopyError("hold: already entered")
        b = self._backend
        slot = b._hold_acquire()
        flags = b._hold_flags(slot)
        flags[:] = 0
        try:
            b._on_device(self._launch, slot)
        except BaseException:
            # release a kernel that may have been launched; the slot is not
            # reused, as nothing tells when that kernel has finished with it
            flags[0] = 1
            raise
        self._slot = slot
        return self

    def _launch(self, slot: int) -> None:
        b = self._backend
        kernel = _hold_kernel(b.device)
        p = _Params(_HoldArgs)
        page = b._hold_page
        p.args.flag = page.device_ptr + slot * _HOLD_SLOT_INTS * 4
        p.args.timeout_ns = int(self._timeout * 1e9)
        try:
            _launch(kernel.kernel.ptr, 1, 1, 1, 1, 1, 1, 0, self._stream, p.addr, 0)
        except _DriverError as e:
            raise b._error("cuLaunchKernel(cucopy_hold)", e, f" (stream={self._stream:#x})") from e
        event = b.event_create()
        b.event_record(event, self._stream)
        with b._hold_lock:
            b._hold_busy.append((slot, event))

    def release(self) -> None:
        """Let the stream run on; safe to call twice.

        Raises
        ------
        CopyError
            If the kernel had already given up (the stream ran on before release).
        """
        slot, self._slot = self._slot, None
        if slot is None:
            return
        flags = self._backend._hold_flags(slot)
        flags[0] = 1
        if flags[1]:
            raise CopyError(
                f"{self._backend.describe()}: hold on stream {self._stream:#x} "
                f"timed out after {self._timeout} s: the stream ran on before "
                f"the block ended"
            )

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.release()
        except CopyError:
            if exc_type is None:
                raise
