"""SkyRL's own data path for its Megatron backend, from the target's checkout.

What SkyRL's trainer does to a rollout batch before its model and loss see it:

- ``convert_prompts_responses_to_batch_tensors`` (``skyrl/train/dataset/preprocess.py``): the
  ``sequences`` ``[B, S]``, every sample's prompt and response in one left-padded block (pad id 0;
  before b059319cf the prompts left-padded and the responses right-padded), its
  ``attention_mask`` and the response-level mask ``[B, max response]`` that says which of the
  loss's ``num_actions`` columns hold a sample's response tokens (right-aligned since b059319cf);
- with ``remove_microbatch_padding`` (before 861e005b4 ``use_sample_packing``; SkyRL's default):
  ``preprocess_packed_seqs`` (``megatron_utils.py``), every sequence padded at its end to the
  packing alignment (``get_packed_seq_align_size``: tp, 2*tp*cp under CP), cut into zigzag chunks
  r and 2cp-1-r, CP rank and sizes read from megatron-core's ``parallel_state``; the packed
  targets by ``_build_packed_targets`` (``megatron_model_wrapper.py``, since 861e005b4); before
  861e005b4 the model's packed output went back to the batch's layout, gathered over CP, through
  ``postprocess_packed_seqs``;
- without it (bshd, cp = 1): the model sees ``remove_left_padding``'s rows and hands the loss
  ``recover_left_padding``'s, the batch's own left-padded ``[B, S]`` layout: that is the layout
  here (the model's round trip is not the code checked).

These functions are compiled alone from their files (:mod:`shardcheck.targets.compiled`): their
modules import loguru, jaxtyping, omegaconf, ray and SkyRL's config stack. Nothing of SkyRL's is
wrapped, cast or patched; what its functions raise propagates.
"""

from __future__ import annotations

import ast
import logging
import math
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardcheck.scenarios.scenario import Scenario
from shardcheck.targets.base import Knob, Rollout
from shardcheck.targets.compiled import compile_alone, with_newer_fields

MEGATRON = Path("skyrl/backends/skyrl_train/distributed/megatron")
MEGATRON_UTILS = MEGATRON / "megatron_utils.py"
PACKING_UTILS = MEGATRON / "packing_utils.py"
WRAPPER = Path("skyrl/backends/skyrl_train/workers/megatron/megatron_model_wrapper.py")
PREPROCESS = Path("skyrl/train/dataset/preprocess.py")
# SkyRL's functions: the batch (preprocess.py), its packing and unpacking (megatron_utils.py), the
# packed targets (the wrapper)
BATCH, PACK, UNPACK, TARGETS = ("convert_prompts_responses_to_batch_tensors", "preprocess_packed_seqs",
                                "postprocess_packed_seqs", "_build_packed_targets")
ALIGNMENT = ("get_packed_seq_align_size", "get_unpacked_seq_align_size")  # packing_utils.py
# what the batch function reads only on the routed-expert (MoE replay) branch, which a rollout
# without expert indices never takes
ROUTED_EXPERTS = ("compact_routed_expert_indices", "make_replay_padding_indices_np")

ALLGATHER_WHY = ("SkyRL's CP is zigzag (2*cp load-balanced chunks per sequence, preprocess_packed_seqs): it has no "
                 "all-gather CP layout")


