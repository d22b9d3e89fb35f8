"""The comparison against the reference, first without processes: outputs and gradients brute-forced
here pass; a one-element change fails and is named by sample, token and column.

The expectations are computed in this file with plain float64 torch on the whole (tiny)
scenario: full logits per sample, ``torch.log_softmax``, the target token gathered, entropy
``-(p * log p).sum``, and the gradient of the global loss by autograd. They are mapped to a rank's
zigzag layout with explicit arithmetic, never with the reference or shard truth code under test
(``shardcheck.reference``, ``shard.share_truth``, ``shard.row_targets_and_weights``,
``loss_grad_chunks``): a bug shared by the harness's truth and the expectation would go unseen.

At the end, the same checks end to end: plants (tests/plants.py) wrong only where a careless
comparison would not look (a NaN, the last token) run on the session's world and must fail.
"""

import math
from dataclasses import dataclass

import pytest
import torch

from shardcheck.harness.rank.checks.compare import TOLERANCES, compare_grad, compare_outputs, mismatch_mask
from shardcheck.scenarios.layout import rank_layout
from shardcheck.scenarios import Sample, Scenario
from shardcheck.scenarios.data import ScenarioData

SC = Scenario("c", (Sample(13, 5), Sample(9, 6)), vocab=10, tp=2, cp=2, layout="zigzag", entropy_coef=0.2,
              temperature=0.9, seed=11)


# The brute-force expectation ---------------------------------------------------------------------

@dataclass
class Truth:
    """One sample, whole: per response token log-prob and entropy, and d loss / d logits
    ``[total, V]`` of the global loss, all float64."""

    log_probs: torch.Tensor
    entropy: torch.Tensor
    grad: torch.Tensor


def _brute_force(sc: Scenario, temperature: float | None = None, entropy_coef: float | None = None) -> list[Truth]:
    """Every sample's truth from its full logits (temperature and entropy_coef overridable, to
    build wrong expectations that must be flagged)."""
    t = sc.temperature if temperature is None else temperature
    coef = sc.entropy_coef if entropy_coef is None else entropy_coef
    data = ScenarioData(sc)
    out = []
    for i, s in enumerate(sc.samples):
        z = data.logit_rows(i, 0, s.total).to(torch.float64).requires_grad_()
        assert z.shape == (s.total, sc.vocab)
        logp = torch.log_softmax(z / t, dim=-1)
        rows = torch.arange(s.prompt - 1, s.total - 1)  # row p predicts token p + 1
        targets = data.tokens(i)[s.prompt:]
        lp = logp[rows].gather(1, targets.unsqueeze(1)).squeeze(1)
        ent = -(logp.exp() * logp).sum(dim=-1)[rows]
        w_lp, w_ent = (w.to(torch.float64) for w in data.loss_weights(i))
        loss = (w_lp * lp).sum() - coef * (w_ent * ent).sum()
        (grad,) = torch.autograd.grad(loss, z)
        out.append(Truth(lp.detach(), ent.detach(), grad))
    return out


