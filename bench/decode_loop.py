"""GPU idle gap between CUDA graph replays when each step's copies go through each contender.

Usage:
    python bench/decode_loop.py [--n 32] [--steps 200] [--replay-us 1000]
                                [--modes pipelined,synced] [--contenders a,b,...]
                                [--quick] [--json PATH]

A captured CUDA graph of about ``--replay-us`` of work (one spin kernel of fixed
duration that stamps its own start and end with ``%globaltimer``) stands in for a
decode step's model. Between two replays the step's N copies (the decode-like mix of
``step_cost``) go through one contender; ``none`` issues no copies, for the floor.

Modes:
- ``pipelined``: the host never waits; it enqueues replay, copies, replay, ... and runs
  ahead (cucopy's ring throttles it at ``slots`` steps). The gap is then the GPU time
  of the step's copies plus the per-operation overheads between them.
- ``synced``: the host synchronizes after each replay (as a loop that reads the sampled
  token would), then issues the copies and the next replay: the gap adds the host's
  issue time and the launch latencies.

Reported per contender and mode: the GPU idle gap (start of replay k+1 minus end of
replay k, from the kernel's own timestamps; median and p10-p90 over ``--steps``) and
the wall time per step. Needs a GPU: on the simulated device it reports nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` and ``cucopy`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench import _common as common  # noqa: E402
from bench import _device as devmod  # noqa: E402

NAME = "decode_loop"
MODES = ("pipelined", "synced")
WARM_STEPS = 5  # dropped from each loop: the first replays warm caches and queues

_REPLAY_SOURCE = r"""
extern "C" __global__ void bench_replay(unsigned long long* stamps, unsigned int* counter,
                                        unsigned long long ns, unsigned int cap)
{
    unsigned long long t0, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    unsigned int k = atomicAdd(counter, 1u);
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - t0 < ns);
    if (k < cap) {
        stamps[2 * k] = t0;
        stamps[2 * k + 1] = now;
    }
}
"""


class _FedGraph:
    """The replay graph of a contender that captured it around its own scatter node."""

    def __init__(self, graph: ReplayGraph, contender):
        self.reset = graph.reset
        self.gaps_us = graph.gaps_us
        self.launch = contender.launch


class NoCopies(devmod.Contender):
    """The floor: replays back to back, no copies between them."""

    name = "none"
    description = "no copies between replays (the floor)"
    writes = False

    def step(self):
        pass

    def work_ops(self, steps):
        return 0.0


class ReplayGraph:
    """A captured graph of one fixed-duration kernel that stamps each replay's start and end.

    Parameters
    ----------
    ctx : bench._device.GpuContext
    duration_us : float
        How long one replay spins.
    cap : int
        Replays stamped before :meth:`reset` (later ones run but are not stamped).
    """

    def __init__(self, ctx, duration_us: float, cap: int):
        cp = ctx.cp
        self.ctx = ctx
        self.cap = cap
        self.stamps = cp.zeros(2 * cap, dtype=cp.uint64)
        self.counter = cp.zeros(1, dtype=cp.uint32)
        kernel = cp.RawKernel(_REPLAY_SOURCE, "bench_replay")
        args = (self.stamps, self.counter, np.uint64(int(duration_us * 1e3)), np.uint32(cap))
        self._kernel, self._args = kernel, args
        side = cp.cuda.Stream(non_blocking=True)
        with side:
            kernel((1,), (1,), args)  # compile and load before capture
        side.synchronize()
        side.begin_capture()
        try:
            self.body(side)
        finally:
            graph = side.end_capture()
        self.graph = graph
        self.reset()

    def body(self, stream) -> None:
        """Launch the replay's work on ``stream`` (into a capture)."""
        with stream:
            self._kernel((1,), (1,), self._args)

    def reset(self) -> None:
        """Forget the stamps."""
        self.counter.fill(0)
        self.stamps.fill(0)
        self.ctx.sync()

    def launch(self) -> None:
        """Enqueue one replay on the context's stream."""
        self.graph.launch(self.ctx.cp_stream)

    def gaps_us(self, replays: int) -> list[float]:
        """Idle µs between consecutive replays (``replays - 1`` values)."""
        self.ctx.sync()
        s = self.ctx.cp.asnumpy(self.stamps[: 2 * min(replays, self.cap)]).reshape(-1, 2)
        s = s.astype(np.int64)
        return ((s[1:, 0] - s[:-1, 1]) / 1e3).tolist()


