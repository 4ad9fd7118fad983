"""A hostile caller: re-entrant Python in the fast path, interrupts at bad lines, foreign
threads, odd arrays. Each case ends in the right bytes or a clear error, and the copier
stays usable (a closed copier refuses every call). The suite runs on the compiled core
and again on the pure-Python twin (CUCOPY_PURE_PYTHON=1); every test here runs on both.
"""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest

import cucopy as cc
from cucopy.backends.sim import SimArray, SimBackend, SimDevice


class Site(cc.CopySite):
    A = cc.H2D
    B = cc.H2D  # a barrier
    PLAIN = cc.H2D  # not merged
    TAIL = cc.FILL


PLAN = cc.CopyPlan(merge={Site.A, Site.B, Site.TAIL}, flush_after={Site.B})


@pytest.fixture
def dev():
    return SimDevice(policy="lazy")


def _copier(dev, backend=None, **kw):
    kw.setdefault("stream", dev.default_stream)
    return cc.DeviceCopier(PLAN, device=dev, backend=backend or "sim", **kw)


_hooks: list = []  # what Hostile's fingerprint and attribute reads run


def _run_hooks():
    for h in list(_hooks):
        h()


def _hostile_fp(x):
    _run_hooks()
    return 1


# a view made afresh (h[:n]) is read through these attributes, as a SimArray's
_hostile_fp.__cucopy_view__ = ("_root", "ptr", False, "shape", "strides", False, False, "dtype", ())


class Hostile(SimArray):
    """A device array whose fingerprint and address read run arbitrary Python code."""

    __slots__ = ()
    __cucopy_fingerprint__ = staticmethod(_hostile_fp)

    @property
    def ptr(self) -> int:
        _run_hooks()
        return self._ptr

    def __getitem__(self, idx):
        v = super().__getitem__(idx)
        return Hostile(v.device, v._view, v._alloc, v._base, v._root)


def _hostile(dev, shape, dtype=np.int32):
    a = dev.zeros(shape, dtype)
    return Hostile(a.device, a._view, a._alloc, a._base)


@pytest.fixture(autouse=True)
def _no_hooks():
    _hooks.clear()
    yield
    _hooks.clear()


def _steps(c, dst, values, site=Site.A, n=2):
    for _ in range(n):  # the first caches the destination; the next take the fast path
        with c.step():
            assert c.copy(site, dst, np.asarray(values, dtype=dst.dtype))


# -- 1: re-entrant close() ---------------------------------------------------------------


@pytest.mark.parametrize("view", [False, True], ids=["cached", "fresh-view"])
def test_close_inside_the_fingerprint_refuses_the_copy(dev, view):
    """A shutdown hook that closes the copier while the fast path validates the
    destination: the copy is refused as closed, not staged into a freed slot."""
    c = _copier(dev)
    base = _hostile(dev, (8,))
    _steps(c, base, np.arange(8))
    dst = base[:4] if view else base
    if view:
        _steps(c, dst, np.arange(4) + 10)
    c.begin()
    _hooks.append(c.close)
    with pytest.raises(cc.CopyError, match="A: the copier is closed"):
        c.copy(Site.A, dst, np.arange(len(dst), dtype=np.int32) + 100)
    assert c.closed and c.staged == 0
    _hooks.clear()
    with pytest.raises(cc.CopyError, match="closed"):
        c.copy(Site.A, dst, np.arange(len(dst), dtype=np.int32))
    assert 100 not in dev.to_host(base)


# -- 2: sixteen dimensions ----------------------------------------------------------------


def test_fresh_view_with_sixteen_non_unit_dimensions(dev):
    c = _copier(dev)
    base = dev.zeros((2,) * 15 + (4,), np.int8)
    src = np.ones(base.shape, np.int8)
    _steps(c, base, src)
    view = base[..., ::2]  # 16 non-1 dimensions, innermost stride 2 items
    want = np.arange(2**16, dtype=np.int64).astype(np.int8).reshape(view.shape)
    with c.step():
        assert c.copy(Site.A, view, want)
    got = dev.to_host(base)
    np.testing.assert_array_equal(got[..., ::2], want)
    np.testing.assert_array_equal(got[..., 1::2], 1)


