"""``shardcheck bisect`` on a throwaway git repository holding a fake slime (its log-prob function
delegates to shardcheck's builtin), where one commit plants a bug and another cannot be imported."""

import subprocess

import pytest

from conftest import run_cli

pytestmark = pytest.mark.world

LOSS = '''
import torch
from megatron.core import mpu

from shardcheck.targets.base import RankInputs
from shardcheck.targets.builtin import BuiltinTarget

BUG = {bug}


def get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths,
                              with_entropy=False, non_loss_data=True):
    cp = mpu.get_context_parallel_world_size()
    inputs = RankInputs(
        logits=logits, tokens=unconcat_tokens, total_lengths=total_lengths, response_lengths=response_lengths,
        layout="allgather" if args.allgather_cp else ("zigzag" if cp > 1 else "thd"),
        with_entropy=with_entropy, entropy_coef=getattr(args, "entropy_coef", 0.0),
        temperature=args.rollout_temperature, chunk_size=args.log_probs_chunk_size, max_seq_lens=None,
        tp_group=mpu.get_tensor_model_parallel_group(), cp_group=mpu.get_context_parallel_group(),
        tp_rank=mpu.get_tensor_model_parallel_rank(), tp_size=mpu.get_tensor_model_parallel_world_size(),
        cp_rank=mpu.get_context_parallel_rank(), cp_size=cp)
    out = BuiltinTarget().compute(inputs)
    res = {{"log_probs": [lp + BUG for lp in out.log_probs]}}
    if with_entropy:
        res["entropy"] = out.entropy
    return torch.empty(0), res
'''


def _commit(repo, message, loss_text):
    path = repo / "slime" / "backends" / "megatron_utils" / "loss.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(loss_text)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run(git + ["add", "-A"], check=True, capture_output=True)
    subprocess.run(git + ["commit", "-q", "-m", message], check=True, capture_output=True)
    return subprocess.run(git + ["rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def history(tmp_path):
    repo = tmp_path / "fake-slime"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    for pkg in ("slime", "slime/backends", "slime/backends/megatron_utils"):
        (repo / pkg).mkdir(parents=True, exist_ok=True)
        (repo / pkg / "__init__.py").write_text("")
    good = LOSS.format(bug="0.0")
    commits = {
        "c1": _commit(repo, "c1 correct", good),
        "c2": _commit(repo, "c2 does not import", good + "\ndef broken(:\n"),
        "c3": _commit(repo, "c3 correct again", good + "\n# tidy\n"),
        "c4": _commit(repo, "c4 plants a bug", LOSS.format(bug="0.5")),
        "c5": _commit(repo, "c5 unrelated", LOSS.format(bug="0.5") + "\n# later\n"),
    }
    return repo, commits


def test_bisect_names_the_commit_that_changed_the_verdict(history):
    repo, commits = history
    before = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True).stdout
    proc = run_cli("bisect", "--slime-repo", str(repo), "--good", commits["c1"], "--bad", commits["c5"],
                   "--suite", "smoke", "--scenario", "thd-tp1cp1-basic", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"first commit where the verdict changes: {commits['c4']}" in proc.stdout, proc.stdout + proc.stderr
    assert "c4 plants a bug" in proc.stdout and "value_mismatch" in proc.stdout
    # the user's repository is only read
    after = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True).stdout
    assert before == after == ""
    wt = subprocess.run(["git", "-C", str(repo), "worktree", "list"], capture_output=True, text=True).stdout
    assert len(wt.strip().splitlines()) == 1


def test_bisect_skips_a_commit_that_cannot_be_imported(history):
    repo, commits = history
    # c1..c4: the first probe (the middle) is c2, which does not import: c3 is tried instead
    proc = run_cli("bisect", "--slime-repo", str(repo), "--good", commits["c1"], "--bad", commits["c4"],
                   "--suite", "smoke", "--scenario", "thd-tp1cp1-basic", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"first commit where the verdict changes: {commits['c4']}" in proc.stdout
    assert f"skipped, could not be imported: {commits['c2'][:12]}" in proc.stdout, proc.stdout + proc.stderr
    proc = run_cli("bisect", "--slime-repo", str(repo), "--good", commits["c1"], "--bad", commits["c3"],
                   "--suite", "smoke", "--scenario", "thd-tp1cp1-basic", timeout=600)
    assert proc.returncode == 0 and "the verdict is the same" in proc.stdout


def test_bisect_bad_input(history):
    repo, commits = history
    proc = run_cli("bisect", "--slime-repo", str(repo), "--good", commits["c5"], "--bad", commits["c1"])
    assert proc.returncode == 2 and "is not an ancestor" in proc.stderr
    proc = run_cli("bisect", "--slime-repo", str(repo), "--good", "nope", "--bad", commits["c1"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
