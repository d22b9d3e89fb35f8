"""A run that is killed keeps what it found and leaves no process behind."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import TESTS, alive, cli_env, descendants

pytestmark = pytest.mark.world


def _killed_run(tmp_path, sig):
    """The CLI killed with ``sig`` three scenarios in, and what it left (the checks raise here,
    in the background, and the test re-raises them)."""
    from shardcheck.harness.controller.worlds import leftovers

    report, temp = tmp_path / "r.json", tmp_path / ("long-" * 12)
    temp.mkdir()
    env = cli_env(PYTHONPATH=str(TESTS), TMPDIR=str(temp))
    out, err = (tmp_path / "stdout").open("w"), (tmp_path / "stderr").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "shardcheck", "run", "--suite", "smoke", "-q",
                             "--json-report", str(report)], env=env, stdout=out, stderr=err)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and proc.poll() is None:
            try:  # read while it is written: a partial read is retried
                # run, not skipped: the smoke suite's training steps are skipped before a rank starts
                ran = [v for v in json.loads(report.read_text()).get("scenarios", []) if v["verdict"] != "skip"] \
                    if report.exists() else []
                if len(ran) >= 3:
                    break
            except json.JSONDecodeError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail(f"no results (the run's exit status: {proc.poll()}): "
                        + (tmp_path / "stderr").read_text()[-2000:])
        ranks = descendants(proc.pid)
        assert len(ranks) >= 4
        proc.send_signal(sig)
        proc.wait(timeout=30)
        deadline = time.time() + 15
        while time.time() < deadline and any(alive(p) for p in ranks):
            time.sleep(0.1)
        assert not any(alive(p) for p in ranks), "rank processes outlived the controller"
        doc = json.loads(report.read_text())
        assert len(doc["scenarios"]) >= 3 and doc["complete"] is False
        assert all(v["verdict"] in ("pass", "skip") for v in doc["scenarios"])
        if sig == signal.SIGTERM:  # handled as Ctrl-C is: the table, its own status, nothing left behind
            stdout, stderr = (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()
            assert proc.returncode == 143 and "shardcheck: terminated" in stderr, (proc.returncode, stderr)
            assert "scenarios:" in stdout and "passed" in stdout, stdout
            left = [e for e in os.listdir(temp) if not e.startswith("torchinductor_")]  # torch's cache: kept
            assert left == [], left
        leftovers.sweep()  # what the next run does first: a killed run's folders go
        mine = f"shardcheck-mp-{proc.pid}-"
        assert [e for root in ("/tmp", "/var/tmp", "/dev/shm") if os.path.isdir(root)
                for e in os.listdir(root) if e.startswith(mine)] == []
    finally:
        if proc.poll() is None:
            proc.kill()


BACKGROUND = {f"killed-run-{sig.name}": (lambda folder, sig=sig: _killed_run(folder, sig), 240)
              for sig in (signal.SIGTERM, signal.SIGKILL)}


@pytest.mark.background("killed-run-SIGTERM", "killed-run-SIGKILL")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["15", "9"])
def test_killed_run_keeps_its_results_and_leaves_no_ranks(background, sig):
    """Also under a TMPDIR too long for the fork server's socket (a pytest-xdist worker's
    tmp_path is): the server listens in a short folder instead, which is gone after the run
    (removed at exit, or by the next run's sweep when the run was killed). In the background: the
    run is a process of its own, and only its own descendants are looked at."""
    background(f"killed-run-{sig.name}")
