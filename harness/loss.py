"""The loss the harness differentiates on every rank, from a target's per-sample outputs.

loss = sum(w_lp * log_probs) - entropy_coef * sum(w_ent * entropy), over the rank's share.
With entropy_coef = 0 the entropy term stays in the graph with weight zero, as slime's policy
loss keeps it: a target that makes entropy differentiable on some ranks only is then exposed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def share_loss(
    log_probs: Sequence[torch.Tensor],
    entropy: Sequence[torch.Tensor] | None,
    weights: Sequence[tuple[torch.Tensor, torch.Tensor]],
    entropy_coef: float,
) -> torch.Tensor:
    terms = [_weighted(lp, w_lp) for lp, (w_lp, _) in zip(log_probs, weights) if _fits(lp, w_lp)]
    if entropy is not None:
        ent = [_weighted(e, w_ent) for e, (_, w_ent) in zip(entropy, weights) if _fits(e, w_ent)]
        if ent:
            terms.append(-entropy_coef * torch.stack(ent).sum())
    if not terms:
        return torch.zeros(())
    return torch.stack(terms).sum()


def _fits(out: object, weight: torch.Tensor) -> bool:
    # Malformed outputs are reported by the comparison; the loss uses what is well formed.
    return isinstance(out, torch.Tensor) and out.dim() == 1 and out.numel() == weight.numel()


def _weighted(out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (weight.to(out.device, torch.float32) * out.float()).sum()
