"""A transformer-like decode step captured once as a CUDA graph, its inputs fed through cucopy.

Usage:
    python examples/torch_decode_loop.py [--steps 200] [--batch 32] [--rounds 5] [--check]
        [--json PATH]
    python examples/torch_decode_loop.py --sim [--steps 5] [--check]      # CPU only

The decode step reads four static input buffers: token ids, positions, sequence
lengths and a block table (pages of a paged KV pool). It embeds the tokens, gathers
each row's context from the KV pool at ``block_table[b, j // page] * page + j % page``
for ``j < seq_lens[b]``, attends over it, runs a small MLP and produces logits. Unused
batch slots hold -1 (0 for the sequence length) and come out as zero logits.

On CUDA the step is captured ONCE as a ``torch.cuda.CUDAGraph`` over those buffers.
Each step the host builds new inputs in NumPy, then the same loop runs twice:

- ``cucopy``: the uploads go through ``cucopy.copy`` / ``cucopy.fill_tail`` at named
  sites, all merged (one pinned upload + one scatter launch per step at the final
  ``copier.flush()`` right before ``graph.replay()``);
- ``plain``: the classic chain of ``copy_(non_blocking=True)`` from pinned tensors and
  ``fill_()`` calls; before refilling the pinned tensors the host waits on an event
  recorded after the previous step's copies;
- ``graph`` (embedded): the same uploads through the same sites, landed by cucopy's
  scatter captured as the first node of a second graph of the step
  (``copier.capture_inputs()`` inside ``torch.cuda.graph``); each step runs in
  ``copier.step(graph=feed)`` and the graph replays with ``feed.replay(graph)``, so the
  copies cost no launch of their own.

All loops keep every step's logits (a device clone after the replay) and a snapshot
of the four input buffers. The script checks that the logits of the two loops are
bit-identical (``torch.equal``) with the plain loop's and that the input buffers hold exactly what a host
mirror of the writes says, and exits 1 otherwise. It prints the median step time of
each loop (GPU time between CUDA events recorded at the start and end of each step,
and the host time to issue the step), the wall time per step, and ``copier.stats``. On CUDA it then times the three loops
again as an engine runs them, with nothing recorded (no clones, snapshots or events),
``--rounds`` rounds with the order rotated each round, and prints each loop's median
wall time per step and its ratio to the plain loop's.

With ``--sim`` it runs on cucopy's simulated device (no GPU, torch CPU): the buffers
live in simulated device memory, the uploads take the same cucopy path, and the graph
replay is replaced by reading the buffers back (``dev.to_host``, which runs the queued
work) and calling the same step function on CPU tensors. The ``plain`` loop there is a
plan-less copier (every copy its own asynchronous operation, as ``copy_`` chains
are), and both loops are also compared with the step run on the host mirror. The
times are host times of the simulation, not GPU times.

``--check`` turns on cucopy's check mode (``cucopy.check.CHECK_MODE = True``): each
flush verifies that nothing else wrote a merged destination before its barrier (it
synchronizes, so the timings are not meaningful then).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``cucopy`` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import cucopy as cc  # noqa: E402
from cucopy import check  # noqa: E402

WARMUP_STEPS = 3  # left out of the medians: the first steps compile kernels and fill caches


class Site(cc.CopySite):
    """Every per-step copy of the decode loop, one member per call site."""

    TOKENS = cc.H2D
    POSITIONS = cc.H2D
    SEQ_LENS = cc.H2D
    BLOCK_TABLE = cc.H2D
    TOKEN_PAD = cc.FILL
    POSITION_PAD = cc.FILL
    SEQ_LEN_PAD = cc.FILL
    BLOCK_PAD = cc.FILL


# Nothing on the device reads or writes these buffers between the copies and the final
# flush right before the replay, so every site merges and no earlier barrier is needed.
PLAN = cc.CopyPlan(merge=set(Site))


@dataclass(frozen=True)
class Shape:
    """Sizes of the toy model."""

    batch: int
    vocab: int = 512
    dim: int = 64
    hidden: int = 256
    page: int = 16
    max_pages: int = 8

    @property
    def max_ctx(self) -> int:
        return self.page * self.max_pages

    @property
    def num_pages(self) -> int:
        return self.batch * self.max_pages + 7


# -- the model ------------------------------------------------------------------------------


def make_weights(shape: Shape, device, seed: int = 0) -> dict:
    """Random float32 weights, a KV pool and index constants, on ``device``."""
    g = torch.Generator().manual_seed(seed)
    d, h = shape.dim, shape.hidden

    def rnd(*size, scale):
        return (torch.randn(*size, generator=g) * scale).to(device)

    j = torch.arange(shape.max_ctx)
    return {
        "tok_emb": rnd(shape.vocab, d, scale=1.0),
        "pos_emb": rnd(shape.max_ctx, d, scale=0.1),
        "wq": rnd(d, d, scale=d**-0.5),
        "wo": rnd(d, d, scale=d**-0.5),
        "w1": rnd(d, h, scale=d**-0.5),
        "w2": rnd(h, d, scale=h**-0.5),
        "w_vocab": rnd(d, shape.vocab, scale=d**-0.5),
        "k_pool": rnd(shape.num_pages * shape.page, d, scale=1.0),
        "v_pool": rnd(shape.num_pages * shape.page, d, scale=1.0),
        "ctx": j.to(device),
        "ctx_page": (j // shape.page).to(device),
        "ctx_off": (j % shape.page).to(device),
    }


def decode_step(w: dict, tokens, positions, seq_lens, block_table, page: int):
    """One decode step over int32 input tensors; returns float32 logits ``[batch, vocab]``.

    Nothing here synchronizes with the host, so it can be captured in a CUDA graph.
    Padding (token -1, block -1) is clamped to a valid index and masked out, and masked
    scores use a finite minimum, so no NaN appears and outputs compare with ``torch.equal``.
    """
    valid = tokens >= 0
    x = w["tok_emb"][tokens.clamp(min=0).long()] + w["pos_emb"][positions.clamp(min=0).long()]
    q = x @ w["wq"]
    pages = block_table.long()[:, w["ctx_page"]]  # [B, C]: the page of each context slot
    slots = pages.clamp(min=0) * page + w["ctx_off"]
    k = w["k_pool"][slots]  # [B, C, D]: the paged-KV gather
    v = w["v_pool"][slots]
    live = (w["ctx"][None, :] < seq_lens.long()[:, None]) & (pages >= 0)
    scores = (k @ q.unsqueeze(-1)).squeeze(-1) * (q.shape[-1] ** -0.5)
    scores = scores.masked_fill(~live, -1e30)
    p = torch.softmax(scores, dim=-1) * live
    h = x + (p.unsqueeze(1) @ v).squeeze(1) @ w["wo"]
    h = h + torch.relu(h @ w["w1"]) @ w["w2"]
    return (h @ w["w_vocab"]).masked_fill(~valid[:, None], 0.0)


# -- host inputs ------------------------------------------------------------------------------


@dataclass
class Inputs:
    """One step's host-built inputs for the ``n`` active rows (NumPy int32)."""

    n: int
    tokens: np.ndarray  # [n]
    positions: np.ndarray  # [n]
    seq_lens: np.ndarray  # [n]
    table: np.ndarray  # [n, m]: m = the most pages any active row uses; -1 past a row's pages


