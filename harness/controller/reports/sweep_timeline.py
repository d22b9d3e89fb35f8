"""What a sweep found: per commit and scenario a :class:`Cell`, and per failure signature the
intervals of commits where it fails (:func:`timeline`). Made by
:mod:`shardcheck.harness.controller.commands.sweep`, shown by :mod:`.sweep_report`."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from shardcheck.harness.controller.reports.verdict import ERROR, HARNESS_ERROR

PASS, FAIL, SKIP, CANNOT_RUN = "pass", "fail", "skip", "cannot run"


@dataclass(frozen=True)
class Commit:
    sha: str
    date: str  # the committer date, ISO 8601
    subject: str
    tags: tuple[str, ...] = ()

    @property
    def short(self) -> str:
        return self.sha[:10]


@dataclass(frozen=True)
class Cell:
    """One scenario at one commit. ``failures``: (kind, phase, the message's rank-independent part)."""

    state: str
    failures: tuple[tuple[str, str, str], ...] = ()
    why: str = ""  # a skip's or a cannot-run's reason

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "failures": [list(f) for f in self.failures], "why": self.why}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cell:
        return cls(d["state"], tuple(tuple(f) for f in d.get("failures", ())), d.get("why", ""))


_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?(?![\w.])|\bnan\b|\binf\b")
_LOCATION = re.compile(r"\s+at\s+\S+:\d+(\s+<-\s+\S+:\d+)*")


def message_key(message: str) -> str:
    """A failure message's subject without what varies from rank to rank and run to run: the text
    before its first ': ' or ';' (what went wrong, not by how much: "log_probs sample # token #",
    "cp group [#, #] call #"), its numbers masked and source locations dropped."""
    first = re.split(r": |;", message, maxsplit=1)[0]
    first = _LOCATION.sub("", first)
    return " ".join(_NUMBER.sub("#", first).split())[:160]


def cells_of(verdicts: Sequence[Any]) -> dict[str, Cell]:
    """Per scenario name, its cell: a run of the harness's own error (the target cannot be built
    or imported at this commit) is "cannot run", never a pass."""
    out = {}
    for v in verdicts:
        if v.status == ERROR or any(f.kind == HARNESS_ERROR for f in v.failures):
            why = next((f.message for f in v.failures if f.kind == HARNESS_ERROR), v.reason or "error")
            out[v.scenario.name] = Cell(CANNOT_RUN, why=why[:300])
        elif v.status == "skip":
            out[v.scenario.name] = Cell(SKIP, why=(v.reason or "")[:300])
        elif v.status == "pass":
            out[v.scenario.name] = Cell(PASS)
        else:
            # one signature per kind and phase: the subject of such a failure on the lowest rank (the
            # ranks' and the tokens' further messages of one finding say the same in other numbers
            # and words). By rank, not by arrival: ranks raising different errors report in the
            # order they happen to finish, which would change the signature from run to run.
            first: dict[tuple[str, str], str] = {}
            for f in sorted(v.failures, key=lambda f: min(f.ranks, default=-1)):  # stable: ties keep their order
                first.setdefault((f.kind, f.phase or ""), message_key(f.message))
            out[v.scenario.name] = Cell(FAIL, tuple(sorted((k, p, m) for (k, p), m in first.items())))
    return out


@dataclass
class SweepResult:
    commits: list[Commit]
    scenarios: list[str]
    cells: dict[str, dict[str, Cell]]  # commit sha -> scenario name -> cell
    ran: int = 0  # cells computed in this sweep (the rest came from the cache)
    interrupted: bool = False


@dataclass(frozen=True)
class Signature:
    scenario: str
    kind: str
    phase: str
    message: str

    def label(self) -> str:
        return f"{self.scenario}: {self.kind}" + (f" in {self.phase}" if self.phase else "") + f": {self.message}"


@dataclass
class Interval:
    """Where a signature fails: from ``first_bad`` up to ``first_good``, the next commit where the
    scenario ran without it; commits between that could not run are listed, never counted as
    passes. Without a first good commit the interval is open (failing at the newest commit) or,
    when the scenario could not run on the commits after ``last_bad``, unresolved."""

    signature: Signature
    first_bad: Commit
    last_bad: Commit
    first_good: Commit | None
    unknown: list[Commit] = field(default_factory=list)  # cannot run / skipped inside the interval
    before_unknown: bool = False  # the commit before first_bad could not say (the start is not exact)
    good_fails_otherwise: bool = False  # at first_good the scenario fails, with other signatures
    after: list[Commit] = field(default_factory=list)  # past last_bad, none of them able to say
    releases: list[str] = field(default_factory=list)  # the release tags carrying it (sweep --tags)

    @property
    def state(self) -> str:
        """fixed (the scenario passes at first_good), changed (it fails otherwise there), open
        (failing at the newest commit checked) or unresolved (it could not run after last_bad)."""
        if self.first_good is not None:
            return "changed" if self.good_fails_otherwise else "fixed"
        return "unresolved" if self.after else "open"

    @property
    def open(self) -> bool:
        return self.state == "open"

    def to_dict(self) -> dict[str, Any]:
        return {"signature": asdict(self.signature), "state": self.state, "first_bad": asdict(self.first_bad),
                "last_bad": asdict(self.last_bad), "first_good": asdict(self.first_good) if self.first_good else None,
                "open": self.open, "unknown_inside": [c.sha for c in self.unknown],
                "start_not_exact": self.before_unknown, "unknown_after": [c.sha for c in self.after],
                "releases": self.releases}


def signatures_of(cell: Cell, scenario: str) -> set[Signature]:
    return {Signature(scenario, kind, phase, msg) for kind, phase, msg in cell.failures}


def timeline(result: SweepResult) -> list[Interval]:
    """Per failure signature, the runs of commits where it fails. A commit whose scenario could not
    run or was skipped neither ends nor starts an interval: it is recorded as unknown inside it."""
    intervals: list[Interval] = []
    for name in result.scenarios:
        open_: dict[Signature, Interval] = {}
        last_known_state: str | None = None
        pending_unknown: list[Commit] = []
        for commit in result.commits:
            cell = result.cells.get(commit.sha, {}).get(name)
            if cell is None or cell.state in (SKIP, CANNOT_RUN):
                pending_unknown.append(commit)
                continue
            now = signatures_of(cell, name) if cell.state == FAIL else set()
            for sig in list(open_):
                interval = open_[sig]
                if sig in now:
                    interval.unknown.extend(pending_unknown)
                    interval.last_bad = commit
                else:
                    interval.first_good = commit
                    interval.good_fails_otherwise = cell.state == FAIL
                    intervals.append(open_.pop(sig))
            for sig in now - set(open_):
                open_[sig] = Interval(sig, commit, commit, None,
                                      before_unknown=bool(pending_unknown) and last_known_state is not None)
            pending_unknown = []
            last_known_state = cell.state
        for interval in open_.values():
            interval.after = list(pending_unknown)
        intervals.extend(open_.values())
    order = {c.sha: i for i, c in enumerate(result.commits)}
    return sorted(intervals, key=lambda iv: (order[iv.first_bad.sha], iv.signature.scenario, iv.signature.kind))
