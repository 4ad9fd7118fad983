"""GraphFeed: a step's merged copies landed by a scatter node inside the engine's CUDA graph.

An engine captures the copier's scatter once, as a node of its own graph
(:meth:`DeviceCopier.capture_inputs <cucopy.DeviceCopier.capture_inputs>`), then
each step stages its copies as usual in ``copier.step(graph=feed)`` and replays
the graph with :meth:`GraphFeed.replay`: the node lands that step's copies, then
the rest of the graph runs. The step costs no stream operation of its own.

How a step reaches the node: a mailbox
--------------------------------------
The node's parameters never change (no driver call per step). It counts its
replays on the device and, at replay ``r``, reads entry ``r % entries`` of a
mailbox in mapped pinned memory; it applies the segment there only when the
entry is tagged ``r`` (``pack.py``, "Graph feeds"). :meth:`GraphFeed.replay`
writes the step's entry, tagged with the number of the replay it is about to
enqueue, then enqueues that replay. So:

- a replay with no step posted for it (no step since the last replay, an empty
  or discarded step, a step whose copies all landed at barriers) finds an entry
  tagged for an older replay and lands nothing;
- the host may run ahead: an entry is rewritten only once the replay that read it
  has run (the entry for replay ``r`` is reused by ``r + entries``; ``entries``
  is the ring's ``slots``, and the ring's wait for the slot of the step posted
  there covers it), and the segment's bytes stay in the step's ring slot until
  then, as every flush's do. When replays without steps bring an entry's turn
  round sooner, that step lands through an ordinary launch right before its
  replay (``GraphFeed.fallbacks``) rather than wait;
- a graph step that is not replayed before the copier's next step, flush,
  eager copy or close lands then, through an ordinary launch, before anything
  that follows it in program order (never lost, never late).

The other mechanism measured for this (``cuGraphExecKernelNodeSetParams`` on
each step, ``bench/probes/graph_feed.py``) is safe for a host running ahead too,
but costs the host a driver call (about 4-5 us on the H200) each step.
"""

from __future__ import annotations

import numpy as np

from . import pack
from .errors import CopyError

__all__ = ["GraphFeed"]

# where a segment header's block count lies (pack.HEADER_DTYPE)
_NBLOCKS_AT = pack.HEADER_DTYPE.fields["nblocks"][1]  # type: ignore[index]


