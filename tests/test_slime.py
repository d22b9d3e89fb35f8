"""The slime target. Checking real slime needs a checkout (slime is not on PyPI): set
SHARDCHECK_SLIME_SRC to one. Era detection and bad input are checked without it."""

import json
import os
import textwrap

import pytest

from conftest import export_commit, run_cli
from shardcheck.errors import BadInput
from shardcheck.targets.slime import ENV, detect_era, slime_source

SLIME_SRC = os.environ.get(ENV)
needs_slime = pytest.mark.skipif(not SLIME_SRC, reason=f"{ENV} is not set: no slime checkout to check "
                                 "(clone THUDM/slime and point it there; never pip install 'slime')")


def _fake_checkout(tmp_path, body: str, ppo: str = ""):
    loss = tmp_path / "slime" / "backends" / "megatron_utils" / "loss.py"
    loss.parent.mkdir(parents=True)
    loss.write_text(textwrap.dedent(body))
    if ppo:
        (tmp_path / "slime" / "utils").mkdir(parents=True)
        (tmp_path / "slime" / "utils" / "ppo_utils.py").write_text(ppo)
    return tmp_path


def test_era_of_an_old_checkout(tmp_path):
    src = _fake_checkout(tmp_path, """
        def get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths,
                                      with_entropy=False, non_loss_data=True, max_seq_lens=None):
            if args.qkv_format == "bshd":
                pass
            return {"log_probs": []}
        """, ppo="def calculate_log_probs_and_entropy(logits, tokens, tp_group, need_entropy_grad=True): pass")
    era = detect_era(src)
    assert era["returns"] == "dict" and era["qkv_format"] and era["max_seq_lens"]
    assert not era["allgather_cp"] and not era["top_p_replay"]
    assert era["entropy_grad_flag"] == "need_entropy_grad"


def test_era_of_a_new_checkout(tmp_path):
    src = _fake_checkout(tmp_path, """
        def get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths,
                                      with_entropy=False, non_loss_data=True, top_p_token_ids=None,
                                      top_p_token_offsets=None):
            if args.allgather_cp:
                pass
            return torch.empty((0,)), {"log_probs": []}
        """)
    era = detect_era(src)
    assert era["returns"] == "tuple (empty, dict)" and era["allgather_cp"] and era["top_p_replay"]
    assert not era["qkv_format"] and era["entropy_grad_flag"] is None


def test_the_source_must_be_named_and_be_a_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(BadInput, match="needs a slime source checkout"):
        slime_source()
    with pytest.raises(BadInput, match="is not a slime checkout"):
        slime_source(str(tmp_path))


def test_cli_without_a_checkout_is_one_line_exit_2(tmp_path, cli_in_process):
    env_free = cli_in_process("run", "--target", "slime", "--slime-src", str(tmp_path))
    assert env_free.returncode == 2 and "is not a slime checkout" in env_free.stderr
    assert "Traceback" not in env_free.stderr


@needs_slime
@pytest.mark.world
def test_slime_passes_every_smoke_scenario_it_supports(tmp_path):
    """Point SHARDCHECK_SLIME_SRC at a commit whose log-probs are right (slime's newest was, at
    624b824a8): every scenario it supports passes, the rest are skipped with the reason."""
    report = tmp_path / "r.json"
    proc = run_cli("run", "--target", "slime", "--suite", "smoke", "--json-report", str(report))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(report.read_text())
    assert doc["target"]["name"] == "slime" and doc["target"]["era"]
    verdicts = {v["verdict"] for v in doc["scenarios"]}
    assert verdicts <= {"pass", "skip"} and "pass" in verdicts


def test_policy_loss_is_a_variant_of_the_slime_target(tmp_path, cli_in_process):
    proc = cli_in_process("targets")
    assert proc.returncode == 0 and "policy_loss" in proc.stdout, proc.stdout
    from shardcheck.targets import resolve

    with pytest.raises(BadInput, match="no variant 'nope'"):
        resolve("slime:nope")


@needs_slime
@pytest.mark.world
def test_slime_applies_replayed_keep_sets_where_its_era_takes_them(tmp_path):
    """get_log_probs_and_entropy's top_p_token_ids / top_p_token_offsets (the adapter hands the
    keep sets over in slime's own format) and policy_loss_function (the batch's
    rollout_top_p_token_ids/offsets, rollout_top_p != 1): the replay suite, whose truth is
    renormalised over the sets, passes through both where slime supports the layout."""
    for target in ("slime", "slime:policy_loss"):
        report = tmp_path / "r.json"
        proc = run_cli("run", "--target", target, "--suite", "replay", "--json-report", str(report))
        doc = json.loads(report.read_text())
        if not doc["target"]["era"].get("top_p_replay"):
            pytest.skip("this slime commit takes no top-p replay")
        assert proc.returncode == 0, proc.stdout[-3000:]
        verdicts = {v["name"]: v["verdict"] for v in doc["scenarios"]}
        assert {verdicts[n] for n in ("replay-zigzag-tp2cp2", "replay-thd-tp2", "replay-allgather-tp2cp2",
                                      "replay-thd-one-device")} == {"pass"}, (target, verdicts)


@needs_slime
@pytest.mark.world
def test_slime_policy_loss_passes_every_smoke_scenario_it_supports(tmp_path):
    """policy_loss_function with old log-probs equal to the truth (ratio 1) and KL off: its loss
    value and gradient match the reference wherever slime's log-probs are right."""
    report = tmp_path / "r.json"
    proc = run_cli("run", "--target", "slime:policy_loss", "--suite", "smoke", "--json-report", str(report))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(report.read_text())
    assert doc["target"]["name"] == "slime:policy_loss"
    assert "args_read_but_not_set" in doc["target"] and not doc["target"]["args_read_but_not_set"]
    verdicts = {v["verdict"] for v in doc["scenarios"]}
    assert verdicts <= {"pass", "skip"} and "pass" in verdicts


REPO_ENV = "SHARDCHECK_SLIME_REPO"
needs_slime_history = pytest.mark.skipif(
    not os.environ.get(REPO_ENV), reason=f"{REPO_ENV} is not set: no slime git repository with its history "
    "(a clone of THUDM/slime) to check past commits against")
PR_2153 = "fa3c990af"  # "bugfix": moves the with_entropy_grad decision out of policy_loss_function



@needs_slime_history
@pytest.mark.world
def test_a_bug_at_one_call_site_shows_only_through_the_caller(tmp_path):
    """The gradient decision at one call site: before PR #2153, policy_loss_function passed
    with_entropy_grad to a get_log_probs_and_entropy that no longer took it. Calling the function directly passes; the
    policy loss target names the caller's line."""
    src = export_commit(os.environ[REPO_ENV], f"{PR_2153}~1", tmp_path / "slime")
    scenario = ["--suite", "regressions", "--scenario", "thd-tp2-chunks", "--slime-src", src]
    direct = run_cli("run", "--target", "slime", *scenario)
    assert direct.returncode == 0, direct.stdout[-2000:]
    caller = run_cli("run", "--target", "slime:policy_loss", *scenario)
    assert caller.returncode == 1, caller.stdout[-2000:]
    assert "rank_error" in caller.stdout and "with_entropy_grad" in caller.stdout
    assert "in policy_loss_function" in caller.stdout, "the error is placed at slime's call site"
