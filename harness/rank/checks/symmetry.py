"""The lockstep's question asked after the fact: given every rank's whole trace of one scenario,
did the ranks of each group issue the same collectives in the same order?

Used by the fake world (``fake_world``), where every rank has run to its end alone and no call
waited for a peer: the first call at which the members of a group differ is where a real world
would have hung (or silently mis-paired two calls). It is reported in the lockstep's words:
``tp group [0, 1] call 3: rank 0 ...; rank 1 ... (they differ in shapes)``, or ``rank r finished
the scenario after k calls in this group`` for a member that issued fewer.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from shardcheck.harness.rank.checks.lockstep import LAST_MATCHED
from shardcheck.harness.rank.plumbing.trace import FINGERPRINT, Call


@dataclass
class Divergence:
    """The first call where a group's members differ."""

    message: str
    phase: str
    group: str  # the group's name (as the lowest member knew it)
    group_ranks: list[int]
    label: str
    call: int
    ranks: list[int]  # the members involved
    sides: dict[str, Any]
    last_matched: list[str]


def first_divergence(traces: dict[int, list[Call]], labels: dict[int, dict[str, str]]) -> Divergence | None:
    """The earliest divergence over all groups, or None when every group agrees. ``traces``: per
    global rank, its calls in the order it issued them; ``labels``: per rank, group name -> what
    the group is for ("tp", "cp", ...). "Earliest": the divergent call that comes first in the
    trace of the lowest rank that made it (the one a real world would have stopped at first)."""
    by_group: dict[tuple[int, ...], dict[int, list[Call]]] = defaultdict(lambda: defaultdict(list))
    for rank, calls in traces.items():
        for c in calls:
            by_group[tuple(c.ranks)][rank].append(c)
    found: list[tuple[tuple[int, int], Divergence]] = []
    for members, per_rank in by_group.items():
        d = _group_divergence(list(members), {r: per_rank.get(r, []) for r in members if r in traces}, labels)
        if d is not None:
            found.append((_when(d, traces), d))
    return min(found, key=lambda p: p[0])[1] if found else None


def _when(d: Divergence, traces: dict[int, list[Call]]) -> tuple[int, int]:
    """(position in its rank's whole trace, rank) of the divergent call: which comes first."""
    best = (10**12, 10**12)
    for r in d.ranks:
        calls = traces.get(r, [])
        mine = [i for i, c in enumerate(calls) if tuple(c.ranks) == tuple(d.group_ranks)]
        pos = mine[d.call] if d.call < len(mine) else (mine[-1] + 1 if mine else len(calls))
        best = min(best, (pos, r))
    return best


def _group_divergence(members: list[int], calls: dict[int, list[Call]],
                      labels: dict[int, dict[str, str]]) -> Divergence | None:
    longest = max((len(v) for v in calls.values()), default=0)
    for n in range(longest):
        at = {r: (cs[n] if n < len(cs) else None) for r, cs in calls.items()}
        prints = {r: (json.dumps(c.fingerprint(), sort_keys=True) if c is not None else None) for r, c in at.items()}
        if len(set(prints.values())) == 1:
            continue
        sample = next(c for c in at.values() if c is not None)
        label = next((labels.get(r, {}).get(sample.group, "") for r in sorted(at) if at[r] is not None), "")
        parts, sides = [], {}
        for r in sorted(at):
            c = at[r]
            if c is None:
                parts.append(f"rank {r} finished the scenario after {len(calls[r])} calls in this group")
                sides[str(r)] = {"finished_after": len(calls[r])}
            else:
                parts.append(f"rank {r} {c.describe()}")
                sides[str(r)] = {**c.fingerprint(), "text": c.describe()}
        issued = [c for c in at.values() if c is not None]
        differ = [k for k in ("op", "reduce_op", "dtype", "shapes", "root", "phase", "stack")
                  if len({json.dumps(getattr(c, k)) for c in issued}) > 1]
        where = f"{label + ' ' if label else ''}group {members} call {n}"
        message = f"{where}: " + "; ".join(parts) + (f" (they differ in {', '.join(differ)})" if differ else "")
        phases = sorted({c.phase for c in issued})
        first = calls[min(r for r in calls if calls[r])]
        return Divergence(message, "/".join(phases), sample.group, members, label, n, sorted(at), sides,
                          [c.describe() for c in first[max(0, n - LAST_MATCHED):n]])
    return None


def calls_from(dicts: list[dict[str, Any]]) -> list[Call]:
    """Calls back from their wire form (``Call.to_dict``)."""
    return [Call(**{k: d[k] for k in d if k in Call.__dataclass_fields__}) for d in dicts]


__all__ = ["Divergence", "FINGERPRINT", "calls_from", "first_divergence"]
