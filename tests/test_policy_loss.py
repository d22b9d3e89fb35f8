"""The "policy" loss form: a target that computes its own policy loss gets the advantages, old
log-probs and loss masks, and the harness checks its loss value and its gradient."""

import pytest
import torch

from shardcheck.harness.controller.commands import runner
from shardcheck.harness.rank.life import shard
from shardcheck.harness.controller.reports.run_report import SilentReport
from shardcheck.scenarios.layout import rank_layout
from shardcheck.scenarios import Sample, Scenario, get_suite
from shardcheck.scenarios.data import ScenarioData

LAYOUTS = [("thd", 2, 1), ("bshd", 1, 1), ("zigzag", 2, 2), ("allgather", 1, 4)]


def _scenarios() -> list[Scenario]:
    samples = (Sample(23, 9), Sample(40, 2), Sample(9, 1), Sample(14, 6))
    return [Scenario(f"{layout}-tp{tp}cp{cp}", samples, vocab=16, tp=tp, cp=cp, layout=layout,
                     entropy_coef=coef, seed=11 + i)
            for i, (layout, tp, cp) in enumerate(LAYOUTS) for coef in (0.0, 0.1)
            if not (coef == 0.0 and layout == "bshd")]


def test_policy_weights_are_the_gradient_of_the_ppo_loss_at_ratio_one():
    """w_lp = -A m / D and w_ent = m / D, D = max(sum m, 1): checked by autograd on a PPO loss."""
    sc = Scenario("w", (Sample(30, 20), Sample(5, 1)), vocab=8)
    data = ScenarioData(sc, loss="policy")
    for i, s in enumerate(sc.samples):
        mask = data.loss_mask(i)
        assert mask.dtype == torch.int32 and set(mask.tolist()) <= {0, 1}
        logp = torch.randn(s.response, dtype=torch.float64, requires_grad=True)
        ent = torch.rand(s.response, dtype=torch.float64, requires_grad=True)
        ratio = (logp - logp.detach()).exp()
        m, adv = mask.double(), data.advantages(i).double()
        d = m.sum().clamp_min(1)
        loss = (-adv * ratio * m).sum() / d - 0.3 * (ent * m).sum() / d
        loss.backward()
        w_lp, w_ent = data.loss_weights(i)
        assert torch.allclose(logp.grad, w_lp.double(), atol=1e-7)
        assert torch.allclose(ent.grad, -0.3 * w_ent.double(), atol=1e-7)
    assert 0 < int(data.loss_mask(0).sum()) < 20, "some tokens masked, not all"


def _brute_force_log_probs(data: ScenarioData, sample: int, share: tuple[int, ...]) -> torch.Tensor:
    """The log-probs of a sample's response tokens ``share``, one row at a time in float64:
    row prompt - 1 + j scores token prompt + j."""
    s = data.scenario.samples[sample]
    rows = data.logit_rows(sample, 0, s.total).double() / data.scenario.temperature
    tokens = data.tokens(sample)
    return torch.tensor([torch.log_softmax(rows[s.prompt - 1 + j], dim=0)[tokens[s.prompt + j]].item()
                         for j in share], dtype=torch.float64)


# zigzag, cp 2: sample 0 (23 tokens, 9 scored) in chunks of 6 rows, sample 1 (40, 2) in chunks of
# 10; a rank holds chunks r and 3 - r, and scores the response rows among them
SHARES_BY_CP_RANK = {0: ((5, 6, 7, 8), (0, 1)), 1: ((0, 1, 2, 3, 4), ())}


@pytest.mark.parametrize("cp_rank", [0, 1])
def test_policy_batch_holds_the_share_and_the_truth(cp_rank):
    # temperature not 1, so old log-probs taken from unscaled logits differ from the truth
    sc = Scenario("b", (Sample(23, 9), Sample(40, 2)), vocab=16, cp=2, layout="zigzag",
                  temperature=0.7, seed=3)
    data = ScenarioData(sc, loss="policy")
    layout = rank_layout(sc, 0, cp_rank)
    share = SHARES_BY_CP_RANK[cp_rank]
    assert layout.share == share
    batch = shard.policy_batch(data, layout)
    assert [lp.dtype for lp in batch.old_log_probs] == [torch.float32, torch.float32]
    for i, js in enumerate(share):
        # float32 old log-probs of a float64 truth: a rounding apart, no more
        torch.testing.assert_close(batch.old_log_probs[i].double(), _brute_force_log_probs(data, i, js),
                                   rtol=1e-6, atol=1e-6)
        assert torch.equal(batch.advantages[i], data.advantages(i)[list(js)])
        assert torch.equal(batch.loss_masks[i], data.loss_mask(i))
    assert [m.numel() for m in batch.loss_masks] == [9, 2]


def _run(world, target, scenarios):
    return runner.run(scenarios, target, reporter=SilentReport(), world=world)


@pytest.mark.world
def test_a_correct_policy_loss_passes(world):
    result = _run(world, "plants:PolicyLoss", _scenarios() + get_suite("regressions"))
    assert result.exit_code == 0, [v.headline() for v in result.verdicts if v.status != "pass"]


@pytest.mark.world
def test_a_local_denominator_is_caught_under_cp_only(world):
    result = _run(world, "plants:PolicyLossLocalDenominator", _scenarios())
    by_name = {v.scenario.name: v for v in result.verdicts}
    for name, v in by_name.items():
        if v.scenario.cp == 1:
            assert v.status == "pass", v.headline()
        else:
            fields = {f.field for f in v.failures}
            assert {"loss", "grad"} <= fields, (name, fields)


@pytest.mark.world
def test_a_wrong_loss_value_is_caught_with_a_right_gradient(world):
    sc = _scenarios()[1]
    [v] = _run(world, "plants:PolicyLossOffset", [sc]).verdicts
    assert v.status == "fail"
    assert {f.field for f in v.failures} == {"loss"}, [f.message for f in v.failures]
    assert "loss: got" in v.failures[0].message


@pytest.mark.world
def test_a_loss_that_is_not_a_scalar_is_reported_without_a_hang(world):
    sc = _scenarios()[4]  # zigzag tp2 cp2: peers still run the backward collectives
    [v] = _run(world, "plants:PolicyLossNotScalar", [sc]).verdicts
    assert v.status == "fail"
    assert any(f.field == "loss" and "expected a scalar" in f.message for f in v.failures)
    assert all(f.kind != "collective_mismatch" for f in v.failures)
