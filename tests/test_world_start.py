"""How ranks start: forked from a server that imported torch once, with the controller's
environment as of each start; spawned afresh where forking would be wrong."""

import os

import pytest

from conftest import parent_pid
from shardcheck.harness.controller.commands import runner
from shardcheck.harness.controller.reports.run_report import SilentReport
from shardcheck.harness.controller.worlds.spawned import SpawnedWorld, _rank_environment, _start_context
from shardcheck.scenarios import Sample, Scenario

pytestmark = pytest.mark.world

TP2 = Scenario("tp2", (Sample(7, 3),), vocab=8, tp=2, seed=3)
ONE = Scenario("one", (Sample(7, 3),), vocab=8, seed=3)


def _probe(world: SpawnedWorld) -> list[str]:
    result = runner.run([TP2 if world.nproc == 2 else ONE], "plants:PrintsAnEnvironmentVariable",
                        reporter=SilentReport(), world=world)
    assert result.exit_code == 0, [v.headline() for v in result.verdicts]
    return [o for o, _ in world.rank_output() if o.startswith("probe:")]


def _parents(world: SpawnedWorld) -> set[int]:
    return {parent_pid(p.pid) for p in world._procs}


def test_a_forked_rank_sees_the_environment_of_each_start_not_the_servers(monkeypatch):
    monkeypatch.setenv("SHARDCHECK_TEST_PROBE", "first")
    with SpawnedWorld(2, timeout=30) as world:
        assert os.getpid() not in _parents(world)  # forked from the server, not spawned by us
        assert _probe(world) == ["probe: first"]
        monkeypatch.setenv("SHARDCHECK_TEST_PROBE", "second")
        world.restart()
        assert _probe(world) == ["probe: first", "probe: second"]


def test_ranks_are_spawned_when_torch_would_load_with_other_settings(monkeypatch):
    env = _rank_environment()
    assert _start_context("gloo", env, True).get_start_method() == "forkserver"
    assert _start_context("nccl", env, True).get_start_method() == "spawn"
    env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL" if env.get("TORCH_DISTRIBUTED_DEBUG") != "DETAIL" else "OFF"
    assert _start_context("gloo", env, True).get_start_method() == "spawn"


def test_a_spawned_world_runs_as_a_forked_one(monkeypatch):
    monkeypatch.setenv("SHARDCHECK_TEST_PROBE", "spawned")
    with SpawnedWorld(1, timeout=30, fork_server=False) as world:
        assert _parents(world) == {os.getpid()}
        assert _probe(world) == ["probe: spawned"]


MEGATRON_PROBE = (
    "import sys, torch\n"
    "from shardcheck.harness.rank.plumbing.megatron_core import load_parallel_state\n"
    "ps = load_parallel_state()\n"
    "import megatron.core.parallel_state as again\n"
    "print(again is ps, ps.__file__.endswith('megatron/core/parallel_state.py'),\n"
    "      'megatron.core.tensor_parallel' in sys.modules, 'megatron.core.transformer' in sys.modules)\n"
    "import megatron.core\n"
    "version = megatron.core.__version__  # a name the package's __init__ sets: it runs then\n"
    "from megatron.core import ModelParallelConfig, tensor_parallel\n"
    "from importlib.metadata import version as installed\n"
    "print(megatron.core.ModelParallelConfig is ModelParallelConfig, megatron.core.parallel_state is ps,\n"
    "      tensor_parallel.vocab_parallel_cross_entropy.__module__, version == installed('megatron-core'))\n")


def _probe_megatron_imports(folder):
    """A fresh interpreter (what it has imported is the finding), in the background."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-W", "ignore", "-c", MEGATRON_PROBE], capture_output=True, text=True,
                          timeout=120, cwd="/")


BACKGROUND = {"megatron-imports": (_probe_megatron_imports, 120)}


@pytest.mark.background("megatron-imports")
def test_a_rank_imports_parallel_state_and_not_the_rest_of_megatron_core_until_asked(background):
    """The fork server and every rank import megatron-core's parallel_state without the package's
    __init__ (tensor_parallel, transformer, ...: 2 s of a start); a target that asks megatron.core
    for a name gets the package as always, its __init__ run in full."""
    out = background("megatron-imports")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["True True False False",
                                       "True True megatron.core.tensor_parallel.cross_entropy True"], out.stdout


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_every_gloo_group_of_a_rank_shares_one_event_loop_unless_asked_not_to(monkeypatch):
    """torch gives each gloo group a device whose loop thread wakes every 10 ms; megatron builds
    about 17 groups a layout. The harness's ranks share one device (harness/rank/plumbing/gloo_device.py)."""
    from shardcheck.harness.rank.plumbing.gloo_device import ENV, loop_threads

    monkeypatch.delenv(ENV, raising=False)
    with SpawnedWorld(2, timeout=30) as world:
        assert _probe(world)  # a TP2 layout: megatron's groups built on both ranks
        assert [loop_threads(p.pid) for p in world._procs] == [1, 1]
        monkeypatch.setenv(ENV, "per-group")
        world.restart()
        _probe(world)
        per_group = [loop_threads(p.pid) for p in world._procs]
        assert min(per_group) > 10, per_group  # torch's own way: one loop a group
