"""Mutants of the builtin target: one small, named variation of the correct code per kind of bug
seen in the frameworks' public history, each run as ``builtin:NAME``. Each states the failure the harness must report
(kind and phase) on the ``regressions`` suite; tests hold the harness to it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from shardcheck.targets.base import RankInputs
from shardcheck.targets.builtin import BuiltinTarget
from shardcheck.targets.builtin_loss import LOSSES, describe_variants


class Mutant(BuiltinTarget):
    expected: tuple[str, str | None] = ("", None)  # (failure kind, phase) on its suite
    found_by = "run"  # the command that finds it: run, or invariance (it passes run)
    suite = "regressions"  # the suite that shows it


class EntropyNone(Mutant):
    """empty slice, None entropy: entropy None (not an empty tensor) for a sample with an empty all-gather slice;
    the redistribution crashes on those ranks while their peers wait in the all-reduce"""

    expected = ("rank_error", None)

    def extract(self, values: torch.Tensor, slices: list[Any], key: str) -> list[torch.Tensor | None]:
        out = super().extract(values, slices, key)
        return [None if key == "entropy" and v.numel() == 0 else v for v in out]


class SkipEmptyRank(Mutant):
    """a rank with only empty slices skips a collective: a rank whose every all-gather slice is empty skips the redistribution all-reduce
    (and returns zeros): the others hang in forward"""

    expected = ("collective_mismatch", "forward")

    def redistribute_allgather(self, values: list[torch.Tensor], inputs: RankInputs, n_rows: int) -> list:
        if all(v.numel() == 0 for v in values):
            return [torch.zeros(0, requires_grad=True) for _ in values]
        return super().redistribute_allgather(values, inputs, n_rows)


class GradPlaceholder(Mutant):
    """placeholders that require grad on some ranks only: zero placeholders for empty slices that require grad while the real (entropy_coef
    = 0, hence non-differentiable) entropy slices do not: the backward all-reduce runs on some
    ranks only, a hang in backward ("comm stuck in DSA")"""

    expected = ("collective_mismatch", "backward")

    def contribution(self, value: torch.Tensor, before: int, response: int) -> torch.Tensor:
        if value.numel() == 0:
            return torch.zeros(response, dtype=value.dtype, requires_grad=True)
        return super().contribution(value, before, response)


class EntropyNoGrad(Mutant):
    """entropy without its gradient: entropy computed without gradient even when entropy_coef != 0: silently wrong
    gradients, no hang"""

    expected = ("grad_mismatch", None)

    def entropy_grad_wanted(self, inputs: RankInputs) -> bool:
        return False


class EntropyGradInverted(Mutant):
    """entropy without its gradient: the entropy-gradient condition inverted (kept only when entropy_coef == 0)"""

    expected = ("grad_mismatch", None)

    def entropy_grad_wanted(self, inputs: RankInputs) -> bool:
        return inputs.with_entropy and inputs.entropy_coef == 0


class CallerDecidesGrad(Mutant):
    """the gradient decision at one call site: whether the entropy keeps its gradient is decided by one caller (the policy loss
    passes need_entropy_grad=True); every other caller gets the default, no gradient"""

    expected = ("grad_mismatch", None)

    def compute(self, inputs: RankInputs, need_entropy_grad: bool = False):  # type: ignore[override]
        self._need = need_entropy_grad
        return super().compute(inputs)

    def entropy_grad_wanted(self, inputs: RankInputs) -> bool:
        return inputs.with_entropy and self._need


class ChunkOffByOne(Mutant):
    """chunk off-by-one: chunked computation reads each later chunk's tokens one row early"""

    expected = ("value_mismatch", None)

    def chunk_targets(self, targets: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        stop = min(stop, targets.numel())
        return targets[start - 1 : stop - 1] if start > 0 else targets[start:stop]


class SampleBoundaryOffByOne(Mutant):
    """sample-boundary off-by-one: packed (thd/bshd) extraction one row late at every sample boundary"""

    expected = ("value_mismatch", None)

    def row_targets_and_slices(self, inputs: RankInputs, n_rows: int):  # type: ignore[override]
        targets, slices = super().row_targets_and_slices(inputs, n_rows)
        if inputs.cp_size == 1:
            slices = [slice(s.start + 1, s.stop + 1) for s in slices]
        return targets, slices


class SkipSameShapeAllGather(Mutant):
    """a TP rank skips the sum-of-exp all-gather; its next one (the entropy's) has the same
    shape, so gloo would silently mis-pair them: a wrong result, then a hang"""

    expected = ("collective_mismatch", "forward")

    def all_gather(self, tensor: torch.Tensor, group: Any, step: str) -> list[torch.Tensor]:
        if step == "sum_exp" and dist.get_rank(group) == 1:
            return [tensor] * dist.get_world_size(group)
        return super().all_gather(tensor, group, step)


class ReduceOpSwap(Mutant):
    """one TP rank reduces the row maximum with SUM instead of MAX (gloo does not notice)"""

    expected = ("collective_mismatch", "forward")

    def all_reduce(self, tensor: torch.Tensor, op: Any, group: Any, step: str) -> None:
        if step == "max" and dist.get_rank(group) == 1:
            op = dist.ReduceOp.SUM
        super().all_reduce(tensor, op, group, step)


class BackwardSkipZeroGrad(Mutant):
    """an 'optimisation' in backward only: a rank whose gradient for the redistributed responses
    is all zero (its zigzag share is empty) skips the backward all-reduce"""

    expected = ("collective_mismatch", "backward")

    def all_reduce(self, tensor: torch.Tensor, op: Any, group: Any, step: str) -> None:
        if step == "redistribute_grad" and not tensor.any():
            return
        super().all_reduce(tensor, op, group, step)


class UnpaddedChunkStart(Mutant):
    """a length-dependent off-by-one: in the path for samples that need no zigzag padding (total a
    multiple of 2 * cp) and have chunks of 3 rows or more, zigzag extraction drops the response's
    first token when the response starts exactly on the first row of a CP chunk other than the
    first (a '>' where '>=' belongs); no smoke scenario has such a sample, and random lengths of
    realistic size rarely make one (regressions holds one built for it)"""

    expected = ("value_mismatch", None)

    def row_targets_and_slices(self, inputs: RankInputs, n_rows: int):  # type: ignore[override]
        targets, slices = super().row_targets_and_slices(inputs, n_rows)
        if inputs.cp_size == 1 or inputs.allgather_cp:
            return targets, slices
        c, r = inputs.cp_size, inputs.cp_rank
        for i, (total, response) in enumerate(zip(inputs.total_lengths, inputs.response_lengths)):
            k = total // (2 * c)
            first_scored = total - response - 1
            if total % (2 * c) or k < 3 or first_scored == 0 or first_scored % k:
                continue
            # the dropped row leads this rank's share only when the chunk it opens is ours
            if first_scored // k in (r, 2 * c - 1 - r):
                slices[i] = slices[i][1:]
        return targets, slices


class InplaceTemperature(Mutant):
    """inputs changed in place: divides the logits it is given by the temperature in place
    (``logits.div_(t)``, as OpenRLHF's log_probs_from_logits does), then works at temperature 1;
    values and gradients stay right, the caller's logits do not"""

    expected = ("input_mutated", "forward")

    def compute(self, inputs: RankInputs):  # type: ignore[override]
        inputs.logits.div_(inputs.temperature)
        return super().compute(dataclasses.replace(inputs, temperature=1.0))


class _LossScaled(torch.autograd.Function):
    """Identity; its backward scales the incoming gradient in place (to keep a low-precision
    backward from underflowing) and unscales what it returns: right values, and the caller's
    gradient tensor left scaled."""

    SCALE = 1024.0

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad.mul_(_LossScaled.SCALE)
        return grad / _LossScaled.SCALE


class InplaceGradOutput(Mutant):
    """inputs changed in place in backward: each per-sample log-prob passes through a function
    whose backward scales the incoming gradient in place (``grad.mul_(scale)``) and unscales
    what it returns; values and gradients stay right, the gradient the caller fed does not"""

    expected = ("input_mutated", "backward")

    def compute(self, inputs: RankInputs):  # type: ignore[override]
        out = super().compute(inputs)
        out.log_probs = [_LossScaled.apply(lp) if lp.requires_grad else lp for lp in out.log_probs]
        return out


class PackingDependent(Mutant):
    """layout and batch invariance: a call holding one sample (nothing packed with it) shifts
    every row by the sample's largest logit (over all its response rows, all TP and CP ranks)
    instead of the row's own maximum; the same arithmetic up to rounding, so every value stays
    within the reference's tolerance, but a sample's bits change when it is packed with others"""

    expected = ("invariance_violation", None)  # on the packing axis only
    found_by = "invariance"

    def compute(self, inputs: RankInputs):  # type: ignore[override]
        self._shift = self._sample_max(inputs) if len(inputs.total_lengths) == 1 else None
        return super().compute(inputs)

    def _sample_max(self, inputs: RankInputs) -> torch.Tensor:
        rows = inputs.logits.detach().reshape(-1, inputs.logits.size(-1))
        _, slices = self.row_targets_and_slices(inputs, rows.size(0))
        scored = rows[slices[0]].float() / inputs.temperature
        top = scored.max() if scored.numel() else torch.tensor(float("-inf"), device=rows.device)
        top = top.reshape(1)
        self.all_reduce(top, dist.ReduceOp.MAX, inputs.tp_group, "sample_max")
        if inputs.cp_size > 1:
            self.all_reduce(top, dist.ReduceOp.MAX, inputs.cp_group, "sample_max")
        return top

    def normaliser(self, row_max: torch.Tensor) -> torch.Tensor:
        return row_max if self._shift is None else self._shift.expand_as(row_max)


class KeepWrongHalf(Mutant):
    """zigzag keep mask filled for the wrong half: the second zigzag half's rows take the keep
    sets of the first half's positions (replayed top-p sets on the wrong tokens)"""

    expected = ("value_mismatch", None)
    suite = "replay"

    def keep_rows(self, inputs: RankInputs, sample: int, local0: int, pos0: int, count: int,
                  half: int | None = None) -> None:
        if half == 0:
            self._first_half = pos0
        elif half == 1:
            pos0 = getattr(self, "_first_half", pos0)
        super().keep_rows(inputs, sample, local0, pos0, count, half)


class KeepIdsUnshifted(Mutant):
    """keep-set ids not shifted by the TP shard's vocabulary start: every TP rank masks columns
    as if it held the vocabulary from 0"""

    expected = ("value_mismatch", None)
    suite = "replay"

    def keep_columns(self, ids: tuple[int, ...], vocab_start: int, v_local: int) -> list[int]:
        return [v for v in ids if 0 <= v < v_local]


class UlyssesSliceOffByOne(Mutant):
    """Ulysses SP slice off by one: each SP rank past the first takes its slice of the rolled
    tokens one row late, so its rows score the token after the one they predict"""

    expected = ("value_mismatch", None)
    suite = "sequence_parallel"

    def ulysses_labels(self, rolled: torch.Tensor, sp_rank: int, n_rows: int) -> torch.Tensor:
        start = sp_rank * n_rows + (1 if sp_rank else 0)
        return rolled[start:start + n_rows]


class UlyssesPaddingKept(Mutant):
    """Ulysses padding not removed before the gather: every SP rank sends its padding rows too, so
    the gathered stream runs past the packed sequence and every response, counted from the
    stream's end, is shifted by the padding"""

    expected = ("value_mismatch", None)
    suite = "sequence_parallel"

    def ulysses_real_rows(self, packed: int, sp_rank: int, n_rows: int) -> int:
        return n_rows


class UlyssesSkipPaddingRank(Mutant):
    """Ulysses all-to-all skipped on a rank with only padding: an SP rank none of whose rows is a
    real token returns empty outputs without joining the gather; its peers wait in the all-to-all"""

    expected = ("collective_mismatch", "forward")
    suite = "sequence_parallel"

    def ulysses_gather(self, value: torch.Tensor, inputs: RankInputs, counts: list[int]) -> torch.Tensor:
        if counts[inputs.sp_rank] == 0:
            return value[:0]
        return super().ulysses_gather(value, inputs, counts)


MUTANTS: dict[str, type[Mutant]] = {
    "entropy_none": EntropyNone,
    "skip_empty_rank": SkipEmptyRank,
    "grad_placeholder": GradPlaceholder,
    "entropy_no_grad": EntropyNoGrad,
    "entropy_grad_inverted": EntropyGradInverted,
    "caller_decides_grad": CallerDecidesGrad,
    "chunk_off_by_one": ChunkOffByOne,
    "sample_boundary_off_by_one": SampleBoundaryOffByOne,
    "skip_same_shape_allgather": SkipSameShapeAllGather,
    "reduce_op_swap": ReduceOpSwap,
    "backward_skip_zero_grad": BackwardSkipZeroGrad,
    "unpadded_chunk_start": UnpaddedChunkStart,
    "inplace_temperature": InplaceTemperature,
    "inplace_grad_output": InplaceGradOutput,
    "packing_dependent": PackingDependent,
    "keep_wrong_half": KeepWrongHalf,
    "keep_ids_unshifted": KeepIdsUnshifted,
    "ulysses_slice_off_by_one": UlyssesSliceOffByOne,
    "ulysses_padding_kept": UlyssesPaddingKept,
    "ulysses_skip_padding_rank": UlyssesSkipPaddingRank,
}


TRACED = "traced"
# builtin:traced with a bug planted in what its data path hands the model (targets/own_layout.py)
TRACED_BUGS = {
    "traced_zero_length_sequence": "builtin:traced, its cu_seqlens ending with a sequence of zero length",
    "traced_positions_not_zigzag": "builtin:traced, its position ids counting each sample's local rows from 0, "
                                   "not the zigzag chunks' positions",
}


def builtin(variant: str | None = None) -> BuiltinTarget:
    """shardcheck's own production-style implementation (all layouts, entropy, fp32/bf16/fp16)"""
    if variant is None:
        return BuiltinTarget()
    if variant == TRACED or variant in TRACED_BUGS:
        from shardcheck.targets.own_layout import DATA_PATHS, traced

        target = traced(BuiltinTarget(), DATA_PATHS[variant])
        target.name = f"builtin:{variant}"
        return target
    if variant in LOSSES:  # the training step's loss and its planted bugs (targets/builtin_loss.py)
        loss = LOSSES[variant]()
        loss.name = f"builtin:{variant}"
        return loss
    if variant not in MUTANTS:
        raise ValueError(f"builtin has no variant {variant!r}")
    target = MUTANTS[variant]()
    target.name = f"builtin:{variant}"
    return target


builtin.variants = {name: " ".join((cls.__doc__ or "").split()) for name, cls in MUTANTS.items()} | describe_variants() | {  # type: ignore[attr-defined]
    TRACED: "builtin, its rows laid out by shardcheck's own layout run as a framework's data path and learned "
            "through the position trace (proves the trace: must pass wherever builtin does)"} | TRACED_BUGS  # type: ignore[attr-defined]
