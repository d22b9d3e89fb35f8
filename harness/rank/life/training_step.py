"""The training step around a target whose loss is a training step's (``loss_form = "step"``).

The scenario's samples are the global batch. This rank's data-parallel replica takes its share
and splits it into micro-batches (:mod:`shardcheck.scenarios.batch`); megatron-core's own schedule
(``forward_backward_no_pipelining``) runs them through a stand-in model wrapped in megatron-core's
``DistributedDataParallel``, and ``finalize_model_grads`` reduces the gradient over the real
data-parallel x CP group, as in training.

The stand-in model (:class:`LogitsTable`) has one parameter: the logits of every (sample,
position) of the global batch, this rank's vocabulary columns. A micro-batch's logits are its
rows, laid out as the layout puts them (padding rows are constants). What DDP leaves in the
parameter's ``main_grad`` is then exactly what the optimizer would receive for each row, and it
is compared with the float64 gradient of the objective the target declares, over the whole
global batch (:class:`~shardcheck.harness.rank.checks.compare.ReferenceComparison`'s ``after_step``).

Each micro-batch is a life of its own up to ``after_forward`` (its inputs made, the target
called inside megatron's loss function, its values compared); megatron's schedule then runs the
backward. The step as a whole is one life more, at ``after_step``.

On a CPU world two calls of megatron-core assume CUDA; each is answered with the CPU and said in
the report: ``torch.cuda.current_device()`` while DDP allocates its gradient buffer, and the
schedule's ``torch.zeros(..., device="cuda")`` token counter.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from shardcheck.harness.rank.checks.compare import same_bits
from shardcheck.scenarios.layout import Piece, RankLayout

SCHEDULE = "megatron.core.pipeline_parallel.schedules.forward_backward_no_pipelining"
REDUCTION = "megatron.core.distributed.DistributedDataParallel, finalize_model_grads"
CPU_DEVICE_SHIM = ("torch.cuda.current_device() answered 'cpu' while megatron-core's DistributedDataParallel "
                   "allocated its gradient buffer (a CPU world)")
CPU_COUNTER_SHIM = ("torch.zeros(device='cuda') placed on the CPU in megatron-core's schedule module (its "
                    "total_num_tokens counter; a CPU world)")


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch on this rank: its samples (global indices), everything its life needs, and
    where its local rows are in the stand-in model's table (built once for every run of the step)."""

    index: int
    samples: tuple[int, ...]
    scenario: Any
    data: Any
    layout: RankLayout
    rollout: Any
    table_rows: torch.Tensor  # per local row, its table row (0 for padding)
    real: torch.Tensor  # per local row, whether it is a real position (else padding: a constant)
    padding: torch.Tensor  # the local rows' generated logits, this rank's columns; padding rows read from it


def micro_batch(index: int, samples: tuple[int, ...], scenario: Any, data: Any, layout: RankLayout, rollout: Any,
                offsets: list[int]) -> MicroBatch:
    """A micro-batch and its rows in the table whose sample ``i`` starts at row ``offsets[i]``."""
    from shardcheck.harness.rank.life import shard

    rows, real = [], []
    for p in layout.pieces:
        held = p.stream < len(samples)
        total = scenario.samples[p.stream].total if held else 0
        base = offsets[samples[p.stream]] if held else 0
        for pos in range(p.start, p.stop):
            rows.append(base + pos if pos < total else 0)
            real.append(pos < total)
    padding = shard.local_logits(data, layout).reshape(layout.num_rows, -1)
    return MicroBatch(index, samples, scenario, data, layout, rollout, torch.tensor(rows, dtype=torch.int64),
                      torch.tensor(real, dtype=torch.bool).unsqueeze(1), padding)


def row_offsets(scenario: Any) -> list[int]:
    """The first table row of each sample, and the table's row count last."""
    out = [0]
    for s in scenario.samples:
        out.append(out[-1] + s.total)
    return out


