"""``shardcheck sweep``: the timeline from tables of cells (no world); on a throwaway git history of a
fake slime (test_bisect's: its log-prob function delegates to the builtin), one bug planted and
fixed, one commit that cannot be imported and one that touches no file the target reaches: the
sweep end to end on a real world, its cache, its reports, the clone left as it was, Ctrl-C, and bad
input in one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from shardcheck.harness.controller.commands import commit_check, sweep_cache
from shardcheck.harness.controller.commands import sweep as engine
from shardcheck.harness.controller.reports.sweep_timeline import (CANNOT_RUN, FAIL, PASS, SKIP, Cell, Commit,
                                                                  SweepResult, message_key, timeline)
from test_bisect import LOSS, _commit, fake_slime_repo

SCENARIO = ["--suite", "smoke", "--scenario", "thd-tp1cp1-basic"]


def _result(table: dict[str, list[Cell]]) -> SweepResult:
    n = len(next(iter(table.values())))
    commits = [Commit(f"{i:040x}", f"2025-07-{i + 1:02d}T00:00:00+00:00", f"c{i}") for i in range(n)]
    cells = {c.sha: {name: row[i] for name, row in table.items()} for i, c in enumerate(commits)}
    return SweepResult(commits, list(table), cells)


BUG = Cell(FAIL, (("value_mismatch", "forward", "log_probs sample # token #"),))
HANG = Cell(FAIL, (("collective_mismatch", "backward", "cp group [#, #] call #"),))
OK, NO, SKIPPED = Cell(PASS), Cell(CANNOT_RUN, why="cannot be imported"), Cell(SKIP, why="no such layout")


def test_an_interval_ends_at_the_first_good_commit_and_one_still_failing_is_open():
    result = _result({"a": [OK, BUG, BUG, OK, HANG], "b": [OK, OK, OK, OK, OK]})
    fixed, still = timeline(result)
    assert (fixed.first_bad.subject, fixed.last_bad.subject, fixed.first_good.subject) == ("c1", "c2", "c3")
    assert still.open and still.first_bad.subject == "c4" and still.signature.kind == "collective_mismatch"


def test_an_interval_ends_as_fixed_as_giving_way_or_as_unresolved_when_the_scenario_stops_running():
    """A first good commit where the scenario fails otherwise is no fix; a signature last seen before
    the scenario stops running (its layout gone) is not open at the newest commit."""
    (gives_way, then) = timeline(_result({"a": [OK, BUG, HANG, OK]}))
    assert gives_way.state == "changed" and gives_way.first_good.subject == "c2"
    assert then.state == "fixed" and then.first_good.subject == "c3"
    (gone,) = timeline(_result({"a": [OK, BUG, BUG, SKIPPED, NO]}))
    assert gone.state == "unresolved" and not gone.open and [c.subject for c in gone.after] == ["c3", "c4"]
    (still,) = timeline(_result({"a": [OK, BUG, SKIPPED, BUG]}))
    assert still.state == "open" and still.open and still.after == []


def test_a_commit_that_cannot_run_or_skips_neither_ends_nor_starts_an_interval():
    """Inside a failing run, a commit that cannot run is unknown, never a pass; before one, it makes
    the start inexact ("or earlier")."""
    (iv,) = timeline(_result({"a": [OK, BUG, NO, SKIPPED, BUG, OK]}))
    assert (iv.first_bad.subject, iv.first_good.subject) == ("c1", "c5")
    assert [c.subject for c in iv.unknown] == ["c2", "c3"] and not iv.before_unknown
    (late,) = timeline(_result({"a": [OK, NO, BUG]}))
    assert late.first_bad.subject == "c2" and late.before_unknown
    assert timeline(_result({"a": [NO, NO, OK]})) == []


def test_the_signature_keeps_what_went_wrong_and_drops_what_varies_by_rank_and_run():
    one = message_key("cp group [0, 1] call 0: rank 0 finished the scenario after 0 calls; rank 1 all_reduce at x.py:3")
    other = message_key("cp group [2, 3] call 0: rank 2 finished the scenario after 0 calls")
    assert one == other == "cp group [#, #] call #"
    assert message_key("log_probs sample 1 token 3: got -0.25, want -0.75 (2 ulps)") == "log_probs sample # token #"
    assert message_key("entropy sample 1 token 3: got 1") != message_key("log_probs sample 1 token 3: got 1")


def test_a_cell_is_the_same_whichever_rank_reports_first():
    """Ranks raising different errors report in the order they finish (verl's engine on a sequence
    shorter than the CP alignment: RuntimeError on ranks 2, 3 and IndexError on 0, 1); the cell
    takes the lowest rank's, so the signature does not change from run to run."""
    from shardcheck.harness.controller.reports.sweep_timeline import cells_of
    from shardcheck.harness.controller.reports.verdict import Verdict
    from shardcheck.harness.wire import Failure
    from shardcheck.scenarios import Sample, Scenario

    late = Failure("rank_error", "raised RuntimeError: The expanded size of the tensor (2) at util.py:336", [2, 3])
    early = Failure("rank_error", "raised IndexError: index 2 is out of bounds at util.py:351", [0, 1])
    sc = Scenario("short2", (Sample(2, 1),), vocab=8)
    one, other = (cells_of([Verdict(sc, "fail", failures)])["short2"] for failures in ([late, early], [early, late]))
    assert one == other == Cell(FAIL, (("rank_error", "", "raised IndexError"),))


