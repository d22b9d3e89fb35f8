"""End to end: the CLI on a real multi-process gloo world, against the builtin target and plants.

What is about the verdicts and reports a run makes (a plant named where it is) runs in this
process on the session's world, with the reporters ``shardcheck run`` uses; what is about the
command and its own world (one start per run, restarts, --no-lockstep, --timeout) runs the CLI.

Over 20 s: the smoke suite's 68 scenarios through the command line, and the hang and timeout
cases, which wait out their deadlines on purpose.
"""

import json
import time

import pytest

from conftest import run_cli, run_on_world, write_scenarios
from shardcheck.scenarios import Sample, Scenario, get_suite, load_scenario_file

pytestmark = pytest.mark.world


def _small(layout: str, tp: int, cp: int, name: str) -> Scenario:
    return Scenario(name, (Sample(11, 4), Sample(19, 9), Sample(6, 2)), vocab=16, tp=tp, cp=cp, layout=layout,
                    entropy_coef=0.1, seed=7)


@pytest.mark.background("smoke-cli")
def test_smoke_suite_passes_with_one_world_start(smoke_cli):
    proc = smoke_cli.proc
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(smoke_cli.json_report.read_text())
    names = [s.name for s in get_suite("smoke")]
    assert sorted(v["name"] for v in doc["scenarios"]) == sorted(names)
    steps = {s.name for s in get_suite("smoke") if s.step}
    assert len(steps) == 4
    for v in doc["scenarios"]:
        # the training-step cells are builtin:loss's: the plain builtin's loss is not a step's
        assert v["verdict"] == ("skip" if v["name"] in steps else "pass"), v
        assert {"layout", "tp", "cp", "verdict"} <= set(v)
    assert doc["complete"] is True
    assert len(doc["startup_seconds"]) == 1, "ranks must start once per run, not per scenario"
    assert doc["ranks"] == 4
    assert "64 passed, 0 failed, 4 skipped" in proc.stdout


@pytest.mark.parametrize("layout,tp,cp", [("thd", 2, 1), ("zigzag", 1, 2)])
def test_corrupted_value_is_named(tmp_path, world2, layout, tp, cp):
    f = write_scenarios(tmp_path / "s.json", [_small(layout, tp, cp, f"{layout}-corrupt")])
    # two ranks: the world `shardcheck run` would start for this scenario
    proc = run_on_world(world2, load_scenario_file(f), "plants:CorruptValue", tmp_path / "r.json", str(f))
    assert proc.exit_code == 1, proc.stdout
    v = proc.report["scenarios"][0]
    assert v["verdict"] == "fail" and v["kinds"] == ["value_mismatch"]
    [f0] = v["failures"]
    assert (f0["field"], f0["sample"], f0["token"]) == ("log_probs", 1, 3)
    assert abs(f0["got"] - f0["want"] - 0.5) < 1e-4
    assert "value_mismatch" in proc.stdout and "log_probs sample 1 token 3" in proc.stdout


@pytest.mark.parametrize("layout,tp,cp", [("thd", 2, 1), ("allgather", 1, 2)])
def test_corrupted_gradient_is_named(tmp_path, world2, layout, tp, cp):
    f = write_scenarios(tmp_path / "s.json", [_small(layout, tp, cp, f"{layout}-corrupt-grad")])
    proc = run_on_world(world2, load_scenario_file(f), "plants:CorruptGrad", tmp_path / "r.json", str(f))
    assert proc.exit_code == 1, proc.stdout
    v = proc.report["scenarios"][0]
    assert v["kinds"] == ["grad_mismatch"]
    [f0] = v["failures"]
    assert (f0["field"], f0["sample"], f0["token"], f0["column"]) == ("grad", 1, 3, 5)
    assert abs(f0["got"] - f0["want"] - 0.25) < 1e-4
    assert "grad sample 1 token 3 column 5" in proc.stdout


