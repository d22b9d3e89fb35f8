"""shardcheck's own training-step loss (``builtin:loss``, ``builtin:loss_token_mean``) and the
bugs planted in it: what a framework on megatron-core writes around its log-probs.

Per micro-batch it computes the builtin's log-probs and entropy, a PPO policy loss over them
(the importance ratio against the old log-probs, the advantages, the loss masks, an entropy
bonus) and reduces it for megatron-core's schedule, as slime's ``loss_function`` does:

- ``sample_mean`` (slime's default, ``calculate_per_token_loss=False``): each sample's masked
  terms over its masked-in count, summed over the micro-batch, times
  ``num_microbatches / global_batch_size * dp_cp``. The schedule divides by
  ``num_microbatches`` and DDP averages over the data-parallel and CP ranks, so the optimizer
  sees the mean over the global batch's samples;
- ``token_mean`` (``calculate_per_token_loss=True``): the masked terms summed, times the CP size,
  with the micro-batch's masked-in count (whole samples, on every CP rank) as megatron's
  ``num_tokens``. The schedule sums, and ``finalize_model_grads`` divides by the count summed over
  the data-parallel and CP ranks (CP times the global count, which the CP factor cancels).

The mutants each plant one bug of the class this loss is prone to (docs/training.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from shardcheck.targets.base import Definitions, RankInputs, RankOutputs, StepSizes
from shardcheck.scenarios.scenario import MEGATRON_LAYOUTS
from shardcheck.targets.builtin import BuiltinTarget, share_ranges


class BuiltinLoss(BuiltinTarget):
    """shardcheck's own training-step loss: a PPO policy loss on the builtin's log-probs, each
    sample's token mean averaged over the global batch (slime's default reduction)"""

    name = "builtin:loss"
    loss_form = "step"
    per_token = False  # megatron-core's calculate_per_token_loss
    capabilities = dataclasses.replace(BuiltinTarget.capabilities, replay_keep=False, sampling=False,
                                       layouts=frozenset(MEGATRON_LAYOUTS))
    invariance: dict[str, str] = {}  # a step is checked against its objective, not across layouts

    @property
    def definitions(self) -> Definitions:
        objective = "token_mean" if self.per_token else "sample_mean"
        return Definitions(objective=objective, objective_source=f"builtin's calculate_per_token_loss={self.per_token}")

    def compute(self, inputs: RankInputs) -> RankOutputs:  # type: ignore[override]
        if inputs.policy is None or inputs.step is None:
            raise ValueError(f"{self.name} is a training step's loss: it needs the policy batch and the step inputs")
        out = super().compute(inputs)
        terms, counts = self.sample_terms(inputs, out)
        loss, num_tokens = self.reduce(inputs, terms, counts)
        # every rank's loss reaches its logits, so the model's backward runs on every CP rank; an
        # empty slice's sum, not 0 * logits.sum(): a NaN in a padding row would make that NaN
        loss = loss + inputs.logits.reshape(-1)[:0].sum()
        return RankOutputs(out.log_probs, out.entropy, loss=loss, num_tokens=num_tokens,
                           reported=self.report(terms, counts))

    def report(self, terms: list[torch.Tensor], counts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the micro-batch logs, as slime's loss_function does: this rank's part of the
        objective's sum (each sample's terms over its count, or for the token mean the terms
        alone) and, for the token mean, the masked-in count it divides by."""
        zero = torch.zeros((), dtype=torch.float64)
        if self.per_token:
            return {"objective_sum": sum((t.detach().double() for t in terms), zero),
                    "count": sum((c.double() for c in counts), zero)}
        return {"objective_sum": sum((t.detach().double() / c.clamp_min(1) for t, c in zip(terms, counts)), zero)}

    def logged_loss(self, reported: list[dict[str, torch.Tensor]], sizes: StepSizes) -> torch.Tensor:
        """The step's loss as it is logged: every micro-batch's parts summed, all-reduced over the
        data-parallel x CP group, over the global count (which every CP rank counted, hence x cp)
        or the global batch's samples."""
        total = self.summed(reported)
        dist.all_reduce(total, group=sizes.dp_cp_group)
        return self.logged_value(total, sizes.cp_size, sizes.global_batch_size)

    def summed(self, reported: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        return torch.stack([sum(r["objective_sum"] for r in reported),
                            sum(r.get("count", torch.zeros((), dtype=torch.float64)) for r in reported)])

    def logged_value(self, total: torch.Tensor, cp_size: int, samples: int) -> torch.Tensor:
        if self.per_token:
            return total[0] * cp_size / total[1].clamp_min(1)
        return total[0] / samples

    def sample_terms(self, inputs: RankInputs, out: RankOutputs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per sample: its masked loss terms on this rank's share, summed, and its masked-in count
        over the whole response (the masks are whole-response on every CP rank)."""
        policy = inputs.policy
        entropy = out.entropy if inputs.with_entropy else None
        terms, counts = [], []
        for i, (lp, total, response) in enumerate(zip(out.log_probs, inputs.total_lengths, inputs.response_lengths)):
            whole = policy.loss_masks[i].to(lp.device)
            ranges = share_ranges(total, response, inputs.cp_size, inputs.cp_rank)
            mask = torch.cat([whole[a:b] for a, b in ranges]).bool()
            ratio = torch.exp(lp - policy.old_log_probs[i].to(lp.device, lp.dtype))
            term = self.masked(-policy.advantages[i].to(lp.device, lp.dtype) * ratio, mask).sum()
            if entropy is not None:
                term = term - inputs.entropy_coef * self.masked(entropy[i], mask).sum()
            terms.append(term)
            counts.append(whole.sum())
        return terms, counts

    def masked(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The values where the mask keeps them, 0 elsewhere: selected, so that whatever a masked
        position holds (NaN, inf) reaches nothing."""
        return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))

    def reduce(self, inputs: RankInputs, terms: list[torch.Tensor], counts: list[torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, num_tokens) as megatron-core's schedule takes them, for this micro-batch."""
        if self.per_token:
            return self.token_mean(inputs, terms, counts)
        return self.sample_mean(inputs, terms, counts)

    def token_mean(self, inputs: RankInputs, terms: list[torch.Tensor], counts: list[torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """calculate_per_token_loss=True: the terms summed, the masked-in count for megatron."""
        zero = inputs.logits.new_zeros((), dtype=torch.float32)
        loss = sum(terms, zero) * self.cp_factor(inputs)
        return loss, torch.stack(counts).sum().to(torch.int) if counts else torch.zeros((), dtype=torch.int)

    def sample_mean(self, inputs: RankInputs, terms: list[torch.Tensor], counts: list[torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """calculate_per_token_loss=False: each sample's terms over its count, rescaled as slime does."""
        step = inputs.step
        zero = inputs.logits.new_zeros((), dtype=torch.float32)
        loss = sum((t / c.clamp_min(1) for t, c in zip(terms, counts)), zero)
        loss = loss * self.microbatch_factor(inputs) / step.global_batch_size * step.dp_size * inputs.cp_size
        return loss, torch.ones((), dtype=torch.int)

    def cp_factor(self, inputs: RankInputs) -> int:
        """The per-token loss's CP factor: megatron's count is CP times the global count."""
        return inputs.cp_size

    def microbatch_factor(self, inputs: RankInputs) -> int:
        """What cancels the schedule's division by the number of micro-batches."""
        return inputs.step.num_microbatches


class BuiltinLossTokenMean(BuiltinLoss):
    """shardcheck's own training-step loss with every masked-in token of the global batch
    weighing the same (calculate_per_token_loss=True)"""

    name = "builtin:loss_token_mean"
    per_token = True


class BuiltinLossGlobalCount(BuiltinLossTokenMean):
    """shardcheck's own token-mean loss as a trainer outside megatron's per-token form computes it
    (NeMo-RL's global_valid_toks): the terms over the global batch's masked-in count, counted from
    the step inputs' loss masks, in megatron's two-value form"""

    calculate_per_token_loss = False  # megatron-core's knob: the two-value form

    @property
    def definitions(self) -> Definitions:
        return Definitions(objective="token_mean", objective_source="the global batch's masked-in count, from the step")

    def reduce(self, inputs: RankInputs, terms: list[torch.Tensor], counts: list[torch.Tensor]
               ) -> tuple[torch.Tensor, None]:
        step = inputs.step
        zero = inputs.logits.new_zeros((), dtype=torch.float32)
        # the schedule multiplies by cp and divides by num_microbatches, DDP averages over dp x cp:
        # what is left to cancel is num_microbatches x dp
        scale = step.num_microbatches * step.dp_size
        return sum(terms, zero) * scale / self.global_count(inputs), None

    def global_count(self, inputs: RankInputs) -> torch.Tensor:
        step = inputs.step
        return sum(m.sum() for m in step.loss_masks).clamp_min(1) * step.copies


class LossCountPerReplica(BuiltinLossGlobalCount):
    """planted: the two-value token mean counts its own replica's masked-in tokens, not the global
    batch's (the count's all-reduce over the data-parallel group left out)"""

    def global_count(self, inputs: RankInputs) -> torch.Tensor:
        step = inputs.step
        return sum(step.loss_masks[i].sum() for i in step.replica_samples).clamp_min(1)


class LossCpMissing(BuiltinLossTokenMean):
    """planted: the per-token loss is not multiplied by the CP size, so megatron's count (CP times
    the global count) divides it once too often (the gradient x 1 / cp)"""

    def cp_factor(self, inputs: RankInputs) -> int:
        return 1


class LossCpTwice(BuiltinLossTokenMean):
    """planted: the per-token loss is multiplied by the CP size twice (the gradient x cp)"""

    def cp_factor(self, inputs: RankInputs) -> int:
        return inputs.cp_size * inputs.cp_size


class LossMicrobatchesMissing(BuiltinLoss):
    """planted: the sample-mean loss does not cancel the schedule's division by the number of
    micro-batches (the gradient x 1 / num_microbatches)"""

    def microbatch_factor(self, inputs: RankInputs) -> int:
        return 1


class LossCountPerMicrobatch(BuiltinLossTokenMean):
    """planted: the per-token loss divides by its own micro-batch's token count and hands megatron
    a count of 1, a mean of micro-batch means instead of the global batch's token mean"""

    def reduce(self, inputs: RankInputs, terms: list[torch.Tensor], counts: list[torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        zero = inputs.logits.new_zeros((), dtype=torch.float32)
        count = torch.stack(counts).sum().clamp_min(1) if counts else torch.ones(())
        return sum(terms, zero) * inputs.cp_size / count, torch.ones((), dtype=torch.int)


class LossSampleMeanAsTokenMean(BuiltinLossTokenMean):
    """planted: declares the token mean (calculate_per_token_loss=True) and reduces as the sample
    mean does"""

    def reduce(self, inputs: RankInputs, terms: list[torch.Tensor], counts: list[torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sample_mean(inputs, terms, counts)


class LossMaskMultiplied(BuiltinLoss):
    """planted: the loss mask multiplies the terms (x * mask) where it should select them, so a
    NaN at a masked position reaches the loss (NaN * 0 is NaN)"""

    def masked(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return values * mask


class LossLoggedUnreduced(BuiltinLoss):
    """planted: the logged loss is this rank's own (the all-reduce over the data-parallel ranks
    left out), its replica's mean where the global batch's is logged"""

    def logged_loss(self, reported: list[dict[str, torch.Tensor]], sizes: StepSizes) -> torch.Tensor:
        return self.logged_value(self.summed(reported), 1, sizes.global_batch_size // sizes.dp_size)


LOSSES: dict[str, type[BuiltinLoss]] = {
    "loss": BuiltinLoss,
    "loss_token_mean": BuiltinLossTokenMean,
    "loss_global_count": BuiltinLossGlobalCount,
    "loss_count_per_replica": LossCountPerReplica,
    "loss_cp_missing": LossCpMissing,
    "loss_cp_twice": LossCpTwice,
    "loss_microbatches_missing": LossMicrobatchesMissing,
    "loss_count_per_microbatch": LossCountPerMicrobatch,
    "loss_sample_mean_as_token_mean": LossSampleMeanAsTokenMean,
    "loss_mask_multiplied": LossMaskMultiplied,
    "loss_logged_unreduced": LossLoggedUnreduced,
}


def describe_variants() -> dict[str, Any]:
    return {name: " ".join((cls.__doc__ or "").split()) for name, cls in LOSSES.items()}
