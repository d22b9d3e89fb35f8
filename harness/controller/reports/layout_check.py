"""What only the whole world shows about a framework-built layout: every (sample, position) held
by exactly one CP rank, and the TP ranks of one CP rank holding the same rows.

Each rank sends the rows its framework's data path built (``RankResult.layout``); a position no
CP rank holds, or two hold, is a token the framework's model never sees or sees twice, whatever
the extraction downstream makes of it.
"""

from __future__ import annotations

from typing import Any

from shardcheck.harness.wire import LAYOUT_MISMATCH, Failure
from shardcheck.scenarios.scenario import Scenario

MAX_LISTED = 5


def _rows(layout: dict[str, Any], scenario: Scenario) -> list[tuple[int, int] | None]:
    samples = scenario.samples
    out: list[tuple[int, int] | None] = []
    for stream, start, stop in layout["pieces"]:
        for pos in range(start, stop):
            out.append((stream, pos) if stream < len(samples) and pos < samples[stream].total else None)
    return out


def coverage_failures(scenario: Scenario, layouts: dict[int, dict[str, Any]]) -> list[Failure]:
    """Findings about the layouts of every rank (world rank -> payload); data-parallel replicas
    (world ranks past tp * cp, or tp * sp) are checked each on their own, when every rank of one
    sent its."""
    if not layouts:
        return []
    per_replica = scenario.tp * scenario.seq
    replicas: dict[int, dict[int, dict[str, Any]]] = {}
    for rank, lay in layouts.items():
        replicas.setdefault(rank // per_replica, {})[rank] = lay
    found: list[Failure] = []
    for members in replicas.values():
        if len(members) < per_replica:  # a rank that died or hung sent none: nothing to say of the whole
            continue
        found += _tp_agree(scenario, members) + _held_once(scenario, members)
    return found


def _tp_agree(scenario: Scenario, members: dict[int, dict[str, Any]]) -> list[Failure]:
    first: dict[int, tuple[int, list]] = {}
    for rank, lay in sorted(members.items()):
        rows = _rows(lay, scenario)
        seen = first.setdefault(lay["cp_rank"], (rank, rows))
        if seen[1] != rows:
            other, theirs = seen
            r = next((i for i, (a, b) in enumerate(zip(rows, theirs)) if a != b), min(len(rows), len(theirs)))
            what = lambda rs: "nothing" if r >= len(rs) else _at(rs[r])  # noqa: E731
            return [Failure(LAYOUT_MISMATCH, f"{lay['built_by']}: ranks {other} and {rank} (cp rank {lay['cp_rank']}, "
                            f"tp ranks {members[other]['tp_rank']} and {lay['tp_rank']}) hold different rows: local row "
                            f"{r} is {what(theirs)} on rank {other}, {what(rows)} on rank {rank}", [other, rank])]
    return []


def _held_once(scenario: Scenario, members: dict[int, dict[str, Any]]) -> list[Failure]:
    holders: dict[tuple[int, int], list[int]] = {}
    built_by = "the data path"
    for rank, lay in sorted(members.items()):
        if lay["tp_rank"] != 0:  # the TP ranks agree (checked above)
            continue
        built_by = lay["built_by"]
        for rp in _rows(lay, scenario):
            if rp is not None:
                holders.setdefault(rp, []).append(lay["cp_rank"])
    wrong = []
    for i, s in enumerate(scenario.samples):
        for pos in range(s.total):
            cps = holders.get((i, pos), [])
            if len(cps) != 1:
                wrong.append((i, pos, cps))
    if not wrong:
        return []
    words = [f"sample {i} position {pos} is held " + _holders(cps) for i, pos, cps in wrong[:MAX_LISTED]]
    more = f" (+{len(wrong) - MAX_LISTED} more)" if len(wrong) > MAX_LISTED else ""
    i, pos, _ = wrong[0]
    return [Failure(LAYOUT_MISMATCH, f"{built_by}: " + "; ".join(words) + more, sorted(members), sample=i,
                    position=pos, details={"positions": [[i, p, c] for i, p, c in wrong[:64]]})]


def _holders(cps: list[int]) -> str:
    if not cps:
        return "by no CP rank"
    if len(set(cps)) == 1:
        return f"{len(cps)} times by cp rank {cps[0]}"
    return f"{len(cps)} times (cp ranks {', '.join(map(str, cps))})"


def _at(rp: tuple[int, int] | None) -> str:
    return "padding" if rp is None else f"sample {rp[0]} position {rp[1]}"
