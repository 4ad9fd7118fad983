"""The eager path's compiled common case (``_core/copier.c``, ``core_eager``).

A site outside the plan copies eagerly: its source's bytes are snapshotted into the
ring slot at the call, then one driver copy. With the compiled core, a copy of a cached
destination (any copy after the first) from a NumPy array or a cached source is issued
with no Python frame; everything else (the first copy, check mode, a capture, an overlap
with staged copies) is the Python path's. These tests hold both paths to one contract,
on the simulated device and, with a GPU, on CUDA.
"""

import numpy as np
import pytest

import cucopy as cc
from cucopy import copier as copier_mod


class Site(cc.CopySite):
    POS = cc.H2D
    PLAIN = cc.H2D
    OTHER = cc.H2D


PLAN = cc.CopyPlan(merge={Site.POS})
COMPILED = copier_mod._COMPILED


@pytest.fixture
def general_calls(monkeypatch):
    """Counts the copies that reached the Python path (``_copy_general``)."""
    calls = []
    real = cc.DeviceCopier._copy_general

    def counted(self, site, *a):
        calls.append(site)
        return real(self, site, *a)

    monkeypatch.setattr(cc.DeviceCopier, "_copy_general", counted)
    return calls


def _sources(env):
    """(name, make(k)) pairs: the source layouts the compiled eager path reads."""
    table = np.zeros((3, 8), np.int32)
    out = [
        ("numpy", lambda k: np.full(12, k, np.int32)),
        ("numpy_2d", lambda k: np.full((3, 4), k, np.int32)),
        ("numpy_rows", lambda k: _fill(table, k)[:, :4]),  # rows apart: gathered
    ]
    pinned = env.pinned((12,))
    out.append(("pinned", lambda k: _fill(pinned, k)))
    try:
        import torch
    except ImportError:
        return out
    t = torch.zeros(12, dtype=torch.int32)
    out.append(("torch", lambda k: _fill(t, k)))
    return out


def _fill(a, k):
    a[...] = k
    return a


@pytest.mark.parametrize("dst_kind", ["flat", "table"])
def test_repeated_plain_copies_take_the_bytes_of_the_call(env, general_calls, dst_kind):
    """Steps on a stalled stream, each source refilled right after its copy: the bytes of
    the call land, on the compiled path from the second copy of a destination on."""
    c = env.copier(PLAN)
    stream = env.default_stream
    for name, make in _sources(env):
        whole = env.empty((3, 6))
        dst = whole.reshape(-1)[:12] if dst_kind == "flat" else whole[:, 1:5]
        # a flat source fills any destination; a 2-D one only its own shape
        if dst_kind == "flat" and name.startswith("numpy_") and name != "numpy":
            continue
        general_calls.clear()
        for k in range(1, 4):
            with env.hold(stream):
                with c.step():
                    src = make(k)
                    assert c.copy(Site.PLAIN, dst, src) is True
                    src[...] = -1  # refilled while the copy is still queued
            got = env.to_host(whole)
            part = got.reshape(-1)[:12] if dst_kind == "flat" else got[:, 1:5]
            assert part.tolist() == np.full(part.shape, k).tolist(), (name, k)
        if COMPILED:
            # the first copy caches the destination (and a torch source); the rest
            # are the compiled path's
            assert len(general_calls) == 1, (name, general_calls)
        assert c.stats.sites[Site.PLAIN].eager >= 3
    c.close()


