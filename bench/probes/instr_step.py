"""Instructions a merged step costs the host, counted by callgrind on a machine with no GPU.

Usage:
    python bench/probes/instr_step.py [--n 8,32,128] [--annotate 25]   # runs valgrind
    python bench/probes/instr_step.py --n 32 --skip   # steps of 32 unchanged buffer updates
    python bench/probes/instr_step.py --n 32 --torch  # from torch CPU tensors
    python bench/probes/instr_step.py --plain         # plain (eager) copies, no merging
    python bench/probes/instr_step.py --inner --n 32 --steps 520      # what valgrind runs

Question: did a change to the compiled staging core make a step cheaper? Wall time on
the CI machine swings by ±40 % and the lent GPU host by 1.7× (session 10), so this
counts instructions instead, which repeat to a few in ten thousand. The step is the
CUDA path's compiled one, run on the simulated device: a copier of the bench's decode
mix (``bench._common.decode_mix``, NumPy sources, ``flush_mode="auto"`` or ``--mode``) whose
launcher is ``cucopy.backends._cudacall.Driver`` bound to a small C library of no-op
driver calls (``cuLaunchKernel``, ``cuStreamIsCapturing``, ``cuEventRecord``,
``cuEventQuery`` that return 0), built here with gcc. So ``begin()``, the copies, the
cut and encode, the carried launch's call and the ring's event calls run as they do on
the GPU, less the driver's own work; nothing reaches the simulated stream.

``--plain``: the same step through a copier whose plan merges nothing (a site outside
the plan, as ``DeviceCopier(None)``'s every site), so each copy takes the eager path:
from a destination's second copy on, the compiled one (``_core/copier.c``,
``core_eager``: the snapshot into the ring slot's top, one copy through the launcher,
here the no-op library's ``cuMemcpyHtoDAsync``), and the slot's event recorded once a
step by the compiled flush. The Python path's calls (the first copies, and anything the
compiled path leaves to it) go to the sim backend's ``copy2d`` and ``event_record``,
which the probe replaces with functions that do nothing: the driver's share is not
counted, as for the merged step, so the count is cucopy's own host work a plain copy.

For each N, valgrind runs the step 20 and 520 times in two processes with
``PYTHONHASHSEED=0``; the difference over 500 is the instructions of one step (imports,
set-up and the first steps cancel). ``--annotate K`` also prints the K functions with
the most instructions in the longer run (``callgrind_annotate``). Needs valgrind and
gcc; the compiled twin must be built (``pip install -e .``).
Answer: ``bench/results/2026-12-02-ci-instr_step.txt`` (session 11: the staging core's
own instructions for a carried and a graphed step; the driver's share is not counted);
``--plain``: ``bench/results/2026-12-03-ci-instr_plain.txt``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

NOOP_C = r"""
int launch(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
           unsigned bz, unsigned sh, void *st, void **p, void **e) { return 0; }
int capturing(void *stream, int *status) { *status = 0; return 0; }
int record(void *event, void *stream) { return 0; }
int query(void *event) { return 0; }
/* a graph per handle (its node and executable the same handle), each with its kernel's
 * tag address (cell: the device address of a slot's completion tag, 0 for none), set
 * when the node is added or re-pointed; mapped_off turns it into the host address (the
 * simulated device maps pinned memory at host + mapped_off) */
