import io
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# Reporters whose default streams are bound when their module is imported (TerminalReport, the
# fuzz Progress): imported here, they hold the session's streams, not those of the first test's
# capsys (closed after that test) that calls shardcheck.cli.main in this process.
import shardcheck.harness.controller.reports.fuzz_report  # noqa: F401
import shardcheck.harness.controller.reports.run_report  # noqa: F401

TESTS = Path(__file__).parent


# what a test sets only for its own in-process runs (a plugin's checks: test_check_pipeline,
# test_preflight); a process the background starts meanwhile must not inherit it
TEST_LOCAL_ENV = ("SHARDCHECK_CHECKS",)


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for a shardcheck process a test starts: this one's, less what a test sets
    for itself alone, with ``extra``."""
    return {k: v for k, v in os.environ.items() if k not in TEST_LOCAL_ENV} | extra


def run_cli(*args: str, timeout: float = 600, cwd: str | None = None) -> subprocess.CompletedProcess:
    """``python -m shardcheck ARGS`` in a fresh process, with tests/ importable (for plants)."""
    env = cli_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "shardcheck", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def torch_only_python(folder: Path) -> str:
    """The python of a virtualenv in ``folder`` whose site-packages reach this one's (torch,
    megatron-core) by a path, which Python adds without running that folder's .pth files:
    shardcheck's editable install stays out (a `shardcheck repro` script must not need it)."""
    import sysconfig

    venv = folder / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = str(venv / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    Path(site, "torch_only.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def export_commit(repo: str, rev: str, dest: Path, *paths: str) -> str:
    """``rev`` of a framework's git repository as a plain folder (``git archive``, only
    ``paths`` when given): the repository is only read."""
    blob = subprocess.run(["git", "-C", repo, "archive", "--format=tar", rev, *paths], capture_output=True,
                          check=True).stdout
    dest.mkdir()
    subprocess.run(["tar", "-x", "-C", str(dest)], input=blob, check=True)
    return str(dest)


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()  # state, parent pid, ...


def parent_pid(pid: int) -> int:
    return int(_stat(pid)[1])


def descendants(pid: int) -> set[int]:
    """Every process below ``pid``: ranks fork from a server, so they are its grandchildren."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = parent_pid(int(entry))
            except OSError:
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        return _stat(pid)[0] != "Z"
    except OSError:
        return False


@dataclass
class SmokeRun:
    proc: subprocess.CompletedProcess
    json_report: Path
    html_report: Path


def _smoke_cli(folder: Path) -> SmokeRun:
    json_report, html_report = folder / "r.json", folder / "r.html"
    proc = run_cli("run", "--target", "builtin", "--suite", "smoke", "--json-report", str(json_report),
                   "--html-report", str(html_report), timeout=600)
    return SmokeRun(proc, json_report, html_report)


# runs any module may name in its tests' background marks (tests/background.py)
BACKGROUND = {"smoke-cli": (_smoke_cli, 600)}


@pytest.fixture
def smoke_cli(background) -> SmokeRun:
    """``shardcheck run --suite smoke`` through the command line, once a session (its checks in
    tests/test_run.py, its HTML page opened in tests/test_html_browser.py): 68 scenarios, 4 of them training steps the builtin skips."""
    return background("smoke-cli")


def at_once(steps: list[Callable[[], Any]], timeout: float = 30) -> list[BaseException | None]:
    """Run each step in a thread of its own, all at once (ranks that wait for each other); what
    each raised, or None. A step still running after ``timeout`` fails the test."""
    import threading

    raised: list[BaseException | None] = [None] * len(steps)

    def one(i: int) -> None:
        try:
            steps[i]()
        except Exception as exc:  # noqa: BLE001
            raised[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(steps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting"
    return raised


def write_scenarios(path: Path, scenarios: list) -> Path:
    path.write_text(json.dumps([s.to_dict() for s in scenarios]))
    return path


@pytest.fixture
def cli():
    return run_cli


@dataclass
class MainResult:
    """What ``shardcheck.cli.main`` did in this process, shaped like a finished subprocess."""

    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli_in_process(capsys, monkeypatch) -> Iterator[Callable[..., MainResult]]:
    """``shardcheck ARGS`` as ``main([...])`` in this process, for input refused before any world
    starts: no interpreter and torch import per case, and a world starting fails the test."""
    from shardcheck.cli import main
    from shardcheck.harness.controller.worlds.spawned import SpawnedWorld

    def no_world(self: Any) -> None:
        pytest.fail("a world started: this input must be refused before any world starts", pytrace=False)

    monkeypatch.setattr(SpawnedWorld, "start", no_world)

    def call(*args: str) -> MainResult:
        capsys.readouterr()  # only what main prints
        code = main(list(args))  # called here, so its prints see capsys' sys.stdout and sys.stderr
        out, err = capsys.readouterr()
        return MainResult(code, out, err)

    # a process's environment dies with it; main may set SHARDCHECK_* (--slime-src) in this one
    saved = {k: v for k, v in os.environ.items() if k.startswith("SHARDCHECK_")}
    yield call
    for k in [k for k in os.environ if k.startswith("SHARDCHECK_") and k not in saved]:
        del os.environ[k]
    os.environ.update(saved)


@dataclass
class InProcessRun:
    """A run made in this process, with what ``shardcheck run`` would have printed and written."""

    exit_code: int
    stdout: str
    report: dict


def run_on_world(world: Any, scenarios: Sequence[Any], target: str, report: Path, suite: str,
                 **options: Any) -> InProcessRun:
    """What ``shardcheck run --target T --scenario-file F --json-report R`` checks, in this process:
    the same reporters (terminal table, JSON report), no interpreter start. On ``world``, one
    this session already started; with None, on a world of the run's own, as the CLI starts
    (``options``: runner.run's timeout, lockstep, ...)."""
    from shardcheck.harness.controller.commands import runner
    from shardcheck.harness.controller.reports.run_report import JsonReport, Reporters, TerminalReport

    out = io.StringIO()
    # the terminal report's default streams are bound at import: give it its own
    terminal = TerminalReport(out=out, err=io.StringIO())
    json_report = JsonReport(str(report), {"suite": suite})
    result = runner.run(list(scenarios), target, reporter=Reporters(terminal, json_report), world=world, **options)
    return InProcessRun(result.exit_code, out.getvalue(), json.loads(report.read_text()))


@pytest.fixture(scope="session")
def world():
    """One 4-rank gloo world for every test that does not need a world of its own (a few seconds
    the first time in a process; it restarts itself when a scenario leaves it unusable)."""
    from shardcheck.harness.controller.worlds.spawned import SpawnedWorld

    with SpawnedWorld(4, timeout=20) as w:
        yield w


@pytest.fixture(scope="session")
def world2():
    """One 2-rank gloo world for the tests that need a world smaller than their scenarios."""
    from shardcheck.harness.controller.worlds.spawned import SpawnedWorld

    with SpawnedWorld(2, timeout=30) as w:
        yield w


# -- runs in the background (tests/background.py) --------------------------------------------------
_background = None


def pytest_configure(config):
    import tempfile

    from background import Background

    global _background
    # under pytest-xdist each worker would start every run: there each is run when asked
    _background = Background(enabled="PYTEST_XDIST_WORKER" not in os.environ,
                             root=Path(tempfile.mkdtemp(prefix="shardcheck-tests-background-")))


def pytest_collection_modifyitems(session, config, items):
    """Calm tests last, in their order: by then every background run has been asked for and the
    queue has drained, so pausing it costs nothing (earlier, the suite idled until the run going
    on ended, up to a minute of the session)."""
    calm = [item for item in items if item.get_closest_marker("calm") is not None]
    if calm:
        items[:] = [item for item in items if item.get_closest_marker("calm") is None] + calm


def pytest_collection_finish(session):
    """Queue the runs of the tests selected, in their order, and start (not to only list them)."""
    if session.config.option.collectonly:
        return
    for item in session.items:
        for mark in item.iter_markers("background"):
            for name in mark.args:
                _queue(item.module, name)
    _background.start()


def _queue(module: Any, name: str) -> None:
    """Run ``name`` as ``module``'s BACKGROUND (or this file's) lists it, queued once."""
    work, timeout = getattr(module, "BACKGROUND", {}).get(name) or BACKGROUND[name]
    _background.add(name, work, timeout)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    calm = item.get_closest_marker("calm") is not None
    if calm:
        _background.pause()  # at once when already paused (the test before was calm too)
    try:
        yield
    finally:
        # a calm test followed by another (a parametrized pair): stay paused, so the next one does
        # not wait out a run that began between them
        if calm and (nextitem is None or nextitem.get_closest_marker("calm") is None):
            _background.resume()


def _kill_descendants() -> None:
    """Every process below this one: at unconfigure the session's worlds are closed, so what is
    left belongs to a background run stopped early."""
    import signal

    for pid in descendants(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def pytest_unconfigure(config):
    if _background is not None:
        _background.close(kill=_kill_descendants)


@pytest.fixture
def background(request) -> Callable[[str], Any]:
    """``background(name)``: what the run ``name`` returned (tests/background.py); a run the test
    did not mark is run when asked."""
    def get(name: str) -> Any:
        _queue(request.module, name)
        return _background.get(name)

    return get


# -- the suite's time budget (tests/budget.py) ---------------------------------------------------
_phase_seconds: list[tuple[str, float]] = []


def pytest_runtest_logreport(report):
    _phase_seconds.append((report.nodeid, report.duration))


def pytest_terminal_summary(terminalreporter):
    import budget

    for line in budget.over_budget(budget.file_seconds(_phase_seconds), TESTS.parent):
        terminalreporter.write_line(f"test budget: {line}", yellow=True)
