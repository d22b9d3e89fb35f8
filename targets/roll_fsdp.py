"""alibaba/ROLL's FSDP2 strategy's log-prob and entropy path, with Ulysses sequence parallelism, from a
source checkout: ``--target roll:fsdp``.

What runs is ROLL's own code, from the checkout:

- ``FSDP2InferStrategy``'s methods ``get_feature_on_cp_rank``, ``op_compute_log_probs`` and
  ``op_compute_entropy`` (``roll/distributed/strategy/fsdp2_strategy.py``; ``FSDP2TrainStrategy``
  inherits them), compiled alone (their path and line numbers kept);
- what they call: ``log_probs_from_logits`` and ``entropy_from_logits`` (``roll/utils/functionals.py``,
  compiled alone: the module imports tensordict, ROLL's configs and its logger, which writes log
  files on import), ``ulysses_gather`` (``roll/utils/context_parallel/autograd_gather.py``) and
  ``get_ulysses_group`` / ``set_upg_manager`` (``.../context_parallel/globals.py``), those two files
  imported from the checkout as they are (they import torch alone; their package ``__init__``
  imports transformers' attention and is not run).

``op_compute_entropy`` imports ``entropy_from_logits`` inside itself (``from roll.utils.functionals
import ...``): its namespace's ``__import__`` hands that statement the compiled function of that
file (the module is not imported); any other import goes to Python's.

The rows are ROLL's own (the target's data path, :class:`RollFSDPDataPath`): the rollout batch
right-padded with 0 to one sequence length, as ``postprocess_generate`` leaves it (prompt and
response moved left, ``attention_mask`` and ``response_mask`` over them), then, at a Ulysses size
cp > 1, sliced by ROLL's ``get_feature_on_cp_rank`` as ``_fsdp2_forward`` slices what it hands the
model: cp contiguous slices of the sequence dimension, slice r on CP rank r, every sample of the
batch on every rank (``[B, S / cp]``). The harness learns that layout through its position trace
and hands each rank's logits in those rows. ROLL pads to ``sequence_length`` (its config, which
``get_feature_on_cp_rank`` asserts cp divides); the adapter's length is the smallest it accepts:
the longest sample rounded up to a multiple of cp (``postprocess_generate`` itself is not run:
its ``DataProto`` imports ray).

The Ulysses group is ROLL's own: ``set_upg_manager(ulysses_size=cp, rank, world_size)``, as
``_prepare_fsdp2_model`` calls it, builds it once per world through the harness's
``framework_groups``, which checks it holds the harness's sp group. ``PROCESS_GROUP_MANAGER`` is
process-wide: ``compute`` sets it to this scenario's group and size (what ``set_upg_manager``
leaves) and restores it after. The strategy object is not built (its ``__init__`` and
``_prepare_fsdp2_model`` build the model, tokenizer and optimizer): the methods run on an object
holding ``worker.rank_info.cp_size`` / ``cp_rank`` with ROLL's arithmetic for them
(``fsdp2_strategy.py:817-820``: ``cp_rank = global_rank % cp_size``, written here).

The call is the workers': ``op_compute_log_probs(logits, input_ids, attention_mask=response_mask)``
and, with entropy, ``op_compute_entropy`` on the same logits (``base_worker.forward_func_log_probs``,
``rlvr/actor_worker.loss_func``: with its gradient for ``entropy_coef > 0``, the loss's term; at 0 the
metric, under no_grad), under the autocast ``forward_step`` / ``train_step`` enter (``param_dtype``:
the logits' dtype where it is bfloat16 or float16; none for float32). Each CP rank gets the whole
gathered ``[B, S - 1]`` output (``ulysses_gather``, whose backward scales the gradient by cp and
slices it: the harness's contract for the sp layouts); the response tokens are cut from it as
ROLL's losses read them (``response_mask[:, 1:]``: response token k of a sample at column
prompt - 1 + k).

Skipped, each with its reason: TP (ROLL's FSDP2 strategy computes log-probs on the whole
vocabulary), Megatron's CP layouts and packing (thd, zigzag, all-gather: its FSDP2 path hands the
model the padded batch), ring attention, a temperature (its FSDP2 log-probs take none), a negative
``entropy_coef``, replayed keep sets, top-k / top-p. Not reached: the model's forward (the Ulysses
attention patch's all-to-all), the VLM path (sliced after the embedding), the loss's token counts
(``forward_step`` divides ``batch_num_tokens`` by cp) and FSDP's gradient reduction.
"""

