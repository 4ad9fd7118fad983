"""The examples run end to end: on the simulated device here, on CUDA where a GPU is visible."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TORCH_EXAMPLE = EXAMPLES / "torch_decode_loop.py"
JAX_EXAMPLE = EXAMPLES / "cupy_jax_prototype.py"

HAVE_TORCH = importlib.util.find_spec("torch") is not None
HAVE_JAX = importlib.util.find_spec("jax") is not None

needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="needs torch")
needs_jax = pytest.mark.skipif(not HAVE_JAX, reason="needs jax")


def run_example(path: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("CUCOPY_CHECK", None)  # check mode only where a test asks for it (--check)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, str(path), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_match(proc: subprocess.CompletedProcess) -> None:
    report = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 0, report
    assert any(line.startswith("match:") for line in proc.stdout.splitlines()), report
    assert "MISMATCH" not in proc.stdout + proc.stderr, report


def load(path: Path, monkeypatch):
    """Import an example in this process (its module-level settings are undone after)."""
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # restored at teardown
    monkeypatch.syspath_prepend(str(ROOT))
    spec = importlib.util.spec_from_file_location(f"_example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", [TORCH_EXAMPLE, JAX_EXAMPLE], ids=lambda p: p.stem)
def test_docstring_has_usage(path):
    text = path.read_text()
    assert '"""' in text.splitlines()[0]
    assert "Usage:" in text.split('"""')[1]


# -- the simulated device ----------------------------------------------------------------------


@needs_torch
@pytest.mark.parametrize("extra", [(), ("--check",), ("--sim-policy", "lazy")], ids=str)
def test_torch_decode_loop_sim(extra):
    proc = run_example(TORCH_EXAMPLE, "--sim", "--steps", "5", *extra)
    assert_match(proc)
    assert "Site.BLOCK_TABLE" in proc.stdout  # copier.stats was printed


@needs_torch
def test_torch_decode_loop_sim_json(tmp_path):
    out = tmp_path / "run.json"
    proc = run_example(TORCH_EXAMPLE, "--sim", "--steps", "5", "--batch", "4", "--json", str(out))
    assert_match(proc)
    data = json.loads(out.read_text())
    assert data["match"] is True
    assert data["backend"] == "sim"
    assert data["args"]["batch"] == 4
    assert data["stats"]["steps"] == 5
    assert data["stats"]["sites"]["Site.TOKENS"]["merged"] == 5
    assert data["graph_stats"]["modes"]["graph"] == 5  # the embedded loop's node landed each
    assert data["graph_stats"]["sites"]["Site.TOKENS"]["merged"] == 5
    assert data["cucopy"]["median_host_us"] > 0
    assert {"python", "numpy", "torch"} <= set(data["environment"])


@needs_torch
def test_torch_decode_loop_reports_a_wrong_upload(monkeypatch, capsys):
    ex = load(TORCH_EXAMPLE, monkeypatch)
    cc = ex.cc
    upload = ex.upload_cucopy

    def wrong(shape, bufs, inp):
        upload(shape, bufs, inp)
        cc.copy(ex.Site.TOKENS, bufs.tokens[:1], inp.tokens[:1] + 1)

    monkeypatch.setattr(ex, "upload_cucopy", wrong)
    assert ex.main(["--sim", "--steps", "3", "--batch", "4"]) == 1
    assert "MISMATCH" in capsys.readouterr().err


@needs_torch
def test_torch_plain_uploader_writes_what_the_mirror_says(monkeypatch):
    # the CUDA run's baseline (copy_ chain from pinned tensors), here on CPU tensors
    import torch

    ex = load(TORCH_EXAMPLE, monkeypatch)

    class Event:
        waits = records = 0

        def synchronize(self):
            Event.waits += 1

        def record(self, stream):
            Event.records += 1

    shape = ex.Shape(batch=6)
    bufs = ex.Buffers(shape, lambda size: torch.full(size, 7, dtype=torch.int32))
    for buf, pad in zip(bufs.all(), (-1, -1, 0, -1)):
        buf.fill_(pad)
    upload = ex.PlainUploader(shape, bufs, Event(), stream=None, pin_memory=False)
    mirror = ex.HostMirror(shape)
    for step in range(12):
        inp = ex.make_inputs(shape, step, seed=3)
        upload(inp)
        mirror.apply(inp)
        got = torch.cat([b.reshape(-1) for b in bufs.all()]).numpy()
        assert (got == mirror.flat()).all(), step
    assert Event.waits == Event.records == 12


