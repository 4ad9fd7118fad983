"""Backends: the protocol (``base``), CUDA through CuPy (``cuda``), the simulated device (``sim``).

:func:`default_backend` is where a copier made without ``backend`` or ``device`` learns
which of them it gets. Importing this package imports neither cupy nor cuda-python.
"""

from __future__ import annotations

import logging
import threading

__all__ = ["default_backend", "pick_default"]

_log = logging.getLogger("cucopy")
_told = False
_lock = threading.Lock()


def default_backend() -> tuple[str, str]:
    """Which backend a copier made with ``backend=None`` and no device gets, and why.

    Imports CuPy to find out (the first call only); never raises.

    Returns
    -------
    name : {"cuda", "sim"}
        ``"cuda"`` when CuPy imports and sees a CUDA device, else ``"sim"``.
    why : str
        What decided it, e.g. ``"CuPy is not installed (No module named 'cupy')"``.
    """
    from .cuda import gpu_status

    ok, why = gpu_status()
    return ("cuda" if ok else "sim"), why


def pick_default() -> str:
    """:func:`default_backend`'s name, logging once per process when it is the simulator.

    A copier that silently ran on the simulated device on a machine meant to have a GPU
    would look like it works; the warning (logger ``"cucopy"``) says why it fell back.

    Returns
    -------
    str
        ``"cuda"`` or ``"sim"``.
    """
    global _told
    name, why = default_backend()
    if name == "sim" and not _told:
        with _lock:
            if not _told:
                _told = True
                _log.warning(
                    "cucopy: a copier made without backend= or device= runs on the simulated "
                    "device: %s. Pass backend='sim' (or a SimDevice) to choose it explicitly; "
                    "cucopy.show_config() shows what was found.",
                    why,
                )
    return name
