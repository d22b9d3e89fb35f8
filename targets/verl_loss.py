"""verl's policy loss in the training step, on verl's Megatron engine's terms: ``--target verl:loss``.

What runs, from the checkout, per micro-batch of the harness's training step
(``docs/training.md``):

- the model output verl's engine forward hands its loss (``verl:actor``'s engine call site:
  ``MegatronEngineWithLMHead``'s logits processor on the rows verl's own packing lays out, its
  outputs unpacked by verl's postprocess, all-gathered over CP);
- ``verl/workers/utils/losses.py:ppo_loss`` (imported from the checkout), bound as verl's actor
  worker binds it (``partial(ppo_loss, config=actor_config)``, ``engine_workers.py``), with verl's
  own ``McoreActorConfig``: ``loss_agg_mode`` (the option), ``entropy_coeff`` (the scenario's),
  the rest verl's defaults (vanilla PPO loss, no KL loss). It calls ``core_algos.py``'s
  ``compute_policy_loss_vanilla`` and ``agg_loss`` and ``torch_functional.py``'s ``masked_sum``;
- the engine's lines around it, compiled alone from ``transformer_impl.py`` (the module imports
  Megatron-Bridge, ray and the rest): ``forward_backward_batch``'s global batch info (the
  mini-batch's ``loss_mask`` summed and all-reduced over the data-parallel group,
  ``batch_num_tokens`` and ``dp_size`` assigned), ``get_data_parallel_size`` /
  ``get_data_parallel_group``, and ``MegatronEngineWithLMHead.postprocess_micro_batch_func``
  (``loss * num_micro_batch``, handed to megatron-core's schedule in its two-value form).

What the adapter writes itself, each following verl's line named in ``describe()``: the micro-batch
``TensorDict`` as verl's trainer and engine fill it (padded prompts / responses / masks, old
log-probs and advantages; ``global_batch_size``, ``num_micro_batch``, ``max_response_len``), the
old log-probs of the whole response on every CP rank (verl's data holds the whole micro-batch
there; the harness hands each rank its share, gathered here over CP), and, where ``tensordict``
is not installed, a stand-in of the part of its ``TensorDict`` API those functions read.

``loss_agg_mode`` declares the objective the optimizer must see (``Definitions.objective``):
``token-mean`` the global batch's token mean, ``seq-mean-token-mean`` the mean over samples of
each sample's token mean. ``seq-mean-token-sum`` and ``token-sum`` are sums, and
``seq-mean-token-sum-norm`` a sum over ``loss_scale_factor``: none is an objective the reference
computes, and every step scenario is skipped saying so, except ``seq-mean-token-sum-norm`` at
commits where it is the global batch's token sum over ``loss_scale_factor`` (before #5417) with
``--target-opt loss_scale_factor=batch_num_tokens``: the factor is then the global batch's masked-in
count, and the objective the token mean.
"""

from __future__ import annotations

import __future__
import ast
import builtins
import copy
import dataclasses
import functools
import importlib.util
import symtable
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shardcheck.errors import BadInput
from shardcheck.scenarios.scenario import Scenario
from shardcheck.targets.base import Capabilities, Definitions, RankInputs, RankOutputs, TargetConfig
from shardcheck.targets.compiled import _not_loaded, names_read
from shardcheck.targets.source import functions_named, parameters
from shardcheck.targets.verl import ENGINE_FILE, FRAMEWORK, TP_FILE, UTIL_FILE, VerlActorTarget, _Config

LOSSES_FILE = Path("verl/workers/utils/losses.py")
LOSSES_MODULE = "verl.workers.utils.losses"
CORE_ALGOS_FILE = Path("verl/trainer/ppo/core_algos.py")
TORCH_FUNCTIONAL_FILE = Path("verl/utils/torch_functional.py")
PADDING_FILE = Path("verl/workers/utils/padding.py")
TRAINER_FILE = Path("verl/trainer/ppo/ray_trainer.py")
ACTOR_CONFIG_FILE = Path("verl/workers/config/actor.py")
CONFIG_MODULE = "verl.workers.config"
TU_MODULE = "verl.utils.tensordict_utils"

