"""One commit of a framework's history checked: exported with ``git archive`` into a scratch
folder of its own (the user's clone and its ``.git`` are only read), the scenarios run there on a
world kept for a series of commits, the verdicts turned into cells (sweep and its workers)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardcheck.errors import BadInput, WorldError
from shardcheck.harness.controller.reports.sweep_timeline import CANNOT_RUN, Cell, cells_of
from shardcheck.scenarios.scenario import Scenario
from shardcheck.targets.source import EXPORTED_COMMIT

GIT_TIMEOUT_S = 120.0
EXPORT_FAILED = "cannot be exported"


def missing_blobs(repo: str | Path, sha: str) -> list[str]:
    """The paths of the commit's tree whose contents the clone does not hold (a partial or
    mirrored clone leaves large files out)."""
    listing = subprocess.run(["git", "-C", str(repo), "ls-tree", "-r", "-z", sha], capture_output=True,
                             timeout=GIT_TIMEOUT_S)
    entries = [e.split("\t", 1) for e in listing.stdout.decode(errors="replace").split("\0") if "\t" in e]
    blobs: dict[str, list[str]] = {}  # one content may sit at several paths (a copied image)
    for meta, path in entries:
        if meta.split()[1] == "blob":
            blobs.setdefault(meta.split()[2], []).append(path)
    check = subprocess.run(["git", "-C", str(repo), "cat-file", "--batch-check"], capture_output=True,
                           timeout=GIT_TIMEOUT_S, input="".join(f"{oid}\n" for oid in blobs).encode())
    return sorted(path for line in check.stdout.decode().splitlines()
                  if line.endswith(" missing") and line.split()[0] in blobs for path in blobs[line.split()[0]])


def export(repo: str | Path, sha: str, into: Path) -> str | None:
    """The commit's tree written into ``into`` (with its hash beside it, where targets.source reads
    an exported tree's commit); None, or why it cannot be exported. Files the clone does not hold
    are left out when none of them is Python source (a lock file, an image: nothing a target
    imports); a missing Python file makes the commit one that cannot be exported."""
    try:
        command = ["git", "-C", str(repo), "archive", "--format=tar", sha]
        archive = subprocess.run(command, capture_output=True, timeout=300)
        if archive.returncode != 0:
            missing = missing_blobs(repo, sha)
            if missing and not any(path.endswith(".py") for path in missing):
                archive = subprocess.run(command + ["--", ".", *(f":(exclude,literal){p}" for p in missing)],
                                         capture_output=True, timeout=300)
        if archive.returncode != 0:
            return archive.stderr.decode(errors="replace").strip()[:200] or "git archive failed"
        into.mkdir(parents=True, exist_ok=True)
        untar = subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, capture_output=True, timeout=300)
        if untar.returncode != 0:
            return untar.stderr.decode(errors="replace").strip()[:200] or "tar failed"
    except subprocess.TimeoutExpired as exc:
        return f"exporting took over {exc.timeout:.0f} s"
    (into / EXPORTED_COMMIT).write_text(sha + "\n")
    return None


def scenario_key(sc: Scenario) -> str:
    return hashlib.sha256(json.dumps(sc.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class CommitCheck:
    """Checks commits on one world kept for their whole series, each in a scratch folder of its own
    under ``scratch`` (removed after its run)."""

    repo: Path
    scenarios: Sequence[Scenario]
    config: Any  # RunConfig
    world: Any
    scratch: Path
    timeout: float = 60.0
    runs: int = 0  # scenarios run (not taken from the cache): what a resumed sweep saves

    def __call__(self, sha: str, names: Sequence[str]) -> dict[str, Cell]:
        from shardcheck.harness.controller.commands import runner
        from shardcheck.harness.controller.reports.run_report import SilentReport

        todo = [sc for sc in self.scenarios if sc.name in set(names)]
        tree = Path(tempfile.mkdtemp(prefix=f"{sha[:10]}-", dir=self.scratch))
        try:
            why = export(self.repo, sha, tree)
            if why is not None:
                return {sc.name: Cell(CANNOT_RUN, why=f"{EXPORT_FAILED}: {why}") for sc in todo}
            try:
                world = self.world.get() if isinstance(self.world, Lazy) else self.world
                result = runner.run(todo, self.config.target, reporter=SilentReport(), world=world,
                                    timeout=self.timeout, config=self.config.with_source(str(tree)))
            except BadInput as exc:  # the target cannot be built at this commit (its era, its files)
                why = str(exc).replace(str(tree), f"<{sha[:10]}>")[:300]
                return {sc.name: Cell(CANNOT_RUN, why=why) for sc in todo}
            except WorldError:
                raise  # no world: nothing further can be checked (one line, the command's error)
            except Exception as exc:  # noqa: BLE001  (the adapter's own planning failed at this commit)
                # shardcheck's, not the framework's: an era the target does not model, said as such;
                # one commit's failure must not end the sweep
                text = " ".join(f"{type(exc).__name__}: {exc}".split()).replace(str(tree), f"<{sha[:10]}>")
                why = f"the target's adapter failed before any rank ran (an era it does not model): {text}"[:300]
                return {sc.name: Cell(CANNOT_RUN, why=why) for sc in todo}
            self.runs += len(todo)
            # the scratch tree's path means nothing after it is gone: the commit names it
            return {n: dataclasses.replace(c, why=c.why.replace(str(tree), f"<{sha[:10]}>"))
                    for n, c in cells_of(result.verdicts).items()}
        finally:
            shutil.rmtree(tree, ignore_errors=True)


class Lazy:
    """A value made at its first use."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make, self._value = make, None

    def get(self) -> Any:
        if self._value is None:
            self._value = self._make()
        return self._value
