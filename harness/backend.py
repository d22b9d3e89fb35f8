"""Which torch.distributed backend a world uses, and which device each rank computes on.

gloo runs everywhere, on CPU. nccl needs one CUDA device per rank on the node: one GPU cannot
hold a multi-rank NCCL world, so a single GPU runs a world of one rank. "auto" takes nccl when
every rank gets its own device and gloo otherwise, and says why.
"""

from __future__ import annotations

import os
from typing import Any

from shardcheck.errors import BadInput

BACKENDS = ("auto", "gloo", "nccl")


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

    if backend != "nccl":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank)) % max(torch.cuda.device_count(), 1)
    torch.cuda.set_device(local)
    return torch.device("cuda", local)
