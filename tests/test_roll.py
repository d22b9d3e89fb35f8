"""alibaba/ROLL's Megatron strategy's log-prob and entropy path (``--target roll``, targets/roll.py).

Without a checkout (SHARDCHECK_ROLL_SRC) the target is refused in one line and the checkout tests
skip, saying why. With one at the pin (8eb27cc2dc34), the smoke suite's float32 scenarios all fail
with the live finding of docs/roll.md (mcore_adapter's vocab_parallel_logprobs writes into float32
logits), its bfloat16 / float16 packed ones with the entropy's backward writing into the packed
output; the same samples in bfloat16 pass but for the entropy computed in bfloat16. With
SHARDCHECK_ROLL_REPO (a history clone; the bare mirror works) the fixed bug: deb4656a (the entropy
cast to float32) fails at its parent 9ba2a44b with a value mismatch and passes at the fix, and a
`shardcheck repro` script of that finding, run without shardcheck, finds it at the pin and not at
the fix.

Over 20 s: with a checkout and its history (about 40 s here), the smoke suite, two grids, two
exported commits and a repro script run three times (each start imports megatron-core)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from conftest import export_commit, run_cli, run_on_world, torch_only_python
from shardcheck.errors import BadInput
from shardcheck.scenarios import Scenario, get_suite
from shardcheck.targets import roll
from shardcheck.targets.base import TargetConfig

ROLL_SRC = os.environ.get(roll.ENV)
REPO_ENV = "SHARDCHECK_ROLL_REPO"
needs_roll = pytest.mark.skipif(
    not ROLL_SRC, reason=f"{roll.ENV} is not set: no ROLL checkout to check (clone alibaba/ROLL at the pin "
    "8eb27cc2dc34 and point it there)")
needs_history = pytest.mark.skipif(
    not os.environ.get(REPO_ENV), reason=f"{REPO_ENV} is not set: no ROLL git repository with its history (a clone "
    "of alibaba/ROLL; a bare mirror works)")
FIX = "deb4656a74f85532d6f4200ad60ca0783a71d23c"  # (refactor): cast logits to float (the entropy), 2025-07-04
PARENT = "9ba2a44b13b03b679e266184ccff0e04d2767435"
# what the target reads of a checkout (the others hold blobs a partial mirror may lack)
PATHS = ("roll/distributed/strategy/megatron_strategy.py", "roll/third_party/megatron/tensor_parallel.py",
         "mcore_adapter/src/mcore_adapter/parallel_functions", "mcore_adapter/src/mcore_adapter/models/model_factory.py",
         "mcore_adapter/src/mcore_adapter/utils.py")
# the smallest scenario of each finding at the pin (docs/roll.md)
FLOAT32_ENTROPY = {"name": "fp32-entropy-after-logprobs", "samples": [[2, 1]], "vocab": 4, "layout": "bshd",
                   "entropy_coef": 0.0, "seed": 1}
FLOAT32_PACKED = {"name": "fp32-packed-two", "samples": [[2, 1], [2, 1]], "vocab": 4, "layout": "thd",
                  "with_entropy": False, "entropy_coef": 0.0, "seed": 1}
BF16_PACKED_ENTROPY = {"name": "bf16-packed-entropy", "samples": [[2, 1], [2, 1]], "vocab": 4, "layout": "thd",
                       "dtype": "bfloat16", "entropy_coef": 0.1, "seed": 1}
BF16_ENTROPY = {"name": "bf16-entropy", "samples": [[3, 2]], "vocab": 32, "layout": "bshd", "dtype": "bfloat16",
                "entropy_coef": 0.0, "seed": 18}
INPLACE = "modified by an inplace operation"


def test_a_folder_that_is_not_a_roll_checkout_is_one_line(tmp_path):
    with pytest.raises(BadInput) as exc:
        roll.target(None, TargetConfig(str(tmp_path)))
    assert "ROLL" in str(exc.value) and "\n" not in str(exc.value)


def test_an_option_that_is_not_yes_or_no_is_one_line(tmp_path):
    with pytest.raises(BadInput) as exc:
        roll.target(None, TargetConfig(str(tmp_path), (("logits_in_fp32", "maybe"),)))
    assert "logits_in_fp32" in str(exc.value) and "\n" not in str(exc.value)


@needs_roll
@pytest.mark.world
def test_smoke_at_the_pin_every_float32_scenario_finds_the_logits_written_in_place(world, tmp_path, monkeypatch):
    from shardcheck.targets.base import SRC_ENV

    monkeypatch.setenv(SRC_ENV, ROLL_SRC)
    run = run_on_world(world, get_suite("smoke"), "roll", tmp_path / "smoke.json", "smoke")
    verdicts = run.report["scenarios"]
    ran = [v for v in verdicts if v["verdict"] != "skip"]
    assert len(ran) == 20, [(v["name"], v.get("reason")) for v in verdicts]
    for v in ran:
        packed = v["scenario"]["layout"] in ("thd", "zigzag")
        if v["scenario"]["dtype"] == "float32":
            # the log-prob kernel's in-place write, every float32 scenario; packed, each sample's write
            # into the shared output makes the backward raise
            assert "input_mutated" in v["kinds"] and ("rank_error" in v["kinds"]) == packed, (v["name"], v["kinds"])
        else:  # bfloat16 / float16, packed with an entropy gradient: its backward's write into the packed output
            assert "rank_error" in v["kinds"] and packed, (v["name"], v["kinds"])
        assert v["max_error"]["log_probs"] < 1e-5, v["name"]  # the log-probs themselves are right
    skipped = {v["reason"] for v in verdicts if v["verdict"] == "skip"}
    for why in ("temperature", "all-gather CP", "keep sets", "training step", "entropy_loss_coef > 0"):
        assert any(why in r for r in skipped), (why, skipped)
    assert run.report["target"]["code"].startswith(str(roll.STRATEGY_FILE))


@needs_roll
@pytest.mark.world
def test_the_same_samples_in_bfloat16_pass_but_for_the_entropy_computed_in_bfloat16(world, tmp_path, monkeypatch):
    """The smoke grid's long-prompt and many cells in bfloat16 (ROLL's default model dtype): the
    log-prob kernel copies the logits first, so they pass; one entropy, computed in bfloat16
    (logits_in_fp32 False, ROLL's default), is outside the tolerance."""
    from shardcheck.targets.base import SRC_ENV

    monkeypatch.setenv(SRC_ENV, ROLL_SRC)
    grid = [dataclasses.replace(s, name=f"{s.name}-bf16", dtype="bfloat16") for s in get_suite("smoke")
            if s.name.endswith(("-long-prompt", "-many")) and "allgather" not in s.name]
    verdicts = {v["name"]: v for v in run_on_world(world, grid, "roll", tmp_path / "bf16.json", "bf16").report["scenarios"]}
    failed = {n: v["kinds"] for n, v in verdicts.items() if v["verdict"] != "pass"}
    assert failed == {"thd-tp2cp1-long-prompt-bf16": ["value_mismatch"]}, failed
    assert len(verdicts) - len(failed) == 17


@needs_roll
@pytest.mark.world
def test_the_smallest_scenarios_of_the_findings(world, tmp_path, monkeypatch):
    from shardcheck.targets.base import SRC_ENV

    monkeypatch.setenv(SRC_ENV, ROLL_SRC)
    scenarios = [Scenario.from_dict(d) for d in (FLOAT32_ENTROPY, FLOAT32_PACKED, BF16_PACKED_ENTROPY, BF16_ENTROPY)]
    run = run_on_world(world, scenarios, "roll", tmp_path / "tiny.json", "tiny")
    kinds = {v["name"]: v["kinds"] for v in run.report["scenarios"]}
    assert kinds == {"fp32-entropy-after-logprobs": ["input_mutated", "value_mismatch"],
                     "fp32-packed-two": ["input_mutated", "rank_error"],
                     "bf16-packed-entropy": ["rank_error"], "bf16-entropy": ["value_mismatch"]}, kinds
    assert INPLACE in run.stdout and "vocab_parallel.py:47 in forward" in run.stdout, run.stdout[-3000:]
    assert "tensor_parallel.py:97 in backward" in run.stdout, run.stdout[-3000:]
    assert "entropy sample 0 token 1: got 0.9375, want 0.896284" in run.stdout, run.stdout[-3000:]


@needs_roll
@pytest.mark.world
def test_logits_in_fp32_copies_the_logits_for_the_entropy(world, tmp_path):
    """ROLL's own knob: the entropy on a float32 copy is exact and its backward writes into the copy."""
    from shardcheck.run_config import RunConfig

    config = RunConfig("roll", target_options=(("logits_in_fp32", "true"),), sources=(("roll", ROLL_SRC),))
    scenarios = [Scenario.from_dict(d) for d in (BF16_PACKED_ENTROPY, BF16_ENTROPY)]
    run = run_on_world(world, scenarios, "roll", tmp_path / "fp32.json", "fp32", config=config)
    assert run.report["target"]["strategy"].endswith("logits_in_fp32 True (ROLL's default False)")
    assert {v["name"]: v["verdict"] for v in run.report["scenarios"]} == {"bf16-packed-entropy": "pass",
                                                                          "bf16-entropy": "pass"}


@needs_history
@pytest.mark.world
def test_the_entropy_in_bfloat16_fails_at_the_parent_of_the_float_cast_and_passes_at_it(world, tmp_path, monkeypatch):
    """deb4656a ("cast logits to float, maybe cause oom"): the entropy's forward casts the logits to
    float32. At its parent the entropy of bfloat16 logits is computed, all-reduced and returned in
    bfloat16: 11 bfloat16 ulps off. (ROLL v0.2.0, 3077befc, moved the cast behind logits_in_fp32,
    default False: the pin has the parent's behaviour again.)"""
    repo = os.environ[REPO_ENV]
    scenario = Scenario.from_dict(BF16_ENTROPY)
    kinds = {}
    for commit in (PARENT, FIX):
        monkeypatch.setenv(roll.ENV, export_commit(repo, commit, tmp_path / commit[:8], *PATHS))
        monkeypatch.setenv("SHARDCHECK_ROLL_COMMIT", commit)
        run = run_on_world(world, [scenario], "roll", tmp_path / f"{commit[:8]}.json", "fix")
        assert run.report["target"]["commit"] == commit
        [v] = run.report["scenarios"]
        kinds[commit] = v["kinds"]
        if commit == PARENT:
            assert "entropy sample 0 token 1: got 0.9375, want 0.896284" in run.stdout, run.stdout[-2000:]
    assert kinds == {PARENT: ["value_mismatch"], FIX: []}, kinds


@needs_roll
@needs_history
def test_a_repro_script_finds_the_bfloat16_entropy_at_the_pin_and_not_at_the_fix(tmp_path):
    """`shardcheck repro` writes finding 3 as a script; run by a python that reaches torch and
    megatron-core but not shardcheck, it compiles ROLL's definitions from the checkout: exit 1
    (FOUND) at the pin, 0 at deb4656a (--src), and 2 (no finding) where the checkout is missing."""
    import json
    import subprocess

    (tmp_path / "tiny.json").write_text(json.dumps([BF16_ENTROPY]))
    script = tmp_path / "repro.py"
    made = run_cli("repro", "--target", "roll", "--roll-src", ROLL_SRC, "--scenario-file", str(tmp_path / "tiny.json"),
                   "--scenario", "bf16-entropy", "--out", str(script), cwd=str(tmp_path))
    assert made.returncode == 0, made.stderr
    assert script.read_text().count("\n") < 300 and "shardcheck." not in script.read_text()
    python = torch_only_python(tmp_path)
    fixed = export_commit(os.environ[REPO_ENV], FIX, tmp_path / "fix", *PATHS)
    ran = {name: subprocess.run([python, str(script), *args], capture_output=True, text=True, timeout=300, cwd=tmp_path)
           for name, args in (("pin", ()), ("fix", ("--src", fixed)), ("none", ("--src", str(tmp_path / "none"))))}
    assert ran["pin"].returncode == 1, ran["pin"].stdout + ran["pin"].stderr[-2000:]
    assert "FOUND in roll" in ran["pin"].stdout and "entropy 0.9375, want 0.89628408" in ran["pin"].stdout
    assert ran["fix"].returncode == 0 and "NOT FOUND" in ran["fix"].stdout, ran["fix"].stdout + ran["fix"].stderr[-2000:]
    assert ran["none"].returncode == 2 and ran["none"].stdout.startswith("CANNOT RUN"), ran["none"].stdout
