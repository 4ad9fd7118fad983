"""Instructions a step with one guarded copy costs the host, counted by callgrind.

Usage:
    python bench/probes/instr_guarded.py [--n 0,8]     # runs valgrind
    python bench/probes/instr_guarded.py --n 8 --no-wait   # no g.wait() between steps
    python bench/probes/instr_guarded.py --inner --n 8 --steps 520

Question: what does a step whose copies include one ``copy(..., guard=g)`` (a
``HostGuard``'s buffer read in place) cost, the owed guard event recorded at the
step's flush included? The copier is ``instr_step.py``'s (the sim device, the compiled
launcher over a library of no-op driver calls, the ring's events raw handles), with N
merged copies of the decode mix and one guarded copy of a 64x128 int8 mask a step. The
guard's event is a raw handle as the CUDA backend's are (``event_create`` answers
ints), and its use's stream the copier's handle, so the compiled flush may record it;
the Python path's calls (the first copy, and the flush's Python body where the
compiled one declines) go to backend functions that do nothing (the driver's share is
not counted). Each step waits on the guard (``g.wait()``), as an owner's refill would
(``--no-wait``: it does not, so the count is the step's alone).
Like ``instr_step.py``: valgrind runs 20 and 520 steps; the difference over 500 is
one step.
Answer: ``bench/results/2026-12-04-ci-instr_guarded.txt`` (the compiled flush's guard
events: a step with one guarded copy, before and after).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHORT, LONG = 20, 520


def inner(n: int, steps: int, lib: Path, wait: bool = True) -> None:
    import numpy as np

    import cucopy as cc
    from bench.probes import instr_step

    c, site, pairs, drv = instr_step._copier(max(n, 1), lib, graphs=False)  # carried
    pairs = pairs[:n]
    be = c._backend
    handles = iter(range(0xF000, 0xF100))
    be.event_create = lambda: next(handles)
    be.event_destroy = lambda ev: None
    be.event_record = instr_step._noop_record
    be.event_query = lambda ev: True
    be.event_wait = lambda ev, timeout: True
    be.copy2d = instr_step._noop_copy2d
    sim_capturing = be.is_capturing
    be.is_capturing = lambda s: False if s == 0x5717 else sim_capturing(s)
    host = be.device.pinned_empty((64, 128), np.int8)
    g = cc.HostGuard(host, label="mask")
    d_mask = be.device.zeros((64, 128), np.int8)
    copy = c.copy
    for k in range(steps):
        if wait:
            g.wait()
        with c.step():
            for d, v in pairs:
                copy(site, d, v)
            copy(site, d_mask, host, guard=g)
        if k == 0:
            g._by_copier[c].stream = 0x5717  # the copier's handle, as a CUDA copier's
    use = g._by_copier[c]
    print(
        f"inner: N={n} steps={steps} ticket={use.ticket} fast_guarded={c._fast_guarded} "
        f"fast_flushes={c._fast_flushes} fenced={getattr(c, '_fast_fenced', None)}"
    )


def _count(n: int, steps: int, lib: Path, out: Path, wait: bool = True) -> int:
    env = dict(os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    cmd = [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={out}",
        sys.executable,
        __file__,
        "--inner",
        "--n",
        str(n),
        "--steps",
        str(steps),
        "--lib",
        str(lib),
        *([] if wait else ["--no-wait"]),
    ]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"valgrind failed ({r.returncode}): {r.stderr[-2000:]}")
    print(r.stdout.strip())
    m = re.search(r"Collected : (\d+)", r.stderr)
    if not m:
        raise RuntimeError(f"no instruction count in valgrind's output: {r.stderr[-500:]}")
    return int(m.group(1))


def main(argv=None) -> int:
    from bench import _common as common
    from bench.probes import instr_step

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=common.parse_ints, default=[0, 8])
    ap.add_argument("--steps", type=int, default=LONG)
    ap.add_argument("--inner", action="store_true")
    ap.add_argument("--lib", type=Path, default=None)
    ap.add_argument("--no-wait", action="store_true", help="no g.wait() between steps")
    args = ap.parse_args(argv)
    if args.inner:
        inner(args.n[0], args.steps, args.lib, not args.no_wait)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        lib = instr_step._noop_lib(where)
        for n in args.n:
            wait = not args.no_wait
            short = _count(n, SHORT, lib, where / f"short-{n}.out", wait)
            long_ = _count(n, LONG, lib, where / f"long-{n}.out", wait)
            per = (long_ - short) / (LONG - SHORT)
            print(f"N={n:4d} + 1 guarded: {per:10.0f} instructions a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
