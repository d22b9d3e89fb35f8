"""The inputs a target is given stay as they were: the rank side of the ``input_mutated`` check.

Before ``compute`` the rank registers every tensor it hands the target (the logits, each
sample's tokens, the policy batch) with what proves it unchanged; the gradients it feeds into
the target's outputs for the backward are registered before the backward. After the forward and
again after the backward each is compared with its original, bit for bit.

Which in-place write changed a tensor is found with torch's own machinery: a
``TorchDispatchMode`` active while the target runs (forward and backward) sees every op whose
schema writes into an argument (``x.sub_``, ``exp(out=x)``, a collective's in-place output) and,
for one that writes into a registered tensor's storage, compares the tensor's bits before and
after it: the first write that changed them is named, with the Python call site outside torch and
the harness, and the writes before it that changed nothing are counted (a ``div_`` by a
temperature of 1.0 is not what changed the logits). It costs a Python call per op (about 1.3x on the smoke suite, see
``benchmarks/inplace_overhead.py``), so it runs only to explain a change already found: the
controller runs such a scenario again with ``explain`` (see ``runner.run``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardcheck.harness.rank.plumbing import trace
from shardcheck.harness.rank.checks.compare import apart
from shardcheck.harness.rank.pipeline import Check, Life
from shardcheck.harness.wire import EXPLAIN, INPUT_MUTATED, Checks, Failure

# A changed element's place, in global terms: the Failure fields it fills in (sample, token,
# position, column) and the words that name it.
Locate = Callable[[int], tuple[dict[str, int | None], str]]


@dataclass
class Write:
    """An in-place write into a watched tensor: the op, the phase, the call site."""

    op: str
    phase: str
    site: list[str]

    def describe(self) -> str:
        where = self.site[0] if self.site else "a frame inside torch"
        return f"{self.op} at {where} in {self.phase}"


MAX_NAMED_UNCHANGED = 2  # writes that changed nothing, named before the one that changed the tensor


@dataclass
class Writes:
    """What the write watch saw of one watched tensor: the first in-place write that changed its
    bits, and the writes before it that left them as they were."""

    changed_by: Write | None = None
    unchanged: list[Write] = field(default_factory=list)  # the first MAX_NAMED_UNCHANGED
    unchanged_count: int = 0

    def describe(self) -> str:
        """The part of the message that names the writes."""
        parts = []
        if self.changed_by is not None:
            parts.append(f"first in-place write that changed it: {self.changed_by.describe()}")
        else:  # changed by something the watch does not see (a raw pointer, another process)
            parts.append("no in-place write that the watch saw changed it")
        n = self.unchanged_count
        if n:
            named = ", ".join(w.describe() for w in self.unchanged)
            more = f" and {n - len(self.unchanged)} more" if n > len(self.unchanged) else ""
            before = "earlier " if self.changed_by is not None else ""
            parts.append(f"{n} {before}in-place write{'s' if n > 1 else ''} left it unchanged: {named}{more}")
        return "; ".join(parts)

    def to_details(self) -> dict[str, Any]:
        details: dict[str, Any] = {"unchanged_writes": self.unchanged_count,
                                   "unchanged": [w.describe() for w in self.unchanged]}
        if self.changed_by is not None:
            w = self.changed_by
            details |= {"op": w.op, "site": w.site, "write_phase": w.phase}
        return details


@dataclass
class _Watched:
    name: str
    given: torch.Tensor
    original: torch.Tensor
    locate: Locate
    found_in: str | None = None  # the phase a change was first seen after


@dataclass
class InputGuard:
    """What a rank handed a target, kept to prove it unchanged."""

    rank: int
    watched: list[_Watched] = field(default_factory=list)
    writes: dict[int, Writes] = field(default_factory=dict)  # id(watched entry) -> what the watch saw
    watching: bool = False  # whether the write watch ran (it ran for the whole of a phase or not at all)

    def watch(self, name: str, given: Any, original: torch.Tensor | None, locate: Locate) -> None:
        """Watch ``given`` (a tensor the target receives); ``original`` holds its values as they
        must stay (None: a copy is taken now). Empty and non-tensor inputs cannot change."""
        if not isinstance(given, torch.Tensor) or given.numel() == 0:
            return
        kept = given.detach().clone() if original is None else original.detach()
        self.watched.append(_Watched(name, given, kept, locate))

    def writes_watch(self, explain: bool = True) -> Any:
        """The dispatch mode to run the target under (forward and backward) when a change is
        to be explained; otherwise (or when nothing is watched) nothing, which costs nothing."""
        return _WriteWatch(self) if explain and self.watched else contextlib.nullcontext()

    def check(self, phase: str) -> list[Failure]:
        """Compare every watched tensor with its original after ``phase``; a tensor is reported
        once, in the first phase after which it differs."""
        failures = []
        for w in self.watched:
            if w.found_in is not None:
                continue
            changed = _changed(w.given.detach(), w.original)
            if changed is None:
                continue
            w.found_in = phase
            failures.append(self._failure(w, changed, phase))
        return failures

    def _failure(self, w: _Watched, changed: torch.Tensor, phase: str) -> Failure:
        first = int(changed[0])
        where, words = w.locate(first)
        given, original = w.given.detach().reshape(-1), w.original.reshape(-1)
        now, was = given[first], original[first]
        if now.dtype == was.dtype:
            shown_was, shown_now, gap = apart(was, now, was.dtype)
        else:  # the tensor itself was replaced by one of another dtype
            shown_was, shown_now, gap = f"{was.item()} ({_name(was.dtype)})", f"{now.item()} ({_name(now.dtype)})", ""
        message = (f"{w.name} changed in {phase}: {changed.numel()} of {given.numel()} elements, first at "
                   f"{words} (was {shown_was}, now {shown_now}{gap})")
        details: dict[str, Any] = {"changed": changed.numel(), "elements": given.numel()}
        if self.watching:
            seen = self.writes.get(id(w), Writes())
            message += f"; {seen.describe()}"
            details |= seen.to_details()
        else:
            details[EXPLAIN] = True  # the write watch, on a run again, names its call site
        return Failure(INPUT_MUTATED, message, [self.rank], field=w.name, phase=phase, got=float(now.item()),
                       want=float(was.item()), details=details, **where)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _changed(given: torch.Tensor, original: torch.Tensor) -> torch.Tensor | None:
    """Flat indices of the elements that differ (NaN equals NaN; -0.0 differs from 0.0)."""
    if given.shape != original.shape or given.dtype != original.dtype:
        return torch.arange(original.numel())
    a, b = given.reshape(-1), original.reshape(-1)
    if a.is_floating_point():
        # bit for bit: compare the integer views, so a sign flip of zero or a new NaN payload counts
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.contiguous().view(bits), b.contiguous().view(bits)
    diff = (a != b).nonzero().flatten()
    return diff.cpu() if diff.numel() else None


_WRITTEN: dict[Any, tuple[tuple[int, str], ...]] = {}


def _written_arguments(func: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments an op's schema writes into (``Tensor(a!)``), cached."""
    got = _WRITTEN.get(func)
    if got is None:
        got = tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                    if a.alias_info is not None and a.alias_info.is_write)
        _WRITTEN[func] = got
    return got


