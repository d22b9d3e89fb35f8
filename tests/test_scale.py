"""Beyond four local ranks: an 8-rank real world on 2 cores (the ``large`` suite), and a world
that spans two torchrun agents (two "machines" on loopback) for ``shardcheck run`` and
``pytest -m multigpu``, a hang's report naming each side's node and local rank.

Over 20 s: an 8-rank world running the large suite, and two launches of two torchrun agents
whose twelve processes each import torch afresh (in the background while other tests go on:
tests/background.py).
"""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env, run_cli
from shardcheck.scenarios import get_suite

BIN = Path(sys.executable).parent
EXAMPLE = Path(__file__).parent.parent / "examples" / "pytest_multigpu" / "test_shardcheck_regressions.py"


def _large_suite(folder):
    """``shardcheck run --suite large --nproc 8``, in the background: (its run, its JSON report)."""
    report = folder / "r.json"
    proc = run_cli("run", "--suite", "large", "--nproc", "8", "--json-report", str(report), "-q", timeout=240)
    return proc, (json.loads(report.read_text()) if report.exists() else None)


@pytest.mark.world
@pytest.mark.background("large-suite")
def test_the_large_suite_passes_on_an_8_rank_world(background):
    scenarios = get_suite("large")
    assert {(sc.tp, sc.cp) for sc in scenarios} == {(8, 1), (1, 8), (2, 4), (4, 2), (1, 1)}
    proc, doc = background("large-suite")
    assert proc.returncode == 0 and doc is not None, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert doc["ranks"] == 8 and [v["verdict"] for v in doc["scenarios"]] == ["pass"] * len(scenarios), \
        [(v["name"], v["verdict"]) for v in doc["scenarios"]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(args: list[str], cwd: Path, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Two torchrun agents, two ranks each, meeting through a c10d rendezvous on loopback."""
    port = _free_port()
    env = {k: v for k, v in cli_env().items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH")]))
    # torchrun's agents make torchelastic_* folders they never remove: in the test's folder, not /tmp
    env["TMPDIR"] = str(cwd / "tmp")
    (cwd / "tmp").mkdir(exist_ok=True)
    cmd = [str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0"]
    procs = [subprocess.Popen(cmd + ["--node-rank", str(n)] + args, cwd=cwd, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for n in (0, 1)]
    out = []
    for p in procs:
        try:
            stdout, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, ""))
    return out


def _run_across_two_agents(folder: Path) -> list[subprocess.CompletedProcess]:
    return _two_nodes(["-m", "shardcheck", "run", "--target", "builtin:skip_empty_rank", "--suite", "regressions",
                       "--scenario", "ag-empty-local-slices", "--scenario", "ag-entropy-grad"], folder)


def _pytest_across_two_agents(folder: Path) -> list[subprocess.CompletedProcess]:
    shutil.copy(EXAMPLE, folder / EXAMPLE.name)
    return _two_nodes(["-m", "pytest", "-p", "no:cacheprovider", "-m", "multigpu", "-q", "-p", "no:warnings"], folder)


# both launches run in the background while other tests go on (tests/background.py)
BACKGROUND = {"large-suite": (_large_suite, 240), "run-two-agents": (_run_across_two_agents, 2 * 240), "pytest-two-agents": (_pytest_across_two_agents, 2 * 240)}


@pytest.mark.launch
@pytest.mark.background("run-two-agents")
def test_a_world_across_two_torchrun_agents_runs_and_names_each_side(background):
    nodes = background("run-two-agents")
    assert [n.returncode for n in nodes] == [1, 1], nodes[0].stdout[-3000:] + nodes[1].stdout[-3000:]
    report = next(n.stdout for n in nodes if "FAILED ag-empty-local-slices" in n.stdout)  # rank 0's, once
    assert sum("FAILED ag-empty-local-slices" in n.stdout for n in nodes) == 1
    assert "collective_mismatch in forward" in report and "ag-entropy-grad" in report
    where = [line for line in report.splitlines() if line.strip().startswith("where:")]
    assert any("node 0 local rank 0" in w for w in where) and any("node 1 local rank 1" in w for w in where), where


@pytest.mark.world
@pytest.mark.launch
@pytest.mark.background("pytest-two-agents")
def test_pytest_multigpu_across_two_torchrun_agents(background):
    """Every rank runs pytest and shardcheck joins the launcher's world (the plugin's torchrun
    path), here spanning two agents."""
    nodes = background("pytest-two-agents")
    scenarios = len(get_suite("regressions"))
    assert [n.returncode for n in nodes] == [0, 0], nodes[0].stdout[-3000:] + nodes[1].stdout[-3000:]
    assert sum(n.stdout.count(f"{scenarios} passed") for n in nodes) == 4  # four pytest processes, every case
