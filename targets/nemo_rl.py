"""NVIDIA-NeMo/RL's vocab-parallel log-prob and entropy functions, loaded from a source checkout:
``--target nemo_rl`` and its variants.

What is checked, from ``nemo_rl/distributed/model_utils.py``:

- ``from_parallel_logits_to_logprobs_packed_sequences`` (thd, zigzag CP): packed sequences with
  ``cu_seqlens_padded``, the targets rolled and CP-sharded inside NeMo-RL, as its Megatron
  ``LogprobsPostProcessor`` calls it (``target_is_pre_rolled=False``), but with
  ``inference_only=False`` so that its backward is checked too;
- ``from_parallel_logits_to_logprobs`` (bshd; and thd/zigzag one sample at a time in the
  ``per_sequence`` variant), with ``chunk_size`` (``ChunkedDistributedLogprob``) or without
  (``DistributedLogprob``), and CP through ``AllGatherCPTensor``;
- ``ChunkedDistributedEntropy``, which returns ``sum_v p_v log p_v``: the NEGATIVE entropy. The
  target declares that definition (``Definitions(entropy_sign=-1)``): the reference's entropy and
  its gradient follow, the report says which definition was checked, and the adapter returns
  NeMo-RL's values as they are, on the rank's own rows; no CP gather is needed for a per-row
  quantity, so none is made.

Variants, each one of NeMo-RL's calling conventions: the default and ``sampling`` call as its
``LogprobsPostProcessor`` does (the logits as they come, ``chunk_size`` as configured);
``per_sequence`` (``SequencePackingLossWrapper``: each sample's slice through
``from_parallel_logits_to_logprobs``) and ``pre_rolled`` (``prepare_packed_loss_input``, the fused
packed loss: ``target_is_pre_rolled=True``) as its loss path does (float32 logits unless
chunking); ``fused_loss`` is that fused loss as NeMo-RL runs it, its targets rolled by its own
``_pack_input_ids`` (``SequencePackingFusionLossWrapper``). ``sampling`` passes ``sampling_params`` (top-k/top-p from the scenario, where it has
them: ``DistributedLogprobWithSampling`` / ``ChunkedDistributedLogprobWithSampling``).

The packed rows (thd, zigzag) are laid out by NeMo-RL's own ``_pack_sequences_for_megatron``
(:mod:`shardcheck.targets.nemo_rl_data`, ``--target-opt layout=framework``, the default where the
checkout has it): each sequence padded to ``make_sequence_length_divisible_by``, the stream to
``pad_packed_seq_to_multiple_of`` or ``pad_packed_seq_to``, zigzag chunks r and ``2 * cp - 1 - r``
per sequence; every call takes that packing's ``input_ids`` and ``cu_seqlens_padded``. On the
harness's rows (``layout=shardcheck``, and bshd) every sequence is padded to a multiple of
``2 * cp`` as NeMo-RL's CP needs, nothing at cp = 1. A chunk size of -1 is ``chunk_size=None``
(``policy.logprob_chunk_size`` unset, NeMo-RL's default).

Temperature: NeMo-RL's ``forward_with_post_processing_fn`` divides the model's output by the
temperature (``apply_temperature_scaling``: ``logits.div_(T)``, in place) before any of these
functions sees it; top-k/top-p filtering happens after, inside them. The adapter divides out of
place (``logits / T``), the same values; ``--target-opt temperature_in_place=true`` does the
caller's ``div_`` instead (the harness then reports that write as ``input_mutated``: it belongs
to that caller, not to the functions covered). ``nemo_rl:dtensor`` divides by nothing itself: it
runs its DTensor worker's own lines from the model's output to the log-prob call (``train`` or
``get_logprobs``, :class:`~shardcheck.targets.nemo_rl_data.DTensorWorkerLines`, compiled alone
from the commit's worker file), so the commit decides whether and how the logits are scaled
(#714, ba648542d: ``get_logprobs`` did not, ``train`` did); ``temperature_in_place=true`` there
hands the worker the harness's own tensor as the model's output.

CPU: ``AllGatherCPTensor.backward`` builds its index with ``torch.tensor(..., pin_memory=True)
.cuda()``, so every cp > 1 path fails on a CPU world. Where the source has that and this machine
has fewer than two CUDA devices (a CP world needs nccl with one GPU per rank), cp > 1 scenarios
are skipped with that reason; ``--target-opt cp_on_cpu=true`` runs them anyway (each then fails
with NeMo-RL's error). All-gather CP is not NeMo-RL's (its CP is zigzag only): skipped.

Loading: the modules are NeMo-RL's own files, imported under their own names from the checkout.
The package ``__init__.py`` files are not run (``nemo_rl/__init__.py`` configures the root
logger, sets ``RAY_USAGE_STATS_ENABLED`` and edits ``sys.path``); no bytecode is written into the
checkout; a module it imports that is missing here is stubbed only if it is in
:data:`STUBBABLE`, and ``describe()`` says which. ``release()`` undoes all of it (all of which
:mod:`shardcheck.targets.checkout` does for every framework target).

The signatures changed over NeMo-RL's history; :func:`detect_era` reads them from the source
(``group`` -> ``tp_group``, ``cp_group``, ``chunk_size``, ``sampling_params``,
``target_is_pre_rolled``, the packed function, the entropy class).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
from pathlib import Path
from typing import Any

from shardcheck.errors import BadInput
from shardcheck.scenarios.scenario import Scenario
from shardcheck.targets.base import (Capabilities, Definitions, RankInputs, RankOutputs, TargetConfig,
                                     layout_description, layout_option)
from shardcheck.targets.checkout import CheckoutFactory, CheckoutTarget
from shardcheck.targets.cpu_stand_ins import tensor_cuda_stays
from shardcheck.targets.nemo_rl_data import (DATA_FILE, DTENSOR_CALLS, LOSS_UTILS_FILE, WRAPPER_FILE, NemoRLDataPath,
                                             PARALLELIZE_FILE, DTensorWorkerLines, DTensorWorkerMesh,
                                             NemoRLDTensorDataPath, NemoRLLossPath, dtensor_cp_logprobs,
                                             dtensor_sampling_reason, has_fused_loss, has_packing, has_unfused_loss)
from shardcheck.targets.source import Framework, parameters

MODEL_UTILS = Path("nemo_rl/distributed/model_utils.py")
MODULE = "nemo_rl.distributed.model_utils"
SAMPLING_MODULE = "nemo_rl.algorithms.logits_sampling_utils"
SAMPLING_FILE = Path("nemo_rl/algorithms/logits_sampling_utils.py")
# Modules model_utils imports at one commit or another that the functions checked do not use.
STUBBABLE = ("ray", "transformer_engine", "apex", "wandb")

LOGPROBS = "from_parallel_logits_to_logprobs"
PACKED = "from_parallel_logits_to_logprobs_packed_sequences"
ENTROPY = "ChunkedDistributedEntropy"
FUSED = "prepare_packed_loss_input"
NEXT_TOKEN = "get_next_token_logprobs_from_logits"  # its DTensor branch: get_logprobs_from_vocab_parallel_logits
DTENSOR = "get_logprobs_from_vocab_parallel_logits"

OPTIONS = {
    "cp_on_cpu": "true: run cp > 1 scenarios on a CPU world although NeMo-RL's AllGatherCPTensor.backward "
                 "needs CUDA (pin_memory + .cuda()); each then fails with NeMo-RL's error",
    "temperature_in_place": "true: divide the given logits in place (logits.div_(T)) as NeMo-RL's "
                            "apply_temperature_scaling (models/megatron/train.py) does, instead of out of place; "
                            "the harness then reports that write as input_mutated at the adapter's line "
                            "(nemo_rl:dtensor: the worker's own lines get the harness's tensor as the model's "
                            "output, not a copy, and their div_, where the commit has one, writes it)",
    "layout": "framework (NeMo-RL's _pack_sequences_for_megatron lays out thd and zigzag rows, the default where "
              "the checkout has it) or shardcheck (the harness's rows, each sequence padded to 2*cp)",
    "call": "nemo_rl:dtensor only: train (default: its train step's prepare_loss_input -> "
            "get_next_token_logprobs_from_logits, which does not hand chunk_size on) or get_logprobs (its "
            "get_logprobs: get_logprobs_from_vocab_parallel_logits with logprob_chunk_size, ChunkedDistributedLogprob"
            "(WithSampling); the worker runs it under no_grad, here with grad so that its backward is checked)",
    "token_level_loss": "nemo_rl:loss only: NeMo-RL's loss_fn.token_level_loss (default true: the global batch's "
                        "token mean; false: each sample's token mean, averaged over the samples)",
}


FRAMEWORK = Framework("nemo_rl", "NeMo-RL", str(MODEL_UTILS), ("nemo_rl",), STUBBABLE,
                      clone="a clone of NVIDIA-NeMo/RL; never pip install nemo-rl")
ENV = FRAMEWORK.env
source = FRAMEWORK.source


@dataclasses.dataclass(frozen=True)
class NemoRLEra:
    """What a NeMo-RL checkout offers and how its functions are called (:func:`detect_era`)."""

    logprobs_params: tuple[str, ...]  # the log-prob function's parameters (not in reports)
    tp_group_name: str | None  # its fifth parameter: the TP group's name at this commit
    cp: bool  # takes cp_group
    chunking: bool  # takes chunk_size
    sampling: bool  # takes sampling_params (top-k / top-p)
    packed: bool  # has the packed-sequence log-prob function
    packed_params: tuple[str, ...] | None  # its parameters (not in reports)
    pre_rolled: bool  # the packed function takes target_is_pre_rolled
    entropy: bool  # has ChunkedDistributedEntropy
    # every .cuda() in the file, with where it is (function or Class.method)
    cuda_calls: tuple[str, ...]
    cp_backward_needs_cuda: int | None  # the line in AllGatherCPTensor.backward that needs CUDA
    packing: bool  # NeMo-RL's own sequence packing (the data path)
    fused_loss: bool
    unfused_loss: bool
    dtensor: bool = False  # get_next_token_logprobs_from_logits takes DTensor logits (its DTensor worker's path)
    # the file holding get_logprobs_from_vocab_parallel_logits (the DTensor worker's get_logprobs call):
    # model_utils from e861b94dd, nemo_rl/models/dtensor/parallelize.py before
    dtensor_logprobs_file: str | None = None

    def reported(self) -> dict[str, Any]:
        """The fields reports show (the parameter lists left out)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("logprobs_params", "packed_params")}


