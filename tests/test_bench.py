"""The benchmark suite runs end to end on the simulated device (``python -m bench --quick``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # ``bench`` is a folder of scripts, not an installed package
    sys.path.insert(0, str(REPO))


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One ``python -m bench --quick --sim`` run into a fresh directory: (process, JSON)."""
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, CUCOPY_NO_GPU="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--sim", "--no-progress", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    files = sorted(out.glob("*-sim.json"))
    doc = json.loads(files[0].read_text()) if files else None
    return proc, doc, out


def test_quick_run_succeeds_and_writes_json(quick_run):
    proc, doc, _ = quick_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert doc is not None, f"no JSON written; output:\n{proc.stdout}\n{proc.stderr}"
    assert {"schema", "created", "device", "environment", "config", "scenarios", "notes"} <= set(
        doc
    )
    assert doc["device"] == "sim"
    env = doc["environment"]
    assert {"python", "numpy", "cucopy", "packages"} <= set(env)
    assert {"commit", "dirty", "source_digest"} <= set(env["cucopy"])
    from bench._common import source_digest

    assert env["cucopy"]["source_digest"] == source_digest()  # the files that ran
    assert doc["config"]["quick"] is True
    assert "step_cost" in doc["scenarios"]
    assert any("GPU times need a GPU" in n for n in doc["notes"])


def test_step_cost_rows_have_samples_and_stats(quick_run):
    _, doc, _ = quick_run
    sc = doc["scenarios"]["step_cost"]
    assert set(sc["mix"]) == {"8", "32"}
    assert sc["mix"]["32"]["total_bytes"] == sum(sc["mix"]["32"]["bytes"])
    names = {r["contender"] for r in sc["results"]}
    assert {"cucopy_chained", "cucopy_dma", "cucopy_mapped", "cucopy_auto"} <= names
    for r in sc["results"]:
        assert r["verified"], r
        host = r["host_us_per_copy"]
        assert host["n"] == doc["config"]["reps"] == len(host["samples"])
        assert host["p10"] <= host["median"] <= host["p90"]
        assert r["gpu_us"] is None  # no GPU time on the simulated device


def test_cucopy_enqueues_fewer_ops_than_chained(quick_run):
    _, doc, _ = quick_run
    rows = {(r["contender"], r["n"]): r for r in doc["scenarios"]["step_cost"]["results"]}
    for n in (8, 32):
        chained = rows["cucopy_chained", n]
        assert chained["work_ops_per_step"] == n
        for mode in ("cucopy_dma", "cucopy_mapped", "cucopy_auto"):
            merged = rows[mode, n]
            assert merged["segments_per_step"] == 1
            assert merged["stream_ops_per_step"] < chained["stream_ops_per_step"]
            assert merged["work_ops_per_step"] < chained["work_ops_per_step"]
        assert rows["cucopy_mapped", n]["work_ops_per_step"] == 1
        assert rows["cucopy_dma", n]["work_ops_per_step"] == 2


def test_tables_printed(quick_run):
    proc, _, _ = quick_run
    assert "== step_cost ==" in proc.stdout
    assert "cucopy_chained" in proc.stdout and "host us/copy" in proc.stdout


def test_plots_written_when_matplotlib_is_installed(quick_run):
    pytest.importorskip("matplotlib")
    _, doc, out = quick_run
    assert doc["plots"], doc["notes"]
    for name in doc["plots"]:
        assert (out / name).stat().st_size > 0


def test_plots_are_written_with_a_palette(quick_run):
    # stored runs keep their plots in the tree that travels to the GPU machine: each is
    # a 256-colour PNG, a third of the bytes of the plain one
    pytest.importorskip("matplotlib")
    image = pytest.importorskip("PIL.Image")
    _, doc, out = quick_run
    for name in doc["plots"]:
        with image.open(out / name) as im:
            assert im.mode == "P" and im.size[0] > 100
    assert not list(out.glob("*.tmp.png"))


