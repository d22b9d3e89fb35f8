"""NVIDIA-NeMo/RL's policy loss in the training step: ``--target nemo_rl:loss``.

Two eras, each NeMo-RL's own training step around its ``ClippedPGLossFn``.

Its Megatron path (``nemo_rl/models/megatron/train.py``, the pin among them): the loss takes the
log-probs, and ``LossPostProcessor`` wraps it as NeMo-RL's megatron worker builds it: the
preparation (``prepare_loss_input``, ``wrap_loss_fn_with_input_preparation``), its ``/ cp_size``
and its ``x num_microbatches / cp_size`` against megatron's averaging, each compiled alone from
its file; the loss configured with its config class's own defaults (read from the class body);
megatron-core's ``calculate_per_token_loss=True`` with the two-value loss, as NeMo-RL's megatron
setup has it. The normalisation factors (``global_valid_seqs``, ``global_valid_toks``) are the
replica's valid samples and tokens all-reduced over the data-parallel group: the arithmetic of
``models/megatron/data.py``, written here. bshd only (its packed wrapper is not run yet); cp 1
(NeMo-RL's CP gather needs CUDA in backward).

The DTensor worker era, on the commits whose ``ClippedPGLossFn`` takes the logits
(NeMo-RL's DTensor worker era, before its Megatron path; ``nemo_rl/algorithms/loss_functions.py``):

- ``ClippedPGLossFn`` itself, compiled alone from its file with NeMo-RL's own ``masked_mean`` and
  ``calculate_kl_penalty_joschu2020`` (``nemo_rl/algorithms/utils.py``), configured as NeMo-RL's
  GRPO example does (ratio clip 0.2, KL penalty 0.01 against reference log-probs equal to the old
  ones, so its gradient is 0 at ratio 1), on the micro-batch's padded ``[B, S]`` batch
  (``token_mask``, ``sample_mask``, ``advantages``, ``prev_logprobs``, ``generation_logprobs``,
  ``reference_policy_logprobs``, ``input_ids``), called as ``DTensorPolicyWorker.train`` calls it;
- the worker's own lines between that call and ``loss.backward()`` (``loss = loss /
  num_microbatches``; from #266 ``loss *= self.dp_size``), read from
  ``nemo_rl/models/policy/dtensor_policy_worker.py`` and run as written;
- from #266, the worker's normalisation factor: the valid tokens (``token_level_loss``, the
  default) or valid samples of the replica's global batch, all-reduced over the data-parallel group
  (the worker's arithmetic, written here: ``dtensor_policy_worker.py``'s ``train``).

The worker sums its micro-batches' gradients (one ``backward`` each) and FSDP averages over the
data-parallel ranks. megatron-core's schedule divides each micro-batch's loss by their number and
its DDP averages over the data-parallel ranks, so the adapter hands the schedule the worker's loss
times ``num_microbatches``: that cancels the schedule's division, which the worker's loop does not
have (a difference of the harness's loop, not NeMo-RL's; the report says so).

The log-probs checked per micro-batch are the ones ``ClippedPGLossFn`` computes and hands its KL
penalty (``curr_logprobs``). On a CPU world the loss's ``input_ids[:, 1:].cuda()`` stays on the
CPU (the ids tensor answers ``.cuda()`` with itself), said in the report.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import types
from pathlib import Path
from typing import Any

import torch

from shardcheck.errors import BadInput
from shardcheck.scenarios.scenario import Scenario
from shardcheck.targets.base import Capabilities, Definitions, RankInputs, RankOutputs, TargetConfig
from shardcheck.targets.checkout import CheckoutTarget
from shardcheck.targets.compiled import compile_alone

LOSS_FILE = Path("nemo_rl/algorithms/loss_functions.py")
UTILS_FILE = Path("nemo_rl/algorithms/utils.py")
WORKER_FILE = Path("nemo_rl/models/policy/dtensor_policy_worker.py")
LOSS_CLASS = "ClippedPGLossFn"

# NeMo-RL's GRPO example configuration (examples/configs/grpo_math_1B.yaml, loss_fn)
LOSS_CONFIG = {"reference_policy_kl_penalty": 0.01, "ratio_clip_min": 0.2, "ratio_clip_max": 0.2,
               "ratio_clip_c": None, "use_on_policy_kl_approximation": False,
               "use_importance_sampling_correction": False}

OPTION = "token_level_loss"


def _call_parameters(tree: ast.Module) -> list[str] | None:
    """ClippedPGLossFn.__call__'s parameters (self dropped), or None where the file has none."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == LOSS_CLASS:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__call__":
                    return [a.arg for a in item.args.args[1:]]
    return None