# -- 3: fill_tail of a byte-swapped dtype --------------------------------------------------


@pytest.mark.parametrize("dtype", [">i4", ">u2", ">i8", "<i4", "|i1"])
def test_fill_tail_of_a_byte_swapped_dtype(dev, dtype):
    c = _copier(dev)
    dst = dev.zeros((5,), np.dtype(dtype))
    for _ in range(3):  # the first fill caches the destination, the next are fast
        with c.step():
            assert c.fill_tail(Site.TAIL, dst, 2, 6)
        np.testing.assert_array_equal(dev.to_host(dst), [0, 0, 6, 6, 6])


def test_fill_tail_alternating_dtypes_each_keep_their_own_order(dev):
    # the compiled fill keeps the last NumPy dtype's kind and byte order: destinations of
    # another dtype in between (same size and kind, the other order; another kind) must
    # each be filled by their own, never by the kept answer
    c = _copier(dev)
    dtypes = ["<i4", ">i4", "<u4", ">u2", "|u1", "|i1", "<i4"]
    dsts = [dev.zeros((5,), np.dtype(d)) for d in dtypes]
    for value in (1, 2, 3):
        for dst in dsts:
            with c.step():
                assert c.fill_tail(Site.TAIL, dst, 0, value)
            np.testing.assert_array_equal(dev.to_host(dst), [value] * 5)
        for dst in dsts:
            with c.step():
                assert c.fill_tail(Site.TAIL, dst, 2, 6)
            np.testing.assert_array_equal(dev.to_host(dst), [value, value, 6, 6, 6])


# -- 4: a torch source whose conj or neg bit is set in place -------------------------------


def test_cached_torch_source_made_conjugate_in_place_is_refused(dev):
    torch = pytest.importorskip("torch")
    c = _copier(dev)
    dst = dev.zeros((3,), np.complex64)
    x = torch.tensor([1 + 1j, 2 + 2j, 3 - 3j], dtype=torch.complex64)
    _steps(c, dst, x.numpy(), n=1)
    for _ in range(2):
        with c.step():
            c.copy(Site.A, dst, x)
    x.data = x.conj()  # the same bytes, now meaning their conjugates
    with pytest.raises(TypeError, match="A: src: .*conjugate/negative bit"):
        with c.step():
            c.copy(Site.A, dst, x)
    np.testing.assert_array_equal(dev.to_host(dst), [1 + 1j, 2 + 2j, 3 - 3j])
    with c.step():  # still usable
        c.copy(Site.A, dst, x.resolve_conj())
    np.testing.assert_array_equal(dev.to_host(dst), [1 - 1j, 2 - 2j, 3 + 3j])


def test_cached_torch_source_made_negative_in_place_is_refused(dev):
    torch = pytest.importorskip("torch")
    c = _copier(dev)
    dst = dev.zeros((3,), np.float32)
    y = torch.tensor([1.0, 2.0, 3.0])
    for _ in range(3):
        with c.step():
            c.copy(Site.A, dst, y)
    y.data = torch.tensor([1 + 5j, 2 + 6j, 3 + 7j]).conj().imag  # a negative view
    assert y.is_neg()
    with pytest.raises(TypeError, match="A: src: .*conjugate/negative bit"):
        with c.step():
            c.copy(Site.A, dst, y)
    np.testing.assert_array_equal(dev.to_host(dst), [1, 2, 3])


# -- 5: BaseExceptions raised by Python code the fast path calls propagate ------------------


