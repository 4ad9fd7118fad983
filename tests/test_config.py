"""cucopy.show_config(), __version__, and the one-time log when a default copier falls back to sim."""

from __future__ import annotations

import importlib.metadata
import io
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cucopy as cc
from cucopy import _config, backends
from cucopy.backends import cuda as cuda_backend
from cucopy.backends.sim import SimDevice

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_pep440_and_matches_the_installed_metadata():
    assert re.fullmatch(r"\d+\.\d+\.\d+([ab]\d+|rc\d+)?(\.post\d+)?(\.dev\d+)?", cc.__version__)
    try:
        dist = importlib.metadata.distribution("cucopy")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("cucopy is not installed (run from a checkout)")
    # only an install of this checkout must agree (another checkout may be older)
    url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    if url.startswith("file://") and Path(url[len("file://") :]).resolve() == ROOT:
        assert dist.version == cc.__version__


def test_pyproject_reads_the_version_from_the_package():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in meta["project"]  # written once, in cucopy/_version.py
    assert "version" in meta["project"]["dynamic"]
    dynamic = meta["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "cucopy._version.__version__"}


def test_package_files_a_user_expects():
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert "Version 2.0, January 2004" in (ROOT / "LICENSE").read_text()
    assert (ROOT / "cucopy" / "py.typed").exists()
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## {cc.__version__}" in changelog


@pytest.fixture
def no_gpu(monkeypatch):
    """The default backend as on a machine without CuPy; the one-time log re-armed."""
    monkeypatch.setattr(cuda_backend, "gpu_status", lambda: (False, "CuPy is not installed (test)"))
    monkeypatch.setattr(backends, "_told", False)


def test_default_copier_logs_once_that_it_runs_on_the_simulator(no_gpu, caplog):
    caplog.set_level(logging.WARNING, logger="cucopy")
    for _ in range(3):
        with cc.DeviceCopier() as copier:
            assert copier.backend.name == "sim"
    records = [r for r in caplog.records if r.name == "cucopy"]
    assert len(records) == 1
    msg = records[0].getMessage()
    assert "simulated device" in msg and "CuPy is not installed (test)" in msg
    assert "show_config" in msg


def test_an_explicit_simulator_is_not_logged(no_gpu, caplog):
    caplog.set_level(logging.DEBUG, logger="cucopy")
    with cc.DeviceCopier(backend="sim"):
        pass
    with cc.DeviceCopier(device=SimDevice()):
        pass
    assert not [r for r in caplog.records if r.name == "cucopy"]


def test_default_backend_names_the_gpu_when_cupy_sees_one(monkeypatch):
    monkeypatch.setattr(cuda_backend, "gpu_status", lambda: (True, "CuPy sees 2 CUDA devices"))
    assert backends.default_backend() == ("cuda", "CuPy sees 2 CUDA devices")


def test_show_config_says_which_backend_and_why(no_gpu):
    buf = io.StringIO()
    cc.show_config(file=buf)
    text = buf.getvalue()
    assert text.startswith(f"cucopy {cc.__version__}\n")
    assert "default backend: sim (CuPy is not installed (test))" in text
    assert "cuda  unavailable: CuPy is not installed (test)" in text
    assert "staging path: " in text
    assert "numpy " in text and "cuda-python " in text and "torch " in text


def test_config_dict_is_json_ready(no_gpu):
    c = cc._config.config_dict()
    assert c == json.loads(json.dumps(c))
    assert c["version"] == cc.__version__
    assert c["default_backend"] == {"name": "sim", "why": "CuPy is not installed (test)"}
    assert c["staging"] == _config._staging()
    assert c["check_mode"] is bool(cc.CHECK_MODE)
    assert c["completion_tags"] is bool(cc.copier.TAGS)
    assert set(c["versions"]) >= {"numpy", "cupy", "cuda-python", "torch"}


def test_staging_path_reads_the_segment_module(monkeypatch):
    class Segment:
        IMPLEMENTATION = "c"

    monkeypatch.setitem(sys.modules, "cucopy.segment", Segment)
    assert _config._staging() == "c"
    monkeypatch.setitem(sys.modules, "cucopy.segment", None)  # import fails
    assert _config._staging() == "python"


def test_show_config_imports_no_framework():
    code = (
        "import sys, cucopy; cucopy._config.config_dict(); "
        "bad = [m for m in ('torch', 'jax', 'jaxlib') if m in sys.modules]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
