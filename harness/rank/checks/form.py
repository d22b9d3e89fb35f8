"""Is what the target returned well formed? A ``RankOutputs`` whose tensors are floating point
no coarser than the logits, on the logits' device and attached to the autograd graph. Each
problem is named as the target's, with the line of its ``compute``, before any value is compared:
otherwise a detached output reads as "grad got 0" and a float16 one as a value mismatch.

A detached output is a problem of the graph, not of the values (they are compared on their own,
and the message says when they are right). The line that names it is where the tensor left the
graph, not the adapter's ``compute``: with ``explain`` (the scenario run again, as for an
``input_mutated`` write) a ``TorchFunctionMode`` follows, while ``compute`` runs, every tensor
that does not require grad back to the op that made it so: the first op whose inputs were attached
and whose output is not (``detach``, ``.data``, an op under ``torch.no_grad()``), or the op that
made it from no tensor of the graph (``torch.zeros``)."""

from __future__ import annotations

import contextlib
import inspect
import sys
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from shardcheck.harness.rank.plumbing import trace
from shardcheck.harness.rank.pipeline import Check, Life
from shardcheck.harness.wire import EXPLAIN, VALUE_MISMATCH, Failure, short_path


def compute_site(target: Any) -> str:
    """Where the target's ``compute`` is defined: ``path:line in compute``."""
    code = target.implementation()
    fn = type(code).compute
    try:
        fn = inspect.unwrap(fn)
        return f"{short_path(inspect.getsourcefile(fn) or '?')}:{inspect.getsourcelines(fn)[1]} in compute"
    except (TypeError, OSError):
        return f"{type(code).__module__}.{type(code).__name__}.compute"


def not_outputs(outputs: Any, site: str, rank: int) -> Failure | None:
    """A failure when ``compute`` returned something other than a RankOutputs."""
    from shardcheck.targets import RankOutputs

    if isinstance(outputs, RankOutputs):
        return None
    return Failure(VALUE_MISMATCH, f"the target's compute returned {_what(outputs)}, not RankOutputs ({site})",
                   [rank], field="outputs", details={"site": site})


def form_problems(outputs: Any, logits: torch.Tensor, with_entropy: bool, entropy_coef: float, policy: bool,
                  site: str, rank: int, cuts: GraphCuts | None = None) -> list[Failure]:
    """One failure per kind of problem and output field (the first sample that shows it). Only
    what the loss differentiates must be attached to the graph: the policy loss, or the log-probs
    and, when its coefficient is not 0, the entropy. ``cuts``: what followed ``compute`` (when
    explaining), to name where a detached output left the graph; without it the failure asks for
    a run that explains."""
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
                if kind in seen:
                    continue
                seen.add(kind)
                details: dict[str, Any] = {"site": site, "malformed": kind}
                message = f"{where} {problem} ({site})"
                if kind == "detached":
                    message, more = _detached(f"{where} {problem}", t, site, cuts)
                    details |= more
                failures.append(Failure(VALUE_MISMATCH, message, [rank], field=name,
                                        sample=None if name == "loss" else i, details=details))
    return failures


def _detached(said: str, t: torch.Tensor, site: str, cuts: GraphCuts | None) -> tuple[str, dict[str, Any]]:
    """A detached output's message, worded as the graph problem it is, and its details: where it
    left the graph when ``cuts`` followed compute, else a request to run again to find it."""
    said += f" ({GRAPH_PROBLEM})"
    if cuts is None:
        return f"{said}; {site}", {EXPLAIN: True}
    cut = cuts.cut_of(t)
    if cut is None:  # made before compute ran, by numpy, or by code torch does not see
        return (f"{said}: where it left the graph was not seen while compute ran (it was made before, or "
                f"outside torch); the target's {site}"), {}
    return f"{said}: {cut.describe()}", {"graph_site": list(cut.site), "graph_op": cut.op, "graph_why": cut.why}


GRAPH_PROBLEM = "a problem of the autograd graph, not of the values"
VALUES_RIGHT = "its values match the reference"


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


@dataclass(frozen=True)
class Cut:
    """Where a tensor that does not require grad got so: the op, why, and its call site (the
    innermost frames outside torch and the harness, the first as ``file:line in function``)."""

    op: str
    why: str  # "cut": its inputs were attached; "made": it was made from no tensor of the graph
    grad_mode: bool  # whether grad mode was on at the op
    site: tuple[str, ...]

    def describe(self) -> str:
        where = " <- ".join(self.site) if self.site else "a frame inside torch"
        if self.why == "made":
            return f"it was made from no tensor of the graph by {self.op} at {where}"
        how = self.op if self.grad_mode else f"{self.op} under torch.no_grad()"
        return f"it left the graph at {where} ({how})"


