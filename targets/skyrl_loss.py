"""``skyrl:loss``: NovaSky-AI/SkyRL's Megatron policy loss in shardcheck's training step
(``loss_form = "step"``, docs/training.md).

What runs, per micro-batch, is SkyRL's own ``loss_func``: the closure its
``MegatronModelWrapper.forward_backward_mini_batch``
(``workers/megatron/megatron_model_wrapper.py``) hands megatron-core's schedule. It is compiled
alone out of that method, from the checkout's file with its line numbers, and called with the
logits and the micro-batch dict its ``forward_step`` builds. It computes the log-probs, the policy
loss (``PolicyLossRegistry``'s ``ppo_policy_loss`` for ``regular``, with its ``reduce_loss``), the
entropy and KL terms and its own rescale for megatron's schedule, and returns megatron's two-value
form ``(loss, metrics)``: SkyRL never sets ``calculate_per_token_loss`` (the wrapper's
``_defer_finalize_model_grads`` says so), so this target sets it False.

Before the workers run, SkyRL's trainer (``skyrl/train/trainer.py`` ``_normalize_advantages``)
scales the advantages over each mini-batch (one optimizer step: the step's global batch) with
``apply_loss_reduction_to_advantages_minibatch`` (#1296 on). That function is called here on the
global batch the harness hands a step target (``StepInputs.loss_masks`` / ``.advantages`` of
every sample, ``.copies`` copies of them), and this micro-batch's rows are taken out of what it
returns. Before #1296 the reduction was ``reduce_loss``'s, inside the policy loss.

What the closure reads from its enclosing method is given: ``self`` (the trainer config's chunk
sizes, no fused LM head), ``temperature``, ``loss_config`` (SkyRL's own ``AlgorithmConfig``,
compiled from ``skyrl/train/config/config.py``, its defaults but for ``loss_reduction``,
``use_entropy_loss`` / ``entropy_loss_coef`` from the scenario and the option ``use_kl_loss``),
``current_loss_fn`` (``ppo_policy_loss``), ``resolved_loss_name`` ("regular"), MTP off. Its
module's names are the checkout's: the log-prob and entropy functions of ``model_utils.py`` (the
``skyrl`` target's import), ``ppo_utils.py``'s and ``torch_utils.py``'s functions compiled alone,
megatron-core's ``parallel_state``.
"""

from __future__ import annotations

import __future__
import ast
import builtins
import dataclasses
import math
import symtable
import sys
import types
import typing
from pathlib import Path
from typing import Any

import torch

from shardcheck.errors import BadInput
from shardcheck.scenarios.scenario import Scenario
from shardcheck.targets.base import RankInputs, RankOutputs, TargetConfig
from shardcheck.targets.compiled import _not_loaded, compile_alone, names_read
from shardcheck.targets.passthrough import Recorder
from shardcheck.targets.skyrl import LOGPROBS, PACKED, SkyRLTarget
from shardcheck.targets.skyrl_data import WRAPPER, top_level

UTILS = Path("skyrl/backends/skyrl_train/utils")
PPO = UTILS / "ppo_utils.py"
TORCH_UTILS = UTILS / "torch_utils.py"
OFF_POLICY = UTILS / "off_policy_correction_utils.py"
WORKER_UTILS = Path("skyrl/backends/skyrl_train/workers/worker_utils.py")
CONFIG = Path("skyrl/train/config/config.py")
NORMALIZE = "apply_loss_reduction_to_advantages_minibatch"
LOSS_FUNC = ("MegatronModelWrapper", "forward_backward_mini_batch", "loss_func")
LOSS_FUNC_NAME = ".".join(LOSS_FUNC)

