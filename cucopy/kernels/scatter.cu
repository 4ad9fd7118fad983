// cucopy scatter kernel: applies one segment (header | descriptors | data) in
// one launch. cucopy/pack.py is the one definition of the wire format; the
// structs below mirror it and tests/test_kernel.py checks every size and
// offset against pack.HEADER_DTYPE / pack.DESC_DTYPE by compiling
// static_asserts with NVRTC.
//
// Compiles warning-free under NVRTC with -std=c++17 for sm_80 and sm_90 and
// needs no headers: NVRTC has no <cstdint>, hence the typedefs.

typedef unsigned long long cucopy_u64;
typedef long long cucopy_i64;
typedef unsigned int cucopy_u32;
typedef unsigned short cucopy_u16;
typedef unsigned char cucopy_u8;

struct CucopyHeader {
    cucopy_u32 magic;
    cucopy_u16 version;
    cucopy_u16 header_bytes;
    cucopy_u32 ndesc;
    cucopy_u32 nblocks;
    cucopy_u32 desc_offset;
    cucopy_u32 data_offset;
    cucopy_u64 total_bytes;
};

struct CucopyDesc {
    cucopy_u64 dst;
    cucopy_u64 src;
    cucopy_u64 value;
    cucopy_u32 dst_pitch;
    cucopy_u32 src_pitch;
    cucopy_u32 width;
    cucopy_u32 rows;
    cucopy_u16 kind;
    cucopy_u16 elem;
    cucopy_u32 block_start;
};

#define CUCOPY_MAGIC 0x59504343u
#define CUCOPY_VERSION 1u
#define CUCOPY_HEADER_BYTES 32u
#define CUCOPY_DESC_BYTES 48u
#define CUCOPY_KIND_H2D 1u
#define CUCOPY_KIND_H2D_2D 2u
#define CUCOPY_KIND_D2D 3u
#define CUCOPY_KIND_FILL 4u
// pack.THREADS: the host sizes a descriptor's block run for this many threads.
#define CUCOPY_THREADS 256
// Windows a thread loads before its first store. The host gives a block
// pack.BLOCK_BYTES (4 KiB, 256 windows of 16 bytes: one a thread) and cuts
// wider descriptors (pack.split), so a round of one window is the whole job for
// nearly every thread; unrolling further made each kernel three times larger and
// measured no faster (the kernel_variants probe: 4 windows a round cost 0.1 to
// 0.25 us more on the bench steps, bench/results/2026-11-30-h200-variants).
// -DCUCOPY_UNROLL=n was that probe's tuning knob.
#ifndef CUCOPY_UNROLL
#define CUCOPY_UNROLL 1
#endif
// Up to this many descriptors the whole table (48 B each, 12 KiB) is read into
// shared memory in one coalesced pass: a block then finds and reads its
// descriptor in the same round trip. Reading only the block_start column
// would touch nearly as many 32-byte sectors (one per 48-byte descriptor) and
// cost a second round trip for the descriptor itself, which in "mapped" mode
// is a PCIe read of about a microsecond.
#define CUCOPY_TABLE_MAX 256

// Which extern "C" entry points this build defines: bit i of CUCOPY_ENTRIES is
// kernels.ENTRY_POINTS[i] (0 cucopy_scatter, 1 cucopy_fill, 2 + k the k-th
// carried capacity); kernels.source(names) defines it. Undefined: all of them.
// The CUDA backend compiles one module per entry point, in parallel, so that a
// cold first copier waits for the slowest kernel rather than all nineteen in a
// row (NVRTC to an sm_90 cubin on a CI-class CPU: the whole file 3.4 s, one
// entry point 0.08-0.24 s; the H200 run measures it: bench/cold_start.py).
#ifdef CUCOPY_ENTRIES
// a helper that the selected entry points do not call is expected, not a warning
#pragma nv_diag_suppress 177
#else
#define CUCOPY_ENTRIES 0xffffffffu
#endif
#define CUCOPY_BUILDS(i) (((CUCOPY_ENTRIES) >> (i)) & 1u)

// What one descriptor (or one cucopy_fill launch) asks for, decoded once into
// registers. Work is cut into "windows": the 16-byte-aligned destination
// words each row touches, so a full window is one 16-byte store and windows
// never straddle two blocks or two threads.
struct CucopyJob {
    cucopy_u64 dst;      // destination address of row 0
    cucopy_u64 src;      // source address of row 0 (segment address for H2D)
    cucopy_u64 dpitch;
    cucopy_u64 spitch;
    cucopy_u64 width;    // 64-bit: dense 2-D copies are flattened into one row
    cucopy_u64 rows;
    cucopy_u64 ppr;      // windows per row (an upper bound when rows differ)
    cucopy_u64 pattern;  // FILL: the element repeated over 8 bytes
    cucopy_u32 kind;
};

// Builds a job; returns false for a descriptor that asks for nothing (or that
// the host should never have written: unknown kind, bad element size). Such a
// descriptor is skipped rather than trapped on: a trap would poison the
// engine's whole CUDA context.
static __device__ __forceinline__ bool cucopy_job_init(CucopyJob& j, cucopy_u32 kind,
                                                       cucopy_u64 dst, cucopy_u64 src,
                                                       cucopy_u64 value, cucopy_u64 dpitch,
                                                       cucopy_u64 spitch, cucopy_u64 width,
                                                       cucopy_u64 rows, cucopy_u32 elem)
{
    if (kind == CUCOPY_KIND_FILL) {
        cucopy_u64 v;
        if (elem == 1u) {
            v = (value & 0xffull) * 0x0101010101010101ull;
        } else if (elem == 2u) {
            v = (value & 0xffffull) * 0x0001000100010001ull;
        } else if (elem == 4u) {
            v = (value & 0xffffffffull) * 0x0000000100000001ull;
        } else if (elem == 8u) {
            v = value;
        } else {
            return false;
        }
        // pack.reference_scatter writes width // elem whole elements per row.
        width -= width % elem;
        j.pattern = v;
    } else if (kind != CUCOPY_KIND_H2D && kind != CUCOPY_KIND_H2D_2D
               && kind != CUCOPY_KIND_D2D) {
        return false;
    } else {
        j.pattern = 0;
    }
    if (width == 0 || rows == 0) {
        return false;
    }
    // A dense 2-D copy (packed rows on both sides) is one long row: no window
    // is wasted on row ends and every window but the first and last is full.
    if (rows > 1 && dpitch == width && (kind == CUCOPY_KIND_FILL || spitch == width)) {
        width *= rows;
        rows = 1;
    }
    j.kind = kind;
    j.dst = dst;
    j.src = src;
    j.dpitch = dpitch;
    j.spitch = spitch;
    j.width = width;
    j.rows = rows;
    if (rows == 1 || (dpitch & 15ull) == 0) {
        // Every row starts at the same offset within a 16-byte word.
        j.ppr = ((dst & 15ull) + width + 15ull) >> 4;
    } else {
        j.ppr = (width + 30ull) >> 4;
    }
    return true;
}

