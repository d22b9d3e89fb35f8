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
import importlib
import inspect
import os
import sys
import types
from argparse import Namespace
from pathlib import Path
from typing import Any

from shardcheck.errors import BadInput
from shardcheck.targets.base import Capabilities, RankInputs, RankOutputs, TargetConfig, source_commit
from shardcheck.targets.passthrough import Recorder
from shardcheck.targets.stub import Stub

ENV = "SHARDCHECK_SLIME_SRC"
LOSS_MODULE = "slime.backends.megatron_utils.loss"
LOSS_FILE = Path("slime/backends/megatron_utils/loss.py")
STUBBABLE = ("httpx", "ray", "sglang", "wandb", "tensorboard", "transformers", "datasets", "deep_ep")


def source(src: str | None = None) -> Path:
    """The checkout named by ``src`` (``--slime-src``/``--target-src``) or SHARDCHECK_SLIME_SRC."""
    return slime_source(src)


def slime_source(src: str | None = None) -> Path:
    """The checkout to import slime from; BadInput naming the problem if it is not usable."""
    value = src or os.environ.get(ENV)
    if not value:
        raise BadInput(f"the slime target needs a slime source checkout: give --slime-src DIR or set {ENV}")
    path = Path(value).expanduser().resolve()
    if not (path / LOSS_FILE).is_file():
        raise BadInput(f"{str(path)!r} is not a slime checkout (no {LOSS_FILE})")
    return path


def detect_era(src: Path) -> dict[str, Any]:
    """What this checkout's get_log_probs_and_entropy takes and returns, read from its source."""
    text = (src / LOSS_FILE).read_text()
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:
        raise BadInput(f"slime at {src} cannot be imported: {LOSS_FILE} line {exc.lineno}: {exc.msg}") from None
    fn = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "get_log_probs_and_entropy"),
              None)
    if fn is None:
        raise BadInput(f"{src / LOSS_FILE} has no get_log_probs_and_entropy")
    params = [a.arg for a in fn.args.args + fn.args.kwonlyargs]
    returns_tuple = any(isinstance(n, ast.Return) and isinstance(n.value, ast.Tuple) for n in ast.walk(fn))
    ppo = src / "slime/utils/ppo_utils.py"
    ppo_text = ppo.read_text() if ppo.is_file() else ""
    return {
        "params": params,
        "returns": "tuple (empty, dict)" if returns_tuple else "dict",
        "qkv_format": "qkv_format" in text,
        "max_seq_lens": "max_seq_lens" in params,
        "allgather_cp": "allgather_cp" in text,
        "top_p_replay": "top_p_token_ids" in params,
        # policy_loss_function hands the batch's rollout_top_p_token_ids on when rollout_top_p != 1
        "policy_top_p_replay": "rollout_top_p_token_ids" in text,
        "entropy_grad_flag": next((f for f in ("with_entropy_grad", "need_entropy_grad") if f in text + ppo_text),
                                  None),
    }


def import_slime(src: Path, undo: list | None = None) -> tuple[types.ModuleType, list[str]]:
    """Import slime's loss module from ``src``; stub missing modules it does not need here.

    Everything this sets process-wide is put back by the callables appended to ``undo`` (run
    in reverse order): the environment, torch's dynamo switch, sys.path, and the modules added.
    """
    undo = [] if undo is None else undo
    before = set(sys.modules)
    undo.append(lambda: [sys.modules.pop(m) for m in set(sys.modules) - before
                         if m == "slime" or m.startswith("slime.") or m in STUBBABLE])
    if "TORCHDYNAMO_DISABLE" not in os.environ:
        os.environ["TORCHDYNAMO_DISABLE"] = "1"
        undo.append(lambda: os.environ.pop("TORCHDYNAMO_DISABLE", None))
    import torch._dynamo

    was_disabled, wrote_bytecode = torch._dynamo.config.disable, sys.dont_write_bytecode
    undo.append(lambda: setattr(torch._dynamo.config, "disable", was_disabled))
    undo.append(lambda: setattr(sys, "dont_write_bytecode", wrote_bytecode))
    torch._dynamo.config.disable = True
    sys.dont_write_bytecode = True  # never write into the user's checkout
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))
        undo.append(lambda: sys.path.remove(str(src)) if str(src) in sys.path else None)
    stubs: list[str] = []
    for _ in range(len(STUBBABLE) + 1):
        try:
            return importlib.import_module(LOSS_MODULE), stubs
        except ModuleNotFoundError as exc:
            missing = (exc.name or "").split(".")[0]
            if missing not in STUBBABLE or missing in stubs:
                raise BadInput(f"slime at {src} cannot be imported: {exc}") from None
            for name in [m for m in sys.modules if m == "slime" or m.startswith("slime.")]:
                del sys.modules[name]
            sys.modules[missing] = Stub(missing)
            stubs.append(missing)
        except Exception as exc:  # a broken commit: reported as such (bisect skips it)
            raise BadInput(f"slime at {src} cannot be imported: {type(exc).__name__}: {exc}") from None
    raise BadInput(f"slime at {src} cannot be imported")


class _Args(Namespace):
    """slime's ``args``: the fields set from the scenario; a read of any other is recorded."""

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("_"):
            self.__dict__.setdefault("_missing", set()).add(name)
        raise AttributeError(name)


