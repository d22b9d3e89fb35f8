"""``areal:loss``: AReaL's PPO actor loss in the training step, on its Megatron engine's terms.

What runs, per micro-batch of the harness's step (megatron-core's schedule and DDP around it,
docs/training.md), all of it compiled alone from AReaL's files:

- ``MegatronEngine.train_batch`` (``areal/engine/megatron_engine.py``) as the PPO actor calls it
  (``PPOActor._ppo_update``: ``self.engine.train_batch(mb, loss_fn=functools.partial(grpo_loss_fn,
  ...), loss_weight_fn=lambda x: x["loss_mask"].count_nonzero())``, both keyword expressions
  evaluated from the actor's own file, the ``self.config`` fields they read being
  ``PPOActorConfig``'s defaults read from ``areal/api/cli_args.py``). ``train_batch`` computes
  ``total_loss_weight`` (``compute_total_loss_weight``: the micro-batches' loss weights summed
  and all-reduced over megatron's data-parallel (x CP) group, a real collective) and
  ``loss_multiplier`` (its own line: dp x the optimizer's loss scale x ``len(mb_list)`` at the
  pin), then ``forward_backward_batch`` -> ``forward_step`` -> ``_compute_logprobs_and_loss``,
  which hands ``grpo_loss_fn`` -> ``ppo_actor_loss_fn`` the log-probs and scales its loss by
  ``local_weight / total_loss_weight * loss_multiplier``. What that returns to megatron's
  schedule (``(loss, {})``, the two-value form) is the loss the harness's schedule runs.
- ``grpo_loss_fn`` and its helpers (``areal/trainer/ppo/actor.py``), ``ppo_actor_loss_fn``
  (``areal/utils/functional/functional.py``), ``infer_token_denominator``
  (``areal/trainer/ppo/stats.py``) and the ``DistributedStatsTracker`` its statistics go to
  (``areal/utils/stats_tracker.py``, a fresh one per call of train_batch; what it would export is
  not checked). ``areal/utils/constants.py`` (datetime and enum only) is imported as it is.

What stands in (describe() lists it): the Megatron model (the harness's logits), the schedule
``forward_backward_batch`` hands its ``forward_step`` to (one forward step: the harness's
megatron-core schedule is the real one, around the whole), ``_prepare_mb_list`` (the harness
splits the step; AReaL's packing packs micro-batch k; the replica's other micro-batches are
their loss masks, which is all ``compute_total_loss_weight`` reads), the optimizer
(``get_loss_scale()`` 1.0, megatron's without a grad scaler: bf16, AReaL's default dtype;
``zero_grad`` and ``step`` are the harness's DDP buffer and nothing) and the engine object.

What the adapter writes itself, said in describe() with the line it follows: the per-token
inputs placed in AReaL's rolled ``[B, S]`` batch as ``PPOActor.compute_advantages`` leaves them
(``logprobs`` and ``prox_logp`` the same old log-probs, actor.py:191; ``loss_mask`` float,
actor.py:175), the whole response's old log-probs on every CP rank (the harness hands each CP
rank its share; AReaL's batch holds whole sequences on every rank: the shares are summed over
the CP group), and, only with ``--target-opt entropy_bonus=adapter``, an entropy term AReaL's
loss does not have (``grpo_loss_fn`` detaches the entropy and logs it).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import time
import types
from collections import defaultdict
from enum import Enum, auto
from pathlib import Path
from threading import Lock
from typing import Any, Callable

import torch
import torch.distributed as dist

from shardcheck.errors import BadInput
from shardcheck.scenarios.scenario import Scenario
from shardcheck.targets.areal import ENTRY_POINTS, ArealTarget, _closure
from shardcheck.targets.areal_data import (ENGINE_CLASS, ENGINE_FILE, ENGINE_METHODS, GLOO_SAFE_DIST_F,
                                           TRAIN_ENGINE_FILE, ArealDataPath, ArealEnginePath, _dataclass, _parse,
                                           _top_level, module_constants)
from shardcheck.targets.base import Capabilities, Definitions, RankInputs, RankOutputs
from shardcheck.targets.compiled import compile_alone

ACTOR_FILES = (Path("areal/trainer/ppo/actor.py"), Path("areal/engine/ppo/actor.py"))  # moved under trainer/
FUNCTIONAL_FILE = Path("areal/utils/functional/functional.py")
CLI_ARGS_FILE = Path("areal/api/cli_args.py")
STATS_FILE = Path("areal/trainer/ppo/stats.py")
TRACKER_FILE = Path("areal/utils/stats_tracker.py")
CONSTANTS_MODULE = "areal.utils.constants"
ACTOR_CLASS, ACTOR_CONFIG, ACTOR_LOSS = "PPOActor", "PPOActorConfig", "grpo_loss_fn"
LOSS_METHODS = ENGINE_METHODS + ("train_batch",)
# what train_batch calls on the engine besides them: compiled where train_batch calls it (since
# 2026: a list of batches concatenated), or stood in for (ArealLossPath.step)
NORMALIZE = "_normalize_batch_input"
STOOD_IN = ("_ensure_ready", "optimizer_zero_grad", "_prepare_mb_list", "optimizer_step")
LOSS_FUNCTIONS = ("ppo_actor_loss_fn", "sapo_loss_fn")
LOSS_SCALE = 1.0  # megatron's optimizer without a grad scaler (bf16, AReaL's default dtype): get_loss_scale()
ENGINE_VERSION = 0  # PPOActor's current_version (engine.get_version()): read only where the batch has versions
ENTROPY_BONUS = ("none", "adapter")


# ---- what this checkout's actor and engine say, from their source --------------------------------

def _method(tree: ast.Module | None, cls: str, name: str) -> ast.FunctionDef | None:
    klass = next((n for n in (tree.body if tree else []) if isinstance(n, ast.ClassDef) and n.name == cls), None)
    return next((n for n in (klass.body if klass else []) if isinstance(n, ast.FunctionDef) and n.name == name),
                None)


def _assigned(fn: ast.FunctionDef, name: str) -> ast.Assign | None:
    """The first ``name = ...`` statement in ``fn`` (at any depth)."""
    return next((n for n in ast.walk(fn) if isinstance(n, ast.Assign) and len(n.targets) == 1
                 and isinstance(n.targets[0], ast.Name) and n.targets[0].id == name), None)


def loss_facts(src: Path) -> dict[str, Any] | str:
    """How this checkout's PPO actor calls train_batch and how train_batch normalises its loss,
    from their source; a string saying why not, where they are not there."""
    actor = next((f for f in ACTOR_FILES if ACTOR_LOSS in _top_level(_parse(src / f))), None)
    if actor is None:
        return f"no {ACTOR_LOSS} in {' or '.join(map(str, ACTOR_FILES))}"
    tree = _parse(src / actor)
    klass = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == ACTOR_CLASS), None)
    call = next((n for n in ast.walk(klass) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                 and n.func.attr == "train_batch"), None) if klass is not None else None
    keywords = {k.arg: k.value for k in call.keywords} if call is not None else {}
    if not {"loss_fn", "loss_weight_fn"} <= set(keywords):
        return f"{actor}: {ACTOR_CLASS} calls no engine.train_batch(..., loss_fn=..., loss_weight_fn=...)"
    train = _method(_parse(src / ENGINE_FILE), ENGINE_CLASS, "train_batch")
    lines = {name: _assigned(train, name) for name in ("total_loss_weight", "loss_multiplier")} if train else {}
    if not train or not all(lines.values()):
        return f"{ENGINE_FILE}: {ENGINE_CLASS}.train_batch sets no total_loss_weight and loss_multiplier"
    calls = sorted({n.func.attr for n in ast.walk(train) if isinstance(n, ast.Call)
                    and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
                    and n.func.value.id == "self"})
    unknown = [c for c in calls if c not in LOSS_METHODS + STOOD_IN + (NORMALIZE,)]
    if unknown:
        return f"{ENGINE_FILE}: {ENGINE_CLASS}.train_batch calls self.{', self.'.join(unknown)}, which the adapter " \
               "neither compiles nor stands in for"
    if not (src / FUNCTIONAL_FILE).is_file():
        return f"no {FUNCTIONAL_FILE} (ppo_actor_loss_fn)"
    return {"actor_file": str(actor), "call_line": call.lineno, "loss_fn": keywords["loss_fn"],
            "loss_weight_fn": keywords["loss_weight_fn"], "aliases": _config_aliases(_method(tree, ACTOR_CLASS,
                                                                                             "__init__")),
            "train_batch_line": train.lineno,
            "methods": LOSS_METHODS + ((NORMALIZE,) if NORMALIZE in calls else ()),
            "normalisation": {name: (ast.unparse(node.value), node.lineno) for name, node in lines.items()}}


def _config_aliases(init: ast.FunctionDef | None) -> dict[str, str]:
    """``self.NAME = config.FIELD`` in PPOActor.__init__, {NAME: FIELD}: what the call site's
    ``self.NAME`` (``self.m2_threshold``) reads."""
    if init is None:
        return {}
    return {t.attr: n.value.attr for n in ast.walk(init) if isinstance(n, ast.Assign) and len(n.targets) == 1
            for t in n.targets if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
            and t.value.id == "self" and isinstance(n.value, ast.Attribute)
            and isinstance(n.value.value, ast.Name) and n.value.value.id == "config"}


class ActorConfigDefaults:
    """``PPOActorConfig`` as its defaults: each field the call site reads, its ``field(default=...)``
    (or plain default) read from ``areal/api/cli_args.py`` (a name among them, e.g.
    ``PROX_LOGP_METHOD_RECOMPUTE``, taken from ``constants``); the fields read are kept."""

    def __init__(self, src: Path, constants: dict[str, Any]) -> None:
        tree = _parse(src / CLI_ARGS_FILE)
        self._classes = {n.name: n for n in (tree.body if tree else []) if isinstance(n, ast.ClassDef)}
        self._constants = constants
        self.read: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self.read:
            self.read[name] = self._default(ACTOR_CONFIG, name)
        return self.read[name]

    def _default(self, cls: str, name: str) -> Any:
        klass = self._classes.get(cls)
        if klass is None:
            raise BadInput(f"{CLI_ARGS_FILE} has no class {cls} (the PPO actor's config)")
        for node in klass.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                value = node.value
                if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
                    value = next((k.value for k in value.keywords if k.arg == "default"), None)
                if value is None:
                    raise BadInput(f"{CLI_ARGS_FILE}: {cls}.{name} has no plain default the adapter can read")
                if isinstance(value, ast.Name) and value.id in self._constants:
                    return self._constants[value.id]
                return ast.literal_eval(value)
        for base in klass.bases:  # a field of a base class (TrainEngineConfig)
            if isinstance(base, ast.Name) and base.id in self._classes:
                with contextlib.suppress(BadInput):
                    return self._default(base.id, name)
        raise BadInput(f"{CLI_ARGS_FILE}: {cls} has no field {name}")


class StepMicroBatches:
    """Stands in for ``_prepare_mb_list``'s MicroBatchList on micro-batch ``index`` of the harness's
    step: ``mbs`` holds every micro-batch of this replica (``index`` AReaL's packed one, the others
    their loss masks: what ``compute_total_loss_weight`` reads of them), ``len`` is AReaL's
    (``len(self.mbs)``), and iterating it yields micro-batch ``index`` alone, from AReaL's own
    padded one-micro-batch list: the harness's schedule runs the others."""

    def __init__(self, own: Any, index: int, others: list[dict[str, torch.Tensor]]) -> None:
        self.own, self.index = own, index
        self.mbs = others[:index] + list(own.mbs) + others[index:]

    def __len__(self) -> int:
        return len(self.mbs)

    def __iter__(self) -> Any:
        return iter(self.own)

    @property
    def max_seqlen(self) -> int:
        return self.own.max_seqlen

    @property
    def padded_mbs(self) -> list[dict[str, Any]]:
        return self.own.padded_mbs

    def to(self, *args: Any, **kwargs: Any) -> "StepMicroBatches":
        return self  # built on the logits' device