def _zigzag_positions(total: int, cp: int, cp_rank: int) -> list[int]:
    """Positions of a sample a zigzag CP rank holds, in local order: chunks r and 2cp - 1 - r of
    ceil(total / 2cp) rows (past ``total``: padding)."""
    k = -(-total // (2 * cp))
    first, second = cp_rank, 2 * cp - 1 - cp_rank
    return list(range(first * k, (first + 1) * k)) + list(range(second * k, (second + 1) * k))


@dataclass
class RankTruth:
    share: list[list[int]]  # per sample, the response tokens the rank returns
    log_probs: list[torch.Tensor]  # float64, per sample
    entropy: list[torch.Tensor]
    grad: torch.Tensor  # float64, the rank's [1, rows, V / tp]
    rows: list[tuple[int, int]]  # (sample, position) of every local row


def _rank_truth(sc: Scenario, truth: list[Truth], tp_rank: int, cp_rank: int) -> RankTruth:
    v = sc.vocab // sc.tp
    cols = slice(tp_rank * v, (tp_rank + 1) * v)
    share, lps, ents, grad_rows, rows = [], [], [], [], []
    for i, (s, t) in enumerate(zip(sc.samples, truth)):
        positions = _zigzag_positions(s.total, sc.cp, cp_rank)
        js = [p - (s.prompt - 1) for p in positions if s.prompt - 1 <= p < s.total - 1]
        share.append(js)
        idx = torch.tensor(js, dtype=torch.int64)
        lps.append(t.log_probs[idx])
        ents.append(t.entropy[idx])
        for p in positions:  # padding rows are in no loss: their gradient is zero
            grad_rows.append(t.grad[p, cols] if p < s.total else torch.zeros(v, dtype=torch.float64))
            rows.append((i, p))
    grad = torch.stack(grad_rows).reshape(1, len(rows), v)
    return RankTruth(share, lps, ents, grad, rows)


def _expected(tp_rank: int, cp_rank: int, **override) -> RankTruth:
    exp = _rank_truth(SC, _brute_force(SC, **override), tp_rank, cp_rank)
    lay = rank_layout(SC, tp_rank, cp_rank)
    # The layout under comparison holds what this file's arithmetic says it holds.
    assert [list(js) for js in lay.share] == exp.share
    assert lay.row_positions() == exp.rows and lay.shape == tuple(exp.grad.shape)
    return exp


def _f32(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.float() for t in ts]


# Tests -------------------------------------------------------------------------------------------

def test_brute_force_rank_truth_is_consistent():
    # Sanity of the expectation itself, from first principles (not from the code under test).
    truth = _brute_force(SC)
    for s, t in zip(SC.samples, truth):
        assert t.log_probs.shape == t.entropy.shape == (s.response,)
        assert (t.log_probs < 0).all() and (t.entropy > 0).all() and (t.entropy <= torch.log(torch.tensor(float(SC.vocab)))).all()
        assert t.grad[: s.prompt - 1].abs().max() == 0 and t.grad[s.total - 1].abs().max() == 0  # unscored rows
        assert t.grad[s.prompt - 1 :].abs().max() > 0
        assert t.grad.sum(dim=-1).abs().max() < 1e-12  # softmax gradients sum to zero over the vocab
    # The shares of the CP ranks partition every response.
    for i, s in enumerate(SC.samples):
        shares = [_rank_truth(SC, truth, 0, r).share[i] for r in range(SC.cp)]
        assert sorted(j for js in shares for j in js) == list(range(s.response))


def test_mismatch_mask_catches_nan_and_respects_tolerance():
    tol = TOLERANCES["float32"]["values"]
    want = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    got = want + torch.tensor([5e-6, float("nan"), 1e-3], dtype=torch.float64)
    assert mismatch_mask(got, want, tol).tolist() == [False, True, True]
    # |got - want| <= atol + rtol * |want|: the relative part scales with |want|; inf fails
    want = torch.tensor([1000.0, 1000.0, 0.0, 1.0], dtype=torch.float64)
    got = want + torch.tensor([5e-3, 2e-2, 9e-6, float("inf")], dtype=torch.float64)
    assert mismatch_mask(got, want, tol).tolist() == [False, True, False, True]
    assert mismatch_mask(torch.tensor([1.1e-5]), torch.tensor([0.0]), tol).tolist() == [True]  # atol alone


def test_true_outputs_pass_and_a_changed_token_is_named():
    data = ScenarioData(SC)
    lay = rank_layout(SC, 1, 1)
    exp = _expected(1, 1)
    # float64 brute force: what compare accepts agrees with it to rounding
    failures, errors = compare_outputs(lay, data, exp.log_probs, exp.entropy, rank=3)
    assert failures == [] and errors["log_probs"] < 1e-12 and errors["entropy"] < 1e-12
    lp, ent = _f32(exp.log_probs), _f32(exp.entropy)
    failures, errors = compare_outputs(lay, data, lp, ent, rank=3)
    assert failures == [] and errors["log_probs"] < 1e-6
    k = 1
    sample = next(i for i, js in enumerate(lay.share) if len(js) > k)
    token = lay.share[sample][k]
    assert (sample, token) == (0, 1)  # sample 0's tokens 0..4 are scored by rows 7..11 of CP rank 1
    ent[sample] = ent[sample].clone()
    ent[sample][k] += 0.01
    failures, _ = compare_outputs(lay, data, lp, ent, rank=3)
    [f] = failures
    assert (f.kind, f.field, f.sample, f.token, f.ranks) == ("value_mismatch", "entropy", sample, token, [3])
    # a changed log-prob is named the same way
    lp2 = [t.clone() for t in lp]
    lp2[1][-1] -= 0.01
    [f] = compare_outputs(lay, data, lp2, _f32(exp.entropy), rank=3)[0]
    assert (f.field, f.sample, f.token) == ("log_probs", 1, lay.share[1][-1])
    assert abs(f.want - exp.log_probs[1][-1].item()) < 1e-12
    # values computed without the temperature are flagged, in both fields
    wrong = _expected(1, 1, temperature=1.0)
    failures, _ = compare_outputs(lay, data, _f32(wrong.log_probs), _f32(wrong.entropy), rank=3)
    assert {f.field for f in failures} == {"log_probs", "entropy"}
    assert all(f.kind == "value_mismatch" for f in failures)


def test_structure_problems_are_value_mismatches():
    data = ScenarioData(SC)
    lay = rank_layout(SC, 0, 0)
    exp = _expected(0, 0)
    assert exp.share == [[], [0]]  # CP rank 0 scores no token of sample 0
    lp, ent = _f32(exp.log_probs), _f32(exp.entropy)
    assert compare_outputs(lay, data, lp, ent, rank=0)[0] == []
    ent[1] = None
    [f] = compare_outputs(lay, data, lp, ent, rank=0)[0]
    assert f.kind == "value_mismatch" and f.sample == 1 and "is None" in f.message
    [f] = compare_outputs(lay, data, lp[:1], _f32(exp.entropy), rank=0)[0]
    assert "1 entries for 2 samples" in f.message
    # one element too many for the empty share of sample 0
    [f] = compare_outputs(lay, data, [torch.zeros(1), lp[1]], _f32(exp.entropy), rank=0)[0]
    assert f.kind == "value_mismatch" and f.sample == 0 and "expected (0,)" in f.message


def test_true_gradient_passes_and_a_changed_element_is_named():
    data = ScenarioData(SC)
    lay = rank_layout(SC, 1, 0)
    exp = _expected(1, 0)
    failures, errors = compare_grad(lay, data, exp.grad, rank=1)  # float64: agrees to rounding
    assert failures == [] and errors["grad"] < 1e-12
    grad = exp.grad.float()
    failures, errors = compare_grad(lay, data, grad, rank=1)
    assert failures == [] and errors["grad"] < 1e-6
    rows = lay.row_positions()
    row = next(r for r, (s, p) in enumerate(rows) if lay.scored_token(s, p) is not None)
    stream, pos = rows[row]
    assert (row, stream, pos) == (10, 1, 2)  # CP rank 0 scores no token of sample 0; sample 1's position 2
    flat = grad.reshape(lay.num_rows, -1)
    flat[row, 2] += 0.01
    [f] = compare_grad(lay, data, grad, rank=1)[0]
    assert (f.kind, f.sample, f.token, f.column) == ("grad_mismatch", stream, lay.scored_token(stream, pos),
                                                     lay.columns[0] + 2)
    assert f.column == 7 and f.token == 0 and abs(f.want - exp.grad[0, row, 2].item()) < 1e-12
    # wrong gradients are flagged: no entropy term, not divided by the temperature, the other
    # TP rank's columns
    for wrong in (_expected(1, 0, entropy_coef=0.0).grad, exp.grad * SC.temperature, _expected(0, 0).grad):
        failures, _ = compare_grad(lay, data, wrong.float(), rank=1)
        assert failures and all(f.kind == "grad_mismatch" for f in failures)


def test_gradient_on_a_padding_row_is_named_as_padding():
    data = ScenarioData(SC)
    lay = rank_layout(SC, 0, 0)  # chunk 3 of sample 0 holds positions 12..15, 13..15 padding
    exp = _expected(0, 0)
    assert exp.rows[:8] == [(0, p) for p in (0, 1, 2, 3, 12, 13, 14, 15)]
    assert exp.grad[0, 5:8].abs().max() == 0  # padding rows carry no gradient
    grad = exp.grad.float()
    assert compare_grad(lay, data, grad, rank=0)[0] == []
    rows = lay.row_positions()
    row = next(r for r, (s, p) in enumerate(rows) if p >= SC.samples[s].total)
    assert (row, rows[row]) == (5, (0, 13))
    grad.reshape(lay.num_rows, -1)[row, 0] = 0.5
    [f] = compare_grad(lay, data, grad, rank=0)[0]
    assert "padding row" in f.message and f.token is None
    assert (f.sample, f.position, f.column) == (0, 13, 0)
    # a gradient on a prompt row (scores no response token) is named as unscored
    grad = exp.grad.float()
    grad.reshape(lay.num_rows, -1)[0, 1] = -0.5
    [f] = compare_grad(lay, data, grad, rank=0)[0]
    assert "unscored row 0" in f.message and f.token is None and f.sample == 0


# -- how values read in a message (issue 23, item 5) -------------------------------------------------
def _float32_after(x: float, steps: int) -> float:
    """The float32 ``steps`` places above ``x``, stepped by numpy (not by the code under test)."""
    import numpy as np

    v = np.float32(x)
    for _ in range(steps):
        v = np.nextafter(v, np.float32(np.inf))
    return float(v)


def test_values_that_differ_by_one_ulp_read_differently_and_say_how_far_apart():
    import numpy as np

    from shardcheck.harness.rank.checks.compare import apart

    for x in (-0.79949, -0.70568, 1.0, 3.0e-7, 12345.678):
        was, now = float(np.float32(x)), _float32_after(x, 1)
        a, b, gap = apart(torch.tensor(was), torch.tensor(now), torch.float32)
        assert a != b and gap == " (1 ulp of float32)", (a, b, gap)
        # each reads back as exactly its own float32: the digits shown are enough
        assert np.float32(float(a)) == np.float32(was) and np.float32(float(b)) == np.float32(now)
    a, b, gap = apart(torch.tensor(1.0), torch.tensor(_float32_after(1.0, 5)), torch.float32)
    assert gap == " (5 ulps of float32)"
    # bfloat16: 1.0 and the next bfloat16, 2**-7 above
    a, b, gap = apart(torch.tensor(1.0, dtype=torch.bfloat16), torch.tensor(1.0078125, dtype=torch.bfloat16),
                      torch.bfloat16)
    assert (a, gap) == ("1", " (1 ulp of bfloat16)") and torch.tensor(float(b)).bfloat16().item() == 1.0078125
    # the same number with another sign bit, and NaNs that differ only in their payload
    assert apart(torch.tensor(0.0), torch.tensor(-0.0), torch.float32)[2] == " (the same number, the sign bit differs)"
    # a float16 entropy against the float64 reference: equal once rounded is not a sign bit (said so before)
    gap = apart(torch.tensor(0.5, dtype=torch.float16), 0.500011, torch.float16)[2]
    assert gap == " (one value once rounded to float16: they differ below its precision)", gap
    nans = torch.tensor([0x7FC00000, 0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert apart(nans[0], nans[1], torch.float32)[:2] == ("nan (bits 0x7fc00000)", "nan (bits 0x7fc00001)")


def test_ulp_distance_agrees_with_the_invariance_checks_own():
    from shardcheck.harness.controller.commands.invariance import ulp_distance as controller_ulps
    from shardcheck.harness.rank.checks.compare import ulp_distance

    g = torch.Generator().manual_seed(3)
    a = torch.randn(200, generator=g)
    b = a + torch.randn(200, generator=g) * 1e-6
    b[:20] = -b[:20]  # across zero too
    want = controller_ulps(a, b)
    assert [ulp_distance(x, y, torch.float32) for x, y in zip(a, b)] == want.tolist()


def test_a_value_mismatch_says_how_many_ulps_off_in_the_outputs_dtype():
    from shardcheck.harness.controller.commands.invariance import ulp_distance as controller_ulps

    data = ScenarioData(SC)
    lay = rank_layout(SC, 1, 1)
    exp = _expected(1, 1)
    lp, ent = _f32(exp.log_probs), _f32(exp.entropy)
    ent[0] = ent[0].clone()
    ent[0][1] += 0.01
    [f] = compare_outputs(lay, data, lp, ent, rank=3)[0]
    steps = int(controller_ulps(torch.tensor([f.got], dtype=torch.float32), torch.tensor([f.want]).float()))
    assert f.message.endswith(f"({steps} ulps of float32)"), f.message


# -- end to end: the same checks through a run on the session's world (issue 26) -------------------
def _run_sc(world, target: str):
    """SC (tp 2 x cp 2: the world's four ranks) run once through the harness: its verdict."""
    from shardcheck.harness.controller.commands import runner
    from shardcheck.harness.controller.reports.run_report import SilentReport

    [verdict] = runner.run([SC], target, reporter=SilentReport(), world=world).verdicts
    return verdict


@pytest.mark.world
def test_builtin_passes_the_scenario_the_plants_below_fail(world):
    v = _run_sc(world, "builtin")
    assert v.status == "pass", [f.message for f in v.failures]


@pytest.mark.world
def test_a_nan_log_prob_and_a_nan_gradient_fail_on_a_world(world):
    v = _run_sc(world, "plants:NanLogProbAndGrad")
    by_field = {f.field: f for f in v.failures}
    assert sorted(by_field) == ["grad", "log_probs"], [f.message for f in v.failures]
    lp, grad = by_field["log_probs"], by_field["grad"]
    assert (lp.kind, lp.sample, lp.token) == ("value_mismatch", 1, 3) and math.isnan(lp.got)
    assert lp.message.startswith("log_probs sample 1 token 3: got nan, want "), lp.message
    assert (grad.kind, grad.sample, grad.token, grad.column) == ("grad_mismatch", 1, 3, 5) and math.isnan(grad.got)
    assert grad.message.startswith("grad sample 1 token 3 column 5: got nan, want "), grad.message


@pytest.mark.world
def test_a_wrong_last_token_of_the_last_sample_fails_on_a_world(world):
    last = len(SC.samples) - 1
    token = SC.samples[last].response - 1
    # the zigzag share holding it ends with it: the last element a rank compares
    assert rank_layout(SC, 0, 1).share[last][-1] == token
    v = _run_sc(world, "plants:CorruptLastToken")
    assert [(f.kind, f.field, f.sample, f.token) for f in v.failures] == [
        ("value_mismatch", "log_probs", last, token)], [f.message for f in v.failures]
    [f] = v.failures
    assert f.message.startswith(f"log_probs sample {last} token {token}: got ") and abs(f.got - f.want - 0.5) < 1e-4
