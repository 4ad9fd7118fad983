"""CI's instruction-count gate: a merged step may not grow past its stored ceiling.

Usage:
    python bench/instr_gate.py                   # count every case, compare, exit 1 if over
    python bench/instr_gate.py --cases n8,n32    # some of the cases
    python bench/instr_gate.py --record          # store what it counts as the references

Each case is one ``bench/probes/instr_step.py`` measurement (callgrind: the
instructions of one step, 520 minus 20 steps over 500, against a no-op driver): the
decode mix at N = 8, 32 and 128 from NumPy sources, the same from torch CPU tensors,
N = 32 unchanged buffer updates (``--skip``), and N = 32 plain copies (``--plain``: a plan
that merges nothing, the compiled eager path). ``bench/instr_thresholds.json`` holds
each case's reference count and its ceiling (the reference + 10 %); a count over its
ceiling fails the gate, and so does a case the file lacks or a case it holds that was
not counted. Counts repeat to a few in ten thousand on one machine, so the 10 % is room
for the toolchain and library versions of a fresh CI machine, not noise. Needs valgrind
and gcc (``.ci/instr_gate`` installs valgrind), torch for the torch cases, and the
compiled twin (``pip install -e .``). The cases run side by side on the machine's cores:
instruction counts don't depend on the load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

THRESHOLDS = Path(__file__).resolve().parent / "instr_thresholds.json"
MARGIN = 0.10  # a ceiling is the reference + 10 %

# name -> (N, instr_step's options: skip, torch sources, plain: nothing merged)
CASES: dict[str, tuple[int, bool, bool, bool]] = {
    "n8": (8, False, False, False),
    "n32": (32, False, False, False),
    "n128": (128, False, False, False),
    "n8-torch": (8, False, True, False),
    "n32-torch": (32, False, True, False),
    "n128-torch": (128, False, True, False),
    "n32-skip": (32, True, False, False),
    "n32-plain": (32, False, False, True),  # the compiled eager path (issue 29)
}


class GateError(Exception):
    """The thresholds and the counted cases don't line up (a case missing on a side)."""


def ceiling_of(reference: float, margin: float = MARGIN) -> int:
    """The allowed count for a reference: ``margin`` above it, rounded down."""
    return int(reference * (1 + margin))


def compare(counts: dict[str, float], thresholds: dict) -> list[dict]:
    """One row per case: its count, reference, ceiling, change and whether it passes.

    ``thresholds`` is the file's ``cases`` table (name -> reference and ceiling). Raises
    :class:`GateError` when a counted case has no threshold or a threshold no count.
    """
    missing = sorted(set(thresholds) - set(counts))
    unknown = sorted(set(counts) - set(thresholds))
    if missing or unknown:
        raise GateError(
            "cases and thresholds differ:"
            + (f" not counted: {', '.join(missing)}" if missing else "")
            + (f" no threshold: {', '.join(unknown)}" if unknown else "")
        )
    rows = []
    for name in sorted(counts, key=lambda k: list(CASES).index(k) if k in CASES else len(CASES)):
        t = thresholds[name]
        ref, ceil, got = float(t["reference"]), float(t["ceiling"]), float(counts[name])
        rows.append(
            {
                "case": name,
                "count": got,
                "reference": ref,
                "ceiling": ceil,
                "change": (got - ref) / ref if ref else float("inf"),
                "ok": got <= ceil,
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    """The rows as printed: one line a case, FAIL where a count passed its ceiling."""
    lines = [f"{'case':<11} {'count':>9} {'reference':>10} {'ceiling':>9} {'change':>8}"]
    for r in rows:
        lines.append(
            f"{r['case']:<11} {r['count']:9.0f} {r['reference']:10.0f} {r['ceiling']:9.0f}"
            f" {r['change']:+8.1%}  {'ok' if r['ok'] else 'FAIL: over the ceiling'}"
        )
    return "\n".join(lines)


def load(path: Path = THRESHOLDS) -> dict:
    """The ``cases`` table of a thresholds file."""
    return json.loads(path.read_text())["cases"]


def count(names: list[str], jobs: int | None = None) -> dict[str, float]:
    """Instructions of one step for each named case (valgrind, side by side)."""
    from bench.probes import instr_step as probe

    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        lib = probe._noop_lib(where)
        runs = [(name, steps) for name in names for steps in (probe.SHORT, probe.LONG)]

        def one(run):
            name, steps = run
            n, skip, torch_src, plain = CASES[name]
            out = where / f"{name}-{steps}.out"
            return probe._count(n, steps, lib, out, True, "auto", skip, torch_src, plain)

        with ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
            got = dict(zip(runs, pool.map(one, runs)))
    span = probe.LONG - probe.SHORT
    return {name: (got[(name, probe.LONG)] - got[(name, probe.SHORT)]) / span for name in names}


def record(counts: dict[str, float], path: Path, note: str) -> None:
    """Store ``counts`` as the references (ceiling: + MARGIN)."""
    cases = {
        name: {"reference": round(v), "ceiling": ceiling_of(round(v))} for name, v in counts.items()
    }
    body = {"note": note, "margin": MARGIN, "cases": cases}
    path.write_text(json.dumps(body, indent=2) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=None, help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--thresholds", type=Path, default=THRESHOLDS)
    ap.add_argument("--jobs", type=int, default=None, help="valgrind runs side by side")
    ap.add_argument("--record", action="store_true", help="store the counts as references")
    ap.add_argument("--note", default="", help="with --record: where the counts come from")
    args = ap.parse_args(argv)
    names = args.cases.split(",") if args.cases else list(CASES)
    bad = [n for n in names if n not in CASES]
    if bad:
        ap.error(f"unknown cases: {', '.join(bad)}")
    start = time.monotonic()
    counts = count(names, args.jobs)
    took = time.monotonic() - start
    if args.record:
        record(counts, args.thresholds, args.note)
        print(f"instr_gate: recorded {len(counts)} cases in {args.thresholds.name}")
    thresholds = load(args.thresholds)
    if args.cases:  # a chosen subset is compared against its own thresholds
        thresholds = {k: v for k, v in thresholds.items() if k in counts}
    try:
        rows = compare(counts, thresholds)
    except GateError as e:
        print(f"instr_gate: {e}", file=sys.stderr)
        return 2
    print(table(rows))
    failed = [r["case"] for r in rows if not r["ok"]]
    print(
        f"instr_gate: {len(rows) - len(failed)} passed, {len(failed)} failed"
        f" ({took:.0f} s counting)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
