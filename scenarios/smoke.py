"""The built-in ``smoke`` suite: every layout at every (tp, cp) it allows on 4 ranks, each with
the shapes that break sharded code.

Per (layout, tp, cp), four scenarios:
- ``basic``: two samples, entropy with a non-zero coefficient, temperature != 1;
- ``edges``: response length 1, prompt length 1, a response spanning CP chunk boundaries, and a
  chunk size that does not divide the local row count;
- ``long-prompt``: long prompts with short responses, so some CP rank holds no response token at
  all (zigzag: an empty share; all-gather: empty local slices), entropy_coef 0;
- ``many``: many short samples, no entropy, chunk size 1;
- ``replay``: replayed top-p / top-k keep sets (processed log-probs, slime's definition: the
  log-prob renormalised over the set, the target always kept, the entropy over the whole
  vocabulary), with a response whose first scored row starts a CP chunk at cp 2 and at cp 4.
A few more try half precision and larger vocabularies, and four cells are whole training steps
(dp 2, several micro-batches: scenarios.training), which a target whose loss is not a training
step's skips.
"""

from __future__ import annotations

import dataclasses

from shardcheck.scenarios.scenario import Sample, Scenario

TP_CP = {
    "thd": [(1, 1), (2, 1), (4, 1)],
    "bshd": [(1, 1), (2, 1), (4, 1)],
    "zigzag": [(1, 2), (2, 2), (1, 4)],
    "allgather": [(1, 2), (2, 2), (1, 4)],
}


def _samples(*pairs: tuple[int, int]) -> tuple[Sample, ...]:
    return tuple(Sample(t, r) for t, r in pairs)


def _grid() -> list[Scenario]:
    out, cell = [], 0
    for layout, pairs in TP_CP.items():
        for tp, cp in pairs:
            tag = f"{layout}-tp{tp}cp{cp}"
            seed = 4 * cell  # the seeds smoke had before replay, so the others kept their data
            cell += 1
            out += [
                Scenario(f"{tag}-basic", _samples((23, 9), (14, 6)), vocab=64, tp=tp, cp=cp, layout=layout,
                         entropy_coef=0.1, temperature=0.8, seed=seed,
                         description="two samples, entropy gradient on, temperature 0.8"),
                Scenario(f"{tag}-edges", _samples((9, 1), (5, 4), (2, 1), (17, 11)), vocab=40, tp=tp, cp=cp,
                         layout=layout, entropy_coef=-0.05, log_probs_chunk_size=3, seed=seed + 1,
                         description="response 1, prompt 1, response across CP chunks, chunk 3"),
                Scenario(f"{tag}-long-prompt", _samples((61, 3), (40, 2)), vocab=48, tp=tp, cp=cp,
                         layout=layout, entropy_coef=0.0, seed=seed + 2,
                         description="long prompts: some CP ranks hold no response token"),
                Scenario(f"{tag}-many", _samples(*[(4 + i % 5, 1 + i % 3) for i in range(12)]), vocab=32,
                         tp=tp, cp=cp, layout=layout, with_entropy=False, log_probs_chunk_size=1,
                         seed=seed + 3, description="twelve short samples, no entropy, chunk 1"),
                # 32 tokens, prompt 9: the first scored row, 8, starts a zigzag chunk at cp 2 and cp 4
                Scenario(f"{tag}-replay", _samples((32, 23), (17, 9), (5, 1)), vocab=32, tp=tp, cp=cp,
                         layout=layout, entropy_coef=0.1, log_probs_chunk_size=5, replay_keep=True,
                         seed=1000 + seed, description="replayed keep sets (top-p / top-k), every edge"),
            ]
    return out


def _extras() -> list[Scenario]:
    return [
        Scenario("thd-tp1cp1-vocab37", _samples((30, 12)), vocab=37, temperature=1.7, entropy_coef=0.3,
                 log_probs_chunk_size=7, seed=101, description="vocab not a multiple of 8"),
        Scenario("thd-tp2cp1-bf16", _samples((20, 8), (11, 5)), vocab=64, tp=2, dtype="bfloat16",
                 entropy_coef=0.1, seed=102, description="bfloat16 logits"),
        Scenario("zigzag-tp2cp2-fp16", _samples((33, 20), (8, 3)), vocab=64, tp=2, cp=2, layout="zigzag",
                 dtype="float16", entropy_coef=0.1, seed=103, description="float16 logits"),
        Scenario("allgather-tp1cp4-wide", _samples((70, 50), (9, 2), (25, 1)), vocab=1024, cp=4,
                 layout="allgather", entropy_coef=0.02, log_probs_chunk_size=16, seed=104,
                 description="larger vocabulary, responses across all-gather pieces"),
    ]


def logprob() -> list[Scenario]:
    """the smoke grid without entropy (for log-prob-only targets such as megatron)"""
    return [
        dataclasses.replace(sc, name=f"{sc.name}-logprob", with_entropy=False, entropy_coef=0.0)
        for sc in _grid() + _extras()
    ]


def smoke() -> list[Scenario]:
    """every layout at every (tp, cp) it allows on 4 ranks, with the edge shapes, and training steps"""
    from shardcheck.scenarios.training import smoke_steps

    return _grid() + _extras() + smoke_steps()


def large() -> list[Scenario]:
    """tp * cp = 8 (8x1, 1x8, 2x4, 4x2) on an 8-rank world, long prompts leaving CP ranks empty"""
    # and the same samples on one device (8 replicas): what a target without parallel code runs
    out = [Scenario("thd-tp1cp1-large", _samples((97, 5), (64, 33), (33, 17)), vocab=64, entropy_coef=0.1,
                    log_probs_chunk_size=7, temperature=0.9, seed=299, description="the large samples, tp 1 cp 1")]
    for tp, cp, layouts in ((8, 1, ("thd", "bshd")), (1, 8, ("zigzag", "allgather")), (2, 4, ("zigzag", "allgather")),
                            (4, 2, ("zigzag", "allgather"))):
        for layout in layouts:
            out.append(Scenario(f"{layout}-tp{tp}cp{cp}-large", _samples((97, 5), (64, 33), (33, 17)), vocab=64, tp=tp,
                                cp=cp, layout=layout, entropy_coef=0.1, log_probs_chunk_size=7, temperature=0.9,
                                seed=300 + len(out),
                                description="a long prompt with a short response (empty CP shares), a response "
                                "starting mid-sample, chunk 7"))
    return out
