"""Comparison of a rank's outputs and gradient with the float64 reference.

Tolerances, per logits dtype: an element fails when |got - want| > atol + rtol * |want| (NaN and
inf always fail). Values are log-probs and entropies; grad is d loss / d logits.

    dtype      values (atol, rtol)   grad (atol, rtol)
    float32    1e-5, 1e-5            1e-6, 1e-4
    float16    1e-3, 1e-3            1e-5, 2e-3
    bfloat16   1e-2, 1.6e-2          1e-4, 1.6e-2

The reference sees exactly the (rounded) logits the target sees, so these bound the target's
arithmetic, not input rounding. float32 allows a few ulps of log-sum-exp over large vocabularies;
half types allow computing in that type, and the gradient is rounded to the logits dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardcheck.harness.rank.life import shard
from shardcheck.scenarios.layout import RankLayout
from shardcheck.harness.rank.pipeline import Check, Life
from shardcheck.harness.wire import GRAD_MISMATCH, VALUE_MISMATCH, Checks, Failure
from shardcheck.reference import loss_grad_chunks
from shardcheck.scenarios.data import ScenarioData

MAX_LISTED = 5  # mismatched elements listed per field and rank; the rest are counted
MAX_MAPPED = 4096  # (sample, position) of every mismatch beyond those, for the report's error map


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


TOLERANCES: dict[str, dict[str, Tolerance]] = {
    "float32": {"values": Tolerance(1e-5, 1e-5), "grad": Tolerance(1e-6, 1e-4)},
    "float16": {"values": Tolerance(1e-3, 1e-3), "grad": Tolerance(1e-5, 2e-3)},
    "bfloat16": {"values": Tolerance(1e-2, 1.6e-2), "grad": Tolerance(1e-4, 1.6e-2)},
}


_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}
MIN_DIGITS = 6  # significant digits a value is shown with, more where two would read alike


def distinct(a: float, b: float) -> tuple[str, str]:
    """Two different values written with as many significant digits as it takes (at least
    MIN_DIGITS) for them to read differently: a 1-ulp change must not read "was x, now x"."""
    if isinstance(a, int) and isinstance(b, int):
        return str(a), str(b)
    for digits in range(MIN_DIGITS, 18):  # 17 significant digits tell any two float64 apart
        shown = f"{a:.{digits}g}", f"{b:.{digits}g}"
        if shown[0] != shown[1]:
            return shown
    return f"{a!r}", f"{b!r}"  # alike as numbers (two NaNs): the caller says how their bits differ


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two scalars are bitwise the same (of one dtype; a NaN only against its own bits)."""
    a, b = a.detach().reshape(1), b.detach().reshape(1)
    return a.dtype == b.dtype and bool(a.view(_BITS[a.element_size()]) == b.view(_BITS[b.element_size()]))


def ulp_distance(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> int | None:
    """How many steps of ``dtype`` separate two scalars, each rounded to ``dtype`` first (1: the
    next value); None where either is NaN or ``dtype`` is not floating point."""
    if not dtype.is_floating_point or a.isnan() or b.isnan():
        return None
    t = torch.stack([a.to(dtype), b.to(dtype)])
    bits = t.view(_BITS[t.element_size()]).to(torch.int64)
    sign_bit = 1 << (8 * t.element_size() - 1)
    # negative floats below the positives, -0.0 and 0.0 one number: the floats' order as integers
    ordered = torch.where(bits < 0, -(bits + sign_bit), bits)
    return int((ordered[0] - ordered[1]).abs())


def apart(a: torch.Tensor | float, b: torch.Tensor | float, dtype: torch.dtype) -> tuple[str, str, str]:
    """Two different scalars as a message shows them: digits enough to tell them apart, and how
    far apart they are in ``dtype`` (the tensor's), " (N ulps of float32)"; -0.0 against 0.0 and
    NaNs of different payloads are named by their bits. A float is taken as float64 (the
    reference), a tensor keeps its own dtype and bits."""
    ta, tb = (x.detach().reshape(()).cpu() if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.float64)
              for x in (a, b))
    x, y = distinct(ta.item(), tb.item())
    if not dtype.is_floating_point:
        return x, y, ""
    n = ulp_distance(ta, tb, dtype)
    if n is None and x == y:  # two NaNs
        return f"nan (bits 0x{_bits(ta):x})", f"nan (bits 0x{_bits(tb):x})", ""
    name = str(dtype).removeprefix("torch.")
    if n == 0:
        if float(ta) == float(tb):  # equal as numbers: -0.0 against 0.0
            return x, y, " (the same number, the sign bit differs)"
        return x, y, f" (one value once rounded to {name}: they differ below its precision)"
    return x, y, "" if n is None else f" ({n} ulp{'' if n == 1 else 's'} of {name})"


