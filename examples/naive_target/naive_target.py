"""A third-party shardcheck target: log-probs and entropy the naive way, for packed (thd) batches
under tensor parallelism. It gathers the vocabulary shards and takes a full log-softmax."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardcheck.targets import Capabilities, RankInputs, RankOutputs, TargetBase


class _GatherVocab(torch.autograd.Function):
    """All TP ranks' vocab shards side by side; each rank's gradient is its own columns."""

    @staticmethod
    def forward(ctx, local, group):  # type: ignore[override]
        ctx.rank, ctx.width = dist.get_rank(group), local.size(-1)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad[..., ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width], None


class NaiveTarget(TargetBase):
    name = "naive"
    capabilities = Capabilities(layouts=frozenset({"thd"}), entropy=True, dtypes=frozenset({"float32"}))

    def describe(self) -> dict:
        return {"name": self.name, "version": "0.1.0"}

    def compute(self, inputs: RankInputs) -> RankOutputs:
        logits = _GatherVocab.apply(inputs.logits[0], inputs.tp_group).float() / inputs.temperature
        logp_all = torch.log_softmax(logits, dim=-1)
        entropy_all = -(logp_all.exp() * logp_all).sum(-1)
        log_probs, entropy, start = [], [], 0
        for tokens, total, response in zip(inputs.tokens, inputs.total_lengths, inputs.response_lengths):
            rows = slice(start + total - response - 1, start + total - 1)  # row p predicts token p + 1
            targets = tokens[total - response :].to(logits.device).unsqueeze(-1)
            log_probs.append(logp_all[rows].gather(-1, targets).squeeze(-1))
            entropy.append(entropy_all[rows])
            start += total
        return RankOutputs(log_probs, entropy if inputs.with_entropy else None)


def make() -> NaiveTarget:
    return NaiveTarget()
