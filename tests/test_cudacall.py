"""The CUDA backend's per-step driver calls made from C (``cucopy.backends._cudacall``).

No GPU here: ctypes callbacks stand in for ``cuLaunchKernel``,
``cuStreamIsCapturing``, ``cuEventRecord`` and ``cuEventQuery``, so the tests see
exactly what the driver would be handed (kernel, grid, stream, the parameter
buffer's bytes and size, event handles). On a GPU the same
calls run for real in every CUDA test (tests/test_backend_cuda.py and the rest).
"""

from __future__ import annotations

import ctypes
import os
import struct
import weakref

import numpy as np
import pytest

from cucopy import pack
from cucopy.errors import CopyError

try:
    from cucopy.backends import _cudacall
except ImportError:  # no compiler where this runs
    _cudacall = None

needs_ext = pytest.mark.skipif(_cudacall is None, reason="cucopy.backends._cudacall is not built")

_LAUNCH = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,
    *([ctypes.c_uint] * 7),
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.POINTER(ctypes.c_void_p),
)
_CAPTURING = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))
_EVENT_RECORD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_EVENT_QUERY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_HTOD = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p
)
_COPY2D = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)


class _Memcpy2D(ctypes.Structure):
    """cuda.h's CUDA_MEMCPY2D."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_ulonglong),
        ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_ulonglong),
        ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
    ]


NOT_READY = 600  # CUDA_ERROR_NOT_READY


class FakeDriver:
    """Records launches and event calls; answers capture queries from ``status`` /
    ``result``, event queries from ``pending`` / ``event_result``."""

    def __init__(self):
        self.launches = []
        self.result = 0  # CUresult the next calls return
        self.status = 0
        self.records = []  # (event, stream) of each cuEventRecord
        self.queries = []  # event of each cuEventQuery
        self.pending = set()  # events cuEventQuery answers NOT_READY for
        self.event_result = 0  # CUresult the next event calls return, when not 0
        self.fail_records = set()  # events cuEventRecord answers an error for
        self._launch = _LAUNCH(self.launch)
        self._capturing = _CAPTURING(self.capturing)
        self._record = _EVENT_RECORD(self.event_record)
        self._query = _EVENT_QUERY(self.event_query)
        self.copies = []  # (dst, dpitch, src, spitch, width, rows, stream) of each copy
        self.copy_result = 0  # CUresult the copies return
        self._htod = _HTOD(self.htod)
        self._copy2d = _COPY2D(self.copy2d)
        addr = ctypes.c_void_p
        self.addrs = (
            ctypes.cast(self._launch, addr).value,
            ctypes.cast(self._capturing, addr).value,
        )
        # for Driver.events()
        self.event_addrs = (
            ctypes.cast(self._record, addr).value,
            ctypes.cast(self._query, addr).value,
        )
        # for Driver.copies()
        self.copy_addrs = (
            ctypes.cast(self._htod, addr).value,
            ctypes.cast(self._copy2d, addr).value,
        )

    def htod(self, dst, src, nbytes, stream):
        return self.copied(dst, nbytes, src or 0, nbytes, nbytes, 1, stream or 0)

    def copy2d(self, params, stream):
        p = _Memcpy2D.from_address(params)
        assert p.srcMemoryType == 1 and p.dstMemoryType == 2  # host to device
        assert p.srcXInBytes == p.srcY == p.dstXInBytes == p.dstY == 0
        return self.copied(
            p.dstDevice, p.dstPitch, p.srcHost, p.srcPitch, p.WidthInBytes, p.Height, stream or 0
        )

    def copied(self, dst, dpitch, src, spitch, width, rows, stream):
        self.copies.append((dst, dpitch, src, spitch, width, rows, stream))
        return self.copy_result

    def launch(self, f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra):
        rec = {"f": f, "grid": (gx, gy, gz), "block": (bx, by, bz), "shmem": shmem}
        rec["stream"] = stream or 0
        if params:
            rec["seg"] = ctypes.cast(params[0], ctypes.POINTER(ctypes.c_uint64))[0]
        if extra:
            # {BUFFER_POINTER, buf, BUFFER_SIZE, &size, END}
            assert (extra[0] or 0) == 1 and (extra[2] or 0) == 2 and (extra[4] or 0) == 0
            size = ctypes.cast(extra[3], ctypes.POINTER(ctypes.c_size_t))[0]
            rec["size"] = size
            rec["buffer"] = ctypes.string_at(extra[1], size)
            rec["buffer_at"] = extra[1]  # where the driver was told to read it
        self.launches.append(rec)
        return self.result

    def capturing(self, stream, out):
        out[0] = self.status
        return self.result

    def event_record(self, event, stream):
        self.records.append((event or 0, stream or 0))
        if (event or 0) in self.fail_records:
            return 999  # CUDA_ERROR_UNKNOWN
        return self.event_result

    def event_query(self, event):
        self.queries.append(event or 0)
        if self.event_result:
            return self.event_result
        return NOT_READY if (event or 0) in self.pending else 0


CAPS = [(1008, 0x1000), (2032, 0x2000), (4080, 0x4000), (32736, 0x8000)]

#: fake drivers of landing copiers and the copiers, kept for the module's tests: a
#: copier left to the garbage collector frees its Driver whenever the collector runs,
#: and the Driver's dealloc calls the fake's graph destroy callbacks, which must not have
#: been freed first (_drivers_before_fakes drops the Drivers at the module's end)
_KEEP: list = []


@pytest.fixture(autouse=True, scope="module")
def _drivers_before_fakes():
    import gc

    yield
    for c, _fake in _KEEP:
        c = c()
        if c is not None:
            c._launcher = c._ring._launcher = c._test_driver = None
    gc.collect()  # the Drivers go while their fakes' callbacks still exist
    _KEEP.clear()
    _GRAPH_FAKES.clear()


#: every GraphFake of the module's tests, kept to its end: a Driver's dealloc calls the
#: fake's graph destroy callbacks, whenever the Driver goes (see _drivers_before_fakes)
_GRAPH_FAKES: list = []


_GRAPH_CREATE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint)
_GRAPH_ADD = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_void_p,
)
_GRAPH_INST = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_ulonglong
)
_GRAPH_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_GRAPH_DESTROY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_GRAPH_SET = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
WHOLE = 0x3A0  # the whole-segment kernel's fake CUfunction


class _NodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2."""

    _fields_ = [
        ("func", ctypes.c_void_p),
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shmem", ctypes.c_uint),
        ("params", ctypes.POINTER(ctypes.c_void_p)),
        ("extra", ctypes.c_void_p),
        ("kern", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
    ]


class GraphFake(FakeDriver):
    """FakeDriver with cuGraphCreate .. cuGraphExecKernelNodeSetParams_v2: records each
    graph's kernel node (function, grid, block, its two arguments), each launch of an
    executable (with the node record as the executable's parameters stand then) and
    each re-pointing of one."""

    def __init__(self):
        super().__init__()
        self.nodes = {}  # graph -> node record (as added)
        self.node_of = {}  # graph -> its kernel node's handle
        self.execs = {}  # exec -> node record (as the exec's launches run it now)
        self.graph_of = {}  # exec -> the graph it was instantiated from
        self.created = []  # graphs made (cuGraphCreate)
        self.instantiated = []  # execs made (cuGraphInstantiateWithFlags)
        self.graph_launches = []  # (node record, stream)
        self.exec_launches = []  # (exec, stream)
        self.set_params = []  # (exec, node record set) of each SetParams call
        self.destroyed = []  # graphs destroyed
        self.exec_destroyed = []
        self.graph_result = 0  # CUresult cuGraphLaunch returns
        self.set_result = 0  # CUresult cuGraphExecKernelNodeSetParams returns
        self.fail_instantiate = {}  # instantiate call's index -> the CUresult it returns
        self._next = 0x6000
        self._keep = [
            _GRAPH_CREATE(self.create),
            _GRAPH_ADD(self.add),
            _GRAPH_INST(self.instantiate),
            _GRAPH_LAUNCH(self.graph_launch),
            _GRAPH_DESTROY(self.destroy),
            _GRAPH_DESTROY(self.exec_destroy),
            _GRAPH_SET(self.exec_set_params),
        ]
        self.graph_addrs = tuple(ctypes.cast(f, ctypes.c_void_p).value for f in self._keep)
        self._calls = 0  # instantiate calls so far
        _GRAPH_FAKES.append(self)  # its callbacks outlive any Driver (see _GRAPH_FAKES)

    def _handle(self):
        self._next += 16
        return self._next

    @staticmethod
    def _node_record(params):
        p = _NodeParams.from_address(params)
        return {
            "f": p.func,
            "grid": tuple(p.grid),
            "block": tuple(p.block),
            "seg": ctypes.cast(p.params[0], ctypes.POINTER(ctypes.c_uint64))[0],
            # the completion tag's device address (0: none)
            "cell": ctypes.cast(p.params[1], ctypes.POINTER(ctypes.c_uint64))[0],
            "extra": p.extra,
        }

    def create(self, out, flags):
        out[0] = g = self._handle()
        self.nodes[g] = None
        self.created.append(g)
        return 0

    def add(self, out, graph, deps, ndeps, params):
        self.nodes[graph] = self._node_record(params)
        out[0] = self.node_of[graph] = self._handle()
        return 0

    def instantiate(self, out, graph, flags):
        rc = self.fail_instantiate.get(self._calls, 0)
        self._calls += 1
        if rc:
            return rc
        out[0] = e = self._handle()
        self.execs[e] = self.nodes[graph]
        self.graph_of[e] = graph
        self.instantiated.append(e)
        return 0

    def graph_launch(self, exec_, stream):
        self.graph_launches.append((self.execs[exec_], stream or 0))
        self.exec_launches.append((exec_, stream or 0))
        return self.graph_result

    def exec_set_params(self, exec_, node, params):
        rec = self._node_record(params)
        self.set_params.append((exec_, rec))
        # the node named is the one of the graph the exec was instantiated from
        if (node or 0) != self.node_of[self.graph_of[exec_]]:
            return 400  # CUDA_ERROR_INVALID_HANDLE
        if self.set_result:
            return self.set_result
        self.execs[exec_] = rec  # a new record: the launches made before keep theirs
        return 0

    def destroy(self, graph):
        self.destroyed.append(graph)
        return 0

    def exec_destroy(self, exec_):
        self.exec_destroyed.append(exec_)
        return 0


def _graph_driver(fake, cap=pack.GRAPH_CAPACITY):
    d = _driver(fake)
    d.graphs(*fake.graph_addrs, WHOLE, cap)
    return d


def _driver(fake):
    d = _cudacall.Driver(*fake.addrs)
    d.kernels(0x5CA7, CAPS, pack.THREADS)
    return d


@needs_ext
def test_capture_query_returns_the_status_or_the_negated_error():
    fake = FakeDriver()
    d = _driver(fake)
    for status in (0, 1, 2):
        fake.status = status
        assert d.is_capturing(0x1234) == status
    fake.result = 201  # CUDA_ERROR_INVALID_CONTEXT: the backend then asks CuPy
    assert d.is_capturing(0x1234) == -201


@needs_ext
@pytest.mark.parametrize("nbytes,cap", [(1, 1008), (1008, 1008), (1009, 2032), (4000, 4080)])
def test_a_carried_launch_takes_the_smallest_capacity_and_the_segment_bytes(nbytes, cap):
    fake = FakeDriver()
    d = _driver(fake)
    host = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    rc = d.carried(7, 0xABC, 0xD00D0000, host.ctypes.data, nbytes)
    assert rc == 0
    (rec,) = fake.launches
    assert rec["f"] == dict(CAPS)[cap]
    assert rec["grid"] == (7, 1, 1) and rec["block"] == (pack.THREADS, 1, 1)
    assert rec["stream"] == 0xABC and rec["shmem"] == 0
    assert rec["size"] == pack.CARRY_PREFIX + cap
    buf = rec["buffer"]
    seg, n, reserved = struct.unpack_from("<QII", buf)
    assert (seg, n, reserved) == (0xD00D0000, nbytes, 0)
    assert buf[pack.CARRY_PREFIX : pack.CARRY_PREFIX + nbytes] == host.tobytes()


@needs_ext
def test_carried_refuses_what_no_capacity_holds_and_bad_grids_without_launching():
    fake = FakeDriver()
    d = _driver(fake)
    host = np.zeros(40000, np.uint8)
    assert d.carried(1, 0, 0, host.ctypes.data, 32737) == -1
    assert d.carried(0, 0, 0, host.ctypes.data, 16) == -1
    assert d.carried(1 << 31, 0, 0, host.ctypes.data, 16) == -1
    assert d.scatter(0, 0, 0) == -1
    assert fake.launches == []


@needs_ext
def test_the_driver_error_comes_back_as_is():
    fake = FakeDriver()
    d = _driver(fake)
    fake.result = 700
    host = np.zeros(8, np.uint8)
    assert d.carried(1, 0, 0, host.ctypes.data, 8) == 700
    assert d.scatter(3, 5, 0xBEEF) == 700


@needs_ext
def test_a_plain_scatter_passes_the_segment_address_as_its_one_argument():
    fake = FakeDriver()
    d = _driver(fake)
    assert d.scatter(3, 5, 0xBEEF00) == 0
    (rec,) = fake.launches
    assert rec["f"] == 0x5CA7 and rec["grid"] == (3, 1, 1) and rec["stream"] == 5
    assert rec["seg"] == 0xBEEF00 and "buffer" not in rec


@needs_ext
def test_launches_keep_the_gil():
    # PyGILState_Check stands in for cuLaunchKernel: it answers 1 when the calling
    # thread holds the GIL. (Called with the launch's arguments, which it ignores: the
    # caller pops them on every ABI CPython supports.) A launch that let the GIL go would
    # hand the interpreter to any other Python thread and wait to get it back.
    check = ctypes.cast(ctypes.pythonapi.PyGILState_Check, ctypes.c_void_p).value
    fake = FakeDriver()
    d = _cudacall.Driver(check, fake.addrs[1])
    d.kernels(0x5CA7, CAPS, pack.THREADS)
    host = np.zeros(64, np.uint8)
    assert d.carried(1, 0, 0x1000, host.ctypes.data, 64) == 1
    assert d.scatter(1, 0, 0x1000) == 1


@needs_ext
def test_no_launch_before_the_kernels_are_known_and_bad_kernel_tables_are_refused():
    fake = FakeDriver()
    d = _cudacall.Driver(*fake.addrs)
    assert d.scatter(1, 0, 0) == -1
    assert d.carried(1, 0, 0, 0, 0) == -1
    with pytest.raises(ValueError):
        d.kernels(0x1, [(2032, 1), (1008, 2)], 256)  # not ascending
    with pytest.raises(ValueError):
        d.kernels(0x1, [(65536, 1)], 256)  # over the 32 KiB the C buffer holds
    with pytest.raises(ValueError):
        _cudacall.Driver(0, 1)
    assert fake.launches == []


def test_the_compiled_driver_calls_are_built_and_chosen_unless_pure_python():
    # CI's normal run must build them; CUCOPY_PURE_PYTHON=1 keeps CuPy's wrappers
    from cucopy._config import config_dict

    if os.environ.get("CUCOPY_PURE_PYTHON"):
        assert config_dict()["driver_calls"] == "python"
    else:
        assert _cudacall is not None, "cucopy.backends._cudacall is not built"
        assert config_dict()["driver_calls"] == "compiled"


# -- the carried launch as a C function, called by the staging core at flush ---------

try:
    from cucopy._segment import Segment as CSegment
except ImportError:
    CSegment = None

from cucopy.backends.sim import _SPACE, SimDevice  # noqa: E402


def _compiled_copier_core_now() -> bool:
    from cucopy import copier

    return copier._CopierCore is not copier.PyCopierCore


needs_both = pytest.mark.skipif(
    _cudacall is None or CSegment is None, reason="both compiled modules are needed"
)


@pytest.fixture(autouse=True)
def _compiled_segment(monkeypatch):
    # the staging core's launcher call is the compiled twin's (the pure-Python run
    # of the suite still tests it, side by side, as test_segment does its twins)
    if CSegment is not None:
        import cucopy.copier as copier_module

        monkeypatch.setattr(copier_module, "Segment", CSegment)


def _staged_copier(sizes):
    """A sim copier with the compiled segment, a step open and len(sizes) copies staged."""
    import cucopy as cc

    sites = list(cc.CopySite("L", [(f"s{i}", cc.H2D) for i in range(len(sizes))]))
    dev = SimDevice()
    c = cc.DeviceCopier(cc.CopyPlan(merge=set(sites)), device=dev, backend="sim")
    assert type(c._seg) is CSegment
    c.test_device, c.test_site = dev, sites[0]
    c.begin()
    rng = np.random.default_rng(len(sizes))
    for s, k in zip(sites, sizes):
        c.copy(s, dev.zeros((k,), np.int32), rng.integers(0, 1 << 30, k, dtype=np.int32))
    return c


@needs_both
def test_the_staging_core_launches_what_cut_encodes_through_the_launcher():
    # the same program staged twice: one segment cut as the Python path cuts it, the
    # other cut and launched in one call; the launch carries exactly the cut bytes
    fake = FakeDriver()
    launcher = _driver(fake).launcher()
    sizes = [3, 40, 1, 200, 17]
    a, b = _staged_copier(sizes), _staged_copier(sizes)
    start, end, nblocks, n = b._seg.cut(4096)
    total = a._seg.flush_carried(launcher, 0xABC, 4096, 0x7000000)
    assert total == end - start
    (rec,) = fake.launches
    assert rec["grid"] == (nblocks, 1, 1) and rec["stream"] == 0xABC
    buf = rec["buffer"]
    seg, nbytes, _ = struct.unpack_from("<QII", buf)
    assert seg == 0x7000000 + start and nbytes == total
    carried = buf[pack.CARRY_PREFIX : pack.CARRY_PREFIX + nbytes]
    assert carried == bytes(a._seg.slot.array[start:end])
    # the same bytes as the Python path's cut (destinations compared within each
    # simulated device's own address space)
    ha, da = pack.decode(carried)
    hb, db = pack.decode(bytes(b._seg.slot.array[start:end]))
    assert ha == hb and da.shape == db.shape
    for f in da.dtype.names:
        x, y = da[f], db[f]
        if f == "dst":
            x, y = x & (_SPACE - 1), y & (_SPACE - 1)
        assert np.array_equal(x, y), f
    assert a._seg.cursor == b._seg.cursor and a._seg.peak == b._seg.peak
    for c in (a, b):
        c.discard()
        c.close()


@needs_both
def test_a_segment_at_the_slots_start_is_launched_from_the_slot_itself():
    # the slot has SLOT_HEADROOM bytes before its first byte: the launch's prefix is
    # written there and the driver reads the slot's own bytes (no copy of the segment)
    from cucopy.ring import SLOT_HEADROOM

    fake = FakeDriver()
    launcher = _driver(fake).launcher()
    a = _staged_copier([3, 40, 1, 200, 17])
    slot = a._seg.slot
    assert slot.headroom == SLOT_HEADROOM >= pack.CARRY_PREFIX and a._seg.seg == 0
    total = a._seg.flush_carried(launcher, 0xABC, 4096, 0x7000000)
    (rec,) = fake.launches
    assert rec["buffer_at"] == slot.pinned.ptr - pack.CARRY_PREFIX
    seg, nbytes, _ = struct.unpack_from("<QII", rec["buffer"])
    assert seg == 0x7000000 and nbytes == total
    assert rec["buffer"][pack.CARRY_PREFIX : pack.CARRY_PREFIX + total] == bytes(slot.array[:total])
    # the prefix went into the headroom, below the slot's first byte
    assert ctypes.string_at(slot.pinned.ptr - pack.CARRY_PREFIX, 16) == rec["buffer"][:16]
    a.discard()
    a.close()


@needs_both
def test_a_later_segment_is_launched_in_place_only_past_a_free_gap():
    # a second segment of the step: in place when seg_open left CARRY_PREFIX free bytes
    # below it, else copied (the bytes below may be a pending mapped segment's data)
    fake = FakeDriver()
    launcher = _driver(fake).launcher()
    for gap, in_place in ((0, False), (8, False), (16, True), (40, True)):
        c = _staged_copier([3])
        slot = c._seg.slot
        c._seg.flush_carried(launcher, 1, 4096, 0x7000000)
        c._seg.finish()  # as the copier does after a launch
        # the first free byte, placed `gap` bytes below a 256-byte boundary
        boundary = pack.align(c._seg.cursor + 64, 256)
        c._seg.set_cursor(boundary - gap)
        c.copy(c.test_site, c.test_device.zeros((5,), np.int32), np.arange(5, dtype=np.int32))
        seg = c._seg.seg
        assert seg == boundary
        slot.array[seg - 16 : seg] = 0xAB  # stands for a pending segment's data
        c._seg.flush_carried(launcher, 1, 4096, 0x7000000)
        rec = fake.launches[-1]
        assert (rec["buffer_at"] == slot.pinned.ptr + seg - pack.CARRY_PREFIX) is in_place
        if not in_place:
            assert bytes(slot.array[seg - 16 : seg]) == b"\xab" * 16  # nothing written
        c.discard()
        c.close()


@needs_both
def test_a_slot_without_headroom_is_never_written_before_its_first_byte():
    # a segment bound to a slot that declares no headroom copies the segment instead
    fake = FakeDriver()
    launcher = _driver(fake).launcher()
    c = _staged_copier([7, 9])
    c.discard()
    c.begin()
    slot = c._seg.slot
    slot.headroom = 0
    c._seg.unbind()
    c._seg.bind(slot)  # exported afresh: reads the headroom again
    c.copy(c.test_site, c.test_device.zeros((5,), np.int32), np.arange(5, dtype=np.int32))
    assert c._seg.seg == 0
    before = ctypes.string_at(slot.pinned.ptr - pack.CARRY_PREFIX, 16)
    c._seg.flush_carried(launcher, 1, 4096, 0x7000000)
    (rec,) = fake.launches
    assert rec["buffer_at"] != slot.pinned.ptr - pack.CARRY_PREFIX
    assert ctypes.string_at(slot.pinned.ptr - pack.CARRY_PREFIX, 16) == before
    c.discard()
    c.close()


@needs_both
def test_what_the_launcher_cannot_launch_comes_back_cut_for_the_python_path():
    fake = FakeDriver()
    launcher = _driver(fake).launcher()
    sizes = [5, 9]
    # too large to carry: cut only, nothing launched
    a, b = _staged_copier(sizes), _staged_copier(sizes)
    assert a._seg.flush_carried(launcher, 1, 16, 0x7000000) == b._seg.cut(16)
    assert fake.launches == []
    # the driver refused the launch: the same cut comes back (the backend's scatter()
    # then launches again and reports the error)
    c, d = _staged_copier(sizes), _staged_copier(sizes)
    fake.result = 700
    assert c._seg.flush_carried(launcher, 1, 4096, 0x7000000) == d._seg.cut(4096)
    assert len(fake.launches) == 1
    with pytest.raises((TypeError, ValueError)):
        c._seg.flush_carried(object(), 1, 4096, 0)  # not a launcher capsule
    for x in (a, b, c, d):
        x.discard()
        x.close()


_CTX_CURRENT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))


