"""NeMo-RL's DTensor worker's context-parallel path (``nemo_rl:dtensor`` at cp > 1).

The data path: NeMo-RL's DTensor worker (``nemo_rl/models/policy/workers/dtensor_policy_worker.py``,
``train`` and ``get_logprobs``) hands the model a padded ``[B, S]`` micro-batch (right-padded, S the
longest sequence rounded up to ``policy.make_sequence_length_divisible_by``) and shards it over CP
with torch's own ``context_parallel(cp_mesh, buffers=[input_ids, position_ids, seq_index],
buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers))`` (its ``create_context_parallel_ctx``;
V2 does the same through nemo_automodel). torch load-balances (head-tail: rank r holds chunks r and
2cp-1-r) when ``S % (2 cp) == 0`` and shards contiguously otherwise, silently. That call runs here
as the worker makes it, on megatron-core's CP group (the harness's), so the position trace learns
the rows.

The call (:func:`cp_logprobs`): as the worker's ``train`` does after the forward,
``seq_index = DTensor.from_local(seq_index, cp_mesh, [Shard(1)]).full_tensor().squeeze(0)``, the
sharded ``input_ids`` re-wrapped as a DTensor on the cp mesh, the logits
``DTensor.from_local(local, mesh[("cp", "tp")], [Shard(1), Shard(-1)])``, then
``prepare_loss_input``'s ``get_next_token_logprobs_from_logits(input_ids, logits, seq_index,
sampling_params, chunk_size)``: its DTensor branch, ``get_logprobs_from_vocab_parallel_logits`` ->
``dtensor_from_parallel_logits_to_logprobs``, which gathers the log-probs over CP itself
(``full_tensor()``, un-permuted with ``argsort(seq_index)``): every CP rank returns ``[B, S - 1]``
in natural order. The worker's next line before backward, ``loss *= dp_size * cp_size``
(dtensor_policy_worker.py:958; ``automodel/train.py``: ``result * dp_size * cp_size``), is
applied to the log-probs' gradient (dp 1 here): ``full_tensor()``'s backward keeps each rank's own
slice (no sum over CP), which that line and FSDP's average over dp x cp make a sum.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from shardcheck.scenarios.scenario import Scenario
from shardcheck.targets.base import Knob, Rollout, positive_int_or_none

WORKER_FILE = Path("nemo_rl/models/policy/workers/dtensor_policy_worker.py")
# the worker's line between its loss and backward (V1; V2: nemo_rl/models/automodel/train.py)
WORKER_LOSS_SCALE = "loss *= self.dp_size * self.cp_size"


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def divisible_by(knobs: dict[str, Any], tp: int, cp: int) -> int:
    """policy.make_sequence_length_divisible_by: the knob, else tp * 2 cp (what NeMo-RL's DTensor
    CP recipes set: dapo-qwen2.5-7b.v2.yaml, distillation_math.yaml)."""
    given = knobs.get("make_sequence_length_divisible_by")
    return given if given is not None else tp * (2 * cp if cp > 1 else 1)


def padded_width(totals: list[int], knobs: dict[str, Any], tp: int, cp: int) -> int:
    return _round_up(max(totals), divisible_by(knobs, tp, cp))


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

    def shard(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's (input_ids, position_ids, seq_index) after the worker's context_parallel:
        [B, S_local], [B, S_local], [1, S_local]."""
        from megatron.core import parallel_state as mpu
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.experimental import context_parallel

        tp, cp = mpu.get_tensor_model_parallel_world_size(), mpu.get_context_parallel_world_size()
        width = padded_width(rollout.total_lengths, rollout.knobs, tp, cp)
        device = rollout.tokens[0].device
        input_ids = torch.zeros(len(rollout.tokens), width, dtype=rollout.tokens[0].dtype, device=device)
        for i, tokens in enumerate(rollout.tokens):
            input_ids[i, : tokens.numel()] = tokens
        # the worker's buffers (dtensor_policy_worker.py train / get_logprobs)
        position_ids = torch.arange(width, device=device).repeat(len(rollout.tokens), 1)
        seq_index = torch.arange(width, device=device).repeat(1, 1)
        buffers = [input_ids, position_ids, seq_index]
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


CALLS = ("train", "get_logprobs")


def cp_logprobs(mod: Any, path: NemoRLDTensorDataPath, logits: torch.Tensor, inputs: Any,
                chunk: int | None, sampling: Any, call: str = "train") -> list[torch.Tensor]:
    """Per sample, every response token's log-prob (gathered over CP by NeMo-RL), as the worker's
    train step computes them on this rank (``call="train"``: prepare_loss_input's
    get_next_token_logprobs_from_logits, which drops chunk_size on this branch) or as its
    get_logprobs does (``"get_logprobs"``: get_logprobs_from_vocab_parallel_logits with
    chunk_size, the logits uncast; with grad enabled here, so inference_only=False)."""
    from torch.distributed.tensor import DTensor, Shard

    input_ids, _, seq_index = path.shard(inputs.rollout.to(logits.device))
    mesh = cp_tp_mesh(inputs.cp_group, inputs.tp_group, logits.device.type)
    cp_mesh = mesh["cp"]
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


def sampling_reason(scenario: Scenario, chunked: bool = False) -> str | None:
    """Why NeMo-RL's top-k/top-p DTensor path cannot take this CP scenario: its
    DistributedLogprobWithSampling all-to-alls the B * S_local rows over tp (a ValueError
    otherwise, asking for make_sequence_length_divisible_by = tp)."""
    if scenario.tp == 1:
        return None
    knobs = dict(scenario.layout_knobs)
    totals = [s.total for s in scenario.samples]
    width = padded_width(totals, knobs, scenario.tp, scenario.cp)
    rows = len(totals) * (width // scenario.cp)
    if width % scenario.cp == 0 and rows % scenario.tp:
        return (f"NeMo-RL's top-k/top-p path needs B*S_local={rows} local rows divisible by tp={scenario.tp} "
                f"(make_sequence_length_divisible_by={divisible_by(knobs, scenario.tp, scenario.cp)} pads S to "
                f"{width}; NeMo-RL raises a ValueError asking for a multiple of tp)")
    chunk = scenario.log_probs_chunk_size
    if chunked and chunk > 0 and (chunk * len(totals)) % scenario.tp:
        return (f"NeMo-RL's chunked top-k/top-p path needs chunk_size*B={chunk * len(totals)} divisible by "
                f"tp={scenario.tp} (ChunkedDistributedLogprobWithSampling raises otherwise)")
    return None