def test_size_mix_is_fixed_and_in_range():
    from bench._common import decode_mix, mix_bytes

    assert decode_mix(32) == decode_mix(32)
    for n in (8, 32, 128, 512):
        mix = decode_mix(n)
        assert len(mix) == n
        sizes = [k * (4 if dt == "int32" else 8) for k, dt in mix]
        assert min(sizes) >= 16 and max(sizes) <= 8192
    assert 15_000 < mix_bytes(decode_mix(32)) < 25_000


def test_crossover_picks_the_tail_where_dma_wins():
    from bench.size_sweep import crossover

    def pts(pairs):
        return [
            {"segment_bytes": 1000 * (i + 1), "dma_us": d, "mapped_us": m}
            for i, (d, m) in enumerate(pairs)
        ]

    x = crossover(pts([(5, 3), (5, 6), (5, 4), (6, 9), (7, 12)]))
    assert x["crossover_segment_bytes"] == 4000
    assert x["suggested_mapped_threshold"] == 3000
    assert crossover(pts([(1, 2), (1, 3)]))["suggested_mapped_threshold"] == 0
    assert crossover(pts([(3, 2), (3, 1)]))["crossover_segment_bytes"] is None


def _git(repo, *args):
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=repo,
        check=True,
        capture_output=True,
    )