def detect_era(src: Path) -> NemoRLEra:
    """What this checkout's model_utils offers and how its functions are called, and which of
    NeMo-RL's packing and loss wrappers it has, from its source."""
    tree = FRAMEWORK.parse(src, MODEL_UTILS)
    assert tree is not None  # the source's marker: FRAMEWORK.source checked it is there
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    if LOGPROBS not in functions:
        raise BadInput(f"{src / MODEL_UTILS} has no {LOGPROBS}")
    logprobs = parameters(functions[LOGPROBS])
    packed = parameters(functions[PACKED]) if PACKED in functions else None
    # x.cuda(...), torch.cuda.*, pin_memory=True, device="cuda": what needs a CUDA device
    cuda_lines = sorted({(n.end_lineno or n.lineno, _enclosing(tree, n)) for n in ast.walk(tree)
                         if (isinstance(n, ast.Attribute) and n.attr == "cuda")
                         or (isinstance(n, ast.keyword) and n.arg == "pin_memory"
                             and not (isinstance(n.value, ast.Constant) and not n.value.value))
                         or (isinstance(n, ast.Constant) and isinstance(n.value, str)
                             and n.value.split(":")[0] == "cuda")})
    gather_cuda = [line for line, where in cuda_lines if where == "AllGatherCPTensor.backward"]
    return NemoRLEra(
        logprobs_params=tuple(logprobs),
        tp_group_name=logprobs[4] if len(logprobs) > 4 else None,
        cp="cp_group" in logprobs,
        chunking="chunk_size" in logprobs,
        sampling="sampling_params" in logprobs,
        packed=packed is not None,
        packed_params=tuple(packed) if packed is not None else None,
        pre_rolled=bool(packed) and "target_is_pre_rolled" in packed,
        entropy=ENTROPY in classes,
        cuda_calls=tuple(f"{where}:{line}" for line, where in cuda_lines),
        cp_backward_needs_cuda=gather_cuda[0] if gather_cuda else None,
        packing=has_packing(src),
        fused_loss=has_fused_loss(src),
        unfused_loss=has_unfused_loss(src),
        dtensor=NEXT_TOKEN in functions and DTENSOR in functions,
        dtensor_logprobs_file=str(MODEL_UTILS) if DTENSOR in functions else (
            str(PARALLELIZE_FILE) if _defines(FRAMEWORK.parse(src, PARALLELIZE_FILE), DTENSOR) else None),
    )


def _defines(tree: ast.Module | None, name: str) -> bool:
    return tree is not None and any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body)


def _enclosing(tree: ast.Module, node: ast.AST) -> str:
    line = getattr(node, "lineno", 0)
    for top in tree.body:
        if isinstance(top, (ast.FunctionDef, ast.ClassDef)) and top.lineno <= line <= (top.end_lineno or 0):
            if isinstance(top, ast.ClassDef):
                for sub in top.body:
                    if isinstance(sub, ast.FunctionDef) and sub.lineno <= line <= (sub.end_lineno or 0):
                        return f"{top.name}.{sub.name}"
            return top.name
    return "<module>"


def scenario_sampling(obj: Any) -> tuple[int | None, float] | None:
    """(top_k, top_p) of a scenario or RankInputs (``top_k``/``top_p``; 0 and 1.0: off), as
    NeMo-RL's TrainingSamplingParams spell it (top_k None: off), or None when nothing filters."""
    top_k, top_p = int(getattr(obj, "top_k", 0) or 0), float(getattr(obj, "top_p", 1.0))
    if top_k <= 0 and top_p >= 1.0:
        return None
    return (top_k if top_k > 0 else None), top_p


def _filters(sampling: tuple[int | None, float] | None) -> bool:
    if sampling is None:
        return False
    top_k, top_p = sampling
    return (top_k is not None and top_k > 0) or top_p != 1.0