def _bits(t: torch.Tensor) -> int:
    """A float scalar's bits, as an unsigned integer."""
    width = 8 * t.element_size()
    return int(t.reshape(1).view(_BITS[t.element_size()])) & ((1 << width) - 1)


def mismatch_mask(got: torch.Tensor, want: torch.Tensor, tol: Tolerance) -> torch.Tensor:
    close = (got - want).abs() <= tol.atol + tol.rtol * want.abs()
    return ~close  # NaN compares False, so it is a mismatch


def _max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.numel() == 0:
        return 0.0
    return float((got - want).abs().nan_to_num(nan=float("inf")).max())


def compare_outputs(
    layout: RankLayout,
    data: ScenarioData,
    log_probs: Sequence[torch.Tensor | None],
    entropy: Sequence[torch.Tensor | None] | None,
    rank: int,
    device: torch.device | None = None,
    entropy_sign: int = 1,
    entropy_layout: RankLayout | None = None,
) -> tuple[list[Failure], dict[str, float]]:
    """Check the per-sample outputs: their structure first, then every value (the reference runs
    on ``device`` when given; its entropy times ``entropy_sign``, the target's definition). The
    entropy owes what ``entropy_layout`` says where it differs from the log-probs' ``layout``."""
    sc = layout.scenario
    failures: list[Failure] = []
    fields = {"log_probs": log_probs}
    if sc.with_entropy:
        fields["entropy"] = entropy
    owed = {"log_probs": layout, "entropy": entropy_layout or layout}
    structure_ok = True
    for name, outs in fields.items():
        problem = _structure_problem(name, outs, owed[name])
        if problem:
            sample, msg = problem
            failures.append(Failure(VALUE_MISMATCH, msg, [rank], field=name, sample=sample))
            structure_ok = False
    if not structure_ok:
        return failures, {}
    ref_lp, ref_ent = shard.share_truth(data, layout, device)
    if owed["entropy"] is not layout and "entropy" in fields:
        ref_ent = shard.share_truth(data, owed["entropy"], device)[1]
    ref_ent = ref_ent * entropy_sign
    tol = TOLERANCES[sc.dtype]["values"]
    errors = {}
    for name, want in (("log_probs", ref_lp), ("entropy", ref_ent)):
        if name not in fields:
            continue
        outs = fields[name]
        positions = shard.global_positions(owed[name])
        got = torch.cat([o.detach().reshape(-1).cpu().double() for o in outs]) if outs else want[:0]
        errors[name] = _max_error(got, want)
        bad = mismatch_mask(got, want, tol).nonzero().flatten().tolist()
        for k in bad[:MAX_LISTED]:
            sample, token = positions[k]
            g, w, gap = apart(got[k].item(), want[k].item(), outs[sample].dtype)
            failures.append(Failure(
                VALUE_MISMATCH, f"{name} sample {sample} token {token}: got {g}, want {w}{gap}",
                [rank], field=name, sample=sample, token=token, got=got[k].item(), want=want[k].item(),
            ))
        if len(bad) > MAX_LISTED:
            failures.append(Failure(VALUE_MISMATCH, f"{name}: {len(bad) - MAX_LISTED} more mismatched tokens",
                                    [rank], field=name, details={
                                        "count": len(bad),
                                        "tokens": [list(positions[k]) for k in bad[MAX_LISTED:MAX_MAPPED]]}))
    return failures, errors