class _WriteWatch(TorchDispatchMode):
    """Finds, for each watched tensor, the first op that writes into its storage and changes its
    bits: the tensor is copied before each such write and compared after it, until one changed
    it (a copy per write into a watched tensor, only while explaining)."""

    def __init__(self, guard: InputGuard) -> None:
        super().__init__()
        self.guard = guard
        self.storages: dict[int, list[_Watched]] = {}

    def __enter__(self) -> _WriteWatch:
        # the storages are read on entry: the backward's gradients are registered before it
        self.storages = {}
        self.guard.watching = True
        for w in self.guard.watched:
            if w.found_in is None:  # a tensor already reported is not followed further
                self.storages.setdefault(w.given.untyped_storage().data_ptr(), []).append(w)
        return super().__enter__()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        hit = self._written(func, args, kwargs) if self.storages else []
        if not hit:
            return func(*args, **kwargs)
        # an in-place collective's output lands when its work is waited on, not when the op
        # returns: its effect cannot be seen here, so it counts as a change
        later = getattr(func, "namespace", "") == "c10d"
        before = [None if later else w.given.detach().clone() for w in hit]
        out = func(*args, **kwargs)
        phase = "backward" if torch._C._current_autograd_node() is not None else "forward"
        write = Write(str(func), phase, trace.call_stack(trace.STACK_SHOWN, sys._getframe(1)))
        for w, kept in zip(hit, before):
            seen = self.guard.writes.setdefault(id(w), Writes())
            if kept is None or _changed(w.given.detach(), kept) is not None:
                seen.changed_by = write
            else:
                seen.unchanged_count += 1
                if len(seen.unchanged) < MAX_NAMED_UNCHANGED:
                    seen.unchanged.append(write)
        return out

    def _written(self, func: Any, args: tuple, kwargs: dict) -> list[_Watched]:
        """The watched tensors whose storage this op writes into and whose change is not yet
        explained, each once."""
        hit: dict[int, _Watched] = {}
        for pos, name in _written_arguments(func):
            value = args[pos] if pos < len(args) else kwargs.get(name)
            for t in trace.tensors_in(value):
                if t.numel():
                    for w in self.storages.get(t.untyped_storage().data_ptr(), ()):
                        seen = self.guard.writes.get(id(w))
                        if seen is None or seen.changed_by is None:
                            hit.setdefault(id(w), w)
        return list(hit.values())