# SkyRL's loss_reduction values with an objective of the step (the others are refused, saying why)
OBJECTIVE = {"token_mean": "token_mean", "sequence_mean": "sample_mean"}
NO_OBJECTIVE = {
    "token_mean_legacy": "a token mean within each micro-batch, averaged over the micro-batches (the token_mean "
                         "before #1296)",
    "seq_mean_token_sum_norm": "each sample's token sum over the constant max_seq_len, averaged (Dr. GRPO)",
    "prompt_mean": "a token mean within each prompt's group of samples, averaged over the prompts (the scenario "
                   "has no prompt groups)",
}
# what loss_func reads only on branches this target does not take: the fused LM head
# (fused_lm_head_logprob) and the MTP draft loss
OFF_PATH = ("from_parallel_hidden_to_logprobs", "from_parallel_hidden_to_logprobs_packed_sequences",
            "from_parallel_hidden_to_entropy_packed_sequences", "_fused_vocab_parallel_entropy_from_hidden",
            "shift_mask_for_mtp", "draft_soft_ce", "draft_soft_ce_topk", "build_teacher_logits",
            "unpadded_vocab_shard_width", "model_config")
# the typing and dataclass names SkyRL's config module reads at class level
CONFIG_NAMES = {"dataclass": dataclasses.dataclass, "field": dataclasses.field, "asdict": dataclasses.asdict,
                "dataclasses": dataclasses, "ABC": __import__("abc").ABC, "typing": typing,
                **{n: getattr(typing, n) for n in ("Annotated", "Any", "Dict", "List", "Literal", "Optional", "Type",
                                                   "TypeVar", "Union", "Tuple")}}
TRAINER_DEFAULTS = ("logprobs_chunk_size", "vocab_entropy_chunk_size", "vocab_entropy_chunk_memory_mb")


# ---- reading SkyRL's files -------------------------------------------------------------------

def _nested(tree: ast.Module, where: tuple[str, ...]) -> ast.FunctionDef:
    node: Any = tree
    for name in where:
        node = next((n for n in node.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name), None)
        if node is None:
            raise LookupError(f"no {'.'.join(where)}")
    return node


