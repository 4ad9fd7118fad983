"""What this cucopy runs with: ``cucopy.show_config()`` and the same as a dict.

Like ``numpy.show_config()``: the version, which backend a default copier gets and
why, the backends on offer, which staging path (pure Python or compiled) is active,
check mode, and the versions of what cucopy runs on. The benchmarks record
:func:`config_dict` with every result.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import sys
from typing import Any, TextIO

from ._version import __version__

__all__ = ["show_config", "config_dict"]

#: Distributions whose versions are reported, by the name shown (read from their
#: metadata: nothing is imported). The first one installed of each tuple is shown.
_DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "numpy": ("numpy",),
    "cupy": ("cupy-cuda13x", "cupy-cuda12x", "cupy"),
    "cuda-python": ("cuda-python",),
    "cuda-bindings": ("cuda-bindings",),
    "torch": ("torch",),
    "jax": ("jax",),
}


def _distribution(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return f"{importlib.metadata.version(name)}" + (
                f" ({name})" if name.startswith("cupy-") else ""
            )
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _staging() -> str:
    # the open segment's hot path: pure Python, or its compiled twin where one is built
    try:
        module = importlib.import_module("cucopy.segment")
    except ImportError:
        return "python"
    return str(getattr(module, "IMPLEMENTATION", "python"))


def _driver_calls() -> str:
    # the CUDA backend's per-step driver calls: from C, or through CuPy's wrappers
    # (importing the backend module imports no CuPy)
    from .backends.cuda import cudacall_module

    return "python" if cudacall_module() is None else "compiled"


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def _cuda_details() -> dict[str, Any]:
    """CUDA as CuPy sees it; empty when CuPy is not imported (no GPU backend)."""
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return {}
    out: dict[str, Any] = {}
    rt = cupy.cuda.runtime
    try:
        out["driver"] = _cuda_version(rt.driverGetVersion())
        out["runtime"] = _cuda_version(rt.runtimeGetVersion())
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    try:
        major, minor = cupy.cuda.nvrtc.getVersion()
        out["nvrtc"] = f"{major}.{minor}"
    except Exception:
        out["nvrtc"] = None
    devices = []
    try:
        for i in range(rt.getDeviceCount()):
            props = rt.getDeviceProperties(i)
            name = props["name"]
            name = name.decode() if isinstance(name, bytes) else str(name)
            devices.append(f"{name} (sm_{props['major']}{props['minor']})")
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["devices"] = devices
    # where NVRTC's output is kept: a cold cache makes the first copier slower
    out["kernel_cache"] = (
        "CUPY_CACHE_DIR" if os.environ.get("CUPY_CACHE_DIR") else "~/.cupy/kernel_cache"
    )
    return out


def _unrouted() -> dict[str, int]:
    from . import copier

    return {getattr(k, "label", repr(k)): v for k, v in copier.unrouted.items()}


def config_dict() -> dict[str, Any]:
    """What :func:`show_config` prints, as plain values (JSON-ready).

    Imports CuPy, if installed, to find the default backend; never raises.

    Returns
    -------
    dict
        ``version``; ``default_backend`` (``name`` and ``why``); ``backends`` (each
        backend's availability); ``staging`` (``"python"`` or the compiled
        twin's name); ``driver_calls`` (``"compiled"`` or ``"python"``: how the CUDA
        backend launches and queries capture each step); ``check_mode``;
        ``completion_tags`` (whether copiers made now fence graphed launches with their
        slot's completion tag rather than an event); ``refuse_unrouted`` (check mode refuses module-level copies
        with no copier to route to); ``unrouted`` (those copies so far, by site);
        ``python``; ``platform``; ``versions`` (installed
        distributions, None when missing); ``cuda`` (driver, runtime and NVRTC versions,
        devices and the kernel cache, when CuPy imports).
    """
    from . import check, copier
    from .backends import default_backend

    name, why = default_backend()
    return {
        "version": __version__,
        "default_backend": {"name": name, "why": why},
        "backends": {
            "sim": "available (the simulated device, in NumPy)",
            "cuda": ("available: " if name == "cuda" else "unavailable: ") + why,
        },
        "staging": _staging(),
        "driver_calls": _driver_calls(),
        "check_mode": bool(check.CHECK_MODE),
        "completion_tags": bool(copier.TAGS),
        "refuse_unrouted": bool(check.REFUSE_UNROUTED),
        "unrouted": _unrouted(),
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "versions": {shown: _distribution(names) for shown, names in _DISTRIBUTIONS.items()},
        "cuda": _cuda_details(),
    }


def show_config(file: TextIO | None = None) -> None:
    """Print the version, the backend a default copier gets and why, and what cucopy runs on.

    Parameters
    ----------
    file : text stream, optional
        Where to print (default ``sys.stdout``).

    Examples
    --------
    >>> import cucopy
    >>> cucopy.show_config()  # doctest: +SKIP
    cucopy 0.1.0
    default backend: sim (CuPy is not installed (No module named 'cupy'))
    ...
    """
    c = config_dict()
    out = file if file is not None else sys.stdout
    d = c["default_backend"]
    cuda = c["cuda"]
    lines = [
        f"cucopy {c['version']}",
        f"default backend: {d['name']} ({d['why']})",
        "backends:",
        *(f"  {k:5} {v}" for k, v in c["backends"].items()),
        f"staging path: {c['staging']}",
        f"CUDA driver calls: {c['driver_calls']}",
        f"check mode: {'on' if c['check_mode'] else 'off'} (CUCOPY_CHECK=1 at import turns it on)",
        f"completion tags: {'on' if c['completion_tags'] else 'off'} "
        "(CUCOPY_TAG=0 at import turns them off)",
        "unrouted module-level copies (no copier to route to: plain copies): "
        + (
            f"{sum(c['unrouted'].values())} ("
            + ", ".join(f"{k}: {v}" for k, v in c["unrouted"].items())
            + ")"
            if c["unrouted"]
            else "0"
        )
        + (" [refused in check mode]" if c["refuse_unrouted"] else ""),
        f"python: {c['python']} on {c['platform']}",
        "versions: "
        + ", ".join(f"{k} {v if v is not None else '-'}" for k, v in c["versions"].items()),
    ]
    if cuda:
        lines.append(
            "CUDA: "
            + ", ".join(
                f"{k} {v}"
                for k, v in (
                    ("driver", cuda.get("driver")),
                    ("runtime", cuda.get("runtime")),
                    ("NVRTC", cuda.get("nvrtc")),
                )
                if v is not None
            )
        )
        for i, dev in enumerate(cuda.get("devices", [])):
            lines.append(f"  cuda:{i} {dev}")
        if "kernel_cache" in cuda:
            lines.append(f"  CuPy kernel cache: {cuda['kernel_cache']}")
        if "error" in cuda:
            lines.append(f"  error: {cuda['error']}")
    else:
        lines.append("CUDA: - (CuPy did not import)")
    print("\n".join(lines), file=out)
