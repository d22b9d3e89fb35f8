"""AReaL's own data path and its Megatron engine's log-prob call sites, from the target's checkout.

- The data path, as ``MegatronEngine._prepare_mb_list`` runs it for one micro-batch: the rollout
  batch (``input_ids`` ``[B, S]`` right-padded, ``attention_mask``, the PPO actor's rolled
  ``loss_mask``, old ``logprobs`` and ``advantages``) given ``position_ids`` by
  ``amend_position_ids``, packed by ``pack_tensor_dict``, padded by
  ``pad_mb_list`` (each sequence to a multiple of ``tp``, or ``2 * tp * cp`` under CP, then a
  trailing padding sequence up to a multiple of 256 tokens, or to ``max_tokens_per_mb`` with
  ``pad_to_maximum``; padding id 0), then cut into zigzag CP chunks by
  ``preprocess_packed_seqs_context_parallel``, the model's input.
- The engine's call sites (``areal/engine/megatron_engine.py``): ``forward_backward_batch`` (its
  ``forward_step`` runs ``packed_context_parallel_forward``, then, under CP, rolls the labels over
  the padded buffer and splits them; without CP, ``unpad_logits``), ``_compute_logprobs_and_loss``
  (``train_batch``: ``gather_logprobs_entropy``, and under CP ``reassemble_cp_packed_logprobs`` +
  ``unpad_logits``) and ``_compute_forward_result`` + ``reorder_and_pad_outputs``
  (``forward_batch``: ``gather_logprobs``).

Everything is compiled alone from AReaL's files (:mod:`shardcheck.targets.compiled`; the methods
by :func:`compile_methods`): their modules import AReaL's whole stack (ray, transformers,
megatron-bridge, its config system). What stands in, and only where AReaL's code is not the
subject: the Megatron model (it returns the harness's logits for the rows it is handed),
megatron's pipeline schedule (one forward step per micro-batch, its ``loss_func`` called on the
output; the backward is the harness's), the loss (a recorder, see :class:`LossRecorder`), the
engine object (its config's temperature), and the micro-batch split (one micro-batch, as
``split_padded_tensor_dict_into_mb_list`` gives for AReaL's default ``mb_spec``). Nothing of
AReaL's is wrapped, cast or patched; what its functions raise propagates.
"""

from __future__ import annotations

import __future__
import ast
import builtins
import contextlib
import functools
import logging
import math
import symtable
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from shardcheck.backend import gloo_safe_all_gather
from shardcheck.scenarios.scenario import Scenario
from shardcheck.targets.base import Knob, Rollout, positive_int_or_none
from shardcheck.targets.compiled import names_read, compile_alone

DATA_FILE = Path("areal/utils/data.py")
MATH_FILE = Path("areal/utils/math.py")
CONSTANTS_FILE = Path("areal/utils/constants.py")
# where the packing's CP split lives: moved under areal/engine at 6a71b0f7d
CP_FILES = (Path("areal/engine/megatron_utils/packed_context_parallel.py"),
            Path("areal/utils/mcore/packed_context_parallel.py"))
ENGINE_FILE = Path("areal/engine/megatron_engine.py")
TRAIN_ENGINE_FILE = Path("areal/engine/core/train_engine.py")
ENGINE_CLASS = "MegatronEngine"
ENGINE_METHODS = ("forward_backward_batch", "_compute_logprobs_and_loss", "_compute_forward_result")
PREPROCESS = "preprocess_packed_seqs_context_parallel"
REASSEMBLE = "reassemble_cp_packed_logprobs"
# read by the engine's methods only on tree training's branches (cp must be 1 there; never taken)
TREE_TRAINING = ("_gather_packed_tree_logprobs", "build_tree_attn_kwargs", "gather_packed_tree_logprobs_entropy",
                 "gather_packed_tree_vocab_stats")
FP8_ALIGNMENT = "DEFAULT_VECTORIZED_ALIGNMENT_BYTES"
PACKING = ("amend_position_ids", "pack_tensor_dict", "pad_packed_tensor_dict", "pad_mb_list", "unpad_logits",
           "MicroBatchList")


