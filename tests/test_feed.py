"""Graph feeds: a step's merged copies landed by a scatter node inside the engine's graph.

The same bodies run on the simulated device and, marked ``gpu``, on CUDA (CuPy graphs).
A graph under test holds the feed's node and, after it, a reader node that appends
what the destinations hold at that point of each replay to a history; each test
compares that history with what program order says each replay must see.
"""

from __future__ import annotations

import numpy as np
import pytest

import cucopy as cc
from cucopy import pack


class Site(cc.CopySite):
    A = cc.H2D
    B = cc.H2D
    TABLE = cc.H2D
    GATHER = cc.D2D
    PAD = cc.FILL
    PLAIN = cc.H2D


PLAN = cc.CopyPlan(
    merge={Site.A, Site.B, Site.TABLE, Site.GATHER, Site.PAD}, flush_after={Site.TABLE}
)
N = 64
SLOTS = 3

_READ_SOURCE = r"""
extern "C" __global__ void feed_test_read(const int* a, const int* b, int* hist,
                                          unsigned int* count, unsigned int n, unsigned int cap)
{
    unsigned int k = *count;
    if (k < cap) {
        for (unsigned int i = threadIdx.x; i < n; i += blockDim.x) {
            hist[(unsigned long long)k * 2 * n + i] = a[i];
            hist[(unsigned long long)k * 2 * n + n + i] = b[i];
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        *count = k + 1;
    }
}
"""


class Rig:
    """A copier, two device arrays, and a graph: [feed node, reader node]."""

    def __init__(self, env, plan=PLAN, slots=SLOTS, cap=4096, blocks=8, reader=True, **kw):
        self.env = env
        self.stream = env.default_stream
        self.c = env.copier(plan, slots=slots, **kw)
        self.a = env.empty((N,))
        self.b = env.empty((N,))
        self.cap = cap
        self._sim_hist = []
        self._cuda = None
        if env.name == "cuda":
            cp = env.cp
            self._cuda = cp
            self._hist = cp.zeros((cap, 2 * N), dtype=cp.int32)
            self._count = cp.zeros((1,), dtype=cp.uint32)
            self._read = cp.RawKernel(_READ_SOURCE, "feed_test_read")
            with self.stream:
                self._launch_read()  # compile and load outside the capture
            self.stream.synchronize()
            self._count.fill(0)
            env.synchronize()
        with env.capture(self.stream) as g:
            self.feed = self.c.capture_inputs(blocks=blocks)
            if reader:
                self._capture_read()
        self._g = g

    @property
    def graph(self):
        return getattr(self._g, "graph", self._g)  # CuPy: the box filled at end_capture

    def _launch_read(self):
        args = (self.a, self.b, self._hist, self._count, np.uint32(N), np.uint32(self.cap))
        self._read((1,), (256,), args, stream=self.stream)

    def _capture_read(self):
        if self._cuda is not None:
            self._launch_read()
            return
        dev = self.env.dev
        self.stream.launch(
            lambda: self._sim_hist.append(
                np.concatenate([dev.raw(self.a).copy(), dev.raw(self.b).copy()])
            )
        )

    def replay(self):
        self.feed.replay(self.graph)

    def history(self) -> list:
        self.env.synchronize()
        if self._cuda is None:
            return [h.tolist() for h in self._sim_hist]
        k = int(self._cuda.asnumpy(self._count)[0])
        return self._cuda.asnumpy(self._hist[: min(k, self.cap)]).tolist()

    def close(self):
        self.c.close()


def _both(model):
    return np.concatenate(model).tolist()


