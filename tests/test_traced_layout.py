"""The position trace: a framework's data path lays the rollout out, the harness learns where each
(sample, position) landed. Pure cases against maps written out by hand; end to end, the harness's
own layout pushed through the trace passes wherever builtin does, and planted data-path bugs (an
off-by-one CP split, a layout that depends on token values) are caught and named."""

import json

import pytest
import torch

from conftest import run_cli, run_on_world, write_scenarios
from shardcheck.harness.controller.reports.layout_check import coverage_failures
from shardcheck.scenarios.layout import rank_layout
from shardcheck.harness.rank.life.data_path import layout_payload
from shardcheck.scenarios.traced_layout import NotAPosition, decode, encoded_tokens, harness_local_tokens, row_map
from shardcheck.scenarios import Sample, Scenario, get_suite
from shardcheck.scenarios.suites import SUITES


def _zigzag() -> Scenario:
    return Scenario("z", (Sample(5, 2), Sample(3, 1)), vocab=4, cp=2, layout="zigzag")


def test_encoding_is_one_plus_the_place_in_the_packed_stream():
    assert [t.tolist() for t in encoded_tokens(_zigzag())] == [[1, 2, 3, 4, 5], [6, 7, 8]]


def test_a_known_zigzag_map_decodes_as_written_by_hand():
    # sample 0 (L=5): chunks of 2 -> rank 0 holds 0,1 and 6,7 (padding); rank 1 holds 2,3 and 4,5(pad)
    # sample 1 (L=3): chunks of 1 -> rank 0 holds 0 and 3 (padding); rank 1 holds 1 and 2
    sc = _zigzag()
    rank0 = torch.tensor([[1, 2, 0, 0, 6, 0]])
    rank1 = torch.tensor([[3, 4, 5, 0, 7, 8]])
    assert row_map(decode(sc, 0, 0, rank0, "hand")) == [(0, 0), (0, 1), None, None, (1, 0), None]
    assert row_map(decode(sc, 0, 1, rank1, "hand")) == [(0, 2), (0, 3), (0, 4), None, (1, 1), (1, 2)]
    lay = decode(sc, 0, 1, rank1, "hand")
    assert lay.shape == (1, 6, 4) and lay.built_by == "hand"
    # the output contract stays the zigzag share: rows 2, 3 of sample 0 (P=3) score its tokens 0, 1;
    # row 1 of sample 1 (P=2) its token 0
    assert lay.share == ((0, 1), (0,))


def test_a_padded_batch_decodes_row_after_row():
    sc = Scenario("b", (Sample(3, 1), Sample(2, 1)), vocab=4, layout="bshd")
    lay = decode(sc, 0, 0, torch.tensor([[1, 2, 3], [4, 5, 0]]), "hand")
    assert lay.shape == (2, 3, 4)
    assert row_map(lay) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), None]


def test_padding_rows_get_positions_unique_to_the_cp_rank():
    sc = _zigzag()
    a = decode(sc, 0, 0, torch.tensor([[1, 2, 0, 0, 6, 0]]), "hand")
    b = decode(sc, 0, 1, torch.tensor([[3, 4, 5, 0, 7, 8]]), "hand")
    pads = lambda lay: {p for s, p in lay.row_positions() if s == len(sc.samples)}  # noqa: E731
    assert pads(a) == {2, 3, 5} and pads(b) == {9}


def test_a_value_that_encodes_no_position_is_refused():
    with pytest.raises(NotAPosition, match="value 9 at local row 1"):
        decode(_zigzag(), 0, 0, torch.tensor([[1, 9]]), "hand")


def test_the_harness_layout_through_the_trace_is_the_harness_layout():
    """Every built-in suite, every rank: today's map comes back row for row."""
    checked = 0
    for name in SUITES:
        for sc in get_suite(name):
            enc = encoded_tokens(sc)
            for cp_rank in range(sc.cp):
                for tp_rank in range(sc.tp):
                    own = rank_layout(sc, tp_rank, cp_rank)
                    got = decode(sc, tp_rank, cp_rank, harness_local_tokens(own, enc), "own")
                    assert row_map(got) == row_map(own), (sc.name, tp_rank, cp_rank)
                    assert (got.shape, got.share, got.columns) == (own.shape, own.share, own.columns)
                    checked += 1
    assert checked > 400


def _payloads(sc: Scenario, shift_second_chunk: int = 0) -> dict[int, dict]:
    out = {}
    for cp_rank in range(sc.cp):
        own = rank_layout(sc, 0, cp_rank)
        tokens = harness_local_tokens(own, encoded_tokens(sc)).reshape(-1)
        if shift_second_chunk:  # the last chunk-size rows of sample 0 come one position early
            k = own.pieces[1].rows
            tokens[k : 2 * k] -= shift_second_chunk
        out[cp_rank] = layout_payload(decode(sc, 0, cp_rank, tokens, "framework"))
    return out


def test_the_coverage_check_passes_a_sound_split_and_names_a_lost_and_a_doubled_position():
    sc = Scenario("z", (Sample(8, 3),), vocab=4, cp=2, layout="zigzag")  # chunks of 2: [0,2) [2,4) [4,6) [6,8)
    assert coverage_failures(sc, _payloads(sc)) == []
    found = coverage_failures(sc, _payloads(sc, shift_second_chunk=1))
    assert [f.kind for f in found] == ["layout_mismatch"]
    # rank 0 holds 0,1 and 5,6 (not 6,7); rank 1 holds 2,3 and 3,4 (not 4,5)
    assert found[0].message == ("framework: sample 0 position 3 is held 2 times by cp rank 1; "
                                "sample 0 position 7 is held by no CP rank")
    assert (found[0].sample, found[0].position) == (0, 3)


