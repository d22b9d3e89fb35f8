import pytest
import torch

from shardcheck.harness.rank.life import shard
from shardcheck.scenarios.layout import rank_layout
from shardcheck.scenarios import Sample, Scenario
from shardcheck.scenarios.data import BLOCK_ROWS, ScenarioData

SC = Scenario("s", (Sample(70, 9), Sample(5, 4), Sample(33, 1)), vocab=12, tp=2, cp=2, layout="allgather",
              entropy_coef=0.1, seed=3)


def test_rows_are_the_same_wherever_they_are_generated():
    data = ScenarioData(SC)
    whole = data.logit_rows(0, 0, 3 * BLOCK_ROWS)
    for a, b in [(0, 1), (BLOCK_ROWS - 1, BLOCK_ROWS + 2), (5, 2 * BLOCK_ROWS + 7)]:
        assert torch.equal(data.logit_rows(0, a, b), whole[a:b])
    assert torch.equal(ScenarioData(SC).tokens(2), data.tokens(2))
    other = Scenario.from_dict(SC.to_dict() | {"seed": 4})
    assert not torch.equal(ScenarioData(other).logit_rows(0, 0, 4), whole[:4])


def test_dtype_is_applied():
    bf = Scenario.from_dict(SC.to_dict() | {"dtype": "bfloat16"})
    assert ScenarioData(bf).logit_rows(1, 0, 3).dtype == torch.bfloat16


def test_local_logits_hold_exactly_the_layouts_rows_and_columns():
    data = ScenarioData(SC)
    for layout_name, cp in (("allgather", 2), ("zigzag", 2)):
        sc = Scenario.from_dict(SC.to_dict() | {"layout": layout_name, "cp": cp})
        for c in range(sc.cp):
            for t in range(sc.tp):
                lay = rank_layout(sc, t, c)
                local = shard.local_logits(data, lay)
                assert tuple(local.shape) == lay.shape
                flat = local.reshape(-1, local.size(-1))
                lo, hi = lay.columns
                for row, (stream, pos) in enumerate(lay.row_positions()):
                    assert torch.equal(flat[row], data.logit_rows(stream, pos, pos + 1)[0, lo:hi])


# Two samples small enough to lay out by hand, under the rules of shardcheck.scenarios.layout's
# docstring. Sample 0: 5 tokens, prompt 2, so rows 1, 2, 3 score response tokens 0, 1, 2 and row 4
# (the last) predicts nothing. Sample 1: 4 tokens, prompt 2, rows 1, 2 score tokens 0, 1.
HAND_SAMPLES = (Sample(5, 3), Sample(4, 2))

# Each rank's local rows as (sample, position), None for padding.
# zigzag cp=2: sample 0 is cut in 4 chunks of ceil(5/4)=2 rows: [0,2) [2,4) [4,6) [6,8), positions
# 5..7 padding; sample 1 in 4 chunks of 1 row. Rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
# allgather cp=2, tp=1: the 9 packed rows are padded to 10 (a multiple of cp*tp=2), 5 per rank.
HAND_ROWS = {
    ("thd", 1, 0): [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (1, 0), (1, 1), (1, 2), (1, 3)],
    ("zigzag", 2, 0): [(0, 0), (0, 1), None, None, (1, 0), (1, 3)],
    ("zigzag", 2, 1): [(0, 2), (0, 3), (0, 4), None, (1, 1), (1, 2)],
    ("allgather", 2, 0): [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4)],
    ("allgather", 2, 1): [(1, 0), (1, 1), (1, 2), (1, 3), None],
}

# Per local row, the token it predicts where it scores a response token (else 0), and that
# token's w_logprob (else 0); w_entropy is its negative (NumberedData).
HAND_ROW_TARGETS = {
    ("thd", 1, 0): ([0, 12, 13, 14, 0, 0, 22, 23, 0], [0, 1, 2, 3, 0, 0, 11, 12, 0]),
    ("zigzag", 2, 0): ([0, 12, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0]),
    ("zigzag", 2, 1): ([13, 14, 0, 0, 22, 23], [2, 3, 0, 0, 11, 12]),
    # all-gather rows score what they hold, not the rank's (zigzag) share
    ("allgather", 2, 0): ([0, 12, 13, 14, 0], [0, 1, 2, 3, 0]),
    ("allgather", 2, 1): ([0, 22, 23, 0, 0], [0, 11, 12, 0, 0]),
}

