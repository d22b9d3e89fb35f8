"""THUDM/slime's real ``get_log_probs_and_entropy`` and ``policy_loss_function``, imported from a
source checkout: ``--target slime`` and ``--target slime:policy_loss``.

slime is not on PyPI (the PyPI package called ``slime`` is another project): the user names a
checkout with ``--slime-src DIR`` or ``SHARDCHECK_SLIME_SRC``. Its files are never written (no
bytecode is cached there). Modules slime imports at module level but does not use on this path
(``httpx`` at the newest commits, ``ray`` at older ones) are stubbed only when missing, and the
report says which. torch.compile'd helpers run eagerly (dynamo disabled): compiling them costs
7 to 30 s per process on 2 cores and is not what is checked.

The signature changed over slime's history; the adapter reads it (and the source) and says which
era it found: the return (a dict, later ``(empty, dict)``), ``qkv_format``/``max_seq_lens`` and
bshd, ``allgather_cp``, top-p replay arguments, ``with_entropy_grad``/``need_entropy_grad``.
Every ``args`` field slime reads is set from the scenario; a field slime asks for that the
adapter did not set is reported (slime defaults ``entropy_coef`` to 0 when it is missing, which
silently drops the entropy gradient).

``slime:policy_loss`` calls ``policy_loss_function`` as slime's ``loss_function`` does, with the
reducer from slime's own ``get_sum_of_sample_mean``, on a batch built so that the loss is a known
function of log-probs and entropy: old log-probs equal to the truth (ratio 1, no clipping acts),
the harness's advantages and loss masks, KL, TIS and OPSM off, per-sample token mean. Whether the
entropy keeps its gradient is then decided where slime decides it for training, not by the
adapter (a decision made at one call site only shows up here). The per-token values are taken
from the caller's own call of ``get_log_probs_and_entropy`` (a pass-through wrapper on the
imported module, never on slime's files).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import types
from argparse import Namespace
from pathlib import Path
from typing import Any

import torch

from shardcheck.errors import BadInput
from shardcheck.targets.base import (Capabilities, Definitions, RankInputs, RankOutputs, Rollout, StepSizes,
                                     TargetConfig, layout_description, layout_option)
from shardcheck.targets.checkout import CheckoutFactory, CheckoutTarget
from shardcheck.targets import slime_schedule
from shardcheck.targets.compiled import compile_alone
from shardcheck.targets.passthrough import Recorder
from shardcheck.targets.slime_data import SlimeDataPath, cpu_accelerator, read_get_batch
from shardcheck.targets.source import Framework, functions_named

LOSS_MODULE = "slime.backends.megatron_utils.loss"
LOSS_FILE = Path("slime/backends/megatron_utils/loss.py")
# where train_one_step's aggregation of the logged metrics lives, since slime took it out of the loop
METRICS_FILE = Path("slime/observability/train_metric_utils.py")
STUBBABLE = ("httpx", "ray", "sglang", "wandb", "tensorboard", "transformers", "datasets", "deep_ep",
             "torch_memory_saver", "yaml", "sglang_router", "pydantic", "pandas", "megatron", "tqdm", "triton",
             # a CUDA allocator actor.py and model.py imported in late 2025 (not on the log-prob path)
             "cumem_allocator")


# slime's megatron_utils/__init__.py sets up its accelerator, as in every slime run: package inits run
FRAMEWORK = Framework("slime", "slime", str(LOSS_FILE), ("slime",), STUBBABLE, package_inits="run", eager=True,
                      clone="a clone of THUDM/slime; the PyPI package named slime is another one")
ENV = FRAMEWORK.env
source = FRAMEWORK.source


@dataclasses.dataclass(frozen=True)
class SlimeEra:
    """What a slime checkout's get_log_probs_and_entropy takes and returns (:func:`detect_era`)."""

    params: tuple[str, ...]
    returns: str  # "dict", or "tuple (empty, dict)"
    qkv_format: bool  # the bshd path (qkv_format), so bshd is supported
    max_seq_lens: bool
    allgather_cp: bool  # all-gather CP (allgather_cp), so the allgather layout is supported
    top_p_replay: bool  # takes top_p_token_ids (replayed keep sets)
    # policy_loss_function hands the batch's rollout_top_p_token_ids on when rollout_top_p != 1
    policy_top_p_replay: bool
    entropy_grad_flag: str | None  # the flag that keeps the entropy's gradient, by its name at this commit


