"""A rank's layout: the framework's own, when the target has a data path, else the harness's.

With a data path (``target.data_path``, :class:`shardcheck.targets.base.DataPath`) the
framework's code lays the rollout out; the position trace (:mod:`shardcheck.scenarios.traced_layout`)
says where each (sample, position) landed, and the real tokens pushed through the same code must
land in the same places (a layout that depends on the token values is a finding).
"""

from __future__ import annotations

from typing import Any

import torch

from shardcheck.scenarios import traced_layout
from shardcheck.scenarios.layout import RankLayout, rank_layout
from shardcheck.harness.wire import LAYOUT_MISMATCH, Failure
from shardcheck.scenarios.data import ScenarioData
from shardcheck.targets.base import Rollout, data_path, resolved_knobs

MAX_LISTED = 5


def rollout(data: ScenarioData, tokens: list[torch.Tensor], knobs: dict[str, Any]) -> Rollout:
    sc = data.scenario
    return Rollout(
        tokens=tokens,
        total_lengths=[s.total for s in sc.samples],
        response_lengths=[s.response for s in sc.samples],
        # the policy form's masks; the weighted form scores every response token
        loss_masks=[data.loss_mask(i) if data.loss == "policy" else torch.ones(s.response, dtype=torch.int32)
                    for i, s in enumerate(sc.samples)],
        layout=sc.layout,
        knobs=knobs,
    )


def layout_for(target: Any, data: ScenarioData, tp_rank: int, cp_rank: int, rank: int
               ) -> tuple[RankLayout, Rollout | None, list[Failure]]:
    """This rank's layout, the rollout the target's data path gets (None without one), and what
    the real tokens' trip through the data path found."""
    sc = data.scenario
    path = data_path(target)
    if path is None or path.builds(sc) is not None:
        return rank_layout(sc, tp_rank, cp_rank), None, []
    knobs = resolved_knobs(path, sc)
    traced = path.local_tokens(rollout(data, traced_layout.encoded_tokens(sc), knobs))
    layout = traced_layout.decode(sc, tp_rank, cp_rank, traced.detach().cpu(), path.name)
    real = rollout(data, [data.tokens(i) for i in range(len(sc.samples))], knobs)
    found = _moved_tokens(layout, path.local_tokens(real), real.tokens, rank)
    handed = getattr(path, "model_inputs", None)  # optional: what else the model is handed
    if handed is not None:
        from shardcheck.harness.rank.life.model_inputs import check_model_inputs

        found += check_model_inputs(layout, handed(real), rank)
    return layout, real, found


def _moved_tokens(layout: RankLayout, local: torch.Tensor, tokens: list[torch.Tensor], rank: int) -> list[Failure]:
    """Rows where the real tokens did not land where their positions did."""
    got = local.detach().cpu().reshape(-1).tolist()
    want = traced_layout.local_tokens_at(layout, tokens)
    if len(got) != len(want):
        return [Failure(LAYOUT_MISMATCH, f"{layout.built_by} built {len(got)} local rows from the real tokens and "
                        f"{len(want)} from their positions: its layout depends on the token values", [rank])]
    wrong = [r for r, (g, w) in enumerate(zip(got, want)) if g != w]
    if not wrong:
        return []
    where = traced_layout.row_map(layout)
    listed = "; ".join(f"row {r}: {_at(where[r])} holds token {got[r]}, not {want[r]}" for r in wrong[:MAX_LISTED])
    more = f" (+{len(wrong) - MAX_LISTED} more rows)" if len(wrong) > MAX_LISTED else ""
    first = where[wrong[0]]
    return [Failure(LAYOUT_MISMATCH, f"{layout.built_by} laid the real tokens out differently from their positions: "
                    f"{listed}{more}", [rank], sample=first[0] if first else None,
                    position=first[1] if first else None)]


def _at(rp: tuple[int, int] | None) -> str:
    return "padding" if rp is None else f"sample {rp[0]} position {rp[1]}"


def layout_payload(layout: RankLayout) -> dict[str, Any] | None:
    """A framework-built layout as plain data for the controller (None for the harness's own,
    which the controller computes itself)."""
    if layout.built_by == "shardcheck":
        return None
    return {"tp_rank": layout.tp_rank, "cp_rank": layout.cp_rank, "built_by": layout.built_by,
            "shape": list(layout.shape), "pieces": [[p.stream, p.start, p.stop] for p in layout.pieces]}