def test_a_file_moved_since_is_selected_by_its_commits_under_its_old_name_too(tmp_path):
    """NeMo-RL moved dtensor_policy_worker.py into workers/: a log of the new path alone misses
    every commit before the move (#714's fix among them)."""
    repo = tmp_path / "moved"
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "worker.py").write_text("x = 1\n")
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "before the move"], check=True)
    (repo / "workers").mkdir()
    subprocess.run(git + ["mv", "worker.py", "workers/worker.py"], check=True)
    subprocess.run(git + ["commit", "-qm", "the move"], check=True)
    (repo / "workers" / "worker.py").write_text("x = 2\n")
    subprocess.run(git + ["commit", "-qam", "after the move"], check=True)
    files = engine.with_earlier_names(repo, None, ["workers/worker.py"])
    assert files == ["worker.py", "workers/worker.py"]
    subjects = lambda names: [c.subject for c in engine.select_commits(repo, names, tags={})]  # noqa: E731
    assert subjects(["workers/worker.py"]) == ["the move", "after the move"]
    assert subjects(files) == ["before the move", "the move", "after the move"]


def test_earlier_names_are_followed_in_a_clone_lacking_a_blob(tmp_path):
    """SkyRL's mirror lacks its images' blobs: git's rename detection cannot score a deleted image
    against an added file, and --follow fails; the moves that kept a file's contents are still
    followed (compared by hash), so the sweep goes on."""
    repo = tmp_path / "partial"
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "old.svg").write_text("<svg>" + "x" * 200 + "</svg>\n")
    (repo / "worker.py").write_text("x = 1\n")
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "c1"], check=True)
    oid = subprocess.run(git + ["rev-parse", "HEAD:old.svg"], capture_output=True, text=True).stdout.strip()
    (repo / "old.svg").unlink()
    (repo / "pkg").mkdir()
    subprocess.run(git + ["mv", "worker.py", "pkg/worker.py"], check=True)
    (repo / "new.py").write_text("y = 2\n")
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "c2"], check=True)
    (repo / ".git" / "objects" / oid[:2] / oid[2:]).unlink()
    follow = subprocess.run(git + ["log", "--follow", "--format=", "--name-only", "--", "new.py"], capture_output=True)
    assert follow.returncode != 0  # what git itself does here
    assert engine.with_earlier_names(repo, None, ["new.py", "pkg/worker.py"]) == ["new.py", "pkg/worker.py",
                                                                                  "worker.py"]


