"""Shared pieces of the benchmarks: statistics, the size mix, progress, environment, output."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"

#: Repetitions when none are asked for: GPU medians over >= 50 samples; the simulated
#: device measures host time only, and its NumPy work is slow, so fewer.
DEFAULT_REPS = {"gpu": 200, "sim": 50}
QUICK_REPS = 10
DEFAULT_N = (8, 32, 128, 512)
QUICK_N = (8, 32)


# -- statistics --------------------------------------------------------------------------


def summarize(samples) -> dict:
    """Median and spread of ``samples``.

    Parameters
    ----------
    samples : sequence of float

    Returns
    -------
    dict
        ``n``, ``median``, ``p10``, ``p90``, ``min``, ``max`` and the raw ``samples``
        (rounded to 4 decimals); the statistics are None when there are no samples.
    """
    xs = np.asarray(list(samples), dtype=np.float64)
    if xs.size == 0:
        return {"n": 0, "median": None, "p10": None, "p90": None, "min": None, "max": None}
    p10, med, p90 = np.percentile(xs, [10, 50, 90])
    return {
        "n": int(xs.size),
        "median": float(med),
        "p10": float(p10),
        "p90": float(p90),
        "min": float(xs.min()),
        "max": float(xs.max()),
        "samples": [round(float(x), 4) for x in xs],
    }


def fmt_stat(s: dict | None, scale: float = 1.0, digits: int = 2) -> str:
    """``median [p10-p90]`` of a :func:`summarize` result, or ``-``."""
    if not s or s.get("median") is None:
        return "-"
    m, lo, hi = (s[k] * scale for k in ("median", "p10", "p90"))
    return f"{m:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


# -- the decode-like size mix ---------------------------------------------------------------


def decode_mix(n: int, seed: int = 0) -> list[tuple[int, str]]:
    """A fixed, seeded mix of ``n`` decode-step inputs, each ``(elements, dtype)``.

    Sizes run from 16 B to 8 KiB in three bands, log-spaced within each: 10 % (at least
    one) block-table-like inputs of 2-8 KiB, 20 % medium ones of 256 B-2 KiB (query
    start locations, sampling parameters), the rest tiny per-request vectors of 16-256 B
    (positions, sequence lengths, slot ids). Every third input is int64, the others int32.
    Totals: about 6.5 KB for ``n`` = 8, 20 KB for 32, 88 KB for 128, 345 KB for 512.

    Parameters
    ----------
    n : int
        Number of inputs.
    seed : int
        Shuffles the order; the mix for a given ``(n, seed)`` never changes.

    Returns
    -------
    list of (int, str)
    """
    big = max(1, round(0.1 * n)) if n else 0
    mid = min(round(0.2 * n), n - big)
    bands = ((big, 2048, 8192), (mid, 256, 2048), (n - big - mid, 16, 256))
    sizes = []
    for count, lo, hi in bands:
        q = (np.arange(count) + 0.5) / max(count, 1)
        sizes.extend(np.exp(np.log(lo) + q * (np.log(hi) - np.log(lo))).astype(int).tolist())
    order = np.random.default_rng([seed, n]).permutation(n)
    out = []
    for i, j in enumerate(order):
        dtype = "int64" if i % 3 == 0 else "int32"
        item = np.dtype(dtype).itemsize
        out.append((max(16, sizes[j]) // item, dtype))
    return out


def mix_bytes(mix) -> int:
    """Total bytes of a :func:`decode_mix`."""
    return sum(k * np.dtype(dt).itemsize for k, dt in mix)


# -- progress ----------------------------------------------------------------------------------


class Progress:
    """Progress over measurement jobs: a tqdm bar on a terminal, else one line per job.

    The suite announces every scenario's jobs up front with :meth:`plan`, so the total
    never jumps; a scenario run alone announces its own with :meth:`add` (which grows
    the total only past what was planned) and calls :meth:`advance` after each job.
    """

    def __init__(self, enabled: bool = True, stream=None):
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = enabled
        self.total = 0
        self.done = 0
        self._announced = 0
        self._bar = None
        if enabled and getattr(self._stream, "isatty", lambda: False)():
            # a bar only on a terminal: in a log, tqdm's carriage returns are noise
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=0, file=self._stream, unit="job", dynamic_ncols=True)

    def plan(self, jobs: int) -> None:
        """Set the total to ``jobs`` before any scenario starts."""
        self.total = jobs
        self._refresh()

    def add(self, jobs: int) -> None:
        """Announce ``jobs`` more jobs (the total grows only past the plan)."""
        self._announced += jobs
        if self._announced > self.total:
            self.total = self._announced
            self._refresh()

    def skip_to(self, done: int) -> None:
        """Count jobs a scenario planned but did not run (it stopped early) as done."""
        if done > self.done:
            if self._bar is not None:
                self._bar.update(done - self.done)
            self.done = done
        self._announced = max(self._announced, done)

    def _refresh(self) -> None:
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.refresh()

    def advance(self, what: str) -> None:
        """Mark one job done; ``what`` names it."""
        self.done += 1
        if not self._enabled:
            return
        if self._bar is not None:
            self._bar.set_description_str(what[:48])
            self._bar.update(1)
        else:
            print(f"[{self.done}/{self.total}] {what}", file=self._stream, flush=True)

    def write(self, line: str) -> None:
        """Print a line without breaking the bar."""
        if self._bar is not None:
            self._bar.write(line, file=self._stream)
        else:
            print(line, file=self._stream, flush=True)

    def close(self) -> None:
        """Finish the bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


