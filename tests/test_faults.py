"""The fault matrix: each way a run used to go wrong (a false green, a crashed controller, an
orphaned rank, the wrong rank blamed, a malformed output blamed on shardcheck), provoked, with
what the report must say. Faults that leave the world usable share the session's world; the
others get a world of their own (0.1 s to start: ranks fork from the server).

Over 20 s: 41 faults, a dozen of which wait out a deadline on purpose (1-2 s timeouts, a hung
rank asked for its stack) and three of which kill a controller while it starts: about half of
its time is waiting, not work.
"""

import inspect
import json
import contextlib
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import plants
from conftest import TESTS, alive, descendants
from shardcheck.cli import build_parser
from shardcheck.harness.controller.commands import fuzz
from shardcheck.harness.controller.worlds import rank_memory as memory
from shardcheck.harness.controller.commands import runner
from shardcheck.harness.controller.reports.run_report import SilentReport
from shardcheck.harness.controller.worlds.spawned import SpawnedWorld
from shardcheck.scenarios import Sample, Scenario, get_suite

pytestmark = pytest.mark.world

TP2 = Scenario("tp2", (Sample(7, 3), Sample(5, 2)), vocab=8, tp=2, seed=3, entropy_coef=0.1)
SMALL = Scenario("small", (Sample(6, 2),), vocab=8, tp=2, seed=4)


def _one(world, spec, sc=TP2):
    result = runner.run([sc], spec, reporter=SilentReport(), world=world)
    return result, result.verdicts[0]


# -- false greens ----------------------------------------------------------------------------------
def test_a_run_that_checked_nothing_is_not_green(cli_in_process):
    proc = cli_in_process("run", "--target", "megatron", "--suite", "regressions", "-q")
    assert proc.returncode == 5, (proc.returncode, proc.stderr)
    assert f"nothing was checked: all {len(get_suite('regressions'))} scenarios were skipped" in proc.stderr
    assert cli_in_process("run", "--target", "megatron", "--suite", "regressions", "-q",
                          "--allow-all-skipped").returncode == 0


# -- the controller survives any rank's death --------------------------------------------------------
def test_a_rank_killed_while_idle_is_named_and_the_next_scenario_runs(world):
    runner.run([SMALL], "builtin", reporter=SilentReport(), world=world)  # healthy, idle
    victim = world._procs[2]
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(timeout=10)
    generation = world.generation
    result, v = _one(world, "builtin")
    assert v.status == "pass", v.headline()
    assert world.generation == generation + 1  # restarted before the scenario, not blamed on it
    [event] = result.info.world_events
    assert "rank 2 died between scenarios (killed by SIGKILL" in event and "restarted" in event
    assert "world, between scenarios" in runner_table(result)


def runner_table(result) -> str:
    from shardcheck.harness.controller.reports.run_report import render_table

    return render_table(result.verdicts, result.info)


def test_a_rank_killed_mid_scenario_is_named_with_the_memory_it_held(monkeypatch):
    kills = iter(range(100))
    monkeypatch.setattr(memory, "oom_kills", lambda: next(kills))  # the OOM killer ran meanwhile
    with SpawnedWorld(2, timeout=20) as world:
        def kill_rank_one() -> None:
            time.sleep(1.5)
            os.kill(world._procs[1].pid, signal.SIGKILL)

        import threading

        threading.Thread(target=kill_rank_one, daemon=True).start()
        _, v = _one(world, "plants:RankOneSleeps")
    head = v.failures[0].message
    assert "rank 1 died (killed by SIGKILL, by the out-of-memory killer; it held" in head, head
    assert "MiB when last seen" in head


# -- blame -----------------------------------------------------------------------------------------
def test_a_hang_names_the_rank_that_did_not_arrive_and_where_it_was(monkeypatch):
    with SpawnedWorld(2, timeout=2) as world:
        result, hung = _one(world, "plants:SpinsOnRankOne")
        head = hung.failures[0]
        assert head.ranks == [1] and head.message.startswith("rank 1 hung: it did not arrive where ranks [0]"), \
            [f.message for f in hung.failures]
        assert "plants.py" in head.message and "in compute" in head.message, head.message
        assert all("rank 0 hung" not in f.message for f in hung.failures)
        assert hung.seconds < 2 + 2  # ended when its peer gave up, not at the controller's deadline
        # the restart (made to take 3 s more) is reported on its own, not charged to the next scenario
        real_start = SpawnedWorld.start
        monkeypatch.setattr(SpawnedWorld, "start", lambda self: (time.sleep(3.0), real_start(self))[1])
        again, after = _one(world, "builtin", SMALL)
        assert len(again.info.startup_seconds) == 2 and after.status == "pass" and after.seconds < 3.0