def detect_era(src: Path) -> SlimeEra:
    """What this checkout's get_log_probs_and_entropy takes and returns, read from its source."""
    tree = FRAMEWORK.parse(src, LOSS_FILE)
    text = (src / LOSS_FILE).read_text()
    fn = next(iter(functions_named(tree, "get_log_probs_and_entropy")), None)
    if fn is None:
        raise BadInput(f"{src / LOSS_FILE} has no get_log_probs_and_entropy")
    params = [a.arg for a in fn.args.args + fn.args.kwonlyargs]
    returns_tuple = any(isinstance(n, ast.Return) and isinstance(n.value, ast.Tuple) for n in ast.walk(fn))
    ppo = src / "slime/utils/ppo_utils.py"
    ppo_text = ppo.read_text() if ppo.is_file() else ""
    return SlimeEra(
        params=tuple(params),
        returns="tuple (empty, dict)" if returns_tuple else "dict",
        qkv_format="qkv_format" in text,
        max_seq_lens="max_seq_lens" in params,
        allgather_cp="allgather_cp" in text,
        top_p_replay="top_p_token_ids" in params,
        policy_top_p_replay="rollout_top_p_token_ids" in text,
        entropy_grad_flag=next((f for f in ("with_entropy_grad", "need_entropy_grad") if f in text + ppo_text), None),
    )


class _Args(Namespace):
    """slime's ``args``: the fields set from the scenario; a read of any other is recorded."""

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("_"):
            self.__dict__.setdefault("_missing", set()).add(name)
        raise AttributeError(name)


