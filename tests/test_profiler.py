"""The copy profiler (cucopy.profiler): counts by call site and step, on torch's meta device."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
import threading
import types
from pathlib import Path

import numpy as np
import pytest

import cucopy as cc
from cucopy import profiler

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
DEV = "meta"  # a device type CPU torch has: copies to it are calls the profiler sees


def _line(fn, marker: str) -> int:
    """The line of ``fn``'s source ending in ``marker`` (a comment; not a lookup of it)."""
    lines, start = inspect.getsourcelines(fn)
    (k,) = [i for i, text in enumerate(lines) if text.rstrip().endswith(marker)]
    return start + k


def _program(dst, table, host, n: int) -> None:
    dst[:8].copy_(host[:8], non_blocking=True)  # COPY
    torch.tensor([1, 2, 3], dtype=torch.int64, device=DEV)  # TENSOR
    host.to(DEV)  # TO
    table[torch.tensor([0, 1])] = torch.ones(2, 4, dtype=torch.int64)  # INDEX
    torch.as_tensor(np.arange(5, dtype=np.int32), device=DEV)  # AS_TENSOR
    torch._foreach_copy_([dst[:2], dst[2:4]], [host[:2], host[2:4]])  # FOREACH
    dst[8:].fill_(-1)  # FILL
    dst.zero_()  # ZERO
    torch.full((n,), 1.0, device=DEV)  # FULL


def _buffers():
    dst = torch.zeros(16, dtype=torch.int32, device=DEV)
    table = torch.zeros(4, 4, dtype=torch.int64, device=DEV)
    host = torch.arange(16, dtype=torch.int32)
    return dst, table, host


def _by_line(prof) -> dict:
    return {int(r.site.rsplit(":", 1)[1]): r for r in prof.sites}


def test_counts_bytes_and_kinds_per_call_site_are_exact():
    dst, table, host = _buffers()
    with cc.profile(device=DEV) as prof:
        for n in (3, 5):
            _program(dst, table, host, n)
            prof.step()
    assert prof.steps == 2
    recs = _by_line(prof)
    want = {  # marker: (op, upload, counts, bytes a step, waits a step)
        "COPY": ("copy_", True, 1, 32, 1),  # pageable source: waits even non_blocking
        "TENSOR": ("torch.tensor", True, 1, 24, 1),
        "TO": (".to", True, 1, 64, 1),
        "INDEX": ("index_put_", True, 1, 16 + 64, 1),  # host indices + values
        "AS_TENSOR": ("torch.as_tensor", True, 1, 20, 1),
        "FOREACH": ("_foreach_copy_", True, 2, 16, 2),
        "FILL": ("fill_", False, 1, 32, 0),
        "ZERO": ("zero_", False, 1, 64, 0),
    }
    for marker, (op, upload, count, nbytes, waits) in want.items():
        r = recs.pop(_line(_program, f"# {marker}"))
        assert (r.op, r.upload) == (op, upload), marker
        assert r.counts == [count, count], marker
        assert r.nbytes == [nbytes, nbytes], marker
        assert r.waits == [waits, waits], marker
        assert r.function == "_program"
        assert r.source == ("pageable" if upload else "-")
        assert r.site.startswith("tests/test_profiler.py:") or r.site.startswith(
            "test_profiler.py:"
        )
    full = recs.pop(_line(_program, "# FULL"))
    assert full.op == "torch.full" and full.nbytes == [12, 20]  # float32 x n
    assert not recs  # nothing else: torch.ones on the CPU and the D2D work are not uploads
    # torch.tensor(np) moves its data with _to_copy below the factory: counted once
    assert sum(r.op == ".to" for r in prof.sites) == 1


def test_pinned_non_blocking_copies_do_not_wait(monkeypatch):
    dst, _, host = _buffers()
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: True)
    with cc.profile(device=DEV) as prof:
        dst.copy_(host, non_blocking=True)
        dst.copy_(host)  # non_blocking=False: torch synchronizes after it
    a, b = prof.sites
    assert (a.source, a.waits, b.source, b.waits) == ("pinned", [0], "pinned", [1])