def loop(ctx, graph: ReplayGraph, step, steps: int, synced: bool) -> tuple[list[float], float]:
    """Replay, copies, replay, ...; return the gaps (µs) and the wall µs per step."""
    graph.reset()
    sync = ctx.sync
    t0 = common.perf_ns()
    for _ in range(steps):
        graph.launch()
        if synced:
            sync()
        step()
    graph.launch()
    sync()
    wall = (common.perf_ns() - t0) / 1e3 / steps
    return graph.gaps_us(steps + 1)[WARM_STEPS:], wall


#: What each mode of the loop means (printed under the table).
MODE_LEGEND = {
    "pipelined": "the host never waits and runs ahead: the gap is the copies' GPU cost",
    "synced": "the host synchronizes after each replay: the gap adds its issue time",
}


def jobs(ctx, contenders=None) -> int:
    """Measurement jobs :func:`run` reports to the progress bar (none without a GPU)."""
    if ctx.kind != "gpu":
        return 0
    return len(_classes(contenders))


def _classes(contenders=None) -> list:
    """The contender classes :func:`run` measures, in order (the floor always)."""
    classes = [NoCopies, *devmod.ALL, devmod.CucopyGraphFeed]
    return [c for c in classes if contenders is None or c.name in contenders or c is NoCopies]


def run(
    ctx,
    n: int = 32,
    steps: int = 200,
    replay_us: float = 1000.0,
    modes=MODES,
    progress=None,
    contenders=None,
    seed: int = 0,
) -> dict:
    """Measure the gap between replays for each contender and mode.

    Parameters
    ----------
    ctx : bench._device.Context
    n : int
        Copies per step.
    steps : int
        Replays per loop.
    replay_us : float
        Duration of one replay.
    modes : sequence of {"pipelined", "synced"}
    progress : bench._common.Progress, optional
    contenders : sequence of str, optional
    seed : int

    Returns
    -------
    dict
        ``results`` (one row per contender and mode), ``config``, ``notes``.
    """
    out = {
        "device": common.device_label(ctx),
        "config": {"n": n, "steps": steps, "replay_us": replay_us, "modes": list(modes)},
        "results": [],
        "notes": [],
        "contenders": {},
    }
    if ctx.kind != "gpu":
        out["notes"].append("needs a GPU: nothing measured on the simulated device")
        return out
    classes = _classes(contenders)
    progress = progress or common.Progress(enabled=False)
    progress.add(jobs(ctx, contenders))
    try:
        graph = ReplayGraph(ctx, replay_us, steps + 8)
    except Exception as e:
        out["notes"].append(f"could not capture the replay graph: {e!r}")
        progress.advance(f"{NAME}: no graph")
        return out
    mix = common.decode_mix(n, seed)
    out["config"]["total_bytes"] = common.mix_bytes(mix)
    wl = devmod.Workload(ctx, mix, seed)
    for cls in classes:
        out["contenders"][cls.name] = cls.description
        notes = []
        make = cls
        if getattr(cls, "embeds_graph", False):  # captures the replay's work around its node

            def make(ctx, wl, cls=cls):
                return cls(ctx, wl, body=graph.body)

        c = devmod.build(make, ctx, wl, notes)
        if c is not None:
            g = _FedGraph(graph, c) if getattr(cls, "embeds_graph", False) else graph
            try:
                loop(ctx, g, c.step, min(steps, 20), False)  # warm-up
                for mode in modes:
                    if c.copier is not None:
                        c.copier.stats.reset()
                    gaps, wall = loop(ctx, g, c.step, steps, mode == "synced")
                    row = {
                        "contender": cls.name,
                        "mode": mode,
                        "gap_us": common.summarize(gaps),
                        "wall_step_us": wall,
                        "host_waits": c.copier.stats.host_waits if c.copier is not None else None,
                    }
                    out["results"].append(row)
            except Exception as e:
                notes.append(f"loop failed: {e!r}")
            finally:
                c.close()
        out["notes"].extend(f"{cls.name}: {note}" for note in notes)
        progress.advance(f"{NAME} {cls.name}")
    return out


