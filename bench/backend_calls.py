"""Host cost of each CUDA call on cucopy's hot path, by API.

Usage:
    python bench/backend_calls.py [--device N] [--iters N] [--batch N]
                                  [--only NAME [NAME ...]] [--json PATH]

For every hot call of the CUDA backend (getDevice, memcpyAsync,
memcpy2DAsync, kernel launch, eventRecord, eventQuery) it times each
candidate API: CuPy's Cython runtime/driver wrappers (what
``cucopy/backends/cuda.py`` uses), cuda-python's ``cuda.bindings`` runtime and
driver modules, CuPy's ``RawKernel.__call__``, and the backend method itself
(which adds the current-device check and error mapping).

What is measured: host time of the Python call, i.e. the enqueue cost the
copier pays per step, as the median (and minimum) over batches of ``--batch``
calls. The stream is synchronized between batches, outside the timed region,
so the launch queue never fills up. GPU execution time is not measured here
(bench the flush itself for that). The ``loop`` line is the cost of the
timing loop and a no-op closure: subtract it from the others.

One line per candidate: ``call  api  median_us  min_us`` (or ``skipped: why``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_NOOP = r"""
extern "C" __global__ void noop(const unsigned char* p) {}
"""


def measure(fn, iters: int, batch: int, sync) -> tuple[float, float]:
    """Median and minimum host microseconds per call of ``fn``."""
    for _ in range(min(batch, 64)):  # warm-up
        fn()
    sync()
    per_call = []
    for _ in range(max(1, iters // batch)):
        t0 = time.perf_counter_ns()
        for _ in range(batch):
            fn()
        t1 = time.perf_counter_ns()
        sync()
        per_call.append((t1 - t0) / batch / 1000)
    return statistics.median(per_call), min(per_call)


def candidates(dev: int):
    """Yield ``(call, api, factory)``: ``factory()`` returns the no-argument call to time,
    or raises to mean 'skipped'. The generator's frame keeps the buffers alive."""
    import cupy

    from cucopy import pack
    from cucopy.backends.cuda import CudaBackend

    rt = cupy.cuda.runtime
    drv = cupy.cuda.driver
    be = CudaBackend(dev)
    cstream = cupy.cuda.Stream(non_blocking=True)
    s = cstream.ptr
    pinned = be.alloc_pinned(1 << 16)
    devbuf = be.alloc_device(1 << 16)
    h, d = pinned.ptr, devbuf.ptr
    ev = be.event_create()
    noop = cupy.RawModule(code=_NOOP).get_function("noop")
    fptr = noop.kernel.ptr

    try:
        from cuda.bindings import driver as cu
        from cuda.bindings import runtime as cudart
    except ImportError:
        cu = cudart = None

    def need_bindings():
        if cu is None:
            raise RuntimeError("cuda.bindings (cuda-python) not installed")

    yield "loop", "python", lambda: lambda: None

    # -- current device check --------------------------------------------------
    yield "getDevice", "cupy.runtime", lambda: rt.getDevice

    def bindings_get_device():
        need_bindings()

        def f():
            err, _ = cudart.cudaGetDevice()
            if err:
                raise RuntimeError(err)

        return f

    yield "getDevice", "cuda.bindings.runtime", bindings_get_device

    # -- memcpyAsync (64 B, pinned H2D) ------------------------------------------
    yield "memcpyAsync", "cupy.runtime", lambda: lambda: rt.memcpyAsync(d, h, 64, 1, s)

    def bindings_memcpy():
        need_bindings()
        kind = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        stream = cudart.cudaStream_t(s)

        def f():
            (err,) = cudart.cudaMemcpyAsync(d, h, 64, kind, stream)
            if err:
                raise RuntimeError(err)

        return f

    yield "memcpyAsync", "cuda.bindings.runtime", bindings_memcpy

    def bindings_memcpy_int():
        need_bindings()
        kind = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice

        def f():
            (err,) = cudart.cudaMemcpyAsync(d, h, 64, kind, s)
            if err:
                raise RuntimeError(err)

        return f

    yield "memcpyAsync", "cuda.bindings.runtime(int stream)", bindings_memcpy_int

    def driver_memcpy():
        need_bindings()
        dptr = cu.CUdeviceptr(d)
        stream = cu.CUstream(s)

        def f():
            (err,) = cu.cuMemcpyHtoDAsync(dptr, h, 64, stream)
            if err:
                raise RuntimeError(err)

        return f

    yield "memcpyAsync", "cuda.bindings.driver(HtoD)", driver_memcpy
    yield "memcpyAsync", "backend.copy2d", lambda: lambda: be.copy2d(True, d, 0, h, 0, 64, 1, s)

    # -- memcpy2DAsync (4 rows of 16 B) --------------------------------------------
    yield (
        "memcpy2DAsync",
        "cupy.runtime",
        lambda: lambda: rt.memcpy2DAsync(d, 64, h, 16, 16, 4, 1, s),
    )
    yield "memcpy2DAsync", "backend.copy2d", lambda: lambda: be.copy2d(True, d, 64, h, 16, 16, 4, s)

    # -- launch (1 block of 256 threads, one pointer argument) ---------------------
    arg = ctypes.c_uint64(d)
    params = (ctypes.c_void_p * 1)(ctypes.addressof(arg))
    paddr = ctypes.addressof(params)

    def cupy_driver_launch():
        arg.value = d
        drv.launchKernel(fptr, 1, 1, 1, pack.THREADS, 1, 1, 0, s, paddr, 0)

    yield "launch", "cupy.driver.launchKernel+ctypes", lambda: cupy_driver_launch

    darg = np.uint64(d)

    def rawkernel_new_stream():
        noop((1,), (pack.THREADS,), (darg,), stream=cupy.cuda.ExternalStream(s))

    yield "launch", "RawKernel(new ExternalStream)", lambda: rawkernel_new_stream

    ext = cupy.cuda.ExternalStream(s)

    def rawkernel_cached_stream():
        noop((1,), (pack.THREADS,), (darg,), stream=ext)

    yield "launch", "RawKernel(cached ExternalStream)", lambda: rawkernel_cached_stream

    def bindings_launch_ptr():
        need_bindings()
        fn = cu.CUfunction(fptr)
        stream = cu.CUstream(s)

        def f():
            arg.value = d
            (err,) = cu.cuLaunchKernel(fn, 1, 1, 1, pack.THREADS, 1, 1, 0, stream, paddr, 0)
            if err:
                raise RuntimeError(err)

        return f

    yield "launch", "cuda.bindings.driver(void** int)", bindings_launch_ptr

    def bindings_launch_tuple():
        need_bindings()
        fn = cu.CUfunction(fptr)
        stream = cu.CUstream(s)

        def f():
            (err,) = cu.cuLaunchKernel(
                fn, 1, 1, 1, pack.THREADS, 1, 1, 0, stream, ((d,), (ctypes.c_void_p,)), 0
            )
            if err:
                raise RuntimeError(err)

        return f

    yield "launch", "cuda.bindings.driver(args tuple)", bindings_launch_tuple

    def backend_scatter():
        # one FILL descriptor of 64 B: the real kernel, dma mode
        seg = pinned.array
        data_offset = pack.align(pack.HEADER_BYTES + pack.DESC_BYTES)
        desc = (d + 4096, 0, 7, 64, 64, 64, 1, pack.KIND_FILL, 4, 0)
        nblocks = pack.encode(seg[:data_offset], [desc], data_offset, data_offset)
        be.copy2d(True, d, 0, h, 0, data_offset, 1, s)
        be.synchronize(s)
        return lambda: be.scatter(d, nblocks, s, False)

    yield "launch", "backend.scatter", backend_scatter
    yield "launch", "backend.fill", lambda: lambda: be.fill(d + 8192, 0, 64, 1, 7, 4, s)

    # -- eventRecord / eventQuery ----------------------------------------------------
    yield "eventRecord", "cupy.runtime", lambda: lambda: rt.eventRecord(ev, s)

    def bindings_record():
        need_bindings()
        e = cudart.cudaEvent_t(ev)
        stream = cudart.cudaStream_t(s)

        def f():
            (err,) = cudart.cudaEventRecord(e, stream)
            if err:
                raise RuntimeError(err)

        return f

    yield "eventRecord", "cuda.bindings.runtime", bindings_record

    def driver_record():
        need_bindings()
        e = cu.CUevent(ev)
        stream = cu.CUstream(s)

        def f():
            (err,) = cu.cuEventRecord(e, stream)
            if err:
                raise RuntimeError(err)

        return f

    yield "eventRecord", "cuda.bindings.driver", driver_record
    yield "eventRecord", "backend.event_record", lambda: lambda: be.event_record(ev, s)

    yield "eventQuery", "cupy.runtime", lambda: lambda: rt.eventQuery(ev)

    def bindings_query():
        need_bindings()
        e = cudart.cudaEvent_t(ev)

        def f():
            return cudart.cudaEventQuery(e)[0]

        return f

    yield "eventQuery", "cuda.bindings.runtime", bindings_query

    def driver_query():
        need_bindings()
        e = cu.CUevent(ev)

        def f():
            return cu.cuEventQuery(e)[0]

        return f

    yield "eventQuery", "cuda.bindings.driver", driver_query
    yield "eventQuery", "backend.event_query", lambda: lambda: be.event_query(ev)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", type=int, default=0, help="CUDA ordinal (default 0)")
    ap.add_argument("--iters", type=int, default=20_000, help="calls per candidate")
    ap.add_argument(
        "--batch", type=int, default=200, help="calls between (untimed) stream synchronizations"
    )
    ap.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="calls to time, e.g. launch eventQuery (default: all)",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)

    import cupy

    # CuPy 14 deprecates ExternalStream; it is timed here only as the RawKernel baseline
    warnings.filterwarnings("ignore", message="ExternalStream is deprecated")
    cupy.cuda.Device(args.device).use()
    results = []
    print(f"{'call':<14} {'api':<36} {'median_us':>9} {'min_us':>8}")
    for call, api, factory in candidates(args.device):
        if args.only and call not in args.only and call != "loop":
            continue
        row = {"call": call, "api": api}
        try:
            med, lo = measure(
                factory(), args.iters, args.batch, cupy.cuda.runtime.deviceSynchronize
            )
            row.update(median_us=round(med, 3), min_us=round(lo, 3))
            print(f"{call:<14} {api:<36} {med:>9.3f} {lo:>8.3f}", flush=True)
        except Exception as e:  # report and go on with the other candidates
            row["skipped"] = f"{type(e).__name__}: {e}"
            print(f"{call:<14} {api:<36} skipped: {row['skipped']}", flush=True)
        results.append(row)

    if args.json is not None:
        props = cupy.cuda.runtime.getDeviceProperties(args.device)
        meta = {
            "device": props["name"].decode(errors="replace"),
            "cupy": cupy.__version__,
            "python": platform.python_version(),
            "iters": args.iters,
            "batch": args.batch,
        }
        try:
            import cuda.bindings

            meta["cuda_bindings"] = cuda.bindings.__version__
        except Exception:
            pass
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
