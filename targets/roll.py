"""alibaba/ROLL's Megatron strategy's log-prob and entropy path, from a source checkout: ``--target roll``.

What runs is ROLL's own code, from the checkout, compiled alone from its files (their paths and
line numbers kept: tracebacks, coverage and in-place write sites name ROLL's lines):

- ``MegatronInferStrategy``'s methods ``op_compute_log_probs``, ``op_compute_entropy``,
  ``_get_feature_on_this_cp_rank`` and ``_unpack_sequences``
  (``roll/distributed/strategy/megatron_strategy.py``; ``MegatronTrainStrategy`` inherits them);
- what they call: ``vocab_parallel_logprobs`` (``mcore_adapter/src/mcore_adapter/parallel_functions/
  vocab_parallel.py``, with ``divide`` from ``mcore_adapter/utils.py``), ``context_parallel_gather``
  (``.../parallel_functions/context_parallel.py``), ``vocab_parallel_entropy``
  (``roll/third_party/megatron/tensor_parallel.py``) and the model's ``get_batch_on_this_cp_rank``
  (``PretrainedModel``'s, ``mcore_adapter/src/mcore_adapter/models/model_factory.py``: the zigzag
  split of the labels).

The modules around them import ray, transformers, mcore_adapter's trainer and Megatron's training
stack, and ``roll.utils.logging`` writes log files into the working directory on import. Every name
the definitions read is bound as their files bind it: torch, torch.distributed, megatron-core's
``parallel_state`` (the groups the harness made), the functions above, a logger. The fused
cutlass kernels (``fused_logprobs``, ``fused_entropy``: TP 1 with ``cross_entropy_loss_fusion``,
off by default) are not loaded: ``FUSED_KERNEL_AVAILABLE`` is False, as on any machine without them.

Stand-ins, each said in the report: the strategy object is not built (its ``__init__`` builds the
model and the optimizer): its methods run on an object holding what they read (``models_unwrapped``,
``megatron_train_args.cross_entropy_loss_fusion`` False and ``worker_config.logits_in_fp32`` False,
ROLL's defaults; ``--target-opt logits_in_fp32=true`` sets the latter). The model is an object
holding ``config.context_parallel_size`` with mcore_adapter's own ``get_batch_on_this_cp_rank``;
that method makes its zigzag index with ``torch.tensor(..., pin_memory=True)``, which a CPU-only
torch refuses: where no accelerator is present it is handed a torch whose ``tensor`` drops
``pin_memory`` (:data:`PIN_MEMORY_WHY`).

The call is the one ROLL's workers make, on the harness's rows: per sample, as the sequence-packing
``loss_wrapper`` of ``inner_forward_step`` hands each sample to the loss (thd and zigzag: the packed
output unpacked by ROLL's ``_unpack_sequences`` on ``cu_seqlens_padded``; the sample's ids and
``response_mask`` at ``full_seq_len``, as ``adjust_sequence_length`` cuts them), or the whole padded
batch (bshd, no packing); then ``op_compute_log_probs`` and, with entropy, ``op_compute_entropy`` on
the same logits, in that order (``base_worker.forward_func_log_probs``, ``actor_worker.loss_func``).
ROLL pads each packed sample to a multiple of lcm(16, 2*cp*tp) (``_get_pad_factor``); the harness's
rows pad it to 2*cp*ceil(L/2cp) (zigzag) or not at all (thd): the functions checked take any length
the zigzag split divides.

With CP, ROLL's output is every token on every CP rank (``context_parallel_gather``), whose
backward hands each rank the gradient of its own chunks, assuming the same loss on every CP rank
(megatron-core then scales a two-value loss by the CP size). The adapter returns each rank its
zigzag share of that output (the rows of its own chunks): the gradient each rank gets is then the
one the whole-sequence loss gives it, which is what ROLL's own loss gives it.

What ROLL does not do is skipped, with its reason: a temperature (its Megatron log-probs and
entropy take none, and its workers divide the logits by none), all-gather CP (its CP is Megatron's
zigzag), replayed keep sets and a top-k / top-p filter, a training step's loss.

``repro_call`` (:data:`REPRO_CALL`): a ``shardcheck repro`` script compiles the same definitions
alone from the checkout (torch and megatron-core's ``parallel_state`` its only imports besides the
standard library) and calls them as :meth:`RollTarget.compute` does. The variant ``fsdp`` is ROLL's
FSDP2 strategy with Ulysses sequence parallelism (:mod:`shardcheck.targets.roll_fsdp`; the factory offering
both is :data:`shardcheck.targets.frameworks.roll_target`).
"""

