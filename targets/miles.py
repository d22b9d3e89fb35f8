"""radixark/miles's ``get_log_probs_and_entropy`` from a source checkout: ``--target miles``.

miles is a fork of slime that moved its files (the log-prob path is
``miles/backends/training_utils/``: ``loss_hub/logit_processors.py``, ``loss_hub/math_utils.py``,
``cp_utils.py``) and reads its process groups from an object of its own
(``training_utils/parallel.get_parallel_state()``). That object is built by miles's own
``create_megatron_parallel_state`` (``megatron_utils/parallel.py``, compiled alone: its module
imports Megatron-LM's training package, which megatron-core does not ship) from megatron-core's
``parallel_state``, the groups the harness made; the ``args`` it reads there is a stand-in with
miles's default ``cp_comm_type`` (None: ring, not Ulysses), said in the report.

Each rank's rows are laid out by miles's own ``get_batch`` (:mod:`shardcheck.targets.miles_data`;
``layout=shardcheck``: the harness's rows, handed to the same function); miles's modules are imported with no package ``__init__`` run, and the ones the path does not use
are stubbed only when missing (the report says which)."""

from __future__ import annotations

import inspect
from argparse import Namespace
from pathlib import Path
from typing import Any

from shardcheck.targets.base import Capabilities, RankInputs, RankOutputs, TargetConfig, layout_description, layout_option
from shardcheck.targets.checkout import CheckoutFactory, CheckoutTarget, refuse_loss_variant
from shardcheck.targets.compiled import compile_alone
from shardcheck.targets.miles_data import DATA_MODULE, MilesDataPath, read_get_batch
from shardcheck.targets.slime import _Args, _rollout_on  # slime's args recorder and rollout move: its fork's
from shardcheck.targets.source import Framework

LOGIT_MODULE = "miles.backends.training_utils.loss_hub.logit_processors"
LOGIT_FILE = Path("miles/backends/training_utils/loss_hub/logit_processors.py")
TRAINING_PARALLEL = "miles.backends.training_utils.parallel"
GROUPS_MODULE = "miles.utils.ft_utils.process_group_utils"
GROUPS_FILE = Path("miles/utils/ft_utils/process_group_utils.py")
MEGATRON_PARALLEL_FILE = Path("miles/backends/megatron_utils/parallel.py")
STUBBABLE = ("backports", "ray", "sglang", "wandb", "httpx", "transformers")

FRAMEWORK = Framework("miles", "miles", str(LOGIT_FILE), ("miles",), STUBBABLE, package_inits="skip", eager=True,
                      clone="a clone of radixark/miles (a fork of THUDM/slime)")
ENV = FRAMEWORK.env
source = FRAMEWORK.source


class _MpuWithoutGloo:
    """megatron-core's parallel_state, but for its data-parallel gloo group: None."""

    def __init__(self, mpu: Any) -> None:
        self._mpu = mpu

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mpu, name)

    @staticmethod
    def get_data_parallel_group_gloo(with_context_parallel: bool = False) -> None:
        return None


