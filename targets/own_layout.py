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
from shardcheck.scenarios.traced_layout import harness_local_tokens
from shardcheck.scenarios.scenario import Scenario
from shardcheck.targets.base import Knob, Rollout


class OwnDataPath:
    """The harness's layout (scenarios/layout.py) as a data path, ranks from megatron's mpu."""

    name = "shardcheck/scenarios/layout.py:rank_layout"

    def knobs(self) -> dict[str, Knob]:
        return {}

    def builds(self, scenario: Scenario) -> str | None:
        if scenario.sp > 1:  # a rollout carries no sp, and megatron's mpu has no sp group of its own
            return f"{self.name} lays out the Megatron family's layouts, not {scenario.layout}"
        return None

    def local_tokens(self, rollout: Rollout) -> torch.Tensor:
        return harness_local_tokens(self.layout(rollout), rollout.tokens)

    def model_inputs(self, rollout: Rollout) -> dict[str, Any]:
        """What the model gets besides the tokens: each local row's position (0 on padding), and
        for packed layouts the packed stream's sequence boundaries (zigzag: each sample padded to
        a multiple of 2 cp, as megatron's CP attention takes it; all-gather: the tail padding as a
        sequence of its own, where there is any)."""
        layout = self.layout(rollout)
        samples = layout.scenario.samples
        positions = [pos if stream < len(samples) and pos < samples[stream].total else 0
                     for stream, pos in self.positions(layout)]
        out: dict[str, Any] = {"position_ids": torch.tensor(positions, dtype=torch.int64)}
        if rollout.layout != "bshd":
            out["cu_seqlens"] = torch.tensor(self.boundaries(layout), dtype=torch.int32)
        return out

    def positions(self, layout: RankLayout) -> list[tuple[int, int]]:
        """(stream, position) of every local row."""
        return layout.row_positions()

    def boundaries(self, layout: RankLayout) -> list[int]:
        """The packed stream's cu_seqlens."""
        sc = layout.scenario
        cp = sc.cp
        lengths = [s.total for s in sc.samples]
        if sc.layout == "zigzag":
            lengths = [-(-t // (2 * cp)) * 2 * cp for t in lengths]
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        if sc.layout == "allgather":
            unit = cp * sc.tp
            padded = -(-cu[-1] // unit) * unit
            if padded > cu[-1]:
                cu.append(padded)
        return cu

    def layout(self, rollout: Rollout) -> RankLayout:
        from megatron.core import parallel_state as mpu

        tp, cp = mpu.get_tensor_model_parallel_world_size(), mpu.get_context_parallel_world_size()
        # the vocabulary plays no part in which rows a rank holds
        sc = Scenario(name="rollout", samples=list(zip(rollout.total_lengths, rollout.response_lengths)),
                      vocab=tp, tp=tp, cp=cp, layout=rollout.layout)
        return rank_layout(sc, mpu.get_tensor_model_parallel_rank(), mpu.get_context_parallel_rank())


class ZeroLengthSequence(OwnDataPath):
    """planted: cu_seqlens ends with a sequence of zero length (its last boundary twice), as a
    padding step that appends the padded length when there was nothing to pad"""

    def boundaries(self, layout: RankLayout) -> list[int]:
        cu = super().boundaries(layout)
        return cu + [cu[-1]]


class PositionsNotZigzag(OwnDataPath):
    """planted: each sample's position ids count its local rows from 0 (0, 1, 2, ...), not the
    positions of the rank's two zigzag chunks"""

    def positions(self, layout: RankLayout) -> list[tuple[int, int]]:
        seen: dict[int, int] = {}
        out = []
        for stream, _ in layout.row_positions():
            out.append((stream, seen.get(stream, 0)))
            seen[stream] = seen.get(stream, 0) + 1
        return out


DATA_PATHS = {"traced": OwnDataPath, "traced_zero_length_sequence": ZeroLengthSequence,
              "traced_positions_not_zigzag": PositionsNotZigzag}


def traced(base: Any, path: type[OwnDataPath] = OwnDataPath) -> Any:
    """``base`` (a builtin target) with its rows laid out through ``path`` (:class:`OwnDataPath`)."""
    base.data_path = path()
    return base
