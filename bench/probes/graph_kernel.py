"""Which graphed scatter kernel costs the GPU least: how the block shares the descriptors,
and how many bytes one graphed launch reads.

Usage:
    python bench/probes/graph_kernel.py [--variants off,warp8k,block8k,block32k]
                                        [--rounds 2] [--n 8,32] [--reps 120] [--json PATH]

Question: session 11's graphed launch (``flush_mode="mapped"``, a one-node CUDA graph
per slot whose kernel, ``cucopy_scatter_w8k``, reads the slot's first 8 KiB of mapped
memory into shared memory) saved about a quarter of an N = 8 step's host time but took
6.2-6.4 µs of GPU time against 4.1-4.3 for the carried launch, where the launch floor
probe's graphed kernel of the same bytes took 4.9. Its kernel ran one descriptor a
warp (a 4 KiB input is 8 windows a lane, one after another). Is the whole block on
each descriptor (``CUCOPY_GRAPH_SPREAD=1``) faster, and would a graph that reads 16 or
32 KiB (``CUCOPY_GRAPH_CAP``, ``pack.GRAPH_CAPACITY``) take N = 32's 20 KiB step off
the carried launch (host 5.3 µs for 20 KB of parameters against 1.3-1.8 for a graph
launch) without costing the GPU more?

Each variant runs in a process of its own (the CUDA backend builds its kernels once a
process): the kernel source gets the variant's ``#define`` lines first and
``pack.GRAPH_CAPACITY`` is set to match, then ``bench/step_cost.py`` measures
``cucopy_mapped`` and ``cucopy_auto`` (graphed where the segment fits; ``auto`` since
session 12), ``cucopy_inline`` (carried) and the batch API at each N: host µs a copy
and GPU µs a step behind a held stream, as the bench does. ``off`` is the unpatched
kernel with ``CUCOPY_NO_GRAPHS=1`` (``mapped`` and ``auto`` without graphs); ``nont``
the tree's code with ``CUCOPY_NO_NT=1`` (no streaming stores into the staging slots,
session 12: what they save the GPU's reads of a segment the host has just written). Variants alternate within a round, the order reversed every other
round, so the host's spells fall on all of them. Needs a GPU.
Answer: ``bench/results/`` (session 12's run with this probe, ``graph_kernel.*``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ROOT = Path(__file__).resolve().parents[2]

#: name -> what the variant changes: ``spread`` and ``cap`` (the graphed kernel's
#: CUCOPY_GRAPH_SPREAD and CUCOPY_GRAPH_CAP, pack.GRAPH_CAPACITY to match) and ``env``
#: (set before cucopy is imported)
VARIANTS: dict[str, dict] = {
    "off": {"env": {"CUCOPY_NO_GRAPHS": "1"}},
    "warp8k": {"spread": 0, "cap": 8192},
    "block8k": {"spread": 1, "cap": 8192},
    "block16k": {"spread": 1, "cap": 16384},
    "block32k": {"spread": 1, "cap": 32768},
    "nont": {"env": {"CUCOPY_NO_NT": "1"}},
}

CONTENDERS = "cucopy_mapped,cucopy_auto,cucopy_inline,batch_memcpy"


def patch(variant: str) -> None:
    """Make this process's copiers run ``variant`` (before anything imports cucopy)."""
    spec = VARIANTS[variant]
    os.environ.update(spec.get("env", {}))
    if "cap" not in spec:
        return
    spread, cap = spec["spread"], spec["cap"]
    from cucopy import kernels, pack

    original = kernels.source
    prefix = f"#define CUCOPY_GRAPH_SPREAD {spread}\n#define CUCOPY_GRAPH_CAP {cap}u\n"

    def source(entry_points=None):
        # only the graphed kernel's build changes: the others keep their cached builds
        text = original(entry_points)
        if entry_points is None or pack.GRAPH_ENTRY_POINT in entry_points:
            return prefix + text
        return text

    kernels.source = source
    pack.GRAPH_CAPACITY = cap


def inner(variant: str, n: str, reps: int, out: str) -> int:
    """Measure one variant in this process (what the outer loop runs)."""
    patch(variant)
    from bench import step_cost

    args = ["--n", n, "--reps", str(reps), "--contenders", CONTENDERS, "--no-progress"]
    return step_cost.main([*args, "--json", out])


def rows_of(path: str) -> list[dict]:
    """The step-cost rows of one inner run's JSON."""
    data = json.loads(Path(path).read_text())
    return data["scenarios"]["step_cost"]["results"]


def main(argv=None) -> int:
    """Run every variant in alternating processes; print and optionally store the medians."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--variants", default="off,warp8k,block8k,block32k")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--n", default="8,32")
    p.add_argument("--reps", type=int, default=120)
    p.add_argument("--json", default=None)
    p.add_argument("--inner", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.inner:
        return inner(args.inner, args.n, args.reps, args.out)
    names = [v for v in args.variants.split(",") if v]
    for v in names:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}: one of {', '.join(VARIANTS)}")
    runs = []
    env = None
    rc = 0
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for v in order:
                out = str(Path(tmp) / f"{v}-{r}.json")
                cmd = [sys.executable, __file__, "--inner", v, "--n", args.n]
                cmd += ["--reps", str(args.reps), "--out", out]
                done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
                if done.returncode != 0 or not Path(out).exists():
                    print(f"round {r} {v}: rc {done.returncode}\n{done.stdout[-2000:]}")
                    print(done.stderr[-4000:])
                    rc = 1
                    continue
                data = json.loads(Path(out).read_text())
                for row in rows_of(out):
                    host = row.get("host_us_per_copy") or {}
                    gpu = row.get("gpu_us") or {}
                    runs.append(
                        {
                            "round": r,
                            "variant": v,
                            "contender": row["contender"],
                            "n": row["n"],
                            "host_us_per_copy": host.get("median"),
                            "gpu_us": gpu.get("median"),
                            "gpu_samples": gpu.get("samples"),
                            "host_samples": host.get("samples"),
                        }
                    )
                    print(
                        f"round {r} {v:9s} {row['contender']:14s} N={row['n']:<4d}"
                        f" host {host.get('median', float('nan')):6.2f} us/copy"
                        f"  GPU {gpu.get('median', float('nan')):6.2f} us",
                        flush=True,
                    )
                env = data.get("environment")
    print("\nmedians over rounds (host us a copy / GPU us a step):")
    keys = sorted({(x["variant"], x["contender"], x["n"]) for x in runs}, key=str)
    for v, c, n in keys:
        xs = [x for x in runs if (x["variant"], x["contender"], x["n"]) == (v, c, n)]
        h = statistics.median(x["host_us_per_copy"] for x in xs)
        g = statistics.median(x["gpu_us"] for x in xs if x["gpu_us"] is not None)
        print(f"{v:9s} {c:14s} N={n:<4d} host {h:6.2f}  GPU {g:6.2f}")
    if args.json:
        doc: dict = {"probe": "graph_kernel", "variants": {v: VARIANTS[v] for v in names}}
        doc["environment"] = env
        doc["runs"] = runs
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main())
