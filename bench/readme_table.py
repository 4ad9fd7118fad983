"""The README's results table, generated from a stored run's bench JSON.

Usage:
    python bench/readme_table.py [RUN_FOLDER]     # default: the latest stored H200 run

Prints the Markdown table of ``README.md`` (## Results on an H200): per contender,
GPU µs per step (host µs per copy) at each N of ``step_cost``, then the decode loop's
GPU gap, pipelined and synced. ``tests/test_readme.py`` checks the README's table is
this script's output for the latest stored run, so the table cannot drift from the
run it names.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

# (contender, label) in the README's order; the bold row is the default mode
ROWS = (
    ("none", "no copies (the floor)"),
    ("one_launch", "one launch of one 4-byte copy, nothing staged (a merged step's floor)"),
    ("torch_chain", "chained torch `copy_(non_blocking=True)`"),
    ("memcpy_chain", "chained `cudaMemcpyAsync`"),
    ("torch_foreach", "`torch._foreach_copy_`"),
    ("batch_memcpy", "one `cudaMemcpyBatchAsync`, settled sources"),
    ("batch_refill", "the same, sources refilled each step"),
    ("pinned_buffers", "a pinned buffer per input, refilled + `copy_` (vLLM)"),
    ("cucopy_chained", "cucopy, nothing merged"),
    ("cucopy_dma", "cucopy `dma`"),
    ("cucopy_mapped", "cucopy `mapped`"),
    ("cucopy_inline", "cucopy `inline`"),
    ("cucopy_auto", "**cucopy `auto`**"),
    ("cucopy_pinned_src", "cucopy `auto`, sources in pinned torch tensors"),
    ("cucopy_graph", "cucopy graph feed (copies landed by a node inside the graph)"),
)


def latest_run(results: Path = RESULTS) -> Path:
    """The stored H200 run folder with the highest run number that holds a bench result
    (a run of a few probes only, without ``python -m bench``, has no table)."""
    runs = []
    for p in results.iterdir():
        m = re.fullmatch(r"\d{4}-\d{2}-\d{2}-h200\w*-run(\d+)", p.name)
        if m and p.is_dir() and any(p.glob("*-nvidia-*.json")):
            runs.append((int(m.group(1)), p))
    return max(runs)[1]


def table(run: Path) -> str:
    """The Markdown table for the bench JSON in ``run``.

    Parameters
    ----------
    run : pathlib.Path
        A stored run folder holding one ``*-nvidia-*.json`` bench result.

    Returns
    -------
    str
    """
    (path,) = sorted(run.glob("*-nvidia-*.json"))
    doc = json.loads(path.read_text())
    sc = doc["scenarios"]["step_cost"]
    ns = sorted({r["n"] for r in sc["results"]})
    cells: dict = {}
    for r in sc["results"]:
        if r.get("gpu_us") and r.get("host_us_per_copy"):
            gpu = r["gpu_us"]["median"]
            host = r["host_us_per_copy"]["median"]
            cells[(r["contender"], r["n"])] = f"{gpu:.1f} ({host:.2f})"
    loop = {}
    for r in doc["scenarios"].get("decode_loop", {}).get("results", []):
        if r.get("gap_us"):
            loop[(r["contender"], r["mode"])] = f"{r['gap_us']['median']:.1f}"
    head = ["per step", *(f"N = {n}" for n in ns)]
    head += ["decode loop, pipelined", "decode loop, synced"]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|--:" * (len(head) - 1) + "|"]
    for name, label in ROWS:
        row = [cells.get((name, n), "") for n in ns]
        row += [loop.get((name, "pipelined"), ""), loop.get((name, "synced"), "")]
        if not any(row):
            continue
        lines.append("| " + " | ".join([label, *row]) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    """Print the table for the run folder given, or the latest stored run."""
    argv = sys.argv[1:] if argv is None else argv
    run = Path(argv[0]) if argv else latest_run()
    print(table(run))


if __name__ == "__main__":
    main()
