"""How the CUDA backend builds its kernels, with CuPy's compile and load faked (no GPU needed).

A copier's first construction builds every entry point of ``scatter.cu`` as a module of its
own, on parallel threads; these tests pin which modules, on how many threads, and what a
failed build does. ``tests/test_backend_cuda.py`` runs the real build on a GPU.
"""

from __future__ import annotations

import re
import threading

import pytest

from cucopy import kernels, pack
from cucopy.backends import cuda as cb
from cucopy.errors import CopyError


class _Handle:
    def __init__(self, ptr):
        self.ptr = ptr


class _Kernel:
    def __init__(self, name):
        self.name = name
        self.kernel = _Handle(kernels.ENTRY_POINTS.index(name) + 1000)


class _Runtime:
    CUDARuntimeError = RuntimeError

    def __init__(self, driver):
        self.driver = driver
        self.devices = []

    def driverGetVersion(self):  # noqa: N802 (CUDA's name)
        return self.driver

    def setDevice(self, device):  # noqa: N802
        self.devices.append((threading.get_ident(), device))


@pytest.fixture
def fake(monkeypatch):
    """CuPy's runtime and ``_build`` replaced; records what each worker built."""
    rt = _Runtime(driver=13000)
    built = []
    fail = set()
    lock = threading.Lock()

    def build(source, names, what, device):
        (name,) = names
        mask = int(re.match(r"#define CUCOPY_ENTRIES (0x[0-9a-f]+)u\n", source).group(1), 16)
        with lock:
            built.append((name, mask, threading.get_ident(), device))
        if name in fail:
            raise CopyError(f"cuda:{device}: compiling {what} failed: (fake)")
        return [_Kernel(name)]

    monkeypatch.setattr(cb, "_rt", rt)
    monkeypatch.setattr(cb, "_RuntimeError", RuntimeError)
    monkeypatch.setattr(cb, "_build", build)
    cb._kernels.cache_clear()
    yield rt, built, fail
    cb._kernels.cache_clear()


def test_each_entry_point_is_its_own_module(fake):
    rt, built, _ = fake
    k = cb._kernels(1)
    names = [name for name, *_ in built]
    assert sorted(names) == sorted(kernels.ENTRY_POINTS)
    for name, mask, _, device in built:
        assert mask == 1 << kernels.ENTRY_POINTS.index(name)  # exactly that entry point
        assert device == 1
    assert k.caps == pack.CARRY_CAPACITIES
    assert k.scatter == _Kernel("cucopy_scatter").kernel.ptr
    assert k.fill == _Kernel("cucopy_fill").kernel.ptr
    assert k.feed == _Kernel(pack.FEED_ENTRY_POINT).kernel.ptr
    assert k.whole == _Kernel(pack.GRAPH_ENTRY_POINT).kernel.ptr
    for cap, name in zip(pack.CARRY_CAPACITIES, pack.CARRY_ENTRY_POINTS):
        assert k.carried[cap] == _Kernel(name).kernel.ptr
    # every worker bound the device before building on it
    workers = {t for _, _, t, _ in built}
    assert workers <= {t for t, d in rt.devices if d == 1}


def test_builds_run_on_parallel_threads(fake, monkeypatch):
    _, built, _ = fake
    monkeypatch.setattr(cb, "_workers", lambda jobs: 4)
    started = threading.Barrier(4, timeout=30)  # the first four builds must run at once
    build = cb._build
    count = iter(range(10**6))

    def concurrent(source, names, what, device):
        if next(count) < 4:
            started.wait()
        return build(source, names, what, device)

    monkeypatch.setattr(cb, "_build", concurrent)
    cb._kernels(0)
    assert len({t for _, _, t, _ in built}) == 4
    assert threading.get_ident() not in {t for _, _, t, _ in built}


def test_build_threads_follow_the_cpus_and_the_cap(monkeypatch):
    monkeypatch.delenv("CUCOPY_BUILD_THREADS", raising=False)
    monkeypatch.setattr(cb.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert cb._workers(19) == 16
    assert cb._workers(3) == 3
    monkeypatch.setenv("CUCOPY_BUILD_THREADS", "1")
    assert cb._workers(19) == 1
    monkeypatch.setenv("CUCOPY_BUILD_THREADS", "0")
    assert cb._workers(19) == 1
    monkeypatch.setenv("CUCOPY_BUILD_THREADS", "many")
    with pytest.raises(ValueError, match="CUCOPY_BUILD_THREADS: expected an int, got 'many'"):
        cb._workers(19)


def test_an_old_driver_gets_the_small_carried_kernels_only(fake):
    rt, built, _ = fake
    rt.driver = 12000
    k = cb._kernels(0)
    small = tuple(c for c in pack.CARRY_CAPACITIES if c <= cb._SMALL_PARAMS_MAX)
    assert k.caps == small
    # scatter, fill, the graph feed, the graphed kernel and the small carried ones
    assert len(built) == 4 + len(small)


def test_a_feed_kernel_that_fails_leaves_the_copier_working(fake):
    _, _, fail = fake
    fail.add(pack.FEED_ENTRY_POINT)  # only capture_inputs() needs it
    k = cb._kernels(0)
    assert k.feed == 0 and k.caps == pack.CARRY_CAPACITIES


def test_a_graphed_kernel_that_fails_leaves_the_copier_working(fake):
    _, _, fail = fake
    fail.add(pack.GRAPH_ENTRY_POINT)  # graphed launches are an option: none are made
    k = cb._kernels(0)
    assert k.whole == 0 and k.caps == pack.CARRY_CAPACITIES


def test_a_large_carried_kernel_that_fails_leaves_the_small_ones(fake):
    _, _, fail = fake
    fail.add("cucopy_scatter_c20k")  # e.g. an NVRTC older than 12.1 lacks it
    k = cb._kernels(0)
    assert k.caps == tuple(c for c in pack.CARRY_CAPACITIES if c <= cb._SMALL_PARAMS_MAX)


@pytest.mark.parametrize("name", ["cucopy_scatter", "cucopy_fill", "cucopy_scatter_c2k"])
def test_a_needed_kernel_that_fails_raises_its_error(fake, name):
    _, _, fail = fake
    fail.add(name)
    with pytest.raises(CopyError, match=rf"\({name}\)"):
        cb._kernels(0)
