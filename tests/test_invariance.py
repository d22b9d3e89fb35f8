"""Invariance: the same sample's outputs keep their bits however it is laid out, packed, ordered
or split; contracts turn differences into invariance_violation failures.

Over 20 s: the packing-dependent plant runs the whole smoke suite and every layout of the
invariance bases.
"""

import dataclasses
import json

import numpy as np
import pytest
import torch

from shardcheck.cli import main
from shardcheck.errors import BadInput
from shardcheck.harness.controller.commands.invariance import (AXES, Expect, check_invariance, difference, parse_expect, ulp_distance,
                                           variants)
from shardcheck.pytest_plugin import ShardcheckSession
from shardcheck.scenarios import Sample, Scenario
from shardcheck.scenarios.data import ScenarioData

BASES = [
    Scenario("thd-four", (Sample(13, 5), Sample(9, 1), Sample(21, 12), Sample(6, 3)), vocab=24, tp=2,
             entropy_coef=0.1, log_probs_chunk_size=4, temperature=0.7, seed=31),
    Scenario("ag-four", (Sample(30, 2), Sample(11, 4), Sample(9, 6), Sample(17, 3)), vocab=16, cp=2,
             layout="allgather", entropy_coef=0.0, seed=32),
]


# -- plain parts -----------------------------------------------------------------------------------
def test_a_sample_carries_its_data_wherever_it_is_placed():
    base = BASES[0]
    [alone] = [v.scenario for v in variants("packing", base, 4) if v.label == "sample 2 alone"]
    [rev] = [v.scenario for v in variants("order", base, 4) if v.label == "reversed"]
    d, a, r = ScenarioData(base), ScenarioData(alone), ScenarioData(rev)
    assert torch.equal(d.tokens(2), a.tokens(0)) and torch.equal(d.tokens(2), r.tokens(1))
    assert torch.equal(d.logit_rows(2, 0, 21), a.logit_rows(0, 0, 21))
    assert all(torch.equal(x, y) for x, y in zip(d.loss_weights(2), r.loss_weights(1)))
    assert Scenario.from_json(rev.to_json()) == rev  # the identities round-trip through JSON
    with pytest.raises(BadInput, match="two samples carry data_id 0"):
        Scenario("x", ([5, 2], [6, 2, 0]), vocab=4)


def test_variants_of_each_axis_and_what_the_world_cannot_hold():
    base = Scenario("b", (Sample(9, 3), Sample(7, 2)), vocab=16, tp=2, cp=2, layout="allgather", seed=1)
    labels = {axis: [(v.label, v.skip) for v in variants(axis, base, 4)] for axis in AXES}
    assert labels["rerun"] == [("run 1", None), ("run 2", None)]
    assert dict(labels["tp"])["tp=4"] == "tp=4 x cp=2 needs 8 ranks; the world has 4"
    assert dict(labels["cp"])["cp=4 allgather"] == "tp=2 x cp=4 needs 8 ranks; the world has 4"
    assert dict(labels["cp"])["cp=1 thd"] is None
    assert [lab for lab, _ in labels["cp_mode"]] == ["zigzag cp=2", "allgather cp=2"]
    assert [lab for lab, _ in labels["format"]] == ["thd", "bshd"]
    assert [lab for lab, _ in labels["chunk"]] == ["chunk=-1", "chunk=3"]
    assert [lab for lab, _ in labels["packing"]] == ["packed", "between new samples", "sample 0 alone",
                                                    "sample 1 alone"]
    assert "need 4" in labels["split"][0][1]
    between = variants("packing", base, 4)[1].scenario
    assert [s.data_id for s in between.samples] == [2, 0, 1, 3]  # new neighbours get new identities
    odd = Scenario("v", (Sample(9, 3),), vocab=37)
    assert variants("tp", odd, 4)[1].skip == "vocab 37 is not divisible by tp 2"
    # a sequence-parallel base: the Megatron family's axes lay it out with sp 1, each variant valid
    ulysses = Scenario("u", (Sample(9, 3), Sample(7, 2)), vocab=16, sp=2, layout="ulysses")
    for axis in ("cp", "cp_mode", "format"):
        assert all(v.skip is None and v.scenario.sp == 1 for v in variants(axis, ulysses, 4)), axis