def test_a_peer_still_working_when_a_rank_dies_is_given_its_time_not_called_hung():
    with SpawnedWorld(2, timeout=20) as world:
        _, v = _one(world, "plants:RankOneDiesWhileRankZeroWorks")
    text = " | ".join(f.message for f in v.failures)
    assert v.failures[0].message.startswith("rank 1 died (exit code 3)"), text
    assert "hung" not in text and v.seconds >= 3.0  # rank 0 finished its 3 s of work and stopped


def test_a_peer_that_never_answers_after_a_death_is_stopped_not_hung():
    with SpawnedWorld(2, timeout=2) as world:
        _, v = _one(world, "plants:RankOneDiesRankZeroSpins")
    text = " | ".join(f.message for f in v.failures)
    assert "rank 1 died (exit code 3)" in text and "rank 0 stopped after rank 1 died: no result within 4s" in text
    assert "hung" not in text


@pytest.mark.parametrize("plant,says", [
    ("ReturnsNone", "the target's compute returned None, not RankOutputs"),
    ("HalfOutputs", "log_probs of sample 0 is float16, coarser than the logits' float32"),
    ("LongOutputs", "log_probs of sample 0 is int64, not floating point"),
    ("DetachedOutputs", "entropy of sample 0 does not require grad: it is detached from the logits"),
    ("MetaOutputs", "log_probs of sample 0 is on meta, the logits on cpu"),
])
def test_a_malformed_output_is_the_targets_and_names_its_compute(world, plant, says):
    _, v = _one(world, f"plants:{plant}")
    head = v.failures[0]
    assert head.kind == "value_mismatch" and says in head.message, [f.message for f in v.failures]
    assert "tests/plants.py:" in head.message and "in compute" in head.message
    assert "harness/" not in head.message and head.ranks == [0, 1, 2, 3]


# -- a healthy run is not silent while its world starts ---------------------------------------------
def test_the_world_start_is_shown_while_it_happens():
    import io

    from shardcheck.harness.controller.reports.run_report import TerminalReport

    err = io.StringIO()
    result = runner.run([SMALL], "builtin", reporter=TerminalReport(out=io.StringIO(), err=err), nproc=2)
    assert result.exit_code == 0
    lines = err.getvalue().splitlines()
    starting = [i for i, ln in enumerate(lines) if ln == "shardcheck: starting 2 ranks ..."]
    progress = [i for i, ln in enumerate(lines) if "small" in ln and "passed" in ln]
    assert starting and progress and starting[0] < progress[0], lines


# -- nothing outlives the controller -----------------------------------------------------------------
@pytest.mark.parametrize("when", [1, 4, "mid-run"])
def test_a_controller_killed_during_start_up_leaves_no_rank(tmp_path, when):
    """Killed as soon as ``when`` processes are below it (1, the fork server still importing
    torch; 4, ranks forked and joining the world) or once a scenario is in its report: no
    process outlives it, and what its folders and report files held is removed by the next run
    (each is named after the controller that made it)."""
    from shardcheck.harness.controller.worlds import leftovers
    from shardcheck.harness.controller.reports.report_file import sweep_beside

    import shutil
    import tempfile
    from pathlib import Path

    # a short TMPDIR: the fork server's socket lives in the run's own folder there (a Unix
    # socket's path is short; under a longer TMPDIR multiprocessing keeps its own folder name)
    tmp = Path(tempfile.mkdtemp(prefix="sc-", dir="/tmp"))
    request_cleanup = lambda: shutil.rmtree(tmp, ignore_errors=True)  # noqa: E731
    env = dict(os.environ, PYTHONPATH=str(TESTS), TMPDIR=str(tmp))
    report = tmp_path / "out" / "r.json"
    report.parent.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "shardcheck", "run", "--suite", "smoke", "-q", "--json-report",
                             str(report)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen: set[int] = set()
    try:
        deadline = time.time() + 60

        def started() -> bool:
            if when == "mid-run":
                return report.exists() and '"verdict"' in report.read_text()
            return len(seen) >= when

        while time.time() < deadline and not started():
            seen |= descendants(proc.pid)
            time.sleep(0.01)
        assert started(), "the world did not start"
        proc.kill()
        proc.wait(timeout=10)
        seen |= descendants(proc.pid)
        deadline = time.time() + 20
        while time.time() < deadline and any(alive(p) for p in seen):
            time.sleep(0.1)
        assert not [p for p in seen if alive(p)], "processes outlived the controller"
        leftovers.sweep(str(tmp))  # what the next run does before it starts a world
        sweep_beside(str(report))  # ... and a report's writer beside its path
        assert [p.name for p in tmp.iterdir() if p.name.startswith(("shardcheck-", "pymp-"))] == [], \
            "a folder outlived the controller"
        assert [p.name for p in report.parent.iterdir()] in ([], ["r.json"])
    finally:
        if proc.poll() is None:
            proc.kill()
        request_cleanup()


