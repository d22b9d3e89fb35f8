"""Layouts are pure arithmetic: checked here without processes, against the definitions in
shardcheck.scenarios.layout's docstring (zigzag chunks, all-gather pieces, TP columns)."""

from collections import Counter

import pytest

from shardcheck.scenarios.layout import allgather_local_rows, rank_layout, zigzag_positions, zigzag_share
from shardcheck.scenarios import Sample, Scenario, get_suite

SMOKE = get_suite("smoke")


def _layouts(sc):
    return [rank_layout(sc, t, c) for c in range(sc.cp) for t in range(sc.tp)]


@pytest.mark.parametrize("sc", SMOKE, ids=lambda s: s.name)
def test_every_response_token_is_returned_by_exactly_one_cp_rank(sc):
    for t in range(sc.tp):
        seen = Counter()
        for c in range(sc.cp):
            lay = rank_layout(sc, t, c)
            for i, js in enumerate(lay.share):
                seen.update((i, j) for j in js)
        want = Counter((i, j) for i, s in enumerate(sc.samples) for j in range(s.response))
        assert seen == want


@pytest.mark.parametrize("sc", SMOKE, ids=lambda s: s.name)
def test_rows_cover_every_sample_row_once_per_tp_rank(sc):
    for t in range(sc.tp):
        rows = Counter()
        for c in range(sc.cp):
            lay = rank_layout(sc, t, c)
            assert lay.num_rows == lay.shape[0] * lay.shape[1]
            rows.update((s, p) for s, p in lay.row_positions() if s < len(sc.samples) and p < sc.samples[s].total)
        assert rows == Counter((i, p) for i, s in enumerate(sc.samples) for p in range(s.total))


def test_vocab_columns_are_contiguous_per_tp_rank():
    sc = Scenario("v", (Sample(5, 2),), vocab=12, tp=4)
    assert [rank_layout(sc, t, 0).columns for t in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]


def test_zigzag_matches_the_definition():
    # L=10, c=2: chunks of ceil(10/4)=3: [0,3) [3,6) [6,9) [9,12); rank 0 holds chunks 0 and 3.
    assert zigzag_positions(10, 2, 0) == [range(0, 3), range(9, 12)]
    assert zigzag_positions(10, 2, 1) == [range(3, 6), range(6, 9)]
    # prompt 4, response 6: rows 3..8 score tokens 0..5, all in rank 1's chunks; row 9 scores nothing
    assert zigzag_share(10, 6, 2, 0) == ()
    assert zigzag_share(10, 6, 2, 1) == (0, 1, 2, 3, 4, 5)
    # prompt 2, response 8: rows 1..8; rank 0 holds rows 1, 2 (chunk 0), rank 1 rows 3..8
    assert zigzag_share(10, 8, 2, 0) == (0, 1)
    assert zigzag_share(10, 8, 2, 1) == (2, 3, 4, 5, 6, 7)


def test_allgather_is_contiguous_and_padded():
    sc = Scenario("a", (Sample(5, 2), Sample(6, 3)), vocab=8, tp=2, cp=2, layout="allgather")
    assert allgather_local_rows(sc) == 6  # 11 -> padded to 12 (multiple of cp*tp=4), /2
    lay0, lay1 = rank_layout(sc, 0, 0), rank_layout(sc, 0, 1)
    assert lay0.row_positions() == [(0, p) for p in range(5)] + [(1, 0)]
    assert lay1.row_positions() == [(1, p) for p in range(1, 6)] + [(2, 0)]  # one tail padding row
    assert lay0.shape == (1, 6, 4)


