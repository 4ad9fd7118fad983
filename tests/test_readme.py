"""Every Python block of the README runs: the quickstart here, the GPU one under ``pytest -m gpu``.

A block preceded by ``<!-- test: gpu -->`` needs torch with CUDA and CuPy; one preceded by
``<!-- test: fragment -->`` calls into the reader's own engine (placeholder names) and is
compiled, not run; the others must run on a machine without a GPU. Each runs as a program
of its own, in a fresh process, from an empty folder (as a newcomer saving it to a file
would run it). The README's shape is checked too: its length and where adoption starts.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
#: pages whose Python blocks run too (moved out of the README)
GRAPH_FEEDS = (ROOT / "docs" / "graph_feeds.md").read_text()
HOST_GUARD = (ROOT / "docs" / "host_guard.md").read_text()

_BLOCK = re.compile(r"(?:<!-- test: (?P<mark>\w+) -->\n)?```python\n(?P<code>.*?)```", re.S)


def _blocks(page: str, prefix: str = ""):
    out = []
    for m in _BLOCK.finditer(page):
        heading = re.findall(r"^#+ (.+)$", page[: m.start()], re.M)[-1]
        slug = prefix + re.sub(r"[^a-z0-9]+", "_", heading.lower()).strip("_")
        marks = [pytest.mark.gpu] if m.group("mark") == "gpu" else []
        out.append(pytest.param(m.group("code"), m.group("mark"), id=slug, marks=marks))
    return out


BLOCKS = _blocks(README)
ALL_BLOCKS = (
    BLOCKS + _blocks(GRAPH_FEEDS, prefix="graph_feeds-") + _blocks(HOST_GUARD, prefix="host_guard-")
)


def _run(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "readme_block.py"
    script.write_text(code)
    env = dict(os.environ)
    env.pop("CUCOPY_CHECK", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _torch_cuda() -> bool:
    code = "import torch, cupy, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


@pytest.mark.parametrize(("code", "mark"), ALL_BLOCKS)
def test_readme_block_runs(code, mark, tmp_path):
    if mark == "fragment":
        compile(code, "README.md", "exec")  # its names are the reader's: it cannot run
        return
    if mark == "gpu" and not _torch_cuda():
        pytest.skip("needs torch with CUDA and CuPy")
    proc = _run(code, tmp_path)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def test_readme_has_a_gpu_free_quickstart_and_a_torch_program():
    marks = [p.values[1] for p in BLOCKS]
    assert marks.count(None) >= 1 and marks.count("gpu") >= 1
    sim = next(p.values[0] for p in BLOCKS if p.values[1] is None)
    for name in ("SimDevice", "dev.stream()", "dev.zeros(", "dev.to_host("):
        assert name in sim
    gpu = next(p.values[0] for p in BLOCKS if p.values[1] == "gpu")
    assert "import torch" in gpu and "graph.replay()" in gpu


def test_quickstart_sets_up_with_two_commands():
    quick = README.split("## Quickstart", 1)[1]
    bash = re.search(r"```bash\n(.*?)```", quick, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in bash.splitlines() if line.strip()]
    assert commands == ["./run bench", "./run test"]


def test_readme_results_come_from_the_latest_stored_run():
    results = README.split("## Results on an H200", 1)[1].split("\n## ", 1)[0]
    # the latest run that ran the bench (a later run of a few probes has no table)
    runs = sorted(
        (int(m.group(1)), m.group(0))
        for m in re.finditer(
            r"\d{4}-\d{2}-\d{2}-h200\w*-run(\d+)",
            "\n".join(
                p.name
                for p in (ROOT / "bench" / "results").iterdir()
                if any(p.glob("*-nvidia-*.json"))
            ),
        )
    )
    latest = runs[-1][1]
    assert f"bench/results/{latest}/" in results
    assert results.count("\n|") >= 12  # one table: a header, a rule, and a row per contender
    # the table is the run's own numbers: what bench/readme_table.py prints from its JSON
    import sys

    sys.path.insert(0, str(ROOT))
    from bench import readme_table

    run = readme_table.latest_run()
    assert run.name == latest
    assert readme_table.table(run) in results


def test_readme_is_short_and_adoption_comes_early():
    lines = README.splitlines()
    assert len(lines) <= 300
    start = next(i for i, line in enumerate(lines, 1) if line.startswith("## Adopting"))
    assert start < 120
    # at most the profiler's block is a fragment: everything else runs
    assert [p.values[1] for p in BLOCKS].count("fragment") <= 1


def test_readme_has_no_internal_references():
    for pattern in (r"\bissue \d+", r"\bruns? \d+\b", r"\bsession \d+", r"the issue's"):
        assert not re.search(pattern, README, re.I), pattern
