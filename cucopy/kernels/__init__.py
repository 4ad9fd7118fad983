"""CUDA C sources of cucopy's kernels and an NVRTC front end for checking them.

``scatter.cu`` holds ``cucopy_scatter`` (applies one segment, see
:mod:`cucopy.pack`), ``cucopy_scatter_c*`` (the same, with the segment's start
carried in the launch's parameters) and ``cucopy_fill``. The CUDA backend builds each
entry point as a module of its own, ``cupy.RawModule(code=source([name]),
options=("-std=c++17",))``, in parallel; :func:`compile_ptx`
compiles it with NVRTC through cuda-python, so CI (which has no GPU) can check
that it compiles warning-free and that its structs match the wire format.

Importing this module imports neither cupy nor cuda-python.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from importlib import resources

from .. import pack

__all__ = ["source", "entry_mask", "compile_ptx", "ENTRY_POINTS", "NVRTC_OPTIONS"]

#: The ``extern "C"`` kernels in ``scatter.cu``.
ENTRY_POINTS = (
    "cucopy_scatter",
    "cucopy_fill",
    *pack.CARRY_ENTRY_POINTS,
    pack.FEED_ENTRY_POINT,
    pack.GRAPH_ENTRY_POINT,
)

#: Options shared by every build of ``scatter.cu`` (the architecture is added
#: per call). ``--display-error-number`` puts the diagnostic number in the log,
#: so a warning can be looked up and, if ever needed, silenced by number.
NVRTC_OPTIONS = ("-std=c++17", "--display-error-number")

_WARNING = re.compile(r"\bwarning\b", re.IGNORECASE)


def source(entry_points: Iterable[str] | None = None) -> str:
    """Return the CUDA C source of the scatter and fill kernels.

    Parameters
    ----------
    entry_points : iterable of str, optional
        Define only these of :data:`ENTRY_POINTS` (``CUCOPY_ENTRIES`` in
        ``scatter.cu``); None defines them all. The selection is written into the
        text, not passed as a compiler option, so every selection shares one set of
        options (CuPy's compile cache probes the compiler once per set of options).

    Returns
    -------
    str
        The text of ``cucopy/kernels/scatter.cu``, with a ``#define`` line first when
        ``entry_points`` is given (a ``#line`` directive keeps the file's line numbers
        in compiler messages).

    Raises
    ------
    ValueError
        If ``entry_points`` names a kernel that is not in :data:`ENTRY_POINTS`.
    """
    text = resources.files(__name__).joinpath("scatter.cu").read_text(encoding="utf-8")
    if entry_points is None:
        return text
    return f'#define CUCOPY_ENTRIES {entry_mask(entry_points):#x}u\n#line 1 "scatter.cu"\n{text}'


def entry_mask(entry_points: Iterable[str]) -> int:
    """The ``CUCOPY_ENTRIES`` bit mask selecting ``entry_points`` (bit i: ``ENTRY_POINTS[i]``).

    Parameters
    ----------
    entry_points : iterable of str

    Returns
    -------
    int

    Raises
    ------
    ValueError
        If a name is not in :data:`ENTRY_POINTS`.
    """
    mask = 0
    for name in entry_points:
        if name not in ENTRY_POINTS:
            raise ValueError(
                f"entry_points: {name!r} is not a kernel of scatter.cu; expected some of "
                f"{ENTRY_POINTS}"
            )
        mask |= 1 << ENTRY_POINTS.index(name)
    return mask


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        from cuda import nvrtc  # cuda-python < 12.6 kept the bindings here
    return nvrtc


def _check(nvrtc, result, what: str, log: str = ""):
    err, *rest = result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, msg = nvrtc.nvrtcGetErrorString(err)
        text = msg.decode() if isinstance(msg, bytes) else str(msg)
        raise RuntimeError(f"NVRTC {what} failed: {text}" + (f"\n{log}" if log else ""))
    return rest[0] if len(rest) == 1 else rest


def compile_ptx(
    arch: str = "sm_90",
    *,
    code: str | None = None,
    name: str = "scatter.cu",
    options: tuple[str, ...] = (),
) -> str:
    """Compile the kernels (or ``code``) to PTX with NVRTC.

    Parameters
    ----------
    arch : str
        Virtual or real GPU architecture for ``--gpu-architecture``, e.g.
        ``"sm_80"`` or ``"sm_90"``.
    code : str, optional
        CUDA C source to compile instead of :func:`source` (tests compile the
        kernel source with layout assertions appended).
    name : str
        File name NVRTC reports in its log.
    options : tuple of str
        Extra NVRTC options, after :data:`NVRTC_OPTIONS`.

    Returns
    -------
    str
        The PTX text.

    Raises
    ------
    ImportError
        If cuda-python is not installed.
    RuntimeError
        If NVRTC cannot be loaded, if compilation fails, or if the compile log
        contains a warning; the message carries the full log.
    """
    nvrtc = _nvrtc()
    text = source() if code is None else code
    opts = [*NVRTC_OPTIONS, f"--gpu-architecture={arch}", *options]
    prog = _check(
        nvrtc, nvrtc.nvrtcCreateProgram(text.encode(), name.encode(), 0, [], []), "create"
    )
    try:
        result = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        size = _check(nvrtc, nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        # NVRTC writes into this object: it must be a fresh one, never an interned
        # one-byte bytes that the whole interpreter shares (``b" " * 1`` is one)
        buf = bytes(size + 64)
        _check(nvrtc, nvrtc.nvrtcGetProgramLog(prog, buf), "log")
        log = buf.rstrip(b"\x00").decode(errors="replace").strip()
        _check(nvrtc, result, f"compile of {name} for {arch} ({' '.join(opts)})", log)
        if _WARNING.search(log):
            raise RuntimeError(f"NVRTC compile of {name} for {arch} produced warnings:\n{log}")
        size = _check(nvrtc, nvrtc.nvrtcGetPTXSize(prog), "PTX size")
        buf = bytes(size + 64)
        _check(nvrtc, nvrtc.nvrtcGetPTX(prog, buf), "PTX")
        return buf.rstrip(b"\x00").decode()
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