class SlimeTarget(CheckoutTarget):
    """THUDM/slime's get_log_probs_and_entropy from a source checkout (--slime-src / SHARDCHECK_SLIME_SRC)"""

    framework = FRAMEWORK

    name = "slime"
    # the modules of slime's log-prob path, from the batch to the loss (--coverage measures them)
    framework_files = ("slime/backends/megatron_utils/data.py", "slime/backends/megatron_utils/cp_utils.py",
                       "slime/backends/megatron_utils/loss.py", "slime/utils/ppo_utils.py")

    def __init__(self, src: str | None = None, layout: str = "framework") -> None:
        super().__init__(src)
        self.era = detect_era(self.src)
        layouts = {"thd", "zigzag"} | ({"allgather"} if self.era.allgather_cp else set()) | (
            {"bshd"} if self.era.qkv_format else set())
        self.capabilities = Capabilities(
            layouts=frozenset(layouts), entropy=True, dtypes=frozenset({"float32"}),
            replay_keep=self.era.top_p_replay and self.passes_keep_sets(),
            reasons=(("layout", f"slime at {self.short()} has no such layout "
                                f"(supports {', '.join(sorted(layouts))})"),
                     ("dtype", "slime asserts float32 logits"),
                     ("replay_keep", f"slime at {self.short()} takes no top-p replay"
                      if not self.era.top_p_replay else
                      f"slime at {self.short()}: this entry point passes no top-p replay on")),
        )
        self._fn: Any = None
        self.missing_args: set[str] = set()
        self.device_notes: list[str] = []
        # slime's get_batch lays the rows out (the default), or shardcheck does (layout=shardcheck)
        found = read_get_batch(self.src) if layout == "framework" else None
        self.data_path = SlimeDataPath(self, found) if found is not None else None
        self.layout_option = layout

    def passes_keep_sets(self) -> bool:
        """Whether this entry point hands get_log_probs_and_entropy the replayed keep sets."""
        return True

    def import_module(self, name: str) -> types.ModuleType:
        """One of slime's modules from the checkout (stubs and settings undone by release())."""
        module = super().import_module(name)
        if not self.device_notes:
            note = cpu_accelerator(self.src, super().import_module)
            self.device_notes = [note] if note else ["none"]
        return module

    def forget(self) -> None:
        self._fn = None
        self.device_notes = []
        if self.data_path is not None:
            self.data_path = SlimeDataPath(self, self.data_path.found)
        self.__dict__.pop("_policy_fns", None)  # slime:policy_loss's functions, imported with it
        self.__dict__.pop("_policy_module", None)

    def description(self) -> dict[str, Any]:
        return {"args_read_but_not_set": sorted(self.missing_args),
                "data_path": layout_description(self.data_path, self.layout_option, "no get_batch"),
                "cpu_world": [n for n in self.device_notes if n != "none"] +
                (self.data_path.shims if self.data_path is not None else [])}

    def _function(self) -> Any:
        if self._fn is None:
            module = self.import_module(LOSS_MODULE)
            self._fn = module.get_log_probs_and_entropy
            self._params = set(inspect.signature(self._fn).parameters)
        return self._fn

    def args(self, inputs: RankInputs) -> _Args:
        return _Args(
            rollout_temperature=inputs.temperature,
            log_probs_chunk_size=inputs.chunk_size,
            allgather_cp=inputs.allgather_cp,
            entropy_coef=inputs.entropy_coef,
            qkv_format=inputs.qkv_format,
            # any value but 1 switches replay on where slime reads it (policy_loss_function); the
            # sets themselves are what the rollout kept, whatever p it used
            rollout_top_p=0.9 if inputs.keep_sets is not None else 1.0,
            context_parallel_size=inputs.cp_size,
            tensor_model_parallel_size=inputs.tp_size,
        )

    def repro_call(self) -> str | None:
        """How a repro script calls slime: get_log_probs_and_entropy on the rows slime's get_batch
        lays out (where it lays them out in the run) or on shardcheck's (a script that runs its
        policy loss or loss function is not written yet)."""
        return REPRO_CALL if type(self) is SlimeTarget else None

    def compute(self, inputs: RankInputs) -> RankOutputs:
        fn = self._function()
        args = self.args(inputs)
        kwargs: dict[str, Any] = {
            "args": args,
            "unconcat_tokens": [t.to(inputs.logits.device) for t in inputs.tokens],
            "total_lengths": inputs.total_lengths,
            "response_lengths": inputs.response_lengths,
            "with_entropy": inputs.with_entropy,
        }
        if inputs.rollout is not None:  # what slime's forward step hands on from get_batch's batch
            batch = self.data_path.batch(_rollout_on(inputs.rollout, inputs.logits.device))
            kwargs.update(unconcat_tokens=batch["unconcat_tokens"], total_lengths=batch["total_lengths"],
                          response_lengths=batch["response_lengths"])
        if "max_seq_lens" in self._params:
            kwargs["max_seq_lens"] = inputs.max_seq_lens
        if inputs.keep_sets is not None:  # slime's replay format: ids and offsets per sample
            from shardcheck.scenarios.keep import to_ids_offsets

            pairs = [to_ids_offsets(sets) for sets in inputs.keep_sets]
            kwargs["top_p_token_ids"] = [ids for ids, _ in pairs]
            kwargs["top_p_token_offsets"] = [offsets for _, offsets in pairs]
        result = fn(inputs.logits, **kwargs)
        if isinstance(result, tuple):
            result = result[-1]
        self.missing_args |= args.__dict__.get("_missing", set())
        return RankOutputs(list(result["log_probs"]), list(result["entropy"]) if "entropy" in result else None)