def test_the_coverage_check_names_tp_ranks_holding_different_rows():
    sc = Scenario("t", (Sample(4, 2),), vocab=4, tp=2)
    same = layout_payload(decode(sc, 0, 0, torch.tensor([[1, 2, 3, 4]]), "f"))
    other = layout_payload(decode(sc, 1, 0, torch.tensor([[1, 2, 4, 3]]), "f"))
    found = coverage_failures(sc, {0: same, 1: other})
    assert len(found) == 1 and "local row 2 is sample 0 position 2 on rank 0, sample 0 position 3 on rank 1" \
        in found[0].message
    assert coverage_failures(sc, {0: same, 1: dict(same, tp_rank=1)}) == []


def test_a_missing_rank_is_not_taken_for_a_lost_position():
    sc = Scenario("z", (Sample(8, 3),), vocab=4, cp=2, layout="zigzag")
    assert coverage_failures(sc, {0: _payloads(sc)[0]}) == []  # rank 1 died: nothing to say of the whole



def _one_of_each() -> list[Scenario]:
    names = {"thd-tp2cp1-edges", "bshd-tp2cp1-long-prompt", "zigzag-tp2cp2-edges", "allgather-tp1cp4-long-prompt",
             "zigzag-tp1cp4-replay"}
    return [s for s in get_suite("smoke") if s.name in names]


@pytest.mark.world
def test_builtin_traced_passes_and_reports_the_rows_it_built(tmp_path, world):
    run = run_on_world(world, _one_of_each(), "builtin:traced", tmp_path / "r.json", "smoke")
    assert run.exit_code == 0, run.stdout
    for v in run.report["scenarios"]:
        assert v["layout_built_by"] == "shardcheck/scenarios/layout.py:rank_layout"
        sc = Scenario.from_dict(v["scenario"])
        assert len(v["layouts"]) == 4
        for rank, lay in v["layouts"].items():
            own = rank_layout(sc, lay["tp_rank"], lay["cp_rank"])
            assert lay["shape"] == list(own.shape)


@pytest.mark.world
def test_an_off_by_one_cp_split_is_caught_with_sample_and_position(tmp_path, world):
    sc = Scenario("split", (Sample(8, 3), Sample(6, 4)), vocab=8, cp=2, layout="zigzag", seed=3)
    run = run_on_world(world, [sc], "plants:CpSplitOffByOne", tmp_path / "r.json", "file")
    assert run.exit_code == 1
    v = run.report["scenarios"][0]
    mismatch = [f for f in v["failures"] if f["kind"] == "layout_mismatch"]
    assert mismatch and "sample 0 position 3 is held 2 times by cp rank 1" in mismatch[0]["message"]
    assert (mismatch[0]["sample"], mismatch[0]["position"]) == (0, 3)


@pytest.mark.world
def test_a_layout_that_depends_on_token_values_is_caught(tmp_path, world):
    sc = get_suite("smoke")[0]  # thd-tp1cp1-basic: token 3 occurs
    run = run_on_world(world, [sc], "plants:ValueDependentLayout", tmp_path / "r.json", "smoke")
    messages = [f["message"] for f in run.report["scenarios"][0]["failures"] if f["kind"] == "layout_mismatch"]
    assert any("laid the real tokens out differently from their positions" in m for m in messages), messages


@pytest.mark.world
def test_slime_like_padding_passes_builtin_and_its_knob_is_checked(tmp_path, world):
    base = [s for s in get_suite("smoke") if s.name in ("allgather-tp1cp4-long-prompt", "zigzag-tp2cp2-edges")]
    scenarios = base + [Scenario.from_dict(dict(s.to_dict(), name=s.name + "-pm1", layout_knobs={"pad_multiplier": 1}))
                        for s in base]
    run = run_on_world(world, scenarios, "plants:SlimeLikePadding", tmp_path / "r.json", "file")
    assert run.exit_code == 0, run.stdout
    rows = {v["name"]: v["layouts"]["0"]["shape"][1] for v in run.report["scenarios"]}
    assert rows["allgather-tp1cp4-long-prompt"] == 128 and rows["allgather-tp1cp4-long-prompt-pm1"] < 128


def test_knobs_a_target_has_not_skip_and_a_bad_value_is_one_line(tmp_path, cli_in_process):
    sc = get_suite("smoke")[0].to_dict()
    cases = {"plants:SlimeLikePadding": dict(sc, name="unknown", layout_knobs={"pad_to": 4}),
             "builtin": dict(sc, name="on-builtin", layout_knobs={"pad_multiplier": 4})}
    reasons = {}
    for target, scenario in cases.items():
        (tmp_path / "s.json").write_text(json.dumps([scenario]))
        got = cli_in_process("run", "--target", target, "--scenario-file", str(tmp_path / "s.json"),
                             "--allow-all-skipped", "--json-report", str(tmp_path / "r.json"))
        assert got.returncode == 0, got.stderr
        reasons[target] = json.loads((tmp_path / "r.json").read_text())["scenarios"][0]["reason"]
    assert reasons["plants:SlimeLikePadding"] == ("tests/plants.py:_SlimeLikePadding has no layout knob pad_to at "
                                                  "this commit (knobs: pad_multiplier)")
    assert reasons["builtin"] == ("target builtin lays out no rows with a framework's code: it has no layout knob "
                                  "pad_multiplier")
    (tmp_path / "bad.json").write_text(json.dumps([dict(sc, name="bad", layout_knobs={"pad_multiplier": 0})]))
    got = cli_in_process("run", "--target", "plants:SlimeLikePadding", "--scenario-file", str(tmp_path / "bad.json"))
    assert got.returncode == 2 and got.stderr.strip().count("\n") == 0, got.stderr
    assert "scenario 'bad': layout knob pad_multiplier must be an integer >= 1, got 0" in got.stderr
