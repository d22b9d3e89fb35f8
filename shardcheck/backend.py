"""Which torch.distributed backend a world uses, and which device each rank computes on.

gloo runs everywhere, on CPU. nccl needs one CUDA device per rank on the node: one GPU cannot
hold a multi-rank NCCL world, so a single GPU runs a world of one rank. "auto" takes nccl when
every rank gets its own device and gloo otherwise, and says why. "gloo-cuda" keeps gloo's
collectives but puts every rank's tensors on a CUDA device, GPUs shared (rank modulo their number):
a CP world of code that needs CUDA tensors (NeMo-RL's CP backward) on a machine with one GPU.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from shardcheck.errors import BadInput
from shardcheck.run_config import BACKEND_ENV, active  # BACKEND_ENV: kept importable from here

BACKENDS = ("auto", "gloo", "nccl", "gloo-cuda")
# the backends whose ranks compute on a CUDA device
ON_CUDA = ("nccl", "gloo-cuda")


def choose_backend(requested: str, nproc: int, *, cuda_available: bool | None = None,
                   device_count: int | None = None) -> tuple[str, str]:
    """(backend, why) for a world of ``nproc`` ranks on this node; BadInput if nccl is asked for
    and cannot be had. The CUDA facts are read from torch unless given (tests give them)."""
    if requested not in BACKENDS:
        raise BadInput(f"unknown backend {requested!r} (choose from {', '.join(BACKENDS)})")
    if cuda_available is None or device_count is None:
        import torch

        cuda_available = torch.cuda.is_available() if cuda_available is None else cuda_available
        device_count = (torch.cuda.device_count() if cuda_available else 0) if device_count is None else device_count
    gpus = device_count if cuda_available else 0
    if requested == "gloo":
        return "gloo", "asked for"
    if requested == "gloo-cuda":
        if gpus == 0:
            raise BadInput("--backend gloo-cuda needs CUDA, and none is available here (use gloo)")
        return "gloo-cuda", f"asked for: {nproc} rank(s) sharing {gpus} GPU(s), gloo collectives"
    if requested == "nccl":
        if gpus == 0:
            raise BadInput("--backend nccl needs CUDA, and none is available here (use gloo)")
        if gpus < nproc:
            raise BadInput(f"--backend nccl needs one GPU per rank: {nproc} ranks, {gpus} GPU(s) here "
                           f"(use --nproc {gpus} or fewer, or gloo)")
        return "nccl", "asked for"
    if gpus == 0:
        return "gloo", "no CUDA device"
    if gpus < nproc:
        return "gloo", f"{gpus} GPU(s) for {nproc} ranks (nccl needs one per rank)"
    return "nccl", f"one of {gpus} GPU(s) per rank"


def rank_device(backend: str, rank: int) -> Any:
    """The device this rank computes on; for nccl its own GPU (LOCAL_RANK under torchrun), made
    current so that collectives and allocations land there."""
    import torch

    if backend not in ON_CUDA:
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank)) % max(torch.cuda.device_count(), 1)
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def process_group_backend(backend: str) -> str:
    """What torch.distributed is given for ``backend`` (gloo-cuda is gloo on CUDA tensors)."""
    return "gloo" if backend == "gloo-cuda" else backend


def requested_backend() -> str:
    """The backend the run was asked for (``--backend``), for targets deciding what they can
    run before the world starts: that of the run configuration in effect (a command's, a rank's
    run), else, for a caller of the library that put none in effect, :data:`BACKEND_ENV`;
    "auto" when not said."""
    config = active()
    return config.backend if config is not None else os.environ.get(BACKEND_ENV, "auto")


def ranks_on_nccl() -> bool:
    """Whether this command's groups will run on nccl, for a target deciding before the world
    starts: asked for, or auto with two GPUs or more (a broken CUDA set-up counts as none)."""
    asked = requested_backend()
    if asked != "auto":
        return asked == "nccl"
    try:
        import torch

        return torch.cuda.is_available() and torch.cuda.device_count() >= 2
    except Exception:
        return False


def gloo_safe_all_gather(tensor: Any, group: Any = None) -> tuple[Any, ...]:
    """torch.distributed.nn.functional.all_gather's contract (forward: all-gather; backward:
    reduce-scatter of the gradients, SUM), with a backward gloo runs on any subgroup. torch's own
    backward on gloo scatters with the group rank as a global ``src`` and fails on any group other
    than global ranks 0..n-1 (a CP group at tp > 1): a fault of the world, not of the code under test,
    which an adapter may route around only when asked (docs/world.md)."""
    return _gloo_safe_all_gather_class().apply(group, tensor)


@functools.cache  # torch is imported when a rank first gathers, not with this module
def _gloo_safe_all_gather_class() -> Any:
    import torch
    import torch.distributed as dist

    class GlooSafeAllGather(torch.autograd.Function):
        """Backward: the gradients stacked, all-reduced, this rank's slice kept."""

        @staticmethod
        def forward(ctx: Any, group: Any, tensor: Any) -> tuple[Any, ...]:
            ctx.group, ctx.rank = group, dist.get_rank(group)
            parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, tensor.contiguous(), group=group)
            return tuple(parts)

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> tuple[None, Any]:
            summed = torch.stack([g.contiguous() for g in grads])
            dist.all_reduce(summed, group=ctx.group)
            return None, summed[ctx.rank]

    return GlooSafeAllGather
