"""``shardcheck bisect``: the search against tables of verdicts (no world); the command on a
throwaway git repository holding a fake slime (its log-prob function delegates to shardcheck's
builtin), where one commit plants a bug and another cannot be imported, with each commit's
verdicts from a table; and that repository bisected once end to end, on real worlds."""

import math
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import run_cli
from shardcheck.errors import BadInput
from shardcheck.harness.controller.commands import bisect as bisect_module
from shardcheck.harness.controller.commands import runner
from shardcheck.harness.controller.commands.bisect import EXPORTED_COMMIT, SRC_ENV, Step, search, signature
from shardcheck.harness.controller.reports.verdict import FAIL, PASS, VALUE_MISMATCH, Failure, RunInfo, Verdict
from shardcheck.scenarios import get_suite

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


def fake_slime_repo(root: Path) -> Path:
    """An empty git repository holding slime's package folders (test_sweep builds its history too)."""
    repo = root / "fake-slime"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    for pkg in ("slime", "slime/backends", "slime/backends/megatron_utils"):
        (repo / pkg).mkdir(parents=True, exist_ok=True)
        (repo / pkg / "__init__.py").write_text("")
    return repo


@pytest.fixture
def history(tmp_path):
    repo = fake_slime_repo(tmp_path)
    good = LOSS.format(bug="0.0")
    commits = {
        "c1": _commit(repo, "c1 correct", good),
        "c2": _commit(repo, "c2 does not import", good + "\ndef broken(:\n"),
        "c3": _commit(repo, "c3 correct again", good + "\n# tidy\n"),
        "c4": _commit(repo, "c4 plants a bug", LOSS.format(bug="0.5")),
        "c5": _commit(repo, "c5 unrelated", LOSS.format(bug="0.5") + "\n# later\n"),
    }
    return repo, commits


SCENARIO = next(sc for sc in get_suite("smoke") if sc.name == "thd-tp1cp1-basic")
BISECT = ["--suite", "smoke", "--scenario", SCENARIO.name]


# -- the search, against tables of verdicts ---------------------------------------------------------

def _verdicts(outcome: str) -> list[Verdict]:
    """A commit's verdicts: G keeps old's, B is the changed one (a value mismatch)."""
    if outcome == "G":
        return [Verdict(SCENARIO, PASS)]
    return [Verdict(SCENARIO, FAIL, [Failure(VALUE_MISMATCH, "log_probs sample 0 token 1: off by 0.5", [0])])]


def _table(outcomes: str) -> tuple[list[str], Callable[[str], Step], list[str]]:
    """Commits c0.. for outcomes such as "G?GB" (? cannot be imported), a check that answers
    from it, and the commits the check was asked about, in order."""
    commits = [f"c{i}" for i in range(len(outcomes))]
    asked: list[str] = []

    def check(commit: str) -> Step:
        asked.append(commit)
        outcome = outcomes[int(commit[1:])]
        if outcome == "?":
            return Step(commit, None, why_skipped="slime cannot be imported")
        verdicts = _verdicts(outcome)
        return Step(commit, signature(verdicts), verdicts)

    return commits, check, asked


@pytest.mark.parametrize("outcomes,first_changed,skipped", [
    ("GB", 1, []),
    ("G?GBB", 3, []),  # c0..c4 of the fake slime: the middle (c2) is importable, c1 never asked
    ("G?GB", 3, ["c1"]),  # the middle (c1) cannot be imported: its neighbour c2 is asked instead
    ("GG?B", 3, ["c2"]),
    ("G??B", 3, ["c1", "c2"]),  # nothing importable between: the change lies in c1..c3, c3 named
    ("GGGGGGGB", 7, []),
    ("GBBBBBBB", 1, []),
])
def test_the_search_names_the_first_changed_commit(outcomes, first_changed, skipped):
    commits, check, asked = _table(outcomes)
    seen: list[str] = []
    result = search(commits, check, progress=lambda step: seen.append(step.commit))
    assert result.first_changed is not None and result.first_changed.commit == f"c{first_changed}"
    assert [s.commit for s in result.steps if s.signature is None] == skipped
    assert seen == asked == [s.commit for s in result.steps]  # each commit asked once, progress told
    assert len(set(asked)) == len(asked)
    assert (result.old.commit, result.new.commit) == (commits[0], commits[-1])


@pytest.mark.parametrize("outcomes", ["G?G", "GGGG", "GBG"])
def test_the_same_verdict_at_both_ends_is_nothing_to_find(outcomes):
    commits, check, asked = _table(outcomes)
    result = search(commits, check)
    assert result.first_changed is None and asked == [commits[0], commits[-1]]


@pytest.mark.parametrize("n", [3, 9, 16])
def test_the_search_halves_the_range(n):
    for change in range(1, n):
        commits, check, asked = _table("G" * change + "B" * (n - change))
        assert search(commits, check).first_changed.commit == f"c{change}"
        assert len(asked) <= 2 + math.ceil(math.log2(n - 1)), (change, asked)


@pytest.mark.parametrize("outcomes", ["?GB", "GB?"])
def test_an_end_that_cannot_be_imported_is_bad_input(outcomes):
    commits, check, _ = _table(outcomes)
    with pytest.raises(BadInput, match="cannot be checked: slime cannot be imported"):
        search(commits, check)