// The FILL pattern seen from absolute addresses: byte (x & 7) of the result is
// what belongs at address x of a row starting at row_start, so any aligned
// 1/2/4/8/16-byte piece of a window is a plain slice of it.
static __device__ __forceinline__ cucopy_u64 cucopy_pattern_at(cucopy_u64 pattern,
                                                               cucopy_u64 row_start)
{
    const unsigned t = (unsigned)(0ull - row_start) & 7u;
    return t ? ((pattern >> (8u * t)) | (pattern << (64u - 8u * t))) : pattern;
}

static __device__ __forceinline__ unsigned cucopy_lowbit(unsigned x)
{
    return x & (0u - x);
}

// Exact-size reads of window bytes [lo, hi) from sb + lo .. sb + hi into the
// window's words, T-sized pieces aligned to T. Used for D2D windows whose
// covering 16-byte source words would reach outside the source row: device
// arrays belong to the caller, and compute-sanitizer memcheck counts even a
// discarded over-read.
template <typename T>
static __device__ __forceinline__ void cucopy_gather(unsigned (&w)[4], const cucopy_u8* sb,
                                                     unsigned lo, unsigned hi)
{
    constexpr unsigned n = sizeof(T);
#pragma unroll
    for (unsigned m = 0; m < 16u / n; ++m) {
        const unsigned off = m * n;
        if (off >= lo && off + n <= hi) {
            const T x = __ldg(reinterpret_cast<const T*>(sb + off));
            if constexpr (n == 8) {
                w[off / 4] = (unsigned)x;
                w[off / 4 + 1] = (unsigned)(x >> 32);
            } else {
                w[off / 4] |= (unsigned)x << (8u * (off % 4u));
            }
        }
    }
}

// Partial-window stores, T-sized pieces: a window is partial only at row ends.
// Stores go through __stwb (st.global) because the addresses come from
// integers: a plain dereference compiles to a generic ST that must first
// check which address space it hits.
template <typename T>
static __device__ __forceinline__ void cucopy_put(cucopy_u8* a, const unsigned (&w)[4],
                                                  unsigned lo, unsigned hi)
{
    constexpr unsigned n = sizeof(T);
#pragma unroll
    for (unsigned m = 0; m < 16u / n; ++m) {
        const unsigned off = m * n;
        if (off >= lo && off + n <= hi) {
            T x;
            if constexpr (n == 8) {
                x = (T)w[off / 4] | ((T)w[off / 4 + 1] << 32);
            } else {
                x = (T)(w[off / 4] >> (8u * (off % 4u)));
            }
            __stwb(reinterpret_cast<T*>(a + off), x);
        }
    }
}

// One aligned 16-byte source word: segment bytes carried in the launch's
// parameters are read with a generic load (they are not in global memory),
// everything else through the read-only data path.
template <bool kCarried>
static __device__ __forceinline__ uint4 cucopy_load16(bool from_segment, cucopy_u64 addr)
{
    if (kCarried && from_segment) {
        return *reinterpret_cast<const uint4*>(addr);
    }
    return __ldg(reinterpret_cast<const uint4*>(addr));
}

// Picks the i-th of the 8 words w0.x .. w1.w after skipping q (0..3) words.
static __device__ __forceinline__ unsigned cucopy_pick(unsigned q, unsigned a, unsigned b,
                                                       unsigned c, unsigned d)
{
    return q == 0u ? a : (q == 1u ? b : (q == 2u ? c : d));
}