# the objective each aggregation declares, where it is one the reference computes
OBJECTIVES = {"token-mean": "token_mean", "seq-mean-token-mean": "sample_mean"}
NORM = "seq-mean-token-sum-norm"
GLOBAL_COUNT = "batch_num_tokens"  # loss_scale_factor's one checkable value: the global batch's count
NOT_OBJECTIVES = {
    "token-sum": "the global batch's token sum (masked_sum * dp_size)",
    "seq-mean-token-sum": "the mean over samples of each sample's token sum",
}
# the engine's methods the loss path runs, compiled alone (class: methods)
ENGINE_METHODS = {"MegatronEngine": ("get_data_parallel_size", "get_data_parallel_group"),
                  "MegatronEngineWithLMHead": ("prepare_model_outputs", "postprocess_micro_batch_func")}
# what forward_backward_batch computes for the loss before it splits the mini-batch
GLOBAL_INFO_KEYS = ("batch_num_tokens", "dp_size=", "routed_num_tokens")
GLOBAL_INFO_STOP = ("prepare_micro_batches", "forward_backward_func", "DynamicCPScheduler")
# names the engine's lines read only under dynamic CP (never taken here)
OFF_PATH = ("DCP_SAMPLE_IDS", "DCP_GROUP_LEADER", "DCP_LOCAL_NUM_TOKENS")


# ----------------------------------------------------------------------------------------------
# the era: read from the checkout's files


def _modes(agg: ast.FunctionDef) -> list[str]:
    """The loss_agg_mode values agg_loss branches on."""
    found: list[str] = []
    for node in ast.walk(agg):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == "loss_agg_mode":
            for comp in node.comparators:
                items = comp.elts if isinstance(comp, (ast.List, ast.Tuple, ast.Set)) else [comp]
                found += [c.value for c in items if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    return list(dict.fromkeys(found))


def _norm_is_global_token_sum(agg: ast.FunctionDef) -> bool:
    """Whether agg_loss's seq-mean-token-sum-norm branch is the token sum over loss_scale_factor
    (before #5417) rather than the sequence mean over it (it then divides by global_batch_size)."""
    for node in ast.walk(agg):
        if isinstance(node, ast.If) and NORM in {c.value for c in ast.walk(node.test) if isinstance(c, ast.Constant)}:
            body = ast.Module(body=node.body, type_ignores=[])
            return not any(isinstance(n, ast.Name) and n.id == "global_batch_size" for n in ast.walk(body))
    return False


def _class_methods(tree: ast.Module | None, cls: str) -> dict[str, ast.FunctionDef]:
    for node in (tree.body if tree is not None else []):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}
    return {}


def global_info_lines(fn: ast.FunctionDef) -> list[ast.stmt]:
    """forward_backward_batch's statements that fill the global batch info, before it splits the
    mini-batch: those naming batch_num_tokens / dp_size / routed_num_tokens, and the assignments
    of the names they read (``loss_mask = data["loss_mask"]``)."""
    before: list[ast.stmt] = []
    for stmt in fn.body:
        if any(k in ast.unparse(stmt) for k in GLOBAL_INFO_STOP):
            break
        before.append(stmt)
    chosen = [s for s in before if any(k in ast.unparse(s) for k in GLOBAL_INFO_KEYS)]
    read = {n.id for s in chosen for n in ast.walk(s) if isinstance(n, ast.Name)}
    chosen += [s for s in before if isinstance(s, ast.Assign) and s not in chosen
               and any(isinstance(t, ast.Name) and t.id in read for t in s.targets)]
    return sorted(chosen, key=lambda s: s.lineno)


def _default_mode(src: Path) -> str | None:
    """ActorConfig's loss_agg_mode default at this commit."""
    for cls in (n for n in (FRAMEWORK.parse(src, ACTOR_CONFIG_FILE) or ast.Module(body=[])).body
                if isinstance(n, ast.ClassDef) and n.name == "ActorConfig"):
        for stmt in cls.body:
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and stmt.target.id == "loss_agg_mode" and isinstance(stmt.value, ast.Constant)):
                return stmt.value.value
    return None