@pytest.mark.parametrize("view", [False, True], ids=["cached", "fresh-view"])
@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_base_exceptions_in_the_fast_path_propagate(dev, view, exc):
    c = _copier(dev)
    base = _hostile(dev, (8,))
    _steps(c, base, np.arange(8))
    dst = base[:4] if view else base
    if view:
        _steps(c, dst, np.arange(4))

    def interrupt():
        _hooks.clear()
        raise exc()

    _hooks.append(interrupt)
    with pytest.raises(exc):
        with c.step():
            c.copy(Site.A, dst, np.full(len(dst), 7, np.int32))
    assert c.staged == 0 and not c.in_step
    _steps(c, dst, np.full(len(dst), 9, np.int32), n=1)  # usable
    np.testing.assert_array_equal(dev.to_host(dst), 9)


def test_an_exception_in_the_fingerprint_is_a_miss_not_an_error(dev):
    """An ordinary Exception there makes the cached entry a miss: the general path
    copies (and would report a real error itself)."""
    c = _copier(dev)
    dst = _hostile(dev, (4,))
    _steps(c, dst, np.arange(4))
    raised = []

    def fail():
        if not raised:
            raised.append(1)
            raise RuntimeError("fingerprint failed")

    _hooks.append(fail)
    _steps(c, dst, np.arange(4) + 1, n=1)
    assert raised
    np.testing.assert_array_equal(dev.to_host(dst), np.arange(4) + 1)


# -- 6 and 8: other threads ------------------------------------------------------------------


def _in_thread(fn):
    box = []

    def run():
        try:
            box.append(("ok", fn()))
        except BaseException as e:  # reported to the caller
            box.append(("raised", e))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return box[0]


def test_close_from_another_thread_while_a_step_is_open_is_refused(dev):
    c = _copier(dev)
    dst = dev.zeros((4,), np.int32)
    with c.step():
        c.copy(Site.A, dst, np.arange(4, dtype=np.int32))
        how, err = _in_thread(c.close)
        assert how == "raised" and isinstance(err, cc.CopyError)
        assert "another thread" in str(err)
        assert not c.closed and c.staged == 1
        c.copy(Site.A, dst[2:], np.array([8, 9], np.int32))
    np.testing.assert_array_equal(dev.to_host(dst), [0, 1, 8, 9])
    c.close()
    assert c.closed


def test_another_threads_step_exit_leaves_the_owners_step_open(dev):
    c = _copier(dev)
    dst = dev.zeros((4,), np.int32)
    step = c.step()
    with step:
        c.copy(Site.A, dst, np.arange(4, dtype=np.int32))
        how, err = _in_thread(lambda: step.__exit__(None, None, None))
        assert how == "raised" and isinstance(err, cc.CopyError)
        assert "another thread" in str(err)
        assert c.in_step and c.staged == 1
        c.copy(Site.A, dst[:1], np.array([5], np.int32))  # still the owner's step
    np.testing.assert_array_equal(dev.to_host(dst), [5, 1, 2, 3])
    assert cc.active_copier() is None  # the owner's exit deactivated the step's copier


def test_a_dead_threads_step_is_never_a_new_threads(dev):
    """Ownership is not the thread ident, which CPython hands to a later thread."""
    c = _copier(dev)
    dst = dev.zeros((4,), np.int32)
    _in_thread(c.begin)  # opened by a thread that then ends
    idents = set()
    for _ in range(4):  # a new thread often gets the dead one's ident: never its step
        how, err = _in_thread(
            lambda: (idents.add(threading.get_ident()), c.copy(Site.A, dst, np.ones(4, np.int32)))
        )
        assert how == "raised" and "another thread" in str(err)
    assert c.staged == 0


# -- 7: interrupts at bad lines ---------------------------------------------------------------


def test_discard_repairs_a_step_block_an_interrupt_cut_short(dev):
    """An interrupt between a step() block's mark and its body leaves the mark set:
    the next step() is refused as nested, saying so, until discard()."""
    c = _copier(dev)
    dst = dev.zeros((4,), np.int32)
    c.begin()
    c._stepping = True  # where the interrupt left it
    with pytest.raises(cc.CopyError, match=r"discard\(\) ends it"):
        with c.step():
            pass
    c.discard()
    _steps(c, dst, np.arange(4), n=1)
    np.testing.assert_array_equal(dev.to_host(dst), np.arange(4))