class SlimeTarget:
    """THUDM/slime's get_log_probs_and_entropy from a source checkout (--slime-src / SHARDCHECK_SLIME_SRC)"""

    name = "slime"

    def __init__(self, src: str | None = None) -> None:
        self.src = slime_source(src)
        self.era = detect_era(self.src)
        self.commit = os.environ.get("SHARDCHECK_SLIME_COMMIT") or source_commit(self.src)
        layouts = {"thd", "zigzag"} | ({"allgather"} if self.era["allgather_cp"] else set()) | (
            {"bshd"} if self.era["qkv_format"] else set())
        self.capabilities = Capabilities(
            layouts=frozenset(layouts), entropy=True, dtypes=frozenset({"float32"}),
            replay_keep=bool(self.era.get("top_p_replay")) and self.passes_keep_sets(),
            reasons=(("layout", f"slime at {(self.commit or '?')[:10]} has no such layout "
                                f"(supports {', '.join(sorted(layouts))})"),
                     ("dtype", "slime asserts float32 logits"),
                     ("replay_keep", f"slime at {(self.commit or '?')[:10]} takes no top-p replay"
                      if not self.era.get("top_p_replay") else
                      f"slime at {(self.commit or '?')[:10]}: this entry point passes no top-p replay on")),
        )
        self._fn: Any = None
        self._undo: list[Any] = []
        self.stubs: list[str] = []
        self.missing_args: set[str] = set()

    def passes_keep_sets(self) -> bool:
        """Whether this entry point hands get_log_probs_and_entropy the replayed keep sets."""
        return True

    def release(self) -> None:
        """Undo what importing slime set in this process (the rank moves to another target)."""
        while self._undo:
            self._undo.pop()()
        self._fn = None
        self.__dict__.pop("_policy_fns", None)  # slime:policy_loss's functions, imported with it

    def describe(self) -> dict[str, Any]:
        # a checkout without git history is named by its path, not as "unknown"
        version = self.commit[:12] if self.commit else f"checkout {self.src} (no git commit)"
        return {"name": self.name, "version": version, "commit": self.commit,
                "src": str(self.src), "era": self.era, "stubbed_modules": self.stubs,
                "args_read_but_not_set": sorted(self.missing_args)}

    def _function(self) -> Any:
        if self._fn is None:
            module, self.stubs = import_slime(self.src, self._undo)
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
}


class SlimePolicyLossTarget(SlimeTarget):
    """THUDM/slime's policy_loss_function (PPO loss at ratio 1, KL off), which calls
    get_log_probs_and_entropy itself"""

    name = "slime:policy_loss"
    loss_form = "policy"

    def passes_keep_sets(self) -> bool:
        return bool(self.era.get("policy_top_p_replay"))

    def _policy(self) -> tuple[Any, Any, Recorder]:
        if getattr(self, "_policy_fns", None) is None:
            module, self.stubs = import_slime(self.src, self._undo)
            recorder = module.get_log_probs_and_entropy
            if not isinstance(recorder, Recorder):
                recorder = Recorder(recorder)
                module.get_log_probs_and_entropy = recorder
            cp_utils = importlib.import_module("slime.backends.megatron_utils.cp_utils")
            self._fn = recorder.fn
            self._params = set(inspect.signature(recorder.fn).parameters)
            self._policy_fns = (module.policy_loss_function, cp_utils.get_sum_of_sample_mean, recorder)
        return self._policy_fns

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
        batch: dict[str, Any] = {
            "unconcat_tokens": [t.to(device) for t in inputs.tokens],
            "total_lengths": inputs.total_lengths,
            "response_lengths": inputs.response_lengths,
            "advantages": [a.to(device) for a in inputs.policy.advantages],
            "log_probs": [lp.to(device) for lp in inputs.policy.old_log_probs],
            "loss_masks": masks,
            "rollout_mask_sums": [m.sum() for m in masks],
        }
        if inputs.max_seq_lens is not None:
            batch["max_seq_lens"] = inputs.max_seq_lens
        if inputs.keep_sets is not None:  # as slime's rollout stores them: ids and offsets per sample
            from shardcheck.scenarios.keep import to_ids_offsets

            pairs = [to_ids_offsets(sets) for sets in inputs.keep_sets]
            batch["rollout_top_p_token_ids"] = [ids for ids, _ in pairs]
            batch["rollout_top_p_token_offsets"] = [offsets for _, offsets in pairs]
        reducer = self._reducer(get_sum_of_sample_mean, inputs, masks)
        recorder.results.clear()
        loss, metrics = policy_loss_function(args, batch, inputs.logits, reducer)
        self.missing_args |= args.__dict__.get("_missing", set())
        if len(recorder.results) != 1:
            raise RuntimeError(f"policy_loss_function called get_log_probs_and_entropy {len(recorder.results)} "
                               "times (expected once)")
        result = recorder.results.pop()
        if isinstance(result, tuple):
            result = result[-1]
        return RankOutputs(list(result["log_probs"]), list(result["entropy"]) if "entropy" in result else None,
                           notes={"metrics": sorted(metrics)}, loss=loss)

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


def target(variant: str | None = None, config: TargetConfig | None = None) -> SlimeTarget:
    """THUDM/slime's get_log_probs_and_entropy from a source checkout (--slime-src, --target-src or SHARDCHECK_SLIME_SRC)

    With the variant ``policy_loss``, its policy_loss_function instead."""
    src = config.src if config is not None else None
    if variant is None:
        return SlimeTarget(src)
    if variant == "policy_loss":
        return SlimePolicyLossTarget(src)
    raise BadInput(f"target 'slime' has no variant {variant!r} (known: policy_loss)")


target.options = {}  # type: ignore[attr-defined]
target.variants = {"policy_loss": " ".join((SlimePolicyLossTarget.__doc__ or "").split())}  # type: ignore[attr-defined]