def test_steps_before_the_first_mark_and_after_the_last_count():
    dst, _, host = _buffers()
    with cc.profile(device=DEV) as prof:
        dst.copy_(host)
        prof.step()
        prof.step()  # an empty step in the middle stays
        dst.copy_(host)
        dst.copy_(host)
    assert prof.steps == 3
    assert [r.counts for r in prof.sites] == [[1, 0, 0], [0, 0, 1], [0, 0, 1]]


def test_empty_edges_are_dropped_and_no_mark_is_one_step():
    dst, _, host = _buffers()
    with cc.profile(device=DEV) as prof:
        profiler.step()  # module-level: marks the active profile
        for _ in range(3):
            dst.copy_(host)
            profiler.step()
    assert prof.steps == 3 and prof.sites[0].counts == [1, 1, 1]
    with cc.profile(device=DEV) as one:
        for _ in range(3):
            dst.copy_(host)
    assert one.steps == 1 and one.sites[0].counts == [3]
    profiler.step()  # no profile active: nothing happens


def test_host_copies_and_other_devices_are_not_uploads():
    cpu = torch.zeros(4)
    with cc.profile(device=DEV) as prof:
        cpu.copy_(torch.ones(4))
        torch.tensor([1.0, 2.0])
        torch.full((3,), 2.0)
        m = torch.zeros(4, device=DEV)  # a fill on the device, counted
        m[:2].copy_(m[2:])  # device to device: not an upload
    assert [r.op for r in prof.sites] == ["torch.zeros"]


def test_no_uploads_says_so():
    with cc.profile(device=DEV) as prof:
        torch.ones(3) + 1
    text = prof.report()
    assert "no host-to-device uploads or fills on 'meta'" in text
    assert "nothing to merge" in text
    assert prof.sites == [] and prof.estimate().copies == 0
    if not torch.cuda.is_available():
        with cc.profile() as nothing:  # device="cuda" on a machine without one
            torch.ones(3)
        assert "torch sees no CUDA device here" in nothing.report()
    ns: dict = {}
    exec(prof.skeleton(), ns)
    assert list(ns["Site"]) == [] and ns["PLAN"].merge == frozenset()


def test_a_block_that_raises_reports_what_it_saw_and_reraises():
    dst, _, host = _buffers()
    with pytest.raises(ValueError, match="boom"):
        with cc.profile(device=DEV) as prof:
            dst.copy_(host)
            prof.step()
            dst.copy_(host)
            raise ValueError("boom")
    assert isinstance(prof.error, ValueError)
    text = prof.report()
    assert "the block raised ValueError: boom" in text
    assert [r.counts for r in prof.sites] == [[1, 0], [0, 1]]
    # the modes are gone: copies after the block are not recorded
    dst.copy_(host)
    assert sum(sum(r.counts) for r in prof.sites) == 2


def test_one_profile_at_a_time_and_once():
    prof = cc.profile(device=DEV)
    with prof:
        with pytest.raises(RuntimeError, match="another cucopy.profile block is active"):
            with cc.profile(device=DEV):
                pass
    with pytest.raises(RuntimeError, match="records one block"):
        with prof:
            pass
    with pytest.raises(TypeError, match="device must be a torch device type"):
        cc.profile(device=0)


def test_threads_started_inside_the_block_are_seen():
    dst, _, host = _buffers()

    def worker():
        dst.copy_(host)  # THREAD

    with cc.profile(device=DEV) as prof:
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    (r,) = prof.sites
    assert r.counts == [1] and r.site.endswith(f":{_line(worker, '# THREAD')}")


def test_calls_from_cucopy_itself_are_not_counted():
    # cucopy routes its own copies: a call whose caller is a cucopy module is left out
    pkg = os.path.dirname(cc.__file__)
    ns = {"torch": torch}
    src = "def inside(dst, host):\n    dst.copy_(host)\n"
    exec(compile(src, os.path.join(pkg, "_fake_module.py"), "exec"), ns)
    dst, _, host = _buffers()
    with cc.profile(device=DEV) as prof:
        ns["inside"](dst, host)
    assert prof.sites == []


