"""NVIDIA/Megatron-LM's own RL loop (``--target megatron_rl``, targets/megatron_rl.py): get_logprobs
compiled alone from megatron/rl/rl_utils.py (its megatron-core 0.20 is never imported).

Without a checkout (SHARDCHECK_MEGATRON_RL_SRC: an export of megatron/rl and
megatron/core/packed_seq_params.py at ci/frameworks.toml's pin) only the checks that need none run
(bad input, the Transformer Engine partition stand-in: well under a second). With one, a handful of
log-prob scenarios on the session's 4-rank world: every value and gradient matches in thd, bshd
and zigzag (TP gathered by the output layer, CP scattered and all-gathered by get_logprobs), and
float16 logits give the live finding of docs/megatron-rl.md (selective_log_softmax's float16
log_softmax: gradients a few float16 ulps off); its repro script finds it too. With
SHARDCHECK_MEGATRON_RL_REPO (a history clone, the bare mirror works) the fixed bug: at the parent
of #5882 get_logprobs hands every CP rank's model the whole bin (rank_error), at #5882 it passes.

Over 20 s: with a checkout and a history clone, 13 to 21 s on the shared 2-core machine (two runs on
the session's 4-rank world, two on the 2-rank one, a repro script's own process); without a
checkout, well under a second.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import export_commit, run_on_world
from shardcheck.errors import BadInput
from shardcheck.scenarios import Scenario, get_suite
from shardcheck.scenarios.layout import zigzag_positions
from shardcheck.targets import megatron_rl
from shardcheck.targets.base import TargetConfig

SRC = os.environ.get(megatron_rl.ENV)
REPO_ENV = "SHARDCHECK_MEGATRON_RL_REPO"
needs_src = pytest.mark.skipif(
    not SRC, reason=f"{megatron_rl.ENV} is not set: no Megatron-LM checkout to check (export megatron/rl and "
    "megatron/core/packed_seq_params.py of NVIDIA/Megatron-LM at ci/frameworks.toml's pin and point it there)")
needs_history = pytest.mark.skipif(
    not os.environ.get(REPO_ENV), reason=f"{REPO_ENV} is not set: no Megatron-LM git repository with its history "
    "(a clone of NVIDIA/Megatron-LM) to check the fixed bug against")
# "Enable context parallelism for RL training" (#5882): get_logprobs splits the bin over CP itself;
# its parent accepted --context-parallel-size > 1 (train_rl.py's loss_func all-reduced over CP) but
# handed every CP rank's model the whole bin
CP_FIX = "34c3741f564c6793aac969c0a1204a85cb4efe70"
CP_FIX_PARENT = "d262dbed3d48a0b6a22b1f0ddc58c2cede2b9149"
EXPORTED = ("megatron/rl", "megatron/core/packed_seq_params.py")
# the smallest scenario of each (docs/megatron-rl.md)
CP_ONE = {"name": "zigzag-cp2-one", "samples": [[6, 3]], "vocab": 8, "cp": 2, "layout": "zigzag",
          "with_entropy": False, "entropy_coef": 0.0, "temperature": 1.0, "seed": 1}
FP16_TINY = {"name": "fp16-tiny", "samples": [[2, 1]], "vocab": 64, "dtype": "float16", "with_entropy": False,
             "entropy_coef": 0.0, "temperature": 1.0, "seed": 1}
GLOO_SAFE = {"cp_all_gather": "shardcheck"}


def _run(world, tmp_path, monkeypatch, scenarios, *, options=None, src=None, commit=None):
    if src is not None:
        monkeypatch.setenv(megatron_rl.ENV, src)
    if commit is not None:
        monkeypatch.setenv("SHARDCHECK_MEGATRON_RL_COMMIT", commit)
    if options:
        monkeypatch.setenv("SHARDCHECK_TARGET_OPTS", json.dumps([[k, v] for k, v in options.items()]))
    else:
        monkeypatch.delenv("SHARDCHECK_TARGET_OPTS", raising=False)
    scenarios = [s if isinstance(s, Scenario) else Scenario.from_dict(s) for s in scenarios]
    run = run_on_world(world, scenarios, "megatron_rl", tmp_path / "megatron_rl.json", "megatron_rl")
    return run, {v["name"]: v for v in run.report["scenarios"]}


def test_a_folder_that_is_not_a_megatron_checkout_is_one_line(tmp_path):
    with pytest.raises(BadInput) as exc:
        megatron_rl.target(None, TargetConfig(str(tmp_path)))
    assert "Megatron-LM" in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize(("totals", "cp"), [([8], 2), ([8, 4, 12], 2), ([16, 8], 4), ([8, 8, 0], 4)])
def test_the_partition_stand_in_holds_the_zigzag_rows_of_every_sequence(totals, cp):
    """TE's THD partition (its stand-in) over megatron's 2*cp-aligned slots picks, sample by sample,
    the rows the harness's zigzag layout gives each CP rank (a zero-length ghost slot holds none)."""
    bounds = torch.tensor([sum(totals[:i]) for i in range(len(totals) + 1)], dtype=torch.int32)
    for rank in range(cp):
        want = [start + p for start, total in zip(bounds.tolist(), totals) if total
                for chunk in zigzag_positions(total, cp, rank) for p in chunk]
        got = megatron_rl._thd_get_partitioned_indices(bounds, sum(totals), cp, rank)
        assert got.tolist() == want


