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
global batch (:class:`~shardcheck.harness.rank.compare.ReferenceComparison`'s ``after_step``).

Each micro-batch is a life of its own up to ``after_forward`` (its inputs made, the target
called inside megatron's loss function, its values compared); megatron's schedule then runs the
backward. The step as a whole is one life more, at ``after_step``.

On a CPU world two calls of megatron-core assume CUDA; each is answered with the CPU and said in
the report: ``torch.cuda.current_device()`` while DDP allocates its gradient buffer, and the
schedule's ``torch.zeros(..., device="cuda")`` token counter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from shardcheck.scenarios.layout import Piece, RankLayout

SCHEDULE = "megatron.core.pipeline_parallel.schedules.forward_backward_no_pipelining"
REDUCTION = "megatron.core.distributed.DistributedDataParallel, finalize_model_grads"
CPU_DEVICE_SHIM = ("torch.cuda.current_device() answered 'cpu' while megatron-core's DistributedDataParallel "
                   "allocated its gradient buffer (a CPU world)")
CPU_COUNTER_SHIM = ("torch.zeros(device='cuda') placed on the CPU while megatron-core's schedule ran (its "
                    "total_num_tokens counter; a CPU world)")


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch on this rank: its samples (global indices) and everything its life needs."""

    index: int
    samples: tuple[int, ...]
    scenario: Any
    data: Any
    layout: RankLayout
    rollout: Any
    moved: list[Any]


class LogitsTable(torch.nn.Module):
    """The stand-in model: one parameter holding the logits of every (sample, position) of the
    global batch, this rank's vocabulary columns; forward lays a micro-batch's rows out."""

    def __init__(self, data: Any, columns: tuple[int, int], device: Any) -> None:
        from megatron.core.enums import ModelType

        super().__init__()
        self.model_type = ModelType.encoder_or_decoder  # what megatron's schedule asks of a model
        sc = data.scenario
        a, b = columns
        rows = [data.logit_rows(i, 0, s.total)[:, a:b] for i, s in enumerate(sc.samples)]
        self.table = torch.nn.Parameter(torch.cat(rows).to(device))
        self.offsets = [0]
        for s in sc.samples:
            self.offsets.append(self.offsets[-1] + s.total)
        self.cp_group: Any = None

    def set_input_tensor(self, tensor: Any) -> None:
        """No pipeline stages: nothing comes from a previous one."""

    def forward(self, mb: MicroBatch) -> torch.Tensor:
        from shardcheck.harness.rank import shard
        from shardcheck.harness.rank.model_stand_in import ModelCpCollective

        layout = mb.layout
        index, real = [], []
        for p in layout.pieces:
            total = mb.scenario.samples[p.stream].total if p.stream < len(mb.samples) else 0
            base = self.offsets[mb.samples[p.stream]] if p.stream < len(mb.samples) else 0
            for pos in range(p.start, p.stop):
                index.append(base + pos if pos < total else 0)
                real.append(pos < total)
        device = self.table.device
        index_t = torch.tensor(index, dtype=torch.int64, device=device)
        real_t = torch.tensor(real, dtype=torch.bool, device=device).unsqueeze(1)
        constant = shard.local_logits(mb.data, layout).reshape(layout.num_rows, -1).to(device)
        logits = torch.where(real_t, self.table.index_select(0, index_t), constant).reshape(layout.shape)
        if mb.scenario.cp > 1:  # the model's CP collective in backward (model_stand_in)
            logits = ModelCpCollective.apply(logits, self.cp_group)
        return logits


class _CudaCounterOnCpu(TorchFunctionMode):
    """``torch.zeros(..., device="cuda")`` on the CPU: megatron's schedule makes its token counter so."""

    def __init__(self, notes: list[str]) -> None:
        super().__init__()
        self.notes = notes

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.zeros and str(kwargs.get("device", "")).startswith("cuda"):
            kwargs = {**kwargs, "device": "cpu"}
            if CPU_COUNTER_SHIM not in self.notes:
                self.notes.append(CPU_COUNTER_SHIM)
        return func(*args, **kwargs)


@contextlib.contextmanager
def _current_device_on_cpu(notes: list[str]) -> Iterator[None]:
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
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


def run_step(runner: Any, sc: Any, target: Any, frame: Any, pipeline: Any) -> dict[str, Any]:
    """The training step of ``sc`` on this rank; findings go into ``frame``. Returns what the
    report says of the step (schedule, micro-batches, what was stood in for)."""
    with warnings.catch_warnings():  # megatron-core's own notices (Apex absent, deprecated scopes) are not the target's
        warnings.simplefilter("ignore")
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer import TransformerConfig

    from shardcheck.harness.rank import groups, shard
    from shardcheck.harness.rank.data_path import layout_for
    from shardcheck.harness.rank.pipeline import Life
    from shardcheck.scenarios.data import ScenarioData
    from shardcheck.targets.base import StepInputs, definitions

    defined = definitions(target)
    objective = defined.objective or "sample_mean"
    per_token = objective == "token_mean"
    tp_rank, cp_rank = groups.tp_rank(), groups.cp_rank()
    dp_size, dp_rank = groups.dp_size(), groups.dp_rank()
    data = ScenarioData(sc, loss="step", objective=objective, token_floor=defined.token_floor)
    batches = sc.micro_batches(dp_rank % sc.dp)
    # the world holds dp_size / sc.dp copies of the scenario: each is part of the global batch
    # the framework is told of (the objective, a mean, is the same over copies)
    global_batch = len(sc.samples) * dp_size // sc.dp
    columns = (tp_rank * sc.vocab // sc.tp, (tp_rank + 1) * sc.vocab // sc.tp)

    notes: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                                   calculate_per_token_loss=per_token)
    module = LogitsTable(data, columns, runner.device or "cpu")
    module.cp_group = groups.cp_group()
    with _current_device_on_cpu(notes):
        model = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module)
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    model.zero_grad_buffer()

    micro: list[MicroBatch] = []
    for k, samples in enumerate(batches):
        mb_sc = sc.micro_batch(samples)
        mb_data = ScenarioData(mb_sc, loss="policy")
        layout, rollout, moved = layout_for(target, mb_data, tp_rank, cp_rank, runner.rank)
        frame.found += moved
        micro.append(MicroBatch(k, samples, mb_sc, mb_data, layout, rollout, moved))
    if len(micro) == 1 and sc.dp == 1:  # the step's one micro-batch is the scenario: its rows are the report's
        from shardcheck.harness.rank.data_path import layout_payload

        runner.layout = layout_payload(micro[0].layout)

    def loss_func(mb: MicroBatch, logits: torch.Tensor) -> tuple:
        inputs = runner.rank_inputs(mb.scenario, mb.data, mb.layout, logits, "policy", mb.rollout)
        inputs.step = StepInputs(mb.index, len(micro), global_batch, dp_size, dp_rank, mb.samples)
        life = Life(runner.rank, frame.checks, mb.scenario, mb.data, mb.layout, target, inputs,
                    logits.detach().clone(), "step", defined, owed=mb.layout, owed_entropy=mb.layout,
                    found=frame.found, errors=frame.errors)
        pipeline.call("inputs_made", life)
        with pipeline.around("forward", life):
            life.outputs = target.compute(inputs)
        life.entropy = getattr(life.outputs, "entropy", None) if mb.scenario.with_entropy else None
        pipeline.call("after_forward", life)
        loss = getattr(life.outputs, "loss", None)
        if life.stopped or not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            # nothing of this micro-batch reaches the gradient (what was wrong is reported); the
            # schedule goes on, so every rank issues the same collectives
            loss = 0 * logits.sum()
            return loss, {}
        reported = life.outputs.reported or {}
        if life.outputs.num_tokens is not None:
            return loss.reshape(()), life.outputs.num_tokens, reported
        return loss.reshape(()), reported

    def forward_step(data_iterator: Iterator[MicroBatch], model: Any) -> tuple:
        mb = next(data_iterator)
        return model(mb), functools.partial(loss_func, mb)

    with _CudaCounterOnCpu(notes) if not torch.cuda.is_available() else contextlib.nullcontext():
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(micro), model=[model],
                                    num_microbatches=len(micro), seq_length=0, micro_batch_size=0,
                                    forward_only=False)
    layout = table_layout(sc, tp_rank, columns)
    life = Life(runner.rank, frame.checks, sc, data, layout, target, None, None, "step", defined, owed=layout,
                owed_entropy=layout, found=frame.found, errors=frame.errors)
    life.grad = module.table.main_grad
    life.step = {"micro_batches": len(micro), "dp_size": dp_size, "cp_size": sc.cp, "tp_size": sc.tp}
    pipeline.call("after_step", life)
    return {"schedule": SCHEDULE, "gradient_reduction": REDUCTION, "cpu_world": notes}