def test_cupy_entry_points_are_wrapped_when_cupy_is_imported(monkeypatch):
    fake = types.ModuleType("cupy")
    fake.__file__ = os.path.join(os.sep, "nowhere", "cupy", "__init__.py")

    class ndarray:  # noqa: N801 (CuPy's name)
        __cuda_array_interface__: dict = {}

        def __init__(self, n=0):
            self.nbytes = n

        def set(self, arr, stream=None):
            self.nbytes = arr.nbytes

    fake.ndarray = ndarray
    fake.asarray = lambda obj, dtype=None: ndarray(np.asarray(obj).nbytes)
    fake.array = lambda obj, dtype=None: ndarray(np.asarray(obj).nbytes)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    old = fake.asarray
    dev = ndarray()
    with cc.profile(device=DEV) as prof:
        fake.asarray(np.zeros(4, np.int64))  # host data: an upload
        fake.asarray(dev)  # already on the device: not one
        fake.array([1, 2, 3])
        dev.set(np.zeros(2, np.int32))
    assert [(r.op, sum(r.nbytes)) for r in prof.sites] == [
        ("cupy.asarray", 32),
        ("cupy.array", 24),
        ("cupy.ndarray.set", 8),
    ]
    assert fake.asarray is old and "set" in ndarray.__dict__


def test_skeleton_is_python_defining_site_and_plan():
    dst, table, host = _buffers()
    with cc.profile(device=DEV) as prof:
        _program(dst, table, host, 2)
        _program(dst, table, host, 2)
    src = prof.skeleton()
    compile(src, "skeleton.py", "exec")
    ns: dict = {}
    exec(src, ns)
    site, plan = ns["Site"], ns["PLAN"]
    assert issubclass(site, cc.CopySite) and isinstance(plan, cc.CopyPlan)
    assert len(site) == len(prof.sites) == 9
    assert plan.merge == frozenset(site) and plan.flush_after == frozenset()
    dirs = [m.direction for m in site]
    assert dirs.count(cc.H2D) == 6 and dirs.count(cc.FILL) == 3
    assert all(m.name.startswith("PROGRAM_") for m in site)


def test_report_table_and_estimate_from_the_shipped_costs():
    dst, _, host = _buffers()
    with cc.profile(device=DEV) as prof:
        for _ in range(2):
            dst.copy_(host)
            dst.copy_(host)
            prof.step()
    e = prof.estimate()
    c = profiler.DEFAULT_COSTS
    assert e.costs is c and e.copies == 2 and e.waits == 2
    assert e.chained_host == pytest.approx(c.chain_host_step + 2 * c.chain_host_copy)
    assert e.merged_host == pytest.approx(c.merged_host_step + 2 * c.merged_host_copy)
    assert e.measured_host is None  # nothing ran on the meta device
    text = prof.report()
    for part in ("count/step", "bytes/step", "pageable", "waits/step", "host us/step"):
        assert part in text
    assert "the defaults shipped in cucopy.profiler (an H200's: bench run 50)" in text
    assert f"saves ~{e.host_saved:.1f} us a step" in text


RUN50 = ROOT / "bench" / "results" / "2026-12-02-h200-run50"


@pytest.mark.skipif(not RUN50.is_dir(), reason="needs the stored run 50")
def test_shipped_costs_are_run_50s_fit():
    fit = profiler.CopyCosts.from_bench(RUN50)
    d = profiler.DEFAULT_COSTS
    for name in (
        "chain_host_step",
        "chain_host_copy",
        "chain_gpu_step",
        "chain_gpu_copy",
        "merged_host_step",
        "merged_host_copy",
        "merged_gpu_step",
        "merged_gpu_copy",
    ):
        assert getattr(fit, name) == getattr(d, name), name
    assert fit.gpu == d.gpu == "NVIDIA H200"
    found = profiler.stored_costs("NVIDIA H200")
    assert found is not None and "bench/results/" in found.source
    assert profiler.stored_costs("No Such GPU") is None
    dst, _, host = _buffers()
    with cc.profile(device=DEV, costs=str(RUN50)) as prof:
        dst.copy_(host)
    assert "2026-12-02-h200-run50" in prof.report()


def test_costs_default_and_a_costs_object_are_taken_as_given():
    mine = profiler.CopyCosts(1, 2, 3, 4, 5, 6, 7, 8, gpu="Some GPU", source="mine")
    for costs, want in (("default", profiler.DEFAULT_COSTS), (mine, mine)):
        with cc.profile(device=DEV, costs=costs) as prof:
            torch.zeros(2, device=DEV)
        assert prof.costs() is want
        assert f"costs: {want.source} [{want.gpu}]" in prof.report()