class _TrackerHolder:
    """What ``grpo_loss_fn`` reads as its module ``stats_tracker``: the current tracker's methods."""

    def __init__(self) -> None:
        self.current: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.current, name)


class ActorLoss:
    """The PPO actor's loss_fn and loss_weight_fn, as ``PPOActor._ppo_update`` builds them, compiled
    alone from the actor's file (``grpo_loss_fn`` and its helpers), functional.py
    (``ppo_actor_loss_fn``, ``sapo_loss_fn`` and theirs), stats.py and stats_tracker.py."""

    def __init__(self, src: Path, facts: dict[str, Any], import_module: Callable[[str], Any]) -> None:
        actor = src / facts["actor_file"]
        constants = {k: v for k, v in vars(import_module(CONSTANTS_MODULE)).items() if not k.startswith("__")}
        tracker_fns = compile_alone(src / TRACKER_FILE, ["ReduceType", "DistributedStatsTracker"], {
            "Enum": Enum, "auto": auto, "Lock": Lock, "contextmanager": contextlib.contextmanager,
            "defaultdict": defaultdict, "time": time, "torch": torch, "dist": dist},
            off_path=("current_platform", "flat2d", "logger"))
        self.tracker_class = tracker_fns["DistributedStatsTracker"]
        self.tracker = _TrackerHolder()
        functional = compile_alone(src / FUNCTIONAL_FILE, _closure(_parse(src / FUNCTIONAL_FILE), LOSS_FUNCTIONS),
                                   {"torch": torch, "dataclass": _dataclass}, off_path=("KLEstimator",))
        given: dict[str, Any] = {"torch": torch, "stats_tracker": self.tracker, **constants,
                                 **{n: functional[n] for n in LOSS_FUNCTIONS},
                                 **module_constants(actor, ("_EPSILON",))}
        if (src / STATS_FILE).is_file():
            given["infer_token_denominator"] = compile_alone(src / STATS_FILE, ["infer_token_denominator"],
                                                             {"torch": torch})["infer_token_denominator"]
        tree = _parse(actor)
        self.functions = compile_alone(actor, _closure(tree, (ACTOR_LOSS,)), given)
        self.config = ActorConfigDefaults(src, constants)
        self.facts = facts
        # the call site's own expressions, evaluated as PPOActor._ppo_update evaluates them
        this = types.SimpleNamespace(config=self.config)
        used = {n.attr for n in ast.walk(facts["loss_fn"]) if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name) and n.value.id == "self"}
        for name, field in facts["aliases"].items():
            if name in used:  # self.m2_threshold = config.m2_threshold (PPOActor.__init__)
                setattr(this, name, getattr(self.config, field))
        scope = {"functools": functools, ACTOR_LOSS: self.functions[ACTOR_LOSS], "self": this,
                 "current_version": ENGINE_VERSION}
        self.loss_fn = self._evaluate(actor, facts["loss_fn"], scope)
        self.loss_weight_fn = self._evaluate(actor, facts["loss_weight_fn"], scope)

    @staticmethod
    def _evaluate(path: Path, node: ast.expr, scope: dict[str, Any]) -> Any:
        code = compile(ast.Expression(body=node), str(path), "eval")
        return eval(code, {"__builtins__": __builtins__, **scope})  # noqa: S307 - AReaL's own expression

    def fresh_tracker(self) -> None:
        """A new DistributedStatsTracker for one call of train_batch (what AReaL exports is not checked)."""
        self.tracker.current = self.tracker_class()


