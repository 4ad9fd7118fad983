"""The repository stays a product: stored results are summaries, the latest run in full.

``bench/results`` keeps a small summary of every stored run and the latest run whole
(``bench/results/README.md``); its tracked files stay under ``RESULTS_LIMIT`` bytes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
RESULTS_LIMIT = 10 * 1000 * 1000  # bytes: the limit for bench/results
TREE_LIMIT = 15 * 1000 * 1000  # bytes: every tracked file, what a fresh clone checks out

sys.path.insert(0, str(ROOT))


def _tracked(under: str = ".") -> list[Path] | None:
    """The tracked files under ``under``; None outside a git checkout."""
    proc = subprocess.run(["git", "ls-files", "-z", under], cwd=ROOT, capture_output=True)
    if proc.returncode != 0 or not proc.stdout:
        return None
    paths = [ROOT / p for p in proc.stdout.decode().split("\0") if p]
    return [p for p in paths if p.is_file()]


def _results_files() -> list[Path]:
    """The tracked files of bench/results (every file there outside a git checkout)."""
    tracked = _tracked("bench/results")
    return tracked if tracked is not None else [p for p in RESULTS.rglob("*") if p.is_file()]


def test_tracked_tree_stays_small():
    tracked = _tracked()
    if tracked is None:
        pytest.skip("not a git checkout")
    total = sum(p.stat().st_size for p in tracked)
    assert total <= TREE_LIMIT, f"the tracked tree holds {total / 1e6:.1f} MB"


def test_stored_results_stay_small():
    if not RESULTS.is_dir():
        pytest.skip("no stored results (an sdist)")
    total = sum(p.stat().st_size for p in _results_files())
    assert total <= RESULTS_LIMIT, (
        f"bench/results holds {total / 1e6:.1f} MB of tracked files, over "
        f"{RESULTS_LIMIT / 1e6:.0f} MB: slim older runs with bench/slim_results.py"
    )


def test_only_the_latest_run_keeps_raw_samples_and_plots():
    if not RESULTS.is_dir():
        pytest.skip("no stored results (an sdist)")
    from bench import readme_table

    latest = readme_table.latest_run()
    assert list(latest.glob("*.png")), "the latest run keeps its plots"
    (bench_json,) = latest.glob("*-nvidia-*.json")
    assert '"samples"' in bench_json.read_text()
    for path in _results_files():
        if latest in path.parents:
            continue
        assert path.suffix != ".png", f"{path}: plots of older runs live in git history"
        if path.suffix == ".json":
            assert '"samples"' not in path.read_text(), f"{path}: raw samples left in"


def test_slim_results_keeps_tables_and_drops_samples(tmp_path):
    from bench import slim_results

    run = tmp_path / "run"
    run.mkdir()
    doc = {
        "environment": {"cucopy": {"source_digest": "abc"}},
        "results": [
            {
                "n": 8,
                "gpu_us": {
                    "n": 3,
                    "median": 1.23456,
                    "p10": 1.0,
                    "p90": 2.0,
                    "min": 0.5,
                    "max": 9.0,
                    "samples": [1.0, 2.0, 3.0],
                },
            }
        ],
        "host_samples": [0.1] * 40,
        "sizes": list(range(100)),
    }
    (run / "a.json").write_text(json.dumps(doc))
    (run / "plot.png").write_bytes(b"\x89PNG")
    (run / "bench.log").write_text("table\n")
    assert slim_results.slim(run) > 0
    out = json.loads((run / "a.json").read_text())
    assert out["environment"] == doc["environment"]
    assert out["results"][0]["gpu_us"] == {"n": 3, "median": 1.235, "p10": 1.0, "p90": 2.0}
    assert "host_samples" not in out and out["sizes"] == list(range(16))
    assert not (run / "plot.png").exists()
    assert (run / "bench.log").read_text() == "table\n"


@pytest.mark.parametrize("name", ["CHANGELOG.md", "docs/graph_feeds.md", "docs/host_guard.md"])
def test_user_pages_carry_no_internal_references(name):
    import re

    text = (ROOT / name).read_text()
    for pattern in (r"\bissue \d+", r"\bsession \d+", r"\bruns? \d+\b"):
        assert not re.search(pattern, text, re.I), f"{name}: {pattern}"
