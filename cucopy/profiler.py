"""The copy profiler: which host-to-device uploads a program issues, and what merging saves.

``cucopy.profile()`` records, inside a ``with`` block, every upload a torch program
issues to one device type (``copy_`` from a host tensor, ``.to(device)``,
``torch.tensor(..., device=)`` and ``torch.as_tensor``, indexed writes from host
tensors, ``torch._foreach_copy_``) and every fill with a value the host knows
(``fill_``, ``zero_``, ``torch.full``/``zeros``/``ones`` with a device), grouped by the
call site in the program (``file:line``, the first frame outside torch, CuPy and
cucopy), step by step. CuPy's ``cupy.asarray`` / ``cupy.array`` from host data and
``cupy.ndarray.set`` are counted too when CuPy is imported (best effort, below).

How it sees the calls
---------------------
Two ways were open; this module uses the first.

- **A dispatch mode** (``TorchDispatchMode``, with a ``TorchFunctionMode`` for the
  factory functions): torch hands every ATen call of the block to Python, with its
  arguments, so the profiler sees the call itself (the op, the source tensor and
  whether it is pinned, ``non_blocking``), attributes it to the Python frame that made
  it, and works on any device, including a stand-in (``device="meta"``) on a machine
  with no GPU, which is how it is tested. ``torch.tensor(list, device=)`` moves its
  data below the dispatcher's Python key, so the factory is seen through the function
  mode. What it misses: copies made below the dispatcher (inside C++ operators and
  extensions, compiled ``torch.compile`` graphs, CUDA graph replays, which re-read
  their sources without a call), copies by other libraries (raw ``cudaMemcpyAsync``
  from CuPy, ctypes or Triton; CuPy's few entry points above are wrapped), threads that
  were already running when the block began (modes are per thread: the calling thread
  and the threads started through ``threading`` inside the block are seen), and the
  transfer itself: whether a copy made the host wait is inferred from what the call
  asked for (below), and its host time is measured around the call.
- **torch's profiler** (``torch.profiler`` with CUPTI) records every host-to-device
  memcpy of every thread and library with its Python stack, pageable or pinned, but
  only on a GPU (without CUPTI there is nothing to record, so it cannot be tested
  here), after the fact (a trace to post-process, steps through its schedule), with a
  stack attached to the op rather than a call site, and it costs more to run with
  stacks on. Its strengths (all threads, other libraries) are what the dispatch mode
  misses: when counts look short, check with it.

A copy **made the host wait** when its source is pageable (a pageable
``cudaMemcpyAsync`` synchronizes with the stream first) or it was issued with
``non_blocking=False`` (torch synchronizes after it); ``torch.tensor(..., device=)``
and indexed writes from host tensors both do. Fills never wait. On a GPU each call's
host time is measured (``perf_counter_ns`` around the call, the profiler's own work
outside it), so a wait shows as host time too.

The estimate
------------
What merging the profiled calls would save, per step, from the per-copy and per-step
costs of chained ``copy_`` and of a cucopy merged step (``auto``): each a least-squares
line through the medians of a stored bench run's ``step_cost`` scenario at N = 8, 32
and 128 (host µs and held GPU µs a step), read from ``bench/results/`` for the same GPU
when a run for it is found, else the defaults this module ships, which are an H200's
(run 50, ``bench/results/2026-12-02-h200-run50/``: chained ``copy_`` 4.07 µs of host
time and 3.26 µs of GPU time a copy; merged 5.99 µs a step plus 0.15 µs a copy on the
host, 5.64 µs a step plus 0.02 µs a copy on the GPU). The report says which it used.
Fills are costed as copies. The estimate does not count what leaving the host waits
behind saves (cucopy stages pageable sources and never synchronizes); the report gives
their count and measured host time beside it.

Command line::

    python -m cucopy.profiler [--device cuda] [--costs PATH] [--skeleton PATH] SCRIPT [ARGS...]
    python -m cucopy.profiler --call module:function --steps N [--warmup K] [...]

A script marks its steps with :func:`step` (a no-op when no profile is active).
Importing this module imports no framework; entering a profile imports torch (when
installed) and wraps CuPy only if the program has already imported it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import runpy
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "CopyCosts",
    "CopyProfile",
    "MergeEstimate",
    "SiteRecord",
    "main",
    "profile",
    "run_call",
    "run_script",
    "step",
    "stored_costs",
]

#: Where stored bench runs live in a source checkout (absent from an installed wheel).
RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"

#: The bench's N used for the cost lines: an engine's step uploads a few to a few dozen
#: buffers, and N = 512 would tilt a straight line toward the per-copy slope of big steps.
FIT_MAX_N = 128

_HERE = os.path.abspath(__file__)
_PKG = os.path.dirname(_HERE) + os.sep


# -- costs ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CopyCosts:
    """Per-copy and per-step costs (µs) of chained ``copy_`` and of a cucopy merged step.

    Attributes
    ----------
    chain_host_step, chain_host_copy : float
        Host µs to issue a chain of ``copy_(non_blocking=True)``: per step, per copy.
    chain_gpu_step, chain_gpu_copy : float
        GPU µs of that chain (stream held, so launch gaps excluded).
    merged_host_step, merged_host_copy : float
        Host µs of a cucopy ``auto`` step (``begin``, the staging, the flush).
    merged_gpu_step, merged_gpu_copy : float
        GPU µs of that step (one scatter launch).
    gpu : str
        The GPU they were measured on.
    source : str
        Where they come from (a stored run's results file, or the shipped defaults).
    """

    chain_host_step: float
    chain_host_copy: float
    chain_gpu_step: float
    chain_gpu_copy: float
    merged_host_step: float
    merged_host_copy: float
    merged_gpu_step: float
    merged_gpu_copy: float
    gpu: str
    source: str

    @classmethod
    def from_bench(cls, path: str | os.PathLike) -> CopyCosts:
        """Costs from a stored bench run: its results JSON, or the run folder holding it.

        Parameters
        ----------
        path : str or os.PathLike
            ``bench/results/<run>/<date>-<gpu>.json`` or ``bench/results/<run>/``.

        Returns
        -------
        CopyCosts

        Raises
        ------
        FileNotFoundError
            When the path does not exist or a folder holds no bench results file.
        ValueError
            When the file has no ``step_cost`` medians for ``torch_chain`` and
            ``cucopy_auto`` (a simulated run, a run cut short).
        """
        p = Path(path)
        if p.is_dir():
            found = sorted(q for q in p.glob("*.json") if _is_bench_json(q))
            if not found:
                raise FileNotFoundError(f"costs: no bench results file (<date>-<gpu>.json) in {p}")
            p = found[-1]
        if not p.exists():
            raise FileNotFoundError(f"costs: no such bench results file: {p}")
        doc = json.loads(p.read_text())
        gpu = (doc.get("environment", {}).get("gpu") or {}).get("name") or "unknown GPU"
        return cls._from_doc(doc, gpu, _display_path(str(p)))

    @classmethod
    def _from_doc(cls, doc: dict, gpu: str, source: str) -> CopyCosts:
        rows = (doc.get("scenarios") or {}).get("step_cost", {}).get("results", [])
        fits = {}
        for contender in ("torch_chain", "cucopy_auto"):
            for key in ("host_us", "gpu_us"):
                pts = [
                    (r["n"], r[key]["median"])
                    for r in rows
                    if r.get("contender") == contender
                    and r.get("n", 0) <= FIT_MAX_N
                    and (r.get(key) or {}).get("median") is not None
                ]
                if len(pts) < 2:
                    raise ValueError(
                        f"costs: {source} has no step_cost {key} medians for {contender} at "
                        f"two N <= {FIT_MAX_N} (a simulated run or one cut short?)"
                    )
                fits[contender, key] = _line(pts)
        return cls(
            *fits["torch_chain", "host_us"],
            *fits["torch_chain", "gpu_us"],
            *fits["cucopy_auto", "host_us"],
            *fits["cucopy_auto", "gpu_us"],
            gpu=gpu,
            source=source,
        )


def _line(points: list) -> tuple[float, float]:
    """``(per step, per copy)``: the least-squares line through ``(n, µs)``, clamped >= 0."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else my / mx
    slope = max(slope, 0.0)
    return round(max(my - slope * mx, 0.0), 3), round(slope, 3)


#: The shipped defaults: an H200's, from run 50 (bench/results/2026-12-02-h200-run50/),
#: ``CopyCosts.from_bench`` of that run's stored summary (tests/test_profiler.py checks
#: they agree).
DEFAULT_COSTS = CopyCosts(
    chain_host_step=1.347,
    chain_host_copy=4.074,
    chain_gpu_step=10.413,
    chain_gpu_copy=3.258,
    merged_host_step=5.99,
    merged_host_copy=0.154,
    merged_gpu_step=5.643,
    merged_gpu_copy=0.018,
    gpu="NVIDIA H200",
    source="the defaults shipped in cucopy.profiler (an H200's: bench run 50)",
)


def _is_bench_json(p: Path) -> bool:
    return re.fullmatch(r"\d{4}-\d{2}-\d{2}-[\w.-]+\.json", p.name) is not None


def _run_key(folder: Path) -> tuple:
    m = re.match(r"(\d{4}-\d{2}-\d{2})", folder.name)
    run = re.search(r"run(\d+)$", folder.name)
    return (m.group(1) if m else "", int(run.group(1)) if run else -1, folder.name)


def stored_costs(gpu: str, results: Path = RESULTS) -> CopyCosts | None:
    """Costs from the latest stored bench run made on ``gpu``, or None.

    Parameters
    ----------
    gpu : str
        The GPU's name as torch reports it (``"NVIDIA H200"``).
    results : pathlib.Path
        The folder of stored runs (``bench/results/`` of a source checkout).

    Returns
    -------
    CopyCosts or None
    """
    if not results.is_dir():
        return None
    folders = sorted((p for p in results.iterdir() if p.is_dir()), key=_run_key, reverse=True)
    for folder in folders:
        for p in sorted(folder.glob("*.json"), reverse=True):
            if not _is_bench_json(p):
                continue
            try:
                doc = json.loads(p.read_text())
                name = (doc.get("environment", {}).get("gpu") or {}).get("name")
                if name != gpu:
                    continue
                return CopyCosts._from_doc(doc, name, _display_path(str(p)))
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return None


# -- records -------------------------------------------------------------------------------------


@dataclass
class SiteRecord:
    """One call site's uploads (or fills) of one kind, step by step.

    Attributes
    ----------
    site : str
        ``file:line`` of the call in the program (the path relative to the working
        directory or to the ``sys.path`` entry it was imported from).
    function : str
        The function the call is in.
    op : str
        What was called: ``copy_``, ``.to``, ``torch.tensor``, ``torch.as_tensor``,
        ``index_put_``, ``_foreach_copy_``, ``fill_``, ``zero_``, ``torch.full``,
        ``torch.zeros``, ``torch.ones``, ``cupy.asarray``, ``cupy.array``,
        ``cupy.ndarray.set``.
    upload : bool
        True for a host-to-device upload, False for a fill (no host source).
    counts, nbytes, waits : list of int
        Per step: calls, bytes uploaded (fills: bytes written on the device), calls
        that made the host wait.
    host_us : list of float
        Per step: host µs spent in the calls (meaningful on a GPU only).
    pinned, pageable : int
        Upload calls from pinned and from pageable sources, over the block.
    """

    site: str
    function: str
    op: str
    upload: bool
    counts: list = field(default_factory=list)
    nbytes: list = field(default_factory=list)
    waits: list = field(default_factory=list)
    host_us: list = field(default_factory=list)
    pinned: int = 0
    pageable: int = 0

    def _grow(self, n: int) -> None:
        for lst, zero in ((self.counts, 0), (self.nbytes, 0), (self.waits, 0), (self.host_us, 0.0)):
            lst.extend([zero] * (n - len(lst)))

    @property
    def source(self) -> str:
        """``pinned``, ``pageable``, ``mixed`` (uploads) or ``-`` (fills)."""
        if not self.upload:
            return "-"
        if self.pinned and self.pageable:
            return "mixed"
        return "pinned" if self.pinned else "pageable"


@dataclass(frozen=True)
class MergeEstimate:
    """What merging a profile's uploads and fills would save, per step (µs).

    Attributes
    ----------
    copies : float
        Uploads and fills a step (mean over the steps).
    waits : float
        Calls a step that made the host wait.
    chained_host, merged_host, chained_gpu, merged_gpu : float
        The modelled cost of a step's calls, chained and merged.
    measured_host : float or None
        Host µs a step measured in the calls (None off a GPU).
    measured_wait_host : float or None
        The part of ``measured_host`` spent in calls that made the host wait.
    costs : CopyCosts
        The costs used.
    """

    copies: float
    waits: float
    chained_host: float
    merged_host: float
    chained_gpu: float
    merged_gpu: float
    measured_host: float | None
    measured_wait_host: float | None
    costs: CopyCosts

    @property
    def host_saved(self) -> float:
        """Host µs a step that merging saves (modelled)."""
        return self.chained_host - self.merged_host

    @property
    def gpu_saved(self) -> float:
        """GPU (stream) µs a step that merging saves (modelled)."""
        return self.chained_gpu - self.merged_gpu


# -- the profile ---------------------------------------------------------------------------------

_ACTIVE: CopyProfile | None = None
_ACTIVE_LOCK = threading.Lock()


class CopyProfile:
    """The uploads a block issued, by call site and step. Made by :func:`profile`.

    Use it as a context manager (``with cucopy.profile() as prof:``); call
    :meth:`step` between steps; after the block read :meth:`report`,
    :meth:`skeleton`, :meth:`estimate` and :attr:`sites`.

    Steps: the calls between two :meth:`step` marks form a step, and so do the calls
    before the first mark and after the last (an empty one of those two is left out).
    With no mark the whole block is one step.

    Parameters
    ----------
    device, costs
        As for :func:`profile`.

    Attributes
    ----------
    device : str
        The device type counted.
    gpu_name : str or None
        The GPU's name when ``device`` is ``"cuda"`` and torch sees one (host times are
        measured then).
    error : BaseException or None
        The exception that ended the block, if any.
    captured : int
        Calls made during CUDA graph capture, left out (a graph replays them without a call).
    elapsed_s : float
        The block's wall time.
    """

    def __init__(self, *, device: str = "cuda", costs=None):
        if not isinstance(device, str) or not device:
            raise TypeError(
                f"profile: device must be a torch device type such as 'cuda', got {device!r}"
            )
        self.device = device.split(":")[0]
        self._costs_arg = costs
        self._lock = threading.Lock()
        self._records: dict = {}
        self._step = 0
        self._marks = 0
        self._open = False
        self._done = False
        self._torch = None
        self._modes: list = []
        self._prev_thread_hook = None
        self._cupy_patches: list = []
        self._cupy_note: str | None = None
        self._tls = threading.local()
        self._torch_dir: str | None = None
        self._cupy_dir: str | None = None
        self.captured = 0
        self.gpu_name: str | None = None
        self.error: BaseException | None = None
        self.elapsed_s = 0.0
        self._t0 = 0

    # -- the block ---------------------------------------------------------------------------

    def __enter__(self) -> CopyProfile:
        global _ACTIVE
        if self._done or self._open:
            raise RuntimeError("profile: a CopyProfile records one block; make a new one")
        with _ACTIVE_LOCK:
            if _ACTIVE is not None:
                raise RuntimeError("profile: another cucopy.profile block is active")
            _ACTIVE = self
        try:
            self._start()
        except BaseException as exc:
            self._stop(exc)
            with _ACTIVE_LOCK:
                _ACTIVE = None
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop(exc)  # an exception propagates (None is not a swallow)

    def _start(self) -> None:
        if importlib.util.find_spec("torch") is not None:
            import torch

            self._torch = torch
            self._torch_dir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
            if self.device == "cuda":
                try:
                    if torch.cuda.is_available():
                        self.gpu_name = torch.cuda.get_device_name()
                except Exception:  # a broken driver: no name, shipped costs
                    self.gpu_name = None
        self._open = True
        self._t0 = time.perf_counter_ns()
        if self._torch is not None:
            self._enter_modes()
            self._prev_thread_hook = threading.getprofile()
            threading.setprofile(self._thread_hook)
        self._hook_cupy()

    def _stop(self, exc) -> None:
        global _ACTIVE
        if not self._open:
            return
        self._open = False
        self._done = True
        self.elapsed_s = (time.perf_counter_ns() - self._t0) / 1e9
        self.error = exc
        try:
            if self._torch is not None:
                threading.setprofile(self._prev_thread_hook)
                for mode in reversed(self._modes):
                    mode.__exit__(None, None, None)
                self._modes = []
            for obj, name, old in reversed(self._cupy_patches):
                setattr(obj, name, old)
            self._cupy_patches = []
        finally:
            with _ACTIVE_LOCK:
                if _ACTIVE is self:
                    _ACTIVE = None

    def _enter_modes(self) -> None:
        self._modes = list(_torch_modes(self))
        for mode in self._modes:
            mode.__enter__()

    def _thread_hook(self, frame, event, arg):
        # runs once in each thread started while the block is open: torch's modes are
        # per thread, so the new thread enters its own (they go quiet when the block
        # ends; the thread's end discards them)
        sys.setprofile(self._prev_thread_hook)
        if self._open:
            fm, dm = _torch_modes(self)
            fm.__enter__()
            dm.__enter__()

    def step(self) -> None:
        """Mark a step boundary (the calls since the last mark form a step)."""
        with self._lock:
            self._step += 1
            self._marks += 1
        if not self._cupy_patches and "cupy" in sys.modules:
            self._hook_cupy()

    # -- recording ---------------------------------------------------------------------------

    def _record(self, op, upload, nbytes, waits, pinned, host_ns, where) -> None:
        path, line, func = where
        key = (path, line, op)
        with self._lock:
            rec = self._records.get(key)
            if rec is None:
                rec = self._records[key] = SiteRecord(
                    f"{_display_path(path)}:{line}", func, op, upload
                )
            s = self._step
            if len(rec.counts) <= s:
                rec._grow(s + 1)
            rec.counts[s] += 1
            rec.nbytes[s] += nbytes
            rec.waits[s] += 1 if waits else 0
            rec.host_us[s] += host_ns / 1e3
            if upload:
                if pinned:
                    rec.pinned += 1
                else:
                    rec.pageable += 1

    def _call_site(self):
        """``(path, line, function)`` of the first frame outside torch, CuPy and cucopy,
        or None when that frame is cucopy's own (its copies route themselves)."""
        f: types.FrameType | None = sys._getframe(1)
        torch_dir, cupy_dir = self._torch_dir, self._cupy_dir
        while f is not None:
            fn = f.f_code.co_filename
            if fn == _HERE or (torch_dir and fn.startswith(torch_dir)):
                f = f.f_back
                continue
            if cupy_dir and fn.startswith(cupy_dir):
                f = f.f_back
                continue
            if fn.startswith(_PKG):
                return None
            code = f.f_code
            return fn, f.f_lineno, getattr(code, "co_qualname", code.co_name)
        return "<unknown>", 0, "?"

    def _capturing(self) -> bool:
        if self.device != "cuda":
            return False
        torch = self._torch
        try:
            return torch is not None and bool(torch.cuda.is_current_stream_capturing())
        except Exception:
            return False

    def totals(self) -> dict:
        """Calls recorded so far, by op (safe to call from inside the block).

        Returns
        -------
        dict
            ``{op: calls}``.
        """
        out: dict = {}
        with self._lock:
            for rec in self._records.values():
                out[rec.op] = out.get(rec.op, 0) + sum(rec.counts)
        return out

    # -- CuPy --------------------------------------------------------------------------------

    def _hook_cupy(self) -> None:
        cupy = sys.modules.get("cupy")
        if cupy is None or self._cupy_patches:
            return
        where = getattr(cupy, "__file__", None)
        if where:
            self._cupy_dir = os.path.dirname(os.path.abspath(where)) + os.sep
        skipped = []
        for obj, name, op in (
            (cupy, "asarray", "cupy.asarray"),
            (cupy, "array", "cupy.array"),
            (getattr(cupy, "ndarray", None), "set", "cupy.ndarray.set"),
        ):
            old = getattr(obj, name, None)
            if old is None:
                continue
            wrapped = _cupy_wrapper(self, old, op, method=name == "set")
            try:
                setattr(obj, name, wrapped)
            except (TypeError, AttributeError):  # CuPy's ndarray is an extension type
                skipped.append(op)
                continue
            self._cupy_patches.append((obj, name, old))
        if skipped:
            self._cupy_note = f"CuPy: {', '.join(skipped)} cannot be wrapped (not counted)"

    # -- results -----------------------------------------------------------------------------

    @property
    def steps(self) -> int:
        """Steps the block had (see the class docstring)."""
        return len(self._kept_steps())

    def _kept_steps(self) -> range:
        n = self._step + 1
        if self._marks == 0:
            return range(0, 1)
        if not self._records:
            return range(0, self._marks)
        with self._lock:
            recs = list(self._records.values())
        for r in recs:
            r._grow(n)

        def used(s):
            return any(r.counts[s] for r in recs)

        lo = 0 if used(0) else 1
        hi = n if used(n - 1) else n - 1
        return range(lo, max(hi, lo))

    @property
    def sites(self) -> list:
        """The records, one per call site and op, in first-seen order (see :class:`SiteRecord`);
        their per-step lists cover the block's steps."""
        kept = self._kept_steps()
        out = []
        with self._lock:
            recs = list(self._records.values())
        for r in recs:
            r._grow(self._step + 1)
            out.append(
                SiteRecord(
                    r.site,
                    r.function,
                    r.op,
                    r.upload,
                    [r.counts[s] for s in kept],
                    [r.nbytes[s] for s in kept],
                    [r.waits[s] for s in kept],
                    [r.host_us[s] for s in kept],
                    r.pinned,
                    r.pageable,
                )
            )
        return out

    def costs(self) -> CopyCosts:
        """The costs the estimate uses (see the module docstring).

        Returns
        -------
        CopyCosts
        """
        c = self._costs_arg
        if isinstance(c, CopyCosts):
            return c
        if c is not None and c != "default":
            return CopyCosts.from_bench(c)
        if c is None and self.gpu_name:
            found = stored_costs(self.gpu_name)
            if found is not None:
                return found
        return DEFAULT_COSTS

    def estimate(self) -> MergeEstimate:
        """What merging every upload and fill of a step into one cucopy step would save.

        Returns
        -------
        MergeEstimate
        """
        sites = self.sites
        nsteps = max(self.steps, 1)
        copies = sum(sum(r.counts) for r in sites) / nsteps
        waits = sum(sum(r.waits) for r in sites) / nsteps
        c = self.costs()
        measured = wait_host = None
        if self.gpu_name:  # host times mean something only where the copies ran
            measured = sum(sum(r.host_us) for r in sites) / nsteps
            wait_host = (
                sum(sum(h for h, w in zip(r.host_us, r.waits) if w) for r in sites if any(r.waits))
                / nsteps
            )
        merged = copies > 0
        return MergeEstimate(
            copies=copies,
            waits=waits,
            chained_host=(c.chain_host_step + copies * c.chain_host_copy) if merged else 0.0,
            merged_host=(c.merged_host_step + copies * c.merged_host_copy) if merged else 0.0,
            chained_gpu=(c.chain_gpu_step + copies * c.chain_gpu_copy) if merged else 0.0,
            merged_gpu=(c.merged_gpu_step + copies * c.merged_gpu_copy) if merged else 0.0,
            measured_host=measured,
            measured_wait_host=wait_host,
            costs=c,
        )

    def report(self) -> str:
        """The table of call sites, then the estimate and the costs it used.

        Returns
        -------
        str
        """
        sites = self.sites
        nsteps = max(self.steps, 1)
        where = f"'{self.device}'" + (f" ({self.gpu_name})" if self.gpu_name else "")
        lines = []
        if self.error is not None:
            lines.append(
                f"the block raised {type(self.error).__name__}: {self.error} "
                f"(what it issued before is below)"
            )
        if self.captured:
            lines.append(f"{self.captured} calls during CUDA graph capture not counted")
        if self._cupy_note:
            lines.append(self._cupy_note)
        if not sites:
            lines.insert(
                0,
                f"cucopy.profile: no host-to-device uploads or fills on {where} seen in "
                f"{nsteps} step{'s' if nsteps != 1 else ''}: nothing to merge",
            )
            if self.device == "cuda" and not self.gpu_name:
                lines.append(
                    "(torch sees no CUDA device here: a stand-in such as 'meta' counts calls)"
                )
            return "\n".join(lines) + "\n"
        copies = sum(sum(r.counts) for r in sites) / nsteps
        lines.insert(
            0,
            f"cucopy.profile: {nsteps} step{'s' if nsteps != 1 else ''} on {where}, "
            f"{len(sites)} call site{'s' if len(sites) != 1 else ''}, "
            f"{_num(copies)} uploads and fills a step",
        )
        head = (
            "site",
            "function",
            "op",
            "count/step",
            "bytes/step",
            "source",
            "waits/step",
            "host us/step",
        )
        rows = []
        for r in sites:
            rows.append(
                (
                    r.site,
                    r.function,
                    r.op,
                    _per_step(r.counts, nsteps),
                    _num(sum(r.nbytes) / nsteps),
                    r.source,
                    _num(sum(r.waits) / nsteps),
                    f"{sum(r.host_us) / nsteps:.1f}" if self.gpu_name else "-",
                )
            )
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
        left = {0, 1, 2, 5}

        def fmt(row):
            return "  ".join(
                c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
            ).rstrip()

        lines.append(fmt(head))
        lines.append("  ".join("-" * w for w in widths))
        lines.extend(fmt(row) for row in rows)
        lines.append(
            "count/step: mean [min-max] over the steps; bytes: uploaded (fills: written on"
        )
        lines.append(
            "the device); waits: calls that made the host wait (pageable source or non_blocking=False)"
        )
        lines.extend(self._estimate_lines())
        return "\n".join(lines) + "\n"

    def _estimate_lines(self) -> list:
        e = self.estimate()
        c = e.costs
        lines = [
            f"estimate: {_num(e.copies)} uploads and fills a step merged into one cucopy step "
            f"(auto), fills costed as copies:",
            f"  host: chained ~{e.chained_host:.1f} us a step -> merged ~{e.merged_host:.1f} us: "
            f"saves ~{e.host_saved:.1f} us a step",
            f"  GPU:  chained ~{e.chained_gpu:.1f} us a step -> merged ~{e.merged_gpu:.1f} us: "
            f"saves ~{e.gpu_saved:.1f} us a step of stream time",
        ]
        if e.waits:
            meas = (
                f"; measured host time in them {e.measured_wait_host:.1f} us a step"
                if e.measured_wait_host is not None
                else ""
            )
            lines.append(
                f"  host waits: {_num(e.waits)} a step would go (cucopy stages pageable sources "
                f"and never\n    synchronizes; not in the figures above){meas}"
            )
        if e.measured_host is not None:
            lines.append(
                f"  measured here: {e.measured_host:.1f} us of host time a step in these calls"
            )
        lines.append(f"  costs: {c.source} [{c.gpu}], us:")
        lines.append(
            f"    chained copy_ {c.chain_host_step:g} + {c.chain_host_copy:g} a copy host, "
            f"{c.chain_gpu_step:g} + {c.chain_gpu_copy:g} a copy GPU"
        )
        lines.append(
            f"    merged {c.merged_host_step:g} + {c.merged_host_copy:g} a copy host, "
            f"{c.merged_gpu_step:g} + {c.merged_gpu_copy:g} a copy GPU"
        )
        if self.gpu_name and c.gpu != self.gpu_name:
            lines.append(f"  (measured on {c.gpu}, this is {self.gpu_name}: treat as rough)")
        return lines

    def skeleton(self) -> str:
        """Python source of a ``CopySite`` enum (``Site``) and a ``CopyPlan`` (``PLAN``) for
        the sites found, every one merged and none a barrier: a starting point to edit.

        Returns
        -------
        str
        """
        sites = self.sites
        out = [
            f'"""Copy sites found by cucopy.profile ({self.steps} steps on \'{self.device}\').',
            "",
            "Route each call through cucopy at its site: cc.copy(Site.X, dst, src) for an",
            "upload into a persistent device buffer, cc.fill_tail(Site.X, dst, start, value)",
            "for a fill. A factory (torch.tensor(..., device=), torch.full) makes a new tensor",
            "each call: give it a persistent destination first. Take a site out of `merge`",
            "when other device work reads or writes its destination before the step's flush,",
            "and list it in `flush_after` when a reader must see it before then.",
            '"""',
            "",
            "import cucopy as cc",
            "",
            "",
            "class Site(cc.CopySite):",
            '    """One member per upload or fill call site the profiler found."""',
            "",
        ]
        names: list = []
        taken: set = set()
        for r in sites:
            name = _member_name(r, taken)
            names.append(name)
            direction = "cc.H2D" if r.upload else "cc.FILL"
            n = max(self.steps, 1)
            src = "" if r.source == "-" else f", {r.source}"
            out.append(
                f"    # {r.site} {r.function}: {r.op}, {_num(sum(r.counts) / n)} a step{src}"
            )
            out.append(f"    {name} = {direction}")
        if not names:
            out.append("    pass  # the profile saw no uploads")
        out += ["", ""]
        if names:
            out.append("PLAN = cc.CopyPlan(")
            out.append("    merge={")
            out.extend(f"        Site.{n}," for n in names)
            out.append("    },")
            out.append("    flush_after=set(),")
            out.append(")")
        else:
            out.append("PLAN = cc.CopyPlan(merge=set())")
        return "\n".join(out) + "\n"


def _member_name(r: SiteRecord, taken: set) -> str:
    parts = [x for x in r.function.split(".") if x and x != "<locals>"]
    generic = ("__call__", "forward", "run", "main", "step")
    while len(parts) > 1 and (parts[-1] in generic or parts[-1].startswith("__")):
        parts.pop()
    func = parts[-1] if parts else ""
    if func.startswith("<") or func in generic or not func:
        func = Path(r.site.rsplit(":", 1)[0]).stem
    base = f"{func}_{r.site.rsplit(':', 1)[1]}"
    base = re.sub(r"[^0-9A-Za-z]+", "_", base).strip("_").upper()
    if not base or base[0].isdigit():
        base = "SITE_" + base
    name, k = base, 2
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    taken.add(name)
    return name


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.1f}"