def _structure_problem(
    name: str, outs: Sequence[torch.Tensor | None] | None, layout: RankLayout
) -> tuple[int | None, str] | None:
    n = len(layout.share)
    if outs is None:
        return None, f"{name} is None (expected a list of {n} tensors)"
    if len(outs) != n:
        return None, f"{name} has {len(outs)} entries for {n} samples"
    for i, (out, js) in enumerate(zip(outs, layout.share)):
        if out is None:
            return i, f"{name} of sample {i} is None (expected a tensor of {len(js)} elements)"
        if not isinstance(out, torch.Tensor):
            return i, f"{name} of sample {i} is a {type(out).__name__}, not a tensor"
        if out.numel() != len(js) or out.dim() != 1:
            return i, f"{name} of sample {i} has shape {tuple(out.shape)}, expected ({len(js)},)"
    return None


def compare_loss(
    layout: RankLayout, data: ScenarioData, loss: object, rank: int, device: torch.device | None = None,
    entropy_sign: int = 1, field: str = "loss",
) -> tuple[list[Failure], dict[str, float]]:
    """Check a target's own scalar loss on this rank against the loss of the truth on its share
    (``field``: "logged_loss" for a training step's logged value, the share the whole batch).

    The tolerance scales with the total weight, since the loss sums one term per token.
    """
    sc = layout.scenario
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        return [Failure(VALUE_MISMATCH, f"{field} is {shape}, expected a scalar tensor", [rank], field=field)], {}
    ref_lp, ref_ent = shard.share_truth(data, layout, device)
    w_lp = torch.cat([w for w, _ in shard.share_weights(data, layout)] or [torch.zeros(0)]).double()
    w_ent = torch.cat([w for _, w in shard.share_weights(data, layout)] or [torch.zeros(0)]).double()
    w_ent = w_ent * sc.entropy_coef * entropy_sign
    # A policy loss at ratio exp(logp - old) = 1 has the gradient of w_lp * logp but the value w_lp.
    lp_term = torch.ones_like(ref_lp) if data.loss in ("policy", "step") else ref_lp
    want = float((w_lp * lp_term).sum() - (w_ent * ref_ent).sum())
    got = float(loss.detach().double().cpu().reshape(()))
    tol = TOLERANCES[sc.dtype]["values"]
    scale = 1.0 + float(w_lp.abs().sum() + w_ent.abs().sum())
    error = abs(got - want)
    if not error <= tol.atol * scale + tol.rtol * abs(want):  # NaN fails
        g, w, gap = apart(got, want, loss.dtype)
        return [Failure(VALUE_MISMATCH, f"{field}: got {g}, want {w}{gap}", [rank], field=field,
                        got=got, want=want)], {field: error}
    return [], {field: error}


