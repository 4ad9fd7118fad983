"""What check mode costs a merged step's host, on the simulated device (issue 30).

Usage:
    python bench/probes/check_cost.py [--n 8,32] [--steps 300] [--policy lazy]

Question: check mode (``CUCOPY_CHECK=1``) snapshots every merged destination at the
call and before its barrier, writes the sentinel over it, watches it until it lands and
reads the snapshots back at each flush; how much host time does a step of the bench's
decode mix (``bench._common.decode_mix``, NumPy sources, ``flush_mode="auto"``) take
with it and without it? Wall time of whole ``step()`` blocks on the simulated device,
stream work included (the sim runs it on the host), median of ``--steps`` steps after a
warm-up. Check mode is a debugging cost, not a target; the ratio is what the README
quotes. Answer: ``bench/results/2026-12-03-ci-check_cost.txt`` (and ``bench/README.md``,
Check mode's cost).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

import cucopy as cc  # noqa: E402
from bench._common import decode_mix  # noqa: E402
from cucopy import check  # noqa: E402
from cucopy.backends.sim import SimDevice  # noqa: E402


def _median_step_us(n: int, steps: int, policy: str, checked: bool) -> float:
    check.CHECK_MODE = checked
    dev = SimDevice(policy=policy)
    mix = decode_mix(n)
    sites = cc.CopySite("Sites", {f"S{i}": cc.H2D for i in range(n)})
    dsts = [dev.zeros((k,), dt) for k, dt in mix]
    srcs = [np.arange(k, dtype=dt) for k, dt in mix]
    pairs = list(zip(list(sites), dsts, srcs))
    c = cc.DeviceCopier(cc.CopyPlan(merge=set(sites)), stream=dev.default_stream, device=dev)
    times = []
    for i in range(steps + 20):
        t0 = time.perf_counter()
        with c.step():
            for site, d, s in pairs:
                c.copy(site, d, s)
        dev.default_stream.synchronize()
        if i >= 20:
            times.append(time.perf_counter() - t0)
    c.close()
    check.CHECK_MODE = False
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="8,32")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--policy", default="lazy", choices=("lazy", "eager", "random"))
    args = ap.parse_args()
    cc.show_config()
    for n in (int(x) for x in args.n.split(",")):
        off = _median_step_us(n, args.steps, args.policy, False)
        on = _median_step_us(n, args.steps, args.policy, True)
        print(
            f"N={n:4d}: {off:8.1f} us a step without check mode, {on:9.1f} us with it "
            f"({on / off:5.1f}x, {(on - off) / n:7.1f} us a copy more)"
        )


if __name__ == "__main__":
    main()
