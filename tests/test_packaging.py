"""Packaging: what the sdist holds, what a build without a compiler says, the metadata.

Each build runs in a copy of the repository's files (a temporary folder), through
setuptools' PEP 517 hooks, so the checkout gets no build outputs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("setuptools")


def _source_copy(tmp_path: Path) -> Path:
    """The files a build reads (package, build inputs, documents), copied."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "CHANGELOG.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copy2(ROOT / "LICENSE", src / "LICENSE")
    shutil.copytree(
        ROOT / "cucopy", src / "cucopy", ignore=shutil.ignore_patterns("*.so", "__pycache__")
    )
    shutil.copytree(ROOT / "tests", src / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    return src


def _hook(src: Path, code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "import setuptools.build_meta as b\n" + code],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_sdist_ships_the_package_and_no_test_suite(tmp_path):
    src = _source_copy(tmp_path)
    out = tmp_path / "dist"
    proc = _hook(src, f"print(b.build_sdist({str(out)!r}))")
    assert proc.returncode == 0, proc.stderr
    (sdist,) = out.glob("cucopy-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for needed in (
        "setup.py",
        "pyproject.toml",
        "README.md",
        "LICENSE",
        "cucopy/__init__.py",
        "cucopy/_core/module.c",
        "cucopy/_core/README.md",
        *(f"cucopy/_core/{p.name}" for p in (ROOT / "cucopy" / "_core").glob("*.[ch]")),
        "cucopy/backends/_cudacall.c",
        "cucopy/kernels/scatter.cu",
        "cucopy/py.typed",
        "cucopy/_segment.pyi",
    ):
        assert needed in names, needed
    # a test suite without its conftest.py, bench/ and README fails: none is shipped
    assert not [n for n in names if n.startswith(("tests/", "bench/", "examples/"))]


def test_a_build_without_a_compiler_warns_once_naming_each_extension(tmp_path):
    src = _source_copy(tmp_path)
    out = tmp_path / "wheel"
    proc = _hook(
        src, f"print(b.build_wheel({str(out)!r}))", env={"CC": "false", "LDSHARED": "false"}
    )
    assert proc.returncode == 0, proc.stderr
    (wheel,) = out.glob("cucopy-*.whl")
    with zipfile.ZipFile(wheel) as whl:
        assert "cucopy/_segment.pyi" in whl.namelist()  # the stubs, even with no extension
    assert proc.stderr.count("WARNING: cucopy") == 1, proc.stderr
    for name in ("cucopy._segment: the compiled staging core", "cucopy.backends._cudacall"):
        assert name in proc.stderr, proc.stderr


def test_an_old_setuptools_is_refused_with_a_clear_message(tmp_path):
    code = (
        "import runpy, setuptools\nsetuptools.__version__ = '70.3.0'\nrunpy.run_path('setup.py')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0
    assert "needs setuptools >= 77, found 70.3.0" in proc.stderr


def test_metadata_has_classifiers_and_one_cuda_major_per_extra():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "Programming Language :: Python :: 3" in project["classifiers"]
    assert any(c.startswith("Environment :: GPU :: NVIDIA CUDA") for c in project["classifiers"])
    extras = project["optional-dependencies"]

    def cuda_python(extra):
        (spec,) = [d for d in extras[extra] if d.startswith("cuda-python")]
        return spec

    # extras meant to go together agree on cuda-python's major
    assert cuda_python("cuda12") == cuda_python("nvrtc12")
    assert cuda_python("cuda13") == cuda_python("nvrtc13") == cuda_python("nvrtc")


def _fake_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A venv whose python logs its arguments and succeeds (``import torch`` included)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "calls.log"
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    python.chmod(0o755)
    return venv, log


def _run(venv: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "run"), *args],
        env={**os.environ, "CUCOPY_VENV": str(venv)},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_run_installs_what_each_command_needs(tmp_path):
    venv, log = _fake_venv(tmp_path)

    def calls():
        out = log.read_text().splitlines() if log.exists() else []
        log.unlink(missing_ok=True)
        return out

    assert _run(venv, "bench", "--quick").returncode == 0
    got = calls()
    assert "-m pip install -q -e .[bench]" in got and got[-1] == "-m bench --quick"
    assert not any("test" in c or "torch" in c for c in got), got
    assert _run(venv, "bench").returncode == 0
    assert calls() == ["-m bench"]  # installed: nothing again
    # the bench environment used for tests: the test profile goes in then, once
    assert _run(venv, "test", "-x").returncode == 0
    got = calls()
    assert "-m pip install -q -e .[test,bench,nvrtc,hf]" in got and got[-1] == "-m pytest -q -x"
    assert _run(venv, "test").returncode == 0
    assert calls() == ["-m pytest -q"]
    assert _run(venv, "bench").returncode == 0
    assert calls() == ["-m bench"]  # the test profile holds the bench one


def test_run_without_a_command_prints_its_usage(tmp_path):
    venv, log = _fake_venv(tmp_path)
    proc = _run(venv, "nonsense")
    assert proc.returncode == 2 and "./run bench" in proc.stdout
    assert not log.exists()  # nothing installed
