"""The Target contract: one protocol, its defaults in TargetBase, and plugins written against
earlier versions of it running unchanged.

tests/fixtures/plugins/ holds three third-party targets, each written against the interface
docs/targets.md documented at an earlier commit of main (7ffb247, 9c5ca4d, 5f5c698), and the
verdicts each gave when run at that commit (verdicts.json says how they were recorded). They are
installed as real packages with entry points, into a folder of their own, and run as a user runs
them."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from conftest import TESTS, cli_env

ROOT = TESTS.parent
PLUGINS = TESTS / "fixtures" / "plugins"
EXAMPLE = ROOT / "examples" / "naive_target"  # today's contract: installed beside them, no notice
RECORDED = json.loads((PLUGINS / "verdicts.json").read_text())


# The user's commands, one process for all three runs (each a command line's main: its own world):
# a process a run would spend its seconds importing torch again.
_RUN_EACH = """
import json, sys
from shardcheck.cli import main
runs = json.loads(sys.argv[1])
listed = main(["targets"])
for spec, argv in runs:
    print("=== " + spec, file=sys.stderr, flush=True)
    print("=== " + spec, flush=True)
    code = main(argv)
    print("=== exit " + str(code), file=sys.stderr, flush=True)
"""


def _earlier_plugins(folder: Path) -> dict:
    site = folder / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "install", "--no-deps",
           "--no-build-isolation", "--target", str(site)]
    build = folder / "build"  # pip builds in a copy: the fixtures' folders stay as committed
    dirs = [str(shutil.copytree(PLUGINS / name, build / name)) for name in sorted({r["plugin"] for r in RECORDED["runs"]})]
    dirs.append(str(shutil.copytree(EXAMPLE, build / "naive_target")))
    installed = subprocess.run(pip + dirs, capture_output=True, text=True, timeout=300)
    out = {"install": installed, "runs": {}}
    if installed.returncode:
        return out
    env = cli_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), str(TESTS), env.get("PYTHONPATH")]))
    runs = []
    for run in RECORDED["runs"]:
        if run["spec"] == "dec03":  # its chunked variant runs the same code, with a variant and an option
            continue
        report = folder / f"{run['spec'].replace(':', '_')}.json"
        runs.append((run["spec"], ["run", "--target", run["spec"], "--scenario-file", str(PLUGINS / "scenarios.json"),
                                   *run["options"], "--json-report", str(report)]))
    report = folder / "naive.json"
    runs.append(("naive", ["run", "--target", "naive", "--scenario-file", str(PLUGINS / "scenarios.json"),
                           "--json-report", str(report)]))
    proc = subprocess.run([sys.executable, "-c", _RUN_EACH, json.dumps(runs)], capture_output=True, text=True,
                          timeout=600, env=env)
    out["targets"], out["process"] = proc.stdout.split("=== ")[0], proc
    for part in proc.stderr.split("=== ")[1:]:
        head, _, said = part.partition("\n")
        if not head.startswith("exit "):
            spec = head
            out["runs"][spec] = {"stderr": said}
        else:
            out["runs"][spec]["exit"] = int(head.split()[1])
    for spec, argv in runs:
        report = Path(argv[-1])
        if spec in out["runs"]:
            out["runs"][spec]["report"] = json.loads(report.read_text()) if report.exists() else None
    return out


BACKGROUND = {"earlier-plugins": (_earlier_plugins, 1300)}


@pytest.mark.background("earlier-plugins")
def test_plugins_written_against_earlier_contracts_run_unchanged(background):
    """Each gives, at this commit, the verdicts it gave at its own (a pass that needs its declared
    definitions followed, skips with its own reasons), with one notice in the run's header."""
    got = background("earlier-plugins")
    assert got["install"].returncode == 0, got["install"].stderr[-2000:]
    proc = got["process"]
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    listed = got["targets"]
    assert all(any(ln.startswith(f"{p} ") for ln in listed.splitlines())
               for p in ("dec02", "dec03", "dec04", "naive")), listed
    checked = [run for run in RECORDED["runs"] if run["spec"] in got["runs"]]  # not dec03: its chunked variant
    assert len(checked) == 3, proc.stderr[-2000:]
    for run in checked:
        ran = got["runs"][run["spec"]]
        assert ran["exit"] == 0 and ran["report"], (run["spec"], ran["stderr"][-2000:])
        verdicts = {s["name"]: [s["verdict"], s.get("reason") or ""] for s in ran["report"]["scenarios"]}
        assert verdicts == run["verdicts"], (run["spec"], run["recorded_at"])
        notices = [ln for ln in ran["stderr"].splitlines() if ln.startswith("shardcheck: notice: ")]
        assert len(notices) == 1 and "written against an earlier Target contract" in notices[0], ran["stderr"][-1500:]
        assert "release()" in notices[0] and "Traceback" not in ran["stderr"]


