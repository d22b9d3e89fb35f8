"""``run --coverage``: which of the framework's functions ran, measured by coverage.py on the
ranks over the target's own files only. The truth: which branches of builtin's code a thd and an
all-gather scenario take (builtin's layout functions are one per layout)."""

import json

import pytest

from conftest import run_on_world
from shardcheck.harness.controller.reports.reach_report import Reach, _functions
from shardcheck.scenarios import Sample, Scenario


def test_functions_are_named_by_their_own_lines(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def a():\n    x = 1\n    def inner():\n        return 2\n    return x\n\n"
                   "class C:\n    def m(self):\n        return 3\n")
    assert [(n, sorted(b)) for n, b in _functions(str(src))] == [("a", [2, 3, 5]), ("a.inner", [4]), ("C.m", [9])]
    reach = Reach(str(tmp_path))
    reach.add({"m.py": {"executed": [1, 2, 3, 5, 7, 8], "statements": [1, 2, 3, 4, 5, 7, 8, 9]}})
    f = reach.summary()["files"]["m.py"]
    assert f["functions"] == ["m.py:a"] and f["not_reached"] == ["m.py:a.inner", "m.py:C.m"]
    assert (f["lines"], f["statements"], f["percent"]) == (6, 8, 75.0)


@pytest.mark.world
def test_a_run_says_which_framework_functions_ran(tmp_path, world):
    thd = Scenario("thd", (Sample(11, 4), Sample(7, 3)), vocab=16, entropy_coef=0.1)
    run = run_on_world(world, [thd], "plants:MeasuredBuiltin", tmp_path / "r.json", "file", coverage=True)
    assert run.exit_code == 0, run.stdout
    files = run.report["coverage"]["files"]
    ran = files["builtin.py"]["functions"]
    assert "builtin.py:BuiltinTarget.compute" in ran and "builtin.py:_VocabParallelLogProbEntropy.backward" in ran
    assert "builtin.py:BuiltinTarget._allgather" in files["builtin.py"]["not_reached"]
    assert 0 < files["builtin.py"]["percent"] < 100
    assert "framework code reached (--coverage" in run.stdout and "not reached:" in run.stdout
    from shardcheck.harness.controller.reports.html_report import render

    page = render(run.report)
    assert "Framework code reached" in page and "BuiltinTarget.compute" in page
    ag = Scenario("ag", (Sample(11, 4), Sample(7, 3)), vocab=16, cp=2, layout="allgather")
    run = run_on_world(world, [ag], "plants:MeasuredBuiltin", tmp_path / "r2.json", "file", coverage=True)
    ran = run.report["coverage"]["files"]["builtin.py"]["functions"]
    assert "builtin.py:BuiltinTarget._allgather" in ran and "builtin.py:BuiltinTarget.redistribute_allgather" in ran


def test_coverage_needs_a_target_with_framework_files(cli_in_process):
    got = cli_in_process("run", "--target", "builtin", "--coverage")
    assert got.returncode == 2 and got.stderr.count("\n") == 1
    assert "--coverage: target 'builtin' names no framework source files" in got.stderr


def test_a_step_target_also_measures_megatron_cores_schedule_and_ddp(tmp_path):
    """For a loss that runs in a training step, megatron-core's schedule and DDP modules are
    measured too (named megatron-core/...), and their functions named from the installed files."""
    from shardcheck.harness.rank.life.reach import STEP_FILES, step_files
    from shardcheck.targets import resolve

    files = step_files(resolve("builtin:loss"))
    assert sorted(files) == sorted(f"megatron-core/{rel}" for rel in STEP_FILES)
    assert step_files(resolve("builtin")) == {}
    rel = "megatron-core/megatron/core/pipeline_parallel/schedules.py"
    reach = Reach(str(tmp_path))  # the checkout holds no megatron-core: the path comes with the lines
    body = dict(_functions(files[rel]))["forward_backward_no_pipelining"]
    reach.add({rel: {"executed": sorted(body)[:3], "statements": sorted(body), "path": files[rel]}})
    assert reach.summary()["files"][rel]["functions"] == [f"{rel}:forward_backward_no_pipelining"]
