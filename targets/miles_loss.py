"""radixark/miles's ``loss_function`` in a training step: ``miles:loss``.

miles's Megatron backend (``megatron_utils/model.py:train_one_step``) hands megatron-core's
schedule ``partial(loss_function, args, batch, num_microbatches, apply_megatron_loss_scaling=True,
num_rollouts=num_rollouts)`` on each micro-batch ``get_batch`` made. This target calls
``loss_function`` (``miles/backends/training_utils/loss.py``) the same way, from the checkout:
``policy_loss_function`` (``loss_hub/losses.py``) through miles's own dispatch
(``get_loss_function``), its reducer ``get_sum_of_sample_mean``, its all-gather CP term and its
rescale for megatron. The harness runs megatron-core's ``forward_backward_no_pipelining``, DDP and
``finalize_model_grads`` around it (``loss_form = "step"``, docs/training.md).

The batch is built as for ``slime:loss`` (slime is the fork's parent, :class:`SlimeLossTarget`):
old log-probs equal to the truth (ratio 1), the harness's advantages and loss masks, KL, TIS, OPSM
off. ``rollout_mask_sums`` (every miles rollout carries it, ``ray/rollout/train_data_conversion.py``)
is each sample's mask sum: each sample its own rollout. ``num_rollouts`` is the step's global
batch size, as ``get_num_rollouts`` gives it without dynamic batches.

Two eras: the pin's (``loss_hub/``, miles's ParallelState read from ``get_parallel_state()``,
built as :class:`MilesTarget` builds it) and the one before the loss refactor (#1132, May 2026:
everything in ``loss.py``, the ParallelState handed to ``loss_function`` and ``get_batch``; built
by that era's ``create_megatron_parallel_state``, compiled alone, on megatron-core's groups).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from shardcheck.errors import BadInput
from shardcheck.targets.base import Capabilities, Definitions, RankInputs, RankOutputs, TargetConfig, layout_option
from shardcheck.targets.checkout import CheckoutTarget
from shardcheck.targets.compiled import compile_alone
from shardcheck.targets.miles import (LOGIT_FILE, MEGATRON_PARALLEL_FILE, TRAINING_PARALLEL, MilesTarget,
                                      _MpuWithoutGloo)
from shardcheck.targets.miles import FRAMEWORK as MILES_FRAMEWORK
from shardcheck.targets.miles_data import DATA_MODULE, MilesDataPath, read_get_batch
from shardcheck.targets.passthrough import Recorder
from shardcheck.targets.slime import POLICY_ARGS, _Args, _rollout_on

LOSS_MODULE = "miles.backends.training_utils.loss"
LOSS_FILE = Path("miles/backends/training_utils/loss.py")
LOSSES_MODULE = "miles.backends.training_utils.loss_hub.losses"
LOSSES_FILE = Path("miles/backends/training_utils/loss_hub/losses.py")

# loss.py is in every miles commit (the log-prob file the log-prob target looks for came with #1132)
FRAMEWORK = dataclasses.replace(MILES_FRAMEWORK, marker=str(LOSS_FILE))
ENV = FRAMEWORK.env

# args miles's loss path reads besides slime's (POLICY_ARGS), at miles's defaults
MILES_ARGS: dict[str, Any] = {
    "skip_actor_forward_only": False,  # the actor's own forward scored the old log-probs
    "use_dynamic_global_batch_size": False,
    "custom_loss_function_path": None,
    "dump_details": None,
    "multi_lora": False,
    "true_on_policy_mode": False,
    "vocab_size": None,
}


@dataclasses.dataclass(frozen=True)
class MilesLossEra:
    """Where a miles checkout keeps its loss and how it hands the ParallelState on."""

    logit_file: str  # the file holding get_responses / get_log_probs_and_entropy
    policy_module: str  # the module whose policy_loss_function runs (and whose get_log_probs_and_entropy it calls)
    explicit_state: bool  # loss_function(args, parallel_state, ...): before #1132's refactor
    loss_params: tuple[str, ...]


def detect_era(src: Path) -> MilesLossEra:
    """The era of a miles checkout's loss_function, read from its source."""
    tree = ast.parse((src / LOSS_FILE).read_text())
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "loss_function"), None)
    if fn is None:
        raise BadInput(f"{src / LOSS_FILE} has no loss_function")
    params = tuple(a.arg for a in fn.args.args + fn.args.kwonlyargs)
    split = (src / LOSSES_FILE).is_file()
    return MilesLossEra(logit_file=str(LOGIT_FILE if (src / LOGIT_FILE).is_file() else LOSS_FILE),
                        policy_module=LOSSES_MODULE if split else LOSS_MODULE,
                        explicit_state="parallel_state" in params, loss_params=params)