def test_without_lockstep_a_raising_rank_is_bounded_by_the_timeout_and_the_world_restarts(tmp_path):
    """No lockstep: rank 1 raises while rank 0 sits in a gloo all-reduce; the collective timeout
    ends the wait, both are reported, the world restarts by itself and the next scenario runs."""
    scenarios = [_small("allgather", 1, 2, "ag-raise"), _small("zigzag", 1, 2, "zz-after")]
    f = write_scenarios(tmp_path / "s.json", scenarios)
    t0 = time.perf_counter()
    # a world of its own, as `run --timeout 5 --no-lockstep` starts (its restarts are counted);
    # the CLI's own flags are run end to end in the test below
    proc = run_on_world(None, load_scenario_file(f), "plants:RaiseOnCpRank1", tmp_path / "r.json", str(f),
                        timeout=5, lockstep=False)
    elapsed = time.perf_counter() - t0
    assert proc.exit_code == 1, proc.stdout
    doc = proc.report
    by_name = {v["name"]: v for v in doc["scenarios"]}
    first = by_name["ag-raise"]["failures"]
    assert first[0]["kind"] == "rank_error"
    assert "RuntimeError: planted failure on cp rank 1" in first[0]["message"]
    assert "plants.py" in first[0]["message"], "the report must say where it was raised"
    assert any("Timed out" in f["message"] and 0 in f["ranks"] for f in first), first
    assert elapsed < 120, f"took {elapsed:.0f}s: a wait was not bounded"
    assert any(f["kind"] == "rank_error" and 1 in f["ranks"] for f in by_name["zz-after"]["failures"])
    assert len(doc["startup_seconds"]) == 2, "the world restarts after a rank error without lockstep"
    assert doc["lockstep"] is False


HANG_TIMEOUT = 6
HANG_SCENARIO = ["--suite", "regressions", "--scenario", "ag-empty-local-slices"]


def _hang_without_lockstep(folder):
    """The CLI on a world of its own, without lockstep: it waits out its timeout (in the background)."""
    report = folder / "r.json"
    proc = run_cli("run", "--target", "builtin:skip_empty_rank", *HANG_SCENARIO, "--timeout", str(HANG_TIMEOUT),
                   "--json-report", str(report), "--no-lockstep", timeout=240)
    return proc, (json.loads(report.read_text()) if report.exists() else None)


BACKGROUND = {"hang-without-lockstep": (_hang_without_lockstep, 240)}


@pytest.mark.background("hang-without-lockstep")
def test_a_hang_is_a_report_at_once_with_lockstep_and_a_timeout_without(tmp_path, world2, background):
    """The lockstep check is what turns the hang into a report: the same mutant blocks until the
    collective timeout without it. Without lockstep, the CLI on a world of its own (its timeout);
    with it, the session's two-rank world (the size the CLI starts for this scenario; lockstep
    on, reporting at once whatever its timeout)."""
    seconds = {}
    for mode in ("--no-lockstep", None):
        if mode:
            proc, doc = background("hang-without-lockstep")
            assert proc.returncode == 1 and doc is not None, proc.stdout + proc.stderr
            [v] = doc["scenarios"]
        else:
            [sc] = [s for s in get_suite("regressions") if s.name == "ag-empty-local-slices"]
            assert world2.lockstep and world2.nproc == sc.ranks
            proc = run_on_world(world2, [sc], "builtin:skip_empty_rank", tmp_path / "r.json", "regressions")
            assert proc.exit_code == 1, proc.stdout
            [v] = proc.report["scenarios"]
        seconds[mode] = v["seconds"]
        kinds = {(f["kind"], f.get("phase")) for f in v["failures"]}
        if mode:
            assert ("rank_error", None) in kinds and ("collective_mismatch", "forward") not in kinds, v
        else:
            assert ("collective_mismatch", "forward") in kinds, v
            [f] = [f for f in v["failures"] if f["kind"] == "collective_mismatch"]
            assert f["details"]["reported_after_s"] < 1.0
            assert "finished the scenario after 0 calls" in f["message"]
    assert seconds["--no-lockstep"] >= HANG_TIMEOUT, seconds
    assert seconds[None] < 1.0, seconds
