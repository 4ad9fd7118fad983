"""The CUDA backend's per-step driver calls made from C (``cucopy.backends._cudacall``).

No GPU here: ctypes callbacks stand in for ``cuLaunchKernel`` and
``cuStreamIsCapturing``, so the tests see exactly what the driver would be handed
(kernel, grid, stream, the parameter buffer's bytes and size). On a GPU the same
calls run for real in every CUDA test (tests/test_backend_cuda.py and the rest).
"""

from __future__ import annotations

import ctypes
import os
import struct

import numpy as np
import pytest

from cucopy import pack

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


class FakeDriver:
    """Records launches; answers capture queries from ``status`` / ``result``."""

    def __init__(self):
        self.launches = []
        self.result = 0  # CUresult the next calls return
        self.status = 0
        self._launch = _LAUNCH(self.launch)
        self._capturing = _CAPTURING(self.capturing)
        addr = ctypes.c_void_p
        self.addrs = (
            ctypes.cast(self._launch, addr).value,
            ctypes.cast(self._capturing, addr).value,
        )

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
        self.launches.append(rec)
        return self.result

    def capturing(self, stream, out):
        out[0] = self.status
        return self.result


CAPS = [(1008, 0x1000), (2032, 0x2000), (4080, 0x4000), (32736, 0x8000)]


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
