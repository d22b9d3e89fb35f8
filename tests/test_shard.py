import torch

from shardcheck.harness.rank import shard
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


def test_row_targets_and_weights_follow_the_scored_rows():
    data = ScenarioData(SC)
    lay = rank_layout(Scenario.from_dict(SC.to_dict() | {"layout": "zigzag"}), 0, 1)
    targets, w_lp, w_ent = shard.row_targets_and_weights(data, lay)
    for row, (stream, pos) in enumerate(lay.row_positions()):
        j = lay.scored_token(stream, pos)
        if j is None:
            assert (targets[row], w_lp[row], w_ent[row]) == (0, 0, 0)
        else:
            assert targets[row] == data.tokens(stream)[pos + 1]
            assert w_lp[row] == data.loss_weights(stream)[0][j]
            assert w_ent[row] == data.loss_weights(stream)[1][j]


def test_share_pieces_score_the_share_tokens():
    data = ScenarioData(SC)
    for c in range(2):
        lay = rank_layout(SC, 0, c)
        pieces = shard.share_pieces(lay)
        positions = shard.global_positions(lay)
        assert sum(p.rows for p in pieces) == len(positions)
        rows = [(p.stream, r) for p in pieces for r in range(p.start, p.stop)]
        for (i, j), (stream, r) in zip(positions, rows):
            assert stream == i and r == SC.samples[i].prompt - 1 + j
        tgt = shard.share_targets(data, lay)
        assert [int(x) for x in tgt] == [int(data.tokens(i)[SC.samples[i].prompt + j]) for i, j in positions]
