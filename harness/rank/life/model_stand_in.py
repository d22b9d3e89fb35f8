"""The model's context-parallel collective in backward, stood in for.

The harness hands a target logits as a model would, but there is no model between them and the
tokens. Under context parallelism a real model's backward issues collectives over the CP group
on every rank (ring attention's exchanges with zigzag CP, the reduce-scatter of the key/value
all-gather with all-gather CP), and it runs only where the loss reaches the logits. A rank whose
loss does not depend on its logits at all (every row padding, say) skips them, and its peers
wait for ever: slime guards against it with ``loss + 0 * logits.sum()`` in ``loss_function``.

For a target whose loss is the one the framework's training step differentiates
(``training_loss = True``), the rank's logits pass through :class:`ModelCpCollective`, whose
backward issues one all-reduce over the CP group, so such a rank shows as a collective mismatch
in backward, in the lockstep's words.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class ModelCpCollective(torch.autograd.Function):
    """Identity in forward; in backward, one all-reduce over the CP group (the model's)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, cp_group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.cp_group = cp_group
        return logits.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        # the model's backward over the CP group: every CP rank must come here
        dist.all_reduce(grad.new_zeros(1), group=ctx.cp_group)
        return grad, None


def model_output(leaf: torch.Tensor, target: Any, cp: int, cp_group: Any) -> torch.Tensor:
    """The logits a target gets: a non-leaf (a model's output), through the model's CP
    collective when the target's loss is the training step's and cp > 1."""
    if cp > 1 and target.training_loss:
        return ModelCpCollective.apply(leaf, cp_group)
    return leaf.clone()
