"""Mapped memory is proven before it is trusted: the one-time coherence probe."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import cucopy as cc
from cucopy import pack
from cucopy.backends.sim import SimBackend, SimDevice


class Site(cc.CopySite):
    A = cc.H2D
    B = cc.H2D


PLAN = cc.CopyPlan(merge={Site.A, Site.B})


@pytest.mark.parametrize("mode", ["auto", "mapped", "inline"])
def test_an_incoherent_mapping_falls_back_to_dma_and_says_so_once(mode, caplog):
    dev = SimDevice(mapped_coherent=False)
    dev.graph_capacity = pack.GRAPH_CAPACITY  # graphed launches read the mapping too
    a = dev.zeros((4,), np.int64)
    big = dev.zeros((4096,), np.int32)  # past what a launch carries: read mapped if allowed
    with caplog.at_level(logging.WARNING, logger="cucopy"):
        c = cc.DeviceCopier(PLAN, device=dev, flush_mode=mode)
        c2 = cc.DeviceCopier(PLAN, device=dev, flush_mode=mode)
    said = [r for r in caplog.records if "coherence probe" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert f"sim:{dev.index}" in said[0].getMessage() and "'dma'" in said[0].getMessage()
    assert c.flush_mode == c2.flush_mode == "dma"
    assert c._graph_cap == 0
    for step in range(3):
        with c.step():
            c.copy(Site.A, a, np.arange(4) + step)
            c.copy(Site.B, big, np.arange(4096, dtype=np.int32) + step)
    assert dev.to_host(a).tolist() == [2, 3, 4, 5]
    assert dev.to_host(big)[:3].tolist() == [2, 3, 4]
    assert {k for k, v in c.stats.modes.items() if v} == {"dma"}
    with pytest.raises(cc.CopyError, match="coherence probe"):
        with dev.capture(dev.default_stream):
            c.capture_inputs()
    c.close()
    c2.close()


def test_the_probe_would_have_caught_zeros_read_through_the_mapping():
    """What the fallback prevents: a mapped launch on such a device lands zeros."""
    dev = SimDevice(mapped_coherent=False)
    be = SimBackend(dev)
    assert be.coherence_probe() is False
    dev.mapped_coherent = True
    assert be.coherence_probe() is True


def test_a_coherent_device_keeps_its_mode_and_the_probe_leaves_no_trace():
    dev = SimDevice(policy="random", seed=5)
    before = (len(dev._pinned), len(dev._allocs), len(dev._streams), dev.device_reads)
    state = dev.rng.bit_generator.state
    c = cc.DeviceCopier(PLAN, device=dev, flush_mode="mapped")
    assert c.flush_mode == "mapped"
    assert dev._coherence is True  # probed once, for the device
    assert (len(dev._streams), dev.device_reads) == before[2:]
    assert dev.rng.bit_generator.state == state  # seeded shuffles unchanged
    assert dev.stream().name == "s1"  # the probe's stream is gone
    c.close()
    assert (len(dev._pinned), len(dev._allocs)) == before[:2]


def test_dma_copiers_do_not_probe():
    dev = SimDevice(mapped_coherent=False)
    c = cc.DeviceCopier(PLAN, device=dev, flush_mode="dma")
    assert dev._coherence is None
    c.close()


@pytest.mark.gpu
def test_the_cuda_coherence_probe_passes_on_an_ordinary_gpu():
    from cucopy.backends.cuda import CudaBackend

    be = CudaBackend(0)
    assert be.coherence_probe() is True
    assert be.mapped_coherent() is True
    c = cc.DeviceCopier(PLAN, device=0, backend="cuda", flush_mode="mapped")
    assert c.flush_mode == "mapped"
    c.close()
