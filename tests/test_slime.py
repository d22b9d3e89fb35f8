"""The slime target. Checking real slime needs a checkout (slime is not on PyPI): set
SHARDCHECK_SLIME_SRC to one. Era detection and bad input are checked without it."""

import json
import os
import textwrap

import pytest

from conftest import run_cli
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


def test_cli_without_a_checkout_is_one_line_exit_2(tmp_path):
    env_free = run_cli("run", "--target", "slime", "--slime-src", str(tmp_path))
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
