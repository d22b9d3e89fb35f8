"""The lockstep check: before a collective reaches the backend, the ranks of its group compare
fingerprints over the c10d store, with bounded waits, so a would-be hang becomes a report.

Per call, a rank sets ``call/<seq>/<group>/<number>/<rank>`` to its fingerprint and reads its
peers' keys. Equal fingerprints: the call goes on. Different ones: every member raises
:class:`CollectiveMismatch` and the call is never issued, so the backend's groups stay in step.

A peer that never arrives is found through status keys (``status/<seq>/<rank>``): a rank that
finishes the scenario or stops on an error says so, the controller says so for a rank that died,
and a rank that has waited one slice publishes what it waits for. A missing peer that finished is
a mismatch (this rank issues a call the peer never does); one that stopped is the peer's own
failure (:class:`PeerStopped`); ranks that wait for each other in a cycle (each blocked in a
different group) are a mismatch too. All within a few slices of the divergent call.
"""

from __future__ import annotations

import datetime
import json
import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from shardcheck.harness.trace import POINT_TO_POINT, Call

SLICE_S = 0.05  # how long a wait blocks before it looks at the peers' status
LAST_MATCHED = 3


def call_key(seq: int, group: str, number: int, rank: int) -> str:
    return f"call/{seq}/{group}/{number}/{rank}"


def status_key(seq: int, rank: int) -> str:
    return f"status/{seq}/{rank}"


class CollectiveMismatch(RuntimeError):
    """The ranks of a group were about to issue different collectives (or one issued none)."""

    def __init__(self, report: dict[str, Any]) -> None:
        super().__init__(report["message"])
        self.report = report


class PeerStopped(RuntimeError):
    """A peer this rank waits for stopped (raised, died, or stopped on a mismatch elsewhere)."""

    def __init__(self, report: dict[str, Any]) -> None:
        super().__init__(report["message"])
        self.report = report


class LockstepTimeout(RuntimeError):
    """Peers neither arrived nor said why within the scenario's timeout."""


