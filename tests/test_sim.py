import numpy as np
import pytest

from cucopy import pack
from cucopy.backends.sim import SimBackend, SimDeadlock, SimDevice, SimMemoryError


@pytest.fixture
def dev():
    return SimDevice(policy="lazy", seed=3)


def test_arrays_slice_into_views(dev):
    a = dev.asarray(np.arange(12, dtype=np.int32).reshape(3, 4))
    v = a[1:, 1:3]
    assert v.shape == (2, 2) and v.strides == (16, 4)
    assert v.ptr == a.ptr + 16 + 4
    dev.raw(v)[...] = -1
    assert dev.to_host(a)[1:, 1:3].tolist() == [[-1, -1], [-1, -1]]
    with pytest.raises(TypeError, match="only basic indexing"):
        a[[0, 2]]


def test_own_address_space(dev):
    be = SimBackend(dev)
    host = np.zeros(4, np.int32)
    with pytest.raises(SimMemoryError, match="not device memory"):
        be.copy2d(True, host.ctypes.data, 16, host.ctypes.data, 16, 16, 1, dev.default_stream)
    other = SimDevice()
    b = other.empty((4,), np.int32)
    with pytest.raises(SimMemoryError):
        be.fill(b.ptr, 16, 16, 1, 0, 4, dev.default_stream)


def test_lazy_runs_only_on_wait_and_query_never_runs(dev):
    be = SimBackend(dev)
    s = dev.stream()
    a = dev.empty((4,), np.int32)
    be.fill(a.ptr, 16, 16, 1, 7, 4, s)
    ev = be.event_create()
    be.event_record(ev, s)
    for _ in range(3):
        assert not be.event_query(ev)
    assert s.pending == 2
    be.event_synchronize(ev)
    assert be.event_query(ev) and s.pending == 0
    assert dev.raw(a).tolist() == [7] * 4


def test_pinned_read_at_execution_pageable_at_call(dev):
    be = SimBackend(dev)
    s = dev.stream()
    pinned = dev.pinned_empty((4,), np.int32)
    pageable = np.zeros(4, np.int32)
    a, b = dev.empty((4,), np.int32), dev.empty((4,), np.int32)
    pinned[:] = 1
    pageable[:] = 1
    be.copy2d(True, a.ptr, 16, pinned.ctypes.data, 16, 16, 1, s)
    be.copy2d(True, b.ptr, 16, pageable.ctypes.data, 16, 16, 1, s)
    pinned[:] = 2
    pageable[:] = 2
    s.synchronize()
    assert dev.raw(a).tolist() == [2] * 4  # the race cucopy exists to prevent
    assert dev.raw(b).tolist() == [1] * 4


def test_hold_stalls_and_waiting_on_a_held_stream_deadlocks(dev):
    s = dev.stream()
    seen = []
    with s.hold():
        s.launch(lambda: seen.append(1))
        with pytest.raises(SimDeadlock):
            s.synchronize()
        assert seen == []
    s.synchronize()
    assert seen == [1]


@pytest.mark.parametrize("policy", ["eager", "random"])
def test_policies_run_in_fifo_order(policy):
    dev = SimDevice(policy=policy, seed=5)
    s = dev.stream()
    seen = []
    for i in range(50):
        s.launch(lambda i=i: seen.append(i))
    s.synchronize()
    assert seen == list(range(50))
    if policy == "eager":
        s.launch(lambda: seen.append("now"))
        assert seen[-1] == "now"


def test_stream_waits_on_event_of_another(dev):
    a, b = dev.stream(), dev.stream()
    order = []
    a.launch(lambda: order.append("a"))
    ev = dev.event()
    ev.record(a)
    b.wait_event(ev)
    b.launch(lambda: order.append("b"))
    b.synchronize()
    assert order == ["a", "b"]


def test_capture_and_replay_reread_pinned_sources(dev):
    be = SimBackend(dev)
    s = dev.stream()
    pinned = dev.pinned_empty((2,), np.int64)
    a = dev.empty((2,), np.int64)
    with dev.capture(s) as graph:
        be.copy2d(True, a.ptr, 16, pinned.ctypes.data, 16, 16, 1, s)
        assert s.is_capturing and be.is_capturing(s)
    assert not be.is_capturing(s) and len(graph) == 1 and s.pending == 0
    for v in (3, 4):
        pinned[:] = v
        graph.replay(s)
        s.synchronize()
        assert dev.raw(a).tolist() == [v, v]
    with dev.capture(s), pytest.raises(Exception, match="pageable"):
        be.copy2d(True, a.ptr, 16, np.zeros(2, np.int64).ctypes.data, 16, 16, 1, s)


