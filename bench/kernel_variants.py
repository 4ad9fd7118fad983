"""Builds of the carried scatter kernel on the bench's decode-like steps.

``bench/kernel_floor.py`` put a carried one-copy scatter ~1 us above what its
parameter reads and data reads cost in microkernels. This probe times the real
``cucopy_scatter_c*`` built several ways (the library's build, and 2 or 4 windows
a thread per round: ``-DCUCOPY_UNROLL``), the library's build followed by a
slot event (what a mapped step records), and a lean kernel that handles only what these steps hold (one-row H2D copies
whose data sits at the destination's offset modulo 16), on the segments of the
step_cost mix: N = 8 and 32 carried whole ("inline"), N = 128 and 512 with the
header and table carried and the data read from mapped memory ("mapped"). With
separate destinations it also times the host rewriting the slot before each launch,
in ordinary and in write-combined pinned memory (``host_write_us``: the host's copy
into the slot). Each launch's result is checked against the step's bytes.

Usage: python bench/kernel_variants.py [--reps 200] [--json PATH]. Needs CuPy and a GPU.
"""

from __future__ import annotations

import ctypes
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _common as common  # noqa: E402
from bench._probe import HeldTimer, environment, span, start, summary, write  # noqa: E402
from cucopy import kernels, pack  # noqa: E402
from cucopy.backends import cuda as cb  # noqa: E402

BUILDS = {
    "library": (),
    "unroll2": ("-DCUCOPY_UNROLL=2",),
    "unroll4": ("-DCUCOPY_UNROLL=4",),
}

# Only what the bench steps hold: descriptor b is block b's (pack.split), one-row
# H2D, data at the destination's offset modulo 16.
_LEAN = r"""
typedef unsigned long long u64;
typedef unsigned int u32;
struct Desc { u64 dst; u64 src; u64 value; u32 dp, sp, width, rows; unsigned short kind, elem; u32 bs; };
template <unsigned CAP> struct __align__(16) Carried { u64 seg; u32 nbytes; u32 r; unsigned char b[CAP]; };

template <unsigned CAP>
__device__ void lean(const Carried<CAP>& p) {
    constexpr unsigned kFit = (CAP - 32u) / 48u;
    const Desc* table = reinterpret_cast<const Desc*>(p.b + 32);
    const Desc d = table[blockIdx.x < kFit ? blockIdx.x : kFit - 1u];
    const u64 total = *reinterpret_cast<const u64*>(p.b + 24);
    const bool carried = total <= p.nbytes;
    const u64 src = (carried ? reinterpret_cast<u64>(p.b) : p.seg) + d.src;
    const u64 a0 = d.dst & ~15ull;
    const u64 end = d.dst + d.width;
    const u32 nwin = (u32)((end - a0 + 15u) >> 4);
    for (u32 k = threadIdx.x; k < nwin; k += 256u) {
        const u64 a = a0 + 16ull * k;
        const u64 s = src + (a - d.dst);
        if (a >= d.dst && a + 16u <= end) {
            const uint4 x = carried ? *reinterpret_cast<const uint4*>(s)
                                    : __ldg(reinterpret_cast<const uint4*>(s));
            *reinterpret_cast<uint4*>(a) = x;
        } else {
            for (u64 i = (a > d.dst ? a : d.dst); i < end && i < a + 16u; ++i) {
                *reinterpret_cast<unsigned char*>(i) = *reinterpret_cast<const unsigned char*>(s + (i - a));
            }
        }
    }
}
"""


def _lean_source() -> str:
    names = []
    body = [_LEAN]
    for cap, name in zip(pack.CARRY_CAPACITIES, pack.CARRY_ENTRY_POINTS):
        body.append(
            f'extern "C" __global__ void __launch_bounds__(256) '
            f"{name}(const __grid_constant__ Carried<{cap}> p) {{ lean<{cap}>(p); }}"
        )
        names.append(name)
    return "\n".join(body)


def _step(n: int, addrs: list, rng) -> tuple[np.ndarray, int, int, list]:
    """The cut segment of one step of the step_cost mix into ``addrs``, its blocks,
    where its data starts, and each input's bytes."""
    mix = common.decode_mix(n, 0)
    rows, payloads, off = [], [], 0
    for (k, dt), dst in zip(mix, addrs):
        nbytes = k * np.dtype(dt).itemsize
        off = pack.align(off) + (dst & 15)
        payloads.append(rng.integers(0, 256, nbytes, dtype=np.uint8))
        rows.append((dst, off, 0, nbytes, nbytes, nbytes, 1, pack.KIND_H2D, 0, 0))
        off += nbytes
    rows = pack.split(rows)
    data0 = pack.align(pack.HEADER_BYTES + len(rows) * pack.DESC_BYTES)
    seg = np.zeros(pack.align(data0 + off), np.uint8)
    o = 0
    for dst, payload in zip(addrs, payloads):
        o = pack.align(o) + (dst & 15)
        seg[data0 + o : data0 + o + payload.size] = payload
        o += payload.size
    nblocks = pack.encode(seg[:data0], rows, data0, seg.size, src_shift=data0)
    return seg, nblocks, data0, payloads


def _sizes(n: int) -> list:
    return [k * np.dtype(dt).itemsize for k, dt in common.decode_mix(n, 0)]


class _Pinned:
    """Page-locked memory as the probe uses a slot: ``array`` and ``device_ptr``."""

    def __init__(self, ptr: int, nbytes: int):
        self.ptr = ptr
        self.device_ptr = cb._rt.pointerGetAttributes(ptr).devicePointer
        self.array = np.frombuffer((ctypes.c_ubyte * nbytes).from_address(ptr), np.uint8)