from __future__ import annotations

import ast
import builtins
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from shardcheck.errors import BadInput
from shardcheck.scenarios.scenario import Scenario
from shardcheck.targets.base import Capabilities, Knob, RankInputs, RankOutputs, Rollout
from shardcheck.targets.checkout import CheckoutTarget, PreparedInputsPath
from shardcheck.targets.compiled import compile_alone
from shardcheck.targets.roll import (ENTROPY_COEF_WHY, FRAMEWORK, _share, methods_alone)

STRATEGY_FILE = Path("roll/distributed/strategy/fsdp2_strategy.py")
FUNCTIONALS_FILE = Path("roll/utils/functionals.py")
GATHER_FILE = Path("roll/utils/context_parallel/autograd_gather.py")
GLOBALS_FILE = Path("roll/utils/context_parallel/globals.py")
GATHER_MODULE = "roll.utils.context_parallel.autograd_gather"
GLOBALS_MODULE = "roll.utils.context_parallel.globals"
FUNCTIONALS_MODULE = "roll.utils.functionals"
CLASS = "FSDP2InferStrategy"
METHODS = ("get_feature_on_cp_rank", "op_compute_log_probs", "op_compute_entropy")
FUNCTIONS = ("log_probs_from_logits", "entropy_from_logits")

TP_WHY = ("ROLL's FSDP2 strategy computes its log-probs and entropy on the whole vocabulary (log_probs_from_logits, "
          "entropy_from_logits): it has no vocab-parallel code")
CP_WHY = ("ROLL's FSDP2 strategy's sequence parallelism is Ulysses (layout ulysses): it has no Megatron context "
          "parallelism")
NO_PACKING_WHY = ("ROLL's FSDP2 strategy hands the model the padded batch (sliced along the sequence under Ulysses): "
                  "it packs no sequences")
LAYOUT_WHY = (("thd", NO_PACKING_WHY), ("zigzag", CP_WHY), ("allgather", CP_WHY),
              ("ring", "ring attention is OpenRLHF's split; ROLL's FSDP2 strategy slices with Ulysses (layout ulysses)"))
TEMPERATURE_WHY = ("ROLL's FSDP2 strategy divides the logits by no temperature (op_compute_log_probs and "
                   "op_compute_entropy take none, and its workers pass the model's logits as they are)")
NO_STRATEGY_WHY = "has no FSDP2 strategy with Ulysses sequence parallelism to check"


def _rule(scenario: Scenario) -> str | None:
    if scenario.temperature != 1.0:
        return TEMPERATURE_WHY
    if scenario.with_entropy and scenario.entropy_coef < 0:
        return ENTROPY_COEF_WHY
    return None


def sequence_length(total_lengths: list[int], cp: int) -> int:
    """The padded batch's length: the longest sample rounded up to a multiple of cp (ROLL's
    ``sequence_length`` is a config that ``get_feature_on_cp_rank`` asserts cp divides)."""
    return -(-max(total_lengths) // cp) * cp


def padded_batch(tokens: list[torch.Tensor], total_lengths: list[int], response_lengths: list[int],
                 length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``input_ids``, ``attention_mask`` and ``response_mask`` ``[B, length]`` as
    ``postprocess_generate`` leaves them: each sample moved left, right-padded with 0 (the
    docstring of ``op_compute_log_probs``: input_ids [[p, p, r, r, r, 0, 0]], response_mask
    [[0, 0, 1, 1, 1, 0, 0]])."""
    device = tokens[0].device
    ids = torch.zeros(len(tokens), length, dtype=torch.int64, device=device)
    attention_mask = torch.zeros_like(ids)
    response_mask = torch.zeros_like(ids)
    for i, (t, total, response) in enumerate(zip(tokens, total_lengths, response_lengths)):
        ids[i, :total] = t[:total]
        attention_mask[i, :total] = 1
        response_mask[i, total - response:total] = 1
    return ids, attention_mask, response_mask


def has_ulysses_strategy(src: Path) -> bool:
    """Whether the checkout's FSDP2 strategy has the methods checked and the Ulysses gather."""
    tree = FRAMEWORK.parse(src, STRATEGY_FILE)
    if tree is None or FRAMEWORK.parse(src, GATHER_FILE) is None:
        return False
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == CLASS), None)
    have = {n.name for n in getattr(cls, "body", []) if isinstance(n, ast.FunctionDef)}
    return set(METHODS) <= have