class _InterruptedBegin(cc.DeviceCopier):
    armed = False

    def begin(self):
        super().begin()
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt


def test_an_interrupt_in_begin_does_not_wedge_step(dev):
    c = _InterruptedBegin(PLAN, device=dev, backend="sim", stream=dev.default_stream)
    dst = dev.zeros((4,), np.int32)
    c.armed = True
    with pytest.raises(KeyboardInterrupt):
        with c.step():
            pass
    _steps(c, dst, np.arange(4), n=1)  # not refused as nested
    np.testing.assert_array_equal(dev.to_host(dst), np.arange(4))


def test_an_interrupt_after_the_launch_closes_the_landed_segment(dev, monkeypatch):
    """Interrupted after the launch and before the segment is closed: the copies have
    landed, so none is dropped and the next step is not lost to a second cut."""
    c = _copier(dev, flush_mode="dma")
    dst = dev.zeros((4,), np.int32)
    drops = []
    add = type(c.stats).add_segment
    armed = [True]

    def interrupted(self, *a):
        add(self, *a)
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt

    monkeypatch.setattr(type(c.stats), "add_segment", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with c.step():
            c.copy(Site.A, dst, np.arange(4, dtype=np.int32), on_drop=lambda: drops.append(1))
    assert c.staged == 0
    np.testing.assert_array_equal(dev.to_host(dst), np.arange(4))
    with c.step():
        c.copy(Site.A, dst[:2], np.array([7, 7], np.int32), on_drop=lambda: drops.append(2))
    np.testing.assert_array_equal(dev.to_host(dst), [7, 7, 2, 3])
    assert drops == []


class _LateInterrupt(SimBackend):
    """A backend whose launch is enqueued, then interrupted (Ctrl-C right after it)."""

    armed = False

    def scatter(self, *a, **kw):
        super().scatter(*a, **kw)
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt


def test_an_interrupt_inside_the_launch_leaves_the_copier_usable(dev):
    """The copier cannot tell whether a launch interrupted from inside ran: it drops the
    segment through on_drop (an owner then re-sends), and the next step lands."""
    be = _LateInterrupt(dev)
    c = cc.DeviceCopier(PLAN, device=dev, backend=be, stream=dev.default_stream, flush_mode="dma")
    dst = dev.zeros((4,), np.int32)
    drops = []
    be.armed = True
    with pytest.raises(KeyboardInterrupt):
        with c.step():
            c.copy(Site.A, dst, np.arange(4, dtype=np.int32), on_drop=lambda: drops.append(1))
    assert drops == [1] and c.staged == 0 and not c.in_step
    _steps(c, dst, np.arange(4) + 5, n=1)
    np.testing.assert_array_equal(dev.to_host(dst), np.arange(4) + 5)


# -- 9: the source cache keeps no dropped input alive ------------------------------------------


@pytest.mark.parametrize("merged", [True, False], ids=["merged", "buffer"])
def test_source_cache_keeps_no_dropped_torch_input_alive(dev, merged):
    torch = pytest.importorskip("torch")
    c = _copier(dev)
    dst = dev.zeros((256,), np.float32)
    buf = cc.DeviceCopyBuffer(dst, site=Site.A)
    owners = []
    for i in range(20):
        host = np.full(256, float(i), np.float32)
        owners.append(weakref.ref(host))
        x = torch.from_numpy(host)  # the tensor's bytes are host's: host lives while they do
        del host
        with c.step(), c.activate():
            if merged:
                c.copy(Site.A, dst, x)
                c.copy(Site.A, dst, x)  # the second from the source cache
            else:
                buf.update(x)
                buf.update(x, force=True)
        del x
    gc.collect()
    assert sum(r() is not None for r in owners) == 0
    np.testing.assert_array_equal(dev.to_host(dst), 19)


# -- 10 and 11: arrays whose bytes are not their values -----------------------------------------


@pytest.mark.parametrize("site", [Site.A, Site.PLAIN])
@pytest.mark.parametrize("cached", [False, True])
def test_masked_array_sources_are_refused(dev, site, cached):
    c = _copier(dev)
    dst = dev.zeros((4,), np.int32)
    if cached:
        _steps(c, dst, np.arange(4), site=site)
    m = np.ma.array(np.arange(4, dtype=np.int32) + 10, mask=[0, 1, 0, 1])
    with pytest.raises(TypeError, match=rf"{site.name}: src: numpy.ma.*MaskedArray.*masked"):
        with c.step():
            c.copy(site, dst, m)
    _steps(c, dst, np.arange(4) + 1, site=site, n=1)
    np.testing.assert_array_equal(dev.to_host(dst), np.arange(4) + 1)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_and_fake_tensors_are_refused_naming_the_argument(dev):
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    c = _copier(dev)
    dst = dev.zeros((4,), np.float32)
    nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(2)])
    with FakeTensorMode():
        fake = torch.zeros(4)
    for x, why in ((nested, "nested tensors"), (fake, "FakeTensor")):
        with pytest.raises(TypeError, match=f"A: src: torch.Tensor.*{why}"):
            with c.step():
                c.copy(Site.A, dst, x)
    _steps(c, dst, np.ones(4), n=1)
    np.testing.assert_array_equal(dev.to_host(dst), 1)