# How a `shardcheck repro` script calls slime (see harness/controller/commands/repro.py): as SlimeTarget
# does with the harness's rows (layout=shardcheck), from the checkout, megatron-core's groups built.
REPRO_CALL = '''
def call_code_under_test(logits, rank):
    """slime's get_log_probs_and_entropy from rank.src, as shardcheck's slime target calls it."""
    import importlib.util, inspect  # noqa: E401
    from megatron.core import parallel_state as mpu
    class Stub(type(sys)):  # a module (types.ModuleType) slime imports but this path never uses
        __path__, __mro_entries__ = [], lambda self, bases: (object,)  # a package; a base class
        __getattr__ = lambda self, name: self if not name.startswith("__") else object.__getattribute__(self, name)
        __call__ = __or__ = __ror__ = __getitem__ = lambda self, *a, **k: self  # calls, X | None, X[...]

    sys.path.insert(0, rank.src)  # each rank's process calls this once
    torch._dynamo.config.disable = True  # its torch.compile'd helpers run eagerly, as shardcheck runs them
    sys.modules.update({name: Stub(name) for name in STUBBABLE if importlib.util.find_spec(name) is None})
    mpu.initialize_model_parallel(rank.tp_size, context_parallel_size=rank.cp_size)
    from slime.backends.megatron_utils import data, loss
    args = SimpleNamespace(rollout_temperature=rank.temperature, log_probs_chunk_size=rank.chunk_size, rollout_top_p=1.0,
                           allgather_cp=rank.layout == "allgather", entropy_coef=rank.entropy_coef, tensor_model_parallel_size=rank.tp_size,
                           qkv_format="bshd" if rank.layout == "bshd" else "thd", context_parallel_size=rank.cp_size)
    batch = {"unconcat_tokens": rank.tokens, "total_lengths": rank.total_lengths, "response_lengths": rank.response_lengths}
    if rank.data_path:  # slime's get_batch packs, pads and splits the rollout, as its training step calls it
        if not torch.cuda.is_available():  # where get_batch places cu_seqlens (later: slime's accelerator API): the CPU
            acc = getattr(data, "accelerator", SimpleNamespace())
            torch.cuda.current_device, acc.current_device, acc.device = (lambda: "cpu",) * 2 + (lambda *a: torch.device("cpu"),)
        rollout = {"tokens": rank.tokens, "total_lengths": rank.total_lengths, "response_lengths": rank.response_lengths,
                   "loss_masks": [torch.ones(r, dtype=torch.int32) for r in rank.response_lengths]}
        knobs = {**rank.knobs, "allgather_cp": rank.layout == "allgather", "qkv_format": "thd"}
        batch = data.get_batch(SimpleNamespace(get_next=lambda keys: {k: list(rollout[k]) for k in keys}), list(rollout),
                               **{k: v for k, v in knobs.items() if k in inspect.signature(data.get_batch).parameters})
        held = [int(rank.tokens[s][p]) if s < len(rank.tokens) else 0 for s, p in rank.rows]
        assert batch["tokens"].reshape(-1).tolist() == held, "get_batch laid the tokens out otherwise than the run did"
    kwargs = {"args": args, "with_entropy": rank.with_entropy, **{k: batch[k] for k in ("unconcat_tokens", "total_lengths", "response_lengths")}}
    if "max_seq_lens" in inspect.signature(loss.get_log_probs_and_entropy).parameters:
        kwargs["max_seq_lens"] = rank.max_seq_lens
    result = loss.get_log_probs_and_entropy(logits, **kwargs)
    result = result[-1] if isinstance(result, tuple) else result  # (empty, dict) in later commits
    return list(result["log_probs"]), list(result["entropy"]) if "entropy" in result else None
'''.replace("STUBBABLE", repr(STUBBABLE))


def _rollout_on(rollout: Rollout, device: Any) -> Rollout:
    return dataclasses.replace(rollout, tokens=[t.to(device) for t in rollout.tokens],
                               loss_masks=[m.to(device) for m in rollout.loss_masks])


# args policy_loss_function reads at one commit or another, set so that the loss is the
# per-sample mean PPO loss with nothing else switched on.
POLICY_ARGS: dict[str, Any] = {
    "advantage_estimator": "grpo",
    "use_rollout_logprobs": False,
    "eps_clip": 0.2,
    "eps_clip_high": 0.28,
    "eps_clip_c": None,
    "use_opsm": False,
    "get_mismatch_metrics": False,
    "use_tis": False,
    "tis_clip": 2.0,
    "tis_clip_low": 0.0,
    "custom_tis_function_path": None,
    "custom_pg_loss_reducer_function_path": None,
    "calculate_per_token_loss": False,
    "use_kl_loss": False,
    "kl_loss_coef": 0.0,
    "kl_loss_type": "low_var_kl",
    "use_unbiased_kl": False,
    "recompute_loss_function": False,
    # TIS as #179 named it (renamed use_tis by #234): slime's default, off
    "enable_off_policy_correction": False,
    # read by the loss of July 2025 (before 2ad9627a2): slime's default; the scenarios of that era's
    # suites hand no token budget
    "use_dynamic_batch_size": False,
}


