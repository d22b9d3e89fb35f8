"""Replayed keep sets through the harness: the scenario carries them, the ranks hand them to a
target that says it applies them, the reference renormalises over them; a target that does not
apply them is skipped with the reason."""

import pytest

from shardcheck.errors import BadInput
from shardcheck.harness.controller.commands import runner
from shardcheck.harness.controller.reports.run_report import SilentReport
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


# -- the sampling definition: keep sets filtered from the logits (NeMo-RL's top-k / top-p) --------

def test_sampling_sets_follow_the_filter_and_the_tokens_are_drawn_inside():
    import torch

    from shardcheck.scenarios.data import ScenarioData
    from shardcheck.scenarios.keep import sampling_keep

    s = torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.0, 0.0, 5.0, 0.1]])
    assert sampling_keep(s, 2, 1.0) == [(0, 2), (2, 3)]
    assert sampling_keep(s, 0, 0.5) == [(0,), (2,)]  # the largest alone holds more than half
    assert sampling_keep(s, 0, 0.95) == [(0, 1, 2), (2,)]  # 5 holds 0.98 of its row
    assert sampling_keep(s, 1, 0.99) == [(0,), (2,)]
    sc = Scenario("s", (Sample(30, 20),), vocab=16, top_k=3, top_p=0.8, temperature=0.7, seed=3)
    data = ScenarioData(sc)
    tokens = data.tokens(0)
    for j in range(20):
        kept = data.keep_at(0, 9 + j)  # row prompt - 1 + j scores response token j
        assert 1 <= len(kept) <= 3 and int(tokens[10 + j]) in kept
    assert data.keep_sets(0) is None  # targets filter the logits themselves: no sets are handed over


def test_sampling_fields_are_validated_and_written_only_when_on():
    assert "top_k" not in REPLAY.to_dict() and "top_p" not in REPLAY.to_dict()
    sc = Scenario("s", (Sample(8, 3),), vocab=8, top_k=2)
    assert Scenario.from_dict(sc.to_dict()) == sc and sc.to_dict()["top_k"] == 2 and sc.sampling
    for field, value, fragment in (("top_k", 9, "top_k must be an integer in [0, vocab 8]"),
                                   ("top_p", 0.0, "top_p must be a number in (0, 1]"),
                                   ("top_p", True, "top_p must be a number in (0, 1]")):
        with pytest.raises(BadInput, match=fragment.replace("[", r"\[").replace("(", r"\(")):
            Scenario.from_dict(dict(sc.to_dict(), **{field: value}))
    with pytest.raises(BadInput, match="two definitions of a processed log-prob"):
        Scenario("s", (Sample(8, 3),), vocab=8, top_p=0.5, replay_keep=True)


@pytest.mark.world
def test_the_sampling_truth_is_met_by_a_plain_filter_and_missed_without_it(world):
    from shardcheck.scenarios import get_suite

    [one] = [s for s in get_suite("sampling") if s.name == "sampling-thd-one-device"]
    [v] = runner.run([one], "plants:SamplingTp1", reporter=SilentReport(), world=world).verdicts
    assert v.status == "pass", v.headline()
    [v] = runner.run([one], "plants:SamplingIgnored", reporter=SilentReport(), world=world).verdicts
    assert v.status == "fail" and {"value_mismatch", "grad_mismatch"} <= set(v.kinds), v.headline()
    assert not any(f.field == "entropy" for f in v.failures)
    [v] = runner.run([one], "builtin", reporter=SilentReport(), world=world).verdicts
    assert v.status == "skip" and v.reason == "applies no top-k / top-p filter to the logits (sampling scenarios)"


# -- keep sets given as they are (a real rollout's) -------------------------------------------------

GIVEN = {"name": "real-rollout", "samples": [[6, 3], [4, 2]], "vocab": 8, "tp": 2, "replay_keep": True,
         "keep_sets": [[[1, 2, 7], [0], None], [[3, 4, 5], [6, 7]]]}


def test_given_keep_sets_round_trip_and_are_what_the_ranks_get():
    from shardcheck.scenarios.data import ScenarioData

    sc = Scenario.from_dict(GIVEN)
    assert Scenario.from_dict(sc.to_dict()) == sc and sc.to_dict()["keep_sets"] == GIVEN["keep_sets"]
    assert ScenarioData(sc).keep_sets(1) == [(3, 4, 5), (6, 7)] and ScenarioData(sc).keep_at(0, 5) is None


@pytest.mark.parametrize("change, fragment", [
    ({"keep_sets": [[[1, 2, 8], [0], None], [[3], [6]]]}, "sample 0: keep set 0 names token 8, outside the vocabulary of 8"),
    ({"keep_sets": [[[1], [-1], None], [[3], [6]]]}, "sample 0: keep set 1 names token -1, outside"),
    ({"keep_sets": [[[1], [0]], [[3], [6]]]}, "sample 0: 2 keep sets for 3 response tokens"),
    ({"keep_sets": [[[1], None, [0]], [[3], [6]]]}, "keep set 1 is null but a later one is not"),
    ({"keep_sets": [[[1], [0], None]]}, "keep_sets has 1 entries for 2 samples"),
    ({"replay_keep": False}, "give replay_keep true with them"),
    ({"keep_sets": 3}, "keep_sets must be a list per sample"),
])
def test_given_keep_sets_are_validated_with_one_line(change, fragment):
    with pytest.raises(BadInput, match=fragment.replace("(", r"\(")):
        Scenario.from_dict(dict(GIVEN, **change))


def test_a_keep_set_outside_the_vocabulary_is_exit_2(cli_in_process, tmp_path):
    import json

    path = tmp_path / "s.json"
    path.write_text(json.dumps(dict(GIVEN, keep_sets=[[[1, 2, 9], [0], None], [[3], [6]]])))
    proc = cli_in_process("run", "--scenario-file", str(path))
    assert proc.returncode == 2 and "keep set 0 names token 9, outside the vocabulary of 8" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.world
def test_given_keep_sets_are_checked_as_generated_ones_are(world):
    sc = Scenario.from_dict(GIVEN)
    assert runner.run([sc], "builtin", reporter=SilentReport(), world=world).verdicts[0].status == "pass"
    [v] = runner.run([sc], "builtin:keep_ids_unshifted", reporter=SilentReport(), world=world).verdicts
    assert v.status == "fail" and "value_mismatch" in v.kinds, v.headline()
