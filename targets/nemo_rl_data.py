"""NeMo-RL's own data path and packed losses, from the target's checkout.

- The data path: ``_pack_sequences_for_megatron`` (``nemo_rl/models/megatron/data.py``), as
  ``process_microbatch`` calls it with sequence packing on: the micro-batch's ``input_ids``
  ``[B, S]`` (right-padded with 0, S the longest sequence rounded up to
  ``make_sequence_length_divisible_by``) and its ``input_lengths``, each sequence padded to
  ``pad_individual_seqs_to_multiple_of``, the packed stream to ``pad_packed_seq_to_multiple_of`` or
  to ``pad_packed_seq_to`` (the padding goes to the last sequence), each sequence cut into zigzag
  chunks with CP rank and size from megatron-core's ``parallel_state``, as NeMo-RL asks them.
- The packed losses (``nemo_rl/algorithms/loss/wrapper.py`` and ``utils.py``): fused
  (``sequence_packing.fuse_loss``: ``prepare_packed_loss_input`` builds the rolled targets with
  ``_pack_input_ids`` from the unpacked ``input_ids`` and the data path's ``PackedSeqParams``, then
  calls ``from_parallel_logits_to_logprobs_packed_sequences`` with ``target_is_pre_rolled=True``)
  or not (``prepare_loss_input`` per sequence, ``get_next_token_logprobs_from_logits``).
- The DTensor worker's CP (``nemo_rl:dtensor`` at cp > 1, the end of this module). Its data path:
  NeMo-RL's DTensor worker (``nemo_rl/models/policy/workers/dtensor_policy_worker.py``, ``train``
  and ``get_logprobs``) hands the model a padded ``[B, S]`` micro-batch (right-padded, S the longest
  sequence rounded up to ``policy.make_sequence_length_divisible_by``) and shards it over CP with
  torch's own ``context_parallel(cp_mesh, buffers=[input_ids, position_ids, seq_index],
  buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers))`` (its ``create_context_parallel_ctx``;
  V2 the same through nemo_automodel). torch load-balances (head-tail: rank r holds chunks r and
  2cp-1-r) when ``S % (2 cp) == 0`` and shards contiguously otherwise, silently. That call runs
  here as the worker makes it, on megatron-core's CP group (the harness's), so the position trace
  learns the rows. The call (:func:`dtensor_cp_logprobs`), as the worker's ``train`` makes it after
  the forward: ``seq_index = DTensor.from_local(seq_index, cp_mesh, [Shard(1)]).full_tensor()
  .squeeze(0)``, the sharded ``input_ids`` re-wrapped as a DTensor on the cp mesh, the logits
  ``DTensor.from_local(local, mesh[("cp", "tp")], [Shard(1), Shard(-1)])``, then
  ``prepare_loss_input``'s ``get_next_token_logprobs_from_logits(input_ids, logits, seq_index,
  sampling_params, chunk_size)``: its DTensor branch, ``get_logprobs_from_vocab_parallel_logits``
  -> ``dtensor_from_parallel_logits_to_logprobs``, which gathers the log-probs over CP itself
  (``full_tensor()``, un-permuted with ``argsort(seq_index)``): every CP rank returns ``[B, S - 1]``
  in natural order. The worker's next line before backward, ``loss *= dp_size * cp_size``
  (dtensor_policy_worker.py:958; ``automodel/train.py``: ``result * dp_size * cp_size``), is applied
  to the log-probs' gradient (dp 1 here): ``full_tensor()``'s backward keeps each rank's own slice
  (no sum over CP), which that line and FSDP's average over dp x cp make a sum.

These functions are compiled alone from their files (:mod:`shardcheck.targets.compiled`): their
modules import megatron-bridge, transformers and NeMo-RL's config stack. Nothing of NeMo-RL's is
wrapped, cast or patched; what its functions raise propagates.
"""

from __future__ import annotations

import ast
import enum
from pathlib import Path
from typing import Any, Callable

import torch

from shardcheck.errors import BadInput
from shardcheck.scenarios.scenario import Scenario
from shardcheck.targets.base import Knob, Rollout, positive_int, positive_int_or_none
from shardcheck.targets.compiled import compile_alone, module_imports, with_newer_fields

DATA_FILE = Path("nemo_rl/models/megatron/data.py")
COMMON_FILE = Path("nemo_rl/models/megatron/common.py")
LOSS_UTILS_FILE = Path("nemo_rl/algorithms/loss/utils.py")
WRAPPER_FILE = Path("nemo_rl/algorithms/loss/wrapper.py")
INTERFACES_FILE = Path("nemo_rl/algorithms/loss/interfaces.py")
ALGORITHM_UTILS_FILE = Path("nemo_rl/algorithms/utils.py")
PACK = "_pack_sequences_for_megatron"
FUSED_PREPARE = "prepare_packed_loss_input"
FUSED_WRAPPER = "SequencePackingFusionLossWrapper"
UNFUSED_PREPARE = "prepare_loss_input"
UNFUSED_WRAPPER = "SequencePackingLossWrapper"


def _top_level(path: Path) -> set[str]:
    if not path.is_file():
        return set()
    tree = ast.parse(path.read_text(), filename=str(path))
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def has_packing(src: Path) -> bool:
    return PACK in _top_level(src / DATA_FILE) and "_round_up_to_multiple" in _top_level(src / COMMON_FILE)