def test_an_axis_that_compared_nothing_is_not_called_kept():
    from shardcheck.harness.controller.commands.invariance import Cell, InvarianceResult
    from shardcheck.harness.controller.reports.invariance_report import render

    nothing = {q: Cell(skipped=["u cp=1 thd: refused"]) for q in ("log_probs", "entropy", "grad")}
    some = {q: Cell(compared=2) for q in ("log_probs", "entropy", "grad")}
    result = InvarianceResult({"name": "t"}, ["cp", "packing"], {"cp": Expect(0), "packing": Expect(0)},
                              {"cp": nothing, "packing": some})
    assert render(result).splitlines()[-1] == "contract kept: packing=bitwise; not checked (no pair compared): cp"
    alone = InvarianceResult({"name": "t"}, ["tp"], {"cp": Expect(0)}, {"tp": some})
    assert render(alone).splitlines()[-1].startswith("no contract declared for the axes run (tp)")


def test_a_difference_of_exactly_one_ulp_is_counted_and_none_is_not():
    want = torch.tensor([1.0, -2.5, 3.0])
    got = want.clone()
    got[1] = torch.nextafter(want[1], torch.tensor(0.0))  # the next float towards zero: one ulp
    d = difference(want, got)
    assert d is not None and (d.ulp, d.count, d.index) == (1, 1, (1,)), d
    assert difference(want, want.clone()) is None


def test_ulp_distance_and_difference():
    one = torch.tensor([1.0])
    nxt = torch.nextafter(one, torch.tensor([2.0]))
    assert int(ulp_distance(one, nxt)) == 1
    assert int(ulp_distance(torch.tensor([-0.0]), torch.tensor([0.0]))) == 0  # the same number
    assert int(ulp_distance(torch.tensor([-1.0]), torch.tensor([1.0]))) > 2 ** 30
    assert int(ulp_distance(torch.tensor([1.0], dtype=torch.bfloat16),
                            torch.tensor([1.0078125], dtype=torch.bfloat16))) == 1
    a = torch.zeros(3, 4)
    assert difference(a, a.clone()) is None
    b = a.clone()
    b[2, 1] = 1e-3
    d = difference(a, b)
    assert d.index == (2, 1) and d.count == 1 and d.got == pytest.approx(1e-3) and d.want == 0.0


def test_contracts_parse_or_say_what_is_wrong():
    assert parse_expect("packing=bitwise, tp=ulp:8") == {"packing": Expect(0), "tp": Expect(8)}
    for spec, words in [("packing", "expected AXIS=bitwise"), ("tp=ulp:x", "'bitwise' or 'ulp:N'"),
                        ("sideways=bitwise", "unknown invariance axis 'sideways'")]:
        with pytest.raises(BadInput, match=words):
            parse_expect(spec)


@pytest.mark.parametrize("args,words", [
    (["invariance", "--axis", "rerun,sideways"], "unknown invariance axis 'sideways'"),
    (["invariance", "--expect", "tp=ulp"], "--expect tp: expected 'bitwise' or 'ulp:N'"),
    (["invariance", "--expect", "packing"], "expected AXIS=bitwise or AXIS=ulp:N"),
])
def test_bad_invariance_options_are_one_line(capsys, args, words):
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardcheck: error: ") and words in err[0], err


# -- on a world ------------------------------------------------------------------------------------
@pytest.mark.world
def test_builtin_meets_its_declared_contract(world):
    result = check_invariance(BASES, "builtin", world=world)
    assert result.exit_code == 0, [f.message for f in result.violations[:3]]
    assert set(result.contract) == set(AXES) - {"tp"}
    for axis in result.contract:
        for q in ("log_probs", "grad"):
            cell = result.matrix[axis][q]
            assert cell.compared and cell.worst is None, (axis, q, cell.to_dict())
    assert result.matrix["tp"]["log_probs"].compared  # measured, not judged
    assert any("cp=4" in s for s in result.matrix["cp"]["grad"].skipped)  # tp=2 x cp=4 > 4 ranks
    # a user contract the target does not make is checked too: sums split over 1 or 2 TP ranks
    strict = check_invariance(BASES[:1], "builtin", axes=["tp"], expect={"tp": Expect(0)}, world=world)
    assert strict.exit_code == 1 and {f.details["axis"] for f in strict.violations} == {"tp"}
    f = strict.violations[0]
    assert f.kind == "invariance_violation" and f.details["layouts"][0] in ("tp=1", "tp=2")


