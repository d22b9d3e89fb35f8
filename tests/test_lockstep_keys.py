"""The lockstep check's keys leave the store once nobody can read them: a long run does not grow
the controller's store."""

import datetime

import pytest
import torch.distributed as dist

from conftest import at_once
from shardcheck.harness.controller.commands import runner
from shardcheck.harness.controller.reports.run_report import SilentReport
from shardcheck.harness.rank.plumbing.arrivals import agree_key
from shardcheck.harness.rank.checks.lockstep import CollectiveMismatch, Lockstep, call_key
from shardcheck.harness.wire import status_key
from shardcheck.harness.rank.plumbing.trace import Call
from shardcheck.scenarios import Sample, Scenario


def _call(shape: int) -> Call:
    return Call(op="all_reduce", group="g", ranks=[0, 1], number=0, shapes=[[shape]], dtype="torch.float32",
                reduce_op="SUM", root=None, phase="forward", site="x.py:1", stack=["x.py:1"])


def test_a_rank_deletes_the_keys_it_set_when_it_begins_the_next_scenario():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    ranks = [Lockstep(store.port, r, 2, timeout=5.0) for r in (0, 1)]
    empty = store.num_keys()
    for r in ranks:
        r.begin(1, "agree")
    assert at_once([lambda r=r: (r.check(_call(4)), r.finish()) for r in ranks]) == [None, None]
    digest = ranks[0]._digests[_call(4).fingerprint_key()]
    ranks[0].begin(2, "differ")  # rank 1 is still on scenario 1: its keys stay
    assert not store.check([agree_key(1, "g", 0, digest, 0)]) and not store.check([status_key(1, 0)])
    assert store.check([agree_key(1, "g", 0, digest, 1)]) and store.check([status_key(1, 1)])
    ranks[1].begin(2, "differ")
    assert store.num_keys() == empty
    # the slow path's keys too: whole fingerprints, waiting and stopped statuses
    raised = at_once([lambda: ranks[0].check(_call(4)), lambda: ranks[1].check(_call(8))])
    assert all(isinstance(e, CollectiveMismatch) for e in raised), raised
    for r in ranks:
        r.stop("stopped on a collective mismatch")
    assert store.check([call_key(2, "g", 0, 0), call_key(2, "g", 0, 1), status_key(2, 0)])
    for r in ranks:
        r.begin(3, "next")
    assert store.num_keys() == empty


def _scenarios(n: int, first_seed: int) -> list[Scenario]:
    out = []
    for i in range(first_seed, first_seed + n):
        if i % 3 == 0:
            out.append(Scenario(f"s{i}", (Sample(7, 3),), vocab=8, tp=2, seed=i))
        elif i % 3 == 1:
            out.append(Scenario(f"s{i}", (Sample(9, 4), Sample(6, 2)), vocab=8, tp=2, cp=2, layout="zigzag", seed=i))
        else:
            out.append(Scenario(f"s{i}", (Sample(8, 5),), vocab=8, tp=2, cp=2, layout="allgather", seed=i))
    return out


@pytest.mark.world
def test_the_store_does_not_grow_with_the_scenarios_run(world):
    def run(n, first_seed):
        result = runner.run(_scenarios(n, first_seed), "builtin", reporter=SilentReport(), world=world)
        assert result.exit_code == 0, [v.headline() for v in result.verdicts if v.status != "pass"]
        return world._store.num_keys()

    run(3, 0)  # both layouts' groups built (their gloo keys stay, made once per layout)
    after_10 = run(10, 100)
    after_30 = run(30, 200)
    # what is left is the last scenario's keys (about 20 here), whatever ran before it
    assert after_30 <= after_10 + 8, (after_10, after_30)