class SlimePolicyLossTarget(SlimeTarget):
    """THUDM/slime's policy_loss_function (PPO loss at ratio 1, KL off), which calls
    get_log_probs_and_entropy itself"""

    name = "slime:policy_loss"
    loss_form = "policy"

    def __init__(self, src: str | None = None, layout: str = "framework") -> None:
        super().__init__(src, layout)
        tree = FRAMEWORK.parse(self.src, LOSS_FILE)
        if not functions_named(tree, "policy_loss_function"):
            # before 2ad9627a2 ("bugfix", 2025-07-05) the policy loss was policy_loss_func(args, batch,
            # num_microbatches, logits), with no loss_function to dispatch to it: an era not modelled
            raise BadInput(f"slime at {self.short()} has no policy_loss_function in {LOSS_FILE} (its policy loss "
                           "before 2ad9627a2 was policy_loss_func, which this adapter does not call)")

    def passes_keep_sets(self) -> bool:
        return self.era.policy_top_p_replay

    def _policy(self) -> tuple[Any, Any, Recorder]:
        if getattr(self, "_policy_fns", None) is None:
            module = self.import_module(LOSS_MODULE)
            recorder = module.get_log_probs_and_entropy
            if not isinstance(recorder, Recorder):
                recorder = Recorder(recorder)
                module.get_log_probs_and_entropy = recorder
            cp_utils = self.import_module("slime.backends.megatron_utils.cp_utils")
            self._fn = recorder.fn
            self._params = set(inspect.signature(recorder.fn).parameters)
            self._policy_fns = (module.policy_loss_function, cp_utils.get_sum_of_sample_mean, recorder)
            # the loss module whose get_log_probs_and_entropy records: slime's loss_function is taken
            # from it too (get_batch's data path may import that module anew in between)
            self._policy_module = module
        return self._policy_fns

    def _mask_sums_key(self) -> str:
        text = (self.src / LOSS_FILE).read_text()
        return "group_mask_sums" if "group_mask_sums" in text and "rollout_mask_sums" not in text else "rollout_mask_sums"

    def args(self, inputs: RankInputs) -> _Args:
        args = super().args(inputs)
        for key, value in POLICY_ARGS.items():
            setattr(args, key, value)
        args.loss_type = "policy_loss"
        return args

    def compute(self, inputs: RankInputs) -> RankOutputs:
        if inputs.policy is None:
            raise ValueError("slime:policy_loss needs the harness's policy batch (loss_form = 'policy')")
        policy_loss_function, get_sum_of_sample_mean, recorder = self._policy()
        device = inputs.logits.device
        args = self.args(inputs)
        masks = [m.to(device) for m in inputs.policy.loss_masks]
        per_sample: dict[str, Any] = {
            "advantages": [a.to(device) for a in inputs.policy.advantages],
            "log_probs": [lp.to(device) for lp in inputs.policy.old_log_probs],
            "loss_masks": masks,
            # #1984 named them group_mask_sums until its revert (44d29ee59): the loss reads that key then
            self._mask_sums_key(): [m.sum() for m in masks],
        }
        if inputs.keep_sets is not None:  # as slime's rollout stores them: ids and offsets per sample
            from shardcheck.scenarios.keep import to_ids_offsets

            pairs = [to_ids_offsets(sets) for sets in inputs.keep_sets]
            per_sample["rollout_top_p_token_ids"] = [ids for ids, _ in pairs]
            per_sample["rollout_top_p_token_offsets"] = [offsets for _, offsets in pairs]
        if inputs.rollout is not None:  # the micro-batch slime's training step gets from get_batch
            batch = self.data_path.batch(_rollout_on(inputs.rollout, device), per_sample)
        else:
            batch = {"unconcat_tokens": [t.to(device) for t in inputs.tokens], "total_lengths": inputs.total_lengths,
                     "response_lengths": inputs.response_lengths, **per_sample}
            if inputs.max_seq_lens is not None:
                batch["max_seq_lens"] = inputs.max_seq_lens
        recorder.results.clear()
        loss, metrics, num_tokens, reported = self._loss(args, batch, inputs, get_sum_of_sample_mean, masks)
        self.missing_args |= args.__dict__.get("_missing", set())
        if len(recorder.results) != 1:
            raise RuntimeError(f"policy_loss_function called get_log_probs_and_entropy {len(recorder.results)} "
                               "times (expected once)")
        result = recorder.results.pop()
        if isinstance(result, tuple):
            result = result[-1]
        return RankOutputs(list(result["log_probs"]), list(result["entropy"]) if "entropy" in result else None,
                           notes={"metrics": sorted(metrics)}, loss=loss, num_tokens=num_tokens, reported=reported)

    def _loss(self, args: Any, batch: dict[str, Any], inputs: RankInputs, get_sum_of_sample_mean: Any,
              masks: list) -> tuple[Any, Any, Any, Any]:
        """(loss, metric names, num_tokens, what it logs): policy_loss_function with slime's own
        reducer (no num_tokens: it is not a training step's loss)."""
        policy_loss_function = self._policy()[0]
        loss, metrics = policy_loss_function(args, batch, inputs.logits,
                                             self._reducer(get_sum_of_sample_mean, inputs, masks))
        return loss, metrics, None, None

    def _reducer(self, get_sum_of_sample_mean: Any, inputs: RankInputs, masks: list) -> Any:
        """slime's own reducer, called as its loss_function calls it at this commit."""
        params = inspect.signature(get_sum_of_sample_mean).parameters
        kwargs: dict[str, Any] = {}
        if "calculate_per_token_loss" in params:
            kwargs["calculate_per_token_loss"] = False
        if "qkv_format" in params:
            kwargs["qkv_format"] = inputs.qkv_format
        if "max_seq_lens" in params:
            kwargs["max_seq_lens"] = inputs.max_seq_lens
        return get_sum_of_sample_mean(inputs.total_lengths, inputs.response_lengths, masks, **kwargs)


