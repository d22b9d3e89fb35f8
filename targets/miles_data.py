"""miles's own data path: ``get_batch`` (miles/backends/training_utils/data.py), slime's with
miles's changes: its process groups from miles's ``ParallelState``, bshd under CP (zigzag, or
contiguous pieces with all-gather CP), the packed stream padded to a multiple of
``tp * pad_multiplier`` (all-gather CP: ``cp * tp * pad_multiplier``).

slime's data path (:class:`SlimeDataPath`) is the base: the knob, the layout trace, the
boundaries it hands the model. What differs: the function and its parameters (read from miles's
file, so that the controller need not import miles), bshd, and two CPU stand-ins, both only while
``get_batch`` runs and only on a world without CUDA, said in the report:
``torch.cuda.current_device()`` answers "cpu" (where it allocates ``cu_seqlens``) and
``Tensor.cuda()`` leaves a tensor where it is (the zigzag thd branch's ``cu_seqlens``: its values
unchanged, only not moved).
"""

from __future__ import annotations

import ast
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from shardcheck.scenarios.scenario import Scenario
from shardcheck.targets.base import Rollout
from shardcheck.targets.cpu_stand_ins import current_device_is_cpu, tensor_cuda_stays
from shardcheck.targets.slime_data import SlimeDataPath, _Iterator

DATA_MODULE = "miles.backends.training_utils.data"
DATA_FILE = Path("miles/backends/training_utils/data.py")
CPU_STAND_INS = ("torch.cuda.current_device() answered 'cpu' and Tensor.cuda() left a tensor on the CPU while "
                 f"get_batch ran ({DATA_FILE}: where it allocates and moves cu_seqlens; a CPU world)")


def read_get_batch(src: Path) -> dict[str, Any] | None:
    """miles's get_batch's parameters and pad_multiplier default, from its source (None: none)."""
    try:
        tree = ast.parse((src / DATA_FILE).read_text())
    except (OSError, SyntaxError):
        return None
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "get_batch"), None)
    if fn is None:
        return None
    names = [a.arg for a in fn.args.args]
    defaults = dict(zip(names[len(names) - len(fn.args.defaults):], fn.args.defaults))
    pad = defaults.get("pad_multiplier")
    return {"params": names + [a.arg for a in fn.args.kwonlyargs], "line": fn.lineno, "current_device": True,
            "pad_multiplier_default": ast.literal_eval(pad) if pad is not None else None}


class MilesDataPath(SlimeDataPath):
    """miles's get_batch, from the target's checkout, with miles's ParallelState set first."""

    name = f"{DATA_FILE}:get_batch"

    def builds(self, scenario: Scenario) -> str | None:
        commit = (self.target.commit or "?")[:10]
        if scenario.layout == "allgather" and "allgather_cp" not in self.found["params"]:
            return f"miles's get_batch at {commit} has no allgather_cp"
        if scenario.layout == "bshd" and "qkv_format" not in self.found["params"]:
            return f"miles's get_batch at {commit} packs (thd) only"
        return None

    def batch(self, rollout: Rollout, extra: dict[str, list] | None = None) -> dict[str, Any]:
        """get_batch's micro-batch of ``rollout``, miles's process groups set from the harness's first."""
        state = self.target.set_parallel_state()
        params = self.found["params"]
        data = {"tokens": rollout.tokens, "total_lengths": rollout.total_lengths,
                "response_lengths": rollout.response_lengths, "loss_masks": rollout.loss_masks, **(extra or {})}
        kwargs: dict[str, Any] = {}
        if "qkv_format" in params:
            kwargs["qkv_format"] = "bshd" if rollout.layout == "bshd" else "thd"
        if "pad_multiplier" in params:
            kwargs["pad_multiplier"] = rollout.knobs["pad_multiplier"]
        if "allgather_cp" in params:
            kwargs["allgather_cp"] = rollout.allgather_cp
        if rollout.layout == "bshd":
            # what miles's get_rollout_data gives bshd (data.py, its `if args.qkv_format == "bshd"`):
            # the longest sample, rounded up to tp * the pad multiplier; written here, as that
            # function also moves the whole rollout to CUDA
            pad = state.tp.size * rollout.knobs["pad_multiplier"]
            data["max_seq_lens"] = [-(-max(rollout.total_lengths) // pad) * pad] * len(rollout.tokens)
        with self._device():
            return self._function()(_Iterator(data), list(data), **kwargs)

    def model_inputs(self, rollout: Rollout) -> dict[str, Any]:
        """The packed stream's boundaries get_batch hands the model (``cu_seqlens``; none for bshd)."""
        batch = self.batch(rollout)
        return {"cu_seqlens": batch["cu_seqlens"]} if "cu_seqlens" in batch else {}

    def _function(self) -> Any:
        if self._fn is None:
            self._fn = self.target.import_module(DATA_MODULE).get_batch
        return self._fn

    @contextlib.contextmanager
    def _device(self) -> Iterator[None]:
        if not torch.cuda.is_available() and CPU_STAND_INS not in self.shims:
            self.shims.append(CPU_STAND_INS)
        with current_device_is_cpu(), tensor_cuda_stays("cuda" if torch.cuda.is_available() else "cpu"):
            yield