long long mapped_off;
static unsigned long long cells[64];
static int ngraphs;
static char handles[64];
/* CUDA_KERNEL_NODE_PARAMS_v2: kernelParams after func, grid, block and shmem */
static unsigned long long cell_of(const void *p) {
    void **params = *(void ***)((const char *)p + 8 + 7 * 4 + 4);
    return *(unsigned long long *)params[1];
}
int graph_create(void **g, unsigned flags) { *g = handles + (ngraphs & 63); return 0; }
int graph_add(void **node, void *g, void *const *deps, unsigned long n, const void *p) {
    cells[(char *)g - handles] = cell_of(p);
    *node = g;
    return 0;
}
int graph_inst(void **e, void *g, unsigned long long flags) { *e = g; ngraphs++; return 0; }
int graph_set(void *e, void *node, const void *p) {
    cells[(char *)e - handles] = cell_of(p);
    return 0;
}
/* the kernel's last act: the tag's first word copied to its second */
int graph_launch(void *e, void *stream) {
    unsigned long long cell = cells[(char *)e - handles];
    if (cell) {
        unsigned long long *host = (unsigned long long *)(cell - mapped_off);
        host[1] = host[0];
    }
    return 0;
}
int graph_destroy(void *g) { return 0; }
int htod(unsigned long long dst, const void *src, unsigned long n, void *stream) { return 0; }
int copy2d(const void *params, void *stream) { return 0; }
"""

SHORT, LONG = 20, 520


def _noop_lib(where: Path) -> Path:
    src = where / "noop_driver.c"
    lib = where / "libnoop_driver.so"
    src.write_text(NOOP_C)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


_GRAPH_FNS = (
    "graph_create",
    "graph_add",
    "graph_inst",
    "graph_launch",
    "graph_destroy",
    "graph_destroy",
    "graph_set",
)


def _noop_copy2d(h2d, dst, dpitch, src, spitch, width, rows, stream) -> None:
    """``--plain``'s ``copy2d``: enqueues nothing (the driver's share is not counted)."""


def _noop_record(event, stream) -> None:
    """``--plain``'s ``event_record``: records nothing (the driver's share)."""


def _copier(
    n: int,
    lib: Path,
    graphs: bool = True,
    mode: str = "auto",
    torch_src: bool = False,
    plain: bool = False,
):
    """A sim copier of the decode mix wired to the compiled launcher over ``lib``
    (``torch_src``: the sources are torch CPU tensors, else NumPy arrays; ``plain``: a
    plan that merges nothing, and a ``copy2d`` that does nothing)."""
    import numpy as np

    import cucopy as cc
    from bench import _common as common
    from cucopy import pack
    from cucopy.backends import _cudacall

    so = ctypes.CDLL(str(lib))
    names = ("launch", "capturing", "record", "query")
    addr = {k: ctypes.cast(getattr(so, k), ctypes.c_void_p).value for k in names}
    drv = _cudacall.Driver(addr["launch"], addr["capturing"])
    caps = [(c, 0x5CA7 + i) for i, c in enumerate(range(2048, 32768 + 1, 2048))]
    drv.kernels(0x5CA7, caps, pack.THREADS)
    drv.events(addr["record"], addr["query"])
    # the eager copy's cuMemcpyHtoDAsync / cuMemcpy2DAsync (--plain)
    drv.copies(*(ctypes.cast(getattr(so, k), ctypes.c_void_p).value for k in ("htod", "copy2d")))
    if graphs:
        g = [ctypes.cast(getattr(so, k), ctypes.c_void_p).value for k in _GRAPH_FNS]
        drv.graphs(*g, 0x3A0, pack.GRAPH_CAPACITY)
    from cucopy.backends.sim import SimDevice

    dev = SimDevice(policy="lazy", seed=0)
    # the no-op graph launch writes a tagged launch's completion tag, as the kernel does
    ctypes.c_longlong.in_dll(so, "mapped_off").value = dev.mapped_pointer(0)
    site = cc.CopySite("S", [("x", cc.H2D)])
    c = cc.DeviceCopier(
        cc.CopyPlan() if plain else cc.CopyPlan(merge={site.x}),
        stream=dev.stream("instr"),
        device=dev,
        backend="sim",
        flush_mode=mode,
    )
    launcher = drv.launcher()
    c._launcher = launcher
    c._handle = 0x5717
    c._ring._launcher = launcher
    c._cap_query = drv.is_capturing
    c._cap_arg = 0x5717
    c._seg.set_capture_query(drv.is_capturing, 0x5717)  # as a CUDA copier's segment asks
    c._mapped_max = 1 << 20
    c._graph_cap = pack.GRAPH_CAPACITY if graphs else 0
    c._ring._events = [0xE000 + i for i in range(len(c._ring._events))]
    if plain:
        # the sim backend's copy2d is a Python copy into simulated memory that no GPU
        # runs: the eager copies' own call does nothing here (the driver's share is not
        # counted); so does the slot's event record that flush() owes after them, once
        # a step (the ring's events are the no-op driver's handles, not sim events)
        c._backend.copy2d = _noop_copy2d
        c._backend.event_record = _noop_record
    mix = common.decode_mix(n, 0)
    rng = np.random.default_rng(0)
    pairs = []
    for k, dt in mix:
        src = rng.integers(1, 1 << 30, size=k).astype(dt)
        if torch_src:
            import torch

            src = torch.from_numpy(src)
        pairs.append((dev.empty((k,), np.dtype(dt)), src))
    return c, site.x, pairs, drv


def inner(
    n: int,
    steps: int,
    lib: Path,
    graphs: bool = True,
    mode: str = "auto",
    skip: bool = False,
    torch_src: bool = False,
    plain: bool = False,
) -> None:
    """Run ``steps`` merged steps of N copies (what valgrind measures).

    With ``skip``, each step is N ``DeviceCopyBuffer.update`` calls of values the buffers
    already hold (``bench/skip_unchanged.py``'s unchanged step), the first step uploading.
    """
    import cucopy as cc

    c, site, pairs, _ = _copier(n, lib, graphs, mode, torch_src, plain)
    if skip:
        bufs = [(cc.DeviceCopyBuffer(d, site=site), v) for d, v in pairs]
        for _ in range(steps):
            with c.activate(), c.step():
                for b, v in bufs:
                    b.update(v)
        assert c.stats.steps == steps, (c.stats.steps, steps)
        print(f"inner: N={n} steps={steps} skipped={c.stats.sites[site].skipped}")
        return
    copy = c.copy
    for _ in range(steps):
        with c.step():
            for d, v in pairs:
                copy(site, d, v)
    modes = dict(c.stats.modes)
    assert c.stats.steps == steps, (c.stats.steps, steps)
    if plain:
        eager = c.stats.sites[site].eager
        assert eager == n * steps and not modes.get("inline"), (eager, modes)
        print(f"inner: N={n} steps={steps} eager={eager}")
        return
    print(f"inner: N={n} steps={steps} modes={modes}")


def _count(
    n: int,
    steps: int,
    lib: Path,
    out: Path,
    graphs: bool = True,
    mode="auto",
    skip=False,
    torch_src=False,
    plain=False,
) -> int:
    # one BLAS thread: OpenBLAS's idle workers spin a varying number of instructions
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
        *([] if graphs else ["--no-graphs"]),
        "--mode",
        mode,
        *(["--skip"] if skip else []),
        *(["--torch"] if torch_src else []),
        *(["--plain"] if plain else []),
    ]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"valgrind failed ({r.returncode}): {r.stderr[-2000:]}")
    m = re.search(r"Collected : (\d+)", r.stderr)
    if not m:
        raise RuntimeError(f"no instruction count in valgrind's output: {r.stderr[-500:]}")
    return int(m.group(1))


def _by_function(out: Path) -> dict:
    """Instructions by function (exclusive) in a callgrind output file."""
    r = subprocess.run(
        ["callgrind_annotate", "--inclusive=no", "--auto=no", "--threshold=100", str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    found = {}
    for line in r.stdout.splitlines():
        m = re.match(r"\s*([\d,]+) \([ \d.]+%\)\s+(\S+)", line)
        if m:
            name = m.group(2).split(":", 1)[-1]
            found[name] = found.get(name, 0) + int(m.group(1).replace(",", ""))
    return found


def main(argv=None) -> int:
    """Count, or (``--inner``) run the steps valgrind counts."""
    from bench import _common as common

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=common.parse_ints, default=[8, 32, 128])
    ap.add_argument("--steps", type=int, default=LONG)
    ap.add_argument("--annotate", type=int, default=0)
    ap.add_argument("--inner", action="store_true")
    ap.add_argument("--lib", type=Path, default=None)
    ap.add_argument(
        "--no-graphs", action="store_true", help="no graphed launches (the carried ones)"
    )
    ap.add_argument("--mode", default="auto", help="the copier's flush_mode (mapped: graphed)")
    ap.add_argument(
        "--skip", action="store_true", help="steps of N unchanged DeviceCopyBuffer updates"
    )
    ap.add_argument("--torch", action="store_true", help="torch CPU tensors as the sources")
    ap.add_argument("--plain", action="store_true", help="a plan that merges nothing: eager copies")
    args = ap.parse_args(argv)
    if args.inner:
        inner(
            args.n[0],
            args.steps,
            args.lib,
            not args.no_graphs,
            args.mode,
            args.skip,
            args.torch,
            args.plain,
        )
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        lib = _noop_lib(where)
        for n in args.n:
            g = not args.no_graphs
            opts = (g, args.mode, args.skip, args.torch, args.plain)
            short = _count(n, SHORT, lib, where / f"short-{n}.out", *opts)
            long_ = _count(n, LONG, lib, where / f"long-{n}.out", *opts)
            per = (long_ - short) / (LONG - SHORT)
            each = f"{per / n:8.0f} a copy" if n else "(an empty step)"
            print(f"N={n:4d}: {per:10.0f} instructions a step, {each}")
            if args.annotate:
                a = _by_function(where / f"short-{n}.out")
                b = _by_function(where / f"long-{n}.out")
                diff = {k: (b.get(k, 0) - a.get(k, 0)) / (LONG - SHORT) for k in set(a) | set(b)}
                top = sorted(diff.items(), key=lambda kv: -kv[1])[: args.annotate]
                for name, v in top:
                    print(f"  {v:9.0f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
