"""The lockstep check: before a collective reaches the backend, the ranks of its group compare
fingerprints, with bounded waits, so a would-be hang becomes a report.

Per call, a rank announces the digest of its fingerprint and waits for its peers to announce the
same one (``arrivals.py``: one word on the shared board of a world on one machine, keys in the
c10d store otherwise); equal digests, the call goes on. When that first wait runs out
(FIRST_WAIT_S), the rank waits on a peer not yet seen, which wakes it the moment that peer
arrives, whatever its fingerprint: a peer with another digest is a divergence at once; both
publish their whole fingerprints under ``call/<seq>/<group>/<number>/<rank>`` in the store,
every member raises :class:`CollectiveMismatch`, and the call is never issued, so the backend's
groups stay in step.

A rank that finishes the scenario or stops on an error says so at the next call it will never
make in every group it belongs to: a peer waiting there wakes at once (a mismatch: the peer
issues a call this rank never does; or :class:`PeerStopped`). The rest is found through status
keys in the store (``status/<seq>/<rank>``), looked at every SLICE_S: the controller says so for
a rank that died, and a rank waiting that long publishes what it waits for, so ranks that wait
for each other in a cycle (each blocked in a different group) are a mismatch too.

Every key a rank sets names that rank, and only peers in the same scenario read it. A rank
deletes the keys it set (and empties its part of the board) when it begins the next scenario:
the controller (or a joined world's exchange of results) starts that one only after every rank
has returned its result for the one before, so nobody reads them any more. A long run thus holds
at most one scenario's keys per rank in the store, however many scenarios it runs.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from shardcheck.harness.rank.plumbing import trace
from shardcheck.harness.rank.plumbing.arrivals import BoardArrivals, StoreArrivals
from shardcheck.harness.rank.plumbing.board import Board
from shardcheck.harness.rank.pipeline import Check, Frame, Life, Stop, raise_payload
from shardcheck.harness.rank.plumbing.trace import POINT_TO_POINT, Call
from shardcheck.harness.wire import COLLECTIVE_MISMATCH, EXPLAIN, RANK_ERROR, Failure, status_key

FIRST_WAIT_S = 0.005  # how long a call waits for agreeing peers before it looks at who arrived
SLICE_S = 0.05  # how often a wait looks at the peers' status
LAST_MATCHED = 3
DIGESTS_KEPT = 4096  # memoised fingerprint digests; a long run with ever new shapes starts over


def call_key(seq: int, group: str, number: int, rank: int) -> str:
    return f"call/{seq}/{group}/{number}/{rank}"


class CollectiveMismatch(Stop):
    """The ranks of a group were about to issue different collectives (or one issued none)."""

    def __init__(self, report: dict[str, Any]) -> None:
        super().__init__(report["message"])
        self.report = report


class PeerStopped(Stop):
    """A peer this rank waits for stopped (raised, died, or stopped on a mismatch elsewhere)."""

    def __init__(self, report: dict[str, Any]) -> None:
        super().__init__(report["message"])
        self.report = report


class LockstepTimeout(Stop):
    """Peers neither arrived nor said why, and nobody in the world issued a call, within the
    scenario's timeout."""

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