HEADER = ["contender", "mode", "GPU gap us [p10-p90]", "wall us/step", "ring waits"]


def report(result: dict) -> str:
    """The scenario's table and notes as text."""
    rows = [
        [
            r["contender"],
            r["mode"],
            common.fmt_stat(r["gap_us"], digits=1),
            f"{r['wall_step_us']:.1f}",
            "-" if r["host_waits"] is None else str(r["host_waits"]),
        ]
        for r in result["results"]
    ]
    cfg = result["config"]
    lines = [
        f"replay {cfg['replay_us']:.0f} us, N={cfg['n']} copies "
        f"({cfg.get('total_bytes', '?')} bytes) per step, {cfg['steps']} steps"
    ]
    if rows:
        lines.append(common.table(rows, HEADER))
        lines.append(common.legend({**result.get("contenders", {}), **MODE_LEGEND}))
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines)


def plot(result: dict, stem: Path) -> list[Path]:
    """``<stem>-decode_loop.png``: median gap per contender and mode, p10-p90 whiskers."""
    plt = common.pyplot()
    if plt is None or not result["results"]:
        return []
    names = list(dict.fromkeys(r["contender"] for r in result["results"]))
    modes = list(dict.fromkeys(r["mode"] for r in result["results"]))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(names)), 4.5))
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        xs, ys, lo, hi = [], [], [], []
        for i, name in enumerate(names):
            r = next(
                (r for r in result["results"] if r["contender"] == name and r["mode"] == mode),
                None,
            )
            if r is None or r["gap_us"]["median"] is None:
                continue
            g = r["gap_us"]
            xs.append(i + (j - (len(modes) - 1) / 2) * width)
            ys.append(g["median"])
            lo.append(g["median"] - g["p10"])
            hi.append(g["p90"] - g["median"])
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=mode)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("GPU idle between replays, µs (median, p10-p90)")
    what = (
        f"decode loop: {result['config']['n']} copies between "
        f"{result['config']['replay_us']:.0f} µs replays"
    )
    ax.set_title(common.plot_title(what, result.get("device", "")), fontsize=10)
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    return common.save_plot(fig, stem, NAME)


def main(argv=None) -> int:
    """Run the scenario alone; print its table; optionally write JSON."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, default=32, help="copies per step")
    p.add_argument("--steps", type=int, default=None, help="replays per loop (default 200)")
    p.add_argument("--replay-us", type=float, default=1000.0, help="duration of one replay")
    p.add_argument("--modes", default=",".join(MODES), help="pipelined,synced")
    p.add_argument("--contenders", default=None, help="names to run (comma-separated)")
    common.add_run_args(p)
    args = p.parse_args(argv)
    ctx = devmod.make_context(args.sim, args.seed)
    steps = args.steps or (20 if args.quick else 200)
    names = args.contenders.split(",") if args.contenders else None
    modes = args.modes.split(",")
    return common.run_script(
        ctx,
        args,
        NAME,
        lambda prog: run(ctx, args.n, steps, args.replay_us, modes, prog, names, args.seed),
        report,
    )


if __name__ == "__main__":
    sys.exit(main())