def guard_inputs(rank: int, layout: Any, data: Any, inputs: Any, leaf: torch.Tensor) -> InputGuard:
    """Watch every tensor of a rank's ``RankInputs``. The logits are kept as the harness's leaf
    (the target is given a copy of it), the tokens as the scenario data regenerates them."""
    guard = InputGuard(rank)
    guard.watch("logits", inputs.logits, leaf, _logits_locator(layout, inputs.logits.size(-1)))
    for i, tokens in enumerate(inputs.tokens):
        guard.watch("tokens", tokens, data.tokens(i), _sample_locator(i, "position"))
    if inputs.policy is not None:
        p = inputs.policy
        for i in range(len(layout.share)):
            guard.watch("advantages", p.advantages[i], None, _share_locator(layout, i))
            guard.watch("old_log_probs", p.old_log_probs[i], None, _share_locator(layout, i))
            guard.watch("loss_masks", p.loss_masks[i], None, _sample_locator(i, "token"))
    return guard


def guard_gradients(guard: InputGuard, layout: Any, fed: list[Any], entropy_layout: Any = None) -> None:
    """Watch the gradients the harness feeds into the target's outputs (see harness/loss.py); the
    entropy's elements are ``entropy_layout``'s tokens where it owes other tokens."""
    for f in fed:
        owed = entropy_layout if f.field == "entropy" and entropy_layout is not None else layout
        locate = (_share_locator(owed, f.sample) if f.sample is not None
                  else lambda k: ({}, "the scalar"))
        guard.watch(f"grad of {f.field}", f.grad, None, locate)


def _logits_locator(layout: Any, width: int) -> Locate:
    def locate(k: int) -> tuple[dict[str, int | None], str]:
        row, col = divmod(k, width)
        stream, pos = layout.row_positions()[row]
        column = layout.columns[0] + col
        if stream >= len(layout.scenario.samples):
            return {"position": pos, "column": column}, f"tail padding row {pos} column {column}"
        token = layout.scored_token(stream, pos)
        scored = f" (scores response token {token})" if token is not None else ""
        return ({"sample": stream, "position": pos, "token": token, "column": column},
                f"sample {stream} position {pos}{scored} column {column}")

    return locate


def _sample_locator(sample: int, unit: str) -> Locate:
    return lambda k: ({"sample": sample, unit: k}, f"sample {sample} {unit} {k}")


def _share_locator(layout: Any, sample: int) -> Locate:
    """Element k of a per-sample share tensor (the rank's response tokens, in output order)."""
    def locate(k: int) -> tuple[dict[str, int | None], str]:
        token = layout.share[sample][k]
        return {"sample": sample, "token": token}, f"sample {sample} response token {token}"

    return locate


class InputsUnchanged(Check):
    """``input_mutated``: every tensor handed to the target (and every gradient fed into its
    outputs) is the same after the forward and after the backward; with ``explain`` the first
    in-place write into one is found as it happens."""

    kind = INPUT_MUTATED

    @classmethod
    def wanted(cls, checks: Checks) -> bool:
        return checks.inplace

    def inputs_made(self, life: Life) -> None:
        self.guard = guard_inputs(life.rank, life.layout, life.data, life.inputs, life.leaf)

    def forward(self, life: Life) -> Any:
        return self.guard.writes_watch(life.checks.explain)

    def after_forward(self, life: Life) -> None:
        life.found += self.guard.check("forward")

    def before_backward(self, life: Life) -> None:
        guard_gradients(self.guard, life.owed, life.fed, life.owed_entropy)

    def backward(self, life: Life) -> Any:
        return self.guard.writes_watch(life.checks.explain)

    def after_backward(self, life: Life) -> None:
        life.found += self.guard.check("backward")
