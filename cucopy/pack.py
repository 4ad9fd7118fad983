"""The segment wire format: ``header | descriptors | data``.

This module is the one definition of the layout. ``kernels/scatter.cu``
mirrors it with C structs, the simulated device decodes it with
:func:`decode`, and ``tests/test_pack.py`` checks sizes and offsets of both.

A segment is 16-byte aligned. Offsets in the header and in H2D descriptors are
bytes from the start of the segment, so the same bytes work wherever the
segment is read from (device staging memory in ``dma`` mode, mapped pinned
memory in ``mapped`` mode).

Each descriptor owns a run of thread blocks ``[block_start, next.block_start)``
(the last one up to ``header.nblocks``); :func:`encode` sizes the runs like
:func:`blocks_for`, so a 64 KiB table is spread over several blocks while a
4-byte vector takes one. The copier cuts wider descriptors with :func:`split`
before it flushes, so that nearly every segment gives each descriptor exactly
one block (``ndesc == nblocks``) and the kernel reads block ``b``'s descriptor
directly; any other block layout stays valid.
"""

from __future__ import annotations

import struct

import numpy as np

__all__ = [
    "MAGIC",
    "VERSION",
    "HEADER_DTYPE",
    "DESC_DTYPE",
    "HEADER_BYTES",
    "DESC_BYTES",
    "ALIGN",
    "KIND_H2D",
    "KIND_H2D_2D",
    "KIND_D2D",
    "KIND_FILL",
    "BLOCK_BYTES",
    "THREADS",
    "align",
    "blocks_for",
    "split",
    "encode",
    "decode",
    "FEED_ENTRY_DTYPE",
    "FEED_ENTRY_BYTES",
    "FEED_HEAD_BYTES",
    "FEED_CAPACITY",
    "FEED_LANE_BYTES",
    "FEED_STATUS_BYTES",
    "FEED_ENTRY_POINT",
    "GRAPH_CAPACITY",
    "GRAPH_ROUNDS",
    "AUTO_GRAPH_ROUNDS",
    "graph_max",
    "graph_reach",
    "GRAPH_ENTRY_POINT",
    "TAG_AT",
    "TAG_BYTES",
    "FEED_MAX",
]

MAGIC = 0x59504343  # b"CCPY" little-endian
VERSION = 1

HEADER_DTYPE = np.dtype(
    [
        ("magic", "<u4"),
        ("version", "<u2"),
        ("header_bytes", "<u2"),
        ("ndesc", "<u4"),
        ("nblocks", "<u4"),
        ("desc_offset", "<u4"),
        ("data_offset", "<u4"),
        ("total_bytes", "<u8"),
    ]
)

DESC_DTYPE = np.dtype(
    [
        ("dst", "<u8"),  # device address of the first destination byte
        ("src", "<u8"),  # H2D: offset of the data in the segment; D2D: device address
        ("value", "<u8"),  # FILL: the element's bit pattern, little-endian
        ("dst_pitch", "<u4"),  # bytes between destination rows
        ("src_pitch", "<u4"),  # bytes between source rows (H2D: == width, packed)
        ("width", "<u4"),  # bytes per row
        ("rows", "<u4"),  # rows, >= 1
        ("kind", "<u2"),
        ("elem", "<u2"),  # FILL: element size 1, 2, 4 or 8
        ("block_start", "<u4"),  # first thread block of this descriptor
    ]
)

HEADER_BYTES = HEADER_DTYPE.itemsize
DESC_BYTES = DESC_DTYPE.itemsize
ALIGN = 16

KIND_H2D = 1
KIND_H2D_2D = 2
KIND_D2D = 3
KIND_FILL = 4
KINDS = (KIND_H2D, KIND_H2D_2D, KIND_D2D, KIND_FILL)

# One thread block per 256 sixteen-byte destination windows (a row touches
# ceil(width / 16) + 1 of them at most), so a large table and a tall table of tiny
# rows are both spread over many blocks instead of one. The kernel's author timed
# this on an H200 in a run that was not stored: re-measure with a stored run before
# tuning it (bench/kernel_check.py builds such segments).
THREADS = 256
WINDOWS_PER_BLOCK = 256
BLOCK_BYTES = WINDOWS_PER_BLOCK * 16