// Moves windows [first, end) of job j, first, first + stride, ... for this
// thread. Each round first issues the loads of CUCOPY_UNROLL windows, then
// combines and stores them, so a thread has all its reads in flight at once.
//
// Source reads. H2D sources live in the segment, which is 16-byte aligned and
// 16-byte granular, so reading the aligned 16-byte words that hold a window's
// source bytes never leaves it: every window costs one or two vector loads and
// a funnel shift when source and destination disagree modulo 16 (the host can
// avoid that by placing data at the destination's offset modulo 16). D2D
// sources take the same path when those words lie inside the source row, and
// exact-size reads (cucopy_gather) at the row ends otherwise.
//
// kCarried: the job's segment sources lie in the launch's parameter buffer
// (cucopy_scatter_c*), read with generic loads; otherwise in global memory
// (device staging or mapped pinned memory), read through the read-only path.
template <bool kCarried>
static __device__ __forceinline__ void cucopy_run(const CucopyJob& j, cucopy_u64 first,
                                                  cucopy_u64 end, cucopy_u64 stride)
{
    if (first >= end) {
        return;
    }
    const bool fill = j.kind == CUCOPY_KIND_FILL;
    const bool from_segment = j.kind != CUCOPY_KIND_D2D;
    // Window u is window k of row r; stepping (r, k) by a constant avoids a
    // 64-bit division per window.
    cucopy_u64 r, k, dr, dk;
    if (j.rows == 1) {
        r = 0;
        k = first;
        dr = 0;
        dk = stride;
    } else {
        r = first / j.ppr;
        k = first - r * j.ppr;
        dr = stride / j.ppr;
        dk = stride - dr * j.ppr;
    }
    for (cucopy_u64 base = first; base < end; base += CUCOPY_UNROLL * stride) {
        cucopy_u8* win[CUCOPY_UNROLL];
        unsigned lo[CUCOPY_UNROLL], hi[CUCOPY_UNROLL], sh[CUCOPY_UNROLL];
        unsigned w0[CUCOPY_UNROLL][4], w1[CUCOPY_UNROLL][4];
#pragma unroll
        for (int s = 0; s < CUCOPY_UNROLL; ++s) {
            lo[s] = 16u;
            hi[s] = 0u;
            sh[s] = 0u;
            win[s] = nullptr;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                w0[s][i] = 0u;
                w1[s][i] = 0u;
            }
            if (base + (cucopy_u64)s * stride >= end) {
                continue;
            }
            const cucopy_u64 rs = j.dst + r * j.dpitch;
            const cucopy_u64 a = (rs & ~15ull) + 16ull * k;
            const cucopy_i64 lo_s = (cucopy_i64)(rs - a);
            const cucopy_i64 hi_s = (cucopy_i64)(rs + j.width - a);
            const unsigned l = lo_s > 0 ? (unsigned)lo_s : 0u;
            const unsigned h = hi_s < 16 ? (hi_s > 0 ? (unsigned)hi_s : 0u) : 16u;
            const cucopy_u64 row = r;
            k += dk;
            r += dr;
            if (k >= j.ppr && j.rows != 1) {
                k -= j.ppr;
                ++r;
            }
            if (l >= h) {
                continue;  // past the end of a row whose windows are counted by ppr's bound
            }
            lo[s] = l;
            hi[s] = h;
            win[s] = reinterpret_cast<cucopy_u8*>(a);
            if (fill) {
                const cucopy_u64 p = cucopy_pattern_at(j.pattern, rs);
                w0[s][0] = (unsigned)p;
                w0[s][1] = (unsigned)(p >> 32);
                w0[s][2] = (unsigned)p;
                w0[s][3] = (unsigned)(p >> 32);
                continue;
            }
            const cucopy_u64 rsrc = j.src + row * j.spitch;
            const cucopy_u64 sb = rsrc + (a - rs);  // source of window byte 0 (maybe virtual)
            const cucopy_u64 s0 = sb & ~15ull;
            const bool need0 = sb + l < s0 + 16ull;
            const bool need1 = sb + h > s0 + 16ull;
            const cucopy_u64 first_word = need0 ? s0 : s0 + 16ull;
            const cucopy_u64 end_word = need1 ? s0 + 32ull : s0 + 16ull;
            if (from_segment || (first_word >= rsrc && end_word <= rsrc + j.width)) {
                sh[s] = (unsigned)(sb & 15ull);
                if (need0) {
                    const uint4 x = cucopy_load16<kCarried>(from_segment, s0);
                    w0[s][0] = x.x;
                    w0[s][1] = x.y;
                    w0[s][2] = x.z;
                    w0[s][3] = x.w;
                }
                if (need1) {
                    const uint4 x = cucopy_load16<kCarried>(from_segment, s0 + 16ull);
                    w1[s][0] = x.x;
                    w1[s][1] = x.y;
                    w1[s][2] = x.z;
                    w1[s][3] = x.w;
                }
            } else {
                const cucopy_u8* p = reinterpret_cast<const cucopy_u8*>(sb);
                const unsigned g = cucopy_lowbit(l | h | (unsigned)(sb & 7ull) | 8u);
                if (g == 8u) {
                    cucopy_gather<cucopy_u64>(w0[s], p, l, h);
                } else if (g == 4u) {
                    cucopy_gather<cucopy_u32>(w0[s], p, l, h);
                } else if (g == 2u) {
                    cucopy_gather<cucopy_u16>(w0[s], p, l, h);
                } else {
                    cucopy_gather<cucopy_u8>(w0[s], p, l, h);
                }
            }
        }
#pragma unroll
        for (int s = 0; s < CUCOPY_UNROLL; ++s) {
            if (lo[s] >= hi[s]) {
                continue;
            }
            // Window byte i is byte sh + i of the 32 bytes w0 | w1.
            const unsigned q = sh[s] >> 2;
            const unsigned b = (sh[s] & 3u) * 8u;
            const unsigned e0 = cucopy_pick(q, w0[s][0], w0[s][1], w0[s][2], w0[s][3]);
            const unsigned e1 = cucopy_pick(q, w0[s][1], w0[s][2], w0[s][3], w1[s][0]);
            const unsigned e2 = cucopy_pick(q, w0[s][2], w0[s][3], w1[s][0], w1[s][1]);
            const unsigned e3 = cucopy_pick(q, w0[s][3], w1[s][0], w1[s][1], w1[s][2]);
            const unsigned e4 = cucopy_pick(q, w1[s][0], w1[s][1], w1[s][2], w1[s][3]);
            unsigned v[4];
            v[0] = __funnelshift_r(e0, e1, b);
            v[1] = __funnelshift_r(e1, e2, b);
            v[2] = __funnelshift_r(e2, e3, b);
            v[3] = __funnelshift_r(e3, e4, b);
            if (lo[s] == 0u && hi[s] == 16u) {
                __stwb(reinterpret_cast<uint4*>(win[s]), make_uint4(v[0], v[1], v[2], v[3]));
                continue;
            }
            const unsigned g = cucopy_lowbit(lo[s] | hi[s] | 8u);
            if (g == 8u) {
                cucopy_put<cucopy_u64>(win[s], v, lo[s], hi[s]);
            } else if (g == 4u) {
                cucopy_put<cucopy_u32>(win[s], v, lo[s], hi[s]);
            } else if (g == 2u) {
                cucopy_put<cucopy_u16>(win[s], v, lo[s], hi[s]);
            } else {
                cucopy_put<cucopy_u8>(win[s], v, lo[s], hi[s]);
            }
        }
    }
}

// Block b's share of descriptor d, whose blocks run up to next_start (or all of
// it, whole: the segment gives each descriptor one block); segment offsets in d
// are relative to seg (an address in global memory, or in the launch's
// parameter buffer when kCarried).
template <bool kCarried>
static __device__ __forceinline__ void cucopy_apply(const CucopyDesc& d, cucopy_u32 next_start,
                                                    cucopy_u64 seg, cucopy_u32 b, bool whole)
{
    const cucopy_u32 kind = d.kind;
    CucopyJob j;
    if (!cucopy_job_init(j, kind, d.dst, kind == CUCOPY_KIND_D2D ? d.src : seg + d.src, d.value,
                         d.dst_pitch, d.src_pitch, d.width, d.rows, d.elem)) {
        return;
    }
    const cucopy_u64 total = j.rows * j.ppr;
    cucopy_u64 begin = 0, end = total;
    if (!whole) {
        const cucopy_u32 first_block = d.block_start;
        const cucopy_u32 nb = next_start > first_block ? next_start - first_block : 1u;
        const cucopy_u64 per = (total + nb - 1u) / nb;
        begin = min(total, (cucopy_u64)(b - first_block) * per);
        end = min(total, begin + per);
    }
    cucopy_run<kCarried>(j, begin + threadIdx.x, end, CUCOPY_THREADS);
}