def _write_combined(nbytes: int) -> _Pinned:
    """Portable, mapped, write-combined ``cudaHostAlloc`` memory (never freed: a probe)."""
    portable, mapped, write_combined = 0x01, 0x02, 0x04
    return _Pinned(cb._rt.hostAlloc(nbytes, portable | mapped | write_combined), nbytes)


def main(argv=None) -> int:
    args, cupy, be, stream = start(__doc__, argv)
    h = stream.ptr
    modules = {
        name: cupy.RawModule(code=kernels.source(), options=("-std=c++17", *opts))
        for name, opts in BUILDS.items()
    }
    modules["lean"] = cupy.RawModule(code=_lean_source(), options=("-std=c++17",))
    arena = cupy.zeros(4 << 20, np.uint8)
    # four pinned buffers of 1 MiB, as the bench's ring slots
    slots = [be.alloc_pinned(1 << 20) for _ in range(4)]
    # the same, write-combined: the host's writes skip its caches, so a kernel reading
    # a slot the host has just rewritten need not snoop them
    wc_slots = [_write_combined(1 << 20) for _ in range(4)]
    buf = (ctypes.c_ubyte * (pack.CARRY_PREFIX + pack.CARRY_CAPACITIES[-1]))()
    size = ctypes.c_size_t(0)
    extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(buf), 2, ctypes.addressof(size), 0)
    head = np.frombuffer(buf, np.uint8)
    timer = HeldTimer(be, stream, args.reps)
    slot_event = be.event_create()  # as the ring's: timing disabled
    rng = np.random.default_rng(0)
    rows, failures = [], []

    def run(
        n,
        how,
        build,
        fn,
        nblocks,
        carry,
        cap,
        dsts,
        payloads,
        nslots,
        event,
        placement,
        seg=None,
        pool=slots,
    ):
        for d in dsts:
            d.fill(0)
        host_s = []

        def launch(i):
            slot = pool[i % nslots]
            head[:8] = np.frombuffer(np.uint64(slot.device_ptr).tobytes(), np.uint8)
            if seg is not None:  # the host writes the step into the slot, as the copier does
                t0 = time.perf_counter()
                slot.array[: seg.size] = seg
                host_s.append(time.perf_counter() - t0)
            cb._launch(fn, nblocks, 1, 1, pack.THREADS, 1, 1, 0, h, 0, ctypes.addressof(extra))
            if event is not None:
                be.event_record(event, h)

        times = summary(timer.time(launch))
        ok = all(bool((d.get() == v).all()) for d, v in zip(dsts, payloads))
        if not ok:
            failures.append(f"N={n} {build} {placement} {nslots} slot(s): wrong bytes")
        row = {
            "n": n,
            "how": how,
            "build": build,
            "placement": placement,
            "host_writes_slot": seg is not None,
            "write_combined": pool is wc_slots,
            "host_write_us": round(float(np.median(host_s)) * 1e6, 3) if host_s else None,
            "slots": nslots,
            "carried_bytes": int(carry),
            "capacity": cap,
            "nblocks": nblocks,
            "verified": ok,
            **times,
        }
        rows.append(row)
        print(
            f"N={n:4d} {how:6s} {build:14s} {placement:8s} {nslots} slot(s)"
            f"{' rewritten' if seg is not None else ''}{' WC' if pool is wc_slots else ''}"
            f" {span(row)} us "
            f"({nblocks} blocks, {carry} B carried{'' if ok else ', WRONG'})",
            flush=True,
        )

    for n, how in ((8, "inline"), (32, "inline"), (128, "mapped"), (512, "mapped")):
        sizes = _sizes(n)
        cursor, views = 0, []
        for nbytes in sizes:  # one arena, inputs 512 B apart as allocators place them
            views.append(arena[cursor : cursor + nbytes])
            cursor = pack.align(cursor + nbytes, 512)
        separate = [cupy.empty(nbytes, np.uint8) for nbytes in sizes]
        for placement, dsts in (("arena", views), ("separate", separate)):
            seg, nblocks, data0, payloads = _step(n, [int(d.data.ptr) for d in dsts], rng)
            for sl in slots:
                sl.array[: seg.size] = seg
            carry = seg.size if how == "inline" else data0
            cap = pack.carry_capacity(carry)
            fn_name = pack.CARRY_ENTRY_POINTS[pack.CARRY_CAPACITIES.index(cap)]
            head[:] = 0
            head[8:12] = np.frombuffer(np.uint32(carry).tobytes(), np.uint8)
            head[16 : 16 + carry] = seg[:carry]
            size.value = pack.CARRY_PREFIX + cap
            if placement == "arena":
                runs = [(b, m, 1, None) for b, m in modules.items()]
                runs.append(("library+event", modules["library"], 1, slot_event))
                runs.append(("library", modules["library"], 4, slot_event))
            else:
                runs = [("library", modules["library"], 1, None)]
                runs.append(("library", modules["library"], 4, slot_event))
            for build, mod, nslots, event in runs:
                fn = mod.get_function(fn_name).kernel.ptr
                run(
                    n, how, build, fn, nblocks, carry, cap, dsts, payloads, nslots, event, placement
                )
            if placement == "separate":  # the host writes the slot before each launch
                fn = modules["library"].get_function(fn_name).kernel.ptr
                args_ = (n, how, "library", fn, nblocks, carry, cap, dsts, payloads)
                run(*args_, 4, slot_event, placement, seg)
                for sl in wc_slots:
                    sl.array[: seg.size] = seg
                run(*args_, 4, slot_event, placement, seg, wc_slots)
    result = {"scenario": "kernel_variants", "environment": environment(), "reps": args.reps}
    builds = {k: list(v) for k, v in BUILDS.items()}
    write(args.json, {**result, "builds": builds, "rows": rows, "failures": failures})
    print("\n".join(failures) if failures else "all launches verified")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