def top_level(src: Path, rel: Path) -> dict[str, ast.FunctionDef | ast.ClassDef]:
    """The top-level functions and classes of one of the checkout's files (none where it is absent)."""
    path = src / rel
    if not path.is_file():
        return {}
    tree = ast.parse(path.read_text(), filename=str(path))
    return {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def keywords_passed(fn: ast.AST, callee: str) -> set[str]:
    """The keyword arguments ``fn``'s body passes to calls of ``callee`` (by its plain name)."""
    return {k.arg for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
            and n.func.id == callee for k in n.keywords if k.arg}


def _bool(value: Any) -> str | None:
    return None if isinstance(value, bool) else f"must be true or false, got {value!r}"


class SkyRLDataPath:
    """SkyRL's batch and packing (thd, zigzag) or its padded batch (bshd, cp = 1), on the rollout."""

    name = f"{PREPROCESS}:{BATCH} -> {MEGATRON_UTILS}:{PACK}"

    def __init__(self, src: Path) -> None:
        self.src = src
        utils, preprocess = top_level(src, MEGATRON_UTILS), top_level(src, PREPROCESS)
        pack = utils[PACK]
        self.pack_params = [a.arg for a in pack.args.args]
        self.batch_params = [a.arg for a in preprocess[BATCH].args.args]
        self.has_unpack = UNPACK in utils
        self.has_targets = TARGETS in top_level(src, WRAPPER)
        self.batch_helpers = [n for n in ("_verify_inputs", "_reward_to_numpy") if n in preprocess]
        self.params_passed = keywords_passed(pack, "PackedSeqParams")
        # PackedSeqParams keywords the installed megatron-core lacks (known once compiled, on a rank)
        self.newer_fields: list[str] = []
        self._compiled: dict[str, Any] | None = None

    # ---- what the checkout offers --------------------------------------------------------

    def knobs(self) -> dict[str, Knob]:
        if "fp8_enabled" not in self.pack_params:
            return {}
        return {"fp8_enabled": Knob(False, "FP8 (megatron fp8 set): every packed sequence padded to lcm(the "
                                           "alignment, 16*cp) (get_packed_seq_align_size)", _bool)}

    def builds(self, scenario: Scenario) -> str | None:
        # bshd under CP is no scenario (and no SkyRL configuration: remove_left_padding asserts cp_size == 1)
        return ALLGATHER_WHY if scenario.layout == "allgather" else None

    # ---- SkyRL's functions -----------------------------------------------------------------

    def _functions(self) -> dict[str, Any]:
        if self._compiled is None:
            import dataclasses

            from megatron.core import parallel_state as mpu
            from megatron.core.packed_seq_params import PackedSeqParams

            self.newer_fields = sorted(self.params_passed - {f.name for f in dataclasses.fields(PackedSeqParams)})

            # the alignment rule's own file since 3c96b381f (inline in preprocess_packed_seqs before)
            align = (compile_alone(self.src / PACKING_UTILS, ALIGNMENT, {"math": math})
                     if (self.src / PACKING_UTILS).is_file() else {})
            params = with_newer_fields(PackedSeqParams, self.newer_fields)
            given = {"torch": torch, "mpu": mpu, "PackedSeqParams": params,
                     **{n: align[n] for n in align if n in ALIGNMENT}}
            out = compile_alone(self.src / MEGATRON_UTILS, [PACK] + ([UNPACK] if self.has_unpack else []), given)
            out.update(compile_alone(self.src / PREPROCESS, [BATCH, *self.batch_helpers],
                                     {"np": np, "torch": torch, "logger": logging.getLogger("skyrl.preprocess")},
                                     off_path=ROUTED_EXPERTS))
            if self.has_targets:
                out.update(compile_alone(self.src / WRAPPER, [TARGETS], {"torch": torch}))
            self._compiled = out
        return self._compiled

    def batch(self, rollout: Rollout) -> dict[str, torch.Tensor]:
        """SkyRL's training batch for the rollout: ``sequences`` [B, S], ``attention_mask`` [B, S]
        (bool, as the forward step casts it), ``response_mask`` and ``loss_mask`` [B, num_actions],
        on the rollout's device (the forward step moves the batch there)."""
        prompts = [t[: total - response].tolist()
                   for t, total, response in zip(rollout.tokens, rollout.total_lengths, rollout.response_lengths)]
        responses = [t[total - response:].tolist()
                     for t, total, response in zip(rollout.tokens, rollout.total_lengths, rollout.response_lengths)]
        # pad id 0 (the position trace reads 0 as padding); before b059319cf SkyRL read it from a tokenizer
        pad = types.SimpleNamespace(pad_token_id=0) if self.batch_params[0] == "tokenizer" else 0
        out = self._functions()[BATCH](pad, prompts, responses, [[0.0] * len(r) for r in responses],
                                       [m.tolist() for m in rollout.loss_masks])
        device = rollout.tokens[0].device
        sequences, attention_mask, response_mask = out[0], out[1], out[2]
        # the response-level loss mask [B, num_actions] (float32, in the response mask's columns): what
        # SkyRL's loss_func reads as its batch's loss_mask
        return {"sequences": sequences.to(device), "attention_mask": attention_mask.to(device=device, dtype=torch.bool),
                "response_mask": response_mask.to(device), "loss_mask": out[4].to(device)}

    def pack(self, batch: dict[str, torch.Tensor], knobs: dict[str, Any]) -> tuple[torch.Tensor, Any]:
        """``preprocess_packed_seqs`` on the batch: this rank's packed ``input_ids`` [1, T/cp] and
        the PackedSeqParams (``cu_seqlens_q_padded``: every sequence's padded bounds)."""
        kwargs = {k: v for k, v in knobs.items() if k in self.pack_params}
        return self._functions()[PACK](batch["sequences"], batch["attention_mask"], pre_process=True, **kwargs)

    def packed_targets(self, batch: dict[str, torch.Tensor], params: Any) -> torch.Tensor:
        """``_build_packed_targets``: the whole packed stream's token ids [1, T] (not CP-split, not rolled)."""
        return self._functions()[TARGETS](batch["sequences"], batch["attention_mask"], params)

    def unpack(self, output: torch.Tensor, params: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``postprocess_packed_seqs`` (before 861e005b4): the packed model output back in the batch's
        [B, S] layout, gathered over CP (the other ranks' rows detached)."""
        mask = batch["attention_mask"]
        return self._functions()[UNPACK](output, params, mask, mask.shape[0], mask.shape[1], post_process=True)

    def local_tokens(self, rollout: Rollout) -> torch.Tensor:
        batch = self.batch(rollout)
        if rollout.layout == "bshd":
            return batch["sequences"]
        return self.pack(batch, rollout.knobs)[0]

    def release(self) -> None:
        """Drop the compiled functions (they hold megatron's parallel_state of this process)."""
        self._compiled = None
