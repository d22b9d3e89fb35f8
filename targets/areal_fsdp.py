"""AReaL's FSDP engine's log-prob and entropy path, with Ulysses sequence parallelism and
vocabulary-parallel TP, from a source checkout: ``--target areal:fsdp``.

What runs is AReaL's own code, from the checkout: the methods of ``FSDPEngine`` between the
micro-batch and the loss (``_prepare_mb_inputs``, ``_sp_all_gather``, ``_get_vocab_min_max_logits``,
``_compute_logprobs_entropy``, ``_compute_logprobs``, ``_compute_values``,
``_compute_logprobs_and_loss``, ``_compute_forward_result``) and the file's ``FSDPTrainContext``,
compiled alone from ``areal/engine/fsdp_engine.py`` (its path and line numbers kept: tracebacks
and coverage name AReaL's lines). The module around them imports peft, transformers, torchdata and
AReaL's whole training stack; every name the methods read from outside themselves is bound as the
file's own imports bind it: ``torch``, ``dist_F`` (torch.distributed.nn.functional),
``ulysses_pad``, ``ulysses_pad_and_slice_inputs`` and ``ulysses_prepare_inputs`` (AReaL's
``areal/models/fsdp/ulysses.py``, imported from the checkout: torch only), ``gather_logprobs`` and
``gather_logprobs_entropy`` (``areal.utils.functional`` re-exports them from
``areal/utils/functional/vocab_parallel.py``; compiled alone from that file, as the ``areal``
target does, since the package's ``__init__`` imports the config system: the module's NPU check
and the torch.compile of its tp = 1 helpers are not run, they run eagerly). The tree-training
names (``gather_packed_tree_*``) are read only on ``enable_tree_training``'s branch, which is off:
they are bound to a function that raises, naming itself. A name the file does not import refuses
the checkout in one line; nothing is guessed.

``train_batch``'s sequence is followed for one micro-batch: ``forward_backward_batch`` calls
``_prepare_mb_inputs(mb_item)`` (with sp > 1: ``ulysses_pad_and_slice_inputs`` on the packed ids
and positions, then ``ulysses_prepare_inputs``: the labels ``rolled_input_ids`` rolled over the
whole padded micro-batch, then padded and sliced), the model (here: the harness's logits for this
rank, ``outputs.logits.squeeze(0)``), then ``train_batch``'s ``process_output``:
``_compute_logprobs_and_loss`` with ``loss_multiplier`` = dp size (1). That computes the local
log-probs and entropy with ``gather_logprobs_entropy`` (``tp_group`` the TP group at tp > 1, as
``ColwiseParallel``'s lm_head hands each TP rank its vocabulary shard), gathers them over the sp
group with ``_sp_all_gather`` (``dist_F.all_gather``, whose backward sums over the group: the
harness's contract for the sp layouts, its loss divided by sp), trims ``[:-ulysses_pad_size]``
then ``[:-pad_length]``, and hands them to the loss: a recorder of what AReaL hands it (its
result, scaled by AReaL, is dropped; the harness takes its own loss over the recorded values).
``--target-opt path=forward`` runs ``forward_batch``'s ``process_output`` instead
(``compute_logp``: ``_compute_forward_result`` -> ``_compute_logprobs``, log-probs only; AReaL runs
it under no_grad, its gradient is checked too).

The micro-batch is built as ``_prepare_mb_list`` hands it (``MicroBatchItem``'s fields read:
``padded_mb``, ``orig_mb``, ``padding_length``): the packed samples (``input_ids``,
``position_ids`` restarting at each sample as ``amend_position_ids`` makes them, ``loss_mask`` over
the response tokens, ``cu_seqlens``, ``max_seqlen``), ``[1, T]``, with ``padding_length`` 0: the
harness's ``ulysses`` layout pads the packed sequence only to a multiple of sp, which is what
AReaL's Ulysses pad does; AReaL's page pad (``pad_mb_list``, to a multiple of 256 tokens) is not
applied (it would make every power-of-two sp's Ulysses pad 0).

The rows are AReaL's own: the target's data path (:class:`ArealFSDPDataPath`) runs the same
``_prepare_mb_inputs`` on the rollout (the position-encoded one, then the real one), with the
Ulysses group set from megatron's CP group (the harness's sp group) and restored, and hands the
harness the ``input_ids`` (and ``position_ids``) it gives this rank's model; the harness learns
the layout from them (its position trace), and the logits arrive in those rows. The inline era
has no such function (its slicing is inline in ``forward``): there the harness lays the rows out.

The engine object is not built (its ``__init__`` and ``initialize`` build the model and the
optimizer): the methods run on an object holding what they read: what ``create_process_group``
sets, ``config`` (temperature, is_critic False), ``is_vision_model`` False,
``enable_tree_training`` False. The process groups are AReaL's own: ``create_process_group``'s
lines that build them (``self.parallel_helper = ParallelHelper.from_parallel_strategy(...)``,
``world_mesh``, ``dp_group``, ``sp_group = world_mesh["sp"]``, ``mp_group = world_mesh["sp_tp"]``;
its other lines start the world, a gloo group, a logger and a warm-up) compiled alone from the
engine file, on ``ParallelHelper`` compiled alone from its file (``build_mesh``:
``init_device_mesh(current_platform.device_type, (dp, sp, tp), ("dp", "sp", "tp"))`` and its
``_flatten``'s) and AReaL's ``FSDPParallelStrategy`` (compiled alone from
``areal/api/alloc_mode.py``, as ``_make_parallel_strategy`` makes it). They run once per world and
layout through the harness's ``framework_groups``, which checks the mesh's dp, sp and tp groups
(``parallel_helper.tp_group``, ``world_mesh["tp"]``: the vocabulary-parallel group the log-prob
path reads) hold the harness's ranks (TP fastest, as megatron orders them). ``current_platform``
is a stand-in whose ``device_type`` is the world's (:data:`PLATFORM_WHY`). The Ulysses group is
set as ``_ensure_ready`` sets it (``set_ulysses_sequence_parallel_group(self.sp_group)`` at
sp > 1) and restored after. The data path runs ``_prepare_mb_inputs`` on the harness's sp group
(it is handed no ``RankInputs`` to build AReaL's through; the ranks are the same). A checkout
whose ``create_process_group`` builds no ``ParallelHelper`` and the inline era keep the harness's
groups, and say so.

CPU: torch's ``dist_F.all_gather`` backward on gloo (``_AlltoAll``) scatters with the group's rank
as a global ``src``: it fails for an sp group other than global ranks 0..sp-1 (tp 2 x sp 2: sp
groups {0, 2} and {1, 3}); such scenarios are skipped on gloo with that reason (a torch
limitation, not AReaL's). nccl runs them.

Before 0369627d4 (the inline era, from 1388338c7's Ulysses SP; ``areal/utils/ulysses.py``) the
engine had none of these methods: ``FSDPEngine.forward`` packed, sliced, called the model, gathered
the logits over the sp group and ran its ``post_hook`` inline. There ``--target-opt path=forward``
is required and runs ``PPOActor.compute_logp(batch, temperature)`` (``areal/engine/ppo/actor.py``)
-> ``FSDPEngine.forward`` (``@torch.no_grad()`` dropped: its gradient is checked too), each
compiled alone from its file, with ``gather_logprobs`` (``areal/utils/functional.py``) and the data
helpers ``forward`` calls (``pack_tensor_dict``, ``unpack_sequence``, ``reorder_list``,
``pad_and_stack_tensors_along_first_dim``, ``areal/utils/data.py``) compiled alone, the checkout's
ulysses functions, and AReaL's ``FSDPUlyssesShardingManager`` on a mesh stand-in whose ``["sp"]``
group is the rank's sp group. Stand-ins: the model (the harness's logits), ``prepare_mb_list``
(one micro-batch as ``pack_tensor_dict`` / ``unsqueeze_mb_list`` leave it, ``padding_lengths``
[0]) and tensordict's ``TensorDict`` (not installed here: a dict with ``to(device)``). tp 1 only
(no vocab-parallel code then). This era shows 08e703258's fix: at its parent the last sp rank
trimmed its Ulysses pad from its logits before the all-gather (unequal sizes).

Not reached: the model's forward (the Ulysses attention's all-to-all, ``ulyssess_patch.py``),
``_prepare_mb_list`` (AReaL's packing and its page pad), VLMs (``ulysses_pad`` alone), tree
training, the critic's values, the loss functions and their scaling (``areal:loss`` checks the
PPO loss on the Megatron engine), the inline era's train_batch / eval_batch (the model call, the
loss and the optimizer inline; only its forward is driven).
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import sys
import types
from pathlib import Path
from typing import Any

from shardcheck.errors import BadInput
from shardcheck.scenarios.scenario import Scenario
from shardcheck.backend import ranks_on_nccl
from shardcheck.targets.areal import ENTRY_POINTS, FRAMEWORK, VOCAB_PARALLEL_FILE, _closure
from shardcheck.targets.base import (Capabilities, Definitions, Knob, RankInputs, RankOutputs, Rollout,
                                     TargetConfig, layout_description)
from shardcheck.targets.checkout import CheckoutTarget, PreparedInputsPath
from shardcheck.targets.compiled import _not_loaded, compile_alone, module_imports, names_read
from shardcheck.targets.source import functions_named, parameters

ENGINE_FILE = Path("areal/engine/fsdp_engine.py")
ENGINE_PACKAGE = "areal.engine"
# where ulysses.py is: areal/models/fsdp/ since 7927735cb, areal/utils/ before
ULYSSES_FILES = (Path("areal/models/fsdp/ulysses.py"), Path("areal/utils/ulysses.py"))
FUNCTIONAL_MODULE = "areal.utils.functional"
FUNCTIONAL_INIT = Path("areal/utils/functional/__init__.py")
CLASS = "FSDPEngine"
METHODS = ("_prepare_mb_inputs", "_sp_all_gather", "_get_vocab_min_max_logits", "_compute_logprobs_entropy",
           "_compute_logprobs", "_compute_values", "_compute_logprobs_and_loss", "_compute_forward_result")
CONTEXT = "FSDPTrainContext"
# the process-group set-up: FSDPEngine.create_process_group's lines that make AReaL's mesh and take
# the groups from it (the method's other lines start the world, a gloo group, a logger, the warm-up)
SET_UP_METHOD = "create_process_group"
SET_UP_ATTRS = ("parallel_helper", "world_mesh", "dp_group", "sp_group", "mp_group")
HELPER = "ParallelHelper"
ALLOC_FILE = Path("areal/api/alloc_mode.py")
STRATEGIES = ("ParallelStrategy", "FSDPParallelStrategy")
PLATFORM_WHY = ("AReaL's current_platform is made by areal/infra/platforms/__init__.py (areal/platforms before), a "
                "package __init__ the adapter does not run (it imports transformers and detects the accelerator); "
                "its platform classes import areal.utils.logging (colorlog): a stand-in whose device_type is the "
                "world's device type (cpu on gloo, as AReaL's CpuPlatform says; cuda on nccl, as its CudaPlatform)")
# read only where enable_tree_training is on (off here)
OFF_PATH = ("gather_packed_tree_vocab_stats", "gather_packed_tree_logprobs_entropy", "_gather_packed_tree_logprobs")
PATHS = ("train", "forward")
OPTIONS = {
    "path": "train (train_batch's process_output: _compute_logprobs_and_loss, log-probs and entropy; the default) or "
            "forward (forward_batch's: _compute_forward_result, log-probs only, as compute_logp)",
}
GLOO_WHY = ("AReaL's _sp_all_gather calls torch.distributed.nn.functional.all_gather, whose backward on gloo "
            "(_AlltoAll) scatters with the sp group's rank as a global src: it fails for an sp group other than "
            "global ranks 0..sp-1 (tp 2 x sp 2: sp groups {0, 2} and {1, 3}); a torch limitation, not AReaL's; "
            "nccl runs it")
CP_WHY = "AReaL's FSDP engine has no context parallelism: its sequence parallelism is Ulysses (layout ulysses)"
LAYOUT_WHY = (("zigzag", CP_WHY), ("allgather", CP_WHY),
              ("ring", "ring attention's split is OpenRLHF's; AReaL's FSDP engine slices with Ulysses (layout ulysses)"),
              ("bshd", "AReaL's FSDP engine packs every micro-batch (pack_tensor_dict): thd, and ulysses under sp"))


@dataclasses.dataclass(frozen=True)
class ArealFSDPEra:
    """What the checkout offers: ``kind`` "methods" (0369627d4 on: the engine's methods between the
    micro-batch and the loss) or "inline" (before: ``FSDPEngine.forward`` with the model call and
    the Ulysses gather inline, driven through ``PPOActor.compute_logp``); the definitions compiled
    and where its ulysses.py is."""

    kind: str
    methods: tuple[str, ...]
    ulysses_file: str


# the inline era (1388338c7's Ulysses SP until 0369627d4): FSDPEngine.forward, its post_hook
# PPOActor.compute_logp's calc_logprobs, gather_logprobs from areal/utils/functional.py, the data
# helpers forward calls from areal/utils/data.py
ACTOR_FILE = Path("areal/engine/ppo/actor.py")
OLD_FUNCTIONAL_FILE = Path("areal/utils/functional.py")
DATA_FILE = Path("areal/utils/data.py")
DATA_HELPERS = ("pack_tensor_dict", "unpack_sequence", "reorder_list", "pad_and_stack_tensors_along_first_dim")
INLINE_GROUPS_WHY = ("the inline era (before 0369627d4) runs FSDPEngine.forward alone, not the engine's set-up: the "
                     "harness's sp group, as the Ulysses mesh stand-in's")
INLINE_WHY = ("before 0369627d4 AReaL's FSDP engine computes log-probs inline in FSDPEngine.forward (compute_logp's "
              "path); areal:fsdp drives that path there: --target-opt path=forward")


class TensorDict(dict):
    """tensordict's TensorDict as the inline era's forward and pack_tensor_dict use it (tensordict
    is not installed here): a dict of tensors with ``to(device)``; ``batch_size`` kept. At module
    level: the micro-batch list travels through ``dist.all_gather_object`` (pickled)."""

    def __init__(self, source: Any = None, batch_size: Any = None, **items: Any) -> None:
        super().__init__(source or {}, **items)
        self.batch_size = batch_size

    def to(self, device: Any) -> "TensorDict":
        return TensorDict({k: v.to(device) if hasattr(v, "to") else v for k, v in self.items()},
                          batch_size=self.batch_size)


@dataclasses.dataclass
class MicroBatchList:
    """What the inline era's ``prepare_mb_list`` hands ``forward`` (the fields it reads): one
    micro-batch, packed, ``padding_lengths`` [0]."""

    mbs: list
    padded_mbs: list
    padding_lengths: list
    forward_indices: list
    backward_indices: list

    def to(self, device: Any) -> "MicroBatchList":
        moved = lambda m: {k: v.to(device) if hasattr(v, "to") else v for k, v in m.items()}  # noqa: E731
        return dataclasses.replace(self, mbs=[moved(m) for m in self.mbs], padded_mbs=[moved(m) for m in self.padded_mbs])


class _Mesh:
    """The Ulysses device mesh as FSDPUlyssesShardingManager reads it: ``mesh["sp"].get_group()``."""

    def __init__(self, group: Any) -> None:
        self._group = group

    def __getitem__(self, name: str) -> Any:
        return types.SimpleNamespace(get_group=lambda: self._group)


def inline_tree(src: Path) -> ast.FunctionDef | None:
    """The inline era's ``FSDPEngine.forward`` (with ``post_hook`` and the Ulysses gather in it),
    None where the checkout has none."""
    tree = FRAMEWORK.parse(src, ENGINE_FILE)
    cls = next((n for n in getattr(tree, "body", []) if isinstance(n, ast.ClassDef) and n.name == CLASS), None)
    fn = next((f for f in getattr(cls, "body", []) if isinstance(f, ast.FunctionDef) and f.name == "forward"), None)
    if fn is None or "post_hook" not in parameters(fn) or "ulysses_pad_and_slice_inputs" not in ast.unparse(fn):
        return None
    return fn


def engine_tree(src: Path) -> tuple[ast.Module, dict[str, ast.AST]] | None:
    """The engine file and the definitions compiled from it (:data:`METHODS` of FSDPEngine and
    :data:`CONTEXT`); None where one is missing (before 0369627d4 / 79b742c12)."""
    tree = FRAMEWORK.parse(src, ENGINE_FILE)
    if tree is None:
        return None
    top = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    cls = top.get(CLASS)
    found: dict[str, ast.AST] = {}
    for method in METHODS:
        fn = next((f for f in getattr(cls, "body", []) if isinstance(f, ast.FunctionDef) and f.name == method), None)
        if fn is None:
            return None
        found[method] = fn
    if CONTEXT not in top:
        return None
    found[CONTEXT] = top[CONTEXT]
    return tree, found


@dataclasses.dataclass(frozen=True)
class GroupSetUp:
    """AReaL's own process-group set-up, where the checkout has it: ``create_process_group``'s
    lines (``method``: the method with only those statements, line numbers kept) and the file
    defining ``ParallelHelper`` (``helper_file``, as the engine file imports it)."""

    method: ast.FunctionDef
    helper_file: Path

    @property
    def lines(self) -> list[int]:
        return [stmt.lineno for stmt in self.method.body]


def _assigned_self_attr(stmt: ast.stmt) -> str | None:
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        target = stmt.targets[0]
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
            return target.attr
    return None


def group_set_up(src: Path, tree: ast.Module) -> GroupSetUp | str:
    """``create_process_group``'s statements that set :data:`SET_UP_ATTRS` (ParallelHelper's mesh
    and the groups taken from it) and ParallelHelper's file; a sentence saying why not where the
    checkout has no such set-up (the harness's groups are used there)."""
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == CLASS), None)
    fn = next((f for f in getattr(cls, "body", []) if isinstance(f, ast.FunctionDef) and f.name == SET_UP_METHOD),
              None)
    if fn is None:
        return f"{ENGINE_FILE} has no {CLASS}.{SET_UP_METHOD}"
    kept = [stmt for stmt in fn.body if _assigned_self_attr(stmt) in SET_UP_ATTRS]
    if sorted({_assigned_self_attr(stmt) for stmt in kept}) != sorted(SET_UP_ATTRS) or len(kept) != len(SET_UP_ATTRS):
        return f"{CLASS}.{SET_UP_METHOD} does not set {', '.join(SET_UP_ATTRS)} once each"
    helper = next(stmt for stmt in kept if _assigned_self_attr(stmt) == "parallel_helper")
    if HELPER not in ast.unparse(helper.value):
        return f"{CLASS}.{SET_UP_METHOD} does not build its parallel_helper with {HELPER}"
    module, attr = module_imports(tree, ENGINE_PACKAGE).get(HELPER, (None, None))
    if module is None or attr != HELPER or not FRAMEWORK.owns(module):
        return f"{ENGINE_FILE} does not import {HELPER} from AReaL"
    helper_file = Path(*module.split(".")).with_suffix(".py")
    helper_tree = FRAMEWORK.parse(src, helper_file)
    if not any(isinstance(n, ast.ClassDef) and n.name == HELPER for n in getattr(helper_tree, "body", [])):
        return f"{helper_file} defines no {HELPER}"
    method = copy.deepcopy(fn)
    method.body, method.decorator_list = kept, []
    return GroupSetUp(method, helper_file)