def test_nothing_of_a_finished_run_outlives_it(tmp_path):
    """After a command with a world returns, no process of its session is left running: the fork
    server used to spend a second or more tearing torch down after the command had exited."""
    (tmp_path / "s.json").write_text('{"name": "small", "samples": [[6, 2]], "vocab": 8, "tp": 2}')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    with open(tmp_path / "out", "w") as out:  # a file, not a pipe: a pipe's reader would wait for every holder
        proc = subprocess.Popen([sys.executable, "-m", "shardcheck", "run", "--scenario-file",
                                 str(tmp_path / "s.json"), "-q"], stdout=out, stderr=out, env=env,
                                start_new_session=True)
        proc.wait(timeout=120)
    assert proc.returncode == 0, (tmp_path / "out").read_text()
    session = proc.pid  # its own session: every process it started is in it
    time.sleep(0.3)
    left = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == session and fields[0] != "Z":  # field 6 of stat: the session id
                left.append(int(entry))
    assert left == [], [open(f"/proc/{p}/cmdline").read().replace("\0", " ")[:120] for p in left]


# -- report files: nothing the user owns replaced, nothing left, a failed write said -----------------
SKIPPED_BY_TP1 = ('{"name": "tp2", "samples": [[6, 2]], "vocab": 8, "tp": 2}')  # plants:SamplingTp1 skips it


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".") or p.suffix in (".tmp", ".old"))


@pytest.mark.parametrize("option", ["--json-report", "--html-report"])
def test_a_report_path_that_is_not_a_regular_file_is_refused_and_left_as_it_is(tmp_path, cli_in_process, option):
    import stat

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    nodes = [fifo]
    try:  # a full-device node of the test's own (never the machine's /dev/full), where it may make one
        os.mknod(tmp_path / "full", 0o600 | stat.S_IFCHR, os.makedev(1, 7))
        nodes.append(tmp_path / "full")
    except (PermissionError, OSError):
        pass
    for node in nodes:
        kind = stat.S_IFMT(os.stat(node).st_mode)
        proc = cli_in_process("run", "--target", "builtin", option, str(node))
        assert proc.returncode == 2 and "is not a regular file" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
        assert stat.S_IFMT(os.stat(node).st_mode) == kind  # still the FIFO / the device
    directory = tmp_path / "dir"
    directory.mkdir()
    proc = cli_in_process("run", "--target", "builtin", "--json-report", str(directory))
    assert proc.returncode == 2 and "is a directory" in proc.stderr
    assert _leftovers(tmp_path) == []


def test_two_reports_on_one_path_both_work_and_leave_nothing_beside_it(tmp_path):
    from shardcheck.harness.controller.reports.run_report import JsonReport
    from shardcheck.harness.controller.reports.verdict import PASS, Verdict

    path = tmp_path / "r.json"
    first, second = JsonReport(str(path), {"suite": "a"}), JsonReport(str(path), {"suite": "b"})
    sc = Scenario("x", (Sample(6, 2),), vocab=8)
    for report in (first, second, first, second):
        report.add(Verdict(sc, PASS))
    first.finish(runner.RunInfo({}, "builtin", 1, "gloo", "", True))
    second.finish(runner.RunInfo({}, "builtin", 1, "gloo", "", True))
    assert first.failed is None and second.failed is None
    import json

    assert json.loads(path.read_text())["suite"] == "b"  # the last to finish leaves its report
    assert _leftovers(tmp_path) == []


