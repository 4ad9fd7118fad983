"""What writing and reading the step's bytes costs the host, by the kind of memory.

Usage:
    python bench/probes/pinned_bytes.py [--json PATH]

Question: the bench's decode mix stages more bytes per copy than ``step_phases.py``'s
(20 KB against 11 KB at N = 32, 87 KB against 43 KB at N = 128), and its step costs
the host about 1 ns more per extra byte, where a plain ``memcpy`` should cost a tenth
of that. Is page-locked memory slow to write or read on the GPU's host? Times one
``memmove`` (ctypes) of 1 KiB to 344 KiB into and out of: ordinary memory (NumPy),
``cudaHostAlloc`` memory as the copier's ring allocates it (portable, mapped), default
``cudaHostAlloc`` memory, and a pinned torch tensor; each warm (the same buffer again
and again) and rotated over 4 buffers that a kernel reads between uses (as the ring's
slots are read by a mapped launch). Host time only; prints GB/s and ns per byte, and
``--json`` writes the medians. Answer: ``pinned_bytes.log`` in the first
``bench/results/`` run with it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time

import numpy as np

SIZES = (1024, 20 * 1024, 87 * 1024, 344 * 1024)
REPS = 400


def _median_ns(fn, reps: int) -> float:
    """Median nanoseconds of ``fn()`` over ``reps`` calls (after 20 untimed)."""
    for _ in range(20):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t0)
    return statistics.median(out)


def main(argv=None) -> int:
    """Run the probe; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the medians here")
    args = ap.parse_args(argv)
    import cupy

    rt = cupy.cuda.runtime
    big = max(SIZES)
    kinds = {}
    keep = []

    def host_alloc(flags):
        bufs = []
        for _ in range(4):
            p = rt.hostAlloc(big, flags)
            keep.append(p)
            bufs.append(p)
        return bufs

    kinds["numpy"] = [np.zeros(big, np.uint8) for _ in range(4)]
    kinds["hostalloc_portable_mapped"] = host_alloc(1 | 2)  # the copier's ring slots
    kinds["hostalloc_default"] = host_alloc(0)
    try:
        import torch

        kinds["torch_pinned"] = [torch.zeros(big, dtype=torch.uint8).pin_memory() for _ in range(4)]
    except Exception as e:  # noqa: BLE001 - torch is optional here
        print(f"torch pinned: unavailable ({e!r})")

    def addr(b):
        if isinstance(b, int):
            return b
        if isinstance(b, np.ndarray):
            return b.ctypes.data
        return b.data_ptr()

    src = np.random.default_rng(0).integers(0, 255, big, dtype=np.uint8)
    sink = np.zeros(big, np.uint8)
    s_ptr, k_ptr = src.ctypes.data, sink.ctypes.data
    # a kernel that reads each rotated buffer through its mapped address
    read = cupy.RawKernel(
        r"""extern "C" __global__ void rd(const unsigned char *p, unsigned n, unsigned *o) {
            unsigned s = 0;
            for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
                 i += gridDim.x * blockDim.x) s += p[i];
            if (s == 0xffffffffu) *o = s;
        }""",
        "rd",
    )
    out = cupy.zeros(1, cupy.uint32)
    memmove = ctypes.memmove
    rows = []
    for kind, bufs in kinds.items():
        ptrs = [addr(b) for b in bufs]
        dev_ptrs = []
        for p in ptrs:
            try:
                dev_ptrs.append(rt.hostGetDevicePointer(p, 0))
            except Exception:  # noqa: BLE001 - ordinary memory has no device address
                dev_ptrs.append(None)
        for n in SIZES:
            w = _median_ns(lambda p=ptrs[0], n=n: memmove(p, s_ptr, n), REPS)
            r = _median_ns(lambda p=ptrs[0], n=n: memmove(k_ptr, p, n), REPS)
            rot = []
            for i in range(REPS):
                j = i % 4
                if dev_ptrs[j] is not None:
                    read((8,), (256,), (np.uint64(dev_ptrs[j]), np.uint32(n), out))
                    cupy.cuda.Device().synchronize()
                t0 = time.perf_counter_ns()
                memmove(ptrs[j], s_ptr, n)
                rot.append(time.perf_counter_ns() - t0)
            rw = statistics.median(rot)
            row = {
                "kind": kind,
                "bytes": n,
                "write_ns": w,
                "read_ns": r,
                "write_after_gpu_read_ns": rw,
            }
            rows.append(row)
            print(
                f"{kind:26s} {n:7d} B: write {w / n:6.3f} ns/B ({n / w:6.2f} GB/s), "
                f"read {r / n:6.3f} ns/B, write after a kernel read it {rw / n:6.3f} ns/B"
            )
    for p in keep:
        rt.freeHost(p)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "python": sys.version}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