@needs_ext
def test_a_bound_driver_calls_nothing_from_another_context():
    fake = GraphFake()
    d = _graph_driver(fake)
    current = {"ctx": 0x1111}

    @_CTX_CURRENT
    def ctx_current(out):
        out[0] = current["ctx"]
        return 0

    d.bind(ctypes.cast(ctx_current, ctypes.c_void_p).value, 0x1111)
    host = np.zeros(32, np.uint8)
    assert d.carried(1, 0, 0x1000, host.ctypes.data, 32) == 0
    assert d.scatter(1, 0, 0x1000) == 0
    fake.status = 1
    assert d.is_capturing(0) == 1
    assert len(fake.launches) == 2
    current["ctx"] = 0x2222  # another device's context is current on this thread
    assert d.carried(1, 0, 0x1000, host.ctypes.data, 32) == _cudacall.OTHER_CONTEXT
    assert d.scatter(1, 0, 0x1000) == _cudacall.OTHER_CONTEXT
    assert d.is_capturing(0) == _cudacall.OTHER_CONTEXT_STATUS < 0
    assert d.graphed(0, 0x1000) == _cudacall.OTHER_CONTEXT
    assert len(fake.launches) == 2  # nothing reached the driver
    assert fake.graph_launches == [] and fake.set_params == [] and d.graph_updates == 0
    with pytest.raises(ValueError):
        d.bind(0, 0x1111)


# -- the event calls (cuEventRecord, cuEventQuery) ----------------------------------


@needs_ext
def test_event_calls_answer_minus_one_and_call_nothing_before_events():
    fake = FakeDriver()
    d = _driver(fake)
    assert d.event_record(0xE1, 0x5) == -1
    assert d.event_query(0xE1) == -1
    assert fake.records == [] and fake.queries == []


@needs_ext
def test_event_calls_pass_the_handles_and_return_the_curesult():
    fake = FakeDriver()
    d = _driver(fake)
    d.events(*fake.event_addrs)
    assert d.event_record(0xE1, 0xABC) == 0
    assert d.event_record(0xE2, 0) == 0  # the legacy default stream
    assert fake.records == [(0xE1, 0xABC), (0xE2, 0)]
    fake.pending.add(0xE2)
    assert d.event_query(0xE1) == 0
    assert d.event_query(0xE2) == NOT_READY
    assert fake.queries == [0xE1, 0xE2]
    fake.event_result = 400  # CUDA_ERROR_INVALID_HANDLE: the backend's call reports it
    assert d.event_record(0xE3, 0x7) == 400
    assert d.event_query(0xE3) == 400
    assert fake.records[-1] == (0xE3, 0x7) and fake.queries[-1] == 0xE3
    assert fake.launches == []
    with pytest.raises(TypeError):
        d.event_record(0xE1)
    with pytest.raises(TypeError):
        d.event_query(0xE1, 0)
    with pytest.raises((OverflowError, TypeError)):
        d.event_query(-1)


@needs_ext
def test_bound_event_calls_call_nothing_from_another_context():
    fake = FakeDriver()
    d = _driver(fake)
    d.events(*fake.event_addrs)
    current = {"ctx": 0x1111}

    @_CTX_CURRENT
    def ctx_current(out):
        out[0] = current["ctx"]
        return 0

    d.bind(ctypes.cast(ctx_current, ctypes.c_void_p).value, 0x1111)
    assert d.event_record(0xE1, 0x5) == 0 and d.event_query(0xE1) == 0
    current["ctx"] = 0x2222  # another device's context is current on this thread
    assert d.event_record(0xE1, 0x5) == _cudacall.OTHER_CONTEXT
    assert d.event_query(0xE1) == _cudacall.OTHER_CONTEXT
    assert fake.records == [(0xE1, 0x5)] and fake.queries == [0xE1]


class _FakeRuntime:
    """CuPy's runtime calls the CUDA backend makes, recorded (no GPU here)."""

    class Error(Exception):
        status = 1

    def __init__(self):
        self.calls = []
        self.fail = False

    def _call(self, *rec):
        self.calls.append(rec)
        if self.fail:
            raise self.Error("cudaErrorInvalidValue: invalid argument")

    def memcpyAsync(self, dst, src, n, kind, stream):
        self._call("memcpyAsync", dst, src, n, kind, stream)

    def memcpy2DAsync(self, dst, dpitch, src, spitch, width, rows, kind, stream):
        self._call("memcpy2DAsync", dst, dpitch, src, spitch, width, rows, kind, stream)

    def eventRecord(self, event, stream):
        self._call("eventRecord", event, stream)


def _bound_backend(monkeypatch, fake):
    """A CudaBackend (made without CuPy) whose compiled driver is bound to the fake,
    with CuPy's runtime replaced by a recording _FakeRuntime; returns (backend, runtime,
    the current context's cell, the device ordinals asked)."""
    from cucopy.backends import cuda

    rt, asked = _FakeRuntime(), []
    monkeypatch.setattr(cuda, "_rt", rt)
    monkeypatch.setattr(cuda, "_RuntimeError", _FakeRuntime.Error)
    monkeypatch.setattr(cuda, "_getDevice", lambda: asked.append(0) or 0)
    d = _driver(fake)
    d.events(*fake.event_addrs)
    d.copies(*fake.copy_addrs)
    current = {"ctx": 0x1111}

    @_CTX_CURRENT
    def ctx_current(out):
        out[0] = current["ctx"]
        return 0

    d.bind(ctypes.cast(ctx_current, ctypes.c_void_p).value, 0x1111)
    be = cuda.CudaBackend.__new__(cuda.CudaBackend)
    be.device, be._bound, be._fast, be._ctx_fn = 0, d, d, ctx_current
    return be, rt, current, asked


@needs_ext
def test_the_backends_copies_and_records_go_through_the_bound_driver(monkeypatch):
    # with the compiled driver bound, an H2D copy2d and event_record are one C call each
    # (which keeps the GIL), with no question to CuPy which device is current
    fake = FakeDriver()
    be, rt, current, asked = _bound_backend(monkeypatch, fake)
    be.copy2d(True, 0xD000, 16, 0x1000, 16, 16, 1, 5)
    be.copy2d(True, 0xD000, 64, 0x1000, 32, 16, 3, 5)
    be.event_record(0xE1, 5)
    assert fake.copies == [(0xD000, 16, 0x1000, 16, 16, 1, 5), (0xD000, 64, 0x1000, 32, 16, 3, 5)]
    assert fake.records == [(0xE1, 5)]
    assert rt.calls == [] and asked == []
    be.copy2d(True, 0xD000, 64, 0x1000, 32, 0, 3, 5)  # nothing to copy: no call at all
    # a D2D copy (the driver's copy is H2D only), and a pitch past the 2-D limit: CuPy's
    be.copy2d(False, 0xD000, 64, 0xD800, 32, 16, 3, 5)
    be.copy2d(True, 0xD000, 1 << 31, 0x1000, 16, 16, 2, 5)
    assert rt.calls[0][0] == "memcpy2DAsync" and rt.calls[0][1:7] == (
        0xD000,
        64,
        0xD800,
        32,
        16,
        3,
    )
    assert [c[0] for c in rt.calls[1:]] == ["memcpyAsync", "memcpyAsync"]  # a row each
    assert len(fake.copies) == 2 and len(asked) == 2


