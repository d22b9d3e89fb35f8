"""Find the first commit of a target's source repository (slime, verl, NeMo-RL, or any target
that takes ``--target-src``) where the verdict of a suite changes.

Each commit reaches the target as its :class:`TargetConfig` source (the run configuration's
``target_src``), the commit's hash written beside its files (``targets.source.EXPORTED_COMMIT``:
an archive has no ``.git``). Commits are exported with ``git archive`` into temporary folders
(the user's checkout and its ``.git`` are only read), each is checked on a fresh world, and a binary search over the
first-parent history from ``old`` to ``new`` names the first commit whose verdicts differ from
``old``'s. A commit that cannot be imported counts as skipped, as ``git bisect skip`` does.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardcheck.errors import BadInput
from shardcheck.harness.controller.commands import runner
from shardcheck.harness.controller.reports.verdict import ERROR, RunInfo, Verdict
from shardcheck.scenarios.scenario import Scenario

from shardcheck.run_config import RunConfig, effective
from shardcheck.targets.base import SRC_ENV  # noqa: F401  (where callers of old imported it from)
from shardcheck.targets.source import EXPORTED_COMMIT


@dataclass
class Step:
    commit: str
    signature: tuple | None  # None: the commit could not be imported (skipped)
    verdicts: list[Verdict] = field(default_factory=list)
    info: RunInfo | None = None  # the run's, as its reporters had it (None: not run)
    why_skipped: str = ""


@dataclass
class BisectResult:
    first_changed: Step | None
    old: Step
    new: Step
    steps: list[Step]


def _git(repo: str, *args: str) -> str:
    proc = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise BadInput(f"git {' '.join(args)} in {repo!r} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return proc.stdout


def commits_between(repo: str, old: str, new: str) -> list[str]:
    """Full hashes from old (excluded) to new (included), oldest first, along first parents."""
    if not os.path.isdir(repo):
        raise BadInput(f"--src-repo {repo!r} is not a directory")
    old_hash = _git(repo, "rev-parse", "--verify", f"{old}^{{commit}}").strip()
    new_hash = _git(repo, "rev-parse", "--verify", f"{new}^{{commit}}").strip()
    if old_hash == new_hash:  # nothing between them: no suite need run to say so
        raise BadInput(f"--good {old} and --bad {new} are one commit ({old_hash[:12]}): there is no change to find")
    if subprocess.run(["git", "-C", repo, "merge-base", "--is-ancestor", old_hash, new_hash]).returncode != 0:
        raise BadInput(f"{old} is not an ancestor of {new}")
    out = _git(repo, "rev-list", "--first-parent", "--ancestry-path", f"{old_hash}..{new_hash}")
    return [old_hash] + list(reversed(out.split()))


def signature(verdicts: Sequence[Verdict]) -> tuple:
    """What 'the verdict' is: per scenario, its status and failure kinds (with phases)."""
    return tuple(sorted((v.scenario.name, v.status, tuple(sorted({(f.kind, f.phase or "") for f in v.failures})))
                        for v in verdicts))


def check_commit(repo: str, commit: str, scenarios: Sequence[Scenario], target: str, *, timeout: float,
                 reporter_factory: Callable[[], Any], config: RunConfig | None = None) -> Step:
    """``commit`` checked on a fresh world, with ``config`` (default: the one in effect) on the
    commit's exported tree."""
    config = (config or effective(target)).for_target(target)
    with tempfile.TemporaryDirectory(prefix="shardcheck-bisect-") as tmp:
        archive = subprocess.run(["git", "-C", repo, "archive", "--format=tar", commit], capture_output=True,
                                 timeout=300)
        if archive.returncode != 0:
            return Step(commit, None, why_skipped=archive.stderr.decode(errors="replace").strip()[:200])
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True, timeout=300)
        Path(tmp, EXPORTED_COMMIT).write_text(commit + "\n")  # what targets.source reads of an exported tree
        try:
            result = runner.run(scenarios, target, reporter=reporter_factory(), timeout=timeout,
                                config=config.with_source(tmp))
        except BadInput as exc:
            return Step(commit, None, why_skipped=str(exc))
    # a commit the target cannot run at (it cannot be imported; the harness's own error there) is no verdict
    unimportable = [v for v in result.verdicts
                    if v.status == ERROR or any("cannot be imported" in f.message for f in v.failures)]
    if unimportable:
        return Step(commit, None, result.verdicts, result.info, why_skipped=unimportable[0].failures[0].message)
    return Step(commit, signature(result.verdicts), result.verdicts, result.info)


def bisect(repo: str, old: str, new: str, scenarios: Sequence[Scenario], target: str = "slime", *,
           timeout: float = 60.0, reporter_factory: Callable[[], Any],
           progress: Callable[[Step], None] = lambda step: None, config: RunConfig | None = None) -> BisectResult:
    commits = commits_between(repo, old, new)

    def check(commit: str) -> Step:
        return check_commit(repo, commit, scenarios, target, timeout=timeout, reporter_factory=reporter_factory,
                            config=config)

    return search(commits, check, progress)


def search(commits: Sequence[str], check: Callable[[str], Step],
           progress: Callable[[Step], None] = lambda step: None) -> BisectResult:
    """The binary search over ``commits`` (oldest first), with ``check`` giving a commit's step:
    the seam that lets the search be tested against a table of verdicts, without a world."""
    steps: list[Step] = []

    def visit(i: int) -> Step:
        step = check(commits[i])
        steps.append(step)
        progress(step)
        return step

    first, last = visit(0), visit(len(commits) - 1)
    for end in (first, last):
        if end.signature is None:
            raise BadInput(f"{end.commit[:12]} cannot be checked: {end.why_skipped}")
    if first.signature == last.signature:
        return BisectResult(None, first, last, steps)
    # invariant: commits[lo] has old's verdict, commits[hi] does not
    lo, hi = 0, len(commits) - 1
    known: dict[int, Step] = {0: first, len(commits) - 1: last}
    while hi - lo > 1:
        candidates = sorted(range(lo + 1, hi), key=lambda i: abs(i - (lo + hi) // 2))
        for i in candidates:  # the middle, or the nearest importable commit to it
            step = known.get(i) or visit(i)
            known[i] = step
            if step.signature is not None:
                break
        else:  # nothing importable between: the change lies in [lo+1, hi]
            break
        if step.signature == first.signature:
            lo = i
        else:
            hi = i
    return BisectResult(known[hi], first, last, steps)
