"""cucopy ``dma``, ``mapped`` and ``inline`` flushes as the segment grows: which wins where?

Usage:
    python bench/size_sweep.py [--table-min 1024] [--table-max 1048576] [--tiny 32]
                               [--reps 200] [--sim] [--quick] [--json PATH]

Each step copies one large table (swept from ``--table-min`` to ``--table-max`` bytes
in steps of about x1.41) plus ``--tiny`` vectors of 16-64 B, all merged into one
segment. ``dma`` uploads the segment with one H2D copy and launches the scatter on the
device copy; ``mapped`` launches the scatter on the pinned segment itself (it reads
host memory over the bus; the header and table travel in the launch's parameters);
``inline`` carries the whole segment in the launch's parameters up to 32 KiB and
falls back to ``auto`` past that (``segment_modes`` in the JSON says what ran). Measured per size and mode: GPU µs per step with the
stream held (CUDA events, no host launch gaps) and host µs per step.

The crossover is the smallest segment (bytes, as ``flush_mode="auto"`` compares:
header + descriptors + data) from which ``dma`` is faster on the GPU at every larger
size; the suggested ``mapped_threshold`` is the largest segment measured below it,
printed as the ``{"sm_XY": bytes}`` entry for ``cucopy/backends/crossover.json``.
Host time is nearly the same for both (dma adds one ``cudaMemcpyAsync``) and does not
enter the choice. On the simulated device only host time is real: no crossover.
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

NAME = "size_sweep"
MODES = ("dma", "mapped", "inline")


def table_sizes(lo: int, hi: int) -> list[int]:
    """Sizes from ``lo`` to ``hi`` bytes, about x1.41 apart, multiples of 256 B (or ``lo``)."""
    out = []
    x = float(lo)
    while x <= hi * 1.0001:
        v = int(round(x / 256) * 256) if x >= 256 else int(x)
        if not out or v > out[-1]:
            out.append(v)
        x *= 2**0.5
    if out[-1] != hi:
        out.append(hi)
    return out


def sweep_mix(table_bytes: int, tiny: int, seed: int = 0) -> list[tuple[int, str]]:
    """One int32 table of ``table_bytes`` plus ``tiny`` int32 vectors of 16-64 B."""
    rng = np.random.default_rng([seed, tiny])
    mix = [(max(1, table_bytes // 4), "int32")]
    mix += [(int(k), "int32") for k in rng.integers(4, 17, size=tiny)]
    return mix


def crossover(points: list[dict]) -> dict:
    """Where ``dma`` starts to win, from rows with ``segment_bytes``, ``dma_us``, ``mapped_us``.

    Returns
    -------
    dict
        ``crossover_segment_bytes`` (None when mapped wins everywhere),
        ``suggested_mapped_threshold`` (bytes; 0 when dma wins everywhere) and ``why``.
    """
    pts = sorted(
        (p for p in points if p["dma_us"] is not None and p["mapped_us"] is not None),
        key=lambda p: p["segment_bytes"],
    )
    if not pts:
        return {
            "crossover_segment_bytes": None,
            "suggested_mapped_threshold": None,
            "why": "no GPU times",
        }
    wins = [p["dma_us"] < p["mapped_us"] for p in pts]
    i = len(pts)
    while i > 0 and wins[i - 1]:
        i -= 1  # pts[i:] is the longest tail where dma wins at every size
    if i == len(pts):
        return {
            "crossover_segment_bytes": None,
            "suggested_mapped_threshold": pts[-1]["segment_bytes"],
            "why": "mapped was faster up to the largest segment measured",
        }
    if i == 0:
        return {
            "crossover_segment_bytes": pts[0]["segment_bytes"],
            "suggested_mapped_threshold": 0,
            "why": "dma was faster at every size measured",
        }
    return {
        "crossover_segment_bytes": pts[i]["segment_bytes"],
        "suggested_mapped_threshold": pts[i - 1]["segment_bytes"],
        "why": "largest segment measured at which mapped is not slower, below the crossover",
    }


#: What each column's flush mode does (printed under the table).
MODE_LEGEND = {
    "dma": "cucopy flush_mode='dma': one H2D of the segment + one scatter",
    "mapped": "cucopy flush_mode='mapped': one scatter reading the data from mapped pinned memory",
    "inline": "cucopy flush_mode='inline': the segment carried in the launch (<= 32 KiB, else auto)",
}


def jobs(ctx, sizes) -> int:
    """Measurement jobs :func:`run` reports to the progress bar."""
    return len(sizes)


def run(
    ctx,
    sizes,
    tiny: int,
    reps: int,
    warmup: int,
    progress=None,
    seed: int = 0,
) -> dict:
    """Measure dma and mapped flushes for each table size.

    Parameters
    ----------
    ctx : bench._device.Context
    sizes : sequence of int
        Table sizes in bytes.
    tiny : int
        Tiny vectors per step besides the table.
    reps, warmup : int
    progress : bench._common.Progress, optional
    seed : int

    Returns
    -------
    dict
        ``results`` (one row per size and mode), ``points`` (per size: segment bytes and
        both modes' GPU medians), ``crossover``, ``notes``.
    """
    progress = progress or common.Progress(enabled=False)
    progress.add(jobs(ctx, sizes))
    out = {
        "device": common.device_label(ctx),
        "config": {"tiny": tiny, "sizes": list(sizes)},
        "results": [],
        "points": [],
        "notes": [],
    }
    classes = {
        "dma": devmod.CucopyDma,
        "mapped": devmod.CucopyMapped,
        "inline": devmod.CucopyInline,
    }
    for size in sizes:
        mix = sweep_mix(size, tiny, seed)
        wl = devmod.Workload(ctx, mix, seed)
        point = {"table_bytes": size, "total_bytes": wl.nbytes, "segment_bytes": None}
        for mode in MODES:
            notes = []
            c = devmod.build(classes[mode], ctx, wl, notes)
            row = {"mode": mode, "table_bytes": size, "total_bytes": wl.nbytes}
            if c is not None:
                try:
                    r = devmod.measure(ctx, c, reps, warmup)
                    notes.extend(r.pop("notes"))
                    row.update(r)
                    segs = r.get("segments_per_step") or 0
                    if segs:
                        point["segment_bytes"] = int(r["bytes_staged_per_step"] / segs)
                    if segs != 1:
                        notes.append(f"{segs:g} segments per step, expected 1")
                except Exception as e:
                    notes.append(f"measurement failed: {e!r}")
                finally:
                    c.close()
            row["notes"] = notes
            out["notes"].extend(f"{size} B {mode}: {n}" for n in notes)
            out["results"].append(row)
            g = row.get("gpu_us")
            point[f"{mode}_us"] = g["median"] if g else None
            point[f"{mode}_host_us"] = row["host_us"]["median"] if row.get("host_us") else None
        out["points"].append(point)
        progress.advance(f"{NAME} {size} B")
    if ctx.kind == "gpu":
        out["crossover"] = crossover(out["points"])
        try:
            arch = "sm_" + ctx.cp.cuda.Device(ctx.device).compute_capability
        except Exception:
            arch = "sm_??"
        out["crossover"]["arch"] = arch
        out["crossover"]["current_threshold"] = ctx.mapped_threshold()
    else:
        out["crossover"] = None
        out["notes"].append("simulated device: host time only; the crossover needs a GPU")
    return out


HEADER = [
    "table B",
    "segment B",
    "dma GPU us",
    "mapped GPU us",
    "inline GPU us",
    "dma host us",
    "mapped host us",
    "inline host us",
]


def report(result: dict) -> str:
    """The scenario's table, crossover and notes as text."""
    by = {(r["table_bytes"], r["mode"]): r for r in result["results"]}
    rows = []
    for p in result["points"]:
        got = [by.get((p["table_bytes"], mode), {}) for mode in MODES]
        rows.append(
            [str(p["table_bytes"]), str(p["segment_bytes"])]
            + [common.fmt_stat(r.get("gpu_us"), digits=1) for r in got]
            + [common.fmt_stat(r.get("host_us"), digits=1) for r in got]
        )
    lines = [common.table(rows, HEADER)]
    x = result.get("crossover")
    if x and x.get("suggested_mapped_threshold") is not None:
        where = (
            f"dma faster from a {x['crossover_segment_bytes']} B segment on"
            if x["crossover_segment_bytes"] is not None
            else "no crossover in the sweep"
        )
        lines.append(
            f"crossover: {where} ({x['why']}); suggested mapped_threshold = "
            f"{x['suggested_mapped_threshold']} bytes; crossover.json entry: "
            f'{{"{x["arch"]}": {x["suggested_mapped_threshold"]}}} '
            f"(in use now: {x['current_threshold']})"
        )
    lines.append(common.legend(MODE_LEGEND))
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines)