class LogitsTable(torch.nn.Module):
    """The stand-in model: one parameter holding the logits of every (sample, position) of the
    global batch, this rank's vocabulary columns; forward lays a micro-batch's rows out.

    ``poison``: the rows that hold NaN instead (a bool per table row), and NaN for the padding
    rows too (the mask-leak run)."""

    def __init__(self, data: Any, columns: tuple[int, int], device: Any, poison: torch.Tensor | None = None) -> None:
        from megatron.core.enums import ModelType

        super().__init__()
        self.model_type = ModelType.encoder_or_decoder  # what megatron's schedule asks of a model
        a, b = columns
        rows = torch.cat([data.logit_rows(i, 0, s.total)[:, a:b] for i, s in enumerate(data.scenario.samples)])
        if poison is not None:
            rows = rows.masked_fill(poison.unsqueeze(1), float("nan"))
        self.table = torch.nn.Parameter(rows.to(device))
        self.poisoned = poison is not None
        self.cp_group: Any = None

    def set_input_tensor(self, tensor: Any) -> None:
        """No pipeline stages: nothing comes from a previous one."""

    def forward(self, mb: MicroBatch) -> torch.Tensor:
        from shardcheck.harness.rank.life.model_stand_in import ModelCpCollective

        device = self.table.device
        padding = mb.padding.to(device)
        if self.poisoned:
            padding = torch.full_like(padding, float("nan"))
        rows = self.table.index_select(0, mb.table_rows.to(device))
        logits = torch.where(mb.real.to(device), rows, padding).reshape(mb.layout.shape)
        if mb.scenario.cp > 1:  # the model's CP collective in backward (model_stand_in)
            logits = ModelCpCollective.apply(logits, self.cp_group)
        return logits