def make_inputs(shape: Shape, step: int, seed: int) -> Inputs:
    """Deterministic inputs of step ``step``: both loops see the same ones."""
    rng = np.random.default_rng([seed, step])
    n = int(rng.integers(1, shape.batch + 1))
    seq_lens = rng.integers(1, shape.max_ctx + 1, size=n).astype(np.int32)
    tokens = rng.integers(0, shape.vocab, size=n).astype(np.int32)
    npages = -(-seq_lens // shape.page)
    m = int(npages.max())
    pages = rng.permutation(shape.num_pages)[: n * m].reshape(n, m)
    table = np.where(np.arange(m)[None, :] < npages[:, None], pages, -1).astype(np.int32)
    return Inputs(n, tokens, (seq_lens - 1).astype(np.int32), seq_lens, table)


class HostMirror:
    """What the four device buffers must hold after each step's writes (columns of the
    block table past a step's ``m`` keep older values, exactly as on the device)."""

    def __init__(self, shape: Shape):
        b = shape.batch
        self.tokens = np.full(b, -1, np.int32)
        self.positions = np.full(b, -1, np.int32)
        self.seq_lens = np.zeros(b, np.int32)
        self.table = np.full((b, shape.max_pages), -1, np.int32)

    def apply(self, inp: Inputs) -> None:
        n, m = inp.n, inp.table.shape[1]
        for buf, src, pad in (
            (self.tokens, inp.tokens, -1),
            (self.positions, inp.positions, -1),
            (self.seq_lens, inp.seq_lens, 0),
        ):
            buf[:n] = src
            buf[n:] = pad
        self.table[:n, :m] = inp.table
        self.table[n:] = -1

    def flat(self) -> np.ndarray:
        return np.concatenate([self.tokens, self.positions, self.seq_lens, self.table.ravel()])


class Buffers:
    """The static input buffers the graph (or the sim step) reads."""

    def __init__(self, shape: Shape, empty):
        self.tokens = empty((shape.batch,))
        self.positions = empty((shape.batch,))
        self.seq_lens = empty((shape.batch,))
        self.block_table = empty((shape.batch, shape.max_pages))

    def all(self) -> tuple:
        return self.tokens, self.positions, self.seq_lens, self.block_table


def upload_cucopy(shape: Shape, bufs: Buffers, inp: Inputs) -> None:
    """The step's uploads through named sites (routed to the active copier)."""
    n, m = inp.n, inp.table.shape[1]
    cc.copy(Site.TOKENS, bufs.tokens[:n], inp.tokens)
    cc.fill_tail(Site.TOKEN_PAD, bufs.tokens, n, -1)
    cc.copy(Site.POSITIONS, bufs.positions[:n], inp.positions)
    cc.fill_tail(Site.POSITION_PAD, bufs.positions, n, -1)
    cc.copy(Site.SEQ_LENS, bufs.seq_lens[:n], inp.seq_lens)
    cc.fill_tail(Site.SEQ_LEN_PAD, bufs.seq_lens, n, 0)
    cc.copy(Site.BLOCK_TABLE, bufs.block_table[:n, :m], inp.table)  # a row-strided view
    cc.fill_tail(Site.BLOCK_PAD, bufs.block_table, n * shape.max_pages, -1)


class PlainUploader:
    """The classic uploads: refill pinned tensors, ``copy_(non_blocking=True)``, ``fill_()``.

    One set of pinned tensors is reused every step, so before refilling them the host
    waits on ``event``, recorded on ``stream`` after the previous step's copies.
    """

    def __init__(self, shape: Shape, bufs: Buffers, event, stream, pin_memory: bool = True):
        self.shape = shape
        self.bufs = bufs
        self.event = event
        self.stream = stream
        self.pinned = Buffers(
            shape, lambda size: torch.empty(size, dtype=torch.int32, pin_memory=pin_memory)
        )
        self.table = self.pinned.block_table.reshape(-1)

    def __call__(self, inp: Inputs) -> None:
        bufs, pinned = self.bufs, self.pinned
        n, m = inp.n, inp.table.shape[1]
        self.event.synchronize()  # the previous step's copies have read the pinned tensors
        for src, host, dst in (
            (inp.tokens, pinned.tokens, bufs.tokens),
            (inp.positions, pinned.positions, bufs.positions),
            (inp.seq_lens, pinned.seq_lens, bufs.seq_lens),
        ):
            host[:n].numpy()[...] = src
            dst[:n].copy_(host[:n], non_blocking=True)
        table = self.table[: n * m].view(n, m)
        table.numpy()[...] = inp.table
        bufs.block_table[:n, :m].copy_(table, non_blocking=True)  # through a contiguous temp
        if n < self.shape.batch:
            bufs.tokens[n:].fill_(-1)
            bufs.positions[n:].fill_(-1)
            bufs.seq_lens[n:].fill_(0)
            bufs.block_table[n:].fill_(-1)
        self.event.record(self.stream)


# -- results --------------------------------------------------------------------------------


@dataclass
class LoopResult:
    name: str
    logits: list  # per step
    inputs: list  # per step: the four buffers, flattened (NumPy int32)
    gpu_us: list  # per step, CUDA events (empty on sim)
    host_us: list  # per step, host time to issue it
    wall_us_per_step: float

    def summary(self) -> dict:
        def med(xs):
            xs = xs[WARMUP_STEPS:] if len(xs) > WARMUP_STEPS else xs
            return round(statistics.median(xs), 2) if xs else None

        return {
            "median_gpu_us": med(self.gpu_us),
            "median_host_us": med(self.host_us),
            "wall_us_per_step": round(self.wall_us_per_step, 2),
        }


def compare(a: LoopResult, b: LoopResult, expected: list) -> list[str]:
    """Differences between two loops, and between each loop's input buffers and the mirror."""
    errors = []
    for i, (x, y) in enumerate(zip(a.logits, b.logits)):
        if not torch.equal(x, y):
            diff = (x != y).nonzero()[0].tolist()
            errors.append(f"step {i}: logits of {a.name} and {b.name} differ, first at {diff}")
    for r in (a, b):
        for i, (got, want) in enumerate(zip(r.inputs, expected)):
            if not np.array_equal(got, want):
                k = int(np.flatnonzero(got != want)[0])
                errors.append(
                    f"step {i}: {r.name}: input buffers differ from the host mirror at flat "
                    f"element {k}: {int(got[k])} != {int(want[k])}"
                )
    if len(a.logits) > 1 and all(torch.equal(a.logits[0], x) for x in a.logits[1:]):
        errors.append("every step produced the same logits: the inputs do not reach the model")
    return errors


# -- CUDA -----------------------------------------------------------------------------------


def _reset_cuda(bufs: Buffers) -> None:
    bufs.tokens.fill_(-1)
    bufs.positions.fill_(-1)
    bufs.seq_lens.fill_(0)
    bufs.block_table.fill_(-1)


def capture(w: dict, bufs: Buffers, shape: Shape):
    """Capture the decode step once; returns the graph and its static logits tensor."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (cuBLAS handles, lazy kernels) outside capture
        for _ in range(3):
            decode_step(w, *bufs.all(), shape.page)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = decode_step(w, *bufs.all(), shape.page)
    torch.cuda.synchronize()
    return graph, logits


def capture_fed(w: dict, bufs: Buffers, shape: Shape, copier, stream):
    """Capture the decode step behind the copier's scatter node (the embedded mode).

    Returns the graph, its static logits and the feed that lands each step's copies in
    it. :func:`capture` has warmed the step up already.
    """
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        feed = copier.capture_inputs()  # first: the model's kernels read what it lands
        logits = decode_step(w, *bufs.all(), shape.page)
    torch.cuda.synchronize()
    return graph, logits, feed


def cuda_loop(name, shape, args, bufs, stream, issue, graph, logits, replay=None) -> LoopResult:
    """Run ``args.steps`` steps: ``issue(inp)`` uploads the inputs, then the graph replays
    (``replay()``, by default ``graph.replay()``)."""
    replay = replay or graph.replay
    _reset_cuda(bufs)
    outs, snaps, events, host_us = [], [], [], []
    with torch.cuda.stream(stream):
        stream.wait_stream(torch.cuda.default_stream())  # the resets above
        t_loop = time.perf_counter_ns()
        for step in range(args.steps):
            inp = make_inputs(shape, step, args.seed)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter_ns()
            start.record(stream)
            issue(inp)
            replay()
            end.record(stream)
            host_us.append((time.perf_counter_ns() - t0) / 1e3)
            events.append((start, end))
            outs.append(logits.clone())
            snaps.append(torch.cat([b.reshape(-1) for b in bufs.all()]))
        stream.synchronize()
        wall = (time.perf_counter_ns() - t_loop) / 1e3 / args.steps
    gpu_us = [s.elapsed_time(e) * 1e3 for s, e in events]
    return LoopResult(name, outs, [s.cpu().numpy() for s in snaps], gpu_us, host_us, wall)


def timed_loop(shape: Shape, args, stream, issue, replay) -> float:
    """Wall us per step of ``args.steps`` steps as an engine runs them: new inputs, the
    uploads, the replay; nothing recorded (no clones, snapshots or events)."""
    with torch.cuda.stream(stream):
        stream.synchronize()
        t0 = time.perf_counter_ns()
        for step in range(args.steps):
            issue(make_inputs(shape, step, args.seed))
            replay()
        stream.synchronize()
        return (time.perf_counter_ns() - t0) / 1e3 / args.steps


def timed_rounds(shape: Shape, args, stream, loops: dict) -> dict:
    """``args.rounds`` rounds of :func:`timed_loop` per loop, the order rotated each round.

    ``loops`` maps a name to ``(issue, replay, context)``; ``context()`` is entered
    around each timed loop (the copier's ``activate()``). Returns every round's wall
    time per loop and, per loop other than ``plain``, its median ratio to ``plain``
    over the rounds (each round's loops ran back to back on the same host).
    """
    names = list(loops)
    walls: dict = {n: [] for n in names}
    for rnd in range(args.rounds):
        k = rnd % len(names)
        for name in names[k:] + names[:k]:
            issue, replay, context = loops[name]
            with context():
                walls[name].append(timed_loop(shape, args, stream, issue, replay))
    ratios = {n: [w / p for w, p in zip(walls[n], walls["plain"])] for n in names if n != "plain"}
    return {
        "rounds": args.rounds,
        "wall_us_per_step": walls,
        "median_wall_us_per_step": {n: round(statistics.median(w), 2) for n, w in walls.items()},
        "ratio_to_plain": {n: round(statistics.median(r), 4) for n, r in ratios.items()},
        "ratio_to_plain_per_round": ratios,
    }


def run_cuda(args, shape: Shape):
    if not torch.cuda.is_available():
        sys.exit("torch_decode_loop: torch sees no CUDA device (use --sim to run on the CPU)")
    try:
        import cupy  # noqa: F401  (cucopy's CUDA backend runs on CuPy)
    except ImportError:
        sys.exit(
            "torch_decode_loop: cucopy's CUDA backend needs CuPy: pip install 'cucopy[cuda13]'"
        )
    index = torch.cuda.current_device()
    device = torch.device("cuda", index)
    w = make_weights(shape, device, args.seed)
    bufs = Buffers(shape, lambda size: torch.empty(size, dtype=torch.int32, device=device))
    _reset_cuda(bufs)
    graph, logits = capture(w, bufs, shape)
    stream = torch.cuda.Stream(device)  # the copies and the replays go on this one stream

    with (
        cc.DeviceCopier(plan=PLAN, stream=stream, device=index, backend="cuda") as copier,
        cc.DeviceCopier(plan=PLAN, stream=stream, device=index, backend="cuda") as fed,
    ):

        def issue_cucopy(inp):
            with copier.step():
                upload_cucopy(shape, bufs, inp)
                copier.flush()  # the final barrier; graph.replay() follows on the same stream

        uploader = PlainUploader(shape, bufs, torch.cuda.Event(), stream, pin_memory=True)
        # both loops once, untimed: whichever runs first would pay the process's warm-up
        # (the caching allocator's first blocks, first calls) in its wall time
        warm = argparse.Namespace(**{**vars(args), "steps": min(args.steps, 20)})
        with copier.activate():
            cuda_loop("cucopy", shape, warm, bufs, stream, issue_cucopy, graph, logits)
        cuda_loop("plain", shape, warm, bufs, stream, uploader, graph, logits)
        copier.stats.reset()
        with copier.activate():
            merged = cuda_loop("cucopy", shape, args, bufs, stream, issue_cucopy, graph, logits)
        stats = copier.stats.as_dict(), str(copier.stats)

        plain = cuda_loop("plain", shape, args, bufs, stream, uploader, graph, logits)

        # the embedded mode: the same uploads, landed by the scatter node inside the graph
        fgraph, flogits, feed = capture_fed(w, bufs, shape, fed, stream)

        def issue_fed(inp):
            with fed.step(graph=feed):  # the step's end leaves its copies for the replay
                upload_cucopy(shape, bufs, inp)

        def replay():
            feed.replay(fgraph)  # the node lands them, then the model runs

        with fed.activate():
            cuda_loop("graph", shape, warm, bufs, stream, issue_fed, fgraph, flogits, replay)
            fed.stats.reset()
            embedded = cuda_loop(
                "graph", shape, args, bufs, stream, issue_fed, fgraph, flogits, replay
            )
        fstats = fed.stats.as_dict(), str(fed.stats)

        # the verified loops above ran one after another; these time the same loops the
        # way an engine runs them, rotated round by round (the lent host drifts)
        timed = None
        if args.rounds:
            timed = timed_rounds(
                shape,
                args,
                stream,
                {
                    "cucopy": (issue_cucopy, graph.replay, copier.activate),
                    "plain": (uploader, graph.replay, contextlib.nullcontext),
                    "graph": (issue_fed, replay, fed.activate),
                },
            )
    env = {
        "device": torch.cuda.get_device_name(device),
        "torch_cuda": torch.version.cuda,
        "timed": timed,
    }
    return merged, plain, _Stats(*stats), env, embedded, _Stats(*fstats)


class _Stats:
    """A copier's stats as they stood after its verified loop (printed, and in the JSON)."""

    def __init__(self, as_dict: dict, text: str):
        self._dict, self._text = as_dict, text

    def as_dict(self) -> dict:
        return self._dict

    def __str__(self) -> str:
        return self._text


# -- the simulated device -------------------------------------------------------------------


def run_sim(args, shape: Shape):
    from cucopy.backends.sim import SimDevice

    dev = SimDevice(policy=args.sim_policy, seed=args.seed)
    stream = dev.stream("decode")
    w = make_weights(shape, "cpu", args.seed)
    bufs = Buffers(shape, lambda size: dev.empty(size, np.int32))
    results, stats = [], {}
    for name, plan in (("cucopy", PLAN), ("plain", None), ("graph", PLAN)):
        for buf, pad in zip(bufs.all(), (-1, -1, 0, -1)):
            buf[...] = pad  # a blocking write
        outs, snaps, host_us = [], [], []
        with cc.DeviceCopier(plan=plan, stream=stream, device=dev, backend="sim") as copier:
            seen: list = []
            if name == "graph":
                # the embedded mode: a graph of [cucopy's scatter node, a reader of the
                # buffers] (the reader stands in for the model's kernels)
                with dev.capture(stream) as graph:
                    feed = copier.capture_inputs()
                    stream.launch(
                        lambda seen=seen: seen.append([dev.raw(b).copy() for b in bufs.all()])
                    )
            with copier.activate():
                t_loop = time.perf_counter_ns()
                for step in range(args.steps):
                    inp = make_inputs(shape, step, args.seed)
                    t0 = time.perf_counter_ns()
                    if name == "graph":
                        with copier.step(graph=feed):
                            upload_cucopy(shape, bufs, inp)
                        feed.replay(graph)
                    else:
                        with copier.step():
                            upload_cucopy(shape, bufs, inp)
                            copier.flush()
                    host_us.append((time.perf_counter_ns() - t0) / 1e3)
                    if name == "graph":  # what the graph's reader saw at this replay
                        dev.synchronize()
                        host = seen[-1]
                    else:  # the "replay": read the buffers back (running the queued copies)
                        host = [dev.to_host(buf) for buf in bufs.all()]
                    outs.append(decode_step(w, *map(torch.from_numpy, host), shape.page))
                    snaps.append(np.concatenate([h.reshape(-1) for h in host]))
                wall = (time.perf_counter_ns() - t_loop) / 1e3 / args.steps
            stats[name] = copier.stats
        results.append(LoopResult(name, outs, snaps, [], host_us, wall))
    merged, plain, embedded = results
    return merged, plain, stats["cucopy"], {"device": repr(dev)}, embedded, stats["graph"]


def host_reference(shape: Shape, args, mirrors: list) -> LoopResult:
    """The step run directly on the host mirror's buffers (CPU torch)."""
    w = make_weights(shape, "cpu", args.seed)
    outs = []
    for flat in mirrors:
        b = shape.batch
        parts = np.split(flat, [b, 2 * b, 3 * b])
        parts[3] = parts[3].reshape(b, shape.max_pages)
        outs.append(decode_step(w, *map(torch.from_numpy, parts), shape.page))
    return LoopResult("host reference", outs, mirrors, [], [], 0.0)


# -- main -----------------------------------------------------------------------------------


def environment(extra: dict) -> dict:
    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "check_mode": bool(check.CHECK_MODE),
    }
    try:
        env["cucopy"] = importlib.metadata.version("cucopy")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        import cupy

        env["cupy"] = cupy.__version__
    except ImportError:
        pass
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
        if rev.returncode == 0:
            env["git"] = rev.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    env.update(extra)
    return env


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200, help="decode steps per loop (default 200)")
    p.add_argument("--batch", type=int, default=32, help="batch slots (default 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="run with cucopy's check mode on")
    p.add_argument("--sim", action="store_true", help="run on the simulated device (CPU only)")
    p.add_argument(
        "--sim-policy",
        choices=("lazy", "eager", "random"),
        default="random",
        help="when the simulated streams run their work (default random)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="CUDA: rounds of timed loops (nothing recorded, order rotated) after the "
        "verified ones (default 5; 0: none)",
    )
    p.add_argument("--json", metavar="PATH", help="write the timings and environment here")
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.rounds < 0:
        p.error("--steps and --batch must be >= 1, --rounds >= 0")
    if args.check:
        check.CHECK_MODE = True
    shape = Shape(batch=args.batch)

    if args.sim:
        merged, plain, stats, extra, embedded, estats = run_sim(args, shape)
    else:
        merged, plain, stats, extra, embedded, estats = run_cuda(args, shape)
    mirror = HostMirror(shape)
    expected = []
    for step in range(args.steps):
        mirror.apply(make_inputs(shape, step, args.seed))
        expected.append(mirror.flat())
    errors = compare(merged, plain, expected) + compare(embedded, plain, expected)
    if args.sim and not errors:  # on CPU the step itself is exact: compare with the host too
        errors = compare(merged, host_reference(shape, args, expected), expected)

    where = "simulated device (host times)" if args.sim else extra["device"]
    print(f"torch_decode_loop: {args.steps} steps, batch {args.batch}, on {where}")
    for r in (merged, plain, embedded):
        s = r.summary()
        gpu = f"gpu {s['median_gpu_us']:9.1f} us/step" if s["median_gpu_us"] is not None else ""
        print(
            f"  {r.name:7} {gpu:22} host {s['median_host_us']:9.1f} us/step (medians)  "
            f"wall {s['wall_us_per_step']:9.1f} us/step"
        )
    timed = extra.pop("timed", None)
    if timed:
        walls, ratios = timed["median_wall_us_per_step"], timed["ratio_to_plain"]
        print(
            f"  timed ({timed['rounds']} rounds, nothing recorded, order rotated): wall us/step "
            + ", ".join(f"{n} {w:.1f}" for n, w in walls.items())
            + "; to plain: "
            + ", ".join(f"{n} {r:.3f}" for n, r in ratios.items())
        )
    print(stats)
    print("graph (embedded):", estats)
    ok = not errors
    if ok:
        what = "cucopy and graph vs plain uploads"
        if args.sim:
            what += " vs the host reference"
        print(
            f"match: {args.steps} steps, logits bit-identical ({what}); input buffers as mirrored"
        )
    else:
        for e in errors[:10]:
            print(f"MISMATCH: {e}", file=sys.stderr)
        print(f"MISMATCH: {len(errors)} differences", file=sys.stderr)
    if args.json:
        out = {
            "example": "torch_decode_loop",
            "args": vars(args),
            "backend": "sim" if args.sim else "cuda",
            "environment": environment(extra),
            "cucopy": merged.summary(),
            "plain": plain.summary(),
            "graph": embedded.summary(),
            "timed": timed,
            "stats": stats.as_dict(),
            "graph_stats": estats.as_dict(),
            "match": ok,
            "errors": errors[:10],
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
