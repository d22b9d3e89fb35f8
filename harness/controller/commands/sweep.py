"""``shardcheck sweep``: every commit of a target's source repository that touches the files the
target reaches, checked with a suite, and the timeline of when each failure came and went.

The data path: the repository's history (``git log --first-parent`` over the reached files) ->
each commit exported with ``git archive`` into a scratch folder (the user's clone and its ``.git``
are only read) -> the suite run there on a world kept for the whole sweep (a checkout target
unloads its framework's modules between runs: ``Checkout.release``) -> one :class:`Cell` per
(commit, scenario) -> the cache (:mod:`.sweep_cache`) -> the intervals
(:mod:`shardcheck.harness.controller.reports.sweep_timeline`) -> their reports (:mod:`.sweep_report`).

A cell is cached per (commit, scenario, shardcheck's code, target and options, backend): a second
sweep runs only the cells it does not hold, and an interrupted one resumes where it stopped.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from shardcheck.errors import BadInput
from shardcheck.harness.controller.commands.commit_check import GIT_TIMEOUT_S, CommitCheck, Lazy, export, scenario_key
from shardcheck.harness.controller.commands.sweep_cache import SweepCache
from shardcheck.harness.controller.reports.sweep_timeline import Cell, Commit, Interval, SweepResult
from shardcheck.scenarios.scenario import Scenario


# -- the history ----------------------------------------------------------------------------------
def git(repo: str | Path, *args: str, what: str = "") -> str:
    """``git -C repo args`` (read-only uses only), its stdout; BadInput naming ``what`` on failure."""
    try:
        proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise BadInput(f"git {' '.join(args[:2])} in {str(repo)!r} took over {GIT_TIMEOUT_S:.0f} s") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["failed"])[-1]
        raise BadInput(f"{what or 'git ' + ' '.join(args[:2])} in {str(repo)!r}: {last}")
    return proc.stdout


def check_repository(repo: str | Path) -> Path:
    """The clone's path; BadInput in one line where it is not a git clone with history."""
    path = Path(repo)
    if not path.is_dir():
        raise BadInput(f"--src-repo {str(repo)!r} is not a directory")
    proc = subprocess.run(["git", "-C", str(path), "rev-parse", "--verify", "HEAD^{commit}"],
                          capture_output=True, text=True, timeout=GIT_TIMEOUT_S)
    if proc.returncode != 0:
        raise BadInput(f"--src-repo {str(repo)!r} is not a git clone with a commit (git rev-parse HEAD failed)")
    return path


def select_commits(repo: str | Path, files: Sequence[str], *, since: str | None = None,
                   revisions: str | None = None, tags: dict[str, list[str]] | None = None) -> list[Commit]:
    """The first-parent commits (oldest first) of ``revisions`` (``A..B``, default HEAD) since
    ``since`` that touch any of ``files``, each with its ``tags`` (default: the repository's);
    BadInput where there is none."""
    if not files:
        raise BadInput("the target names no files it reaches: nothing to select commits by")
    rng = revisions or "HEAD"
    if ".." in rng:
        for rev in (r for r in rng.split("..", 1) if r):
            git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", what=f"--range: {rev!r} is no commit")
    else:
        git(repo, "rev-parse", "--verify", "--quiet", f"{rng}^{{commit}}", what=f"--range: {rng!r} is no commit")
    args = ["log", "--first-parent", "--reverse", "--format=%H%x1f%cI%x1f%s"]
    if since:
        args.append(f"--since={since}")
    out = git(repo, *args, rng, "--", *files, what="git log")
    tags = tags_by_commit(repo) if tags is None else tags
    commits = []
    for line in out.splitlines():
        sha, date, subject = line.split("\x1f", 2)
        commits.append(Commit(sha, date, subject, tuple(tags.get(sha, ()))))
    if not commits:
        where = f"{rng}" + (f" since {since}" if since else "")
        raise BadInput(f"no commit in {where} touches the files the target reaches ({', '.join(files[:4])}"
                       f"{', ...' if len(files) > 4 else ''})")
    return commits


def with_earlier_names(repo: str | Path, revisions: str | None, files: Sequence[str]) -> list[str]:
    """``files`` and every name each had before, up to the newest commit of ``revisions`` (git's
    --follow, one file at a time): a file moved since (NeMo-RL's dtensor_policy_worker.py into
    workers/) is selected by its commits under its old name too, which a log of the new path misses."""
    newest = (revisions or "HEAD").split("..")[-1] or "HEAD"
    names = dict.fromkeys(files)
    for path in files:
        # a clone lacking some blobs (mirrored, partial) cannot score an inexact rename: then only
        # the moves that kept the file's contents (-M100%: compared by hash), else its name alone
        for similarity in ((), ("-M100%",)):
            try:
                out = git(repo, "log", "--follow", *similarity, "--name-only", "--format=", newest, "--", path,
                          what="git log --follow")
            except BadInput:
                continue
            names.update(dict.fromkeys(line.strip() for line in out.splitlines() if line.strip()))
            break
    return sorted(names)