class _TorchWithCpuCounters:
    """torch, as megatron-core's schedule module sees it on a CPU world: its
    ``torch.zeros(..., device="cuda")`` token counter is made on the CPU; all else is torch's."""

    def __init__(self, notes: list[str]) -> None:
        self._notes = notes

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def zeros(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
            if CPU_COUNTER_SHIM not in self._notes:
                self._notes.append(CPU_COUNTER_SHIM)
        return torch.zeros(*args, **kwargs)


@contextlib.contextmanager
def _schedule_counter_on_cpu(notes: list[str]) -> Iterator[None]:
    """The shim in megatron-core's schedule module only (the code under test sees torch as it is)."""
    if torch.cuda.is_available():
        yield
        return
    from megatron.core.pipeline_parallel import schedules

    saved = schedules.torch
    schedules.torch = _TorchWithCpuCounters(notes)  # type: ignore[assignment]
    try:
        yield
    finally:
        schedules.torch = saved


@contextlib.contextmanager
def _current_device_on_cpu(notes: list[str]) -> Iterator[None]:
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    if CPU_DEVICE_SHIM not in notes:
        notes.append(CPU_DEVICE_SHIM)
    try:
        yield
    finally:
        torch.cuda.current_device = saved  # type: ignore[assignment]


def table_layout(scenario: Any, tp_rank: int, columns: tuple[int, int]) -> RankLayout:
    """The table's rows as a layout: every position of every sample, in order, owing every
    response token (what the step's gradient is compared over)."""
    pieces = tuple(Piece(i, 0, s.total) for i, s in enumerate(scenario.samples))
    rows = sum(s.total for s in scenario.samples)
    share = tuple(tuple(range(s.response)) for s in scenario.samples)
    return RankLayout(scenario, tp_rank, 0, pieces, (1, rows, columns[1] - columns[0]), columns, share)


@dataclasses.dataclass
class Step:
    """What one training step of a scenario needs on this rank, built once for every run of it."""

    runner: Any
    scenario: Any
    target: Any
    frame: Any
    defined: Any
    data: Any  # the global batch's ScenarioData ("step": the objective's weights)
    micro: list[MicroBatch]
    columns: tuple[int, int]
    dp_size: int
    dp_rank: int
    global_batch: int
    notes: list[str]
    offsets: list[int]  # row_offsets of the global batch: where each sample's rows start in the table

    @functools.cached_property
    def replica_samples(self) -> tuple[int, ...]:
        """The global indices of every sample of this replica's micro-batches, in order."""
        return tuple(i for mb in self.micro for i in mb.samples)

    @functools.cached_property
    def loss_masks(self) -> tuple[torch.Tensor, ...]:
        """Per sample of the scenario, its whole response's loss mask (the copies share them)."""
        return tuple(self.data.loss_mask(i) for i in range(len(self.scenario.samples)))

    @functools.cached_property
    def advantages(self) -> tuple[torch.Tensor, ...]:
        """Per sample of the scenario, its whole response's advantages."""
        return tuple(self.data.advantages(i) for i in range(len(self.scenario.samples)))

    @functools.cached_property
    def masked(self) -> torch.Tensor:
        """Per table row, whether it is masked (masked_rows of the global batch), computed once."""
        return masked_rows(self.data)


@dataclasses.dataclass
class Ran:
    """What one run of the step left: per micro-batch its outputs and loss, and the gradient."""

    outputs: list[Any]
    losses: list[Any]
    grad: torch.Tensor
    reported: list[Any] = dataclasses.field(default_factory=list)  # megatron-core's forward_data_store


POISONABLE = ("logits", "advantages", "old_log_probs")


def run_step(runner: Any, sc: Any, target: Any, frame: Any, pipeline: Any) -> dict[str, Any]:
    """The training step of ``sc`` on this rank; findings go into ``frame``. Returns what the
    report says of the step (schedule, micro-batches, what was stood in for)."""
    from shardcheck.harness.rank.plumbing import groups
    from shardcheck.harness.rank.life.data_path import layout_for, layout_payload
    from shardcheck.harness.rank.pipeline import Life
    from shardcheck.scenarios.data import ScenarioData
    from shardcheck.targets.base import definitions, step_batches

    defined = definitions(target)
    objective = defined.objective or "sample_mean"
    tp_rank, cp_rank = groups.tp_rank(), groups.cp_rank()
    dp_size, dp_rank = groups.dp_size(), groups.dp_rank()
    data = ScenarioData(sc, loss="step", objective=objective, token_floor=defined.token_floor)
    split, split_by = step_batches(target, sc)
    batches = split[dp_rank % sc.dp]
    columns = (tp_rank * sc.vocab // sc.tp, (tp_rank + 1) * sc.vocab // sc.tp)
    offsets = row_offsets(sc)
    micro: list[MicroBatch] = []
    for k, samples in enumerate(batches):
        mb_sc = sc.micro_batch(samples)
        mb_data = ScenarioData(mb_sc, loss="policy")
        layout, rollout, moved = layout_for(target, mb_data, tp_rank, cp_rank, runner.rank)
        frame.found += moved
        micro.append(micro_batch(k, samples, mb_sc, mb_data, layout, rollout, offsets))
    if len(micro) == 1 and sc.dp == 1:  # the step's one micro-batch is the scenario: its rows are the report's
        runner.layout = layout_payload(micro[0].layout)
    # the world holds dp_size / sc.dp copies of the scenario: each is part of the global batch the
    # framework is told of (the objective, a mean, is the same over copies)
    step = Step(runner, sc, target, frame, defined, data, micro, columns, dp_size, dp_rank,
                len(sc.samples) * dp_size // sc.dp, [], offsets)

    clean = _run(step, pipeline)
    layout = table_layout(sc, tp_rank, columns)
    life = Life(runner.rank, frame.checks, sc, data, layout, target, None, None, "step", defined, owed=layout,
                owed_entropy=layout, found=frame.found, errors=frame.errors)
    life.grad = clean.grad
    life.step = {"micro_batches": len(micro), "dp_size": dp_size, "cp_size": sc.cp, "tp_size": sc.tp}
    life.logged_loss, logged_by = logged_loss(step, clean)
    pipeline.call("after_step", life)
    if frame.checks.mask_leak:
        frame.found += mask_leaks(step, clean)
    return {"schedule": SCHEDULE, "gradient_reduction": REDUCTION, "cpu_world": step.notes, "split": split_by,
            "logged_loss": logged_by}


def logged_loss(step: Step, ran: Ran) -> tuple[Any, str]:
    """The loss the framework logs for the step, aggregated by the target's ``logged_loss`` (the
    framework's own code) from what each micro-batch reported, and what the report says of it.
    Every rank asks the target or none does: its aggregation is collective (an all-reduce over
    the data-parallel x CP group), and a rank whose micro-batch reported nothing (its failure is
    reported already) would leave the others waiting."""
    import torch.distributed as dist

    from shardcheck.harness.rank.plumbing import groups
    from shardcheck.harness.rank.plumbing import trace
    from shardcheck.targets.base import StepSizes

    if not step.target.declares("logged_loss"):
        return None, f"not compared: {step.target.name} has no logged_loss"
    whole = len(ran.reported) == len(step.micro) and all(isinstance(r, dict) and r for r in ran.reported)
    every = torch.tensor([1 if whole else 0], device=step.runner.device or "cpu")
    dist.all_reduce(every, op=dist.ReduceOp.MIN)
    if not int(every):
        return None, "not compared: a micro-batch on some rank reported nothing (its failure is reported)"
    with trace.labelled("logged loss"):
        view = StepSizes(len(step.micro), step.global_batch, step.dp_size, step.scenario.cp, groups.dp_cp_group())
        value = step.target.logged_loss(ran.reported, view)
    if value is None:
        return None, f"not compared: {step.target.name}'s commit has no aggregation of it"
    # a value that is no number raises here, the target's (not in the check that compares it)
    return torch.as_tensor(value).detach(), "compared with the objective's value over the global batch"


def per_token_loss(target: Any, defined: Any) -> bool:
    """megatron-core's ``calculate_per_token_loss`` as the framework sets it: the target's own
    ``calculate_per_token_loss`` where it has one, else whether its objective is the token mean
    (the three-value form whose count megatron divides by)."""
    knob = target.calculate_per_token_loss
    return defined.objective == "token_mean" if knob is None else bool(knob)


def _run(step: Step, pipeline: Any, poison: tuple[str, ...] = ()) -> Ran:
    """One run of the step through megatron-core's schedule and DDP. With ``pipeline`` each
    micro-batch lives its checks; ``poison`` names the inputs that hold NaN at every masked
    position (the checks are then not called: the run is compared with the clean one)."""
    with warnings.catch_warnings():  # megatron-core's own notices (Apex absent, deprecated scopes) are not the target's
        warnings.simplefilter("ignore")
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer import TransformerConfig

        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                                   calculate_per_token_loss=per_token_loss(step.target, step.defined))
    from shardcheck.harness.rank.plumbing import groups
    from shardcheck.harness.rank.pipeline import Life
    from shardcheck.targets.base import StepInputs

    runner, frame, target = step.runner, step.frame, step.target
    module = LogitsTable(step.data, step.columns, runner.device or "cpu", step.masked if "logits" in poison else None)
    module.cp_group = groups.cp_group()
    with _current_device_on_cpu(step.notes), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
        model = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module)
    config.no_sync_func = model.no_sync

    def finalize(*args: Any, **kwargs: Any) -> Any:  # megatron-core's, its collectives named for what they are
        from shardcheck.harness.rank.plumbing import trace

        with trace.labelled("gradient sync"):
            return finalize_model_grads(*args, **kwargs)

    config.finalize_model_grads_func = finalize
    model.zero_grad_buffer()
    batch_advantages = step.advantages
    if "advantages" in poison:  # the whole batch's, as a trainer normalising them would read them
        batch_advantages = tuple(a.masked_fill(m == 0, float("nan")) for a, m in zip(batch_advantages, step.loss_masks))
    outputs: list[Any] = [None] * len(step.micro)
    losses: list[Any] = [None] * len(step.micro)

    def loss_func(mb: MicroBatch, logits: torch.Tensor) -> tuple:
        inputs = runner.rank_inputs(mb.scenario, mb.data, mb.layout, logits, "policy", mb.rollout)
        inputs.step = StepInputs(mb.index, len(step.micro), step.global_batch, step.dp_size, step.dp_rank, mb.samples,
                                 step.replica_samples, step.loss_masks, batch_advantages)
        if poison:
            _poison_policy(inputs.policy, mb, poison)
            out = target.compute(inputs)
        else:
            life = Life(runner.rank, frame.checks, mb.scenario, mb.data, mb.layout, target, inputs,
                        logits.detach().clone(), "step", step.defined, owed=mb.layout, owed_entropy=mb.layout,
                        found=frame.found, errors=frame.errors)
            pipeline.call("inputs_made", life)
            with pipeline.around("forward", life):
                life.outputs = target.compute(inputs)
            life.entropy = getattr(life.outputs, "entropy", None) if mb.scenario.with_entropy else None
            pipeline.call("after_forward", life)
            out = None if life.stopped else life.outputs
        loss = getattr(out, "loss", None)
        outputs[mb.index] = _kept(out)
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            # nothing of this micro-batch reaches the gradient (what was wrong is reported); the
            # schedule goes on, so every rank issues the same collectives
            return logits.reshape(-1)[:0].sum(), {}
        losses[mb.index] = loss.detach().clone()
        reported = out.reported or {}
        if out.num_tokens is not None:
            return loss.reshape(()), out.num_tokens, reported
        return loss.reshape(()), reported

    def forward_step(data_iterator: Iterator[MicroBatch], model: Any) -> tuple:
        mb = next(data_iterator)
        return model(mb), functools.partial(loss_func, mb)

    with _schedule_counter_on_cpu(step.notes), warnings.catch_warnings():
        # megatron-core's notice as it imports its norms lazily: the harness's import, not the target's
        warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
        reported = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(step.micro),
                                               model=[model], num_microbatches=len(step.micro), seq_length=0,
                                               micro_batch_size=0, forward_only=False)
    return Ran(outputs, losses, module.table.main_grad.detach().clone(), list(reported or []))