class MilesTarget(CheckoutTarget):
    """radixark/miles's get_log_probs_and_entropy from a source checkout (--miles-src / SHARDCHECK_MILES_SRC)"""

    framework = FRAMEWORK
    name = "miles"
    framework_files = ("miles/backends/training_utils/data.py", str(LOGIT_FILE), "miles/backends/training_utils/loss_hub/math_utils.py",
                       "miles/backends/training_utils/cp_utils.py", "miles/backends/training_utils/parallel.py",
                       str(MEGATRON_PARALLEL_FILE))

    def __init__(self, src: str | None = None, layout: str = "framework") -> None:
        super().__init__(src)
        # get_responses's assert: float32 alone until 2026-07 (#1469), bfloat16 too since
        asserts = [line for line in (self.src / LOGIT_FILE).read_text().splitlines()
                   if line.strip().startswith("assert logits.dtype")]
        dtypes = {"float32", "bfloat16"} if any("bfloat16" in line for line in asserts) else {"float32"}
        self.capabilities = Capabilities(
            layouts=frozenset({"thd", "zigzag", "allgather", "bshd"}), entropy=True,
            dtypes=frozenset(dtypes), reasons=(("dtype", f"miles's get_responses asserts {' or '.join(sorted(dtypes))} logits"),))
        self._fn: Any = None
        self._state_builder: Any = None
        self.missing_args: set[str] = set()
        # miles's get_batch lays the rows out (the default), or shardcheck does (layout=shardcheck)
        found = read_get_batch(self.src) if layout == "framework" else None
        self.data_path = MilesDataPath(self, found) if found is not None else None
        self.layout_option = layout

    def forget(self) -> None:
        self._fn = None
        self._state_builder = None
        if self.data_path is not None:
            self.data_path = MilesDataPath(self, self.data_path.found)

    def description(self) -> dict[str, Any]:
        return {"args_read_but_not_set": sorted(self.missing_args),
                "data_path": layout_description(self.data_path, self.layout_option, "no get_batch"),
                "cpu_world": self.data_path.shims if self.data_path is not None else [],
                "parallel_state": f"{MEGATRON_PARALLEL_FILE}:create_megatron_parallel_state, compiled alone, on "
                                  "megatron-core's groups (their data-parallel gloo copy None: the world makes "
                                  "none); its get_args() a stand-in with cp_comm_type None"}

    def repro_call(self) -> str | None:
        """How a repro script calls miles (REPRO_CALL): the same function on the same rows."""
        return REPRO_CALL

    def _function(self) -> Any:
        if self._fn is None:
            module = self.import_module(LOGIT_MODULE)
            self._fn = module.get_log_probs_and_entropy
            self._params = set(inspect.signature(self._fn).parameters)
        return self._fn

    def set_parallel_state(self) -> Any:
        """miles's ParallelState, as its Megatron backend builds it, from megatron-core's groups (the
        builder compiled once; the state built anew each call, as the groups follow the scenario)."""
        if self._state_builder is None:
            from megatron.core import parallel_state as mpu

            # every module first: a missing module stubbed on the way re-imports all of miles's,
            # and the state must be set in the module get_batch and the log-prob path read it from
            for name in (LOGIT_MODULE, DATA_MODULE):
                self.import_module(name)
            training = self.import_module(TRAINING_PARALLEL)
            # GroupInfo moved to ft_utils (2026-06); before, training_utils/parallel.py held it
            group_info = (self.import_module(GROUPS_MODULE).GroupInfo if (self.src / GROUPS_FILE).is_file()
                          else training.GroupInfo)
            # the harness's megatron-core groups have no gloo copies (on a gloo world they would be
            # the same groups again): the data-parallel gloo group miles records is None, as GroupInfo allows
            given = {"mpu": _MpuWithoutGloo(mpu), "GroupInfo": group_info, "ParallelState": training.ParallelState,
                     "get_args": lambda: Namespace(cp_comm_type=None, pipeline_model_parallel_size=1)}
            build = compile_alone(self.src / MEGATRON_PARALLEL_FILE,
                                  ["create_megatron_parallel_state", "_compute_vpp_fields"], given)
            create = build["create_megatron_parallel_state"]
            # its independent data-parallel group (a later parameter): none, one rank
            given_args = [group_info(rank=0, size=1, group=None)] if inspect.signature(create).parameters else []
            self._state_builder = lambda: training.set_parallel_state(create(*given_args))
        self._state_builder()
        return self.import_module(TRAINING_PARALLEL).get_parallel_state()

    def compute(self, inputs: RankInputs) -> RankOutputs:
        fn = self._function()
        self.set_parallel_state()
        args = _Args(rollout_temperature=inputs.temperature, log_probs_chunk_size=inputs.chunk_size,
                     allgather_cp=inputs.allgather_cp, qkv_format=inputs.qkv_format, true_on_policy_mode=False,
                     entropy_coef=inputs.entropy_coef, context_parallel_size=inputs.cp_size,
                     tensor_model_parallel_size=inputs.tp_size,
                     vocab_size=None)  # miles reads it with getattr(args, "vocab_size", None): its default
        kwargs: dict[str, Any] = {"args": args, "unconcat_tokens": [t.to(inputs.logits.device) for t in inputs.tokens],
                                  "total_lengths": inputs.total_lengths, "response_lengths": inputs.response_lengths,
                                  "with_entropy": inputs.with_entropy}
        max_seq_lens = inputs.max_seq_lens
        if inputs.rollout is not None:  # what miles's forward step hands on from get_batch's batch
            batch = self.data_path.batch(_rollout_on(inputs.rollout, inputs.logits.device))
            kwargs.update({k: batch[k] for k in ("unconcat_tokens", "total_lengths", "response_lengths")})
            max_seq_lens = batch.get("max_seq_lens", max_seq_lens)
        if "max_seq_lens" in self._params:
            kwargs["max_seq_lens"] = max_seq_lens
        result = fn(inputs.logits, **kwargs)  # a dict in every miles commit (slime's (empty, dict) era predates it)
        self.missing_args |= args.__dict__.get("_missing", set())
        return RankOutputs(list(result["log_probs"]), list(result["entropy"]) if "entropy" in result else None)


