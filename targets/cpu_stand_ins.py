"""The device stand-ins a framework's code needs on a world without CUDA, written once.

A framework's log-prob path sometimes moves a tensor to CUDA (``.cuda()``, ``pin_memory()``) or asks
which CUDA device it is on, only to decide where a tensor lives: the values are the same on the CPU.
On a CPU world these stand in for the duration of one call of the framework's code (a process runs
one rank's call at a time, so nothing else sees them); on a world with CUDA nothing stands in. Every
adapter using one says so in its report.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def tensor_cuda_stays(device: Any = "cpu") -> Iterator[None]:
    """``Tensor.cuda()`` returns the tensor itself while the block runs, where ``device`` (the
    logits' device) is the CPU."""
    if torch.device(device).type != "cpu":
        yield
        return
    own = "cuda" in vars(torch.Tensor)
    was = vars(torch.Tensor).get("cuda")
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own:
            torch.Tensor.cuda = was  # type: ignore[method-assign]
        else:
            del torch.Tensor.cuda


@contextlib.contextmanager
def current_device_is_cpu() -> Iterator[None]:
    """``torch.cuda.current_device()`` answers "cpu" while the block runs, where CUDA is absent (a
    framework places a tensor with it: the CPU rank's device)."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_device = saved
