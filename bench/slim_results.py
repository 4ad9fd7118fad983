"""Turn a stored run into its summary: raw samples and plots leave the working tree.

Usage:
    python bench/slim_results.py RUN_FOLDER [RUN_FOLDER ...]

Every JSON file in the folder keeps its tables (each statistic's ``n``, ``median``,
``p10`` and ``p90``), its environment and its source digest; it loses every list of
raw samples (``samples``, ``*_samples``), any list of more than 16 numbers or
strings keeps its first 16 (raw series, per-copy size lists), and its floats keep four
significant figures, written on one line. PNG plots are deleted. The folder's own
README and its logs stay, a log over 64 KiB (a sanitizer's) cut to its first and last
60 lines; ``gpu_session_summary.txt`` keeps its step table (the rest repeats the logs'
tails). Run it on the previous latest run when a new one is stored: ``bench/results``
keeps the latest run in full and a summary of every other (``tests/test_repo.py``
checks the size). The raw records stay in git history (``bench/results/README.md``
says where).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

_KEPT_STATS = ("n", "median", "p10", "p90")
_LONG = 16
_LOG_LINES = 60  # a log over _LOG_BYTES keeps this many lines at each end
_LOG_BYTES = 64 * 1024


def strip_samples(obj):
    """``obj`` without its ``samples`` and ``*_samples`` keys, floats to 4 figures."""
    if isinstance(obj, float):
        return float(f"{obj:.4g}")
    if isinstance(obj, dict) and "median" in obj:
        return {k: strip_samples(v) for k, v in obj.items() if k in _KEPT_STATS}
    if isinstance(obj, dict):
        return {
            k: strip_samples(v)
            for k, v in obj.items()
            if not (k == "samples" or k.endswith("_samples"))
        }
    if isinstance(obj, list):
        if len(obj) > _LONG and all(isinstance(v, (int, float, str)) for v in obj):
            return obj[:_LONG]  # a raw series or a per-copy list: its head shows the shape
        return [strip_samples(v) for v in obj]
    return obj


def slim(run: Path) -> int:
    """Slim one run folder in place; returns the bytes saved."""
    saved = 0
    for path in sorted(run.rglob("*")):
        if path.suffix == ".png":
            saved += path.stat().st_size
            path.unlink()
        elif path.suffix == ".json":
            before = path.stat().st_size
            try:
                doc = json.loads(path.read_text())
            except ValueError:
                continue
            slimmed = strip_samples(doc)
            if slimmed != doc:
                path.write_text(json.dumps(slimmed, separators=(",", ":")) + "\n")
                saved += before - path.stat().st_size
        elif path.suffix == ".log" and path.stat().st_size > _LOG_BYTES:
            before = path.stat().st_size
            lines = path.read_text(errors="replace").splitlines()
            cut = len(lines) - 2 * _LOG_LINES
            if cut > 0:
                kept = [*lines[:_LOG_LINES], f"... ({cut} lines cut) ...", *lines[-_LOG_LINES:]]
                path.write_text("\n".join(kept) + "\n")
                saved += before - path.stat().st_size
        elif path.name == "gpu_session_summary.txt":
            # the step table only: the rest repeats the tails of the logs beside it
            before = path.stat().st_size
            text = path.read_text()
            head = text.split("\n---- ", 1)[0].rstrip("\n") + "\n"
            if len(head) < len(text):
                path.write_text(head + "(the logs' tails: in the run's logs)\n")
                saved += before - path.stat().st_size
    return saved


def main(argv=None) -> None:
    """Slim each folder named on the command line."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        sys.exit(__doc__)
    for name in argv:
        run = Path(name)
        if not run.is_dir():
            sys.exit(f"slim_results: {name!r} is not a run folder")
        print(f"{run}: {slim(run) / 1e6:.1f} MB removed")


if __name__ == "__main__":
    main()
