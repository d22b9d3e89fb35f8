"""Verdicts: one per scenario, made of plain data (they travel from ranks and into JSON)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from dataclasses import field as _field
from typing import Any

from shardcheck.errors import BadInput
from shardcheck.harness.wire import (  # noqa: F401  (the kinds, re-exported for the controller side)
    COLLECTIVE_MISMATCH,
    GRAD_MISMATCH,
    INPUT_MUTATED,
    INVARIANCE_VIOLATION,
    KINDS,
    RANK_ERROR,
    HARNESS_ERROR,
    ROOT_CAUSES,
    TIMEOUT,
    VALUE_MISMATCH,
    Failure,
    RankResult,
)
from shardcheck.harness.controller.reports.layout_check import coverage_failures
from shardcheck.scenarios.scenario import Scenario

PASS, FAIL, SKIP = "pass", "fail", "skip"
# a deadline the machine missed (its ranks waited for a CPU): no finding either way; exit status 3
TIMED_OUT = "timeout"
# the harness's own part failed on a rank (harness_error): not the target's; exit status 2
ERROR = "error"
STATUSES = (PASS, FAIL, SKIP, TIMED_OUT, ERROR)


@dataclass
class Verdict:
    scenario: Scenario
    status: str
    failures: list[Failure] = _field(default_factory=list)
    reason: str | None = None  # why skipped
    seconds: float = 0.0
    max_error: dict[str, float] = _field(default_factory=dict)  # field -> max |got - want|
    traces: dict[int, list[dict[str, Any]]] = _field(default_factory=dict)  # rank -> collective calls
    # rank -> the rows the framework's data path built there (empty: the harness laid them out)
    layouts: dict[int, dict[str, Any]] = _field(default_factory=dict)
    # why a target with its own data path did not lay this scenario out (the harness did)
    layout_note: str | None = None

    @property
    def built_by(self) -> str | None:
        """Who laid the rows out: the framework's function, "shardcheck", or None (not run)."""
        if self.layouts:
            return next(iter(self.layouts.values()))["built_by"]
        return None if self.status == SKIP else "shardcheck"

    @property
    def kinds(self) -> list[str]:
        return sorted({f.kind for f in self.failures})

    def headline(self) -> str:
        if self.status == SKIP:
            return f"skipped: {self.reason}"
        if self.status == PASS:
            return "ok"
        f = self.failures[0]
        more = len(self.failures) - 1
        return f"{f.kind}: {f.message}" + (f" (+{more} more)" if more else "")

    def to_dict(self) -> dict[str, Any]:
        sc = self.scenario
        return {
            "name": sc.name,
            "layout": sc.layout,
            "tp": sc.tp,
            "cp": sc.cp,
            **({"sp": sc.sp} if sc.sp > 1 else {}),
            "verdict": self.status,
            "kinds": self.kinds,
            "reason": self.reason,
            "seconds": round(self.seconds, 4),
            "max_error": self.max_error,
            "failures": [f.to_dict() for f in self.failures],
            "scenario": sc.to_dict(),
            **({"layout_built_by": self.built_by} if self.built_by else {}),
            **({"layout_note": self.layout_note} if self.layout_note else {}),
            **({"layouts": {str(r): lay for r, lay in self.layouts.items()}} if self.layouts else {}),
            **({"traces": {str(r): t for r, t in self.traces.items()}} if self.traces else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Verdict:
        """A verdict read back from its entry in a saved JSON report: :meth:`to_dict`'s inverse.
        What an older shardcheck did not write gets its default (layouts and traces came later);
        what is derived (``kinds``, ``layout_built_by``) is derived again. BadInput (one line) for
        an entry that is not a verdict."""
        if not isinstance(d, dict):
            raise BadInput(f"a scenario's entry must be an object, got {type(d).__name__}")
        if "scenario" not in d:
            raise BadInput(f"the entry {d.get('name', '?')!r} has no scenario field")
        status = d.get("verdict")
        if status not in STATUSES:
            raise BadInput(f"the entry {d.get('name', '?')!r} has verdict {status!r} (known: {', '.join(STATUSES)})")
        failures = d.get("failures") or []
        if not isinstance(failures, list):
            raise BadInput(f"the entry {d.get('name', '?')!r}: failures must be a list")
        return cls(
            scenario=Scenario.from_dict(d["scenario"]),
            status=status,
            failures=[_failure(f, d.get("name", "?")) for f in failures],
            reason=d.get("reason"),
            seconds=float(d.get("seconds") or 0.0),
            max_error=dict(d.get("max_error") or {}),
            traces={int(r): t for r, t in (d.get("traces") or {}).items()},
            layouts={int(r): lay for r, lay in (d.get("layouts") or {}).items()},
            layout_note=d.get("layout_note"),
        )


@dataclass
class RunInfo:
    """What a run says about itself, beside its verdicts: the target (as the ranks describe it
    once they have run), the world, and the time it took. Reporters read it by attribute."""

    target: dict[str, Any]
    target_spec: str
    ranks: int
    backend: str
    backend_why: str
    lockstep: bool
    startup_seconds: list[float] = _field(default_factory=list)  # one entry per world (re)start
    wall_seconds: float = 0.0
    rank_output: list[dict[str, Any]] = _field(default_factory=list)  # {"line", "ranks"}, each line once
    world_events: list[str] = _field(default_factory=list)  # outside any scenario: a rank that died idle
    inplace: bool = True  # whether input_mutated was checked (run --no-inplace: not)
    mask_leak: bool = True  # whether a training step was run again with NaN at masked positions (--no-mask-leak: not)
    # run --coverage: what of the framework's own code ran (controller/reach_report.Reach.summary)
    coverage: dict[str, Any] | None = None
    # how to write a failure as a standalone script ({scenario}: its name); None where the target
    # cannot say how it calls its code
    repro: str | None = None
    # what configured the target ({"src": its checkout, "options": [[key, value], ...]}), so that
    # `shardcheck repro --report` builds the same target
    target_config: dict[str, Any] = _field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> RunInfo:
        """The run info of a saved JSON report (whose document holds :meth:`to_dict`'s keys among
        its own): its inverse. A field an older shardcheck did not write gets its default, or,
        for one every run has, the value that says nothing (no lockstep, from before it existed);
        keys of the document that are not run info (``scenarios``, ``summary``, ...) are left."""
        known = {f.name for f in dataclasses.fields(cls)}
        given = {k: v for k, v in doc.items() if k in known}
        return cls(**{**_UNSAID, **given})


# what a saved report that lacks a field every run now writes is read as (the first reports had
# only target, target_spec, ranks and backend; a run stopped before it started has none)
_UNSAID: dict[str, Any] = {"target": {}, "target_spec": "", "ranks": 0, "backend": "", "backend_why": "",
                           "lockstep": False}


def _failure(d: Any, name: str) -> Failure:
    """A failure read back from a saved report: the fields this version knows (a newer report's
    others are left), the kind at least."""
    if not isinstance(d, dict) or not isinstance(d.get("kind"), str):
        raise BadInput(f"the entry {name!r} has a failure without a kind")
    known = {f.name for f in dataclasses.fields(Failure)}
    return Failure.from_dict({"message": "", **{k: v for k, v in d.items() if k in known}})


def merge(scenario: Scenario, results: list[RankResult], seconds: float) -> Verdict:
    """One verdict from every rank's result; replicas' identical findings merge, ranks listed.

    Notes from ranks that stopped because a peer failed say where they were waiting; they are
    attached to the root failure (the earliest rank error or collective mismatch).
    """
    layouts = {r: res.layout for r, res in enumerate(results) if res.layout}
    merged: dict[tuple, Failure] = {}
    for res in [*results, RankResult(-1, None, coverage_failures(scenario, layouts))]:
        for f in res.failures:
            if "divergent_call_at" in f.details and res.received_at is not None:
                f.details["reported_after_s"] = round(res.received_at - f.details["divergent_call_at"], 4)
            key = f.identity()
            if key in merged:
                m = merged[key]
                m.ranks = sorted(set(m.ranks) | set(f.ranks))
                if len(f.details.get("sides", {})) > len(m.details.get("sides", {})):
                    m.message, m.details["sides"] = f.message, f.details["sides"]  # the fullest view
                for timing in ("reported_after_s", "detected_after_s"):  # the first rank to see it
                    if timing in f.details:
                        m.details[timing] = min(m.details.get(timing, 1e9), f.details[timing])
            else:
                merged[key] = dataclasses.replace(f, ranks=list(f.ranks), details=dict(f.details))
    failures = sorted(merged.values(), key=_order)
    notes = [n for res in results for n in res.notes]
    if notes and failures and failures[0].kind in ROOT_CAUSES:
        root = failures[0]
        root.details["peers_waiting"] = notes
        root.message += "; " + "; ".join(n["message"] for n in notes)
    elif notes:  # peers stopped but nobody said why: that is itself an error
        failures.insert(0, Failure(RANK_ERROR, "; ".join(n["message"] for n in notes),
                                   sorted({n.get("peer", -1) for n in notes}), details={"peers_waiting": notes}))
    worst: dict[str, float] = {}
    for res in results:
        for k, v in res.max_error.items():
            worst[k] = max(worst.get(k, 0.0), v)
    traces = {r: res.trace for r, res in enumerate(results) if res.trace}
    return Verdict(scenario, _status(failures), failures, None, seconds, worst, traces, layouts)


def _status(failures: list[Failure]) -> str:
    """FAIL for any finding; TIMED_OUT when the only failures are deadlines the machine missed
    and its peers' reports of waiting for the ranks that missed them."""
    if not failures:
        return PASS
    if any(f.kind == HARNESS_ERROR for f in failures):
        return ERROR
    if any(f.kind == TIMEOUT for f in failures) and all(
            f.kind == TIMEOUT or "waited_for" in f.details for f in failures):
        return TIMED_OUT
    return FAIL


def _order(f: Failure) -> tuple:
    # rank errors first, a rank blamed for not coming first of all, then earliest first (the root
    # cause; peers' timeouts follow), then by position
    return (
        0 if f.kind in ROOT_CAUSES else 1,
        0 if f.details.get("blamed") else 1,
        f.details.get("at", 0.0),
        "count" in f.details,  # "... N more" summaries after the findings they summarise
        f.sample if f.sample is not None else -1,
        f.token if f.token is not None else -1,
        f.position if f.position is not None else -1,
        f.column if f.column is not None else -1,
        f.field or "",
    )