def test_both_reports_get_the_umasks_mode(tmp_path, cli_in_process):
    from shardcheck.harness.controller.reports.report_file import report_mode

    (tmp_path / "s.json").write_text(SKIPPED_BY_TP1)
    old = os.umask(0o027)
    try:
        proc = cli_in_process("run", "--target", "plants:SamplingTp1", "--scenario-file", str(tmp_path / "s.json"),
                              "--json-report", str(tmp_path / "r.json"), "--html-report", str(tmp_path / "r.html"),
                              "--allow-all-skipped")
        assert proc.returncode == 0, proc.stderr
        assert report_mode() == 0o640
    finally:
        os.umask(old)
    assert {os.stat(tmp_path / n).st_mode & 0o777 for n in ("r.json", "r.html")} == {0o640}
    assert _leftovers(tmp_path) == []


def test_a_report_write_that_fails_is_one_line_exit_2_and_the_run_goes_on(tmp_path, cli_in_process, monkeypatch):
    import errno

    from shardcheck.harness.controller.reports import run_report as report

    (tmp_path / "s.json").write_text(SKIPPED_BY_TP1)
    real, calls = report._write_all, []

    def disk_full(fd, parts, offset):
        calls.append(offset)
        if len(calls) > 1:  # the first write (before the run) goes through; the disk fills up after
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, parts, offset)

    monkeypatch.setattr(report, "_write_all", disk_full)
    proc = cli_in_process("run", "--target", "plants:SamplingTp1", "--scenario-file", str(tmp_path / "s.json"),
                          "--json-report", str(tmp_path / "r.json"), "--allow-all-skipped")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    said = f"shardcheck: error: cannot write the JSON report {str(tmp_path / 'r.json')!r}: No space left on device"
    assert proc.stderr.strip().splitlines()[-1] == said and proc.stderr.count("error") == 1, proc.stderr
    assert len(calls) == 2  # after the failed write none is tried again; the run finished (exit 2 comes after it)
    assert _leftovers(tmp_path) == []


def test_a_session_page_whose_write_fails_keeps_one_line_and_tries_no_more(tmp_path, monkeypatch):
    import errno

    from shardcheck.harness.controller.reports import html_report

    calls = []

    def disk_full(path, *args):
        calls.append(path)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(html_report, "write_verdicts", disk_full)
    page = html_report.SessionHtmlReport(str(tmp_path / "p.html"))
    page.close()
    page.close()
    assert page.failed == f"cannot write the HTML report {str(tmp_path / 'p.html')!r}: No space left on device"
    assert len(calls) == 1


def test_hidden_and_reordering_characters_in_names_are_shown_escaped(tmp_path, cli_in_process):
    """A name ending in 'gnp.exe' after a right-to-left override reads 'exe.png' when printed raw;
    it is shown as what it is, in the terminal and the HTML page, and the columns stay aligned."""
    import json

    name = "x\u202egnp.exe"
    (tmp_path / "s.json").write_text(json.dumps({"name": name, "samples": [[6, 2]], "vocab": 8, "tp": 2}))
    proc = cli_in_process("run", "--target", "plants:SamplingTp1", "--scenario-file", str(tmp_path / "s.json"),
                          "--html-report", str(tmp_path / "r.html"), "--allow-all-skipped")
    assert proc.returncode == 0, proc.stderr
    page = (tmp_path / "r.html").read_text()
    assert "\u202e" not in page and "x\\u202egnp.exe" in page
    from shardcheck.harness.controller.reports.run_report import render_table, visible
    from shardcheck.harness.controller.reports.verdict import SKIP, Verdict

    assert visible(name) == "x\\u202egnp.exe" and visible("a\tb\nc") == "a\tb\nc"
    table = render_table([Verdict(Scenario(name, (Sample(6, 2),), vocab=8), SKIP, reason="r")],
                         runner.RunInfo({}, "builtin", 1, "gloo", "", True))
    assert "\u202e" not in table and "x\\u202egnp.exe" in table


def test_a_newline_in_a_name_is_escaped_in_the_table_the_progress_line_and_the_failure():
    """A name holding a newline split the table row and the progress line in two; it is shown as
    one line, the newline (and a tab) escaped, everywhere the terminal prints it."""
    import io

    from shardcheck.harness.controller.reports.run_report import TerminalReport, render_failure, render_table
    from shardcheck.harness.controller.reports.verdict import FAIL, SKIP, Verdict

    sc = Scenario("two\nlines\tand a tab", (Sample(6, 2),), vocab=8)
    shown = "two\\nlines\\tand a tab"
    info = runner.RunInfo({}, "builtin", 1, "gloo", "", True)
    table = render_table([Verdict(sc, SKIP, reason="r")], info)
    assert table.splitlines()[2].startswith(shown + "  "), table
    err = io.StringIO()
    progress = TerminalReport(out=io.StringIO(), err=err)
    progress.start(info, [sc])
    progress.add(Verdict(sc, SKIP, reason="r"))
    assert err.getvalue().splitlines()[-1].endswith(f"skip {shown}"), err.getvalue()
    assert render_failure(Verdict(sc, FAIL)).splitlines()[0].startswith(f"FAILED {shown}  (")