def tags_by_commit(repo: str | Path) -> dict[str, list[str]]:
    """Each tagged commit's tags (annotated tags peeled to their commit)."""
    out = git(repo, "for-each-ref", "--format=%(objectname) %(*objectname) %(refname:short)", "refs/tags",
              what="git for-each-ref")
    tags: dict[str, list[str]] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3:
            obj, peeled, name = parts
        elif len(parts) == 2:
            (obj, name), peeled = parts, ""
        else:
            continue
        tags.setdefault(peeled or obj, []).append(name)
    return tags


def sweep(commits: Sequence[Commit], scenarios: Sequence[Scenario], cache: SweepCache,
          check: Callable[[str, Sequence[str]], dict[str, Cell]],
          progress: Callable[[int, Commit, dict[str, Cell], int], None] = lambda i, c, cells, ran: None
          ) -> SweepResult:
    """Each commit's cells, from the cache where it holds them, else ``check(sha, names)``; stored
    after each commit, so that an interrupted sweep (KeyboardInterrupt propagates) keeps its work."""
    keys = {sc.name: scenario_key(sc) for sc in scenarios}
    result = SweepResult(list(commits), [sc.name for sc in scenarios], {})
    try:
        for i, commit in enumerate(commits):
            cells, todo = cache.held(commit.sha, keys)
            if todo:
                cells |= cache.keep(commit.sha, keys, check(commit.sha, todo), todo)
                result.ran += len(todo)
            result.cells[commit.sha] = cells
            progress(i, commit, cells, len(todo))
    except KeyboardInterrupt:
        result.interrupted = True
        result.commits = [c for c in commits if c.sha in result.cells]
    return result


def mark_releases(repo: str | Path, intervals: Sequence[Interval], tags: dict[str, list[str]]) -> None:
    """Each interval's ``releases``: the tags (``tags``: commit -> names) whose commit holds its bug,
    its first bad commit an ancestor and its first good commit (if any) not. One ``git rev-list``
    a tag, not a query a tag and interval."""
    for sha, names in tags.items():
        ancestors = set(git(repo, "rev-list", sha, what=f"git rev-list {sha[:10]}").split())
        for iv in intervals:
            if iv.first_bad.sha in ancestors and (iv.first_good is None or iv.first_good.sha not in ancestors):
                iv.releases.extend(names)
    for iv in intervals:
        iv.releases.sort()


# -- the sweep as the command runs it --------------------------------------------------------------
def reached_files(repo: str | Path, config: Any, revisions: str | None, scratch: Path) -> list[str]:
    """The files the target names as its framework's, read at the newest commit of the sweep (a
    target's list may depend on what its checkout holds)."""
    from shardcheck.harness.controller.commands.runner import controller_target

    newest = (revisions or "HEAD").split("..")[-1] or "HEAD"
    sha = git(repo, "rev-parse", "--verify", "--quiet", f"{newest}^{{commit}}",
              what=f"--range: {newest!r} is no commit").strip()
    tree = scratch / "newest"
    why = export(repo, sha, tree)
    if why is not None:
        raise BadInput(f"the newest commit {sha[:10]} cannot be exported: {why}")
    target = controller_target(config.target, config.with_source(str(tree)))
    if target.src is None:
        raise BadInput(f"target {config.target!r} takes no source checkout: there is no history to sweep")
    files = sorted(dict.fromkeys(str(f) for f in target.framework_files))
    if not files:
        raise BadInput(f"target {config.target!r} names no framework files at {sha[:10]}: give --file PATH")
    return files


def run_sweep(repo: Path, commits: Sequence[Commit], scenarios: Sequence[Scenario], config: Any,
              cache: SweepCache, scratch: Path, *, jobs: int = 1, timeout: float = 60.0,
              progress: Callable[[int, Commit, dict[str, Cell], int], None] = lambda i, c, cells, ran: None
              ) -> SweepResult:
    """:func:`sweep` on a world started here and closed at the end, on Ctrl-C too (the result then
    says it was interrupted and holds the commits done, which the cache keeps). ``jobs`` > 1: that
    many worker processes, each with a world of its own (:mod:`.sweep_workers`)."""
    from shardcheck.harness.controller.commands.runner import world_size_for
    from shardcheck.harness.controller.worlds.spawned import SpawnedWorld

    if jobs > 1:
        from shardcheck.harness.controller.commands.sweep_workers import parallel_sweep

        return parallel_sweep(repo, commits, scenarios, config, cache, scratch, jobs=jobs, timeout=timeout,
                              progress=progress)
    with contextlib.ExitStack() as stack:
        # started at the first commit the cache does not answer (a sweep the cache holds starts none)
        world = Lazy(lambda: stack.enter_context(SpawnedWorld(world_size_for(scenarios), timeout=timeout)))
        return sweep(commits, scenarios, cache, CommitCheck(repo, scenarios, config, world, scratch, timeout),
                     progress)