def test_source_digest_ties_files_to_their_commit(tmp_path):
    # A copied checkout's .git may be stale; the digest of its files names the commit.
    from bench._common import source_digest

    (tmp_path / "cucopy" / "kernels").mkdir(parents=True)
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "cucopy" / "a.py").write_text("A = 1\n")
    (tmp_path / "cucopy" / "kernels" / "k.cu").write_text("// k\n")
    (tmp_path / "bench" / "b.py").write_text("B = 2\n")
    (tmp_path / "bench" / "results" / "r.json").write_text("{}")  # not source
    (tmp_path / "README.md").write_text("not source\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "one")
    first = source_digest(tmp_path)
    assert first == source_digest(tmp_path, rev="HEAD")
    # stored results and other files do not move it
    (tmp_path / "bench" / "results" / "r.json").write_text('{"x": 1}')
    (tmp_path / "README.md").write_text("changed\n")
    assert source_digest(tmp_path) == first
    # any byte of the library or the bench does
    (tmp_path / "cucopy" / "kernels" / "k.cu").write_text("// k2\n")
    assert source_digest(tmp_path) != first
    _git(tmp_path, "commit", "-qam", "two")
    assert source_digest(tmp_path, rev="HEAD") == source_digest(tmp_path)
    assert source_digest(tmp_path, rev="HEAD~1") == first
    assert source_digest(tmp_path, rev="no-such-rev") is None


# -- the main job and the probes ---------------------------------------------------------------

BENCH = REPO / "bench"
PROBES = sorted(p for p in (BENCH / "probes").glob("*.py") if p.name != "__init__.py")


def test_bench_top_level_holds_the_main_job_only():
    # scenarios of ``python -m bench``, their shared code and session tools; probes go under
    # bench/probes/ (bench/README.md, Probes)
    from bench import SCENARIOS

    tools = {"__init__", "__main__", "_common", "_device", "digest", "kernel_check", "cold_start"}
    tools |= {"host_ratio", "readme_table", "slim_results"}  # CI host figure; README table; results
    tools |= {"hf_ab"}  # transformers unmodified vs routed (the seam is in examples/)
    tools |= {"profile_programs"}  # the copy profiler over the examples
    tools |= {"instr_gate"}  # CI's instruction-count gate (.ci/instr_gate)
    assert {p.stem for p in BENCH.glob("*.py")} <= set(SCENARIOS) | tools


@pytest.mark.parametrize("path", PROBES, ids=lambda p: p.stem)
def test_each_probe_names_its_question_and_is_listed(path):
    doc = path.read_text().split('"""')[1]
    assert "Usage:" in doc and "Question:" in doc
    assert "bench/results/" in doc  # the stored run holding its answer
    assert f"`probes/{path.name}`" in (BENCH / "README.md").read_text()


@pytest.mark.parametrize("path", PROBES, ids=lambda p: p.stem)
def test_each_probe_shows_its_usage_without_a_gpu(path):
    proc = subprocess.run(
        [sys.executable, str(path), "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout


def test_cold_start_runs_fresh_processes_and_writes_json(tmp_path):
    # on the simulated device nothing is compiled: this checks the script gpu_session.sh runs
    out = tmp_path / "cold.json"
    proc = subprocess.run(
        [sys.executable, "bench/cold_start.py", "--sim", "--warm", "1", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert [r["run"] for r in doc["runs"]] == ["cold", "warm1", "cold_serial"]
    for r in doc["runs"]:
        assert r["first_step_ok"] is True and r["backend"] == "sim"
        assert r["first_copier_s"] >= 0 and r["second_copier_s"] >= 0
    assert doc["cucopy_config"]["version"]
    assert "first copier s" in proc.stdout and "cold_serial" in proc.stdout


# -- what the output says ------------------------------------------------------------------------


def test_each_table_carries_a_legend_of_its_contenders(quick_run):
    proc, doc, _ = quick_run
    out = proc.stdout
    step_table = out.split("== step_cost ==")[1].split("== skip_unchanged ==")[0]
    assert "legend:" in step_table
    for name, description in doc["scenarios"]["step_cost"]["contenders"].items():
        assert f"  {name}  " in step_table and description in step_table
    skip_table = out.split("== skip_unchanged ==")[1]
    assert "legend:" in skip_table and "cucopy_buffer" in skip_table


def test_skip_unchanged_says_what_the_buffer_saves_and_why(quick_run):
    proc, doc, _ = quick_run
    table = proc.stdout.split("== skip_unchanged ==")[1]
    # with nothing changed the buffer issues nothing: the saving is printed, not just host time
    assert "changed=0: copies 0 of 32" in table
    assert "bytes staged 0 of" in table
    assert "why:" in table and "compares the new values" in table
    rows = {
        (r["contender"], r["changed"]): r for r in doc["scenarios"]["skip_unchanged"]["results"]
    }
    assert rows["cucopy_buffer", 0.0]["bytes_staged_per_step"] == 0
    assert rows["cucopy_always", 0.0]["bytes_staged_per_step"] > 0


def test_results_say_where_they_were_measured(quick_run):
    _, doc, _ = quick_run
    for name, result in doc["scenarios"].items():
        assert result["device"] == "simulated device", name
    assert doc["environment"]["cucopy_config"]["default_backend"]["name"] in ("sim", "cuda")


def test_plot_titles_say_lower_is_better_and_simulated():
    from bench._common import plot_title

    assert plot_title("step_cost", "simulated device").endswith("lower is better")
    assert "simulated device" in plot_title("step_cost", "simulated device")
    assert plot_title("step_cost", "NVIDIA H200") == "step_cost on NVIDIA H200; lower is better"


def test_progress_total_is_fixed_before_the_first_scenario():
    import io

    from bench._common import Progress

    out = io.StringIO()
    p = Progress(stream=out)
    p.plan(5)
    p.add(2)  # the first scenario announces its own share: no jump
    p.advance("a")
    p.advance("b")
    p.skip_to(2)
    p.add(3)
    p.advance("c")
    p.skip_to(5)  # the second stopped early: counted as done
    assert [line.split()[0] for line in out.getvalue().splitlines()] == ["[1/5]", "[2/5]", "[3/5]"]
    assert p.done == p.total == 5
    q = Progress(stream=io.StringIO())  # a scenario run alone grows its own total
    q.add(3)
    assert q.total == 3


def test_planned_jobs_match_what_the_scenarios_report():
    import argparse

    from bench import __main__ as suite
    from bench import _device as devmod
    from bench._common import Progress

    class Counting(Progress):
        def __init__(self):
            super().__init__(enabled=False)
            self.announced = 0

        def add(self, jobs):
            self.announced += jobs
            super().add(jobs)

    args = argparse.Namespace(quick=True, n=None, seed=0)
    ctx = devmod.make_context(True, 0)
    try:
        for name in ("step_cost", "skip_unchanged", "decode_loop", "size_sweep"):
            p = Counting()
            suite.run_scenario(name, ctx, args, 2, 0, p)
            assert p.announced == p.done == suite.planned_jobs(name, ctx, args), name
    finally:
        ctx.close()


def test_decode_loop_counts_every_contender_it_measures_on_a_gpu():
    # on the simulated device decode_loop measures nothing; on a GPU it advances the
    # progress bar once per class it runs: the floor, every contender and the graph feed
    # (the bar once ended at [100/99], the graph feed left out of the count)
    from types import SimpleNamespace

    from bench import _device as devmod
    from bench import decode_loop

    gpu = SimpleNamespace(kind="gpu")
    assert decode_loop.jobs(gpu) == len(devmod.ALL) + 2
    assert decode_loop.jobs(gpu, ["cucopy_auto", "cucopy_graph"]) == 3
    assert decode_loop.jobs(SimpleNamespace(kind="sim")) == 0


def test_host_ratio_reports_both_staging_paths(tmp_path):
    # bench/host_ratio.py: the CI machine's figure of merit, a copy's host cost as a
    # multiple of an empty call, for the compiled twin and for the pure-Python one
    out = tmp_path / "ratio.json"
    env = dict(os.environ, CUCOPY_NO_GPU="1")
    env.pop("CUCOPY_PURE_PYTHON", None)
    proc = subprocess.run(
        [sys.executable, "bench/host_ratio.py", "--n", "8", "--steps", "20", "--json", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [r["staging"] for r in rows] == ["compiled", "python"]
    for r in rows:
        assert r["n"] == 8
        assert r["empty_us"] > 0 and r["copy_us"] > 0 and r["step_us"] > 0
        assert r["copy_x"] == pytest.approx(r["copy_us"] / r["empty_us"])
    assert "compiled" in proc.stdout and "python" in proc.stdout
    assert doc["environment"]["device"] == "sim"


def test_the_source_digest_covers_the_compiled_twins(tmp_path):
    # two trees differing only in a C source must not share a digest (the first rule,
    # kept for the digests stored up to run 30, left .c files out)
    from bench._common import DIGEST_SUFFIXES_V1, source_digest

    (tmp_path / "cucopy").mkdir()
    (tmp_path / "cucopy" / "a.py").write_text("x = 1\n")
    (tmp_path / "cucopy" / "_core.c").write_text("int f(void) { return 1; }\n")
    before = source_digest(root=tmp_path)
    old_rule = source_digest(root=tmp_path, suffixes=DIGEST_SUFFIXES_V1)
    (tmp_path / "cucopy" / "_core.c").write_text("int f(void) { return 2; }\n")
    assert source_digest(root=tmp_path) != before
    assert source_digest(root=tmp_path, suffixes=DIGEST_SUFFIXES_V1) == old_rule


def test_host_passes_time_every_contender_in_order_then_reversed():
    # the host's drift during a run must weigh on every contender alike: half the
    # repetitions in order, half reversed; warm-up only before the first pass
    from types import SimpleNamespace

    from bench import _device as devmod

    log = []
    ctx = SimpleNamespace(kind="gpu", sync=lambda: None)

    def contender(name):
        return SimpleNamespace(copier=None, step=lambda: log.append(name))

    a, b, c = contender("a"), contender("b"), contender("c")
    samples, ops = devmod.host_passes(ctx, [a, b, c], reps=5, warmup=1)
    assert "".join(log) == "aaa" + "bbb" + "ccc" + "ccc" + "bbb" + "aaa"
    assert [len(x) for x in samples] == [5, 5, 5]
    assert ops == [None, None, None]


@pytest.mark.gpu
def test_on_a_gpu_one_launch_lands_its_copy_every_step():
    from cucopy.backends.cuda import gpu_available

    if not gpu_available():
        pytest.skip("needs a CUDA GPU")
    import numpy as np

    from bench import _common as common
    from bench import _device as devmod

    ctx = devmod.make_context(False, 0)
    try:
        assert ctx.kind == "gpu"
        wl = devmod.Workload(ctx, common.decode_mix(8), 0)
        c = devmod.OneLaunch(ctx, wl)  # its constructor checks the first launch landed
        ctx.zero([c._dst])
        for _ in range(3):
            c.step()
        assert np.array_equal(ctx.to_numpy(c._dst), np.array([7, 0, 0, 0], np.int32))
        assert c.work_ops(3) == 1.0
    finally:
        ctx.close()
