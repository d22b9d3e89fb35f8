"""shardcheck's own layout written as a framework's data path: ``builtin:traced``.

A framework's data path lays a rollout batch out with its own code; the harness learns the layout
by pushing position-encoded tokens through it. This data path builds each rank's tokens from the
harness's arithmetic layout (asking megatron-core's ``parallel_state`` for its TP and CP rank, as
a framework does), so a run of ``builtin:traced`` goes through the whole trace (encode, the data
path, decode, the logits of each traced row, the real tokens' check, the world-wide coverage
check) and must give exactly what ``builtin`` gives on the harness's own layout.
"""

from __future__ import annotations

from typing import Any

import torch

from shardcheck.scenarios.layout import RankLayout, rank_layout
from shardcheck.harness.traced_layout import harness_local_tokens
from shardcheck.scenarios.scenario import Scenario
from shardcheck.targets.base import Knob, Rollout


class OwnDataPath:
    """The harness's layout (scenarios/layout.py) as a data path, ranks from megatron's mpu."""

    name = "shardcheck/scenarios/layout.py:rank_layout"

    def knobs(self) -> dict[str, Knob]:
        return {}

    def builds(self, scenario: Scenario) -> str | None:
        return None

    def local_tokens(self, rollout: Rollout) -> torch.Tensor:
        return harness_local_tokens(self.layout(rollout), rollout.tokens)

    def layout(self, rollout: Rollout) -> RankLayout:
        from megatron.core import parallel_state as mpu

        tp, cp = mpu.get_tensor_model_parallel_world_size(), mpu.get_context_parallel_world_size()
        # the vocabulary plays no part in which rows a rank holds
        sc = Scenario(name="rollout", samples=list(zip(rollout.total_lengths, rollout.response_lengths)),
                      vocab=tp, tp=tp, cp=cp, layout=rollout.layout)
        return rank_layout(sc, mpu.get_tensor_model_parallel_rank(), mpu.get_context_parallel_rank())


def traced(base: Any) -> Any:
    """``base`` (a builtin target) with its rows laid out through :class:`OwnDataPath`."""
    base.data_path = OwnDataPath()
    return base