@contextlib.contextmanager
def _module_for_dataclasses(rel: Path) -> Any:
    """A module named as compile_alone names the namespace it compiles ``rel`` into, in
    sys.modules while it compiles: ``@dataclass`` looks its class's module up there (and fails on
    none); removed after, nothing of AReaL's left importable."""
    name = f"shardcheck_compiled_{rel.stem}"
    saved = sys.modules.get(name)
    sys.modules[name] = types.ModuleType(name)
    try:
        yield
    finally:
        if saved is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved


def _harness_groups(sp_size: int, tp_size: int, tp_group: Any, sp_group: Any) -> Any:
    """The harness's sp and tp groups as create_process_group leaves them for the methods (a
    ParallelHelper-shaped stand-in): where AReaL's own set-up is not run."""
    helper = types.SimpleNamespace(sp_size=sp_size, tp_size=tp_size, dp_size=1,
                                   tp_group=tp_group if tp_size > 1 else None)
    return types.SimpleNamespace(parallel_helper=helper, sp_group=sp_group if sp_size > 1 else None)


INLINE_LAYOUT_WHY = ("before 0369627d4 AReaL's FSDP engine slices the rows inline in FSDPEngine.forward, between "
                     "prepare_mb_list and the model call (no function of its own to run alone): the harness lays "
                     "out the rows (its ulysses layout) and checks them against the ids forward hands the model")