# -- environment ------------------------------------------------------------------------------


#: Distributions whose versions go into the environment record (those installed).
PACKAGES = (
    "numpy",
    "cupy-cuda13x",
    "cupy-cuda12x",
    "cupy",
    "torch",
    "cuda-python",
    "cuda-bindings",
    "cuda-core",
    "jax",
    "jaxlib",
    "matplotlib",
    "tqdm",
)


def package_versions() -> dict:
    """Installed versions of :data:`PACKAGES`, read from metadata (nothing is imported)."""
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


# What a source digest covers: the library and the bench, not the stored results.
DIGEST_DIRS = ("cucopy", "bench")
DIGEST_SUFFIXES = (".py", ".cu", ".sh", ".c", ".h")  # no .h file existed before session 7
# the rule of the digests stored up to run 30, which left out the compiled twins' C
# sources (two runs differing only in them had one digest); digest.py --find tries both
DIGEST_SUFFIXES_V1 = (".py", ".cu", ".sh")


def _digest_path(rel: str, suffixes: tuple = DIGEST_SUFFIXES) -> bool:
    parts = rel.split("/")
    return (
        parts[0] in DIGEST_DIRS
        and rel.endswith(suffixes)
        and "__pycache__" not in parts
        and "results" not in parts[1:2]
    )


def source_digest(
    root: Path = REPO, rev: str | None = None, suffixes: tuple = DIGEST_SUFFIXES
) -> str | None:
    """SHA-256 of the source a measurement ran (``cucopy/`` and ``bench/`` code).

    A checkout copied to another machine may carry a stale ``.git``; its files are
    what ran. This digest names them: equal to ``source_digest(rev=C)`` computed
    where commit ``C`` exists, so a stored result can be tied to its commit.

    Parameters
    ----------
    root : Path
        The checkout.
    rev : str, optional
        Digest the files of this git revision instead of the working tree.
    suffixes : tuple of str
        The file endings digested (``DIGEST_SUFFIXES_V1`` gives the digests stored up
        to run 30).

    Returns
    -------
    str or None
        Hex digest; None when ``rev`` is given and git cannot read it.
    """
    import hashlib

    h = hashlib.sha256()
    if rev is None:
        files = sorted(
            p.relative_to(root).as_posix()
            for d in DIGEST_DIRS
            if (root / d).is_dir()
            for p in (root / d).rglob("*")
            if p.is_file()
        )
        read = lambda rel: (root / rel).read_bytes()  # noqa: E731
    else:
        try:
            ls = subprocess.run(
                ["git", "ls-tree", "-r", "--name-only", rev, "--", *DIGEST_DIRS],
                cwd=root,
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        files = sorted(ls.stdout.split("\n"))

        def read(rel):
            return subprocess.run(
                ["git", "show", f"{rev}:{rel}"], cwd=root, capture_output=True, timeout=30
            ).stdout

    for rel in files:
        if rel and _digest_path(rel, suffixes):
            data = read(rel)
            h.update(f"{rel}\0{len(data)}\0".encode())
            h.update(data)
    return h.hexdigest()


def git_commit() -> dict:
    """The checkout's commit, whether its tree has uncommitted changes, and the
    digest of the source that ran (:func:`source_digest`)."""
    out = {"commit": None, "dirty": None, "source_digest": source_digest()}
    try:
        out["commit"] = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        )
        out["dirty"] = bool(status.stdout.strip()) if status.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def _nvidia_smi() -> dict:
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return {}
    line = r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else ""
    parts = [p.strip() for p in line.split(",")]
    return {"smi_name": parts[0], "driver": parts[1]} if len(parts) == 2 else {}


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def _cucopy_config() -> dict:
    try:
        from cucopy import _config
    except ImportError:  # a cucopy from before show_config()
        return {}
    return _config.config_dict()