def test_each_replay_lands_its_step(env):
    r = Rig(env)
    model = [np.zeros(N, np.int32), np.zeros(N, np.int32)]
    want = []
    host = np.zeros(N, np.int32)
    for k in range(12):
        n = 1 + (7 * k) % N
        host[:n] = np.arange(n) + 100 * k
        with r.c.step(graph=r.feed):
            r.c.copy(Site.A, r.a[:n], host[:n])
            r.c.fill_tail(Site.PAD, r.a, n, -1)
            r.c.copy(Site.B, r.b[k : k + 3], np.full(3, k, np.int32))
            host[:] = -5  # snapshot: the host refills at once
        model[0][:n] = np.arange(n) + 100 * k
        model[0][n:] = -1
        model[1][k : k + 3] = k
        r.replay()
        want.append(_both(model))
    assert r.history() == want
    st = r.c.stats
    assert st.modes["graph"] == 12 and st.segments == 12
    assert st.sites[Site.A].merged == 12
    assert st.sites[Site.PAD].merged + st.sites[Site.PAD].skipped == 12  # n = N: empty tail
    assert r.feed.replays == 12 and r.feed.posts == 12
    r.close()


def test_a_replay_without_a_step_lands_nothing_stale(env):
    r = Rig(env)
    with r.c.step(graph=r.feed):
        r.c.copy(Site.A, r.a[:4], np.array([1, 2, 3, 4], np.int32))
    r.replay()
    # after the replay the destination is the engine's again: it writes it on the stream
    env.write(r.stream, r.a, np.full(N, 9, np.int32))
    r.replay()  # no step since: the node lands nothing (the first step's bytes stay out)
    with r.c.step(graph=r.feed):
        pass  # an empty graph step posts nothing either
    r.replay()
    h = r.history()
    assert h[0][:5] == [1, 2, 3, 4, 0]
    assert h[1][:N] == [9] * N and h[2][:N] == [9] * N
    assert r.feed.posts == 1 and r.feed.replays == 3
    r.close()


def test_a_discarded_step_lands_nothing_and_calls_on_drop(env):
    r = Rig(env)
    dropped = []
    with r.c.step(graph=r.feed):
        r.c.copy(Site.A, r.a[:2], np.array([5, 6], np.int32))
    r.replay()
    with pytest.raises(KeyError):
        with r.c.step(graph=r.feed):
            r.c.copy(Site.A, r.a[:2], np.array([7, 8], np.int32), on_drop=lambda: dropped.append(1))
            raise KeyError("boom")
    r.replay()
    assert dropped == [1]
    h = r.history()
    assert h[0][:2] == [5, 6] and h[1][:2] == [5, 6]
    r.close()


def test_a_step_not_replayed_lands_at_the_next_step_in_order(env):
    r = Rig(env)
    with r.c.step(graph=r.feed):
        r.c.copy(Site.A, r.a[:4], np.array([1, 1, 1, 1], np.int32))
        r.c.copy(Site.B, r.b[:2], np.array([3, 3], np.int32))
    # no replay: the next step lands it first (an ordinary launch), then its own copies
    with r.c.step(graph=r.feed):
        r.c.copy(Site.A, r.a[2:6], np.array([2, 2, 2, 2], np.int32))
    r.replay()
    assert r.history()[0][:6] == [1, 1, 2, 2, 2, 2]
    assert r.history()[0][N : N + 3] == [3, 3, 0]
    assert r.c.stats.modes["graph"] == 1 and r.c.stats.segments == 2
    r.close()


def test_a_pending_step_lands_before_an_eager_copy_and_at_close(env):
    r = Rig(env)
    with r.c.step(graph=r.feed):
        r.c.copy(Site.A, r.a[:3], np.array([1, 2, 3], np.int32))
    r.c.copy(Site.PLAIN, r.a[1:2], np.array([7], np.int32))  # outside a step: after it
    assert env.to_host(r.a)[:3].tolist() == [1, 7, 3]
    with r.c.step(graph=r.feed):
        r.c.copy(Site.B, r.b[:1], np.array([4], np.int32))
    r.c.close()  # not replayed: close lands it
    assert env.to_host(r.b)[:1].tolist() == [4]


