"""Where a small scatter's kernel time goes, above an empty launch.

``bench/param_probe.py`` found a carried one-copy scatter ~1.2 us above an empty
kernel with as many parameter bytes. This probe times microkernels that add one
ingredient at a time (threads, one global store, a load from the parameter
buffer, a dependent second load, a block-wide barrier count, more blocks), then
reads of mapped pinned memory spread over a varying number of blocks (does the
PCIe read rate depend on how many SMs issue it?). Same method as the bench: a
held stream, an event pair around the launch.

Usage: python bench/kernel_floor.py [--reps 200] [--json PATH]. Needs CuPy and a GPU.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._probe import HeldTimer, environment, span, start, summary, write  # noqa: E402
from cucopy.backends import cuda as cb  # noqa: E402

CAP = 1008  # parameter bytes after the 16-byte prefix, as cucopy_scatter_c1k
BIG = 22512  # as cucopy_scatter_c22k: a 128-descriptor table, or a whole N = 32 step
NDESC = 128

_SRC = r"""
typedef unsigned long long u64;
typedef unsigned int u32;
struct __align__(16) P { u64 dst; u64 src; u32 n; u32 pad; unsigned char b[CAP]; };

extern "C" __global__ void empty(const __grid_constant__ P p) {}

extern "C" __global__ void store4(const __grid_constant__ P p) {
    if (threadIdx.x == 0) *reinterpret_cast<u32*>(p.dst) = 1u;
}

// 16 bytes from the parameter buffer, through a generic pointer, to dst.
extern "C" __global__ void param16(const __grid_constant__ P p) {
    if (threadIdx.x == 0) {
        const uint4 x = *reinterpret_cast<const uint4*>(p.b);
        *reinterpret_cast<uint4*>(p.dst + 16u * blockIdx.x) = x;
    }
}

// an offset read from the buffer, then 16 bytes at that offset: two dependent loads.
extern "C" __global__ void chain2(const __grid_constant__ P p) {
    if (threadIdx.x == 0) {
        const u32 off = *reinterpret_cast<const u32*>(p.b);
        const uint4 x = *reinterpret_cast<const uint4*>(p.b + off);
        *reinterpret_cast<uint4*>(p.dst + 16u * blockIdx.x) = x;
    }
}

// every thread reads a word of the buffer, a barrier count picks one, then chain2.
extern "C" __global__ void chain2_count(const __grid_constant__ P p) {
    const u32 w = reinterpret_cast<const u32*>(p.b)[threadIdx.x];
    const unsigned c = __syncthreads_count(w <= blockIdx.x);
    if (threadIdx.x == 0) {
        const u32 off = *reinterpret_cast<const u32*>(p.b) + 16u * (c & 0u);
        const uint4 x = *reinterpret_cast<const uint4*>(p.b + off);
        *reinterpret_cast<uint4*>(p.dst + 16u * blockIdx.x) = x;
    }
}

// p.n bytes of mapped memory at p.src, split evenly over the grid, 16 B per thread per
// round, four rounds in flight; copied to p.dst.
extern "C" __global__ void mapped_read(const __grid_constant__ P p) {
    const u32 words = p.n / 16u;
    const u32 per = (words + gridDim.x - 1u) / gridDim.x;
    const u32 lo = blockIdx.x * per;
    const u32 hi = min(words, lo + per);
    const uint4* s = reinterpret_cast<const uint4*>(p.src);
    uint4* d = reinterpret_cast<uint4*>(p.dst);
    for (u32 i = lo + threadIdx.x; i < hi; i += 4u * blockDim.x) {
        uint4 x[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const u32 j = i + k * blockDim.x;
            if (j < hi) x[k] = __ldg(s + j);
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const u32 j = i + k * blockDim.x;
            if (j < hi) d[j] = x[k];
        }
    }
}

// -- a 128-entry table of 48-byte descriptors at offset 32 of a 22 KiB buffer;
// block_start (the last word of each) = i. How should a block find its entry?
struct __align__(16) Q { u64 dst; u64 src; u32 n; u32 pad; u64 pad2; unsigned char b[BIG]; };

extern "C" __global__ void big_empty(const __grid_constant__ Q p) {}