class Lockstep:
    """One per rank process; :meth:`begin` starts a scenario, :meth:`check` is the trace's checker."""

    def __init__(self, port: int, rank: int, world_size: int, timeout: float,
                 label: Callable[[str], str] | None = None, host: str = "127.0.0.1",
                 member_groups: Callable[[], list[str]] | None = None, board: Board | None = None) -> None:
        # get is only called for keys known to exist: a get that times out would leave its late
        # reply on the socket. Waiting is done with wait(keys, timeout), which cancels cleanly
        # on the server when it times out.
        self.store = dist.TCPStore(host, port, is_master=False,
                                   timeout=datetime.timedelta(seconds=max(timeout, 1.0)))
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.label = label or (lambda group: "")
        self.member_groups = member_groups or (lambda: [])
        self.seq = 0
        self.scenario = ""
        self.matched: dict[str, deque] = defaultdict(lambda: deque(maxlen=LAST_MATCHED))
        self.counts: dict[str, int] = {}
        self.waiting: dict[str, Any] | None = None
        self._digests: dict[tuple, str] = {}
        self._written: set[str] = set()  # the keys this rank set since it last deleted its own
        self.arrivals = (BoardArrivals(board, self.store, self._status_of) if board is not None
                         else StoreArrivals(self.store, rank, lambda keys: self._written.update(keys)))

    def begin(self, seq: int, scenario: str) -> None:
        """Start scenario ``seq``. Every rank has returned its result for the scenarios before
        it, so no peer reads the keys this rank set for them any more: they are deleted now."""
        self._forget()
        self.seq, self.scenario = seq, scenario
        self.arrivals.begin(seq)
        self.matched.clear()
        self.counts = {}
        self.waiting = None

    def _set(self, key: str, value: str) -> None:
        self._written.add(key)
        self.store.set(key, value)

    def _forget(self) -> None:
        """Delete the keys this rank set. Best effort: a store that fails here fails again at
        the scenario's first check, which reports it."""
        written, self._written = self._written, set()
        try:
            for key in written:
                self.store.delete_key(key)
        except Exception:  # noqa: BLE001
            pass

    # -- sentinels ----------------------------------------------------------------------------
    def finish(self) -> None:
        self._set_status({"state": "finished", "counts": self.counts})
        self._mark({"state": "finished", "counts": self.counts})

    def stop(self, reason: str) -> None:
        self._set_status({"state": "stopped", "reason": reason, "waiting": self.waiting})
        self._mark({"state": "stopped", "reason": reason})

    def _mark(self, why: dict[str, Any]) -> None:
        """Wake peers waiting for a call this rank will never make: the arrive key of its next
        call in every group it belongs to (call 0 in one it never called in) holds why."""
        try:
            never = [g for g in self.member_groups() if g not in self.counts]
        except Exception:  # noqa: BLE001  (groups gone: peers find the status at their next look)
            never = []
        self.arrivals.mark([*self.counts.items(), *((g, 0) for g in never)], why)

    def _set_status(self, status: dict[str, Any]) -> None:
        self._set(status_key(self.seq, self.rank), json.dumps(status))

    # -- the check ---------------------------------------------------------------------------
    def check(self, call: Call) -> None:
        peers = [r for r in call.ranks if r != self.rank]
        if not peers or call.op in POINT_TO_POINT:  # point-to-point is traced, not lockstepped
            self.counts[call.group] = call.number + 1
            return
        # Until its peers agree, this call is the next one this rank has not made: a stop mark
        # goes here. Marked one further, a board would show the peers this rank past the call,
        # and a late peer agreeing with it would issue a call nobody else does.
        self.counts[call.group] = call.number
        t_call = time.time()
        fp_key = call.fingerprint_key()
        digest = self._digests.get(fp_key)
        if digest is None:  # the same call site repeats thousands of times: hash it once
            if len(self._digests) >= DIGESTS_KEPT:
                self._digests.clear()
            digest = self._digests[fp_key] = hashlib.blake2b(repr(fp_key).encode(), digest_size=8).hexdigest()
        # Fast path: announce my fingerprint's digest, then wait for every peer to have announced
        # the same one. Equal digests: the call goes on.
        self.arrivals.announce(call, digest, peers)
        if not self.arrivals.agreed(call, digest, peers, FIRST_WAIT_S):
            self._slow_path(call, digest, peers, t_call)
        self.counts[call.group] = call.number + 1
        self.matched[call.group].append(call)

    def _slow_path(self, call: Call, digest: str, peers: list[int], t_call: float) -> None:
        """A peer is late or different: wait on its arrival, whatever it brings, then find out which."""
        arrivals = self.arrivals
        plain = {p: call_key(self.seq, call.group, call.number, p) for p in peers}
        # published in full for the report: the fingerprint, and where a backward call's
        # autograd node was made (not agreed on: it is known only when explaining); made only
        # for a report (most late peers agree)
        @functools.cache
        def mine() -> str:
            return json.dumps(call.fingerprint() | {"created_at": call.created_at}, sort_keys=True)

        same: set[int] = set()
        differ: set[int] = set()
        shown = False
        published: list[int] | None = None
        cycle_seen = None
        # The wait's deadline follows the world's progress: a key set anywhere (a call announced
        # in any group, a status) restarts it. A peer busy with calls elsewhere is not hung.
        keys, t_progress = None, t_call  # the count is first read at the first look
        look = t_call + SLICE_S  # when the statuses are looked at next
        arrived: int | None = None  # the peer whose arrival the last wait saw: no need to ask
        first = arrivals.costly  # nobody is known to have arrived yet: wait before asking
        try:
            while True:
                ticket = arrivals.ticket()  # before looking: a peer arriving after the look wakes the wait
                for p in peers:
                    if p in same or p in differ or (first and p != arrived):
                        continue
                    value = arrivals.seen(call, p, known=p == arrived)
                    if value is None:
                        continue
                    if isinstance(value, dict):  # it finished or stopped instead of making this call
                        self._not_coming(call, mine, same, p, value, t_call)
                    elif arrivals.same(value, digest):
                        same.add(p)
                    else:
                        differ.add(p)
                first, arrived = False, None
                missing = [p for p in peers if p not in same and p not in differ]
                if not missing and not differ:
                    return
                if differ:
                    if not shown:  # each side publishes its own on seeing the other's digest differ
                        self._set(call_key(self.seq, call.group, call.number, self.rank), mine())
                        shown = True
                    ready = [p for p in sorted(differ) if self.store.check([plain[p]])]
                    if ready:
                        sides = {r: json.loads(mine()) for r in [self.rank, *same]}
                        sides |= {p: json.loads(self.store.get(plain[p])) for p in ready}
                        raise CollectiveMismatch(self._report(call, {r: _side(fp) for r, fp in sides.items()}, t_call))
                now = time.time()
                if now >= look:
                    look = now + SLICE_S
                    waited_for = missing or sorted(differ)
                    if waited_for != published:  # say what this rank waits for (peers find cycles with it)
                        self.waiting = {"group": call.group, "number": call.number, "call": call.describe(),
                                        "for": waited_for, "label": self.label(call.group)}
                        self._set_status({"state": "waiting", **self.waiting})
                        published = waited_for
                    statuses = self._statuses()
                    for p in waited_for:
                        st = statuses.get(p)
                        if st and st["state"] in ("finished", "stopped", "died"):
                            self._not_coming(call, mine, same, p, st, t_call)
                    cycle = _wait_cycle(self.rank, statuses | {self.rank: {"state": "waiting", **self.waiting}})
                    if cycle and cycle == cycle_seen:  # the same cycle twice: not a stale read
                        raise CollectiveMismatch(self._cycle_report(call, cycle, statuses, t_call))
                    cycle_seen = cycle
                    now_keys = arrivals.progress()
                    if keys is None:
                        keys = now_keys
                    elif now_keys != keys:
                        keys, t_progress = now_keys, time.time()
                    elif time.time() - t_progress > self.timeout:
                        waited = f"waited {time.time() - t_call:.0f}s" + (
                            f" ({self.timeout:.0f}s with no call anywhere)" if t_progress > t_call else "")
                        raise LockstepTimeout(f"{waited} in {call.describe()} for ranks {waited_for}, "
                                              "which neither arrived nor said why", waited_for)
                # wake when the peer waited on arrives (or, once it differs, publishes its fingerprint)
                timeout = min(SLICE_S, look - time.time())
                if differ:
                    try:
                        self.store.wait([plain[min(differ)]], datetime.timedelta(seconds=max(0.001, timeout)))
                    except dist.DistStoreError:
                        pass
                elif arrivals.wait(call, missing[0], timeout, ticket):
                    arrived = missing[0]
        finally:
            if published is not None:
                self._set_status({"state": "running"})
            self.waiting = None

    def _not_coming(self, call: Call, mine: Callable[[], str], same: set[int], peer: int, status: dict[str, Any],
                    t_call: float) -> None:
        """Raise for a peer that will not make this call: it finished (a mismatch) or stopped."""
        if status["state"] == "finished":
            sides = {r: _side(json.loads(mine())) for r in [self.rank, *same]}
            sides[peer] = {"finished_after": status["counts"].get(call.group, 0)}
            raise CollectiveMismatch(self._report(call, sides, t_call))
        raise PeerStopped(self._stopped_report(call, peer, status))

    def _status_of(self, rank: int) -> dict[str, Any] | None:
        k = status_key(self.seq, rank)
        return json.loads(self.store.get(k)) if self.store.check([k]) else None

    def _statuses(self) -> dict[int, dict[str, Any]]:
        return {r: st for r in range(self.world_size) if r != self.rank and (st := self._status_of(r)) is not None}

    # -- reports -----------------------------------------------------------------------------
    def _where(self, call: Call) -> str:
        label = self.label(call.group)
        return f"{label + ' ' if label else ''}group {call.ranks} call {call.number}"

    def _report(self, call: Call, sides: dict[int, dict[str, Any]], t_call: float) -> dict[str, Any]:
        parts = []
        for r in sorted(sides):
            s = sides[r]
            parts.append(f"rank {r} finished the scenario after {s['finished_after']} calls in this group"
                         if "finished_after" in s else f"rank {r} {s['text']}")
        phases = sorted({s["phase"] for s in sides.values() if "phase" in s})
        fps = [s for s in sides.values() if "phase" in s]
        differ = [k for k in ("op", "reduce_op", "dtype", "shapes", "root", "phase", "stack")
                  if len({json.dumps(fp.get(k)) for fp in fps}) > 1]
        message = f"{self._where(call)}: " + "; ".join(parts) + (
            f" (they differ in {', '.join(differ)})" if differ else "")
        return self._mismatch(call, message, "/".join(phases), sides, t_call)

    def _mismatch(self, call: Call, message: str, phase: str, sides: dict[int, Any], t_call: float) -> dict[str, Any]:
        """A collective mismatch report: the divergent call, each side, and what led up to it."""
        return {
            "message": message,
            "phase": phase,
            "group": call.group, "group_ranks": call.ranks, "label": self.label(call.group), "call": call.number,
            "sides": {str(r): s for r, s in sides.items()},
            "last_matched": [c.describe() for c in self.matched[call.group]],
            "scenario": self.scenario,
            "detected_after_s": time.time() - t_call,
            "divergent_call_at": t_call,
        }

    def _stopped_report(self, call: Call, peer: int, status: dict[str, Any]) -> dict[str, Any]:
        why = status.get("reason") or status["state"]
        return {
            "message": f"rank {self.rank} was waiting in {call.describe()} ({self._where(call)}) "
                       f"for rank {peer}, which stopped: {why}",
            "peer": peer, "waiting_at": call.describe(), "phase": call.phase,
        }

    def _cycle_report(self, call: Call, cycle: list[int], statuses: dict[int, Any], t_call: float) -> dict[str, Any]:
        everyone = statuses | {self.rank: {"state": "waiting", "call": call.describe(), "label": self.label(call.group),
                                           "number": call.number}}
        parts = [f"rank {r} waits in {everyone[r].get('label') or 'group'} call {everyone[r]['number']} "
                 f"{everyone[r]['call']}" for r in sorted(cycle)]
        message = f"ranks {sorted(cycle)} wait for each other in different collectives: " + "; ".join(parts)
        return self._mismatch(call, message, call.phase, {r: everyone[r] for r in cycle}, t_call)


