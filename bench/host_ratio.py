"""A merged copy's host cost as a multiple of an empty Python call, compiled and pure Python.

Usage:
    python bench/host_ratio.py [--n 32] [--steps 2000] [--json PATH]

Runs on the simulated device (no GPU needed: what CI can measure). For each staging
path, the compiled twin and the pure-Python one (``CUCOPY_PURE_PYTHON=1``, in a child
process), it times in that process:

- ``empty``: an empty Python function called with the same three arguments
  (``f(site, dst, src)``), per call;
- ``copy``: ``copier.copy(site, dst, src)`` of N merged copies between ``begin()``
  and ``flush()`` (sim destinations, NumPy sources), per copy;
- ``step``: ``begin()`` + the N copies + ``flush()``, per copy, less the simulated
  device's own work (the NumPy scatter it runs at flush, timed apart and subtracted:
  a GPU runs that, not the host).

and prints each as microseconds and as a ratio to ``empty``. Ratios travel between
machines better than microseconds: the GPU's host is slower at everything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``cucopy`` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402


def _empty(a, b, c):
    return None


def measure(n: int, steps: int) -> dict:
    """Time the empty call, the copies and the whole step in this process.

    Parameters
    ----------
    n : int
        Merged copies per step.
    steps : int
        Timed steps (after 200 untimed).

    Returns
    -------
    dict
        ``staging`` (the active path), ``empty_us``, ``copy_us``, ``step_us`` (medians,
        per call / copy), and the ratios ``copy_x`` and ``step_x``.
    """
    import cucopy as cc
    from cucopy import segment
    from cucopy.backends.sim import SimDevice

    sites = list(cc.CopySite("S", [(f"s{i}", cc.H2D) for i in range(n)]))
    rng = np.random.default_rng(0)
    sizes = rng.choice([4, 16, 64, 256], size=n)
    srcs = [rng.integers(0, 9, int(k), dtype=np.int32) for k in sizes]
    dev = SimDevice(policy="eager")
    dsts = [dev.zeros((int(k),), np.int32) for k in sizes]
    copier = cc.DeviceCopier(
        cc.CopyPlan(merge=set(sites)), stream=dev.default_stream, device=dev, backend="sim"
    )
    triples = list(zip(sites, dsts, srcs))
    copy = copier.copy
    backend = copier._backend
    scatter = backend.scatter
    device_s = []

    def timed_scatter(*args, **kw):  # the simulated GPU's work, not the host's
        t = time.perf_counter()
        try:
            return scatter(*args, **kw)
        finally:
            device_s.append(time.perf_counter() - t)

    backend.scatter = timed_scatter
    clock = time.perf_counter
    te, tc, ts = [], [], []
    for i in range(steps + 200):
        t0 = clock()
        for s, d, x in triples:
            _empty(s, d, x)
        t1 = clock()
        copier.begin()
        t2 = clock()
        for s, d, x in triples:
            copy(s, d, x)
        t3 = clock()
        del device_s[:]
        copier.flush()
        t4 = clock()
        if i >= 200:
            te.append((t1 - t0) / n)
            tc.append((t3 - t2) / n)
            ts.append((t4 - t1 - sum(device_s)) / n)
    copier.close()
    med = statistics.median
    empty, cp, st = med(te) * 1e6, med(tc) * 1e6, med(ts) * 1e6
    return {
        "staging": segment.IMPLEMENTATION,
        "n": n,
        "empty_us": empty,
        "copy_us": cp,
        "step_us": st,
        "copy_x": cp / empty,
        "step_x": st / empty,
    }


def main(argv=None) -> None:
    """Measure both staging paths and print the table (``--json``: write it too)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.n, args.steps)))
        return
    rows = []
    for pure in (False, True):
        env = dict(os.environ, CUCOPY_NO_GPU="1")
        env.pop("CUCOPY_PURE_PYTHON", None)
        if pure:
            env["CUCOPY_PURE_PYTHON"] = "1"
        out = subprocess.run(
            [sys.executable, __file__, "--child", "--n", str(args.n), "--steps", str(args.steps)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"host cost of a merged copy, N={args.n}, simulated device (x = times an empty call)")
    print(
        f"{'staging':10s} {'empty us':>9s} {'copy us':>8s} {'copy x':>7s} {'step us':>8s} {'step x':>7s}"
    )
    for r in rows:
        print(
            f"{r['staging']:10s} {r['empty_us']:9.3f} {r['copy_us']:8.3f} {r['copy_x']:7.1f} "
            f"{r['step_us']:8.3f} {r['step_x']:7.1f}"
        )
    if args.json:
        from types import SimpleNamespace

        from bench import _common as common

        env = common.environment(SimpleNamespace(kind="sim"))
        doc = {"created": common.now_iso(), "environment": env, "n": args.n, "rows": rows}
        common.write_json(Path(args.json), doc)


if __name__ == "__main__":
    main()