def compile_nested(path: Path, where: tuple[str, ...], given: dict[str, Any], off_path: tuple[str, ...] = ()
                   ) -> types.FunctionType:
    """A function defined inside another (``where``: class, method, function), compiled alone from
    its file with its line numbers: what it reads from its enclosing function (its closure) and
    from its module becomes a global, to be given in ``given``; names in ``off_path`` are bound to
    a function that raises if called. LookupError names what is missing."""
    tree = ast.parse(path.read_text(), filename=str(path))
    fn = _nested(tree, where)
    module = ast.Module(body=[fn], type_ignores=[])
    code = compile(module, str(path), "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True)
    table = symtable.symtable(ast.unparse(module), str(path), "exec")
    reads: set[str] = set()
    for child in table.get_children():
        reads |= names_read(child)
    missing = sorted(reads - set(given) - set(off_path) - set(dir(builtins)))
    if missing:
        raise LookupError(f"{path}: {'.'.join(where)} reads {', '.join(missing)}, which the adapter does not give")
    ns: dict[str, Any] = {"__name__": f"shardcheck_compiled_{path.stem}", "__file__": str(path),
                          **{n: _not_loaded(n, path) for n in off_path}, **given}
    exec(code, ns)  # noqa: S102 - the framework's own definition, from its file
    return ns[fn.name]


def _compared_with(fn: ast.FunctionDef, name: str) -> list[str]:
    """The string constants ``fn`` compares the variable ``name`` with (``name == "x"``), in order."""
    out = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == name:
            for c in node.comparators:
                if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value not in out:
                    out.append(c.value)
    return out


def _literal_defaults(src: Path, cls: str, names: tuple[str, ...]) -> dict[str, Any]:
    """The literal defaults of ``cls``'s fields ``names`` in SkyRL's config module (absent: not there)."""
    node = top_level(src, CONFIG).get(cls)
    out: dict[str, Any] = {}
    for stmt in getattr(node, "body", []):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id in names:
            try:
                out[stmt.target.id] = ast.literal_eval(stmt.value)
            except ValueError:
                pass
    return out


def detect_loss_era(src: Path) -> dict[str, Any]:
    """How this checkout reduces the policy loss, read from its source: by the trainer's advantage
    scaling over the mini-batch (#1296 on) or by ``reduce_loss`` inside the loss; the
    loss_reduction values that code takes; whether the wrapper's loss_func rescales for megatron."""
    ppo = top_level(src, PPO)
    if "ppo_policy_loss" not in ppo or "reduce_loss" not in ppo:
        raise BadInput(f"SkyRL at {src} has no ppo_policy_loss / reduce_loss in {PPO}: not a tree skyrl:loss reads")
    wrapper = src / WRAPPER
    try:
        loss_func = _nested(ast.parse(wrapper.read_text()), LOSS_FUNC)
    except (OSError, LookupError):
        raise BadInput(f"SkyRL at {src} has no {LOSS_FUNC_NAME} in {WRAPPER}: not a tree skyrl:loss reads") from None
    by_trainer = NORMALIZE in ppo and "loss_reduction" not in [a.arg for a in ppo["reduce_loss"].args.args]
    reducer = ppo[NORMALIZE] if by_trainer else ppo["reduce_loss"]
    return {
        "reduced_by": "trainer" if by_trainer else "reduce_loss",
        "reductions": _compared_with(reducer, "loss_reduction"),
        "rescale": "grad_sum_correction_factor" in ast.unparse(loss_func),
    }


# ---- the target --------------------------------------------------------------------------------

ENTROPY_WHY = ("SkyRL's entropy term is each micro-batch's masked token mean, averaged over the micro-batches and "
               "data-parallel replicas (megatron_model_wrapper.py loss_func: 'The KL and entropy loss terms are not "
               "pre-scaled'; loss_reduction scales the policy loss only)")


def entropy_reduction_differs(scenario: Scenario, objective: str) -> str | None:
    """Why the step's reference, which weighs the entropy by the declared objective as it weighs the
    policy loss, is not SkyRL's objective for ``scenario`` (None where the two weigh every sample
    alike: one sample a micro-batch under sequence_mean, micro-batches of equal token counts under
    token_mean, or no entropy in the loss)."""
    if not scenario.with_entropy or scenario.entropy_coef == 0:
        return None
    from shardcheck.scenarios.data import ScenarioData

    data = ScenarioData(scenario, loss="policy")
    counts = [max(int(data.loss_mask(i).sum()), 1) for i in range(len(scenario.samples))]
    batches = [mb for r in range(scenario.dp) for mb in scenario.micro_batches(r)]
    total = max(1, sum(int(data.loss_mask(i).sum()) for i in range(len(scenario.samples))))
    for mb in batches:
        in_mb = max(1, sum(int(data.loss_mask(i).sum()) for i in mb))
        for i in mb:
            skyrl = 1.0 / (len(batches) * in_mb)
            declared = 1.0 / total if objective == "token_mean" else 1.0 / (len(scenario.samples) * counts[i])
            if int(data.loss_mask(i).sum()) and not math.isclose(skyrl, declared, rel_tol=1e-9):
                return (f"{ENTROPY_WHY}: here that weighs sample {i}'s entropy x {skyrl / declared:.3f} the declared "
                        f"{objective}'s, and the harness declares one objective for both terms (entropy_coef 0 "
                        "checks the policy loss alone)")
    return None


class SkyRLLossTarget(SkyRLTarget):
    """NovaSky-AI/SkyRL's Megatron policy loss in a training step: the wrapper's own loss_func (ppo_policy_loss,
    reduce_loss, the entropy and KL terms, its rescale for megatron's schedule) and, from #1296, the trainer's
    apply_loss_reduction_to_advantages_minibatch over the step's global batch; option loss_reduction (SkyRL's
    default token_mean)"""

    loss_form = "step"
    training_loss = True
    calculate_per_token_loss = False  # SkyRL returns megatron's two-value form and never sets the knob
    invariance: dict[str, str] = {}

    def __init__(self, config: TargetConfig) -> None:
        super().__init__(None, config)
        self.name = "skyrl:loss"
        self.loss_era = detect_loss_era(self.src)
        try:
            self.use_kl: bool | None = config.flag("use_kl_loss") if config.get("use_kl_loss") is not None else None
        except ValueError as exc:
            raise BadInput(f"target 'skyrl:loss': {exc}") from None
        self.reduction = config.get("loss_reduction", "token_mean")
        known = self.loss_era["reductions"]
        if self.reduction not in known:
            raise BadInput(f"target 'skyrl:loss': SkyRL at {self.short()} has no loss_reduction {self.reduction!r} "
                           f"(it has {', '.join(known)})")
        if self.reduction not in OBJECTIVE:
            raise BadInput(f"target 'skyrl:loss': loss_reduction={self.reduction} is "
                           f"{NO_OBJECTIVE.get(self.reduction, 'not a mean over the global batch')}: no objective the "
                           f"step is checked against (it checks {', '.join(OBJECTIVE)})")
        objective = OBJECTIVE[self.reduction]
        where = ("the trainer's advantage scaling over the mini-batch" if self.loss_era["reduced_by"] == "trainer"
                 else "reduce_loss, within each micro-batch")
        self.definitions = dataclasses.replace(
            self.definitions, objective=objective,
            objective_source=f"SkyRL's loss_reduction={self.reduction}, by {where}")
        # and the scenarios whose entropy term SkyRL reduces otherwise than the declared objective (its
        # entropy is each micro-batch's token mean, not loss_reduction's)
        self.capabilities = dataclasses.replace(
            self.capabilities, rule=lambda scenario: entropy_reduction_differs(scenario, objective))
        self.framework_files = tuple(dict.fromkeys(self.framework_files + tuple(
            str(f) for f in (WRAPPER, PPO, TORCH_UTILS))))
        self._compiled: dict[str, Any] | None = None

    def forget(self) -> None:
        super().forget()
        self._compiled = None

    def description(self) -> dict[str, Any]:
        out = super().description()
        out["temperature"] = ("loss_func's logits.div_(T), on the harness's logits (temperature_in_place)" if
                              self.temperature_in_place else "loss_func's logits.div_(T), on a copy of the harness's "
                              "logits (temperature_in_place=true: on them, reported as input_mutated)")
        trainer = self.loss_era["reduced_by"] == "trainer"
        out["loss"] = {
            "loss_func": f"{WRAPPER}:{LOSS_FUNC_NAME}, compiled alone from the checkout, returning megatron's "
                         "two-value form (calculate_per_token_loss False, as SkyRL leaves it)",
            "policy_loss": f"{PPO}:ppo_policy_loss (policy_loss_type regular) with reduce_loss",
            "loss_reduction": self.reduction,
            "reduced_by": (f"{PPO}:{NORMALIZE} over the step's global batch (the trainer's _normalize_advantages, "
                           "one mini-batch; advantage_batch_normalize off, SkyRL's default)" if trainer else
                           f"{PPO}:reduce_loss within each micro-batch"),
            "rescale": "the wrapper's own (loss_func)" if self.loss_era["rescale"] else "none in loss_func",
            "config": (f"SkyRL's AlgorithmConfig ({CONFIG}) with its defaults but loss_reduction, use_entropy_loss and "
                       "entropy_loss_coef (the scenario's)" + (f", use_kl_loss={self.use_kl}" if self.use_kl is not None
                                                               else "")),
            "stood_in": ["forward_step's micro-batch dict (sequences, masks, packing, num_microbatches) built from "
                         "SkyRL's own batch and packing functions; the model's output is the harness's logits",
                         "base_action_log_probs (the reference model's) = old_action_log_probs: the KL term is 0 in "
                         "value and gradient", "rollout_action_logprobs None (no off-policy correction, SkyRL's "
                         "default)", "old log-probs: each CP rank's share gathered over CP (SkyRL's batch holds "
                         "whole responses on every CP rank)",
                         "the per-token entropies checked per micro-batch: vocab_parallel_entropy on the same "
                         "logits without gradient (loss_func's entropy term is one scalar)"],
        }
        return out

    # ---- SkyRL's functions --------------------------------------------------------------------

    def _functions(self) -> dict[str, Any]:
        if self._compiled is not None:
            return self._compiled
        from megatron.core import parallel_state as mpu

        src = self.src
        torch_utils = compile_alone(src / TORCH_UTILS, ["masked_mean", "safe_exp_delta"], {"torch": torch})
        off = compile_alone(src / OFF_POLICY, ["apply_off_policy_correction"], {"torch": torch},
                            off_path=("compute_off_policy_correction",))
        ppo_names = ["ppo_policy_loss", "reduce_loss", "compute_approx_kl"] + (
            [NORMALIZE] if self.loss_era["reduced_by"] == "trainer" else [])
        # the registry decorator (a ray-backed registry) as one that returns the function it is given
        given = {"torch": torch, "masked_mean": torch_utils["masked_mean"], "safe_exp_delta": torch_utils[
            "safe_exp_delta"], "apply_off_policy_correction": off["apply_off_policy_correction"],
            "register_policy_loss": lambda name: (lambda fn: fn),
            "PolicyLossType": types.SimpleNamespace(REGULAR="regular", DUAL_CLIP="dual_clip")}
        ppo = compile_alone(src / PPO, ppo_names, given, off_path=("logger",))
        worker = (compile_alone(src / WORKER_UTILS, ["compute_minibatch_rollout_logprob_diff_metrics"],
                                {"torch": torch, "masked_mean": torch_utils["masked_mean"]},
                                off_path=tuple(f"MINIBATCH_ROLLOUT_LOGPROB_DIFF_{k}_KEY" for k in
                                               ("MEAN", "SQ_MEAN", "MAX", "MIN")))
                  if "compute_minibatch_rollout_logprob_diff_metrics" in top_level(src, WORKER_UTILS) else {})
        mod = self._module()
        module_names = {n: getattr(mod, n) for n in dir(mod) if not n.startswith("__")}
        self._compiled = {"ppo": ppo, "config_class": self._config_class(), "module": module_names,
                          "trainer_defaults": _literal_defaults(src, "TrainerConfig", TRAINER_DEFAULTS),
                          "given": {"torch": torch, "mpu": mpu, "masked_mean": torch_utils["masked_mean"],
                                    "compute_approx_kl": ppo["compute_approx_kl"],
                                    "compute_minibatch_rollout_logprob_diff_metrics": worker.get(
                                        "compute_minibatch_rollout_logprob_diff_metrics")}}
        return self._compiled

    def _config_class(self) -> type:
        """SkyRL's AlgorithmConfig and the config classes its fields default to, compiled alone; what
        their other methods read (OmegaConf, the config loader) is bound to a raising stand-in."""
        defs = top_level(self.src, CONFIG)
        if "AlgorithmConfig" not in defs:
            raise BadInput(f"SkyRL at {self.short()} has no AlgorithmConfig in {CONFIG}")
        names = ["AlgorithmConfig"]
        for node in ast.walk(defs["AlgorithmConfig"]):
            if isinstance(node, ast.keyword) and node.arg == "default_factory" and isinstance(node.value, ast.Name):
                names.append(node.value.id)
        bases = [b.id for n in names for b in defs[n].bases if isinstance(b, ast.Name) and b.id in defs]
        names = list(dict.fromkeys(bases + names))
        module = ast.Module(body=[defs[n] for n in names], type_ignores=[])
        table = symtable.symtable("from __future__ import annotations\n" + ast.unparse(module), str(CONFIG), "exec")
        reads: set[str] = {s.get_name() for s in table.get_symbols() if s.is_referenced() and s.is_global()}
        for child in table.get_children():
            reads |= names_read(child)
        off = tuple(sorted(reads - set(CONFIG_NAMES) - set(names) - set(dir(builtins)) - {"annotations"}))
        # @dataclass looks its class's module up in sys.modules (for ClassVar in string annotations):
        # a module of that name is there while the classes are made, and only then
        name = f"shardcheck_compiled_{CONFIG.stem}"
        held = sys.modules.get(name)
        sys.modules[name] = types.ModuleType(name)
        try:
            return compile_alone(self.src / CONFIG, names, dict(CONFIG_NAMES), off_path=off)["AlgorithmConfig"]
        finally:
            if held is None:
                del sys.modules[name]
            else:
                sys.modules[name] = held

    def _loss_config(self, inputs: RankInputs) -> Any:
        config = self._functions()["config_class"]()
        config.loss_reduction = self.reduction
        config.use_entropy_loss = inputs.entropy_coef != 0
        config.entropy_loss_coef = inputs.entropy_coef
        config.temperature = inputs.temperature
        if self.use_kl is not None:
            config.use_kl_loss = self.use_kl
        return config

    def _loss_func(self, inputs: RankInputs, record: Recorder) -> Any:
        """The wrapper's loss_func, its closure given for this micro-batch's scenario."""
        fns = self._functions()
        trainer = fns["trainer_defaults"]
        cfg = types.SimpleNamespace(
            logprobs_chunk_size=inputs.chunk_size if inputs.chunk_size > 0 else trainer.get("logprobs_chunk_size"),
            vocab_entropy_chunk_size=max(inputs.chunk_size, 0) or trainer.get("vocab_entropy_chunk_size", 0),
            vocab_entropy_chunk_memory_mb=trainer.get("vocab_entropy_chunk_memory_mb", 512))
        closure = {"self": types.SimpleNamespace(cfg=cfg, _fused_lm_head=False, _fused_lm_head_backend="torch"),
                   "temperature": inputs.temperature, "loss_config": self._loss_config(inputs),
                   "current_loss_fn": fns["ppo"]["ppo_policy_loss"], "resolved_loss_name": "regular",
                   "mtp_enabled": False, "mtp_loss_weight": 0.0, "mtp_loss_chunk_size": None, "mtp_loss_topk": None,
                   "return_per_token_outputs": False}
        recorded = PACKED if self.era.thd_path == "packed" and inputs.layout != "bshd" else LOGPROBS
        given = {**fns["module"], **{k: v for k, v in fns["given"].items() if v is not None}, **closure,
                 recorded: record}
        if "loss_func" not in fns:  # compiled once; each micro-batch gets its own closure values
            fns["loss_func"] = compile_nested(self.src / WRAPPER, LOSS_FUNC, given, OFF_PATH)
        compiled = fns["loss_func"]
        return types.FunctionType(compiled.__code__, {**compiled.__globals__, **given}, compiled.__name__)

    # ---- the loss -----------------------------------------------------------------------------

    def compute(self, inputs: RankInputs) -> RankOutputs:  # type: ignore[override]
        if inputs.policy is None or inputs.step is None:
            raise ValueError("skyrl:loss is a training step's loss: it needs the policy batch and the step inputs")
        mod = self._module()
        batch, params, packed = self._laid_out(inputs)
        num_actions = batch["response_mask"].shape[1]
        recorded = PACKED if packed else LOGPROBS
        record = Recorder(getattr(mod, recorded))
        loss_func = self._loss_func(inputs, record)
        # the model's output as SkyRL's forward step hands it on: packed rows (861e005b4 on), else the
        # batch's layout (postprocess_packed_seqs before it); loss_func divides it by the temperature
        # in place, so it gets a copy of the harness's logits unless temperature_in_place is set
        logits = inputs.logits if packed else self._loss_logits(inputs, batch, params)
        if logits is inputs.logits and inputs.temperature != 1.0 and not self.temperature_in_place:
            logits = logits.clone()
        data = self._micro_batch(inputs, batch, params, packed)
        loss, metrics = loss_func(logits, data)
        held = inputs.held_rows()
        log_probs = self._per_sample(record.results[-1][:, -num_actions:], batch["response_mask"], held)
        entropy = None
        if inputs.with_entropy:
            with torch.no_grad():  # the loss's entropy term is loss_func's; these are for the per-token check
                entropy = self._entropy_values(mod, inputs, logits, batch, packed)
        reported = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        return RankOutputs(log_probs, entropy, loss=loss, num_tokens=None, reported=reported)

    def _micro_batch(self, inputs: RankInputs, batch: dict[str, Any], params: Any, packed: bool) -> dict[str, Any]:
        """The micro-batch dict SkyRL's worker and forward step hand loss_func
        (megatron_worker.py forward_backward: the experience's fields, num_microbatches; the forward
        step: packed_seq_params and packed_targets under remove_microbatch_padding)."""
        step = inputs.step
        response_mask = batch["response_mask"]
        loss_mask = batch["loss_mask"]
        columns = [response_mask[i].nonzero().squeeze(-1) for i in range(response_mask.shape[0])]
        old = self._columns(self._whole(inputs.policy.old_log_probs, inputs), columns, loss_mask)
        advantages = self._columns(self._advantages(inputs), columns, loss_mask)
        data = {"sequences": batch["sequences"], "attention_mask": batch["attention_mask"],
                "num_actions": response_mask.shape[1], "old_action_log_probs": old,
                "base_action_log_probs": old, "advantages": advantages, "loss_mask": loss_mask,
                "rollout_action_logprobs": None, "response_mask": response_mask, "action_mask": response_mask,
                "num_microbatches": step.num_microbatches, "num_real_microbatches": step.num_microbatches,
                "sub_seq_lengths_list": None}
        if packed:
            data["packed_seq_params"] = params
            data["packed_targets"] = self.data_path.packed_targets(batch, params)
        return data

    def _advantages(self, inputs: RankInputs) -> list[torch.Tensor]:
        """Per sample of the micro-batch, its whole response's advantages as SkyRL's loss reads them:
        from #1296 on, scaled by the trainer's apply_loss_reduction_to_advantages_minibatch over the
        step's global batch (every copy of every sample, whole responses, right-aligned as SkyRL's
        batch holds them); before, as they are."""
        step = inputs.step
        if self.loss_era["reduced_by"] != "trainer":
            return [step.advantages[g].float() for g in step.samples]
        n, copies = len(step.loss_masks), step.copies
        width = max(len(m) for m in step.loss_masks)
        advantages = torch.zeros((n * copies, width), dtype=torch.float32)
        masks = torch.zeros((n * copies, width), dtype=torch.float32)
        for c in range(copies):
            for i, (a, m) in enumerate(zip(step.advantages, step.loss_masks)):
                if len(m):
                    advantages[c * n + i, width - len(a):] = a.float()
                    masks[c * n + i, width - len(m):] = m.float()
        fn = self._functions()["ppo"][NORMALIZE]
        takes = fn.__code__.co_varnames[:fn.__code__.co_argcount]
        kwargs = {"loss_reduction": self.reduction, "micro_batch_size": len(step.samples), "max_seq_len": None}
        scaled = fn(advantages, masks, **{k: v for k, v in kwargs.items() if k in takes})
        copy = step.dp_rank // max(1, step.dp_size // copies)  # which copy of the scenario this replica holds
        return [scaled[copy * n + g, width - len(step.loss_masks[g]):] for g in step.samples]

    @staticmethod
    def _whole(values: list[torch.Tensor], inputs: RankInputs) -> list[torch.Tensor]:
        """Per sample, the whole response's values out of each CP rank's share (gathered over CP)."""
        share = inputs.rank_layout.share
        mine = [(list(share[k]), v.detach().cpu()) for k, v in enumerate(values)]
        gathered: list[Any] = [mine]
        if inputs.cp_size > 1:
            import torch.distributed as dist

            gathered = [None] * inputs.cp_size
            dist.all_gather_object(gathered, mine, group=inputs.cp_group)
        out = []
        for k, response in enumerate(inputs.response_lengths):
            whole = torch.full((response,), math.nan, dtype=values[k].dtype)
            seen = torch.zeros(response, dtype=torch.bool)
            for rank in gathered:
                tokens, v = rank[k]
                if tokens:
                    whole[torch.tensor(tokens)] = v
                    seen[torch.tensor(tokens)] = True
            if not bool(seen.all()):
                raise RuntimeError(f"skyrl:loss: sample {k}'s response tokens are not all held by the CP ranks")
            out.append(whole)
        return out

    @staticmethod
    def _columns(per_sample: list[torch.Tensor], columns: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """Per-sample whole-response values in SkyRL's [B, num_actions] columns (0 elsewhere)."""
        out = torch.zeros(like.shape, dtype=torch.float32, device=like.device)
        for i, values in enumerate(per_sample):
            out[i, columns[i]] = values.to(out)
        return out