class SlimeLossTarget(SlimePolicyLossTarget):
    """THUDM/slime's loss_function in a training step (megatron-core's schedule and DDP around it,
    get_batch's micro-batches): policy_loss_function through slime's dispatch, its all-gather CP
    term and its rescale for megatron; option calculate_per_token_loss (slime's default false)"""

    name = "slime:loss"
    loss_form = "step"
    framework_files = SlimePolicyLossTarget.framework_files + (str(METRICS_FILE), str(slime_schedule.SCHEDULE_FILE))
    # the loss the framework's training step differentiates (the model's CP collective runs in
    # its backward: harness/rank/life/model_stand_in.py)
    training_loss = True

    def __init__(self, src: str | None = None, layout: str = "framework", per_token: bool = False) -> None:
        super().__init__(src, layout)
        self.per_token = per_token  # slime's --calculate-per-token-loss
        self.capabilities = dataclasses.replace(self.capabilities, replay_keep=False)
        self.compatibility: set[str] = set()  # what was handed on otherwise than it came, and why

    @property
    def definitions(self) -> Definitions:
        # slime counts num_tokens as sum(clamp_min(loss_mask.sum(), 1)): a fully masked sample counts one
        return Definitions(objective="token_mean" if self.per_token else "sample_mean",
                           objective_source=f"slime's calculate_per_token_loss={str(self.per_token).lower()}",
                           token_floor=1 if self.per_token else 0)

    def description(self) -> dict[str, Any]:
        split = slime_schedule.SOURCE if (self.src / slime_schedule.SCHEDULE_FILE).is_file() else (
            "megatron's rules (no build_dp_schedule at this commit)")
        return {**super().description(), "calculate_per_token_loss": self.per_token, "batch_split": split,
                **({"compatibility": sorted(self.compatibility)} if self.compatibility else {})}

    def args(self, inputs: RankInputs) -> _Args:
        args = super().args(inputs)
        args.calculate_per_token_loss = self.per_token
        return args

    def _loss(self, args: Any, batch: dict[str, Any], inputs: RankInputs, get_sum_of_sample_mean: Any,
              masks: list) -> tuple[Any, Any, Any, Any]:
        step = inputs.step
        if step is None:
            raise ValueError("slime:loss is a training step's loss: it needs the step inputs")
        self._policy()
        loss_function = self._policy_module.loss_function
        # what slime's train_one_step hands it: the step's micro-batch count and its global batch
        # (samples over every data-parallel replica)
        args.global_batch_size = step.global_batch_size
        named = {"args": args, "batch": batch, "num_microbatches": step.num_microbatches,
                 "step_global_batch_size": step.global_batch_size, "logits": inputs.logits}
        params = list(inspect.signature(loss_function).parameters)
        unknown = [p for p in params if p not in named]
        if unknown:
            raise BadInput(f"slime at {self.src}: loss_function takes {', '.join(unknown)}, which this adapter "
                           "does not know")
        loss, normalizer, log = loss_function(*[named[p] for p in params])
        if isinstance(normalizer, int):
            # slime before 2026 returned the sample-mean's normaliser as the int 1; the megatron-core
            # of its day divided by it, 0.16.1 clamps it as a tensor: the same value, handed as one
            normalizer = torch.tensor(normalizer)
            self.compatibility.add(INT_NORMALIZER)
        return loss, list(log.get("keys", [])), normalizer, log

    @functools.cached_property
    def _dp_schedule(self) -> Any:
        """slime's build_dp_schedule at this checkout (None: before #1926), compiled once."""
        return slime_schedule.build_dp_schedule(self.src)

    def split_batch(self, scenario: Any) -> list[list[tuple[int, ...]]] | None:
        """The step's global batch split as slime splits it (its build_dp_schedule), or None at a
        commit that splits otherwise (before #1926)."""
        build = self._dp_schedule
        if build is None:
            return None
        return slime_schedule.split(build, [s.total for s in scenario.samples], scenario.dp, scenario.cp,
                                    scenario.micro_batch_size, scenario.micro_batch_tokens)

    def logged_loss(self, reported: list[dict[str, Any]], sizes: StepSizes) -> Any:
        """The "loss" slime's train_one_step logs: its own reduce_train_step_metrics (compiled
        alone from its file) on what each micro-batch's loss_function returned, called as
        train_one_step calls it. None at a commit that aggregates inline in train_one_step."""
        path = self.src / METRICS_FILE
        if not path.is_file():
            return None
        reduce = compile_alone(path, ["reduce_train_step_metrics"], {"dist": torch.distributed})
        logged = reduce["reduce_train_step_metrics"](
            reported, calculate_per_token_loss=self.per_token, step_global_batch_size=sizes.global_batch_size,
            cp_size=sizes.cp_size, dp_with_cp_group=sizes.dp_cp_group)
        return logged.get("loss")


