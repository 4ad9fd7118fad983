"""What the CUDA driver itself charges the host for one stream operation: the floor under a step.

Usage:
    python bench/probes/launch_floor.py [--json PATH] [--arch sm_90] [--build-dir DIR]
    python bench/probes/launch_floor.py --compile-only      # no GPU needed

Question: our carried scatter launch costs 4.2-4.8 us of host time a step on the H200
host, measured from Python. What do the raw driver calls cost, with no Python, no
framework and no cucopy in the way, and is any variant of a launch (or another stream
operation) cheaper? Compiles the kernels below to a cubin with NVRTC, builds
``launch_floor.c`` beside this file with gcc and runs it: a C program that loads
``libcuda.so.1`` itself and times one driver call at a time with ``CLOCK_MONOTONIC``,
on one non-blocking stream of device 0's primary context (as CuPy and torch use it), in
three regimes: ``drained`` (the stream synchronized before each call), ``busy`` (behind
a ~30 us spin kernel) and ``burst`` (8 calls back to back, timed together). Variants:

- ``launch_empty``: ``cuLaunchKernel`` of an empty kernel, grid 1, block 256, no
  parameters;
- ``launch_p16_params`` / ``launch_p16_extra``: a kernel taking a 16-byte struct, through
  ``kernelParams`` / through the ``extra`` buffer (``CU_LAUNCH_PARAM_BUFFER_POINTER``);
- ``launch_1k``, ``launch_6k``, ``launch_20k``, ``launch_32k``: 1024, 6144, 20480 and
  32752 bytes of parameters through ``extra`` (the carried launch's payload sizes);
- ``launchex_p16``: the 16-byte kernel through ``cuLaunchKernelEx`` (no attributes);
- ``launch_grid8``: the 16-byte kernel with grid 8;
- ``memcpy_h2d_4`` / ``memcpy_h2d_20k``: ``cuMemcpyHtoDAsync`` of 4 B / 20 KiB from
  pinned host memory;
- ``event_record``: ``cuEventRecord`` (timing disabled); ``event_query_done``:
  ``cuEventQuery`` of an event that has completed; ``stream_query``: ``cuStreamQuery``;
- ``stream_is_capturing``: ``cuStreamIsCapturing`` (a copier asks it at each ``begin()``
  and ``flush()``);
- ``write_value32``: ``cuStreamWriteValue32`` to device memory;
- ``graph_launch``: ``cuGraphLaunch`` of a graph of one empty kernel node;
- ``graph_set_p16`` / ``graph_set_1k`` / ``graph_set_6k`` / ``graph_set_20k``: the node's
  parameters replaced (``cuGraphExecKernelNodeSetParams``, the grid alternating between
  1 and 2, one carried byte changed) and the graph launched: a launch whose parameters
  change every step, through the graph path; ``graph_set_only_6k``: the update alone;
  ``graph_fixed_6k``: the 6 KB node launched as instantiated;
- a ``gpu`` regime for ``launch_empty``, ``graph_launch``, ``graph_set_p16/6k/20k`` and
  the ``launch_*_gpu`` rows (GPU time only): the call's GPU microseconds between two
  timing events, enqueued behind the spin kernel;
- ``carried_6k_write`` / ``graph_whole8k``: a step's 6 KB scattered (8 pieces) from a
  launch's 6 KB of parameters (``cuLaunchKernel``), or by a one-node graph's kernel
  that reads 8 KB of mapped pinned memory into shared memory in one round
  (``cuGraphLaunch``, the host rewriting the 6 KB before each call in both): host and
  GPU time of the two ways a small step can travel;
- ``ctx_get_current``: ``cuCtxGetCurrent`` (no stream operation: a driver call's floor);
  ``timer_overhead``: the two clock reads around nothing (the measurement's own floor).

Prints median, p10 and p90 host microseconds per variant and regime (``busy`` also
counts the repetitions where the stream was still busy after the call); a variant the
driver refuses is printed as unavailable with its ``CUresult``. ``--json`` writes the
summaries (median/p10/p90/mean/min/count) with an ``environment`` key. Host time only;
needs a GPU, gcc and cuda-python's NVRTC (``--compile-only`` needs no GPU). Answer:
``launch_floor.log`` / ``launch_floor.json`` in the first ``bench/results/`` run with it
(none stored yet).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cucopy import kernels  # noqa: E402 - NVRTC helpers only: the timed calls are C

HERE = Path(__file__).resolve().parent
C_SOURCE = HERE / "launch_floor.c"
GCC_FLAGS = ("-O2", "-std=c11", "-Wall", "-Wextra")
DEFAULT_ARCH = "sm_90"

# Kernel names and parameter layouts are the C program's: k_spin (u64 nanoseconds),
# k_empty (none), k_p16 (16 bytes), k_1k .. k_32k (16 + CAP bytes, CAP as in the C file).
KERNELS = r"""
struct P16 { unsigned long long a; unsigned long long b; };
template <int CAP> struct PB {
  unsigned long long a; unsigned int n; unsigned int r; unsigned char b[CAP];
};
static_assert(sizeof(P16) == 16, "P16");
static_assert(sizeof(PB<1008>) == 1024, "PB<1008>");
static_assert(sizeof(PB<6128>) == 6144, "PB<6128>");
static_assert(sizeof(PB<20464>) == 20480, "PB<20464>");
static_assert(sizeof(PB<32736>) == 32752, "PB<32736>");

