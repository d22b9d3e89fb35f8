"""What a report says: one failure for one cause, nothing hidden by a later crash, the target
as it describes itself, suite order, call sites, rank output, the command line's own words."""

import json
import os
import re

import pytest

from shardcheck.cli import bisect_state, main
from shardcheck.harness.controller.commands import runner
from shardcheck.harness.controller.commands.bisect import Step
from shardcheck.harness.controller.reports.run_report import JsonReport, SilentReport, _target_line, render_table
from shardcheck.harness.controller.reports.verdict import Failure, RunInfo, Verdict
from shardcheck.scenarios import Sample, Scenario, get_suite
from shardcheck.scenarios import regressions as regressions_module
from shardcheck.targets import available
from shardcheck.targets import mutants as mutants_module

TP2 = Scenario("tp2", (Sample(11, 4), Sample(9, 6), Sample(7, 2)), vocab=16, tp=2, entropy_coef=0.1, seed=5)


# -- plain parts -----------------------------------------------------------------------------------
def test_the_target_line_shows_what_any_target_describes():
    line = _target_line({"name": "mine", "version": "2.1", "backend": "triton", "fused": True, "extras": [],
                         "limits": {"max_vocab": 1024}})
    assert line == "target: mine 2.1 (backend: triton; fused: yes; limits: max vocab 1024)"
    assert _target_line({"name": "bare"}) == "target: bare"


def test_the_json_report_is_in_suite_order_while_it_is_rewritten(tmp_path):
    a, b = Scenario("a", (Sample(5, 2),), vocab=4), Scenario("b", (Sample(5, 2),), vocab=4, tp=2)
    path = tmp_path / "r.json"
    report = JsonReport(str(path))
    report.start(RunInfo({"name": "t"}, "t", 2, "gloo", "test", True), [a, b])
    report.add(Verdict(b, "pass"))
    report.add(Verdict(a, "pass"))  # ran second (grouped by tp), listed first
    assert [s["name"] for s in json.loads(path.read_text())["scenarios"]] == ["a", "b"]


def test_mutants_and_suites_say_the_kind_of_bug_in_words():
    """No reference to numbered bug classes of a document that is not in the repository."""
    texts = [d for t in available() for d in t.get("variant_docs", {}).values()]
    texts += [sc.description for sc in get_suite("regressions")]
    texts += [mutants_module.__doc__, regressions_module.__doc__]
    assert texts and not [t for t in texts if re.search(r"\bclass(es)? [1-6]\b|CONTEXT\.md", t)]