// Launch: grid = header.nblocks (the value pack.encode returns), block =
// CUCOPY_THREADS (pack.THREADS), no dynamic shared memory. seg is the
// segment's device address: device staging memory ("dma" mode) or the device
// pointer of mapped pinned host memory ("mapped" mode), 16-byte aligned.
//
// In mapped mode every dependent read of the segment is a PCIe round trip, so
// a block reads it in as few rounds as it can: (1) the header (and, for a
// one-block launch, descriptor 0 beside it: nothing else to look up); (2) the
// whole descriptor table when it has at most CUCOPY_TABLE_MAX entries, from
// which __syncthreads_count over block_start <= blockIdx.x gives the owner;
// larger tables take a 256-way search over block_start per round, then one
// read of the descriptor; (3) the data. The table is re-read by every block,
// 48 bytes a descriptor: for mapped segments with many descriptors and many
// blocks, "dma" mode (one bulk copy, then L2-resident reads) is cheaper.
// Kernel time on an H200 (CUDA-graph launches, device memory / mapped), from a
// development run that was not stored, so leads rather than results: one 4-byte
// copy 1.9 / 3.7 us; 32 x 64 B 2.1 / 11.4 us; 300 x 16 B 4.6 / 49 us. The stored
// step timings are in bench/results/2026-11-30-h200-run2.
//
// Blocks [block_start_i, block_start_{i+1}) share descriptor i; its windows
// (rows x windows per row) are split evenly between them, so the kernel is
// correct for any block count the host picks. Narrow 2-D copies have many
// more windows than bytes / 16, which is why pack.blocks_for counts windows
// (in the same unstored run, 4096 rows of 4 bytes took 18.5 us on one block and
// 2.5 us on 32).
// Block b's work of the segment at seg, read from memory as above (`single`: the
// launch has one block, so descriptor 0 is read beside the header). Every thread of
// the block calls it with the same b.
static __device__ __forceinline__ void cucopy_memory_block(const unsigned char* __restrict__ seg,
                                                           const unsigned b, const bool single)
{
    __shared__ __align__(16) CucopyDesc s_table[CUCOPY_TABLE_MAX];
    __shared__ cucopy_u32 s_head[4];  // ndesc, nblocks, desc_offset, valid

    const unsigned t = threadIdx.x;

    if (t == 0u) {
        const uint4 h0 = __ldg(reinterpret_cast<const uint4*>(seg));
        const uint4 h1 = __ldg(reinterpret_cast<const uint4*>(seg + 16));
        s_head[0] = h0.z;  // ndesc
        s_head[1] = h0.w;  // nblocks
        s_head[2] = h1.x;  // desc_offset
        s_head[3] = h0.x == CUCOPY_MAGIC && (h0.y & 0xffffu) == CUCOPY_VERSION
                    && (h1.x & 15u) == 0u && h1.x >= CUCOPY_HEADER_BYTES;
    } else if (single && t < 4u) {
        // Speculative: pack.encode always puts the table right after the
        // header, and a launchable segment holds at least one descriptor.
        reinterpret_cast<uint4*>(s_table)[t - 1u] =
            __ldg(reinterpret_cast<const uint4*>(seg + CUCOPY_HEADER_BYTES) + (t - 1u));
    }
    __syncthreads();
    const cucopy_u32 n = s_head[0];
    const cucopy_u32 nblocks = s_head[1];
    const cucopy_u32 doff = s_head[2];
    if (!s_head[3] || n == 0u || b >= nblocks) {
        return;
    }
    const cucopy_u8* table = seg + doff;

    const CucopyDesc* d;
    cucopy_u32 next_start;
    if (single && n == 1u && doff == CUCOPY_HEADER_BYTES) {
        d = &s_table[0];
        next_start = nblocks;
    } else if (n <= CUCOPY_TABLE_MAX) {
        const unsigned words = n * (CUCOPY_DESC_BYTES / 16u);
#pragma unroll
        for (unsigned i = 0; i < CUCOPY_DESC_BYTES / 16u; ++i) {
            const unsigned w = t + i * CUCOPY_THREADS;
            if (w < words) {
                reinterpret_cast<uint4*>(s_table)[w] =
                    __ldg(reinterpret_cast<const uint4*>(table) + w);
            }
        }
        __syncthreads();
        const unsigned owner = __syncthreads_count(t < n && s_table[t].block_start <= b);
        if (owner == 0u) {
            return;  // block_start[0] != 0: not a segment pack.encode wrote
        }
        d = &s_table[owner - 1u];
        next_start = owner < n ? s_table[owner].block_start : nblocks;
    } else {
        // Invariant: block_start[lo] <= b, and the owner lies in [lo, hi).
        cucopy_u32 lo = 0u, hi = n;
        while (hi - lo > 1u) {
            const cucopy_u32 step = (hi - lo + CUCOPY_THREADS - 1u) / CUCOPY_THREADS;
            const cucopy_u32 i = lo + t * step;
            bool below = false;
            if (i < hi) {
                below = __ldg(reinterpret_cast<const cucopy_u32*>(
                            table + (cucopy_u64)i * CUCOPY_DESC_BYTES + 44u)) <= b;
            }
            const unsigned c = __syncthreads_count(below);
            if (c == 0u) {
                return;  // block_start[0] != 0: not a segment pack.encode wrote
            }
            lo += (c - 1u) * step;
            hi = min(hi, lo + step);
        }
        if (t < 3u) {
            reinterpret_cast<uint4*>(s_table)[t] =
                __ldg(reinterpret_cast<const uint4*>(table + (cucopy_u64)lo * CUCOPY_DESC_BYTES) + t);
        } else if (t == 3u) {
            s_head[0] = lo + 1u < n ? __ldg(reinterpret_cast<const cucopy_u32*>(
                                          table + (cucopy_u64)(lo + 1u) * CUCOPY_DESC_BYTES + 44u))
                                    : nblocks;
        }
        __syncthreads();
        d = &s_table[0];
        next_start = s_head[0];
    }

    cucopy_apply<false>(*d, next_start, reinterpret_cast<cucopy_u64>(seg), b, false);
}

#if CUCOPY_BUILDS(0)
extern "C" __global__ void __launch_bounds__(CUCOPY_THREADS)
cucopy_scatter(const unsigned char* __restrict__ seg)
{
    cucopy_memory_block(seg, blockIdx.x, gridDim.x == 1u);
}
#endif

// Standalone fill of `rows` rows of `width` bytes, `dpitch` apart, with the
// `elem`-byte (1, 2, 4 or 8) little-endian pattern `value`; for CUDA graph
// capture, where no segment exists. Any grid is correct (grid-stride loop);
// block = CUCOPY_THREADS. Suggested grid: min(max(1, ceil(rows * width /
// 16384)), 1024), i.e. one block per pack.BLOCK_BYTES like the scatter, capped
// where the grid stride already covers a few waves of an H200's 132 SMs.
#if CUCOPY_BUILDS(1)
extern "C" __global__ void __launch_bounds__(CUCOPY_THREADS)
cucopy_fill(unsigned char* dst, unsigned long long dpitch, unsigned int width,
            unsigned int rows, unsigned long long value, unsigned int elem)
{
    CucopyJob j;
    if (!cucopy_job_init(j, CUCOPY_KIND_FILL, reinterpret_cast<cucopy_u64>(dst), 0ull, value,
                         dpitch, 0ull, width, rows, elem)) {
        return;
    }
    const cucopy_u64 stride = (cucopy_u64)gridDim.x * CUCOPY_THREADS;
    cucopy_run<false>(j, (cucopy_u64)blockIdx.x * CUCOPY_THREADS + threadIdx.x, j.rows * j.ppr,
                      stride);
}
#endif

// -- segments carried in the launch's parameters ------------------------------------
//
// cucopy_scatter_c<CAP>: the same segment format, but the launch's parameter
// buffer carries the segment's first `nbytes` bytes (at least the header and
// the whole descriptor table), copied by the driver when the launch is
// enqueued. A block then finds its descriptor without touching memory; in
// "mapped" mode the data is the only PCIe read left (one round trip instead of
// three). When nbytes covers the whole segment the data travels too and the
// kernel reads no staging memory at all ("inline" mode). The parameter buffer
// is snapshotted at enqueue, so the host may rewrite the pinned slot at once.
//
// Parameter layout (CucopyCarried<CAP>, 16 + CAP bytes): the segment's address
// (where bytes past nbytes are read from), nbytes, 4 reserved bytes, then the
// bytes. The host passes the buffer through CU_LAUNCH_PARAM_BUFFER_POINTER and
// picks the smallest CAP that holds what it carries: the driver copies all
// 16 + CAP bytes of each launch. Buffers over 4 KiB need CUDA 12.1 or later.
#define CUCOPY_CARRY_PREFIX 16u