def worker_loss_lines(path: Path) -> list[ast.stmt]:
    """The statements of ``DTensorPolicyWorker.train`` that rebind ``loss`` between the loss
    function's call and ``loss.backward()``, in order, as written in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    train = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "train"), None)
    if train is None:
        raise LookupError(f"{path}: no train")
    for block in (getattr(n, "body", None) for n in ast.walk(train)):
        if not isinstance(block, list):
            continue
        calls = [i for i, s in enumerate(block) if isinstance(s, ast.Assign) and isinstance(s.value, ast.Call)
                 and isinstance(s.value.func, ast.Name) and s.value.func.id == "loss_fn"]
        if not calls:
            continue
        lines: list[ast.stmt] = []
        for stmt in block[calls[0] + 1:]:
            for node in ast.walk(stmt):
                if _is_backward(node):
                    return lines
                if isinstance(node, (ast.Assign, ast.AugAssign)) and _binds_loss(node):
                    lines.append(node)
        raise LookupError(f"{path}: train calls no loss.backward() after loss_fn")
    raise LookupError(f"{path}: train calls no loss_fn")


def _is_backward(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "backward"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "loss")


def _binds_loss(node: ast.Assign | ast.AugAssign) -> bool:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return any(isinstance(t, ast.Name) and t.id == "loss" for t in targets)


EXAMPLE_CONFIG = Path("examples/configs/grpo_math_1B.yaml")


def example_loss_config(src: Path) -> dict[str, Any]:
    """The loss_fn section of NeMo-RL's own GRPO example config: the values a commit whose
    ClippedPGLossConfig declares no defaults (a TypedDict, until #2325 made it a pydantic model) runs with."""
    import yaml

    path = src / EXAMPLE_CONFIG
    if not path.is_file():
        raise LookupError(f"no defaults in ClippedPGLossConfig and no {EXAMPLE_CONFIG}")
    section = (yaml.safe_load(path.read_text()) or {}).get("loss_fn")
    if not isinstance(section, dict):
        raise LookupError(f"{EXAMPLE_CONFIG} has no loss_fn section")
    return section


class LossConfig(dict):
    """ClippedPGLossFn's config as each era reads it: a dict (``cfg["ratio_clip_min"]``) until the
    loss took an object (``cfg.ratio_clip_min``), read both ways."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def valid_counts(inputs: RankInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid samples, valid tokens) of the replica's batch, all-reduced over the data-parallel
    group, as NeMo-RL's workers count them before the micro-batches run."""
    from megatron.core import parallel_state

    step = inputs.step
    toks = sum((step.loss_masks[i].sum() for i in step.replica_samples), torch.zeros((), dtype=torch.int64))
    counts = torch.stack([torch.tensor(len(step.replica_samples), dtype=torch.int64), toks]).to(inputs.logits.device,
                                                                                               torch.float32)
    torch.distributed.all_reduce(counts, group=parallel_state.get_data_parallel_group())
    return counts[0], counts[1]


def build(framework: Any, src: str | None, config: TargetConfig) -> "NemoRLLossTarget":
    """The era's target: the Megatron path where ClippedPGLossFn takes log-probs and a
    LossPostProcessor wraps it, else the DTensor worker's."""
    root = framework.source(src)
    if (root / NEW_LOSS_FILE).is_file() and (root / TRAIN_FILE).is_file() and \
            POST_PROCESSOR in (root / TRAIN_FILE).read_text():
        return NemoRLMegatronLossTarget(framework, src, config)
    return NemoRLLossTarget(framework, src, config)


@dataclasses.dataclass(frozen=True)
class WorkerLossEra:
    """NeMo-RL's DTensor-worker era of the loss: ClippedPGLossFn takes the logits."""

    loss_takes: str  # "logits"
    global_count: bool  # the loss takes the global batch's count (total_valid_tokens_or_seqs, or its two counts)
    worker_lines: tuple[str, ...]  # the worker's lines around the loss, as its source has them


@dataclasses.dataclass(frozen=True)
class MegatronLossEra:
    """NeMo-RL's Megatron path: ClippedPGLossFn takes log-probs, a LossPostProcessor wraps it."""

    loss_takes: str  # "log-probs"
    post_processor: str  # FILE:CLASS


class NemoRLLossTarget(CheckoutTarget):
    """NVIDIA-NeMo/RL's ClippedPGLossFn in a training step, with its DTensor worker's lines around it"""

    loss_form = "step"
    calculate_per_token_loss = False  # the worker's loss is a mean: megatron's two-value form
    invariance: dict[str, str] = {}

    def __init__(self, framework: Any, src: str | None, config: TargetConfig) -> None:
        self.framework = framework
        self.name = "nemo_rl:loss"
        super().__init__(src)
        loss_file, worker_file = self.src / LOSS_FILE, self.src / WORKER_FILE
        params = _call_parameters(ast.parse(loss_file.read_text())) if loss_file.is_file() else None
        if params is None or not params or params[0] != "next_token_logits" or not worker_file.is_file():
            raise BadInput(f"nemo_rl:loss runs NeMo-RL's Megatron path or its DTensor-worker era (ClippedPGLossFn "
                           f"taking the logits, in {LOSS_FILE}, and {WORKER_FILE}); NeMo-RL at {self.short()} has "
                           + ("no such ClippedPGLossFn" if params is None or not params or params[0] !=
                              "next_token_logits" else f"no {WORKER_FILE}")
                           + f", nor a Megatron {POST_PROCESSOR} in {TRAIN_FILE}")
        try:
            self.worker_lines = worker_loss_lines(worker_file)
        except (LookupError, SyntaxError) as exc:
            raise BadInput(f"nemo_rl:loss cannot follow NeMo-RL's worker at {self.short()}: {exc}") from None
        self.loss_config = self._config()  # read once: described and handed to the loss
        # the global batch's count: one argument (#266), or, from b9607949d (#312's token-level
        # metrics) until the loss moved to loss/, both counts, the loss picking by its loss_type
        self.both_counts = {"global_valid_seqs", "global_valid_toks"} <= set(params)
        self.global_count = "total_valid_tokens_or_seqs" in params or self.both_counts
        asked = config.get(OPTION)
        if asked is not None and not self.global_count:
            raise BadInput(f"NeMo-RL at {self.short()} has no {OPTION} (its loss is each micro-batch's token mean)")
        try:
            self.token_level = config.flag(OPTION) if asked is not None else True
        except ValueError as exc:
            raise BadInput(f"target 'nemo_rl:loss': {exc}") from None
        self.era: WorkerLossEra | MegatronLossEra = WorkerLossEra(
            loss_takes="logits", global_count=self.global_count,
            worker_lines=tuple(ast.unparse(s) for s in self.worker_lines))
        self.framework_files = tuple(str(f) for f in (LOSS_FILE, UTILS_FILE, WORKER_FILE))
        self.capabilities = Capabilities(
            layouts=frozenset({"bshd"}), entropy=False, tp_sizes=frozenset({1}), cp_sizes=frozenset({1}),
            reasons=(("layout", "NeMo-RL's DTensor worker hands its loss padded [B, S] logits (bshd)"),
                     ("entropy", "NeMo-RL's ClippedPGLossFn computes no entropy (it has no entropy bonus)"),
                     ("tp", "at tp > 1 ClippedPGLossFn takes a DTensor (get_logprobs_from_vocab_parallel_logits): "
                            "the DTensor family is not run by this target"),
                     ("cp", "NeMo-RL's DTensor worker of this era has no context parallelism")))
        self.cpu_notes: list[str] = []
        self._loss: Any = None

    @property
    def definitions(self) -> Definitions:
        if not self.global_count:
            return Definitions(objective="token_mean", objective_source="NeMo-RL's masked_mean over tokens (no "
                               f"{OPTION} at this commit: the token mean its design intends)")
        objective = "token_mean" if self.token_level else "sample_mean"
        return Definitions(objective=objective, objective_source=f"NeMo-RL's {OPTION}={str(self.token_level).lower()}")

    def description(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "loss": f"{LOSS_FILE}:{LOSS_CLASS} ({', '.join(f'{k}={v}' for k, v in self.loss_config.items())})",
            "worker_lines": f"{WORKER_FILE} train: " + "; ".join(ast.unparse(s) for s in self.worker_lines),
            "schedule_difference": "the worker sums its micro-batches' gradients; megatron's schedule divides each "
                                   "loss by num_microbatches, so the schedule is handed the worker's loss x "
                                   "num_microbatches",
        }
        if self.global_count:
            out[OPTION] = self.token_level
            out["normalization"] = ("the replica's valid " + ("tokens" if self.token_level else "samples")
                                    + ", all-reduced over the data-parallel group (the worker's arithmetic, written "
                                    "by the adapter)")
        if self.cpu_notes:
            out["cpu_world"] = sorted(set(self.cpu_notes))
        return out

    def forget(self) -> None:
        self._loss = None

    def skip_reason(self, scenario: Scenario) -> str | None:
        return self.capabilities.skip_reason(scenario)

    # -- the loss -----------------------------------------------------------------------------
    def _loss_fn(self) -> Any:
        if self._loss is None:
            utils = compile_alone(self.src / UTILS_FILE, self._utils_names(), {"torch": torch, **self._utils_given()})
            given = {"torch": torch, "Tuple": Any, "Any": Any, "TypedDict": dict,
                     "masked_mean": utils["masked_mean"],
                     "calculate_kl_penalty_joschu2020": self._recording(utils["calculate_kl_penalty_joschu2020"]),
                     "LossFunction": object, "BatchedDataDict": dict}
            names = [LOSS_CLASS] + (["LossType"] if self._defines("LossType") else [])
            if "LossType" in names:
                import enum

                given["enum"] = enum
            try:
                ns = compile_alone(self.src / LOSS_FILE, names, given,
                                   off_path=("get_logprobs_from_vocab_parallel_logits",))
            except LookupError as exc:
                raise BadInput(f"nemo_rl:loss cannot load NeMo-RL's {LOSS_CLASS} at {self.short()}: {exc}") from None
            cfg = dict(self.loss_config)
            if self.global_count:
                cfg[OPTION] = self.token_level
            self._loss = ns[LOSS_CLASS](cfg)
        return self._loss

    def _config(self) -> dict[str, Any]:
        """NeMo-RL's own GRPO example config's loss_fn where the commit has one (its keys were
        renamed over the eras: ratio_eps_min, then ratio_clip_min), else the same values by hand."""
        try:
            return example_loss_config(self.src)
        except LookupError:  # no example config at this commit
            return dict(LOSS_CONFIG)

    def _utils_names(self) -> list[str]:
        names = ["masked_mean", "calculate_kl_penalty_joschu2020"]
        return names + (["surpress_user_warnings"] if self._defines("surpress_user_warnings", UTILS_FILE) else [])

    def _utils_given(self) -> dict[str, Any]:
        import functools
        import warnings
        from typing import Optional

        return {"wraps": functools.wraps, "warnings": warnings, "Optional": Optional}

    def _defines(self, name: str, file: Path = LOSS_FILE) -> bool:
        tree = ast.parse((self.src / file).read_text())
        return any(getattr(n, "name", None) == name for n in tree.body)

    def _recording(self, kl: Any) -> Any:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            bound = inspect.signature(kl).bind(*args, **kwargs)
            self._seen = bound.arguments.get("logprobs_policy")
            return kl(*args, **kwargs)
        return recorded

    def compute(self, inputs: RankInputs) -> RankOutputs:
        step, policy = inputs.step, inputs.policy
        if step is None or policy is None:
            raise ValueError("nemo_rl:loss is a training step's loss: it needs the policy batch and the step inputs")
        data = self._batch(inputs)
        logits = inputs.logits / inputs.temperature if inputs.temperature != 1.0 else inputs.logits
        args: list[Any] = [logits, data]
        if self.global_count:
            args.extend(valid_counts(inputs) if self.both_counts else [self._normalization(inputs)])
        self._seen = None
        loss, metrics = self._loss_fn()(*args)
        if self._seen is None:
            raise ValueError(f"NeMo-RL's {LOSS_CLASS} at {self.short()} did not hand its KL penalty the log-probs")
        loss = self._worker(loss, step)
        curr = self._seen
        log_probs = [curr[i, inputs.total_lengths[i] - inputs.response_lengths[i] - 1
                          + torch.arange(inputs.response_lengths[i], device=curr.device)]
                     for i in range(len(inputs.total_lengths))]
        # the worker's loop sums micro-batches; megatron's schedule divides by their number
        return RankOutputs(log_probs, None, loss=loss * step.num_microbatches, num_tokens=None,
                           reported={"loss": torch.as_tensor(metrics.get("loss", float("nan")))})

    def _worker(self, loss: torch.Tensor, step: Any) -> torch.Tensor:
        """The worker's own lines between the loss function and ``loss.backward()``."""
        scope = {"loss": loss, "num_microbatches": step.num_microbatches,
                 "self": types.SimpleNamespace(dp_size=step.dp_size, cp_size=1)}
        for stmt in self.worker_lines:
            code = compile(ast.Module(body=[stmt], type_ignores=[]), str(self.src / WORKER_FILE), "exec")
            try:
                exec(code, {}, scope)  # noqa: S102 - NeMo-RL's own line, from its file
            except NameError as exc:
                raise ValueError(f"nemo_rl:loss: NeMo-RL's worker line {ast.unparse(stmt)!r} "
                                 f"({WORKER_FILE}:{stmt.lineno}) reads what the adapter does not give: {exc}") from None
        return scope["loss"]

    def _normalization(self, inputs: RankInputs) -> torch.Tensor:
        """The worker's factor: the replica's valid tokens (or samples), all-reduced over dp."""
        seqs, toks = valid_counts(inputs)
        return toks if self.token_level else seqs

    def _batch(self, inputs: RankInputs) -> dict[str, torch.Tensor]:
        """The micro-batch as NeMo-RL's worker hands its loss: [B, S] per-token fields, each
        response token's value at its own position (position p holds token p)."""
        policy, device = inputs.policy, inputs.logits.device
        b, s = len(inputs.total_lengths), inputs.logits.shape[1]
        ids = torch.zeros(b, s, dtype=torch.int64)
        fields = {k: torch.zeros(b, s, dtype=torch.float32) for k in ("token_mask", "advantages", "prev_logprobs")}
        for i, (total, response) in enumerate(zip(inputs.total_lengths, inputs.response_lengths)):
            ids[i, :total] = inputs.tokens[i].cpu()
            start = total - response
            fields["token_mask"][i, start:total] = policy.loss_masks[i].cpu().float()
            fields["advantages"][i, start:total] = policy.advantages[i].detach().cpu().float()
            fields["prev_logprobs"][i, start:total] = policy.old_log_probs[i].detach().cpu().float()
        data = {k: v.to(device) for k, v in fields.items()}
        data["generation_logprobs"] = data["prev_logprobs"].clone()
        data["reference_policy_logprobs"] = data["prev_logprobs"].clone()
        data["sample_mask"] = torch.ones(b, dtype=torch.float32, device=device)
        data["input_ids"] = self._ids(ids.to(device))
        return data

    def _ids(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.is_cuda:
            return ids
        self.cpu_notes.append("input_ids[:, 1:].cuda() in ClippedPGLossFn stays on the CPU (a CPU world)")
        return ids.as_subclass(_StaysOnCpu)


class _StaysOnCpu(torch.Tensor):
    """Token ids whose ``.cuda()`` is themselves: NeMo-RL's loss moves them to CUDA, a CPU world
    has none (ids select; nothing of their values changes)."""

    def cuda(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        return self.as_subclass(torch.Tensor)


# -- NeMo-RL's Megatron path (ClippedPGLossFn taking log-probs, LossPostProcessor) -------------------

NEW_LOSS_FILE = Path("nemo_rl/algorithms/loss/loss_functions.py")
INTERFACES = Path("nemo_rl/algorithms/loss/interfaces.py")
LOSS_UTILS = Path("nemo_rl/algorithms/loss/utils.py")
WRAPPER = Path("nemo_rl/algorithms/loss/wrapper.py")
TRAIN_FILE = Path("nemo_rl/models/megatron/train.py")
POST_PROCESSOR = "LossPostProcessor"


def config_defaults(path: Path, cls: str) -> dict[str, Any]:
    """The field defaults a (pydantic) config class declares in its body, read from its file:
    NeMo-RL's defaults, without importing pydantic."""
    tree = ast.parse(path.read_text(), filename=str(path))
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
    if node is None:
        raise LookupError(f"{path}: no {cls}")
    return {item.target.id: ast.literal_eval(item.value) for item in node.body
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None}


class _Recorder:
    """NeMo-RL's loss function, seen through: the log-probs its wrappers hand it are kept (the
    values checked per micro-batch); everything else is the loss function's own."""

    def __init__(self, loss_fn: Any) -> None:
        self.loss_fn = loss_fn
        self.seen: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loss_fn, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.seen = kwargs.get("next_token_logprobs")
        return self.loss_fn(*args, **kwargs)


class NemoRLMegatronLossTarget(NemoRLLossTarget):
    """NVIDIA-NeMo/RL's ClippedPGLossFn in a training step, behind its Megatron LossPostProcessor"""

    calculate_per_token_loss = True  # NeMo-RL's megatron setup sets it (models/megatron/setup.py)

    def __init__(self, framework: Any, src: str | None, config: TargetConfig) -> None:
        self.framework = framework
        self.name = "nemo_rl:loss"
        CheckoutTarget.__init__(self, src)
        self.global_count = True
        try:
            self.token_level = config.flag(OPTION) if config.get(OPTION) is not None else True
        except ValueError as exc:
            raise BadInput(f"target 'nemo_rl:loss': {exc}") from None
        try:
            self.loss_config = (config_defaults(self.src / NEW_LOSS_FILE, "ClippedPGLossConfig")
                                or example_loss_config(self.src))
        except (LookupError, ValueError, SyntaxError) as exc:
            raise BadInput(f"nemo_rl:loss cannot read NeMo-RL's loss configuration at {self.short()}: {exc}") from None
        self.loss_config[OPTION] = self.token_level
        self.era = MegatronLossEra(loss_takes="log-probs", post_processor=f"{TRAIN_FILE}:{POST_PROCESSOR}")
        self.framework_files = tuple(str(f) for f in (NEW_LOSS_FILE, UTILS_FILE, TRAIN_FILE, LOSS_UTILS,
                                                      WRAPPER, Path("nemo_rl/distributed/model_utils.py")))
        self.capabilities = Capabilities(
            layouts=frozenset({"bshd"}), entropy=False, cp_sizes=frozenset({1}),
            reasons=(("layout", "nemo_rl:loss hands LossPostProcessor padded [B, S] logits (bshd); its packed path "
                                "(SequencePackingLossWrapper) is not run by this target yet"),
                     ("entropy", "NeMo-RL's ClippedPGLossFn computes no entropy (it has no entropy bonus)"),
                     ("cp", "NeMo-RL's CP gathers with AllGatherCPTensor, whose backward needs CUDA")))
        self.cpu_notes = []
        self._loss = None
        self._post: Any = None

    def description(self) -> dict[str, Any]:
        shown = {k: self.loss_config.get(k) for k in ("ratio_clip_min", "ratio_clip_max", "reference_policy_kl_penalty",
                                                       "reference_policy_kl_type", OPTION)}
        return {"loss": f"{NEW_LOSS_FILE}:ClippedPGLossFn (its config's defaults: "
                        + ", ".join(f"{k}={v}" for k, v in shown.items()) + ")",
                "post_processor": f"{TRAIN_FILE}:{POST_PROCESSOR} (prepare_loss_input, "
                                  "wrap_loss_fn_with_input_preparation, its / cp_size and x num_microbatches / cp_size)",
                OPTION: self.token_level,
                "normalization": ("the replica's valid " + ("tokens" if self.token_level else "samples")
                                  + ", all-reduced over the data-parallel group (models/megatron/data.py's arithmetic, "
                                    "written by the adapter)"),
                "megatron": "calculate_per_token_loss=True with the two-value loss, as NeMo-RL's megatron setup has it"}

    def forget(self) -> None:
        self._loss = None
        self._post = None

    def _loss_fn(self) -> Any:
        if self._loss is None:
            import enum

            from shardcheck.targets.nemo_rl_data import NemoRLLossPath

            model_utils = self.import_module("nemo_rl.distributed.model_utils")
            sampling = sys.modules.get("nemo_rl.algorithms.logits_sampling_utils")
            path = NemoRLLossPath(self.src, model_utils, sampling, fused=False)
            # the one LossInputType the preparation and the loss share
            # MetricNormalizer came after the loss moved to loss/ (#1920): compiled where defined
            wanted = [n for n in ("LossType", "MetricNormalizer") if n == "LossType" or self._defines(n, INTERFACES)]
            interfaces = compile_alone(self.src / INTERFACES, wanted, {"enum": enum})
            utils = compile_alone(self.src / UTILS_FILE, ["masked_mean", "calculate_kl"], {"torch": torch})
            given = {"torch": torch, "LossFunction": object, "masked_mean": utils["masked_mean"],
                     "calculate_kl": utils["calculate_kl"], "LossInputType": path.LossInputType,
                     **{k: interfaces[k] for k in wanted}}
            try:
                ns = compile_alone(self.src / NEW_LOSS_FILE, [LOSS_CLASS], given)
            except LookupError as exc:
                raise BadInput(f"nemo_rl:loss cannot load NeMo-RL's {LOSS_CLASS} at {self.short()}: {exc}") from None
            self._loss = _Recorder(ns[LOSS_CLASS](LossConfig(self.loss_config)))
            self._post = self._post_processor(path.prepare)
        return self._loss

    def _post_processor(self, prepare: Any) -> Any:
        import functools
        import math
        from typing import Optional

        from megatron.core import parallel_state

        wrapper = compile_alone(self.src / WRAPPER, ["wrap_loss_fn_with_input_preparation"],
                                {"torch": torch, "math": math, "Optional": Optional})
        given = {"torch": torch, "partial": functools.partial, "prepare_loss_input": prepare,
                 "wrap_loss_fn_with_input_preparation": wrapper["wrap_loss_fn_with_input_preparation"],
                 **{n: getattr(parallel_state, n) for n in ("get_tensor_model_parallel_rank",
                                                            "get_tensor_model_parallel_group",
                                                            "get_context_parallel_group",
                                                            "get_context_parallel_world_size")}}
        try:
            ns = compile_alone(self.src / TRAIN_FILE, [POST_PROCESSOR], given,
                               off_path=("SequencePackingLossWrapper", "SequencePackingFusionLossWrapper",
                                         "DraftLossWrapper", "prepare_packed_loss_input"))
        except LookupError as exc:
            raise BadInput(f"nemo_rl:loss cannot load NeMo-RL's {POST_PROCESSOR} at {self.short()}: {exc}") from None
        return ns[POST_PROCESSOR]

    def compute(self, inputs: RankInputs) -> RankOutputs:
        step, policy = inputs.step, inputs.policy
        if step is None or policy is None:
            raise ValueError("nemo_rl:loss is a training step's loss: it needs the policy batch and the step inputs")
        recorder = self._loss_fn()
        data = self._batch(inputs)
        data["input_ids"] = data["input_ids"].as_subclass(torch.Tensor)
        chunk = inputs.chunk_size if getattr(inputs, "chunk_size", 0) and inputs.chunk_size > 0 else None
        cfg = {"sequence_packing": {"enabled": False}, "logprob_chunk_size": chunk}
        counts = valid_counts(inputs)
        post = self._post(loss_fn=recorder, cfg=cfg, num_microbatches=step.num_microbatches)
        wrapped = post(data, packed_seq_params=None, global_valid_seqs=counts[0], global_valid_toks=counts[1])
        logits = inputs.logits / inputs.temperature if inputs.temperature != 1.0 else inputs.logits
        recorder.seen = None
        loss, metrics = wrapped(logits)
        if recorder.seen is None:
            raise ValueError(f"NeMo-RL's {POST_PROCESSOR} at {self.short()} handed its loss no next_token_logprobs")
        curr = recorder.seen
        log_probs = [curr[i, inputs.total_lengths[i] - inputs.response_lengths[i] - 1
                          + torch.arange(inputs.response_lengths[i], device=curr.device)]
                     for i in range(len(inputs.total_lengths))]
        return RankOutputs(log_probs, None, loss=loss, num_tokens=None,
                           reported={"loss": torch.as_tensor(metrics.get("loss", float("nan")))})
