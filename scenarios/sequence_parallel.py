"""The built-in ``sequence_parallel`` suite: the other family's sequence-parallel layouts, Ulysses
(verl's FSDP engine, AReaL's) and ring attention's split (OpenRLHF), in a world of 4 ranks at most: sp 2 (two data-parallel copies in a 4-rank
world), sp 4, and tp 2 x sp 2. Each scenario names the bug class it exposes."""

from __future__ import annotations

from shardcheck.scenarios.scenario import Sample, Scenario


def sequence_parallel() -> list[Scenario]:
    """Ulysses sequence parallelism: padding to sp, a rank with only padding, TP with SP, chunks"""
    return [
        Scenario("ulysses-sp2-padded", (Sample(13, 5), Sample(8, 3)), vocab=32, sp=2, layout="ulysses",
                 entropy_coef=0.1, seed=301,
                 description="Ulysses sp 2, a packed length of 21 padded to 22: the second slice holds a sample "
                 "boundary and the padding (a slice off by one, padding left in the gathered stream)"),
        Scenario("ulysses-sp4-padding-rank", (Sample(5, 2), Sample(4, 3)), vocab=32, sp=4, layout="ulysses",
                 entropy_coef=0.0, seed=302,
                 description="Ulysses sp 4, 9 tokens padded to 12: SP rank 3 holds only padding (a collective "
                 "skipped there hangs its peers)"),
        Scenario("ulysses-tp2-sp2-chunks", (Sample(17, 9), Sample(6, 2)), vocab=32, tp=2, sp=2, layout="ulysses",
                 entropy_coef=0.05, log_probs_chunk_size=4, temperature=0.8, seed=303,
                 description="TP 2 x Ulysses sp 2, chunk 4, temperature 0.8: vocab-parallel math on a sequence slice"),
        Scenario("ring-sp2-temperature", (Sample(9, 4), Sample(12, 6)), vocab=32, sp=2, layout="ring",
                 entropy_coef=0.1, temperature=0.7, seed=305,
                 description="ring attention's split (OpenRLHF), sp 2, 21 tokens padded to 22, an entropy term "
                 "at temperature 0.7 (entropy and log-probs at two temperatures, a scaled copy changed in place)"),
        Scenario("ulysses-sp2-exact", (Sample(10, 4), Sample(6, 5)), vocab=32, sp=2, layout="ulysses",
                 with_entropy=False, seed=304,
                 description="Ulysses sp 2 with no padding (16 tokens): log-probs only"),
    ]
