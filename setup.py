"""Build cucopy's compiled twins when a C compiler is present.

``cucopy._segment`` (the staging core) and ``cucopy.backends._cudacall`` (the CUDA
backend's per-step driver calls).

The extension is optional: without a compiler the install still succeeds, says
so once, and cucopy runs its pure-Python twin (``cucopy.segment.PySegment``).
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """``build_ext`` that turns a failed compile into one warning."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # no compiler at all (distutils raises before compiling)
            _warn(exc)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            _warn(exc)


def _warn(exc) -> None:
    import sys

    print(
        f"WARNING: cucopy: the compiled staging core was not built ({exc}); "
        "cucopy will use its pure-Python staging path (slower on the host, same results).",
        file=sys.stderr,
    )


setup(
    ext_modules=[
        Extension(
            "cucopy._segment",
            ["cucopy/_segment.c"],
            depends=["cucopy/_carried_launcher.h"],
            extra_compile_args=["-O2", "-std=c11"],
        ),
        # the CUDA backend's per-step driver calls (links nothing: entry points are
        # passed in as addresses); cuda.py falls back to CuPy's wrappers without it
        Extension(
            "cucopy.backends._cudacall",
            ["cucopy/backends/_cudacall.c"],
            depends=["cucopy/_carried_launcher.h"],
            extra_compile_args=["-O2", "-std=c11"],
        ),
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
