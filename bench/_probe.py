"""What the GPU probes share: held-stream timing, sample summaries, the environment.

``param_probe.py``, ``kernel_floor.py`` and ``kernel_variants.py`` time single launches
the way ``step_cost`` times a step: the stream is stalled by a spin kernel, an event
pair and the launch are enqueued behind it, then the stall is released, so the events
bracket GPU work that runs back to back.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import numpy as np

from bench._common import source_digest

WARMUP = 10


class HeldTimer:
    """Times launches on ``stream`` between two events, the stream held meanwhile.

    Parameters
    ----------
    backend : cucopy.backends.cuda.CudaBackend
        Provides ``hold``.
    stream : cupy.cuda.Stream
    reps : int
        Timed repetitions (after :data:`WARMUP` untimed ones).
    """

    def __init__(self, backend, stream, reps: int):
        import cupy

        self._cupy = cupy
        self._be = backend
        self._stream = stream
        self._reps = reps
        self._e0, self._e1 = cupy.cuda.Event(), cupy.cuda.Event()

    def time(self, launch) -> list[float]:
        """Microseconds between the events around ``launch(i)``, for each timed rep ``i``."""
        out = []
        stream, e0, e1 = self._stream, self._e0, self._e1
        for i in range(self._reps + WARMUP):
            with self._be.hold(stream.ptr):
                e0.record(stream)
                launch(i)
                e1.record(stream)
            e1.synchronize()
            if i >= WARMUP:
                out.append(self._cupy.cuda.get_elapsed_time(e0, e1) * 1000.0)
        return out


def summary(samples) -> dict:
    """Median, p10 and p90 of ``samples`` (microseconds) and the samples themselves."""
    a = np.asarray(samples)
    return {
        "median_us": float(np.median(a)),
        "p10_us": float(np.percentile(a, 10)),
        "p90_us": float(np.percentile(a, 90)),
        "samples_us": [round(float(x), 3) for x in a],
    }


def span(row: dict) -> str:
    """``median [p10-p90]`` of a :func:`summary`."""
    return f"{row['median_us']:6.2f} [{row['p10_us']:.2f}-{row['p90_us']:.2f}]"


def environment() -> dict:
    """Python, CuPy, the device and the CUDA versions."""
    import cupy

    rt = cupy.cuda.runtime
    return {
        "python": platform.python_version(),
        "cupy": cupy.__version__,
        "device": rt.getDeviceProperties(0)["name"].decode(),
        "driver": rt.driverGetVersion(),
        "runtime": rt.runtimeGetVersion(),
        "source_digest": source_digest(),  # bench/digest.py ties it to a commit
    }


def write(path: Path | None, result: dict) -> None:
    """Write ``result`` as JSON to ``path`` (when given) and say so."""
    if path:
        path.write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")


def start(doc: str, argv=None):
    """Parse ``--reps`` and ``--json``; make the CUDA backend and a stream on device 0.

    Returns
    -------
    args : argparse.Namespace
    cupy : module
    backend : cucopy.backends.cuda.CudaBackend
    stream : cupy.cuda.Stream
    """
    import argparse

    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    import cupy

    from cucopy.backends.cuda import CudaBackend

    return args, cupy, CudaBackend(0), cupy.cuda.Stream(non_blocking=True)
