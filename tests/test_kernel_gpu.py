"""GPU conformance of ``cucopy_scatter`` and ``cucopy_fill`` against pack.reference_scatter.

Random segments (every descriptor kind, 1 B to 256 KiB, random alignments of
destinations, sources and pitches) run from device memory, from mapped pinned
memory, with the header and table carried in the launch ("carried") and whole
in the launch ("inline"); the device arena must equal the reference byte for
byte. The
harness is ``bench/kernel_check.py``, which also runs standalone under
compute-sanitizer.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from cucopy import pack

pytestmark = pytest.mark.gpu

MODES = ("dma", "mapped", "carried", "inline", "graphed")


@functools.cache
def _kernel_check():
    path = Path(__file__).resolve().parents[1] / "bench" / "kernel_check.py"
    spec = importlib.util.spec_from_file_location("cucopy_kernel_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def harness():
    cupy = pytest.importorskip("cupy")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver: CUDARuntimeError, or an import-time failure
        pytest.skip(f"no CUDA device: {exc}")
    if count == 0:
        pytest.skip("no CUDA device")
    h = _kernel_check().Harness(seed=1234)
    yield h
    cupy.cuda.runtime.deviceSynchronize()


def _check_batches(h, rng, mode, segments, batch=100, **kw):
    failures = []
    for start in range(0, segments, batch):
        segs = [h.segment(rng, **kw) for _ in range(min(batch, segments - start))]
        failures += h.check(segs, mode)
        if failures:
            break
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("mode", MODES)
def test_scatter_random_segments(harness, mode):
    rng = np.random.default_rng(1 if mode == "dma" else 2)
    _check_batches(harness, rng, mode, segments=1500)


@pytest.mark.parametrize("mode", MODES)
def test_scatter_tiny_descriptors(harness, mode):
    # Many descriptors of a few bytes each: every window is a partial one.
    rng = np.random.default_rng(3)
    _check_batches(harness, rng, mode, segments=300, max_bytes=40)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", [pack.KIND_H2D, pack.KIND_H2D_2D, pack.KIND_D2D, pack.KIND_FILL])
def test_scatter_one_kind(harness, mode, kind):
    rng = np.random.default_rng(10 + kind)
    _check_batches(harness, rng, mode, segments=100, kinds=(kind,))


@pytest.mark.parametrize("mode", MODES)
def test_scatter_single_descriptor(harness, mode):
    # One descriptor and one block: the kernel skips the table lookup.
    rng = np.random.default_rng(4)
    _check_batches(harness, rng, mode, segments=200, ndesc=1, max_bytes=pack.BLOCK_BYTES)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ndesc", [255, 256, 257, 1000, 5000])
def test_scatter_large_tables(harness, mode, ndesc):
    # Past 256 descriptors the table no longer fits in shared memory and the
    # kernel searches block_start in rounds.
    rng = np.random.default_rng(ndesc)
    _check_batches(harness, rng, mode, segments=3, batch=3, ndesc=ndesc, max_bytes=600)


@pytest.mark.parametrize("mode", MODES)
def test_scatter_cut_segments(harness, mode):
    # Descriptors cut to one block each (pack.split, as the copier flushes them):
    # the carried kernel runs descriptor b in block b without a table search.
    rng = np.random.default_rng(8)
    segs = [harness.segment(rng, cut=True) for _ in range(200)]
    segs += [harness.segment(rng, cut=True, max_bytes=64) for _ in range(100)]
    assert all(s.nblocks == len(s.descs) for s in segs)
    assert any(s.nblocks > 200 for s in segs)
    direct = harness.direct
    failures = harness.check(segs, mode)
    assert not failures, "\n".join(failures)
    if mode in ("carried", "inline"):
        assert harness.direct - direct > 200  # most took the direct path


def test_scatter_large_descriptors_span_blocks(harness):
    rng = np.random.default_rng(5)
    segs = [harness.segment(rng, ndesc=4, max_bytes=256 << 10) for _ in range(20)]
    assert any(s.nblocks > 4 for s in segs)
    assert not harness.check(segs, "dma")


@pytest.mark.parametrize("mode", MODES)
def test_scatter_any_blocks_per_descriptor(harness, mode):
    # Tiny descriptors over many blocks (most blocks idle), big ones over few.
    rng = np.random.default_rng(9)
    kc = _kernel_check()
    failures = []
    for _ in range(4):
        segs = [kc.reblock(harness.segment(rng), rng, most=12) for _ in range(50)]
        failures += harness.check(segs, mode)
    assert not failures, "\n".join(failures)


def test_scatter_unknown_kind_is_skipped(harness):
    rng = np.random.default_rng(6)
    seg = harness.segment(rng, ndesc=3, kinds=(pack.KIND_FILL,), max_bytes=64)
    before = harness.arena.get()
    table = seg.data[pack.HEADER_BYTES : pack.HEADER_BYTES + 3 * pack.DESC_BYTES].view(
        pack.DESC_DTYPE
    )
    table["kind"] = 99
    harness.run([seg], "dma")
    assert np.array_equal(harness.arena.get(), before)


@pytest.mark.parametrize("mode", MODES)
def test_scatter_bad_magic_writes_nothing(harness, mode):
    rng = np.random.default_rng(7)
    seg = harness.segment(rng, ndesc=5, max_bytes=256)
    seg.data[:4] = 0
    before = harness.arena.get()
    harness.run([seg], mode)
    assert np.array_equal(harness.arena.get(), before)


def test_scatter_inline_small_segments(harness):
    # Segments that fit the parameter buffers travel whole: the kernel reads
    # their data from its parameters (generic loads), at every capacity.
    rng = np.random.default_rng(11)
    before = dict(harness.carried)
    for max_bytes in (16, 200, 2000):
        _check_batches(harness, rng, "inline", segments=300, max_bytes=max_bytes)
    assert harness.carried["all"] - before["all"] >= 600


def test_scatter_carried_tables_up_to_the_largest_buffer(harness):
    # 600 descriptors: a 28.8 KB table in the largest parameter buffer.
    rng = np.random.default_rng(12)
    before = dict(harness.carried)
    _check_batches(harness, rng, "carried", segments=5, batch=5, ndesc=600, max_bytes=600)
    assert harness.carried["head"] - before["head"] == 5


def test_fill_random(harness):
    rng = np.random.default_rng(8)
    failures = []
    for _ in range(300):
        failures += harness.check_fill(rng)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("grid", [1, 3, 1024])
def test_fill_any_grid(harness, grid):
    rng = np.random.default_rng(grid)
    failures = []
    for _ in range(50):
        failures += harness.check_fill(rng, grid=grid)
    assert not failures, "\n".join(failures)


def test_scatter_carried_garbage_block_starts_end(harness):
    # A table whose block_start is not ascending (never written by pack.encode)
    # must not hang or read out of bounds; the next segments still land.
    rng = np.random.default_rng(13)
    for n in (5, 40, 300):
        seg = harness.segment(rng, ndesc=n, max_bytes=64)
        table = seg.data[pack.HEADER_BYTES : pack.HEADER_BYTES + n * pack.DESC_BYTES].view(
            pack.DESC_DTYPE
        )
        table["block_start"] = rng.permutation(n)
        table["block_start"][0] = 0
        harness.run([seg], "carried")
    _check_batches(harness, rng, "carried", segments=50)


def test_graphed_launches_write_their_completion_tags(harness):
    # every graphed launch of the conformance checks above is tagged (kernel_check's
    # graphed mode): its kernel copies the armed word to the tag's second word once
    # done, a bad segment's (nothing landed) too
    rng = np.random.default_rng(14)
    before = harness.tagged
    seg = harness.segment(rng, ndesc=5, max_bytes=256)
    seg.data[:4] = 0  # a bad magic: the kernel lands nothing, and still writes the tag
    image = harness.arena.get()
    harness.run([seg], "graphed")
    assert np.array_equal(harness.arena.get(), image)
    assert harness.tagged - before == 1
    failures = harness.check([harness.segment(rng, ndesc=3, max_bytes=64)], "graphed")
    assert not failures, "\n".join(failures)
    assert harness.tagged - before == 2
    assert not harness.tag_failures
