"""megatron-core's ``tensor_parallel.vocab_parallel_cross_entropy`` as the log-prob path.

log p(target) = -cross_entropy(logits / temperature). megatron-core computes no entropy, and no
per-sample extraction: this adapter takes each row's label and the rows scoring each rank's share
from the harness (``RankInputs.row_labels``/``scored_rows``), so what is checked is megatron's vocab-parallel kernel and its gradient.
"""

from __future__ import annotations

from typing import Any

from shardcheck.targets.base import Capabilities, RankInputs, RankOutputs, TargetBase


class MegatronTarget(TargetBase):
    """megatron-core tensor_parallel.vocab_parallel_cross_entropy (log-probs only; no entropy)"""

    name = "megatron"
    capabilities = Capabilities(
        layouts=frozenset({"thd", "bshd", "zigzag"}),
        entropy=False,
        dtypes=frozenset({"float32"}),
        reasons=(
            ("entropy", "megatron-core's vocab_parallel_cross_entropy computes no entropy"),
            ("layout", "all-gather CP redistribution is not part of megatron-core's cross entropy"),
            ("dtype", "megatron-core's cross entropy is checked on float32 logits"),
        ),
    )

    def describe(self) -> dict[str, Any]:
        from importlib.metadata import version

        return {"name": self.name, "version": version("megatron-core"),
                "function": "megatron.core.tensor_parallel.vocab_parallel_cross_entropy"}

    def release(self) -> None:
        """Nothing to undo: it sets nothing process-wide."""

    def compute(self, inputs: RankInputs) -> RankOutputs:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        rows = inputs.logits.reshape(-1, inputs.logits.size(-1))
        if inputs.temperature != 1.0:
            rows = rows / inputs.temperature
        loss = vocab_parallel_cross_entropy(rows.unsqueeze(1), inputs.row_labels().unsqueeze(1))  # [T, 1]
        log_prob = -loss.squeeze(1)
        return RankOutputs([log_prob[r] for r in inputs.scored_rows()])