def test_a_barrier_inside_a_graph_step_lands_before_its_reader(env):
    r = Rig(env)
    seen = env.stream()  # unused on sim: the reader goes on the copier's stream
    del seen
    with r.c.step(graph=r.feed):
        r.c.copy(Site.A, r.a[:2], np.array([4, 4], np.int32))
        r.c.copy(Site.TABLE, r.b[:3], np.array([8, 8, 8], np.int32))  # a barrier: lands now
        got = env.read_later(r.stream, r.b)  # a device reader before the replay
        r.c.copy(Site.B, r.b[3:4], np.array([9], np.int32))  # after the barrier: the node
    r.replay()
    assert got()[:4].tolist() == [8, 8, 8, 0]
    h = r.history()
    assert h[0][:2] == [4, 4] and h[0][N : N + 4] == [8, 8, 8, 9]
    assert r.c.stats.modes["graph"] == 1 and r.c.stats.segments == 2
    r.close()


def test_host_runs_ahead_of_a_stalled_stream(env):
    """Steps, replays and replays without steps enqueued behind a hold: each replay
    still sees its own step's bytes, though the host rewrote its sources at once."""
    r = Rig(env, slots=SLOTS)
    model = [np.zeros(N, np.int32), np.zeros(N, np.int32)]
    want = []
    host = np.zeros(8, np.int32)
    rng = np.random.default_rng(3)
    k = 0
    for _ in range(6):
        with env.hold(r.stream):
            steps = 0
            while steps < SLOTS - 1:  # the ring lets the host run this far ahead
                if rng.random() < 0.3:
                    r.replay()  # a replay without a step
                    want.append(_both(model))
                    continue
                k += 1
                host[:] = rng.integers(0, 1000, 8)
                with r.c.step(graph=r.feed):
                    r.c.copy(Site.A, r.a[k % 50 : k % 50 + 8], host)
                    r.c.copy(Site.B, r.b[:1], np.array([k], np.int32))
                model[0][k % 50 : k % 50 + 8] = host
                model[1][:1] = k
                host[:] = -1
                r.replay()
                want.append(_both(model))
                steps += 1
        r.stream.synchronize()  # released: the held work runs (the sim runs it when waited on)
    assert r.history() == want
    assert r.c.stats.host_waits == 0
    r.close()


def test_replays_without_steps_reuse_entries_safely(sim_env):
    """More replays than entries between two posts: the entry of the older post is
    rewritten only after the replay that read it ran (here: the host waits for it)."""
    r = Rig(sim_env, slots=2)
    model = [np.zeros(N, np.int32), np.zeros(N, np.int32)]
    want = []
    for k in range(10):
        with r.c.step(graph=r.feed):
            r.c.copy(Site.A, r.a[:1], np.array([k], np.int32))
        model[0][0] = k
        for _ in range(1 + k % 3):
            r.replay()
            want.append(_both(model))
    assert r.history() == want
    r.close()


def test_replaying_the_graph_some_other_way_is_caught(env):
    r = Rig(env)
    with r.c.step(graph=r.feed):
        r.c.copy(Site.A, r.a[:1], np.array([1], np.int32))
    r.replay()
    r.c.backend.graph_launch(r.graph, r.c.stream)  # behind the feed's back
    env.synchronize()
    with pytest.raises(cc.CopyError, match=r"graph feed \d+: its node ran 2 replays, but only 1"):
        r.replay()
    r.feed.resync()
    with r.c.step(graph=r.feed):
        r.c.copy(Site.A, r.a[:1], np.array([5], np.int32))
    r.replay()
    assert [h[0] for h in r.history()] == [1, 1, 5]
    r.close()