def test_costs_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such bench results file"):
        profiler.CopyCosts.from_bench(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError, match="no bench results file"):
        profiler.CopyCosts.from_bench(tmp_path)
    sim = tmp_path / "2026-01-01-sim.json"
    sim.write_text(json.dumps({"scenarios": {"step_cost": {"results": []}}}))
    with pytest.raises(ValueError, match="no step_cost host_us medians for torch_chain"):
        profiler.CopyCosts.from_bench(sim)


# -- the command line ------------------------------------------------------------------------------


def _cli(*args, cwd=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "cucopy.profiler", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=120,
    )


SCRIPT = """
import sys
import torch
import cucopy.profiler

dst = torch.empty(8, device="meta")
for i in range(int(sys.argv[1])):
    dst.copy_(torch.ones(8))
    torch.tensor([1.0, 2.0], device="meta")
    cucopy.profiler.step()
if len(sys.argv) > 2:
    raise RuntimeError("late failure")
"""


def test_cli_runs_a_script_with_its_arguments(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(SCRIPT)
    skel = tmp_path / "sites.py"
    r = _cli("--device", "meta", "--skeleton", str(skel), str(script), "4", cwd=tmp_path)
    assert r.returncode == 0 and not r.stderr, r.stderr
    assert "4 steps on 'meta', 2 call sites, 2 uploads and fills a step" in r.stdout
    assert "prog.py:8" in r.stdout and "prog.py:9" in r.stdout
    ns: dict = {}
    exec(skel.read_text(), ns)
    assert len(ns["Site"]) == 2


def test_cli_script_that_raises_reports_then_reraises(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(SCRIPT)
    r = _cli("--device", "meta", str(script), "2", "fail", cwd=tmp_path)
    assert r.returncode == 1
    assert "the block raised RuntimeError: late failure" in r.stdout
    assert "2 steps on 'meta'" in r.stdout
    assert "RuntimeError: late failure" in r.stderr  # the traceback


def test_cli_missing_script_is_a_clear_error(tmp_path):
    r = _cli("--device", "meta", "no_such_script.py", cwd=tmp_path)
    assert r.returncode == 2
    assert "error: no such script: no_such_script.py" in r.stderr
    with pytest.raises(FileNotFoundError, match="no such script: 'no_such_script.py'"):
        profiler.run_script("no_such_script.py", device=DEV)


def test_cli_calls_a_function_for_n_steps(tmp_path):
    (tmp_path / "engine_mod.py").write_text(
        textwrap.dedent(
            """
            import torch
            calls = []
            dst = torch.zeros(4, device="meta")

            def step():
                calls.append(1)
                dst.copy_(torch.ones(4))
                if len(calls) % 2:
                    dst.fill_(0)
            """
        )
    )
    r = _cli(
        "--device",
        "meta",
        "--call",
        "engine_mod:step",
        "--steps",
        "4",
        "--warmup",
        "1",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "4 steps on 'meta', 2 call sites" in r.stdout
    assert "0.5 [0-1]" in r.stdout  # the fill runs on odd calls: warm-up 1, then 2 of 4
    bad = _cli("--device", "meta", "--call", "engine_mod", "--steps", "1", cwd=tmp_path)
    assert bad.returncode == 1 and "--call takes module:function" in bad.stderr
    none = _cli("--device", "meta", cwd=tmp_path)
    assert none.returncode == 2 and "give a SCRIPT or --call" in none.stderr


def test_run_call_in_process(monkeypatch, tmp_path):
    (tmp_path / "engine_mod2.py").write_text(
        'import torch\ndst = torch.zeros(2, device="meta")\n'
        "def step():\n    dst.copy_(torch.ones(2))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    prof = profiler.run_call("engine_mod2:step", 3, device=DEV)
    assert prof.steps == 3 and prof.sites[0].counts == [1, 1, 1]


def test_importing_cucopy_imports_no_framework():
    code = (
        "import sys, cucopy, cucopy.profiler; "
        "cucopy.profile(device='meta'); "
        "bad = [m for m in ('torch', 'cupy', 'jax') if m in sys.modules]; "
        "assert not bad, bad; print('ok')"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    assert "profile" in cc.__all__ and cc.profile is profiler.profile


# -- bench/profile_programs.py, the part without a GPU ---------------------------------------------


def _profile_programs():
    """``bench.profile_programs``, imported from the repository root."""
    sys.path.insert(0, str(ROOT))
    try:
        from bench import profile_programs
    finally:
        sys.path.remove(str(ROOT))
    return profile_programs


def test_profile_programs_decode_on_the_stand_in_device(tmp_path, capsys):
    profile_programs = _profile_programs()
    rc = profile_programs.main(
        ["--device", "meta", "--steps", "8", "--out", str(tmp_path), "--programs", "decode,hf_sync"]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "decode: counts MATCH over 8 steps" in out
    assert "hf_sync: skipped: transformers' continuous batching needs CUDA" in out
    doc = json.loads((tmp_path / "profile_programs.json").read_text())
    assert doc["all_match"] and doc["programs"]["decode"]["ok"]
    ups = [s for s in doc["programs"]["decode"]["sites"] if s["upload"]]
    assert sorted(s["calls"] for s in ups) == [8, 24]
    ns: dict = {}
    exec((tmp_path / "decode-skeleton.py").read_text(), ns)
    assert len(ns["Site"]) == 6


# -- on a GPU --------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_uploads_are_classified_and_timed():
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    dst = torch.zeros(1024, device="cuda")
    pinned = torch.ones(1024).pin_memory()
    pageable = torch.ones(1024)
    torch.cuda.synchronize()
    with cc.profile(device="cuda") as prof:
        for _ in range(3):
            dst.copy_(pinned, non_blocking=True)  # PINNED
            dst.copy_(pageable, non_blocking=True)  # PAGEABLE
            torch.tensor([1, 2, 3], device="cuda")  # TENSOR
            prof.step()
    torch.cuda.synchronize()
    recs = _by_line(prof)
    fn = test_cuda_uploads_are_classified_and_timed
    p = recs[_line(fn, "# PINNED")]
    q = recs[_line(fn, "# PAGEABLE")]
    t = recs[_line(fn, "# TENSOR")]
    assert (p.source, p.waits) == ("pinned", [0, 0, 0])
    assert (q.source, q.waits) == ("pageable", [1, 1, 1])
    assert (t.op, t.counts, t.nbytes) == ("torch.tensor", [1, 1, 1], [24, 24, 24])
    assert all(h > 0 for r in (p, q, t) for h in r.host_us)
    e = prof.estimate()
    assert e.measured_host is not None and e.measured_host > 0
    assert prof.gpu_name and prof.gpu_name in prof.report()


def _transformers_ok() -> bool:
    try:
        import transformers
    except ImportError:
        return False
    return transformers.__version__ == "5.17.0"  # the release the example is written for


@pytest.mark.skipif(not _transformers_ok(), reason="needs transformers 5.17.0 (the hf extra)")
def test_profile_programs_hf_sync_harness_on_the_cpu(tmp_path, capsys):
    # the engine's own thread, the upload hook and the expected counts, with the CPU as
    # the counted device: its seven torch.tensor calls a step and its mask blocks
    profile_programs = _profile_programs()
    rc = profile_programs.main(
        ["--device", "cpu", "--programs", "hf_sync", "--requests", "3", "--new-tokens", "4"]
        + ["--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "hf_sync: counts MATCH" in out
    doc = json.loads((tmp_path / "profile_programs.json").read_text())
    res = doc["programs"]["hf_sync"]
    tensors = [s for s in res["sites"] if s["op"] == "torch.tensor"]
    assert len(tensors) == 7  # one call site each
    assert all(s["site"].startswith("transformers/") for s in tensors)


def test_docs_sample_report_is_what_the_profiler_prints(tmp_path):
    # docs/profile.md shows a program and its report: they must not drift apart
    doc = (ROOT / "docs" / "profile.md").read_text()
    prog = doc.split("```python\n")[-1].split("```")[0]
    report = doc.split("prints:\n\n```\n")[1].split("```")[0]
    (tmp_path / "engine_step.py").write_text(prog)
    r = _cli("--device", "meta", "engine_step.py", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout == report