# -- large scenario files: said while read, counted in the summary, memory of the scenarios only -----
def test_a_large_scenario_file_is_said_while_it_is_read(tmp_path, cli_in_process, monkeypatch):
    """Reading and validating 509,018 scenarios took 37 s of silence; now a line comes every
    PROGRESS_EVERY seconds (0 here: one per scenario) before any world starts."""
    import json

    from shardcheck.scenarios import suites

    monkeypatch.setattr(suites, "PROGRESS_EVERY", 0.0)
    entries = [{"name": f"s{i}", "samples": [[6, 2]], "vocab": 8} for i in range(3)]
    entries.append({"name": "bad", "samples": [[-5, 2]], "vocab": 8})  # refused after the three are read
    text = json.dumps(entries)
    (tmp_path / "s.json").write_text(text)
    proc = cli_in_process("run", "--scenario-file", str(tmp_path / "s.json"))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    # where in the file each entry ends, written out: '[' then the entries joined by ', '
    ends = [len("[" + ", ".join(json.dumps(e) for e in entries[:k])) for k in (1, 2, 3)]
    assert [ln.split(": ")[2] for ln in lines[:3]] == [f"{k} scenarios, {end * 100 // len(text)} % of the file ..."
                                                       for k, end in zip((1, 2, 3), ends)], lines
    assert lines[0].startswith(f"shardcheck: reading {tmp_path / 's.json'}: ")
    assert lines[-1].endswith("entry 3: scenario 'bad': sample 0: total length -5 must be at least 2 "
                              "(a prompt token and a response token)"), lines


def test_reading_a_scenario_file_holds_the_scenarios_not_the_document(tmp_path):
    """Memory while reading grows by the scenarios kept, not by the file parsed whole (json.loads
    of it held every entry as dicts and the text at once: 540 MB for a 46 MB file)."""
    import json
    import tracemalloc

    from shardcheck.scenarios import load_scenario_file

    path = tmp_path / "s.json"
    path.write_text(json.dumps([{"name": f"s{i}", "samples": [[6 + i % 9, 2]], "vocab": 8,
                                 "description": "x" * 200} for i in range(20000)]))  # 5.1 MB
    tracemalloc.start()
    try:
        scenarios = load_scenario_file(path)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(scenarios) == 20000 and scenarios[-1].name == "s19999"
    # beyond what it keeps: a chunk of the file (256 KiB, as bytes and as text) and one entry
    assert peak - kept < 2 * 2**20, f"read with {(peak - kept) / 2**20:.1f} MiB beyond the {kept / 2**20:.1f} MiB kept"


def test_a_run_stopped_early_says_how_many_of_how_many(world):
    import io

    from shardcheck.harness.controller.reports.run_report import TerminalReport

    class StopAfterOne(TerminalReport):
        def add(self, verdict):
            super().add(verdict)
            raise KeyboardInterrupt  # as Ctrl-C after the first verdict

    out = io.StringIO()
    scenarios = [Scenario(f"small{i}", (Sample(6, 2),), vocab=8, tp=2, seed=i) for i in range(3)]
    with pytest.raises(KeyboardInterrupt):
        runner.run(scenarios, "builtin", reporter=StopAfterOne(out=out, err=io.StringIO()), world=world)
    assert "\n1 of 3 scenarios: 1 passed, 0 failed, 0 skipped in " in out.getvalue(), out.getvalue()


# -- blame: deadlines follow progress; a busy machine's deadline is not the target's -------------
REPLICAS_TP2 = Scenario("replicas", (Sample(7, 3), Sample(8, 5)), vocab=8, tp=2, seed=3)  # sample 1 token 3: CorruptValue's
TP2CP2 = Scenario("tp2cp2", (Sample(12, 4), Sample(9, 3)), vocab=8, tp=2, cp=2, layout="zigzag", seed=1)


