"""One way to a world: the spawned, joined and simulated worlds meet one protocol, and
world_for is where every command gets its world (nothing starts until it is used)."""

import pytest

from shardcheck.errors import BadInput
from shardcheck.harness.controller.worlds.simulated import FakeWorld
from shardcheck.harness.controller.worlds.joined import LAUNCHER_ENV, JoinedWorld
from shardcheck.harness.controller.worlds.spawned import SpawnedWorld
from shardcheck.harness.controller.worlds.choice import World, world_for


def test_the_three_worlds_meet_the_protocol(monkeypatch):
    for key, value in zip(LAUNCHER_ENV, ("0", "2", "0", "127.0.0.1", "29500")):
        monkeypatch.setenv(key, value)
    worlds = [SpawnedWorld(2), JoinedWorld(), FakeWorld([1, 2])]
    assert all(isinstance(w, World) for w in worlds)
    assert not isinstance(object(), World)


def test_world_for_gives_the_given_joins_or_starts_one_here(monkeypatch):
    given = SpawnedWorld(2)
    chosen = world_for(4, given=given)
    assert chosen.world is given and not chosen.owned and chosen.why == "the given world's"
    chosen = world_for(3, backend="gloo", timeout=5, lockstep=False)
    assert isinstance(chosen.world, SpawnedWorld) and chosen.owned and not chosen.world.started
    assert (chosen.world.nproc, chosen.world.backend, chosen.world.lockstep) == (3, "gloo", False)
    for key, value in zip(LAUNCHER_ENV, ("1", "2", "1", "127.0.0.1", "29500")):
        monkeypatch.setenv(key, value)
    joined = world_for(0, join=True)
    assert isinstance(joined.world, JoinedWorld) and joined.world.nproc == 2 and joined.owned


def test_a_backend_that_cannot_be_had_is_one_line_before_anything_starts(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BadInput, match="--backend nccl needs CUDA"):
        world_for(2, backend="nccl")