class RollFSDPDataPath(PreparedInputsPath):
    """ROLL's FSDP2 rows: the batch right-padded to one sequence length, sliced by
    ``get_feature_on_cp_rank`` (compiled alone) at a Ulysses size above 1, as ``_fsdp2_forward``
    slices what it hands the model. The Ulysses size and rank are the harness's sp group's
    (megatron's CP group under the sp layouts: the data path is handed no RankInputs); ROLL's own
    group, built in ``compute``, is checked to hold the same ranks."""

    name = f"{STRATEGY_FILE}:{CLASS}.get_feature_on_cp_rank"

    def __init__(self, target: "RollFSDPTarget") -> None:
        super().__init__()
        self.target = target

    def knobs(self) -> dict[str, Knob]:
        return {}  # ROLL's sequence_length: the smallest it accepts (the module docstring)

    def builds(self, scenario: Any) -> str | None:
        return None  # bshd and ulysses: every layout the target runs

    def prepare(self, rollout: Rollout) -> dict[str, Any]:
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        cp = mpu.get_context_parallel_world_size() if rollout.layout == "ulysses" else 1
        length = sequence_length(list(rollout.total_lengths), cp)
        ids, attention_mask, _ = padded_batch(list(rollout.tokens), list(rollout.total_lengths),
                                              list(rollout.response_lengths), length)
        if cp == 1:  # _fsdp2_forward slices only at cp_size > 1
            return {"input_ids": ids}
        strategy = self.target.strategy(cp, dist.get_rank() % cp)
        with torch.no_grad():
            features = strategy.get_feature_on_cp_rank(ids, attention_mask, None)
        return {"input_ids": features["input_ids"]}