@needs_ext
def test_the_backend_falls_back_to_cupy_from_another_context_or_a_failed_call(monkeypatch):
    fake = FakeDriver()
    be, rt, current, asked = _bound_backend(monkeypatch, fake)
    current["ctx"] = 0x2222  # another device's context is current: CuPy's calls
    be.copy2d(True, 0xD000, 64, 0x1000, 32, 16, 3, 5)
    be.event_record(0xE1, 5)
    assert fake.copies == [] and fake.records == []
    assert [c[0] for c in rt.calls] == ["memcpy2DAsync", "eventRecord"]
    current["ctx"] = 0x1111
    fake.copy_result = fake.event_result = 1  # the driver refuses: CuPy's call reports
    rt.fail = True
    with pytest.raises(CopyError, match=r"cudaMemcpy2DAsync failed: .*width=16 rows=3"):
        be.copy2d(True, 0xD000, 64, 0x1000, 32, 16, 3, 5)
    with pytest.raises(CopyError, match=r"cudaMemcpyAsync failed"):
        be.copy2d(True, 0xD000, 16, 0x1000, 16, 16, 1, 5)
    with pytest.raises(CopyError, match=r"cudaEventRecord failed: .*event=0xe1 stream=0x5"):
        be.event_record(0xE1, 5)
    assert len(fake.copies) == 2 and len(fake.records) == 1  # asked once each


@needs_ext
def test_events_refuses_a_null_entry_point():
    fake = FakeDriver()
    d = _driver(fake)
    record, query = fake.event_addrs
    with pytest.raises(ValueError):
        d.events(0, query)
    with pytest.raises(ValueError):
        d.events(record, 0)
    assert d.event_record(0xE1, 0) == -1 and d.event_query(0xE1) == -1  # still unset


class _Launcher(ctypes.Structure):
    """The layout of _carried_launcher.h's CarriedLauncher."""

    _fields_ = [
        ("carried", ctypes.c_void_p),
        ("drv", ctypes.c_void_p),
        ("abi", ctypes.c_int),
        ("record", ctypes.c_void_p),
        ("query", ctypes.c_void_p),
        ("carried_at", ctypes.c_void_p),
        ("graphed", ctypes.c_void_p),
        ("graph_cap", ctypes.c_size_t),
        ("capturing", ctypes.c_void_p),
        ("copy", ctypes.c_void_p),
        ("graphed_tag", ctypes.c_void_p),
    ]


# called as the staging core calls them: with the GIL held
_RECORD_IMPL = ctypes.PYFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_ulonglong
)
_QUERY_IMPL = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_ulonglong)


def _launcher_struct(capsule) -> _Launcher:
    get = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
        ("PyCapsule_GetPointer", ctypes.pythonapi)
    )
    ptr = get(capsule, _cudacall.LAUNCHER_NAME.encode())
    assert ptr
    return _Launcher.from_address(ptr)


@needs_ext
def test_the_launcher_carries_its_abi_and_the_event_calls():
    fake = FakeDriver()
    d = _driver(fake)
    capsule = d.launcher()
    s = _launcher_struct(capsule)
    assert s.abi == _cudacall.LAUNCHER_ABI
    assert s.carried and s.drv and s.record and s.query
    record, query = _RECORD_IMPL(s.record), _QUERY_IMPL(s.query)
    # set before events(): they answer -1 and call nothing until then
    assert record(s.drv, 0xE1, 0x5) == -1 and query(s.drv, 0xE1) == -1
    assert fake.records == [] and fake.queries == []
    d.events(*fake.event_addrs)  # the capsule's calls see it (the same Driver)
    fake.pending.add(0xE1)
    assert record(s.drv, 0xE1, 0x5) == 0 and query(s.drv, 0xE1) == NOT_READY
    assert fake.records == [(0xE1, 0x5)] and fake.queries == [0xE1]


@needs_ext
def test_the_launcher_offers_the_capture_query():
    fake = FakeDriver()
    d = _driver(fake)
    s = _launcher_struct(d.launcher())
    capturing = ctypes.PYFUNCTYPE(
        ctypes.c_int, ctypes.c_void_p, ctypes.c_ulonglong, ctypes.POINTER(ctypes.c_int)
    )(s.capturing)
    status = ctypes.c_int(-1)
    fake.status = 1
    assert capturing(s.drv, 0x5, ctypes.byref(status)) == 0 and status.value == 1
    fake.result = 700
    assert capturing(s.drv, 0x5, ctypes.byref(status)) == 700


@needs_both
@pytest.mark.skipif(
    not _compiled_copier_core_now(), reason="the compiled staging core is not in use"
)
def test_the_compiled_begin_and_flush_ask_the_capture_status_through_the_launcher():
    # with the copier's capture query the Driver's and its argument the launch's stream,
    # the compiled begin() and flush() ask cuStreamIsCapturing from C: a capturing
    # stream makes them decline (and change nothing), an idle one lets them run
    c, Site, dev, fake, problems = _landing_copier("inline")
    c._cap_query, c._cap_arg = c._test_driver.is_capturing, c._handle
    a = dev.zeros((8,), np.int32)
    for _ in range(c._ring.slots):  # a slot's first step is the Python path's
        with c.step():
            c.copy(Site.A, a, np.zeros(8, np.int32))
    begins, flushes = c._fast_begins, c._fast_flushes
    fake.status = 1  # capturing
    assert c._begin_fast() is False and c._fast_begins == begins
    fake.status = 0
    assert c._begin_fast() is True
    c.copy(Site.A, a, np.arange(8, dtype=np.int32))
    fake.status = 1
    assert c._flush_fast() is False and c._fast_flushes == flushes
    fake.status = 0
    assert c._flush_fast() is True and c._fast_flushes == flushes + 1
    c.discard()
    dev.synchronize()
    assert dev.to_host(a).tolist() == list(range(8)) and problems == []
    c.close()


def _steps_of_eight(c, Site, dev, steps: int) -> None:
    """``steps`` steps each staging 8 int32 (all ``k`` at step ``k``) into one fresh
    destination through site A of a landing copier, each checked landed."""
    a = dev.zeros((8,), np.int32)
    for k in range(steps):
        with c.step():
            c.copy(Site.A, a, np.full(8, k, np.int32))
        dev.synchronize()
        assert dev.to_host(a).tolist() == [k] * 8


@needs_both
def test_compiled_flushes_take_slot_addresses_past_2_63(monkeypatch):
    # the simulated device's addresses pass 2**63 from its 127th device on (CUDA's do
    # not); the compiled flush reads them as the Python path does
    import itertools

    from cucopy import copier as copier_mod
    from cucopy.backends import sim as sim_mod

    monkeypatch.setattr(sim_mod, "_device_ids", itertools.count(150))
    c, Site, dev, fake, problems = _landing_copier("inline")
    _steps_of_eight(c, Site, dev, 6)
    assert c._slot.base >= 1 << 63 and problems == []
    compiled = copier_mod._CopierCore is not copier_mod.PyCopierCore
    assert c._fast_flushes == (6 if compiled else 0)
    c.close()


@needs_ext
def test_a_launcher_keeps_its_driver_alive():
    import gc

    fake = FakeDriver()
    launcher = _driver(fake).launcher()  # the Driver itself is dropped here
    gc.collect()
    if CSegment is None:
        return
    a = _staged_copier([4])
    assert isinstance(a._seg.flush_carried(launcher, 1, 4096, 0x1000), int)
    assert len(fake.launches) == 1
    a.discard()
    a.close()


@needs_ext
def test_graphs_makes_the_pool_and_no_graph_is_made_after():
    # the pool's one-node graphs are made inside graphs() (set-up, the device's context
    # current), each graph kept for its node; however many segments launch after, none
    # is made: a new one re-points a graph of the pool
    fake = GraphFake()
    d = _driver(fake)
    assert d.graph_count == 0 and d.graph_updates == 0
    d.graphs(*fake.graph_addrs, WHOLE, pack.GRAPH_CAPACITY)
    pool = _cudacall.GRAPH_POOL
    assert pool == 16 and d.graph_count == pool
    assert len(fake.created) == len(fake.instantiated) == pool
    assert fake.destroyed == []  # kept: re-pointing names the node of the exec's graph
    # each: one node of the whole-segment kernel, grid 1, no segment or tag yet
    assert [fake.execs[e] for e in fake.instantiated] == [
        {
            "f": WHOLE,
            "grid": (1, 1, 1),
            "block": (pack.THREADS, 1, 1),
            "seg": 0,
            "cell": 0,
            "extra": None,
        }
    ] * pool
    segs = [0x100000 + 0x4000 * i for i in range(3 * pool)]
    for seg in segs:
        assert d.graphed(0x77, seg) == 0
        assert d.graphed(0x77, seg, seg - 64) == 0
    assert len(fake.created) == len(fake.instantiated) == d.graph_count == pool
    assert d.graph_updates == len(fake.set_params) == 2 * len(segs)
    nodes = [n for n, _ in fake.graph_launches]
    assert [(n["seg"], n["cell"]) for n in nodes] == [
        x for seg in segs for x in ((seg, 0), (seg, seg - 64))
    ]
    assert {(n["f"], n["grid"], n["block"], n["extra"]) for n in nodes} == {
        (WHOLE, (1, 1, 1), (pack.THREADS, 1, 1), None)
    }
    assert {st for _, st in fake.graph_launches} == {0x77}
    assert fake.launches == []  # no kernel launch
    fake.graph_result = 719
    assert d.graphed(0x77, segs[-1]) == 719  # the driver's error, as is


@needs_ext
def test_a_new_segment_re_points_the_least_recently_launched_graph():
    fake = GraphFake()
    d = _graph_driver(fake)
    pool = _cudacall.GRAPH_POOL
    keys = [(0x10000 * (i + 1), 0x10000 * (i + 1) - 64 if i % 2 else 0) for i in range(pool)]

    def launch(stream, seg, cell):
        return d.graphed(stream, seg, cell) if cell else d.graphed(stream, seg)

    for seg, cell in keys:  # the never-launched graphs first, one each
        assert launch(5, seg, cell) == 0
    exec_of = {(r["seg"], r["cell"]): e for e, r in fake.set_params}
    assert len(set(exec_of.values())) == pool
    assert launch(5, *keys[0]) == 0  # launched as pointed: keys[1]'s is now the oldest
    n = len(fake.set_params)
    assert launch(5, 0xABC000, 0xABC000 - 64) == 0
    (e, rec), *_ = fake.set_params[n:]
    assert len(fake.set_params) == n + 1 and e == exec_of[keys[1]]
    assert (rec["seg"], rec["cell"]) == (0xABC000, 0xABC000 - 64)
    assert (rec["f"], rec["grid"], rec["block"]) == (WHOLE, (1, 1, 1), (pack.THREADS, 1, 1))
    node, st = fake.graph_launches[-1]
    assert (node["seg"], node["cell"], st) == (0xABC000, 0xABC000 - 64, 5)  # the new args
    assert launch(5, *keys[1]) == 0  # gone: re-points the next oldest, keys[2]'s
    assert fake.set_params[-1][0] == exec_of[keys[2]] and d.graph_updates == n + 2
    node, _ = fake.graph_launches[-1]
    assert (node["seg"], node["cell"]) == keys[1]


@needs_ext
def test_a_repeat_segment_on_its_stream_launches_with_no_re_pointing():
    fake = GraphFake()
    d = _graph_driver(fake)
    calls = [(0x1000, 0), (0x1000, 0x0FC0), (0x1000, 0x0FC0), (0x1000, 0), (0x9000, 0x8FC0)]
    for seg, cell in calls:
        assert (d.graphed(0x77, seg, cell) if cell else d.graphed(0x77, seg)) == 0
    # the tag's address is the kernel's second argument: tagged and untagged are two
    assert d.graph_updates == len(fake.set_params) == 3
    assert [(n["seg"], n["cell"]) for n, _ in fake.graph_launches] == calls
    for _ in range(5):
        assert d.graphed(0x77, 0x1000, 0) == 0  # cell 0: untagged
        assert d.graphed(0x77, 0x9000, 0x8FC0) == 0
    assert d.graph_updates == 3 and d.graph_count == _cudacall.GRAPH_POOL
    assert fake.graph_launches[-1][0]["seg"] == 0x9000
    with pytest.raises(TypeError, match=r"graphed\(stream, seg\[, cell\]\)"):
        d.graphed(0x77)


@needs_ext
def test_a_graph_last_launched_on_one_stream_never_launches_on_another():
    # launches of one executable are ordered behind its last launch on any stream: a
    # graph is the stream's it last launched on, and a stream with none left gets -1
    fake = GraphFake()
    d = _graph_driver(fake)
    pool = _cudacall.GRAPH_POOL
    for i in range(10):
        assert d.graphed(0xA, 0x10000 * (i + 1)) == 0
    a_execs = {e for e, _ in fake.set_params}
    assert d.graphed(0xB, 0x10000) == 0  # A's segment: B re-points a graph of its own
    for i in range(pool - 10 - 1):
        assert d.graphed(0xB, 0x900000 + 0x10000 * i) == 0
    b_execs = {e for e, _ in fake.set_params} - a_execs
    assert len(b_execs) == pool - 10
    for i in range(20):  # B's new segments re-point B's graphs, never A's
        assert d.graphed(0xB, 0xF00000 + 0x10000 * i) == 0
        assert fake.set_params[-1][0] in b_execs
    for i in range(20):  # and A's, A's
        assert d.graphed(0xA, 0xE00000 + 0x10000 * i) == 0
        assert fake.set_params[-1][0] in a_execs
    streams_of: dict = {}  # every executable's launches on one stream
    for e, st in fake.exec_launches:
        streams_of.setdefault(e, set()).add(st)
    assert len(streams_of) == pool and all(len(v) == 1 for v in streams_of.values())
    assert {e for e, v in streams_of.items() if v == {0xA}} == a_execs

    # once every graph is A's, B launches none: -1, nothing launched or re-pointed
    fake = GraphFake()
    d = _graph_driver(fake)
    for i in range(pool):
        assert d.graphed(0xA, 0x10000 * (i + 1)) == 0
    n, updates = len(fake.graph_launches), d.graph_updates
    assert d.graphed(0xB, 0x10000) == -1  # A's segment too: A's graph
    assert d.graphed(0xB, 0x777000, 0x777000 - 64) == -1
    assert len(fake.graph_launches) == n and d.graph_updates == updates
    assert d.graphed(0xA, 0x10000) == 0  # A's still launch


