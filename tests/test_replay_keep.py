"""Replayed keep sets through the harness: the scenario carries them, the ranks hand them to a
target that says it applies them, the reference renormalises over them; a target that does not
apply them is skipped with the reason."""

import pytest

from shardcheck.errors import BadInput
from shardcheck.harness.controller import runner
from shardcheck.harness.controller.report import SilentReport
from shardcheck.scenarios import Sample, Scenario

REPLAY = Scenario("replay", (Sample(14, 9), Sample(11, 6, 7)), vocab=12, replay_keep=True, entropy_coef=0.2,
                  temperature=0.8, seed=11)


def test_a_replay_scenario_round_trips_and_a_wrong_flag_is_named():
    assert Scenario.from_dict(REPLAY.to_dict()) == REPLAY and REPLAY.to_dict()["replay_keep"] is True
    with pytest.raises(BadInput, match="replay_keep must be true or false, got 'yes'"):
        Scenario.from_dict(dict(REPLAY.to_dict(), replay_keep="yes"))


@pytest.mark.world
def test_the_processed_truth_is_met_by_a_plain_implementation_and_missed_without_the_keep_sets(world):
    result = runner.run([REPLAY], "plants:ReplayKeepTp1", reporter=SilentReport(), world=world)
    assert result.verdicts[0].status == "pass", result.verdicts[0].headline()
    [v] = runner.run([REPLAY], "plants:ReplayKeepIgnored", reporter=SilentReport(), world=world).verdicts
    kinds = {f.kind for f in v.failures}
    assert v.status == "fail" and {"value_mismatch", "grad_mismatch"} <= kinds, v.headline()
    assert not any(f.field == "entropy" for f in v.failures)  # the entropy is not processed
    [v] = runner.run([REPLAY], "plants:WithoutReplayKeep", reporter=SilentReport(), world=world).verdicts
    assert v.status == "skip" and v.reason == "does not apply replayed keep sets (top-p / top-k replay)"


@pytest.mark.world
def test_builtin_applies_the_keep_sets_in_every_layout(world):
    import dataclasses

    from shardcheck.scenarios import get_suite

    picked = {}
    for sc in get_suite("smoke"):  # one of each (layout, tp, cp, chunked) the smoke suite has
        picked.setdefault((sc.layout, sc.tp, sc.cp, sc.log_probs_chunk_size > 0), sc)
    scenarios = [dataclasses.replace(sc, name=sc.name + "-keep", replay_keep=True) for sc in picked.values()]
    assert {sc.layout for sc in scenarios} == {"thd", "bshd", "zigzag", "allgather"} and len(scenarios) >= 8
    result = runner.run(scenarios, "builtin", reporter=SilentReport(), world=world)
    assert [v.headline() for v in result.verdicts if v.status != "pass"] == []
