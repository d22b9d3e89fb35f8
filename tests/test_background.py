"""The suite's background runs (tests/background.py): one at a time, in order, none while a calm
test runs, a run asked for before it began is run by the asker, errors reach the test."""

import threading
import time

import pytest

from background import Background


def _recorder(log: list, name: str, seconds: float = 0.0, fail: bool = False):
    def work(folder):
        log.append(("start", name, threading.current_thread().name))
        assert folder.is_dir()
        time.sleep(seconds)
        log.append(("end", name))
        if fail:
            raise ValueError(f"{name} failed")
        return name.upper()
    return work


def _queue(tmp_path, enabled: bool = True) -> Background:
    bg = Background(enabled=enabled, root=tmp_path / "bg")
    bg.root.mkdir()
    return bg


def test_runs_go_one_at_a_time_in_order_and_a_waiting_one_is_run_by_the_asker(tmp_path):
    log: list = []
    bg = _queue(tmp_path)
    bg.add("a", _recorder(log, "a", 0.2), 5)
    bg.add("b", _recorder(log, "b"), 5)
    bg.add("c", _recorder(log, "c"), 5)
    bg.start()
    time.sleep(0.05)  # "a" is going on
    assert bg.get("c") == "C"  # not begun: run here, in this thread
    assert bg.get("a") == "A" and bg.get("b") == "B"
    starts = [(e[1], e[2]) for e in log if e[0] == "start"]
    assert starts[0] == ("a", "shardcheck-tests-background")
    assert ("c", threading.current_thread().name) in starts
    a_end, b_start = log.index(("end", "a")), next(i for i, e in enumerate(log) if e[:2] == ("start", "b"))
    assert a_end < b_start  # never two at once in the background
    bg.close()
    assert not bg.root.exists()


def test_a_calm_test_waits_for_the_run_going_on_and_none_starts_until_it_ends(tmp_path):
    log: list = []
    bg = _queue(tmp_path)
    bg.add("a", _recorder(log, "a", 0.3), 5)
    bg.add("b", _recorder(log, "b"), 5)
    bg.start()
    time.sleep(0.05)
    bg.pause()
    assert ("end", "a") in log  # pause returned only once "a" ended
    time.sleep(0.2)
    assert not any(e[:2] == ("start", "b") for e in log)  # paused: "b" waits
    bg.resume()
    assert bg.get("b") == "B"
    bg.close()


def test_an_error_reaches_the_test_and_close_starts_nothing_more(tmp_path):
    log: list = []
    bg = _queue(tmp_path)
    bg.add("bad", _recorder(log, "bad", fail=True), 5)
    bg.add("later", _recorder(log, "later", 0.2), 5)
    bg.add("never", _recorder(log, "never"), 5)
    bg.start()
    with pytest.raises(ValueError, match="bad failed"):
        bg.get("bad")
    time.sleep(0.05)  # "later" is going on
    bg.close()
    assert ("end", "later") in log and not any(e[1] == "never" for e in log)


def test_disabled_every_run_is_run_when_asked(tmp_path):
    log: list = []
    bg = _queue(tmp_path, enabled=False)
    bg.add("a", _recorder(log, "a"), 5)
    bg.start()
    time.sleep(0.05)
    assert log == []
    assert bg.get("a") == "A" and log[0][2] == threading.current_thread().name
    bg.close()


def test_closing_with_a_run_going_on_kills_it_and_waits_briefly(tmp_path):
    import subprocess
    import sys

    procs: list = []

    def long_run(folder):
        procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        return procs[0].wait(timeout=120)

    bg = _queue(tmp_path)
    bg.add("long", long_run, 120)
    bg.start()
    while not procs:
        time.sleep(0.01)
    t0 = time.perf_counter()
    bg.close(kill=lambda: procs[0].kill())
    assert time.perf_counter() - t0 < 5 and procs[0].poll() is not None
    assert bg.runs["long"].done.is_set()