class GraphFeed:
    """The handle of one scatter node captured into an engine's CUDA graph.

    Made by :meth:`DeviceCopier.capture_inputs <cucopy.DeviceCopier.capture_inputs>`
    inside the capture; pass it to ``copier.step(graph=feed)`` and replay the
    graph with :meth:`replay`. Its mailbox belongs to the copier and is freed by
    the copier's ``close()``: replaying the graph after that is an error.

    Attributes
    ----------
    index : int
        The feed's replay counter on the device (one per captured node).
    blocks : int
        Thread blocks of the node (fixed at capture).
    entries : int
        Mailbox entries (the copier's ring slots).
    posts : int
        Steps whose copies rode in a replay of the node.
    fallbacks : int
        Graph steps replayed whose copies landed through an ordinary launch right
        before the replay: a table larger than an entry holds
        (``pack.FEED_CAPACITY``), or an entry still busy (replays without steps
        brought its turn round within ``entries`` steps).
    """

    def __init__(self, copier, blocks: int):
        self._copier = copier
        be = copier.backend
        ring = copier._ring
        self.entries = ring.slots
        self.blocks = blocks
        lanes = self.entries * pack.FEED_ENTRY_BYTES
        status = lanes + self.entries * blocks * pack.FEED_LANE_BYTES
        self._box = be.alloc_feed(status + pack.FEED_STATUS_BYTES)
        try:
            self._box.array[:] = 0
            self._status = self._box.array[status:][:8].view(np.uint64)
            # lane (i, b): entry i's head and header, for block b (pack.py, Graph feeds)
            self._lanes = self._box.array[lanes:status].reshape(
                self.entries, blocks, pack.FEED_LANE_BYTES
            )
            self._lane_tags = self._lanes.view(np.uint64)[:, :, 0]
            status_ptr = self._box.device_ptr + status
            self.index = be.feed_capture(
                self._box.device_ptr, self.entries, blocks, status_ptr, copier.stream
            )
        except BaseException:
            self._box.close()
            raise
        self._mv = memoryview(self._box.array)
        self._q = self._mv[: self.entries * pack.FEED_ENTRY_BYTES].cast("Q")  # little-endian
        self._replays = 0
        # per entry: the ring acquisition (StagingRing.acquires) of its last post
        self._posted: list = [None] * self.entries
        self.posts = 0
        self.fallbacks = 0

    @property
    def replays(self) -> int:
        """Replays enqueued through :meth:`replay`."""
        return self._replays

    @property
    def device_replays(self) -> int:
        """Replays the node has run, as far as the host has seen (it lags while the
        device runs behind)."""
        return int(self._status[0])

    def __repr__(self) -> str:
        return (
            f"GraphFeed(index={self.index}, blocks={self.blocks}, entries={self.entries}, "
            f"replays={self._replays}, posts={self.posts}, fallbacks={self.fallbacks})"
        )

    def replay(self, graph) -> None:
        """Enqueue one replay of ``graph`` on the copier's stream, landing this step's copies.

        The copies staged by the last ``copier.step(graph=self)`` (if it has ended
        and nothing has landed them since) ride in this replay: its scatter node
        applies them before the nodes after it. A replay with nothing posted lands
        nothing. Copies of a graph step of another feed land first, through an
        ordinary launch.

        Parameters
        ----------
        graph : graph or callable
            The graph holding this feed's node: a ``torch.cuda.CUDAGraph`` (replayed
            on torch's current stream, which must be the copier's), a CuPy graph, a
            raw ``cudaGraphExec_t``, a sim graph, or a callable that replays it.

        Raises
        ------
        CopyError
            When the copier is closed, a non-graph step is open, or the node has
            run more replays than were enqueued here (the graph was replayed some
            other way: call :meth:`resync`); also when the launch fails (the
            step's copies are then dropped, their ``on_drop`` called).
        """
        self._copier._replay_feed(self, graph)

    def resync(self) -> None:
        """Adopt the device's replay count after the graph was replayed some other way.

        Waits for the copier's stream (a full stop: call it where waiting is
        harmless), then forgets every posted entry.
        """
        c = self._copier
        c._live()
        if not c.backend.stream_wait(c.stream, c.wait_timeout):
            raise CopyError(
                f"graph feed {self.index}: resync() waited {c.wait_timeout:g} s "
                "(wait_timeout) for the copier's stream to drain; it never did"
            )
        for i in range(self.entries):
            self._q[i * pack.FEED_ENTRY_BYTES // 8] = 0
        self._lane_tags[:] = 0
        self._posted = [None] * self.entries
        self._replays = int(self._status[0])

    def _check_replays(self) -> None:
        seen = int(self._status[0])
        if seen > self._replays:
            raise CopyError(
                f"graph feed {self.index}: its node ran {seen} replays, but only "
                f"{self._replays} were enqueued through GraphFeed.replay(): the graph was "
                "replayed some other way, and the feed no longer knows which replay "
                "takes which step. Replay it only through feed.replay(graph) (after "
                "feed.resync())"
            )

    def _busy(self, tag: int, turn: int) -> bool:
        """Whether the entry for replay ``tag`` may still be read by an earlier replay.

        ``turn`` counts the ring's slot acquisitions: acquisition ``turn`` waited for
        the slot of acquisition ``turn - entries`` (``entries`` = slots), whose event
        follows every replay enqueued while that slot was current. A post closer
        than that to the entry's last one (replays without steps in between) finds
        the entry busy: the step then lands through an ordinary launch instead, and
        nobody waits.
        """
        last = self._posted[tag % self.entries]
        if last is None:
            return False
        since = turn - last
        return since < self.entries or since < 0

    def _post(self, tag: int, seg_device: int, head, turn: int) -> None:
        """Write the entry for replay ``tag``: ``head`` is the segment's first bytes (at
        least its header and table), the rest is read at ``seg_device``."""
        i = tag % self.entries
        n = len(head)
        off = i * pack.FEED_ENTRY_BYTES + pack.FEED_HEAD_BYTES
        q = self._q
        w = i * pack.FEED_ENTRY_BYTES // 8
        q[w] = 0  # never a half-written entry under a valid tag
        self._mv[off : off + n] = head
        q[w + 1] = seg_device
        q[w + 2] = n
        q[w] = tag
        # each block the segment uses reads its own copy of the head and header
        nblocks = int.from_bytes(head[_NBLOCKS_AT : _NBLOCKS_AT + 4], "little")
        base = i * pack.FEED_ENTRY_BYTES
        self._lanes[i, : min(nblocks, self.blocks)] = self._box.array[
            base : base + pack.FEED_LANE_BYTES
        ]
        self._posted[i] = turn
        self.posts += 1

    def _unpost(self, tag: int) -> None:
        w = (tag % self.entries) * pack.FEED_ENTRY_BYTES // 8
        if self._q[w] == tag:
            self._q[w] = 0
            self._lane_tags[tag % self.entries] = 0
            self._posted[tag % self.entries] = None

    def close(self) -> None:
        """Free the mailbox (the copier's ``close()`` does it; waits for the device)."""
        self._mv.release()
        self._q.release()
        self._lanes = self._lane_tags = None
        self._box.close()
