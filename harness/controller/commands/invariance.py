"""Invariance: the same sample gives the same bits however it is laid out.

For each base scenario and each axis, the harness lays the base's samples out in the axis's ways
(the variants), runs every variant on one world with the target's outputs sent back bit for bit
(``RankRunner.run(outputs=True)``), puts each sample's log-probs, entropies and logit gradient
back together, and compares them across the axis's variants. A sample carries the same data in
every variant (its ``data_id``), so any difference is the target's.

Axes (variants of a base scenario S with samples s_0 .. s_n-1):

    rerun     S, then S again
    tp        S at tp = 1, 2, 4
    cp        S at cp = 1 (thd, or bshd if S is), 2, 4 (S's CP mode, zigzag if S has none)
    cp_mode   zigzag vs all-gather, at S's cp (2 if S has none)
    format    thd vs bshd, at cp = 1
    chunk     log_probs_chunk_size -1, S's, 3
    packing   each sample alone, in S, and in S with a new sample before and after it all
    order     S, and S in reverse order
    split     S, and S cut into two micro-batches of at least two samples each (S needs 4
              samples: a micro-batch of one is the packing axis)

A variant the world cannot hold (tp * cp not dividing the world), that the vocab does not allow
(tp not dividing it) or that the target does not support is skipped with the reason.

Differences are measured per quantity: bitwise (the same floats; -0.0 and +0.0 count as the
same), the largest distance in units in the last place
of the output's dtype (ulp), and the largest absolute and relative difference with where it is.
A contract (what the target declares in ``invariance``, overridden by the user's ``--expect``)
turns them into ``invariance_violation`` failures.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardcheck.errors import BadInput
from shardcheck.harness.controller.reports.verdict import INVARIANCE_VIOLATION, Failure, RankResult, Verdict, merge
from shardcheck.harness.controller.worlds.choice import World
from shardcheck.scenarios.scenario import CP_LAYOUTS, SP_LAYOUTS, Sample, Scenario, data_id
from shardcheck.harness.wire import Checks
from shardcheck.targets.base import knob_skip_reason, step_skip_reason

AXES = ("rerun", "tp", "cp", "cp_mode", "format", "chunk", "packing", "order", "split", "sp")
QUANTITIES = ("log_probs", "entropy", "grad")
TP_SIZES = (1, 2, 4)
CP_SIZES = (1, 2, 4)
SP_SIZES = (1, 2, 4)  # sp 1: the packed layout the sp layouts slice (thd)
CHUNK_SIZES = (-1, 3)
# the new neighbours of the packing axis: a sample before and one after the whole batch
FILLERS = (Sample(7, 3), Sample(11, 4))
MAX_VIOLATIONS_LISTED = 3  # per axis, quantity and base scenario; the rest are counted


# -- contracts ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Expect:
    """What an axis must keep: ``bitwise`` (ulp = 0) or at most ``ulp`` units in the last place."""

    ulp: int

    def __str__(self) -> str:
        return "bitwise" if self.ulp == 0 else f"ulp:{self.ulp}"

    @classmethod
    def parse(cls, text: str, where: str) -> Expect:
        t = text.strip()
        if t == "bitwise":
            return cls(0)
        if t.startswith("ulp:") and t[4:].isdigit():
            return cls(int(t[4:]))
        raise BadInput(f"{where}: expected 'bitwise' or 'ulp:N' (N a whole number), got {text!r}")


def parse_expect(spec: str | None) -> dict[str, Expect]:
    """``packing=bitwise,tp=ulp:8`` -> {axis: Expect}; one line naming what is wrong otherwise."""
    out: dict[str, Expect] = {}
    for item in (spec or "").split(","):
        if not item.strip():
            continue
        axis, eq, value = item.partition("=")
        axis = axis.strip()
        if not eq:
            raise BadInput(f"--expect {item.strip()!r}: expected AXIS=bitwise or AXIS=ulp:N")
        check_axes([axis])
        out[axis] = Expect.parse(value, f"--expect {axis}")
    return out


def check_axes(axes: Sequence[str]) -> list[str]:
    unknown = [a for a in axes if a not in AXES]
    if unknown:
        raise BadInput(f"unknown invariance axis {unknown[0]!r} (axes: {', '.join(AXES)})")
    return list(dict.fromkeys(axes))


def declared_contract(target: Any) -> dict[str, Expect]:
    """What a target declares: ``invariance = {"packing": "bitwise", "tp": "ulp:8", ...}``."""
    declared = target.invariance or {}
    return {axis: Expect.parse(str(v), f"target {target.name} declares {axis}")
            for axis, v in declared.items() if axis in AXES}


# -- variants ----------------------------------------------------------------------------------
@dataclass
class Variant:
    """One way an axis lays out (some of) a base scenario's samples."""

    label: str
    scenario: Scenario | None
    skip: str | None = None
    run: int = 0  # rerun: which run of the same scenario