def test_ranks_still_issuing_calls_are_not_hung():
    """Ranks 2 and 3 take 4 s of calls among themselves while ranks 0 and 1 wait for them, with
    a 1 s timeout: the wait (lockstep's and the controller's) runs from the last call anywhere."""
    with SpawnedWorld(4, timeout=1) as world:
        _, v = _one(world, "plants:CallsElsewhereWhilePeersWait", TP2CP2)
    assert v.status == "pass", [f.message for f in v.failures]
    assert v.seconds > 4.0


@pytest.mark.calm
@pytest.mark.parametrize("loaded", [False, True], ids=["quiet", "loaded"])
def test_the_rank_that_did_not_come_heads_the_verdict_when_replicas_finished(loaded):
    """World 4 at tp 2: ranks 2 and 3 (a data-parallel replica) finish; rank 0 waits for rank 1,
    which spins. The first line blames rank 1, at once (not at the controller's deadline), and
    says it was busy. The same with the machine loaded (two busy processes a core, started here):
    the spinning rank waits for a CPU much of the time, but it runs its share of one, so the
    deadline is the target's, not the machine's (timeout, as it was at load 3 to 15). Calm: no
    background run beside it."""
    from plants import machine_loaded

    with machine_loaded() if loaded else contextlib.nullcontext(), SpawnedWorld(4, timeout=2) as world:
        _, v = _one(world, "plants:SpinsOnRankOne")
    head = v.failures[0]
    assert head.ranks == [1] and head.message.startswith("rank 1 hung: it did not arrive where ranks [0]"), \
        [f.message for f in v.failures]
    assert "; busy: it ran " in head.message and "without reaching a call" in head.message, head.message
    assert v.status == "fail" and v.seconds < 2 + (6 if loaded else 2)


@pytest.mark.skipif(not os.path.exists("/proc/self/task/%d/schedstat" % os.getpid()),
                    reason="no schedstat: how long a rank waited for a CPU cannot be known here")
@pytest.mark.calm
def test_a_deadline_missed_while_waiting_for_a_cpu_is_the_machines_and_a_wrong_value_beside_it_the_targets():
    """Two replicas (world 4 at tp 2). Rank 1 runs at SCHED_IDLE on a CPU a busy process holds: it
    waits for the CPU, rank 0 for it; that replica's missed deadline is the machine's (timeout,
    rank 0's wait not blamed on anyone). The other replica finds a wrong value: the verdict is the
    target's (fail, exit status 1), whatever else timed out. (A verdict of missed deadlines alone is
    timeout, exit status 3: tests/test_verdict.py, and end to end tests/test_simulate.py.) Without
    the busy process the starved target passes. The machine is loaded by the test besides (a busy
    process a core beside the hog: as many busy processes as cores and one more)."""
    from plants import hog_cpu, machine_loaded

    with SpawnedWorld(4, timeout=2) as world:
        world.ensure_ready()  # started before the load: its start-up is not what is tested
        hog = subprocess.Popen([sys.executable, "-c", "import os\nos.sched_setaffinity(0, {%d})\nwhile True: pass"
                                % hog_cpu()])
        try:
            with machine_loaded(per_core=1):
                result, v = _one(world, "plants:StarvedOnRankOneCorruptValue", REPLICAS_TP2)
        finally:
            hog.kill()
            hog.wait()
    said = [(f.kind, f.ranks, f.message) for f in v.failures]
    assert v.status == "fail" and result.exit_code == 1, said
    by_kind = {f.kind: f for f in v.failures}
    assert sorted(by_kind) == ["rank_error", "timeout", "value_mismatch"], said
    starved, waited, wrong = by_kind["timeout"], by_kind["rank_error"], by_kind["value_mismatch"]
    assert starved.ranks == [1] and "for a CPU" in starved.message, starved.message
    assert waited.ranks == [0] and "waited_for" in waited.details and not waited.details.get("blamed"), waited.message
    assert wrong.ranks == [2, 3] and wrong.message.startswith("log_probs sample 1 token 3: got "), wrong.message
    with SpawnedWorld(2, timeout=2) as world:
        _, calm = _one(world, "plants:StarvedOnRankOne")
    assert calm.status == "pass", [f.message for f in calm.failures]


# -- messages that point the right way: the write that changed the bits, digits that differ, the
# same check switches on every command, a detached output named where it left the graph ----------
MSG_SC = Scenario("m", (Sample(9, 5), Sample(6, 3)), vocab=16, tp=2, entropy_coef=0.1, seed=3)


