"""Where a carried launch's GPU time goes: the parameter buffer or the kernel's reads.

Times, on a held stream between an event pair (as ``bench/step_cost.py`` does):

- an empty kernel whose parameter buffer is 16 B to 32 KiB (delivery alone);
- ``cucopy_scatter_c*`` at every capacity, carrying one 16-byte copy (delivery
  plus the smallest scatter);
- the largest capacity carrying 1 to 32 KiB of data in one descriptor (the
  kernel's reads of carried data), and the same data read from mapped memory.

Usage: python bench/param_probe.py [--reps 200] [--json PATH]. Needs CuPy and a GPU.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._probe import HeldTimer, environment, span, start, summary, write  # noqa: E402
from cucopy import pack  # noqa: E402
from cucopy.backends import cuda as cb  # noqa: E402

SIZES = (16, 1024, 4096, 8192, 16384, 24576, 32752)

_EMPTY = "\n".join(
    f"struct __align__(16) P{n} {{ unsigned char b[{n}]; }};\n"
    f'extern "C" __global__ void empty{n}(const __grid_constant__ P{n} p) {{}}'
    for n in SIZES
)


def _segment(nbytes: int, dst: int) -> np.ndarray:
    data0 = pack.align(pack.HEADER_BYTES + pack.DESC_BYTES)
    total = data0 + pack.align(nbytes)
    seg = np.zeros(total, np.uint8)
    row = (dst, data0, 0, nbytes, nbytes, nbytes, 1, pack.KIND_H2D, 1, 0)
    nblocks = pack.encode(seg, [row], data0, total)
    seg[data0 : data0 + nbytes] = np.arange(nbytes) % 251
    return seg, nblocks


def main(argv=None) -> int:
    args, cupy, be, stream = start(__doc__, argv)
    k = be._get_kernels()
    h = stream.ptr
    mod = cupy.RawModule(code=_EMPTY, options=("-std=c++17",))
    empties = {n: mod.get_function(f"empty{n}").kernel.ptr for n in SIZES}
    buf = (ctypes.c_ubyte * 32768)()
    size = ctypes.c_size_t(0)
    extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(buf), 2, ctypes.addressof(size), 0)
    dst = cupy.zeros(1 << 16, np.uint8)
    pinned = be.alloc_pinned(1 << 16)
    timer = HeldTimer(be, stream, args.reps)

    def timed(launch):
        return timer.time(lambda i: launch())

    def empty(n):
        size.value = n
        return lambda: cb._launch(empties[n], 1, 1, 1, 32, 1, 1, 0, h, 0, ctypes.addressof(extra))

    def carried(cap, nbytes, whole=True, mapped_data=False):
        seg, nblocks = _segment(nbytes, int(dst.data.ptr))
        pinned.array[: seg.size] = seg
        carry = seg.size if whole else pack.align(pack.HEADER_BYTES + pack.DESC_BYTES)
        c = be._scratch.carry
        fn = k.carried[cap]

        def go():
            c.args.seg = pinned.device_ptr
            c.args.nbytes = carry
            ctypes.memmove(c.bytes_addr, pinned.ptr, carry)
            c.size.value = pack.CARRY_PREFIX + cap
            cb._launch(fn, nblocks, 1, 1, pack.THREADS, 1, 1, 0, h, 0, c.extra_addr)

        return go

    rows = []

    def record(name, samples):
        row = {"name": name, **summary(samples)}
        rows.append(row)
        print(f"{name:44s} {span(row)}")

    record("event pair alone", timed(lambda: None))
    for n in SIZES:
        record(f"empty kernel, {n} B of parameters", timed(empty(n)))
    for cap in k.caps:
        record(f"scatter_c, cap {cap}, one 16 B copy", timed(carried(cap, 16)))
    top = k.caps[-1]
    for nbytes in (1024, 4096, 8192, 16384, 24576, 32736 - 96):
        record(f"scatter_c, cap {top}, {nbytes} B carried", timed(carried(top, nbytes)))
        record(
            f"scatter_c, cap {k.caps[0]}, {nbytes} B mapped",
            timed(carried(k.caps[0], nbytes, whole=False)),
        )
    stream.synchronize()
    result = {"scenario": "param_probe", "environment": environment(), "reps": args.reps}
    write(args.json, {**result, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