@needs_ext
def test_a_refused_re_pointing_returns_its_error_and_keeps_the_graph_as_it_was():
    fake = GraphFake()
    d = _graph_driver(fake)
    for i in range(_cudacall.GRAPH_POOL - 1):  # all graphs but one another stream's
        assert d.graphed(0xA, 0x10000 * (i + 1)) == 0
    assert d.graphed(5, 0x5000, 0x5000 - 64) == 0  # stream 5's one graph
    n, updates = len(fake.graph_launches), d.graph_updates
    fake.set_result = 1  # CUDA_ERROR_INVALID_VALUE
    assert d.graphed(5, 0x6000) == 1  # the driver's error, as is
    assert len(fake.graph_launches) == n and d.graph_updates == updates + 1
    fake.set_result = 0
    assert d.graphed(5, 0x5000, 0x5000 - 64) == 0  # still pointed there: no re-pointing
    assert d.graph_updates == updates + 1
    node, st = fake.graph_launches[-1]
    assert (node["seg"], node["cell"], st) == (0x5000, 0x5000 - 64, 5)


@needs_ext
def test_the_pool_s_graphs_and_executables_go_with_the_driver():
    import gc

    fake = GraphFake()
    d = _graph_driver(fake)
    for i in range(40):
        assert d.graphed(i % 3, 0x10000 * (i + 1)) == 0
    assert fake.destroyed == [] and fake.exec_destroyed == []
    del d
    gc.collect()
    assert sorted(fake.exec_destroyed) == sorted(fake.instantiated)
    assert sorted(fake.destroyed) == sorted(fake.created)
    assert len(fake.created) == _cudacall.GRAPH_POOL


@needs_ext
def test_a_pool_short_of_graphs_keeps_those_made_and_none_made_raises():
    import gc

    # making the fifth failed: the pool is the four made before it (the fifth's graph
    # destroyed at once), and they launch
    fake = GraphFake()
    fake.fail_instantiate = {4: 2}  # CUDA_ERROR_OUT_OF_MEMORY
    d = _graph_driver(fake)
    assert d.graph_count == 4 and d.graph_cap == pack.GRAPH_CAPACITY
    assert fake.destroyed == [fake.created[4]] and len(fake.created) == 5
    for i in range(9):
        assert d.graphed(7, 0x10000 * (i + 1)) == 0
    assert len({e for e, _ in fake.set_params}) == 4
    # the first failed: an error with the CUresult, and no graphs (graphed() answers -1)
    fake = GraphFake()
    fake.fail_instantiate = {0: 2}
    d = _driver(fake)
    with pytest.raises(RuntimeError, match="CUresult 2") as info:
        d.graphs(*fake.graph_addrs, WHOLE, pack.GRAPH_CAPACITY)
    assert info.value.status == 2
    assert d.graph_count == 0 and d.graph_cap == 0 and d.graphed(7, 0x1000) == -1
    assert fake.destroyed == fake.created and fake.graph_launches == []
    d.graphs(*fake.graph_addrs, WHOLE, pack.GRAPH_CAPACITY)  # set-up may try again
    assert d.graph_count == _cudacall.GRAPH_POOL and d.graphed(7, 0x1000) == 0
    del d
    gc.collect()
    assert sorted(fake.exec_destroyed) == sorted(fake.instantiated)


@needs_ext
def test_graphed_launches_nothing_before_graphs_and_graphs_checks_its_arguments():
    fake = GraphFake()
    d = _driver(fake)
    assert d.graph_cap == 0 and d.graphed(1, 0x1000) == -1
    assert fake.created == []
    d.graphs(*fake.graph_addrs, WHOLE, pack.GRAPH_CAPACITY)
    assert d.graphed(1, 0x1000) == 0
    with pytest.raises(RuntimeError, match="already set"):
        d.graphs(*fake.graph_addrs, WHOLE, pack.GRAPH_CAPACITY)
    assert len(fake.created) == _cudacall.GRAPH_POOL  # (the second made none)
    with pytest.raises(ValueError, match="null"):
        _driver(fake).graphs(0, *fake.graph_addrs[1:], WHOLE, pack.GRAPH_CAPACITY)
    with pytest.raises(ValueError, match="null"):
        _driver(fake).graphs(*fake.graph_addrs[:6], 0, WHOLE, pack.GRAPH_CAPACITY)
    with pytest.raises(ValueError, match="multiple of 16"):
        _driver(fake).graphs(*fake.graph_addrs, WHOLE, 100)
    with pytest.raises(RuntimeError, match="kernels"):
        _cudacall.Driver(*fake.addrs).graphs(*fake.graph_addrs, WHOLE, pack.GRAPH_CAPACITY)
    with pytest.raises(TypeError):  # the old arity (no exec_set_params)
        _driver(fake).graphs(*fake.graph_addrs[:6], WHOLE, pack.GRAPH_CAPACITY)
    assert len(fake.created) == _cudacall.GRAPH_POOL


@needs_ext
def test_the_launcher_offers_graphed_launches_once_graphs_are_set():
    fake = GraphFake()
    d = _driver(fake)
    capsule = d.launcher()
    s = _launcher_struct(capsule)
    assert s.graphed and s.graph_cap == 0
    d.graphs(*fake.graph_addrs, WHOLE, pack.GRAPH_CAPACITY)
    assert s.graph_cap == pack.GRAPH_CAPACITY  # the capsule's struct is the Driver's
    graphed = ctypes.PYFUNCTYPE(
        ctypes.c_int, ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_ulonglong
    )(s.graphed)
    assert graphed(s.drv, 0x5, 0x4000) == 0
    assert [(n["seg"], st) for n, st in fake.graph_launches] == [(0x4000, 0x5)]
    assert s.graphed_tag
    graphed_tag = ctypes.PYFUNCTYPE(
        ctypes.c_int, ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_ulonglong
    )(s.graphed_tag)
    assert graphed_tag(s.drv, 0x5, 0x4000, 0x4000 + pack.TAG_AT) == 0
    node, _ = fake.graph_launches[-1]
    assert (node["seg"], node["cell"]) == (0x4000, 0x4000 + pack.TAG_AT)
    assert fake.graph_launches[0][0]["cell"] == 0  # the untagged graph: no tag


def _two_copy_steps(env, c, site, steps: int) -> None:
    """``steps`` steps of two merged copies (20 B and 1200 B), each checked landed."""
    a, b = env.empty((5,)), env.empty((300,))
    for step in range(steps):
        with c.step():
            c.copy(site.a, a, np.arange(5, dtype=np.int32) + step)
            c.copy(site.b, b, np.arange(300, dtype=np.int32) * step)
        assert env.to_host(a).tolist() == list(range(step, step + 5))
        assert env.to_host(b).tolist() == [i * step for i in range(300)]


def _gpu_copier(env, **kw):
    """A copier on the GPU merging two sites ``a`` and ``b``: ``(copier, site)``; skips
    where the compiled launcher is not in use (pure Python, or the simulated device)."""
    import cucopy as cc

    if os.environ.get("CUCOPY_PURE_PYTHON") or not hasattr(env, "cp"):
        pytest.skip("the compiled launcher is the CUDA backend's")
    site = cc.CopySite("G", [("a", cc.H2D), ("b", cc.H2D)])
    return env.copier(cc.CopyPlan(merge=set(site)), **kw), site


def _graphed_gpu_copier(env, **kw):
    """:func:`_gpu_copier` whose backend launches graphs: ``(copier, site, driver)``;
    skips where the driver offers no graphs."""
    c, site = _gpu_copier(env, **kw)
    fast = c._backend._bound
    if fast is None or not fast.graph_cap:
        c.close()
        pytest.skip("no graphed launches on this driver")
    return c, site, fast


@pytest.mark.gpu
@needs_both
def test_on_a_gpu_inline_segments_launch_from_the_staging_core(env):
    c, site = _gpu_copier(env, flush_mode="inline")
    assert c._launcher is not None
    calls = []
    scatter = c._backend.scatter

    def spy(*args, **kw):
        calls.append(args)
        return scatter(*args, **kw)

    c._backend.scatter = spy
    _two_copy_steps(env, c, site, 3)
    assert calls == []  # every launch came from the staging core
    assert c.stats.modes["inline"] == 3 and c.stats.segments == 3
    c.close()


@pytest.mark.gpu
@needs_both
@pytest.mark.parametrize("mode", ["mapped", "auto"])
def test_on_a_gpu_small_segments_launch_graphed_and_wait_for_their_slots(env, mode):
    # mapped and auto: a step of 1.2 KB goes through a one-node graph of the pool
    # pointed at its slot's address, from the staging core; behind a stalled stream the
    # host stages more steps than the ring has slots, and each reuse waits for the
    # slot's own launch
    c, site, fast = _graphed_gpu_copier(env, flush_mode=mode, slots=2)
    assert c._graph_cap == pack.GRAPH_CAPACITY
    made, updates = fast.graph_count, fast.graph_updates
    assert made == _cudacall.GRAPH_POOL  # made with the copier, before any step
    _two_copy_steps(env, c, site, 4)
    assert c.stats.modes["mapped"] == 4 and c.stats.modes["inline"] == 0
    assert c._fast_flushes == 4 and fast.graph_updates - updates == 2  # one a slot
    assert fast.graph_count == made  # none made since
    outs = [env.empty((300,)) for _ in range(6)]
    with env.hold(c._stream_obj if c._stream_obj is not None else env.default_stream):
        for k, o in enumerate(outs[:2]):  # both slots in flight behind the hold
            with c.step():
                c.copy(site.b, o, np.full(300, k, np.int32))
    for k, o in enumerate(outs[2:], 2):  # each reuse waits for the slot's launch
        with c.step():
            c.copy(site.b, o, np.full(300, k, np.int32))
    for k, o in enumerate(outs):
        assert env.to_host(o).tolist() == [k] * 300
    assert c.stats.modes["mapped"] == 10
    c.close()


@pytest.mark.gpu
@needs_both
@pytest.mark.parametrize("mode", ["mapped", "auto"])
def test_on_a_gpu_segments_past_the_graph_capacity_launch_graphed(env, mode, monkeypatch):
    # a segment of more than GRAPH_CAPACITY bytes is graphed too, up to
    # pack.graph_max bytes (mapped; auto: up to AUTO_GRAPH_ROUNDS times the capacity):
    # the kernel reads the rest in a second round (the table past the first 8 KiB
    # included: 200 and 400 copies of 16 B); each graphed step's slot is tagged (only a
    # graphed launch is). Behind a held stream the steps' slots are read when the
    # launches run, the bytes each step staged
    from cucopy import copier as copier_mod

    monkeypatch.setattr(copier_mod, "TAGS", True)  # (the default; CUCOPY_TAG=0 turns it off)
    c, site, fast = _graphed_gpu_copier(env, flush_mode=mode, slots=2, capacity=1 << 16)
    c._mapped_max = 1 << 20  # (auto: the crossover table may say less)
    rng = np.random.default_rng(3)
    shapes = [[2100], [3800], [50, 3000], [4] * 200, [2048, 1]]
    if mode == "mapped":  # 31.6, 28.2 and 25.7 KB
        shapes += [[7900], [100, 4000, 2950], [4] * 400]
    steps = []
    for ks in shapes:
        dsts = [env.empty((k,)) for k in ks]
        want = [rng.integers(-(1 << 30), 1 << 30, k, dtype=np.int32) for k in ks]
        steps.append((dsts, want))
    for dsts, want in steps:
        with c.step():
            for d_, w in zip(dsts, want):
                c.copy(site.b, d_, w)
        assert c._ring.current.tag == c._ring.acquires  # graphed (tagged)
        for d_, w in zip(dsts, want):
            assert np.array_equal(env.to_host(d_), w)
    assert c.stats.modes["mapped"] == len(shapes) and c._fast_flushes == len(shapes)
    stream = c._stream_obj if c._stream_obj is not None else env.default_stream
    outs = [[env.empty(w.shape) for w in want] for _, want in steps]
    with env.hold(stream):
        for (_, want), o in list(zip(steps, outs))[:2]:  # both slots in flight
            with c.step():
                for d_, w in zip(o, want):
                    c.copy(site.b, d_, w)
    for (_, want), o in list(zip(steps, outs))[2:]:  # each reuse waits for its slot
        with c.step():
            for d_, w in zip(o, want):
                c.copy(site.b, d_, w)
    for (_, want), o in zip(steps, outs):
        for d_, w in zip(o, want):
            assert np.array_equal(env.to_host(d_), w)
    assert c.stats.modes["mapped"] == 2 * len(shapes) and c.stats.modes["inline"] == 0
    c.close()


@pytest.mark.gpu
@needs_both
def test_on_a_gpu_a_graphed_step_writes_its_slot_s_tag_and_owes_no_event(env, monkeypatch):
    # the real kernel (cucopy_scatter_w8k) writes the slot's completion tag: a graphed
    # step from the staging core leaves its slot tagged with no event recorded; the tag
    # arrives once the stream ran the launch, not before (behind a held stream), and
    # the slot's reuse waits for it
    from cucopy import copier as copier_mod

    monkeypatch.setattr(copier_mod, "TAGS", True)  # (the default; CUCOPY_TAG=0 turns it off)
    c, site, fast = _graphed_gpu_copier(env, flush_mode="mapped", slots=2)
    assert c._tags
    _two_copy_steps(env, c, site, 4)  # (each checked through to_host: synchronized)
    slot = c._ring.current
    assert slot.tag == c._ring.acquires == 4 and not slot.recorded and not slot.dirty
    assert int(slot.cell[0]) == int(slot.cell[1]) == 4  # armed, and written back
    assert c._fast_flushes == 4 and c.stats.modes["mapped"] == 4
    stream = c._stream_obj if c._stream_obj is not None else env.default_stream
    outs = [env.empty((300,)) for _ in range(4)]
    with env.hold(stream):
        for k, o in enumerate(outs[:2]):  # both slots in flight behind the hold
            with c.step():
                c.copy(site.b, o, np.full(300, k, np.int32))
            held = c._ring.current
            assert held.tag == c._ring.acquires and int(held.cell[1]) < held.tag
        assert c._ring.in_flight()
    for k, o in enumerate(outs[2:], 2):  # each reuse waits for the slot's tag
        with c.step():
            c.copy(site.b, o, np.full(300, k, np.int32))
    for k, o in enumerate(outs):
        assert env.to_host(o).tolist() == [k] * 300
    assert not c._ring.in_flight()
    assert all(int(s_.cell[1]) == s_.tag for s_ in c._ring._slots)
    c.close()


@pytest.mark.gpu
@needs_both
def test_on_a_gpu_a_tag_behind_a_stalled_stream_is_reported_at_the_deadline(env, monkeypatch):
    from cucopy import copier as copier_mod

    monkeypatch.setattr(copier_mod, "TAGS", True)  # (the default; CUCOPY_TAG=0 turns it off)
    c, site, fast = _graphed_gpu_copier(env, flush_mode="mapped", slots=2, wait_timeout=0.5)
    a = env.empty((300,))
    stream = c._stream_obj if c._stream_obj is not None else env.default_stream
    with env.hold(stream):
        for k in range(2):
            with c.step():
                c.copy(site.b, a, np.full(300, k, np.int32))
        with pytest.raises(CopyError, match="its completion tag"):
            c.begin()
        assert not c.in_step and c.staged == 0
    with c.step():  # the hold ended: the copier goes on
        c.copy(site.b, a, np.full(300, 9, np.int32))
    assert env.to_host(a).tolist() == [9] * 300
    c.close()