def _top_level(tree: ast.Module | None) -> dict[str, ast.AST]:
    if tree is None:
        return {}
    return {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def _parse(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(), filename=str(path)) if path.is_file() else None
    except SyntaxError:
        return None


def packing_facts(src: Path) -> dict[str, Any] | None:
    """What this checkout's packing offers, from its source (None: no packing the adapter can run)."""
    data = _top_level(_parse(src / DATA_FILE))
    cp_file = next((f for f in CP_FILES if PREPROCESS in _top_level(_parse(src / f))), None)
    if cp_file is None or any(n not in data for n in PACKING):
        return None
    pad = data["pad_mb_list"]
    params = [a.arg for a in pad.args.args + pad.args.kwonlyargs]  # type: ignore[attr-defined]
    return {"cp_file": str(cp_file),
            # seq_align_to since d58cca56f; align_sequences=True, align_to_multiple_of before
            "seq_align_to": "seq_align_to" in params,
            # _prepare_mb_list aligns to lcm(alignment, 16) under FP8 (since its enable_fp8)
            "fp8": FP8_ALIGNMENT in module_constants(src / CONSTANTS_FILE, (FP8_ALIGNMENT,))
            and FP8_ALIGNMENT in (src / ENGINE_FILE).read_text()}


def engine_facts(src: Path) -> dict[str, Any] | None:
    """How this checkout's MegatronEngine computes log-probs, from its source (None: its methods are
    not the ones the engine variants call, before 0369627d4)."""
    tree = _parse(src / ENGINE_FILE)
    klass = next((n for n in (tree.body if tree else []) if isinstance(n, ast.ClassDef) and n.name == ENGINE_CLASS),
                 None)
    methods = {n.name: n for n in (klass.body if klass else []) if isinstance(n, ast.FunctionDef)}
    if any(m not in methods for m in ENGINE_METHODS) or \
            "reorder_and_pad_outputs" not in _top_level(_parse(src / TRAIN_ENGINE_FILE)):
        return None
    step = ast.unparse(methods["forward_backward_batch"])
    loss = ast.unparse(methods["_compute_logprobs_and_loss"])
    return {
        # d58cca56f: under CP the logits stay on their rank; labels rolled and split to match
        "cp_local": "_cp_local_labels" in step,
        # 95e2379d0: the CP-local log-probs all-gathered back (reduce-scatter in backward)
        "reassembles": REASSEMBLE in loss,
        "lines": {m: methods[m].lineno for m in ENGINE_METHODS},
    }


def module_constants(path: Path, names: tuple[str, ...]) -> dict[str, Any]:
    """Module-level constants of a framework file (``N = 256``, ``M = int(1e12)``), evaluated from
    its own text: what its compiled-alone definitions read besides other definitions."""
    tree = _parse(path)
    out: dict[str, Any] = {}
    for node in tree.body if tree else []:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and node.targets[0].id in names:
            out[node.targets[0].id] = eval(compile(ast.Expression(node.value), str(path), "eval"),  # noqa: S307
                                           {"__builtins__": {"int": int, "float": float, "tuple": tuple}})
    return out


def compile_methods(path: Path, cls: str, names: tuple[str, ...], given: dict[str, Any],
                    off_path: tuple[str, ...] = ()) -> dict[str, Callable[..., Any]]:
    """Methods of class ``cls`` in ``path`` compiled alone as plain functions (``self`` their first
    argument; path and line numbers kept): the engine's own code without its class, whose module
    and bases pull AReaL's whole stack. LookupError naming what they read that is not given."""
    tree = ast.parse(path.read_text(), filename=str(path))
    klass = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
    found = {n.name: n for n in (klass.body if klass else []) if isinstance(n, ast.FunctionDef)}
    if any(n not in found for n in names):
        raise LookupError(f"{path}: {cls} has no {', '.join(n for n in names if n not in found)}")
    module = ast.Module(body=[found[n] for n in names], type_ignores=[])
    table = symtable.symtable("from __future__ import annotations\n" + ast.unparse(module), str(path), "exec")
    reads = set().union(*(names_read(child) for child in table.get_children()))
    unknown = sorted(reads - set(given) - set(off_path) - set(vars(builtins)))
    if unknown:
        raise LookupError(f"{path}: {cls}.{', '.join(names)} read {', '.join(unknown)}, which the adapter does "
                          "not give")
    namespace: dict[str, Any] = {"__name__": f"shardcheck_compiled_{cls}", "__file__": str(path), **given}
    for name in off_path:
        namespace.setdefault(name, _off_path(name))
    exec(compile(module, str(path), "exec", flags=__future__.annotations.compiler_flag,  # noqa: S102
                 dont_inherit=True), namespace)
    return {n: namespace[n] for n in names}


def _off_path(name: str) -> Callable[..., Any]:
    def absent(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"shardcheck did not load {name}: the engine took a branch the adapter does not model")
    return absent


def _dataclass(cls: type) -> type:
    """dataclasses.dataclass on a class compiled alone: to tell a ClassVar annotation (a string
    here) the decorator reads the class's module from sys.modules, and that module was never
    imported; an empty one stands for it while the decorator runs."""
    stand_in = cls.__module__ not in sys.modules
    if stand_in:
        sys.modules[cls.__module__] = types.ModuleType(cls.__module__)
    try:
        return dataclass(cls)
    finally:
        if stand_in:
            del sys.modules[cls.__module__]


def _boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else f"must be true or false, got {value!r}"


class ArealDataPath:
    """AReaL's packing for its Megatron engine (thd, zigzag CP), one micro-batch."""

    def __init__(self, src: Path, facts: dict[str, Any]) -> None:
        self.src, self.facts = src, facts
        self.name = f"{DATA_FILE}:pack_tensor_dict -> pad_mb_list -> {facts['cp_file']}:{PREPROCESS}"
        self._fns: dict[str, Any] | None = None

    def knobs(self) -> dict[str, Knob]:
        out = {
            "pad_to_maximum": Knob(False, "config.pad_to_maximum: pad the micro-batch to mb_spec.max_tokens_per_mb "
                                          "(rounded up to a multiple of lcm(alignment, 256)) instead of to a "
                                          "multiple of 256 tokens; without max_tokens_per_mb AReaL warns and "
                                          "does not", _boolean),
            "max_tokens_per_mb": Knob(None, "mb_spec.max_tokens_per_mb (None: AReaL's default, unset); a batch "
                                            "longer than it would be split into micro-batches, which the "
                                            "adapter does not model (such a scenario is skipped)",
                                      positive_int_or_none),
        }
        if self.facts["fp8"]:
            out["enable_fp8"] = Knob(False, "FP8 training: each sequence aligned to lcm(alignment, "
                                            "DEFAULT_VECTORIZED_ALIGNMENT_BYTES=16), as _prepare_mb_list does",
                                     _boolean)
        return out

    def builds(self, scenario: Scenario) -> str | None:
        if scenario.layout == "bshd":
            return "AReaL's Megatron engine packs every batch (pack_tensor_dict, thd): a bshd batch is laid out by " \
                   "shardcheck"
        if scenario.layout == "allgather":
            return "AReaL has no all-gather CP (its Megatron CP is zigzag only); rows laid out by shardcheck"
        limit = dict(scenario.layout_knobs).get("max_tokens_per_mb")
        tokens = sum(s.total for s in scenario.samples)
        if limit is not None and tokens > limit:
            return (f"AReaL would split these {tokens} tokens into micro-batches of at most max_tokens_per_mb="
                    f"{limit} (split_padded_tensor_dict_into_mb_list), which the adapter does not model")
        return None

    def functions(self) -> dict[str, Any]:
        """The packing compiled alone from data.py and the CP split from its file (once)."""
        if self._fns is None:
            from megatron.core import parallel_state as mpu
            from megatron.core.packed_seq_params import PackedSeqParams

            data = self.src / DATA_FILE
            names = list(PACKING) + [n for n in ("MicroBatchItem", "tensor_container_to", "unpack_sequence",
                                                 "reorder_list", "pad_and_stack_tensors_along_first_dim")
                                     if n in _top_level(_parse(data))]
            given = {"torch": torch, "F": torch.nn.functional, "np": np, "dist": dist, "dataclass": _dataclass,
                     "NamedTuple": NamedTuple, "logger": logging.getLogger("areal.utils.data"),
                     **module_constants(data, ("N_TOKENS_PER_PAGE", "DEFAULT_MAX_TOKENS_PER_MB"))}
            if "ceil_div" in _top_level(_parse(self.src / MATH_FILE)):
                given["align"] = compile_alone(self.src / MATH_FILE, ["ceil_div", "align"], {})["align"]
            self._fns = compile_alone(data, names, given)
            self._fns.update(compile_alone(self.src / self.facts["cp_file"], [PREPROCESS],
                                           {"torch": torch, "mpu": mpu, "PackedSeqParams": PackedSeqParams}))
        return self._fns

    @staticmethod
    def batch(rollout: Rollout, values: dict[str, list[torch.Tensor]] | None = None) -> dict[str, torch.Tensor]:
        """The rollout batch as AReaL's PPO actor hands it to train_batch: ``[B, S]`` right-padded
        with 0, its ``loss_mask`` (1 on response tokens) and old ``logprobs`` rolled by -1 as
        ``PPOActor._compute_advantages`` rolls them (row p then scores token p + 1).

        ``values``: per key, per sample, a value per response token (the whole response), placed
        where the rolled batch holds it (response token j of a sample whose prompt is P at P + j -
        1, 0 elsewhere); the loss mask is then float, as ``compute_advantages`` leaves it (without
        them: ``logprobs`` and ``advantages`` are 0, the mask bool)."""
        device = rollout.tokens[0].device
        width, n = max(rollout.total_lengths), len(rollout.tokens)
        input_ids = torch.zeros(n, width, dtype=torch.int64, device=device)
        attention = torch.zeros(n, width, dtype=torch.bool, device=device)
        loss_mask = torch.zeros(n, width, dtype=torch.bool, device=device)
        for i, (tokens, total, response, mask) in enumerate(zip(rollout.tokens, rollout.total_lengths,
                                                                rollout.response_lengths, rollout.loss_masks)):
            input_ids[i, :total] = tokens
            attention[i, :total] = True
            loss_mask[i, total - response:total] = mask.to(device).bool()
        out = {"input_ids": input_ids, "attention_mask": attention, "loss_mask": torch.roll(loss_mask, -1, -1),
               "logprobs": torch.zeros(n, width, device=device), "advantages": torch.zeros(n, width, device=device)}
        if values is None:
            return out
        out["loss_mask"] = out["loss_mask"].float()
        for key, per_sample in values.items():
            rolled = torch.zeros(n, width, device=device)
            for i, (total, response, v) in enumerate(zip(rollout.total_lengths, rollout.response_lengths, per_sample)):
                rolled[i, total - response - 1:total - 1] = v.to(device, torch.float32)
            out[key] = rolled
        return out

    def alignment(self, knobs: dict[str, Any], tp: int, cp: int) -> int:
        """Each sequence's alignment, as _prepare_mb_list computes it."""
        align = tp * cp * 2 if cp > 1 else tp
        if knobs.get("enable_fp8"):
            align = math.lcm(align, module_constants(self.src / CONSTANTS_FILE, (FP8_ALIGNMENT,))[FP8_ALIGNMENT])
        return align

    def micro_batches(self, rollout: Rollout, values: dict[str, list[torch.Tensor]] | None = None) -> Any:
        """AReaL's padded MicroBatchList for the batch: one micro-batch, packed and padded by AReaL
        (``values``: per-token inputs of the batch, see :meth:`batch`)."""
        return self.pack(self.batch(rollout, values), rollout.knobs)

    def pack(self, batch: dict[str, torch.Tensor], knobs: dict[str, Any]) -> Any:
        """A ``[B, S]`` batch as one of AReaL's padded micro-batches: amend_position_ids ->
        pack_tensor_dict -> MicroBatchList -> pad_mb_list, as _prepare_mb_list calls them."""
        from megatron.core import parallel_state as mpu

        f = self.functions()
        batch = f["amend_position_ids"](dict(batch))  # as _prepare_mb_list does for a text model
        packed = f["pack_tensor_dict"](dict(batch))
        n = int(batch["attention_mask"].shape[0])
        lengths = batch["attention_mask"].sum(-1)
        spec = types.SimpleNamespace(n_mbs=1, max_tokens_per_mb=knobs.get("max_tokens_per_mb"))
        mb_list = f["MicroBatchList"](data=batch, mb_spec=spec, mbs=[packed], group_lens=[int(lengths.sum())],
                                      forward_indices=list(range(n)), backward_indices=list(range(n)))
        align = self.alignment(knobs, mpu.get_tensor_model_parallel_world_size(),
                               mpu.get_context_parallel_world_size())
        aligned = {"seq_align_to": align} if self.facts["seq_align_to"] else \
            {"align_sequences": True, "align_to_multiple_of": align}
        return f["pad_mb_list"](mb_list, pad_value=0.0, pad_to_maximum=bool(knobs.get("pad_to_maximum")),
                                **aligned)

    def local_tokens(self, rollout: Rollout) -> torch.Tensor:
        padded = self.micro_batches(rollout).padded_mbs[0]
        return self.functions()[PREPROCESS](padded["input_ids"], padded["cu_seqlens"])[0]

    def model_inputs(self, rollout: Rollout) -> dict[str, Any]:
        """The sequence boundaries the model's attention gets: the PackedSeqParams that
        preprocess_packed_seqs_context_parallel builds from pad_mb_list's padded micro-batch."""
        padded = self.micro_batches(rollout).padded_mbs[0]
        params = self.functions()[PREPROCESS](padded["input_ids"], padded["cu_seqlens"])[1]
        return {"cu_seqlens": params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None
                else params.cu_seqlens_q}

    def release(self) -> None:
        self._fns = None


# what reassemble_cp_packed_logprobs reads of torch.distributed.nn.functional, gloo-safe (cp_all_gather=shardcheck)
GLOO_SAFE_DIST_F = types.SimpleNamespace(all_gather=gloo_safe_all_gather)


def _one_step_per_micro_batch(*, forward_step_func: Callable[..., Any], data_iterator: Any, model: Any,
                              num_microbatches: int, forward_only: bool, **_: Any) -> None:
    """Stands in for megatron's no-pipelining schedule (get_forward_backward_func() with pp = 1):
    each micro-batch's forward step, then its loss_func on the output. Its backward is the
    harness's: it differentiates the log-probs the loss was handed."""
    for _ in range(num_microbatches):
        output, loss_func = forward_step_func(data_iterator, model)
        loss_func(output)


class _Model:
    """Stands in for the Megatron model: returns the harness's logits ``[1, T_local, V/tp]`` for the
    rows it is handed, having checked they are the rows those logits were laid out for."""

    def __init__(self, logits: torch.Tensor, rows: torch.Tensor) -> None:
        self.logits, self.rows = logits, rows

    def __call__(self, input_ids: torch.Tensor, **_: Any) -> torch.Tensor:
        if not torch.equal(input_ids.reshape(-1).cpu(), self.rows.reshape(-1).cpu()):
            raise ValueError("shardcheck's model stand-in was handed input_ids other than the rows its logits were "
                             "laid out for (AReaL's forward step packed the batch otherwise than its data path)")
        return self.logits


class LossRecorder:
    """Stands in for AReaL's loss behind ``_compute_logprobs_and_loss``: keeps the log-probs and
    entropy it is handed and returns 0. It checks what AReaL's own losses assume of them: one
    value per token of the inputs they come with (``ppo_actor_loss_fn`` combines the log-probs
    elementwise with ``inputs["logprobs"]``, the advantages and ``loss_mask``)."""

    def __init__(self) -> None:
        self.seen: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]] = []

    def __call__(self, logprobs: torch.Tensor, entropy: torch.Tensor, inputs: dict[str, Any], **_: Any
                 ) -> torch.Tensor:
        for key in ("logprobs", "advantages", "loss_mask"):
            if tuple(logprobs.shape) != tuple(inputs[key].shape):
                raise ValueError(f"AReaL's loss_fn was handed log-probs of shape {tuple(logprobs.shape)} with "
                                 f"inputs[{key!r}] of shape {tuple(inputs[key].shape)}: its PPO loss "
                                 "(ppo_actor_loss_fn) combines them elementwise")
        self.seen.append((logprobs, entropy, inputs))
        return logprobs.sum() * 0.0


