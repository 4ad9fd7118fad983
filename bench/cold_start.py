"""What the first copier in a fresh process costs: cold and warm kernel cache.

Usage:
    python bench/cold_start.py [--json PATH] [--warm 2] [--sim]

Each measurement runs in a fresh Python process and times, in order: ``import cupy``,
``import cucopy`` (NumPy already imported), CUDA's start (the first device allocation), the first
``DeviceCopier`` (a CUDA copier builds and loads its kernels here, never at a first
launch), its first step (one merged copy, flushed and synchronized, its bytes checked)
and a second copier (kernels already loaded in the process). Runs:

- ``cold``: ``CUPY_CACHE_DIR`` pointed at an empty folder, so NVRTC compiles every
  kernel (one module per entry point, on parallel threads);
- ``warm``: the same folder again (``--warm`` times): CuPy loads the compiled modules
  from disk;
- ``cold_serial``: a second empty folder with ``CUCOPY_BUILD_THREADS=1``, the kernels
  compiled one after another: what the threads save.

Targets (issue 16): the first copier within 1.5 s with a cold cache, 0.3 s warm.
With ``--sim`` (or without a GPU) the same processes run on the simulated device, where
nothing is compiled: it checks the script, not CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` and ``cucopy`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _common as common  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

#: The phases each child times, in order, with the table's column names.
PHASES = (
    ("import_cupy_s", "import cupy"),
    ("import_cucopy_s", "import cucopy"),
    ("cuda_start_s", "CUDA start"),
    ("first_copier_s", "first copier"),
    ("first_step_s", "first step"),
    ("second_copier_s", "second copier"),
)


def child(sim: bool) -> dict:
    """Time one fresh process's first copier (run with ``--child``); returns the phases."""
    clock = time.perf_counter
    out: dict = {"backend": "sim" if sim else "cuda"}
    t = clock()
    if not sim:
        import cupy
    out["import_cupy_s"] = None if sim else clock() - t

    t = clock()
    import numpy as np

    import cucopy as cc

    out["import_cucopy_s"] = clock() - t

    class Site(cc.CopySite):
        INPUT = cc.H2D

    plan = cc.CopyPlan(merge={Site.INPUT})
    src = np.arange(256, dtype=np.int32)
    t = clock()
    if sim:
        from cucopy.backends.sim import SimDevice

        dev = SimDevice()
        stream = dev.stream()
        dst = dev.zeros((256,), np.int32)
        kw: dict = {"device": dev}
    else:
        stream = cupy.cuda.Stream(non_blocking=True)
        dst = cupy.zeros(256, dtype=cupy.int32)
        stream.synchronize()
        kw = {"backend": "cuda"}
    out["cuda_start_s"] = None if sim else clock() - t

    t = clock()
    copier = cc.DeviceCopier(plan, stream=stream, **kw)
    out["first_copier_s"] = clock() - t

    t = clock()
    with copier.step():
        copier.copy(Site.INPUT, dst, src)
    stream.synchronize()
    got = dev.to_host(dst) if sim else cupy.asnumpy(dst)
    out["first_step_s"] = clock() - t
    out["first_step_ok"] = bool((got == src).all())

    t = clock()
    second = cc.DeviceCopier(plan, stream=stream, **kw)
    out["second_copier_s"] = clock() - t
    second.close()
    copier.close()
    if not sim:
        from cucopy import kernels
        from cucopy.backends import cuda as cb

        out["build_threads"] = cb._workers(len(kernels.ENTRY_POINTS))
        out["kernels"] = 2 + len(copier.backend.carry_capacities())
    out["cuda_module_loading"] = os.environ.get("CUDA_MODULE_LOADING")
    return out


def run_child(sim: bool, cache_dir: str, extra_env: dict | None = None) -> dict:
    """One fresh process; returns its phases, or ``{"error": ...}``."""
    env = dict(os.environ, CUPY_CACHE_DIR=cache_dir, **(extra_env or {}))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child"] + (["--sim"] if sim else [])
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - t
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-2000:]}"}
    out = json.loads(lines[-1])
    out["process_wall_s"] = wall
    return out


def measure(sim: bool, warm: int) -> dict:
    """The cold, warm and cold-serial runs, each in a fresh process."""
    runs = []
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as serial:
        runs.append({"run": "cold", **run_child(sim, cache)})
        files = sum(1 for _ in Path(cache).iterdir())
        for i in range(warm):
            runs.append({"run": f"warm{i + 1}", **run_child(sim, cache)})
        runs.append({"run": "cold_serial", **run_child(sim, serial, {"CUCOPY_BUILD_THREADS": "1"})})
    return {"runs": runs, "cache_files_after_cold": files, "targets_s": {"cold": 1.5, "warm": 0.3}}


def report(result: dict) -> str:
    """One row per run: seconds per phase."""
    rows = []
    for r in result["runs"]:
        if "error" in r:
            rows.append([r["run"], *(["-"] * len(PHASES)), r["error"].splitlines()[-1][:60]])
            continue
        cells = ["-" if r.get(k) is None else f"{r[k]:.3f}" for k, _ in PHASES]
        rows.append([r["run"], *cells, "ok" if r.get("first_step_ok") else "WRONG BYTES"])
    header = ["run", *(f"{name} s" for _, name in PHASES), "step"]
    lines = [common.table(rows, header)]
    first = next((r for r in result["runs"] if "build_threads" in r), None)
    if first:
        lines.append(
            f"{first['kernels']} kernels built on up to {first['build_threads']} threads "
            f"(cold_serial: 1); CuPy's cache held {result['cache_files_after_cold']} files "
            "after the cold run"
        )
    lines.append(
        "targets: first copier <= 1.5 s with a cold kernel cache, <= 0.3 s warm "
        "(CUDA start and imports not included)"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run the measurement; print its table; optionally write JSON."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--json", default=None, help="also write the result to this JSON file")
    p.add_argument("--warm", type=int, default=2, help="warm-cache runs after the cold one")
    p.add_argument("--sim", action="store_true", help="the simulated device even with a GPU")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:  # the parent decided the device: nothing is imported before the timing
        print(json.dumps(child(args.sim)))
        return 0
    sim = args.sim
    if not sim:
        from cucopy.backends.cuda import gpu_available

        sim = not gpu_available()
    result = {
        "scenario": "cold_start",
        "device": "sim" if sim else "gpu",
        **measure(sim, args.warm),
    }
    print(report(result))
    if args.json:
        from cucopy import _config

        result["cucopy_config"] = _config.config_dict()
        result["environment"] = {
            "commit": common.git_commit(),
            "python": sys.version.split()[0],
            "packages": common.package_versions(),
        }
        common.write_json(Path(args.json), result)
    failed = [r["run"] for r in result["runs"] if "error" in r or not r.get("first_step_ok")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