def _line_of(obj, text: str) -> str:
    """``tests/plants.py:LINE`` of the first line of ``obj``'s source holding ``text``."""
    lines, first = inspect.getsourcelines(obj)
    k = next(i for i, ln in enumerate(lines) if text in ln)
    return f"plants.py:{first + k}"


def _shown(message: str) -> tuple[str, str, str]:
    """(was, now, what follows) as an input_mutated message writes them."""
    inside = message.split("(was ", 1)[1]
    was, rest = inside.split(", now ", 1)
    now, rest = rest.split(" ", 1)
    return was, now, rest


# -- input_mutated: the write that changed it, and values that read apart ---------------------------
@pytest.mark.world
def test_the_write_named_is_the_backward_one_that_changed_the_logits_not_a_division_by_one(world):
    """verl's engine divides the logits by a temperature of 1.0 in place (no bit changes), then
    its entropy backward changes them: the message named the division. Here two no-op divisions
    in the forward, then a one-ulp write in the backward."""
    [v] = runner.run([MSG_SC], "plants:NoOpWritesThenOneUlpInBackward", reporter=SilentReport(), world=world).verdicts
    assert v.kinds == ["input_mutated"], [f.message for f in v.failures]  # values and gradients are right
    changed_at = _line_of(plants._NudgesSavedLogitsInBackward, "the planted write")
    noops = [_line_of(plants.NoOpWritesThenOneUlpInBackward, "first no-op"),
             _line_of(plants.NoOpWritesThenOneUlpInBackward, "the second")]
    for f in v.failures:
        assert (f.field, f.phase, f.details["write_phase"]) == ("logits", "backward", "backward")
        assert f.details["op"] == "aten.copy_.default" and f.details["site"][0].endswith(changed_at), f.details
        assert f.details["changed"] == 1 and f.details["unchanged_writes"] == 2
        said = f.message.split("; ", 1)[1]
        assert said.startswith(f"first in-place write that changed it: aten.copy_.default at tests/{changed_at} "
                               "in backward; 2 earlier in-place writes left it unchanged: aten.div_."), f.message
        assert all(f"tests/{line} in forward" in said for line in noops), f.message
        # one ulp up, in float32: read apart, each as its own float32
        assert np.nextafter(np.float32(f.want), np.float32(np.inf)) == np.float32(f.got)
        was, now, rest = _shown(f.message)
        assert was != now and rest.startswith("(1 ulp of float32))"), f.message
        assert (np.float32(float(was)), np.float32(float(now))) == (np.float32(f.want), np.float32(f.got))


# -- the check switches on every command ---------------------------------------------------------------
@pytest.mark.parametrize("command", [["fuzz"], ["simulate"], ["invariance"]])
def test_every_command_that_checks_a_target_takes_no_inplace(command):
    args = build_parser().parse_args([*command, "--target", "builtin", "--no-inplace"])
    assert args.no_inplace is True


def test_the_replay_line_of_a_search_keeps_no_inplace():
    from shardcheck.cli import _target_args

    args = build_parser().parse_args(["fuzz", "--target", "builtin", "--no-inplace", "--target-opt", "a=b"])
    assert _target_args(args) == ["--no-inplace", "--target-opt", "a=b"]


@pytest.mark.world
def test_fuzz_without_the_input_check_looks_past_a_known_write_and_finds_the_wrong_value(world):
    """The plant scales the gradient fed into its log-probs in place in every scenario, and is wrong
    at sample 1 token 3 only. With the input check the search stops at the first scenario drawn;
    without it, it finds the value. (About 20 s: a search, then its shrinking.)"""
    common = dict(max_examples=25, seed=2, tp=(1,), cp=(1,), layouts=["thd"], world=world, database=None,
                  max_shrinks=8)
    blind = fuzz.fuzz("plants:GradScaledInPlaceAndCorruptValue", inplace=False, **common)
    assert blind.failure is not None and "input_mutated" not in blind.failure.kinds
    assert "value_mismatch" in blind.failure.kinds and blind.searched > 1, blind.failure.headline()
    seeing = fuzz.fuzz("plants:GradScaledInPlaceAndCorruptValue", **dict(common, max_examples=1, max_shrinks=0))
    assert seeing.searched == 1 and "input_mutated" in seeing.failure.kinds


