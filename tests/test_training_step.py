"""The training step (issue 36): a global batch over data-parallel replicas and micro-batches,
megatron-core's schedule and DDP around a target's loss, and the gradient the optimizer sees
compared with the declared objective over the whole global batch.

The split rules and the objective's weights are checked against expectations written out by hand
or computed by autograd from the objective's definition; the planted bugs of the builtin's loss
(targets/builtin_loss.py) are each caught with the factor they scale by, on a real 4-rank world."""

import pytest
import torch

from shardcheck.errors import BadInput
from shardcheck.harness.controller.commands import runner
from shardcheck.harness.controller.reports.run_report import SilentReport
from shardcheck.harness.rank.checks.compare import Tolerance, clean_factor, factor_names, scale_of
from shardcheck.scenarios import Sample, Scenario, get_suite
from shardcheck.scenarios.data import ScenarioData


def _sc(n: int = 8, **kw) -> Scenario:
    return Scenario("s", [Sample(5 + i, 2) for i in range(n)], vocab=8, **kw)


# -- the split ------------------------------------------------------------------------------------
def test_a_fixed_micro_batch_size_follows_megatrons_sampler():
    """micro-batch k of replica r: samples [k*mbs*dp + r*mbs, +mbs)."""
    sc = _sc(12, dp=2, micro_batch_size=2)
    assert sc.micro_batches(0) == [(0, 1), (4, 5), (8, 9)]
    assert sc.micro_batches(1) == [(2, 3), (6, 7), (10, 11)]
    one = _sc(6, dp=3)  # no size: one micro-batch, a contiguous block each
    assert [one.micro_batches(r) for r in range(3)] == [[(0, 1)], [(2, 3)], [(4, 5)]]


def test_a_token_budget_packs_in_order_and_every_replica_runs_as_many_micro_batches():
    totals = [5, 9, 4, 6, 3, 3]
    sc = Scenario("t", [Sample(t, 1) for t in totals], vocab=8, dp=2, micro_batch_tokens=10)
    # replica 0 (5, 9, 4): 5 | 9 | 4, three; replica 1 (6, 3, 3): 6+3 | 3, two, so its fuller
    # micro-batch (6+3) is split in two
    assert sc.micro_batches(0) == [(0,), (1,), (2,)]
    assert sc.micro_batches(1) == [(3,), (4,), (5,)]
    packed = Scenario("p", [Sample(t, 1) for t in (4, 4, 4, 4)], vocab=8, micro_batch_tokens=9)
    assert packed.micro_batches(0) == [(0, 1), (2, 3)]


def test_a_micro_batch_keeps_its_samples_data():
    sc = _sc(4, dp=2, micro_batch_size=1, seed=7)
    mb = sc.micro_batch((2,))
    assert (mb.dp, mb.micro_batch_size, len(mb.samples)) == (1, 0, 1)
    whole, part = ScenarioData(sc, loss="policy"), ScenarioData(mb, loss="policy")
    assert torch.equal(whole.tokens(2), part.tokens(0))
    assert torch.equal(whole.logit_rows(2, 0, 7), part.logit_rows(0, 0, 7))
    assert torch.equal(whole.loss_mask(2), part.loss_mask(0)) and torch.equal(whole.advantages(2), part.advantages(0))


@pytest.mark.parametrize("kw, fragment", [
    (dict(dp=3), "8 samples cannot be split evenly over dp 3"),
    (dict(dp=0), "dp must be >= 1"),
    (dict(dp=2, micro_batch_size=3), "a replica's 4 samples cannot be split into micro-batches of 3"),
    (dict(micro_batch_size=1, micro_batch_tokens=20), "give one"),
    (dict(micro_batch_tokens=6), "a sample of 12 tokens does not fit micro_batch_tokens 6"),
    (dict(dp="2"), "dp must be an integer"),
])
def test_a_step_that_cannot_be_split_is_refused_in_one_line(kw, fragment):
    with pytest.raises(BadInput) as err:
        _sc(**kw)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_a_step_scenario_round_trips_and_a_plain_one_keeps_its_json():
    sc = _sc(4, dp=2, micro_batch_size=1)
    assert Scenario.from_json(sc.to_json()) == sc and sc.ranks == 2 and sc.step
    assert not {"dp", "micro_batch_size", "micro_batch_tokens"} & set(_sc(4).to_dict())