template <unsigned CAP>
struct __align__(16) CucopyCarried {
    cucopy_u64 seg;
    cucopy_u32 nbytes;
    cucopy_u32 reserved;
    cucopy_u8 bytes[CAP];
};

// A 4-byte generic load from the launch's parameter buffer (addr from the
// generic address of a __grid_constant__ parameter).
static __device__ __forceinline__ cucopy_u32 cucopy_param_u32(cucopy_u64 addr)
{
    return *reinterpret_cast<const cucopy_u32*>(addr);
}

// Reads of the parameter buffer are not free (the kernel_floor probe, stored in
// bench/results/2026-11-30-h200-run9 and later: 128 blocks that each read a
// 128-entry table, one descriptor a thread, then count, cost ~1 us above an
// empty launch; a uniform binary search as much). So a block first tries the
// common layout: header and descriptor b, read together with warp-uniform
// loads (one broadcast each), one round; then only the data's reads diverge. Other
// segments (a descriptor spanning several blocks, a table placed elsewhere) find
// the owner as before: up to CUCOPY_THREADS descriptors, thread t reads
// descriptor t and one barrier count names it; larger tables take a 32-way
// search per warp.
//
// Block b's work, given the carried bytes at `bytes` (`have` of at most CAP of
// them, read with generic loads: a launch's parameter buffer, or a graph feed's
// mailbox entry in mapped memory) and the whole segment at `seg`. Every thread
// of the block calls it with the same b.
template <unsigned CAP>
static __device__ __forceinline__ void cucopy_carried_block(const cucopy_u8* bytes,
                                                            cucopy_u32 have, cucopy_u64 seg,
                                                            cucopy_u32 b)
{
    constexpr unsigned kFit = (CAP - CUCOPY_HEADER_BYTES) / CUCOPY_DESC_BYTES;
    static_assert(kFit >= 1u, "a carried buffer holds the header and one descriptor");
    __shared__ __align__(16) CucopyDesc s_desc;
    __shared__ cucopy_u32 s_next;
    const unsigned t = threadIdx.x;
    const cucopy_u64 base = reinterpret_cast<cucopy_u64>(bytes);
    const CucopyDesc* const table = reinterpret_cast<const CucopyDesc*>(bytes + CUCOPY_HEADER_BYTES);
    // speculative, and inside the buffer whatever b is: descriptor b
    const CucopyDesc mine = table[b < kFit ? b : kFit - 1u];
    if (have < CUCOPY_HEADER_BYTES || have > CAP) {
        return;
    }
    const CucopyHeader& h = *reinterpret_cast<const CucopyHeader*>(bytes);
    const cucopy_u32 n = h.ndesc;
    const cucopy_u32 nblocks = h.nblocks;
    const cucopy_u32 doff = h.desc_offset;
    if (h.magic != CUCOPY_MAGIC || h.version != CUCOPY_VERSION || (doff & 15u) != 0u
        || doff < CUCOPY_HEADER_BYTES || n == 0u || b >= nblocks
        || (cucopy_u64)doff + (cucopy_u64)n * CUCOPY_DESC_BYTES > have) {
        return;  // not a segment pack.encode wrote, or its table did not travel whole
    }
    alignas(16) CucopyDesc d;
    uint4* dw = reinterpret_cast<uint4*>(&d);
    cucopy_u32 next_start = nblocks;
    // Every descriptor owns exactly one block (pack.split makes this the common
    // case): block b runs all of descriptor b, whatever its block_start says.
    const bool whole = doff == CUCOPY_HEADER_BYTES && n == nblocks;
    if (whole) {
        d = mine;  // b < n and the table lies inside the buffer, so b < kFit
    } else if (doff == CUCOPY_HEADER_BYTES && n <= CUCOPY_THREADS) {
        // the table lies inside the buffer (n <= kFit); block_start is the last
        // word of a descriptor (offset 44)
        uint4 w0 = make_uint4(0u, 0u, 0u, 0u), w1 = w0, w2 = w0;
        if (t < n) {
            const uint4* e = reinterpret_cast<const uint4*>(
                base + CUCOPY_HEADER_BYTES + (cucopy_u64)t * CUCOPY_DESC_BYTES);
            w0 = e[0];
            w1 = e[1];
            w2 = e[2];
        }
        const cucopy_u32 owner = __syncthreads_count(t < n && w2.w <= b);
        if (owner == 0u) {
            return;  // block_start[0] != 0: not a segment pack.encode wrote
        }
        if (t + 1u == owner) {
            uint4* sd = reinterpret_cast<uint4*>(&s_desc);
            sd[0] = w0;
            sd[1] = w1;
            sd[2] = w2;
        } else if (t == owner) {
            s_next = w2.w;
        }
        __syncthreads();
        const uint4* sd = reinterpret_cast<const uint4*>(&s_desc);
        dw[0] = sd[0];
        dw[1] = sd[1];
        dw[2] = sd[2];
        next_start = owner < n ? s_next : nblocks;
    } else {
        // The owner: the last descriptor whose block_start <= b, by a 32-way
        // search in which each lane reads one candidate (block_start[lo] <= b
        // holds throughout); every warp runs it alike. Up to 32 descriptors
        // take one round, up to 1024 two.
        const cucopy_u64 tbl = base + doff;
        const unsigned lane = t & 31u;
        if (cucopy_param_u32(tbl + 44u) > b) {
            return;  // block_start[0] != 0: not a segment pack.encode wrote
        }
        cucopy_u32 lo = 0u, hi = n;
        while (hi - lo > 1u) {
            const cucopy_u32 step = (hi - lo + 31u) >> 5;
            const cucopy_u32 i = lo + lane * step;
            const bool below =
                i < hi && cucopy_param_u32(tbl + (cucopy_u64)i * CUCOPY_DESC_BYTES + 44u) <= b;
            const unsigned c = __popc(__ballot_sync(0xffffffffu, below));
            if (c == 0u) {
                return;  // block_start not ascending: not a segment pack.encode wrote
            }
            lo += (c - 1u) * step;
            hi = min(hi, lo + step);
        }
        const uint4* src = reinterpret_cast<const uint4*>(tbl + (cucopy_u64)lo * CUCOPY_DESC_BYTES);
        dw[0] = src[0];
        dw[1] = src[1];
        dw[2] = src[2];
        next_start = lo + 1u < n
                         ? cucopy_param_u32(tbl + (cucopy_u64)(lo + 1u) * CUCOPY_DESC_BYTES + 44u)
                         : nblocks;
    }
    if (h.total_bytes <= have) {
        cucopy_apply<true>(d, next_start, base, b, whole);
    } else {
        cucopy_apply<false>(d, next_start, seg, b, whole);
    }
}

