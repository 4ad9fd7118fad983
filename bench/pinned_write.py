"""How fast the host writes into each kind of page-locked memory.

Usage:
    python bench/pinned_write.py [--bytes 1024] [--reps 20000]

Times a memoryview copy of ``--bytes`` bytes from ordinary memory into pageable
memory, cudaHostAlloc memory with each flag set, and a torch pinned tensor.
Host time only.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time

import numpy as np


def _time(dst_mv, src_mv, n, reps) -> float:
    for _ in range(200):
        dst_mv[0:n] = src_mv
    t0 = time.perf_counter()
    for i in range(reps):
        o = (i * 1024) & 0xFFFFF
        dst_mv[o : o + n] = src_mv
    return (time.perf_counter() - t0) / reps * 1e6


def main(argv=None) -> dict:
    """Measure and print microseconds per copy for each memory kind."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=20000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import cupy

    rt = cupy.cuda.runtime
    size = 1 << 21
    src = memoryview(np.arange(args.bytes, dtype=np.uint8))
    out = {"bytes": args.bytes}
    out["pageable"] = _time(memoryview(np.zeros(size, np.uint8)), src, args.bytes, args.reps)
    flags = {
        "default": 0,
        "portable": 1,
        "mapped": 2,
        "mapped|portable": 3,
        "write_combined": 4,
        "mapped|portable|write_combined": 7,
    }
    for name, fl in flags.items():
        ptr = rt.hostAlloc(size, fl)
        arr = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(ptr))
        out[name] = _time(memoryview(arr), src, args.bytes, args.reps)
        del arr
        rt.freeHost(ptr)
    try:
        import torch

        t = torch.zeros(size, dtype=torch.uint8, pin_memory=True)
        out["torch_pinned"] = _time(memoryview(t.numpy()), src, args.bytes, args.reps)
    except Exception as e:  # torch missing or without CUDA
        out["torch_pinned"] = repr(e)
    for k, v in out.items():
        print(f"{k:34s} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
