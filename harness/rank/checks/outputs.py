"""A target's own outputs on one rank, as data the controller can put back together per sample.

The invariance check compares what a target computed for the same sample under different
layouts, bit for bit, so the values travel in the dtype the target produced them in. Each rank
sends its share of each sample's response (log-probs, entropies, with the response token each
element scores) and the rows of each sample's logit gradient it holds (real positions only,
its vocab columns). Malformed outputs are left out: the value check reports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardcheck.harness.rank.pipeline import Check, Life
from shardcheck.harness.wire import Checks
from shardcheck.scenarios.layout import RankLayout


def rank_outputs(
    layout: RankLayout,
    log_probs: Sequence[Any] | None,
    entropy: Sequence[Any] | None,
    grad: torch.Tensor,
    entropy_layout: RankLayout | None = None,
) -> dict[str, Any]:
    """``{"values": {field: [(sample, tokens, tensor)]}, "grad": [(sample, first position,
    first column, tensor [rows, columns])]}``, all on the CPU; the entropy's tokens are
    ``entropy_layout``'s share where it owes other tokens than the log-probs."""
    values: dict[str, list] = {}
    for name, outs, owed in (("log_probs", log_probs, layout), ("entropy", entropy, entropy_layout or layout)):
        if outs is None or len(outs) != len(owed.share):
            continue
        values[name] = [
            (i, list(js), out.detach().reshape(-1).cpu())
            for i, (out, js) in enumerate(zip(outs, owed.share))
            if isinstance(out, torch.Tensor) and out.numel() == len(js)
        ]
    rows = grad.detach().reshape(layout.num_rows, -1).cpu()
    samples = layout.scenario.samples
    pieces, row = [], 0
    for p in layout.pieces:
        if p.stream < len(samples):
            real = max(0, min(p.stop, samples[p.stream].total) - p.start)
            if real:
                pieces.append((p.stream, p.start, layout.columns[0], rows[row : row + real].clone()))
        row += p.rows
    return {"values": values, "grad": pieces}


class OutputCapture(Check):
    """Invariance's capture: the target's own outputs and logit gradient sent back, bit for bit."""

    kind = ""  # it finds nothing itself: the controller compares what it captured

    @classmethod
    def wanted(cls, checks: Checks) -> bool:
        return checks.outputs

    def result(self, life: Life) -> None:
        life.produced = rank_outputs(life.owed, life.outputs.log_probs, life.entropy, life.grad, life.owed_entropy)