// One entry point per capacity (pack.CARRY_CAPACITIES): parameter buffers of 1,
// 2, 4 and 6 KiB, then 2 KiB steps up to 32 KiB, the last just under CUDA's
// 32764-byte limit. Those over 4 KiB need CUDA 12.1 or later.
#define CUCOPY_CARRIED_ENTRY(NAME, CAP)                                               \
    extern "C" __global__ void __launch_bounds__(CUCOPY_THREADS)                      \
    NAME(const __grid_constant__ CucopyCarried<CAP> p)                                \
    {                                                                                 \
        cucopy_carried_block<CAP>(p.bytes, p.nbytes, p.seg, blockIdx.x);              \
    }

#if CUCOPY_BUILDS(2)
CUCOPY_CARRIED_ENTRY(cucopy_scatter_c1k, 1008)
#endif
#if CUCOPY_BUILDS(3)
CUCOPY_CARRIED_ENTRY(cucopy_scatter_c2k, 2032)
#endif
#if CUCOPY_BUILDS(4)
CUCOPY_CARRIED_ENTRY(cucopy_scatter_c4k, 4080)
#endif
#if __CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 1)
#if CUCOPY_BUILDS(5)
CUCOPY_CARRIED_ENTRY(cucopy_scatter_c6k, 6128)
#endif
#if CUCOPY_BUILDS(6)
CUCOPY_CARRIED_ENTRY(cucopy_scatter_c8k, 8176)
#endif
#if CUCOPY_BUILDS(7)
CUCOPY_CARRIED_ENTRY(cucopy_scatter_c10k, 10224)
#endif
#if CUCOPY_BUILDS(8)
CUCOPY_CARRIED_ENTRY(cucopy_scatter_c12k, 12272)
#endif
#if CUCOPY_BUILDS(9)
CUCOPY_CARRIED_ENTRY(cucopy_scatter_c14k, 14320)
#endif
#if CUCOPY_BUILDS(10)
CUCOPY_CARRIED_ENTRY(cucopy_scatter_c16k, 16368)
#endif
#if CUCOPY_BUILDS(11)
CUCOPY_CARRIED_ENTRY(cucopy_scatter_c18k, 18416)
#endif
#if CUCOPY_BUILDS(12)
CUCOPY_CARRIED_ENTRY(cucopy_scatter_c20k, 20464)
#endif
#if CUCOPY_BUILDS(13)
CUCOPY_CARRIED_ENTRY(cucopy_scatter_c22k, 22512)
#endif
#if CUCOPY_BUILDS(14)
CUCOPY_CARRIED_ENTRY(cucopy_scatter_c24k, 24560)
#endif
#if CUCOPY_BUILDS(15)
CUCOPY_CARRIED_ENTRY(cucopy_scatter_c26k, 26608)
#endif
#if CUCOPY_BUILDS(16)
CUCOPY_CARRIED_ENTRY(cucopy_scatter_c28k, 28656)
#endif
#if CUCOPY_BUILDS(17)
CUCOPY_CARRIED_ENTRY(cucopy_scatter_c30k, 30704)
#endif
#if CUCOPY_BUILDS(18)
CUCOPY_CARRIED_ENTRY(cucopy_scatter_c32k, 32736)
#endif
#endif

// -- graph feeds -----------------------------------------------------------------------
//
// cucopy_scatter_feed: the scatter as a node of an engine's own CUDA graph
// (DeviceCopier.capture_inputs), captured once with fixed parameters, fed each
// step through a mailbox in mapped pinned memory (pack.py, "Graph feeds").
// Replay r of feed f (r = 1, 2, ..., counted here, in device memory) reads
// entry r % entries and applies it only when the entry's tag is r: the host
// writes an entry for the replay it is about to launch, so a replay that no
// step was posted for (tag of an older replay, or 0) lands nothing, and one
// launched before the host posted a later step never takes that step's
// bytes. The parameters never change, so a step costs the host no driver call.
//
// The grid is fixed at capture: block b runs virtual blocks b, b + gridDim.x,
// ... of the segment's nblocks. The last block to finish advances the replay
// counter (every block has read it by then) and stores it at `status` (mapped
// memory the host reads to notice replays it did not issue).
#define CUCOPY_FEED_HEAD 32u
#define CUCOPY_FEED_ENTRY_BYTES 16384u
#define CUCOPY_FEED_CAPACITY (CUCOPY_FEED_ENTRY_BYTES - CUCOPY_FEED_HEAD)
#define CUCOPY_FEED_MAX 4096u
#define CUCOPY_FEED_LANE 64u

// pack.FEED_ENTRY_DTYPE
struct CucopyFeedEntry {
    cucopy_u64 tag;
    cucopy_u64 seg;
    cucopy_u32 nbytes;
    cucopy_u32 reserved;
    cucopy_u64 reserved2;
};

#if CUCOPY_BUILDS(19)
// Zero when the module loads; the host hands out each index once per process.
__device__ cucopy_u64 cucopy_feed_replays[CUCOPY_FEED_MAX];
__device__ cucopy_u32 cucopy_feed_done[CUCOPY_FEED_MAX];
#endif