def _pinned(base: Scenario) -> tuple[Sample, ...]:
    return tuple(Sample(s.total, s.response, data_id(base, i)) for i, s in enumerate(base.samples))


def _variant(base: Scenario, label: str, world: int, samples: Sequence[Sample] | None = None,
             **changes: Any) -> Variant:
    try:
        sc = dataclasses.replace(base, name=f"{base.name}~{label}",
                                 samples=tuple(samples) if samples is not None else _pinned(base), **changes)
    except BadInput as exc:
        return Variant(label, None, str(exc).split(": ", 1)[-1])
    if world % sc.ranks:
        seq = f"sp={sc.sp}" if sc.sp > 1 else f"cp={sc.cp}"
        return Variant(label, None, f"tp={sc.tp} x {seq} needs {sc.ranks} ranks; the world has {world}"
                       if sc.ranks > world else f"tp*cp={sc.ranks} does not divide the world size {world}")
    return Variant(label, sc)


def _cp_layout(base: Scenario, cp: int) -> str:
    if cp == 1:
        return base.layout if base.layout in ("thd", "bshd") else "thd"
    return base.layout if base.layout in CP_LAYOUTS else "zigzag"


def variants(axis: str, base: Scenario, world: int) -> list[Variant]:
    """The variants of ``base`` along ``axis`` (the first is the one the others are compared with)."""
    n = len(base.samples)
    v = _variant
    if axis == "rerun":
        first = v(base, "run 1", world)
        return [first, dataclasses.replace(first, label="run 2", run=1)]
    if axis == "tp":
        return [v(base, f"tp={t}", world, tp=t) for t in TP_SIZES]
    if axis == "cp":
        return [v(base, f"cp={c} {_cp_layout(base, c)}", world, cp=c, sp=1, layout=_cp_layout(base, c))
                for c in CP_SIZES]
    if axis == "cp_mode":
        c = base.cp if base.cp > 1 else 2
        return [v(base, f"{m} cp={c}", world, cp=c, sp=1, layout=m) for m in CP_LAYOUTS]
    if axis == "format":
        return [v(base, f, world, cp=1, sp=1, layout=f) for f in ("thd", "bshd")]
    if axis == "chunk":
        sizes = dict.fromkeys((base.log_probs_chunk_size, *CHUNK_SIZES))
        return [v(base, f"chunk={c}", world, log_probs_chunk_size=c) for c in sizes]
    if axis == "packing":
        pinned = _pinned(base)
        top = max(s.data_id for s in pinned) + 1
        fillers = [Sample(f.total, f.response, top + k) for k, f in enumerate(FILLERS)]
        out = [v(base, "packed", world),
               v(base, "between new samples", world, samples=[fillers[0], *pinned, fillers[1]])]
        return out + [v(base, f"sample {i} alone", world, samples=[pinned[i]]) for i in range(n)]
    if axis == "order":
        if n < 2:
            return [Variant("reversed", None, "one sample: no other order")]
        return [v(base, "in order", world), v(base, "reversed", world, samples=_pinned(base)[::-1])]
    if axis == "split":
        if n < 4:
            return [Variant("two micro-batches", None,
                            f"{n} sample(s): two micro-batches of two or more need 4 (one alone is the packing axis)")]
        pinned = _pinned(base)
        return [v(base, "one batch", world), v(base, "micro-batch 1", world, samples=pinned[: n // 2]),
                v(base, "micro-batch 2", world, samples=pinned[n // 2 :])]
    if axis == "sp":  # the other family's sequence parallelism: ulysses (or the base's sp layout) at sp 2, 4
        lay = base.layout if base.layout in SP_LAYOUTS else "ulysses"
        return [v(base, f"sp={p} {lay if p > 1 else 'thd'}", world, cp=1, sp=p, layout=lay if p > 1 else "thd")
                for p in SP_SIZES]
    raise BadInput(f"unknown invariance axis {axis!r} (axes: {', '.join(AXES)})")


# -- a run's outputs, per sample -----------------------------------------------------------------
@dataclass
class SampleOutputs:
    """One sample's outputs in one run, whole (every rank's share put back)."""

    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    grad: torch.Tensor | None = None  # [total, vocab]


def assemble(scenario: Scenario, results: Sequence[RankResult]) -> dict[int, SampleOutputs] | None:
    """Per data_id, the whole outputs of a run (the first data-parallel replica's ranks); None
    when some rank sent none (it failed before its outputs existed)."""
    ranks = results[: scenario.ranks]
    if any(r.outputs is None for r in ranks):
        return None
    out: dict[int, SampleOutputs] = {}
    for i, s in enumerate(scenario.samples):
        got = SampleOutputs()
        for name in ("log_probs", "entropy"):
            parts = [(js, t) for r in ranks for (k, js, t) in r.outputs["values"].get(name, []) if k == i]
            if not parts:
                continue
            full = torch.zeros(s.response, dtype=parts[0][1].dtype)
            seen = torch.zeros(s.response, dtype=torch.bool)
            for js, t in parts:
                idx = torch.tensor(js, dtype=torch.int64)
                full[idx], seen[idx] = t, True
            setattr(got, name, full if bool(seen.all()) else None)
        pieces = [(p, c, t) for r in ranks for (k, p, c, t) in r.outputs["grad"] if k == i]
        if pieces:
            grad = torch.zeros(s.total, scenario.vocab, dtype=pieces[0][2].dtype)
            for p, c, t in pieces:
                grad[p : p + t.size(0), c : c + t.size(1)] = t
            got.grad = grad
        out[data_id(scenario, i)] = got
    return out


# -- differences ---------------------------------------------------------------------------------
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}
FAR = 1 << 40  # the distance of a NaN from a number, or of outputs of different shapes


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Units in the last place between same-dtype floats (int64; NaN against a number: huge)."""
    def ordered(x: torch.Tensor) -> torch.Tensor:
        bits = x.contiguous().view(_BITS[x.element_size()]).to(torch.int64)
        sign_bit = 1 << (8 * x.element_size() - 1)
        # negative floats below the positives; -0.0 and +0.0 are the same number (a zero
        # gradient's sign is no difference a caller can see)
        return torch.where(bits < 0, -(bits + sign_bit), bits)

    d = (ordered(a) - ordered(b)).abs()
    return torch.where(a.isnan() != b.isnan(), torch.full_like(d, FAR), d)


@dataclass
class Difference:
    """The largest difference between two variants' outputs for one sample and quantity."""

    ulp: int
    abs: float
    rel: float
    index: tuple[int, ...]  # (token,) or (position, column)
    got: float
    want: float
    count: int  # elements that differ at all


def difference(want: torch.Tensor, got: torch.Tensor) -> Difference | None:
    if want.shape != got.shape or want.dtype != got.dtype:
        return Difference(FAR, float("inf"), float("inf"), (), float("nan"), float("nan"), max(want.numel(), 1))
    ulp = ulp_distance(want, got)
    count = int((ulp > 0).sum())
    if count == 0:
        return None
    k = int(ulp.reshape(-1).argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(k), ulp.shape))
    a, b = want.double(), got.double()
    absdiff = (a - b).abs().nan_to_num(nan=float("inf"))
    rel = absdiff / a.abs().clamp_min(torch.finfo(torch.float64).tiny)
    return Difference(int(ulp.max()), float(absdiff.max()), float(rel.max()), index,
                      float(got.reshape(-1)[k]), float(want.reshape(-1)[k]), count)


# -- the matrix ----------------------------------------------------------------------------------
@dataclass
class Cell:
    """One (axis, quantity): compared pairs, and the worst difference with where it is."""

    compared: int = 0
    worst: Difference | None = None
    where: dict[str, Any] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    def add(self, diff: Difference | None, where: dict[str, Any]) -> None:
        self.compared += 1
        if diff is not None and (self.worst is None or diff.ulp > self.worst.ulp):
            self.worst, self.where = diff, where

    def text(self) -> str:
        if not self.compared:
            return "n/a"
        if self.worst is None:
            return "bitwise"
        w = self.worst
        return f"<= {w.ulp} ulp (abs {w.abs:.2g})" if w.ulp < FAR else "differs (shape/NaN)"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"compared": self.compared, "result": self.text()}
        if self.worst is not None:
            d |= {"max_ulp": self.worst.ulp, "max_abs": self.worst.abs, "max_rel": self.worst.rel,
                  "differing_elements": self.worst.count, "where": self.where}
        elif self.compared:
            d |= {"max_ulp": 0}
        if self.skipped:
            d["skipped"] = self.skipped[:20]
        return d


@dataclass
class InvarianceInfo:
    """What an invariance check says about itself, beside its matrix: the world and the time."""

    target_spec: str = ""
    ranks: int = 0
    backend: str = ""
    backend_why: str = ""
    bases: list[str] = field(default_factory=list)  # the base scenarios' names
    bases_done: int = 0
    complete: bool = False
    startup_seconds: list[float] = field(default_factory=list)  # one entry per world (re)start
    wall_seconds: float = 0.0
    lockstep: bool = True  # the world's collective lockstep (invariance --no-lockstep: off)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class InvarianceResult:
    target: dict[str, Any]
    axes: list[str]
    contract: dict[str, Expect]
    matrix: dict[str, dict[str, Cell]]
    violations: list[Failure] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)  # every variant run: scenario, verdict
    axis_seconds: dict[str, float] = field(default_factory=dict)
    info: InvarianceInfo = field(default_factory=InvarianceInfo)

    @property
    def exit_code(self) -> int:
        return 1 if self.violations else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "axes": self.axes,
            "contract": {a: str(e) for a, e in self.contract.items()},
            "matrix": {a: {q: c.to_dict() for q, c in row.items()} for a, row in self.matrix.items()},
            "violations": [f.to_dict() for f in self.violations],
            "axis_seconds": {a: round(s, 3) for a, s in self.axis_seconds.items()},
            "runs": self.runs,
            **self.info.to_dict(),
        }


