"""The comparison against the reference, without processes: the reference's own outputs pass;
a one-element change fails and is named by sample, token and column."""

import torch

from shardcheck.harness.rank import shard
from shardcheck.harness.rank.compare import TOLERANCES, compare_grad, compare_outputs, mismatch_mask
from shardcheck.harness.layout import rank_layout
from shardcheck.reference import logprob_entropy, loss_grad_chunks
from shardcheck.scenarios import Sample, Scenario
from shardcheck.scenarios.data import ScenarioData

SC = Scenario("c", (Sample(13, 5), Sample(9, 6)), vocab=10, tp=2, cp=2, layout="zigzag", entropy_coef=0.2,
              temperature=0.9, seed=11)


def _true_outputs(lay, data):
    lp, ent = logprob_entropy(shard.PieceRows(data, shard.share_pieces(lay)), shard.share_targets(data, lay),
                              temperature=SC.temperature)
    sizes = [len(js) for js in lay.share]
    return list(lp.float().split(sizes)), list(ent.float().split(sizes))


def _true_grad(lay, data):
    targets, w_lp, w_ent = shard.row_targets_and_weights(data, lay)
    chunks = loss_grad_chunks(shard.PieceRows(data, lay.pieces), targets, w_lp, w_ent, entropy_coef=SC.entropy_coef,
                              temperature=SC.temperature, columns=slice(*lay.columns))
    return torch.cat([g for _, g in chunks]).float().reshape(lay.shape)


def test_mismatch_mask_catches_nan_and_respects_tolerance():
    tol = TOLERANCES["float32"]["values"]
    want = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    got = want + torch.tensor([5e-6, float("nan"), 1e-3], dtype=torch.float64)
    assert mismatch_mask(got, want, tol).tolist() == [False, True, True]


def test_true_outputs_pass_and_a_changed_token_is_named():
    data = ScenarioData(SC)
    lay = rank_layout(SC, 1, 1)
    lp, ent = _true_outputs(lay, data)
    failures, errors = compare_outputs(lay, data, lp, ent, rank=3)
    assert failures == [] and errors["log_probs"] < 1e-6
    k = 1
    sample = next(i for i, js in enumerate(lay.share) if len(js) > k)
    token = lay.share[sample][k]
    ent[sample] = ent[sample].clone()
    ent[sample][k] += 0.01
    failures, _ = compare_outputs(lay, data, lp, ent, rank=3)
    [f] = failures
    assert (f.kind, f.field, f.sample, f.token, f.ranks) == ("value_mismatch", "entropy", sample, token, [3])


def test_structure_problems_are_value_mismatches():
    data = ScenarioData(SC)
    lay = rank_layout(SC, 0, 0)
    lp, ent = _true_outputs(lay, data)
    ent[1] = None
    [f] = compare_outputs(lay, data, lp, ent, rank=0)[0]
    assert f.kind == "value_mismatch" and f.sample == 1 and "is None" in f.message
    [f] = compare_outputs(lay, data, lp[:1], _true_outputs(lay, data)[1], rank=0)[0]
    assert "1 entries for 2 samples" in f.message


def test_true_gradient_passes_and_a_changed_element_is_named():
    data = ScenarioData(SC)
    lay = rank_layout(SC, 1, 0)
    grad = _true_grad(lay, data)
    failures, errors = compare_grad(lay, data, grad, rank=1)
    assert failures == [] and errors["grad"] < 1e-6
    rows = lay.row_positions()
    row = next(r for r, (s, p) in enumerate(rows) if lay.scored_token(s, p) is not None)
    stream, pos = rows[row]
    flat = grad.reshape(lay.num_rows, -1)
    flat[row, 2] += 0.01
    [f] = compare_grad(lay, data, grad, rank=1)[0]
    assert (f.kind, f.sample, f.token, f.column) == ("grad_mismatch", stream, lay.scored_token(stream, pos),
                                                     lay.columns[0] + 2)


def test_gradient_on_a_padding_row_is_named_as_padding():
    data = ScenarioData(SC)
    lay = rank_layout(SC, 0, 0)  # chunk 3 of sample 0 holds positions 12..15, 13..15 padding
    grad = _true_grad(lay, data)
    rows = lay.row_positions()
    row = next(r for r, (s, p) in enumerate(rows) if p >= SC.samples[s].total)
    grad.reshape(lay.num_rows, -1)[row, 0] = 0.5
    [f] = compare_grad(lay, data, grad, rank=0)[0]
    assert "padding row" in f.message and f.token is None
