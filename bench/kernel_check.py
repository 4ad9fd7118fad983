"""Random-segment conformance check of the scatter kernel, byte for byte.

Builds random segments with :func:`cucopy.pack.encode` (all four descriptor
kinds, sizes 1 B to 256 KiB, random alignments of destinations, sources and
pitches, 2-D copies whose rows interleave with another descriptor's), runs
``cucopy_scatter`` on them from device memory ("dma") and from mapped pinned
host memory ("mapped"), and ``cucopy_scatter_c*`` through the CUDA backend with
the header and table carried in the launch's parameters and the data mapped
("carried") or the whole segment carried ("inline"; segments too large for the
largest parameter buffer fall back to "carried", then to "mapped"), and
``cucopy_scatter_w8k`` launched through the one-node graphs of
``CudaBackend.scatter_graphed`` ("graphed": each segment at one of four places of
the mapped staging, a graph of the pool pointed at each, each launch's completion tag
checked written back, bad segments' too), and compares the device arena with
:func:`cucopy.pack.reference_scatter` applied to a host copy of it. Also checks
``cucopy_fill``. ``tests/test_kernel_gpu.py`` runs the same harness; this
script exists to run it under compute-sanitizer.

Usage:
    python bench/kernel_check.py [--segments 200] [--seed 0] [--mode all]
        [--max-desc 64] [--max-bytes 262144] [--fills 200]
    compute-sanitizer --tool memcheck python bench/kernel_check.py --segments 100
    compute-sanitizer --tool racecheck python bench/kernel_check.py --segments 20

Exit status 0 when every byte matches, 1 on a mismatch (details on stderr).
Needs CuPy and a CUDA GPU.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

try:
    from cucopy import kernels, pack
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from cucopy import kernels, pack

KINDS = (pack.KIND_H2D, pack.KIND_H2D_2D, pack.KIND_D2D, pack.KIND_FILL)
MODES = ("dma", "mapped", "carried", "inline", "graphed")


@dataclass
class Segment:
    """One encoded segment and what the launch needs."""

    data: np.ndarray  # uint8, a multiple of 16 bytes
    nblocks: int
    descs: list = field(default_factory=list)


def _size(rng: np.random.Generator, max_bytes: int) -> int:
    # Log-uniform, so 4-byte vectors and 256 KiB tables both show up often.
    return max(1, min(max_bytes, int(math.exp(rng.uniform(0.0, math.log(max_bytes + 1))))))


def make_segment(
    rng: np.random.Generator,
    dst_base: int,
    dst_bytes: int,
    src_base: int,
    src_bytes: int,
    *,
    ndesc: int | None = None,
    max_desc: int = 64,
    max_bytes: int = 256 << 10,
    kinds: tuple[int, ...] = KINDS,
    cut: bool = False,
) -> Segment:
    """Build one random segment whose destinations do not overlap.

    Parameters
    ----------
    rng : numpy.random.Generator
    dst_base, dst_bytes : int
        Device address range the destinations are placed in.
    src_base, src_bytes : int
        Device address range D2D sources are read from (never written).
    ndesc : int, optional
        Exact descriptor count; otherwise 1 to ``max_desc``, fewer when the
        destination range fills up.
    max_desc, max_bytes : int
        Upper bounds on the descriptor count and on one descriptor's bytes.
    kinds : tuple of int
        Descriptor kinds to draw from.
    cut : bool
        Cut descriptors wider than a block with :func:`cucopy.pack.split`, as the
        copier does, so that every descriptor owns one block (the carried
        kernel's direct path).

    Returns
    -------
    Segment
    """
    want = ndesc if ndesc is not None else int(rng.integers(1, max_desc + 1))
    descs = []  # [dst, src, value, dpitch, spitch, width, rows, kind, elem]
    cursor = int(rng.integers(0, 64))
    while len(descs) < want:
        kind = int(rng.choice(kinds))
        n = _size(rng, max_bytes)
        elem = 1
        value = 0
        rows = 1
        if kind != pack.KIND_H2D and n >= 2 and rng.random() < 0.5:
            rows = int(rng.integers(2, min(64, n) + 1))
        width = max(1, n // rows)
        if kind == pack.KIND_FILL:
            elem = int(rng.choice((1, 2, 4, 8)))
            width = elem * max(1, width // elem)
            if rng.random() < 0.1 and elem > 1:
                width += int(rng.integers(1, elem))  # reference writes whole elements only
            value = int(rng.integers(0, 1 << 63)) * 2 + int(rng.integers(0, 2))
        extra = 0 if rng.random() < 0.3 else int(rng.integers(1, 48))
        dpitch = width + extra if rows > 1 else width
        spitch = width
        if kind == pack.KIND_D2D and rows > 1 and rng.random() < 0.7:
            spitch = width + int(rng.integers(0, 48))
        # Now and then two 2-D copies share rows: the second one takes the
        # columns after the first, so partial 16-byte windows of different
        # descriptors meet inside one destination word.
        pair = rows > 1 and extra >= 2 and rng.random() < 0.2 and len(descs) + 2 <= want
        extent = (rows - 1) * dpitch + width
        if pair:
            w2 = int(rng.integers(1, extra))
            gap = int(rng.integers(0, extra - w2 + 1))
            extent = (rows - 1) * dpitch + width + gap + w2
        if cursor + extent > dst_bytes:
            if descs:
                break
            continue
        dst = dst_base + cursor
        if kind == pack.KIND_D2D:
            src_extent = (rows - 1) * spitch + width
            src = src_base + int(rng.integers(0, src_bytes - src_extent + 1))
        else:
            src = 0
        descs.append([dst, src, value, dpitch, spitch, width, rows, kind, elem])
        if pair:
            kind2 = int(rng.choice([k for k in kinds if k != pack.KIND_H2D]))
            src2, value2, elem2, spitch2 = 0, 0, 1, w2
            if kind2 == pack.KIND_D2D:
                spitch2 = w2 + int(rng.integers(0, 8))
                src2 = src_base + int(rng.integers(0, src_bytes - (rows - 1) * spitch2 - w2 + 1))
            elif kind2 == pack.KIND_FILL:
                value2 = int(rng.integers(0, 1 << 62))
            descs.append([dst + width + gap, src2, value2, dpitch, spitch2, w2, rows, kind2, elem2])
        cursor += extent + int(rng.integers(0, 40))
    order = rng.permutation(len(descs))
    descs = [descs[i] for i in order]
    chunks = []
    off = 0  # data offsets relative to the data region (16-byte aligned)
    for d in descs:
        kind, width, rows = d[7], d[5], d[6]
        if kind in (pack.KIND_H2D, pack.KIND_H2D_2D):
            d[4] = width  # H2D rows are packed in the segment
            off = pack.align(off)
            # Half of the sources share the destination's offset modulo 16
            # (what a packer aims for); the rest are anywhere.
            off += (d[0] & 15) if rng.random() < 0.5 else int(rng.integers(0, 16))
            nbytes = width * rows
            d[1] = off
            chunks.append((off, rng.integers(0, 256, nbytes, dtype=np.uint8)))
            off += nbytes
    rows_out = [(d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7], d[8], 0) for d in descs]
    if cut:
        rows_out = pack.split(rows_out)
    data_offset = pack.align(pack.HEADER_BYTES + len(rows_out) * pack.DESC_BYTES)
    total = pack.align(data_offset + off)
    buf = np.zeros(total, dtype=np.uint8)
    for o, payload in chunks:
        buf[data_offset + o : data_offset + o + payload.size] = payload
    rows_out = [
        (r[0], r[1] + data_offset, *r[2:]) if r[7] in (pack.KIND_H2D, pack.KIND_H2D_2D) else r
        for r in rows_out
    ]
    nblocks = pack.encode(buf[:data_offset], rows_out, data_offset, total)
    return Segment(buf, nblocks, rows_out)


def reblock(segment: Segment, rng: np.random.Generator, most: int = 8) -> Segment:
    """Give each descriptor 1 to ``most`` blocks, whatever its size.

    The kernel must split any descriptor over any number of blocks, so the
    host is free to change :func:`cucopy.pack.blocks_for`.
    """
    header = segment.data[: pack.HEADER_BYTES].view(pack.HEADER_DTYPE)
    n = int(header["ndesc"][0])
    off = int(header["desc_offset"][0])
    table = segment.data[off : off + n * pack.DESC_BYTES].view(pack.DESC_DTYPE)
    counts = rng.integers(1, most + 1, n)
    table["block_start"] = np.cumsum(counts) - counts
    header["nblocks"] = int(counts.sum())
    segment.nblocks = int(counts.sum())
    return segment


def reference(image: np.ndarray, base: int, segment: np.ndarray) -> None:
    """Apply ``segment`` to ``image`` (the host copy of the arena at ``base``)."""

    def load(addr: int, n: int) -> bytes:
        off = addr - base
        if off < 0 or off + n > image.size:
            raise AssertionError(f"internal: load outside the arena at {addr:#x}+{n}")
        return image[off : off + n].tobytes()

    def store(addr: int, data: bytes) -> None:
        off = addr - base
        if off < 0 or off + len(data) > image.size:
            raise AssertionError(f"internal: store outside the arena at {addr:#x}+{len(data)}")
        image[off : off + len(data)] = np.frombuffer(data, dtype=np.uint8)

    pack.reference_scatter(segment, load, store)


class Harness:
    """A device arena, the compiled kernels, and staging for segments.

    Parameters
    ----------
    dst_bytes : int
        Bytes of the arena's destination part.
    src_bytes : int
        Bytes of its D2D source part (random, never written).
    stage_bytes : int
        Bytes of device and mapped pinned staging for one batch of segments.
    seed : int
        Seed of the arena's initial contents.
    """

    def __init__(self, dst_bytes=8 << 20, src_bytes=4 << 20, stage_bytes=64 << 20, seed=0):
        import cupy

        self.cp = cupy
        self.module = cupy.RawModule(code=kernels.source(), options=("-std=c++17",))
        self.scatter = self.module.get_function("cucopy_scatter")
        self.fill = self.module.get_function("cucopy_fill")
        rng = np.random.default_rng(seed)
        self.dst_bytes = dst_bytes
        self.src_bytes = src_bytes
        self.arena = cupy.asarray(rng.integers(0, 256, dst_bytes + src_bytes, dtype=np.uint8))
        self.base = int(self.arena.data.ptr)
        self.src_base = self.base + dst_bytes
        self.stage_bytes = stage_bytes
        self.stage_dev = cupy.empty(stage_bytes, dtype=np.uint8)
        flags = cupy.cuda.runtime.hostAllocMapped
        self._pinned = cupy.cuda.PinnedMemory(stage_bytes, flags)
        self.stage_host = np.frombuffer(
            cupy.cuda.PinnedMemoryPointer(self._pinned, 0), dtype=np.uint8, count=stage_bytes
        )
        attrs = cupy.cuda.runtime.pointerGetAttributes(self._pinned.ptr)
        self.stage_mapped = int(attrs.devicePointer)
        self.stage_host_ptr = int(self._pinned.ptr)
        from cucopy.backends.cuda import CudaBackend

        self.backend = CudaBackend(cupy.cuda.Device().id)
        self.caps = self.backend.carry_capacities()
        #: launches by how much they carried: "none", "head", "all"
        self.carried = {"none": 0, "head": 0, "all": 0, "graphed": 0}
        # graphed launches write a completion tag (pack.TAG_BYTES) at one of four places
        # of their own: each launch's is checked once its round was waited for
        self._tags = cupy.cuda.PinnedMemory(4 * 64, flags)
        self.tag_host = np.frombuffer(
            cupy.cuda.PinnedMemoryPointer(self._tags, 0), dtype=np.uint64, count=4 * 8
        )
        self.tag_host[:] = 0
        self.tag_mapped = int(cupy.cuda.runtime.pointerGetAttributes(self._tags.ptr).devicePointer)
        #: graphed launches that wrote their tag, and reports of those that did not
        self.tagged = 0
        self.tag_failures: list[str] = []
        #: carried launches of one block a descriptor (the kernel's direct path)
        self.direct = 0

    def segment(self, rng: np.random.Generator, **kw) -> Segment:
        """A random segment aimed at this arena (see :func:`make_segment`)."""
        return make_segment(rng, self.base, self.dst_bytes, self.src_base, self.src_bytes, **kw)

    def run(self, segments: list[Segment], mode: str) -> None:
        """Launch ``segments`` in order, staged for ``mode``; waits for them.

        A batch larger than the staging runs in several rounds, each waited
        for before its staging is rewritten.
        """
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        if mode == "graphed":
            self._run_graphed(segments)
            return
        pending, off = [], 0
        for s in segments:
            if s.data.size > self.stage_bytes:
                raise ValueError(f"segment: {s.data.size} bytes exceed the staging")
            if off + s.data.size > self.stage_bytes:
                self._launch(pending, off, mode)
                pending, off = [], 0
            self.stage_host[off : off + s.data.size] = s.data
            pending.append((s, off))
            off += s.data.size
        self._launch(pending, off, mode)

    def _run_graphed(self, segments: list[Segment]) -> None:
        """Each segment at one of four places of the mapped staging, launched through the
        one-node graph pointed at that place (``CudaBackend.scatter_graphed``: its kernel
        reads ``pack.GRAPH_CAPACITY`` bytes there, and the rest of a longer segment from
        mapped memory); a round of four is waited for before its places are rewritten."""
        stride = self.stage_bytes // 4
        be = self.backend
        armed: list = []
        for i, s in enumerate(segments):
            if s.data.size + pack.GRAPH_CAPACITY > stride:
                raise ValueError(f"segment: {s.data.size} bytes exceed a graphed place")
            if i % 4 == 0:
                self.cp.cuda.runtime.deviceSynchronize()
                self._check_tags(armed)
            o = (i % 4) * stride
            self.stage_host[o : o + s.data.size] = s.data
            # the place's tag, armed with a number of its own (whatever the segment holds,
            # a bad one included, the kernel writes it back when done)
            w = (i % 4) * 8
            want = self.carried["graphed"] + 1
            self.tag_host[w] = want
            cell = self.tag_mapped + (i % 4) * 64
            if be.scatter_graphed(self.stage_mapped + o, s.nblocks, 0, cell):
                armed.append((w, want))
            self.carried["graphed"] += 1
        self.cp.cuda.runtime.deviceSynchronize()
        self._check_tags(armed)

    def _check_tags(self, armed: list) -> None:
        """After a wait for the device: each tagged launch of ``armed`` wrote its tag."""
        for w, want in armed:
            got = int(self.tag_host[w + 1])
            if got == want:
                self.tagged += 1
            else:
                self.tag_failures.append(f"graphed: the tag armed with {want} reads {got}")
        armed.clear()

    def _carry(self, s: Segment, mode: str) -> int:
        """Bytes of ``s`` a launch in ``mode`` carries (0: the uncarried kernel)."""
        cmax = self.caps[-1] if self.caps else 0
        if mode == "inline" and s.data.size <= cmax:
            return s.data.size
        header = s.data[: pack.HEADER_BYTES].view(pack.HEADER_DTYPE)[0]
        head = int(header["desc_offset"]) + int(header["ndesc"]) * pack.DESC_BYTES
        return head if pack.HEADER_BYTES <= head <= cmax else 0

    def _launch(self, pending, used: int, mode: str) -> None:
        if mode == "dma":
            self.stage_dev[:used].set(self.stage_host[:used])
            base = int(self.stage_dev.data.ptr)
        else:
            base = self.stage_mapped
        for s, o in pending:
            carry = self._carry(s, mode) if mode in ("carried", "inline") else 0
            if carry:
                self.carried["all" if carry == s.data.size else "head"] += 1
                self.direct += s.nblocks == len(s.descs)
                self.backend.scatter(base + o, s.nblocks, 0, True, carry, self.stage_host_ptr + o)
            else:
                self.carried["none"] += 1
                self.scatter((s.nblocks,), (pack.THREADS,), (np.uint64(base + o),))
        self.cp.cuda.runtime.deviceSynchronize()

    def check(self, segments: list[Segment], mode: str) -> list[str]:
        """Run a batch and compare with the reference; returns mismatch reports."""
        image = self.arena.get()
        failed = len(self.tag_failures)
        self.run(segments, mode)
        got = self.arena.get()
        tags = self.tag_failures[failed:]
        for s in segments:
            reference(image, self.base, s.data)
        if np.array_equal(got, image):
            return tags
        return tags + self._localize(image, got, segments, mode)

    def _localize(self, want_end, got_end, segments, mode) -> list[str]:
        # Replay the batch one segment at a time from the state before it.
        bad = np.flatnonzero(got_end != want_end)
        reports = [f"{mode}: {bad.size} bytes differ after the batch, first at +{bad[0]:#x}"]
        for i, s in enumerate(segments):
            before = self.arena.get()
            self.run([s], mode)
            got = self.arena.get()
            want = before.copy()
            reference(want, self.base, s.data)
            diff = np.flatnonzero(got != want)
            if diff.size:
                reports.append(
                    f"{mode}: segment {i} ({len(s.descs)} descriptors, {s.nblocks} blocks)"
                )
                for j, d in enumerate(s.descs):
                    dst, width, rows, dpitch = d[0] - self.base, d[5], d[6], d[3]
                    lo, hi = dst, dst + (rows - 1) * dpitch + width
                    hit = diff[(diff >= lo - 16) & (diff < hi + 16)]
                    if hit.size:
                        reports.append(
                            f"  desc {j}: kind={d[7]} dst=+{dst:#x} src={d[1]:#x} "
                            f"dpitch={dpitch} spitch={d[4]} width={width} rows={rows} "
                            f"elem={d[8]}: {hit.size} bad bytes, first +{hit[0]:#x} "
                            f"got {got[hit[0]]} want {want[hit[0]]}"
                        )
                break
        return reports

    def check_fill(self, rng: np.random.Generator, grid: int | None = None) -> list[str]:
        """Run one random ``cucopy_fill`` and compare with the reference."""
        elem = int(rng.choice((1, 2, 4, 8)))
        n = _size(rng, 256 << 10)
        rows = int(rng.integers(2, 65)) if rng.random() < 0.5 and n > 64 else 1
        width = elem * max(1, (n // rows) // elem)
        if rng.random() < 0.1 and elem > 1:
            width += int(rng.integers(1, elem))
        dpitch = width + (int(rng.integers(0, 48)) if rows > 1 else 0)
        extent = (rows - 1) * dpitch + width
        dst = self.base + int(rng.integers(0, self.dst_bytes - extent + 1))
        value = int(rng.integers(0, 1 << 63)) * 2 + 1
        if grid is None:
            grid = min(max(1, -(-rows * width // pack.BLOCK_BYTES)), 1024)
        image = self.arena.get()
        self.fill(
            (grid,),
            (pack.THREADS,),
            (
                np.uint64(dst),
                np.uint64(dpitch),
                np.uint32(width),
                np.uint32(rows),
                np.uint64(value),
                np.uint32(elem),
            ),
        )
        self.cp.cuda.runtime.deviceSynchronize()
        got = self.arena.get()
        seg = np.zeros(pack.align(pack.HEADER_BYTES + pack.DESC_BYTES), dtype=np.uint8)
        row = (dst, 0, value, dpitch, 0, width, rows, pack.KIND_FILL, elem, 0)
        pack.encode(seg, [row], seg.size, seg.size)
        reference(image, self.base, seg)
        diff = np.flatnonzero(got != image)
        if not diff.size:
            return []
        return [
            f"fill: dst=+{dst - self.base:#x} dpitch={dpitch} width={width} rows={rows} "
            f"elem={elem} value={value:#x} grid={grid}: {diff.size} bad bytes, "
            f"first +{diff[0]:#x}"
        ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--segments", type=int, default=200, help="random segments per mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", choices=(*MODES, "all"), default="all")
    p.add_argument("--max-desc", type=int, default=64)
    p.add_argument("--max-bytes", type=int, default=256 << 10)
    p.add_argument("--batch", type=int, default=50, help="segments launched between checks")
    p.add_argument("--fills", type=int, default=200, help="random cucopy_fill launches")
    args = p.parse_args(argv)

    h = Harness(seed=args.seed)
    rng = np.random.default_rng(args.seed)
    modes = MODES if args.mode == "all" else (args.mode,)
    failures = []
    for mode in modes:
        done = 0
        while done < args.segments:
            k = min(args.batch, args.segments - done)
            segs = [
                h.segment(rng, max_desc=args.max_desc, max_bytes=args.max_bytes) for _ in range(k)
            ]
            failures += h.check(segs, mode)
            done += k
        # Descriptor tables past the 256 entries that fit in shared memory.
        for n in (257, 1000):
            segs = [h.segment(rng, ndesc=n, max_bytes=256)]
            failures += h.check(segs, mode)
        # One block a descriptor, as the copier cuts them (the carried kernel's direct path).
        segs = [
            h.segment(rng, max_desc=args.max_desc, max_bytes=args.max_bytes, cut=True)
            for _ in range(10)
        ]
        failures += h.check(segs, mode)
        # Block counts other than pack.blocks_for's.
        segs = [reblock(h.segment(rng, max_desc=args.max_desc), rng) for _ in range(10)]
        failures += h.check(segs, mode)
        if mode == "inline":  # small segments, so that most travel whole
            segs = [h.segment(rng, max_desc=args.max_desc, max_bytes=512) for _ in range(50)]
            failures += h.check(segs, mode)
            done += 50
        print(f"{mode}: {done + 22} segments checked", flush=True)
    print(f"launches by bytes carried: {h.carried}, one block a descriptor: {h.direct}", flush=True)
    if "graphed" in modes:
        fast = h.backend._bound
        made = fast.graph_count if fast is not None else 0
        pointed = fast.graph_updates if fast is not None else 0
        print(
            f"graphed: a pool of {made} graphs (none: the launches fell back to mapped), "
            f"{pointed} re-pointed, {h.tagged} completion tags written back",
            flush=True,
        )
        if not made:
            failures.append("graphed: no graph was made (the compiled driver calls are needed)")
        elif not h.tagged:
            failures.append("graphed: no launch wrote its completion tag")
    for i in range(args.fills):
        failures += h.check_fill(rng, grid=None if i % 2 else int(rng.integers(1, 8)))
    print(f"fill: {args.fills} launches checked", flush=True)
    if failures:
        print("\n".join(failures), file=sys.stderr)
        print("FAILED", file=sys.stderr)
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