def make_history(root: Path) -> tuple[Path, dict[str, str]]:
    """c1 correct, c2 does not import, c3 correct, c4 plants a bug (tagged v1), c5 touches only a
    README, c6 fixes the bug (tagged v2)."""
    repo = fake_slime_repo(root)
    good = LOSS.format(bug="0.0")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    c = {"c1": _commit(repo, "c1 correct", good), "c2": _commit(repo, "c2 does not import", good + "\ndef broken(:\n"),
         "c3": _commit(repo, "c3 correct again", good + "\n# tidy\n"),
         "c4": _commit(repo, "c4 plants a bug", LOSS.format(bug="0.5"))}
    subprocess.run(git + ["tag", "v1"], check=True)
    (repo / "README").write_text("unrelated\n")
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "c5 readme"], check=True)
    c["c6"] = _commit(repo, "c6 fixes the bug", good + "\n# fixed\n")
    subprocess.run(git + ["tag", "-a", "v2", "-m", "release 2"], check=True)
    return repo, c


@pytest.fixture
def history(tmp_path):
    return make_history(tmp_path)


def _state(repo: Path) -> tuple[str, str, list[str]]:
    status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--ignored"], capture_output=True,
                            text=True).stdout
    refs = subprocess.run(["git", "-C", str(repo), "show-ref"], capture_output=True, text=True).stdout
    return status, refs, sorted(str(p.relative_to(repo)) for p in repo.rglob("*") if ".git" not in p.parts)


def _scratch() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("shardcheck-sweep-*")}


def _sweep_cli(*args: str) -> subprocess.Popen:
    """``shardcheck sweep ARGS`` as a terminal runs it: SIGINT's handler Python's default (a process
    started from a background thread or an xdist worker may inherit SIGINT ignored), in a session
    of its own, so that a Ctrl-C can reach its whole process group."""
    from conftest import cli_env

    launch = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
              "os.execv(sys.executable, [sys.executable, '-m', 'shardcheck', 'sweep', *sys.argv[1:]])")
    return subprocess.Popen([sys.executable, "-c", launch, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=cli_env())


def _sweeps(folder: Path) -> dict:
    """The sweep of the history with every report, the same sweep again (its cache full), and one
    interrupted by SIGINT after its first commit: subprocesses, run while other tests go on."""
    repo, c = make_history(folder)
    out: dict = {"repo": str(repo), "commits": c, "scratch_before": _scratch()}
    before = _state(repo)
    args = ["--target", "slime", "--src-repo", str(repo), *SCENARIO]
    first = _sweep_cli(*args, "--cache", str(folder / "cache"), "--tags", "--json", str(folder / "s.json"),
                       "--html", str(folder / "s.html"))
    out["first"] = (*first.communicate(timeout=240), first.returncode)
    out["json"], out["html"] = json.loads((folder / "s.json").read_text()), (folder / "s.html").read_text()
    again = _sweep_cli(*args, "--cache", str(folder / "cache"), "--json", str(folder / "again.json"))
    out["again"] = (*again.communicate(timeout=120), again.returncode)
    out["again_json"] = json.loads((folder / "again.json").read_text())
    out["repo_unchanged"] = _state(repo) == before
    proc = _sweep_cli(*args, "--cache", str(folder / "cache2"), "--json", str(folder / "int.json"))
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "[1/5]" in line:
                break
        os.killpg(proc.pid, signal.SIGINT)
        stdout, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    deadline = time.time() + 10
    while subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True).returncode == 0 and time.time() < deadline:
        time.sleep(0.2)
    out["interrupted"] = {"code": proc.returncode, "stdout": stdout,
                          "json": json.loads((folder / "int.json").read_text()),
                          "left": subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True).returncode == 0,
                          "kept": len([p for p in (folder / "cache2").rglob("*.json") if p.name != "configuration.json"])}
    out["scratch_after"] = _scratch()
    return out


BACKGROUND = {"sweep-history": (_sweeps, 600)}


