"""bench/instr_gate.py's comparison: a count over its ceiling fails, one under passes,
and a case missing on either side is an error. No valgrind: the counts are given."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import instr_gate as gate  # noqa: E402

THRESHOLDS = {
    "n8": {"reference": 1000, "ceiling": 1100},
    "n32-skip": {"reference": 4000, "ceiling": 4400},
}


def test_counts_under_or_at_their_ceilings_pass():
    rows = gate.compare({"n8": 1050.4, "n32-skip": 4400}, THRESHOLDS)
    assert [r["ok"] for r in rows] == [True, True]
    assert rows[0]["change"] == pytest.approx(0.0504)
    assert "FAIL" not in gate.table(rows)


def test_a_count_over_its_ceiling_fails():
    rows = gate.compare({"n8": 1100.5, "n32-skip": 3000}, THRESHOLDS)
    assert {r["case"]: r["ok"] for r in rows} == {"n8": False, "n32-skip": True}
    assert "n8" in gate.table(rows).splitlines()[1] and "FAIL" in gate.table(rows)


def test_a_case_without_a_count_is_an_error():
    with pytest.raises(gate.GateError, match="not counted: n32-skip"):
        gate.compare({"n8": 1000}, THRESHOLDS)


def test_a_count_without_a_threshold_is_an_error():
    with pytest.raises(gate.GateError, match="no threshold: n128"):
        gate.compare({"n8": 1000, "n32-skip": 4000, "n128": 5}, THRESHOLDS)


def test_the_stored_thresholds_cover_every_case_with_a_ten_percent_ceiling():
    stored = gate.load()
    assert set(stored) == set(gate.CASES)
    for name, t in stored.items():
        assert t["ceiling"] == gate.ceiling_of(t["reference"]), name
        assert t["reference"] > 0


def test_main_exits_nonzero_over_a_ceiling_and_on_a_missing_case(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gate, "count", lambda names, jobs=None: {n: 1200.0 for n in names})
    path = tmp_path / "t.json"
    path.write_text('{"cases": {"n8": {"reference": 1000, "ceiling": 1100}}}')
    assert gate.main(["--cases", "n8", "--thresholds", str(path)]) == 1
    assert "FAIL" in capsys.readouterr().out
    path.write_text('{"cases": {"n8": {"reference": 1100, "ceiling": 1210}}}')
    assert gate.main(["--cases", "n8", "--thresholds", str(path)]) == 0
    assert gate.main(["--cases", "n32", "--thresholds", str(path)]) == 2  # no threshold