def environment(ctx) -> dict:
    """What the numbers were measured on (no host names, no paths).

    Parameters
    ----------
    ctx : bench._device.Context

    Returns
    -------
    dict
    """
    env = {
        "device": ctx.kind,
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "platform": platform.platform(terse=True),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "numpy": np.__version__,
        "cucopy": git_commit(),
        "cucopy_config": _cucopy_config(),
        "packages": package_versions(),
    }
    if ctx.kind == "gpu":
        gpu = {"ordinal": ctx.device}
        try:
            rt = ctx.cp.cuda.runtime
            props = rt.getDeviceProperties(ctx.device)
            name = props["name"]
            gpu["name"] = name.decode() if isinstance(name, bytes) else str(name)
            gpu["compute_capability"] = f"{props['major']}.{props['minor']}"
            gpu["sm_count"] = props.get("multiProcessorCount")
            gpu["driver_cuda"] = _cuda_version(rt.driverGetVersion())
            gpu["runtime_cuda"] = _cuda_version(rt.runtimeGetVersion())
            gpu["cupy"] = ctx.cp.__version__
        except Exception as e:  # the environment record must never stop a run
            gpu["error"] = repr(e)
        gpu.update(_nvidia_smi())
        if ctx.torch is not None:
            gpu["torch"] = ctx.torch.__version__
            gpu["torch_cuda"] = ctx.torch.version.cuda
        try:
            import cuda.bindings

            gpu["cuda_bindings"] = cuda.bindings.__version__
        except Exception:
            gpu["cuda_bindings"] = None
        env["gpu"] = gpu
    return env


def device_label(ctx) -> str:
    """``"simulated device"``, or the GPU's name (what the plots' titles say)."""
    if ctx.kind != "gpu":
        return "simulated device"
    try:
        name = ctx.cp.cuda.runtime.getDeviceProperties(ctx.device)["name"]
    except Exception:
        return "GPU"
    return name.decode() if isinstance(name, bytes) else str(name)


def device_slug(env: dict) -> str:
    """``sim``, or the GPU's name as a file-name slug (``nvidia-h200``)."""
    if env.get("device") != "gpu":
        return "sim"
    name = env.get("gpu", {}).get("name") or "gpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


# -- output ----------------------------------------------------------------------------------


def today() -> str:
    """The date in UTC, ``YYYY-MM-DD``."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def now_iso() -> str:
    """The time in UTC, ISO 8601, seconds."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` as indented JSON, atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    text = json.dumps(data, indent=1, default=_jsonable)
    # one line per list of numbers (the raw samples), not one line per number
    text = _NUMBER_LIST.sub(
        lambda m: "[" + ", ".join(m.group(1).replace(",", " ").split()) + "]", text
    )
    tmp.write_text(text + "\n")
    os.replace(tmp, path)


_NUMBER_LIST = re.compile(r"\[\s*((?:-?[0-9][0-9.eE+-]*,?\s*)+)\]")


def _jsonable(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, Path):
        return x.name
    raise TypeError(f"not JSON-serializable: {type(x).__qualname__}")