def test_check_mode_catches_a_write_before_the_replay(env, check_mode):
    r = Rig(env)
    with r.c.step(graph=r.feed):
        r.c.copy(Site.A, r.a[:4], np.array([1, 2, 3, 4], np.int32))
    with pytest.raises(cc.CopyError):
        cc.expect_landed(Site.A, r.a)  # still staged until the replay
    env.write(r.stream, r.a, np.full(N, 3, np.int32))  # breaks the plan's promise
    with pytest.raises(cc.CopyError, match=r"Site\.A: merged destination bytes"):
        r.replay()
    with r.c.step(graph=r.feed):
        r.c.copy(Site.A, r.a[:4], np.array([1, 2, 3, 4], np.int32))
        r.c.copy(Site.B, r.b[:2], np.array([0, 0], np.int32), unchanged=True)
    r.replay()
    cc.expect_landed(Site.A, r.a)
    assert r.history()[-1][:4] == [1, 2, 3, 4]
    with pytest.raises(cc.CopyError, match=r"Site\.B: unchanged copy into"):
        with r.c.step(graph=r.feed):  # nothing staged: the claim is checked at the end
            r.c.copy(Site.B, r.b[:2], np.array([1, 1], np.int32), unchanged=True)
    with r.c.step(graph=r.feed):
        r.c.copy(Site.A, r.a[:1], np.array([7], np.int32))
        r.c.copy(Site.B, r.b[:2], np.array([1, 1], np.int32), unchanged=True)  # false too
    with pytest.raises(cc.CopyError, match=r"Site\.B: unchanged copy into"):
        r.replay()  # copies staged: checked with them, before the replay
    r.close()


def test_a_table_larger_than_an_entry_lands_before_the_replay(sim_env):
    r = Rig(sim_env, capacity=1 << 20)
    big = sim_env.empty((400, 4))
    n = pack.FEED_CAPACITY // pack.DESC_BYTES + 8
    with r.c.step(graph=r.feed):
        for i in range(n):  # rows 16 bytes apart with gaps: one descriptor each
            r.c.copy(Site.B, big[i % 400, : 1 + i % 3], np.full(1 + i % 3, i, np.int32))
    r.replay()
    assert r.feed.fallbacks == 1 and r.feed.posts == 0 and "graph" not in r.c.stats.modes
    assert r.c.stats.modes["inline"] + r.c.stats.modes["mapped"] == 1
    got = sim_env.to_host(big)
    for i in range(n):
        assert got[i % 400, : 1 + i % 3].tolist() == [i] * (1 + i % 3)
    r.close()


def test_d2d_and_fills_ride_the_node(env):
    r = Rig(env)
    src = env.asarray(np.arange(N, dtype=np.int32) * 3)
    with r.c.step(graph=r.feed):
        r.c.copy(Site.GATHER, r.b[:5], src[10:15])
        r.c.fill_tail(Site.PAD, r.a, N - 2, 6)
    r.replay()
    h = r.history()[0]
    assert h[N : N + 5] == [30, 33, 36, 39, 42] and h[N - 2 : N] == [6, 6]
    r.close()


def test_bad_uses_are_refused(sim_env):
    env = sim_env
    c = env.copier(PLAN)
    with pytest.raises(
        cc.CopyError, match=r"capture_inputs\(\): the copier's stream is not capturing"
    ):
        c.capture_inputs()
    with env.capture(env.default_stream):
        with pytest.raises(ValueError, match=r"blocks: expected an int in \[1, 65535\], got 0"):
            c.capture_inputs(blocks=0)
        feed = c.capture_inputs()
        with pytest.raises(
            cc.CopyError, match=r"step\(graph=...\): the copier's stream is capturing"
        ):
            with c.step(graph=feed):
                pass
    other = env.copier(PLAN)
    with pytest.raises(ValueError, match=r"step\(graph=...\): expected a GraphFeed made by this"):
        with other.step(graph=feed):
            pass
    with pytest.raises(ValueError, match=r"step\(graph=...\): expected a GraphFeed"):
        with c.step(graph="g"):
            pass
    with c.step():
        with pytest.raises(cc.CopyError, match=r"graph feed 0: replay\(\) while a step"):
            feed.replay(lambda: None)
    a = env.empty((4,))
    with c.step(graph=feed):
        c.copy(Site.A, a, np.ones(4, np.int32))
    with env.capture(env.stream()):  # another stream's capture does not matter
        pass
    assert c.staged == 1
    other.close()
    c.close()
    with pytest.raises(cc.CopyError, match="the copier is closed"):
        feed.replay(lambda: None)
    assert env.to_host(a).tolist() == [1, 1, 1, 1]  # close landed the pending step