# All-gather CP pads the packed rows up to a multiple of cp * tp and cuts them in cp contiguous
# pieces. Worked out by hand for totals that are and are not such multiples (padding is where
# an off-by-one hides): (samples, tp, cp, rows per rank, each CP rank's rows, None for padding).
ALLGATHER_BY_HAND = {
    "cp2-tp1-total8-no-padding": (
        (Sample(5, 2), Sample(3, 1)), 1, 2, 4,
        [[(0, 0), (0, 1), (0, 2), (0, 3)],
         [(0, 4), (1, 0), (1, 1), (1, 2)]]),
    "cp2-tp1-total9-pads-to-10": (
        (Sample(5, 2), Sample(4, 1)), 1, 2, 5,
        [[(0, 0), (0, 1), (0, 2), (0, 3), (0, 4)],
         [(1, 0), (1, 1), (1, 2), (1, 3), None]]),
    "cp2-tp2-total12-no-padding": (
        (Sample(5, 2), Sample(7, 3)), 2, 2, 6,
        [[(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (1, 0)],
         [(1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (1, 6)]]),
    "cp2-tp2-total11-pads-to-12": (
        (Sample(5, 2), Sample(6, 3)), 2, 2, 6,
        [[(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (1, 0)],
         [(1, 1), (1, 2), (1, 3), (1, 4), (1, 5), None]]),
    "cp2-tp2-total9-pads-to-12": (
        (Sample(5, 2), Sample(4, 1)), 2, 2, 6,
        [[(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (1, 0)],
         [(1, 1), (1, 2), (1, 3), None, None, None]]),
    # the last rank holds padding only
    "cp4-tp1-total6-pads-to-8": (
        (Sample(4, 1), Sample(2, 1)), 1, 4, 2,
        [[(0, 0), (0, 1)], [(0, 2), (0, 3)], [(1, 0), (1, 1)], [None, None]]),
}


@pytest.mark.parametrize("case", ALLGATHER_BY_HAND)
def test_allgather_padding_matches_the_hand_computed_rows(case):
    samples, tp, cp, local_rows, rows_by_cp_rank = ALLGATHER_BY_HAND[case]
    sc = Scenario("a", samples, vocab=8, tp=tp, cp=cp, layout="allgather")
    assert allgather_local_rows(sc) == local_rows
    for c in range(cp):
        for t in range(tp):  # TP ranks split columns, never rows
            lay = rank_layout(sc, t, c)
            assert lay.shape == (1, local_rows, 8 // tp)
            rows = [(s, p) if s < len(samples) and p < samples[s].total else None for s, p in lay.row_positions()]
            assert rows == rows_by_cp_rank[c]


def test_bshd_pads_each_sample_to_the_longest():
    sc = Scenario("b", (Sample(5, 2), Sample(3, 1)), vocab=8, layout="bshd")
    lay = rank_layout(sc, 0, 0)
    assert lay.shape == (2, 5, 8)
    assert lay.row_positions()[5:] == [(1, p) for p in range(5)]
    assert lay.scored_token(1, 3) is None and lay.scored_token(1, 1) == 0


# The smoke suite must hold the shapes that break sharded code (issue #3's list).
def test_smoke_covers_the_edge_shapes():
    assert len(SMOKE) >= 40
    pairs = {(s.layout, s.tp, s.cp) for s in SMOKE}
    for layout, allowed in {"thd": [(1, 1), (2, 1), (4, 1)], "bshd": [(1, 1), (2, 1), (4, 1)],
                            "zigzag": [(1, 2), (2, 2), (1, 4)], "allgather": [(1, 2), (2, 2), (1, 4)]}.items():
        for tp, cp in allowed:
            assert (layout, tp, cp) in pairs
    samples = [smp for s in SMOKE for smp in s.samples]
    assert any(smp.response == 1 for smp in samples)
    assert any(smp.prompt == 1 for smp in samples)
    assert any(len(s.samples) >= 10 for s in SMOKE)
    assert any(not s.with_entropy for s in SMOKE)
    assert any(s.entropy_coef == 0 and s.with_entropy for s in SMOKE)
    assert any(s.entropy_coef != 0 for s in SMOKE)
    assert any(s.temperature != 1 for s in SMOKE)

    def empty_rank(s):  # some CP rank returns no response token at all
        return any(all(not js for js in rank_layout(s, 0, c).share) for c in range(s.cp))

    def no_local_scored(s):  # some all-gather rank holds no scored row at all
        return any(all(lay.scored_token(*rp) is None for rp in lay.row_positions())
                   for lay in (rank_layout(s, 0, c) for c in range(s.cp)))

    def spans_boundary(s):  # a response split over several CP ranks
        return any(sum(1 for c in range(s.cp) if rank_layout(s, 0, c).share[i]) > 1 for i in range(len(s.samples)))

    def chunk_not_dividing(s):
        return s.log_probs_chunk_size > 1 and any(lay.num_rows % s.log_probs_chunk_size for lay in _layouts(s))

    assert any(empty_rank(s) for s in SMOKE if s.layout == "zigzag")
    assert any(empty_rank(s) for s in SMOKE if s.layout == "allgather")
    assert any(no_local_scored(s) for s in SMOKE if s.layout == "allgather")
    assert any(spans_boundary(s) for s in SMOKE if s.cp > 1)
    assert any(chunk_not_dividing(s) for s in SMOKE)


@pytest.mark.parametrize("layout", ["ulysses", "ring"])
def test_the_sp_layouts_cut_the_padded_packed_sequence_into_contiguous_slices(layout):
    # 5 + 4 = 9 tokens padded to 12 over sp 4: 3 rows a rank, rank 3 only padding (stream 2 is
    # the tail padding); every rank owes every response token (its outputs are gathered)
    sc = Scenario("u", [[5, 2], [4, 3]], vocab=8, tp=2, sp=4, layout=layout)
    assert sc.ranks == 8 and sc.seq == 4 and sc.to_dict()["sp"] == 4 and Scenario.from_dict(sc.to_dict()) == sc
    pieces = [[(p.stream, p.start, p.stop) for p in rank_layout(sc, 1, r).pieces] for r in range(4)]
    assert pieces == [[(0, 0, 3)], [(0, 3, 5), (1, 0, 1)], [(1, 1, 4)], [(2, 0, 3)]]
    for r in range(4):
        lay = rank_layout(sc, 1, r)
        assert lay.shape == (1, 3, 4) and lay.columns == (4, 8) and lay.share == ((0, 1), (0, 1, 2))
    assert "sp" not in Scenario("t", [[5, 2]], vocab=8).to_dict()  # written when on: older files hold


def test_the_tokens_a_frameworks_model_must_be_handed_are_the_rows_tokens():
    """RankInputs.row_tokens / check_model_tokens, which verl:fsdp, areal:fsdp and openrlhf ask
    before their framework's model output stands in: hand-laid rows (ulysses sp 2: 5 + 4 tokens
    padded to 10, rank 1 holds tokens 5..8 and one padding row; bshd pads each sample with 0), and
    the same ids a row late are refused, naming who built them."""
    import torch

    from shardcheck.targets.base import RankInputs

    tokens = [torch.arange(10, 15), torch.arange(20, 24)]

    def inputs(sc, sp_rank):
        lay = rank_layout(sc, 0, sp_rank)
        return RankInputs(logits=torch.zeros(lay.shape), tokens=tokens, total_lengths=[5, 4], response_lengths=[2, 3],
                          layout=sc.layout, with_entropy=False, entropy_coef=0.0, temperature=1.0, chunk_size=-1,
                          max_seq_lens=None, tp_group=None, cp_group=None, tp_rank=0, tp_size=1, cp_rank=0, cp_size=1,
                          rank_layout=lay)

    rank1 = inputs(Scenario("u", [[5, 2], [4, 3]], vocab=4, sp=2, layout="ulysses"), 1)
    assert rank1.row_tokens().tolist() == [[20, 21, 22, 23, 0]]
    padded = inputs(Scenario("b", [[5, 2], [4, 3]], vocab=4, layout="bshd"), 0)
    assert padded.row_tokens().tolist() == [[10, 11, 12, 13, 14], [20, 21, 22, 23, 0]]
    rank1.check_model_tokens(torch.tensor([[20, 21, 22, 23, 0]]), "x's engine")  # the right ids pass
    with pytest.raises(RuntimeError, match=r"x's engine hands this rank's model other tokens \(\[21, 22, 23, 0, 0\]\)"):
        rank1.check_model_tokens(torch.tensor([[21, 22, 23, 0, 0]]), "x's engine")