def detect_loss_era(src: Path, short: str | None = None) -> dict[str, Any]:
    """What this checkout's loss path has, read from its source; BadInput (one line) where the
    engine's loss path the adapter follows is not there (``short``: the commit as messages name it)."""
    short = short or src.name
    losses = FRAMEWORK.parse(src, LOSSES_FILE)
    ppo = functions_named(losses, "ppo_loss")
    if not ppo:
        raise BadInput(f"verl at {short}: no ppo_loss in {LOSSES_FILE} (the engine's policy loss); verl:loss "
                       "follows the Megatron engine's loss path only")
    agg = functions_named(FRAMEWORK.parse(src, CORE_ALGOS_FILE), "agg_loss")
    if not agg:
        raise BadInput(f"verl at {short}: no agg_loss in {CORE_ALGOS_FILE}")
    engine = FRAMEWORK.parse(src, ENGINE_FILE)
    methods = {cls: _class_methods(engine, cls) for cls in ENGINE_METHODS}
    missing = [f"{cls}.{m}" for cls, names in ENGINE_METHODS.items() for m in names if m not in methods[cls]]
    fbb = methods["MegatronEngine"].get("forward_backward_batch")
    if fbb is None:
        missing.append("MegatronEngine.forward_backward_batch")
    if missing:
        raise BadInput(f"verl at {short}: {ENGINE_FILE} has no {', '.join(missing)} (the engine's loss path)")
    lines = global_info_lines(fbb)
    if not any("batch_num_tokens" in ast.unparse(s) for s in lines):
        raise BadInput(f"verl at {short}: forward_backward_batch ({ENGINE_FILE}:{fbb.lineno}) computes no "
                       "batch_num_tokens for the loss, which this adapter follows")
    post = methods["MegatronEngineWithLMHead"]["postprocess_micro_batch_func"]
    return {
        "ppo_loss": {"file": str(LOSSES_FILE), "line": ppo[0].lineno,
                     "global_batch_info": "global_batch_info" in ast.unparse(ppo[0])},
        "agg_loss": {"file": str(CORE_ALGOS_FILE), "line": agg[0].lineno, "params": parameters(agg[0]),
                     "modes": _modes(agg[0]), "norm_is_global_token_sum": _norm_is_global_token_sum(agg[0])},
        "default_loss_agg_mode": _default_mode(src),
        "global_batch_info_lines": [[s.lineno, s.end_lineno] for s in lines],
        "postprocess_micro_batch_func": {"line": post.lineno, "end": post.end_lineno,
                                         "per_token_branch": "calculate_per_token_loss" in ast.unparse(post)},
    }


# ----------------------------------------------------------------------------------------------
# the engine's lines, compiled alone from its file


