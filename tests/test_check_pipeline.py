"""A check is one module hooked into a scenario's life on the rank (harness/rank/pipeline.py):
a new kind is added here without touching any other source file, and every report renders it."""

import pytest

import argparse

from conftest import run_on_world
from shardcheck.errors import BadInput
from shardcheck.harness.rank.checks import CHECKS
from shardcheck.harness.rank.pipeline import (EXTRA_ENV, POINTS, Check, Life, Pipeline, extra_checks, pipeline_for,
                                              registered_checks)
from shardcheck.harness.wire import Checks
from shardcheck.scenarios.suites import get_suite

BUILT_IN = ["CollectiveTrace", "InputsUnchanged", "OutputForm", "ReferenceComparison", "OutputCapture"]


def test_the_built_in_checks_are_registered_in_their_order_and_follow_the_asked_checks():
    assert [c.__name__ for c in CHECKS] == BUILT_IN
    assert [c.__name__ for c in registered_checks()] == BUILT_IN  # through the entry points, in the declared order
    assert [type(c).__name__ for c in pipeline_for(Checks()).checks] == BUILT_IN[:4]
    assert [type(c).__name__ for c in pipeline_for(Checks(), CHECKS).checks] == BUILT_IN[:4]  # named first: once
    invariance = pipeline_for(Checks(outputs=True, reference=False, inplace=False), CHECKS)
    assert [type(c).__name__ for c in invariance.checks] == ["CollectiveTrace", "OutputForm", "OutputCapture"]


def installed(folder, entries: dict[str, str], name: str = "toy-checks"):
    """A distribution's metadata in ``folder`` (what ``pip install`` leaves in site-packages),
    registering ``entries`` in the shardcheck.checks group; put ``folder`` on sys.path to install it."""
    info = folder / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[shardcheck.checks]\n"
                                           + "".join(f"{k} = {v}\n" for k, v in entries.items()))
    return folder


def test_a_plugins_entry_point_runs_after_the_built_ins_and_once(tmp_path, monkeypatch):
    monkeypatch.delenv(EXTRA_ENV, raising=False)
    monkeypatch.syspath_prepend(str(installed(tmp_path, {"positive_log_prob": "toy_check:PositiveLogProb"})))
    assert [c.__name__ for c in registered_checks()] == [*BUILT_IN, "PositiveLogProb"]
    monkeypatch.setenv(EXTRA_ENV, "toy_check:PositiveLogProb")  # registered both ways (an older plugin's setup)
    assert [type(c).__name__ for c in pipeline_for(Checks(), CHECKS).checks] == [*BUILT_IN[:4], "PositiveLogProb"]


@pytest.mark.parametrize("entries, says", [
    ({"broken": "toy_check:NoSuchCheck"}, "the check 'broken' registered in shardcheck.checks (toy_check:NoSuchCheck "
                                          "from toy-checks 0.1) cannot be loaded: AttributeError"),
    ({"raised": "toy_check:RaisedLogProbs"}, "the check 'raised' registered as toy_check:RaisedLogProbs from toy-checks "
                                             "0.1 is not a shardcheck Check"),
    ({"output_form": "toy_check:PositiveLogProb"}, "the check 'output_form' is registered twice in shardcheck.checks"),
])
def test_a_broken_plugin_is_one_line_before_any_world_and_an_error_on_a_rank(tmp_path, monkeypatch, entries, says):
    from shardcheck import preflight

    monkeypatch.delenv(EXTRA_ENV, raising=False)
    monkeypatch.syspath_prepend(str(installed(tmp_path, entries)))
    with pytest.raises(BadInput) as caught:
        preflight.check(argparse.Namespace(command="run"))
    assert says in str(caught.value) and "\n" not in str(caught.value), caught.value
    [stand_in] = [c for c in pipeline_for(Checks(), CHECKS).checks if type(c).__name__ == "Unloadable"]
    with pytest.raises(ValueError, match="registered"):  # at begin: the scenario is the harness's error, exit 2
        stand_in.begin(None)


def test_every_point_is_called_in_order_and_a_stop_ends_the_life():
    calls = []

    class Recorder(Check):
        def __getattribute__(self, name):
            if name in POINTS and name not in ("forward", "backward"):
                return lambda life: calls.append(name)
            return object.__getattribute__(self, name)

    class Stopper(Check):
        def after_forward(self, life: Life) -> None:
            life.stop()

    life = Life(0, Checks(), None, None, None, None, None, None, "weighted", None, None, None)
    pipe = Pipeline([Stopper(), Recorder()])
    pipe.call("inputs_made", life)
    with pipe.around("forward", life):
        pass
    pipe.call("after_forward", life)
    pipe.call("after_backward", life)
    assert calls == ["inputs_made"] and life.stopped