# Per rank: the response tokens its share holds per sample, the (sample, row) scoring each, and
# the token each of those rows predicts. With cp=2 the share is the zigzag one in both layouts:
# rank 0's chunks hold only row 1 of sample 0 among the scored rows, and none of sample 1.
ZIGZAG_SHARES = {
    0: (((0,), ()), [(0, 1)], [12]),
    1: (((1, 2), (0, 1)), [(0, 2), (0, 3), (1, 1), (1, 2)], [13, 14, 22, 23]),
}
HAND_SHARES = {
    ("thd", 1, 0): (((0, 1, 2), (0, 1)), [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2)], [12, 13, 14, 22, 23]),
    ("zigzag", 2, 0): ZIGZAG_SHARES[0],
    ("zigzag", 2, 1): ZIGZAG_SHARES[1],
    ("allgather", 2, 0): ZIGZAG_SHARES[0],
    ("allgather", 2, 1): ZIGZAG_SHARES[1],
}


class NumberedData(ScenarioData):
    """Tokens and weights that name their place, so expectations can be written as numbers:
    sample i's token at position p is 10 * (i + 1) + p; its response token j has
    w_logprob = 10 * i + j + 1 and w_entropy = -w_logprob."""

    def tokens(self, sample):
        return torch.arange(self.scenario.samples[sample].total) + 10 * (sample + 1)

    def loss_weights(self, sample):
        w_lp = torch.arange(self.scenario.samples[sample].response, dtype=torch.float32) + 10 * sample + 1
        return w_lp, -w_lp


def _case_id(key):
    layout_name, cp, cp_rank = key
    return f"{layout_name}-cp{cp}-rank{cp_rank}"


def _hand_layout(key):
    layout_name, cp, cp_rank = key
    sc = Scenario("hand", HAND_SAMPLES, vocab=32, cp=cp, layout=layout_name, seed=3)
    return rank_layout(sc, 0, cp_rank)


def _rows_or_padding(lay):
    samples = lay.scenario.samples
    return [(s, p) if s < len(samples) and p < samples[s].total else None for s, p in lay.row_positions()]


@pytest.mark.parametrize("key", HAND_ROWS, ids=_case_id)
def test_local_rows_are_the_hand_laid_out_rows(key):
    lay = _hand_layout(key)
    assert _rows_or_padding(lay) == HAND_ROWS[key]
    data = ScenarioData(lay.scenario)
    local = shard.local_logits(data, lay).reshape(-1, lay.scenario.vocab)
    assert local.shape[0] == len(HAND_ROWS[key])
    for row, place in enumerate(HAND_ROWS[key]):
        if place is not None:
            sample, position = place
            assert torch.equal(local[row], data.logit_rows(sample, position, position + 1)[0])


@pytest.mark.parametrize("key", HAND_ROW_TARGETS, ids=_case_id)
def test_row_targets_and_weights_follow_the_scored_rows(key):
    lay = _hand_layout(key)
    targets, w_lp, w_ent = shard.row_targets_and_weights(NumberedData(lay.scenario), lay)
    want_targets, want_w_lp = HAND_ROW_TARGETS[key]
    assert targets.tolist() == want_targets
    assert w_lp.tolist() == want_w_lp
    assert w_ent.tolist() == [-w for w in want_w_lp]


@pytest.mark.parametrize("key", HAND_SHARES, ids=_case_id)
def test_share_pieces_score_the_share_tokens(key):
    lay = _hand_layout(key)
    want_share, want_rows, want_targets = HAND_SHARES[key]
    assert lay.share == want_share
    assert [(p.stream, r) for p in shard.share_pieces(lay) for r in range(p.start, p.stop)] == want_rows
    assert shard.share_targets(NumberedData(lay.scenario), lay).tolist() == want_targets
    assert shard.global_positions(lay) == [(i, j) for i, js in enumerate(want_share) for j in js]