# -- Segment.bind() ------------------------------------------------------------------------------


def test_bind_clamps_a_slots_top_to_its_bytes():
    from cucopy import segment

    arr = np.zeros(4096, np.uint8)

    class Slot:  # hand-made: the ring never makes one that claims more than it has
        array = arr
        mv = memoryview(arr)
        top = 1 << 40
        bottom = 0
        headroom = 0

    seg = segment.Segment(set(), set(), set())
    seg.bind(Slot())
    assert seg.room(4096)
    assert not seg.room(4097)


# -- 12: a capture that begins and ends inside an open step ----------------------------------


@pytest.mark.parametrize("cached", [False, True], ids=["first-copy", "fast-path"])
def test_a_merged_copy_made_during_a_capture_begun_inside_the_step_is_refused(dev, cached):
    """Staged during a capture that began after begin() and ended before the flush, a
    merged copy would land once, outside the graph, which would hold nothing of it."""
    stream = dev.stream()
    c = _copier(dev, stream=stream)
    a, t = dev.zeros((4,), np.int32), dev.zeros((4,), np.int32)
    if cached:  # the destinations cached: the copies below reach the fast path
        with c.step():
            c.copy(Site.A, a, np.zeros(4, np.int32))
            c.fill_tail(Site.TAIL, t, 0, 0)
    began = r"a graph capture began on the copier's stream after begin\(\)"
    c.begin()
    with dev.capture(stream):
        with pytest.raises(cc.CopyError, match=f"A: {began}"):
            c.copy(Site.A, a, np.full(4, 1, np.int32))
        with pytest.raises(cc.CopyError, match=f"TAIL: {began}"):
            c.fill_tail(Site.TAIL, t, 1, 5)
        assert c.staged == 0
    c.flush()
    assert dev.to_host(a).tolist() == [0] * 4 and dev.to_host(t).tolist() == [0] * 4
    with c.step():  # the copier goes on
        c.copy(Site.A, a, np.full(4, 2, np.int32))
    assert dev.to_host(a).tolist() == [2] * 4


def test_take_top_of_an_unbound_segment_takes_nothing():
    from cucopy import segment

    seg = segment.Segment(frozenset(), frozenset())
    assert seg.take_top(64) == -1
    assert seg.take_top(-64) == -1


def test_an_interrupt_inside_discard_still_tells_the_owners(dev, monkeypatch):
    c = _copier(dev)
    dst = dev.zeros((4,), np.int32)
    drops = []
    record = c._ring.record
    armed = [True]

    def interrupted(stream):
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt
        return record(stream)

    c.begin()
    c.copy(Site.A, dst, np.arange(4, dtype=np.int32), on_drop=lambda: drops.append(1))
    monkeypatch.setattr(c._ring, "record", interrupted)
    with pytest.raises(KeyboardInterrupt):
        c.discard()
    assert drops == [1] and c.staged == 0 and not c.in_step
    _steps(c, dst, np.arange(4) + 3, n=1)
    np.testing.assert_array_equal(dev.to_host(dst), np.arange(4) + 3)


