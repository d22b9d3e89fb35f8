"""slime's own data path: ``get_batch`` (slime/backends/megatron_utils/data.py), which packs a
micro-batch, pads it (to a multiple of ``tp * pad_multiplier``; with all-gather CP the whole
packed stream to ``cp * tp * pad_multiplier``) and splits it across CP ranks (zigzag chunks, or
contiguous pieces with all-gather CP). slime's training step calls it with
``args.data_pad_size_multiplier`` (default 128) and ``args.allgather_cp``; the scenario's layout
gives the second, its ``layout_knobs`` may set the first (``pad_multiplier``).

On a CPU world: where slime's accelerator API exists (slime.utils.accelerator, since e593fa0a0)
a CPU backend is registered through it (slime's own extension point, ``register_accelerator``);
at older commits ``get_batch`` places ``cu_seqlens`` with ``torch.cuda.current_device()``, which
answers the rank's device while ``get_batch`` runs (said in ``describe()``; it only chooses where
a tensor is allocated), and a branch that calls ``.cuda()`` is not taken on a CPU world: such a
scenario is laid out by shardcheck, and the report says why.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from shardcheck.scenarios.scenario import Scenario
from shardcheck.targets.base import Knob, Rollout, positive_int

DATA_MODULE = "slime.backends.megatron_utils.data"
DATA_FILE = Path("slime/backends/megatron_utils/data.py")


def read_get_batch(src: Path) -> dict[str, Any] | None:
    """What this checkout's get_batch takes and where it needs CUDA, from its source (None: none)."""
    path = src / DATA_FILE
    if not path.is_file():
        return None
    try:
        tree = ast.parse(path.read_text())
    except SyntaxError:
        return None
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "get_batch"), None)
    if fn is None:
        return None
    params = [a.arg for a in fn.args.args + fn.args.kwonlyargs]
    defaults = dict(zip([a.arg for a in fn.args.args][-len(fn.args.defaults):] if fn.args.defaults else [],
                        fn.args.defaults))
    pad_default = defaults.get("pad_multiplier")
    branches = [n for n in ast.walk(fn) if isinstance(n, ast.If) and isinstance(n.test, ast.Name)
                and n.test.id == "allgather_cp"]
    cuda: dict[str, int] = {}  # the layouts whose branch calls .cuda(), with the line
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "cuda" \
                and not node.args:
            where = _branch(branches, node.lineno)
            for layout in (("allgather",) if where == "allgather" else ("thd", "zigzag") if where == "else"
                           else ("thd", "zigzag", "allgather")):
                cuda.setdefault(layout, node.lineno)
    text = ast.get_source_segment(path.read_text(), fn) or ""
    return {
        "params": params,
        "pad_multiplier_default": ast.literal_eval(pad_default) if pad_default is not None else None,
        "cuda_lines": cuda,
        "current_device": "torch.cuda.current_device()" in text,
        "line": fn.lineno,
    }


def _branch(branches: list[ast.If], line: int) -> str:
    """Which side of an ``if allgather_cp:`` holds ``line`` (the innermost one around it)."""
    def span(nodes: list[ast.stmt]) -> tuple[int, int]:
        return (nodes[0].lineno, nodes[-1].end_lineno or nodes[-1].lineno) if nodes else (0, -1)

    around = [(n, side) for n in branches for side, body in (("allgather", n.body), ("else", n.orelse))
              if span(body)[0] <= line <= span(body)[1]]
    if not around:
        return "all"
    return max(around, key=lambda p: p[0].lineno)[1]


class _Iterator:
    """What get_batch reads from: one micro-batch of the rollout (slime's DataIterator serves
    the same lists; its constructor changed over slime's history, get_next did not)."""

    def __init__(self, rollout_data: dict[str, list]) -> None:
        self.rollout_data = rollout_data

    def get_next(self, keys: list[str]) -> dict[str, Any]:
        return {k: (list(self.rollout_data[k]) if k in self.rollout_data else None) for k in keys}