@pytest.mark.world
def test_packing_dependent_passes_run_and_breaks_packing_only(world):
    from shardcheck.harness.controller.commands import runner
    from shardcheck.harness.controller.reports.run_report import SilentReport

    # run passes it: its own path (a call holding one sample) is within tolerance, each sample alone
    # in each base's layout, and packed it is the builtin
    alone = [dataclasses.replace(sc, name=f"{sc.name}-{i}", samples=(sample,)) for sc in BASES
             for i, sample in enumerate(sc.samples)]
    assert runner.run(alone + BASES, "builtin:packing_dependent", reporter=SilentReport(),
                      world=world).exit_code == 0
    result = check_invariance(BASES, "builtin:packing_dependent", world=world)
    assert result.exit_code == 1
    assert {f.details["axis"] for f in result.violations} == {"packing"}
    f = result.violations[0]
    assert "alone" in " ".join(f.details["layouts"]) and f.got != f.want
    assert f.message.startswith("packing: ") and "expected bitwise" in f.message


@pytest.mark.world
def test_the_pytest_plugin_asserts_a_contract(world):
    session = ShardcheckSession(world, "builtin:packing_dependent")
    session.check_invariance(BASES[0], axes=["rerun", "order", "split"])  # kept
    with pytest.raises(pytest.fail.Exception, match="invariance_violation: packing: "):
        session.check_invariance(BASES[0], axes=["packing"])
    kept = ShardcheckSession(world, "builtin").check_invariance(BASES[0], axes=["packing"],
                                                                expect="packing=bitwise")
    assert kept.matrix["packing"]["entropy"].compared


@pytest.mark.world
def test_the_command_writes_the_matrix_and_exits_1_on_a_violation(tmp_path, capsys):
    f = tmp_path / "s.json"
    f.write_text(json.dumps([dataclasses.replace(BASES[0], tp=1).to_dict()]))  # a world of one starts fastest
    report = tmp_path / "inv.json"
    # --no-lockstep is the world's, as for run (it was accepted and dropped)
    code = main(["invariance", "--target", "builtin:packing_dependent", "--scenario-file", str(f), "-q",
                 "--axis", "packing,order", "--json-report", str(report), "--nproc", "1", "--no-lockstep"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "1 ranks, lockstep off (--no-lockstep))" in out.splitlines()[0], out
    doc = json.loads(report.read_text())
    assert doc["complete"] and doc["contract"]["packing"] == "bitwise"
    assert doc["matrix"]["packing"]["log_probs"]["max_ulp"] >= 1 and doc["matrix"]["order"]["grad"]["max_ulp"] == 0
    assert doc["violations"] and all(v["details"]["axis"] == "packing" for v in doc["violations"])
    assert "packing" in out and "invariance violation" in out


# -- a difference of exactly one ulp (issue 26) ---------------------------------------------------
# tp = cp = 1 and short: each order is one quick run
TWO_SAMPLES = Scenario("two", (Sample(9, 4), Sample(7, 3)), vocab=16, seed=5)


@pytest.mark.world
def test_a_one_ulp_difference_between_orders_is_a_violation(world):
    result = check_invariance([TWO_SAMPLES], "plants:OneUlpUpFirstInBatch", axes=["order"],
                              expect={"order": Expect(0)}, world=world)
    # each sample is first in one order and second in the other: its token 0 is one ulp apart
    assert [(f.sample, f.token, f.details["ulp"]) for f in result.violations] == [(0, 0, 1), (1, 0, 1)]
    for f in result.violations:
        assert (f.kind, f.field, f.details["differing_elements"]) == ("invariance_violation", "log_probs", 1)
        assert "(1 ulp, 1 elements differ; expected bitwise)" in f.message, f.message
        lower, upper = sorted(np.float32(x) for x in (f.want, f.got))  # neighbours, by numpy's count
        assert np.nextafter(lower, np.float32(np.inf)) == upper
    cells = result.matrix["order"]
    assert cells["log_probs"].worst.ulp == 1 and cells["entropy"].worst is None and cells["grad"].worst is None


@pytest.mark.world
def test_bitwise_equal_orders_are_no_violation(world):
    result = check_invariance([TWO_SAMPLES], "builtin", axes=["order"], expect={"order": Expect(0)}, world=world)
    assert result.exit_code == 0, [f.message for f in result.violations]
    assert all(cell.compared and cell.worst is None for cell in result.matrix["order"].values())