@pytest.mark.background("sweep-history")
def test_the_sweep_finds_the_bug_from_its_commit_to_its_fix_and_a_second_sweep_runs_nothing(background):
    """End to end on a real world: 5 commits selected (c5 touches no reached file), c4 -> c6 the one
    interval, carried by release v1 and not v2, c2 shown as cannot run; every cell in the JSON, the
    HTML's cells link to their replay and repro lines; the clone unchanged, no scratch folder left.
    The same sweep again takes every cell from the cache and starts no world."""
    done = background("sweep-history")
    c = done["commits"]
    stdout, stderr, code = done["first"]
    assert code == 0, stderr[-2000:]
    doc = done["json"]
    assert [x["subject"] for x in doc["commits"]] == ["c1 correct", "c2 does not import", "c3 correct again",
                                                      "c4 plants a bug", "c6 fixes the bug"]
    states = [x["cells"]["thd-tp1cp1-basic"]["state"] for x in doc["commits"]]
    assert states == [PASS, CANNOT_RUN, PASS, FAIL, PASS], states
    (iv,) = doc["intervals"]
    assert (iv["first_bad"]["sha"], iv["first_good"]["sha"]) == (c["c4"], c["c6"]) and iv["releases"] == ["v1"]
    assert doc["cells_run"] == 5
    assert f"fixed at {c['c6'][:10]}" in stdout and "releases: v1" in stdout
    assert "could not run at all (never counted as passes)" in stdout
    html = done["html"]
    assert html.count("<td class=fail") == 1 and html.count("<td class=cannot") == 1
    assert f"shardcheck repro --target slime --target-src /tmp/shardcheck-{c['c4'][:10]}" in html
    # a passing cell links to its commit's lines, which name the scenario to replay
    assert f'href="#c-{c["c1"][:10]}"' in html and f'id="c-{c["c1"][:10]}"' in html
    assert "[1/5]" in stderr and c["c1"][:10] in stderr
    assert done["repo_unchanged"]
    again_out, again_err, again_code = done["again"]
    assert again_code == 0, again_err[-2000:]
    assert done["again_json"]["cells_run"] == 0 and "starting" not in again_err
    assert "1 failure intervals, 1 fixed, 0 giving way to another failure, 0 open" in again_out


@pytest.mark.background("sweep-history")
def test_ctrl_c_stops_the_sweep_cleanly_and_keeps_what_was_done(background):
    """SIGINT to the process group after the first commit, as a terminal's Ctrl-C: exit 130 with
    what was done, no scratch folder, no process of its left, and every commit finished in the
    cache for the next sweep to start from (the cache's reuse: the test above)."""
    done = background("sweep-history")
    got = done["interrupted"]
    assert got["code"] == 130, got["stdout"]
    assert got["stdout"].startswith("interrupted after")
    ran = got["json"]["cells_run"]
    assert 1 <= ran < 5 and got["kept"] == ran
    assert not got["left"], "processes left"
    assert done["scratch_after"] == done["scratch_before"]


@pytest.mark.parametrize("args, says", [
    (["--src-repo", "{tmp}"], "is not a git clone"),
    (["--src-repo", "{repo}", "--range", "{c1}..{c1}"], "no commit in"),
    (["--src-repo", "{repo}", "--range", "nosuch..{c1}"], "is no commit"),
    (["--src-repo", "{repo}", "--target", "builtin"], "takes no"),
    (["--src-repo", "{repo}", "--target-src", "{tmp}"], "--target-src"),
], ids=["not-a-clone", "empty-range", "unknown-revision", "target-without-source", "target-src"])
def test_bad_input_is_one_line_and_exit_2(history, tmp_path, args, says, cli_in_process):
    repo, c = history
    filled = [a.format(tmp=tmp_path, repo=repo, c1=c["c1"]) for a in args]
    if "--target" not in filled:
        filled = ["--target", "slime", *filled]
    res = cli_in_process("sweep", *filled, *SCENARIO, "--cache", str(tmp_path / "cache"))
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert says in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_a_commit_that_cannot_be_exported_is_shown_as_cannot_run_and_not_cached(history, tmp_path):
    repo, _ = history
    check = commit_check.CommitCheck(repo, [], None, None, tmp_path)
    cells = check("0" * 40, ["x"])
    assert cells == {} or all(cell.state == CANNOT_RUN for cell in cells.values())
    from shardcheck.scenarios import get_suite

    sc = next(s for s in get_suite("smoke") if s.name == "thd-tp1cp1-basic")
    check = commit_check.CommitCheck(repo, [sc], None, None, tmp_path)
    (cell,) = check("0" * 40, [sc.name]).values()
    assert cell.state == CANNOT_RUN and cell.why.startswith(commit_check.EXPORT_FAILED)
    cache = sweep_cache.SweepCache(tmp_path / "cache", {"k": 1})
    result = engine.sweep([Commit("0" * 40, "2025-01-01", "gone")], [sc], cache, check)
    assert result.cells["0" * 40][sc.name].state == CANNOT_RUN and cache.load("0" * 40) == {}