class ArealLossPath(ArealEnginePath):
    """MegatronEngine.train_batch on one micro-batch of the harness's step, with the PPO actor's loss."""

    def __init__(self, src: Path, facts: dict[str, Any], data: ArealDataPath, logprob_functions: dict[str, Any],
                 dist_f: Any, methods: tuple[str, ...]) -> None:
        self.handed: list[Any] = []
        total = compile_alone(src / TRAIN_ENGINE_FILE, ["compute_total_loss_weight"], {"torch": torch, "dist": dist})
        super().__init__(src, facts, data, logprob_functions, dist_f, methods=methods,
                         schedule=self._one_forward_step,
                         extra={"compute_total_loss_weight": total["compute_total_loss_weight"]},
                         off_path=("concat_batch",))

    def _one_forward_step(self, *, forward_step_func: Callable[..., Any], data_iterator: Any, model: Any,
                          **_: Any) -> None:
        """Stands in for the schedule forward_backward_batch calls: the forward step of the one
        micro-batch its iterator yields and its loss_func; what that hands megatron is kept (the
        harness's megatron-core schedule, around the whole, runs it)."""
        output, loss_func = forward_step_func(data_iterator, model)
        self.handed.append(loss_func(output))

    def step(self, logits: torch.Tensor, rows: torch.Tensor, batch: dict[str, torch.Tensor], knobs: dict[str, Any],
             index: int, others: list[dict[str, torch.Tensor]], temperature: float, loss_fn: Any,
             loss_weight_fn: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """train_batch(batch, loss_fn, loss_weight_fn) for micro-batch ``index``: the (loss, logged)
        AReaL's forward step hands megatron's schedule."""
        engine = self._engine(logits, rows, temperature)
        engine.device = logits.device
        engine.optimizer = types.SimpleNamespace(get_loss_scale=lambda: torch.tensor(LOSS_SCALE))
        engine.optimizer_zero_grad = lambda: None  # the harness zeroes DDP's gradient buffer
        engine.optimizer_step = lambda: {}  # the optimizer is not run: DDP's main_grad is what is checked
        engine._prepare_mb_list = lambda input_: StepMicroBatches(self.data.pack(input_, knobs), index, others)
        self.handed.clear()
        engine.train_batch(batch, loss_fn=loss_fn, loss_weight_fn=loss_weight_fn)
        if len(self.handed) != 1:
            raise RuntimeError(f"AReaL's forward step handed megatron's schedule {len(self.handed)} losses "
                               "(expected 1)")
        loss, logged = self.handed[0]
        return loss, logged


class Recorder:
    """Wraps the actor's loss_fn: keeps what ``_compute_logprobs_and_loss`` hands it (log-probs,
    entropy, inputs) and, with ``entropy_coef``, adds the adapter's entropy term."""

    def __init__(self, loss_fn: Any, entropy_coef: float) -> None:
        self.loss_fn, self.entropy_coef = loss_fn, entropy_coef
        self.seen: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]] = []

    def __call__(self, logprobs: torch.Tensor, entropy: torch.Tensor, input_data: dict[str, Any], **kwargs: Any
                 ) -> torch.Tensor:
        self.seen.append((logprobs, entropy, input_data))
        loss = self.loss_fn(logprobs, entropy, input_data, **kwargs)
        if not self.entropy_coef:
            return loss
        # the adapter's term, reduced as ppo_actor_loss_fn reduces pg_loss (functional.py:542 at the
        # pin: torch.where(loss_mask, pg_loss, 0).sum() / loss_mask_count, loss_mask_count =
        # loss_mask.count_nonzero() or 1, :483); selected, not multiplied, so a masked NaN reaches nothing
        mask = input_data["loss_mask"].bool()
        count = mask.count_nonzero() or 1
        return loss - self.entropy_coef * torch.where(mask, entropy, 0).sum() / count