def test_an_unknown_option_is_one_line(tmp_path):
    with pytest.raises(BadInput, match="no option layout"):
        megatron_rl.target(None, TargetConfig(str(tmp_path), (("layout", "framework"),)))


@needs_src
@pytest.mark.world
def test_log_probs_and_gradients_match_and_float16_gradients_are_off(world, tmp_path, monkeypatch):
    names = ("thd-tp2cp1-many-logprob", "bshd-tp4cp1-many-logprob", "zigzag-tp2cp2-many-logprob",
             "zigzag-tp1cp4-edges-logprob", "thd-tp2cp1-bf16-logprob")
    chosen = [s for s in get_suite("logprob") if s.name in names]
    entropy = next(s for s in get_suite("smoke") if s.name == "thd-tp1cp1-basic")
    run, verdicts = _run(world, tmp_path, monkeypatch, chosen + [entropy, Scenario.from_dict(FP16_TINY)],
                         options=GLOO_SAFE)
    assert {n: verdicts[n]["verdict"] for n in names} == dict.fromkeys(names, "pass"), run.stdout[-3000:]
    assert "sampled token's -p log p" in verdicts[entropy.name]["reason"]
    # float16 logits: selective_log_softmax's log_softmax in float16 (rl_utils.py), whose backward reuses
    # the float16-rounded log-probs; the values pass, the gradient is 3 ulps of float16 off
    assert verdicts["fp16-tiny"]["kinds"] == ["grad_mismatch"], verdicts["fp16-tiny"]
    assert "got -0.101868, want -0.101654 (3 ulps of float16)" in run.stdout, run.stdout[-2000:]
    described = run.report["target"]
    assert described["era"] == {"cp_scatter": True, "packing_multiple": True}
    assert described["cp_all_gather"].startswith("shardcheck's gloo-safe")
    # torch's own all-gather on gloo: CP skipped with its reason (a torch limitation)
    run, verdicts = _run(world, tmp_path, monkeypatch, [s for s in chosen if s.cp > 1])
    assert all("torch limitation" in v["reason"] for v in verdicts.values()), verdicts


@needs_src
def test_a_repro_script_finds_the_float16_gradient_with_torch_alone(tmp_path):
    from conftest import run_cli

    (tmp_path / "tiny.json").write_text(json.dumps([FP16_TINY]))
    made = run_cli("repro", "--target", "megatron_rl", "--megatron-rl-src", SRC, "--scenario-file",
                   str(tmp_path / "tiny.json"), "--scenario", "fp16-tiny", "--out", str(tmp_path / "repro.py"),
                   cwd=str(tmp_path))
    assert made.returncode == 0, made.stderr
    ran = subprocess.run([sys.executable, str(tmp_path / "repro.py")], capture_output=True, text=True, timeout=180,
                         cwd=tmp_path)
    assert ran.returncode == 1, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert "FOUND in megatron_rl" in ran.stdout and "gradient -0.10186768, want -0.10165428" in ran.stdout


@needs_history
@pytest.mark.world
def test_the_cp_fix_hands_each_rank_its_share_where_its_parent_handed_the_whole_bin(world2, tmp_path,
                                                                                       monkeypatch):
    repo = os.environ[REPO_ENV]
    parent = export_commit(repo, CP_FIX_PARENT, tmp_path / "parent", *EXPORTED)
    run, verdicts = _run(world2, tmp_path, monkeypatch, [CP_ONE], src=parent, commit=CP_FIX_PARENT)
    [failure] = {f["kind"] for f in verdicts["zigzag-cp2-one"]["failures"]}
    assert failure == "rank_error" and run.report["target"]["era"]["cp_scatter"] is False
    assert "get_logprobs hands this rank's model other tokens ([2, 2, 1, 4, 5, 0, 0, 0])" in run.stdout
    fixed = export_commit(repo, CP_FIX, tmp_path / "fixed", *EXPORTED)
    run, verdicts = _run(world2, tmp_path, monkeypatch, [CP_ONE], src=fixed, commit=CP_FIX, options=GLOO_SAFE)
    assert verdicts["zigzag-cp2-one"]["verdict"] == "pass", run.stdout[-2000:]