@pytest.mark.world
@pytest.mark.world
def test_the_pytest_session_takes_the_switch_to_its_runs(world):
    from shardcheck.pytest_plugin import ShardcheckSession

    sc = Scenario.from_dict(dict(MSG_SC.to_dict(), temperature=0.9))
    assert ShardcheckSession(world, "builtin:inplace_temperature").run(sc).kinds == ["input_mutated"]
    assert ShardcheckSession(world, "builtin:inplace_temperature", inplace=False).run(sc).status == "pass"


def test_the_pytest_plugin_offers_the_switch():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--help"], capture_output=True,
                          text=True, cwd="/", env=env, timeout=120)
    assert "--shardcheck-no-inplace" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


# -- a detached output: where it left the graph, as a graph problem -------------------------------------
@pytest.mark.world
def test_a_detached_entropy_names_the_line_that_cut_it_not_the_adapters_compute(world):
    """The entropy is made under torch.no_grad() in a function of the target's (the framework's):
    that function's line is named, the values are said to be right, and no value is called wrong."""
    [v] = runner.run([MSG_SC], "plants:EntropyLeftGraphInFramework", reporter=SilentReport(), world=world).verdicts
    [head] = [f for f in v.failures if f.field == "entropy"]
    cut = _line_of(plants._framework_entropy_for_logging, "the planted cut")
    assert head.details["malformed"] == "detached" and head.details["graph_op"] == "Tensor.clone"
    assert head.message.startswith("entropy of sample 0 does not require grad"), head.message
    assert (f"a problem of the autograd graph, not of the values): it left the graph at tests/{cut} in "
            "_framework_entropy_for_logging") in head.message
    assert "(Tensor.clone under torch.no_grad())" in head.message
    assert head.message.endswith("; its values match the reference"), head.message
    compute = _line_of(plants.EntropyLeftGraphInFramework, "def compute")
    assert f"tests/{compute}" not in head.message  # the adapter's compute is where it was called from, not the cut
    # the values are right: what else fails is the gradient the entropy term should have carried
    assert set(v.kinds) == {"value_mismatch", "grad_mismatch"}
    assert [f for f in v.failures if f.kind == "value_mismatch" and "malformed" not in f.details] == []


@pytest.mark.world
def test_a_detach_in_compute_is_named_at_its_line(world):
    [v] = runner.run([MSG_SC], "plants:DetachedOutputs", reporter=SilentReport(), world=world).verdicts
    [head] = [f for f in v.failures if f.details.get("malformed") == "detached"]
    line = _line_of(plants.DetachedOutputs, "e.detach()")
    assert f"it left the graph at tests/{line} in compute" in head.message and "(Tensor.detach)" in head.message


# -- the real cases, on a framework checkout -------------------------------------------------------------
VERL_SRC = os.environ.get("SHARDCHECK_VERL_SRC")


@pytest.mark.world
@pytest.mark.skipif(not VERL_SRC, reason="SHARDCHECK_VERL_SRC is not set: no verl checkout to check")
def test_verls_division_by_a_temperature_of_one_is_not_named_for_its_entropy_backwards_write(world, tmp_path):
    """verl's engine divides the logits by the temperature in place (1.0: nothing changes), then
    _VocabParallelEntropy.backward subtracts from and adds back to them, not exactly. The write
    named is the backward's in tensor_parallel.py; the division is counted as harmless. (Slow:
    the ranks import verl and megatron-core.)"""
    from shardcheck.targets.verl import detect_era, source

    era = detect_era(source())
    if "engine" not in era.call_sites:
        pytest.skip("this verl commit has no engine call site (the temperature division in place)")
    sc = Scenario("verl-t1", (Sample(9, 5), Sample(6, 3)), vocab=32, entropy_coef=0.1, temperature=1.0, seed=5)
    [v] = runner.run([sc], "shardcheck.targets.verl:VerlActorTarget", reporter=SilentReport(), world=world).verdicts
    found = [f for f in v.failures if f.kind == "input_mutated" and f.field == "logits"]
    assert found, v.headline()
    for f in found:
        assert f.phase == "backward" and f.details["write_phase"] == "backward", f.message
        assert "tensor_parallel.py" in f.details["site"][0], f.details
        assert f.details["unchanged_writes"] >= 1 and "aten.div_" in f.details["unchanged"][0], f.details
        assert "transformer_impl.py" in f.details["unchanged"][0]
        was, now, _ = _shown(f.message)
        assert was != now, f.message