def _where(base: Scenario, i: int, quantity: str, a: Variant, b: Variant, d: Difference) -> dict[str, Any]:
    w: dict[str, Any] = {"base": base.name, "sample": i, "layouts": [a.label, b.label],
                         "scenarios": [a.scenario.name, b.scenario.name], "want": d.want, "got": d.got}
    if quantity == "grad" and len(d.index) == 2:
        w |= {"position": d.index[0], "column": d.index[1]}
    elif d.index:
        w["token"] = d.index[0]
    return w


def _violation(axis: str, quantity: str, expect: Expect, w: dict[str, Any], d: Difference) -> Failure:
    at = (f"position {w['position']} column {w['column']}" if "position" in w
          else f"token {w['token']}" if "token" in w else "shape")
    a, b = w["layouts"]
    message = (f"{axis}: {quantity} of sample {w['sample']} ({w['base']}) differs between {a} and {b}: {at} "
               f"{w['want']!r} vs {w['got']!r} ({d.ulp} ulp, {d.count} elements differ; expected {expect})")
    return Failure(INVARIANCE_VIOLATION, message, [], field=quantity, sample=w["sample"], token=w.get("token"),
                   position=w.get("position"), column=w.get("column"), got=d.got, want=d.want,
                   details={"axis": axis, "expected": str(expect), "ulp": d.ulp, "differing_elements": d.count,
                            **{k: w[k] for k in ("base", "layouts", "scenarios")}})