def test_a_capture_query_that_closes_the_copier_leaves_begin_safe(dev):
    # begin()'s capture query may be Python code; one that closes the copier leaves the
    # compiled begin() nothing to open (it checks again after the query): the step is
    # refused as any closed copier's is
    c = _copier(dev)
    dst = dev.zeros((4,), np.int32)
    for _ in range(2 * c._ring.slots):  # the ring's slots made: begin() is compiled
        with c.step():
            c.copy(Site.A, dst, np.arange(4, dtype=np.int32))
    query = c._cap_query
    called = []

    def closing(arg):
        called.append(arg)
        c._cap_query = query
        c.close()
        return query(arg)

    c._cap_query = closing
    from cucopy import copier

    try:
        c.begin()
    except cc.CopyError as e:
        assert called and "closed" in str(e)
    else:  # (the Python begin() asks the backend itself, not this query)
        assert not called and not copier._COMPILED
        c.discard()
        c.close()
    assert called or not copier._COMPILED
    assert c.closed
    assert dev.to_host(dst).tolist() == [0, 1, 2, 3]


def test_an_on_drop_dropped_with_its_entries_may_stage_again(dev):
    # the segment's entries are dropped when it lands, inside the step's exit; the last
    # reference to an on_drop going may run Python that stages through the same copier
    # into the segment being dropped: every entry is dropped once, the new ones land
    c = _copier(dev)
    dst = [dev.zeros((4,), np.int32) for _ in range(6)]
    late = [dev.zeros((4,), np.int32) for _ in range(3)]
    done = []

    class Stager:
        def __call__(self, *args):
            pass

        def __del__(self):
            if not done:
                for k, d in enumerate(late):
                    done.append(c.copy(Site.A, d, np.full(4, 7 + k, np.int32)))

    with c.step():
        for i, d in enumerate(dst):
            c.copy(Site.A, d, np.full(4, i, np.int32), on_drop=Stager() if i == 0 else None)
    gc.collect()
    with c.step():
        c.copy(Site.A, dst[0], np.full(4, 9, np.int32))
    c.close()
    assert done == [True] * 3
    assert [dev.to_host(d).tolist()[0] for d in dst] == [9, 1, 2, 3, 4, 5]
    assert [dev.to_host(d).tolist() for d in late] == [[7] * 4, [8] * 4, [9] * 4]


# -- 13: a slot the compiled segment binds through its own fields --------------------------------


def test_binding_a_slot_whose_fields_are_not_set_raises_and_binds_nothing():
    """The compiled segment reads a ring slot's array, top and bottom as the slot's own
    C fields: a bare SlotCore (nothing set) or a closed slot (array None) is refused
    with a TypeError, never read."""
    from cucopy import segment

    core = pytest.importorskip("cucopy._segment")
    if segment.IMPLEMENTATION != "compiled":
        pytest.skip("the compiled core is not in use")
    seg = segment.Segment(frozenset(), frozenset())
    slot = core.SlotCore()
    assert slot.tag == -1 and slot.array is None
    with pytest.raises(TypeError, match="no array"):
        seg.bind(slot)
    slot.array = np.zeros(4096, np.uint8)
    with pytest.raises(TypeError, match="top and bottom"):
        seg.bind(slot)
    slot.top, slot.bottom = 4096, 0
    seg.bind(slot)
    assert seg.room(4096) and not seg.room(4097)
    assert seg.take_top(64) == 4096 - 64 and slot.top == 4096 - 64  # written back
    slot.array = None  # as Slot.close() does: the export ends
    with pytest.raises(TypeError):
        seg.bind(slot)
    assert seg.take_top(64) == -1  # (unbound: nothing to take)