# -- the objective ------------------------------------------------------------------------------
@pytest.mark.parametrize("objective", ["sample_mean", "token_mean"])
def test_the_objectives_weights_are_the_gradient_of_the_global_loss(objective):
    """The global PPO loss at ratio 1, written from its definition and differentiated by autograd:
    sample_mean averages each sample's masked token mean, token_mean divides every masked-in term
    by the masked-in tokens of the whole batch."""
    sc = Scenario("o", [Sample(30, 20), Sample(6, 1), Sample(12, 9), Sample(9, 3)], vocab=8, seed=5)
    data = ScenarioData(sc, loss="step", objective=objective)
    logps = [torch.randn(s.response, dtype=torch.float64, requires_grad=True) for s in sc.samples]
    ents = [torch.rand(s.response, dtype=torch.float64, requires_grad=True) for s in sc.samples]
    masks = [data.loss_mask(i).double() for i in range(4)]
    advs = [data.advantages(i).double() for i in range(4)]
    terms = [(-a * (lp - lp.detach()).exp() * m) - 0.3 * e * m for lp, e, m, a in zip(logps, ents, masks, advs)]
    if objective == "token_mean":
        loss = sum(t.sum() for t in terms) / sum(m.sum() for m in masks)
    else:
        loss = sum(t.sum() / m.sum().clamp_min(1) for t, m in zip(terms, masks)) / 4
    loss.backward()
    assert 0 < sum(int(m.sum()) for m in masks) < sum(s.response for s in sc.samples), "some tokens masked"
    for i in range(4):
        w_lp, w_ent = data.loss_weights(i)
        assert torch.allclose(logps[i].grad, w_lp.double(), atol=1e-7)
        assert torch.allclose(ents[i].grad, -0.3 * w_ent.double(), atol=1e-7)


def test_a_factor_is_named_by_the_steps_sizes():
    want = torch.tensor([[1.0, -2.0], [0.5, 3.0]], dtype=torch.float64)
    tol = Tolerance(1e-6, 1e-4)
    assert clean_factor(want * 0.25, want, tol) == pytest.approx(0.25)
    assert clean_factor(want * torch.tensor([[1.0, 1.0], [2.0, 2.0]]), want, tol) is None
    assert clean_factor(want * float("nan"), want, tol) is None
    # a scale beside a small rest (a bfloat16 rounding) is still found, with the rest; none beyond 2 %
    rounded = want * 0.5 * torch.tensor([[1.0, 1.001], [0.999, 1.0]], dtype=torch.float64)
    factor, rest = scale_of(rounded, want)
    assert factor == pytest.approx(0.5, rel=1e-3) and 0 < rest < 2e-3 and clean_factor(rounded, want, tol) is None
    assert scale_of(want * torch.tensor([[1.0, 1.1], [1.0, 1.0]], dtype=torch.float64), want) is None
    sizes = {"cp_size": 4, "dp_size": 1, "tp_size": 1, "micro_batches": 2}
    assert factor_names(0.25, sizes) == "1 / cp"
    assert factor_names(2.0, sizes) == "num_microbatches"
    assert factor_names(3.0, sizes) == ""
    assert factor_names(8.0, {"cp_size": 2, "dp_size": 4}) == "dp x cp"


# -- on a world -----------------------------------------------------------------------------------
def _run(world, target, scenarios):
    return runner.run(scenarios, target, reporter=SilentReport(), world=world)


def _training(*names):
    suite = {sc.name: sc for sc in get_suite("training")}
    return [suite[n] for n in names] if names else list(suite.values())


@pytest.mark.world
@pytest.mark.parametrize("target", ["builtin:loss", "builtin:loss_token_mean"])
def test_the_builtins_loss_passes_the_training_suite(world, target):
    result = _run(world, target, _training())
    assert result.exit_code == 0, [v.headline() for v in result.verdicts if v.status != "pass"]
    described = result.info.target
    assert described["training_step"]["schedule"].endswith("forward_backward_no_pipelining")
    assert described["training_step"]["logged_loss"] == "compared with the objective's value over the global batch"
    assert "objective" in described["definitions"]


@pytest.mark.world
def test_a_logged_loss_that_is_not_all_reduced_over_the_replicas_is_caught(world):
    """The loss a framework logs is checked against the objective's value over the global batch:
    one that logs its own replica's mean (the all-reduce left out) is a value_mismatch of
    logged_loss, and its gradient, a separate path, still passes."""
    [v] = _run(world, "builtin:loss_logged_unreduced", _training("step-thd-dp2-mb3")).verdicts
    assert v.status == "fail" and v.kinds == ["value_mismatch"], v.headline()
    assert {f.field for f in v.failures} == {"logged_loss"}, [f.message for f in v.failures]
    assert v.failures[0].message.startswith("logged_loss: got "), v.failures[0].message


@pytest.mark.world
def test_a_loss_that_counts_the_global_batch_from_the_step_inputs_passes(world):
    """StepInputs' loss masks and replica samples are the global batch's: a token mean counted
    from them (megatron's two-value form) is the declared objective, and one that counts only its
    own replica is not."""
    scenarios = _training("step-thd-dp2-mb3", "step-zigzag-dp2cp2-mb2", "step-allgather-cp2tp2-mb3", "step-thd-dp4")
    result = _run(world, "builtin:loss_global_count", scenarios)
    assert result.exit_code == 0, [v.headline() for v in result.verdicts if v.status != "pass"]
    [v] = _run(world, "builtin:loss_count_per_replica", _training("step-thd-dp2-mb3")).verdicts
    assert v.status == "fail" and v.kinds == ["grad_mismatch"], v.headline()
    assert "off by no one factor" in v.failures[0].message