@pytest.mark.gpu
@needs_both
def test_on_a_gpu_with_tags_off_graphed_steps_record_their_events(env, monkeypatch):
    from cucopy import copier as copier_mod

    monkeypatch.setattr(copier_mod, "TAGS", False)  # as CUCOPY_TAG=0 at import
    c, site, fast = _graphed_gpu_copier(env, flush_mode="mapped", slots=2)
    assert not c._tags
    _two_copy_steps(env, c, site, 5)
    slot = c._ring.current
    assert slot.tag == -1 and slot.recorded and c.stats.modes["mapped"] == 5
    c.close()


@pytest.mark.gpu
@needs_ext
def test_on_a_gpu_the_backends_compiled_driver_records_and_queries_events():
    # the backend hands cuEventRecord and cuEventQuery to its compiled driver, and the
    # runtime's event handles are the driver's CUevents
    if os.environ.get("CUCOPY_PURE_PYTHON"):
        pytest.skip("CUCOPY_PURE_PYTHON=1: the compiled driver calls are off")
    cupy = pytest.importorskip("cupy")
    from cucopy.backends.cuda import CudaBackend

    be = CudaBackend()
    be._get_kernels()
    fast = be._bound
    assert fast is not None
    s = cupy.cuda.Stream(non_blocking=True)
    stream = be.resolve_stream(s)
    ev = be.event_create()
    assert fast.event_record(ev, stream) == 0
    be.event_synchronize(ev)
    assert fast.event_query(ev) == 0 and be.event_query(ev)
    with be.hold(stream):
        assert fast.event_record(ev, stream) == 0  # behind the held kernel
        assert fast.event_query(ev) == NOT_READY and not be.event_query(ev)
    be.event_synchronize(ev)
    assert fast.event_query(ev) == 0
    s.synchronize()
    be.event_destroy(ev)


@needs_both
def _landing_copier(
    mode: str,
    plan_sites=("A", "B"),
    eager_site: bool = False,
    events: bool = False,
    graphs: bool = False,
    tags: bool | None = None,
):
    """A sim copier given a fake launcher that lands what it is handed.

    The fake driver checks the launch carries the slot's bytes, then lands them with
    the sim backend's own scatter (as the carried kernel would). With ``events`` the
    ring's events become raw handles (ints) that the backend and the fake driver's
    ``cuEventRecord`` / ``cuEventQuery`` translate to the sim's events, so the staging
    core's compiled record and query run against the simulated device. Returns
    ``(copier, site class, device, fake driver, problems)``. With ``graphs`` the sim
    offers graphed launches (``SimDevice.graph_capacity``) and the fake driver makes
    and launches graphs, each launch landing its segment as the sim's mapped scatter
    does (read when the stream runs it). ``tags``: completion tags on or off for this
    copier (``copier.TAGS`` while it is made; None: as imported).
    """
    import cucopy as cc
    from cucopy import copier as copier_mod

    members = [(name, cc.H2D) for name in plan_sites] + ([("E", cc.H2D)] if eager_site else [])
    members += [("P", cc.H2D)]  # a site outside the plan (eager)
    site = cc.CopySite("Site", members)
    dev = SimDevice(policy="lazy")
    if graphs:
        dev.graph_capacity = pack.GRAPH_CAPACITY
    saved = copier_mod.TAGS
    copier_mod.TAGS = saved if tags is None else tags
    try:
        c = cc.DeviceCopier(
            cc.CopyPlan(merge={getattr(site, n) for n in plan_sites}),
            stream=dev.default_stream,
            device=dev,
            backend="sim",
            flush_mode=mode,
        )
    finally:
        copier_mod.TAGS = saved
    fake, problems = _attach_landing(c, dev, events=events, graphs=graphs)
    return c, site, dev, fake, problems


def _attach_landing(c, dev, events: bool = False, graphs: bool = False):
    """Give sim copier ``c`` (on ``dev``) a fake launcher that lands what it is handed
    (see :func:`_landing_copier`); returns ``(fake driver, problems)``."""
    be = c._backend
    problems: list = []

    class Landing(GraphFake):
        def launch(self, f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra):
            super().launch(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra)
            try:
                buf = self.launches[-1]["buffer"]
                seg, n, _ = struct.unpack_from("<QII", buf)
                pin = c._slot.pinned
                start = seg - pin.device_ptr
                if buf[pack.CARRY_PREFIX : pack.CARRY_PREFIX + n] != bytes(
                    c._slot.array[start : start + n]
                ):
                    problems.append("the launch carried other bytes than the slot's")
                be.scatter(seg, gx, dev.default_stream, True, n, pin.ptr + start)
            except Exception as e:  # a callback's exception would be lost
                problems.append(repr(e))
            return 0

        def graph_launch(self, exec_, stream):
            rc = super().graph_launch(exec_, stream)
            try:
                node = self.graph_launches[-1][0]
                seg = node["seg"]
                head, _ = pack.decode(dev._mem(seg, pack.HEADER_BYTES).tobytes())
                # the kernel reads all GRAPH_CAPACITY bytes, and writes the tag last
                be.scatter_graphed(seg, int(head["nblocks"]), dev.default_stream, node["cell"])
            except Exception as e:  # a callback's exception would be lost
                problems.append(repr(e))
            return rc

        def copied(self, dst, dpitch, src, spitch, width, rows, stream):
            rc = super().copied(dst, dpitch, src, spitch, width, rows, stream)
            if rc == 0:  # the copy the driver would make, on the sim
                be.copy2d(True, dst, dpitch, src, spitch, width, rows, dev.default_stream)
            return rc

        # (events=True) the sim's events behind the raw handles
        def event_record(self, event, stream):
            rc = super().event_record(event, stream)
            if rc == 0:
                sim_record(by_handle[event], dev.default_stream)
            return rc

        def event_query(self, event):
            rc = super().event_query(event)
            return rc if rc else (0 if sim_query(by_handle[event]) else NOT_READY)

    by_handle: dict = {}
    sim_record, sim_query = be.event_record, be.event_query
    if events:
        ring = c._ring
        by_handle.update({0xE000 + i: ev for i, ev in enumerate(ring._events)})
        ring._events = list(by_handle)
        for name in (
            "event_record",
            "event_query",
            "event_synchronize",
            "event_wait",
            "event_destroy",
        ):
            fn = getattr(be, name)
            setattr(be, name, lambda ev, *a, _fn=fn: _fn(by_handle.get(ev, ev), *a))
    fake = Landing()
    fake.by_handle = by_handle  # (events=True) the raw handles' sim events
    d = _cudacall.Driver(*fake.addrs)
    if events:
        d.events(*fake.event_addrs)
    d.copies(*fake.copy_addrs)
    caps = be.carry_capacities()
    d.kernels(0x5CA7, [(cap, 0x1000 + i) for i, cap in enumerate(caps)], pack.THREADS)
    if graphs:
        d.graphs(*fake.graph_addrs, WHOLE, pack.GRAPH_CAPACITY)
    c._launcher, c._handle = d.launcher(), 77
    c._test_driver = d
    _KEEP.append((weakref.ref(c), fake))  # its callbacks outlive the Driver (see _KEEP)
    if events:
        c._ring._launcher = c._launcher
    return fake, problems


@pytest.mark.parametrize("mode", ["auto", "inline", "mapped", "dma"])
def test_a_copier_given_a_launcher_lands_what_scatter_would(mode):
    # CI has no GPU, so the copier's launcher branch runs here against the simulated
    # device (see _landing_copier)
    from cucopy import copier as copier_mod

    c, Site, dev, fake, problems = _landing_copier(mode)
    rng = np.random.default_rng(7)
    dsts = [dev.zeros((k,), np.int32) for k in (3, 100, 5000, 1)]
    for _ in range(4):
        want = [rng.integers(-9, 9, d_.shape[0], dtype=np.int32) for d_ in dsts]
        with c.step():
            for i, (d_, w) in enumerate(zip(dsts, want)):
                c.copy(Site.A if i % 2 else Site.B, d_, w)
                if i == 1:
                    c.flush()  # a barrier: the step's second segment starts past the first
        dev.synchronize()
        for d_, w in zip(dsts, want):
            assert np.array_equal(dev.to_host(d_), w)
    assert problems == []
    # inline segments went through the launcher, the others through scatter()
    assert len(fake.launches) == c.stats.modes["inline"]
    assert c.stats.segments == 8
    if mode in ("auto", "inline"):  # at most 20 KB a segment: carried whole
        assert len(fake.launches) == 8
        # each through flush()'s compiled common case (CopierCore._flush_fast)
        compiled = copier_mod._CopierCore is not copier_mod.PyCopierCore
        assert c._fast_flushes == (8 if compiled else 0)
    if mode in ("mapped", "dma"):
        assert fake.launches == []
        assert c._fast_flushes == 0
    c.close()


@pytest.mark.parametrize("mode", ["auto", "mapped"])
def test_a_mapped_segment_lands_from_the_staging_core_with_its_event(mode):
    # a segment over the largest carry (auto: up to _mapped_max) is read mapped; the
    # compiled flush launches it carrying its header and table, records the slot's
    # event through the launcher, and the compiled ring step asks that event before
    # reusing the slot. The Python twin lands the same through scatter()/event_record.
    from cucopy import copier as copier_mod

    c, Site, dev, fake, problems = _landing_copier(mode, events=True)
    c._mapped_max = 1 << 20  # the sim's threshold is 4 KiB: auto would pick dma
    compiled = copier_mod._CopierCore is not copier_mod.PyCopierCore
    rng = np.random.default_rng(11)
    dsts = [dev.zeros((k,), np.int32) for k in (3, 100, 9000, 1)]  # 36 KB a step
    steps = 3 * c._ring.slots
    for _ in range(steps):
        want = [rng.integers(-9, 9, d_.shape[0], dtype=np.int32) for d_ in dsts]
        with c.step():
            for i, (d_, w) in enumerate(zip(dsts, want)):
                c.copy(Site.A if i % 2 else Site.B, d_, w)
        for d_, w in zip(dsts, want):
            assert np.array_equal(dev.to_host(d_), w)
    assert problems == []
    assert c.stats.modes["mapped"] == c.stats.segments == steps
    assert c._fast_flushes == (steps if compiled else 0)
    if compiled:
        # one launch carrying the header and table (not the data), one record, a step
        assert len(fake.launches) == steps
        carried = [struct.unpack_from("<I", r["buffer"], 8)[0] for r in fake.launches]
        assert all(0 < n < 1024 for n in carried)  # 36 KB of data stayed in the slot
        assert [e for e, _ in fake.records] == [0xE000 + i % c._ring.slots for i in range(steps)]
        assert {s for _, s in fake.records} == {77}
        # the ring came round: its compiled step asked the slots' events
        assert fake.queries and c._ring.fast_advances > 0
    else:
        assert fake.launches == [] and fake.records == []
    assert all(s_.recorded and not s_.dirty for s_ in c._ring._slots if s_ is not None)
    c.close()


def test_small_mapped_segments_launch_graphed_with_their_events():
    # a mapped segment of at most pack.GRAPH_CAPACITY bytes is launched through a
    # one-node graph pointed at its address (compiled: the staging core's flush calls
    # the launcher's graphed(); Python twin: the backend's scatter_graphed()); the
    # step's first writes its slot's completion tag, the second (a later reader of the
    # slot) has the slot's event recorded after it; the kernel reads GRAPH_CAPACITY
    # bytes at the segment, so a later segment of the step starts past them
    from cucopy import copier as copier_mod

    # (tags: the default; CUCOPY_TAG=0 turns them off)
    c, Site, dev, fake, problems = _landing_copier("mapped", events=True, graphs=True, tags=True)
    compiled = copier_mod._CopierCore is not copier_mod.PyCopierCore
    rng = np.random.default_rng(5)
    dsts = [dev.zeros((k,), np.int32) for k in (3, 100, 600, 1)]  # 2.8 KB a step
    steps = 3 * c._ring.slots
    for _ in range(steps):
        want = [rng.integers(-9, 9, d_.shape[0], dtype=np.int32) for d_ in dsts]
        with c.step():
            for i, (d_, w) in enumerate(zip(dsts, want)):
                c.copy(Site.A if i % 2 else Site.B, d_, w)
                if i == 1:
                    c.flush()  # a barrier: two segments in the step
                    first = c._slot.bottom
        assert first >= pack.GRAPH_CAPACITY  # the second segment began past the first's read
        dev.synchronize()
        for d_, w in zip(dsts, want):
            assert np.array_equal(dev.to_host(d_), w)
    assert problems == []
    assert c.stats.modes["mapped"] == c.stats.segments == 2 * steps
    assert fake.launches == []  # no kernel launch: every segment went graphed
    if compiled:
        assert c._fast_flushes == 2 * steps
        segs = [n["seg"] for n, _ in fake.graph_launches]
        assert len(segs) == 2 * steps
        assert {st for _, st in fake.graph_launches} == {77}
        # a graph pointed at each segment address (the slots' first and second
        # segments) once, then launched as pointed: no graph made
        assert len(set(segs)) == 2 * c._ring.slots
        assert c._test_driver.graph_updates == 2 * c._ring.slots
        assert c._test_driver.graph_count == _cudacall.GRAPH_POOL
        tagged = [n["cell"] for n, _ in fake.graph_launches]
        # the first segment of each step tagged (the tag in the slot's headroom), the
        # second not: its event recorded after it, from C, one a step
        assert tagged[1::2] == [0] * steps
        assert all(t == s_ + pack.TAG_AT for t, s_ in zip(tagged[::2], segs[::2]))
        assert len(fake.records) == steps
    else:
        assert fake.graph_launches == [] and c._fast_flushes == 0
    c.close()


def test_a_segment_too_large_or_too_near_the_top_is_not_graphed():
    # over pack.graph_max bytes, or where the kernel's read would pass the slot's
    # end or its eager snapshots: a carried-header mapped launch as before
    c, Site, dev, fake, problems = _landing_copier("mapped", events=True, graphs=True)
    c._mapped_max = 1 << 20
    big = dev.zeros((8200,), np.int32)  # 32.8 KB
    assert pack.HEADER_BYTES + big.nbytes > pack.graph_max(pack.GRAPH_CAPACITY)
    with c.step():
        c.copy(Site.A, big, np.arange(8200, dtype=np.int32))
    small = dev.zeros((4,), np.int32)
    with c.step():
        c._slot.top = c._seg.cursor + 4096  # as if eager snapshots filled the slot's top
        c._seg.bind(c._slot)
        c.copy(Site.A, small, np.arange(4, dtype=np.int32))
    assert c.stats.modes["mapped"] == 2 and fake.graph_launches == []
    dev.synchronize()
    assert dev.to_host(small).tolist() == [0, 1, 2, 3]
    assert dev.to_host(big).tolist() == list(range(8200))
    assert problems == []
    c.close()