# How a `shardcheck repro` script calls miles (harness/controller/commands/repro.py): as MilesTarget
# does, from the checkout, megatron-core's groups built and miles's ParallelState made from them.
REPRO_CALL = '''
def call_code_under_test(logits, rank):
    """miles's get_log_probs_and_entropy from rank.src, as shardcheck's miles target calls it."""
    import ast, importlib, inspect  # noqa: E401
    from megatron.core import parallel_state as mpu
    sys.path.insert(0, rank.src)  # each rank's process calls this once
    mpu.initialize_model_parallel(rank.tp_size, context_parallel_size=rank.cp_size)
    from miles.backends.training_utils import parallel
    from miles.backends.training_utils.loss_hub import logit_processors
    GroupInfo = getattr(parallel, "GroupInfo", None) or importlib.import_module("miles.utils.ft_utils.process_group_utils").GroupInfo
    # miles's create_megatron_parallel_state alone (its module imports Megatron-LM's training), no gloo groups
    path = os.path.join(rank.src, "miles", "backends", "megatron_utils", "parallel.py")
    no_gloo = {"__getattr__": lambda self, name: getattr(mpu, name), "get_data_parallel_group_gloo": lambda self, **kw: None}
    ns = {"mpu": type("Mpu", (), no_gloo)(), "GroupInfo": GroupInfo, "ParallelState": parallel.ParallelState,
          "get_args": lambda: SimpleNamespace(cp_comm_type=None, pipeline_model_parallel_size=1)}
    exec(compile(ast.Module([n for n in ast.parse(open(path).read()).body if isinstance(n, ast.FunctionDef) and n.name in
                             ("create_megatron_parallel_state", "_compute_vpp_fields")], []), path, "exec"), ns)
    create = ns["create_megatron_parallel_state"]
    parallel.set_parallel_state(create(*[GroupInfo(rank=0, size=1, group=None)][:len(inspect.signature(create).parameters)]))
    args = SimpleNamespace(rollout_temperature=rank.temperature, log_probs_chunk_size=rank.chunk_size, true_on_policy_mode=False,
                           allgather_cp=rank.layout == "allgather", qkv_format="bshd" if rank.layout == "bshd" else "thd", vocab_size=None)
    kwargs = {"args": args, "unconcat_tokens": rank.tokens, "total_lengths": rank.total_lengths,
              "response_lengths": rank.response_lengths, "with_entropy": rank.with_entropy}
    # where miles's get_batch laid the run's rows out, the script's rows are its layout (rank.rows); get_batch
    # itself is not run here (its module imports ray): these are the tokens it hands the function unchanged
    if "max_seq_lens" in inspect.signature(logit_processors.get_log_probs_and_entropy).parameters:
        kwargs["max_seq_lens"] = rank.max_seq_lens
    result = logit_processors.get_log_probs_and_entropy(logits, **kwargs)
    return list(result["log_probs"]), list(result["entropy"]) if "entropy" in result else None
'''


def _build(variant: str | None, config: TargetConfig) -> MilesTarget:
    refuse_loss_variant("miles", variant, config, ("calculate_per_token_loss",))
    return MilesTarget(config.src, layout_option(config, framework="framework (miles's get_batch)"))


target = CheckoutFactory(
    FRAMEWORK, _build,
    doc=("radixark/miles's get_log_probs_and_entropy (loss_hub/logit_processors.py) on its own get_batch's rows, its "
         "ParallelState built by its own create_megatron_parallel_state (--miles-src, --target-src or "
         "SHARDCHECK_MILES_SRC)"),
    options={"layout": "framework (default): miles's get_batch lays out each rank's rows; shardcheck: the harness's "
                       "own layout, handed to miles's functions as before",
             "calculate_per_token_loss": "miles:loss only: miles's --calculate-per-token-loss (default false: each "
                                         "sample's token mean over the step's rollouts; true: the global batch's token mean)"},
    # built by the registered factory (shardcheck.targets.frameworks.miles_target): its module builds on this one
    variants={"loss": "radixark/miles's loss_function in a training step (megatron-core's schedule and DDP around it, "
                      "get_batch's micro-batches): policy_loss_function through miles's dispatch, its all-gather CP "
                      "term and its rescale for megatron (apply_megatron_loss_scaling, num_rollouts, as "
                      "train_one_step calls it)"})