def fully_masked_micro_batch(scenario: Scenario) -> str | None:
    """Why a step scenario cannot be checked here, or None: a micro-batch whose every response
    token is masked (AReaL's _compute_logprobs_and_loss returns ``output.mean() * 0.0`` for it
    and computes no log-probs for the harness to compare)."""
    from shardcheck.scenarios.data import ScenarioData

    data = ScenarioData(scenario, loss="step")
    for replica in range(scenario.dp):
        for mb in scenario.micro_batches(replica):
            if all(int(data.loss_mask(i).sum()) == 0 for i in mb):
                return (f"the micro-batch of sample{'s' if len(mb) > 1 else ''} {', '.join(map(str, mb))} has every "
                        "token masked: AReaL's _compute_logprobs_and_loss skips it (loss weight 0: output.mean() * "
                        "0.0) and computes no log-probs to compare")
    return None


class ArealLossTarget(ArealTarget):
    """AReaL's PPO actor loss (grpo_loss_fn -> ppo_actor_loss_fn) in the training step, run by
    MegatronEngine.train_batch as PPOActor._ppo_update calls it: loss_weight_fn,
    total_loss_weight over DP x CP, loss_multiplier; option entropy_bonus"""

    loss_form = "step"
    # AReaL leaves megatron's calculate_per_token_loss at its default: the two-value form
    calculate_per_token_loss = False
    # the loss the training step differentiates (the model's CP collective runs in its backward)
    training_loss = True

    def __init__(self, config: Any) -> None:
        self.entropy_bonus = config.get("entropy_bonus", "none")
        if self.entropy_bonus not in ENTROPY_BONUS:
            raise BadInput(f"target 'areal:loss': option entropy_bonus={self.entropy_bonus!r}: expected none or "
                           "adapter")
        super().__init__("loss", config)
        facts = loss_facts(self.src)
        if isinstance(facts, str):
            raise BadInput(f"AReaL at {self.short()}: {facts}: areal:loss runs the PPO actor's loss through "
                           "MegatronEngine.train_batch")
        self.loss_era = facts
        self.definitions = Definitions(objective="token_mean", objective_source=self._objective_source())
        extra = [facts["actor_file"], str(FUNCTIONAL_FILE), str(TRACKER_FILE)] + (
            [str(STATS_FILE)] if (self.src / STATS_FILE).is_file() else [])
        self.framework_files = tuple(dict.fromkeys(list(self.framework_files) + extra))
        self._loss_path: ArealLossPath | None = None
        self._actor: ActorLoss | None = None

    def _objective_source(self) -> str:
        facts = self.loss_era
        norm = facts["normalisation"]
        return (f"AReaL's MegatronEngine.train_batch: each micro-batch's loss x local_weight / total_loss_weight x "
                f"loss_multiplier, loss_weight_fn the PPO actor's {ast.unparse(facts['loss_weight_fn'])} "
                f"({facts['actor_file']}:{facts['loss_weight_fn'].lineno}), total_loss_weight = "
                f"{norm['total_loss_weight'][0]} ({ENGINE_FILE.name}:{norm['total_loss_weight'][1]}), "
                f"loss_multiplier = {norm['loss_multiplier'][0]} ({ENGINE_FILE.name}:{norm['loss_multiplier'][1]}),"
                f" loss_scale {LOSS_SCALE}; megatron's calculate_per_token_loss=False")

    def _capabilities(self) -> Capabilities:
        caps = super()._capabilities()
        inner = caps.rule

        def rule(scenario: Scenario) -> str | None:
            return (self._entropy_rule(scenario) or (inner(scenario) if inner is not None else None)
                    or fully_masked_micro_batch(scenario))

        return dataclasses.replace(caps, rule=rule)

    def _entropy_rule(self, scenario: Scenario) -> str | None:
        if scenario.entropy_coef == 0 or self.entropy_bonus == "adapter":
            return None
        return (f"entropy_coef {scenario.entropy_coef:g}: AReaL's PPO actor loss has no entropy term (grpo_loss_fn "
                "detaches the entropy and only logs it); --target-opt entropy_bonus=adapter adds one, the "
                "adapter's")

    # ---- what runs ------------------------------------------------------------------------

    def _path(self) -> ArealLossPath:
        if self._loss_path is None:
            import torch.distributed.nn.functional as dist_f

            fns = self._functions()
            try:
                self._loss_path = ArealLossPath(self.src, self.era.engine, self.data_path,
                                                {n: fns[n] for n in ENTRY_POINTS},
                                                GLOO_SAFE_DIST_F if self.cp_all_gather == "shardcheck" else dist_f,
                                            self.loss_era["methods"])
            except LookupError as exc:
                raise BadInput(f"AReaL at {self.short()}: {exc}") from None
        return self._loss_path

    def _actor_loss(self) -> ActorLoss:
        if self._actor is None:
            try:
                self._actor = ActorLoss(self.src, self.loss_era, self.import_module)
            except LookupError as exc:
                raise BadInput(f"AReaL at {self.short()}: {exc}") from None
        return self._actor

    def compute(self, inputs: RankInputs) -> RankOutputs:
        step = inputs.step
        if step is None or inputs.policy is None or inputs.rollout is None:
            raise ValueError(f"{self.name} is a training step's loss on AReaL's packing: it needs the step inputs, "
                             "the policy batch and the rollout")
        from shardcheck.scenarios.traced_layout import local_tokens_at

        device = inputs.logits.device
        rows = torch.tensor(local_tokens_at(inputs.rank_layout, inputs.tokens), dtype=torch.int64)
        rollout = inputs.rollout.to(device)
        old = self._whole_old_log_probs(inputs)
        advantages = [step.advantages[g].to(device) for g in step.samples]
        # as compute_advantages leaves them: the old log-probs are logprobs and prox_logp (actor.py:191)
        batch = self.data_path.batch(rollout, {"logprobs": old, "prox_logp": old, "advantages": advantages})
        actor = self._actor_loss()
        actor.fresh_tracker()
        recorder = Recorder(actor.loss_fn, inputs.entropy_coef if self.entropy_bonus == "adapter" else 0.0)
        loss, logged = self._path().step(inputs.logits, rows, batch, rollout.knobs, step.micro_batch,
                                         self._other_loss_masks(step, device), inputs.temperature, recorder,
                                         actor.loss_weight_fn)
        if len(recorder.seen) != 1:
            raise RuntimeError(f"AReaL's _compute_logprobs_and_loss called the actor's loss {len(recorder.seen)} "
                               "times (expected once)")
        logprobs, entropy, fed = recorder.seen[0]
        # what AReaL's loss read: its inputs' packing (cu_seqlens), row p scoring token p + 1
        cu = [int(c) for c in fed["cu_seqlens"].tolist()]
        picks = [cu[i] + (total - response - 1) + torch.tensor(js, dtype=torch.int64, device=logprobs.device)
                 for i, (total, response, js) in enumerate(zip(inputs.total_lengths, inputs.response_lengths,
                                                               inputs.rank_layout.share))]
        ent = [entropy[p] for p in picks] if inputs.with_entropy else None
        return RankOutputs([logprobs[p] for p in picks], ent, loss=loss, num_tokens=None,
                           reported=logged if isinstance(logged, dict) else {})

    def _whole_old_log_probs(self, inputs: RankInputs) -> list[torch.Tensor]:
        """Each sample's old log-probs over its whole response, on every CP rank. The harness hands
        each CP rank its share; AReaL's batch holds whole sequences on every rank (its CP split is the
        logits'): the shares, disjoint, are summed over the CP group (the adapter's collective)."""
        device = inputs.logits.device
        whole = [torch.zeros(r, dtype=torch.float32, device=device) for r in inputs.response_lengths]
        for w, js, v in zip(whole, inputs.rank_layout.share, inputs.policy.old_log_probs):
            w[torch.tensor(js, dtype=torch.int64, device=device)] = v.to(device, torch.float32)
        if inputs.cp_size == 1:
            return whole
        flat = torch.cat(whole)
        dist.all_reduce(flat, group=inputs.cp_group)
        return list(flat.split(list(inputs.response_lengths)))

    @staticmethod
    def _other_loss_masks(step: Any, device: Any) -> list[dict[str, torch.Tensor]]:
        """The replica's other micro-batches as what compute_total_loss_weight reads of them, their
        loss masks: the samples before micro-batch k in k groups, those after it in the rest, in order
        (the grouping changes no sum)."""
        replica = list(step.replica_samples)
        start = replica.index(step.samples[0]) if step.samples else 0
        before, after = replica[:start], replica[start + len(step.samples):]
        groups = _split(before, step.micro_batch) + _split(after, step.num_microbatches - step.micro_batch - 1)
        return [{"loss_mask": torch.cat([step.loss_masks[i].float() for i in g]).to(device)
                 if g else torch.zeros(0, device=device)} for g in groups]

    # ---- report ----------------------------------------------------------------------------

    def forget(self) -> None:
        super().forget()
        self._loss_path = None
        self._actor = None

    def description(self) -> dict[str, Any]:
        out = super().description()
        facts = self.loss_era
        actor = facts["actor_file"]
        out["loss"] = {
            "loss_fn": f"{actor}:{facts['loss_fn'].lineno}: {ast.unparse(facts['loss_fn'])}",
            "loss_weight_fn": f"{actor}:{facts['loss_weight_fn'].lineno}: {ast.unparse(facts['loss_weight_fn'])}",
            **{name: f"{ENGINE_FILE}:{line}: {text}" for name, (text, line) in facts["normalisation"].items()},
            "config": "PPOActorConfig's defaults, read from areal/api/cli_args.py"
                      + (": " + ", ".join(f"{k}={v!r}" for k, v in sorted(self._actor.config.read.items()))
                         if self._actor is not None and self._actor.config.read else ""),
            "entropy_bonus": {"none": "none (AReaL's): scenarios with entropy_coef != 0 are skipped",
                              "adapter": "the adapter's: -entropy_coef x where(loss_mask, entropy, 0).sum() / "
                                         "(loss_mask.count_nonzero() or 1) added to grpo_loss_fn's loss, as "
                                         f"ppo_actor_loss_fn reduces pg_loss ({FUNCTIONAL_FILE})"}[self.entropy_bonus],
        }
        differentiated = "; the adapter's entropy term differentiates it" if self.entropy_bonus == "adapter" else ""
        out["entropy"] = f"-sum p log p, AReaL's gather_logprobs_entropy; grpo_loss_fn detaches it{differentiated}"
        out["stand_ins"] = [
            "the Megatron model (the harness's logits for the rows it is handed)",
            "the schedule forward_backward_batch calls (one forward step and its loss_func: the harness's "
            "megatron-core schedule, DDP and finalize_model_grads run around it)",
            "_prepare_mb_list (the harness's micro-batch split; micro-batch k packed by AReaL's packing, the "
            "replica's other micro-batches as their loss masks, what compute_total_loss_weight reads)",
            f"the optimizer (get_loss_scale() {LOSS_SCALE}: megatron's without a grad scaler, bf16; zero_grad is "
            "the harness's, step is not run)",
            "the engine object (config.temperature, one model chunk)",
            f"PPOActor (current_version {ENGINE_VERSION}; the batch has no versions)",
        ]
        out["adapter_writes"] = [
            "the per-token inputs placed in AReaL's rolled [B, S] batch as compute_advantages leaves them "
            f"({actor}: logprobs and prox_logp the same old log-probs, loss_mask float)",
            "each sample's whole-response old log-probs on every CP rank (the CP ranks' shares summed over the "
            "CP group)",
        ] + (["the entropy term (entropy_bonus=adapter)"] if self.entropy_bonus == "adapter" else [])
        out["not_run"] = [n for n in out.get("not_run", []) if "loss scaling" not in n and "one micro-batch" not in n]
        out["not_run"] += ["PPOActor.compute_advantages (the advantages and old log-probs are the harness's)",
                           "split_padded_tensor_dict_into_mb_list (the harness splits the step)",
                           "the optimizer's step"]
        return out


def _split(items: list[int], parts: int) -> list[list[int]]:
    """``items`` in ``parts`` runs, in order, as even as they go (none when ``parts`` is 0)."""
    if parts <= 0:
        return []
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for k in range(parts):
        stop = start + size + (1 if k < extra else 0)
        out.append(items[start:stop])
        start = stop
    return out