def plot(result: dict, stem: Path) -> list[Path]:
    """``<stem>-size_sweep.png``: GPU (or host) µs per step vs segment bytes, both modes."""
    plt = common.pyplot()
    if plt is None or not result["points"]:
        return []
    gpu = any(p.get("dma_us") is not None for p in result["points"])
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for i, mode in enumerate(MODES):
        xs, ys, lo, hi = [], [], [], []
        for r in result["results"]:
            s = r.get("gpu_us" if gpu else "host_us")
            if r["mode"] != mode or not s or s.get("median") is None:
                continue
            seg = next(
                p["segment_bytes"] for p in result["points"] if p["table_bytes"] == r["table_bytes"]
            )
            xs.append(seg or r["total_bytes"])
            ys.append(s["median"])
            lo.append(s["median"] - s["p10"])
            hi.append(s["p90"] - s["median"])
        xs = common.dodge(xs, i, len(MODES))
        ax.errorbar(xs, ys, yerr=[lo, hi], label=mode, **common.line_style(i))
    x = result.get("crossover")
    if x and x.get("crossover_segment_bytes"):
        ax.axvline(x["crossover_segment_bytes"], color="gray", ls="--", label="crossover")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("segment bytes (one table + tiny vectors)")
    ax.set_ylabel(("GPU" if gpu else "host") + " µs per step (median, p10-p90)")
    ax.set_title(
        common.plot_title(
            "size_sweep: one merged segment, dma vs mapped vs inline", result.get("device", "")
        ),
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return common.save_plot(fig, stem, NAME)


def main(argv=None) -> int:
    """Run the scenario alone; print its table and crossover; optionally write JSON."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--table-min", type=int, default=1024, help="smallest table, bytes")
    p.add_argument("--table-max", type=int, default=1 << 20, help="largest table, bytes")
    p.add_argument("--tiny", type=int, default=32, help="tiny vectors besides the table")
    common.add_run_args(p)
    args = p.parse_args(argv)
    ctx = devmod.make_context(args.sim, args.seed)
    reps, warmup = common.reps_for(ctx, args)
    hi = min(args.table_max, 16 << 10) if args.quick else args.table_max
    sizes = table_sizes(args.table_min, hi)
    return common.run_script(
        ctx,
        args,
        NAME,
        lambda prog: run(ctx, sizes, args.tiny, reps, warmup, prog, args.seed),
        report,
    )


if __name__ == "__main__":
    sys.exit(main())