// as cucopy_scatter_c* does now: thread t loads descriptor t (3 x 16 B) through a
// generic pointer, a barrier count names the owner, its thread passes it on in
// shared memory.
template <bool kGeneric>
__device__ void spec(const Q& p) {
    __shared__ uint4 s[3];
    const unsigned t = threadIdx.x;
    uint4 w0 = make_uint4(0, 0, 0, 0), w1 = w0, w2 = w0;
    if (t < p.n) {
        if (kGeneric) {
            const u64 a = reinterpret_cast<u64>(p.b) + 32u + 48u * t;
            w0 = *reinterpret_cast<const uint4*>(a);
            w1 = *reinterpret_cast<const uint4*>(a + 16u);
            w2 = *reinterpret_cast<const uint4*>(a + 32u);
        } else {
            const uint4* e = reinterpret_cast<const uint4*>(p.b + 32u + 48u * t);
            w0 = e[0];
            w1 = e[1];
            w2 = e[2];
        }
    }
    const unsigned owner = __syncthreads_count(t < p.n && w2.w <= blockIdx.x);
    if (t + 1u == owner) {
        s[0] = w0;
        s[1] = w1;
        s[2] = w2;
    }
    __syncthreads();
    if (t == 0u) {
        const uint4 x = s[0];
        *reinterpret_cast<uint4*>(p.dst + 16u * blockIdx.x) = make_uint4(x.x, x.y, s[2].w, owner);
    }
}
extern "C" __global__ void spec_generic(const __grid_constant__ Q p) { spec<true>(p); }
extern "C" __global__ void spec_param(const __grid_constant__ Q p) { spec<false>(p); }

// every thread runs the same binary search over block_start (warp-uniform loads:
// one broadcast each), then reads the descriptor with uniform loads: no barrier.
template <bool kGeneric>
__device__ void search(const Q& p) {
    u32 lo = 0u, hi = p.n;
    const u64 a = reinterpret_cast<u64>(p.b) + 32u;
    while (hi - lo > 1u) {
        const u32 mid = (lo + hi) >> 1;
        const u32 bs = kGeneric ? *reinterpret_cast<const u32*>(a + 48u * mid + 44u)
                                : *reinterpret_cast<const u32*>(p.b + 32u + 48u * mid + 44u);
        if (bs <= blockIdx.x) lo = mid; else hi = mid;
    }
    const uint4 x = kGeneric ? *reinterpret_cast<const uint4*>(a + 48u * lo)
                             : *reinterpret_cast<const uint4*>(p.b + 32u + 48u * lo);
    if (threadIdx.x == 0u) {
        *reinterpret_cast<uint4*>(p.dst + 16u * blockIdx.x) = make_uint4(x.x, x.y, lo, 0u);
    }
}
extern "C" __global__ void search_generic(const __grid_constant__ Q p) { search<true>(p); }
extern "C" __global__ void search_param(const __grid_constant__ Q p) { search<false>(p); }