@pytest.mark.background("earlier-plugins")
def test_the_example_plugin_of_todays_contract_runs_without_a_notice(background):
    """examples/naive_target (docs/targets.md), derived from TargetBase: installed the same way,
    it checks what it supports and says nothing of contracts."""
    ran = background("earlier-plugins")["runs"]["naive"]
    assert ran["exit"] == 0, ran["stderr"][-2000:]
    by = {s["name"]: s for s in ran["report"]["scenarios"]}
    assert by["thd-tp1"]["verdict"] == by["thd-tp2"]["verdict"] == "pass"
    assert by["zigzag-cp2"]["verdict"] == "skip" and "layout zigzag not supported" in by["zigzag-cp2"]["reason"]
    assert "notice" not in ran["stderr"] and "contract_notice" not in ran["report"]["target"]


# -- the contract itself, no world -------------------------------------------------------------
def test_every_member_of_the_protocol_is_in_the_history_and_has_a_default():
    """A member added to the Target protocol without its contract version, or without a default
    in TargetBase, fails here: that is how a plugin written before it would break."""
    from shardcheck.targets.base import CONTRACT_HISTORY, CONTRACT_VERSION, OPTIONAL_MEMBERS, Target, TargetBase

    tree = ast.parse((ROOT / "targets" / "base.py").read_text())
    protocol = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Target")
    declared = {n.target.id for n in protocol.body if isinstance(n, ast.AnnAssign)} | {
        n.name for n in protocol.body if isinstance(n, ast.FunctionDef)}
    history = {m for _, added in CONTRACT_HISTORY.values() for m in added}
    assert declared == history, declared ^ history
    assert max(CONTRACT_HISTORY) == CONTRACT_VERSION == TargetBase.contract
    for member in OPTIONAL_MEMBERS:
        assert hasattr(TargetBase, member), member
    assert set(OPTIONAL_MEMBERS) == declared - {"name", "capabilities", "describe", "compute", "contract", "declares",
                                                "implementation"}
    assert isinstance(Target, type)


class _Old:
    """Contract 1: the four required members and nothing else."""

    name = "old"

    def __init__(self):
        from shardcheck.targets import Capabilities

        self.capabilities = Capabilities(layouts=frozenset({"thd"}))
        self.released = 0

    def describe(self):
        return {"name": self.name}

    def compute(self, inputs):
        raise AssertionError("not called here")


class _WithDefinitionsAndRelease(_Old):
    def __init__(self):
        from shardcheck.targets.base import Definitions

        super().__init__()
        self.definitions = Definitions(entropy_sign=-1, entropy_source="its own")

    def release(self):
        self.released += 1


def test_an_adopted_plugin_answers_every_member_from_itself_or_the_default():
    from shardcheck.targets.base import Definitions, TargetBase, definitions
    from shardcheck.targets.contract import AdoptedTarget, adopt

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        old = adopt(_Old(), "tests:old")
        newer = adopt(_WithDefinitionsAndRelease(), "tests:newer")
        adopt(_Old(), "tests:old")  # once a spec and process
    notices = [str(w.message) for w in said if issubclass(w.category, FutureWarning)]
    assert len(notices) == 2 and "'tests:old'" in notices[0] and "release()" in notices[0], notices
    assert "release()" not in notices[1] and "definitions" not in notices[1].split("defaults for")[1], notices[1]
    assert isinstance(old, AdoptedTarget) and isinstance(old, TargetBase)
    assert old.loss_form == "weighted" and old.data_path is None and old.src is None and old.framework_files == ()
    assert definitions(old) == Definitions() and definitions(newer).entropy_sign == -1
    assert not old.declares("release") and newer.declares("release") and newer.declares("definitions")
    newer.release()
    old.release()  # nothing to undo: no error
    assert newer.implementation().released == 1 and old.repro_call() is None and old.split_batch(None) is None
    assert old.describe()["contract_notice"] == notices[0]
    with pytest.raises(ValueError):
        old.declares("nonsense")


def test_a_target_deriving_from_the_base_is_not_wrapped_and_declares_what_it_overrides():
    from shardcheck.targets import resolve

    builtin, loss = resolve("builtin"), resolve("builtin:loss")
    assert type(builtin).__name__ == "BuiltinTarget" and "contract_notice" not in builtin.describe()
    assert builtin.declares("repro_call") and not builtin.declares("logged_loss")
    assert loss.declares("logged_loss") and not loss.declares("split_batch")


# the contract's members, and the calls that would read one by probing
_MEMBERS = ("src", "framework_files", "data_path", "definitions", "loss_form", "training_loss", "invariance",
            "repro_call", "release", "split_batch", "logged_loss", "calculate_per_token_loss", "name", "capabilities")


def test_the_harness_reads_contract_members_without_probing():
    """Issue 38's acceptance: no ``getattr(target, ...)`` / ``hasattr(target, ...)`` of a contract
    member in shardcheck/, harness/ or targets/ (targets/contract.py adopts plugins: the one place
    that asks a plugin what it has, through ``self.plugin``)."""
    found = []
    for folder in ("shardcheck", "harness", "targets"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                        and isinstance(node.args[1], ast.Constant) and node.args[1].value in _MEMBERS
                        and "target" in ast.unparse(node.args[0])):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "\n".join(found)