def test_plain_and_merged_copies_of_the_same_bytes_keep_program_order(env):
    """A plain copy over bytes staged by a merged copy lands after it, and a merged copy
    staged over a plain copy's bytes lands after that one: in call order either way."""
    c = env.copier(PLAN)
    a = env.empty((8,))
    for _ in range(2):  # the second round: a cached destination (the compiled path)
        with c.step():
            c.copy(Site.POS, a, np.full(8, 1, np.int32))  # staged
            c.copy(Site.PLAIN, a, np.full(8, 2, np.int32))  # lands the staged copy first
        assert env.to_host(a).tolist() == [2] * 8
        with c.step():
            c.copy(Site.PLAIN, a, np.full(8, 3, np.int32))  # issued now
            c.copy(Site.POS, a, np.full(8, 4, np.int32))  # staged, lands at the flush
        assert env.to_host(a).tolist() == [4] * 8
    assert c.stats.sites[Site.PLAIN].eager == 4
    c.close()


def test_plain_copies_are_counted_once_each(env):
    """The compiled path counts its copies apart; stats.sites folds them in."""
    c = env.copier(None)
    dsts = [env.empty((4,)) for _ in range(3)]
    for step in range(5):
        with c.step():
            for i, d in enumerate(dsts):
                c.copy(Site.PLAIN if i else Site.OTHER, d, np.full(4, step, np.int32))
    st = c.stats
    assert st.sites[Site.PLAIN].eager == 10 and st.sites[Site.OTHER].eager == 5
    assert st.sites[Site.PLAIN].merged == 0 and not st.sites[Site.PLAIN].fallback
    assert st.as_dict()["sites"]["Site.PLAIN"]["eager"] == 10
    st.reset()
    with c.step():
        c.copy(Site.PLAIN, dsts[1], np.zeros(4, np.int32))
    assert c.stats.sites[Site.PLAIN].eager == 1  # counts pending at reset() are dropped
    assert [env.to_host(d).tolist() for d in dsts] == [[4] * 4, [0] * 4, [4] * 4]
    c.close()


def test_a_capture_begun_mid_step_refuses_a_cached_plain_copy(env):
    """The compiled path asks the capture state before each copy: a capture begun after
    begin() is refused as the Python path refuses it, nothing issued."""
    stream = env.stream()
    c = env.copier(PLAN, stream=stream)
    b = env.empty((4,))
    src = env.pinned((4,))
    with c.step():
        c.copy(Site.PLAIN, b, np.full(4, 1, np.int32))  # caches b
    src[:] = 5
    c.begin()
    with env.capture(stream):
        with pytest.raises(cc.CopyError, match="a graph capture began on the copier's stream"):
            c.copy(Site.PLAIN, b, src)
    c.flush()
    assert env.to_host(b).tolist() == [1] * 4
    with c.step():
        c.copy(Site.PLAIN, b, src)
    assert env.to_host(b).tolist() == [5] * 4
    c.close()


def test_bad_plain_copies_of_a_cached_destination_name_the_site(env):
    """Mismatched sources are the Python path's to refuse, naming the site; the copier
    goes on."""
    c = env.copier(PLAN)
    a = env.empty((4,))
    with c.step():
        c.copy(Site.PLAIN, a, np.zeros(4, np.int32))  # caches a
        with pytest.raises(TypeError, match=r"Site\.PLAIN: dtype mismatch"):
            c.copy(Site.PLAIN, a, np.zeros(4, np.float32))
        with pytest.raises(ValueError, match=r"Site\.PLAIN: size mismatch"):
            c.copy(Site.PLAIN, a, np.zeros(5, np.int32))
        with pytest.raises(TypeError, match=r"Site\.PLAIN: on_drop must be callable"):
            c.copy(Site.PLAIN, a, np.zeros(4, np.int32), on_drop=3)
        c.copy(Site.PLAIN, a, np.full(4, 6, np.int32))
    assert env.to_host(a).tolist() == [6] * 4
    c.close()


def test_check_mode_takes_the_python_path(env, check_mode, general_calls):
    c = env.copier(PLAN)
    a = env.empty((4,))
    for k in range(3):
        with c.step():
            c.copy(Site.PLAIN, a, np.full(4, k, np.int32))
    assert len(general_calls) == 3
    assert env.to_host(a).tolist() == [2] * 4
    c.close()