def test_a_file_the_clone_does_not_hold_is_left_out_of_the_export_unless_it_is_python(tmp_path):
    """A mirrored or partial clone lacks large files (NeMo-RL's uv.lock, SkyRL's images): the
    commit is exported without them; a missing Python file fails the export (a target may import it)."""
    repo = tmp_path / "partial"
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "loss.py").write_text("x = 1\n")
    (repo / "big.svg").write_text("<svg/>\n")
    (repo / "docs").mkdir()
    (repo / "docs" / "copy.svg").write_text("<svg/>\n")  # the same content at a second path
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "c1"], check=True)

    def drop(path: str) -> None:
        oid = subprocess.run(git + ["rev-parse", f"HEAD:{path}"], capture_output=True, text=True).stdout.strip()
        (repo / ".git" / "objects" / oid[:2] / oid[2:]).unlink()

    drop("big.svg")
    sha = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert commit_check.missing_blobs(repo, sha) == ["big.svg", "docs/copy.svg"]
    assert commit_check.export(repo, sha, tmp_path / "out") is None
    assert (tmp_path / "out" / "loss.py").read_text() == "x = 1\n" and not (tmp_path / "out" / "big.svg").exists()
    assert not (tmp_path / "out" / "docs" / "copy.svg").exists()
    drop("loss.py")
    assert commit_check.export(repo, sha, tmp_path / "out2") is not None


def test_the_cache_key_follows_the_code_a_cell_depends_on_and_not_how_it_is_shown(tmp_path):
    """A changed adapter (targets/) gives another digest; a changed report or the sweep's own
    bookkeeping does not (their cells stay valid). On a copy of the layout, not the installed code."""
    files = {"targets/builtin.py": "x = 1\n", "harness/controller/reports/sweep_report.py": "y = 1\n",
             "harness/controller/commands/sweep.py": "z = 1\n", "harness/rank/main.py": "w = 1\n",
             "harness/controller/reports/sweep_timeline.py": "v = 1\n"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    roots = [tmp_path / "targets", tmp_path / "harness"]
    base = sweep_cache.code_digest(roots)
    for rel, same in (("harness/controller/reports/sweep_report.py", True),
                      ("harness/controller/commands/sweep.py", True), ("targets/builtin.py", False),
                      ("harness/rank/main.py", False),
                      ("harness/controller/reports/sweep_timeline.py", False)):  # cells_of: a verdict's cell
        (tmp_path / rel).write_text(files[rel] + "# changed\n")
        assert (sweep_cache.code_digest(roots) == base) is same, rel
        (tmp_path / rel).write_text(files[rel])
    assert sweep_cache.code_digest(roots) == base


def test_an_adapter_failing_before_any_rank_runs_is_cannot_run_and_the_sweep_goes_on(history, tmp_path, monkeypatch):
    """A target whose controller-side planning raises at one commit (an era it does not model):
    that commit's cells say so as "cannot run", naming the adapter; nothing escapes the sweep."""
    from shardcheck.harness.controller.commands import runner
    from shardcheck.scenarios import get_suite

    repo, c = history
    sc = next(s for s in get_suite("smoke") if s.name == "thd-tp1cp1-basic")

    def planning_fails(*args, **kwargs):
        raise TypeError("build_dp_schedule() missing 1 required keyword-only argument: 'group_indices'")

    monkeypatch.setattr(runner, "run", planning_fails)
    check = commit_check.CommitCheck(repo, [sc], type("C", (), {"target": "slime", "with_source": lambda self, s: self})(),
                               world=object(), scratch=tmp_path)
    result = engine.sweep([Commit(c["c1"], "2025-01-01", "c1")], [sc], sweep_cache.SweepCache(tmp_path / "k", {}), check)
    cell = result.cells[c["c1"]][sc.name]
    assert cell.state == CANNOT_RUN and "adapter failed before any rank ran" in cell.why and "group_indices" in cell.why