from __future__ import annotations

import __future__
import ast
import builtins
import logging
import symtable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from shardcheck.errors import BadInput
from shardcheck.scenarios.scenario import Scenario
from shardcheck.targets.base import Capabilities, RankInputs, RankOutputs, TargetConfig
from shardcheck.targets.checkout import CheckoutFactory, CheckoutTarget
from shardcheck.targets.compiled import NotCompiled, _not_loaded, compile_alone, names_read
from shardcheck.targets.source import Framework

STRATEGY_FILE = Path("roll/distributed/strategy/megatron_strategy.py")
ENTROPY_FILE = Path("roll/third_party/megatron/tensor_parallel.py")
MCORE_ADAPTER = Path("mcore_adapter/src/mcore_adapter")
LOGPROBS_FILE = MCORE_ADAPTER / "parallel_functions/vocab_parallel.py"
CP_GATHER_FILE = MCORE_ADAPTER / "parallel_functions/context_parallel.py"
UTILS_FILE = MCORE_ADAPTER / "utils.py"
MODEL_FILE = MCORE_ADAPTER / "models/model_factory.py"
STRATEGY_METHODS = ("_get_feature_on_this_cp_rank", "op_compute_log_probs", "op_compute_entropy")
PACKING_METHOD = "_unpack_sequences"  # sequence packing's unpacking (3657919e, Nov 2025; absent before)

FRAMEWORK = Framework("roll", "ROLL", str(STRATEGY_FILE), ("roll", "mcore_adapter"), package_inits="skip",
                      eager=True, clone="a clone of alibaba/ROLL")
ENV = FRAMEWORK.env
source = FRAMEWORK.source

PIN_MEMORY_WHY = ("mcore_adapter's get_batch_on_this_cp_rank builds its zigzag index with torch.tensor(..., "
                  "pin_memory=True), which a torch without an accelerator refuses: on such a machine it is handed "
                  "a torch whose tensor() drops pin_memory (the index's values are unchanged)")
TEMPERATURE_WHY = ("ROLL's Megatron strategy divides the logits by no temperature (op_compute_log_probs and "
                   "op_compute_entropy take none, and its workers pass the model's logits as they are): its "
                   "log-probs and entropy are the temperature-1 ones")
ENTROPY_COEF_WHY = ("ROLL adds an entropy term to its loss only for entropy_loss_coef > 0 (actor_worker.loss_func: "
                    "`if self.pipeline_config.entropy_loss_coef > 0`): a negative coefficient adds none")
NO_PACKING_WHY = ("ROLL's Megatron strategy has no sequence packing at this commit (no _unpack_sequences): it "
                  "hands the loss the padded batch only (bshd)")
ALLGATHER_WHY = ("ROLL's Megatron strategy has no all-gather CP: its CP is Megatron's zigzag split "
                 "(get_batch_on_this_cp_rank) with context_parallel_gather")


