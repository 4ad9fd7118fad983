"""Where the routed upload of the transformers example spends its host time.

Usage:
    python bench/probes/hf_upload_profile.py [--mode async|sync] [--pairs 2]   # needs a GPU

Question: in ``examples/hf_continuous_batching.py`` the routed upload
(``CucopyRoute.upload``, called from the engine's own thread) cost 214-238 us a step
against 103-110 us for the engine's own ``transfer_inputs_h2d`` (runs 28 and 29,
``hf_async.log``). Which calls take it? Runs ``bench/hf_ab.py`` with every routed upload
under a cProfile profiler (enabled in the calling thread, call by call), then prints the
profile's top entries by own time and the median host us per upload (check mode's run
left out). Answer, first run (``bench/results/2026-12-01-h200-hfprof/``, made before the
check-mode run was left out, so its check-mode reads and syncs are in it): the
``carried`` launch took ~28 us a call from the engine's thread (5-7 us in the bench,
one thread), the example's own ``upload`` body ~40 us; still open.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))


def main(argv=None) -> int:
    """Run the example with the routed uploads profiled; print the profile."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="async", choices=("async", "sync"))
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--flush-mode", default="auto", choices=("auto", "dma", "mapped", "inline"))
    args = ap.parse_args(argv)
    import hf_continuous_batching as ex

    prof = cProfile.Profile()
    spent = []
    upload = ex.CucopyRoute.upload

    from cucopy import check

    def profiled(self, *a, **kw):
        if check.CHECK_MODE:  # the example's last run: check mode's reads would swamp it
            return upload(self, *a, **kw)
        t0 = time.perf_counter()
        prof.enable()
        try:
            return upload(self, *a, **kw)
        finally:
            prof.disable()
            spent.append(time.perf_counter() - t0)

    ex.CucopyRoute.upload = profiled
    from bench import hf_ab

    rc = hf_ab.main(
        ["--mode", args.mode, "--pairs", str(args.pairs), "--flush-mode", args.flush_mode]
    )
    if spent:
        spent.sort()
        print(
            f"routed uploads: {len(spent)}, median {spent[len(spent) // 2] * 1e6:.1f} us "
            "(profiled: cProfile adds ~0.3-1 us a call)"
        )
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    return rc


if __name__ == "__main__":
    sys.exit(main())