def _per_step(counts: list, nsteps: int) -> str:
    mean = _num(sum(counts) / nsteps)
    if not counts:
        return mean
    lo, hi = min(counts), max(counts)
    return mean if lo == hi else f"{mean} [{lo}-{hi}]"


_DISPLAY: dict = {}


def _display_path(path: str) -> str:
    """``path`` relative to the nearest folder holding it of the working directory and the
    ``sys.path`` entries (a library under a virtual environment in the working directory
    reads ``transformers/...``, not ``.venv/lib/...``)."""
    got = _DISPLAY.get(path)
    if got is not None:
        return got
    out = path
    if os.path.isabs(path):
        best = ""
        for entry in (os.getcwd(), *sys.path):
            e = os.path.abspath(entry or ".") + os.sep
            if path.startswith(e) and len(e) > len(best):
                best = e
        if best:
            out = path[len(best) :]
    _DISPLAY[path] = out
    return out


# -- the torch modes -----------------------------------------------------------------------------

_MODE_CLASSES: tuple | None = None


def _torch_modes(prof: CopyProfile) -> tuple:
    """A ``TorchFunctionMode`` and a ``TorchDispatchMode`` recording into ``prof``."""
    global _MODE_CLASSES
    if _MODE_CLASSES is None:
        _MODE_CLASSES = _make_mode_classes()
    fcls, dcls = _MODE_CLASSES
    return fcls(prof), dcls(prof)


