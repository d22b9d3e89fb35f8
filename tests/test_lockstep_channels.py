"""The two channels the lockstep speaks through, the store's keys (any world, torchrun's across
machines) and the shared board (a world the controller started on its machine), give the same
outcome for the same calls: agreement, a divergence, a late peer, a peer that finished or stopped."""

import datetime
import time

import pytest
import torch.distributed as dist

from conftest import at_once
from shardcheck.harness.rank.plumbing import board
from shardcheck.harness.rank.checks.lockstep import CollectiveMismatch, Lockstep, PeerStopped
from shardcheck.harness.rank.plumbing.trace import Call


def _call(shape: int, number: int = 0, ranks: tuple[int, ...] = (0, 1)) -> Call:
    return Call(op="all_reduce", group="g", ranks=list(ranks), number=number, shapes=[[shape]], dtype="float32",
                reduce_op="SUM", root=None, phase="forward", site="x.py:1", stack=["x.py:1"])


def _world(channel: str, size: int, tmp_path):
    if channel == "board" and not board.supported():
        pytest.skip("no shared board on this machine (it needs Linux futexes)")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    boards = [None] * size
    if channel == "board":
        path = str(tmp_path / "board")
        board.Board.create(path, size)
        boards = [board.Board(path, size, r) for r in range(size)]
    ranks = [Lockstep(store.port, r, size, timeout=5.0, member_groups=lambda: ["g"], board=boards[r])
             for r in range(size)]
    for r in ranks:
        r.begin(1, "s")
    return store, ranks


@pytest.fixture(params=["store", "board"])
def pair(request, tmp_path):
    store, ranks = _world(request.param, 2, tmp_path)
    yield ranks
    del store


@pytest.fixture(params=["store", "board"])
def trio(request, tmp_path):
    store, ranks = _world(request.param, 3, tmp_path)
    yield ranks
    del store


def test_agreeing_calls_go_on(pair):
    assert at_once([lambda r=r: [r.check(_call(4, n)) for n in range(200)] for r in pair]) == [None, None]
    assert pair[0].counts == pair[1].counts == {"g": 200}


def test_a_late_peer_is_waited_for_and_agrees(pair):
    def late():
        time.sleep(0.3)  # past the first wait: the slow path waits on its arrival
        pair[1].check(_call(4))

    assert at_once([lambda: pair[0].check(_call(4)), late]) == [None, None]


def test_a_divergent_call_stops_both_naming_each_side(pair):
    raised = at_once([lambda: pair[0].check(_call(4)), lambda: pair[1].check(_call(8))])
    assert all(isinstance(e, CollectiveMismatch) for e in raised), raised
    for e in raised:
        assert "float32[4]" in str(e) and "float32[8]" in str(e) and "differ in shapes" in str(e), str(e)


def test_a_peer_that_finished_is_a_mismatch_at_once(pair):
    def finish_late():
        time.sleep(0.2)
        pair[0].finish()

    t0 = time.perf_counter()
    raised = at_once([finish_late, lambda: pair[1].check(_call(4))])
    assert raised[0] is None and isinstance(raised[1], CollectiveMismatch), raised
    assert "rank 0 finished the scenario after 0 calls in this group" in str(raised[1])
    assert time.perf_counter() - t0 < 2.0  # woken by the mark, not by the 5 s timeout


def test_a_peer_that_stopped_wakes_the_waiter_with_its_reason(pair):
    def stop_late():
        time.sleep(0.2)
        pair[0].stop("raised ValueError: bad")

    t0 = time.perf_counter()
    raised = at_once([stop_late, lambda: pair[1].check(_call(4))])
    assert isinstance(raised[1], PeerStopped) and "raised ValueError: bad" in str(raised[1]), raised
    assert time.perf_counter() - t0 < 2.0


def test_a_late_peer_agreeing_with_one_side_of_a_divergence_does_not_go_on(trio):
    """Ranks 0 and 1 diverge and stop; rank 2, late, agrees with rank 0. Had it gone on, it
    would wait in the backend for a call nobody else issues (a hang the lockstep exists to stop)."""
    def diverge(r: int, shape: int) -> None:
        try:
            trio[r].check(_call(shape, ranks=(0, 1, 2)))
        except CollectiveMismatch:
            trio[r].stop("stopped on a collective mismatch")  # as the trace's claim does
            raise

    raised = at_once([lambda: diverge(0, 4), lambda: diverge(1, 8)])
    assert all(isinstance(e, CollectiveMismatch) for e in raised), raised
    with pytest.raises((CollectiveMismatch, PeerStopped)):
        trio[2].check(_call(4, ranks=(0, 1, 2)))


@pytest.fixture
def board_path(tmp_path):
    if not board.supported():
        pytest.skip("no shared board on this machine (it needs Linux futexes)")
    return str(tmp_path / "board")


def test_the_board_reads_each_state_of_a_peer(board_path):
    """A peer's word read against the call a rank is at, written out for a small case."""
    path = board_path
    board.Board.create(path, 2)
    me, peer = board.Board(path, 2, 0), board.Board(path, 2, 1)
    me.begin(5)
    peer.begin(4)
    peer.post("g", 3, 77, [0])
    assert me.read(1, "g", 3) is None  # the peer is still in the scenario before
    peer.begin(5)
    assert me.read(1, "g", 3) is None  # nothing said in this scenario yet
    peer.post("g", 3, 77, [0])
    assert (me.read(1, "g", 2), me.read(1, "g", 3), me.read(1, "g", 4)) == (board.AHEAD, 77, None)
    assert me.read(1, "other", 3) is None
    peer.post("g", 4, board.FINISHED, [0])
    assert me.read(1, "g", 4) == board.FINISHED
    assert me.calls() == 3
    # the wake: a ticket taken before a peer's post does not sleep through it
    ticket = me.ticket()
    peer.post("g", 5, 77, [0])
    t0 = time.perf_counter()
    me.wait(ticket, 5.0)
    assert time.perf_counter() - t0 < 1.0


def test_a_rank_calling_in_more_groups_than_the_board_holds_is_told_so(board_path):
    path = board_path
    board.Board.create(path, 1)
    b = board.Board(path, 1, 0)
    b.begin(1)
    for i in range(board.SLOTS):
        b.post(f"g{i}", 0, 9, [])
    with pytest.raises(RuntimeError, match=f"holds {board.SLOTS} groups a rank and scenario"):
        b.post("one more", 0, 9, [])
    b.begin(2)  # a new scenario starts empty
    b.post("one more", 0, 9, [])
