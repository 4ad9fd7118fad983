"""What each read of another library's internals saves a merged step, on the GPU's host.

Usage:
    python bench/probes/foreign_reads.py [--n 8,32,128] [--blocks 150] [--steps 50]

Question: do the compiled core's direct reads of NumPy's and torch's internals
(``cucopy/_core/foreign.c``: an exact ndarray's fields; a fingerprint's native getters,
torch's AOTI C shim; the handle word a tensor holds; its key-set flag word) pay for
themselves against the public path each falls back to (the dtype attribute and the
buffer protocol; the spec's Python calls; the ``_cdata`` attribute; ``is_conj()`` and
``is_neg()``)? In one process, two copiers of the same step (``ab_step.py``'s:
``begin()`` + N merged copies of ``bench._common.decode_mix`` + ``flush()`` into torch
CUDA tensors, after a drained stream): one with every read, one with a read turned off
(``cucopy._segment._set_foreign``), blocks of ``--steps`` steps alternated
``--blocks`` times, the order swapped every pair. The answer per read and N is the
median of the per-pair ratios (public path / foreign read): above 1, the read saves
that much. NumPy sources for the NumPy read, pinned torch sources for the others.
Host time only. Prints one JSON line. Answer:
``bench/results/2026-12-03-h200-foreign-reads/``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

#: (name, bit, sources)
READS = [
    ("numpy_fields", 1, "numpy"),
    ("native_getters", 2, "torch"),
    ("handle_word", 4, "torch"),
    ("flag_word", 8, "torch"),
]
ALL = 15


def _side(cc, mix, src, stream):
    """``ab_inproc``'s merged step from ``cc``: (median µs of ``steps`` steps, check)."""
    from bench.probes.ab_inproc import _make

    run_ns, check, c = _make(cc, mix, src, stream)

    def run(steps):
        return statistics.median(run_ns(steps)) / 1e3

    def done():
        check()  # (raises when a destination is wrong)
        c.close()

    return run, done


def main(argv=None) -> int:
    """Run the probe; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="8,32,128")
    ap.add_argument("--blocks", type=int, default=150)
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args(argv)
    import torch

    import cucopy as cc
    from bench._common import decode_mix
    from cucopy import _segment

    stream = torch.cuda.Stream()
    out = {"reads": {}}
    for name, bit, src in READS:
        out["reads"][name] = {}
        for n in (int(x) for x in args.n.split(",")):
            sides = {}
            for label, bits in (("foreign", ALL), ("public", ALL & ~bit)):
                _segment._set_foreign(bits)
                run, check = _side(cc, decode_mix(n), src, stream)
                run(200)  # warm: its cache entries made under its bits
                sides[label] = (bits, run, check)
            ratios, meds = [], {"foreign": [], "public": []}
            for b in range(args.blocks):
                got = {}
                order = ("foreign", "public") if b % 2 == 0 else ("public", "foreign")
                for label in order:
                    bits, run, _ = sides[label]
                    _segment._set_foreign(bits)
                    got[label] = run(args.steps)
                    meds[label].append(got[label])
                ratios.append(got["public"] / got["foreign"])
            for _, _, check in sides.values():
                check()
            q = statistics.quantiles(ratios, n=4)
            out["reads"][name][str(n)] = {
                "src": src,
                "foreign_step_us": statistics.median(meds["foreign"]),
                "public_step_us": statistics.median(meds["public"]),
                "ratio_median": statistics.median(ratios),
                "ratio_q1": q[0],
                "ratio_q3": q[2],
            }
    _segment._set_foreign(ALL)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