def _make_mode_classes() -> tuple:
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    factories = {torch.tensor: "torch.tensor", torch.as_tensor: "torch.as_tensor"}
    if hasattr(torch, "asarray"):
        factories[torch.asarray] = "torch.asarray"
    copies = {aten.copy_.default}
    to_copies = {aten._to_copy.default}
    index_puts = {aten.index_put_.default, aten.index_put.default}
    if hasattr(aten, "_index_put_impl_"):
        index_puts.add(aten._index_put_impl_.default)
    foreach = {aten._foreach_copy_.default} if hasattr(aten, "_foreach_copy_") else set()
    fills = {aten.fill_.Scalar: "fill_", aten.fill_.Tensor: "fill_", aten.zero_.default: "zero_"}
    makers = {aten.full.default: "torch.full", aten.zeros.default: "torch.zeros"}
    makers[aten.ones.default] = "torch.ones"
    makers[aten.scalar_tensor.default] = "scalar_tensor"  # t[i] = 5
    perf = time.perf_counter_ns

    def nbytes(t) -> int:
        return t.numel() * t.element_size()

    def pinned(t) -> bool:
        try:
            return bool(t.is_pinned())
        except Exception:  # no accelerator: nothing is pinned
            return False

    class FunctionMode(TorchFunctionMode):
        def __init__(self, prof):
            super().__init__()
            self.prof = prof

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            prof = self.prof
            op = factories.get(func) if prof._open else None
            if op is None:
                return func(*args, **kwargs)
            tls = prof._tls
            outer = getattr(tls, "inside", False)
            tls.inside = True
            t0 = perf()
            try:
                out = func(*args, **kwargs)
            finally:
                tls.inside = outer
            dt = perf() - t0
            if outer or not isinstance(out, torch.Tensor) or out.device.type != prof.device:
                return out
            data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
            if isinstance(data, torch.Tensor) and data.device.type != "cpu":
                return out  # already on a device: no upload
            if prof._capturing():
                prof.captured += 1
                return out
            where = prof._call_site()
            if where is not None:
                is_pinned = isinstance(data, torch.Tensor) and pinned(data)
                prof._record(op, True, nbytes(out), True, is_pinned, dt, where)
            return out

    class DispatchMode(TorchDispatchMode):
        def __init__(self, prof):
            super().__init__()
            self.prof = prof

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            prof = self.prof
            if not prof._open or getattr(prof._tls, "inside", False):
                return func(*args, **kwargs)
            dev = prof.device
            # (op, bytes, host sources, non_blocking, waits whatever the source); nothing
            # here calls CUDA: is_pinned() is asked only after the capture check
            found: tuple | None = None
            if func in copies:
                dst, src = args[0], args[1]
                if dst.device.type == dev and src.device.type == "cpu":
                    nb = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
                    found = ("copy_", nbytes(src), [src], nb, False)
            elif func in to_copies:
                src, target = args[0], kwargs.get("device")
                if (
                    target is not None
                    and torch.device(target).type == dev
                    and src.device.type == "cpu"
                ):
                    found = (".to", nbytes(src), [src], kwargs.get("non_blocking", False), False)
            elif func in index_puts:
                dst, indices, values = args[0], args[1], args[2]
                if dst.device.type == dev:
                    host = [i for i in indices if i is not None and i.device.type == "cpu"]
                    if values.device.type == "cpu" and values.dim() > 0:
                        host.append(values)
                    if host:
                        found = ("index_put_", sum(nbytes(t) for t in host), host, False, True)
            elif func in foreach:
                dsts, srcs = args[0], args[1]
                nb = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
                pairs = [
                    (d, s)
                    for d, s in zip(dsts, srcs)
                    if d.device.type == dev and s.device.type == "cpu"
                ]
                if pairs:
                    t0 = perf()
                    out = func(*args, **kwargs)
                    dt = (perf() - t0) / len(pairs)
                    if prof._capturing():
                        prof.captured += len(pairs)
                        return out
                    where = prof._call_site()
                    if where is not None:
                        for _, s in pairs:
                            p = pinned(s)
                            prof._record(
                                "_foreach_copy_", True, nbytes(s), not (p and nb), p, dt, where
                            )
                    return out
            elif func in fills:
                dst = args[0]
                if dst.device.type == dev:
                    found = (fills[func], nbytes(dst), None, False, False)
            elif func in makers:
                target = kwargs.get("device")
                if target is not None and torch.device(target).type == dev:
                    found = (makers[func], 0, None, False, False)
            if found is None:
                return func(*args, **kwargs)
            t0 = perf()
            out = func(*args, **kwargs)
            dt = perf() - t0
            if prof._capturing():
                prof.captured += 1
                return out
            where = prof._call_site()
            if where is not None:
                op, nb_bytes, hosts, nb, always = found
                if hosts is None:  # a fill: no host source, never waits
                    if op in makers.values():
                        nb_bytes = nbytes(out)
                    prof._record(op, False, nb_bytes, False, False, dt, where)
                else:
                    p = all(pinned(t) for t in hosts)
                    prof._record(op, True, nb_bytes, always or not (p and nb), p, dt, where)
            return out

    return FunctionMode, DispatchMode


