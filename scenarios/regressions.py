"""The built-in ``regressions`` suite: named scenarios that expose each kind of bug the
frameworks have shipped (and each mutant of ``builtin`` that ``run`` finds)."""

from __future__ import annotations

from shardcheck.scenarios.scenario import Sample, Scenario

LONG_PROMPTS = (Sample(61, 3), Sample(40, 2))  # CP rank 0 of all-gather holds no response row


def regressions() -> list[Scenario]:
    """named scenarios exposing each bug class (empty slices, entropy grads, chunking, collectives)"""
    return [
        Scenario("ag-empty-local-slices", LONG_PROMPTS, vocab=32, cp=2, layout="allgather", entropy_coef=0.0,
                 seed=201, description="all-gather CP, entropy_coef 0: rank 0 has only empty slices, "
                 "rank 1 an empty zigzag share (None entropy, a skipped collective, placeholders that "
                 "require grad on some ranks)"),
        Scenario("ag-entropy-grad", LONG_PROMPTS + (Sample(30, 20),), vocab=32, tp=2, cp=2, layout="allgather",
                 entropy_coef=0.1, log_probs_chunk_size=7, seed=202,
                 description="all-gather CP with an entropy gradient (entropy without its gradient, the "
                 "decision made at one call site)"),
        Scenario("thd-tp2-chunks", (Sample(23, 9), Sample(14, 6), Sample(9, 1)), vocab=32, tp=2, entropy_coef=0.1,
                 log_probs_chunk_size=4, temperature=0.9, seed=203,
                 description="packed, TP 2, chunk 4 (chunk off-by-ones, TP collectives)"),
        Scenario("zigzag-tp2cp2-empty-share", LONG_PROMPTS, vocab=32, tp=2, cp=2, layout="zigzag",
                 entropy_coef=0.05, seed=204, description="zigzag CP with a rank holding no response token"),
        Scenario("bshd-tp4-boundaries", (Sample(12, 5), Sample(7, 1), Sample(30, 29)), vocab=32, tp=4,
                 layout="bshd", log_probs_chunk_size=5, entropy_coef=0.2, seed=205,
                 description="padded batch, prompt length 1, response length 1 (boundary off-by-ones)"),
        Scenario("zigzag-response-on-chunk-start", (Sample(36, 17), Sample(13, 4)), vocab=32, cp=2,
                 layout="zigzag", entropy_coef=0.1, seed=206,
                 description="zigzag CP, responses starting on the first row of a CP chunk, with and without "
                 "zigzag padding (a length-dependent off-by-one)"),
        Scenario("thd-tp2-bf16-wide", (Sample(40, 30), Sample(25, 20)), vocab=512, tp=2, dtype="bfloat16",
                 with_entropy=False, seed=5,
                 description="bfloat16 logits, a wide vocabulary: a log-softmax (or the softmax saved for "
                 "backward) computed in half precision misses the gradient by a few percent"),
        Scenario("ag-cp2-padding-rank", (Sample(100, 50),), vocab=32, cp=2, layout="allgather", entropy_coef=0.0,
                 seed=208, description="all-gather CP, one sample: with slime's padding (the packed stream to "
                 "cp * tp * 128) CP rank 1 holds only padding, with shardcheck's (cp * tp) both ranks hold "
                 "response rows (a rank of padding skipping a backward collective: slime 6ad61127e, 92682315a)"),
        Scenario("thd-one-device-edges", (Sample(23, 9), Sample(2, 1), Sample(9, 8)), vocab=37, entropy_coef=0.1,
                 log_probs_chunk_size=4, temperature=0.7, seed=207,
                 description="one device, packed: prompt 1, response 1, a chunk that does not divide the rows, "
                 "temperature (what a target without parallel code can run: tp 1, cp 1, thd)"),
    ]


def replay() -> list[Scenario]:
    """replayed keep sets (top-p / top-k replay) in every layout, at tp 2 (and one on one device; the
    sp layouts' rows are ulysses' and ring's alike: one of them)"""
    return [
        Scenario("replay-thd-one-device", (Sample(21, 11), Sample(6, 5)), vocab=24, entropy_coef=0.1,
                 temperature=0.9, replay_keep=True, seed=25),
        Scenario("replay-thd-tp2", (Sample(23, 12), Sample(14, 8)), vocab=32, tp=2, entropy_coef=0.1,
                 replay_keep=True, seed=21),
        Scenario("replay-bshd-tp2", (Sample(17, 9), Sample(12, 11)), vocab=32, tp=2, layout="bshd",
                 replay_keep=True, seed=22),
        Scenario("replay-zigzag-tp2cp2", (Sample(36, 17), Sample(21, 12)), vocab=32, tp=2, cp=2,
                 layout="zigzag", entropy_coef=0.1, replay_keep=True, seed=23),
        Scenario("replay-allgather-tp2cp2", (Sample(30, 14), Sample(19, 10)), vocab=32, tp=2, cp=2,
                 layout="allgather", replay_keep=True, seed=24),
        Scenario("replay-ulysses-tp2sp2", (Sample(13, 6), Sample(10, 5)), vocab=32, tp=2, sp=2, layout="ulysses",
                 log_probs_chunk_size=3, replay_keep=True, seed=26),
    ]


def sampling() -> list[Scenario]:
    """log-probs processed by a top-k / top-p filter of the logits (NeMo-RL's sampling definition)"""
    return [
        Scenario("sampling-thd-one-device", (Sample(21, 11), Sample(6, 5)), vocab=24, entropy_coef=0.1,
                 temperature=0.9, top_k=5, top_p=0.9, seed=31),
        # packed rows a multiple of tp, as NeMo-RL's top-k/top-p path needs (it pads to make them so)
        Scenario("sampling-thd-tp2-topk", (Sample(24, 12), Sample(14, 8)), vocab=32, tp=2, top_k=4, seed=32),
        Scenario("sampling-thd-tp2-topp", (Sample(23, 12), Sample(13, 8)), vocab=32, tp=2, top_p=0.7,
                 temperature=1.3, log_probs_chunk_size=4, seed=33),
        Scenario("sampling-bshd-tp2", (Sample(17, 9), Sample(12, 11)), vocab=32, tp=2, layout="bshd", top_k=8,
                 top_p=0.8, seed=34),
        Scenario("sampling-zigzag-tp2cp2", (Sample(36, 17), Sample(20, 12)), vocab=32, tp=2, cp=2,
                 layout="zigzag", entropy_coef=0.1, top_k=6, top_p=0.85, seed=35),
        Scenario("sampling-zigzag-cp2-greedy", (Sample(24, 15), Sample(16, 3)), vocab=32, cp=2, layout="zigzag",
                 top_k=1, seed=36, description="top-k 1: every log-prob is 0"),
        Scenario("sampling-allgather-tp2cp2", (Sample(30, 14), Sample(18, 10)), vocab=32, tp=2, cp=2,
                 layout="allgather", top_p=0.9, seed=37),
    ]
