import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent


def run_cli(*args: str, timeout: float = 600, cwd: str | None = None) -> subprocess.CompletedProcess:
    """``python -m shardcheck ARGS`` in a fresh process, with tests/ importable (for plants)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "shardcheck", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def write_scenarios(path: Path, scenarios: list) -> Path:
    path.write_text(json.dumps([s.to_dict() for s in scenarios]))
    return path


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(scope="session")
def world():
    """One 4-rank gloo world for every test that does not need a world of its own (start-up
    costs 10 to 25 s on 2 cores; the world restarts itself when a scenario leaves it unusable)."""
    from shardcheck.harness.controller.world import World

    with World(4, timeout=20) as w:
        yield w


@pytest.fixture(scope="session")
def world2():
    """One 2-rank gloo world for the tests that need a world smaller than their scenarios."""
    from shardcheck.harness.controller.world import World

    with World(2, timeout=30) as w:
        yield w