def _cupy_wrapper(prof: CopyProfile, old, op: str, method: bool):
    def is_host(x) -> bool:
        return not hasattr(x, "__cuda_array_interface__")

    def size(x) -> int:
        n = getattr(x, "nbytes", None)
        if n is None:
            try:
                import numpy as np

                n = np.asarray(x).nbytes
            except Exception:
                n = 0
        return int(n)

    if method:

        def set_(self, arr, *args, **kwargs):
            if not prof._open or not is_host(arr):
                return old(self, arr, *args, **kwargs)
            t0 = time.perf_counter_ns()
            out = old(self, arr, *args, **kwargs)
            dt = time.perf_counter_ns() - t0
            where = prof._call_site()
            if where is not None:
                prof._record(op, True, size(arr), True, False, dt, where)
            return out

        return set_

    def call(obj, *args, **kwargs):
        if not prof._open or not is_host(obj):
            return old(obj, *args, **kwargs)
        t0 = time.perf_counter_ns()
        out = old(obj, *args, **kwargs)
        dt = time.perf_counter_ns() - t0
        where = prof._call_site()
        if where is not None:
            prof._record(op, True, size(out), True, False, dt, where)
        return out

    call.__wrapped__ = old  # type: ignore[attr-defined]
    return call


# -- the public entry points ---------------------------------------------------------------------


