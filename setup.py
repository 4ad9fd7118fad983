"""Build cucopy's compiled twins when a C compiler is present.

``cucopy._segment`` (the staging core) and ``cucopy.backends._cudacall`` (the CUDA
backend's per-step driver calls).

The extension is optional: without a compiler the install still succeeds, says
so once, and cucopy runs its pure-Python twin (``cucopy.segment.PySegment``).
"""

import glob
import sys

import setuptools
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# pyproject.toml's SPDX ``license = "Apache-2.0"`` needs setuptools 77. A build with
# isolation (pip's default) gets it from [build-system]; one without isolation uses the
# environment's, whose older releases fail with an opaque ``project.license`` error.
_SETUPTOOLS = tuple(int(p) for p in setuptools.__version__.split(".")[:2] if p.isdigit())
if _SETUPTOOLS < (77,):
    sys.exit(
        f"cucopy: building needs setuptools >= 77, found {setuptools.__version__}: run "
        "pip install 'setuptools>=77' first, or build with isolation (drop "
        "--no-build-isolation)"
    )

#: what each optional extension gives, and what runs without it
_WHAT = {
    "cucopy._segment": "the compiled staging core (without it: the pure-Python staging "
    "path, slower on the host, same results)",
    "cucopy.backends._cudacall": "the CUDA backend's compiled driver calls (without them: "
    "CuPy's wrappers, slower on the host, same results)",
}


class OptionalBuildExt(build_ext):
    """``build_ext`` that turns failed compiles into one warning naming each extension."""

    def run(self):
        self._failed = {}
        try:
            super().run()
        except Exception as exc:  # no compiler at all (raised before any extension)
            for ext in self.extensions:
                self._failed.setdefault(ext.name, exc)
        if self._failed:
            lines = [f"  {name}: {_WHAT[name]} ({exc})" for name, exc in self._failed.items()]
            print(
                "WARNING: cucopy: not built, so cucopy runs without them:\n" + "\n".join(lines),
                file=sys.stderr,
            )

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._failed[ext.name] = exc


setup(
    ext_modules=[
        Extension(
            "cucopy._segment",
            # one translation unit: module.c includes the concept files beside it
            # (cucopy/_core/README.md says why)
            ["cucopy/_core/module.c"],
            depends=["cucopy/_carried_launcher.h"] + sorted(glob.glob("cucopy/_core/*.[ch]")),
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