# A descriptor's pitches, width and rows are 32-bit fields: a copy whose form
# exceeds this runs eagerly instead (the copier checks before staging).
MAX_PITCH = (1 << 32) - 1
MAX_FIELD = MAX_PITCH


def fits(rows: int, width: int, pitch: int) -> bool:
    """Whether a 2-D form's ``rows``, ``width`` and ``pitch`` fit a descriptor's fields."""
    return rows <= MAX_FIELD and width <= MAX_FIELD and pitch <= MAX_FIELD


# Carried segments (scatter.cu, cucopy_scatter_c*): a launch's parameter buffer is
# CARRY_PREFIX bytes (the segment's address, the count of bytes carried, 4 reserved)
# followed by up to one of CARRY_CAPACITIES bytes of the segment's start: at least
# its header and whole descriptor table, or all of it. CARRY_ENTRY_POINTS names the
# kernel for each capacity; those over 4 KiB need CUDA 12.1 or later. The driver
# copies a launch's whole parameter buffer and its GPU time grows with it (about
# 0.09 us per KiB above 8 KiB on the H200, bench/results/2026-11-30-h200-run7,
# param_probe), so the capacities step by 2 KiB and a launch takes the smallest
# that holds it.
CARRY_PREFIX = 16
CARRY_CAPACITIES = (
    1008,
    2032,
    4080,
    6128,
    8176,
    10224,
    12272,
    14320,
    16368,
    18416,
    20464,
    22512,
    24560,
    26608,
    28656,
    30704,
    32736,
)
CARRY_ENTRY_POINTS = (
    "cucopy_scatter_c1k",
    "cucopy_scatter_c2k",
    "cucopy_scatter_c4k",
    "cucopy_scatter_c6k",
    "cucopy_scatter_c8k",
    "cucopy_scatter_c10k",
    "cucopy_scatter_c12k",
    "cucopy_scatter_c14k",
    "cucopy_scatter_c16k",
    "cucopy_scatter_c18k",
    "cucopy_scatter_c20k",
    "cucopy_scatter_c22k",
    "cucopy_scatter_c24k",
    "cucopy_scatter_c26k",
    "cucopy_scatter_c28k",
    "cucopy_scatter_c30k",
    "cucopy_scatter_c32k",
)


def carry_capacity(nbytes: int, capacities=CARRY_CAPACITIES) -> int:
    """The smallest capacity in ``capacities`` holding ``nbytes``; 0 when none does.

    Parameters
    ----------
    nbytes : int
        Leading segment bytes a launch is to carry.
    capacities : sequence of int
        Ascending capacities on offer (a backend may offer fewer).

    Returns
    -------
    int
    """
    for cap in capacities:
        if nbytes <= cap:
            return cap
    return 0


assert HEADER_BYTES == 32 and DESC_BYTES == 48, "internal: wire format size changed"

# Graph feeds (scatter.cu, cucopy_scatter_feed; cucopy.feed): a scatter node captured
# once in an engine's CUDA graph reads, at each replay, a mailbox in mapped pinned
# memory: ``entries`` entries of FEED_ENTRY_BYTES, then FEED_STATUS_BYTES. Replay r
# (1, 2, ... counted on the device, per feed) reads entry ``r % entries`` and applies
# it only when its ``tag`` is r. An entry is its FEED_ENTRY_DTYPE head followed by
# the segment's first ``nbytes`` bytes (at least the header and the whole table, as a
# carried launch takes them); bytes past ``nbytes`` are read at ``seg`` (the ring
# slot's mapped address). After the entries come the lanes: ``entries x blocks`` of
# FEED_LANE_BYTES, lane ``(i, b)`` a copy of entry i's head and the segment's header
# for block b of the node, written for every block the segment uses (the node's
# blocks read their own lane: reads of one address of mapped memory from many blocks
# queue behind each other, ~1 us each on the H200, bench/results/2026-12-01-h200-run28).
# The status area follows: its first 8 bytes receive the device's replay count after
# each replay (how the host notices replays it did not issue).
FEED_ENTRY_DTYPE = np.dtype(
    [
        ("tag", "<u8"),  # the replay this entry is for (0: none)
        ("seg", "<u8"),  # device address of the whole segment
        ("nbytes", "<u4"),  # segment bytes copied after the head
        ("reserved", "<u4"),
        ("reserved2", "<u8"),
    ]
)
FEED_HEAD_BYTES = FEED_ENTRY_DTYPE.itemsize
FEED_ENTRY_BYTES = 16384
FEED_CAPACITY = FEED_ENTRY_BYTES - FEED_HEAD_BYTES
FEED_LANE_BYTES = 64
FEED_STATUS_BYTES = 64
FEED_ENTRY_POINT = "cucopy_scatter_feed"
#: Feeds a process may capture per device: each has a replay counter in the feed
#: kernel's module (zero when the module loads, never reused)
FEED_MAX = 4096
assert FEED_HEAD_BYTES == 32, "internal: feed entry head size changed"