extern "C" __global__ void k_spin(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

extern "C" __global__ void k_empty() {}

// The probe passes b = 0: nothing is written, but the compiler cannot drop the read.
extern "C" __global__ void k_p16(const __grid_constant__ P16 p) {
  if (p.b == 0xffffffffffffffffull && threadIdx.x == 0) *(unsigned long long *)p.a = p.b;
}

// The probe passes n = 0; __grid_constant__ reads b[] in place (no local-memory copy).
template <int CAP> __device__ void read_all(const PB<CAP> &p) {
  if (p.n == 0xffffffffu) {
    unsigned s = 0;
    for (int i = threadIdx.x; i < CAP; i += blockDim.x) s += p.b[i];
    atomicAdd((unsigned *)p.a, s);
  }
}
extern "C" __global__ void k_1k(const __grid_constant__ PB<1008> p) { read_all(p); }
extern "C" __global__ void k_6k(const __grid_constant__ PB<6128> p) { read_all(p); }
extern "C" __global__ void k_20k(const __grid_constant__ PB<20464> p) { read_all(p); }
extern "C" __global__ void k_32k(const __grid_constant__ PB<32736> p) { read_all(p); }

// A step's scatter two ways, for their GPU time: 6 KB written to a device buffer as 8
// pieces of 768 B (1 KB apart). k_6k_write takes the bytes from its parameters (the
// carried launch); k_whole8k from mapped pinned memory at seg, the whole first 8 KB
// read into shared memory in one round (a graph node's kernel, whose parameters stay
// as instantiated, reads the step's bytes that way).
extern "C" __global__ void k_6k_write(const __grid_constant__ PB<6128> p) {
  const uint4 *src = reinterpret_cast<const uint4 *>(p.b);
  for (unsigned w = threadIdx.x; w < 384u; w += blockDim.x)
    reinterpret_cast<uint4 *>(p.a + (w / 48u) * 1024u)[w % 48u] = src[w];
}
extern "C" __global__ void k_whole8k(const unsigned char *__restrict__ seg,
                                     unsigned long long dst) {
  __shared__ __align__(16) unsigned char s[8192];
#pragma unroll
  for (unsigned i = 0; i < 2u; ++i)
    reinterpret_cast<uint4 *>(s)[threadIdx.x + i * 256u] =
        __ldg(reinterpret_cast<const uint4 *>(seg) + threadIdx.x + i * 256u);
  __syncthreads();
  for (unsigned w = threadIdx.x; w < 384u; w += blockDim.x)
    reinterpret_cast<uint4 *>(dst + (w / 48u) * 1024u)[w % 48u] =
        reinterpret_cast<const uint4 *>(s)[w];
}
"""


def _nvrtc():
    """Import cuda-python's NVRTC bindings (as the kernel build does).

    Returns
    -------
    module
        ``cuda.bindings.nvrtc`` (``cuda.nvrtc`` on cuda-python < 12.6).

    Raises
    ------
    SystemExit
        If cuda-python is not installed.
    """
    try:
        return kernels._nvrtc()
    except ImportError:
        raise SystemExit(
            "launch_floor: NVRTC not found: this probe needs cuda-python "
            "(pip install cuda-python nvidia-cuda-nvrtc)"
        ) from None


# an NVRTC call's result unpacked, raising on an error code (the kernel build's own)
_check = kernels._check


def compile_cubin(arch: str) -> tuple[bytes, str]:
    """Compile :data:`KERNELS` to a cubin with NVRTC.

    Parameters
    ----------
    arch : str
        A real GPU architecture, e.g. ``"sm_90"`` (a cubin needs one; ``compute_XX``
        gives PTX only).

    Returns
    -------
    bytes
        The cubin.
    str
        NVRTC's version, ``"major.minor"``.

    Raises
    ------
    SystemExit
        If cuda-python or the NVRTC library is missing, or the compile fails.
    """
    nvrtc = _nvrtc()
    opts = [f"--gpu-architecture={arch}", "--std=c++17"]
    try:
        major, minor = _check(nvrtc, nvrtc.nvrtcVersion(), "version")
        prog = _check(
            nvrtc,
            nvrtc.nvrtcCreateProgram(KERNELS.encode(), b"launch_floor.cu", 0, [], []),
            "create",
        )
    except (RuntimeError, OSError) as exc:  # the bindings load libnvrtc on first use
        raise SystemExit(f"launch_floor: NVRTC unavailable: {exc}") from None
    try:
        result = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        size = _check(nvrtc, nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        buf = bytes(size + 64)  # NVRTC writes into it: a fresh object, never a shared one
        _check(nvrtc, nvrtc.nvrtcGetProgramLog(prog, buf), "log")
        log = buf.rstrip(b"\x00").decode(errors="replace").strip()
        _check(nvrtc, result, f"compile for {arch} ({' '.join(opts)})", log)
        if log:
            print(f"launch_floor: NVRTC log:\n{log}", file=sys.stderr)
        size = _check(nvrtc, nvrtc.nvrtcGetCUBINSize(prog), "cubin size")
        buf = bytes(size)
        _check(nvrtc, nvrtc.nvrtcGetCUBIN(prog, buf), "cubin")
    except RuntimeError as exc:
        raise SystemExit(f"launch_floor: {exc}") from None
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return buf, f"{major}.{minor}"


def build_program(out_dir: Path) -> Path:
    """Build ``launch_floor.c`` with gcc.

    Parameters
    ----------
    out_dir : Path
        Where the executable goes.

    Returns
    -------
    Path
        The executable.

    Raises
    ------
    SystemExit
        If gcc is missing or the build fails.
    """
    gcc = shutil.which("gcc")
    if gcc is None:
        raise SystemExit("launch_floor: gcc not found on PATH: the probe is a C program")
    exe = out_dir / "launch_floor"
    cmd = [gcc, *GCC_FLAGS, "-o", str(exe), str(C_SOURCE), "-ldl"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"launch_floor: {' '.join(cmd)} failed:\n{proc.stderr}")
    if proc.stderr.strip():
        print(f"launch_floor: gcc warnings:\n{proc.stderr}", file=sys.stderr)
    return exe


def _run_text(cmd: list[str]) -> str | None:
    """First line of a command's output, or None if it cannot run or fails."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = proc.stdout.strip().splitlines()
    return lines[0].strip() if proc.returncode == 0 and lines else None


def _device_arch() -> str | None:
    """``sm_XY`` of GPU 0 from ``nvidia-smi``, or None where that does not answer."""
    cap = _run_text(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"])
    if not cap or "." not in cap:
        return None
    major, minor = cap.split(".", 1)
    return f"sm_{major}{minor}" if (major + minor).isdigit() else None


def _cpu_model() -> str | None:
    """The host CPU's model name from ``/proc/cpuinfo``, or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def environment(probe: dict, nvrtc_version: str, arch: str) -> dict:
    """Describe the machine the figures came from.

    Parameters
    ----------
    probe : dict
        The C program's JSON (its ``driver_version`` and ``device``).
    nvrtc_version : str
        NVRTC's version, as :func:`compile_cubin` returns it.
    arch : str
        The architecture the cubin was built for.

    Returns
    -------
    dict
        Python version, platform, CPU, gcc version, NVRTC version and arch, the driver
        version (``cuDriverGetVersion``) and the GPU's name.
    """
    drv = probe.get("driver_version")
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "gcc": _run_text(["gcc", "--version"]),
        "nvrtc": nvrtc_version,
        "arch": arch,
        "driver_version": drv,
        "driver": f"{drv // 1000}.{drv % 1000 // 10}" if isinstance(drv, int) else None,
        "gpu": _run_text(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
        or probe.get("device"),
    }


def main(argv=None) -> int:
    """Build the probe, run it, print its lines and optionally write the JSON.

    Parameters
    ----------
    argv : list of str, optional
        Command-line arguments (``sys.argv[1:]`` when None).

    Returns
    -------
    int
        The exit status: 0, or the C program's nonzero status.
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the summaries here")
    ap.add_argument(
        "--arch", default=None, help=f"cubin architecture (default: GPU 0's, else {DEFAULT_ARCH})"
    )
    ap.add_argument("--build-dir", default=None, help="keep the cubin and binary here")
    ap.add_argument(
        "--compile-only", action="store_true", help="build the cubin and the binary, then exit"
    )
    args = ap.parse_args(argv)
    arch = args.arch or (None if args.compile_only else _device_arch()) or DEFAULT_ARCH
    if not arch.startswith("sm_"):
        ap.error(f"--arch {arch}: a cubin needs a real architecture (sm_XY)")

    with tempfile.TemporaryDirectory(prefix="launch_floor_") as tmp:
        out_dir = Path(args.build_dir) if args.build_dir else Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        cubin, nvrtc_version = compile_cubin(arch)
        cubin_path = out_dir / f"launch_floor_{arch}.cubin"
        cubin_path.write_bytes(cubin)
        exe = build_program(out_dir)
        print(
            f"launch_floor: {cubin_path.name} ({len(cubin)} B, NVRTC {nvrtc_version}, {arch}), "
            f"{exe.name} built with gcc {' '.join(GCC_FLAGS)}",
            flush=True,
        )
        if args.compile_only:
            return 0
        json_path = out_dir / "launch_floor.json"
        proc = subprocess.run([str(exe), str(cubin_path), str(json_path)], check=False)
        if proc.returncode != 0:
            print(f"launch_floor: the probe exited with {proc.returncode}", file=sys.stderr)
        if args.json and json_path.exists():  # written last: also after a failed final sync
            probe = json.loads(json_path.read_text())
            probe["environment"] = environment(probe, nvrtc_version, arch)
            probe["exit_status"] = proc.returncode
            Path(args.json).write_text(json.dumps(probe, indent=2) + "\n")
            print(f"launch_floor: wrote {args.json}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
