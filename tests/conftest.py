"""Shared fixtures: the same test bodies run on the simulated device and, with a GPU, on CUDA."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

import cucopy as cc
from cucopy import check
from cucopy.backends.sim import SimDevice


def _gpu() -> bool:
    if os.environ.get("CUCOPY_NO_GPU"):
        return False
    try:
        from cucopy.backends.cuda import gpu_available
    except Exception:
        return False
    return gpu_available()


HAVE_GPU = _gpu()


def pytest_collection_modifyitems(config, items):
    if HAVE_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class SimEnv:
    """Test-facing helpers on a :class:`SimDevice`."""

    name = "sim"

    def __init__(self, policy="lazy", seed=0):
        self.dev = SimDevice(policy=policy, seed=seed)
        self.device = self.dev

    @property
    def default_stream(self):
        return self.dev.default_stream

    def copier(self, plan=None, **kw):
        kw.setdefault("stream", self.dev.default_stream)
        return cc.DeviceCopier(plan, device=self.dev, backend="sim", **kw)

    def stream(self):
        return self.dev.stream()

    def empty(self, shape, dtype=np.int32):
        return self.dev.empty(shape, dtype)

    def asarray(self, host):
        return self.dev.asarray(np.asarray(host))

    def to_host(self, arr):
        return self.dev.to_host(arr)

    def pinned(self, shape, dtype=np.int32):
        return self.dev.pinned_empty(shape, dtype)

    def hold(self, stream):
        return stream.hold()

    def write(self, stream, arr, value):
        """Foreign work: write ``value`` into ``arr`` in stream order."""
        dev = self.dev
        stream.launch(lambda: dev.raw(arr).__setitem__(Ellipsis, value))

    def read_later(self, stream, arr):
        """Foreign work reading ``arr`` in stream order; returns a getter for what it saw."""
        dev, box = self.dev, []
        stream.launch(lambda: box.append(dev.raw(arr).copy()))
        return lambda: (dev.synchronize(), box[0])[1]

    def capture(self, stream):
        return self.dev.capture(stream)

    def synchronize(self):
        self.dev.synchronize()


class CudaEnv:
    """The same helpers with CuPy on a real GPU."""

    name = "cuda"

    def __init__(self, policy=None, seed=0):
        import cupy
        import cupyx

        from cucopy.backends.cuda import CudaBackend

        self.cp = cupy
        self.cpx = cupyx
        self.device = 0
        self.backend = CudaBackend(0)
        self._default = cupy.cuda.Stream(non_blocking=True)

    def copier(self, plan=None, **kw):
        kw.setdefault("stream", self._default)
        return cc.DeviceCopier(plan, device=0, backend="cuda", **kw)

    def stream(self):
        return self.cp.cuda.Stream(non_blocking=True)

    @property
    def default_stream(self):
        return self._default

    def empty(self, shape, dtype=np.int32):
        # zeroed on CuPy's current stream, which the copier's non-blocking streams do not
        # wait for: wait here, or a large memset (8 GiB: milliseconds) lands after copies
        # made right away. Only that stream: another may be held.
        a = self.cp.zeros(shape, dtype)
        self.cp.cuda.get_current_stream().synchronize()
        return a

    def asarray(self, host):
        return self.cp.asarray(np.asarray(host))

    def to_host(self, arr):
        self.cp.cuda.Device(0).synchronize()
        return self.cp.asnumpy(arr)

    def pinned(self, shape, dtype=np.int32):
        return self.cpx.zeros_pinned(shape, dtype)

    def hold(self, stream):
        return self.backend.hold(stream.ptr)

    def write(self, stream, arr, value):
        with stream:
            arr[...] = self.cp.asarray(value) if isinstance(value, np.ndarray) else value

    def read_later(self, stream, arr):
        with stream:
            out = arr.copy()
        return lambda: self.to_host(out)

    @contextlib.contextmanager
    def capture(self, stream):
        stream.begin_capture()
        box = _GraphBox()
        try:
            yield box
        finally:
            box.graph = stream.end_capture()

    def synchronize(self):
        self.cp.cuda.Device(0).synchronize()


class _GraphBox:
    graph = None

    def replay(self, stream):
        self.graph.launch(stream)


@pytest.fixture(params=["sim", pytest.param("cuda", marks=pytest.mark.gpu)])
def env(request):
    """A device to test on: the simulated device (lazy policy) or the GPU."""
    if request.param == "sim":
        return SimEnv("lazy")
    return CudaEnv()


@pytest.fixture(params=["lazy", "eager", "random"])
def sim_env(request):
    """The simulated device under each stream policy."""
    return SimEnv(request.param, seed=1234)


@pytest.fixture
def check_mode(monkeypatch):
    """Turn check mode on for one test."""
    monkeypatch.setattr(check, "CHECK_MODE", True)
    return True
