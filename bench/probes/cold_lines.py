"""Cache lines each phase of a merged step touches on a cold host, counted by callgrind.

Usage:
    python bench/probes/cold_lines.py [--n 32] [--mode auto] [--reps 3] [--top 0]
    python bench/probes/cold_lines.py --inner ...   # what valgrind runs

Question: on a host whose caches an engine's own work has just evicted (issue 29), a
merged step's ``begin()`` and flush cost several times their warm host time (on the
H200's host, N = 32: ``begin()`` 8-12 us cold against ~1 us warm). How much of that is
memory the step touches, and where? Wall time cannot say on a machine without a GPU,
and swings too much to compare two trees on one with; this counts instead. The step is
``bench/probes/instr_step.py``'s: the CUDA path's compiled ``begin()`` and flush on the
simulated device, against a no-op driver (the driver's own cold cost is not counted).
Under callgrind's cache simulation (a 32 MiB last-level cache) the program writes 64 MiB
before each step, as ``step_phases.py``'s cold variant does, and dumps each region's
counts on its own (``CALLGRIND_ZERO_STATS``, ``CALLGRIND_DUMP_STATS_AT``): the
last-level misses of a region are the lines it touched that no earlier region of the
step did, code (``ILmr``) and data (``DLmr + DLmw``), each a trip to memory when the
host is cold. Regions: the markers alone (their own cost, in every other region too),
one carried launch of an empty segment through the compiled ``Driver`` (the floor's
host side, less the driver), ``begin()``, the copies, ``flush()``. ``--top K`` lists the
K functions of ``begin()`` and ``flush()`` that touch the most lines. Needs valgrind
(with its headers) and gcc; the compiled twin must be built. Answer:
``bench/results/2026-12-03-ci-cold_lines-issue29.txt`` (before and after the cuts of
issue 29, on the CI machine).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MARKER_C = r"""
#include <valgrind/callgrind.h>
void zero(void) { CALLGRIND_ZERO_STATS; }
void dump(const char *what) { CALLGRIND_DUMP_STATS_AT(what); }
"""

REGIONS = ("markers", "empty_launch", "begin", "copies", "flush")
COLD_BYTES = 64 << 20


def _marker_lib(where: Path) -> Path:
    src, lib = where / "marker.c", where / "libmarker.so"
    src.write_text(MARKER_C)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


def inner(n: int, mode: str, reps: int, lib: Path, markers: Path, torch_src: bool) -> None:
    """The steps valgrind counts (each region dumped on its own)."""
    import numpy as np

    from bench.probes import instr_step

    mk = ctypes.CDLL(str(markers))
    zero, dump = mk.zero, mk.dump
    dump.argtypes = [ctypes.c_char_p]
    c, site, pairs, drv = instr_step._copier(n, lib, mode=mode, torch_src=torch_src)
    copy = c.copy
    buf = c._backend.alloc_pinned(1 << 14)
    seg, host = buf.device_ptr, buf.ptr
    scratch = np.empty(COLD_BYTES, np.uint8)
    for _ in range(12):  # the ring's slots made, every cache filled
        c.begin()
        for d, v in pairs:
            copy(site, d, v)
        c.flush()
    for i in range(reps):
        scratch.fill(i & 255)
        zero()
        dump(b"markers")
        scratch.fill(i & 255)
        zero()
        drv.carried(1, 0x5717, seg, host, 0)
        dump(b"empty_launch")
        scratch.fill(i & 255)
        zero()
        c.begin()
        dump(b"begin")
        zero()
        for d, v in pairs:
            copy(site, d, v)
        dump(b"copies")
        zero()
        c.flush()
        dump(b"flush")
    print(f"inner: N={n} modes={dict(c.stats.modes)} fast_begins={c._fast_begins}")


def _parse(path: Path) -> tuple[str, dict, dict]:
    """A dump's region name, its totals, and each function's own counts."""
    events: list[str] = []
    names: dict = {}
    own: dict = collections.defaultdict(collections.Counter)
    region, totals, fn, after_call = "", {}, None, False
    for line in path.read_text().splitlines():
        if line.startswith("desc: Trigger: Client Request: "):
            region = line.rsplit(" ", 1)[1]
        elif line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith(("summary:", "totals:")):
            totals = dict(zip(events, map(int, line.split()[1:])))
        elif m := re.match(r"^(c?fn)=\((\d+)\)(?: (.*))?$", line):
            if m.group(3):
                names[m.group(2)] = m.group(3)
            if m.group(1) == "fn":
                fn = names.get(m.group(2), m.group(2))
        elif line.startswith("calls="):
            after_call = True  # the next cost line is the call's, not the function's own
        elif line[:1].isdigit() or line[:1] in "+-*":
            if after_call:
                after_call = False
                continue
            own[fn].update(dict(zip(events, map(int, line.split()[1:]))))
    return region, totals, own


def _lines(counts) -> tuple[int, int]:
    return counts.get("ILmr", 0), counts.get("DLmr", 0) + counts.get("DLmw", 0)


def main(argv=None) -> int:
    """Count (or, with ``--inner``, run the steps valgrind counts)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--mode", default="auto")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--top", type=int, default=0)
    ap.add_argument("--torch", action="store_true", help="torch CPU tensors as the sources")
    ap.add_argument("--inner", action="store_true")
    ap.add_argument("--lib", type=Path)
    ap.add_argument("--markers", type=Path)
    args = ap.parse_args(argv)
    if args.inner:
        inner(args.n, args.mode, args.reps, args.lib, args.markers, args.torch)
        return 0
    from bench.probes import instr_step

    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        lib, markers = instr_step._noop_lib(where), _marker_lib(where)
        out = where / "cg.out"
        env = dict(os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        cmd = ["valgrind", "--tool=callgrind", "--cache-sim=yes", "--LL=33554432,16,64"]
        cmd += [f"--callgrind-out-file={out}", sys.executable, __file__, "--inner"]
        cmd += ["--n", str(args.n), "--mode", args.mode, "--reps", str(args.reps)]
        cmd += ["--lib", str(lib), "--markers", str(markers)]
        cmd += ["--torch"] if args.torch else []
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            print(r.stdout[-2000:], r.stderr[-4000:], file=sys.stderr)
            return 1
        print(r.stdout.strip())
        last: dict = {}
        for f in sorted(where.glob("cg.out.*"), key=lambda p: int(p.suffix[1:])):
            region, totals, own = _parse(f)
            if region in REGIONS:
                last[region] = (totals, own)  # the last repetition's
    src = "torch" if args.torch else "numpy"
    print(
        f"cold lines, N={args.n} {src} sources, flush_mode={args.mode} (the last of {args.reps}):"
    )
    for region in REGIONS:
        if region not in last:
            continue
        totals, own = last[region]
        code, data = _lines(totals)
        print(
            f"  {region:13s} {totals.get('Ir', 0):7d} instructions, {code:4d} code lines, "
            f"{data:4d} data lines from memory"
        )
        if args.top and region in ("begin", "flush"):
            rows = sorted(own.items(), key=lambda kv: -sum(_lines(kv[1])))[: args.top]
            for fn, c in rows:
                code, data = _lines(c)
                print(f"      {code:4d} code {data:4d} data  {fn}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