# -- the command, with each commit's verdicts from a table ------------------------------------------

FAKE = {"c1": "G", "c2": "?", "c3": "G", "c4": "B", "c5": "B"}  # what a world would say of each commit


@pytest.fixture
def fake_verdicts(history, monkeypatch) -> None:
    """Each commit's run answered from FAKE, on the tree ``bisect`` exported (no world); a commit
    that cannot be imported is refused as slime's target refuses it (BadInput, before any world)."""
    repo, commits = history
    label = {full: name for name, full in commits.items()}

    def run(scenarios, target, *, reporter, timeout, **kwargs):
        src = Path(kwargs["config"].target_src)  # the run's configuration
        commit = (src / EXPORTED_COMMIT).read_text().strip()  # the exported tree says its commit
        assert (src / "slime" / "backends" / "megatron_utils" / "loss.py").is_file()  # the exported tree
        assert src != repo and not (src / ".git").exists()
        outcome = FAKE[label[commit]]
        if outcome == "?":
            raise BadInput(f"slime at {src} cannot be imported: loss.py line 38: invalid syntax")
        info = RunInfo(target={"name": "slime"}, target_spec=target, ranks=1, backend="gloo",
                       backend_why="a table", lockstep=True)
        return runner.RunResult(_verdicts(outcome), info)

    monkeypatch.setattr(bisect_module.runner, "run", run)


def _git_state(repo) -> tuple[str, int]:
    """The user's repository as bisect must leave it: its status, and how many worktrees it has."""
    status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True).stdout
    wt = subprocess.run(["git", "-C", str(repo), "worktree", "list"], capture_output=True, text=True).stdout
    return status, len(wt.strip().splitlines())


def test_bisect_names_the_commit_that_changed_the_verdict(history, fake_verdicts, capsys):
    from shardcheck.cli import main

    repo, commits = history
    before = _git_state(repo)
    code = main(["bisect", "--src-repo", str(repo), "--target", "slime", "--good", commits["c1"], "--bad",
                 commits["c5"], *BISECT])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert f"first commit where the verdict changes: {commits['c4']}" in out, out + err
    assert "c4 plants a bug" in out and "value_mismatch" in out
    # the user's repository is only read
    assert before == _git_state(repo) == ("", 1)


def test_bisect_skips_a_commit_that_cannot_be_imported(history, fake_verdicts, capsys):
    from shardcheck.cli import main

    repo, commits = history
    # c1..c4: the first probe (the middle) is c2, which does not import: c3 is tried instead
    code = main(["bisect", "--slime-repo", str(repo), "--good", commits["c1"], "--bad", commits["c4"], *BISECT])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert f"first commit where the verdict changes: {commits['c4']}" in out
    assert f"skipped, could not be imported: {commits['c2'][:12]}" in out, out + err
    code = main(["bisect", "--slime-repo", str(repo), "--good", commits["c1"], "--bad", commits["c3"], *BISECT])
    out, err = capsys.readouterr()
    assert code == 0 and "the verdict is the same" in out


def test_bisect_bad_input(history, cli_in_process):
    repo, commits = history
    proc = cli_in_process("bisect", "--slime-repo", str(repo), "--good", commits["c5"], "--bad", commits["c1"])
    assert proc.returncode == 2 and "is not an ancestor" in proc.stderr
    proc = cli_in_process("bisect", "--slime-repo", str(repo), "--good", "nope", "--bad", commits["c1"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    # which target: named, or implied by --NAME-repo; never a framework the command line picks
    proc = cli_in_process("bisect", "--src-repo", str(repo), "--good", commits["c1"], "--bad", commits["c5"])
    assert proc.returncode == 2 and "needs --target NAME" in proc.stderr
    proc = cli_in_process("bisect", "--slime-repo", str(repo), "--target", "verl", "--good", commits["c1"],
                          "--bad", commits["c5"])
    assert proc.returncode == 2 and "names a slime repository, but --target is 'verl'" in proc.stderr
    # good and bad one commit (a hash and a name of it): said at once, no suite run at either
    proc = cli_in_process("bisect", "--slime-repo", str(repo), "--good", commits["c3"], "--bad", commits["c3"][:10])
    assert proc.returncode == 2 and proc.stderr.strip().endswith("there is no change to find"), proc.stderr
    assert "shardcheck bisect:" not in proc.stderr


# -- end to end: the one real bisect, a world per commit ---------------------------------------------

@pytest.mark.world
@pytest.mark.launch
def test_bisect_end_to_end_names_the_change_and_skips_what_cannot_be_imported(history):
    """``python -m shardcheck bisect`` on real worlds: c1..c4 asks c2 (which does not import),
    then c3, and names c4; the fake slime's verdicts, not a table's."""
    repo, commits = history
    before = _git_state(repo)
    proc = run_cli("bisect", "--slime-repo", str(repo), "--good", commits["c1"], "--bad", commits["c4"], *BISECT,
                   timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"first commit where the verdict changes: {commits['c4']}" in proc.stdout, proc.stdout + proc.stderr
    assert "c4 plants a bug" in proc.stdout and "value_mismatch" in proc.stdout
    assert f"skipped, could not be imported: {commits['c2'][:12]}" in proc.stdout, proc.stdout + proc.stderr
    assert before == _git_state(repo) == ("", 1)