#if CUCOPY_BUILDS(19)
extern "C" __global__ void __launch_bounds__(CUCOPY_THREADS)
cucopy_scatter_feed(const unsigned char* __restrict__ box, unsigned int entries,
                    unsigned int feed, unsigned long long* status)
{
    // The entry is read once per block into shared memory with wide loads, all at
    // once: a read of mapped memory crosses the bus (~1 us), and the first build,
    // where every thread read the head and the table in place, made dependent reads
    // that queued behind each other, ~25 us a block (run 28, graph_feed.log).
    __shared__ __align__(16) cucopy_u8 s_entry[CUCOPY_FEED_ENTRY_BYTES];
    __shared__ cucopy_u64 s_replay;
    const unsigned t = threadIdx.x;
    if (feed >= CUCOPY_FEED_MAX || entries == 0u) {
        return;
    }
    if (t == 0u) {
        s_replay = *reinterpret_cast<volatile cucopy_u64*>(&cucopy_feed_replays[feed]) + 1ull;
    }
    __syncthreads();
    const cucopy_u64 r = s_replay;
    const uint4* e = reinterpret_cast<const uint4*>(
        box + (r % entries) * (cucopy_u64)CUCOPY_FEED_ENTRY_BYTES);
    // Round one, a load a thread, all at once (__ldcv: fetched again, never from a
    // cache: the host rewrites entries): the entry's head and the segment's header
    // (4 words, from the block's lane), and this block's descriptor where a one-descriptor-a-block table
    // puts it (3 words). A segment that needs more (a table with block starts, or
    // more blocks than the grid) loads its whole table in a second round.
    constexpr unsigned kHeadWords = (CUCOPY_FEED_HEAD + CUCOPY_HEADER_BYTES) / 16u;
    const unsigned mine = (CUCOPY_FEED_HEAD + CUCOPY_HEADER_BYTES
                           + blockIdx.x * CUCOPY_DESC_BYTES) / 16u;
    constexpr unsigned kWords = CUCOPY_FEED_ENTRY_BYTES / 16u;
    uint4* sw = reinterpret_cast<uint4*>(s_entry);
    // the head and header from this block's own lane (pack.py, Graph feeds): reads of
    // one address of mapped memory from many blocks queue behind each other
    const uint4* lane = reinterpret_cast<const uint4*>(
        box + (cucopy_u64)entries * CUCOPY_FEED_ENTRY_BYTES
        + ((r % entries) * gridDim.x + blockIdx.x) * (cucopy_u64)CUCOPY_FEED_LANE);
    if (t < kHeadWords) {
        sw[t] = __ldcv(lane + t);
    } else if (t < kHeadWords + 3u && mine + (t - kHeadWords) < kWords) {
        sw[mine + (t - kHeadWords)] = __ldcv(e + mine + (t - kHeadWords));
    }
    __syncthreads();
    const CucopyFeedEntry* hp = reinterpret_cast<const CucopyFeedEntry*>(s_entry);
    const cucopy_u64 tag = hp->tag;
    const cucopy_u64 seg = hp->seg;
    const cucopy_u32 have = hp->nbytes;
    if (tag == r && have >= CUCOPY_HEADER_BYTES && have <= CUCOPY_FEED_CAPACITY) {
        const CucopyHeader* h = reinterpret_cast<const CucopyHeader*>(s_entry + CUCOPY_FEED_HEAD);
        const bool one_round = h->desc_offset == CUCOPY_HEADER_BYTES && h->ndesc == h->nblocks
                               && h->nblocks <= gridDim.x;
        if (!one_round) {
            const unsigned words = (CUCOPY_FEED_HEAD + have + 15u) / 16u;
            for (unsigned i = kHeadWords + t; i < words; i += CUCOPY_THREADS) {
                sw[i] = __ldcv(e + i);
            }
        }
        __syncthreads();
        const cucopy_u8* bytes = s_entry + CUCOPY_FEED_HEAD;
        const cucopy_u32 nblocks = reinterpret_cast<const CucopyHeader*>(bytes)->nblocks;
        for (cucopy_u32 vb = blockIdx.x; vb < nblocks; vb += gridDim.x) {
            cucopy_carried_block<CUCOPY_FEED_CAPACITY>(bytes, have, seg, vb);
            __syncthreads();  // the next round reuses the block's shared descriptor
        }
    }
    __syncthreads();
    if (t == 0u) {
        __threadfence();
        const cucopy_u32 done = atomicAdd(&cucopy_feed_done[feed], 1u);
        if (done + 1u == gridDim.x) {
            cucopy_feed_done[feed] = 0u;
            cucopy_feed_replays[feed] = r;
            __threadfence();
            if (status != nullptr) {
                *reinterpret_cast<volatile cucopy_u64*>(status) = r;
                __threadfence_system();
            }
        }
    }
}
#endif

// -- graphed segments --------------------------------------------------------------------
//
// cucopy_scatter_w8k: the scatter as the one kernel node of a small CUDA graph the host
// makes once per segment address (a ring slot's offset 0, usually) and then launches
// as made (cuGraphLaunch: about half the host time of cuLaunchKernel on an H200's host,
// bench/results/2026-12-02-h200-probes-session11). Its parameters never change, so the
// step's bytes cannot travel in them: the block reads the first CUCOPY_GRAPH_CAP bytes
// at seg (mapped pinned memory) into shared memory in one round, all its loads in
// flight at once, then runs every block of the segment from there as the carried
// kernel does from its parameters. A segment of up to four times that (CUCOPY_GRAPH_MAX)
// is read whole as well: the rest in a second round, all its loads in flight at once,
// once the header read in the first says the segment goes on. A segment longer still is
// correct (the rest is read from seg), only slower. pack.GRAPH_CAPACITY and
// pack.GRAPH_ROUNDS; the host keeps the bytes read (pack.graph_reach: all
// CUCOPY_GRAPH_CAP, or the whole of a longer segment, rounded up to 16) readable, and
// unwritten until the launch completes.
// Launch: grid 1 (any grid is correct: block b runs blocks b, b + gridDim.x, ...),
// block CUCOPY_THREADS.
//
// The completion tag (cell: pack.TAG_AT, the slot's headroom): with cell non-null the
// kernel's last act is to copy cell[0] (the step the host armed it with before the
// launch, read in the first round with the segment) to cell[1], once every thread's
// reads of the slot are done (the barrier) and behind a system fence. The host reads
// cell[1] to know the slot is free to rewrite, instead of recording and querying an
// event (a driver call each, several microseconds each on a host whose caches are
// cold). Only a grid of one block writes it, as the graphs the host makes are; a larger
// grid would need its last block to write it, and nothing launches one.
//
// CUCOPY_GRAPH_SPREAD: how the segment's descriptors share the block when it all sits in
// shared memory. 0: one warp a descriptor (a 4 KiB descriptor is 8 windows a lane, one
// after another). 1: the whole block runs each descriptor in turn, each descriptor's
// first window on the next warp. No barrier either way: nothing is written to shared
// memory past the first. bench/probes/graph_kernel.py builds both (and other
// capacities) to compare them on a GPU: on an H200 at N = 8, 6.26 us of GPU time a
// step for 0 against 6.51 for 1, and a 32 KiB read took 7.1 at N = 8 and 12.8 at
// N = 32 (one block scattering 20 KB; session 12).
#ifndef CUCOPY_GRAPH_CAP
#define CUCOPY_GRAPH_CAP 8192u
#endif
#ifndef CUCOPY_GRAPH_SPREAD
#define CUCOPY_GRAPH_SPREAD 0
#endif
// The most a segment read whole may be: four rounds' worth (pack.GRAPH_ROUNDS), in 32
// KiB of static shared memory; a capacity over 8 KiB, which bench/probes/graph_kernel.py
// can build, reads less (a block has 48 KiB of static shared memory)
#define CUCOPY_GRAPH_MAX                                                                   \
    (CUCOPY_GRAPH_CAP <= 8192u    ? 4u * CUCOPY_GRAPH_CAP                                   \
     : CUCOPY_GRAPH_CAP <= 16384u ? 2u * CUCOPY_GRAPH_CAP                                   \
                                  : CUCOPY_GRAPH_CAP)
static_assert(CUCOPY_GRAPH_CAP % (16u * CUCOPY_THREADS) == 0u, "whole rounds of 16-byte loads");