def compare_grad(
    layout: RankLayout, data: ScenarioData, grad: torch.Tensor, rank: int, device: torch.device | None = None,
    entropy_sign: int = 1, wanted: list[torch.Tensor] | None = None,
) -> tuple[list[Failure], dict[str, float]]:
    """Check d loss / d local logits against the reference gradient of the global loss (its
    entropy term as the target defines entropy: ``entropy_sign``); ``wanted`` gets the
    reference's chunks, in row order, where it is given."""
    sc = layout.scenario
    dtype = grad.dtype
    grad = grad.detach().reshape(layout.num_rows, -1).cpu().double()
    targets, w_lp, w_ent = shard.row_targets_and_weights(data, layout)
    rows = layout.row_positions()
    tol = TOLERANCES[sc.dtype]["grad"]
    a, _ = layout.columns
    listed, count, worst = [], 0, 0.0
    mapped: dict[tuple[int, int], None] = {}  # (sample, position) of every row with a mismatch, in order
    source = shard.PieceRows(data, layout.pieces)
    for start, want in loss_grad_chunks(
        source, targets, w_lp, w_ent * entropy_sign if sc.with_entropy else None, entropy_coef=sc.entropy_coef,
        temperature=sc.temperature, columns=slice(*layout.columns), device=device, keep=source.keep(),
    ):
        want = want.cpu()
        if wanted is not None:
            wanted.append(want)
        got = grad[start : start + want.size(0)]
        worst = max(worst, _max_error(got, want))
        bad = mismatch_mask(got, want, tol).nonzero().tolist()
        count += len(bad)
        for r, c in bad[: MAX_LISTED - len(listed)]:
            stream, pos = rows[start + r]
            listed.append(_grad_failure(layout, stream, pos, a + c, got[r, c].item(), want[r, c].item(), rank,
                                        dtype))
        for r, _ in bad:
            if len(mapped) < MAX_MAPPED and rows[start + r][0] < len(sc.samples):
                mapped.setdefault(rows[start + r], None)
    if count > len(listed):
        listed.append(Failure(GRAD_MISMATCH, f"grad: {count - len(listed)} more mismatched elements",
                              [rank], field="grad", details={"count": count, "rows": [list(k) for k in mapped]}))
    return listed, {"grad": worst}


def _grad_failure(layout: RankLayout, stream: int, pos: int, column: int, got: float, want: float,
                  rank: int, dtype: torch.dtype) -> Failure:
    samples = layout.scenario.samples
    token = layout.scored_token(stream, pos)
    if stream >= len(samples):
        where, sample, pos_out = f"tail padding row {pos}", None, pos
    elif token is not None:
        where, sample, pos_out = f"sample {stream} token {token}", stream, pos
    else:
        kind = "padding" if pos >= samples[stream].total else "unscored"
        where, sample, pos_out = f"sample {stream} {kind} row {pos}", stream, pos
    g, w, gap = apart(got, want, dtype)
    return Failure(
        GRAD_MISMATCH, f"grad {where} column {column}: got {g}, want {w}{gap}", [rank],
        field="grad", sample=sample, token=token, position=pos_out, column=column, got=got, want=want,
    )


class ReferenceComparison(Check):
    """Values (before the backward runs) and the logits' gradient against the float64
    reference, under the target's definitions: what it owes, its entropy's sign."""

    kind = VALUE_MISMATCH  # and GRAD_MISMATCH

    @classmethod
    def wanted(cls, checks: Checks) -> bool:
        return checks.reference

    def after_forward(self, life: Life) -> None:
        sign = life.definitions.entropy_sign
        life.add(compare_outputs(life.owed, life.data, life.outputs.log_probs, life.entropy, life.rank,
                                 life.reference_device, sign, life.owed_entropy))
        if life.form == "policy":
            life.add(compare_loss(life.owed, life.data, life.outputs.loss, life.rank, life.reference_device, sign))

    def after_backward(self, life: Life) -> None:
        life.add(compare_grad(life.layout, life.data, life.grad, life.rank, life.reference_device,
                              life.definitions.entropy_sign))

    def after_step(self, life: Life) -> None:
        wanted: list[torch.Tensor] = []
        failures, worst = compare_grad(life.layout, life.data, life.grad, life.rank, life.reference_device,
                                       life.definitions.entropy_sign, wanted)
        if failures:
            failures.insert(0, step_scale_failure(life, torch.cat(wanted)))
        life.add((failures, {"step_grad": worst["grad"]}))
        if life.logged_loss is not None:
            life.add(compare_loss(life.layout, life.data, life.logged_loss, life.rank,
                                  life.reference_device, life.definitions.entropy_sign, field="logged_loss"))