def test_random_programs_against_the_model(sim_env):
    """Graph steps, plain steps, barriers, discards, eager copies, replays with and
    without steps, foreign writes after replays, holds: every replay sees what
    program order says, and every copy not dropped lands."""
    _random_program(sim_env, seed=11, steps=80)


@pytest.mark.parametrize("seed", [1, 2])
def test_random_programs_on_each_backend(env, seed):
    _random_program(env, seed=seed, steps=60)


def _random_program(env, seed, steps, holds=True):
    rng = np.random.default_rng(seed)
    r = Rig(env, cap=8 * steps)
    model = [np.zeros(N, np.int32), np.zeros(N, np.int32)]
    arrs = [r.a, r.b]
    want = []
    hold = None
    held = 0
    host = np.zeros(N, np.int32)
    for step in range(steps):
        if holds and hold is None and rng.random() < 0.2:
            r.stream.synchronize()  # a sim hold stalls work queued before it, too
            hold = env.hold(r.stream)
            hold.__enter__()
            held = 0
        graph = rng.random() < 0.8
        ops, dropped = [], set()
        fail = rng.random() < 0.1
        try:
            with r.c.step(graph=r.feed if graph else None):
                for i in range(int(rng.integers(0, 6))):
                    k = int(rng.integers(0, 2))
                    lo = int(rng.integers(0, N - 1))
                    hi = int(rng.integers(lo + 1, min(N, lo + 16) + 1))
                    on_drop = lambda i=i, d=dropped: d.add(i)  # noqa: E731
                    kind = rng.random()
                    if kind < 0.6:
                        site = (Site.A, Site.B, Site.TABLE, Site.PLAIN)[int(rng.integers(0, 4))]
                        vals = rng.integers(-999, 999, hi - lo).astype(np.int32)
                        host[: hi - lo] = vals
                        r.c.copy(site, arrs[k][lo:hi], host[: hi - lo], on_drop=on_drop)
                        host[:] = -3
                        ops.append(
                            (
                                i,
                                lambda m=model[k], lo=lo, hi=hi, v=vals: m.__setitem__(
                                    slice(lo, hi), v
                                ),
                            )
                        )
                    else:
                        v = int(rng.integers(-9, 9))
                        r.c.fill_tail(Site.PAD, arrs[k][lo:hi], 0, v, on_drop=on_drop)
                        ops.append(
                            (
                                i,
                                lambda m=model[k], lo=lo, hi=hi, v=v: m.__setitem__(
                                    slice(lo, hi), v
                                ),
                            )
                        )
                if fail:
                    raise KeyError("boom")
        except KeyError:
            pass
        for i, apply in ops:
            if i not in dropped:
                apply()
        replays = int(rng.integers(0, 3)) if rng.random() < 0.3 else 1
        for _ in range(replays):
            r.replay()
            want.append(_both(model))
        # The engine writes a destination once the copies have landed: a graph step's
        # land in its replay (the step's end is no barrier), so not before it.
        if (replays or not graph) and rng.random() < 0.2:
            k = int(rng.integers(0, 2))
            v = int(rng.integers(100, 200))
            env.write(r.stream, arrs[k], np.full(N, v, np.int32))
            model[k][:] = v
        if hold is not None:
            held += 1
            if held >= SLOTS - 1 or step == steps - 1:
                hold.__exit__(None, None, None)
                hold = None
                r.stream.synchronize()  # the sim runs released work only when waited on
    if hold is not None:
        hold.__exit__(None, None, None)
    r.c.flush()
    assert r.history() == want
    assert env.to_host(r.a).tolist() == model[0].tolist()
    assert env.to_host(r.b).tolist() == model[1].tolist()
    assert r.c.stats.modes.get("graph", 0) > 0
    r.close()


def test_random_programs_in_check_mode(sim_env, check_mode):
    """The same programs keep the plan's promises: check mode finds nothing to report."""
    _random_program(sim_env, seed=5, steps=40, holds=False)  # check mode synchronizes