# Graphed segments (scatter.cu, cucopy_scatter_w8k): a one-node CUDA graph pointed at a
# segment address, one of a pool the compiled driver calls make at set-up and re-point
# as needed (backends/_cudacall.c; cuGraphLaunch takes about half the host time of
# cuLaunchKernel: bench/results/2026-12-02-h200-probes-session11). Its kernel reads the
# first GRAPH_CAPACITY bytes at that address into shared memory in one round, so a
# segment of at most that many bytes is read from mapped memory at once.
# The copier launches "mapped" and "auto" segments this way ("inline" carries small
# ones instead: less GPU time, more host time).
# A segment of more than GRAPH_CAPACITY bytes and at most GRAPH_ROUNDS times that is read
# whole as well: the rest in a second round, once the header (in the first) says it is
# there. "auto" graphs only segments of up to AUTO_GRAPH_ROUNDS times GRAPH_CAPACITY:
# past that, the one block's scatter costs the GPU more than a carried launch (which
# spreads a segment's blocks over the GPU), and "auto" carries them; "mapped" graphs
# them all (the host's cost, half a carried launch's, is what it is chosen for).
# The host must leave the bytes the kernel reads (graph_reach: all GRAPH_CAPACITY bytes,
# or the whole longer segment) readable and unwritten until the launch completes (the
# copier moves the slot's next segment past them).
GRAPH_CAPACITY = 8192
GRAPH_ROUNDS = 4
AUTO_GRAPH_ROUNDS = 2
GRAPH_ENTRY_POINT = "cucopy_scatter_w8k"


def graph_max(cap: int) -> int:
    """The longest segment a graphed kernel of capacity ``cap`` reads whole.

    ``GRAPH_ROUNDS * cap`` for the copier's capacity (scatter.cu's ``CUCOPY_GRAPH_MAX``,
    in a block's static shared memory); a larger capacity, which only
    ``bench/probes/graph_kernel.py`` builds, reads less: twice itself up to 16 KiB, else
    itself.
    """
    return GRAPH_ROUNDS * cap if cap <= 8192 else 2 * cap if cap <= 16384 else cap


def graph_reach(cap: int, total: int, auto: bool = False) -> int:
    """Bytes a graphed kernel of capacity ``cap`` reads at a segment of ``total`` bytes.

    ``cap`` for a segment of at most ``cap`` bytes (its one round); ``total`` rounded
    up to 16 for one of at most :func:`graph_max` bytes (its second round stops at the
    segment's end); 0 for a longer one, which is not launched graphed (nor is any with
    ``cap`` 0). With ``auto`` (``flush_mode="auto"``'s choice), 0 as well past
    ``AUTO_GRAPH_ROUNDS * cap`` bytes (carried instead). ``core.h``'s ``graph_reach``
    is the compiled twin.
    """
    if total <= cap:
        return cap
    if total > graph_max(cap) or (auto and total > AUTO_GRAPH_ROUNDS * cap):
        return 0
    return (total + 15) & ~15


# The completion tag of a graphed launch (scatter.cu, cucopy_scatter_w8k's ``cell``):
# TAG_BYTES in a ring slot's headroom, TAG_AT bytes from the slot's first byte: the
# step the host armed it with before the launch (u64), then the step the kernel copies
# there once its reads of the slot are done (u64). The host reads the second word to
# know the slot is free, instead of an event (cucopy.ring). A cache line of its own in
# the headroom, the one whose last CARRY_PREFIX bytes a carried launch of the slot's
# first segment writes.
TAG_AT = -64
TAG_BYTES = 16
assert FEED_LANE_BYTES == FEED_HEAD_BYTES + HEADER_BYTES, "internal: a lane is head + header"