INT_NORMALIZER = ("loss_function returned its normaliser as the int 1 (slime of its day); handed to megatron-core "
                  "0.16.1's schedule as a tensor of the same value")


def _build(variant: str | None, config: TargetConfig) -> SlimeTarget:
    layout = layout_option(config, framework="framework (slime's get_batch)")
    if variant == "loss":
        try:
            per_token = config.flag("calculate_per_token_loss")
        except ValueError as exc:
            raise BadInput(str(exc)) from None
        return SlimeLossTarget(config.src, layout, per_token)
    if config.get("calculate_per_token_loss") is not None:
        raise BadInput("option calculate_per_token_loss is slime:loss's (the training step's loss)")
    kinds = {None: SlimeTarget, "policy_loss": SlimePolicyLossTarget}
    return kinds[variant](config.src, layout)


target = CheckoutFactory(
    FRAMEWORK, _build,
    doc=("THUDM/slime's get_log_probs_and_entropy from a source checkout (--slime-src, --target-src or "
         "SHARDCHECK_SLIME_SRC)\n\nWith the variant ``policy_loss``, its policy_loss_function instead."),
    options={"layout": "framework (default): slime's get_batch lays out each rank's rows; shardcheck: the harness's "
                       "own layout, handed to slime's functions as before",
             "calculate_per_token_loss": "slime:loss only: slime's --calculate-per-token-loss (default false: each "
                                         "sample's token mean, averaged; true: the global batch's token mean)"},
    variants={"policy_loss": " ".join((SlimePolicyLossTarget.__doc__ or "").split()),
              "loss": " ".join((SlimeLossTarget.__doc__ or "").split())})