def table(rows: list[list[str]], header: list[str]) -> str:
    """Left-aligned first column, right-aligned others."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for r in [header, *rows]:
        cells = [
            str(c).ljust(widths[0]) if i == 0 else str(c).rjust(widths[i]) for i, c in enumerate(r)
        ]
        lines.append("  ".join(cells))
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def legend(names: dict) -> str:
    """``legend:`` and one line per name: what each contender or column of a table is."""
    if not names:
        return ""
    width = max(len(n) for n in names)
    return "\n".join(["legend:", *(f"  {n:<{width}}  {d}" for n, d in names.items())])


#: Markers and line styles cycled per line, so that lines with equal values (``inline``
#: and ``auto``, which picks ``inline`` for small segments) stay visible under each other.
MARKERS = ("o", "s", "D", "^", "v", "<", ">", "P", "X", "*", "h", "p")
LINESTYLES = ("-", "--", "-.", ":")


def line_style(i: int) -> dict:
    """Matplotlib keyword arguments for the ``i``-th line of a plot."""
    style = {
        "marker": MARKERS[i % len(MARKERS)],
        "linestyle": LINESTYLES[i % len(LINESTYLES)],
        "capsize": 3,
    }
    if i % 2:
        style["markerfacecolor"] = "none"  # hollow: a filled marker beneath shows through
    return style


def dodge(xs, i: int, k: int, log: bool = True, step: float = 0.035) -> list:
    """Shift line ``i`` of ``k`` sideways a little, so equal points do not hide each other.

    ``log``: ``x`` is on a log axis, shifted by a factor; else by ``step`` in ``x``'s units.
    """
    off = (i - (k - 1) / 2) * step
    return [x * 2**off if log else x + off for x in xs]


def plot_title(what: str, device: str) -> str:
    """A figure title that says where it was measured and that lower is better."""
    sim = (
        " (simulated device: host time and operation counts only)" if "simulated" in device else ""
    )
    where = "" if sim else f" on {device}"
    return f"{what}{where}{sim}; lower is better"


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_plot(fig, stem, name: str) -> list[Path]:
    """Write ``fig`` as ``<stem>-<name>.png``, close it, and return ``[path]``.

    The PNG is written with a palette of 256 colours (:func:`shrink_png`): a third of
    the bytes, the same plot to the eye. Stored runs keep their plots in the
    repository, whose whole tree travels to the lent GPU machine (64 MiB at most).
    """
    fig.tight_layout()
    path = Path(f"{stem}-{name}.png")
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    shrink_png(path)
    return [path]


def shrink_png(path) -> bool:
    """Re-encode the PNG at ``path`` with a 256-colour palette, in place, if smaller.

    Returns whether it was rewritten (False without Pillow, or when the palette one
    is not smaller).
    """
    try:
        from PIL import Image
    except ImportError:
        return False
    path = Path(path)
    with Image.open(path) as im:
        q = im.convert("RGB").quantize(
            colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE
        )
    tmp = path.with_suffix(".tmp.png")
    q.save(tmp, optimize=True)
    if tmp.stat().st_size < path.stat().st_size:
        tmp.replace(path)
        return True
    tmp.unlink()
    return False


def parse_ints(text: str) -> list[int]:
    """``"8,32,128"`` -> ``[8, 32, 128]``."""
    return [int(t) for t in text.split(",") if t.strip()]


def parse_floats(text: str) -> list[float]:
    """``"0,0.5,1"`` -> ``[0.0, 0.5, 1.0]``."""
    return [float(t) for t in text.split(",") if t.strip()]


def perf_ns() -> int:
    """The host clock the benchmarks use (``time.perf_counter_ns``)."""
    return time.perf_counter_ns()


# -- command lines ------------------------------------------------------------------------------


def add_run_args(p) -> None:
    """Options every scenario script takes."""
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per measurement")
    p.add_argument("--warmup", type=int, default=None, help="untimed repetitions first")
    p.add_argument("--quick", action="store_true", help="a tiny configuration (CI)")
    p.add_argument("--sim", action="store_true", help="the simulated device even with a GPU")
    p.add_argument("--seed", type=int, default=0, help="seeds the size mix and the values")
    p.add_argument("--json", default=None, help="also write the result to this JSON file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_script(ctx, args, name: str, measure, report) -> int:
    """The end of every scenario script: measure, print the table, write JSON, close.

    Parameters
    ----------
    ctx : bench._device.Context
    args : argparse.Namespace
        With the options of :func:`add_run_args`.
    name : str
        The scenario's name, its key under ``scenarios`` in the JSON.
    measure : callable
        ``measure(progress) -> result``.
    report : callable
        ``report(result) -> str``.

    Returns
    -------
    int
        The script's exit status (0).
    """
    prog = Progress(enabled=not args.no_progress)
    try:
        result = measure(prog)
    finally:
        prog.close()
    print(report(result))
    if args.json:
        write_json(Path(args.json), {"environment": environment(ctx), "scenarios": {name: result}})
    ctx.close()
    return 0


def reps_for(ctx, args) -> tuple[int, int]:
    """``(reps, warmup)`` from the command line, else the defaults for ``ctx``'s device."""
    reps = args.reps or (QUICK_REPS if args.quick else DEFAULT_REPS[ctx.kind])
    if args.warmup is not None:
        warmup = args.warmup
    else:
        warmup = 2 if args.quick else max(5, reps // 10)
    return reps, warmup
