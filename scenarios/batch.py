"""A scenario's samples as the global batch of one training step: which samples each
data-parallel replica gets and how it splits them into micro-batches. Pure arithmetic.

The rules are Megatron's, as a framework on megatron-core uses them:

- a fixed micro-batch size ``mbs`` (``micro_batch_size``; 0 takes a replica's whole share as one
  micro-batch): megatron's pretraining sampler. The global batch is read micro-batch after
  micro-batch, ``mbs * dp`` samples at a time, replica ``r`` taking the ``r``-th run of ``mbs``;
- a token budget (``micro_batch_tokens``, dynamic batching as slime's ``use_dynamic_batch_size``):
  replica ``r`` takes the ``r``-th contiguous block of ``n / dp`` samples and packs them in order,
  a new micro-batch whenever the next sample would exceed the budget. Every replica must run the
  same number of micro-batches (its gradient sync is one collective), so the count is the largest
  any replica needs (slime all-reduces it with MAX); a replica that needs fewer splits its fullest
  micro-batch (by tokens, then the earliest) in two, in order, until it has as many.

A sample keeps its identity (``data_id``) in its micro-batch (``Scenario.micro_batch``), so it
carries the same tokens, logits and weights as in the global batch (:mod:`shardcheck.scenarios.data`).
Nothing here knows a Scenario: the rules take the samples' lengths and the sizes, so the scenario's
own validation can ask them.
"""

from __future__ import annotations

from collections.abc import Sequence


def replica_micro_batches(totals: Sequence[int], dp: int, replica: int, micro_batch_size: int = 0,
                          micro_batch_tokens: int = 0) -> list[tuple[int, ...]]:
    """The sample indices of each micro-batch replica ``replica`` (of ``dp``) runs, in the order
    it runs them, for samples of ``totals`` tokens."""
    if not 0 <= replica < dp:
        raise ValueError(f"replica {replica} outside dp={dp}")
    n = len(totals)
    if micro_batch_tokens:
        return token_budget_split(totals, dp, micro_batch_tokens)[replica]
    mbs = micro_batch_size or n // dp
    return [tuple(range(start + replica * mbs, start + (replica + 1) * mbs)) for start in range(0, n, mbs * dp)]


def token_budget_split(totals: Sequence[int], dp: int, budget: int) -> list[list[tuple[int, ...]]]:
    """Per replica, its micro-batches under a token budget; ValueError where a replica has fewer
    samples than the micro-batches every replica must run."""
    per = len(totals) // dp
    greedy = []
    for r in range(dp):
        batches: list[list[int]] = []
        used = 0
        for i in range(r * per, (r + 1) * per):
            if not batches or used + totals[i] > budget:
                batches.append([])
                used = 0
            batches[-1].append(i)
            used += totals[i]
        greedy.append(batches)
    count = max(len(b) for b in greedy)
    if per < count:
        raise ValueError(f"micro_batch_tokens {budget}: a replica needs {count} micro-batches and another holds "
                         f"only {per} samples (every replica runs as many micro-batches)")
    out = []
    for batches in greedy:
        while len(batches) < count:
            k = max((k for k in range(len(batches)) if len(batches[k]) > 1),
                    key=lambda k: (sum(totals[i] for i in batches[k]), -k))
            half = (len(batches[k]) + 1) // 2
            batches[k:k + 1] = [batches[k][:half], batches[k][half:]]
        out.append([tuple(b) for b in batches])
    return out