def _side(fp: dict[str, Any]) -> dict[str, Any]:
    c = Call(group="", ranks=[], number=0, **fp)
    return {**fp, "text": c.describe()}


def _wait_cycle(start: int, statuses: dict[int, dict[str, Any]]) -> list[int] | None:
    """A cycle of waiting ranks through ``start``, if the statuses show one."""
    path, node = [start], start
    seen = {start}
    while True:
        st = statuses.get(node)
        if not st or st.get("state") != "waiting":
            return None
        nxt = next((p for p in st["for"] if statuses.get(p, {}).get("state") == "waiting"), None)
        if nxt is None:
            return None
        if nxt == start:
            return path
        if nxt in seen:
            return None
        seen.add(nxt)
        path.append(nxt)
        node = nxt


class CollectiveTrace(Check):
    """The collective trace and, where the world has one, the lockstep check, framing the whole
    scenario (every collective issued from ``begin`` on is traced and checked against the group's
    peers): a divergence is ``collective_mismatch``, a peer that stopped leaves its note, a wait
    that ran out is this rank's ``rank_error`` naming what it waited for."""

    kind = COLLECTIVE_MISMATCH

    def begin(self, frame: Frame) -> None:
        if frame.lockstep is not None:
            frame.lockstep.begin(frame.seq, frame.name)
        trace.start(frame.lockstep.check if frame.lockstep is not None else None)

    def forward(self, life: Life) -> Any:
        # explaining: anomaly mode makes torch record each autograd node's forward stack, so a
        # collective issued in the backward names where its node was made (see trace)
        import contextlib
        import warnings

        import torch

        if not life.checks.explain:
            return contextlib.nullcontext()
        with warnings.catch_warnings():  # torch's notice of the mode the harness turned on: not the ranks' output
            warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
            return torch.autograd.detect_anomaly(check_nan=False)

    def finish(self, frame: Frame) -> None:
        if frame.lockstep is not None:
            frame.lockstep.finish()

    def claim(self, frame: Frame, exc: BaseException) -> bool:
        if isinstance(exc, CollectiveMismatch):
            report = dict(exc.report)
            message, phase = report.pop("message"), report.pop("phase")
            if phase == "backward" and "(its forward at" not in message:
                report[EXPLAIN] = True  # anomaly mode, on a run again, names where its node was made
            frame.found.append(Failure(COLLECTIVE_MISMATCH, message, [frame.rank], phase=phase,
                                       details={"at": time.time(), **report}))
            self.abandon(frame, f"stopped on a collective mismatch in {report.get('label') or 'group'} "
                                f"{report['group_ranks']} call {report['call']}")
            return True
        if isinstance(exc, PeerStopped):
            frame.notes.append(exc.report)  # the peer's own report names the cause
            self.abandon(frame, f"stopped: {exc}")
            return True
        if isinstance(exc, LockstepTimeout):  # this rank waited; the controller names who did not come
            err = raise_payload(exc)
            frame.found.append(Failure(RANK_ERROR, f"rank {frame.rank} stopped waiting: {exc}", [frame.rank],
                                       details={"at": time.time(), **err, "waited_for": str(exc),
                                                "waited_for_ranks": exc.missing}))
            self.abandon(frame, f"raised {err['type']}: {err['message']}")
            return True
        return False

    def abandon(self, frame: Frame, reason: str) -> None:
        if frame.lockstep is not None:
            try:
                frame.lockstep.stop(reason)
            except Exception:  # noqa: BLE001  (the store is gone: peers will time out, bounded)
                pass

    def end(self, frame: Frame) -> None:
        frame.calls = trace.stop()
        frame.desync = trace.backend_failed()