// p.n bytes of the buffer itself copied out, 16 B per thread, grid-stride: the
// divergent reads an inline segment's data makes.
template <bool kGeneric>
__device__ void data(const Q& p) {
    const u32 words = p.n / 16u;
    uint4* d = reinterpret_cast<uint4*>(p.dst);
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < words; i += gridDim.x * blockDim.x) {
        d[i] = kGeneric ? *reinterpret_cast<const uint4*>(reinterpret_cast<u64>(p.b) + 16u * i)
                        : reinterpret_cast<const uint4*>(p.b)[i];
    }
}
extern "C" __global__ void data_generic(const __grid_constant__ Q p) { data<true>(p); }
extern "C" __global__ void data_param(const __grid_constant__ Q p) { data<false>(p); }
""".replace("BIG", str(BIG)).replace("CAP", str(CAP))


class _Params(ctypes.Structure):
    _fields_ = [
        ("dst", ctypes.c_uint64),
        ("src", ctypes.c_uint64),
        ("n", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("b", ctypes.c_ubyte * CAP),
    ]


class _Big(ctypes.Structure):
    _fields_ = [
        ("dst", ctypes.c_uint64),
        ("src", ctypes.c_uint64),
        ("n", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("pad2", ctypes.c_uint64),
        ("b", ctypes.c_ubyte * BIG),
    ]


_BIG_KERNELS = (
    "big_empty",
    "spec_generic",
    "spec_param",
    "search_generic",
    "search_param",
    "data_generic",
    "data_param",
)


def main(argv=None) -> int:
    args, cupy, be, stream = start(__doc__, argv)
    h = stream.ptr
    mod = cupy.RawModule(code=_SRC, options=("-std=c++17",))
    fns = {
        name: mod.get_function(name).kernel.ptr
        for name in ("empty", "store4", "param16", "chain2", "chain2_count", "mapped_read")
        + _BIG_KERNELS
    }
    dst = cupy.zeros(1 << 20, np.uint8)
    pinned = be.alloc_pinned(1 << 20)
    pinned.array[:] = np.arange(1 << 20) % 251
    prm = _Params()
    prm.dst = int(dst.data.ptr)
    prm.src = int(pinned.device_ptr)
    words = np.frombuffer(prm.b, np.uint32)
    words[:] = 0
    words[0] = 16  # chain2's offset
    size = ctypes.c_size_t(ctypes.sizeof(prm))
    extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(prm), 2, ctypes.addressof(size), 0)
    big = _Big()
    big.dst = prm.dst + (1 << 19)  # clear of what mapped_read writes
    big.src = prm.src
    table = np.frombuffer(big.b, np.uint32)
    table[:] = np.arange(table.size, dtype=np.uint32)
    starts = (32 + 48 * np.arange(NDESC) + 44) // 4
    table[starts] = np.arange(NDESC, dtype=np.uint32)
    big_size = ctypes.c_size_t(ctypes.sizeof(big))
    big_extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(big), 2, ctypes.addressof(big_size), 0)
    timer = HeldTimer(be, stream, args.reps)

    def timed(launch):
        return timer.time(lambda i: launch())

    def launch(name, grid, block, n=0):
        def go():
            prm.n = n
            cb._launch(fns[name], grid, 1, 1, block, 1, 1, 0, h, 0, ctypes.addressof(extra))

        return go

    def launch_big(name, grid, n):
        def go():
            big.n = n
            cb._launch(fns[name], grid, 1, 1, 256, 1, 1, 0, h, 0, ctypes.addressof(big_extra))

        return go

    rows = []

    def record(name, samples, **extra_fields):
        row = {"name": name, **extra_fields, **summary(samples)}
        rows.append(row)
        print(f"{name:44s} {span(row)}")

    record("event pair alone", timed(lambda: None))
    record("empty, 1 x 32 threads", timed(launch("empty", 1, 32)))
    record("empty, 1 x 256 threads", timed(launch("empty", 1, 256)))
    record("empty, 32 x 256 threads", timed(launch("empty", 32, 256)))
    record("empty, 128 x 256 threads", timed(launch("empty", 128, 256)))
    record("one 4 B store, 1 x 256", timed(launch("store4", 1, 256)))
    record("param 16 B -> store, 1 x 256", timed(launch("param16", 1, 256)))
    record("param 16 B -> store, 32 x 256", timed(launch("param16", 32, 256)))
    record("two dependent param loads, 1 x 256", timed(launch("chain2", 1, 256)))
    record("two dependent param loads, 32 x 256", timed(launch("chain2", 32, 256)))
    record("count + two loads, 1 x 256", timed(launch("chain2_count", 1, 256)))
    record("count + two loads, 32 x 256", timed(launch("chain2_count", 32, 256)))
    for nbytes in (20480, 90112):
        for grid in (1, 2, 6, 22, 44, 88, 132):
            record(
                f"mapped read {nbytes} B on {grid} blocks",
                timed(launch("mapped_read", grid, 256, nbytes)),
                nbytes=nbytes,
                grid=grid,
            )
    record(f"empty, {BIG} B of parameters, 130 x 256", timed(launch_big("big_empty", 130, 0)))
    for how in ("generic", "param"):
        record(
            f"table: thread t reads desc t, count ({how})",
            timed(launch_big(f"spec_{how}", NDESC, NDESC)),
        )
        record(
            f"table: uniform binary search ({how})",
            timed(launch_big(f"search_{how}", NDESC, NDESC)),
        )
    for how in ("generic", "param"):
        for grid in (5, 40):
            record(
                f"20 KiB of carried data, 16 B/thread, {grid} blocks ({how})",
                timed(launch_big(f"data_{how}", grid, 20480)),
            )
    stream.synchronize()
    got = dst[1 << 19 : (1 << 19) + 20480].get()
    ok_data = bool((got == np.frombuffer(big.b, np.uint8)[:20480]).all())
    print("data_* copied the bytes:", ok_data)
    ok = bool((dst[:90112].get() == pinned.array[:90112]).all())
    print("mapped_read copied the bytes:", ok)
    ok = ok and ok_data
    result = {"scenario": "kernel_floor", "environment": environment(), "reps": args.reps}
    write(args.json, {**result, "mapped_read_verified": ok, "rows": rows})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