def test_scatter_decodes_segment_in_shuffled_order(dev):
    be = SimBackend(dev)
    s = dev.stream()
    out = dev.empty((64,), np.uint8)
    pinned = be.alloc_pinned(4096)
    seg = pinned.array
    n = 16
    data0 = pack.align(pack.HEADER_BYTES + n * pack.DESC_BYTES)
    descs = []
    for i in range(n):
        seg[data0 + 16 * i] = i + 1
        descs.append((out.ptr + i, data0 + 16 * i, 0, 1, 1, 1, 1, pack.KIND_H2D, 0, 0))
    nblocks = pack.encode(seg[:data0], descs, data0, data0 + 16 * n)
    seen_orders = set()
    orig = pack.reference_scatter

    def spy(segment, load, store, order=None):
        seen_orders.add(tuple(order))
        return orig(segment, load, store, order)

    pack.reference_scatter = spy
    try:
        for _ in range(4):
            be.scatter(pinned.device_ptr, nblocks, s, True)
            s.synchronize()
    finally:
        pack.reference_scatter = orig
    assert dev.raw(out)[:n].tolist() == list(range(1, n + 1))
    assert len(seen_orders) > 1  # shuffled, not program order
    pinned.close()


def _one_copy_segment(be, dev, value):
    out = dev.empty((4,), np.int32)
    pinned = be.alloc_pinned(4096)
    seg = pinned.array
    data0 = pack.align(pack.HEADER_BYTES + pack.DESC_BYTES)
    seg[data0 : data0 + 16] = np.full(4, value, np.int32).view(np.uint8)
    row = (out.ptr, data0, 0, 16, 16, 16, 1, pack.KIND_H2D, 0, 0)
    nblocks = pack.encode(seg[:data0], [row], data0, data0 + 16)
    return out, pinned, data0, nblocks


def test_sim_scatter_carry_snapshots_at_the_call():
    dev = SimDevice("lazy")
    be = SimBackend(dev)
    s = dev.stream()
    for carry_all in (True, False):
        out, pinned, data0, nblocks = _one_copy_segment(be, dev, 7)
        carry = data0 + 16 if carry_all else data0
        be.scatter(pinned.device_ptr, nblocks, s, True, carry, pinned.ptr)
        pinned.array[data0 : data0 + 16] = np.full(4, 9, np.int32).view(np.uint8)
        pinned.array[:data0] = 0  # the header and table: carried either way
        s.synchronize()
        # carried data keeps its value at the call; uncarried data is read when it runs
        assert dev.raw(out).tolist() == ([7] * 4 if carry_all else [9] * 4)
        pinned.close()


def test_sim_scatter_carry_must_hold_the_table_and_fit():
    dev = SimDevice("lazy")
    be = SimBackend(dev)
    out, pinned, data0, nblocks = _one_copy_segment(be, dev, 1)
    with pytest.raises(AssertionError, match="do not hold the descriptor table"):
        be.scatter(pinned.device_ptr, nblocks, dev.stream(), True, pack.HEADER_BYTES, pinned.ptr)
    dev.carry_capacities = (1008,)
    with pytest.raises(ValueError, match="carry=2000"):
        be.scatter(pinned.device_ptr, nblocks, dev.stream(), True, 2000, pinned.ptr)
    pinned.close()


def test_a_kernel_node_takes_its_parameters_when_a_replay_is_enqueued():
    """cuGraphExecKernelNodeSetParams semantics: a replay already enqueued keeps the
    parameters it was enqueued with; later replays take the new ones."""
    from cucopy.backends.sim import SimDevice, SimGraph

    dev = SimDevice(policy="lazy")
    s = dev.stream()
    seen = []
    params = bytearray(b"\x07")
    with dev.capture(s) as g:
        node = s.launch_node(lambda p: seen.append(p[0]), params)
    params[0] = 1  # the node copied its parameters at capture
    assert g.nodes == [node]
    with s.hold():
        g.replay(s)
        g.set_params(node, b"\x09")
        g.replay(s)
    s.synchronize()
    assert seen == [7, 9]
    with pytest.raises(ValueError, match="is not a node of this graph"):
        SimGraph().set_params(node, b"\x01")