# -- the mask-leak check ---------------------------------------------------------------------------
def masked_rows(data: Any) -> torch.Tensor:
    """Per table row (every position of every sample of the global batch): whether it is masked,
    i.e. scores no response token whose loss mask is 1 (prompt rows, the last row, masked tokens)."""
    out = []
    for i, s in enumerate(data.scenario.samples):
        rows = torch.ones(s.total, dtype=torch.bool)
        rows[s.prompt - 1 : s.total - 1] = data.loss_mask(i) == 0
        out.append(rows)
    return torch.cat(out)


def _poison_policy(policy: Any, mb: MicroBatch, poison: tuple[str, ...]) -> None:
    """NaN at the masked tokens of the rank's share in the per-token inputs ``poison`` names."""
    for k, tokens in enumerate(mb.layout.share):
        mask = policy.loss_masks[k]
        masked = torch.tensor([int(mask[j]) == 0 for j in tokens], dtype=torch.bool)
        for name in ("advantages", "old_log_probs"):
            if name in poison:
                values = getattr(policy, name)
                values[k] = values[k].masked_fill(masked.to(values[k].device), float("nan"))


def mask_leaks(step: Step, clean: Ran) -> list[Any]:
    """The step again with NaN at every masked position: an unmasked output, a loss or an
    unmasked gradient row that is not bitwise the clean run's is a leak; the inputs whose NaN
    leaks are found one at a time."""
    import torch.distributed as dist

    from shardcheck.harness.wire import MASK_LEAK, Failure

    poisoned = _run(step, None, POISONABLE)
    seen = _leak(step, clean, poisoned)
    # every rank runs the same steps (they are collectives): whether any rank saw a leak, agreed
    anywhere = torch.tensor([0 if seen is None else 1], device=step.runner.device or "cpu")
    dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
    if not int(anywhere):
        return []
    through = [name for name in POISONABLE if _leak(step, clean, _run(step, None, (name,))) is not None]
    if seen is None:
        return []

    what, where = seen
    inputs = " and ".join(through) or "the inputs together"
    return [Failure(MASK_LEAK, f"NaN at the masked positions of the {inputs} reached {what}", [step.runner.rank],
                    details={"inputs": through, **where}, **{k: v for k, v in where.items()
                                                             if k in ("field", "sample", "token", "position")})]