def _padded(total: int, cp: int) -> int:
    """NeMo-RL's padded sequence length: a multiple of 2 * cp when cp > 1, as it is."""
    return total if cp == 1 else -(-total // (2 * cp)) * 2 * cp


def sampling_shape_reason(scenario: Scenario, framework_rows: bool = False) -> str | None:
    """Why NeMo-RL's top-k/top-p path cannot take this scenario's layout, or None. Its
    DistributedLogprobWithSampling moves the rows to a row-parallel layout with an all-to-all:
    B * S (local rows) must divide by tp, and with chunking chunk_size * B too; NeMo-RL gets that
    by padding sequences (policy.make_sequence_length_divisible_by = tp), a layout shardcheck does
    not build."""
    if not _filters(scenario_sampling(scenario)) or scenario.tp == 1:
        return None
    totals = [s.total for s in scenario.samples]
    if scenario.layout == "bshd":
        batch, rows = len(totals), max(totals)
    else:
        batch, rows = 1, sum(_padded(t, scenario.cp) for t in totals) // scenario.cp
    if (batch * rows) % scenario.tp and not framework_rows:
        return (f"NeMo-RL's top-k/top-p path needs B*S={batch * rows} local rows divisible by tp={scenario.tp} "
                "(it pads sequences to policy.make_sequence_length_divisible_by, a layout shardcheck does not build)")
    chunk = scenario.log_probs_chunk_size
    if chunk > 0 and (chunk * batch) % scenario.tp:
        return (f"NeMo-RL's chunked top-k/top-p path needs chunk_size*B={chunk * batch} divisible by "
                f"tp={scenario.tp} (ChunkedDistributedLogprobWithSampling raises otherwise)")
    return None


VARIANTS = {
    "loss": "NeMo-RL's ClippedPGLossFn in a training step (megatron-core's schedule and DDP around it), with its "
            "DTensor worker's own lines between the loss and backward (loss / num_microbatches; from #266 the "
            "global valid-token count and loss *= dp_size); option token_level_loss; bshd, tp 1, cp 1",
    "per_sequence": "NeMo-RL's default packed training path for thd/zigzag: SequencePackingLossWrapper -> "
                    "prepare_loss_input -> get_next_token_logprobs_from_logits -> from_parallel_logits_to_logprobs "
                    "on each sample's logits slice (where the checkout has them, else that last call per sample), "
                    "bshd as the default",
    "pre_rolled": "from_parallel_logits_to_logprobs_packed_sequences with target_is_pre_rolled=True and the "
                  "targets rolled and CP-sharded outside (NeMo-RL's fused packed loss, "
                  "sequence_packing.fuse_loss), bshd as the default",
    "fused_loss": "NeMo-RL's fused packed training loss (sequence_packing.fuse_loss): SequencePackingFusionLossWrapper "
                  "-> prepare_packed_loss_input (_pack_input_ids builds the rolled targets from the unpacked "
                  "input_ids and the data path's cu_seqlens) -> from_parallel_logits_to_logprobs_packed_sequences; "
                  "thd and zigzag only",
    "dtensor": "NeMo-RL's DTensor worker's path, on the DeviceMesh its own __init__ statements build "
               "(init_device_mesh (dp, cp, tp), compiled alone): get_next_token_logprobs_from_logits on logits "
               "that are a DTensor sharded over the vocabulary (Shard(-1)) on its tp_mesh at tp > 1 -> "
               "get_logprobs_from_vocab_parallel_logits -> dtensor_from_parallel_logits_to_logprobs (with a "
               "scenario's top-k / top-p, sampling_params: DistributedLogprobWithSampling), on the plain logits "
               "at tp 1 (its full-vocabulary branch: [:, :-1], apply_top_k_top_p, log_softmax); bshd at cp 1; "
               "at cp > 1 "
               "(scenario layout zigzag) the worker's CP: the padded [B, S] batch sharded by torch's "
               "context_parallel (head-tail load-balanced where S % 2cp == 0, else contiguous), seq_index, "
               "input_ids a DTensor on its cp_mesh, logits [Shard(1), Shard(-1)] on its device_mesh[('cp','tp')], "
               "NeMo-RL's own CP gather (full_tensor) and the worker's loss *= cp_size; before the call, the "
               "worker's own lines from its model's output to it (the temperature, where the commit divides), "
               "compiled alone from its worker file; before e861b94dd call=get_logprobs only, at cp 1",
    "sampling": "the default paths with sampling_params=TrainingSamplingParams(top_k, top_p, temperature) from "
                "the scenario (DistributedLogprobWithSampling / ChunkedDistributedLogprobWithSampling); a "
                "scenario without top-k/top-p passes params that filter nothing",
}


class NemoRLTarget(CheckoutTarget):
    """NVIDIA-NeMo/RL's from_parallel_logits_to_logprobs(_packed_sequences) and ChunkedDistributedEntropy from a source checkout (--nemo-rl-src, --target-src or SHARDCHECK_NEMO_RL_SRC)"""

    framework = FRAMEWORK

    def __init__(self, variant: str | None = None, src: str | None = None,
                 config: TargetConfig | None = None) -> None:
        if variant is not None and variant not in VARIANTS:
            raise BadInput(f"target 'nemo_rl' has no variant {variant!r} (known: {', '.join(sorted(VARIANTS))})")
        config = config or TargetConfig()
        try:
            self.cp_on_cpu = config.flag("cp_on_cpu")
            self.temperature_in_place = config.flag("temperature_in_place")
        except ValueError as exc:
            raise BadInput(f"target 'nemo_rl': {exc}") from None
        self.dtensor_call = config.get("call", "train")
        if self.dtensor_call not in DTENSOR_CALLS:
            raise BadInput(f"target 'nemo_rl': option call={self.dtensor_call!r}: expected "
                           f"{' or '.join(DTENSOR_CALLS)}")
        if config.get("call") is not None and variant != "dtensor":
            raise BadInput("option call is nemo_rl:dtensor's (which of its DTensor worker's calls)")
        layout = layout_option(config, "target 'nemo_rl': ")
        self.layout_option = layout
        self.variant = variant
        self.name = "nemo_rl" if variant is None else f"nemo_rl:{variant}"
        super().__init__(src)
        self.era = detect_era(self.src)
        if variant == "pre_rolled" and not self.era.pre_rolled:
            raise BadInput(f"NeMo-RL at {self.short()} has no target_is_pre_rolled (the fused packed loss came "
                           "later): use the default nemo_rl target")
        if variant == "sampling" and not self.era.sampling:
            raise BadInput(f"NeMo-RL at {self.short()} takes no sampling_params (top-k/top-p came later)")
        if variant == "dtensor" and not self.era.dtensor and not (
                self.dtensor_call == "get_logprobs" and self.era.dtensor_logprobs_file):
            raise BadInput(f"NeMo-RL at {self.short()} has no {NEXT_TOKEN} with a DTensor branch ({DTENSOR})"
                           + (f" (its {DTENSOR} is in {self.era.dtensor_logprobs_file}: call=get_logprobs runs there)"
                              if self.era.dtensor_logprobs_file else ""))
        self.worker_lines: DTensorWorkerLines | None = None
        if variant == "dtensor":
            try:
                self.worker_lines = DTensorWorkerLines(self.src, self.dtensor_call, self.import_module)
            except (LookupError, OSError, SyntaxError) as exc:
                raise BadInput(f"NeMo-RL at {self.short()}: its DTensor worker's lines between the model's output "
                               f"and the log-prob call cannot be compiled: {exc}") from None
        # the worker's own DeviceMesh (its __init__'s statements); a commit without them: the
        # adapter's meshes over the harness's groups, as before
        self.worker_mesh: DTensorWorkerMesh | None = None
        self._no_worker_mesh = ""  # why the commit's worker offers none
        if variant == "dtensor":
            try:
                self.worker_mesh = DTensorWorkerMesh(self.src)
            except (LookupError, OSError, SyntaxError) as exc:
                self._no_worker_mesh = str(exc)
        if variant == "fused_loss" and not self.era.fused_loss:
            raise BadInput(f"NeMo-RL at {self.short()} has no fused packed loss ({FUSED} in {LOSS_UTILS_FILE} came "
                           "later): use nemo_rl:pre_rolled")
        if variant == "dtensor":
            self.data_path = NemoRLDTensorDataPath() if layout == "framework" else None
        else:
            self.data_path = (NemoRLDataPath(self.src, self._module)
                              if layout == "framework" and self.era.packing and self.era.packed else None)
        if variant == "fused_loss" and self.data_path is None:
            raise BadInput(f"target 'nemo_rl:fused_loss' runs on NeMo-RL's own packing ({DATA_FILE}); "
                           f"{'layout=shardcheck was asked' if layout != 'framework' else 'this checkout has none'}")
        self.framework_files = tuple(str(f) for f in (MODEL_UTILS, SAMPLING_FILE) if (self.src / f).is_file()) + (
            (str(DATA_FILE),) if self.data_path is not None and variant != "dtensor" else ()) + (
            (str(LOSS_UTILS_FILE), str(WRAPPER_FILE)) if self._through_loss() else ()) + (
            (str(self.worker_lines.file),) if self.worker_lines is not None else ()) + (
            (str(PARALLELIZE_FILE),) if variant == "dtensor" and not self.era.dtensor else ())
        self.capabilities = self._capabilities()
        # ChunkedDistributedEntropy returns sum p log p: the reference follows, the adapter never negates.
        # With CP every log-prob path gathers (AllGatherCPTensor, allgather_cp_sharded_tensor): each
        # CP rank holds, and takes its loss over, the whole sequence; the entropy stays on its own rows.
        if variant == "dtensor":
            # no entropy on this path; with CP its log-probs are gathered by DTensor.full_tensor()
            self.definitions = Definitions(loss_over="gathered", loss_source=(
                "NeMo-RL's DTensor log-probs gathered over CP by DTensor.full_tensor() in "
                "dtensor_from_parallel_logits_to_logprobs, whose backward keeps each rank's slice; its worker's "
                "loss *= dp_size * cp_size before backward"))
        else:
            self.definitions = Definitions(entropy_sign=-1, entropy_source=f"NeMo-RL's {ENTROPY}",
                                           loss_over="gathered", entropy_over="held",
                                           loss_source="NeMo-RL's log-probs gathered over CP by AllGatherCPTensor / "
                                                       "allgather_cp_sharded_tensor")
        self._mod: Any = None
        self._sampling_mod: Any = None
        self._loss_path: NemoRLLossPath | None = None  # compiled on first use, from the imported modules
        self._old_dtensor: Any = None  # parallelize.py's get_logprobs_from_vocab_parallel_logits, compiled alone

    def repro_call(self) -> str | None:
        """How a repro script calls NeMo-RL: the default variant on shardcheck's rows (a script that
        runs NeMo-RL's packing or loss wrappers is not written yet); nemo_rl:dtensor's call at cp 1
        (the harness refuses cp > 1: its log-probs are gathered) where the commit's worker scales
        the logits as the script does (:meth:`_repro_dtensor`)."""
        if self.variant == "dtensor":
            return REPRO_CALL_DTENSOR.replace("@CALL@", self.dtensor_call) if self._repro_dtensor() else None
        return REPRO_CALL if self.variant is None and self.data_path is None else None

    def _repro_dtensor(self) -> bool:
        """Whether a script can make nemo_rl:dtensor's call faithfully: model_utils holds both of its
        functions and takes sampling_params, logits_sampling_utils has TrainingSamplingParams, and the
        worker's only lines between its model's output and the call are its _apply_temperature_scaling
        dividing by sampling_params.temperature (the script divides out of place: the same values);
        not with temperature_in_place (that write is the worker's, on the harness's tensor)."""
        lines = self.worker_lines
        if not (self.era.dtensor and self.era.sampling and lines is not None and not self.temperature_in_place
                and "class TrainingSamplingParams" in _text(self.src / SAMPLING_FILE)
                and lines.helpers == ["_apply_temperature_scaling"]):
            return False
        tree = ast.parse(_text(self.src / lines.file))
        helper = next((f for c in tree.body if isinstance(c, ast.ClassDef) and c.name == lines.cls_name
                       for f in c.body if isinstance(f, ast.FunctionDef) and f.name == lines.helpers[0]), None)
        return helper is not None and ".div_(self.sampling_params.temperature)" in ast.unparse(helper)

    def _capabilities(self) -> Capabilities:
        era = self.era
        layouts = {"bshd"}
        reasons: dict[str, str] = {
            "allgather": "NeMo-RL has no all-gather CP: its Megatron CP is zigzag (2*cp load-balanced chunks "
                         "per sequence) only"}
        if self.variant == "dtensor":
            reasons["thd"] = ("NeMo-RL's DTensor worker hands get_next_token_logprobs_from_logits "
                              "[batch, sequence] batches (bshd; zigzag at cp > 1: torch's context_parallel) here")
            if self.data_path is not None:
                layouts.add("zigzag")  # what torch's context_parallel makes of the [B, S] batch (load-balanced)
            else:
                reasons["zigzag"] = ("NeMo-RL's DTensor CP shards a [B, S] batch with torch's context_parallel "
                                     "(layout=framework): shardcheck's packed zigzag rows are not its")
            cp_sizes, cp_reason = None, ""
            if not era.dtensor:  # get_logprobs only, from parallelize.py (before e861b94dd)
                cp_sizes, cp_reason = frozenset({1}), (
                    f"NeMo-RL at {self.short()}: its {DTENSOR} is in {PARALLELIZE_FILE}; shardcheck runs its "
                    "DTensor worker's get_logprobs there at cp 1 only (its CP call is not modelled at that era)")
        elif self.variant == "fused_loss":
            layouts = {"thd", "zigzag"}
            reasons["bshd"] = ("NeMo-RL's fused packed loss runs with sequence packing only (thd, zigzag): bshd "
                               "batches take the unfused loss")
        elif self.variant == "per_sequence":
            layouts.add("thd")
            if era.cp:
                layouts.add("zigzag")
            else:
                reasons["zigzag"] = f"NeMo-RL at {self.short()}: {LOGPROBS} takes no cp_group (no CP yet)"
        elif era.packed:
            layouts |= {"thd", "zigzag"}
        else:
            reasons["thd"] = reasons["zigzag"] = (f"NeMo-RL at {self.short()} has no {PACKED} "
                                                  "(sequence packing came later)")
        if self.variant != "dtensor":
            cp_sizes, cp_reason = None, ""
        line = era.cp_backward_needs_cuda
        if line and self.variant != "dtensor" and not self.cp_on_cpu and not _ranks_on_cuda():
            cp_sizes = frozenset({1})
            cp_reason = (f"NeMo-RL's AllGatherCPTensor.backward (model_utils.py:{line}) builds its index with "
                         "pin_memory=True and .cuda(): cp > 1 needs ranks on CUDA (nccl, one GPU per rank, or "
                         f"--backend gloo-cuda; {_cuda_devices()} GPU(s) here); --target-opt cp_on_cpu=true runs "
                         "it anyway")
        kwargs: dict[str, Any] = {}
        if cp_sizes is not None:
            kwargs["cp_sizes"] = cp_sizes
        sampling = self.variant in ("sampling", "dtensor") and era.sampling
        # NeMo-RL's own packing pads every sequence to a multiple of tp: only its chunk rule is left
        framework_rows = self.data_path is not None

        def sampling_shape(scenario: Scenario) -> str | None:
            if self.variant == "dtensor" and scenario.layout == "zigzag":
                return (dtensor_sampling_reason(scenario, chunked=self.dtensor_call == "get_logprobs")
                        if _filters(scenario_sampling(scenario)) else None)
            return sampling_shape_reason(scenario, framework_rows and scenario.layout in ("thd", "zigzag"))

        return Capabilities(
            layout_reasons=tuple(reasons.items()), sampling=sampling, rule=sampling_shape if sampling else None,
            layouts=frozenset(layouts), entropy=bool(era.entropy) and self.variant != "dtensor",
            replay_keep=False,
            reasons=(("layout", f"NeMo-RL at {self.short()} supports {', '.join(sorted(layouts))}"),
                     ("entropy", "NeMo-RL's DTensor worker computes no entropy on this path (its "
                                 f"{ENTROPY} is the Megatron path's: nemo_rl)" if self.variant == "dtensor" else
                                 f"NeMo-RL at {self.short()} has no {ENTROPY}"),
                     ("cp", cp_reason),
                     ("replay_keep", "NeMo-RL does not replay the rollout's keep sets: it recomputes "
                                     "top-k/top-p from the training logits (nemo_rl:sampling)")),
            **kwargs,
        )

    def forget(self) -> None:
        self._mod = self._sampling_mod = self._loss_path = None
        self._old_dtensor = None
        if self.worker_lines is not None:
            self.worker_lines.forget()
        if self.worker_mesh is not None:
            self.worker_mesh.forget()
        if self.data_path is not None:
            self.data_path.release()

    def description(self) -> dict[str, Any]:
        return {
            "era": self.era.reported(),
            "functions": self._functions(),
            "entropy": ("none (the DTensor worker's path computes none)" if self.variant == "dtensor" else
                        f"{ENTROPY} (sum p log p, the negative entropy, as NeMo-RL defines it)"),
            "definitions": self.definitions.describe(),
            "temperature": (f"NeMo-RL's own DTensor worker lines decide: {self.worker_lines.describe()}; names bound "
                            f"from its imports: {self.worker_lines.bound or '(none read yet)'}; the model's output a "
                            + ("the harness's logits themselves (temperature_in_place=true)" if self.temperature_in_place
                               else "copy of the harness's logits")
                            if self.worker_lines is not None else
                            "logits.div_(T) on the given logits, as NeMo-RL's caller" if self.temperature_in_place
                            else "logits / T before the call (NeMo-RL's caller does logits.div_(T) in place)"),
            "cp_on_cpu": self.cp_on_cpu,
            **({"device_mesh": self._mesh_description(), "tp1": self._tp1_description()}
               if self.variant == "dtensor" else {}),
            **({"call": ((f"DTensorPolicyWorker.get_logprobs's ({PARALLELIZE_FILE}'s {DTENSOR} compiled alone, "
                          "called as the worker then did: logits.to(torch.float32), input_ids; its "
                          "dtensor_from_parallel_logits_to_logprobs's @torch.no_grad() body run undecorated so the "
                          "backward is checked)" if not self.era.dtensor else
                          "DTensorPolicyWorker.get_logprobs's (get_logprobs_from_vocab_parallel_logits with chunk_size; "
                          "with grad here: inference_only=False)") if self.dtensor_call == "get_logprobs" else
                         "DTensorPolicyWorker.train's (prepare_loss_input -> get_next_token_logprobs_from_logits)")}
               if self.variant == "dtensor" else {}),
            "data_path": layout_description(self.data_path, self.layout_option, "no packing"),
            "framework_files": list(self.framework_files),
            **({"packed_seq_params": f"megatron-core's PackedSeqParams with {', '.join(self.data_path.newer_fields)} "
                                     "kept as attributes (a newer megatron-core's fields NeMo-RL's packing passes)"}
               if self.data_path is not None and self.data_path.newer_fields else {}),
        }

    def _mesh_description(self) -> str:
        if self.worker_mesh is None:
            return (f"the adapter's, as before: a ('tp',) mesh of the rank's TP group (DeviceMesh.from_group) and at "
                    f"cp > 1 a ('cp', 'tp') mesh of its CP and TP groups; the commit's worker has no mesh statements "
                    f"to run ({self._no_worker_mesh})")
        return (f"the worker's own: {self.worker_mesh.describe()}; built through the harness's framework_groups "
                "once per world and layout (dp_size = world // (tp * cp)), its tp, cp, dp and dp_cp groups checked "
                "against the harness's; its tp_mesh holds the logits at tp > 1, its device_mesh[('cp', 'tp')] and "
                "cp_mesh serve at cp > 1 (the data path's own phase, run before compute without RankInputs, shards "
                "on a ('cp',) mesh of megatron-core's CP group: the same ranks)")

    def _tp1_description(self) -> str:
        if self.dtensor_call != "train":
            return ("get_logprobs at tp 1, cp 1: the DTensor call on a 1-rank tp mesh (the worker's own plain-tensor "
                    "branch, inline in get_logprobs, is not modelled)")
        return (f"train at tp 1, cp 1: the plain logits, as the worker hands them (no TP plan at tp 1): {NEXT_TOKEN}'s "
                "full-vocabulary branch (next_token_logits[:, :-1], a non-contiguous view for 2+ samples, "
                "apply_top_k_top_p, log_softmax); on a CPU world Tensor.cuda returns the tensor itself for that call "
                "only (its input_ids[:, 1:].cuda(): a device move, values unchanged; never on a CUDA world)")

    def _functions(self) -> dict[str, str]:
        packed = PACKED + (" (target_is_pre_rolled=True)" if self.variant == "pre_rolled" else
                           " (targets rolled inside)")
        thd = f"{LOGPROBS} per sample" if self.variant == "per_sequence" else packed
        if self.variant == "fused_loss":
            thd = f"SequencePackingFusionLossWrapper -> {FUSED} -> _pack_input_ids, {PACKED} (target_is_pre_rolled=True)"
        elif self._through_loss():
            thd = f"SequencePackingLossWrapper -> prepare_loss_input -> get_next_token_logprobs_from_logits -> {LOGPROBS}"
        out = {"thd, zigzag": thd, "bshd": LOGPROBS}
        if self.variant == "dtensor":
            out = {"zigzag (cp > 1)": f"torch's context_parallel on [B, S] -> {NEXT_TOKEN} on DTensor logits "
                                      "([Shard(1), Shard(-1)] on the worker's device_mesh[('cp','tp')]), input_ids a "
                                      f"DTensor on its cp_mesh, seq_index -> {DTENSOR} -> "
                                      "dtensor_from_parallel_logits_to_logprobs "
                                      "(CP gather: full_tensor)",
                   "bshd": f"tp > 1: {NEXT_TOKEN} on DTensor logits (Shard(-1), the worker's tp_mesh) -> {DTENSOR} -> "
                           "dtensor_from_parallel_logits_to_logprobs; tp 1: "
                           + (f"{NEXT_TOKEN} on the plain logits (the worker parallelizes nothing at tp 1): its "
                              "full-vocabulary branch, [:, :-1], apply_top_k_top_p, log_softmax, gather"
                              if self.dtensor_call == "train" else
                              "the same DTensor call on a 1-rank tp mesh (the worker's own plain-tensor branch of "
                              "get_logprobs, inline in its file, is not modelled)")}
            if not self.era.dtensor:  # call=get_logprobs at a commit before e861b94dd, cp 1 only
                out = {"bshd": f"{PARALLELIZE_FILE}::{DTENSOR} (compiled alone) on DTensor logits (Shard(-1), a "
                               "('tp',) mesh) -> dtensor_from_parallel_logits_to_logprobs"}
            out["worker lines"] = self.worker_lines.describe() if self.worker_lines is not None else "none"
        if self.variant == "sampling":
            out["sampling"] = "sampling_params=TrainingSamplingParams(top_k, top_p, temperature)"
        return out

    def _module(self) -> Any:
        if self._mod is None:
            self._mod = self.import_module(MODULE)
            self._sampling_mod = sys.modules.get(SAMPLING_MODULE)  # imported by model_utils where it exists
            self._logprobs_params = set(inspect.signature(getattr(self._mod, LOGPROBS)).parameters)
            packed = getattr(self._mod, PACKED, None)
            self._packed_params = set(inspect.signature(packed).parameters) if packed is not None else set()
        return self._mod

    # ---- the calls ------------------------------------------------------------------------
    #
    # Two calling conventions, each NeMo-RL's own:
    # - "post-processor" (default, sampling): as LogprobsPostProcessor calls the functions: the
    #   logits as they come (no cast), chunk_size as configured, even with top-k/top-p;
    # - "training" (per_sequence, pre_rolled): as the loss path (get_next_token_logprobs_from_logits,
    #   prepare_packed_loss_input) calls them: float32 logits unless chunking, and no chunking with
    #   top-k/top-p.
    # Both with inference_only=False, so that the backward is checked.

    @property
    def training_convention(self) -> bool:
        return self.variant in ("per_sequence", "pre_rolled", "fused_loss")

    def _through_loss(self) -> bool:
        """Whether thd/zigzag rows go through NeMo-RL's loss wrapper and its preparation (which cast
        the logits themselves) rather than the adapter calling the log-prob functions."""
        return self.data_path is not None and (
            self.variant == "fused_loss" or (self.variant == "per_sequence" and self.era.unfused_loss))

    def _packing(self, inputs: RankInputs) -> tuple[list[int], Any, int]:
        """Each sequence's padded length, the padded packed ``input_ids`` [1, T] and the unpacked
        width: from NeMo-RL's own packing on the real batch where it laid out the rows, else
        NeMo-RL's arithmetic on the harness's rows (each sequence padded to 2*cp)."""
        import torch

        device = inputs.logits.device
        if inputs.rollout is not None:
            input_ids, (all_ids, _, _, _, cu_padded) = self.data_path.pack(inputs.rollout.to(device))
            bounds = [int(b) for b in cu_padded.tolist()]
            return [b - a for a, b in zip(bounds, bounds[1:])], all_ids, int(input_ids.shape[1])
        padded = [_padded(total, inputs.cp_size) for total in inputs.total_lengths]
        target = torch.zeros(1, sum(padded), dtype=inputs.tokens[0].dtype, device=device)
        lo = 0
        for toks, length in zip(inputs.tokens, padded):
            target[0, lo:lo + toks.numel()] = toks.to(device)
            lo += length
        return padded, target, max(inputs.total_lengths)

    def _through_wrapper(self, mod: Any, logits: Any, inputs: RankInputs, chunk: int | None) -> list[Any]:
        """NeMo-RL's packed loss wrapper on the data path's PackedSeqParams, fused (one
        [B, S - 1] for the batch) or not (one [1, L - 1] per sequence): the log-probs its loss
        receives (position p scoring token p + 1), this rank's share of each response."""
        if self._loss_path is None:
            self._loss_path = NemoRLLossPath(self.src, mod, self._sampling_mod, fused=self.variant == "fused_loss")
        input_ids, (_, _, params, _, _) = self.data_path.pack(inputs.rollout.to(logits.device))
        rows = self._loss_path(logits, input_ids, params, inputs.tp_rank, inputs.tp_group, inputs.cp_group, chunk)
        return [rows[i][(total - response - 1) + share.to(logits.device)]
                for i, (total, response, share) in enumerate(zip(inputs.total_lengths, inputs.response_lengths,
                                                                 self._share(inputs)))]

    def compute(self, inputs: RankInputs) -> RankOutputs:
        mod = self._module()
        # the worker builds its mesh in __init__, before any forward: first, on every rank alike
        worker_mesh = self._worker_mesh(inputs) if self.variant == "dtensor" else None
        logits = inputs.logits
        if self.worker_lines is not None:  # the DTensor worker's own lines decide (temperature or not)
            logits = self._worker_logits(inputs)
        elif inputs.temperature != 1.0:  # NeMo-RL's caller scales the model output before these functions
            logits = logits.div_(inputs.temperature) if self.temperature_in_place else logits / inputs.temperature
        chunk = inputs.chunk_size if inputs.chunk_size > 0 else None
        v_local = logits.size(-1)
        start, end = inputs.tp_rank * v_local, (inputs.tp_rank + 1) * v_local
        sampling = self._sampling_params(inputs) if self.variant == "sampling" else None
        entropy_logits = logits
        through_loss = self._through_loss() and inputs.rollout is not None
        if self.training_convention and not through_loss:
            if chunk is None:
                import torch

                logits = logits.to(torch.float32)
        if through_loss:
            log_probs = self._through_wrapper(mod, logits, inputs, chunk)
        elif self.variant == "dtensor":
            filtered = self.capabilities.sampling and scenario_sampling(inputs) is not None
            sampling = self._sampling_params(inputs) if filtered else None
            if inputs.cp_size > 1:  # the worker's CP: torch's context_parallel rows, seq_index, a ("cp","tp") mesh
                log_probs = dtensor_cp_logprobs(mod, self.data_path, logits, inputs, chunk, sampling,
                                                self.dtensor_call, worker_mesh)
            else:
                log_probs = self._dtensor(mod, logits, inputs, chunk, sampling, worker_mesh)
        elif inputs.layout == "bshd":
            log_probs = self._bshd(mod, logits, inputs, start, end, chunk, sampling)
        elif self.variant == "per_sequence":
            log_probs = self._per_sequence(mod, logits, inputs, start, end, chunk)
        else:
            log_probs = self._packed(mod, logits, inputs, start, end, chunk, sampling)
        entropy = None
        if inputs.with_entropy:
            rows = [r for r, _ in inputs.held_rows()]  # its own rows (declared: entropy_over="held")
            # NeMo-RL's only caller (get_distillation_topk_logprobs_from_logits) chunks by
            # min(local rows, 1024); a scenario's chunk size is used where it sets one
            ent_chunk = chunk or max(1, min(int(entropy_logits.shape[1]), 1024))
            neg = getattr(mod, ENTROPY).apply(entropy_logits, ent_chunk, inputs.tp_group, False)
            flat = neg.reshape(-1)  # sum p log p: NeMo-RL's definition, declared in self.definitions
            entropy = [flat[r] for r in rows]
        return RankOutputs(log_probs, entropy)

    def _worker_mesh(self, inputs: RankInputs) -> dict[str, Any] | None:
        """What the worker's own mesh statements set (``device_mesh``, ``tp_mesh``, ``cp_mesh``,
        ``dp_mesh``, ``dp_cp_mesh``; :class:`DTensorWorkerMesh`), built once per world and layout
        through the harness (its groups checked against the harness's tp, cp, dp and dp_cp
        groups); None where the commit's worker has no such statements."""
        if self.worker_mesh is None:
            return None
        import torch.distributed as dist

        tp, cp = inputs.tp_size, inputs.cp_size
        dp = dist.get_world_size() // (tp * cp)  # the worker's dp_size = world_size // tp_size // cp_size
        device_type = inputs.logits.device.type
        mesh = self.worker_mesh
        return inputs.framework_groups(("nemo_rl:dtensor", (dp, cp, tp)),
                                       lambda: mesh.build(dp, cp, tp, device_type), mesh.roles)

    def _worker_logits(self, inputs: RankInputs) -> Any:
        """The DTensor worker's own lines from its model's output to its log-prob call
        (:class:`DTensorWorkerLines`), the model a stand-in whose output is a copy of the harness's
        logits for this rank (the harness's own tensor with temperature_in_place=true, so that the
        worker's in-place div_ writes it), on an object holding what the worker's __init__ sets that
        they read: cfg["generation"] (temperature, top_k, top_p) and sampling_params
        (TrainingSamplingParams from that config, where the commit has it), cp_size."""
        asked = scenario_sampling(inputs)
        top_k, top_p = asked if asked is not None else (None, 1.0)
        cls = getattr(self._sampling_mod, "TrainingSamplingParams", None)
        attributes = {
            "cfg": {"generation": {"temperature": inputs.temperature, "top_k": top_k, "top_p": top_p}},
            "sampling_params": cls(top_k=top_k, top_p=top_p, temperature=inputs.temperature) if cls else None,
            "cp_size": inputs.cp_size}
        output = inputs.logits if self.temperature_in_place else inputs.logits.clone()
        assert self.worker_lines is not None
        return self.worker_lines(output, attributes)

    def _dtensor_logprobs(self, mod: Any) -> Any:
        """get_logprobs_from_vocab_parallel_logits: model_utils's, or before e861b94dd
        parallelize.py's compiled alone (that module imports transformers' models), its
        dtensor_from_parallel_logits_to_logprobs model_utils's; where that is decorated
        @torch.no_grad() (the worker's get_logprobs runs without grad anyway) its undecorated body
        (``__wrapped__``), so that the backward is checked as on every other commit."""
        if self.era.dtensor_logprobs_file == str(MODEL_UTILS):
            return getattr(mod, DTENSOR)
        if self._old_dtensor is None:
            import typing

            import torch
            from torch.distributed.tensor import DTensor

            from shardcheck.targets.compiled import compile_alone

            inner = mod.dtensor_from_parallel_logits_to_logprobs
            ns = compile_alone(self.src / PARALLELIZE_FILE, [DTENSOR], {
                "torch": torch, "DTensor": DTensor, "Optional": typing.Optional,
                "dtensor_from_parallel_logits_to_logprobs": getattr(inner, "__wrapped__", inner)})
            self._old_dtensor = ns[DTENSOR]
        return self._old_dtensor

    def _kwargs(self, params: set[str], inputs: RankInputs, chunk: int | None, sampling: Any) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"inference_only": False}
        if "cp_group" in params:
            kwargs["cp_group"] = inputs.cp_group
        elif inputs.cp_size > 1:
            raise ValueError(f"NeMo-RL at {self.short()} takes no cp_group here")
        if "chunk_size" in params:
            kwargs["chunk_size"] = chunk
        if sampling is not None:
            kwargs["sampling_params"] = sampling
        return kwargs

    def _share(self, inputs: RankInputs) -> list[Any]:
        """Per sample, the response token indices this rank returns: with CP every one (NeMo-RL's
        log-probs are gathered over CP, declared in self.definitions), else what it holds."""
        if inputs.cp_size > 1:
            import torch

            return [torch.arange(response) for response in inputs.response_lengths]
        return [tokens for _, tokens in inputs.held_rows()]

    def _bshd(self, mod: Any, logits: Any, inputs: RankInputs, start: int, end: int, chunk: int | None,
              sampling: Any) -> list[Any]:
        """NeMo-RL's unpacked path: input_ids [B, S] right-padded; out[:, p] scores token p + 1."""
        width = logits.shape[1]
        out = getattr(mod, LOGPROBS)(logits, _right_padded(inputs, width, logits.device), start, end, inputs.tp_group,
                                     **self._kwargs(self._logprobs_params, inputs, chunk, sampling))
        out = out[:, :width - 1]  # as the caller slices off CP padding
        return [out[r // width, r % width] for r in inputs.scored_rows()]

    def _next_token(self, mod: Any, ids: Any, logits: Any, sampling: Any, chunk: int | None) -> Any:
        """get_next_token_logprobs_from_logits called as the worker's prepare_loss_input calls it at
        this commit: sampling_params and chunk_size only where the function takes them (before
        f67e9e61d, #2872, neither existed there; sweep found the adapter passing them)."""
        fn = getattr(mod, NEXT_TOKEN)
        params = inspect.signature(fn).parameters
        if sampling is not None and "sampling_params" not in params:
            raise BadInput(f"NeMo-RL at {self.short()}: {NEXT_TOKEN} takes no sampling_params (no top-k / top-p "
                           "on this path at this commit)")
        kwargs = {k: v for k, v in (("sampling_params", sampling), ("chunk_size", chunk)) if k in params}
        return fn(ids, logits, **kwargs)

    def _dtensor(self, mod: Any, logits: Any, inputs: RankInputs, chunk: int | None, sampling: Any,
                 worker_mesh: dict[str, Any] | None = None) -> list[Any]:
        """NeMo-RL's DTensor worker's call at cp 1, input_ids [B, S] right-padded; out[:, p]
        scores token p + 1. At tp > 1 the logits are a DTensor sharded over the vocabulary
        (Shard(-1)) on the worker's own ``tp_mesh`` (its TP plan's lm_head output), else on a
        ('tp',) mesh of the rank's TP group. At tp 1 the worker parallelizes nothing (parallelize.py:
        ``if tp_mesh.size() > 1``), so train's call gets the plain logits and takes
        get_next_token_logprobs_from_logits's full-vocabulary branch; get_logprobs's own plain
        branch is the worker's inline code, not modelled: there the logits stay a DTensor on the
        1-rank mesh. Its logprob_chunk_size is passed as the worker passes it (neither branch of
        train's call hands it on)."""
        width = logits.shape[1]
        ids = _right_padded(inputs, width, logits.device)
        if self.dtensor_call == "train" and inputs.tp_size == 1:
            with tensor_cuda_stays(logits.device):  # that branch's input_ids[:, 1:].cuda()
                out = self._next_token(mod, ids, logits, sampling, chunk)
            return [out[r // width, r % width] for r in inputs.scored_rows()]
        if worker_mesh is not None and "tp_mesh" in worker_mesh:
            from torch.distributed.tensor import DTensor, Shard

            sharded = DTensor.from_local(logits, worker_mesh["tp_mesh"], [Shard(-1)], run_check=False)
        else:
            from shardcheck.targets.torch_parallel import vocab_sharded

            sharded = vocab_sharded(logits, inputs.tp_group, "tp")
        if self.dtensor_call == "get_logprobs":  # DTensorPolicyWorker.get_logprobs's call (cp 1)
            fn = self._dtensor_logprobs(mod)
            params = inspect.signature(fn).parameters
            kwargs = {k: v for k, v in (("chunk_size", chunk), ("sampling_params", sampling)) if k in params}
            if not self.era.dtensor:  # the worker casts there: logits.to(torch.float32)
                import torch

                sharded = sharded.to(torch.float32)
            out = fn(sharded, ids, **kwargs)
        else:
            out = self._next_token(mod, ids, sharded, sampling, chunk)
        return [out[r // width, r % width] for r in inputs.scored_rows()]

    def _per_sequence(self, mod: Any, logits: Any, inputs: RankInputs, start: int, end: int,
                      chunk: int | None) -> list[Any]:
        """SequencePackingLossWrapper: each sample's (padded, CP-local) logits slice and its
        unpadded input_ids go through get_next_token_logprobs_from_logits, i.e.
        from_parallel_logits_to_logprobs with a batch of one."""
        cp = inputs.cp_size
        offset = 0
        out = []
        kwargs = self._kwargs(self._logprobs_params, inputs, chunk, None)
        padded = self._packing(inputs)[0]
        for toks, total, response, share, length in zip(inputs.tokens, inputs.total_lengths, inputs.response_lengths,
                                                        self._share(inputs), padded):
            local = length // cp
            piece = logits.narrow(1, offset, local)
            offset += local
            lp = getattr(mod, LOGPROBS)(piece, toks.to(logits.device).unsqueeze(0), start, end, inputs.tp_group,
                                        **kwargs)
            lp = lp[:, :total - 1]  # as the caller slices off CP padding
            out.append(lp[0, (total - response - 1) + share.to(lp.device)])
        if offset != logits.shape[1]:
            raise ValueError(f"nemo_rl: {logits.shape[1]} local rows, NeMo-RL's layout has {offset}")
        return out

    def _packed(self, mod: Any, logits: Any, inputs: RankInputs, start: int, end: int, chunk: int | None,
                sampling: Any) -> list[Any]:
        """from_parallel_logits_to_logprobs_packed_sequences over the packed batch."""
        import torch

        cp = inputs.cp_size
        device = logits.device
        padded, packed_ids, unpacked = self._packing(inputs)  # unpacked: the unpacked input_ids' width
        bounds = [0]
        for length in padded:
            bounds.append(bounds[-1] + length)
        if bounds[-1] // cp != logits.shape[1]:
            raise ValueError(f"nemo_rl: {logits.shape[1]} local rows, NeMo-RL's layout has {bounds[-1] // cp}")
        cu_seqlens_padded = torch.tensor(bounds, dtype=torch.int32, device=device)
        kwargs = self._kwargs(self._packed_params, inputs, chunk, sampling)
        if self.variant == "pre_rolled":
            # prepare_packed_loss_input: each sequence's targets rolled by one and CP-sharded outside
            # (a row's target is the next token; rows that score none get 0, as padding does)
            target = inputs.row_labels().unsqueeze(0)
            kwargs["target_is_pre_rolled"] = True
        else:
            # LogprobsPostProcessor: the whole padded packed input_ids, rolled inside NeMo-RL
            target = packed_ids
        out = getattr(mod, PACKED)(logits, target, cu_seqlens_padded, unpacked, start, end, inputs.tp_group,
                                   **kwargs)
        return [out[i, (total - response - 1) + share.to(out.device)]
                for i, (total, response, share) in enumerate(zip(inputs.total_lengths, inputs.response_lengths,
                                                                 self._share(inputs)))]

    def _sampling_params(self, inputs: RankInputs) -> Any:
        cls = getattr(self._sampling_mod, "TrainingSamplingParams", None)
        if cls is None:
            raise ValueError(f"NeMo-RL at {self.short()} has no TrainingSamplingParams")
        asked = scenario_sampling(inputs)
        top_k, top_p = asked if asked is not None else (None, 1.0)
        return cls(top_k=top_k, top_p=top_p, temperature=inputs.temperature)


def _right_padded(inputs: RankInputs, width: int, device: Any) -> Any:
    """Every sample's token ids, right-padded with 0 to ``width``: the [B, S] input_ids NeMo-RL's
    unpacked callers hand it."""
    import torch

    ids = torch.zeros(len(inputs.tokens), width, dtype=inputs.tokens[0].dtype, device=device)
    for i, toks in enumerate(inputs.tokens):
        ids[i, :toks.numel()] = toks.to(device)
    return ids


# How a `shardcheck repro` script calls NeMo-RL (see harness/controller/commands/repro.py): as NemoRLTarget
# does on the harness's rows at cp 1, from the checkout (its package __init__.py files not run).
REPRO_CALL = '''
def call_code_under_test(logits, rank):
    """NeMo-RL's log-prob functions and ChunkedDistributedEntropy from rank.src, as shardcheck's nemo_rl target calls them."""
    import importlib, inspect  # noqa: E401
    for name in ("nemo_rl", "nemo_rl.distributed", "nemo_rl.algorithms"):  # empty packages: __init__.py not run
        sys.modules.setdefault(name, type(sys)(name)).__path__ = [os.path.join(rank.src, *name.split("."))]
    mod = importlib.import_module("nemo_rl.distributed.model_utils")
    if rank.temperature != 1.0:  # NeMo-RL's caller scales the model output first (in place there)
        logits = logits / rank.temperature
    chunk, v = (rank.chunk_size if rank.chunk_size > 0 else None), logits.shape[-1]
    bshd = rank.layout == "bshd"
    fn = getattr(mod, "from_parallel_logits_to_logprobs" + ("" if bshd else "_packed_sequences"))
    kwargs = {"inference_only": False, **({"chunk_size": chunk} if "chunk_size" in inspect.signature(fn).parameters else {})}
    if bshd:  # input_ids [B, S], right-padded
        ids = torch.stack([torch.nn.functional.pad(t, (0, logits.shape[1] - len(t))) for t in rank.tokens])
        out = fn(logits, ids, rank.tp_rank * v, (rank.tp_rank + 1) * v, rank.tp_group, **kwargs)
    else:  # the packed stream, sequences back to back (cp 1: no padding), rolled inside NeMo-RL
        bounds = torch.tensor([0] + [sum(rank.total_lengths[:i + 1]) for i in range(len(rank.tokens))], dtype=torch.int32)
        out = fn(logits, torch.cat(rank.tokens).unsqueeze(0), bounds, max(rank.total_lengths), rank.tp_rank * v,
                 (rank.tp_rank + 1) * v, rank.tp_group, **kwargs)
    scored = [[t - r - 1 + j for j in share] for t, r, share in zip(rank.total_lengths, rank.response_lengths, rank.share)]
    log_probs = [out[i, positions] for i, positions in enumerate(scored)]  # out[i, p] scores token p + 1
    if not rank.with_entropy:
        return log_probs, None
    neg = mod.ChunkedDistributedEntropy.apply(logits, chunk or max(1, min(logits.shape[1], 1024)), rank.tp_group, False)
    return log_probs, [neg.reshape(-1)[[rank.rows.index((i, p)) for p in ps]] for i, ps in enumerate(scored)]
'''

# nemo_rl:dtensor's (call @CALL@, written in by repro_call) at cp 1 on shardcheck's [B, S] rows.
REPRO_CALL_DTENSOR = '''
def call_code_under_test(logits, rank):
    """NeMo-RL's DTensor worker's @CALL@ call (cp 1) from rank.src, as shardcheck's nemo_rl:dtensor target makes it."""
    import importlib
    for name in ("nemo_rl", "nemo_rl.distributed", "nemo_rl.algorithms"):  # empty packages: __init__.py not run
        sys.modules.setdefault(name, type(sys)(name)).__path__ = [os.path.join(rank.src, *name.split("."))]
    mod = importlib.import_module("nemo_rl.distributed.model_utils")  # it imports logits_sampling_utils: torch alone
    top_k, top_p = CASE["scenario"].get("top_k", 0), CASE["scenario"].get("top_p", 1.0)  # 0, 1.0: no filter
    params = importlib.import_module("nemo_rl.algorithms.logits_sampling_utils").TrainingSamplingParams
    sampling = params(top_k=top_k or None, top_p=top_p, temperature=rank.temperature) if top_k or top_p < 1 else None
    if rank.temperature != 1.0:  # the worker's _apply_temperature_scaling: logits.div_(T) on its model's output
        logits = logits / rank.temperature
    ids = torch.stack([torch.nn.functional.pad(t, (0, logits.shape[1] - len(t))) for t in rank.tokens])  # [B, S]
    chunk = rank.chunk_size if rank.chunk_size > 0 else None
    if "@CALL@" == "train" and rank.tp_size == 1:  # no TP plan at tp 1: the plain logits, the full-vocabulary branch
        cuda = torch.Tensor.cuda  # its input_ids[:, 1:].cuda(): on a CPU world the tensor itself for this call (a
        if logits.device.type == "cpu":  # device move, values unchanged), as shardcheck's target does there
            torch.Tensor.cuda = lambda self, *args, **kwargs: self
        try:
            out = mod.get_next_token_logprobs_from_logits(ids, logits, sampling_params=sampling, chunk_size=chunk)
        finally:
            torch.Tensor.cuda = cuda
    else:  # the vocab-sharded DTensor, Shard(-1) on a ('tp',) mesh of the rank's TP group: the ranks of the
        from torch.distributed.device_mesh import DeviceMesh  # worker's tp_mesh (its whole mesh is not rebuilt)
        from torch.distributed.tensor import DTensor, Shard
        mesh = DeviceMesh.from_group(rank.tp_group, logits.device.type, mesh_dim_names=("tp",))
        sharded = DTensor.from_local(logits, mesh, [Shard(-1)], run_check=False)
        if "@CALL@" == "train":  # neither branch of train's call hands chunk_size on
            out = mod.get_next_token_logprobs_from_logits(ids, sharded, sampling_params=sampling, chunk_size=chunk)
        else:  # get_logprobs (the worker's runs under no_grad; with grad here, so that the backward is checked)
            out = mod.get_logprobs_from_vocab_parallel_logits(sharded, ids, chunk_size=chunk, sampling_params=sampling)
    scored = [[t - r - 1 + j for j in share] for t, r, share in zip(rank.total_lengths, rank.response_lengths, rank.share)]
    return [out[i, positions] for i, positions in enumerate(scored)], None  # out[i, p] scores token p + 1; no entropy
'''


def _text(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


def _ranks_on_cuda() -> bool:
    """Whether this command's ranks compute on CUDA: asked for (nccl, gloo-cuda), or auto with
    two GPUs or more (a CP world under auto then gets nccl where it has one GPU per rank)."""
    from shardcheck.backend import ON_CUDA, requested_backend

    asked = requested_backend()
    return asked in ON_CUDA or (asked == "auto" and _cuda_devices() >= 2)


def _cuda_devices() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken CUDA set-up counts as none
        return 0


def _build(variant: str | None, config: TargetConfig) -> Any:
    if variant == "loss":
        from shardcheck.targets.nemo_rl_loss import OPTION, build

        other = sorted(k for k, _ in config.options if k != OPTION)
        if other:
            raise BadInput(f"target 'nemo_rl:loss' takes no option {other[0]!r} (its option: {OPTION})")
        return build(FRAMEWORK, config.src, config)
    if config.get("token_level_loss") is not None:
        raise BadInput("option token_level_loss is nemo_rl:loss's (the training step's loss)")
    return NemoRLTarget(variant, config.src, config)


target = CheckoutFactory(
    FRAMEWORK, _build,
    doc=("NVIDIA-NeMo/RL's from_parallel_logits_to_logprobs(_packed_sequences) and ChunkedDistributedEntropy from a "
         "source checkout (--nemo-rl-src, --target-src or SHARDCHECK_NEMO_RL_SRC)"),
    options=OPTIONS, variants=VARIANTS)