class Lockstep:
    """One per rank process; :meth:`begin` starts a scenario, :meth:`check` is the trace's checker."""

    def __init__(self, port: int, rank: int, world_size: int, timeout: float,
                 label: Callable[[str], str] | None = None) -> None:
        # get/multi_get are only called for keys known to exist: a get that times out would leave
        # its late reply on the socket. Waiting is done with wait(keys, timeout), which cancels
        # cleanly on the server when it times out.
        self.store = dist.TCPStore("127.0.0.1", port, is_master=False,
                                   timeout=datetime.timedelta(seconds=max(timeout, 1.0)))
        self.slice = datetime.timedelta(seconds=SLICE_S)
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.label = label or (lambda group: "")
        self.seq = 0
        self.scenario = ""
        self.matched: dict[str, deque] = defaultdict(lambda: deque(maxlen=LAST_MATCHED))
        self.counts: dict[str, int] = {}
        self.waiting: dict[str, Any] | None = None

    def begin(self, seq: int, scenario: str) -> None:
        self.seq, self.scenario = seq, scenario
        self.matched.clear()
        self.counts = {}
        self.waiting = None

    # -- sentinels ----------------------------------------------------------------------------
    def finish(self) -> None:
        self._set_status({"state": "finished", "counts": self.counts})

    def stop(self, reason: str) -> None:
        self._set_status({"state": "stopped", "reason": reason, "waiting": self.waiting})

    def _set_status(self, status: dict[str, Any]) -> None:
        self.store.set(status_key(self.seq, self.rank), json.dumps(status))

    # -- the check ---------------------------------------------------------------------------
    def check(self, call: Call) -> None:
        self.counts[call.group] = call.number + 1
        peers = [r for r in call.ranks if r != self.rank]
        if not peers or call.op in POINT_TO_POINT:  # point-to-point is traced, not lockstepped
            return
        mine = call.fingerprint()
        self.store.set(call_key(self.seq, call.group, call.number, self.rank), json.dumps(mine, sort_keys=True))
        theirs = self._await(call, peers)
        sides = {self.rank: mine} | theirs
        if any(fp != mine for fp in theirs.values()):
            raise CollectiveMismatch(self._report(call, {r: _side(fp) for r, fp in sides.items()}))
        self.matched[call.group].append(call.describe())

    def _await(self, call: Call, peers: list[int]) -> dict[int, dict[str, Any]]:
        keys = {p: call_key(self.seq, call.group, call.number, p) for p in peers}
        try:
            self.store.wait(list(keys.values()), self.slice)
            return {p: json.loads(v) for p, v in zip(peers, self.store.multi_get(list(keys.values())))}
        except dist.DistStoreError:
            pass  # someone is late: find out why, slice by slice
        t0 = time.perf_counter()
        got: dict[int, dict[str, Any]] = {}
        published: list[int] | None = None
        cycle_seen = None
        try:
            while True:
                for p in [p for p in peers if p not in got]:
                    if self.store.check([keys[p]]):
                        got[p] = json.loads(self.store.get(keys[p]))
                missing = [p for p in peers if p not in got]
                if not missing:
                    if published is not None:
                        self._set_status({"state": "running"})
                    return got
                if missing != published:  # say what this rank waits for (peers find cycles with it)
                    self.waiting = {"group": call.group, "number": call.number, "call": call.describe(),
                                    "for": missing, "label": self.label(call.group)}
                    self._set_status({"state": "waiting", **self.waiting})
                    published = missing
                statuses = self._statuses()
                for p in missing:
                    st = statuses.get(p)
                    if st and st["state"] == "finished":
                        sides = {self.rank: _side(call.fingerprint())} | {
                            p: {"finished_after": st["counts"].get(call.group, 0)}}
                        raise CollectiveMismatch(self._report(call, sides, time.perf_counter() - t0))
                    if st and st["state"] in ("stopped", "died"):
                        raise PeerStopped(self._stopped_report(call, p, st))
                cycle = _wait_cycle(self.rank, statuses | {self.rank: {"state": "waiting", **self.waiting}})
                if cycle and cycle == cycle_seen:  # the same cycle twice: not a stale read
                    raise CollectiveMismatch(self._cycle_report(call, cycle, statuses, time.perf_counter() - t0))
                cycle_seen = cycle
                if time.perf_counter() - t0 > self.timeout:
                    raise LockstepTimeout(
                        f"waited {self.timeout:.0f}s in {call.describe()} for ranks {missing}, "
                        "which neither arrived nor said why")
                try:
                    self.store.wait([keys[missing[0]]], self.slice)
                except dist.DistStoreError:
                    pass
        finally:
            self.waiting = None

    def _statuses(self) -> dict[int, dict[str, Any]]:
        out = {}
        for r in range(self.world_size):
            k = status_key(self.seq, r)
            if r != self.rank and self.store.check([k]):
                out[r] = json.loads(self.store.get(k))
        return out

    # -- reports -----------------------------------------------------------------------------
    def _where(self, call: Call) -> str:
        label = self.label(call.group)
        return f"{label + ' ' if label else ''}group {call.ranks} call {call.number}"

    def _report(self, call: Call, sides: dict[int, dict[str, Any]], waited: float = 0.0) -> dict[str, Any]:
        parts = []
        for r in sorted(sides):
            s = sides[r]
            parts.append(f"rank {r} finished the scenario after {s['finished_after']} calls in this group"
                         if "finished_after" in s else f"rank {r} {s['text']}")
        phases = sorted({s["phase"] for s in sides.values() if "phase" in s})
        fps = [s for s in sides.values() if "phase" in s]
        differ = [k for k in ("op", "reduce_op", "dtype", "shapes", "root", "phase", "stack")
                  if len({json.dumps(fp.get(k)) for fp in fps}) > 1]
        return {
            "message": f"{self._where(call)}: " + "; ".join(parts)
                       + (f" (they differ in {', '.join(differ)})" if differ else ""),
            "phase": "/".join(phases),
            "group": call.group, "group_ranks": call.ranks, "label": self.label(call.group), "call": call.number,
            "sides": {str(r): s for r, s in sides.items()},
            "last_matched": list(self.matched[call.group]),
            "scenario": self.scenario,
            "detected_after_s": waited,
            "divergent_call_at": time.time() - waited,
        }

    def _stopped_report(self, call: Call, peer: int, status: dict[str, Any]) -> dict[str, Any]:
        why = status.get("reason") or status["state"]
        return {
            "message": f"rank {self.rank} was waiting in {call.describe()} ({self._where(call)}) "
                       f"for rank {peer}, which stopped: {why}",
            "peer": peer, "waiting_at": call.describe(), "phase": call.phase,
        }

    def _cycle_report(self, call: Call, cycle: list[int], statuses: dict[int, Any], waited: float) -> dict[str, Any]:
        everyone = statuses | {self.rank: {"state": "waiting", "call": call.describe(), "label": self.label(call.group),
                                           "number": call.number}}
        parts = [f"rank {r} waits in {everyone[r].get('label') or 'group'} call {everyone[r]['number']} "
                 f"{everyone[r]['call']}" for r in sorted(cycle)]
        return {
            "message": f"ranks {sorted(cycle)} wait for each other in different collectives: " + "; ".join(parts),
            "phase": call.phase,
            "group": call.group, "group_ranks": call.ranks, "label": self.label(call.group), "call": call.number,
            "sides": {str(r): everyone[r] for r in cycle},
            "last_matched": list(self.matched[call.group]),
            "scenario": self.scenario,
            "detected_after_s": waited,
            "divergent_call_at": time.time() - waited,
        }


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