def test_a_check_named_in_the_environment_must_be_one():
    with pytest.raises(ValueError, match="is not a shardcheck Check"):
        extra_checks("toy_check:RaisedLogProbs")
    assert [c.__name__ for c in extra_checks("toy_check:PositiveLogProb")] == ["PositiveLogProb"]


@pytest.mark.world
def test_a_new_kind_is_found_by_its_own_module_and_rendered_by_every_report(tmp_path, world, monkeypatch):
    from shardcheck.harness.controller.reports.html_report import render

    monkeypatch.setenv(EXTRA_ENV, "toy_check:PositiveLogProb")  # every rank reads the SHARDCHECK_* settings
    scenarios = [s for s in get_suite("smoke") if s.name in ("thd-tp2cp1-basic", "zigzag-tp2cp2-edges")]
    right = run_on_world(world, scenarios, "builtin", tmp_path / "b.json", "smoke")
    assert right.exit_code == 0, right.stdout
    caught = run_on_world(world, scenarios, "toy_check:RaisedLogProbs", tmp_path / "t.json", "smoke")
    assert caught.exit_code == 1
    for v in caught.report["scenarios"]:
        assert "positive_log_prob" in v["kinds"], v["kinds"]
        assert any(f["kind"] == "positive_log_prob" and f["message"].startswith("log_probs of sample 0")
                   for f in v["failures"])
    assert "positive_log_prob [ranks" in caught.stdout
    assert "positive_log_prob" in render(caught.report)
    monkeypatch.delenv(EXTRA_ENV)
    without = run_on_world(world, scenarios[:1], "toy_check:RaisedLogProbs", tmp_path / "w.json", "smoke")
    assert "positive_log_prob" not in without.report["scenarios"][0]["kinds"]


@pytest.mark.world
def test_a_check_registered_only_as_an_entry_point_runs_on_every_rank(tmp_path, monkeypatch):
    """No SHARDCHECK_CHECKS: the check is found through its package's entry point alone, on ranks
    of a world of the run's own (forked with this process's path, the plugin installed on it)."""
    monkeypatch.delenv(EXTRA_ENV, raising=False)
    monkeypatch.syspath_prepend(str(installed(tmp_path / "site", {"positive_log_prob": "toy_check:PositiveLogProb"})))
    scenarios = [s for s in get_suite("smoke") if s.name == "thd-tp1cp1-basic"]
    caught = run_on_world(None, scenarios, "toy_check:RaisedLogProbs", tmp_path / "t.json", "smoke")
    [v] = caught.report["scenarios"]
    assert v["verdict"] == "fail" and "positive_log_prob" in v["kinds"], v["kinds"]


@pytest.mark.world
def test_a_check_that_raises_is_the_harnesss_error_never_the_targets(tmp_path, world, monkeypatch):
    """A plugin's check whose hook raises was filed as the target's rank_error (exit 1, a repro
    offered). It is an `error` verdict of kind harness_error naming the check and the point, exit
    2, no repro line; what the other checks found before it is kept."""
    monkeypatch.setenv(EXTRA_ENV, "toy_check:BrokenCheck")
    scenarios = [s for s in get_suite("smoke") if s.name == "thd-tp2cp1-basic"]
    run = run_on_world(world, scenarios, "toy_check:RaisedLogProbs", tmp_path / "e.json", "smoke", repro="x {scenario}")
    assert run.exit_code == 2, run.stdout
    [v] = run.report["scenarios"]
    assert v["verdict"] == "error" and v["kinds"][0] == "harness_error", v["kinds"]
    head = v["failures"][0]["message"]
    assert head.startswith("the check toy_check:BrokenCheck raised at after_forward: KeyError: "), head
    assert head.endswith("(a check's failure, not the target's)"), head
    assert "value_mismatch" in v["kinds"], v["kinds"]  # the reference's comparison ran before it
    assert "ERROR (shardcheck's own, not the target's) thd-tp2cp1-basic" in run.stdout
    assert "as a script needing only torch" not in run.stdout and "1 error (shardcheck's own" in run.stdout


@pytest.mark.world
def test_an_adapter_that_refuses_its_checkout_on_a_rank_is_an_error_not_a_finding(tmp_path, world):
    """A framework commit the adapter cannot import gave a FAIL (rank_error holding the harness's
    own BadInput) on every rank: it is an `error` verdict (harness_error), exit 2, no repro line."""
    scenarios = [s for s in get_suite("smoke") if s.name == "thd-tp2cp1-basic"]
    run = run_on_world(world, scenarios, "plants:RefusesItsCheckout", tmp_path / "r.json", "smoke", repro="x {scenario}")
    assert run.exit_code == 2, run.stdout
    [v] = run.report["scenarios"]
    assert v["verdict"] == "error" and v["kinds"] == ["harness_error"], v
    assert v["failures"][0]["message"] == ("the target could not be run here: slime at /x cannot be imported: no module "
                                           "named slime.backends (its first commit)"), v["failures"][0]
    assert "as a script needing only torch" not in run.stdout