// The segment at seg, its first have bytes already in s_bytes (see above: at least
// CUCOPY_GRAPH_CAP, at most CUCOPY_GRAPH_MAX). Every thread of the block calls it; it
// returns at the same point for all of them.
static __device__ __forceinline__ void cucopy_graph_run(const unsigned char* __restrict__ seg,
                                                        cucopy_u8* s_bytes, cucopy_u32 have)
{
    const CucopyHeader& h = *reinterpret_cast<const CucopyHeader*>(s_bytes);
    const cucopy_u32 n = h.ndesc;
    const cucopy_u32 nblocks = h.nblocks;
    const cucopy_u32 doff = h.desc_offset;
    if (h.magic != CUCOPY_MAGIC || h.version != CUCOPY_VERSION || (doff & 15u) != 0u
        || doff < CUCOPY_HEADER_BYTES || n == 0u) {
        return;  // not a segment pack.encode wrote (a slot rewritten too early)
    }
    const cucopy_u64 base = reinterpret_cast<cucopy_u64>(s_bytes);
    if (h.total_bytes <= have && doff == CUCOPY_HEADER_BYTES && n == nblocks) {
        // The copier's case: all of it in shared memory, one block's work a descriptor
        // (pack.split); shared by the block's threads as CUCOPY_GRAPH_SPREAD says.
        const CucopyDesc* table = reinterpret_cast<const CucopyDesc*>(s_bytes + doff);
#if CUCOPY_GRAPH_SPREAD
        for (cucopy_u32 i = blockIdx.x; i < n; i += gridDim.x) {
            const CucopyDesc& d = table[i];
            CucopyJob j;
            if (!cucopy_job_init(j, d.kind, d.dst, d.kind == CUCOPY_KIND_D2D ? d.src : base + d.src,
                                 d.value, d.dst_pitch, d.src_pitch, d.width, d.rows, d.elem)) {
                continue;
            }
            // window w of descriptor i falls to thread (w + 32 i) mod CUCOPY_THREADS
            const unsigned rot = (i * 32u) % CUCOPY_THREADS;
            const unsigned t = (threadIdx.x + CUCOPY_THREADS - rot) % CUCOPY_THREADS;
            cucopy_run<true>(j, t, j.rows * j.ppr, CUCOPY_THREADS);
        }
#else
        const unsigned lane = threadIdx.x & 31u;
        for (cucopy_u32 i = blockIdx.x * (CUCOPY_THREADS / 32u) + threadIdx.x / 32u; i < n;
             i += gridDim.x * (CUCOPY_THREADS / 32u)) {
            const CucopyDesc& d = table[i];
            CucopyJob j;
            if (!cucopy_job_init(j, d.kind, d.dst, d.kind == CUCOPY_KIND_D2D ? d.src : base + d.src,
                                 d.value, d.dst_pitch, d.src_pitch, d.width, d.rows, d.elem)) {
                continue;
            }
            cucopy_run<true>(j, lane, j.rows * j.ppr, 32u);
        }
#endif
        return;
    }
    if ((cucopy_u64)doff + (cucopy_u64)n * CUCOPY_DESC_BYTES <= have) {
        // the table in shared memory: as the carried kernel, block by block
        const cucopy_u32 in_shared = h.total_bytes < have ? (cucopy_u32)h.total_bytes : have;
        for (cucopy_u32 b = blockIdx.x; b < nblocks; b += gridDim.x) {
            cucopy_carried_block<CUCOPY_GRAPH_MAX>(s_bytes, in_shared,
                                                   reinterpret_cast<cucopy_u64>(seg), b);
            __syncthreads();  // its shared descriptor is read before the next block's is written
        }
        return;
    }
    // a table past the bytes read: as the uncarried kernel, from memory
    for (cucopy_u32 b = blockIdx.x; b < nblocks; b += gridDim.x) {
        cucopy_memory_block(seg, b, false);
        __syncthreads();  // its shared header and table are read before the next block's
    }
}

#if CUCOPY_BUILDS(20)
extern "C" __global__ void __launch_bounds__(CUCOPY_THREADS)
cucopy_scatter_w8k(const unsigned char* __restrict__ seg, cucopy_u64* cell)
{
    __shared__ __align__(16) cucopy_u8 s_bytes[CUCOPY_GRAPH_MAX];
    constexpr unsigned kRounds = CUCOPY_GRAPH_CAP / 16u / CUCOPY_THREADS;
    uint4 w[kRounds];
#pragma unroll
    for (unsigned i = 0; i < kRounds; ++i) {
        w[i] = __ldg(reinterpret_cast<const uint4*>(seg) + threadIdx.x + i * CUCOPY_THREADS);
    }
    // the step the host armed the tag with: in flight with the segment's loads (__ldcv:
    // fetched again, never from a cache: the host rewrites it every step)
    const bool tags = cell != nullptr && gridDim.x == 1u && threadIdx.x == 0u;
    const cucopy_u64 armed = tags ? __ldcv(cell) : 0ull;
#pragma unroll
    for (unsigned i = 0; i < kRounds; ++i) {
        reinterpret_cast<uint4*>(s_bytes)[threadIdx.x + i * CUCOPY_THREADS] = w[i];
    }
    __syncthreads();
    // A segment longer than the first round and at most CUCOPY_GRAPH_MAX bytes (its
    // header, in the first round, says so): the rest, to its end rounded up to 16, in a
    // second round, every load of it issued before the first is stored. Every thread
    // reads the same header, so all take the same branch.
    cucopy_u32 have = CUCOPY_GRAPH_CAP;
    {
        // (a kernel with no second round has one load a thread here, never taken)
        constexpr unsigned kMore = CUCOPY_GRAPH_MAX > CUCOPY_GRAPH_CAP
                                       ? (CUCOPY_GRAPH_MAX - CUCOPY_GRAPH_CAP) / 16u / CUCOPY_THREADS
                                       : 1u;
        const CucopyHeader& h = *reinterpret_cast<const CucopyHeader*>(s_bytes);
        const cucopy_u64 total = h.total_bytes;
        if (h.magic == CUCOPY_MAGIC && total > CUCOPY_GRAPH_CAP && total <= CUCOPY_GRAPH_MAX) {
            const cucopy_u32 end16 = (cucopy_u32)((total + 15u) / 16u);
            uint4 m[kMore];
#pragma unroll
            for (unsigned i = 0; i < kMore; ++i) {
                const cucopy_u32 k = CUCOPY_GRAPH_CAP / 16u + threadIdx.x + i * CUCOPY_THREADS;
                if (k < end16) m[i] = __ldg(reinterpret_cast<const uint4*>(seg) + k);
            }
#pragma unroll
            for (unsigned i = 0; i < kMore; ++i) {
                const cucopy_u32 k = CUCOPY_GRAPH_CAP / 16u + threadIdx.x + i * CUCOPY_THREADS;
                if (k < end16) reinterpret_cast<uint4*>(s_bytes)[k] = m[i];
            }
            have = end16 * 16u;
            __syncthreads();
        }
    }
    cucopy_graph_run(seg, s_bytes, have);
    if (cell != nullptr) {
        __syncthreads();  // every thread's reads of the segment have completed
        if (tags) {
            __threadfence_system();  // and so have its writes, for any reader of the tag
            *reinterpret_cast<volatile cucopy_u64*>(cell + 1) = armed;
        }
    }
}
#endif