class RollFSDPTarget(CheckoutTarget):
    """alibaba/ROLL's FSDP2 strategy (op_compute_log_probs / op_compute_entropy with ulysses_gather, compiled
    alone) on its own rows: the padded batch sliced along the sequence by get_feature_on_cp_rank"""

    framework = FRAMEWORK
    name = "roll:fsdp"
    framework_files = (str(STRATEGY_FILE), str(FUNCTIONALS_FILE), str(GATHER_FILE), str(GLOBALS_FILE))

    def __init__(self, src: str | None = None) -> None:
        super().__init__(src)
        if not has_ulysses_strategy(self.src):
            raise BadInput(f"ROLL at {self.short()} {NO_STRATEGY_WHY}: {STRATEGY_FILE} with {CLASS}."
                           f"{', '.join(METHODS)} and {GATHER_FILE} (ROLL v0.2.0, 3077befc, on)")
        self.capabilities = Capabilities(
            layouts=frozenset({"bshd", "ulysses"}), entropy=True, tp_sizes=frozenset({1}), cp_sizes=frozenset({1}),
            layout_reasons=LAYOUT_WHY, rule=_rule,
            reasons=(("tp", TP_WHY), ("cp", CP_WHY),
                     ("sampling", "ROLL's FSDP2 strategy applies no top-k / top-p filter to the training logits"),
                     ("replay_keep", "ROLL's FSDP2 strategy replays no top-p / top-k keep sets")))
        self.data_path = RollFSDPDataPath(self)
        self._strategy_class: Any = None
        self._globals: Any = None

    def forget(self) -> None:
        self._strategy_class = None
        self._globals = None

    def description(self) -> dict[str, Any]:
        return {"code": f"{STRATEGY_FILE}:{CLASS}.{', .'.join(METHODS)} and {FUNCTIONALS_FILE.name}:"
                        f"{', '.join(FUNCTIONS)}, compiled alone; {GATHER_FILE.name}:ulysses_gather and "
                        f"{GLOBALS_FILE.name}:set_upg_manager / get_ulysses_group, imported from the checkout",
                "call": "op_compute_log_probs then op_compute_entropy on the same logits with response_mask, under "
                        "forward_step's autocast (bfloat16 / float16 logits), as ROLL's workers call them",
                "data_path": "the batch right-padded to the longest sample rounded up to a multiple of cp (ROLL's "
                             "sequence_length, a config), sliced by get_feature_on_cp_rank",
                "groups": "ROLL's set_upg_manager builds the Ulysses group (through the harness's framework_groups, "
                          "checked against its sp group); PROCESS_GROUP_MANAGER set to it during compute",
                "strategy": "an object holding worker.rank_info.cp_size / cp_rank (cp_rank = global rank % cp, "
                            "fsdp2_strategy.py:817-820, written by the adapter)",
                "stand_in": "op_compute_entropy's `from roll.utils.functionals import entropy_from_logits` is handed "
                            "the compiled function of that file (its module imports tensordict and ROLL's configs)"}

    def _load(self) -> Any:
        """The strategy's methods, compiled once, with what they call."""
        if self._strategy_class is not None:
            return self._strategy_class
        src = self.src
        functions = compile_alone(src / FUNCTIONALS_FILE, FUNCTIONS, {"torch": torch, "F": torch.nn.functional})
        gather = self.import_module(GATHER_MODULE)
        self._globals = self.import_module(GLOBALS_MODULE)
        functionals = SimpleNamespace(**{n: functions[n] for n in FUNCTIONS})

        def roll_import(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
            # op_compute_entropy's own import of entropy_from_logits: the function compiled from that file
            if name == FUNCTIONALS_MODULE and level == 0:
                return functionals
            return builtins.__import__(name, globals, locals, fromlist, level)

        self._strategy_class = methods_alone(
            src / STRATEGY_FILE, CLASS, METHODS,
            {"torch": torch, "log_probs_from_logits": functions["log_probs_from_logits"],
             "ulysses_gather": gather.ulysses_gather, "get_ulysses_group": self._globals.get_ulysses_group,
             "logger": logging.getLogger("roll.distributed.strategy.fsdp2_strategy"),
             "__builtins__": {**vars(builtins), "__import__": roll_import}})
        return self._strategy_class

    def strategy(self, cp_size: int, cp_rank: int) -> Any:
        """A strategy object holding what the methods read: ``worker.rank_info``'s CP size and rank."""
        strategy = self._load()()
        strategy.worker = SimpleNamespace(rank_info=SimpleNamespace(cp_size=cp_size, cp_rank=cp_rank))
        return strategy

    def _ulysses_group(self, inputs: RankInputs) -> Any:
        """ROLL's Ulysses group for this world and size: ``set_upg_manager`` (its own lines, as
        ``_prepare_fsdp2_model`` calls it), once, through the harness's framework_groups."""
        import torch.distributed as dist

        manager = self._globals

        def build() -> Any:
            manager.set_upg_manager(ulysses_size=inputs.sp_size, rank=dist.get_rank(), world_size=dist.get_world_size())
            return manager.get_ulysses_group()

        return inputs.framework_groups(("roll:fsdp", str(self.src), inputs.sp_size), build, lambda g: {"sp": g})

    def compute(self, inputs: RankInputs) -> RankOutputs:
        import torch.distributed as dist

        self._load()
        cp = inputs.sp_size if inputs.layout == "ulysses" else 1
        group = self._ulysses_group(inputs) if cp > 1 else None
        strategy = self.strategy(cp, dist.get_rank() % cp)
        ids, _, response_mask = padded_batch(inputs.tokens, inputs.total_lengths, inputs.response_lengths,
                                             sequence_length(inputs.total_lengths, cp))
        manager = self._globals.PROCESS_GROUP_MANAGER
        saved = (manager.ulysses_group, manager.ulysses_size)
        manager.ulysses_group, manager.ulysses_size = (group, cp) if cp > 1 else saved
        dtype = inputs.logits.dtype
        autocast = torch.autocast(device_type=inputs.logits.device.type, dtype=dtype,
                                  enabled=dtype in (torch.bfloat16, torch.float16))
        try:
            with autocast:
                out = strategy.op_compute_log_probs(logits=inputs.logits, input_ids=ids, attention_mask=response_mask)
                entropy = None
                if inputs.with_entropy:  # after the log-probs, on the same logits, as ROLL's workers call it
                    with torch.enable_grad() if inputs.entropy_coef > 0 else torch.no_grad():
                        entropy = strategy.op_compute_entropy(logits=inputs.logits, attention_mask=response_mask)
        finally:
            manager.ulysses_group, manager.ulysses_size = saved
        batch = list(range(len(inputs.tokens)))
        return RankOutputs(_share(inputs, batch, out), None if entropy is None else _share(inputs, batch, entropy))