def test_graph_reach_follows_the_kernel_s_rounds_and_auto_s_choice():
    cap = pack.GRAPH_CAPACITY
    top = pack.graph_max(cap)
    assert top == pack.GRAPH_ROUNDS * cap == 32768  # scatter.cu's CUCOPY_GRAPH_MAX
    assert pack.graph_reach(cap, 100) == cap
    assert pack.graph_reach(cap, cap + 1) == cap + 16
    assert pack.graph_reach(cap, 2 * cap) == 2 * cap
    assert pack.graph_reach(cap, 2 * cap + 1) == 2 * cap + 16
    assert pack.graph_reach(cap, top) == top
    assert pack.graph_reach(cap, top + 1) == 0  # too long: not graphed
    assert pack.graph_reach(0, 100) == 0  # no graphs
    auto = pack.AUTO_GRAPH_ROUNDS * cap
    assert pack.graph_reach(cap, 100, auto=True) == cap
    assert pack.graph_reach(cap, auto, auto=True) == auto
    assert pack.graph_reach(cap, auto + 1, auto=True) == 0  # auto carries it instead
    # capacities only the probe builds: the kernel reads less past 8 KiB
    assert pack.graph_max(16384) == 32768 and pack.graph_max(32768) == 32768


@pytest.mark.parametrize("mode", ["mapped", "auto"])
def test_segments_past_the_graph_capacity_are_graphed_and_read_to_their_end(mode):
    # more than GRAPH_CAPACITY bytes and at most pack.graph_max (mapped) or
    # AUTO_GRAPH_ROUNDS times it (auto): graphed as well (compiled: the staging core's
    # flush; Python twin: the sim's scatter_graphed), the kernel reading the segment to
    # its end (pack.graph_reach), so the step's next segment starts past it; a segment
    # of at most GRAPH_CAPACITY bytes still moves the next one past all GRAPH_CAPACITY
    # bytes. Auto carries a longer one whole (inline)
    from cucopy import copier as copier_mod

    c, Site, dev, fake, problems = _landing_copier(mode, events=True, graphs=True)
    c._mapped_max = 1 << 20
    compiled = copier_mod._CopierCore is not copier_mod.PyCopierCore
    cap = pack.GRAPH_CAPACITY
    rng = np.random.default_rng(11)
    # 8.4 KB, 15.2 KB, 120 B, 8.4 KB, 24 KB and 31.6 KB of data
    sizes = (2100, 3800, 30, 2100, 6000, 7900)
    for k in sizes:
        big = dev.zeros((k,), np.int32)
        tail = dev.zeros((5,), np.int32)
        want, want_tail = (rng.integers(-99, 99, n, dtype=np.int32) for n in (k, 5))
        graphed = mode == "mapped" or k * 4 <= 16000  # (auto: up to 16 KiB in all)
        with c.step():
            start = c._seg.cursor
            c.copy(Site.A, big, want)
            c.flush()  # a barrier: a second segment in the step
            first = c._slot.bottom
            c.copy(Site.B, tail, want_tail)
        if graphed:
            assert first - start >= max(cap, pack.HEADER_BYTES + k * 4)
        else:  # carried whole: the next segment right after this one
            assert first - start < pack.HEADER_BYTES + 48 * 8 + k * 4 + 64
        dev.synchronize()
        assert np.array_equal(dev.to_host(big), want)
        assert np.array_equal(dev.to_host(tail), want_tail)
    assert problems == []
    n = 2 * len(sizes)
    carried = 0 if mode == "mapped" else 2  # auto: the 24 and 31.6 KB segments
    assert c.stats.modes["mapped"] == n - carried and c.stats.modes["inline"] == carried
    if compiled:
        assert len(fake.graph_launches) == n - carried and c._fast_flushes == n
        assert len(fake.launches) == carried  # the carried ones: a kernel launch each
    else:
        assert fake.launches == []  # the sim's scatter: no driver launch
    c.close()


def test_a_mapped_segment_s_table_is_compacted_to_fit_a_graphed_read():
    # a step of 200 copies leaves 200 descriptors reserved for the next steps' tables; a
    # mapped segment whose data would then pass pack.graph_max has its table compacted
    # (the data moved down to it) and goes graphed, its bytes intact (compiled flush and
    # Python twin alike)
    from cucopy import copier as copier_mod

    # (tags: the default; CUCOPY_TAG=0 turns them off)
    c, Site, dev, fake, problems = _landing_copier("mapped", events=True, graphs=True, tags=True)
    compiled = copier_mod._CopierCore is not copier_mod.PyCopierCore
    small = [dev.zeros((4,), np.int32) for _ in range(200)]
    with c.step():
        for i, d_ in enumerate(small):
            c.copy(Site.A, d_, np.full(4, i, np.int32))
    big = dev.zeros((7900,), np.int32)  # 31.6 KB: past graph_max behind a 9.6 KB table
    rng = np.random.default_rng(2)
    for _ in range(2 * c._ring.slots):
        want = rng.integers(-(1 << 30), 1 << 30, 7900, dtype=np.int32)
        with c.step():
            c.copy(Site.A, big, want)
        assert c._ring.current.tag == c._ring.acquires  # graphed (tagged)
        dev.synchronize()
        assert np.array_equal(dev.to_host(big), want)
    assert [dev.to_host(d_).tolist() for d_ in small] == [[i] * 4 for i in range(200)]
    assert problems == []
    n = 1 + 2 * c._ring.slots
    assert c.stats.modes["mapped"] == n
    if compiled:
        assert len(fake.graph_launches) == n and c._fast_flushes == n
    c.close()


@pytest.mark.parametrize("mode", ["auto", "inline", "dma"])
def test_mapped_and_auto_segments_launch_graphed(mode):
    # auto launches small segments graphed too (half a carried launch's host time),
    # inline carries them always, dma uploads them
    from cucopy import copier as copier_mod

    c, Site, dev, fake, problems = _landing_copier("mapped", events=True, graphs=True)
    c.flush_mode = mode
    compiled = copier_mod._CopierCore is not copier_mod.PyCopierCore
    a = dev.zeros((8,), np.int32)
    for k in range(2):
        with c.step():
            c.copy(Site.A, a, np.arange(8, dtype=np.int32) + k)
        dev.synchronize()
        assert dev.to_host(a).tolist() == list(range(k, k + 8))
    want = "mapped" if mode == "auto" else mode
    assert c.stats.modes[want] == 2 and problems == []
    assert len(fake.graph_launches) == (2 if mode == "auto" and compiled else 0)
    if mode == "auto":
        assert fake.launches == []  # no carried launch: graphed (or, Python twin, mapped)
        assert c._fast_flushes == (2 if compiled else 0)
    c.close()


@pytest.mark.parametrize("mapped_max", [0, 1 << 20])
def test_auto_carries_what_a_graph_would_not_read_or_its_threshold_forbids(mapped_max):
    # over AUTO_GRAPH_ROUNDS times GRAPH_CAPACITY bytes (within the largest carry):
    # carried whole, as before (a graph would read it whole: auto does not choose one);
    # a small segment with the mapped threshold below it (mapped_threshold=0 means
    # never read mapped memory) is carried too
    c, Site, dev, fake, problems = _landing_copier("auto", events=True, graphs=True)
    c._mapped_max = mapped_max
    big = dev.zeros((4200,), np.int32)  # 16.8 KB: over the graph's reads, under the carry
    small = dev.zeros((4,), np.int32)
    with c.step():
        c.copy(Site.A, big, np.arange(4200, dtype=np.int32))
    with c.step():
        c.copy(Site.A, small, np.arange(4, dtype=np.int32))
    dev.synchronize()
    assert dev.to_host(big).tolist() == list(range(4200))
    assert dev.to_host(small).tolist() == [0, 1, 2, 3]
    graphed = 1 if mapped_max else 0
    assert c.stats.modes["inline"] == 2 - graphed
    assert c.stats.modes["mapped"] == graphed
    assert problems == []
    c.close()


@pytest.mark.parametrize("tags", [False, True], ids=["untagged", "tagged"])
@pytest.mark.parametrize("mode", ["mapped", "auto"])
def test_a_stream_with_no_graph_left_lands_by_a_carried_launch_in_the_compiled_flush(mode, tags):
    # every graph of the Driver's pool last launched on another stream: graphed()
    # answers -1 and launches nothing, and the compiled flush goes on to its carried
    # launches (auto: the whole segment carried; mapped: its header and table), as if
    # the segment were never graphed: no tag armed in the slot, the slot's event
    # recorded for a mapped launch, the slot's next segment right after this one (no
    # graph's read to step past). The Python twin's scatter_graphed (the sim's) still
    # launches it graphed: the bytes land either way.
    from cucopy import copier as copier_mod

    c, Site, dev, fake, problems = _landing_copier(mode, events=True, graphs=True, tags=tags)
    assert c._tags == tags
    c._mapped_max = 1 << 20  # (auto: small segments would go graphed)
    compiled = copier_mod._CopierCore is not copier_mod.PyCopierCore
    s = _launcher_struct(c._launcher)
    assert s.graph_cap == pack.GRAPH_CAPACITY
    graphed = ctypes.PYFUNCTYPE(
        ctypes.c_int, ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_ulonglong
    )(s.graphed)
    for i in range(_cudacall.GRAPH_POOL):  # every graph stream 99's (the copier's is 77)
        assert graphed(s.drv, 99, 0xF0000000 + 0x10000 * i) == 0
    assert graphed(s.drv, 77, 0xF0000000) == -1
    fake.graph_launches.clear()
    problems.clear()  # those addresses are not the sim's: their landing failed
    updates = c._test_driver.graph_updates
    a, b = dev.zeros((8,), np.int32), dev.zeros((6,), np.int32)
    steps = 2 * c._ring.slots
    for k in range(steps):
        with c.step():
            c.copy(Site.A, a, np.arange(8, dtype=np.int32) + k)
            c.flush()  # a barrier: a second segment in the step
            first_end = c._seg.cursor
            c.copy(Site.B, b, np.arange(6, dtype=np.int32) * k)
        if compiled:  # (a graphed launch would have moved the next segment past 8 KiB)
            assert first_end < pack.GRAPH_CAPACITY
        dev.synchronize()
        assert dev.to_host(a).tolist() == list(range(k, k + 8))
        assert dev.to_host(b).tolist() == [i * k for i in range(6)]
    assert problems == []
    assert fake.graph_launches == [] and c._test_driver.graph_updates == updates
    if compiled:
        # every segment through the compiled flush, by a carried launch on the stream
        assert c._fast_flushes == 2 * steps
        assert len(fake.launches) == 2 * steps
        assert {r["stream"] for r in fake.launches} == {77}
        carried = [struct.unpack_from("<I", r["buffer"], 8)[0] for r in fake.launches]
        if mode == "auto":
            assert c.stats.modes["inline"] == 2 * steps
        else:  # the header and table carried, the data read mapped: the slot's event
            assert c.stats.modes["mapped"] == 2 * steps
            head = pack.align(pack.HEADER_BYTES + pack.DESC_BYTES)  # one copy a segment
            assert carried == [head] * (2 * steps)
            assert len(fake.records) >= steps
        assert all(s_.tag == -1 for s_ in c._ring._slots if s_ is not None)
    else:
        assert c._fast_flushes == 0
        assert c.stats.modes["mapped"] == 2 * steps  # the sim's scatter_graphed
    c.close()


def test_stats_count_the_compiled_steps_when_read_and_a_reset_drops_them():
    # the compiled begin() and flush() count in C; stats folds the counts in whenever
    # a total is read, and a reset drops what was counted before it
    from cucopy import copier as copier_mod

    compiled = copier_mod._CopierCore is not copier_mod.PyCopierCore
    c, Site, dev, fake, problems = _landing_copier("auto")
    c._cap_query, c._cap_arg = (lambda stream: 0), 77  # never capturing: begin() compiled
    d = dev.zeros((4,), np.int32)
    with c.step():
        c.copy(Site.A, d, np.arange(4, dtype=np.int32))
    st = c.stats
    one = st.bytes_staged
    assert one > 16 and (st.steps, st.segments, st.modes["inline"]) == (1, 1, 1)
    for k in range(7):  # round the ring twice: once its slots exist, begin() is compiled
        with c.step():
            c.copy(Site.A, d, np.arange(4, dtype=np.int32) + k)
    # counted in C (compiled)
    assert c._fast_begins >= 4 if compiled else c._fast_begins == 0
    assert c._fast_flushes == (8 if compiled else 0)
    assert st.as_dict()["steps"] == 8 and st.segments == 8 and st.bytes_staged == 8 * one
    assert st.modes == {"dma": 0, "mapped": 0, "inline": 8}
    if compiled:
        assert c._take_counts() == (0,) * 5  # all folded by the reads above
    with c.step():
        c.copy(Site.A, d, np.arange(4, dtype=np.int32))
    st.reset()  # the step above was counted (in C) before the reset: dropped
    assert (st.steps, st.segments, st.bytes_staged) == (0, 0, 0)
    assert st.modes == {"dma": 0, "mapped": 0, "inline": 0}
    with c.step():
        c.copy(Site.A, d, np.arange(4, dtype=np.int32))
    st.steps += 10  # a total set from Python keeps what C counted before it
    assert (st.steps, st.segments, st.modes["inline"]) == (11, 1, 1)
    assert "steps=11 segments=1" in str(st)
    assert problems == [] and dev.to_host(d).tolist() == [0, 1, 2, 3]
    c.close()