def align(n: int, a: int = ALIGN) -> int:
    """Round ``n`` up to a multiple of ``a`` (a power of two)."""
    return (n + a - 1) & -a


def blocks_for(width: int, rows: int = 1) -> int:
    """Thread blocks given to a descriptor of ``rows`` rows of ``width`` bytes."""
    windows = (width + 15) // 16 if rows == 1 else rows * ((width + 15) // 16 + 1)
    return max(1, (windows + WINDOWS_PER_BLOCK - 1) // WINDOWS_PER_BLOCK)


def split(descs: list) -> list:
    """The same copies as ``descs``, cut so that each descriptor needs one thread block.

    A segment whose every descriptor owns exactly one block (``ndesc == nblocks``)
    lets the carried scatter kernel find block ``b``'s work at descriptor ``b``, with
    no search of the table. One-dimensional rows (and dense 2-D ones, flattened) are
    cut every :data:`BLOCK_BYTES`; 2-D copies into runs of rows that fill a block, and
    a row wider than a block into pieces of it. The pieces write exactly the bytes
    the descriptor wrote, whatever order they run in.

    Parameters
    ----------
    descs : list of tuple
        Descriptor rows as :func:`encode` takes them (H2D ``src`` an offset, D2D
        ``src`` an address: either way, a piece's source moves with its destination).

    Returns
    -------
    list of tuple
        ``descs`` itself when no descriptor needs more than one block, else a new list.
    """
    out = None
    for i, d in enumerate(descs):
        dst, src, value, dpitch, spitch, width, rows, kind, elem, _ = d
        per_row = (width + 15) >> 4
        windows = per_row if rows == 1 else rows * (per_row + 1)
        if windows <= WINDOWS_PER_BLOCK or width == 0 or rows == 0:
            if out is not None:
                out.append(d)
            continue
        if out is None:
            out = list(descs[:i])
        fill = kind == KIND_FILL
        if fill and elem not in (1, 2, 4, 8):
            out.append(d)  # the kernel skips it whole; nothing to cut
            continue
        if (
            rows > 1
            and dpitch == width
            and (fill or spitch == width)
            and not (fill and width % elem)
        ):
            width, rows = width * rows, 1  # dense: one long row
        if rows == 1:
            runs = [(0, 1)]
        else:
            per = max(1, WINDOWS_PER_BLOCK // (per_row + 1))
            runs = [(r, min(per, rows - r)) for r in range(0, rows, per)]
        # pieces of a row start at multiples of BLOCK_BYTES from its start: a multiple
        # of any fill element, so each piece's pattern starts in phase
        cols = [(0, width)] if rows > 1 and per_row + 1 <= WINDOWS_PER_BLOCK else None
        if cols is None:
            cols = [(c, min(BLOCK_BYTES, width - c)) for c in range(0, width, BLOCK_BYTES)]
            if rows > 1:
                runs = [(r, 1) for r in range(rows)]
        sk = 0 if fill else 1
        for r, nr in runs:
            for c, w in cols:
                if nr == 1:
                    dp, sp = w, w * sk
                else:
                    dp, sp = dpitch, spitch
                out.append(
                    (
                        dst + r * dpitch + c,
                        src + (r * spitch + c) * sk,
                        value,
                        dp,
                        sp,
                        w,
                        nr,
                        kind if nr > 1 or kind != KIND_H2D_2D else KIND_H2D,
                        elem,
                        0,
                    )
                )
    return descs if out is None else out


# struct layouts derived from the dtypes above, for packing from Python at flush
# time (one pack_into per descriptor costs a fraction of building a NumPy table)
_HEADER_STRUCT = struct.Struct("<IHHIIIIQ")
_DESC_STRUCT = struct.Struct("<QQQIIIIHHI")
assert _HEADER_STRUCT.size == HEADER_BYTES and _DESC_STRUCT.size == DESC_BYTES


def encode(out, descs: list, data_offset: int, total_bytes: int, src_shift: int = 0) -> int:
    """Write the header and descriptors of one segment into ``out``.

    Parameters
    ----------
    out : writable buffer
        The segment's first ``data_offset`` bytes (a ``uint8`` array or memoryview).
    descs : list of tuple
        Descriptor rows in :data:`DESC_DTYPE` field order, ``block_start`` last
        (ignored: it is computed here).
    data_offset : int
        Where the data region starts (16-byte aligned, past the descriptors).
    total_bytes : int
        Bytes of the whole segment.
    src_shift : int
        Added to the ``src`` field of H2D rows (turns slot offsets into segment
        offsets).

    Returns
    -------
    int
        The number of thread blocks the scatter launch needs.
    """
    pack_desc = _DESC_STRUCT.pack_into
    block = 0
    off = HEADER_BYTES
    for dst, src, value, dpitch, spitch, width, rows, kind, elem, _ in descs:
        if kind <= KIND_H2D_2D:
            src += src_shift
        pack_desc(out, off, dst, src, value, dpitch, spitch, width, rows, kind, elem, block)
        per_row = (width + 15) >> 4
        windows = per_row if rows == 1 else rows * (per_row + 1)
        block += (windows + WINDOWS_PER_BLOCK - 1) // WINDOWS_PER_BLOCK or 1
        off += DESC_BYTES
    _HEADER_STRUCT.pack_into(
        out,
        0,
        MAGIC,
        VERSION,
        HEADER_BYTES,
        len(descs),
        block,
        HEADER_BYTES,
        data_offset,
        total_bytes,
    )
    return block


def decode(segment) -> tuple[np.void, np.ndarray]:
    """Read a segment's header and descriptor table.

    Parameters
    ----------
    segment : bytes-like
        The segment's bytes, at least through its descriptor table.

    Returns
    -------
    header : numpy.void
        One :data:`HEADER_DTYPE` record.
    descs : numpy.ndarray
        The :data:`DESC_DTYPE` table.

    Raises
    ------
    ValueError
        If the magic number or version does not match.
    """
    buf = np.frombuffer(segment, dtype=np.uint8)
    header = buf[:HEADER_BYTES].view(HEADER_DTYPE)[0]
    if int(header["magic"]) != MAGIC:
        raise ValueError(f"segment: bad magic {int(header['magic']):#x}, expected {MAGIC:#x}")
    if int(header["version"]) != VERSION:
        raise ValueError(f"segment: version {int(header['version'])}, this cucopy reads {VERSION}")
    off = int(header["desc_offset"])
    n = int(header["ndesc"])
    descs = buf[off : off + n * DESC_BYTES].view(DESC_DTYPE)
    return header, descs


def reference_scatter(segment, load, store, order=None) -> None:
    """Apply a segment's descriptors the way the scatter kernel does.

    This is the byte-level reference the CUDA kernel is checked against.

    Parameters
    ----------
    segment : bytes-like
        The whole segment (header, descriptors and data).
    load : callable
        ``load(addr, nbytes) -> bytes`` reads device memory (D2D sources).
    store : callable
        ``store(addr, data)`` writes device memory.
    order : sequence of int, optional
        The order to apply descriptors in. The GPU runs them concurrently, so
        callers (the simulated device) pass a shuffled order to prove that
        nothing depends on it.
    """
    buf = memoryview(segment).cast("B")
    header, descs = decode(buf)
    n = len(descs)
    for i in order if order is not None else range(n):
        d = descs[i]
        kind = int(d["kind"])
        dst, width, rows = int(d["dst"]), int(d["width"]), int(d["rows"])
        dpitch, spitch = int(d["dst_pitch"]), int(d["src_pitch"])
        if kind in (KIND_H2D, KIND_H2D_2D):
            src = int(d["src"])
            for r in range(rows):
                store(dst + r * dpitch, bytes(buf[src + r * spitch : src + r * spitch + width]))
        elif kind == KIND_D2D:
            src = int(d["src"])
            rows_data = [load(src + r * spitch, width) for r in range(rows)]
            for r in range(rows):
                store(dst + r * dpitch, rows_data[r])
        elif kind == KIND_FILL:
            elem = int(d["elem"])
            pattern = int(d["value"]).to_bytes(8, "little")[:elem]
            row = pattern * (width // elem)
            for r in range(rows):
                store(dst + r * dpitch, row)
        else:
            raise ValueError(f"segment: descriptor {i} has unknown kind {kind}")
