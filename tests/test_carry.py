"""Segments carried in the scatter launch's parameters (``inline``, and ``mapped``'s header).

A carried launch snapshots the segment's first bytes when it is enqueued; the
rest is read when the kernel runs. These tests stall the copier's stream,
scribble over the whole staging ring while the launch waits, and look at what
lands: a carried byte keeps its enqueue-time value, an uncarried one takes the
scribble. The same bodies run on the simulated device and on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import cucopy as cc
from cucopy import pack, segment


class Site(cc.CopySite):
    POS = cc.H2D
    LENS = cc.H2D
    GATHER = cc.D2D
    PAD = cc.FILL


PLAN = cc.CopyPlan(merge={Site.POS, Site.LENS, Site.GATHER, Site.PAD})
SCRIBBLE = 0x5A


def _scribble(c) -> None:
    for slot in c._ring._slots:
        if slot is not None:
            slot.array[:] = SCRIBBLE


def _held_step(env, c, values, dst, scribble=True):
    """One merged copy enqueued behind a stalled stream; the ring is scribbled on meanwhile."""
    with env.hold(c_stream(env, c)):
        with c.step():
            c.copy(Site.POS, dst, values)
        if scribble:
            _scribble(c)
    return env.to_host(dst)


def c_stream(env, c):
    return c._stream_obj if c._stream_obj is not None else env.default_stream


def test_inline_segments_are_snapshotted_at_enqueue(env):
    c = env.copier(PLAN, flush_mode="inline")
    dst = env.empty((64,))
    values = np.arange(64, dtype=np.int32) * 7 + 1
    got = _held_step(env, c, values, dst)
    assert got.tolist() == values.tolist()
    assert c.stats.modes == {"dma": 0, "mapped": 0, "inline": 1}
    c.close()


def test_mapped_segments_carry_the_header_and_read_the_data_at_run_time(env):
    # The header and table travel with the launch (a scribbled header would stop
    # the kernel cold); the data is read from the pinned slot when the kernel
    # runs, so it is the scribble that lands. This is why the ring's events
    # guard a mapped slot until its launch has run.
    c = env.copier(PLAN, flush_mode="mapped")
    c._graph_cap = 0  # carried, not graphed (next test)
    dst = env.empty((64,))
    got = _held_step(env, c, np.arange(64, dtype=np.int32), dst)
    want = np.full(64, SCRIBBLE * 0x01010101, np.uint32).view(np.int32)
    assert got.tolist() == want.tolist()
    assert c.stats.modes["mapped"] == 1
    c.close()


@pytest.mark.gpu
def test_a_graphed_segment_scribbled_before_it_runs_lands_nothing_and_returns():
    # a graphed launch carries nothing: its kernel reads the header from the slot when
    # it runs, finds no segment there and returns (it must not loop over a scribbled
    # block count); this is why the slot's event guards it until then
    from conftest import CudaEnv

    env = CudaEnv()
    c = env.copier(PLAN, flush_mode="mapped")
    if not c._graph_cap:
        pytest.skip("no graphed launches on this driver")
    dst = env.empty((64,))
    env.write(env.default_stream, dst, np.full(64, 3, np.int32))
    got = _held_step(env, c, np.arange(64, dtype=np.int32), dst)
    assert got.tolist() == [3] * 64
    assert c.stats.modes["mapped"] == 1
    c.close()


def test_mapped_lands_when_the_slot_is_left_alone(env):
    c = env.copier(PLAN, flush_mode="mapped")
    dst = env.empty((64,))
    values = np.arange(64, dtype=np.int32) - 5
    assert _held_step(env, c, values, dst, scribble=False).tolist() == values.tolist()
    c.close()


def test_auto_carries_or_graphs_small_segments(env):
    # carried whole in the launch; where the backend launches graphs (CUDA), a segment
    # within their read goes graphed instead (mapped: half a carried launch's host time)
    c = env.copier(PLAN)
    a = env.empty((4096,))
    src = env.asarray(np.arange(100, dtype=np.int32))
    with c.step():
        c.copy(Site.POS, a[:10], np.arange(10, dtype=np.int32))
        c.copy(Site.GATHER, a[100:200], src)
        c.fill_tail(Site.PAD, a[200:300], 0, 9)
    got = env.to_host(a)
    assert got[:10].tolist() == list(range(10))
    assert got[100:200].tolist() == list(range(100))
    assert got[200:300].tolist() == [9] * 100
    graphed = int(bool(c._graph_cap))
    assert c.stats.modes == {"dma": 0, "mapped": graphed, "inline": 1 - graphed}
    c.close()


def test_inline_falls_back_to_auto_past_the_largest_capacity(env):
    c = env.copier(PLAN, flush_mode="inline")
    n = pack.CARRY_CAPACITIES[-1] // 4 + 16  # a segment one capacity cannot hold
    a = env.empty((n,))
    values = np.arange(n, dtype=np.int32)
    with c.step():
        c.copy(Site.LENS, a, values)
    assert env.to_host(a).tolist() == values.tolist()
    assert c.stats.modes["inline"] == 0 and c.stats.segments == 1
    c.close()


@pytest.mark.parametrize("ndesc", [1, 20, 100, 600])
def test_many_descriptors_carried(env, ndesc):
    # 600 descriptors (28.8 KB of table) still fit the largest buffer, header
    # and data included for small rows; every block finds its descriptor.
    c = env.copier(PLAN, flush_mode="mapped")
    a = env.empty((ndesc * 8,))
    rng = np.random.default_rng(ndesc)
    want = np.zeros(ndesc * 8, np.int32)
    with c.step():
        for i in range(ndesc):
            k = int(rng.integers(1, 9))
            v = rng.integers(-(2**31), 2**31, k, dtype=np.int64).astype(np.int32)
            c.copy(Site.POS, a[i * 8 : i * 8 + k], v)
            want[i * 8 : i * 8 + k] = v
    assert env.to_host(a).tolist() == want.tolist()
    assert c.stats.modes["mapped"] == 1
    c.close()


def test_without_carry_support_the_old_paths_run():
    # A backend that carries nothing (an old driver): auto picks mapped for a
    # small table and dma past the descriptor cap, inline falls back to auto.
    from conftest import SimEnv

    env = SimEnv("lazy")
    env.dev.carry_capacities = ()
    for mode, want in (("auto", "mapped"), ("inline", "mapped"), ("dma", "dma")):
        c = env.copier(PLAN, flush_mode=mode)
        a = env.empty((16,))
        with c.step():
            c.copy(Site.POS, a, np.arange(16, dtype=np.int32))
        assert env.to_host(a).tolist() == list(range(16))
        assert c.stats.modes[want] == 1, (mode, c.stats.modes)
        c.close()
    c = env.copier(PLAN)
    a = env.empty((200,))
    with c.step():
        for i in range(100):  # more descriptors than an uncarried mapped table takes
            c.copy(Site.POS, a[2 * i : 2 * i + 1], np.array([i], np.int32))
    assert env.to_host(a)[::2].tolist() == list(range(100))
    assert c.stats.modes == {"dma": 1, "mapped": 0, "inline": 0}
    c.close()


def test_carry_larger_than_every_capacity_is_refused(env):
    c = env.copier(PLAN, flush_mode="dma")
    with c.step():
        c.copy(Site.POS, env.empty((4,)), np.arange(4, dtype=np.int32))
    be = c._backend
    big = be.carry_capacities()[-1] + 16
    slot = c._ring._slots[0]
    with pytest.raises(ValueError, match=f"carry={big}"):
        be.scatter(slot.pinned.device_ptr, 1, c._stream, True, big, slot.pinned.ptr)
    c.close()


def test_stats_report_segment_modes(env):
    c = env.copier(PLAN, flush_mode="dma")
    a = env.empty((8,))
    for mode in ("dma", "mapped", "inline"):
        c.flush_mode = mode
        with c.step():
            c.copy(Site.POS, a, np.arange(8, dtype=np.int32))
    assert c.stats.modes == {"dma": 1, "mapped": 1, "inline": 1}
    assert c.stats.as_dict()["modes"] == {"dma": 1, "mapped": 1, "inline": 1}
    assert "dma=1 mapped=1 inline=1" in str(c.stats)
    c.stats.reset()
    assert c.stats.modes == {"dma": 0, "mapped": 0, "inline": 0}
    c.close()


def _spy_launches(c):
    """Record (launched blocks, header ndesc, header nblocks) of each scatter, at the call."""
    seen = []
    scatter = c._backend.scatter

    def spy(segment_ptr, nblocks, stream, mapped, carry=0, host_ptr=0):
        head = c._slot.array[c._seg.seg : c._seg.seg + pack.HEADER_BYTES].tobytes()
        header, _ = pack.decode(head)
        seen.append((nblocks, int(header["ndesc"]), int(header["nblocks"])))
        return scatter(segment_ptr, nblocks, stream, mapped, carry, host_ptr)

    c._backend.scatter = spy
    c._launcher = None  # every launch through scatter(), none from the staging core
    c._graph_cap = 0  # nor graphed (scatter_graphed)
    return seen


@pytest.mark.parametrize("mode", ["auto", "inline", "mapped", "dma"])
def test_wide_copies_are_cut_to_one_block_a_descriptor(env, mode):
    # A copy wider than one block (pack.BLOCK_BYTES), a tall 2-D one and a long fill
    # go out as one-block pieces, so block b runs descriptor b; the bytes that land
    # are the same.
    c = env.copier(PLAN, flush_mode=mode)
    seen = _spy_launches(c)
    wide = np.arange(3 * 1024 + 5, dtype=np.int32) * 3 - 7
    a = env.empty((wide.size,))
    tall = env.empty((600, 4))
    rows = np.arange(600 * 3, dtype=np.int32).reshape(600, 3)
    f = env.empty((9000,))
    for step in range(2):  # the second step finds the longer table reserved
        with c.step():
            c.copy(Site.POS, a, wide + step)
            c.copy(Site.LENS, tall[:, :3], rows - step)
            c.fill_tail(Site.PAD, f, 0, -1 - step)
        assert env.to_host(a).tolist() == (wide + step).tolist()
        assert env.to_host(tall)[:, :3].tolist() == (rows - step).tolist()
        assert env.to_host(f).tolist() == [-1 - step] * 9000
    assert len(seen) == 2
    for launched, ndesc, nblocks in seen:
        assert launched == nblocks == ndesc > 3
    c.close()


def test_a_cut_that_does_not_fit_below_the_snapshots_is_left_whole(env):
    # In a 4 KiB slot holding 2.8 KB of data, a 128 KiB fill cannot grow the table
    # to 33 descriptors (its reservation holds 16): it goes out whole (its blocks
    # search the table) and still lands.
    c = env.copier(PLAN, capacity=4096, flush_mode="mapped")
    seen = _spy_launches(c)
    a = env.empty((700,))
    f = env.empty((1 << 15,))
    values = np.arange(700, dtype=np.int32)
    with c.step():
        c.copy(Site.POS, a, values)
        c.fill_tail(Site.PAD, f, 0, 5)
    assert c.stats.sites[Site.POS].merged == 1
    assert env.to_host(a).tolist() == values.tolist()
    assert env.to_host(f).tolist() == [5] * (1 << 15)
    assert seen and all(launched == nblocks for launched, _, nblocks in seen)
    assert any(ndesc < nblocks for _, ndesc, nblocks in seen)
    c.close()


def test_inline_steps_leave_the_slot_free_at_once(env):
    # An inline launch took its bytes at enqueue: the step records no slot event,
    # and the next step may rewrite the slot while the launch still waits (here,
    # behind a held stream, one slot). A mapped step records one.
    c = env.copier(PLAN, slots=1, flush_mode="inline")
    records = []
    rec = c._backend.event_record
    c._backend.event_record = lambda ev, st: (records.append(ev), rec(ev, st))[1]
    a, b = env.empty((64,)), env.empty((64,))
    with env.hold(c_stream(env, c)):
        with c.step():
            c.copy(Site.POS, a, np.arange(64, dtype=np.int32))
        with c.step():  # the only slot, reused before the first launch ran
            c.copy(Site.POS, b, np.arange(64, dtype=np.int32) * 2)
    assert env.to_host(a).tolist() == list(range(64))
    assert env.to_host(b).tolist() == [2 * i for i in range(64)]
    assert records == [] and c.stats.host_waits == 0
    assert not c._ring.current.recorded
    assert c.stats.modes["inline"] == 2
    c.close()
    # a mapped step's slot is fenced: its event recorded (through the backend, or from C
    # by the staging core's launcher on CUDA), or, a graphed launch with completion tags
    # on (the default; CUCOPY_TAG=0 turns them off), its tag armed instead: the slot's
    # state says which happened
    m = env.copier(PLAN, slots=1, flush_mode="mapped")
    with m.step():
        m.copy(Site.POS, a, np.arange(64, dtype=np.int32) + 1)
    slot = m._ring.current
    assert (slot.recorded or (m._tags and slot.tag >= 0)) and not slot.dirty
    assert env.to_host(a).tolist() == list(range(1, 65))
    assert m.stats.modes["mapped"] == 1
    m.close()


@pytest.mark.parametrize("mode", ["auto", "inline", "mapped"])
def test_a_smaller_step_carries_no_table_space_reserved_for_a_larger_one(env, mode):
    # The copier reserves table space for the largest step it has seen; a later,
    # smaller step must not carry that empty space in its launch (inline closes
    # the gap, mapped carries the table only).
    c = env.copier(PLAN, flush_mode=mode)
    carries = []
    scatter = c._backend.scatter

    def spy(segment_ptr, nblocks, stream, mapped, carry=0, host_ptr=0):
        carries.append(carry)
        return scatter(segment_ptr, nblocks, stream, mapped, carry, host_ptr)

    c._backend.scatter = spy
    c._launcher = None  # every launch through scatter(), none from the staging core
    c._graph_cap = 0  # auto: small steps carried, not graphed (what is carried is the point)
    a = env.empty((300 * 4,))
    with c.step():  # 300 descriptors: 14 KB of table
        for i in range(300):
            c.copy(Site.POS, a[4 * i : 4 * i + 3], np.full(3, i, np.int32))
    for step in range(2):
        with c.step():
            for i in range(10):
                c.copy(Site.LENS, a[4 * i : 4 * i + 3], np.full(3, -i - step, np.int32))
        got = env.to_host(a).reshape(300, 4)[:, :3]
        assert got[:10].tolist() == [[-i - step] * 3 for i in range(10)]
        assert got[10:].tolist() == [[i] * 3 for i in range(10, 300)]
    table = pack.align(pack.HEADER_BYTES + 10 * pack.DESC_BYTES)
    if mode == "mapped":
        assert carries[1:] == [table, table]
    else:  # the table, then the data: ten 12-byte rows, 16 bytes apart
        assert carries[1:] == [table + 10 * 16] * 2
    c.close()


def test_a_wide_copy_is_cut_before_the_table_is_encoded(env, monkeypatch):
    # Staging notes a destination wider than one block, so the flush cuts the table
    # first and encodes it once (not once whole, then again cut).
    import cucopy.copier as copier_module

    calls = []
    encode = copier_module.pack.encode

    def counting(*a, **k):
        calls.append(a[1])
        return encode(*a, **k)

    monkeypatch.setattr(copier_module.pack, "encode", counting)
    # inline: a carried launch through scatter(), which the spy sees (auto would launch
    # this 12 KB segment graphed on a GPU)
    c = env.copier(PLAN, flush_mode="inline")
    seen = _spy_launches(c)
    wide = env.empty((3000,))
    small = env.empty((4,))
    with c.step():
        c.copy(Site.POS, wide, np.arange(3000, dtype=np.int32))
        c.copy(Site.LENS, small, np.arange(4, dtype=np.int32))
    assert env.to_host(wide).tolist() == list(range(3000))
    assert seen == [(4, 4, 4)]  # 12000 bytes in three pieces, and one: a block each
    if segment.IMPLEMENTATION == "python":  # the compiled twin encodes in C, unspied
        assert len(calls) == 1 and len(calls[0]) == 4
    c.close()
