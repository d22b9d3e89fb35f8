"""verl's FSDP engine's log-prob and entropy path, with Ulysses sequence parallelism, from a source
checkout: ``--target verl:fsdp``.

What runs is verl's own code, from the checkout: the methods ``prepare_model_inputs`` and
``prepare_model_outputs`` of ``FSDPEngineWithLMHead`` and the two helpers of ``FSDPEngine`` they
call (``_get_packed_pad_size``, ``_gather_and_unpad_packed``), compiled alone from
``verl/workers/engine/fsdp/transformer_impl.py`` (its path and line numbers kept: tracebacks and
coverage name verl's lines). The module around them imports peft, transformers, FSDP's checkpoint
manager and the engine registry; every name the methods read from outside themselves is bound as
that file's own imports bind it (``verl_F``, ``tu``, ``ulysses_pad_and_slice_inputs``,
``gather_outputs_and_unpad``, ``logprobs_from_logits``, ``pad_packed_inputs``, ...), each imported
from the checkout. A name the file does not import, or one whose module cannot be imported, refuses
the checkout in one line; nothing is guessed.

``forward_step``'s sequence is followed: ``prepare_model_inputs(micro_batch)`` on the micro-batch
verl's data path hands the engine (nested jagged ``input_ids`` and ``position_ids``, the scalar
temperature, ``use_remove_padding``, ``calculate_entropy``), the model (here: the harness's logits
for this rank, handed over as ``output.logits``), then ``prepare_model_outputs`` under the autocast
``forward_step`` enters (the logits' dtype where it is bfloat16 or float16; none for float32, as the
engine skips it, nor for float64). The engine rolls the packed ids by -1 on the whole sequence,
pads and slices them (and the temperatures, padded with 1) with ``ulysses_pad_and_slice_inputs``,
divides the logits by the clamped temperature, computes the entropy with ``entropy_from_logits``
(``entropy_from_logits_with_chunking`` with the scenario's chunk size when it has one: verl's
``entropy_from_logits_with_chunking`` engine option) and the log-probs with
``logprobs_from_logits`` (``inplace_backward=False`` when the entropy is wanted), and gathers both
over the Ulysses group with ``gather_outputs_and_unpad`` (whose backward scales the gradient by sp:
the harness's contract for the sp layouts). The response tokens are cut from the nested outputs by
``verl/workers/utils/padding.py::no_padding_2_padding``, as verl's losses do.

The rows are verl's own: the target's data path (:class:`VerlFSDPDataPath`) runs the same
``prepare_model_inputs`` on the rollout (the position-encoded one, then the real one) and hands
the harness the ``input_ids`` (and ``position_ids``) it gives this rank's model; the harness
learns the layout from them (its position trace), and the logits arrive in those rows.
``--target-opt layout=shardcheck`` keeps the harness's own rows instead.

The Ulysses group is verl's own: ``FSDPEngine._init_device_mesh`` (with ``get_data_parallel_size``,
compiled alone likewise; the file's module-level ``device_name = get_device_name()`` runs with
them) builds the engine's meshes on a fresh engine object whose ``engine_config`` holds
``FSDPEngineConfig``'s default ``fsdp_size`` (read from the checkout) and the scenario's sp as
``ulysses_sequence_parallel_size``: ``create_device_mesh`` (1-D over the world at fsdp_size -1)
and, at sp > 1, ``init_device_mesh(device_name, (dp, sp), ["dp", "sp"])``. It runs through the
harness's ``framework_groups`` (once per world, layout and checkout, collectively), which checks
the groups against its own: the fsdp mesh's as the world, the Ulysses mesh's dp and sp.
``ulysses_parallel_group`` is then set as the engine's ``EngineTrainModeCtx`` sets it: the
previous group saved, ``set_ulysses_sequence_parallel_group(engine.ulysses_parallel_group)``
(None at sp 1), restored when ``compute`` returns (the gather's backward keeps its group in its
autograd context). Before #5305 ``_init_device_mesh`` set no ``ulysses_parallel_group`` (an
``FSDPUlyssesShardingManager`` held the mesh): there the harness's sp group is set instead.

The engine object is not built (its ``__init__`` builds the FSDP module and optimizer): the
compiled methods run on an object holding what ``_init_device_mesh`` set and the attributes
``__init__`` sets that they read (``pad_to_length`` off, ``engine_config``'s entropy fields,
``compute_entropy_from_logits`` picked as ``__init__`` picks it, torch.compile running eagerly).
The micro-batch is a dict with the keys verl's ``TensorDict`` carries (tensordict is not installed
here: where it is missing a stand-in whose ``NonTensorData`` is a class is put in ``sys.modules``
while the target is loaded, so that ``tu.unwrap_non_tensor_data``'s isinstance works).

Not reached: the model's forward (the Ulysses attention's all-to-all, ``monkey_patch.py``), the
fused-kernel path (``use_fused_kernels``: log-probs from hidden states), the static bucket pad
(``pad_to_length``), VLMs (``ulysses_pad`` alone, sliced after the embedding), TP (verl's FSDP
engine gathers DTensor logits with ``full_tensor()``; shardcheck's ``ulysses`` layout hands vocab
shards), the distillation branches and ``sum_pi_squared``.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import dataclasses
import sys
import types
from pathlib import Path
from typing import Any

from shardcheck.errors import BadInput
from shardcheck.targets.base import (Capabilities, Knob, RankInputs, RankOutputs, Rollout, TargetConfig,
                                     layout_description, layout_option)
from shardcheck.targets.checkout import CheckoutTarget, PreparedInputsPath
from shardcheck.targets.compiled import module_imports, names_read
from shardcheck.targets.stub import Stub
from shardcheck.targets.verl import FRAMEWORK, REPLAY_WHY

ENGINE_FILE = Path("verl/workers/engine/fsdp/transformer_impl.py")
ENGINE_PACKAGE = "verl.workers.engine.fsdp"
ULYSSES_FILE = Path("verl/utils/ulysses.py")
TF_FILE = Path("verl/utils/torch_functional.py")
PADDING_FILE = Path("verl/workers/utils/padding.py")
ENGINE_UTILS_FILE = Path("verl/workers/engine/utils.py")
PADDING_MODULE = "verl.workers.utils.padding"
ULYSSES_MODULE = "verl.utils.ulysses"
# (class, method): what runs of the engine file; the helpers are there since #6420's static pad (older
# commits gather in prepare_model_outputs itself)
METHODS = (("FSDPEngineWithLMHead", "prepare_model_inputs"), ("FSDPEngineWithLMHead", "prepare_model_outputs"))
HELPERS = (("FSDPEngine", "_get_packed_pad_size"), ("FSDPEngine", "_gather_and_unpad_packed"))
# the engine's mesh set-up; since #5305 it sets ulysses_parallel_group, which EngineTrainModeCtx sets as the
# Ulysses group (before, FSDPUlyssesShardingManager held the mesh: not followed, the harness's sp group is set)
MESH_METHODS = (("FSDPEngine", "_init_device_mesh"), ("FSDPEngine", "get_data_parallel_size"))
MESH_GROUP = "ulysses_parallel_group"
CONFIG_FILE = Path("verl/workers/config/engine.py")
FSDP_UTILS_FILE = Path("verl/workers/engine/fsdp/utils.py")  # create_device_mesh
DENSE_FILE = Path("verl/models/transformers/dense_common.py")
DENSE_MODULE = "verl.models.transformers.dense_common"
FUSED_FILE = Path("verl/utils/experimental/torch_functional.py")
TP_WHY = ("verl's FSDP engine has no vocab-parallel log-prob code: under TP its logits are a DTensor it gathers "
          "whole (full_tensor()) before log_softmax; shardcheck's layouts hand each TP rank its vocabulary shard")
CP_WHY = "verl's FSDP engine has no context parallelism (its sequence parallelism is Ulysses: layout ulysses)"
LAYOUT_WHY = (("zigzag", CP_WHY), ("allgather", CP_WHY),
              ("ring", "ring attention's split is OpenRLHF's; verl's FSDP engine slices with Ulysses (layout ulysses)"))
# what the stand-ins for missing third-party packages hold that is real (the rest is a stub)
STAND_INS = {"tensordict": "TensorDict, NonTensorData and NonTensorStack are empty classes",
             "transformers": "modeling_outputs.CausalLMOutputWithPast a dataclass of its fields, cache_utils.Cache "
                             "a class"}
OPTIONS = {
    "layout": "framework (the default: the rows are learned through the position trace from verl's own "
              "FSDPEngineWithLMHead.prepare_model_inputs) or shardcheck (the harness's rows, checked against "
              "what prepare_model_inputs hands the model)",
    "fused_kernels": "verl:fsdp only: torch (use_fused_kernels with the torch backend: the model's forward is verl's "
                     "dense_common.forward_with_torch_backend, FusedLinearForPPO on the harness's logits as the last "
                     "hidden states and an identity LM head) or off (the default: the logits path)",
}


@dataclasses.dataclass(frozen=True)
class FSDPEra:
    """What the checkout offers: the engine's methods compiled (the helpers are newer), whether
    it has the dense models' fused forward (``fused_kernels=torch``), and whether the Ulysses group
    is verl's own ``_init_device_mesh``'s (``ulysses_parallel_group``, since #5305), with
    ``FSDPEngineConfig``'s default ``fsdp_size``."""

    methods: tuple[str, ...]
    dense_fused_forward: bool
    device_mesh: bool = False
    fsdp_size: int | None = None


class _Module:
    """The model's config as the engine reads it (``config.vision_config``: a text model has none)."""

    class config:  # noqa: N801 - read as self.module.config
        pass


class _MicroBatch(dict):
    """The micro-batch as the engine reads it: TensorDict's ``get``, ``[]`` and ``batch_size``."""

    def __init__(self, batch_size: int, **items: Any) -> None:
        super().__init__(**items)
        self.batch_size = (batch_size,)


def _tensordict_stand_in() -> dict[str, types.ModuleType]:
    """Where tensordict is missing: modules whose ``NonTensorData``, ``NonTensorStack`` and
    ``TensorDict`` are classes (isinstance works) and anything else a stub."""
    classes = {n: type(n, (), {"__module__": "tensordict"}) for n in ("TensorDict", "NonTensorData", "NonTensorStack")}
    top, sub = Stub("tensordict"), Stub("tensordict.tensorclass")
    for mod in (top, sub):
        vars(mod).update(classes)
    top.tensorclass = sub
    return {"tensordict": top, "tensordict.tensorclass": sub}


def engine_methods(src: Path) -> tuple[ast.Module, dict[str, ast.FunctionDef]] | None:
    """The engine file and the methods of :data:`METHODS` (and the :data:`HELPERS` the commit has)
    in it; None where the file or one of :data:`METHODS` is missing (an era before the FSDP engine)."""
    tree = FRAMEWORK.parse(src, ENGINE_FILE)
    if tree is None:
        return None
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    found: dict[str, ast.FunctionDef] = {}
    for cls, method in METHODS + HELPERS + MESH_METHODS:
        fn = next((f for f in getattr(classes.get(cls), "body", []) if isinstance(f, ast.FunctionDef)
                   and f.name == method), None)
        if fn is None and (cls, method) in METHODS:
            return None
        if fn is not None:
            found[method] = fn
    return tree, found


def left_right_padding_era(src: Path) -> bool:
    """Whether ``no_padding_2_padding`` takes the left-right padded batch's ``indices`` (verl's
    engine before 455e44c6f, #5041): its micro-batch is laid out otherwise than the adapter's."""
    tree = FRAMEWORK.parse(src, PADDING_FILE)
    fn = next((n for n in (tree.body if tree else []) if isinstance(n, ast.FunctionDef)
               and n.name == "no_padding_2_padding"), None)
    return fn is not None and any(isinstance(n, ast.Constant) and n.value == "indices" for n in ast.walk(fn))


def builds_ulysses_group(methods: dict[str, ast.FunctionDef]) -> bool:
    """Whether ``_init_device_mesh`` sets ``self.ulysses_parallel_group`` (and
    ``get_data_parallel_size``, which it calls, is there): the engine's own Ulysses group."""
    init = methods.get(MESH_METHODS[0][1])
    return init is not None and MESH_METHODS[1][1] in methods and any(
        isinstance(t, ast.Attribute) and t.attr == MESH_GROUP and isinstance(t.value, ast.Name) and t.value.id == "self"
        for n in ast.walk(init) if isinstance(n, ast.Assign) for t in n.targets)


def fsdp_size_default(src: Path) -> int | None:
    """``FSDPEngineConfig``'s default ``fsdp_size`` at this commit (None where not found)."""
    tree = FRAMEWORK.parse(src, CONFIG_FILE)
    for cls in (n for n in (tree.body if tree else []) if isinstance(n, ast.ClassDef) and n.name == "FSDPEngineConfig"):
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == "fsdp_size":
                try:
                    value = ast.literal_eval(stmt.value) if stmt.value is not None else None
                except ValueError:
                    return None
                return value if isinstance(value, int) else None
    return None


def module_assignments(tree: ast.Module, names: set[str]) -> dict[str, ast.Assign]:
    """The file's module-level ``name = ...`` statements of ``names`` (``device_name =
    get_device_name()``): run with the compiled methods, as the module runs them on import."""
    return {n.targets[0].id: n for n in tree.body if isinstance(n, ast.Assign) and len(n.targets) == 1
            and isinstance(n.targets[0], ast.Name) and n.targets[0].id in names}


def _transformers_stand_in() -> dict[str, types.ModuleType]:
    """Where transformers is missing: ``modeling_outputs.CausalLMOutputWithPast`` a dataclass with
    its fields (verl's CausalLMOutputForPPO derives from it), ``cache_utils.Cache`` a class, anything
    else a stub."""
    import dataclasses

    fields = [(n, Any, dataclasses.field(default=None))
              for n in ("loss", "logits", "past_key_values", "hidden_states", "attentions")]
    output = dataclasses.make_dataclass("CausalLMOutputWithPast", fields)
    top, outputs, cache = Stub("transformers"), Stub("transformers.modeling_outputs"), Stub("transformers.cache_utils")
    outputs.CausalLMOutputWithPast = output
    cache.Cache = type("Cache", (), {})
    top.modeling_outputs, top.cache_utils = outputs, cache
    return {"transformers": top, "transformers.modeling_outputs": outputs, "transformers.cache_utils": cache}


class _BaseModelOutput(tuple):
    """What the decoder (``self.model``) returns: the last hidden states first."""

    past_key_values = hidden_states = attentions = None


class _FusedModel:
    """The HF causal LM verl's monkey patch gives ``forward_with_torch_backend`` (``patch_forward_with_
    backends``: ``model.__class__.forward``): its decoder returns the harness's logits as the last
    hidden states and its LM head is the identity, so verl's FusedLinearForPPO computes its
    log-probs and entropy from exactly the harness's logits (``hidden @ I.T``), and the gradient
    of the hidden states is the logits'."""

    class config:  # noqa: N801
        output_attentions = False
        output_hidden_states = False

    def __init__(self, forward: Any, hidden: Any) -> None:
        import torch

        self._forward, self._hidden = forward, hidden
        self.lm_head = types.SimpleNamespace(weight=torch.eye(hidden.size(-1), dtype=hidden.dtype,
                                                              device=hidden.device))
        self.model = lambda **kwargs: _BaseModelOutput((self._hidden,))
        self.seen: dict[str, Any] = {}

    def __call__(self, **kwargs: Any) -> Any:
        self.seen = kwargs
        return self._forward(self, **kwargs)


class VerlFSDPDataPath(PreparedInputsPath):
    """verl's FSDP engine's own layout: ``prepare_model_inputs`` on the micro-batch verl's data path
    hands the engine (nested jagged ids and positions), with the Ulysses group set as
    ``EngineTrainModeCtx`` sets it (megatron's context-parallel group, which under the sp layouts is
    the harness's sp group; None at sp 1: the slicing reads only its rank and size, which verl's own
    mesh's sp group, built in ``compute``, shares). What it hands the model as ``input_ids`` is this rank's
    rows: ``[1, T_local]`` packed (thd, ulysses: rolled, padded to a multiple of sp and sliced by
    ``ulysses_pad_and_slice_inputs``), ``[B, S]`` padded with 0 for bshd (no padding removal)."""

    name = f"{ENGINE_FILE}:FSDPEngineWithLMHead.prepare_model_inputs"

    def __init__(self, target: "VerlFSDPTarget") -> None:
        super().__init__()
        self.target = target

    def knobs(self) -> dict[str, Knob]:
        # pad_to_length / pad_to_length_bucket change the packed rows, but prepare_model_outputs strips
        # them again only on paths this adapter does not follow: not offered
        return {}

    def builds(self, scenario: Any) -> str | None:
        return None  # thd, bshd and ulysses: every layout the target runs

    def prepare(self, rollout: Rollout) -> dict[str, Any]:
        import torch
        from megatron.core import parallel_state as mpu

        sp = mpu.get_context_parallel_world_size() if rollout.layout == "ulysses" else 1
        group = mpu.get_context_parallel_group() if sp > 1 else None
        target = self.target
        engine = target._engine(sp, 0)
        ulysses = target._mods[ULYSSES_MODULE]
        micro_batch = target.micro_batch(list(rollout.tokens), rollout.total_lengths, rollout.response_lengths,
                                         1.0, rollout.layout != "bshd", False)
        previous = ulysses.get_ulysses_sequence_parallel_group()
        ulysses.set_ulysses_sequence_parallel_group(group)
        try:
            with torch.no_grad():
                model_inputs, _ = engine.prepare_model_inputs(micro_batch=micro_batch)
        finally:
            ulysses.set_ulysses_sequence_parallel_group(previous)
        return model_inputs


class VerlFSDPTarget(CheckoutTarget):
    """verl's FSDP engine (FSDPEngineWithLMHead.prepare_model_inputs / prepare_model_outputs, compiled
    alone from verl's file): log-probs and entropy of the rank's Ulysses slice, gathered over the sp group"""

    framework = FRAMEWORK
    name = "verl:fsdp"
    framework_files: tuple[str, ...] = (str(ENGINE_FILE), str(ULYSSES_FILE), str(TF_FILE), str(PADDING_FILE))

    def __init__(self, src: str | None = None, options: TargetConfig | None = None) -> None:
        super().__init__(src)
        found = engine_methods(self.src)
        if found is None:
            raise BadInput(f"verl at {self.short()} has no FSDP engine to check: {ENGINE_FILE} with "
                           f"{', '.join(f'{c}.{m}' for c, m in METHODS)}")
        self._tree, self._methods = found
        if left_right_padding_era(self.src):
            raise BadInput(f"verl at {self.short()}: no_padding_2_padding reads the left-right padded batch's "
                           "indices, max_seq_len and max_response_len (until 455e44c6f): an era this adapter does "
                           "not model")
        self.layout_option = layout_option(options, "target 'verl:fsdp': ")
        self.fused = (options or TargetConfig()).get("fused_kernels", "off")
        if self.fused not in ("off", "torch"):
            raise BadInput(f"target 'verl:fsdp': option fused_kernels={self.fused!r}: expected torch or off")
        if self.fused == "torch":
            if FRAMEWORK.parse(self.src, DENSE_FILE) is None or FRAMEWORK.parse(self.src, FUSED_FILE) is None:
                raise BadInput(f"verl at {self.short()} has no {DENSE_FILE} or {FUSED_FILE} (fused_kernels=torch)")
            self.framework_files = self.framework_files + (str(DENSE_FILE), str(FUSED_FILE))
        fsdp_size = fsdp_size_default(self.src)
        mesh = builds_ulysses_group(self._methods) and fsdp_size is not None
        self.era = FSDPEra(tuple(f"{c}.{m}" for c, m in METHODS + HELPERS + (MESH_METHODS if mesh else ())
                                 if m in self._methods),
                           FRAMEWORK.parse(self.src, DENSE_FILE) is not None, mesh, fsdp_size if mesh else None)
        if mesh:
            self.framework_files = self.framework_files + (str(FSDP_UTILS_FILE),)
        self.capabilities = Capabilities(
            layouts=frozenset({"thd", "bshd", "ulysses"}), entropy=True, tp_sizes=frozenset({1}),
            cp_sizes=frozenset({1}), layout_reasons=LAYOUT_WHY,
            reasons=(("tp", TP_WHY), ("cp", CP_WHY), ("replay_keep", REPLAY_WHY.replace("Megatron", "FSDP"))))
        self._engine_cls: Any = None
        self._mods: dict[str, Any] = {}
        self.read_names: list[str] = []
        self.module_lines: list[str] = []
        self.data_path = VerlFSDPDataPath(self) if self.layout_option == "framework" else None

    # -- loading -----------------------------------------------------------------------------
    def forget(self) -> None:
        self._engine_cls, self._mods = None, {}

    def _load(self) -> Any:
        if self._engine_cls is not None:
            return self._engine_cls
        for wanted, make in (("tensordict", _tensordict_stand_in),
                             ("transformers", _transformers_stand_in if self.fused != "off" else None)):
            if make is not None:
                self._stand_in(wanted, make)
        path = self.src / ENGINE_FILE
        compiled = METHODS + HELPERS + (MESH_METHODS if self.era.device_mesh else ())
        methods = [self._methods[m] for _, m in compiled if m in self._methods]
        for fn in methods:
            fn.decorator_list = []
        cls = ast.ClassDef(name="FSDPEngineWithLMHead", bases=[], keywords=[], body=methods, decorator_list=[],
                           type_params=[])
        import __future__
        import builtins
        import symtable

        table = symtable.symtable("from __future__ import annotations\n" + ast.unparse(cls), str(path), "exec")
        reads: set[str] = set()
        for child in table.get_children():
            reads |= names_read(child)
        reads -= set(dir(builtins))
        imports = module_imports(self._tree, ENGINE_PACKAGE)
        # names the file binds at module level other than by import run their own lines first
        assigns = module_assignments(self._tree, reads - set(imports))
        reads = (reads - set(assigns)) | {n.id for a in assigns.values() for n in ast.walk(a.value)
                                          if isinstance(n, ast.Name)} - set(dir(builtins))
        module = ast.fix_missing_locations(ast.Module(
            body=sorted(assigns.values(), key=lambda a: a.lineno) + [cls], type_ignores=[]))
        unknown = sorted(n for n in reads if n not in imports)
        if unknown:
            raise BadInput(f"verl at {self.short()}: the FSDP engine's methods read {', '.join(unknown)}, which "
                           f"{ENGINE_FILE} does not import (the adapter binds only what the file imports)")
        import importlib

        given: dict[str, Any] = {}
        for name in sorted(reads):
            mod_name, attr = imports[name]
            mod = self.import_module(mod_name) if FRAMEWORK.owns(mod_name) else importlib.import_module(mod_name)
            if attr is None:
                given[name] = mod
            elif hasattr(mod, attr):
                given[name] = getattr(mod, attr)
            else:
                given[name] = self.import_module(f"{mod_name}.{attr}") if FRAMEWORK.owns(mod_name) else getattr(
                    mod, attr)
        self.read_names = sorted(reads)
        self.module_lines = [f"{ENGINE_FILE}:{a.lineno}: {ast.unparse(a)}" for a in module.body[:-1]]
        for mod_name in (ULYSSES_MODULE, PADDING_MODULE, "verl.utils.torch_functional") + (
                (DENSE_MODULE,) if self.fused != "off" else ()):
            self._mods[mod_name] = self.import_module(mod_name)
        namespace: dict[str, Any] = {"__name__": "shardcheck_verl_fsdp_engine", "__file__": str(path), **given}
        code = compile(module, str(path), "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True)
        exec(code, namespace)  # noqa: S102 - verl's own methods, from its file
        self._engine_cls = namespace["FSDPEngineWithLMHead"]
        return self._engine_cls

    def _stand_in(self, package: str, make: Any) -> None:
        """``make()``'s modules in ``sys.modules`` where ``package`` is not installed, until release."""
        import importlib.util

        if package in sys.modules or importlib.util.find_spec(package) is not None:
            return
        stand_in = make()
        saved = {k: sys.modules.get(k) for k in stand_in}
        sys.modules.update(stand_in)

        def undo() -> None:
            for k, v in saved.items():
                if sys.modules.get(k) is stand_in[k]:
                    if v is None:
                        del sys.modules[k]
                    else:
                        sys.modules[k] = v

        self.checkout.undo_later(undo)
        self.checkout.stubs.append(f"{package} (a stand-in: {STAND_INS[package]})")

    def _built_mesh(self, sp_size: int) -> dict[str, Any]:
        """What verl's ``_init_device_mesh`` sets on a fresh engine object (its meshes, its
        ``ulysses_parallel_group``, ``use_ulysses_sp``, ...), the config at ``FSDPEngineConfig``'s
        default fsdp_size and the scenario's sp. Collective: every rank of the world runs it."""
        from shardcheck.targets.verl import _Config

        engine = object.__new__(self._load())
        engine.engine_config = _Config(fsdp_size=self.era.fsdp_size, ulysses_sequence_parallel_size=sp_size)
        engine._init_device_mesh()
        return {k: v for k, v in vars(engine).items() if k != "engine_config"}

    @staticmethod
    def _mesh_roles(built: dict[str, Any]) -> dict[str, Any]:
        """The groups of verl's meshes, by the harness's role each must equal: the fsdp mesh's
        (1-D over the world at the default fsdp_size: FSDP's own), the Ulysses mesh's dp and sp."""
        import torch.distributed as dist

        roles: dict[str, Any] = {}
        mesh = built.get("device_mesh")
        if mesh is not None and mesh.ndim == 1 and mesh.size() == dist.get_world_size():
            roles["world"] = mesh.get_group()
        if built.get("ulysses_device_mesh") is not None:
            roles["dp"] = built["ulysses_device_mesh"]["dp"].get_group()
        if built.get(MESH_GROUP) is not None:
            roles["sp"] = built[MESH_GROUP]
        return roles

    def _mesh(self, inputs: RankInputs) -> dict[str, Any] | None:
        """verl's own meshes for this layout, through the harness (built once per world, layout and
        checkout); None for a commit before ``ulysses_parallel_group`` or outside a harness, where
        the harness's sp group stands in."""
        if not self.era.device_mesh or inputs.world is None:
            return None
        import torch.distributed as dist

        shape = (dist.get_world_size(), self.era.fsdp_size, inputs.sp_size)
        # the checkout in the key: another commit's adapter in the same world runs its own code
        return inputs.framework_groups((self.name, str(self.src), shape), lambda: self._built_mesh(inputs.sp_size),
                                       self._mesh_roles)

    def _engine(self, sp_size: int, chunk_size: int, mesh: dict[str, Any] | None = None) -> Any:
        """An engine object holding what ``_init_device_mesh`` set (``mesh``: verl's own; else
        the attributes it sets that the methods read) and what ``__init__`` sets that they read."""
        from shardcheck.targets.verl import _Config

        cls = self._load()
        tf = self._mods["verl.utils.torch_functional"]
        engine = object.__new__(cls)
        chunking = chunk_size > 0
        config = _Config(entropy_checkpointing=False, entropy_from_logits_with_chunking=chunking,
                         entropy_from_logits_chunk_size=chunk_size if chunking else 2048,
                         use_torch_compile=True, pad_to_length=False, pad_to_length_bucket=None,
                         ulysses_sequence_parallel_size=sp_size)
        engine.engine_config = config
        engine.module = _Module()
        if mesh is not None:
            vars(engine).update(mesh)
        else:
            engine.ulysses_sequence_parallel_size = sp_size
            engine.use_ulysses_sp = sp_size > 1
        engine.pad_to_length, engine.pad_to_length_bucket = config.pad_to_length, config.pad_to_length_bucket
        # as __init__ picks it (torch.compile runs eagerly: the checkout's torch._dynamo is disabled)
        import torch

        fn = tf.entropy_from_logits_with_chunking if chunking else tf.entropy_from_logits
        engine.compute_entropy_from_logits = torch.compile(fn, dynamic=True) if config.use_torch_compile else fn
        return engine

    # -- the report -----------------------------------------------------------------------------
    def description(self) -> dict[str, Any]:
        return {"fused_kernels": self.fused,
                "data_path": layout_description(self.data_path, self.layout_option, "layout=shardcheck"),
                "calls": (f"{ENGINE_FILE}: " + ("FSDPEngine._init_device_mesh (once per world and layout), "
                                                 if self.era.device_mesh else "")
                          + "FSDPEngineWithLMHead.prepare_model_inputs, the harness's logits as the "
                          "model's output, prepare_model_outputs (under forward_step's autocast); responses cut by "
                          f"{PADDING_FILE}::no_padding_2_padding"),
                "compiled_alone": list(self.era.methods),
                "names_bound_from_the_engine_file's_imports": self.read_names,
                "module_level_lines_run": self.module_lines,
                "ulysses_group": (
                    f"built by verl's FSDPEngine._init_device_mesh ({ENGINE_FILE}; fsdp_size "
                    f"{self.era.fsdp_size}, FSDPEngineConfig's default, ulysses_sequence_parallel_size the "
                    "scenario's sp) once per world and layout, its groups checked against the harness's (the fsdp "
                    "mesh's as the world, the Ulysses mesh's dp and sp); set_ulysses_sequence_parallel_group("
                    "engine.ulysses_parallel_group) around the forward, as EngineTrainModeCtx does; restored after"
                    if self.era.device_mesh else
                    "the harness's sp group: this commit's FSDPEngine has no _init_device_mesh setting "
                    "ulysses_parallel_group (before #5305 an FSDPUlyssesShardingManager held its mesh: not followed); "
                    "set_ulysses_sequence_parallel_group(sp group) around the forward, as the engine's train mode "
                    "does; restored after"),
                "engine_config": {"use_remove_padding": "true (thd, ulysses); false for bshd",
                                  "entropy_from_logits_with_chunking": "when the scenario has a chunk size",
                                  "entropy_checkpointing": False, "pad_to_length": False,
                                  "use_fused_kernels": False,
                                  **({"fsdp_size": self.era.fsdp_size} if self.era.device_mesh else {})},
                "not_run": "the __init__.py of the verl packages holding the modules imported (verl/__init__.py "
                           "imports ray); torch.compile runs eagerly",
                "framework_files": list(self.framework_files)}

    # -- the computation -------------------------------------------------------------------------
    def compute(self, inputs: RankInputs) -> RankOutputs:
        import torch
        import torch.distributed as dist

        if inputs.tp_size != 1:
            raise ValueError(f"verl:fsdp runs at tp 1 only, got tp {inputs.tp_size}")
        # the meshes first, as the engine's __init__ builds them before anything else
        mesh = self._mesh(inputs)
        engine = self._engine(inputs.sp_size, inputs.chunk_size, mesh)
        ulysses = self._mods[ULYSSES_MODULE]
        padding = self._mods[PADDING_MODULE]
        logits = inputs.logits
        device = logits.device
        # the real rollout the data path laid out (the harness's tokens with layout=shardcheck)
        source = inputs.rollout.tokens if inputs.rollout is not None else inputs.tokens
        lengths, responses = inputs.total_lengths, inputs.response_lengths
        tokens = [t[:n].to(device) for t, n in zip(source, lengths)]
        nested = lambda ts: torch.nested.as_nested_tensor(ts, layout=torch.jagged)  # noqa: E731
        micro_batch = self.micro_batch(tokens, lengths, responses, inputs.temperature, inputs.layout != "bshd",
                                       bool(inputs.with_entropy))
        if mesh is not None:
            group = engine.ulysses_parallel_group
        else:
            group = inputs.sp_group if inputs.sp_size > 1 else None
        if group is not None and dist.get_rank(group=group) != inputs.sp_rank:
            raise RuntimeError(f"shardcheck's verl:fsdp adapter: sp rank {inputs.sp_rank} is rank "
                               f"{dist.get_rank(group=group)} of its sp group")
        previous = ulysses.get_ulysses_sequence_parallel_group()
        ulysses.set_ulysses_sequence_parallel_group(group)
        try:
            if self.fused != "off":  # the model verl's monkey patch makes: its forward is verl's
                engine.module = _FusedModel(self._mods[DENSE_MODULE].forward_with_torch_backend, logits)
            model_inputs, output_args = engine.prepare_model_inputs(micro_batch=micro_batch)
            # the rows the logits arrive in (the ones the position trace learned from this same method,
            # or the harness's with layout=shardcheck) must be what the engine hands the model
            inputs.check_model_tokens(model_inputs["input_ids"], "shardcheck's verl:fsdp adapter: verl's engine")
            self._check_mask(lengths, model_inputs.get("attention_mask"))
            dtype = logits.dtype
            autocast = (torch.autocast(device_type=device.type, dtype=dtype)
                        if dtype in (torch.bfloat16, torch.float16) else contextlib.nullcontext())
            with autocast:  # as forward_step: the model's forward and prepare_model_outputs
                if self.fused != "off":
                    output = engine.module(**model_inputs, use_cache=False)
                else:
                    output = types.SimpleNamespace(logits=logits)
                # as forward_step calls it: logits_processor_func only where the commit takes it
                # (not before 2026; verl passes None there in its log-prob path)
                extra = ({"logits_processor_func": None} if "logits_processor_func" in
                         inspect.signature(engine.prepare_model_outputs).parameters else {})
                model_output = engine.prepare_model_outputs(output=output, output_args=output_args,
                                                            micro_batch=micro_batch, **extra)
        finally:
            ulysses.set_ulysses_sequence_parallel_group(previous)
        prompts = [n - r for n, r in zip(lengths, responses)]
        # what verl's micro-batch carries for no_padding_2_padding: the prompts, the responses and
        # (read by some commits, e.g. 455e44c6f, even when nested) the attention mask
        data = _MicroBatch(len(tokens), prompts=nested([t[:p] for t, p in zip(tokens, prompts)]),
                           responses=nested([t[p:] for t, p in zip(tokens, prompts)]),
                           attention_mask=nested([torch.ones(n, dtype=torch.int64, device=device) for n in lengths]))
        out: dict[str, list[Any]] = {}
        for key in ("log_probs", "entropy"):
            if key in model_output:
                padded = padding.no_padding_2_padding(model_output[key], data)
                out[key] = [padded[i, :r] for i, r in enumerate(responses)]
        return RankOutputs(out["log_probs"], out.get("entropy"))

    def micro_batch(self, tokens: list[Any], lengths: list[int], responses: list[int], temperature: float,
                    rmpad: bool, calculate_entropy: bool) -> "_MicroBatch":
        """The micro-batch verl's data path hands the engine (the TensorDict's keys): nested jagged
        ids and positions, the response mask right-padded to the longest response (which
        left_right_2_no_padding also hands on as loss_mask), the scalar temperature, the flags."""
        import torch

        device = tokens[0].device
        tokens = [t[:n] for t, n in zip(tokens, lengths)]
        nested = lambda ts: torch.nested.as_nested_tensor(ts, layout=torch.jagged)  # noqa: E731
        response_mask = torch.nn.utils.rnn.pad_sequence(
            [torch.ones(r, dtype=torch.int64, device=device) for r in responses], batch_first=True)
        return _MicroBatch(
            len(tokens), input_ids=nested(tokens), response_mask=response_mask, loss_mask=response_mask,
            position_ids=nested([torch.arange(n, device=device) for n in lengths]),
            temperature=temperature, use_remove_padding=rmpad, calculate_entropy=calculate_entropy,
            use_fused_kernels=self.fused != "off")

    @staticmethod
    def _check_mask(lengths: list[int], mask: Any) -> None:
        """Without padding removal the engine hands the model a padded batch and its attention
        mask: 1 over each sample's tokens, 0 over the padding. A mask that hides a real token (or
        shows a padding one) changes the model's logits, which the harness hands in unchanged: a
        finding of verl's, raised on the rank (the harness reports it as a rank error)."""
        if mask is None:
            return
        import torch

        want = (torch.arange(mask.size(-1), device=mask.device).unsqueeze(0)
                < torch.tensor(lengths, device=mask.device).unsqueeze(1))
        if mask.shape != want.shape or not torch.equal(mask.bool(), want):
            raise RuntimeError(f"verl's prepare_model_inputs hands the model attention_mask {mask.int().tolist()} for "
                               f"samples of {lengths} tokens: the model would not attend to each sample's own "
                               "tokens (1 over them, 0 over the padding)")



def build(variant: str | None, config: TargetConfig) -> VerlFSDPTarget:
    given = [k for k, _ in config.options if k not in OPTIONS]
    if given:
        raise BadInput(f"target 'verl:fsdp': option {given[0]} is not verl:fsdp's (its options: "
                       f"{', '.join(OPTIONS)})")
    return VerlFSDPTarget(config.src, config)


def make(config: TargetConfig | None = None) -> VerlFSDPTarget:
    """verl:fsdp by module path (``shardcheck.targets.verl_fsdp:make``), with its options"""
    config = config or TargetConfig()
    return build("fsdp", config)


make.options = OPTIONS  # type: ignore[attr-defined]