class SlimeDataPath:
    """slime's get_batch, from the target's checkout."""

    name = "slime/backends/megatron_utils/data.py:get_batch"

    def __init__(self, target: Any, found: dict[str, Any]) -> None:
        self.target = target  # imports (and releases) slime's modules
        self.found = found
        self.shims: list[str] = []
        self._fn: Any = None

    def knobs(self) -> dict[str, Knob]:
        if "pad_multiplier" not in self.found["params"]:
            return {}
        return {"pad_multiplier": Knob(self.found["pad_multiplier_default"] or 128,
                                       "rows padded to a multiple of tp * pad_multiplier (all-gather CP: the packed "
                                       "stream to cp * tp * pad_multiplier); slime's --data-pad-size-multiplier",
                                       positive_int)}

    def builds(self, scenario: Scenario) -> str | None:
        commit = (self.target.commit or "?")[:10]
        if scenario.layout == "bshd":
            return f"slime's get_batch at {commit} packs (thd); bshd rows are laid out by shardcheck"
        if scenario.layout == "allgather" and "allgather_cp" not in self.found["params"]:
            return f"slime's get_batch at {commit} has no allgather_cp"
        line = self.found["cuda_lines"].get(scenario.layout)
        if line is not None and not torch.cuda.is_available():
            return (f"slime's get_batch at {commit} calls .cuda() on this layout's branch (data.py:{line}): it needs "
                    "a CUDA world; rows laid out by shardcheck")
        return None

    def local_tokens(self, rollout: Rollout) -> torch.Tensor:
        return self.batch(rollout)["tokens"]

    def model_inputs(self, rollout: Rollout) -> dict[str, Any]:
        """The sequence boundaries get_batch hands the model's attention (its PackedSeqParams)."""
        params = self.batch(rollout).get("packed_seq_params")
        return {"cu_seqlens": params.cu_seqlens_q} if params is not None else {}

    def batch(self, rollout: Rollout, extra: dict[str, list] | None = None) -> dict[str, Any]:
        """get_batch's micro-batch of ``rollout`` (``extra``: more per-sample keys, as the
        training step asks for them: advantages, log_probs, ...)."""
        data = {"tokens": rollout.tokens, "total_lengths": rollout.total_lengths,
                "response_lengths": rollout.response_lengths, "loss_masks": rollout.loss_masks, **(extra or {})}
        kwargs: dict[str, Any] = {}
        params = self.found["params"]
        if "pad_multiplier" in params:
            kwargs["pad_multiplier"] = rollout.knobs["pad_multiplier"]
        if "allgather_cp" in params:
            kwargs["allgather_cp"] = rollout.allgather_cp
        if "qkv_format" in params:
            kwargs["qkv_format"] = "thd"
        fn = self._function()
        with self._device():
            return fn(_Iterator(data), list(data), **kwargs)

    def _function(self) -> Any:
        if self._fn is None:
            self._fn = self.target.import_module(DATA_MODULE).get_batch
            if set(inspect.signature(self._fn).parameters) != set(self.found["params"]):  # read != imported
                raise RuntimeError(f"slime's get_batch at {self.target.src} does not match its source")
        return self._fn

    @contextlib.contextmanager
    def _device(self) -> Iterator[None]:
        if torch.cuda.is_available() or not self.found["current_device"]:
            yield
            return
        cuda = torch.cuda
        saved = cuda.current_device
        cuda.current_device = lambda: "cpu"  # where get_batch puts cu_seqlens: the CPU rank's device
        note = (f"torch.cuda.current_device() answered 'cpu' while get_batch ran (data.py:{self.found['line']} "
                "places cu_seqlens with it; a CPU world)")
        if note not in self.shims:
            self.shims.append(note)
        try:
            yield
        finally:
            cuda.current_device = saved


CPU_BACKEND = "slime.utils.accelerator: a CPU backend registered through slime's register_accelerator"


def cpu_accelerator(src: Path, import_module: Any) -> str | None:
    """Register a CPU backend through slime's accelerator API where the checkout has it and no
    accelerator is present (its contract: ``current_device`` is "cpu" for CPU); what was done,
    or None."""
    if torch.cuda.is_available() or not (src / "slime/utils/accelerator/__init__.py").is_file():
        return None
    acc = import_module("slime.utils.accelerator")
    base = import_module("slime.utils.accelerator.base")
    if not hasattr(acc, "register_accelerator") or not hasattr(acc, "set_accelerator"):
        return None
    answers = {"is_available": True, "device_count": 1, "current_device": "cpu", "device_name": "cpu"}
    attrs: dict[str, Any] = {"name": "cpu", "device_type": "cpu", "communication_backend_name": "gloo",
                             "device": lambda self, index=None: torch.device("cpu")}
    for name in getattr(base.Accelerator, "__abstractmethods__", frozenset()):
        if name not in attrs:  # set_device, synchronize, empty_cache, current_stream: nothing to do on a CPU
            attrs[name] = (lambda value: lambda self, *a, **k: value)(answers.get(name))
    cpu = type("CPUAccelerator", (base.Accelerator,), attrs)
    acc.register_accelerator("cpu", cpu, lambda: True)
    acc.set_accelerator(cpu())
    return CPU_BACKEND