def _long_run(env, steps):
    """``steps`` decode-like graph steps, the host never waiting (the ring throttles it),
    every replay's view of the inputs compared with the host mirror at the end."""
    rng = np.random.default_rng(7)
    r = Rig(env, cap=steps, blocks=16)
    model = [np.zeros(N, np.int32), np.zeros(N, np.int32)]
    want = np.empty((steps, 2 * N), np.int32)
    pos = np.zeros(N, np.int32)
    lens = np.zeros(N, np.int32)
    for k in range(steps):
        n = int(rng.integers(1, N + 1))
        pos[:n] = rng.integers(0, 1 << 30, n)
        lens[:n] = rng.integers(1, 4096, n)
        with r.c.step(graph=r.feed):
            r.c.copy(Site.A, r.a[:n], pos[:n])
            r.c.fill_tail(Site.PAD, r.a, n, -1)
            r.c.copy(Site.B, r.b[:n], lens[:n])
            r.c.fill_tail(Site.PAD, r.b, n, 0)
        model[0][:n], model[0][n:] = pos[:n], -1
        model[1][:n], model[1][n:] = lens[:n], 0
        r.replay()
        want[k, :N], want[k, N:] = model
    got = np.asarray(r.history(), np.int32)
    bad = np.flatnonzero((got != want).any(axis=1))
    assert bad.size == 0, f"{bad.size} replays differ, first {bad[0]}"
    assert r.feed.posts == steps and r.c.stats.modes["graph"] == steps
    r.close()


def test_many_steps_match_the_mirror(env):
    """10^4 steps on the GPU, 300 on the simulated device (bit-identical to what plain
    copies write: the mirror)."""
    _long_run(env, 10_000 if env.name == "cuda" else 300)


def test_resetting_the_stats_does_not_make_entries_look_busy(sim_env):
    r = Rig(sim_env)
    for k in range(8):
        if k == 4:
            r.c.stats.reset()
        with r.c.step(graph=r.feed):
            r.c.copy(Site.A, r.a[:1], np.array([k], np.int32))
        r.replay()
    assert r.feed.fallbacks == 0 and r.feed.posts == 8
    assert [h[0] for h in r.history()] == list(range(8))
    r.close()


def test_every_block_the_segment_uses_gets_its_own_lane(sim_env, monkeypatch):
    # the node's block b reads the entry's head and header from lane b (reads of one
    # address of mapped memory from many blocks queue on the GPU); the sim checks each
    # lane the segment needs holds this replay's head, so a post that forgot one fails
    r = Rig(sim_env, blocks=4)
    host = np.arange(N, dtype=np.int32)
    with r.c.step(graph=r.feed):
        for k in range(3):  # several descriptors: several blocks
            r.c.copy(Site.A, r.a[16 * k : 16 * k + 16], host[16 * k : 16 * k + 16])
    r.replay()
    lanes = r.feed._lanes
    i = r.feed.replays % r.feed.entries
    entry = r.feed._box.array[i * pack.FEED_ENTRY_BYTES :][: pack.FEED_LANE_BYTES]
    used = [b for b in range(r.feed.blocks) if lanes[i, b].tobytes() == entry.tobytes()]
    assert len(used) >= 2 and used == list(range(len(used)))
    assert r.history()[-1][:48] == list(range(48))
    # a post whose lanes were not written: the node's blocks would land nothing
    post = type(r.feed)._post

    def forgetful(self, tag, seg, head, turn):
        post(self, tag, seg, head, turn)
        self._lanes[tag % self.entries, 1:] = 0

    monkeypatch.setattr(type(r.feed), "_post", forgetful)
    with r.c.step(graph=r.feed):
        for k in range(3):
            r.c.copy(Site.A, r.a[16 * k : 16 * k + 16], host[16 * k : 16 * k + 16] + 1)
    with pytest.raises(cc.CopyError, match="lane 1 of replay 2"):
        r.replay()  # the node runs here under the eager policy, later under the others
        r.history()
    monkeypatch.undo()
