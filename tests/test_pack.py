import numpy as np
import pytest

from cucopy import pack


def test_sizes_and_alignment():
    assert pack.HEADER_BYTES == 32
    assert pack.DESC_BYTES == 48
    assert pack.HEADER_BYTES % pack.ALIGN == 0
    # 8-byte fields sit on 8-byte boundaries, so the C struct has no padding
    for name in ("dst", "src", "value"):
        assert pack.DESC_DTYPE.fields[name][1] % 8 == 0
    assert pack.HEADER_DTYPE.fields["total_bytes"][1] % 8 == 0


def test_blocks_for():
    assert pack.blocks_for(1) == 1
    assert pack.blocks_for(pack.BLOCK_BYTES) == 1
    assert pack.blocks_for(pack.BLOCK_BYTES + 1) == 2
    assert pack.blocks_for(4, rows=4096) == 32  # two windows a row: spread tall tables too
    assert pack.align(17) == 32 and pack.align(32) == 32


def _segment(descs, data: bytes, data_offset=None):
    n = len(descs)
    data_offset = data_offset or pack.align(pack.HEADER_BYTES + n * pack.DESC_BYTES)
    total = pack.align(data_offset + len(data))
    buf = np.zeros(total, np.uint8)
    buf[data_offset : data_offset + len(data)] = np.frombuffer(data, np.uint8)
    # H2D src fields are relative to data_offset here
    descs = [(d[0], d[1] + data_offset, *d[2:]) if d[7] <= 2 else d for d in descs]
    nblocks = pack.encode(buf[:data_offset], descs, data_offset, total)
    return buf, nblocks


def test_encode_decode_roundtrip_and_block_runs():
    big = pack.BLOCK_BYTES * 2 + 5
    descs = [
        (0x1000, 0, 0, 4, 4, 4, 1, pack.KIND_H2D, 0, 0),
        (0x2000, 16, 0, 64, big, big, 1, pack.KIND_H2D, 0, 0),
        (0x9000, 0, 0xAB, 8, 0, 8, 3, pack.KIND_FILL, 1, 0),
    ]
    buf, nblocks = _segment(descs, b"\x01\x02\x03\x04" + bytes(12) + bytes(big))
    header, table = pack.decode(buf.tobytes())
    assert int(header["ndesc"]) == 3
    assert int(header["nblocks"]) == nblocks == 1 + pack.blocks_for(big) + 1
    assert table["block_start"].tolist() == [0, 1, 1 + pack.blocks_for(big)]
    assert pack.blocks_for(big) == 3
    assert int(header["total_bytes"]) == buf.nbytes
    assert int(header["data_offset"]) % pack.ALIGN == 0


def test_decode_rejects_bad_magic_and_version():
    buf, _ = _segment([(0x10, 0, 0, 1, 1, 1, 1, pack.KIND_H2D, 0, 0)], b"x")
    bad = buf.copy()
    bad[0] ^= 0xFF
    with pytest.raises(ValueError, match="bad magic"):
        pack.decode(bad.tobytes())
    bad = buf.copy()
    bad[4] = 99
    with pytest.raises(ValueError, match="version 99"):
        pack.decode(bad.tobytes())


def test_reference_scatter_all_kinds_any_order():
    mem = np.zeros(4096, np.uint8)
    base = 0x10000
    mem[2000:2100] = np.arange(100, dtype=np.uint8)

    def load(a, n):
        return mem[a - base : a - base + n].tobytes()

    def store(a, d):
        mem[a - base : a - base + len(d)] = np.frombuffer(d, np.uint8)

    descs = [
        (base + 1, 0, 0, 3, 3, 3, 1, pack.KIND_H2D, 0, 0),  # odd address, 3 bytes
        (base + 100, 16, 0, 10, 2, 2, 3, pack.KIND_H2D_2D, 0, 0),  # 3 rows of 2, pitch 10
        (base + 500, base + 2000, 0, 7, 5, 4, 2, pack.KIND_D2D, 0, 0),
        (base + 800, 0, 0xDEADBEEF, 16, 0, 8, 2, pack.KIND_FILL, 4, 0),
    ]
    data = b"abc" + bytes(13) + b"ABCDEF"
    buf, _ = _segment(descs, data)
    want = None
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1]):
        mem[:2000] = 0
        pack.reference_scatter(buf.tobytes(), load, store, order)
        got = mem[:1000].copy()
        if want is None:
            want = got
        assert np.array_equal(got, want)
    assert mem[1:4].tobytes() == b"abc"
    assert mem[100:102].tobytes() == b"AB" and mem[110:112].tobytes() == b"CD"
    assert mem[120:122].tobytes() == b"EF" and mem[102:110].sum() == 0
    assert mem[500:504].tolist() == [0, 1, 2, 3] and mem[507:511].tolist() == [5, 6, 7, 8]
    assert mem[800:808].tobytes() == bytes.fromhex("efbeadde") * 2
    assert mem[816:824].tobytes() == bytes.fromhex("efbeadde") * 2
    assert mem[808:816].sum() == 0


