"""``shardcheck sweep``: every commit of a target's source repository that touches the files the
target reaches, checked with a suite, and the timeline of when each failure came and went.

The data path: the repository's history (``git log --first-parent`` over the reached files) ->
each commit exported with ``git archive`` into a scratch folder (the user's clone and its ``.git``
are only read) -> the suite run there on a world kept for the whole sweep (a checkout target
unloads its framework's modules between runs: ``Checkout.release``) -> one :class:`Cell` per
(commit, scenario) -> the cache (:class:`SweepCache`) -> :func:`timeline`'s intervals ->
:mod:`shardcheck.harness.controller.reports.timeline`.

A cell is cached per (commit, scenario, shardcheck's code, target and options, backend): a second
sweep runs only the cells it does not hold, and an interrupted one resumes where it stopped.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from shardcheck.errors import BadInput
from shardcheck.harness.controller.commands.commit_check import (EXPORT_FAILED, GIT_TIMEOUT_S, CommitCheck, Lazy,
                                                                 export, scenario_key)
from shardcheck.harness.controller.reports.sweep_timeline import CANNOT_RUN, Cell, Commit, Interval, SweepResult
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
                   revisions: str | None = None) -> list[Commit]:
    """The first-parent commits (oldest first) of ``revisions`` (``A..B``, default HEAD) since
    ``since`` that touch any of ``files``; BadInput where there is none."""
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
    tags = tags_by_commit(repo)
    commits = []
    for line in out.splitlines():
        sha, date, subject = line.split("\x1f", 2)
        commits.append(Commit(sha, date, subject, tuple(tags.get(sha, ()))))
    if not commits:
        where = f"{rng}" + (f" since {since}" if since else "")
        raise BadInput(f"no commit in {where} touches the files the target reaches ({', '.join(files[:4])}"
                       f"{', ...' if len(files) > 4 else ''})")
    return commits


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


# -- the cache ------------------------------------------------------------------------------------
def default_cache_dir() -> Path:
    """The platform's cache directory for shardcheck's sweeps."""
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    elif os.name == "nt":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "shardcheck" / "sweep"


# modules whose changes cannot change a cell: how results are shown and how a command line or a
# sweep is read (a report's wording, a sweep's own bookkeeping); everything else a cell may depend on
_NOT_IN_CELLS = frozenset({
    *(f"controller/reports/{m}.py" for m in ("run_report", "html_report", "fuzz_report", "invariance_report",
                                             "reach_report", "report_file", "sweep_report", "sweep_timeline")),
    *(f"controller/commands/{m}.py" for m in ("sweep", "sweep_workers", "commit_check")),
    "cli.py", "command.py", "check_commands.py", "info_commands.py", "sweep_command.py"})


def code_digest(roots: Sequence[Path] | None = None) -> str:
    """shardcheck's version and a digest of its own Python sources that a cell depends on (the
    targets, the rank side, the scenarios, the reference, the verdicts): a cell computed by other
    code (an adapter fixed since) is not reused; a change to how results are shown keeps them.
    ``roots``: the package folders (default: shardcheck's and those mapped into it)."""
    import shardcheck

    if roots is None:
        from shardcheck import harness, reference, scenarios, targets

        roots = [Path(shardcheck.__file__).parent, *(Path(p) for m in (harness, reference, scenarios, targets)
                                                      for p in m.__path__)]
    h = hashlib.sha256(shardcheck.__version__.encode())
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel in _NOT_IN_CELLS:
                continue
            h.update(rel.encode())
            h.update(path.read_bytes())
    return f"{shardcheck.__version__}+{h.hexdigest()[:12]}"


class SweepCache:
    """Cells on disk: ``<root>/<configuration key>/<commit>.json``, one file per commit holding its
    cells by scenario key, rewritten whole (write then rename) after every commit checked."""

    def __init__(self, root: Path, configuration: dict[str, Any]) -> None:
        key = hashlib.sha256(json.dumps(configuration, sort_keys=True).encode()).hexdigest()[:16]
        self.dir = Path(root) / key
        self.configuration = configuration

    def _path(self, sha: str) -> Path:
        return self.dir / f"{sha}.json"

    def load(self, sha: str) -> dict[str, Cell]:
        try:
            data = json.loads(self._path(sha).read_text())
        except (OSError, ValueError):
            return {}
        return {k: Cell.from_dict(v) for k, v in data.get("cells", {}).items()}

    def store(self, sha: str, cells: dict[str, Cell]) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            about = self.dir / "configuration.json"
            if not about.exists():
                about.write_text(json.dumps(self.configuration, indent=1, sort_keys=True) + "\n")
            merged = self.load(sha) | cells
            tmp = self._path(sha).with_suffix(".tmp")
            tmp.write_text(json.dumps({"commit": sha, "cells": {k: c.to_dict() for k, c in merged.items()}},
                                      sort_keys=True))
            os.replace(tmp, self._path(sha))
        except OSError as exc:
            raise BadInput(f"--cache {str(self.dir.parent)!r} cannot be written: {exc.strerror or exc}") from None


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
            held = cache.load(commit.sha)
            cells = {name: held[key] for name, key in keys.items() if key in held}
            todo = [name for name in keys if name not in cells]
            if todo:
                fresh = check(commit.sha, todo)
                fresh |= {n: Cell(CANNOT_RUN, why="no verdict came back") for n in todo if n not in fresh}
                # an export that failed may not fail next time: only what the commit itself decides is kept
                cache.store(commit.sha, {keys[n]: c for n, c in fresh.items()
                                         if n in keys and not c.why.startswith(EXPORT_FAILED)})
                cells |= {n: fresh[n] for n in todo}
                result.ran += len(todo)
            result.cells[commit.sha] = cells
            progress(i, commit, cells, len(todo))
    except KeyboardInterrupt:
        result.interrupted = True
        result.commits = [c for c in commits if c.sha in result.cells]
    return result


def is_ancestor(repo: str | Path, older: str, newer: str) -> bool:
    return subprocess.run(["git", "-C", str(repo), "merge-base", "--is-ancestor", older, newer],
                          capture_output=True, timeout=GIT_TIMEOUT_S).returncode == 0


def releases_carrying(repo: str | Path, interval: Interval, tags: dict[str, list[str]]) -> list[str]:
    """The tags (``tags``: commit -> names) whose commit holds the interval's bug: its first bad
    commit is an ancestor, its first good commit (if any) is not."""
    out = []
    for sha, names in tags.items():
        if is_ancestor(repo, interval.first_bad.sha, sha) and not (
                interval.first_good is not None and is_ancestor(repo, interval.first_good.sha, sha)):
            out.extend(names)
    return sorted(out)




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


def cache_configuration(config: Any) -> dict[str, Any]:
    """What, besides the commit and the scenario, a cell depends on: shardcheck's code, the target
    and its options, the backend and the checks switched on."""
    return {"shardcheck": code_digest(), "target": config.target,
            "target_options": sorted(f"{k}={v}" for k, v in config.target_options), "backend": config.backend,
            "checks": {"lockstep": config.lockstep, "inplace": config.inplace, "mask_leak": config.mask_leak}}


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