def _leak(step: Step, clean: Ran, poisoned: Ran) -> tuple[str, dict[str, Any]] | None:
    """The first unmasked thing the poisoned run changed: (what, where), or None."""
    for mb, a, b in zip(step.micro, clean.outputs, poisoned.outputs):
        if a is None or b is None:
            continue
        for name in ("log_probs", "entropy"):
            got, want = getattr(b, name, None), getattr(a, name, None)
            if got is None or want is None:
                continue
            for k, tokens in enumerate(mb.layout.share):
                mask = step.data.loss_mask(mb.samples[k])
                for e, j in enumerate(tokens):
                    if int(mask[j]) and not same_bits(got[k][e], want[k][e]):
                        sample = mb.samples[k]
                        return (f"{name} of sample {sample} response token {j} (unmasked): {_pair(want[k][e], got[k][e])}",
                                {"field": name, "sample": sample, "token": j})
    for mb, a, b in zip(step.micro, clean.losses, poisoned.losses):
        if a is not None and (b is None or not same_bits(a, b)):
            return (f"the loss of micro-batch {mb.index}: {_pair(a, b)}", {"field": "loss"})
    differ = (clean.grad.view(torch.int32) != poisoned.grad.view(torch.int32)).any(dim=1) & ~step.masked
    if bool(differ.any()):
        row = int(differ.nonzero()[0])
        sample = bisect.bisect_right(step.offsets, row) - 1
        position = row - step.offsets[sample]
        column = int((clean.grad[row].view(torch.int32) != poisoned.grad[row].view(torch.int32)).nonzero()[0])
        token = position - (step.scenario.samples[sample].prompt - 1)
        return (f"the step's gradient at sample {sample} response token {token} (row {position}, unmasked) column "
                f"{step.columns[0] + column}: {_pair(clean.grad[row, column], poisoned.grad[row, column])}",
                {"field": "grad", "sample": sample, "token": token, "position": position})
    return None


def _kept(out: Any) -> Any:
    """A micro-batch's outputs as values (detached copies), or None where they cannot be read."""
    import types

    def values(xs: Any) -> Any:
        if xs is None:
            return None
        return [x.detach().clone() if isinstance(x, torch.Tensor) else None for x in xs]

    if out is None:
        return None
    return types.SimpleNamespace(log_probs=values(getattr(out, "log_probs", None)),
                                 entropy=values(getattr(out, "entropy", None)))


def _pair(clean: torch.Tensor, poisoned: torch.Tensor) -> str:
    return f"{float(clean):.6g} in the clean run, {float(poisoned):.6g} with NaN at the masked positions"