def has_unfused_loss(src: Path) -> bool:
    return (UNFUSED_PREPARE in _top_level(src / LOSS_UTILS_FILE) and UNFUSED_WRAPPER in _top_level(src / WRAPPER_FILE)
            and "LossInputType" in _top_level(src / INTERFACES_FILE))


def has_fused_loss(src: Path) -> bool:
    return (FUSED_PREPARE in _top_level(src / LOSS_UTILS_FILE) and FUSED_WRAPPER in _top_level(src / WRAPPER_FILE)
            and "LossInputType" in _top_level(src / INTERFACES_FILE))



def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class NemoRLDataPath:
    """NeMo-RL's sequence packing for Megatron (thd, zigzag CP)."""

    name = f"{DATA_FILE}:{PACK}"

    def __init__(self, src: Path, model_utils: Callable[[], Any]) -> None:
        self.src = src
        self._model_utils = model_utils  # the target's import of model_utils (and its release)
        self._pack: Any = None
        self.newer_fields: list[str] = []

    def knobs(self) -> dict[str, Knob]:
        return {
            "make_sequence_length_divisible_by": Knob(
                None, "policy.make_sequence_length_divisible_by: each sequence padded to a multiple of it (the "
                      "packer's pad_individual_seqs_to_multiple_of); None: NeMo-RL's Megatron default, tp (its "
                      "GRPO configs), times 2*cp under CP (the least its packer accepts)", positive_int_or_none),
            "pad_packed_seq_to_multiple_of": Knob(
                1, "the packed stream padded to a multiple of it, the padding given to the last sequence "
                   "(_get_pack_sequence_parameters_for_megatron derives it from the FP8 recipe: 16, 32 or 128, "
                   "and HybridEP: 128, times 2*cp and tp with sequence parallel); 1: off", positive_int),
            "pad_packed_seq_to": Knob(
                None, "the packed stream padded to this length (pipeline parallel: the batch's longest); "
                      "None: off", positive_int_or_none),
        }

    def builds(self, scenario: Scenario) -> str | None:
        if scenario.layout == "bshd":
            return "NeMo-RL packs with sequence packing only (thd, zigzag): a bshd batch is laid out by shardcheck"
        if scenario.layout == "allgather":
            return "NeMo-RL has no all-gather CP of its own; rows laid out by shardcheck"
        return None

    def packed_seq_params(self) -> tuple[Any, list[str]]:
        """megatron-core's PackedSeqParams, and the keywords the checkout's packing passes that the
        installed megatron-core does not take (a newer megatron's fields, e.g. ``total_tokens``).
        Where there are some, a subclass that keeps them as plain attributes stands in: the
        packing's own code runs unchanged, and the report says so."""
        import dataclasses

        from megatron.core.packed_seq_params import PackedSeqParams

        tree = ast.parse((self.src / DATA_FILE).read_text())
        fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == PACK)
        passed = {k.arg for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                  and n.func.id == "PackedSeqParams" for k in n.keywords if k.arg}
        missing = sorted(passed - {f.name for f in dataclasses.fields(PackedSeqParams)})
        if not missing:
            return PackedSeqParams, []

        return with_newer_fields(PackedSeqParams, missing), missing

    def _function(self) -> Any:
        if self._pack is None:
            params_class, self.newer_fields = self.packed_seq_params()
            common = compile_alone(self.src / COMMON_FILE, ["_round_up_to_multiple"], {})
            ns = compile_alone(self.src / DATA_FILE, [PACK], {
                "torch": torch, "PackedSeqParams": params_class,
                "_round_up_to_multiple": common["_round_up_to_multiple"],
                "_get_tokens_on_this_cp_rank": self._model_utils()._get_tokens_on_this_cp_rank})
            self._pack = ns[PACK]
        return self._pack

    @staticmethod
    def divisible_by(knobs: dict[str, Any], tp: int, cp: int) -> int:
        given = knobs.get("make_sequence_length_divisible_by")
        return given if given is not None else tp * (2 * cp if cp > 1 else 1)

    def batch(self, rollout: Rollout, tp: int, cp: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch as NeMo-RL's packing receives it: ``input_ids`` [B, S] right-padded
        with 0 (S: the longest sequence rounded up to make_sequence_length_divisible_by) and
        ``input_lengths``."""
        width = _round_up(max(rollout.total_lengths), self.divisible_by(rollout.knobs, tp, cp))
        device = rollout.tokens[0].device
        input_ids = torch.zeros(len(rollout.tokens), width, dtype=rollout.tokens[0].dtype, device=device)
        for i, tokens in enumerate(rollout.tokens):
            input_ids[i, : tokens.numel()] = tokens
        return input_ids, torch.tensor(rollout.total_lengths, dtype=torch.int32, device=device)

    def pack(self, rollout: Rollout) -> tuple[torch.Tensor, tuple]:
        """``input_ids`` [B, S] and what ``_pack_sequences_for_megatron`` returns for it on this
        rank: (all_input_ids, local input_ids, PackedSeqParams, cu_seqlens, cu_seqlens_padded)."""
        from megatron.core import parallel_state as mpu

        tp, cp = mpu.get_tensor_model_parallel_world_size(), mpu.get_context_parallel_world_size()
        input_ids, lengths = self.batch(rollout, tp, cp)
        knobs = rollout.knobs
        out = self._function()(input_ids, lengths, self.divisible_by(knobs, tp, cp),
                               knobs.get("pad_packed_seq_to_multiple_of", 1), knobs.get("pad_packed_seq_to"),
                               cp_rank=mpu.get_context_parallel_rank(), cp_size=cp)
        return input_ids, out

    def local_tokens(self, rollout: Rollout) -> torch.Tensor:
        return self.pack(rollout)[1][1][0]

    def release(self) -> None:
        """Drop the compiled packing (it holds the target's import of model_utils, now undone)."""
        self._pack = None


class _RecordLogprobs:
    """Stands in for NeMo-RL's loss (ClippedPGLossFn and the rest) behind the wrapper: it keeps the
    ``next_token_logprobs`` the wrapper hands a LOGPROB loss (one call per sequence unfused, one
    for the batch fused), so that the harness's loss is differentiated through NeMo-RL's
    preparation of them; the loss it returns is 0."""

    def __init__(self, input_type: Any) -> None:
        self.input_type = input_type
        self.seen: list[Any] = []

    def __call__(self, data: Any, global_valid_seqs: Any, global_valid_toks: Any, next_token_logprobs: Any,
                 **rest: Any) -> tuple[Any, dict]:
        self.seen.append(next_token_logprobs)
        return next_token_logprobs.new_zeros(()), {}


class _Batch(dict):
    """The micro-batch the unfused wrapper slices per sequence: a dict of unpacked [B, ...] tensors
    with ``BatchedDataDict.slice``'s semantics (each tensor's rows start:end). The adapter's stand-in
    for NeMo-RL's container (its module imports NeMo-RL's data stack)."""

    def slice(self, start: int, end: int) -> "_Batch":
        return _Batch({k: v[start:end] for k, v in self.items()})


class NemoRLLossPath:
    """NeMo-RL's packed training loss, from its files, fused (``sequence_packing.fuse_loss``:
    ``SequencePackingFusionLossWrapper`` -> ``prepare_packed_loss_input``, which rolls the targets
    with ``_pack_input_ids``) or not (``SequencePackingLossWrapper`` cuts each sequence's logits out
    of the packed rows by ``cu_seqlens_q_padded`` and calls ``prepare_loss_input``, which calls
    ``get_next_token_logprobs_from_logits``, its vocab-parallel branch)."""

    # what loss/utils.py's functions read from model_utils, where the checkout has them
    MODEL_UTILS_NAMES = ("_get_tokens_on_this_cp_rank", "from_parallel_logits_to_logprobs_packed_sequences",
                         "get_next_token_logprobs_from_logits", "get_distillation_topk_logprobs_from_logits")

    def __init__(self, src: Path, model_utils: Any, sampling: Any, fused: bool) -> None:
        import math

        self.fused = fused
        self.LossInputType = compile_alone(src / INTERFACES_FILE, ["LossInputType"], {"enum": enum})["LossInputType"]
        given = {"torch": torch, "LossInputType": self.LossInputType,
                 **{n: getattr(model_utils, n) for n in self.MODEL_UTILS_NAMES if hasattr(model_utils, n)}}
        # the -inf masking and the top-k / top-p check came later than loss/utils.py (#1920): given
        # where the commit has them (a preparation that reads one the commit lacks is refused below)
        try:
            given["mask_out_neg_inf_logprobs"] = compile_alone(src / ALGORITHM_UTILS_FILE, ["mask_out_neg_inf_logprobs"],
                                                               {"torch": torch})["mask_out_neg_inf_logprobs"]
        except LookupError:
            pass
        if sampling is not None and hasattr(sampling, "need_top_k_or_top_p_filtering"):
            given["need_top_k_or_top_p_filtering"] = sampling.need_top_k_or_top_p_filtering
        prepare, wrapper = (FUSED_PREPARE, FUSED_WRAPPER) if fused else (UNFUSED_PREPARE, UNFUSED_WRAPPER)
        names = ["_pack_input_ids", prepare] if fused else [prepare]
        # the cross-tokenizer distillation branch is not the LOGPROB loss's
        try:
            self.prepare = compile_alone(src / LOSS_UTILS_FILE, names, given,
                                         off_path=("prepare_xtoken_cross_tokenizer_loss_input",))[prepare]
        except LookupError as exc:
            raise BadInput(f"NeMo-RL's loss preparation at {src.name} reads what the adapter does not give: {exc}") \
                from None
        self.wrapper = compile_alone(src / WRAPPER_FILE, [wrapper], {"torch": torch, "math": math})[wrapper]

    def __call__(self, logits: torch.Tensor, input_ids: torch.Tensor, packed_seq_params: Any, tp_rank: int,
                 tp_group: Any, cp_group: Any, chunk_size: int | None) -> list[torch.Tensor]:
        """Per sample, the ``next_token_logprobs`` row NeMo-RL's loss receives (position p scoring
        token p + 1; every CP rank's, gathered), with what the megatron train step's
        LossPostProcessor passes the wrapper: the data path's ``cu_seqlens_q`` and
        ``cu_seqlens_q_padded`` and the TP and CP groups."""
        import inspect
        from functools import partial

        params = inspect.signature(self.prepare).parameters
        settings = {k: v for k, v in (("sampling_params", None), ("chunk_size", chunk_size)) if k in params}
        recorder = _RecordLogprobs(self.LossInputType.LOGPROB)
        wrapped = self.wrapper(
            loss_fn=recorder, prepare_fn=partial(self.prepare, **settings),
            cu_seqlens_q=packed_seq_params.cu_seqlens_q, cu_seqlens_q_padded=packed_seq_params.cu_seqlens_q_padded,
            vocab_parallel_rank=tp_rank, vocab_parallel_group=tp_group, context_parallel_group=cp_group)
        wrapped(logits, _Batch(input_ids=input_ids), None, None)
        # fused: one [B, S - 1] for the batch; unfused: one [1, L - 1] per sequence
        return list(recorder.seen[0]) if self.fused else [seen[0] for seen in recorder.seen]


# ---- the DTensor worker's CP (nemo_rl:dtensor at cp > 1) ----------------------------------------

WORKER_FILE = Path("nemo_rl/models/policy/workers/dtensor_policy_worker.py")
# the worker's line between its loss and backward (V1; V2: nemo_rl/models/automodel/train.py)
WORKER_LOSS_SCALE = "loss *= self.dp_size * self.cp_size"


def dtensor_divisible_by(knobs: dict[str, Any], tp: int, cp: int) -> int:
    """policy.make_sequence_length_divisible_by: the knob, else tp * 2 cp (what NeMo-RL's DTensor
    CP recipes set: dapo-qwen2.5-7b.v2.yaml, distillation_math.yaml)."""
    given = knobs.get("make_sequence_length_divisible_by")
    return given if given is not None else tp * (2 * cp if cp > 1 else 1)


def dtensor_width(totals: list[int], knobs: dict[str, Any], tp: int, cp: int) -> int:
    return _round_up(max(totals), dtensor_divisible_by(knobs, tp, cp))


class NemoRLDTensorDataPath:
    """The DTensor worker's CP sharding: torch's context_parallel on the padded [B, S] batch."""

    name = f"{WORKER_FILE.name}:create_context_parallel_ctx (torch's context_parallel)"
    newer_fields: list[str] = []  # (NeMo-RL's Megatron packing's; none here)

    def knobs(self) -> dict[str, Knob]:
        return {
            "make_sequence_length_divisible_by": Knob(
                None, "policy.make_sequence_length_divisible_by: the batch's width S padded to a multiple of it; "
                      "None: tp * 2 * cp, what NeMo-RL's DTensor CP recipes set (its base grpo_math_1B.yaml sets "
                      "tp: then S % (2 cp) != 0 shards contiguously and S % cp != 0 unevenly)",
                positive_int_or_none),
        }

    def builds(self, scenario: Scenario) -> str | None:
        if scenario.layout == "zigzag" and scenario.cp > 1:
            return None
        return (f"NeMo-RL's DTensor worker shards over CP only (cp > 1; this is {scenario.layout} at cp "
                f"{scenario.cp}): the [B, S] batch is laid out by shardcheck")

    def shard(self, rollout: Rollout, cp_mesh: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's (input_ids, position_ids, seq_index) after the worker's context_parallel:
        [B, S_local], [B, S_local], [1, S_local], on ``cp_mesh`` (the worker's own ``self.cp_mesh``
        in compute), else a ("cp",) mesh of megatron-core's CP group: the data path's phase runs
        before compute and holds no RankInputs, so it cannot reach the worker's mesh (built through
        ``RankInputs.framework_groups``); the two hold the same ranks (the harness checks the
        worker's cp group against its own), and context_parallel shards locally."""
        from megatron.core import parallel_state as mpu
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.experimental import context_parallel

        tp, cp = mpu.get_tensor_model_parallel_world_size(), mpu.get_context_parallel_world_size()
        width = dtensor_width(rollout.total_lengths, rollout.knobs, tp, cp)
        device = rollout.tokens[0].device
        input_ids = torch.zeros(len(rollout.tokens), width, dtype=rollout.tokens[0].dtype, device=device)
        for i, tokens in enumerate(rollout.tokens):
            input_ids[i, : tokens.numel()] = tokens
        # the worker's buffers (dtensor_policy_worker.py train / get_logprobs)
        position_ids = torch.arange(width, device=device).repeat(len(rollout.tokens), 1)
        seq_index = torch.arange(width, device=device).repeat(1, 1)
        buffers = [input_ids, position_ids, seq_index]
        if cp_mesh is None:
            cp_mesh = DeviceMesh.from_group(mpu.get_context_parallel_group(), device.type, mesh_dim_names=("cp",))
        with context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                              no_restore_buffers=set(buffers)):
            pass  # the model's forward runs here in the worker; the buffers stay sharded after it
        return input_ids, position_ids, seq_index

    def local_tokens(self, rollout: Rollout) -> torch.Tensor:
        return self.shard(rollout)[0]

    def model_inputs(self, rollout: Rollout) -> dict[str, Any]:
        return {"position_ids": self.shard(rollout)[1].reshape(-1)}

    def release(self) -> None:
        """Nothing held: torch's context_parallel restores what it patched on exit."""


def cp_tp_mesh(cp_group: Any, tp_group: Any, device_type: str) -> Any:
    """The worker's ``device_mesh[("cp", "tp")]`` for this rank's data-parallel replica, from the
    harness's real groups: mesh[i][j] is the rank at CP index i and TP index j (megatron's ranks
    are strided, so it is cp_ranks[i] + tp_ranks[j] - this rank)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    me = dist.get_rank()
    cp_ranks, tp_ranks = dist.get_process_group_ranks(cp_group), dist.get_process_group_ranks(tp_group)
    mesh = torch.tensor([[c + t - me for t in tp_ranks] for c in cp_ranks], dtype=torch.int)
    return DeviceMesh.from_group([cp_group, tp_group], device_type, mesh=mesh, mesh_dim_names=("cp", "tp"))


class _WorkerLossScale(torch.autograd.Function):
    """Identity forward; backward times ``scale``: the worker's ``loss *= dp_size * cp_size``
    moved onto the log-probs (the harness builds the loss)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: int) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad * ctx.scale, None


DTENSOR_CALLS = ("train", "get_logprobs")


def dtensor_cp_logprobs(mod: Any, path: NemoRLDTensorDataPath, logits: torch.Tensor, inputs: Any,
                        chunk: int | None, sampling: Any, call: str = "train",
                        worker_mesh: dict[str, Any] | None = None) -> list[torch.Tensor]:
    """Per sample, every response token's log-prob (gathered over CP by NeMo-RL), as the worker's
    train step computes them on this rank (``call="train"``: prepare_loss_input's
    get_next_token_logprobs_from_logits, which drops chunk_size on this branch) or as its
    get_logprobs does (``"get_logprobs"``: get_logprobs_from_vocab_parallel_logits with
    chunk_size, the logits uncast; with grad enabled here, so inference_only=False). The meshes
    are the worker's own (``worker_mesh``: what :class:`DTensorWorkerMesh` set,
    ``device_mesh[("cp", "tp")]`` and ``cp_mesh``) where its commit builds them so, else
    :func:`cp_tp_mesh` over the harness's groups."""
    from torch.distributed.tensor import DTensor, Shard

    if worker_mesh is not None and {"device_mesh", "cp_mesh"} <= set(worker_mesh):
        mesh, cp_mesh = worker_mesh["device_mesh"][("cp", "tp")], worker_mesh["cp_mesh"]
    else:
        mesh = cp_tp_mesh(inputs.cp_group, inputs.tp_group, logits.device.type)
        cp_mesh = mesh["cp"]
    input_ids, _, seq_index = path.shard(inputs.rollout.to(logits.device), cp_mesh)
    seq_index = DTensor.from_local(seq_index, device_mesh=cp_mesh, placements=[Shard(1)]).full_tensor().squeeze(0)
    ids = DTensor.from_local(input_ids, device_mesh=cp_mesh, placements=[Shard(1)])
    sharded = DTensor.from_local(logits, device_mesh=mesh, placements=[Shard(1), Shard(-1)])
    if call == "get_logprobs":  # DTensorPolicyWorker.get_logprobs's call
        out = mod.get_logprobs_from_vocab_parallel_logits(sharded, ids, seq_index, chunk_size=chunk,
                                                          sampling_params=sampling)
    else:  # prepare_loss_input's call
        out = mod.get_next_token_logprobs_from_logits(input_ids=ids, next_token_logits=sharded, seq_index=seq_index,
                                                      sampling_params=sampling, chunk_size=chunk)
    out = _WorkerLossScale.apply(out, inputs.cp_size)  # dp 1: the scenario's one replica
    return [out[i, (total - response - 1) + torch.arange(response, device=out.device)]
            for i, (total, response) in enumerate(zip(inputs.total_lengths, inputs.response_lengths))]


def dtensor_sampling_reason(scenario: Scenario, chunked: bool = False) -> str | None:
    """Why NeMo-RL's top-k/top-p DTensor path cannot take this CP scenario: its
    DistributedLogprobWithSampling all-to-alls the B * S_local rows over tp (a ValueError
    otherwise, asking for make_sequence_length_divisible_by = tp)."""
    if scenario.tp == 1:
        return None
    knobs = dict(scenario.layout_knobs)
    totals = [s.total for s in scenario.samples]
    width = dtensor_width(totals, knobs, scenario.tp, scenario.cp)
    rows = len(totals) * (width // scenario.cp)
    if width % scenario.cp == 0 and rows % scenario.tp:
        m = dtensor_divisible_by(knobs, scenario.tp, scenario.cp)
        return (f"NeMo-RL's top-k/top-p path needs B*S_local={rows} local rows divisible by tp={scenario.tp} "
                f"(make_sequence_length_divisible_by={m} pads S to {width}, S_local = S / cp; NeMo-RL raises a "
                "ValueError asking for make_sequence_length_divisible_by = tp"
                + (", which this is: under CP that is not enough" if m % scenario.tp == 0 else "") + ")")
    chunk = scenario.log_probs_chunk_size
    if chunked and chunk > 0 and (chunk * len(totals)) % scenario.tp:
        return (f"NeMo-RL's chunked top-k/top-p path needs chunk_size*B={chunk * len(totals)} divisible by "
                f"tp={scenario.tp} (ChunkedDistributedLogprobWithSampling raises otherwise)")
    return None


# ---- the DTensor worker's own lines between the model's output and the log-prob call ------------

WORKER_FILES = (Path("nemo_rl/models/policy/workers/dtensor_policy_worker.py"),
                Path("nemo_rl/models/policy/dtensor_policy_worker.py"))
WORKER_CLASS = "DTensorPolicyWorker"
PARALLELIZE_FILE = Path("nemo_rl/models/dtensor/parallelize.py")  # get_logprobs_from_vocab_parallel_logits before e861b94dd


def _self_calls(node: ast.AST) -> set[str]:
    """The ``self.NAME(...)`` methods ``node`` calls."""
    return {n.func.attr for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"}


def _reads_outputs_into_logits(stmt: ast.stmt) -> bool:
    """``logits = outputs.logits`` (or an ``if`` choosing between the model's outputs for it)."""
    assigns = any(isinstance(n, ast.Name) and n.id == "logits" and isinstance(n.ctx, ast.Store) for n in ast.walk(stmt))
    reads = any(isinstance(n, ast.Name) and n.id == "outputs" and isinstance(n.ctx, ast.Load) for n in ast.walk(stmt))
    return assigns and reads


def _is_cp_branch(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.If) and "self.cp_size" in ast.unparse(stmt.test)


def worker_lines(method: ast.FunctionDef) -> list[ast.stmt] | None:
    """The statements of ``method`` from the one that takes ``logits`` from the model's ``outputs``
    up to (not including) its ``if self.cp_size > 1:`` (where the log-prob call's branches start):
    whatever the worker does to the logits in between, the temperature among it. None if absent."""
    for node in ast.walk(method):
        for field in ("body", "orelse", "finalbody"):
            body = getattr(node, field, None)
            if not isinstance(body, list):
                continue
            for i, stmt in enumerate(body):
                if isinstance(stmt, ast.stmt) and _reads_outputs_into_logits(stmt):
                    # (a block around it reads and assigns them too: the search goes on inside)
                    j = next((j for j in range(i + 1, len(body)) if _is_cp_branch(body[j])), None)
                    if j is not None:
                        return body[i:j]
                    break
    return None


class DTensorWorkerLines:
    """NeMo-RL's DTensor worker's own lines between its model's output and the log-prob call, for
    one of its calls (``train`` or ``get_logprobs``), compiled alone from the worker's file (path
    and line numbers kept) as a function of ``(self, outputs)`` returning ``logits``, with the
    worker's methods those lines call (``self._apply_temperature_scaling`` where the commit has it)
    compiled alone too. Every other name they read is bound as the worker file's imports bind it
    (a NeMo-RL module the checkout cannot import here: the definition compiled alone from its own
    file). What the commit's worker does to the logits (divide by the temperature or not) is what
    runs; nothing of it is shardcheck's."""

    def __init__(self, src: Path, call: str, import_module: Callable[[str], Any]) -> None:
        self.src, self.call, self._import_module = src, call, import_module
        path = next((p for p in WORKER_FILES if (src / p).is_file()), None)
        if path is None:
            raise LookupError(f"no DTensor policy worker ({' or '.join(map(str, WORKER_FILES))})")
        self.file = path
        tree = ast.parse((src / path).read_text(), filename=str(src / path))
        # the class defining the call (DTensorPolicyWorker; DTensorPolicyWorkerImpl at newer commits)
        cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and any(
            isinstance(f, ast.FunctionDef) and f.name == call for f in n.body)), None)
        if cls is None:
            raise LookupError(f"{path}: no class with a method {call}")
        self.cls_name = cls.name
        methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
        lines = worker_lines(methods[call])
        if lines is None:
            raise LookupError(f"{path}: {cls.name}.{call} has no 'logits = outputs...' followed by "
                              "'if self.cp_size > 1:' in one block")
        self.lines = (lines[0].lineno, lines[-1].end_lineno or lines[-1].lineno)
        helpers: dict[str, ast.FunctionDef] = {}
        todo = set().union(*(_self_calls(s) for s in lines))
        while todo:
            name = todo.pop()
            if name in helpers:
                continue
            if name not in methods:
                raise LookupError(f"{path}: {cls.name}.{call}'s lines call self.{name}, which {cls.name} lacks")
            helpers[name] = methods[name]
            todo |= _self_calls(methods[name])
        self.helpers = sorted(helpers)
        last = lines[-1]
        ret = ast.Return(value=ast.Name(id="logits", ctx=ast.Load()))
        ast.copy_location(ret, last)
        ret.end_lineno, ret.end_col_offset = last.end_lineno, last.end_col_offset
        fn = ast.FunctionDef(name=f"_{call}_lines", args=ast.arguments(
            posonlyargs=[], args=[ast.arg(arg="self"), ast.arg(arg="outputs")], kwonlyargs=[], kw_defaults=[],
            defaults=[]), body=[*lines, ret], decorator_list=[], returns=None, type_params=[])
        ast.copy_location(fn, lines[0])
        for h in helpers.values():
            h.decorator_list = []
        klass = ast.ClassDef(name=cls.name, bases=[], keywords=[], body=[fn, *helpers.values()],
                             decorator_list=[], type_params=[])
        ast.copy_location(klass, lines[0])
        self._module = ast.fix_missing_locations(ast.Module(body=[klass], type_ignores=[]))
        self._tree, self._path = tree, src / path
        self._cls: Any = None
        self.bound: dict[str, str] = {}

    def _bind(self) -> type:
        import __future__
        import builtins
        import importlib
        import symtable

        from shardcheck.targets.compiled import names_read

        table = symtable.symtable("from __future__ import annotations\n" + ast.unparse(self._module),
                                  str(self._path), "exec")
        reads: set[str] = set()
        for child in table.get_children():
            reads |= names_read(child)
        reads -= set(dir(builtins))
        package = ".".join(self.file.with_suffix("").parts[:-1])
        imports = module_imports(self._tree, package)
        unknown = sorted(n for n in reads if n not in imports)
        if unknown:
            raise LookupError(f"{self.file}: the worker's lines read {', '.join(unknown)}, which the file does not "
                              "import (the adapter binds only what the file imports)")
        given: dict[str, Any] = {}
        for name in sorted(reads):
            mod_name, attr = imports[name]
            if mod_name.split(".")[0] == "nemo_rl":
                try:
                    mod = self._import_module(mod_name)
                    given[name] = mod if attr is None else getattr(mod, attr)
                    self.bound[name] = f"{mod_name}" + (f".{attr}" if attr else "")
                except Exception:  # its module imports what is not here: the definition alone, from its file
                    if attr is None:
                        raise
                    rel = Path(*mod_name.split(".")).with_suffix(".py")
                    mod_tree = ast.parse((self.src / rel).read_text())
                    inner = module_imports(mod_tree, mod_name.rpartition(".")[0])
                    ns = compile_alone(self.src / rel, [attr], {n: importlib.import_module(m) if a is None else
                                                                getattr(importlib.import_module(m), a)
                                                                for n, (m, a) in inner.items()
                                                                if m.split(".")[0] in ("os", "torch", "typing")})
                    given[name] = ns[attr]
                    self.bound[name] = f"{rel}::{attr} (compiled alone)"
            else:
                mod = importlib.import_module(mod_name)
                given[name] = mod if attr is None else getattr(mod, attr)
                self.bound[name] = f"{mod_name}" + (f".{attr}" if attr else "")
        namespace: dict[str, Any] = {"__name__": "shardcheck_nemo_rl_dtensor_worker", "__file__": str(self._path),
                                     **given}
        code = compile(self._module, str(self._path), "exec", flags=__future__.annotations.compiler_flag,
                       dont_inherit=True)
        exec(code, namespace)  # noqa: S102 - NeMo-RL's own worker lines, from its file
        return namespace[self.cls_name]

    def __call__(self, model_output: torch.Tensor, attributes: dict[str, Any]) -> torch.Tensor:
        """The worker's lines on ``outputs.logits = model_output``, on an object holding what its
        ``__init__`` sets that they read (``attributes``); the logits they leave."""
        import types

        if self._cls is None:
            self._cls = self._bind()
        worker = object.__new__(self._cls)
        vars(worker).update(attributes)
        return getattr(worker, f"_{self.call}_lines")(types.SimpleNamespace(logits=model_output))

    def forget(self) -> None:
        """Drop what was bound from the checkout's modules (the target's release)."""
        self._cls, self.bound = None, {}

    def describe(self) -> str:
        helpers = "".join(f", {self.cls_name}.{h}" for h in self.helpers)
        return (f"{self.file}:{self.lines[0]}-{self.lines[1]} ({self.cls_name}.{self.call}: from the model's output "
                f"to 'if self.cp_size > 1'){helpers}, compiled alone")


# ---- the DTensor worker's own DeviceMesh, from its __init__ -----------------------------------

MESH_ROLES = {"tp_mesh": "tp", "cp_mesh": "cp", "dp_mesh": "dp", "dp_cp_mesh": "dp_cp"}


def _is_mesh_init(stmt: ast.stmt) -> str | None:
    """The name ``stmt`` binds to ``...init_device_mesh(...)``, or None."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and isinstance(stmt.value, ast.Call)):
        return None
    func = stmt.value.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    return stmt.targets[0].id if name == "init_device_mesh" else None


def _slices_mesh(stmt: ast.stmt, mesh: str) -> bool:
    """``self.X = <mesh>[...]``, ``self.a, self.b = (<mesh>["a"], <mesh>["b"])``,
    ``self.X = <mesh>[...]._flatten(...)``, ``self.device_mesh = <mesh>``: an assignment to the
    worker's attributes whose value reads nothing but the mesh (and calls nothing but _flatten)."""
    if not isinstance(stmt, ast.Assign):
        return False
    targets = [t for target in stmt.targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
    if not all(isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
               for t in targets):
        return False
    names = {n.id for n in ast.walk(stmt.value) if isinstance(n, ast.Name)}
    calls = [n for n in ast.walk(stmt.value) if isinstance(n, ast.Call)]
    return names == {mesh} and all(isinstance(c.func, ast.Attribute) and c.func.attr == "_flatten" for c in calls)


class _DeviceType(ast.NodeTransformer):
    """The literal "cuda" that init_device_mesh is handed, as the name ``device_type``."""

    def visit_Call(self, node: ast.Call) -> ast.Call:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name == "init_device_mesh" and node.args and isinstance(node.args[0], ast.Constant) \
                and node.args[0].value == "cuda":
            node.args[0] = ast.copy_location(ast.Name(id="device_type", ctx=ast.Load()), node.args[0])
        return node


class DTensorWorkerMesh:
    """NeMo-RL's DTensor worker's own DeviceMesh statements, taken alone out of its ``__init__``
    (path and line numbers kept): ``device_mesh = torch.distributed.device_mesh.init_device_mesh(
    "cuda", (dp_size, cp_size, tp_size), mesh_dim_names=("dp", "cp", "tp"))`` and the statements
    after it that set the worker's meshes from it and nothing else (``self.dp_cp_mesh =
    device_mesh[("dp", "cp")]._flatten(mesh_dim_name="dp_cp")``, ``self.dp_mesh, self.tp_mesh,
    self.cp_mesh = ...``, ``self.device_mesh = device_mesh``). Run as a function of ``(self,
    dp_size, cp_size, tp_size, device_type)``: the one change is the literal "cuda", which becomes
    the world's device type (the logits'), so that a CPU gloo world builds the same mesh on "cpu".
    The LOCAL_RANK juggling around the call is not taken: it exists for Ray's one visible GPU per
    worker (torch sets the device from LOCAL_RANK only where none is set yet), and the harness has
    set each rank's device before; kept, it would need LOCAL_RANK set and could move a rank that
    had none set onto GPU 0."""

    def __init__(self, src: Path) -> None:
        path = next((p for p in WORKER_FILES if (src / p).is_file()), None)
        if path is None:
            raise LookupError(f"no DTensor policy worker ({' or '.join(map(str, WORKER_FILES))})")
        self.file, self._path = path, src / path
        self._tree = ast.parse(self._path.read_text(), filename=str(self._path))
        found = None
        for cls in (n for n in self._tree.body if isinstance(n, ast.ClassDef)):
            init = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
            found = found or (self._statements(init) if init is not None else None)
            if found:
                self.cls_name = cls.name
                break
        if not found:
            raise LookupError(f"{path}: no __init__ with 'NAME = ...init_device_mesh(...)' followed by the "
                              "worker's meshes taken from it")
        self.statements = found
        self.lines = [s.lineno for s in found]
        self.attributes = sorted({t.attr for s in found[1:] for target in s.targets  # type: ignore[attr-defined]
                                  for t in (target.elts if isinstance(target, ast.Tuple) else [target])})
        body = [_DeviceType().visit(s) for s in found]
        ret = ast.Return(value=ast.Constant(value=None))
        ast.copy_location(ret, found[-1])
        args = [ast.arg(arg=a) for a in ("self", "dp_size", "cp_size", "tp_size", "device_type")]
        fn = ast.FunctionDef(name="_device_mesh_lines", args=ast.arguments(
            posonlyargs=[], args=args, kwonlyargs=[], kw_defaults=[], defaults=[]), body=[*body, ret],
            decorator_list=[], returns=None, type_params=[])
        ast.copy_location(fn, found[0])
        self._module = ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[]))
        self._fn: Any = None

    @staticmethod
    def _statements(init: ast.FunctionDef) -> list[ast.stmt] | None:
        for node in ast.walk(init):
            body = getattr(node, "body", None)
            if not isinstance(body, list):
                continue
            for i, stmt in enumerate(body):
                mesh = _is_mesh_init(stmt) if isinstance(stmt, ast.stmt) else None
                if mesh is not None:
                    rest = [s for s in body[i + 1:] if _slices_mesh(s, mesh)]
                    return [stmt, *rest] if rest else None
        return None

    def _function(self) -> Callable[..., None]:
        if self._fn is None:
            import importlib
            import symtable

            from shardcheck.targets.compiled import names_read

            table = symtable.symtable(ast.unparse(self._module), str(self._path), "exec")
            reads = set().union(*(names_read(child) for child in table.get_children()))
            package = ".".join(self.file.with_suffix("").parts[:-1])
            imports = module_imports(self._tree, package)
            given: dict[str, Any] = {}
            for name in sorted(reads):
                if name not in imports or imports[name][0].split(".")[0] != "torch":
                    raise LookupError(f"{self.file}: the worker's mesh statements read {name}, which is not one of "
                                      "the file's torch imports")
                mod_name, attr = imports[name]
                mod = importlib.import_module(mod_name)
                given[name] = mod if attr is None else getattr(mod, attr)
            namespace: dict[str, Any] = {"__name__": "shardcheck_nemo_rl_dtensor_worker_mesh",
                                         "__file__": str(self._path), **given}
            exec(compile(self._module, str(self._path), "exec", dont_inherit=True), namespace)  # noqa: S102
            self._fn = namespace["_device_mesh_lines"]
        return self._fn

    def build(self, dp_size: int, cp_size: int, tp_size: int, device_type: str) -> dict[str, Any]:
        """What the statements set on the worker (``device_mesh``, ``tp_mesh``, ...), run with
        these sizes on ``device_type``: collective (every rank of the world, in the same order)."""
        import types

        worker = types.SimpleNamespace()
        self._function()(worker, dp_size, cp_size, tp_size, device_type)
        return vars(worker)

    @staticmethod
    def roles(built: dict[str, Any]) -> dict[str, Any]:
        """The harness's role of each mesh the worker keeps (tp, cp, dp, dp_cp)."""
        return {role: built[attr].get_group() for attr, role in MESH_ROLES.items() if attr in built}

    def forget(self) -> None:
        self._fn = None

    def describe(self) -> str:
        return (f"{self.file}:{self.lines[0]}-{self.statements[-1].end_lineno} ({self.cls_name}.__init__, lines "
                f"{', '.join(map(str, self.lines))}: init_device_mesh and {', '.join(self.attributes)}), compiled "
                "alone; the literal \"cuda\" given to init_device_mesh is the world's device type; the LOCAL_RANK "
                "juggling around it (Ray's one visible GPU per worker) not taken")
