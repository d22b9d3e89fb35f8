"""A target declares where its definition differs from the reference's default (NeMo-RL's entropy
is sum p log p): the reference follows it, values and gradients, and the report says which
definition was checked. The same outputs without the declaration fail."""

import pytest

from conftest import run_on_world
from shardcheck.harness.controller.reports.run_report import definitions_line
from shardcheck.scenarios.suites import get_suite
from shardcheck.targets.base import Definitions, TargetBase, definitions


def test_the_default_is_the_references_and_says_nothing():
    assert definitions(TargetBase()).entropy_sign == 1 and Definitions().describe() == {}
    assert definitions_line({"name": "builtin"}) is None
    described = Definitions(entropy_sign=-1, entropy_source="a plant").describe()
    assert "sum p log p" in described["entropy"] and "a plant" in described["entropy"]
    assert definitions_line({"definitions": described}).startswith("definitions checked (the target's")
    held = Definitions(loss_over="held", loss_source="a plant").describe()["loss"]
    assert "on the tokens its own rows score" in held and "a plant" in held


@pytest.mark.world
def test_a_declared_negative_entropy_is_checked_as_declared(tmp_path, world):
    # entropy_coef != 0, so the entropy term's gradient is checked as well as its values
    scenarios = [s for s in get_suite("smoke") if s.name in ("thd-tp2cp1-basic", "zigzag-tp2cp2-edges")]
    assert all(s.with_entropy and s.entropy_coef != 0 for s in scenarios)
    declared = run_on_world(world, scenarios, "plants:NegativeEntropy", tmp_path / "d.json", "smoke")
    assert declared.exit_code == 0, declared.stdout
    assert "definitions checked (the target's, the reference followed): entropy: sum p log p" in declared.stdout
    assert "sum p log p" in declared.report["target"]["definitions"]["entropy"]
    undeclared = run_on_world(world, scenarios, "plants:NegativeEntropyUndeclared", tmp_path / "u.json", "smoke")
    assert undeclared.exit_code == 1
    for v in undeclared.report["scenarios"]:
        assert set(v["kinds"]) == {"value_mismatch", "grad_mismatch"}, v["kinds"]
        assert any(f["kind"] == "value_mismatch" and f["message"].startswith("entropy") for f in v["failures"])


@pytest.mark.world
def test_the_loss_over_the_gathered_sequence_is_checked_as_declared(tmp_path, world):
    """NeMo-RL's convention: with CP every rank returns every token and takes the loss over the
    whole gathered sequence, divided by cp. Declared, a right gather passes; one whose backward
    does not sum the CP ranks' gradients fails (1/cp of the truth); the same faulty gather under
    the share convention passes: the convention must be the framework's to catch it."""
    scenarios = [s for s in get_suite("smoke") if s.name in ("zigzag-tp2cp2-edges", "allgather-tp1cp4-long-prompt")]
    assert {s.cp for s in scenarios} == {2, 4}
    right = run_on_world(world, scenarios, "plants:GatheredLoss", tmp_path / "g.json", "smoke")
    assert right.exit_code == 0, right.stdout
    assert "loss: over the whole gathered sequence on every CP rank" in right.stdout
    wrong = run_on_world(world, scenarios, "plants:GatheredLossNoGradSum", tmp_path / "w.json", "smoke")
    assert wrong.exit_code == 1
    for v in wrong.report["scenarios"]:
        assert set(v["kinds"]) == {"grad_mismatch"}, (v["name"], v["kinds"])
    hidden = run_on_world(world, scenarios, "plants:ShareOfGatheredNoGradSum", tmp_path / "s.json", "smoke")
    assert hidden.exit_code == 0, hidden.stdout


@pytest.mark.world
def test_log_probs_gathered_and_entropy_on_own_rows_are_declared_field_by_field(tmp_path, world):
    """NeMo-RL gathers its log-probs over CP but computes its entropy on each rank's own rows:
    declared so (entropy_over="held"), both pass, the gradient of both terms checked; declared as
    a whole, the entropy is short of the tokens owed and fails."""
    scenarios = [s for s in get_suite("smoke") if s.name == "zigzag-tp2cp2-edges"]
    assert scenarios[0].with_entropy and scenarios[0].entropy_coef != 0
    right = run_on_world(world, scenarios, "plants:GatheredLogProbs", tmp_path / "f.json", "smoke")
    assert right.exit_code == 0, right.stdout
    assert ("every CP rank's log-probs checked for every response token; the entropy on the tokens each rank's "
            "own rows score" in right.stdout)
    whole = run_on_world(world, scenarios, "plants:GatheredLogProbsEntropyUndeclared", tmp_path / "u.json", "smoke")
    assert whole.exit_code == 1
    failures = whole.report["scenarios"][0]["failures"]
    assert any(f["kind"] == "value_mismatch" and f["message"].startswith("entropy of sample 0 has shape")
               for f in failures), failures
