"""How ranks start: forked from a server that imported torch once, with the controller's
environment as of each start; spawned afresh where forking would be wrong."""

import os

import pytest

from conftest import parent_pid
from shardcheck.harness.controller import runner
from shardcheck.harness.controller.report import SilentReport
from shardcheck.harness.controller.world import SpawnedWorld, _rank_environment, _start_context
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