class ArealFSDPDataPath(PreparedInputsPath):
    """AReaL's FSDP engine's own layout: ``_prepare_mb_inputs`` (compiled alone) on the micro-batch
    ``compute`` builds (packed ``[1, T]``, positions restarting at each sample), with the Ulysses
    group set as ``_ensure_ready`` sets it (megatron's context-parallel group, which under the sp
    layouts is the harness's sp group; none at sp 1) and restored. What it hands the model as
    ``input_ids`` is this rank's rows: ``[1, T]`` packed (thd), or padded to a multiple of sp and
    sliced by ``ulysses_pad_and_slice_inputs`` (ulysses). The inline era has no such function:
    ``builds`` says so and the harness lays the rows out."""

    name = f"{ENGINE_FILE}:{CLASS}._prepare_mb_inputs"

    def __init__(self, target: "ArealFSDPTarget") -> None:
        super().__init__()
        self.target = target

    def knobs(self) -> dict[str, Knob]:
        return {}  # AReaL's page pad (pad_mb_list) is _prepare_mb_list's, not run: no knob

    def builds(self, scenario: Any) -> str | None:
        return INLINE_LAYOUT_WHY if self.target.era.kind == "inline" else None

    def prepare(self, rollout: Rollout) -> dict[str, Any]:
        import torch
        from megatron.core import parallel_state as mpu

        target = self.target
        sp = mpu.get_context_parallel_world_size() if rollout.layout == "ulysses" else 1
        group = mpu.get_context_parallel_group() if sp > 1 else None
        # the harness's sp group (megatron's CP group): the data path is handed no RankInputs to build
        # AReaL's through; compute's framework_groups checks AReaL's holds the same ranks
        engine = target._engine(_harness_groups(sp, 1, None, group), 1.0)
        ulysses = target._ulysses
        mb_item, _ = target.micro_batch(list(rollout.tokens), list(rollout.total_lengths),
                                        list(rollout.response_lengths), rollout.tokens[0].device)
        previous = ulysses.get_ulysses_sequence_parallel_group()
        if group is not None:
            ulysses.set_ulysses_sequence_parallel_group(group)
        try:
            with torch.no_grad():
                model_inputs, _ = engine._prepare_mb_inputs(mb_item)
        finally:
            ulysses.set_ulysses_sequence_parallel_group(previous)
        return model_inputs