@pytest.mark.parametrize("graphs", [False, True], ids=["kernels", "graphs"])
@pytest.mark.parametrize("mode", ["auto", "mapped", "inline"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_steps_land_through_the_compiled_flushes_with_events(mode, seed, graphs):
    # random steps (several segments, eager copies that dirty the slot, discards,
    # segments over the largest carry) against the simulated device, the ring's
    # events as raw handles: whatever the compiled flush and ring step take or leave
    # to Python, every destination holds what the last landed copy wrote
    c, Site, dev, fake, problems = _landing_copier(
        mode, plan_sites=("A", "B"), eager_site=True, events=True, graphs=graphs
    )
    c._mapped_max = 1 << 20
    rng = np.random.default_rng(seed)
    dsts = [dev.zeros((int(k),), np.int32) for k in (1, 7, 300, 4000, 9000, 12)]
    want = [np.zeros(d_.shape[0], np.int32) for d_ in dsts]
    for _ in range(40):
        c.begin()
        staged = [w.copy() for w in want]
        for _ in range(int(rng.integers(1, 8))):
            i = int(rng.integers(len(dsts)))
            v = rng.integers(-99, 99, dsts[i].shape[0], dtype=np.int32)
            site = (Site.A, Site.B, Site.E)[int(rng.integers(3))]
            c.copy(site, dsts[i], v)
            staged[i] = v
            if rng.random() < 0.2:
                c.flush()  # a barrier: the step's next segment starts past this one
        if rng.random() < 0.1:
            c.discard()  # what was flushed landed; the rest is dropped
            dev.synchronize()
            want = [dev.to_host(d_).copy() for d_ in dsts]
            continue
        c.flush()
        want = staged
        if rng.random() < 0.5:
            dev.synchronize()
            for d_, w in zip(dsts, want):
                assert np.array_equal(dev.to_host(d_), w)
    dev.synchronize()
    for d_, w in zip(dsts, want):
        assert np.array_equal(dev.to_host(d_), w)
    assert problems == []
    if graphs and mode in ("mapped", "auto") and c._fast_flushes:
        assert fake.graph_launches  # small segments went graphed from the staging core
    if not graphs or mode == "inline":
        assert fake.graph_launches == []
    # every slot but the current one left clean: none is read behind the ring's back
    for s_ in c._ring._slots:
        assert s_ is None or not s_.dirty or s_ is c._ring.current
    c.close()


@needs_both
@pytest.mark.skipif(
    not _compiled_copier_core_now(), reason="the compiled staging core is not in use"
)
def test_a_failed_compiled_record_leaves_the_slot_to_flush_s_body():
    # the launch went through but cuEventRecord failed: the slot stays dirty and
    # flush()'s Python body records its event (through the backend), as before
    c, Site, dev, fake, problems = _landing_copier("mapped", events=True)
    fake.event_result = 700
    a = dev.zeros((9000,), np.int32)
    for k in range(3):
        with c.step():
            c.copy(Site.A, a, np.full(9000, k, np.int32))
        assert dev.to_host(a).tolist() == [k] * 9000
        slot = c._ring.current
        assert slot.recorded and not slot.dirty  # recorded by the body
    assert len(fake.records) == 3 and c._fast_flushes == 3 and problems == []
    c.close()


def _compiled_copier_core() -> bool:
    from cucopy import copier

    return copier._CopierCore is not copier.PyCopierCore


@needs_both
@pytest.mark.skipif(
    not _compiled_copier_core_now(), reason="the compiled staging core is not in use"
)
def test_a_failing_compiled_event_query_leaves_the_step_to_the_python_path():
    # cuEventQuery answering an error (not 0, not NOT_READY): the ring's compiled step
    # declines, and the Python path asks the backend, which answers for the same event
    c, Site, dev, fake, problems = _landing_copier("mapped", events=True)
    a = dev.zeros((9000,), np.int32)
    slots = c._ring.slots
    for k in range(slots):  # every slot used and recorded once
        with c.step():
            c.copy(Site.A, a, np.full(9000, k, np.int32))
        dev.synchronize()
    advances = c._ring.fast_advances
    fake.event_result = 999  # every event call fails from now on (the record too)
    for k in range(slots, 3 * slots):
        with c.step():
            c.copy(Site.A, a, np.full(9000, k, np.int32))
        dev.synchronize()
        assert dev.to_host(a).tolist() == [k] * 9000
        assert c._ring.current.recorded and not c._ring.current.dirty
    # a step that must ask declines (the Python path asks the backend, which answers
    # complete: the newest event, so the slots recorded before it need no asking); the
    # other steps of that turn of the ring advance compiled without a query
    assert c._ring.fast_advances - advances == 2 * (slots - 1)
    assert len(fake.queries) >= 2 and problems == []
    c.close()


@needs_both
@pytest.mark.skipif(not _compiled_copier_core(), reason="the compiled staging core is not in use")
@pytest.mark.parametrize(
    "why", ["dma", "no_launcher", "check_mode", "capturing", "mapped_without_event_handles"]
)
def test_flush_fast_declines_without_cutting(monkeypatch, why):
    from cucopy import check

    # (a mapped flush needs the slot's event as a raw handle: the sim's are objects)
    mode = {"dma": "dma", "mapped_without_event_handles": "mapped"}.get(why, "auto")
    c, Site, dev, fake, problems = _landing_copier(mode)
    a = dev.zeros((64,), np.int32)
    with c.step():
        c.copy(Site.A, a, np.arange(64, dtype=np.int32))
    if why == "no_launcher":
        c._launcher = None
    elif why == "check_mode":
        monkeypatch.setattr(check, "CHECK_MODE", True)
    c.begin()
    c.copy(Site.A, a, np.full(64, 5, np.int32))
    if why == "capturing":
        monkeypatch.setattr(c, "_cap_query", lambda arg: 1)
    staged, cursor, flushes = c.staged, c._seg.cursor, c._fast_flushes
    assert c._flush_fast() is False
    assert (c.staged, c._seg.cursor, c._fast_flushes) == (staged, cursor, flushes)
    c.flush()  # flush()'s Python body lands it
    dev.synchronize()
    assert dev.to_host(a).tolist() == [5] * 64 and problems == []
    c.close()


@needs_both
@pytest.mark.skipif(not _compiled_copier_core(), reason="the compiled staging core is not in use")
def test_flush_fast_lands_what_it_cut_through_the_python_path_when_too_large():
    c, Site, dev, fake, problems = _landing_copier("auto")
    big = dev.zeros((16384,), np.int32)  # 64 KiB: past every carry capacity
    want = np.arange(16384, dtype=np.int32)
    with c.step():
        c.copy(Site.A, big, want)
    dev.synchronize()
    assert np.array_equal(dev.to_host(big), want) and problems == []
    assert fake.launches == [] and c._fast_flushes == 0
    assert c.stats.segments == 1 and c.stats.modes["inline"] == 0
    assert c._ring.current.recorded  # mapped or dma: its event follows the launch
    c.close()


@needs_both
@pytest.mark.skipif(not _compiled_copier_core(), reason="the compiled staging core is not in use")
def test_flush_fast_leaves_an_eager_copys_event_to_the_python_body():
    c, Site, dev, fake, problems = _landing_copier("auto", eager_site=True)
    a, b = dev.zeros((16,), np.int32), dev.zeros((16,), np.int32)
    with c.step():
        c.copy(Site.A, a, np.full(16, 3, np.int32))
    with c.step():
        c.copy(Site.E, b, np.full(16, 4, np.int32))  # not merged: an eager copy, slot dirty
        c.copy(Site.A, a, np.full(16, 6, np.int32))
    assert c._fast_flushes == 2 and len(fake.launches) == 2
    assert c._ring.current.recorded and not c._ring.current.dirty
    dev.synchronize()
    assert dev.to_host(a).tolist() == [6] * 16 and dev.to_host(b).tolist() == [4] * 16
    assert problems == []
    c.close()


@needs_both
def test_a_compiled_flush_that_fails_at_the_step_exit_is_reported_as_flush_reports_it():
    # the compiled step's exit calls _flush_fast itself (no flush() frame): an error it
    # raises (a descriptor field too wide to encode) is reported as flush() reports it,
    # naming the site, dropped copies' callbacks run, and the copier stays usable
    import cucopy as cc
    from cucopy import copier as copier_mod

    c, Site, dev, fake, problems = _landing_copier("inline")
    compiled = copier_mod._CopierCore is not copier_mod.PyCopierCore
    _steps_of_eight(c, Site, dev, c._ring.slots)  # a slot's first step is the Python path's
    fast = c._fast_flushes
    dropped, failed = [], []
    report = c._flush_failed

    def spy(exc):
        failed.append(exc)
        report(exc)

    c._flush_failed = spy  # what the exit calls when _flush_fast raised
    with pytest.raises(cc.CopyError, match=r"Site\.A: flushing 1 staged copies failed") as info:
        with c.step():
            desc = (1 << 40, 1 << 41, 0, 1 << 32, 4, 4, 2, pack.KIND_D2D, 0, 0)
            c._seg.stage(Site.A, lambda: dropped.append(1), 0, 1 << 33, None, 0, desc)
    assert isinstance(info.value.__cause__, (ValueError, OverflowError))
    assert [type(e) for e in failed] == ([type(info.value.__cause__)] if compiled else [])
    assert dropped == [1] and c.staged == 0 and c._fast_flushes == fast
    _steps_of_eight(c, Site, dev, 2)
    assert c._fast_flushes == fast + (2 if compiled else 0) and problems == []
    c.close()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_on_a_gpu_cached_destinations_stay_on_the_fast_path(env, kind):
    # CuPy arrays and torch CUDA tensors, once seen, are validated by the staging core
    # (CuPy: __cucopy_spec__, torch: the native getters) and never resolved again; an
    # in-place shape change is caught and read afresh
    import cucopy as cc

    if not hasattr(env, "cp"):
        pytest.skip("needs the GPU")
    if kind == "torch":
        torch = pytest.importorskip("torch")
        a = torch.zeros(8, dtype=torch.int32, device="cuda")
        b = torch.zeros((2, 4), dtype=torch.int32, device="cuda")
        torch.cuda.synchronize()
    else:
        a, b = env.empty((8,)), env.empty((2, 4))
    site = cc.CopySite("D", [("a", cc.H2D), ("b", cc.H2D)])
    c = env.copier(cc.CopyPlan(merge=set(site)))
    calls: list = []
    orig = c._dst

    def spy(s, d):
        calls.append(s)
        return orig(s, d)

    for k in range(4):
        with c.step():
            c.copy(site.a, a, np.full(8, k, np.int32))
            c.copy(site.b, b, np.full((2, 4), k, np.int32))
        c._dst = spy  # from the second step on
    env.cp.cuda.Device(0).synchronize()
    host = a.cpu().numpy() if kind == "torch" else env.cp.asnumpy(a)
    assert host.tolist() == [3] * 8
    assert calls == []  # never resolved after the first step
    if kind == "torch":
        b.resize_(4, 2)
    else:
        b.shape = (4, 2)
    with c.step():
        c.copy(site.b, b, np.arange(8, dtype=np.int32).reshape(4, 2))
    env.cp.cuda.Device(0).synchronize()
    host = b.cpu().numpy() if kind == "torch" else env.cp.asnumpy(b)
    assert host.reshape(-1).tolist() == list(range(8)) and calls == [site.b]
    c.close()


@needs_ext
def test_event_wait_sleeps_between_queries_and_gives_up_at_its_deadline():
    """cuEventQuery, then a sleep (20 us doubling to 1 ms) with the GIL released, never a
    spin: a 50 ms wait on an event that never completes asks it a few dozen times."""
    import threading
    import time

    fake = FakeDriver()
    d = _driver(fake)
    assert d.event_wait(0xE1, 10**9) == -1  # before events(): the backend polls in Python
    d.events(*fake.event_addrs)
    assert d.event_wait(0xE1, 10**9) == 0  # complete: one query, no sleep
    assert fake.queries == [0xE1]
    fake.pending.add(0xE2)
    ticks = []
    stop = threading.Event()
    other = threading.Thread(
        target=lambda: [ticks.append(1) or time.sleep(0.001) for _ in iter(stop.is_set, True)]
    )
    other.start()
    t0 = time.monotonic()
    assert d.event_wait(0xE2, 50_000_000) == NOT_READY
    spent = time.monotonic() - t0
    stop.set()
    other.join()
    assert 0.05 <= spent < 1.0
    asked = fake.queries.count(0xE2)
    assert 5 <= asked <= 120, asked  # slept between queries (a spin asks ~10^5 times)
    assert len(ticks) >= 10  # the GIL was released while it slept
    fake.pending.clear()
    assert d.event_wait(0xE2, 50_000_000) == 0
    fake.event_result = 700  # a failure comes back at once, as is
    assert d.event_wait(0xE3, 10**9) == 700


@needs_ext
def test_the_drivers_copy_calls_nothing_until_copies_is_set():
    fake = FakeDriver()
    d = _driver(fake)
    assert d.copy(0xD000, 16, 0x1000, 16, 16, 1, 5) == -1 and fake.copies == []
    d.copies(*fake.copy_addrs)
    assert d.copy(0xD000, 16, 0x1000, 16, 16, 1, 5) == 0  # one row: cuMemcpyHtoDAsync
    assert d.copy(0xD000, 64, 0x1000, 16, 16, 3, 5) == 0  # rows: cuMemcpy2DAsync
    assert fake.copies == [
        (0xD000, 16, 0x1000, 16, 16, 1, 5),
        (0xD000, 64, 0x1000, 16, 16, 3, 5),
    ]
    assert d.copy(0xD000, 1 << 31, 0x1000, 16, 16, 3, 5) == -1  # past the 2-D pitch limit
    assert d.copy(0xD000, 16, 0x1000, 16, 0, 1, 5) == -1  # nothing to copy
    fake.copy_result = 700
    assert d.copy(0xD000, 16, 0x1000, 16, 16, 1, 5) == 700
    assert len(fake.copies) == 3
    with pytest.raises(ValueError):
        d.copies(0, fake.copy_addrs[1])
    s = _launcher_struct(d.launcher())
    assert s.abi == _cudacall.LAUNCHER_ABI and s.copy


@needs_both
@pytest.mark.skipif(
    not _compiled_copier_core_now(), reason="the compiled staging core is not in use"
)
@pytest.mark.parametrize("merged", [False, True])
def test_plain_copies_take_one_driver_copy_each_and_one_event_a_step(merged):
    # a site outside the plan: from the second copy of a destination on, the compiled
    # path snapshots the source into the slot and makes one copy through the launcher
    # (the slot's pinned bytes, the destination's pitch); the flush records the slot's
    # event once, from C, after a carried launch or with nothing staged
    c, Site, dev, fake, problems = _landing_copier("inline", events=True)
    whole = dev.zeros((4, 8), np.int32)
    flat, view = dev.zeros((6,), np.int32), whole[:, 2:5]
    m = dev.zeros((4,), np.int32)
    src1, src2 = np.zeros(6, np.int32), np.zeros((4, 3), np.int32)
    steps = 2 * c._ring.slots
    for k in range(steps):
        copies, records = len(fake.copies), len(fake.records)
        with c.step():
            src1[:] = k
            c.copy(Site.P, flat, src1)
            src1[:] = -1  # refilled at once: the snapshot holds the call's bytes
            src2[:] = 10 + k
            c.copy(Site.P, view, src2)
            src2[:] = -1
            if merged:
                c.copy(Site.A, m, np.full(4, k, np.int32))
        assert dev.to_host(flat).tolist() == [k] * 6
        assert dev.to_host(whole)[:, 2:5].tolist() == [[10 + k] * 3] * 4
        if merged:
            assert dev.to_host(m).tolist() == [k] * 4
        if k:
            assert len(fake.copies) == copies + 2
            assert len(fake.records) == records + 1  # one event a step
    assert problems == []
    one, two = fake.copies[-2:]
    assert one[1:] == (24, one[2], 24, 24, 1, 77)  # 6 int32: one row
    assert two[0] == whole.ptr + 8 and two[1] == 32 and two[3:] == (12, 12, 4, 77)
    slot = c._slot
    assert slot.pinned.ptr <= two[2] < slot.pinned.ptr + slot.size  # from the slot's bytes
    assert c.stats.sites[Site.P].eager == 2 * steps
    c.close()


@needs_both
def test_a_failed_driver_copy_is_made_through_the_backend():
    # the launcher's copy answering an error (or copying nothing): the backend's copy2d
    # makes the copy (and reports its own error, were it to fail too)
    c, Site, dev, fake, problems = _landing_copier("inline", events=True)
    a = dev.zeros((8,), np.int32)
    fake.copy_result = 700
    for k in range(3):
        with c.step():
            c.copy(Site.P, a, np.full(8, k, np.int32))
        assert dev.to_host(a).tolist() == [k] * 8
    assert c.stats.sites[Site.P].eager == 3 and problems == []
    c.close()


@needs_both
@pytest.mark.parametrize("merged", [False, True])
def test_the_compiled_flush_leaves_a_sim_guards_event_to_the_python_flush(merged):
    # a copy read in place through a HostGuard owes the guard's event at the step's
    # flush: the guard's event here is the simulator's (an object, not a raw handle), so
    # the compiled flush (which would otherwise record the slot's event and the guard's
    # itself, with nothing staged or after a carried launch) declines, and flush()'s
    # Python body records it, so the owner's write() waits for exactly that copy
    import cucopy as cc

    c, Site, dev, fake, problems = _landing_copier("inline", events=True)
    buf = dev.pinned_empty((64,), np.int32)
    guard = cc.HostGuard(buf, label="mask")
    a, m = dev.zeros((64,), np.int32), dev.zeros((4,), np.int32)
    for k in range(2 * c._ring.slots):
        with guard.write():
            buf[:] = k
        with c.step():
            c.copy(Site.P, a, buf, guard=guard)
            if merged:
                c.copy(Site.A, m, np.full(4, k, np.int32))
            assert c._guarded is True and len(c._guards_owed) == 1
        assert c._guarded is False and c._guards_owed == []  # recorded at the flush
        assert dev.to_host(a).tolist() == [k] * 64
    assert problems == [] and c._fast_fenced == 0
    guard.close()
    c.close()


def _raw_guard_events(c, dev, fake) -> list:
    """HostGuard uses made for landing copier ``c`` from here on get raw event handles,
    as the CUDA backend's (``event_create`` answers ints the fake driver and the backend
    translate to sim events; ``_attach_landing(events=True)``), and ``_use_raw`` gives a
    use the copier's handle (77) as its stream; the copier's capture query is the
    launcher's (asked from C), and the backend's ``is_capturing`` answers for the
    copier's stream (77, or the sim stream it stands for) as the fake driver does
    (``status``). Returns the events the backend's ``event_wait`` was called with (what
    a ``write()`` waited on)."""
    be = c._backend
    sim_create = be.event_create
    handles = iter(range(0xF000, 0xF100))

    def create():
        h = next(handles)
        fake.by_handle[h] = sim_create()
        return h

    record, capturing, wait = be.event_record, be.is_capturing, be.event_wait
    waited: list = []

    def event_wait(ev, *a):
        waited.append(ev)
        return wait(ev, *a)

    be.event_create = create
    be.event_record = lambda ev, st: record(ev, dev.default_stream if st == 77 else st)
    be.is_capturing = lambda st: bool(fake.status) if st == 77 or st is c._stream else capturing(st)
    c._cap_query, c._cap_arg = c._test_driver.is_capturing, c._handle
    be.event_wait = event_wait
    return waited


def _use_raw(guard, c):
    use = guard._by_copier[c]
    use.stream = 77  # the copier's handle, as a CUDA copier's use has it
    return use


def _python_flush_refused(monkeypatch) -> list:
    """Make DeviceCopier._flush_rest (flush()'s Python body) raise; returns its calls."""
    import cucopy as cc

    calls: list = []

    def refuse(self, done):
        calls.append(done)
        raise AssertionError("the flush ran its Python body")

    monkeypatch.setattr(cc.DeviceCopier, "_flush_rest", refuse)
    return calls


@needs_both
@pytest.mark.skipif(
    not _compiled_copier_core_now(), reason="the compiled staging core is not in use"
)
@pytest.mark.parametrize("mode", ["inline", "mapped"])
@pytest.mark.parametrize("merged", [False, True])
def test_the_compiled_flush_records_a_guards_raw_event_once_a_step(monkeypatch, mode, merged):
    # with the guard's event a raw handle on the copier's stream (as the CUDA backend's),
    # a guarded step's flush runs no Python body: the launch (merged copies) or nothing
    # staged (flush_dirty), the slot's event, then the guard's, recorded once a step
    # through the launcher; write() then waits on exactly that event
    import cucopy as cc

    c, Site, dev, fake, problems = _landing_copier(mode, events=True)
    c._mapped_max = 1 << 20  # (the sim's threshold is 4 KiB)
    waited = _raw_guard_events(c, dev, fake)
    buf = dev.pinned_empty((64,), np.int32)
    guard = cc.HostGuard(buf, label="mask")
    a, m = dev.zeros((64,), np.int32), dev.zeros((4,), np.int32)
    with c.step():  # Python: the use made (pinned verified), the destination cached
        c.copy(Site.P, a, buf, guard=guard)
    use = _use_raw(guard, c)
    assert 0xF000 <= use.event < 0xF100 and use.ticket == 1
    python = _python_flush_refused(monkeypatch)
    fenced, flushes = c._fast_fenced, c._fast_flushes
    steps = 2 * c._ring.slots
    for k in range(steps):
        with guard.write():
            buf[:] = k
        assert waited[-1] == use.event  # the write waited on the guard's own event
        records = len(fake.records)
        with c.step():
            c.copy(Site.P, a, buf, guard=guard)
            if merged:
                c.copy(Site.A, m, np.full(4, k, np.int32))
            assert use.owed and c._guarded and len(c._guards_owed) == 1
        assert not use.owed and use.recorded and use.ticket == k + 2
        assert c._guarded is False and c._guards_owed == []
        new = fake.records[records:]
        # the slot's event, then the guard's (on the copier's stream), once each
        assert [e for e, _ in new][-1] == use.event and len(new) == 2
        assert new[0][0] in range(0xE000, 0xE000 + c._ring.slots) and {s for _, s in new} == {77}
        assert guard.in_flight
        guard.wait()
        assert dev.to_host(a).tolist() == [k] * 64
        if merged:
            assert dev.to_host(m).tolist() == [k] * 4
    assert python == [] and problems == []
    assert c._fast_fenced - fenced == steps
    assert c._fast_flushes - flushes == (steps if merged else 0)
    assert [e for e, _ in fake.records].count(use.event) == steps  # (the first: Python's)
    monkeypatch.undo()
    guard.close()
    c.close()


@needs_both
@pytest.mark.skipif(
    not _compiled_copier_core_now(), reason="the compiled staging core is not in use"
)
def test_what_the_compiled_flush_leaves_to_python_for_raw_guard_events(monkeypatch):
    # check mode (and the flush after it, whose guards to verify are Python's), a
    # capture begun in the step (the event stays owed, recorded by the next flush from
    # C), and a record the driver fails (left owed: the Python body records it, or
    # reports its error) go to flush()'s Python body, which does what it always did
    import cucopy as cc
    from cucopy import check

    c, Site, dev, fake, problems = _landing_copier("inline", events=True)
    _raw_guard_events(c, dev, fake)
    buf = dev.pinned_empty((64,), np.int32)
    guard = cc.HostGuard(buf, label="mask")
    a, m = dev.zeros((64,), np.int32), dev.zeros((4,), np.int32)
    with c.step():
        c.copy(Site.P, a, buf, guard=guard)
    use = _use_raw(guard, c)
    body = cc.DeviceCopier._flush_rest
    python: list = []
    monkeypatch.setattr(
        cc.DeviceCopier, "_flush_rest", lambda self, done: python.append(done) or body(self, done)
    )

    def step(k, merged=True):
        with guard.write():
            buf[:] = k
        with c.step():
            c.copy(Site.P, a, buf, guard=guard)
            if merged:
                c.copy(Site.A, m, np.full(4, k, np.int32))

    def guard_records():
        return [e for e, _ in fake.records].count(use.event)

    # check mode: the whole step is Python's; then its watched guard once more
    monkeypatch.setattr(check, "CHECK_MODE", True)
    step(1)
    assert c._watching and python and c._fast_fenced == 0 and use.ticket == 2
    monkeypatch.setattr(check, "CHECK_MODE", False)
    del python[:]
    step(2)
    assert python == [False] and not c._watching and c._fast_fenced == 0
    assert use.ticket == 3 and guard_records() == 0  # (Python's records: the backend's)
    del python[:]
    step(3)
    assert python == [] and c._fast_fenced == 1 and use.ticket == 4 and guard_records() == 1
    # a capture begun in the step: nothing recorded, the event stays owed ...
    with guard.write():
        buf[:] = 4
    with c.step():
        c.copy(Site.P, a, buf, guard=guard)
        fake.status = 1
    assert python == [False] and use.owed and c._guarded and use.ticket == 4
    fake.status = 0
    del python[:]
    c.flush()  # ... and the next flush records it, from C
    assert python == [] and not use.owed and use.ticket == 5 and guard_records() == 2
    assert c._fast_fenced == 2 and c._guards_owed == [] and not c._guarded
    # the driver fails the guard's record: left owed, the Python body records it
    fake.fail_records.add(use.event)
    step(6)
    assert python == [False] and not use.owed and use.ticket == 6 and c._fast_fenced == 2
    assert guard_records() == 3  # the failed one
    guard.wait()
    assert dev.to_host(a).tolist() == [6] * 64 and dev.to_host(m).tolist() == [6] * 4
    # ... or reports the error the backend's record raises
    record = c._backend.event_record

    def failing(ev, st):
        if ev == use.event:
            raise CopyError("cuEventRecord failed (999)")
        return record(ev, st)

    monkeypatch.setattr(c._backend, "event_record", failing)
    with pytest.raises(CopyError, match=r"cuEventRecord failed"):
        step(7)
    assert use.owed and c._guards_owed == [(guard, use)] and c._guarded
    fake.fail_records.clear()
    monkeypatch.setattr(c._backend, "event_record", record)
    del python[:]
    step(8)  # the write records it (Python's, at the fence), the flush the step's (C)
    assert python == [] and not use.owed and use.ticket == 8 and c._fast_fenced == 3
    guard.wait()
    assert dev.to_host(a).tolist() == [8] * 64
    assert problems == []
    monkeypatch.undo()
    guard.close()
    c.close()


class _LandingEnv:
    """tests/conftest.py's SimEnv whose copiers get a fake launcher that lands what it is
    handed (_attach_landing: graphs, events as raw handles), with completion tags on or
    off: the property programs of tests/test_properties_env.py run through the compiled
    flush's graphed and tagged launches, as on a GPU."""

    def __init__(self, policy: str, tags: bool):
        from conftest import SimEnv

        self._env = SimEnv(policy, seed=1234)
        self._env.dev.graph_capacity = pack.GRAPH_CAPACITY  # (the GPU's; the slots' size)
        self.tags = tags
        self.copiers: list = []

    def __getattr__(self, name):
        return getattr(self._env, name)

    def copier(self, plan=None, **kw):
        from cucopy import copier as copier_mod

        copier_mod.TAGS, saved = self.tags, copier_mod.TAGS
        try:
            c = self._env.copier(plan, **kw)
        finally:
            copier_mod.TAGS = saved
        fake, problems = _attach_landing(c, self._env.dev, events=True, graphs=True)
        self.copiers.append((c, fake, problems))
        return c


@needs_ext
@pytest.mark.parametrize("policy", ["lazy", "eager"])
@pytest.mark.parametrize("seed,mode", [(2, "mapped"), (1, "auto")])
def test_held_programs_wait_no_more_with_tags_than_with_events(policy, seed, mode):
    # tests/test_properties_env.py's program (a stream held for at most SLOTS - 1 steps
    # at a time) through the compiled flush's graphed launches, tags on and off: with
    # tags the host waits for no slot behind a hold (the sim raises SimDeadlock on any
    # wait for held work) and no more often than with events, the tagged launches write
    # their tags (close() waits for them), and both land the same segments the same
    # ways
    import test_properties_env as programs

    from cucopy import copier as copier_mod

    compiled = copier_mod._CopierCore is not copier_mod.PyCopierCore
    seen = {}
    for tags in (False, True):
        env = _LandingEnv(policy, tags)
        stats = programs._run(env, seed, 60, mode)
        ((c, fake, problems),) = env.copiers
        assert problems == []
        cells = [n["cell"] for n, _ in fake.graph_launches]
        if compiled:
            assert fake.graph_launches  # the staging core launched graphed segments
            assert any(cells) == tags  # and tagged the steps' first readers (tags on)
        seen[tags] = (stats.host_waits, stats.segments, dict(stats.modes))
    assert seen[True] == seen[False]


@needs_both
@pytest.mark.skipif(
    not _compiled_copier_core_now(), reason="the compiled staging core is not in use"
)
def test_compiled_guarded_copies_take_one_driver_copy_from_the_buffer_itself(monkeypatch):
    # past the first (Python: pinned verified, the destination cached), a guarded copy is
    # one copy through the launcher from the guard's buffer (no snapshot in the slot),
    # with the destination's pitch and the view's; flush()'s body records the guard's
    # event once a step
    import cucopy as cc

    c, Site, dev, fake, problems = _landing_copier("inline", events=True)
    buf = dev.pinned_empty((6, 16), np.int32)
    guard = cc.HostGuard(buf, label="mask")
    table = dev.zeros((8, 12), np.int32)
    flat = dev.zeros((2, 12), np.int32)
    python = []
    body = cc.DeviceCopier._copy_guarded
    monkeypatch.setattr(
        cc.DeviceCopier,
        "_copy_guarded",
        lambda self, site, *a: python.append(site) or body(self, site, *a),
    )
    for k in range(2 * c._ring.slots):
        with guard.write():
            buf[...] = np.arange(96, dtype=np.int32).reshape(6, 16) + k
        copies = len(fake.copies)
        with c.step():
            c.copy(Site.A, table[:5, 2:9], buf[:5, 3:10], guard=guard)  # merged: in place
            c.copy(Site.P, flat, buf[1:3, 4:], guard=guard)  # rows into a packed dst
        guard.wait()
        assert dev.to_host(table)[:5, 2:9].tolist() == buf[:5, 3:10].tolist()
        assert dev.to_host(flat).tolist() == buf[1:3, 4:].tolist()
        if k:
            assert len(fake.copies) == copies + 2
        assert guard._by_copier[c].ticket == k + 1  # the guard's event, once a step
    assert python == [Site.A, Site.P] and c._fast_guarded == 2 * (2 * c._ring.slots - 1)
    one, two = fake.copies[-2:]
    assert one == (table.ptr + 8, 48, buf.ctypes.data + 12, 64, 28, 5, 77)
    assert two == (flat.ptr, 48, buf.ctypes.data + 64 + 16, 64, 48, 2, 77)
    st = c.stats.sites
    assert st[Site.A].eager == st[Site.A].fallback["in_place"] == 2 * c._ring.slots
    assert problems == []
    guard.close()
    c.close()
