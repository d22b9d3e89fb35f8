"""What the model is handed besides the tokens (position ids, cu_seqlens), checked against the
layout the position trace learned: the rules on hand-written inputs, and two bugs planted in the
builtin's traced data path caught end to end (issue 36)."""

import pytest
import torch

from shardcheck.harness.controller.commands import runner
from shardcheck.harness.controller.reports.run_report import SilentReport
from shardcheck.harness.rank.life.model_inputs import check_model_inputs
from shardcheck.scenarios import Sample, Scenario, get_suite
from shardcheck.scenarios.layout import rank_layout

THD = Scenario("t", (Sample(5, 2), Sample(3, 1)), vocab=8)
# zigzag cp 2, one sample of 8 tokens: chunks of 2 rows; rank 0 holds positions 0, 1 and 6, 7
ZIGZAG = Scenario("z", (Sample(8, 3),), vocab=8, cp=2, layout="zigzag")


def _messages(layout, given):
    return [f.message for f in check_model_inputs(layout, given, 0)]


def test_true_inputs_pass():
    thd = rank_layout(THD, 0, 0)
    assert _messages(thd, {"position_ids": torch.tensor([0, 1, 2, 3, 4, 0, 1, 2]),
                           "cu_seqlens": torch.tensor([0, 5, 8])}) == []
    zig = rank_layout(ZIGZAG, 0, 0)
    assert _messages(zig, {"position_ids": torch.tensor([0, 1, 6, 7]), "cu_seqlens": torch.tensor([0, 8])}) == []


def test_a_zero_length_sequence_is_named():
    [m] = _messages(rank_layout(THD, 0, 0), {"cu_seqlens": torch.tensor([0, 5, 8, 8])})
    assert m.endswith("handed the model cu_seqlens [0, 5, 8, 8]: sequence 2 has zero length (8 to 8)"), m


def test_boundaries_that_cut_a_sample_or_start_elsewhere_are_named():
    thd = rank_layout(THD, 0, 0)
    [short] = _messages(thd, {"cu_seqlens": torch.tensor([0, 4, 8])})
    assert "sequence 0 holds 4 positions, sample 0 has 5" in short
    [few] = _messages(thd, {"cu_seqlens": torch.tensor([0, 8])})
    assert "1 sequences for 2 samples" in few
    [start] = _messages(thd, {"cu_seqlens": torch.tensor([1, 6, 9])})
    assert "it must start at 0" in start


def test_position_ids_not_in_zigzag_order_are_named_by_row():
    [m] = _messages(rank_layout(ZIGZAG, 0, 0), {"position_ids": torch.tensor([0, 1, 2, 3])})
    assert "row 2 (sample 0 position 6) holds 2; row 3 (sample 0 position 7) holds 3" in m, m
    [count] = _messages(rank_layout(THD, 0, 0), {"position_ids": torch.tensor([0, 1, 2])})
    assert "3 position ids for 8 local rows" in count


@pytest.mark.world
@pytest.mark.parametrize("variant, scenario, said", [
    ("traced_zero_length_sequence", "thd-tp2cp1-basic", "cu_seqlens [0, 23, 37, 37]: sequence 2 has zero length"),
    ("traced_positions_not_zigzag", "zigzag-tp2cp2-basic", "position ids that are not the rows' positions: row "),
])
def test_each_planted_model_input_bug_is_a_layout_mismatch(world, variant, scenario, said):
    smoke = {sc.name: sc for sc in get_suite("smoke")}
    result = runner.run([smoke[scenario], smoke["bshd-tp2cp1-basic"]], f"builtin:{variant}", reporter=SilentReport(),
                        world=world)
    failed, padded = result.verdicts
    assert failed.status == "fail" and failed.kinds == ["layout_mismatch"], failed.headline()
    assert said in failed.failures[0].message, failed.failures[0].message
    # bshd hands no cu_seqlens, and its position ids are each row's own: nothing to find there
    assert padded.status == "pass", padded.headline()


def test_no_script_is_offered_for_what_a_script_does_not_look_for():
    from shardcheck.harness.controller.commands.repro import kinds_refusal

    assert kinds_refusal(["layout_mismatch"]) == "a script does not look for layout_mismatch yet"
    assert kinds_refusal(["mask_leak", "layout_mismatch"]) is not None
    assert kinds_refusal(["layout_mismatch", "grad_mismatch"]) is None and kinds_refusal([]) is None


def test_repro_refuses_a_report_whose_failure_a_script_does_not_look_for(tmp_path, cli_in_process):
    import json

    scenario = get_suite("smoke")[0]
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"target_spec": "builtin:traced_zero_length_sequence", "scenarios": [
        {"name": scenario.name, "verdict": "fail", "scenario": scenario.to_dict(),
         "failures": [{"kind": "layout_mismatch", "message": "cu_seqlens ... zero length"}]}]}))
    got = cli_in_process("repro", "--report", str(report), "--scenario", scenario.name, "--out", str(tmp_path / "s.py"))
    assert got.returncode == 2 and "a script does not look for layout_mismatch yet" in got.stderr, got.stderr
    assert len(got.stderr.strip().splitlines()) == 1 and not (tmp_path / "s.py").exists()