def profile(*, device: str = "cuda", costs=None) -> CopyProfile:
    """Record the host-to-device uploads and fills a block issues, by call site and step.

    Parameters
    ----------
    device : str
        The torch device type whose uploads count (``"cuda"``; a stand-in such as
        ``"meta"`` where there is no GPU).
    costs : None, "default", str, os.PathLike or CopyCosts
        The costs of the estimate: None looks for a stored bench run made on this GPU
        (``bench/results/`` of a source checkout) and falls back to the shipped
        defaults (an H200's); ``"default"`` takes the defaults; a path names a stored
        run's results file or folder.

    Returns
    -------
    CopyProfile
        A context manager; ``with cucopy.profile() as prof:`` yields it.

    Raises
    ------
    TypeError
        When ``device`` is not a device type string.

    Examples
    --------
    >>> with cucopy.profile(device="cuda") as prof:  # doctest: +SKIP
    ...     for _ in range(10):
    ...         engine.step()
    ...         prof.step()
    >>> print(prof.report())  # doctest: +SKIP
    """
    return CopyProfile(device=device, costs=costs)


def step() -> None:
    """Mark a step on the active profile; a no-op when no profile is active."""
    prof = _ACTIVE
    if prof is not None:
        prof.step()


def run_script(path, args=(), *, device: str = "cuda", costs=None) -> CopyProfile:
    """Run a Python script as ``__main__`` under a profile.

    Parameters
    ----------
    path : str or os.PathLike
        The script.
    args : sequence of str
        Its command line arguments (``sys.argv[1:]`` inside it).
    device, costs
        As for :func:`profile`.

    Returns
    -------
    CopyProfile
        After the script ends. If it raises (``SystemExit`` with a non-zero status
        included), the exception propagates with the profile attached as its
        ``cucopy_profile`` attribute.

    Raises
    ------
    FileNotFoundError
        When ``path`` is not a file.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"cucopy.profiler: no such script: {str(path)!r}")
    argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [str(p), *args]
    sys.path.insert(0, str(p.resolve().parent))
    prof = profile(device=device, costs=costs)
    try:
        with prof:
            try:
                runpy.run_path(str(p), run_name="__main__")
            except SystemExit as exc:
                if exc.code not in (None, 0):
                    raise
    except BaseException as exc:
        exc.cucopy_profile = prof  # type: ignore[attr-defined]
        raise
    finally:
        sys.argv = argv
        sys.path[:] = saved_path
    return prof


def run_call(
    target: str, steps: int, *, warmup: int = 0, device: str = "cuda", costs=None
) -> CopyProfile:
    """Call ``module:function`` ``warmup`` times unrecorded, then ``steps`` times, a step each.

    Parameters
    ----------
    target : str
        ``"package.module:function"`` (the function may be ``Class.method`` of a
        module-level object); it is called with no arguments.
    steps, warmup : int
        Recorded calls (>= 1) and unrecorded calls before them (>= 0).
    device, costs
        As for :func:`profile`.

    Returns
    -------
    CopyProfile
        If a call raises, the exception propagates with the profile attached as its
        ``cucopy_profile`` attribute.

    Raises
    ------
    ValueError
        When ``target`` is not ``module:function`` or ``steps``/``warmup`` are out of range.
    ImportError, AttributeError
        When the module or the function is not found.
    """
    if not isinstance(target, str) or target.count(":") != 1:
        raise ValueError(f"cucopy.profiler: --call takes module:function, got {target!r}")
    if steps < 1 or warmup < 0:
        raise ValueError(
            f"cucopy.profiler: steps must be >= 1 and warmup >= 0, got {steps}, {warmup}"
        )
    mod_name, attr = target.split(":")
    obj = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"cucopy.profiler: {target} is not callable ({type(obj).__name__})")
    for _ in range(warmup):
        obj()
    prof = profile(device=device, costs=costs)
    try:
        with prof:
            for i in range(steps):
                if i:
                    prof.step()
                obj()
    except BaseException as exc:
        exc.cucopy_profile = prof  # type: ignore[attr-defined]
        raise
    return prof


def main(argv=None) -> int:
    """The command line (``python -m cucopy.profiler --help``).

    Parameters
    ----------
    argv : list of str, optional
        The arguments (default ``sys.argv[1:]``).

    Returns
    -------
    int
        The exit status.
    """
    p = argparse.ArgumentParser(
        prog="python -m cucopy.profiler",
        description="Record the host-to-device uploads a torch program issues, by call site "
        "and step, and estimate what merging them with cucopy would save.",
    )
    p.add_argument("--call", metavar="MODULE:FUNCTION", help="call this N times, a step each")
    p.add_argument("--steps", type=int, default=None, help="with --call: recorded calls")
    p.add_argument("--warmup", type=int, default=0, help="with --call: unrecorded calls first")
    p.add_argument("--device", default="cuda", help="the torch device type counted (default cuda)")
    p.add_argument(
        "--costs",
        metavar="PATH",
        default=None,
        help="a stored bench run's results file or folder (default: a stored run for this "
        "GPU, else the shipped H200 defaults); 'default' for the defaults",
    )
    p.add_argument("--skeleton", metavar="PATH", help="write a CopySite enum and CopyPlan here")
    p.add_argument("script", nargs="?", help="a Python script (it may call cucopy.profiler.step())")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    a = p.parse_args(argv)
    if a.call and a.script:
        p.error("give a SCRIPT or --call MODULE:FUNCTION, not both")
    if not a.call and not a.script:
        p.error("give a SCRIPT or --call MODULE:FUNCTION")
    if a.call and a.steps is None:
        p.error("--call needs --steps N")
    if a.script and not Path(a.script).is_file():
        p.error(f"no such script: {a.script}")
    try:
        if a.call:
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())
            prof = run_call(a.call, a.steps, warmup=a.warmup, device=a.device, costs=a.costs)
        else:
            prof = run_script(a.script, a.args, device=a.device, costs=a.costs)
    except BaseException as exc:
        seen: CopyProfile | None = getattr(exc, "cucopy_profile", None)
        if seen is None:
            raise
        _emit(seen, a.skeleton)
        raise
    _emit(prof, a.skeleton)
    return 0


def _emit(prof: CopyProfile, skeleton: str | None) -> None:
    sys.stdout.flush()
    print(prof.report(), end="", flush=True)
    if skeleton:
        Path(skeleton).write_text(prof.skeleton())
        print(f"wrote {skeleton}", flush=True)


if __name__ == "__main__":
    # run as ``python -m cucopy.profiler``: this file is then ``__main__``, a second copy of
    # the module; the scripts it runs import ``cucopy.profiler``, whose state must be the one
    # recording, so the command line runs there
    from cucopy.profiler import main as _main

    sys.exit(_main())
