"""A sweep's cells on disk, kept per (commit, scenario) under a folder named by what else a cell
depends on (shardcheck's own code, the target and its options, the backend, the checks): the one
store the serial sweep and its workers' controller read and write."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardcheck.errors import BadInput
from shardcheck.harness.controller.commands.commit_check import EXPORT_FAILED
from shardcheck.harness.controller.reports.sweep_timeline import CANNOT_RUN, Cell


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
# (sweep_timeline is not here: its cells_of makes a verdict a cell, signature and all)
_NOT_IN_CELLS = frozenset({
    *(f"controller/reports/{m}.py" for m in ("run_report", "html_report", "fuzz_report", "invariance_report",
                                             "reach_report", "report_file", "sweep_report")),
    *(f"controller/commands/{m}.py" for m in ("sweep", "sweep_workers", "sweep_cache", "commit_check")),
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

    def held(self, sha: str, keys: dict[str, str]) -> tuple[dict[str, Cell], list[str]]:
        """(the cells of ``sha`` the cache holds, by scenario name; the names it lacks), for
        ``keys``: scenario name -> scenario key."""
        held = self.load(sha)
        cells = {name: held[key] for name, key in keys.items() if key in held}
        return cells, [name for name in keys if name not in cells]

    def keep(self, sha: str, keys: dict[str, str], fresh: dict[str, Cell], todo: Sequence[str]) -> dict[str, Cell]:
        """``fresh``, the cells just computed for ``todo`` (one that did not come back is "cannot
        run"), stored but for an export that failed, which may not fail next time; returned."""
        fresh = fresh | {n: Cell(CANNOT_RUN, why="no verdict came back") for n in todo if n not in fresh}
        self.store(sha, {keys[n]: c for n, c in fresh.items() if n in keys and not c.why.startswith(EXPORT_FAILED)})
        return {n: fresh[n] for n in todo}


def cache_configuration(config: Any) -> dict[str, Any]:
    """What, besides the commit and the scenario, a cell depends on: shardcheck's code, the target
    and its options, the backend and the checks switched on."""
    return {"shardcheck": code_digest(), "target": config.target,
            "target_options": sorted(f"{k}={v}" for k, v in config.target_options), "backend": config.backend,
            "checks": {"lockstep": config.lockstep, "inplace": config.inplace, "mask_leak": config.mask_leak}}