# -- the check -----------------------------------------------------------------------------------
RunFn = Callable[[Scenario], list[RankResult]]


class Invariance:
    """Plans the variants of each base, runs them once each (rerun twice), compares."""

    def __init__(self, target: Any, axes: Sequence[str], contract: dict[str, Expect], world_size: int,
                 run: RunFn, on_run: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.target = target
        self.axes = list(axes)
        self.contract = contract
        self.world_size = world_size
        self._run = run
        self._on_run = on_run
        self._cache: dict[tuple[str, int], tuple[dict[int, SampleOutputs] | None, Verdict]] = {}
        self.result = InvarianceResult(target.describe(), self.axes, contract,
                                       {a: {q: Cell() for q in QUANTITIES} for a in self.axes},
                                       axis_seconds={a: 0.0 for a in self.axes})

    def check(self, base: Scenario) -> None:
        """Every axis for one base scenario; the matrix and violations grow."""
        for axis in self.axes:
            t0 = time.perf_counter()
            vs = variants(axis, base, self.world_size)
            for v in vs:
                if v.scenario is not None and v.skip is None:
                    v.skip = (step_skip_reason(self.target, v.scenario)
                              or self.target.capabilities.skip_reason(v.scenario)
                              or knob_skip_reason(self.target, v.scenario))
            runnable = [v for v in vs if v.skip is None]
            row = self.result.matrix[axis]
            for v in vs:
                if v.skip is not None:
                    for cell in row.values():
                        cell.skipped.append(f"{base.name} {v.label}: {v.skip}")
            outs = [(v, self._outputs(v)) for v in runnable]
            self._compare(axis, base, outs)
            self.result.axis_seconds[axis] += time.perf_counter() - t0

    def _outputs(self, v: Variant) -> tuple[dict[int, SampleOutputs] | None, Verdict]:
        key = (v.scenario.key, v.run)
        if key not in self._cache:
            started = time.perf_counter()
            results = self._run(v.scenario)
            verdict = merge(v.scenario, results, time.perf_counter() - started)
            self._cache[key] = (assemble(v.scenario, results), verdict)
            entry = {"scenario": v.scenario.to_dict(), "run": v.run + 1, "verdict": verdict.status,
                     "seconds": round(verdict.seconds, 4)}
            if verdict.failures:
                entry["headline"] = verdict.headline()
            self.result.runs.append(entry)
            if self._on_run is not None:
                self._on_run(entry)
        return self._cache[key]

    def _compare(self, axis: str, base: Scenario, outs: list) -> None:
        row = self.result.matrix[axis]
        expect = self.contract.get(axis)
        listed: dict[str, int] = {}
        for i in range(len(base.samples)):
            ident = data_id(base, i)
            have = [(v, o[ident]) for v, (o, _) in outs if o is not None and ident in o]
            if len(have) < 2:
                continue
            (ref_v, ref), others = have[0], have[1:]
            for v, got in others:
                for q in QUANTITIES:
                    want_t, got_t = getattr(ref, q), getattr(got, q)
                    if want_t is None and got_t is None:
                        continue
                    if want_t is None or got_t is None:
                        row[q].skipped.append(f"{base.name} sample {i}: {q} missing in "
                                              f"{ref_v.label if want_t is None else v.label}")
                        continue
                    d = difference(want_t, got_t)
                    w = _where(base, i, q, ref_v, v, d) if d is not None else {}
                    row[q].add(d, w)
                    if d is not None and expect is not None and d.ulp > expect.ulp:
                        n = listed.get(q, 0)
                        listed[q] = n + 1
                        if n < MAX_VIOLATIONS_LISTED:
                            self.result.violations.append(_violation(axis, q, expect, w, d))
        for v, (o, verdict) in outs:
            if o is None:
                for cell in row.values():
                    cell.skipped.append(f"{base.name} {v.label}: no outputs ({verdict.headline()})")


def check_invariance(
    scenarios: Sequence[Scenario],
    target_spec: str,
    *,
    axes: Sequence[str] = AXES,
    expect: dict[str, Expect] | None = None,
    nproc: int | None = None,
    timeout: float = 60.0,
    backend: str = "gloo",
    world: World | None = None,
    on_run: Callable[[dict[str, Any]], None] | None = None,
    on_base: Callable[[InvarianceResult], None] | None = None,
    lockstep: bool = True,
) -> InvarianceResult:
    """The invariance matrix of ``scenarios``' samples for a target, on one world started once
    (or the given one). ``expect`` overrides, axis by axis, what the target declares.
    ``on_base`` is called with the result so far after each base scenario (a report rewritten
    then keeps what was found if the run is stopped)."""
    from shardcheck.harness.controller.commands.runner import controller_target, world_size_for
    from shardcheck.harness.controller.worlds.choice import world_for

    axes = check_axes(axes)
    target = controller_target(target_spec)
    contract = declared_contract(target) | (expect or {})
    size = world.nproc if world is not None else nproc or max(4, world_size_for(scenarios))
    chosen = world_for(size, given=world, backend=backend, timeout=timeout, lockstep=lockstep)
    world, own_world, backend_why = chosen.world, chosen.owned, chosen.why
    def run(sc: Scenario) -> list[RankResult]:
        # outputs only: values against the reference and the in-place check are `run`'s business
        results = world.run(sc.to_dict(), target_spec, Checks(outputs=True, reference=False, inplace=False))
        if results and results[0].target:
            res.target = results[0].target  # as the ranks describe it (slime: commit, era)
        return results

    check = Invariance(target, axes, contract, size, run, on_run)
    res = check.result
    res.info = InvarianceInfo(target_spec, size, world.backend, backend_why,
                              [sc.name for sc in scenarios], lockstep=bool(getattr(world, "lockstep", True)))
    t0 = time.perf_counter()
    try:
        if own_world:
            world.start()
        for sc in scenarios:
            check.check(sc)
            res.info.bases_done += 1
            if on_base is not None:
                on_base(res)
        res.info.complete = True
    finally:
        res.info.startup_seconds = [round(s, 3) for s in world.startup_seconds]
        res.info.wall_seconds = round(time.perf_counter() - t0, 3)
        if own_world:
            world.close()
    return res