def test_help_has_no_markup_and_a_bad_option_points_to_its_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "``" not in capsys.readouterr().out
    assert main(["run", "--bogus"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["shardcheck: error: unrecognized arguments: --bogus (see shardcheck run --help)"]


def test_bisect_prints_each_commits_kinds():
    sc = Scenario("s", (Sample(5, 2),), vocab=4)
    fail = Verdict(sc, "fail", [Failure("rank_error", "x", [0]), Failure("grad_mismatch", "y", [0])])
    assert bisect_state(Step("c" * 40, ("sig",), [fail])) == "1 of 1 scenarios failed (s: grad_mismatch+rank_error)"
    assert bisect_state(Step("c" * 40, None, why_skipped="no module named x")) == "skipped (no module named x)"


@pytest.mark.skipif(not os.environ.get("SHARDCHECK_SLIME_SRC"), reason="needs a slime checkout: set SHARDCHECK_SLIME_SRC")
def test_a_slime_checkout_without_git_is_named_by_its_path(tmp_path, monkeypatch):
    import shutil

    src = tmp_path / "slime"
    shutil.copytree(os.path.join(os.environ["SHARDCHECK_SLIME_SRC"], "slime"), src / "slime")
    monkeypatch.setenv("SHARDCHECK_SLIME_SRC", str(src))
    monkeypatch.delenv("SHARDCHECK_SLIME_COMMIT", raising=False)
    from shardcheck.targets.slime import target

    assert target().describe()["version"] == f"checkout {src} (no git commit)"


# -- on a world ------------------------------------------------------------------------------------
def _one(world, spec, sc=TP2):
    result = runner.run([sc], spec, reporter=SilentReport(), world=world)
    return result, result.verdicts[0]


@pytest.mark.world
def test_one_cause_on_every_rank_is_one_failure_naming_the_ranks(world):
    _, v = _one(world, "plants:RaiseEverywhere")
    errors = [f for f in v.failures if f.kind == "rank_error"]
    assert len(errors) == 1 and errors[0].ranks == [0, 1, 2, 3], [f.message for f in v.failures]
    f = errors[0]
    assert f.message.startswith("raised ValueError: planted failure on every rank at ")
    # one convention for call sites: relative, as the collective reports give them
    assert re.search(r"at (tests/)?plants\.py:\d+ in compute", f.message) and " at /" not in f.message


@pytest.mark.world
def test_a_backward_crash_keeps_what_the_forward_found(world):
    _, v = _one(world, "plants:CorruptValueThenRaiseInBackward")
    kinds = {f.kind for f in v.failures}
    assert kinds == {"value_mismatch", "rank_error"}, [f.message for f in v.failures]
    [value] = {(f.sample, f.token) for f in v.failures if f.kind == "value_mismatch"}
    assert value == (1, 3)
    assert any("planted failure in backward" in f.message for f in v.failures if f.kind == "rank_error")


@pytest.mark.world
def test_a_backward_collective_names_where_its_autograd_node_was_made(world):
    sc = get_suite("regressions")[0]
    _, v = _one(world, "builtin:grad_placeholder", sc)
    found = [f for f in v.failures if f.kind == "collective_mismatch"]  # one per data-parallel replica
    assert found
    for f in found:
        assert f.phase == "backward"
        assert re.search(r"in backward at targets/builtin\.py:\d+ .*\(its forward at targets/builtin\.py:\d+\)",
                         f.message), f.message


@pytest.mark.world
def test_what_the_ranks_print_is_shown_once_under_the_table(world):
    result, v = _one(world, "plants:PrintsALine")
    assert v.status == "pass"
    lines = [o for o in result.info.rank_output if "planted: a line every rank prints" in o["line"]]
    assert len(lines) == 1 and lines[0]["ranks"] == [0, 1, 2, 3]
    table = render_table(result.verdicts, result.info)
    assert table.count("planted: a line every rank prints") == 1


@pytest.mark.world
def test_a_two_rank_world_skips_what_it_cannot_hold(world2):
    """A passed-in world (the plugin's, torchrun's) is checked against each scenario's tp * cp."""
    result = runner.run(get_suite("regressions"), "builtin", reporter=SilentReport(), world=world2)
    by = {v.scenario.name: v for v in result.verdicts}
    big = [sc.name for sc in get_suite("regressions") if sc.ranks > 2]
    assert big and all(by[n].status == "skip" and "needs tp*cp=4 ranks to divide the world size 2" in by[n].reason
                       for n in big)
    assert all(v.status == "pass" for n, v in by.items() if n not in big) and result.exit_code == 0


@pytest.mark.world
def test_two_scenarios_with_one_name_each_get_their_own_verdict(world):
    skipped = Scenario("same", (Sample(5, 2),), vocab=4, tp=2)  # with entropy: megatron has none
    runnable = Scenario("same", (Sample(5, 2),), vocab=4, tp=2, with_entropy=False, temperature=0.5)
    result = runner.run([skipped, runnable], "megatron", reporter=SilentReport(), world=world)
    assert [v.status for v in result.verdicts] == ["skip", "pass"], [v.headline() for v in result.verdicts]
    assert "computes no entropy" in result.verdicts[0].reason


def test_moving_to_another_target_releases_the_previous_ones_process_settings():
    import plants
    from shardcheck.harness.rank.main import RankRunner

    runner_ = RankRunner(rank=0, lockstep=None)
    first = runner_.target("plants:Releasable")
    assert runner_.target("plants:Releasable") is first and plants.RELEASED == []  # resolved once
    runner_.target("builtin")
    assert plants.RELEASED == ["plants:Releasable"]
    assert runner_.target("plants:Releasable") is not first  # set up again when it comes back


@pytest.mark.skipif(not os.environ.get("SHARDCHECK_SLIME_SRC"), reason="needs a slime checkout: set SHARDCHECK_SLIME_SRC")
def test_the_slime_adapter_undoes_what_its_import_set():
    import sys

    from shardcheck.targets.slime import target

    t = target()
    env_before, path_before = os.environ.get("TORCHDYNAMO_DISABLE"), list(sys.path)
    t._function()
    assert "slime.backends.megatron_utils.loss" in sys.modules and str(t.src) in sys.path
    t.release()
    assert not [m for m in sys.modules if m == "slime" or m.startswith("slime.")]
    assert str(t.src) not in sys.path and os.environ.get("TORCHDYNAMO_DISABLE") == env_before
    assert [p for p in path_before if p not in sys.path] == []


def test_the_controller_resolves_a_target_once_per_setting(monkeypatch):
    from shardcheck.harness.controller.commands.runner import controller_target

    first = controller_target("builtin:packing_dependent")
    assert controller_target("builtin:packing_dependent") is first
    monkeypatch.setenv("SHARDCHECK_SLIME_COMMIT", "0" * 40)  # a setting that may change what a spec names
    assert controller_target("builtin:packing_dependent") is not first
