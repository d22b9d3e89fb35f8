"""Is what the target returned well formed? A ``RankOutputs`` whose tensors are floating point
no coarser than the logits, on the logits' device and attached to the autograd graph. Each
problem is named as the target's, with the line of its ``compute``, before any value is compared:
otherwise a detached output reads as "grad got 0" and a float16 one as a value mismatch."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from shardcheck.harness.rank.pipeline import Check, Life
from shardcheck.harness.wire import VALUE_MISMATCH, Failure, short_path


def compute_site(target: Any) -> str:
    """Where the target's ``compute`` is defined: ``path:line in compute``."""
    fn = getattr(type(target), "compute", None) or getattr(target, "compute", None)
    try:
        fn = inspect.unwrap(fn)
        return f"{short_path(inspect.getsourcefile(fn) or '?')}:{inspect.getsourcelines(fn)[1]} in compute"
    except (TypeError, OSError):
        return f"{type(target).__module__}.{type(target).__name__}.compute"


def not_outputs(outputs: Any, site: str, rank: int) -> Failure | None:
    """A failure when ``compute`` returned something other than a RankOutputs."""
    from shardcheck.targets import RankOutputs

    if isinstance(outputs, RankOutputs):
        return None
    return Failure(VALUE_MISMATCH, f"the target's compute returned {_what(outputs)}, not RankOutputs ({site})",
                   [rank], field="outputs", details={"site": site})


def form_problems(outputs: Any, logits: torch.Tensor, with_entropy: bool, entropy_coef: float, policy: bool,
                  site: str, rank: int) -> list[Failure]:
    """One failure per kind of problem and output field (the first sample that shows it). Only
    what the loss differentiates must be attached to the graph: the policy loss, or the log-probs
    and, when its coefficient is not 0, the entropy."""
    fields: dict[str, list[Any]] = {"log_probs": list(outputs.log_probs or [])}
    if with_entropy:
        fields["entropy"] = list(outputs.entropy or [])
    if policy and outputs.loss is not None:
        fields["loss"] = [outputs.loss]
    differentiated = {"loss"} if policy else {"log_probs"} | ({"entropy"} if entropy_coef else set())
    failures = []
    for name, values in fields.items():
        seen: set[str] = set()
        for i, t in enumerate(values):
            if not isinstance(t, torch.Tensor):
                continue  # None or not a tensor: the structure check names it
            where = name if name == "loss" else f"{name} of sample {i}"
            for kind, problem in _problems(t, logits, name in differentiated):
                if kind not in seen:
                    seen.add(kind)
                    failures.append(Failure(VALUE_MISMATCH, f"{where} {problem} ({site})", [rank], field=name,
                                            sample=None if name == "loss" else i,
                                            details={"site": site, "malformed": kind}))
    return failures


def _problems(t: torch.Tensor, logits: torch.Tensor, differentiated: bool) -> list[tuple[str, str]]:
    out = []
    if not t.dtype.is_floating_point:
        out.append(("dtype", f"is {_dtype(t.dtype)}, not floating point (the logits are {_dtype(logits.dtype)})"))
    elif torch.finfo(t.dtype).eps > torch.finfo(logits.dtype).eps:
        out.append(("dtype", f"is {_dtype(t.dtype)}, coarser than the logits' {_dtype(logits.dtype)}: "
                             "precision is lost"))
    if t.device != logits.device:
        out.append(("device", f"is on {t.device}, the logits on {logits.device}"))
    # an empty share (a rank with no response tokens) has nothing to carry a gradient
    if differentiated and t.numel() and logits.requires_grad and torch.is_grad_enabled() and not t.requires_grad:
        out.append(("detached", "does not require grad: it is detached from the logits, so no gradient "
                                "flows back through it"))
    return out


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _what(value: Any) -> str:
    return "None" if value is None else f"a {type(value).__name__}"


class OutputForm(Check):
    """What compute returned is a RankOutputs of well-formed tensors; else nothing is compared or
    differentiated past a problem that makes its values unreadable here."""

    kind = VALUE_MISMATCH

    def after_forward(self, life: Life) -> None:
        site = compute_site(life.target)
        wrong = not_outputs(life.outputs, site, life.rank)
        if wrong is not None:  # nothing to compare or differentiate
            life.found.append(wrong)
            life.stop()
            return
        sc = life.scenario
        malformed = form_problems(life.outputs, life.inputs.logits, sc.with_entropy, sc.entropy_coef,
                                  life.form == "policy", site, life.rank)
        life.found += malformed
        if any(f.details["malformed"] == "device" for f in malformed):  # its values cannot be read here
            life.stop()