# (mutant, scenario, what the step's gradient is said to be off by)
PLANTED = [
    ("loss_cp_missing", "step-zigzag-cp4-mb2", "x 0.250 the reference's on every row (= 1 / cp)"),
    ("loss_cp_twice", "step-zigzag-cp4-mb2", "x 4.000 the reference's on every row (= cp)"),
    ("loss_microbatches_missing", "step-thd-dp2-mb3", "x 0.333 the reference's on every row (= 1 / num_microbatches)"),
    ("loss_count_per_microbatch", "step-thd-dp2-mb3", "off by no one factor"),
    ("loss_sample_mean_as_token_mean", "step-zigzag-tp2cp2-mb3", "off by no one factor"),
]


@pytest.mark.world
@pytest.mark.parametrize("variant, scenario, said", PLANTED, ids=[p[0] for p in PLANTED])
def test_each_planted_scale_bug_is_caught_with_its_factor(world, variant, scenario, said):
    [v] = _run(world, f"builtin:{variant}", _training(scenario)).verdicts
    assert v.status == "fail"
    head = v.failures[0]
    assert head.kind == "grad_mismatch" and said in head.message, head.message
    assert {f.kind for f in v.failures} == {"grad_mismatch"}, [f.message for f in v.failures]


@pytest.mark.world
def test_a_mask_that_multiplies_lets_nan_at_a_masked_position_into_the_loss(world):
    """x * mask where the mask should select: NaN at the masked positions (the logits' prompt,
    padding and masked-token rows, the masked tokens' advantages and old log-probs) reaches the
    loss, through each of the three inputs; the builtin's select passes (the training suite)."""
    [v] = _run(world, "builtin:loss_mask_multiplied", _training("step-zigzag-dp2cp2-mb2")).verdicts
    assert v.status == "fail" and v.kinds == ["mask_leak"], v.headline()
    head = v.failures[0]
    assert head.message.startswith("NaN at the masked positions of the logits and advantages and old_log_probs "
                                   "reached the loss of micro-batch "), head.message
    assert " in the clean run, nan with NaN at the masked positions" in head.message


@pytest.mark.world
def test_the_mask_leak_check_can_be_turned_off_and_the_report_says_so(world):
    result = runner.run(_training("step-thd-dp4"), "builtin:loss_mask_multiplied", reporter=SilentReport(),
                        world=world, mask_leak=False)
    assert result.exit_code == 0 and result.info.mask_leak is False


@pytest.mark.world
def test_a_loss_that_misses_its_logits_is_a_hang_between_the_models_backward_and_the_gradient_sync(world):
    """A rank whose loss does not reach its logits (an empty CP share) skips the model's CP
    collective in backward and goes on to DDP's gradient all-reduce: the lockstep names both sides,
    the gradient sync as such (not as forward)."""
    sc = Scenario("misses", [Sample(61, 3), Sample(40, 2)], vocab=16, dp=2, cp=2, layout="zigzag")
    [v] = _run(world, "plants:StepLossMissesLogits", [sc]).verdicts
    assert v.status == "fail" and v.kinds == ["collective_mismatch"], v.headline()
    message = v.failures[0].message
    assert "in backward" in message and "in gradient sync at megatron/core/distributed/" in message, message


@pytest.mark.world
def test_a_bug_the_step_cancels_passes_where_its_factor_is_one(world):
    """The CP factor missing is no bug at cp 1 (the factor is 1): the check is not a blanket fail."""
    result = _run(world, "builtin:loss_cp_missing", _training("step-thd-dp2-mb3", "step-thd-dp4"))
    assert result.exit_code == 0, [v.headline() for v in result.verdicts]


@pytest.mark.world
def test_a_target_whose_loss_is_not_a_steps_skips_a_step_with_the_reason(world2):
    result = _run(world2, "builtin", _training("step-thd-dp2-mb3") + [_sc(4, dp=2)])
    reasons = [v.reason for v in result.verdicts]
    assert [v.status for v in result.verdicts] == ["skip", "skip"]
    assert all("a training step (dp 2, " in r and "builtin's loss is not one" in r for r in reasons), reasons


@pytest.mark.world
def test_a_step_larger_than_the_world_is_skipped_naming_dp(world2):
    [v] = _run(world2, "builtin:loss", _training("step-thd-dp4")).verdicts
    assert v.status == "skip" and "needs dp*tp*cp=4 ranks to divide the world size 2" in v.reason
