"""The pytest plugin, used as a framework team would: the example test file run by plain pytest
and by pytest-xdist (under torchrun, every rank running pytest and shardcheck joining its world:
tests/test_scale.py, across two torchrun agents).

Over 20 s: eight pytest sessions in processes of their own, as a framework team runs them
(one with two xdist workers, each starting its own world); they run in the background while
other tests go on (tests/background.py).
"""

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conftest import cli_env
from shardcheck.scenarios import get_suite

EXAMPLE = Path(__file__).parent.parent / "examples" / "pytest_multigpu" / "test_shardcheck_regressions.py"
SCENARIOS = [s.name for s in get_suite("regressions")]
BIN = Path(sys.executable).parent


def _project(tmp_path: Path) -> Path:
    """The example in a project of its own (no shardcheck pytest config around it)."""
    shutil.copy(EXAMPLE, tmp_path / EXAMPLE.name)
    return tmp_path


def _pytest(cwd: Path, *args: str, launcher: tuple[str, ...] = (), timeout: float = 600):
    cmd = [*launcher, "-m", "pytest", "-p", "no:cacheprovider", *args] if launcher else \
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]
    env = {k: v for k, v in cli_env().items() if not k.startswith("PYTEST_")}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def _cases(junit: Path) -> dict[str, str | None]:
    root = ET.parse(junit).getroot()
    out = {}
    for tc in root.iter("testcase"):
        failure = tc.find("failure")
        out[tc.get("name")] = None if failure is None else failure.get("message")
    return out


def _marker(folder: Path):
    (_project(folder) / "test_plain.py").write_text("def test_cpu_only():\n    pass\n")
    return (_pytest(folder, "-m", "not multigpu", "-q", "-W", "error::pytest.PytestUnknownMarkWarning"),
            _pytest(folder, "--markers"))


def _session(*args: str, timeout: float = 600):
    """A pytest session on the example in a project of its own: (the process, its folder)."""
    return lambda folder: (_pytest(_project(folder), *args, timeout=timeout), folder)


BAD_TARGETS = [
    (["--shardcheck-target", "no_such_module:thing"], "cannot import 'no_such_module'"),
    (["--shardcheck-target-opt", "chunk=4"], "target 'builtin' takes no --target-opt"),
    (["--shardcheck-html-report", "/no/such/dir/p.html"], "cannot write the HTML report '/no/such/dir/p.html'"),
]


def _bad_sessions(folder: Path) -> list[tuple[int, str]]:
    """Each bad option's pytest session, one after another in one process (pytest.main, as a
    framework's own runner may call it; torch imported once, not once a session): (its exit
    status, what it printed)."""
    project = _project(folder)
    cases = [["-p", "no:cacheprovider", "-m", "multigpu", "-q", *args, "--shardcheck-nproc", "1"]
             for args, _ in BAD_TARGETS]
    script = ("import json, sys, pytest\n"
              "for args in json.loads(sys.argv[1]):\n"
              "    print('=== session', flush=True)\n"
              "    print(f'=== exit {int(pytest.main(args))}', flush=True)\n")
    env = {k: v for k, v in cli_env().items() if not k.startswith("PYTEST_")}
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], cwd=project, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120, env=env)  # one stream: a traceback is seen
    out = []
    for part in proc.stdout.split("=== session\n")[1:]:
        text, _, code = part.rpartition("=== exit ")
        out.append((int(code.split()[0]), text))
    assert len(out) == len(cases), proc.stdout[-2000:]
    return out


# every session runs in the background while other tests go on (tests/background.py)
BACKGROUND = {
    "plugin-marker": (_marker, 1200),
    "plugin-builtin": (_session("-m", "multigpu", "-q", "--junitxml", "j.xml"), 600),
    "plugin-mutant": (_session("-m", "multigpu", "-q", "--junitxml", "j.xml", "--shardcheck-target",
                               "builtin:grad_placeholder", "--shardcheck-html-report", "page.html"), 600),
    "plugin-xdist": (_session("-n", "2", "-q"), 600),
    "plugin-bad": (_bad_sessions, 180),
}


@pytest.mark.background("plugin-marker")
def test_the_marker_is_registered(background):
    proc, markers = background("plugin-marker")
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "1 passed" in proc.stdout and f"{len(SCENARIOS)} deselected" in proc.stdout
    assert "@pytest.mark.multigpu" in markers.stdout


@pytest.mark.world
@pytest.mark.background("plugin-builtin")
def test_one_testcase_per_scenario_passing_against_builtin(background):
    proc, project = background("plugin-builtin")
    assert proc.returncode == 0, proc.stdout[-3000:]
    cases = _cases(project / "j.xml")
    assert sorted(cases) == sorted(f"test_regressions[{n}]" for n in SCENARIOS)
    assert all(v is None for v in cases.values()), cases


@pytest.mark.world
@pytest.mark.background("plugin-mutant")
def test_a_mutant_fails_per_scenario_with_the_kind_in_the_message(background):
    proc, project = background("plugin-mutant")
    assert proc.returncode == 1, proc.stdout[-3000:]
    # one page for the session: every scenario it checked, the failing one with its lanes
    page = (project / "page.html").read_text()
    assert page.count("<tr class=") >= len(SCENARIOS) and "FAILED ag-empty-local-slices" in page
    assert "<table class=lanes>" in page and f"{len(SCENARIOS)} scenarios:" in page
    cases = _cases(project / "j.xml")
    assert len(cases) == len(SCENARIOS)
    failed = {name: msg for name, msg in cases.items() if msg}
    # the backward hang of placeholders that require grad on some ranks, named in its failure message
    assert "collective_mismatch" in failed["test_regressions[ag-empty-local-slices]"], failed
    assert "FAILED ag-empty-local-slices  (allgather tp=1 cp=2" in proc.stdout
    assert "in backward" in proc.stdout


@pytest.mark.world
@pytest.mark.launch
@pytest.mark.background("plugin-xdist")
def test_with_xdist_workers_each_own_a_world(background):
    proc, _ = background("plugin-xdist")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert f"{len(SCENARIOS)} passed" in proc.stdout


@pytest.mark.parametrize("case", range(len(BAD_TARGETS)), ids=[f for _, f in BAD_TARGETS])
@pytest.mark.background("plugin-bad")
def test_a_bad_target_stops_the_session_with_one_line(background, case):
    code, said = background("plugin-bad")[case]
    assert code == 2, said[-2000:]
    assert BAD_TARGETS[case][1] in said
    assert "Traceback" not in said
