"""ms-swift's Megatron GRPO forward path, compiled from a checkout: what ``--target ms_swift`` runs.

``MegatronGRPOTrainer.forward_step`` (swift/megatron/trainers/grpo_trainer.py) is compiled alone
with what it calls, every piece from its own file: ``prepare_batch`` and
``get_batch_on_this_pp_rank`` (the label roll) and ``reconstruct_tensor_cp`` (the CP gather)
from swift/megatron/trainers/utils.py, ``get_packed_seq_params`` from swift/megatron/utils/utils.py
and swift/utils/transformers_utils.py, ``get_batch_on_this_cp_rank`` from
swift/megatron/utils/megatron_lm_utils.py, ``pad_logps_back_to_batch`` and
``build_completion_mask_and_seq_lengths`` from swift/rlhf_trainers/utils.py, ``to_device`` from
swift/utils/torch_utils.py; ``compute_logps_and_entropy_from_logits`` is its module
(swift/megatron/trainers/vocab_parallel_utils.py: torch and megatron-core alone) imported as it is.
Their modules import ms-swift's whole stack (transformers, peft, datasets, accelerate), which a
shardcheck environment does not have.

The CP split is mcore-bridge's ``split_cp_inputs`` (a package of modelscope's own), compiled from
an mcore-bridge checkout where one is given (``--target-opt mcore_bridge=DIR`` or
SHARDCHECK_MCORE_BRIDGE_SRC), its ``torch.tensor(..., pin_memory=True).cuda()`` index left on the
CPU on a CPU world (a device move, the values unchanged); without one, the harness's zigzag split
of each ``cu_seqlens`` segment stands in for it (the same chunks r and 2c-1-r), said in the report.

What is written here, not run from ms-swift: the collator's output (template/base.py
``_data_collator``: the prompt's labels -100, each sample padded to a multiple of 2 * cp with
``_handle_megatron_cp``, packed with ``packing_row``'s position ids, or right-padded with its 4-D
causal mask without padding_free), the model (the harness's logits for the tokens ms-swift's
``prepare_batch`` hands it, checked to be the harness's rows), the NPU probe (False) and the
profiling decorator (its wrapper only times the call).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from shardcheck.targets.areal_data import compile_methods
from shardcheck.targets.compiled import compile_alone
from shardcheck.targets.cpu_stand_ins import tensor_cuda_stays

GRPO_FILE = Path("swift/megatron/trainers/grpo_trainer.py")
TRAINER_UTILS = Path("swift/megatron/trainers/utils.py")
VOCAB_FILE = Path("swift/megatron/trainers/vocab_parallel_utils.py")
MEGATRON_UTILS = Path("swift/megatron/utils/utils.py")
MEGATRON_LM_UTILS = Path("swift/megatron/utils/megatron_lm_utils.py")
RLHF_UTILS = Path("swift/rlhf_trainers/utils.py")
TRANSFORMERS_UTILS = Path("swift/utils/transformers_utils.py")
TORCH_UTILS = Path("swift/utils/torch_utils.py")
BRIDGE_FILE = Path("src/mcore_bridge/utils/megatron_utils.py")
VOCAB_MODULE = "swift.megatron.trainers.vocab_parallel_utils"
FILES = (GRPO_FILE, TRAINER_UTILS, VOCAB_FILE, MEGATRON_UTILS, MEGATRON_LM_UTILS, RLHF_UTILS)
# forward_step's routing-replay branches (enable_routing_replay is False: MoE router replay is off)
ROUTING = ("RouterReplayHelper", "RouterReplayAction", "set_router_replay_data", "GRPOBatch")


class _TorchWithoutPinning:
    """torch, but for ``torch.tensor(..., pin_memory=True)``: not pinned (a CPU world has no
    accelerator to pin for). Only split_cp_inputs's index goes through it, on a CPU world."""

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch, name)

    @staticmethod
    def tensor(*args: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
        import torch

        return torch.tensor(*args, **kwargs)


def harness_split() -> Callable[..., Any]:
    """Without an mcore-bridge checkout: split_cp_inputs's zigzag, as the harness lays it out
    (scenarios/layout.py zigzag_positions): chunks r and 2c-1-r of each cu_seqlens segment."""
    import torch
    from megatron.core import parallel_state as mpu

    from shardcheck.scenarios.layout import zigzag_positions

    def split_cp_inputs(inputs: Any, cu_seqlens: Any, dim: int, **kwargs: Any) -> Any:
        if kwargs:
            raise ValueError(f"the harness's split stands in for split_cp_inputs's zigzag only, not {kwargs}")
        dim = dim % inputs.ndim
        cp, rank = mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank()
        bounds = [0, inputs.shape[dim]] if cu_seqlens is None else [int(c) for c in cu_seqlens]
        picked = [torch.arange(a + r.start, a + r.stop) for a, b in zip(bounds, bounds[1:])
                  for r in zigzag_positions(b - a, cp, rank)]
        return inputs.index_select(dim, torch.cat(picked).to(inputs.device))

    return split_cp_inputs


@dataclass
class Collated:
    """What ms-swift's collator hands the trainer for one micro-batch (the model inputs) and what
    its collate_to_grpo_micro_batch derives from them (completion mask, sequence lengths)."""

    model_inputs: dict[str, Any]
    completion_mask: Any
    seq_lengths: Any


class GrpoForwardPath:
    """forward_step and its callees from a checkout (and split_cp_inputs from an mcore-bridge
    one, or the harness's stand-in): built once per target, run per rank call."""

    def __init__(self, src: Path, vocab_module: Any, bridge: Path | None) -> None:
        import torch
        from megatron.core import parallel_state as mpu
        from megatron.core.packed_seq_params import PackedSeqParams

        self.src, self.bridge = src, bridge
        npu = lambda: False  # noqa: E731 - transformers' is_torch_npu_available: no NPU here
        self._device: Any = None
        to_device = compile_alone(src / TORCH_UTILS, ["to_device"], {"Mapping": Mapping, "torch": torch})["to_device"]
        inner = compile_alone(src / TRANSFORMERS_UTILS, ["get_packed_seq_params"], {"torch": torch})
        packed = compile_alone(src / MEGATRON_UTILS, ["get_packed_seq_params"], {
            "torch": torch, "PackedSeqParams": PackedSeqParams, "is_torch_npu_available": npu,
            "_get_packed_seq_params": inner["get_packed_seq_params"]})["get_packed_seq_params"]
        self.bridge_split = self._bridge_split(bridge) if bridge is not None else None
        self.cp = compile_alone(src / MEGATRON_LM_UTILS, ["get_batch_on_this_cp_rank"], {
            "mpu": mpu, "is_torch_npu_available": npu, "split_cp_inputs": self._split})
        self.utils = compile_alone(src / TRAINER_UTILS, ["get_batch_on_this_pp_rank", "prepare_batch",
                                                         "reconstruct_tensor_cp"], {
            "torch": torch, "mpu": mpu, "to_device": to_device, "get_current_device": lambda: self._device,
            "get_packed_seq_params": packed, "get_batch_on_this_cp_rank": self.cp["get_batch_on_this_cp_rank"],
            # NPU only: the attention-mask branch for Ascend devices is never taken here
            "_should_use_npu_generated_attention_mask": lambda args: False},
            off_path=["_prepare_npu_generated_attention_mask", "_NPU_ATTENTION_MASK_2D_MODEL_TYPES"])
        self.rlhf = compile_alone(src / RLHF_UTILS, ["pad_logps_back_to_batch", "build_completion_mask_and_seq_lengths"],
                                  {"torch": torch, "get_packed_seq_params": inner["get_packed_seq_params"]},
                                  off_path=["get_cu_seqlens_from_position_ids"])
        given = {"mpu": mpu, "partial": functools.partial, "torch": torch,
                 "compute_logps_and_entropy_from_logits": vocab_module.compute_logps_and_entropy_from_logits,
                 "reconstruct_tensor_cp": self.utils["reconstruct_tensor_cp"],
                 "pad_logps_back_to_batch": self.rlhf["pad_logps_back_to_batch"],
                 "profiling_decorator": lambda fn: fn}  # its wrapper times the call and logs: nothing else
        self.methods = compile_methods(src / GRPO_FILE, "MegatronGRPOTrainer", ("forward_step",), given,
                                       off_path=ROUTING)

    def _bridge_split(self, bridge: Path) -> Callable[..., Any]:
        import torch
        from megatron.core import parallel_state as mpu

        # compiled twice: with torch's pinning left out on a CPU world, with torch itself on CUDA
        fns = {on_cpu: compile_alone(bridge / BRIDGE_FILE, ["split_cp_inputs"],
                                     {"torch": _TorchWithoutPinning() if on_cpu else torch, "mpu": mpu})
               ["split_cp_inputs"] for on_cpu in (True, False)}

        def split(*args: Any, **kwargs: Any) -> Any:
            with tensor_cuda_stays(self._device):
                return fns[self._device.type == "cpu"](*args, **kwargs)

        return split

    def _split(self, *args: Any, **kwargs: Any) -> Any:
        if self.bridge_split is not None:
            return self.bridge_split(*args, **kwargs)
        return harness_split()(*args, **kwargs)

    def collate(self, tokens: list[Any], response_lengths: list[int], cp: int, padding_free: bool,
                device: Any) -> Collated:
        """template/base.py ``_data_collator`` on Megatron, written here (the template needs a
        tokenizer and ms-swift's stack): labels -100 on the prompt; with CP each sample padded to
        a multiple of 2 * cp (``_handle_megatron_cp``, pad id 0, labels -100); padding_free packs
        them with per-sample position ids (``packing_row``), else right-pads them with the
        inverted causal mask. ``seq_lens`` are the lengths before the CP padding, as there."""
        import torch

        ids, labels, real = [], [], []
        for t, r in zip(tokens, response_lengths):
            t = t.to("cpu", torch.int64)
            lab = torch.cat([torch.full((len(t) - r,), -100, dtype=torch.int64), t[len(t) - r:]])
            real.append(len(t))
            pad = math.ceil(len(t) / (2 * cp)) * 2 * cp - len(t) if cp > 1 else 0
            ids.append(torch.cat([t, torch.zeros(pad, dtype=torch.int64)]))
            labels.append(torch.cat([lab, torch.full((pad,), -100, dtype=torch.int64)]))
        if padding_free:
            inputs = {"input_ids": torch.cat(ids)[None], "labels": torch.cat(labels)[None],
                      "position_ids": torch.cat([torch.arange(len(i)) for i in ids])[None]}
        else:
            width = max(len(i) for i in ids)
            mask = torch.tril(torch.ones((len(ids), width, width), dtype=torch.bool)).view(len(ids), 1, width, width)
            for k, n in enumerate(real):
                mask[k, :, :, n:] = 0
            inputs = {"input_ids": torch.stack([torch.nn.functional.pad(i, (0, width - len(i))) for i in ids]),
                      "labels": torch.stack([torch.nn.functional.pad(x, (0, width - len(x)), value=-100)
                                             for x in labels]),
                      "position_ids": torch.stack([torch.nn.functional.pad(torch.arange(len(i)), (0, width - len(i)))
                                                   for i in ids]),
                      "attention_mask": ~mask}
        inputs["seq_lens"] = real
        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        # collate_to_grpo_micro_batch's full-sequence frame (Megatron): ms-swift's own function
        completion_mask, seq_lengths, _ = self.rlhf["build_completion_mask_and_seq_lengths"](
            inputs["labels"], len(tokens), padding_free=padding_free, encoded_batch=inputs, device=device)
        return Collated(inputs, completion_mask, seq_lengths)

    def forward_step(self, collated: Collated, args: Any, model: Callable[..., Any], temperature: float,
                     compute_entropy: bool, loss_func: Callable[..., Any] | None = None) -> tuple[Any, Any, dict]:
        """forward_step on one micro-batch: (per-token log-probs [B, S], entropy or None, the data
        its loss function is handed)."""
        device = collated.completion_mask.device
        self._device = device
        grpo_batch = SimpleNamespace(completion_mask=collated.completion_mask, seq_lengths=collated.seq_lengths)
        trainer = SimpleNamespace(
            args=args, temperature=temperature, compute_entropy=compute_entropy,
            micro_batch_size=collated.completion_mask.shape[0], enable_routing_replay=False,
            _prepare_batch=lambda data, vp_stage=None: self.utils["prepare_batch"](args, data, vp_stage=vp_stage),
            loss_func=loss_func or (lambda output_tensor, data: None))
        data = dict(collated.model_inputs, grpo_batch=grpo_batch)
        output, loss = self.methods["forward_step"](trainer, iter([data]), model)
        kept = loss.keywords["data"]
        return output, kept.get("per_token_entropy"), kept


def megatron_args(*, padding_free: bool, tp: int, cp: int) -> SimpleNamespace:
    """The MegatronArguments the path reads, at ms-swift's defaults (megatron_args.py):
    causal_lm, no pipeline, text only, cp_partition_mode zigzag, no sequence parallel."""
    return SimpleNamespace(task_type="causal_lm", pipeline_model_parallel_size=1, padding_free=padding_free,
                           is_multimodal=False, cp_partition_mode="zigzag", tensor_model_parallel_size=tp,
                           context_parallel_size=cp, sequence_parallel=False)
