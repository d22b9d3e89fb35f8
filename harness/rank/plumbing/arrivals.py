"""How the ranks of a group tell each other that they arrived at a call, and with which
fingerprint: the two channels the lockstep check (``lockstep.py``) speaks through.

- :class:`StoreArrivals`, over the c10d store, works wherever the ranks run (two torchrun agents
  on two machines): per call one round trip sets ``agree/<seq>/<group>/<number>/<digest>/<rank>``
  and ``arrive/<seq>/<group>/<number>/<rank>`` (the digest), and one waits for the peers' agree
  keys with the same digest.
- :class:`BoardArrivals`, over the shared-memory board (``board.py``), for a world the controller
  started on its own machine: a call writes one word and wakes its peers.

A rank that finishes or stops says so at the next call it will never make in each of its groups:
the store's arrive key holds why; the board holds a mark, and why is in the rank's status key.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from shardcheck.harness.rank.plumbing import board as board_mod
from shardcheck.harness.rank.plumbing.trace import Call
from shardcheck.harness.wire import progress


def agree_key(seq: int, group: str, number: int, digest: str, rank: int) -> str:
    return f"agree/{seq}/{group}/{number}/{digest}/{rank}"


def arrive_key(seq: int, group: str, number: int, rank: int) -> str:
    return f"arrive/{seq}/{group}/{number}/{rank}"


class StoreArrivals:
    """Arrivals as store keys. ``remember`` records each key set (deleted at the next scenario)."""

    costly = True  # each look is a round trip: look only at peers known or likely to have arrived

    def __init__(self, store: Any, rank: int, remember: Callable[[list[str]], None]) -> None:
        self.store = store
        self.rank = rank
        self.remember = remember
        self.seq = 0

    def begin(self, seq: int) -> None:
        self.seq = seq

    def announce(self, call: Call, digest: str, peers: list[int]) -> None:
        keys = [agree_key(self.seq, call.group, call.number, digest, self.rank),
                arrive_key(self.seq, call.group, call.number, self.rank)]
        self.remember(keys)
        self.store.multi_set(keys, ["", digest])

    def agreed(self, call: Call, digest: str, peers: list[int], within: float) -> bool:
        """Whether every peer announced ``digest`` for this call within ``within`` seconds."""
        try:
            self.store.wait([agree_key(self.seq, call.group, call.number, digest, p) for p in peers],
                            datetime.timedelta(seconds=within))
            return True
        except dist.DistStoreError:
            return False

    def ticket(self) -> None:
        return None

    def seen(self, call: Call, peer: int, known: bool) -> str | dict[str, Any] | None:
        """What ``peer`` announced for this call: its digest, why it will not make it (a dict), or
        None when it has not arrived. ``known``: a wait just saw it arrive (no need to ask)."""
        key = arrive_key(self.seq, call.group, call.number, peer)
        if not known and not self.store.check([key]):
            return None
        value = self.store.get(key).decode()
        return json.loads(value) if value.startswith("{") else value

    def same(self, value: str, digest: str) -> bool:
        return value == digest

    def wait(self, call: Call, peer: int, timeout: float, ticket: Any) -> bool:
        """Wait until ``peer`` arrives at this call (True) or ``timeout`` runs out (False)."""
        try:
            self.store.wait([arrive_key(self.seq, call.group, call.number, peer)],
                            datetime.timedelta(seconds=max(0.001, timeout)))
            return True
        except dist.DistStoreError:
            return False

    def mark(self, calls: list[tuple[str, int]], why: dict[str, Any]) -> None:
        keys = [arrive_key(self.seq, group, number, self.rank) for group, number in calls]
        if keys:
            self.remember(keys)
            self.store.multi_set(keys, [json.dumps(why)] * len(keys))

    def progress(self) -> Any:
        return progress(self.store)


class BoardArrivals:
    """Arrivals on the shared board; why a peer stopped is read from its status in the store."""

    costly = False

    def __init__(self, board: board_mod.Board, store: Any, status_of: Callable[[int], dict[str, Any] | None]) -> None:
        self.board = board
        self.store = store
        self.status_of = status_of

    def begin(self, seq: int) -> None:
        self.board.begin(seq)

    def announce(self, call: Call, digest: str, peers: list[int]) -> None:
        self.board.post(call.group, call.number, board_mod.code_of(digest), peers)

    def agreed(self, call: Call, digest: str, peers: list[int], within: float) -> bool:
        board, code = self.board, board_mod.code_of(digest)
        deadline = time.perf_counter() + within
        first = True
        while True:
            ticket = board.ticket()
            said = [board.read(p, call.group, call.number) for p in peers]
            if all(s == code or s == board_mod.AHEAD for s in said):
                if first and code in said:
                    # Peers got here first and are asleep, just woken by this rank's post. The
                    # call completes only once they too have issued it: where they wait for a CPU
                    # (more ranks than cores), handing them this one lets them send their part
                    # before this rank even starts its own. Nothing else runnable here: a no-op.
                    os.sched_yield()
                return True
            first = False
            if any(s is not None for s in said if s != code and s != board_mod.AHEAD):
                return False  # a peer differs or will not come: the slow path says which
            left = deadline - time.perf_counter()
            if left <= 0:
                return False
            board.wait(ticket, left)

    def ticket(self) -> int:
        return self.board.ticket()

    def seen(self, call: Call, peer: int, known: bool) -> str | dict[str, Any] | None:
        said = self.board.read(peer, call.group, call.number)
        if said is None:
            return None
        if said == board_mod.AHEAD:
            return _AGREED
        if said in (board_mod.FINISHED, board_mod.STOPPED):
            return self.status_of(peer) or {"state": "finished" if said == board_mod.FINISHED else "stopped"}
        return f"{said:x}"  # compared as codes by :meth:`same`

    def same(self, value: str, digest: str) -> bool:
        return value is _AGREED or int(value, 16) == board_mod.code_of(digest)

    def wait(self, call: Call, peer: int, timeout: float, ticket: int) -> bool:
        self.board.wait(ticket, timeout)
        return False  # woken by any peer: every peer is read again

    def mark(self, calls: list[tuple[str, int]], why: dict[str, Any]) -> None:
        code = board_mod.FINISHED if why.get("state") == "finished" else board_mod.STOPPED
        for group, number in calls:
            self.board.post(group, number, code, [])
        for r in range(self.board.world_size):  # which group each peer shares is not known here: wake them all
            if r != self.board.rank:
                self.board.wake(r)

    def progress(self) -> Any:
        return progress(self.store, self.board)


_AGREED = "agreed"  # the peer is past this call: it made it, every member agreeing