# AReaL, its checkout recognised by the FSDP engine's file (the areal target's marker, the Megatron
# engine, came later than the FSDP engine's Ulysses SP)
FSDP_FRAMEWORK = dataclasses.replace(FRAMEWORK, marker=str(ENGINE_FILE))


class ArealFSDPTarget(CheckoutTarget):
    """AReaL's FSDP engine (FSDPEngine's methods between the micro-batch and the loss, compiled alone
    from its file): log-probs and entropy of the rank's Ulysses slice, gathered over the sp group"""

    framework = FSDP_FRAMEWORK
    name = "areal:fsdp"
    # entropy: -sum p log p (_gather_logprobs_entropy / _VocabParallelLogProbsEntropy), the positive sign
    definitions = Definitions()

    def __init__(self, config: TargetConfig) -> None:
        self.path = config.get("path", "train")
        if self.path not in PATHS:
            raise BadInput(f"target 'areal:fsdp': option path={self.path!r}: expected train or forward")
        super().__init__(config.src)
        found = engine_tree(self.src)
        inline = inline_tree(self.src) if found is None else None
        if found is None and inline is None:
            raise BadInput(f"AReaL at {self.short()} has no FSDP engine this target drives: {ENGINE_FILE} with "
                           f"{CLASS}.{', '.join(METHODS)} and {CONTEXT} (they came with 0369627d4 and 79b742c12), "
                           f"or (before) {CLASS}.forward with the Ulysses gather inline")
        ulysses = next((f for f in ULYSSES_FILES if (self.src / f).is_file()), None)
        if ulysses is None:
            raise BadInput(f"AReaL at {self.short()} has no {' or '.join(map(str, ULYSSES_FILES))}")
        self.ulysses_module = str(ulysses.with_suffix("")).replace("/", ".")
        # where AReaL's own set-up builds the groups (GroupSetUp), or why the harness's are used
        self.group_set_up: GroupSetUp | str = INLINE_GROUPS_WHY
        self.strategy_why = ""  # why the strategy is a stand-in, where the checkout has no FSDPParallelStrategy
        if inline is not None:
            if self.path != "forward":
                raise BadInput(f"AReaL at {self.short()}: {INLINE_WHY}")
            self._forward_def = inline
            self.era = ArealFSDPEra("inline", (f"{CLASS}.forward", "PPOActor.compute_logp"), str(ulysses))
            self.framework_files = (str(ENGINE_FILE), str(ulysses), str(OLD_FUNCTIONAL_FILE), str(ACTOR_FILE),
                                    str(DATA_FILE))
        else:
            self._tree, self._defs = found
            fn = functions_named(FRAMEWORK.parse(self.src, VOCAB_PARALLEL_FILE), "gather_logprobs_entropy")
            if not fn or "tp_group" not in parameters(fn[0]):
                raise BadInput(f"AReaL at {self.short()} has no {VOCAB_PARALLEL_FILE} with "
                               "gather_logprobs_entropy(tp_group)")
            self.era = ArealFSDPEra("methods", tuple(f"{CLASS}.{m}" for m in METHODS), str(ulysses))
            self.framework_files = (str(ENGINE_FILE), str(ulysses), str(VOCAB_PARALLEL_FILE))
            self.group_set_up = group_set_up(self.src, self._tree)
            if isinstance(self.group_set_up, GroupSetUp):
                self.framework_files += (str(self.group_set_up.helper_file),)
                alloc = FRAMEWORK.parse(self.src, ALLOC_FILE)
                defined = {n.name for n in getattr(alloc, "body", []) if isinstance(n, ast.ClassDef)}
                if set(STRATEGIES) <= defined:
                    self.framework_files += (str(ALLOC_FILE),)
                else:
                    self.strategy_why = f"{ALLOC_FILE} defines no {' and '.join(STRATEGIES)}"
        forward = self.path == "forward"
        self.capabilities = Capabilities(
            layouts=frozenset({"thd", "ulysses"}), entropy=not forward,
            tp_sizes=frozenset({1}) if inline is not None else None,
            cp_sizes=frozenset({1}), layout_reasons=LAYOUT_WHY, rule=self._rule,
            reasons=(("cp", CP_WHY),
                     ("tp", "before 0369627d4 AReaL's gather_logprobs has no vocab-parallel path (FSDP without TP)"),
                     ("entropy", "the forward path (compute_logp) computes log-probs only"),
                     ("replay_keep", "AReaL normalises over the whole vocabulary: it replays no keep sets"),
                     ("sampling", "AReaL applies no top-k / top-p filter to the training logits")))
        self._engine_cls: Any = None
        self._actor_cls: Any = None
        self._ulysses: Any = None
        self.read_names: list[str] = []
        # per device type: AReaL's set-up compiled with a current_platform of that type, and its strategy
        self._set_up_cls: dict[str, tuple[Any, Any]] = {}
        self.data_path = ArealFSDPDataPath(self)

    @staticmethod
    def _rule(scenario: Scenario) -> str | None:
        if scenario.sp > 1 and scenario.tp > 1 and not ranks_on_nccl():
            return GLOO_WHY
        return None

    # -- loading -----------------------------------------------------------------------------
    def forget(self) -> None:
        self._engine_cls, self._ulysses = None, None
        self._set_up_cls = {}

    def _functions(self) -> dict[str, Any]:
        """gather_logprobs(_entropy), as ``areal.utils.functional`` re-exports them from
        vocab_parallel.py, compiled alone from that file."""
        import functools

        import torch
        import torch.distributed as dist

        init = FRAMEWORK.parse(self.src, FUNCTIONAL_INIT)
        exported = {a.asname or a.name for n in getattr(init, "body", []) if isinstance(n, ast.ImportFrom)
                    and n.module == "areal.utils.functional.vocab_parallel" for a in n.names}
        if not set(ENTRY_POINTS) <= exported:
            raise BadInput(f"AReaL at {self.short()}: {FUNCTIONAL_INIT} does not re-export {', '.join(ENTRY_POINTS)} "
                           f"from {VOCAB_PARALLEL_FILE}")
        tree = FRAMEWORK.parse(self.src, VOCAB_PARALLEL_FILE)
        try:
            return compile_alone(self.src / VOCAB_PARALLEL_FILE, _closure(tree, ENTRY_POINTS),
                                 {"torch": torch, "dist": dist, "functools": functools})
        except LookupError as exc:
            raise BadInput(f"AReaL at {self.short()}: {exc}") from None

    def _load(self) -> Any:
        if self._engine_cls is not None:
            return self._engine_cls
        import __future__
        import builtins
        import importlib
        import symtable

        path = self.src / ENGINE_FILE
        methods = [self._defs[m] for m in METHODS]
        for fn in methods:
            fn.decorator_list = []
        context = self._defs[CONTEXT]
        cls = ast.ClassDef(name=CLASS, bases=[], keywords=[], body=methods, decorator_list=[], type_params=[])
        module = ast.fix_missing_locations(ast.Module(body=[context, cls], type_ignores=[]))
        table = symtable.symtable("from __future__ import annotations\n" + ast.unparse(module), str(path), "exec")
        reads: set[str] = set()
        for child in table.get_children():
            reads |= names_read(child)
        reads |= {s.get_name() for s in table.get_symbols() if s.is_referenced() and s.is_global()}
        reads -= set(dir(builtins)) | {CONTEXT, CLASS, "annotations"}
        imports = module_imports(self._tree, ENGINE_PACKAGE)
        unknown = sorted(n for n in reads if n not in imports)
        if unknown:
            raise BadInput(f"AReaL at {self.short()}: the FSDP engine's methods read {', '.join(unknown)}, which "
                           f"{ENGINE_FILE} does not import (the adapter binds only what the file imports)")
        functions = None
        given: dict[str, Any] = {}
        for name in sorted(reads):
            mod_name, attr = imports[name]
            if name in OFF_PATH:
                given[name] = _not_loaded(name, path)
            elif mod_name == FUNCTIONAL_MODULE and attr in ENTRY_POINTS:
                functions = functions or self._functions()
                given[name] = functions[attr]
            elif FRAMEWORK.owns(mod_name):
                if mod_name != self.ulysses_module:
                    raise BadInput(f"AReaL at {self.short()}: the FSDP engine's methods read {name} from {mod_name}, "
                                   "which the adapter does not load")
                mod = self.import_module(mod_name)
                given[name] = mod if attr is None else getattr(mod, attr)
            else:
                mod = importlib.import_module(mod_name)
                given[name] = mod if attr is None else getattr(mod, attr)
        self.read_names = sorted(reads)
        self._ulysses = self.import_module(self.ulysses_module)
        # a module of its own in sys.modules while the target is loaded: dataclasses resolves
        # FSDPTrainContext's (string) annotations through it
        name = "shardcheck_areal_fsdp_engine"
        holder = types.ModuleType(name)
        holder.__file__ = str(path)
        vars(holder).update(given)
        saved = sys.modules.get(name)
        sys.modules[name] = holder

        def undo() -> None:
            if sys.modules.get(name) is holder:
                if saved is None:
                    del sys.modules[name]
                else:
                    sys.modules[name] = saved

        self.checkout.undo_later(undo)
        code = compile(module, str(path), "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True)
        exec(code, vars(holder))  # noqa: S102 - AReaL's own methods, from its file
        self._engine_cls = vars(holder)[CLASS]
        return self._engine_cls

    def _strategy_cls(self) -> Any:
        """AReaL's FSDPParallelStrategy (with its base ParallelStrategy) compiled alone from
        alloc_mode.py; None where the checkout has none (:attr:`strategy_why`)."""
        import dataclasses as dc

        if self.strategy_why:
            return None
        try:
            with _module_for_dataclasses(ALLOC_FILE):
                return compile_alone(self.src / ALLOC_FILE, STRATEGIES, {"dataclass": dc.dataclass,
                                                                         "field": dc.field})[STRATEGIES[-1]]
        except LookupError as exc:
            raise BadInput(f"AReaL at {self.short()}: {exc}") from None

    def _set_up(self, device_type: str) -> tuple[Any, Any]:
        """``create_process_group``'s lines (a class holding only them) and the strategy class they
        are handed, ParallelHelper compiled alone from its file with ``current_platform`` a stand-in
        of ``device_type`` (:data:`PLATFORM_WHY`), every other name it reads bound as its file's
        imports bind it."""
        if device_type in self._set_up_cls:
            return self._set_up_cls[device_type]
        import importlib

        set_up = self.group_set_up
        assert isinstance(set_up, GroupSetUp)
        helper_tree = FRAMEWORK.parse(self.src, set_up.helper_file)
        node = next(n for n in helper_tree.body if isinstance(n, ast.ClassDef) and n.name == HELPER)
        imports = module_imports(helper_tree, str(set_up.helper_file.parent).replace("/", "."))
        given: dict[str, Any] = {}
        for name in sorted(self._reads(set_up.helper_file, [node])):
            mod_name, attr = imports.get(name, (None, None))
            if name == "current_platform":
                given[name] = types.SimpleNamespace(device_type=device_type)
            elif mod_name is None or FRAMEWORK.owns(mod_name):
                raise BadInput(f"AReaL at {self.short()}: {HELPER} in {set_up.helper_file} reads {name}"
                               f"{f' from {mod_name}' if mod_name else ''}, which the adapter does not give")
            else:
                mod = importlib.import_module(mod_name)
                given[name] = mod if attr is None else getattr(mod, attr)
        try:
            with _module_for_dataclasses(set_up.helper_file):
                helper = compile_alone(self.src / set_up.helper_file, (HELPER,), given)[HELPER]
        except LookupError as exc:
            raise BadInput(f"AReaL at {self.short()}: {exc}") from None
        cls = ast.ClassDef(name=CLASS, bases=[], keywords=[], body=[copy.deepcopy(set_up.method)],
                           decorator_list=[], type_params=[])
        engine = self._compile(self.src / ENGINE_FILE, cls, {HELPER: helper})
        self._set_up_cls[device_type] = (engine, self._strategy_cls())
        return self._set_up_cls[device_type]

    def _groups(self, inputs: RankInputs) -> Any:
        """What ``create_process_group`` leaves on the engine (parallel_helper, world_mesh, dp_group,
        sp_group, mp_group): AReaL's own lines, building ParallelHelper's mesh (dp, sp, tp) once
        per world and layout through the harness's framework_groups, which checks its dp, sp and
        tp groups against the harness's. Where the checkout has no such set-up (the inline era), the
        harness's sp and tp groups on a ParallelHelper-shaped stand-in."""
        if not isinstance(self.group_set_up, GroupSetUp):
            return _harness_groups(inputs.sp_size, inputs.tp_size, inputs.tp_group, inputs.sp_group)
        import torch.distributed as dist

        device_type = inputs.logits.device.type
        set_up_cls, strategy_cls = self._set_up(device_type)
        sp, tp = inputs.sp_size, inputs.tp_size
        dp = dist.get_world_size() // (sp * tp)

        def build() -> Any:
            if strategy_cls is not None:  # what _make_parallel_strategy makes of a ParallelStrategy of these sizes
                strategy = strategy_cls(tensor_parallel_size=tp, context_parallel_size=sp, data_parallel_size=dp)
            else:
                strategy = types.SimpleNamespace(dp_size=dp, cp_size=sp, tp_size=tp, ep_size=1, etp_size=1,
                                                 pp_size=1, world_size=dp * sp * tp)
            built = object.__new__(set_up_cls)
            built.create_process_group(strategy)
            return built

        return inputs.framework_groups(
            ("areal:fsdp", device_type, (dp, sp, tp)), build,
            lambda b: {"dp": b.dp_group, "sp": b.sp_group, "tp": b.parallel_helper.tp_group})

    def _engine(self, groups: Any, temperature: float) -> Any:
        """An engine object holding what ``__init__`` / ``create_process_group`` set that the methods
        read; ``groups`` what create_process_group set (:meth:`_groups`)."""
        engine = object.__new__(self._load())
        for attr in SET_UP_ATTRS:
            setattr(engine, attr, getattr(groups, attr, None))
        engine.config = types.SimpleNamespace(temperature=temperature, is_critic=False)
        engine.is_vision_model = False
        engine.enable_tree_training = False
        return engine

    # -- the report -----------------------------------------------------------------------------
    def description(self) -> dict[str, Any]:
        if self.era.kind == "inline":
            return {"path": self.path,
                    "data_path": layout_description(None, "framework", INLINE_LAYOUT_WHY),
                    "calls": f"{ACTOR_FILE}: PPOActor.compute_logp(batch, temperature) -> {ENGINE_FILE}: "
                             f"{CLASS}.forward (post_hook calc_logprobs: gather_logprobs on the logits gathered over "
                             "the sp group), each compiled alone from its file; @torch.no_grad() dropped (the "
                             "gradient is checked too)",
                    "names_bound": self.read_names,
                    "stand_ins": ["the model (the harness's logits for the rows it is handed)",
                                  "prepare_mb_list (one micro-batch, packed as pack_tensor_dict packs it, "
                                  "padding_lengths [0]: AReaL's page pad not applied)",
                                  "tensordict's TensorDict (a dict with to(device))",
                                  "the Ulysses device mesh (mesh['sp'].get_group(): the sp group) handed to AReaL's "
                                  "FSDPUlyssesShardingManager"],
                    "process_groups": INLINE_GROUPS_WHY,
                    "framework_files": list(self.framework_files)}
        calls = {"train": "_prepare_mb_inputs, the harness's logits as the model's (squeeze(0)), "
                          "_compute_logprobs_and_loss (loss_multiplier 1: the loss's result is dropped) -> _compute_logprobs_entropy "
                          "(gather_logprobs_entropy, _sp_all_gather, [:-ulysses_pad_size]), "
                          "_get_vocab_min_max_logits, [:-pad_length]; the loss a recorder",
                 "forward": "_prepare_mb_inputs, the harness's logits as the model's (squeeze(0)), "
                            "_compute_forward_result -> _compute_logprobs (gather_logprobs, _sp_all_gather, "
                            "[:-ulysses_pad_size]), [:-pad_length]"}[self.path]
        return {"path": self.path, "data_path": layout_description(self.data_path, "framework", ""),
                "calls": f"{ENGINE_FILE}: {CLASS}: {calls}",
                "compiled_alone": [f"{CLASS}.{m}" for m in METHODS] + [CONTEXT],
                "names_bound_from_the_engine_file's_imports": self.read_names,
                "off_path": list(OFF_PATH),
                "ulysses_group": "set_ulysses_sequence_parallel_group(sp group) as _ensure_ready does (sp > 1); "
                                 "restored after",
                **self._groups_description(),
                "micro_batch": "packed [1, T] (input_ids, position_ids per sample, loss_mask, cu_seqlens, "
                               "max_seqlen), padding_length 0 (AReaL's page pad not applied)",
                "entropy": "-sum p log p; detached where the scenario's entropy_coef is 0, as AReaL's losses "
                           "detach it",
                "chunk_size": "AReaL's 1024 (the engine passes none)",
                "not_run": ["vocab_parallel.py's module top level (the NPU check, torch.compile of the tp=1 helpers: "
                            "they run eagerly)", "the package __init__.py files of the modules imported"],
                "framework_files": list(self.framework_files)}

    def _groups_description(self) -> dict[str, Any]:
        set_up = self.group_set_up
        if not isinstance(set_up, GroupSetUp):
            return {"process_groups": f"the harness's sp and tp groups on a ParallelHelper-shaped stand-in: {set_up}"}
        strategy = (f"AReaL's FSDPParallelStrategy (with ParallelStrategy, compiled alone from {ALLOC_FILE}) of "
                    "tensor_parallel_size tp, context_parallel_size sp, data_parallel_size world / (sp x tp), as "
                    "_make_parallel_strategy makes it" if not self.strategy_why else
                    f"{self.strategy_why}: a namespace of the fields ParallelHelper reads (dp_size, cp_size = sp, "
                    "tp_size, ep_size 1, etp_size 1, pp_size 1, world_size)")
        return {"process_groups": f"built by AReaL's own code, once per world and layout through the harness's "
                                  f"framework_groups (which checks its dp, sp and tp groups hold the harness's ranks): "
                                  f"{ENGINE_FILE}: {CLASS}.{SET_UP_METHOD}'s lines {', '.join(map(str, set_up.lines))} "
                                  f"(parallel_helper = {HELPER}.from_parallel_strategy(...), world_mesh, dp_group, "
                                  f"sp_group = world_mesh['sp'], mp_group = world_mesh['sp_tp']) and {set_up.helper_file}: "
                                  f"{HELPER} (compiled alone; world_mesh -> build_mesh -> init_device_mesh(device_type, "
                                  "(dp, sp, tp), ('dp', 'sp', 'tp')) and its _flatten's); the engine's sp_group, "
                                  "parallel_helper and its tp_group (world_mesh['tp']) are those",
                "parallel_strategy": strategy,
                "current_platform": PLATFORM_WHY,
                "not_run_of_create_process_group": "its other lines: init_process_group (the harness's world is up), "
                                                   "the gloo cpu group, the logger, dp_head / dp_rank, "
                                                   "warmup_process_groups",
                "data_path_groups": "the data path's _prepare_mb_inputs (handed no RankInputs) runs on the harness's "
                                    "sp group (megatron's CP group), which framework_groups checks AReaL's matches"}

    # -- the computation -------------------------------------------------------------------------
    @staticmethod
    def _gloo_group_check(group: Any, sp_size: int, tp_size: int) -> None:
        """On gloo, torch's all-gather backward (which AReaL's code calls) runs only on an sp group of
        global ranks 0..sp-1; a data-parallel replica's sp group (a world larger than tp x sp) cannot
        run it. ``group``: the sp group AReaL's all-gather is handed. Said before the all-gather
        runs, naming torch's limitation (a capability rule cannot: it does not see the world's
        size). BadInput: the harness's error (this world cannot run it), never the target's
        finding."""
        import torch.distributed as dist

        if sp_size == 1 or group is None or dist.get_backend(group) != "gloo":
            return
        ranks = dist.get_process_group_ranks(group)
        if sorted(ranks) != list(range(sp_size)):
            raise BadInput(f"not run: this rank's sp group is global ranks {sorted(ranks)}; {GLOO_WHY} (run a "
                           f"world of tp x sp ranks, --nproc {sp_size * tp_size})")

    def compute(self, inputs: RankInputs) -> RankOutputs:
        if self.era.kind == "inline":
            self._gloo_group_check(inputs.sp_group, inputs.sp_size, inputs.tp_size)
            return self._compute_inline(inputs)
        import torch
        import torch.distributed as dist

        # the groups first, on every rank alike (building them is collective, as at AReaL's start-up)
        engine = self._engine(self._groups(inputs), inputs.temperature)
        self._gloo_group_check(engine.sp_group, inputs.sp_size, inputs.tp_size)
        ulysses = self._ulysses
        logits = inputs.logits
        device = logits.device
        lengths, responses = list(inputs.total_lengths), list(inputs.response_lengths)
        # the real rollout the data path laid out (the harness's tokens where it laid none out)
        source = inputs.rollout.tokens if inputs.rollout is not None else inputs.tokens
        mb_item, mb = self.micro_batch(list(source), lengths, responses, device)
        cu = mb["cu_seqlens"]
        # _ensure_ready sets the Ulysses group only at sp > 1
        group = engine.sp_group if engine.parallel_helper.sp_size > 1 else None
        if group is not None and dist.get_rank(group=group) != inputs.sp_rank:
            raise RuntimeError(f"shardcheck's areal:fsdp adapter: sp rank {inputs.sp_rank} is rank "
                               f"{dist.get_rank(group=group)} of its sp group")
        previous = ulysses.get_ulysses_sequence_parallel_group()
        if group is not None:
            ulysses.set_ulysses_sequence_parallel_group(group)
        try:
            model_inputs, ctx = engine._prepare_mb_inputs(mb_item)
            # the rows the logits arrive in (the ones the position trace learned from this same method)
            # must be what the engine hands the model
            inputs.check_model_tokens(model_inputs["input_ids"], "shardcheck's areal:fsdp adapter: AReaL's engine")
            local = logits.squeeze(0)  # forward_backward_batch: outputs.logits.squeeze(0)
            seen: dict[str, Any] = {}
            if self.path == "train":
                def loss_fn(logprobs: Any, entropy: Any, mb_input: Any, **kwargs: Any) -> Any:
                    seen.update(logprobs=logprobs, entropy=entropy)
                    return logprobs.sum() * 0.0

                weight = lambda m: m["loss_mask"].count_nonzero()  # noqa: E731 - the PPO actor's token count
                engine._compute_logprobs_and_loss(local, ctx, loss_fn, weight, weight(mb), loss_multiplier=1)
            else:
                seen["logprobs"] = engine._compute_forward_result(local, ctx)
        finally:
            ulysses.set_ulysses_sequence_parallel_group(previous)
        logprobs, entropy = seen["logprobs"], seen.get("entropy")
        if logprobs.shape != (sum(lengths),):
            raise RuntimeError(f"AReaL's engine hands its loss log-probs of shape {tuple(logprobs.shape)} for a packed "
                               f"micro-batch of {sum(lengths)} tokens")
        # row p scores token p + 1: response token j of sample i is scored at start_i + prompt_i - 1 + j
        starts = cu[:-1].tolist()
        picks = [s + (n - r - 1) + torch.arange(r, device=logprobs.device)
                 for s, n, r in zip(starts, lengths, responses)]
        ent = None
        if inputs.with_entropy and entropy is not None:
            kept = entropy if inputs.entropy_coef else entropy.detach()
            ent = [kept[p] for p in picks]
        return RankOutputs([logprobs[p] for p in picks], ent)

    @staticmethod
    def micro_batch(tokens: list[Any], lengths: list[int], responses: list[int], device: Any) -> tuple[Any, dict]:
        """The micro-batch as ``_prepare_mb_list`` hands it (``MicroBatchItem``'s fields read) and
        its dict: the samples packed ``[1, T]``, positions restarting at each sample, ``loss_mask``
        over the responses, ``cu_seqlens``, ``max_seqlen``; ``padding_length`` 0."""
        import torch

        ids = torch.cat([t[:n] for t, n in zip(tokens, lengths)]).to(device).unsqueeze(0)
        position_ids = torch.cat([torch.arange(n, device=device) for n in lengths]).unsqueeze(0)
        loss_mask = torch.cat([torch.cat([torch.zeros(n - r, dtype=torch.bool, device=device),
                                          torch.ones(r, dtype=torch.bool, device=device)])
                               for n, r in zip(lengths, responses)]).unsqueeze(0)
        cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=device)
        mb = {"input_ids": ids, "position_ids": position_ids, "loss_mask": loss_mask, "cu_seqlens": cu,
              "max_seqlen": max(lengths), "use_cache": False}
        mb_item = types.SimpleNamespace(orig_mb=dict(mb), padded_mb=dict(mb), padding_length=0, old_cu_seqlens=None,
                                        padded_to_length=None)
        return mb_item, mb

    # -- the inline era ------------------------------------------------------------------------
    def _load_inline(self) -> Any:
        """PPOActor.compute_logp and FSDPEngine.forward, each compiled alone from its file; every name
        they (and gather_logprobs, compiled alone from areal/utils/functional.py) read bound as their
        file's imports bind it (:meth:`_bind`)."""
        if self._engine_cls is not None:
            return self._engine_cls
        self._ulysses = self.import_module(self.ulysses_module)
        fn = self._forward_def
        fn.decorator_list = []  # @torch.no_grad(): the gradient is checked too
        cls = ast.ClassDef(name=CLASS, bases=[], keywords=[], body=[fn], decorator_list=[], type_params=[])
        engine_tree = FRAMEWORK.parse(self.src, ENGINE_FILE)
        given = self._bind(engine_tree, "areal.engine", self._reads(ENGINE_FILE, [cls]))
        engine = self._compile(self.src / ENGINE_FILE, cls, given)
        actor_tree = FRAMEWORK.parse(self.src, ACTOR_FILE)
        actor = next((n for n in getattr(actor_tree, "body", []) if isinstance(n, ast.ClassDef)
                      and n.name == "PPOActor"), None)
        logp = next((f for f in getattr(actor, "body", []) if isinstance(f, ast.FunctionDef)
                     and f.name == "compute_logp"), None)
        if logp is None:
            raise BadInput(f"AReaL at {self.short()} has no PPOActor.compute_logp in {ACTOR_FILE}")
        logp.decorator_list = []
        actor_cls = ast.ClassDef(name="PPOActor", bases=[], keywords=[], body=[logp], decorator_list=[],
                                 type_params=[])
        actor_given = self._bind(actor_tree, "areal.engine.ppo", self._reads(ACTOR_FILE, [actor_cls]))
        self._actor_cls = self._compile(self.src / ACTOR_FILE, actor_cls, actor_given)
        self.read_names = sorted(set(given) | set(actor_given))
        self._engine_cls = engine
        return engine

    def _reads(self, rel: Path, nodes: list[ast.AST]) -> set[str]:
        """The global names ``nodes`` (definitions of ``rel``) read, decorators included."""
        import builtins
        import symtable

        module = ast.fix_missing_locations(ast.Module(body=nodes, type_ignores=[]))
        table = symtable.symtable("from __future__ import annotations\n" + ast.unparse(module), str(self.src / rel),
                                  "exec")
        reads: set[str] = set()
        for child in table.get_children():
            reads |= names_read(child)
        reads |= {s.get_name() for s in table.get_symbols() if s.is_referenced() and s.is_global()}
        return reads - set(dir(builtins)) - {getattr(n, "name", "") for n in nodes} - {"annotations"}

    def _bind(self, tree: ast.Module, package: str, reads: set[str]) -> dict[str, Any]:
        """``reads`` bound as ``tree``'s file imports them: the checkout's ulysses module's names from
        it, ``areal.utils.data``'s and ``areal.utils.functional``'s functions compiled alone from
        their file (with what they read, bound the same way), a third-party module's from it; any
        other name refuses the checkout in one line."""
        import importlib

        imports = module_imports(tree, package)
        given: dict[str, Any] = {}
        compiled = {"areal.utils.data": DATA_FILE, "areal.utils.functional": OLD_FUNCTIONAL_FILE}
        for name in sorted(reads):
            if name not in imports:
                raise BadInput(f"AReaL at {self.short()}: the inline era's code reads {name}, which its file does not "
                               "import (the adapter binds only what the file imports)")
            mod_name, attr = imports[name]
            if mod_name == self.ulysses_module:
                given[name] = getattr(self._ulysses, attr) if attr else self._ulysses
            elif mod_name in compiled and attr is not None:
                rel = compiled[mod_name]
                own = FRAMEWORK.parse(self.src, rel)
                defs = {n.name: n for n in own.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
                if attr not in defs:
                    raise BadInput(f"AReaL at {self.short()}: {rel} defines no {attr}")
                names = _closure(own, (attr,))
                inner = self._bind(own, mod_name.rsplit(".", 1)[0], self._reads(rel, [defs[n] for n in names]))
                try:
                    given[name] = compile_alone(self.src / rel, names, inner)[attr]
                except LookupError as exc:
                    raise BadInput(f"AReaL at {self.short()}: {exc}") from None
            elif mod_name == "tensordict":
                given[name] = TensorDict
            elif not FRAMEWORK.owns(mod_name):
                mod = importlib.import_module(mod_name)
                if attr is None:
                    given[name] = mod
                else:
                    given[name] = getattr(mod, attr) if hasattr(mod, attr) else importlib.import_module(
                        f"{mod_name}.{attr}")
            else:
                raise BadInput(f"AReaL at {self.short()}: the inline era's code reads {name} from {mod_name}, which "
                               "the adapter does not load")
        return given

    def _compile(self, path: Path, cls: ast.ClassDef, given: dict[str, Any]) -> Any:
        """``cls`` compiled from ``path`` (line numbers kept) into a namespace holding ``given``;
        BadInput naming a name it reads that is not given."""
        import __future__
        import builtins
        import symtable

        module = ast.fix_missing_locations(ast.Module(body=[cls], type_ignores=[]))
        table = symtable.symtable("from __future__ import annotations\n" + ast.unparse(module), str(path), "exec")
        reads: set[str] = set()
        for child in table.get_children():
            reads |= names_read(child)
        missing = sorted(reads - set(dir(builtins)) - set(given) - {cls.name})
        if missing:
            raise BadInput(f"AReaL at {self.short()}: {cls.name} in {path.name} reads {', '.join(missing)}, which the "
                           "adapter does not give")
        namespace: dict[str, Any] = {"__name__": f"shardcheck_areal_{path.stem}", "__file__": str(path), **given}
        code = compile(module, str(path), "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True)
        exec(code, namespace)  # noqa: S102 - AReaL's own code, from its file
        return namespace[cls.name]

    def _compute_inline(self, inputs: RankInputs) -> RankOutputs:
        """``PPOActor.compute_logp(batch, temperature)`` -> ``FSDPEngine.forward(post_hook=calc_logprobs)``
        on a padded batch of the scenario's samples; the model the harness's logits."""
        import torch

        engine_cls = self._load_inline()
        ulysses = self._ulysses
        logits, device = inputs.logits, inputs.logits.device
        lengths, responses = list(inputs.total_lengths), list(inputs.response_lengths)
        width = max(lengths)
        ids = torch.zeros(len(lengths), width, dtype=torch.int64, device=device)
        mask = torch.zeros(len(lengths), width, dtype=torch.bool, device=device)
        for i, (t, n) in enumerate(zip(inputs.tokens, lengths)):
            ids[i, :n], mask[i, :n] = t[:n].to(device), True
        batch = TensorDict({"input_ids": ids, "attention_mask": mask}, batch_size=[len(lengths)])
        engine = object.__new__(engine_cls)
        engine.device = device
        forward = ast.unparse(self._forward_def)
        if "self.sp_world_size" in forward:
            # #297 (f52e58e14) to 8f3ac9e50: the engine slices on a Ulysses device mesh of its own
            # making, which the adapter does not build: its rows would not be the harness's
            raise BadInput(f"AReaL at {self.short()}: the inline era with the engine's own Ulysses device mesh "
                           "(sp_world_size, from #297 until parallel_helper) is not one this adapter models")
        engine.ulysses_sp_size = inputs.sp_size
        engine.is_vision_model = False
        group = inputs.sp_group if inputs.sp_size > 1 else None
        if "ulysses_sharding_manager" in forward:  # AReaL's own, on the mesh stand-in
            manager = self.import_module("areal.models.sharding.fsdp_ulysses").FSDPUlyssesShardingManager
            engine.ulysses_sharding_manager = manager(_Mesh(group) if group is not None else None)
        # the later inline shape (parallel_helper, sp_group; _ensure_ready-like set-up in forward)
        engine.parallel_helper = types.SimpleNamespace(sp_size=inputs.sp_size, tp_size=1, dp_size=1, tp_group=None)
        engine.sp_group = group
        seen: list[Any] = []

        def prepare_mb_list(input_: Any) -> MicroBatchList:
            # base_hf_engine.prepare_mb_list's result for one micro-batch: amend_position_ids, pack_tensor_dict
            # (mbs: packed [T]), no page pad (padding_lengths [0]), padded_mbs unsqueezed to [1, T]
            # (unsqueeze_mb_list), each a plain dict (dict(**mb))
            got = input_["attention_mask"].sum(1).tolist()
            packed = {"input_ids": torch.cat([input_["input_ids"][i, :n] for i, n in enumerate(got)]),
                      "position_ids": torch.cat([torch.arange(n, device=device) for n in got]),
                      "cu_seqlens": torch.tensor([0] + torch.tensor(got).cumsum(0).tolist(), dtype=torch.int32,
                                                 device=device),
                      "max_seqlen": max(got)}
            padded = {k: v.unsqueeze(0) if k in ("input_ids", "position_ids") else v for k, v in packed.items()}
            # forward_indices / backward_indices: the samples' order in the micro-batches and back (unchanged)
            return MicroBatchList(mbs=[packed], padded_mbs=[padded], padding_lengths=[0],
                                  forward_indices=list(range(len(got))), backward_indices=list(range(len(got))))

        def model(**kwargs: Any) -> Any:
            seen.append(kwargs["input_ids"])
            inputs.check_model_tokens(kwargs["input_ids"], "shardcheck's areal:fsdp adapter: AReaL's engine")
            return types.SimpleNamespace(logits=logits)

        engine.prepare_mb_list = prepare_mb_list
        engine.model = model
        engine.eval = lambda: None
        actor = object.__new__(self._actor_cls)
        actor.engine = engine
        previous = ulysses.get_ulysses_sequence_parallel_group()
        try:
            out = actor.compute_logp(batch, temperature=inputs.temperature)
        finally:
            ulysses.set_ulysses_sequence_parallel_group(previous)
        return RankOutputs([out[i, (n - r - 1) + torch.arange(r, device=out.device)]
                            for i, (n, r) in enumerate(zip(lengths, responses))])



def build(variant: str | None, config: TargetConfig) -> ArealFSDPTarget:
    given = [k for k, _ in config.options if k not in OPTIONS]
    if given:
        raise BadInput(f"target 'areal:fsdp': option {given[0]} is not areal:fsdp's (its options: "
                       f"{', '.join(OPTIONS)})")
    return ArealFSDPTarget(config)


def make(config: TargetConfig | None = None) -> ArealFSDPTarget:
    """areal:fsdp by module path (``shardcheck.targets.areal_fsdp:make``), with its options"""
    return build("fsdp", config or TargetConfig())


make.options = OPTIONS  # type: ignore[attr-defined]
