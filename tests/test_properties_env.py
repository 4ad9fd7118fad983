"""Seeded random programs against a NumPy model, on the sim device and on a GPU.

The GPU half of the reliability suite (smaller than ``test_properties.py``, which
uses the simulated device's in-stream checks): random H2D, D2D and FILL copies into
overlapping views of two device arrays through merged, barrier and plain sites,
host sources overwritten right after each call, exceptions inside ``step()`` (the
copies that were dropped are exactly those whose ``on_drop`` ran, and nothing else
is lost), and steps enqueued behind a stalled stream. The same body runs on
``sim`` in CI and on ``cuda`` with the ``gpu`` marker.
"""

from __future__ import annotations

import numpy as np
import pytest

import cucopy as cc


class Site(cc.CopySite):
    MERGED = cc.H2D
    BARRIER = cc.H2D
    PLAIN = cc.H2D
    GATHER = cc.D2D
    GATHER_PLAIN = cc.D2D
    PAD = cc.FILL


PLAN = cc.CopyPlan(
    merge={Site.MERGED, Site.BARRIER, Site.GATHER, Site.PAD}, flush_after={Site.BARRIER}
)
N = 512
SLOTS = 3


class Boom(Exception):
    """Raised inside a step on purpose."""


def _view(rng, arr, model):
    """A random contiguous or row-strided view of ``arr`` and the same view of ``model``."""
    if rng.random() < 0.7:
        lo = int(rng.integers(0, N - 1))
        hi = int(rng.integers(lo + 1, min(N, lo + 96) + 1))
        return arr[lo:hi], model[lo:hi]
    rows = int(rng.integers(1, 9))
    width = int(rng.integers(1, 9))
    pitch = int(rng.integers(width, 17))
    start = int(rng.integers(0, N - rows * pitch + 1))
    a2 = arr[start : start + rows * pitch].reshape(rows, pitch)[:, :width]
    m2 = model[start : start + rows * pitch].reshape(rows, pitch)[:, :width]
    return a2, m2


def _run(env, seed, steps, flush_mode="auto"):
    rng = np.random.default_rng(seed)
    c = env.copier(PLAN, slots=SLOTS, capacity=8192, flush_mode=flush_mode)
    arrs = [env.empty((N,)), env.empty((N,))]
    model = [np.zeros(N, np.int32), np.zeros(N, np.int32)]
    host = env.pinned((N,))
    h2d_sites = (Site.MERGED, Site.BARRIER, Site.PLAIN)
    stream = env.default_stream
    held = 0
    hold = None
    for step in range(steps):
        if hold is None and rng.random() < 0.15:
            hold = env.hold(stream)
            hold.__enter__()
            held = 0
        ops = []  # (index, apply-to-model)
        dropped = set()
        fail_at = int(rng.integers(0, 10)) if rng.random() < 0.2 else -1
        try:
            with c.step():
                for i in range(int(rng.integers(1, 10))):
                    if i == fail_at:
                        raise Boom()
                    k = int(rng.integers(0, 2))
                    dst, mdst = _view(rng, arrs[k], model[k])
                    op = int(rng.integers(0, 3))
                    on_drop = lambda i=i, d=dropped: d.add(i)  # noqa: E731
                    if op == 0:
                        vals = rng.integers(-1000, 1000, mdst.size).astype(np.int32)
                        src = host[: mdst.size].reshape(mdst.shape)
                        src[...] = vals.reshape(mdst.shape)
                        c.copy(h2d_sites[int(rng.integers(0, 3))], dst, src, on_drop=on_drop)
                        host[...] = -7  # the host refills its buffer at once
                        ops.append(
                            (i, lambda m=mdst, v=vals: m.__setitem__(..., v.reshape(m.shape)))
                        )
                    elif op == 1:
                        j = 1 - k
                        n = mdst.size
                        lo = int(rng.integers(0, N - n + 1))
                        src, msrc = arrs[j][lo : lo + n], model[j][lo : lo + n]
                        site = Site.GATHER if rng.random() < 0.7 else Site.GATHER_PLAIN
                        c.copy(site, dst, src.reshape(mdst.shape), on_drop=on_drop)

                        def apply(m=mdst, s=msrc):
                            m[...] = s.reshape(m.shape).copy()

                        ops.append((i, apply))
                    else:
                        start = int(rng.integers(0, mdst.size))
                        v = int(rng.integers(-5, 5))
                        c.fill_tail(Site.PAD, dst, start, v, on_drop=on_drop)

                        def fill(m=mdst, s=start, v=v):
                            flat = m.reshape(-1).copy()
                            flat[s:] = v
                            m[...] = flat.reshape(m.shape)

                        ops.append((i, fill))
        except Boom:
            pass
        for i, apply in ops:
            if i not in dropped:
                apply()
        if hold is not None:
            held += 1
            if held >= SLOTS - 1 or step == steps - 1:
                hold.__exit__(None, None, None)
                hold = None
        if hold is None:
            for k in range(2):
                assert env.to_host(arrs[k]).tolist() == model[k].tolist(), (seed, step, k)
    c.close()
    return c.stats


@pytest.mark.parametrize("seed,flush_mode", [(1, "auto"), (2, "mapped"), (3, "dma"), (6, "inline")])
def test_random_programs_match_the_model(env, seed, flush_mode):
    stats = _run(env, seed, 60, flush_mode)
    assert stats.segments > 0
    assert stats.host_waits <= 60  # the ring waits only for a slot still in flight


@pytest.mark.parametrize("seed", [4, 5])
def test_random_programs_under_every_policy(sim_env, seed):
    _run(sim_env, seed, 60)