def test_cupy_jax_prototype_sim_numpy():
    assert_match(run_example(JAX_EXAMPLE, "--sim", "--steps", "5", "--no-jax"))


@needs_jax
@pytest.mark.parametrize("extra", [(), ("--check",), ("--sim-policy", "lazy")], ids=str)
def test_cupy_jax_prototype_sim_jax(extra):
    proc = run_example(JAX_EXAMPLE, "--sim", "--steps", "5", *extra)
    assert_match(proc)
    assert "JAX on the CPU" in proc.stdout
    assert "Site.WEIGHTS" in proc.stdout


def test_cupy_jax_prototype_reports_a_wrong_upload(monkeypatch, capsys):
    ex = load(JAX_EXAMPLE, monkeypatch)
    cc = ex.cc

    def no_pad(bufs, inp, weights_src):  # leaves stale lengths in the unused rows
        values, lengths, weights = bufs
        n, m = inp.n, inp.values.shape[1]
        cc.copy(ex.Site.VALUES, values[:n, :m], inp.values)
        cc.copy(ex.Site.LENGTHS, lengths[:n], inp.lengths)
        cc.copy(ex.Site.WEIGHTS, weights, weights_src)

    monkeypatch.setattr(ex, "upload", no_pad)
    assert ex.main(["--sim", "--no-jax", "--steps", "8"]) == 1
    assert "MISMATCH" in capsys.readouterr().err


# -- CUDA ----------------------------------------------------------------------------------------


def _probe(code: str) -> bool:
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    return proc.returncode == 0


@pytest.mark.gpu
@needs_torch
@pytest.mark.parametrize("extra", [("--steps", "100"), ("--steps", "10", "--check")], ids=str)
def test_torch_decode_loop_gpu(extra, tmp_path):
    if not _probe("import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"):
        pytest.skip("torch has no CUDA")
    out = tmp_path / "run.json"
    proc = run_example(TORCH_EXAMPLE, *extra, "--json", str(out))
    assert_match(proc)
    data = json.loads(out.read_text())
    assert data["backend"] == "cuda" and data["match"] is True
    assert data["cucopy"]["median_gpu_us"] > 0 and data["plain"]["median_gpu_us"] > 0
    sites = data["stats"]["sites"]
    assert all(not s["fallback"] for s in sites.values()), sites  # everything merged
    assert data["graph"]["median_gpu_us"] > 0
    assert data["graph_stats"]["modes"]["graph"] == data["graph_stats"]["steps"]
    # the stats are the verified loops' own, not the timed rounds' after them
    steps = int(extra[1])
    assert data["stats"]["steps"] == steps and data["graph_stats"]["steps"] == steps
    timed = data["timed"]  # then 5 timed rounds of each loop, rotated
    assert timed["rounds"] == 5
    assert {n: len(w) for n, w in timed["wall_us_per_step"].items()} == dict.fromkeys(
        ("cucopy", "plain", "graph"), 5
    )
    assert set(timed["ratio_to_plain"]) == {"cucopy", "graph"}
    assert all(r > 0 for r in timed["ratio_to_plain"].values())
    assert "timed (5 rounds" in proc.stdout


@pytest.mark.gpu
@needs_jax
@pytest.mark.parametrize("extra", [("--steps", "100"), ("--steps", "10", "--check")], ids=str)
def test_cupy_jax_prototype_gpu(extra):
    if not _probe("import jax; jax.devices('gpu')"):
        pytest.skip("jax has no GPU backend")
    proc = run_example(JAX_EXAMPLE, *extra)
    assert_match(proc)
    assert "Site.WEIGHTS" in proc.stdout