def step_scale_failure(life: Life, want: torch.Tensor) -> Failure:
    """What a training step's gradient is off by against the reference's ``want`` (its rows): one
    factor on every row, named by the step's sizes where it is one of them ("x 0.500 = 1 / cp"),
    or a factor per sample. A factor that explains the gradient but for a small rest (a bfloat16
    rounding beside a scale error) is still named, with the rest."""
    sc = life.scenario
    got = life.grad.detach().reshape(want.shape).cpu().double()
    tol = TOLERANCES[sc.dtype]["grad"]
    where = "the step's gradient (DDP's main_grad, what the optimizer sees)"
    objective = life.definitions.objective or "sample_mean"
    scale = scale_of(got, want)
    if scale is not None:
        factor, rest = scale
        clean = not bool(mismatch_mask(got, want * factor, tol).any())
        beyond = "" if clean else f", and beyond that its elements differ by up to {rest:.2%}"
        details = {"factor": factor, "rest": rest}
        if abs(factor - 1.0) <= SAME_SCALE:
            return Failure(GRAD_MISMATCH, f"{where} has the declared {objective}'s scale (x {factor:.3f} on every "
                           f"row){beyond}: not a normalisation", [life.rank], field="grad", details=details)
        named = factor_names(factor, life.step or {})
        return Failure(GRAD_MISMATCH, f"{where} is x {factor:.3f} the reference's on every row"
                       + (f" (= {named})" if named else "") + f"{beyond}: {objective} scaled wrong", [life.rank],
                       field="grad", details={**details, "named": named})
    per_sample, start = [], 0
    for p in life.layout.pieces:
        f = scale_of(got[start:start + p.rows], want[start:start + p.rows])
        per_sample.append("?" if f is None else f"{f[0]:.3f}")
        start += p.rows
    listed = ", ".join(f"sample {i} x {f}" for i, f in enumerate(per_sample[:MAX_LISTED]))
    more = f", +{len(per_sample) - MAX_LISTED} more" if len(per_sample) > MAX_LISTED else ""
    return Failure(GRAD_MISMATCH, f"{where} is off by no one factor: {listed}{more} (not the declared "
                   f"{objective})", [life.rank], field="grad", details={"sample_factors": per_sample})


SAME_SCALE = 1e-3  # a factor this close to 1 is no scale error
FACTOR_REST = 0.02  # a factor names a gradient whose rest is at most this fraction of it


def scale_of(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float] | None:
    """(r, rest): the least-squares factor with got ~ r * want and the largest element of the
    rest, |got - r * want|, as a fraction of the largest |r * want|; None where no factor leaves
    a rest of at most FACTOR_REST."""
    norm = float((want * want).sum())
    if norm == 0.0 or not bool(torch.isfinite(got).all()):
        return None
    r = float((got * want).sum()) / norm
    top = float((want * r).abs().max())
    if r == 0.0 or top == 0.0:
        return None
    rest = float((got - want * r).abs().max()) / top
    return (r, rest) if rest <= FACTOR_REST else None


def clean_factor(got: torch.Tensor, want: torch.Tensor, tol: Tolerance) -> float | None:
    """The one factor r with got = r * want within ``tol`` everywhere, or None."""
    scale = scale_of(got, want)
    if scale is None or bool(mismatch_mask(got, want * scale[0], tol).any()):
        return None
    return scale[0]


def factor_names(factor: float, sizes: dict[str, int]) -> str:
    """The step's sizes (or their reciprocals) equal to ``factor``, as "cp" or "1 / num_microbatches"."""
    candidates = {"cp": sizes.get("cp_size", 1), "dp": sizes.get("dp_size", 1), "tp": sizes.get("tp_size", 1),
                  "num_microbatches": sizes.get("micro_batches", 1)}
    if candidates["dp"] > 1 and candidates["cp"] > 1:  # DDP's average over the data-parallel and CP ranks
        candidates["dp x cp"] = candidates["dp"] * candidates["cp"]
    names = []
    for name, value in candidates.items():
        if value > 1 and abs(factor - value) <= 1e-3 * value:
            names.append(name)
        elif value > 1 and abs(factor - 1 / value) <= 1e-3 / value:
            names.append(f"1 / {name}")
    return " = ".join(names)
