"""The gradient the harness feeds into a target's outputs for the backward.

For the weighted form, the loss over the rank's share is

    loss = sum(w_lp * log_probs) - entropy_coef * sum(w_ent * entropy)

and the harness feeds d loss / d output straight into each output (``torch.autograd.backward``
with gradients it owns), so it can check afterwards that the target's backward left them as
they were. With entropy_coef = 0 the entropy term stays in the graph with weight zero, as
slime's policy loss keeps it: a target that makes entropy differentiable on some ranks only is
then exposed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Fed:
    """One output of the target and the gradient fed into it."""

    field: str  # log_probs | entropy | loss
    sample: int | None
    output: torch.Tensor
    grad: torch.Tensor


def share_gradients(
    log_probs: Sequence[torch.Tensor],
    entropy: Sequence[torch.Tensor] | None,
    weights: Sequence[tuple[torch.Tensor, torch.Tensor]],
    entropy_coef: float,
) -> list[Fed]:
    """d loss / d output for every well-formed output in the autograd graph."""
    fed = [_fed("log_probs", i, lp, w_lp) for i, (lp, (w_lp, _)) in enumerate(zip(log_probs, weights))]
    if entropy is not None:
        fed += [_fed("entropy", i, e, -entropy_coef * w_ent) for i, (e, (_, w_ent)) in enumerate(zip(entropy, weights))]
    return [f for f in fed if f is not None]


def policy_gradients(loss: object) -> list[Fed]:
    """A policy-form target's own scalar loss, fed d loss / d loss = 1."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad:
        return [Fed("loss", None, loss, torch.ones_like(loss))]
    return []


def _fed(field: str, sample: int, out: object, grad: torch.Tensor) -> Fed | None:
    # Malformed outputs are reported by the comparison; the backward uses what is well formed.
    if not (isinstance(out, torch.Tensor) and out.dim() == 1 and out.numel() == grad.numel() and out.requires_grad):
        return None
    return Fed(field, sample, out, grad.to(out.device, out.dtype))