def compile_engine(src: Path, given: dict[str, Any]) -> dict[str, Any]:
    """The engine methods the loss path runs, and ``forward_backward_batch`` cut to its global
    batch info lines, compiled from ``transformer_impl.py`` with its path and line numbers kept;
    BadInput naming any name they read that the adapter does not give."""
    path = src / ENGINE_FILE
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes: list[ast.FunctionDef] = []
    for cls, names in ENGINE_METHODS.items():
        found = _class_methods(tree, cls)
        nodes += [found[n] for n in names]
    fbb = copy.deepcopy(_class_methods(tree, "MegatronEngine")["forward_backward_batch"])
    fbb.body = global_info_lines(fbb)
    nodes.append(fbb)
    for fn in nodes:
        fn.decorator_list = []
    module = ast.Module(body=sorted(nodes, key=lambda n: n.lineno), type_ignores=[])
    code = compile(module, str(path), "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True)
    table = symtable.symtable("from __future__ import annotations\n" + ast.unparse(module), str(path), "exec")
    reads: set[str] = set()
    for child in table.get_children():
        reads |= names_read(child)
    unknown = sorted(reads - set(given) - set(OFF_PATH) - set(dir(builtins)))
    if unknown:
        raise BadInput(f"verl at {src.name}: the engine's loss path ({ENGINE_FILE}) reads {', '.join(unknown)}, "
                       "which this adapter does not give")
    namespace: dict[str, Any] = {"__name__": "shardcheck_verl_engine", "__file__": str(path),
                                 **{n: _not_loaded(n, path) for n in OFF_PATH}, **given}
    exec(code, namespace)  # noqa: S102 - verl's own methods, from its file
    return {fn.name: namespace[fn.name] for fn in nodes}


# ----------------------------------------------------------------------------------------------
# tensordict, where it is not installed: the part of TensorDict the loss path reads


class NonTensorData:
    """tensordict's NonTensorData: a value held beside the tensors."""

    def __init__(self, data: Any) -> None:
        self.data = data


class NonTensorStack(NonTensorData):
    """tensordict's NonTensorStack (a list of values)."""

    @classmethod
    def from_list(cls, items: list) -> "NonTensorStack":
        return cls([i.data if isinstance(i, NonTensorData) else i for i in items])


class TensorDict:
    """What verl's loss path reads of tensordict's TensorDict: items (a non-tensor's value
    unwrapped, as tensordict does), ``in``, ``get``, ``keys``, ``pop``, ``select``, ``to`` and
    ``to_padded_tensor`` (nested tensors padded with 0, as tensordict pads)."""

    def __init__(self, source: dict[str, Any] | None = None, batch_size: Any = None, device: Any = None) -> None:
        self._items = dict(source or {})
        self.batch_size = batch_size

    def __getitem__(self, key: str) -> Any:
        value = self._items[key]
        return value.data if isinstance(value, NonTensorData) else value

    def __setitem__(self, key: str, value: Any) -> None:
        self._items[key] = value

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def keys(self) -> Any:
        return self._items.keys()

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self._items else default

    def pop(self, key: str, default: Any = None) -> Any:
        value = self.get(key, default)
        self._items.pop(key, None)
        return value

    def select(self, *keys: str) -> "TensorDict":
        return TensorDict({k: self._items[k] for k in keys}, self.batch_size)

    def to(self, *args: Any, **kwargs: Any) -> "TensorDict":
        return self

    def to_padded_tensor(self) -> "TensorDict":
        def padded(v: Any) -> Any:
            return torch.nested.to_padded_tensor(v, 0.0) if isinstance(v, torch.Tensor) and v.is_nested else v
        return TensorDict({k: padded(v) for k, v in self._items.items()}, self.batch_size)


def tensordict_stand_in() -> dict[str, types.ModuleType]:
    """``tensordict`` and ``tensordict.tensorclass`` holding the stand-ins above."""
    top = types.ModuleType("tensordict", "shardcheck's stand-in for tensordict (targets/verl_loss.py)")
    top.__path__ = []  # a package: tensordict.tensorclass is imported from it
    top.TensorDict, top.NonTensorData, top.NonTensorStack, top.__version__ = (TensorDict, NonTensorData,
                                                                              NonTensorStack, "0+shardcheck")
    sub = types.ModuleType("tensordict.tensorclass")
    sub.NonTensorData, sub.NonTensorStack = NonTensorData, NonTensorStack
    top.tensorclass = sub
    return {"tensordict": top, "tensordict.tensorclass": sub}


def tensordict_missing() -> bool:
    """Whether tensordict is not installed (its stand-in, where it is in use, says so)."""
    import sys

    held = sys.modules.get("tensordict")
    if held is not None:
        return getattr(held, "TensorDict", None) is TensorDict
    return importlib.util.find_spec("tensordict") is None


TENSORDICT_STAND_IN = ("tensordict is not installed: verl's loss path gets shardcheck's stand-in TensorDict "
                       "(targets/verl_loss.py: items, get, select, to_padded_tensor), verl's tensordict_utils on it")


# ----------------------------------------------------------------------------------------------
# the target


def loss_capabilities(engine: Capabilities, unchecked: str | None,
                      builds: Callable[[Scenario], str | None]) -> Capabilities:
    """The engine's capabilities less the scenarios whose rows verl's packing does not lay out
    (``builds``: the data path's reason not to; the loss runs on verl's rows only). With
    ``unchecked`` (why the aggregation asked for has no objective the reference computes) it
    supports no layout, so that reason skips every scenario."""
    if unchecked:
        return Capabilities(layouts=frozenset(), reasons=(("layout", unchecked),))
    inner = engine.rule

    def rule(scenario: Scenario) -> str | None:
        why = inner(scenario) if inner is not None else None
        if why is None:
            built = builds(scenario)
            if built:
                why = f"verl:loss runs on the rows verl's engine packing lays out: {built}"
        return why

    return dataclasses.replace(engine, rule=rule)


def _padded(rows: list[torch.Tensor], width: int, dtype: torch.dtype, device: Any, left: bool = False) -> torch.Tensor:
    """[len(rows), width]: each row's values, right-padded with 0 (left-padded with ``left``)."""
    out = torch.zeros(len(rows), width, dtype=dtype, device=device)
    for i, r in enumerate(rows):
        if len(r):
            if left:
                out[i, width - len(r):] = r.to(device, dtype)
            else:
                out[i, : len(r)] = r.to(device, dtype)
    return out


class VerlLossTarget(VerlActorTarget):
    """verl's policy loss in the training step: losses.py's ppo_loss (agg_loss, compute_policy_loss_vanilla) on
    the engine's model output, with the engine's global batch info and its rescale for megatron-core's schedule
    (transformer_impl.py, compiled alone); option loss_agg_mode (verl's default token-mean)"""

    name = "verl:loss"
    loss_form = "step"
    training_loss = True
    calculate_per_token_loss = False  # megatron-core's knob as verl's tf_config carries it: the two-value form

    def __init__(self, src: str | None = None, options: TargetConfig | None = None) -> None:
        config = options or TargetConfig()
        if config.get("call_site", "engine") != "engine":
            raise BadInput("target 'verl:loss': the loss path is the Megatron engine's (call_site=engine only)")
        if config.get("layout", "framework") != "framework":
            raise BadInput("target 'verl:loss': the loss runs on the rows verl's engine packing lays out "
                           "(layout=framework only)")
        self._tensordict_checked = False
        # the loss path first: a commit before the engine's loss is refused naming it
        checkout = FRAMEWORK.source(src)
        loss_era = detect_loss_era(checkout, (FRAMEWORK.commit(checkout) or "")[:10] or checkout.name)
        opts = dict(config.options) | {"call_site": "engine"}
        super().__init__(src, TargetConfig(config.src, tuple(opts.items())))
        self.loss_era = loss_era
        modes = self.loss_era["agg_loss"]["modes"]
        default = self.loss_era["default_loss_agg_mode"] or "token-mean"
        self.loss_agg_mode = config.get("loss_agg_mode", default)
        if self.loss_agg_mode not in modes:
            raise BadInput(f"target 'verl:loss': option loss_agg_mode={self.loss_agg_mode!r}: agg_loss at "
                           f"{self.short()} takes {', '.join(modes)}")
        self.loss_scale_factor = config.get("loss_scale_factor")
        if self.loss_scale_factor not in (None, GLOBAL_COUNT):
            raise BadInput(f"target 'verl:loss': option loss_scale_factor={self.loss_scale_factor!r}: only "
                           f"{GLOBAL_COUNT} (the global batch's masked-in token count) is checked")
        if self.loss_scale_factor is not None and self.loss_agg_mode != NORM:
            raise BadInput(f"target 'verl:loss': option loss_scale_factor is read by loss_agg_mode={NORM} only")
        if self.data_path is None:
            raise BadInput(f"verl at {self.short()}: no engine packing in {UTIL_FILE} for the loss's micro-batches")
        self.objective, self.unchecked = self._objective()
        self.framework_files = (str(TP_FILE), str(UTIL_FILE), str(ENGINE_FILE), str(LOSSES_FILE), str(PADDING_FILE),
                                str(CORE_ALGOS_FILE), str(TORCH_FUNCTIONAL_FILE))
        self.capabilities = loss_capabilities(self._capabilities(), self.unchecked, self.data_path.builds)
        self._loss_fns: dict[str, Any] | None = None
        self._step_state: dict[str, Any] = {}
        self.engine_config_missing: set[str] = set()

    # -- the objective ----------------------------------------------------------------------
    def _objective(self) -> tuple[str, str | None]:
        """(the declared objective, or why the mode cannot be checked)."""
        mode = self.loss_agg_mode
        if mode in OBJECTIVES:
            return OBJECTIVES[mode], None
        if mode == NORM:
            if not self.loss_era["agg_loss"]["norm_is_global_token_sum"]:
                return "", (f"loss_agg_mode={NORM} at {self.short()} is the mean over samples of each sample's token "
                            "sum, over loss_scale_factor (agg_loss): not an objective the reference computes "
                            "(sample_mean, token_mean)")
            if self.loss_scale_factor != GLOBAL_COUNT:
                return "", (f"loss_agg_mode={NORM} at {self.short()} is the global batch's token sum over "
                            "loss_scale_factor (None: the padded response length): not an objective the reference "
                            f"computes; --target-opt loss_scale_factor={GLOBAL_COUNT} makes it the token mean")
            return "token_mean", None
        what = NOT_OBJECTIVES.get(mode, "an aggregation this adapter does not know")
        return "", (f"loss_agg_mode={mode} is {what}: not an objective the reference computes (sample_mean, "
                    "token_mean)")

    @property
    def definitions(self) -> Definitions:
        agg = f"{CORE_ALGOS_FILE}:{self.loss_era['agg_loss']['line']} agg_loss"
        source = f"verl's loss_agg_mode={self.loss_agg_mode} ({agg})"
        if self.loss_agg_mode == NORM:
            source = f"verl's loss_agg_mode={NORM} with loss_scale_factor = the global batch's masked-in count ({agg})"
        return Definitions(objective=self.objective, objective_source=source)

    # -- imports ----------------------------------------------------------------------------
    def import_module(self, name: str) -> types.ModuleType:
        if not self._tensordict_checked:  # before verl's first module: its files import tensordict
            self._tensordict_checked = True
            import sys

            if tensordict_missing():
                stand_in = tensordict_stand_in()
                sys.modules.update(stand_in)
                self.checkout.undo_later(lambda: [sys.modules.pop(k, None) for k in stand_in])
        return super().import_module(name)

    def module_names(self) -> tuple[str, ...]:
        """The loss path's modules first: core_algos.py takes helpers from verl/utils/__init__.py, which
        must then run (the log-prob path's imports alone would make verl.utils an empty package)."""
        return (LOSSES_MODULE, CONFIG_MODULE, TU_MODULE) + super().module_names()

    def forget(self) -> None:
        super().forget()
        self._tensordict_checked = False
        self._loss_fns = None
        self._step_state = {}

    def _loss_functions(self, device: Any) -> dict[str, Any]:
        """verl's ppo_loss, its config class, tensordict_utils and the engine's compiled lines."""
        if self._loss_fns is None:
            from megatron.core import parallel_state

            mods = self.modules(self.module_names())
            losses, config, tu = mods[LOSSES_MODULE], mods[CONFIG_MODULE], mods[TU_MODULE]
            engine = compile_engine(self.src, {
                "torch": torch, "tu": tu, "mpu": parallel_state,
                # verl.utils.device.get_device_id: the rank's device (torch.cuda.current_device() on a CPU world raises)
                "get_device_id": lambda: device,
            })
            self._loss_fns = {"ppo_loss": losses.ppo_loss, "TensorDict": losses.TensorDict, "tu": tu,
                              "config": getattr(config, "McoreActorConfig", None) or config.ActorConfig,
                              "engine": engine}
        return self._loss_fns

    # -- the step ---------------------------------------------------------------------------
    def _engine_stand_in(self, inputs: RankInputs) -> Any:
        """The engine the compiled methods are bound to: verl's methods, its config as the loss path reads it."""
        fns = self._loss_functions(inputs.logits.device)["engine"]
        cls = type("MegatronEngineWithLMHead", (), {k: v for k, v in fns.items()})
        engine = cls()
        engine.engine_config = _Config(dynamic_context_parallel=False, use_remove_padding=inputs.layout != "bshd",
                                       context_parallel_size=inputs.cp_size)
        engine.tf_config = _Config(calculate_per_token_loss=self.calculate_per_token_loss)
        return engine

    def _actor_config(self, inputs: RankInputs, batch_num_tokens: int) -> Any:
        """verl's McoreActorConfig as the worker builds it: the option's loss_agg_mode, the scenario's
        entropy coefficient, verl's defaults otherwise (vanilla PPO, no KL loss)."""
        # rollout_n and a micro-batch size: what its __post_init__ asserts are set
        fields: dict[str, Any] = {"rollout_n": 1, "ppo_micro_batch_size_per_gpu": 1,
                                  "loss_agg_mode": self.loss_agg_mode, "calculate_entropy": inputs.with_entropy,
                                  "entropy_coeff": inputs.entropy_coef if inputs.with_entropy else 0.0}
        if self.loss_scale_factor == GLOBAL_COUNT:
            fields["loss_scale_factor"] = batch_num_tokens
        cls = self._loss_functions(inputs.logits.device)["config"]
        known = {f.name for f in dataclasses.fields(cls)}
        with warnings.catch_warnings():  # verl's own notice (sequence parallel off at tp 1)
            warnings.simplefilter("ignore")
            return cls(**{k: v for k, v in fields.items() if k in known})

    def _global_batch_info(self, inputs: RankInputs, engine: Any) -> dict[str, Any]:
        """What forward_backward_batch computes over the replica's mini-batch before it splits it
        (verl's lines), once a step: on its first micro-batch."""
        step = inputs.step
        if step.micro_batch == 0 or not self._step_state:
            fns = self._loss_functions(inputs.logits.device)
            tu = fns["tu"]
            device = inputs.logits.device
            masks = [step.loss_masks[i] for i in step.replica_samples]
            width = max(len(m) for m in step.loss_masks)
            mini = fns["TensorDict"]({"loss_mask": _padded(masks, width, torch.int64, device)},
                                     batch_size=[len(masks)])
            fns["engine"]["forward_backward_batch"](engine, mini, None)
            info = {k: tu.get_non_tensor_data(mini, k, None) for k in ("batch_num_tokens", "dp_size")}
            count = int(sum(int(m.sum()) for m in step.loss_masks) * step.copies)
            self._step_state = {"info": info, "config": self._actor_config(inputs, count)}
        return self._step_state

    def _whole_old_log_probs(self, inputs: RankInputs) -> list[torch.Tensor]:
        """Each sample's old log-probs over its whole response: verl's micro-batch holds them on
        every CP rank; the harness hands each rank its share, summed here over the CP group into
        zeros elsewhere (a NaN stays at its own token)."""
        shares = inputs.rank_layout.share
        old = inputs.policy.old_log_probs
        whole = []
        for k, (js, values) in enumerate(zip(shares, old)):
            row = torch.zeros(inputs.response_lengths[k], dtype=torch.float32, device=inputs.logits.device)
            row[torch.tensor(list(js), dtype=torch.int64, device=row.device)] = values.to(row.device, row.dtype)
            whole.append(row)
        if inputs.cp_size > 1:
            import torch.distributed as dist

            flat = torch.cat(whole)
            dist.all_reduce(flat, group=inputs.cp_group)
            whole = list(flat.split(list(inputs.response_lengths)))
        return whole

    def _micro_batch(self, inputs: RankInputs, info: dict[str, Any]) -> Any:
        """The micro-batch as verl's engine hands it to the loss (DataProto's padded fields after
        left_right_2_no_padding, the non-tensors forward_backward_batch and the trainer set)."""
        fns = self._loss_functions(inputs.logits.device)
        tu, step, rollout = fns["tu"], inputs.step, inputs.rollout
        device = inputs.logits.device
        tokens = [t.to(device) for t in rollout.tokens]
        prompts = [t - r for t, r in zip(rollout.total_lengths, rollout.response_lengths)]
        width_p = max(prompts)
        width_r = max(len(m) for m in step.loss_masks)  # the batch's responses share one width
        masks = [m.to(device) for m in inputs.policy.loss_masks]
        data = fns["TensorDict"]({
            "input_ids": self.data_path.nested(tokens),
            "prompts": _padded([t[:p] for t, p in zip(tokens, prompts)], width_p, torch.int64, device, left=True),
            "responses": _padded([t[p:] for t, p in zip(tokens, prompts)], width_r, torch.int64, device),
            "attention_mask": torch.cat([_padded([torch.ones(p) for p in prompts], width_p, torch.int64, device, True),
                                         _padded([torch.ones(r) for r in rollout.response_lengths], width_r,
                                                 torch.int64, device)], dim=1),
            "response_mask": _padded(masks, width_r, torch.int64, device),
            "old_log_probs": _padded(self._whole_old_log_probs(inputs), width_r, torch.float32, device),
            "advantages": _padded([step.advantages[g] for g in step.samples], width_r, torch.float32, device),
        }, batch_size=[len(tokens)])
        data["loss_mask"] = data["response_mask"]  # left_right_2_no_padding: loss_mask = response_mask
        # the trainer's (ray_trainer.py _update_actor: calculate_entropy, global_batch_size), the engine's
        # (num_micro_batch) and left_right_2_no_padding's (max_response_len)
        tu.assign_non_tensor(data, **info, calculate_entropy=inputs.with_entropy,
                             global_batch_size=step.global_batch_size, num_micro_batch=step.num_microbatches,
                             max_response_len=width_r)
        return data

    def compute(self, inputs: RankInputs) -> RankOutputs:
        if inputs.step is None or inputs.policy is None or inputs.rollout is None:
            raise ValueError("verl:loss is a training step's loss on verl's packing: it needs the step inputs, the "
                             "policy batch and the rollout")
        call, context = self._caller(inputs)
        try:
            model_output = self._engine_forward(call, inputs)
        finally:
            self.missing_config |= context["self"].engine_config.__dict__["_missing"]
        engine = self._engine_stand_in(inputs)
        state = self._global_batch_info(inputs, engine)
        data = self._micro_batch(inputs, state["info"])
        fns = self._loss_functions(inputs.logits.device)
        # verl's actor worker: partial(ppo_loss, config=actor_config) (engine_workers.py)
        loss_function = functools.partial(fns["ppo_loss"], config=state["config"])
        try:
            result = engine.postprocess_micro_batch_func(model_output, data=data, forward_only=False,
                                                         loss_function=loss_function)
        finally:
            self.engine_config_missing |= engine.engine_config.__dict__["_missing"]
        loss, num_tokens, logged = (result[0], None, result[1]) if len(result) == 2 else result
        rollout = inputs.rollout
        starts = [t - r - 1 for t, r in zip(rollout.total_lengths, rollout.response_lengths)]
        responses = {k: [v[i][s: s + r] for i, (s, r) in enumerate(zip(starts, rollout.response_lengths))]
                     for k, v in model_output.items() if k in ("log_probs", "entropy")}
        out = self._outputs(inputs, responses)
        reported = {"loss": logged.get("loss"), "metrics": sorted(logged.get("metrics") or {})}
        return RankOutputs(out.log_probs, out.entropy, loss=loss, num_tokens=num_tokens, reported=reported)

    # -- the report -------------------------------------------------------------------------
    def _line_of(self, rel: Path, text: str) -> str:
        """``file:line`` of the first line of the checkout's file holding ``text`` (the file alone where none does)."""
        path = self.src / rel
        lines = path.read_text().splitlines() if path.is_file() else []
        return next((f"{rel}:{i}" for i, line in enumerate(lines, 1) if text in line), str(rel))

    def description(self) -> dict[str, Any]:
        out = super().description()
        era = self.loss_era
        engine = str(ENGINE_FILE)
        info_lines = ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in era["global_batch_info_lines"])
        post = era["postprocess_micro_batch_func"]
        # the lines of verl's whose values the adapter sets itself
        at = {"loss_mask": self._line_of(PADDING_FILE, 'data["loss_mask"] = data["response_mask"]'),
              "global_batch_size": self._line_of(TRAINER_FILE, "global_batch_size=ppo_mini_batch_size"),
              "calculate_entropy": self._line_of(TRAINER_FILE, "calculate_entropy = self.config"),
              "num_micro_batch": self._line_of(ENGINE_FILE, "num_micro_batch=n_micro_batch)"),
              "max_response_len": self._line_of(PADDING_FILE, '"max_response_len", max_response_len')}
        out["loss"] = {
            "loss_agg_mode": self.loss_agg_mode,
            "loss_agg_mode_default": era["default_loss_agg_mode"],
            "loss_scale_factor": self.loss_scale_factor,
            "unchecked": self.unchecked,
            "loss_function": (f"{LOSSES_FILE}:{era['ppo_loss']['line']} ppo_loss (imported from the checkout), "
                              "partial(ppo_loss, config=McoreActorConfig(...)) as verl's actor worker binds it; "
                              f"it calls {CORE_ALGOS_FILE}'s compute_policy_loss_vanilla and agg_loss"),
            "engine": (f"compiled alone from {engine}: forward_backward_batch's global batch info "
                       f"(lines {info_lines}), "
                       "MegatronEngine.get_data_parallel_size / get_data_parallel_group, MegatronEngineWithLMHead."
                       f"prepare_model_outputs and postprocess_micro_batch_func (lines {post['line']}-{post['end']})"),
            "megatron_form": ("two-value (loss * num_micro_batch, logged): tf_config.calculate_per_token_loss=False" +
                              ("; the engine's per-token branch (calculate_per_token_loss=True) is not followed"
                               if post["per_token_branch"] else "")),
            "written_by_shardcheck": [
                "the micro-batch TensorDict: prompts left-padded, responses / response_mask / old_log_probs / "
                "advantages right-padded to the batch's longest response, attention_mask, loss_mask = response_mask "
                f"({at['loss_mask']} left_right_2_no_padding, on DataProto's padded batch)",
                "global_batch_size = the step's samples over every data-parallel replica (the trainer's "
                f"ppo_mini_batch_size * rollout.n, {at['global_batch_size']}); calculate_entropy = the scenario's "
                "with_entropy (the trainer's actor.calculate_entropy or entropy_coeff != 0, "
                f"{at['calculate_entropy']})",
                f"num_micro_batch = the step's micro-batch count ({at['num_micro_batch']})",
                f"max_response_len = the batch's longest response ({at['max_response_len']})",
                "the old log-probs of the whole response on every CP rank (verl's micro-batch holds them there): "
                "each rank's share summed over the CP group",
                "micro-batches: the harness's split (megatron's rules), not verl's prepare_micro_batches "
                "(verl/workers/engine/utils.py)",
            ] + ([f"loss_scale_factor = the global batch's masked-in token count ({GLOBAL_COUNT})"]
                 if self.loss_scale_factor else []),
            "stand_ins": [TENSORDICT_STAND_IN] * tensordict_missing() + [
                "verl.utils.device.get_device_id answered with the rank's device"],
            "engine_config_read_but_not_set": sorted(self.engine_config_missing),
            "era": era,
        }
        return out


def build(config: TargetConfig) -> VerlLossTarget:
    return VerlLossTarget(config.src, config)
