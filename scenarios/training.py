"""The ``training`` suite: whole training steps (a global batch over data-parallel replicas and
micro-batches) on a 4-rank world, for a target whose loss is a training step's (docs/training.md).

The sizes differ from cell to cell so that a wrong scale names one of them: the number of
micro-batches is 3 where dp or cp is 2, cp is 4 where there are 2 micro-batches, dp is 4 where
there is one. Every cell has masked tokens (scenarios.data) and samples of different lengths, so a
per-sample reduction and a per-token one give different gradients.
"""

from __future__ import annotations

from shardcheck.scenarios.scenario import Sample, Scenario


def _samples(*pairs: tuple[int, int]) -> tuple[Sample, ...]:
    return tuple(Sample(t, r) for t, r in pairs)


SIX = _samples((23, 9), (14, 6), (9, 1), (17, 11), (30, 4), (12, 7))


def smoke_steps() -> list[Scenario]:
    """The smoke suite's training-step cells: dp 2 and several micro-batches in a 4-rank world."""
    return [
        Scenario("step-thd-dp2-mb3", SIX, vocab=48, dp=2, micro_batch_size=1, entropy_coef=0.1, seed=501,
                 description="dp 2, three micro-batches of one sample each, entropy bonus"),
        Scenario("step-zigzag-dp2cp2-mb2", _samples((23, 9), (40, 2), (14, 6), (9, 1)), vocab=32, dp=2, cp=2,
                 layout="zigzag", micro_batch_size=1, seed=502,
                 description="dp 2 x cp 2, two micro-batches, a long prompt leaving a CP rank no token"),
        Scenario("step-allgather-dp2cp2-tokens", SIX, vocab=32, dp=2, cp=2, layout="allgather",
                 micro_batch_tokens=40, entropy_coef=0.05, seed=503,
                 description="dp 2 x cp 2, micro-batches by a token budget of 40 (dynamic batching)"),
        Scenario("step-bshd-dp2tp2-mb3", SIX, vocab=64, dp=2, tp=2, layout="bshd", micro_batch_size=1,
                 with_entropy=False, seed=504, description="dp 2 x tp 2, padded, three micro-batches, no entropy"),
    ]


def training() -> list[Scenario]:
    """training steps: dp x tp x cp = 4 with 1 to 3 micro-batches, every layout, scales told apart"""
    return smoke_steps() + [
        Scenario("step-zigzag-tp2cp2-mb3", SIX[:3], vocab=32, tp=2, cp=2, layout="zigzag", micro_batch_size=1,
                 entropy_coef=0.1, temperature=0.8, seed=511,
                 description="tp 2 x cp 2, one replica, three micro-batches: cp 2, num_microbatches 3"),
        Scenario("step-zigzag-cp4-mb2", SIX[:4], vocab=32, cp=4, layout="zigzag", micro_batch_size=2,
                 entropy_coef=0.1, seed=512, description="cp 4, two micro-batches"),
        Scenario("step-thd-dp4", SIX[:4], vocab=32, dp=4, entropy_coef=0.1, seed=513,
                 description="dp 4, one micro-batch each"),
        Scenario("step-allgather-cp2tp2-mb3", SIX, vocab=32, tp=2, cp=2, layout="allgather", micro_batch_size=2,
                 log_probs_chunk_size=3, seed=514, description="all-gather cp 2 x tp 2, three micro-batches, chunk 3"),
        Scenario("step-thd-dp2tp2-bf16", SIX[:4], vocab=64, dp=2, tp=2, micro_batch_size=1, dtype="bfloat16",
                 entropy_coef=0.1, seed=515, description="bfloat16 logits, dp 2 x tp 2, two micro-batches"),
    ]
