"""PyTorch's own vocab-parallel cross entropy: ``torch.distributed.tensor.parallel.loss_parallel``,
the reference implementation of the DTensor family (docs/targets.md, "torch:loss_parallel").

The rank's logits become a DTensor sharded over the vocabulary (``Shard(-1)``) on a DeviceMesh
built from the rank's tensor-parallel group, as a model with a ``ColwiseParallel`` LM head hands
them over; ``F.cross_entropy(..., reduction="none")`` inside ``loss_parallel()`` gives each row's
negative log-prob, replicated over the mesh. loss_parallel installs its backward handlers only
inside the context, so the target's ``backward_context()`` is that context: the harness runs the
backward there, as a training loop written for it does. It computes no entropy and has no
context parallelism: those scenarios are skipped, saying so.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from shardcheck.errors import BadInput
from shardcheck.targets.base import Capabilities, RankInputs, RankOutputs, TargetBase

# what --coverage reports on: torch's own module of loss_parallel's handlers
LOSS_MODULE = "distributed/tensor/parallel/loss.py"


class LossParallelTarget(TargetBase):
    """torch's loss_parallel: F.cross_entropy on vocab-sharded DTensor logits (log-probs only)"""

    name = "torch:loss_parallel"
    capabilities = Capabilities(
        layouts=frozenset({"thd", "bshd"}), entropy=False, cp_sizes=frozenset({1}),
        reasons=(("entropy", "loss_parallel is a cross entropy: it computes no entropy"),
                 ("cp", "loss_parallel has no context parallelism (its DTensor shards the vocabulary only)")),
        layout_reasons=(("zigzag", "loss_parallel has no context parallelism (zigzag CP)"),
                        ("allgather", "loss_parallel has no context parallelism (all-gather CP)")))
    src = Path(torch.__file__).parent
    framework_files = (LOSS_MODULE,)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "version": torch.__version__,
                "calls": "F.cross_entropy(DTensor(Shard(-1)), reduction='none') inside loss_parallel()"}

    def backward_context(self) -> contextlib.AbstractContextManager[Any]:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def compute(self, inputs: RankInputs) -> RankOutputs:
        from torch.distributed.tensor.parallel import loss_parallel

        rows = inputs.logits.reshape(-1, inputs.logits.size(-1)) / inputs.temperature
        sharded = vocab_sharded(rows, inputs.tp_group)
        with loss_parallel():
            nll = F.cross_entropy(sharded, inputs.row_labels(), reduction="none")
        log_probs = -nll.to_local()  # replicated: every TP rank holds every row's
        return RankOutputs([log_probs[r] for r in inputs.scored_rows()])



def vocab_sharded(local: torch.Tensor, tp_group: Any, dim_name: str | None = None) -> Any:
    """``local`` (this rank's vocabulary columns) as the DTensor a model with a vocab-parallel LM
    head hands over: ``Shard(-1)`` on a DeviceMesh of the rank's real TP group, its one dimension
    named ``dim_name`` where the caller looks it up by name. A mesh a call: DeviceMesh.from_group
    makes no collective and takes about 0.2 ms."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    names = (dim_name,) if dim_name else None
    mesh = DeviceMesh.from_group(tp_group, local.device.type, mesh_dim_names=names)
    return DTensor.from_local(local, mesh, [Shard(-1)], run_check=False)


def make(variant: str | None = None) -> LossParallelTarget:
    """PyTorch's DTensor vocab-parallel cross entropy (torch.distributed.tensor.parallel.loss_parallel), log-probs only"""
    if variant not in (None, "loss_parallel"):
        raise BadInput(f"target 'torch' has no variant {variant!r} (known: loss_parallel)")
    return LossParallelTarget()


make.variants = {"loss_parallel": "F.cross_entropy on vocab-sharded DTensor logits inside loss_parallel() (the default)"}