class _ExplicitStateDataPath(MilesDataPath):
    """miles's get_batch of the era that took the ParallelState as an argument (before #1132)."""

    def _function(self) -> Any:
        get_batch = super()._function()
        return lambda *args, **kwargs: get_batch(*args, parallel_state=self.target.parallel_state, **kwargs)


class MilesLossTarget(MilesTarget):
    """radixark/miles's loss_function in a training step (megatron-core's schedule and DDP around it,
    get_batch's micro-batches): policy_loss_function through miles's dispatch, its all-gather CP term
    and its rescale for megatron (apply_megatron_loss_scaling, num_rollouts, as train_one_step calls it);
    option calculate_per_token_loss (miles's default false)"""

    framework = FRAMEWORK
    name = "miles:loss"
    loss_form = "step"
    # the loss the framework's training step differentiates (the model's CP collective runs in its backward)
    training_loss = True

    def __init__(self, src: str | None = None, layout: str = "framework", per_token: bool = False) -> None:
        # MilesTarget's own __init__ reads loss_hub/logit_processors.py, which the era before #1132 lacks
        CheckoutTarget.__init__(self, src)
        self.era = detect_era(self.src)
        asserts = [line for line in (self.src / self.era.logit_file).read_text().splitlines()
                   if line.strip().startswith("assert logits.dtype")]
        dtypes = {"float32", "bfloat16"} if any("bfloat16" in line for line in asserts) else {"float32"}
        self.capabilities = Capabilities(
            layouts=frozenset({"thd", "zigzag", "allgather", "bshd"}), entropy=True, dtypes=frozenset(dtypes),
            reasons=(("dtype", f"miles's get_responses asserts {' or '.join(sorted(dtypes))} logits"),
                     ("replay_keep", "miles:loss hands no top-p replay on")))
        self.per_token = per_token  # miles's --calculate-per-token-loss
        self._fn = None
        self._state_builder = None
        self._policy_fns: tuple[Any, Recorder] | None = None
        self.parallel_state: Any = None
        self.missing_args: set[str] = set()
        found = read_get_batch(self.src) if layout == "framework" else None
        path = _ExplicitStateDataPath if self.era.explicit_state else MilesDataPath
        self.data_path = path(self, found) if found is not None else None
        self.layout_option = layout
        self.framework_files = (str(LOSS_FILE), self.era.logit_file, "miles/backends/training_utils/cp_utils.py",
                                "miles/backends/training_utils/data.py", str(MEGATRON_PARALLEL_FILE)) + (
            (str(LOSSES_FILE),) if self.era.policy_module == LOSSES_MODULE else ())

    @property
    def definitions(self) -> Definitions:
        # miles counts num_tokens as sum(clamp_min(loss_mask.sum(), 1)) (loss.py): a fully masked sample counts one
        return Definitions(objective="token_mean" if self.per_token else "sample_mean",
                           objective_source=f"miles's calculate_per_token_loss={str(self.per_token).lower()}",
                           token_floor=1 if self.per_token else 0)

    def forget(self) -> None:
        super().forget()
        self._policy_fns = None
        if self.data_path is not None:
            self.data_path = type(self.data_path)(self, self.data_path.found)

    def description(self) -> dict[str, Any]:
        return {**super().description(), "calculate_per_token_loss": self.per_token,
                "loss_era": ("ParallelState handed to loss_function (before #1132)" if self.era.explicit_state
                             else "ParallelState from get_parallel_state() (loss_hub)"),
                "batch_split": "megatron's rules (miles's data iterator: contiguous micro-batches)",
                "logged_loss": "not compared (miles's aggregate_train_losses not run)"}

    def repro_call(self) -> str | None:
        return None  # a script that runs miles's training step is not written yet

    def set_parallel_state(self) -> Any:
        """miles's ParallelState from megatron-core's groups: at the pin as MilesTarget sets it; before
        #1132, that era's create_megatron_parallel_state (compiled alone), kept to be handed on."""
        if not self.era.explicit_state:
            self.parallel_state = super().set_parallel_state()
            return self.parallel_state
        if self._state_builder is None:
            from megatron.core import parallel_state as mpu

            for name in (LOSS_MODULE, DATA_MODULE):  # a stub made on the way re-imports miles's modules
                self.import_module(name)
            training = self.import_module(TRAINING_PARALLEL)
            given = {"mpu": _MpuWithoutGloo(mpu), "ParallelState": training.ParallelState, "Sequence": Sequence}
            # its model config is read only under virtual pipelines, which the harness never builds
            self._state_builder = compile_alone(self.src / MEGATRON_PARALLEL_FILE, ["create_megatron_parallel_state"],
                                                given, off_path=["get_model_config"])["create_megatron_parallel_state"]
        self.parallel_state = self._state_builder()
        return self.parallel_state

    def _policy(self) -> tuple[Any, Recorder]:
        """(loss_function, the recorder of the get_log_probs_and_entropy policy_loss_function calls)."""
        if self._policy_fns is None:
            self.set_parallel_state()  # imports every module first (see MilesTarget.set_parallel_state)
            policy = self.import_module(self.era.policy_module)
            recorder = policy.get_log_probs_and_entropy
            if not isinstance(recorder, Recorder):
                recorder = Recorder(recorder)
                policy.get_log_probs_and_entropy = recorder  # on the imported module, never the file
            self._policy_fns = (self.import_module(LOSS_MODULE).loss_function, recorder)
        return self._policy_fns

    def args(self, inputs: RankInputs) -> _Args:
        args = _Args(rollout_temperature=inputs.temperature, log_probs_chunk_size=inputs.chunk_size,
                     allgather_cp=inputs.allgather_cp, qkv_format=inputs.qkv_format, entropy_coef=inputs.entropy_coef,
                     context_parallel_size=inputs.cp_size, tensor_model_parallel_size=inputs.tp_size,
                     # miles computes the entropy for its log when asked to observe it (detached at coef 0)
                     observe_training_entropy=inputs.with_entropy, rollout_top_p=1.0,
                     **POLICY_ARGS, **MILES_ARGS)
        args.loss_type = "policy_loss"
        args.calculate_per_token_loss = self.per_token
        return args

    def compute(self, inputs: RankInputs) -> RankOutputs:
        step = inputs.step
        if step is None or inputs.policy is None:
            raise ValueError("miles:loss is a training step's loss: it needs the step and policy inputs")
        loss_function, recorder = self._policy()
        device = inputs.logits.device
        args = self.args(inputs)
        # what train_one_step's args carry: the step's global batch (samples over every replica)
        args.global_batch_size = step.global_batch_size
        masks = [m.to(device) for m in inputs.policy.loss_masks]
        per_sample: dict[str, Any] = {
            "advantages": [a.to(device) for a in inputs.policy.advantages],
            "log_probs": [lp.to(device) for lp in inputs.policy.old_log_probs],
            "loss_masks": masks,
        }
        if "rollout_mask_sums" in (self.src / LOSS_FILE).read_text() + self._losses_text:
            # each sample its own rollout; float32, as get_rollout_data makes it
            per_sample["rollout_mask_sums"] = [m.sum().to(torch.float32) for m in masks]
        if inputs.rollout is not None:  # the micro-batch miles's forward_step gets from get_batch
            batch = self.data_path.batch(_rollout_on(inputs.rollout, device), per_sample)
        else:
            self.set_parallel_state()
            batch = {"unconcat_tokens": [t.to(device) for t in inputs.tokens], "total_lengths": inputs.total_lengths,
                     "response_lengths": inputs.response_lengths, **per_sample}
            if inputs.max_seq_lens is not None:
                batch["max_seq_lens"] = inputs.max_seq_lens
        named = {"args": args, "batch": batch, "num_microbatches": step.num_microbatches, "logits": inputs.logits,
                 "parallel_state": self.parallel_state, "apply_megatron_loss_scaling": True,
                 "num_rollouts": step.global_batch_size}
        unknown = [p for p in self.era.loss_params if p not in named]
        if unknown:
            raise BadInput(f"miles at {self.short()}: loss_function takes {', '.join(unknown)}, which this adapter "
                           "does not know")
        recorder.results.clear()
        loss, normalizer, log = loss_function(**{p: named[p] for p in self.era.loss_params})
        self.missing_args |= args.__dict__.get("_missing", set())
        if len(recorder.results) != 1:
            raise RuntimeError(f"policy_loss_function called get_log_probs_and_entropy {len(recorder.results)} times "
                               "(expected once)")
        result = recorder.results.pop()
        return RankOutputs(list(result["log_probs"]), list(result["entropy"]) if "entropy" in result else None,
                           notes={"metrics": sorted(log.get("keys", []))}, loss=loss, num_tokens=normalizer,
                           reported=log)

    @functools.cached_property
    def _losses_text(self) -> str:
        return (self.src / LOSSES_FILE).read_text() if (self.src / LOSSES_FILE).is_file() else ""


def build(config: TargetConfig) -> MilesLossTarget:
    """miles:loss from its options (layout, calculate_per_token_loss)."""
    try:
        per_token = config.flag("calculate_per_token_loss")
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    return MilesLossTarget(config.src, layout_option(config, framework="framework (miles's get_batch)"), per_token)