class _TorchWithoutPinnedMemory:
    """torch, but ``tensor(..., pin_memory=True)`` makes an unpinned tensor (:data:`PIN_MEMORY_WHY`)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def tensor(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        return torch.tensor(*args, **kwargs)


def methods_alone(path: Path, class_name: str, names: tuple[str, ...], given: dict[str, Any],
                  off_path: tuple[str, ...] = ()) -> type:
    """The methods ``names`` of class ``class_name`` in ``path``, compiled alone into a class with
    no base, in a namespace holding ``given`` (as :func:`compile_alone` does for top-level
    definitions: the file's path and line numbers kept; NotCompiled naming a method the class lacks
    or a name they read that ``given`` lacks; names in ``off_path``, read only on branches not
    taken, bound to a function that raises, naming itself)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name]
    if not found:
        raise NotCompiled(f"{path}: no class {class_name}")
    methods = {n.name: n for n in found[0].body if isinstance(n, ast.FunctionDef)}
    absent = [n for n in names if n not in methods]
    if absent:
        raise NotCompiled(f"{path}: {class_name} has no {', '.join(absent)}")
    shell = ast.ClassDef(name=class_name, bases=[], keywords=[], body=[methods[n] for n in names],
                         decorator_list=[], type_params=[])
    ast.copy_location(shell, found[0])
    module = ast.fix_missing_locations(ast.Module(body=[shell], type_ignores=[]))
    table = symtable.symtable("from __future__ import annotations\n" + ast.unparse(module), str(path), "exec")
    missing = sorted(set().union(*(names_read(c) for c in table.get_children())) - set(given) - set(off_path)
                     - set(dir(builtins)))
    if missing:
        raise NotCompiled(f"{path}: {class_name}.{', '.join(names)} read {', '.join(missing)}, which the adapter "
                          "does not give")
    namespace: dict[str, Any] = {"__name__": f"shardcheck_compiled_{path.stem}", "__file__": str(path),
                                 **{n: _not_loaded(n, path) for n in off_path}, **given}
    exec(compile(module, str(path), "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True),  # noqa: S102
         namespace)
    return namespace[class_name]


def _roll_rule(scenario: Scenario) -> str | None:
    """What ROLL's Megatron path does not do, asked once the capabilities hold."""
    if scenario.temperature != 1.0:
        return TEMPERATURE_WHY
    if scenario.with_entropy and scenario.entropy_coef < 0:
        return ENTROPY_COEF_WHY
    return None


def _packs(src: Path) -> bool:
    """Whether the checkout's Megatron strategy unpacks a packed output (sequence packing)."""
    tree = FRAMEWORK.parse(src, STRATEGY_FILE)
    return tree is not None and any(isinstance(n, ast.FunctionDef) and n.name == PACKING_METHOD for n in ast.walk(tree))


class RollTarget(CheckoutTarget):
    """alibaba/ROLL's Megatron strategy's op_compute_log_probs / op_compute_entropy from a source checkout
    (--roll-src / SHARDCHECK_ROLL_SRC)"""

    framework = FRAMEWORK
    name = "roll"
    framework_files = (str(STRATEGY_FILE), str(ENTROPY_FILE), str(LOGPROBS_FILE), str(CP_GATHER_FILE),
                       str(MODEL_FILE), str(UTILS_FILE))

    def __init__(self, src: str | None = None, logits_in_fp32: bool = False) -> None:
        super().__init__(src)
        self.logits_in_fp32 = logits_in_fp32
        self.packing = _packs(self.src)
        self.capabilities = Capabilities(
            layouts=frozenset({"thd", "bshd", "zigzag"} if self.packing else {"bshd"}), entropy=True,
            layout_reasons=(("allgather", ALLGATHER_WHY),) + (() if self.packing else (("thd", NO_PACKING_WHY),
                                                                                       ("zigzag", NO_PACKING_WHY))),
            reasons=(("sampling", "ROLL's Megatron strategy applies no top-k / top-p filter to the training logits"),
                     ("replay_keep", "ROLL's Megatron strategy replays no top-p / top-k keep sets")),
            rule=_roll_rule)
        self._strategy_class: Any = None
        self._model_method: Any = None
        self._pinned = torch.cuda.is_available()
        # ROLL's current_platform, as the model's CP splitter reads it: the device the logits are on
        self._platform = SimpleNamespace(device_type="cpu")

    def forget(self) -> None:
        self._strategy_class = None
        self._model_method = None

    def description(self) -> dict[str, Any]:
        out = {"code": f"{STRATEGY_FILE}:MegatronInferStrategy.{', .'.join(STRATEGY_METHODS)}, with "
                       f"{LOGPROBS_FILE.name}:vocab_parallel_logprobs, {CP_GATHER_FILE.name}:context_parallel_gather, "
                       f"{ENTROPY_FILE}:vocab_parallel_entropy, {MODEL_FILE.name}:get_batch_on_this_cp_rank, "
                       "compiled alone",
               "call": "per sample as the sequence-packing loss_wrapper hands it (thd, zigzag) or the padded batch "
                       "(bshd); op_compute_log_probs then op_compute_entropy on the same logits, as ROLL's workers",
               "data_path": "the harness's rows (ROLL pads a packed sample to a multiple of lcm(16, 2*cp*tp); the "
                            "harness's zigzag to 2*cp*ceil(L/2cp), thd not at all)",
               "strategy": "an object holding what the methods read: cross_entropy_loss_fusion False, "
                           f"logits_in_fp32 {self.logits_in_fp32} (ROLL's default False)",
               "cp_outputs": "ROLL returns every token on every CP rank (context_parallel_gather); each rank's "
                             "zigzag share of it is returned"}
        if not self._pinned:
            out["stand_in"] = PIN_MEMORY_WHY
        return out

    def repro_call(self) -> str | None:
        """How a repro script calls ROLL (REPRO_CALL): the same definitions, compiled alone, on the same rows."""
        return REPRO_CALL.replace("LOGITS_IN_FP32", str(self.logits_in_fp32))

    def _load(self) -> Any:
        """ROLL's strategy methods, compiled once, with what they call."""
        if self._strategy_class is not None:
            return self._strategy_class
        import torch._dynamo
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        # vocab_parallel_entropy torch.compile's a helper on every forward: it runs eagerly (compiling
        # costs seconds per process on a CPU and is not what is checked)
        was_disabled = torch._dynamo.config.disable
        torch._dynamo.config.disable = True
        self.checkout.undo_later(lambda: setattr(torch._dynamo.config, "disable", was_disabled))
        src = self.src
        base = {"torch": torch, "dist": dist, "mpu": mpu}
        # the fused cutlass kernels are off by default (cross_entropy_loss_fusion False) and not loaded
        fused = {"FUSED_KERNEL_AVAILABLE": False}
        divide = compile_alone(src / UTILS_FILE, ["divide", "ensure_divisibility"], {})["divide"]
        logprobs = compile_alone(
            src / LOGPROBS_FILE, ["VocabUtility", "_VocabParallelHelper", "_VocabParallelLogProbs",
                                  "vocab_parallel_logprobs"],
            {**base, **fused, "divide": divide, "Sequence": Any, "Tuple": Any,
             "logger": logging.getLogger("mcore_adapter.parallel_functions.vocab_parallel")},
            off_path=("logprobs_fwd", "logprobs_bwd"))["vocab_parallel_logprobs"]
        gather = compile_alone(src / CP_GATHER_FILE, ["_ContextParallelGather", "context_parallel_gather"],
                               base)["context_parallel_gather"]
        entropy = compile_alone(src / ENTROPY_FILE, ["_VocabParallelEntropy", "vocab_parallel_entropy"],
                                {**base, **fused, "logger": logging.getLogger("roll.third_party.megatron")},
                                off_path=("entropy_fwd", "entropy_bwd"))["vocab_parallel_entropy"]
        strategy_class = methods_alone(
            src / STRATEGY_FILE, "MegatronInferStrategy", STRATEGY_METHODS + ((PACKING_METHOD,) if self.packing else ()),
            {**base, "vocab_parallel_logprobs": logprobs, "context_parallel_gather": gather,
             "vocab_parallel_entropy": entropy})
        model_torch = torch if self._pinned else _TorchWithoutPinnedMemory()
        # get_thd_data_on_this_cp_rank: read only for a batch holding packed_seq_params, which the
        # strategy's _get_feature_on_this_cp_rank never passes
        self._model_method = methods_alone(src / MODEL_FILE, "PretrainedModel", ("get_batch_on_this_cp_rank",),
                                           {"torch": model_torch, "mpu": mpu, "Dict": Any, "List": Any,
                                            "current_platform": self._platform},
                                           off_path=("get_thd_data_on_this_cp_rank",))
        self._strategy_class = strategy_class
        return strategy_class

    def _strategy(self, inputs: RankInputs) -> Any:
        """A strategy object holding what the methods read; its model the CP splitter."""
        cls = self._load()
        model_cls = self._model_method
        model = model_cls()
        model.config = SimpleNamespace(context_parallel_size=inputs.cp_size)
        strategy = cls()
        strategy.models_unwrapped = [model]
        strategy.megatron_train_args = SimpleNamespace(cross_entropy_loss_fusion=False)
        strategy.use_remove_padding = False  # read by the commits of e1fd60f3 to 3077befc: ROLL's default
        strategy.worker_config = SimpleNamespace(logits_in_fp32=self.logits_in_fp32)
        return strategy

    def compute(self, inputs: RankInputs) -> RankOutputs:
        self._platform.device_type = inputs.logits.device.type
        strategy = self._strategy(inputs)
        samples = inputs.rank_layout.scenario.samples
        if inputs.layout == "bshd":  # no packing: the padded batch, as inner_forward_step hands it to the loss
            calls = [(inputs.logits, list(range(len(samples))))]
        else:  # sequence packing: the packed output unpacked by ROLL's own _unpack_sequences, sample by sample
            rows = [sum(p.rows for p in inputs.rank_layout.pieces if p.stream == i) for i in range(len(samples))]
            ends = [sum(rows[:i + 1]) * inputs.cp_size for i in range(len(rows))]
            cu_seqlens_padded = torch.tensor([0] + ends, dtype=torch.int32, device=inputs.logits.device)
            calls = [(one, [i]) for i, one in enumerate(strategy._unpack_sequences(inputs.logits, cu_seqlens_padded))]
        log_probs: list[torch.Tensor] = []
        entropy: list[torch.Tensor] = []
        for logits, batch in calls:
            # full_seq_len as loss_wrapper computes it: the local rows times the CP size
            ids, response_mask = _batch_tensors(inputs, batch, logits.size(1) * inputs.cp_size)
            out = strategy.op_compute_log_probs(logits=logits, input_ids=ids, attention_mask=response_mask)
            log_probs += _share(inputs, batch, out)
            if inputs.with_entropy:  # after the log-probs, on the same logits, as ROLL's workers call it
                # entropy_loss_coef > 0: actor_worker.loss_func's entropy term, with its gradient; 0: the
                # loss has none, the entropy is forward_func_log_probs's metric, under no_grad
                with torch.enable_grad() if inputs.entropy_coef > 0 else torch.no_grad():
                    ent = strategy.op_compute_entropy(logits=logits, attention_mask=response_mask)
                entropy += _share(inputs, batch, ent)
        return RankOutputs(log_probs, entropy if inputs.with_entropy else None)


def _batch_tensors(inputs: RankInputs, batch: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ROLL's ``input_ids`` and ``response_mask`` of samples ``batch``, right-padded to ``length``
    (what ``adjust_sequence_length`` leaves of them for a packed sample): the mask marks the
    response tokens of the ids (op_compute_log_probs's docstring: [[0, 0, 1, 1, 1, 0, 0]])."""
    device = inputs.logits.device
    ids = torch.zeros(len(batch), length, dtype=torch.int64, device=device)
    response_mask = torch.zeros(len(batch), length, dtype=torch.int64, device=device)
    for b, i in enumerate(batch):
        s = inputs.rank_layout.scenario.samples[i]
        ids[b, :s.total] = inputs.tokens[i].to(device)
        response_mask[b, s.prompt:s.total] = 1
    return ids, response_mask


def _share(inputs: RankInputs, batch: list[int], out: torch.Tensor) -> list[torch.Tensor]:
    """Per sample of ``batch``, the rank's share of its response from ROLL's ``[B, length - 1]``
    output (every token, gathered over CP): output j scores token j + 1, so response token k is at
    prompt - 1 + k."""
    taken = []
    for b, i in enumerate(batch):
        first = inputs.rank_layout.scenario.samples[i].prompt - 1
        idx = torch.tensor([first + k for k in inputs.rank_layout.share[i]], dtype=torch.int64, device=out.device)
        taken.append(out[b].index_select(0, idx))
    return taken


# How a `shardcheck repro` script calls ROLL (harness/controller/commands/repro.py): torch, megatron-core's
# parallel_state and the checkout alone, ROLL's definitions compiled alone from their files as RollTarget
# does. They are loaded in the script's own process before any rank starts: a module or file missing is
# said (exit 2) and is no finding. "LOGITS_IN_FP32" is the target's option, written in.
REPRO_CALL = '''
MA, S = "mcore_adapter/src/mcore_adapter/", "MegatronInferStrategy."  # what of each file runs; "Class.method": the class holds only those, base-less
ROLL_FILES = {MA + "utils.py": ("divide", "ensure_divisibility"), MA + "parallel_functions/context_parallel.py": ("_ContextParallelGather", "context_parallel_gather"),
              MA + "parallel_functions/vocab_parallel.py": ("VocabUtility", "_VocabParallelHelper", "_VocabParallelLogProbs", "vocab_parallel_logprobs"),
              "roll/third_party/megatron/tensor_parallel.py": ("_VocabParallelEntropy", "vocab_parallel_entropy"), MA + "models/model_factory.py": ("PretrainedModel.get_batch_on_this_cp_rank",),
              "roll/distributed/strategy/megatron_strategy.py": tuple(S + m for m in ("_get_feature_on_this_cp_rank", "op_compute_log_probs", "op_compute_entropy", "_unpack_sequences"))}
try:  # ROLL's definitions compiled alone (lines kept; their modules import ray, transformers, Megatron's training), before any rank starts: what is missing is no finding
    import __future__, ast, logging, megatron.core.parallel_state as mpu  # noqa: E401
    src = (peek := argparse.ArgumentParser(add_help=False)).add_argument("--src", default=CASE["code"]["src"]) and peek.parse_known_args()[0].src
    # torch, but tensor() drops pin_memory: get_batch_on_this_cp_rank's torch.tensor(..., pin_memory=True), which a CPU-only torch refuses (same values)
    pinless = type("T", (), {"__getattr__": lambda _, n: getattr(torch, n), "tensor": staticmethod(lambda *a, pin_memory=0, **k: torch.tensor(*a, **k))})()
    ROLL = dict(torch=pinless, dist=dist, mpu=mpu, FUSED_KERNEL_AVAILABLE=False, logger=logging.getLogger("roll"), current_platform=SimpleNamespace(device_type="cpu"))
    for path, names in ((os.path.join(src, rel), names) for rel, names in ROLL_FILES.items()):
        for node in (keep := [n for n in ast.parse(open(path).read(), path).body if getattr(n, "name", None) in {k.split(".")[0] for k in names}]):
            if methods := [k.split(".")[1] for k in names if k.startswith(node.name + ".")]:  # the strategy's __init__ builds a model: not run
                node.bases, node.keywords, node.body = [], [], [m for m in node.body if getattr(m, "name", None) in methods]
        exec(compile(ast.Module(keep, []), path, "exec", __future__.annotations.compiler_flag, dont_inherit=True), ROLL)  # noqa: S102
    torch._dynamo.config.disable = True  # vocab_parallel_entropy's torch.compile'd helper: eager, as the target runs it
except (ImportError, OSError, SyntaxError) as exc: sys.exit(print(f"CANNOT RUN: {type(exc).__name__}: {exc} (needs torch, megatron-core and a ROLL checkout): no finding") or 2)
def call_code_under_test(logits, rank):  # as shardcheck's roll target: bshd the padded batch (inner_forward_step), packed each sample _unpack_sequences yields
    mpu.initialize_model_parallel(rank.tp_size, context_parallel_size=rank.cp_size)
    ROLL["current_platform"].device_type, model, st, dev = logits.device.type, ROLL["PretrainedModel"](), ROLL["MegatronInferStrategy"](), logits.device
    model.config, st.models_unwrapped, st.use_remove_padding = SimpleNamespace(context_parallel_size=rank.cp_size), [model], False
    st.megatron_train_args, st.worker_config, log_probs, entropy = SimpleNamespace(cross_entropy_loss_fusion=False), SimpleNamespace(logits_in_fp32=LOGITS_IN_FP32), [], []
    ends = torch.tensor([0] + [sum(s <= i for s, _ in rank.rows) for i in range(len(rank.tokens))], dtype=torch.int32, device=dev) * rank.cp_size  # cu_seqlens_padded
    for x, batch in [(logits, range(len(rank.tokens)))] if rank.layout == "bshd" else [(x, [i]) for i, x in enumerate(st._unpack_sequences(logits, ends))]:
        L, T, P = x.size(1) * rank.cp_size, [rank.total_lengths[i] for i in batch], [rank.total_lengths[i] - rank.response_lengths[i] for i in batch]
        ids = torch.stack([torch.nn.functional.pad(rank.tokens[i], (0, L - t)) for i, t in zip(batch, T)])  # input_ids at full_seq_len
        mask = torch.stack([((pos := torch.arange(L, device=dev)) >= p) & (pos < t) for p, t in zip(P, T)]).long()  # response_mask
        share = [torch.tensor([p - 1 + k for k in rank.share[i]], dtype=torch.long, device=dev) for i, p in zip(batch, P)]  # output j scores token j + 1
        log_probs += [o.index_select(0, s) for o, s in zip(st.op_compute_log_probs(logits=x, input_ids=ids, attention_mask=mask), share)]
        with torch.set_grad_enabled(rank.entropy_coef > 0):  # > 0: the loss's entropy term; 0: forward_func_log_probs's metric
            entropy += [o.index_select(0, s) for o, s in zip(st.op_compute_entropy(logits=x, attention_mask=mask), share)] if rank.with_entropy else []
    return log_probs, entropy if rank.with_entropy else None
'''


def _build(variant: str | None, config: TargetConfig) -> Any:
    try:
        fp32 = config.flag("logits_in_fp32")
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    return RollTarget(config.src, logits_in_fp32=fp32)


# the Megatron strategy's target; the registered factory, with the fsdp variant whose module builds on
# this one, is shardcheck.targets.frameworks.roll_target (no circle of imports)
target = CheckoutFactory(
    FRAMEWORK, _build,
    doc=("alibaba/ROLL's Megatron strategy (op_compute_log_probs / op_compute_entropy with mcore_adapter's "
         "vocab_parallel_logprobs and context_parallel_gather) on the harness's rows (--roll-src, --target-src or "
         "SHARDCHECK_ROLL_SRC)"),
    options={"logits_in_fp32": "ROLL's worker_config.logits_in_fp32 (default false): the entropy in float32"})
