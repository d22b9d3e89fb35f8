"""End to end: the CLI on a real multi-process gloo world, against the builtin target and plants."""

import json
import time

import pytest

from conftest import run_cli, write_scenarios
from shardcheck.scenarios import Sample, Scenario, get_suite

pytestmark = pytest.mark.world


def _small(layout: str, tp: int, cp: int, name: str) -> Scenario:
    return Scenario(name, (Sample(11, 4), Sample(19, 9), Sample(6, 2)), vocab=16, tp=tp, cp=cp, layout=layout,
                    entropy_coef=0.1, seed=7)


def test_smoke_suite_passes_with_one_world_start(tmp_path):
    report = tmp_path / "r.json"
    proc = run_cli("run", "--target", "builtin", "--suite", "smoke", "--json-report", str(report))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(report.read_text())
    names = [s.name for s in get_suite("smoke")]
    assert sorted(v["name"] for v in doc["scenarios"]) == sorted(names)
    for v in doc["scenarios"]:
        assert v["verdict"] == "pass", v
        assert {"layout", "tp", "cp", "verdict"} <= set(v)
    assert doc["complete"] is True
    assert len(doc["startup_seconds"]) == 1, "ranks must start once per run, not per scenario"
    assert doc["ranks"] == 4
    assert "52 passed, 0 failed" in proc.stdout


@pytest.mark.parametrize("layout,tp,cp", [("thd", 2, 1), ("zigzag", 1, 2)])
def test_corrupted_value_is_named(tmp_path, layout, tp, cp):
    f = write_scenarios(tmp_path / "s.json", [_small(layout, tp, cp, f"{layout}-corrupt")])
    report = tmp_path / "r.json"
    proc = run_cli("run", "--target", "plants:CorruptValue", "--scenario-file", str(f), "--json-report", str(report))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    v = json.loads(report.read_text())["scenarios"][0]
    assert v["verdict"] == "fail" and v["kinds"] == ["value_mismatch"]
    [f0] = v["failures"]
    assert (f0["field"], f0["sample"], f0["token"]) == ("log_probs", 1, 3)
    assert abs(f0["got"] - f0["want"] - 0.5) < 1e-4
    assert "value_mismatch" in proc.stdout and "log_probs sample 1 token 3" in proc.stdout


@pytest.mark.parametrize("layout,tp,cp", [("thd", 2, 1), ("allgather", 1, 2)])
def test_corrupted_gradient_is_named(tmp_path, layout, tp, cp):
    f = write_scenarios(tmp_path / "s.json", [_small(layout, tp, cp, f"{layout}-corrupt-grad")])
    report = tmp_path / "r.json"
    proc = run_cli("run", "--target", "plants:CorruptGrad", "--scenario-file", str(f), "--json-report", str(report))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    v = json.loads(report.read_text())["scenarios"][0]
    assert v["kinds"] == ["grad_mismatch"]
    [f0] = v["failures"]
    assert (f0["field"], f0["sample"], f0["token"], f0["column"]) == ("grad", 1, 3, 5)
    assert abs(f0["got"] - f0["want"] - 0.25) < 1e-4
    assert "grad sample 1 token 3 column 5" in proc.stdout


def test_raising_rank_is_reported_and_world_recovers(tmp_path):
    """A rank that raises while its peer waits in a collective: both reported within the bounded
    collective timeout; the world restarts by itself and the next scenario runs."""
    scenarios = [_small("allgather", 1, 2, "ag-raise"), _small("zigzag", 1, 2, "zz-after")]
    f = write_scenarios(tmp_path / "s.json", scenarios)
    report = tmp_path / "r.json"
    t0 = time.perf_counter()
    proc = run_cli("run", "--target", "plants:RaiseOnCpRank1", "--scenario-file", str(f), "--timeout", "5",
                   "--json-report", str(report), timeout=240)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 1, proc.stdout + proc.stderr
    by_name = {v["name"]: v for v in json.loads(report.read_text())["scenarios"]}
    first = by_name["ag-raise"]["failures"]
    assert first[0]["kind"] == "rank_error"
    assert "RuntimeError: planted failure on cp rank 1" in first[0]["message"]
    assert "plants.py" in first[0]["message"], "the report must say where it was raised"
    assert elapsed < 120, f"took {elapsed:.0f}s: a wait was not bounded"
    # rank 1 raised again in the second scenario, but rank 0 (zigzag, no CP collective) finished
    second = by_name["zz-after"]["failures"]
    assert any(f["kind"] == "rank_error" and 1 in f["ranks"] for f in second)
    assert json.loads(report.read_text())["startup_seconds"].__len__() == 2, "the world restarts after a rank error"
