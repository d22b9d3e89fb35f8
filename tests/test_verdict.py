"""The verdict of one scenario from its ranks' results (harness/controller/reports/verdict.merge), without
processes: what makes it fail or time out, and that the layout check of all ranks together
reaches it."""

import torch

from shardcheck.harness.controller.reports.verdict import FAIL, PASS, TIMED_OUT, merge
from shardcheck.harness.rank.life.data_path import layout_payload
from shardcheck.scenarios.traced_layout import decode
from shardcheck.harness.wire import Failure, RankResult
from shardcheck.scenarios import Sample, Scenario

SC = Scenario("v", (Sample(8, 3),), vocab=4, cp=2, layout="zigzag")


def _timeout(rank: int) -> Failure:
    return Failure("timeout", f"rank {rank} missed its deadline", [rank])


def _waited(rank: int, on: int) -> Failure:
    return Failure("timeout", f"rank {rank} waited for rank {on}", [rank], details={"waited_for": [on]})


def test_nothing_found_passes_and_a_finding_fails():
    assert merge(SC, [RankResult(0, 0), RankResult(1, 0)], 0.1).status == PASS
    wrong = Failure("value_mismatch", "log_probs sample 0 token 1: got 1, want 2", [0], sample=0, token=1)
    assert merge(SC, [RankResult(0, 0, [wrong]), RankResult(1, 0)], 0.1).status == FAIL


def test_only_missed_deadlines_time_out_and_a_real_finding_beside_one_fails():
    """A deadline the machine missed is not the target's fault (exit 3); a value wrong on another
    rank at the same time is (exit 1), whatever else timed out."""
    assert merge(SC, [RankResult(0, 0, [_waited(0, 1)]), RankResult(1, 0, [_timeout(1)])], 0.1).status == TIMED_OUT
    wrong = Failure("value_mismatch", "log_probs sample 0 token 1: got 1, want 2", [0], sample=0, token=1)
    assert merge(SC, [RankResult(0, 0, [wrong]), RankResult(1, 0, [_timeout(1)])], 0.1).status == FAIL


def test_a_position_no_rank_holds_reaches_the_verdict():
    """The framework's rows as each rank reported them: CP rank 0 holds positions 0, 1, 5, 6 and
    CP rank 1 positions 2, 3, 3, 4 (written out here), so position 7 is lost and 3 doubled."""
    codes = {0: torch.tensor([[1, 2, 6, 7]]), 1: torch.tensor([[3, 4, 4, 5]])}  # 1 + position
    results = [RankResult(r, 0, layout=layout_payload(decode(SC, 0, r, codes[r], "framework"))) for r in (0, 1)]
    v = merge(SC, results, 0.1)
    assert v.status == FAIL and [f.kind for f in v.failures] == ["layout_mismatch"], [f.message for f in v.failures]
    assert v.failures[0].message == ("framework: sample 0 position 3 is held 2 times by cp rank 1; "
                                     "sample 0 position 7 is held by no CP rank")