class GraphCuts(TorchFunctionMode):
    """While ``compute`` runs, remembers for each floating-point tensor that does not require
    grad where it got so (a :class:`Cut`), passed on to what is made from it. Above autograd,
    so an op's output already shows whether it requires grad; a Python call per op, which is why
    it runs only to explain a detached output."""

    def __init__(self) -> None:
        super().__init__()
        self._cuts: dict[int, tuple[weakref.ref, Cut]] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        made = [t for t in trace.tensors_in(out) if t.dtype.is_floating_point and not t.requires_grad]
        if not made:
            return out
        given = trace.tensors_in(list(args)) + trace.tensors_in(list(kwargs.values()))
        if any(t.requires_grad for t in given):
            cut = Cut(_op_name(func), "cut", torch.is_grad_enabled(), _site(sys._getframe(1)))
        else:  # what it was made from carries its cut on; from nothing of the graph, it starts here
            cut = next((c for c in map(self.cut_of, given) if c is not None), None)
            if cut is None:
                cut = Cut(_op_name(func), "made", torch.is_grad_enabled(), _site(sys._getframe(1)))
                # an in-place op on a tensor made before compute ran: where it was made is not known
                made = [t for t in made if not any(t is g for g in given)]
        for t in made:
            self._cuts[id(t)] = (weakref.ref(t, lambda ref, key=id(t): self._forget(key, ref)), cut)
        return out

    def _forget(self, key: int, ref: weakref.ref) -> None:
        """A tensor is freed: its entry goes, unless its id was given to a newer one meanwhile."""
        if self._cuts.get(key, (None,))[0] is ref:
            del self._cuts[key]

    def cut_of(self, t: torch.Tensor) -> Cut | None:
        """The tensor's cut, if it was made while the mode was on (ids are checked against the
        tensor itself: a freed tensor's id is given again)."""
        got = self._cuts.get(id(t))
        return got[1] if got is not None and got[0]() is t else None


def _op_name(func: Any) -> str:
    """How a torch function reads in a message: ``Tensor.detach``, ``Tensor.data``, ``torch.softmax``."""
    name = getattr(func, "__name__", str(func))
    if name == "__get__" and hasattr(func, "__self__"):  # a Tensor property, .data
        return f"Tensor.{getattr(func.__self__, '__name__', '?')}"
    module = getattr(func, "__module__", None)
    return f"Tensor.{name}" if module is None else f"{module}.{name}"


_INNER = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")  # frames of their own before Python 3.12


def _site(frame: Any) -> tuple[str, ...]:
    """The innermost frames outside torch and the harness (the code that ran the op), the first
    with the name of the function it is in (a comprehension's: the function around it)."""
    stack: list[str] = []
    for line in trace.call_stack(trace.STACK_SHOWN + 1, frame):
        if not stack or line != stack[-1]:  # a comprehension and the line around it: one frame
            stack.append(line)
    stack = stack[:trace.STACK_SHOWN]
    f = frame
    while stack and f is not None:  # the frame call_stack named first
        if f"{short_path(f.f_code.co_filename)}:{f.f_lineno}" == stack[0]:
            while f.f_code.co_name in _INNER and f.f_back is not None:
                f = f.f_back
            return (f"{stack[0]} in {f.f_code.co_name}", *stack[1:])
        f = f.f_back
    return tuple(stack)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _what(value: Any) -> str:
    return "None" if value is None else f"a {type(value).__name__}"


class OutputForm(Check):
    """What compute returned is a RankOutputs of well-formed tensors; else nothing is compared or
    differentiated past a problem that makes its values unreadable here."""

    kind = VALUE_MISMATCH
    cuts: GraphCuts | None = None
    detached: list[Failure] = []

    def after_forward(self, life: Life) -> None:
        site = compute_site(life.target)
        wrong = not_outputs(life.outputs, site, life.rank)
        if wrong is not None:  # nothing to compare or differentiate
            life.found.append(wrong)
            life.stop()
            return
        sc = life.scenario
        malformed = form_problems(life.outputs, life.inputs.logits, sc.with_entropy, sc.entropy_coef,
                                  life.form in ("policy", "step"), site, life.rank, self.cuts)
        life.found += malformed
        self.detached = [f for f in malformed if f.details["malformed"] == "detached"]
        if any(f.details["malformed"] == "device" for f in malformed):  # its values cannot be read here
            life.stop()

    def forward(self, life: Life) -> Any:
        self.cuts = GraphCuts() if life.checks.explain else None
        return self.cuts if self.cuts is not None else contextlib.nullcontext()

    def result(self, life: Life) -> None:
        # the values were compared (after this check's after_forward): a detached output whose
        # values are right says so, so that no one looks for a wrong value
        if not life.checks.reference:
            return
        for f in self.detached:
            wrong = [g for g in life.found if g.kind == VALUE_MISMATCH and g.field == f.field
                     and "malformed" not in g.details]
            if not wrong:
                f.message += f"; {VALUES_RIGHT}"