def ppo_loss_weight(inputs: dict[str, Any]) -> torch.Tensor:
    """The PPO actor's loss_weight_fn (``lambda x: x["loss_mask"].count_nonzero()``)."""
    return inputs["loss_mask"].count_nonzero()


class ArealEnginePath:
    """MegatronEngine's log-prob call sites on AReaL's packed micro-batch (see the module docstring)."""

    def __init__(self, src: Path, facts: dict[str, Any], data: ArealDataPath, logprob_functions: dict[str, Any],
                 dist_f: Any, methods: tuple[str, ...] = ENGINE_METHODS, schedule: Callable[..., Any] | None = None,
                 extra: dict[str, Any] | None = None, off_path: tuple[str, ...] = ()) -> None:
        """``methods``: the engine's methods compiled (besides its log-prob call sites, what a
        caller of them needs); ``schedule`` stands in for get_forward_backward_func()'s schedule
        (default: one forward step per micro-batch); ``extra`` / ``off_path``: what else they read."""
        from megatron.core import parallel_state as mpu
        from megatron.core.packed_seq_params import PackedSeqParams

        self.data, self.facts = data, facts
        cp_path = src / data.facts["cp_file"]
        present = _top_level(_parse(cp_path))
        names = [n for n in (PREPROCESS, "postprocess_packed_seqs_context_parallel",
                             "split_packed_seqs_for_context_parallel", "_build_cp_reassemble_indices", REASSEMBLE,
                             "packed_context_parallel_forward") if n in present]
        cp = compile_alone(cp_path, names, {"torch": torch, "dist": dist, "dist_F": dist_f, "mpu": mpu,
                                            "PackedSeqParams": PackedSeqParams,
                                            **module_constants(cp_path, ("_VLM_FORWARD_KEYS",))})
        fns = data.functions()
        given = {"torch": torch, "functools": functools, "mpu": mpu, "unpad_logits": fns["unpad_logits"],
                 "get_forward_backward_func": lambda: schedule or _one_step_per_micro_batch,
                 "trace_scope": lambda *a, **k: contextlib.nullcontext(), **logprob_functions,
                 **{n: cp[n] for n in names}, **(extra or {})}
        self.methods = compile_methods(src / ENGINE_FILE, ENGINE_CLASS, methods, given, TREE_TRAINING + off_path)
        self.reorder = compile_alone(src / TRAIN_ENGINE_FILE, ["reorder_and_pad_outputs"], {
            "torch": torch, **{n: fns[n] for n in ("unpack_sequence", "reorder_list",
                                                   "pad_and_stack_tensors_along_first_dim") if n in fns}}
        )["reorder_and_pad_outputs"]

    def _engine(self, logits: torch.Tensor, rows: torch.Tensor, temperature: float) -> Any:
        """The engine object the methods read: its config's temperature, one model chunk."""
        engine = types.SimpleNamespace(config=types.SimpleNamespace(temperature=temperature, is_critic=False),
                                       enable_tree_training=False, is_vision_model=False,
                                       model=[_Model(logits, rows)], _ensure_ready=lambda: None)
        for name, fn in self.methods.items():  # a staticmethod (_normalize_batch_input) takes no engine
            setattr(engine, name, fn.__func__ if isinstance(fn, staticmethod) else types.MethodType(fn, engine))
        return engine

    def train(self, logits: torch.Tensor, rows: torch.Tensor, rollout: Rollout, temperature: float
              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """train_batch's path: what AReaL's loss receives (log-probs, entropy, its inputs)."""
        mb_list = self.data.micro_batches(rollout)
        engine = self._engine(logits, rows, temperature)
        recorder = LossRecorder()
        # train_batch all-reduces the weight over DP (+CP); the scale it sets is not what is checked
        total = ppo_loss_weight(mb_list.mbs[0])

        def process_output(output: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
            return engine._compute_logprobs_and_loss(output, inputs, recorder, ppo_loss_weight, total)

        engine.forward_backward_batch(mb_list, process_output, forward_only=False)
        if not recorder.seen:
            raise ValueError("AReaL's _compute_logprobs_and_loss skipped the micro-batch (its loss weight is 0)")
        return recorder.seen[0]

    def forward(self, logits: torch.Tensor, rows: torch.Tensor, rollout: Rollout, temperature: float
                ) -> torch.Tensor:
        """forward_batch's path (compute_logp: the reference model, the proximal log-probs): the
        ``[B, S]`` log-probs it returns (row p of a sequence scoring token p + 1)."""
        mb_list = self.data.micro_batches(rollout)
        engine = self._engine(logits, rows, temperature)
        outputs: list[torch.Tensor] = []

        def process_output(output: torch.Tensor, inputs: dict[str, Any]) -> None:
            outputs.append(engine._compute_forward_result(output, inputs))

        engine.forward_backward_batch(mb_list, process_output, forward_only=True)
        return self.reorder(outputs, list(rollout.total_lengths), mb_list, torch.cat)
