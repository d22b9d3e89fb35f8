"""radixark/miles's loss_function in a training step (``miles:loss``, targets/miles_loss.py).

With a checkout at ci/frameworks.toml's pin (SHARDCHECK_MILES_SRC), the training suite's 9 steps run
in megatron-core's schedule and DDP: every gradient has the declared sample mean's scale and differs
only by the bfloat16 rounding of megatron-core's fused cross entropy (docs/miles.md), and the mask-leak
check finds NaN at masked logits reaching the loss. With SHARDCHECK_MILES_REPO (its history), #683's
parent hangs the model's CP backward and the fix does not. Each test skips without its checkout.

Over 20 s: about 23 s in all on a quiet 2-core machine with both variables set (four CLI processes, each
starting a world: the training suite, one step, and #683's parent and fix, each exported from the
history); without them, well under a second."""

from __future__ import annotations

import json
import os

import pytest

from conftest import export_commit, run_cli

SPEC = "miles:loss"
ENV = "SHARDCHECK_MILES_SRC"
REPO_ENV = "SHARDCHECK_MILES_REPO"
MILES_SRC = os.environ.get(ENV)
needs_miles = pytest.mark.skipif(not MILES_SRC, reason=f"{ENV} is not set: no miles checkout (radixark/miles at "
                                 "ci/frameworks.toml's pin) to check")
needs_history = pytest.mark.skipif(not os.environ.get(REPO_ENV), reason=f"{REPO_ENV} is not set: no miles git "
                                   "repository with its history (a clone of radixark/miles) to export #683 from")

# #683 (dee60c813, "[GLM-5] fix CP hanging issue through adding dummy loss for autograd"): under
# all-gather CP, a CP rank whose contiguous chunk holds no response row (prompt and get_batch's padding
# to cp * tp * 128) rebuilt its responses from a fresh zeros(requires_grad=True): its loss missed its
# logits, so the model's CP collective in backward ran on the other rank alone. The smallest scenario:
FIX_683 = "dee60c813b79589d4e5cf7eec7a472a0befb557f"
PROMPT_RANK = {"name": "ag-cp2-prompt-rank-683", "layout": "allgather", "cp": 2, "samples": [[4, 2]], "vocab": 8,
               "entropy_coef": 0.0, "with_entropy": False, "seed": 1}


def test_a_folder_that_is_not_a_miles_checkout_is_one_line(tmp_path):
    from shardcheck.errors import BadInput
    from shardcheck.targets.base import TargetConfig
    from shardcheck.targets.frameworks import miles_target

    with pytest.raises(BadInput) as exc:
        miles_target("loss", TargetConfig(str(tmp_path)))
    assert "miles" in str(exc.value) and "\n" not in str(exc.value)


@needs_miles
def test_miles_loss_function_in_the_training_step_is_off_only_by_the_bfloat16_rounding(tmp_path):
    """9 steps (dp x tp x cp = 4, 1 to 3 micro-batches, every layout), the mask-leak check off: each
    gradient is the declared sample mean's within megatron-core's bfloat16 rounding of the
    cross entropy's gradient (0.2% at most; the bfloat16 scenario passes), every value matches."""
    report = tmp_path / "r.json"
    proc = run_cli("run", "--target", SPEC, "--target-src", MILES_SRC, "--suite", "training", "--no-mask-leak",
                   "--json-report", str(report))
    doc = json.loads(report.read_text())
    verdicts = doc["scenarios"]
    assert len(verdicts) == 9 and not [v for v in verdicts if v["verdict"] == "skip"], proc.stdout[-3000:]
    for v in verdicts:
        expected = [[]] if v["scenario"]["dtype"] == "bfloat16" else [["grad_mismatch"]]
        assert v["kinds"] in expected, (v["name"], v["kinds"])
        assert v["max_error"]["log_probs"] < 1e-5 and v["max_error"].get("entropy", 0) < 1e-5, v["name"]
        assert v["max_error"]["step_grad"] < 1e-3, (v["name"], v["max_error"])
    assert "differ by up to 0.20%" in proc.stdout, proc.stdout[-3000:]
    assert "calculate_per_token_loss=false" in doc["target"]["definitions"]["objective"]


@needs_miles
def test_nan_at_masked_logits_reaches_miles_loss(tmp_path):
    """Latent at the pin: the entropy term's (x * loss_mask).sum() (cp_utils.get_sum_of_sample_mean)
    and loss + 0 * logits.sum() let NaN at a masked logit row into the loss (the advantages and old
    log-probs are masked with torch.where since, so they do not)."""
    proc = run_cli("run", "--target", SPEC, "--target-src", MILES_SRC, "--suite", "training", "--scenario",
                   "step-thd-dp4")
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "mask_leak [ranks 0]: NaN at the masked positions of the logits reached the loss of micro-batch 0" \
        in proc.stdout, proc.stdout[-3000:]


@needs_history
def test_the_allgather_cp_hang_683_fails_at_its_parent_and_not_at_the_fix(tmp_path):
    """At #683's parent the CP rank holding only prompt and padding skips the model's backward
    collective and goes on to DDP's gradient all-reduce (collective_mismatch); at the fix the step
    runs and its gradient is off only by the bfloat16 rounding both commits share."""
    repo = os.environ[REPO_ENV]
    scenarios = tmp_path / "s.json"
    scenarios.write_text(json.dumps([PROMPT_RANK]))
    kinds = {}
    for rev, name in ((FIX_683 + "^", "parent"), (FIX_683, "fix")):
        src = export_commit(repo, rev, tmp_path / name, "miles")
        proc = run_cli("run", "--target", SPEC, "--target-src", src, "--scenario-file", str(scenarios),
                       "--no-mask-leak", "--json-report", str(tmp_path / f"{name}.json"), timeout=300)
        [v] = json.loads((tmp_path / f"{name}.json").read_text())["scenarios"]
        kinds[name] = v["kinds"]
        if name == "parent":
            assert "cp call 4 all_reduce(SUM, float32[1]) in backward" in proc.stdout, proc.stdout[-3000:]
            assert "distributed_data_parallel.py" in proc.stdout, proc.stdout[-3000:]
        else:
            assert v["max_error"]["step_grad"] < 1e-3, v["max_error"]
    assert kinds == {"parent": ["collective_mismatch"], "fix": ["grad_mismatch"]}, kinds
