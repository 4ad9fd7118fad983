"""The test configuration turns cucopy's own DeprecationWarnings into errors.

pyproject.toml's ``filterwarnings`` holds ``error::DeprecationWarning:cucopy(\\.|$)``:
a DeprecationWarning whose stack level points into a module of cucopy (a deprecated
NumPy call made by cucopy's code, say) fails the test that triggered it; one raised
from elsewhere (a test's own code, a third-party library) stays a warning. These tests
run under that configuration and check both sides, with code executed as if it lay in
a cucopy module (its globals' ``__name__``, which is what the warnings filter matches).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]

WARN = "import warnings\nwarnings.warn('old API', DeprecationWarning, stacklevel=1)\n"


def _run_as(module: str, code: str, **names) -> None:
    exec(compile(code, f"<{module}>", "exec"), {"__name__": module, **names})


def _config_filters() -> list[str]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        tomllib = pytest.importorskip("tomli")
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["pytest"]["ini_options"]["filterwarnings"]


def test_the_config_holds_the_filter():
    assert "error::DeprecationWarning:cucopy(\\.|$)" in _config_filters()


@pytest.mark.parametrize("module", ["cucopy", "cucopy.backends.sim", "cucopy.adapters.torch"])
def test_a_deprecation_warned_from_cucopy_is_an_error(module):
    with pytest.raises(DeprecationWarning, match="old API"):
        _run_as(module, WARN)


@pytest.mark.parametrize("module", ["tests.test_sim", "numpy.core", "cucopyx", "not_cucopy"])
def test_a_deprecation_from_elsewhere_stays_a_warning(module):
    with pytest.warns(DeprecationWarning, match="old API"):
        _run_as(module, WARN)


@pytest.mark.skipif(
    np.lib.NumpyVersion(np.__version__) < "2.5.0", reason="NumPy deprecates .shape= from 2.5"
)
def test_numpys_shape_assignment_from_cucopy_is_an_error():
    # the call cucopy's simulated device made before it moved to reshape(copy=False)
    code = "v = a.view()\nv.shape = (2, 3)\n"
    with pytest.raises(DeprecationWarning):
        _run_as("cucopy.backends.sim", code, a=np.zeros(6))


def test_sim_reshape_makes_views_without_deprecated_calls():
    from cucopy.backends.sim import SimDevice

    dev = SimDevice()
    a = dev.empty((4, 6), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning at all, from any module
        b = a.reshape(24)
        c = a.reshape((3, -1))
        d = a.reshape(2, 12)
    assert (b.shape, c.shape, d.shape) == ((24,), (3, 8), (2, 12))
    assert b.ptr == c.ptr == d.ptr == a.ptr  # views of the same memory
    with pytest.raises((ValueError, AttributeError)):  # no view of a transposed array
        a.T.reshape(-1)