def _random_desc(rng, base, span, data_len):
    """One descriptor of any kind, inside [base, base + span), H2D data in [0, data_len)."""
    kind = int(rng.choice(pack.KINDS))
    shape = rng.integers(3)
    if shape == 0:  # one row, up to several blocks wide
        rows, width = 1, int(rng.integers(1, 3 * pack.BLOCK_BYTES))
    elif shape == 1:  # tall and narrow: many rows a block
        rows, width = int(rng.integers(2, 600)), int(rng.integers(1, 40))
    else:  # a few wide rows
        rows, width = int(rng.integers(2, 4)), int(rng.integers(1, 2 * pack.BLOCK_BYTES))
    elem = int(rng.choice([1, 2, 4, 8])) if kind == pack.KIND_FILL else 0
    dense = rng.random() < 0.3
    dpitch = width if dense else width + int(rng.integers(0, 40))
    spitch = width if (dense or kind != pack.KIND_D2D) else width + int(rng.integers(0, 40))
    if kind in (pack.KIND_H2D, pack.KIND_H2D_2D):
        spitch = width
    need = (rows - 1) * dpitch + width
    dst = base + int(rng.integers(0, span // 2 - need))
    if kind == pack.KIND_D2D:
        src = base + span // 2 + int(rng.integers(0, span // 2 - ((rows - 1) * spitch + width)))
    elif kind == pack.KIND_FILL:
        src = 0
    else:
        src = int(rng.integers(0, data_len - rows * width))
    value = int(rng.integers(0, 1 << 63)) if kind == pack.KIND_FILL else 0
    if kind == pack.KIND_H2D and rows > 1:
        kind = pack.KIND_H2D_2D
    return (dst, src, value, dpitch, spitch, width, rows, kind, elem, 0)


@pytest.mark.parametrize("seed", range(40))
def test_split_writes_the_same_bytes_one_block_a_descriptor(seed):
    rng = np.random.default_rng(seed)
    base, span = 0x100000, 1 << 17
    data = rng.integers(0, 256, 1 << 16, dtype=np.uint8).tobytes()
    descs = [_random_desc(rng, base, span, len(data)) for _ in range(int(rng.integers(1, 4)))]
    pieces = pack.split(descs)

    def run(rows, order_seed):
        mem = np.zeros(span, np.uint8)
        mem[span // 2 :] = np.arange(span // 2) % 251  # D2D sources

        def load(a, n):
            return mem[a - base : a - base + n].tobytes()

        def store(a, d):
            mem[a - base : a - base + len(d)] = np.frombuffer(d, np.uint8)

        buf, nblocks = _segment(rows, data)
        order = np.random.default_rng(order_seed).permutation(len(rows)).tolist()
        # descriptors of one segment write disjoint bytes here only if they do not
        # overlap; random ones may, so compare each descriptor with its own pieces
        pack.reference_scatter(buf.tobytes(), load, store, order)
        return mem, nblocks

    for d in descs:
        mine = pack.split([d])
        want, _ = run([d], 0)
        got, nblocks = run(mine, seed)
        assert np.array_equal(got, want), (d, mine[:4])
        assert nblocks == len(mine)  # every piece is one block
        if pack.blocks_for(d[5], d[6]) == 1:
            assert mine == [d]
    assert len(pieces) == sum(len(pack.split([d])) for d in descs)


def test_split_returns_the_list_itself_when_nothing_is_wide():
    descs = [
        (0x1000, 0, 0, 4, 4, 4, 1, pack.KIND_H2D, 0, 0),
        (0x2000, 16, 0, 64, 16, 16, 8, pack.KIND_H2D_2D, 0, 0),
        (0x9000, 0, 7, 0, 0, pack.BLOCK_BYTES, 1, pack.KIND_FILL, 4, 0),
    ]
    assert pack.split(descs) is descs


def test_split_keeps_a_fill_in_phase_and_drops_the_same_partial_element():
    # 3 blocks and 3 bytes of an 8-byte pattern starting at an odd address: the
    # trailing partial element is dropped once, at the end, as in the whole fill
    width = 3 * pack.BLOCK_BYTES + 3
    d = (0x10001, 0, 0x0807060504030201, width, 0, width, 1, pack.KIND_FILL, 8, 0)
    pieces = pack.split([d])
    assert len(pieces) == 4
    mem = {}

    def store(a, b):
        for i, x in enumerate(b):
            mem[a + i] = x

    buf, _ = _segment(pieces, b"")
    pack.reference_scatter(buf.tobytes(), None, store)
    assert len(mem) == width - width % 8
    assert all(mem[0x10001 + i] == i % 8 + 1 for i in range(width - width % 8))
