"""NovaSky-AI/SkyRL's Megatron log-prob and entropy path, loaded from a source checkout:
``--target skyrl`` and ``--target skyrl:fused_lm_head``.

What is checked, from ``skyrl/backends/skyrl_train/distributed/megatron/model_utils.py``, called
as the policy's ``loss_func`` (``workers/megatron/megatron_model_wrapper.py``) calls it, with
``inference_only=False`` so that the backward is checked too:

- thd and zigzag (SkyRL's default, ``remove_microbatch_padding``): since 861e005b4
  ``from_parallel_logits_to_logprobs_packed_sequences`` on the packed, CP-split logits, with the
  packing's ``cu_seqlens_q_padded``, ``_build_packed_targets``' targets and the batch's
  ``attention_mask`` (the log-probs scattered back to the batch's columns), gathered over CP by
  ``AllGatherPackedCPTensor``; before it the model's packed output went back to the batch's layout
  through ``postprocess_packed_seqs`` (all-gathered over CP) and ``from_parallel_logits_to_logprobs``
  ran on that with ``cp_group=None``;
- bshd (``remove_microbatch_padding=False``, cp = 1: ``remove_left_padding`` asserts it):
  ``from_parallel_logits_to_logprobs`` on the batch's left-padded ``[B, S]`` layout (what
  ``recover_left_padding`` hands the loss), ``cp_group=None``;
- ``chunk_size``: the scenario's where it sets one (``ChunkedDistributedLogprob``), else None
  (SkyRL's ``logprobs_chunk_size`` unset);
- the entropy: ``vocab_parallel_entropy`` (``_VocabParallelEntropy``, the TP group from
  megatron-core's ``parallel_state``) on the same logits tensor after the log-probs, as the loss
  does, with a gradient only where the entropy is in the loss (``use_entropy_loss``:
  ``entropy_coef != 0``): per token on the packed rows (SkyRL's packed loss sums this kernel's
  values over the response rows, ``vocab_parallel_entropy_packed_sequences``), or on the
  ``[:, -num_actions - 1:-1]`` columns of the batch's layout (bshd, and thd before 861e005b4);
  chunked by the scenario's chunk size where the checkout's kernel takes one, else SkyRL's
  default (0: sized from ``vocab_entropy_chunk_memory_mb``).

``skyrl:fused_lm_head`` (``fused_lm_head_logprob=True``, 0a18dd727 on) checks the fused LM-head
kernels instead: ``from_parallel_hidden_to_logprobs(_packed_sequences)``
(``FusedLinearChunkedDistributedLogprob``, torch backend), handed the given logits as the decoder's
hidden states and an identity LM-head weight in their dtype (``x @ I = x`` exactly, and the
gradient to the hidden states is the logits' gradient), the temperature dividing that weight as
SkyRL passes it; its entropy is ``_fused_vocab_parallel_entropy_from_hidden``, a metric without
gradient: SkyRL raises NotImplementedError for it with ``use_entropy_loss``, so scenarios with
``entropy_coef != 0`` are skipped with that reason.

The rows are SkyRL's own (:mod:`shardcheck.targets.skyrl_data`): its batch
(``convert_prompts_responses_to_batch_tensors``, pad id 0) and packing (``preprocess_packed_seqs``),
learned by the position trace; ``compute`` runs the same code on the real batch and takes every
response token's log-prob from the columns SkyRL's loss takes them (``[:, -num_actions:]``, the
batch's response mask).

CP: SkyRL's gather gives every CP rank every token, its backward keeps the rank's own positions
(no all-reduce), and each rank's loss is over the whole gathered sequence, not divided by cp
(Megatron's schedule multiplies it by cp, DDP averages over DP x CP). For the gradient that is
exactly each rank's loss over the tokens its own rows score, declared as
``Definitions(loss_over="held")``: each rank returns, per sample, those tokens' log-probs (and
entropies) picked out of SkyRL's output, and the reference follows.

Temperature: SkyRL's loss divides its logits in place (``logits.div_(T)``); the adapter divides
out of place, the same values, and ``--target-opt temperature_in_place=true`` does the ``div_``
(reported then as ``input_mutated``, the caller's write).

Loading: ``model_utils.py`` is imported as SkyRL's own module from the checkout without running
any package ``__init__`` (``skyrl/__init__.py`` edits flash-attn, ``skyrl/backends/__init__.py``
imports the whole backend); the data-path functions are compiled alone from their files. The
tree moved to ``skyrl/backends/skyrl_train`` on 2026-02-15 (2c1cf9e4f); older trees are refused.
"""

from __future__ import annotations

import ast
import dataclasses
import os
from pathlib import Path
from typing import Any

from shardcheck.errors import BadInput
from shardcheck.scenarios.scenario import Scenario
from shardcheck.targets.base import Capabilities, Definitions, RankInputs, RankOutputs, TargetConfig
from shardcheck.targets.checkout import CheckoutFactory, CheckoutTarget, refuse_loss_variant
from shardcheck.targets.skyrl_data import (ALLGATHER_WHY, BATCH, MEGATRON, MEGATRON_UTILS, PACK,
                                           PREPROCESS, TARGETS, UNPACK, WRAPPER, SkyRLDataPath)
from shardcheck.targets.source import Framework, parameters

MODEL_UTILS = MEGATRON / "model_utils.py"
MODULE = "skyrl.backends.skyrl_train.distributed.megatron.model_utils"
OLD_TREE = Path("skyrl-train/skyrl_train/distributed/megatron/model_utils.py")
LOGPROBS = "from_parallel_logits_to_logprobs"
PACKED = "from_parallel_logits_to_logprobs_packed_sequences"
ENTROPY = "vocab_parallel_entropy"
FUSED = "from_parallel_hidden_to_logprobs"
FUSED_PACKED = "from_parallel_hidden_to_logprobs_packed_sequences"
FUSED_ENTROPY = "_fused_vocab_parallel_entropy_from_hidden"

# model_utils.py imports only torch and megatron-core: nothing to stub (the data path's modules,
# which import loguru, jaxtyping and more, are not imported: their functions are compiled alone)
FRAMEWORK = Framework("skyrl", "SkyRL", str(MODEL_UTILS), ("skyrl",), package_inits="skip", eager=True,
                      clone="a clone of NovaSky-AI/SkyRL")
ENV = FRAMEWORK.env

OPTIONS = {
    "loss_reduction": "skyrl:loss only: SkyRL's trainer.algorithm.loss_reduction (default token_mean: the global "
                      "batch's token mean; sequence_mean: each sample's token mean, averaged; token_mean_legacy, "
                      "seq_mean_token_sum_norm and prompt_mean, no objective the step checks, are refused)",
    "use_kl_loss": "skyrl:loss only: SkyRL's use_kl_loss (default SkyRL's, true): the KL term against reference "
                   "log-probs equal to the old log-probs (0 in value and gradient)",
    "temperature_in_place": "true: divide the given logits in place (logits.div_(T)) as SkyRL's loss_func does, "
                            "instead of out of place; the harness then reports that write as input_mutated",
}
REPLAY_WHY = ("SkyRL's Megatron loss replays no rollout keep sets: its training log-probs normalise over the "
              "whole vocabulary")
SAMPLING_WHY = "SkyRL's Megatron loss applies no top-k / top-p filter (only the temperature)"
FUSED_ENTROPY_WHY = ("SkyRL raises NotImplementedError for fused_lm_head_logprob with use_entropy_loss: its fused "
                     "entropy is a metric without gradient (entropy_coef must be 0)")


@dataclasses.dataclass(frozen=True)
class SkyRLEra:
    """What a SkyRL checkout's files offer and how its loss calls them (:func:`detect_era`)."""

    thd_path: str | None  # "packed" (861e005b4 on), "unpacked" (postprocess_packed_seqs), None: no packing
    entropy_chunk_size: bool  # the entropy function takes chunk_size
    logprobs_chunk_size: bool  # the log-prob function takes chunk_size
    batch_pad: str  # the first parameter of the batch preprocessing
    fp8_knob: bool  # the packing takes fp8_enabled
    fused_lm_head: bool  # the fused LM-head log-prob and entropy (0a18dd727 on)


def detect_era(src: Path) -> SkyRLEra:
    """What this checkout's files offer and how its loss calls them, read from the source."""
    trees = {rel: FRAMEWORK.parse(src, rel) for rel in (MODEL_UTILS, MEGATRON_UTILS, PREPROCESS, WRAPPER)}
    defs = {rel: {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))} if tree else {}
            for rel, tree in trees.items()}
    model_utils, utils = defs[MODEL_UTILS], defs[MEGATRON_UTILS]
    for rel, name in ((MODEL_UTILS, LOGPROBS), (MODEL_UTILS, ENTROPY), (MEGATRON_UTILS, PACK), (PREPROCESS, BATCH)):
        if name not in defs[rel]:
            raise BadInput(f"SkyRL at {src} has no {name} in {rel}: not a tree the skyrl target reads")
    packed = parameters(model_utils[PACKED]) if PACKED in model_utils else []
    if "attention_mask" in packed and TARGETS in defs[WRAPPER]:
        thd = "packed"  # 861e005b4 on: log-probs on the packed, CP-split logits
    elif UNPACK in utils:
        thd = "unpacked"  # before: postprocess_packed_seqs, then the bshd function
    else:
        thd = None
    return SkyRLEra(
        thd_path=thd,
        entropy_chunk_size="chunk_size" in parameters(model_utils[ENTROPY]),
        logprobs_chunk_size="chunk_size" in parameters(model_utils[LOGPROBS]),
        batch_pad=parameters(defs[PREPROCESS][BATCH])[0],
        fp8_knob="fp8_enabled" in parameters(utils[PACK]),
        fused_lm_head=thd == "packed" and all(n in model_utils for n in (FUSED, FUSED_PACKED, FUSED_ENTROPY)),
    )


def _refuse_old_tree(src: str | None) -> None:
    """A checkout from before the tree moved (2c1cf9e4f) is named as such, not as a wrong folder."""
    given = src or os.environ.get(FRAMEWORK.env)
    if given and (Path(given) / OLD_TREE).is_file() and not (Path(given) / MODEL_UTILS).is_file():
        raise BadInput(f"SkyRL at {given} is from before 2026-02-15 (skyrl-train/skyrl_train, moved to "
                       "skyrl/backends/skyrl_train by 2c1cf9e4f): the skyrl target reads the newer tree only")


class SkyRLTarget(CheckoutTarget):
    """NovaSky-AI/SkyRL's Megatron log-probs and entropy, as its policy loss calls them, on its own batch and packing (--skyrl-src, --target-src or SHARDCHECK_SKYRL_SRC)"""

    framework = FRAMEWORK

    def __init__(self, variant: str | None, config: TargetConfig) -> None:
        try:
            self.temperature_in_place = config.flag("temperature_in_place")
        except ValueError as exc:
            raise BadInput(f"target 'skyrl': {exc}") from None
        self.fused = variant == "fused_lm_head"
        self.name = "skyrl" if variant is None else f"skyrl:{variant}"
        if self.fused and self.temperature_in_place:
            raise BadInput("target 'skyrl:fused_lm_head' divides the LM-head weight by the temperature, never the "
                           "logits: temperature_in_place does not apply")
        _refuse_old_tree(config.src)
        super().__init__(config.src)
        self.era = detect_era(self.src)
        if self.fused and not self.era.fused_lm_head:
            raise BadInput(f"SkyRL at {self.short()} has no fused LM-head log-prob ({FUSED_PACKED}, from 0a18dd727 "
                           "on): use the skyrl target")
        self.data_path = SkyRLDataPath(self.src)
        packed = self.era.thd_path == "packed"
        self.framework_files = tuple(str(f) for f in (MODEL_UTILS, MEGATRON_UTILS, PREPROCESS)) + (
            (str(WRAPPER),) if packed else ())
        gather = ("AllGatherPackedCPTensor (its backward keeps the rank's own positions)" if packed else
                  "postprocess_packed_seqs (all_gather of the detached output, the rank's own slot kept)")
        self.definitions = Definitions(
            loss_over="held", loss_source=f"SkyRL gathers its log-probs over CP with {gather} and takes each CP "
                                          "rank's loss over the whole gathered sequence, not divided by cp")
        layouts = {"bshd"} | ({"thd", "zigzag"} if self.era.thd_path else set())
        self.capabilities = Capabilities(
            layouts=frozenset(layouts), entropy=True, entropy_grad=not self.fused, replay_keep=False, sampling=False,
            layout_reasons=(("allgather", ALLGATHER_WHY),),
            reasons=(("layout", f"SkyRL at {self.short()} has no sequence packing the adapter follows "
                                f"({PACK} without {UNPACK} or the packed log-probs)"),
                     ("entropy_grad", FUSED_ENTROPY_WHY), ("replay_keep", REPLAY_WHY), ("sampling", SAMPLING_WHY)))
        self._mod: Any = None

    def forget(self) -> None:
        self._mod = None
        self.data_path.release()

    def description(self) -> dict[str, Any]:
        packed = self.era.thd_path == "packed"
        if self.fused:
            functions = {"thd, zigzag": f"{FUSED_PACKED} (attention_mask scatter; gathered over CP by "
                                        "AllGatherPackedCPTensor)", "bshd": f"{FUSED} (cp_group=None)",
                         "entropy": f"{FUSED_ENTROPY} (no gradient: SkyRL's metric)",
                         "lm_head": "the given logits as the hidden states, an identity LM-head weight (x @ I = x)"}
        else:
            functions = {"thd, zigzag": (f"{PACKED} (attention_mask scatter; gathered over CP by "
                                         "AllGatherPackedCPTensor)" if packed else
                                         f"{UNPACK} (gathered over CP), then {LOGPROBS} with cp_group=None"),
                         "bshd": f"{LOGPROBS} (cp_group=None)",
                         "entropy": f"{ENTROPY} on the same logits, after the log-probs"}
        temperature = ("the LM-head weight divided by T inside the fused op" if self.fused else
                       "logits.div_(T) on the given logits, as SkyRL's loss_func" if self.temperature_in_place
                       else "logits / T (SkyRL's loss_func does logits.div_(T) in place)")
        out = {"functions": functions, "definitions": self.definitions.describe(), "temperature": temperature,
               "data_path": self.data_path.name, "framework_files": list(self.framework_files)}
        if self.data_path.newer_fields:
            newer = ", ".join(self.data_path.newer_fields)
            out["packed_seq_params"] = (f"megatron-core's PackedSeqParams with {newer} kept as attributes (a newer "
                                        f"megatron-core's fields SkyRL's {PACK} passes)")
        return out

    def _module(self) -> Any:
        if self._mod is None:
            self._mod = self.import_module(MODULE)
        return self._mod

    # ---- the calls ------------------------------------------------------------------------

    def _scaled(self, logits: Any, temperature: float) -> Any:
        """The loss_func's temperature, on the logits it receives."""
        if temperature == 1.0:
            return logits
        return logits.div_(temperature) if self.temperature_in_place else logits / temperature

    def compute(self, inputs: RankInputs) -> RankOutputs:
        import torch

        mod = self._module()
        batch, params, packed = self._laid_out(inputs)
        num_actions = batch["response_mask"].shape[1]
        v_local = inputs.logits.shape[-1]
        common = {"vocab_start_index": inputs.tp_rank * v_local, "vocab_end_index": (inputs.tp_rank + 1) * v_local,
                  "inference_only": False, "chunk_size": inputs.chunk_size if inputs.chunk_size > 0 else None}
        weight = None
        if self.fused:
            logits, token_logprobs, weight = self._fused(mod, inputs, batch, params, common)
        elif packed:
            logits = self._scaled(inputs.logits, inputs.temperature)
            token_logprobs = getattr(mod, PACKED)(
                logits, self.data_path.packed_targets(batch, params), params.cu_seqlens_q_padded,
                batch["sequences"].shape[1], group=inputs.tp_group, cp_group=inputs.cp_group,
                attention_mask=batch["attention_mask"], **common)
        else:
            # bshd, or (before 861e005b4) the packed output back in the batch's layout
            logits = self._scaled(self._loss_logits(inputs, batch, params), inputs.temperature)
            token_logprobs = getattr(mod, LOGPROBS)(logits, batch["sequences"], tp_group=inputs.tp_group,
                                                    cp_group=None, **common)
        held = inputs.held_rows()
        log_probs = self._per_sample(token_logprobs[:, -num_actions:], batch["response_mask"], held)
        if not inputs.with_entropy:
            return RankOutputs(log_probs, None)
        # use_entropy_loss: SkyRL computes the entropy with a gradient only when it is in the loss
        with torch.set_grad_enabled(inputs.entropy_coef != 0 and not self.fused and torch.is_grad_enabled()):
            entropy = self._entropy_values(mod, inputs, logits, batch, packed, weight)
        return RankOutputs(log_probs, entropy)

    def _laid_out(self, inputs: RankInputs) -> tuple[dict[str, Any], Any, bool]:
        """SkyRL's batch for the rank's rollout, its packing (None for bshd) and whether the log-probs
        are taken on the packed rows (861e005b4 on)."""
        if inputs.rollout is None:  # every layout SkyRL runs is laid out by its data path
            raise ValueError(f"{self.name}: no rollout for a {inputs.layout} scenario; SkyRL's data path lays out "
                             "its rows")
        batch = self.data_path.batch(inputs.rollout.to(inputs.logits.device))
        packed = inputs.layout != "bshd" and self.era.thd_path == "packed"
        params = self.data_path.pack(batch, inputs.rollout.knobs)[1] if inputs.layout != "bshd" else None
        return batch, params, packed

    def _loss_logits(self, inputs: RankInputs, batch: dict[str, Any], params: Any) -> Any:
        """What SkyRL's forward step hands its loss off the packed era's path: the logits as they are
        (bshd: the batch's own layout), or before 861e005b4 the packed output back in the batch's
        layout (postprocess_packed_seqs)."""
        return inputs.logits if params is None else self.data_path.unpack(inputs.logits, params, batch)

    def _entropy_values(self, mod: Any, inputs: RankInputs, logits: Any, batch: dict[str, Any], packed: bool,
                        weight: Any = None) -> list[Any]:
        """Per sample, the entropy of the held response tokens: the kernel on the packed rows, or on
        the ``[:, -num_actions - 1:-1]`` columns of the batch's layout."""
        num_actions = batch["response_mask"].shape[1]
        held = inputs.held_rows()
        rows = logits if packed else logits[:, -num_actions - 1:-1, :]
        if self.fused:
            values = getattr(mod, FUSED_ENTROPY)(rows, weight, inputs.tp_group,
                                                 chunk_size=inputs.chunk_size if inputs.chunk_size > 0 else None,
                                                 temperature=inputs.temperature)
        elif self.era.entropy_chunk_size:
            # the scenario's chunk where it sets one, else SkyRL's vocab_entropy_chunk_size default (0: auto)
            values = getattr(mod, ENTROPY)(rows, chunk_size=max(inputs.chunk_size, 0))
        else:
            values = getattr(mod, ENTROPY)(rows)
        if packed:  # per packed row: the rows this rank's logits hold
            flat = values.reshape(-1)
            return [flat[r] for r, _ in held]
        return self._per_sample(values, batch["response_mask"], held)

    def _fused(self, mod: Any, inputs: RankInputs, batch: dict[str, Any], params: Any,
               common: dict[str, Any]) -> tuple[Any, Any, Any]:
        """fused_lm_head_logprob: the given logits stand for the decoder's hidden states and an identity
        LM-head weight (in their dtype) makes the fused op's logits exactly them; the temperature
        divides the weight inside, as SkyRL's loss passes it."""
        import torch

        hidden = inputs.logits
        weight = torch.eye(hidden.shape[-1], dtype=hidden.dtype, device=hidden.device)
        kwargs = dict(common, temperature=inputs.temperature, fused_backend="torch")
        if params is None:
            out = getattr(mod, FUSED)(hidden, weight, batch["sequences"], tp_group=inputs.tp_group, cp_group=None,
                                      **kwargs)
        else:
            out = getattr(mod, FUSED_PACKED)(
                hidden, weight, self.data_path.packed_targets(batch, params), params.cu_seqlens_q_padded,
                batch["sequences"].shape[1], group=inputs.tp_group, cp_group=inputs.cp_group,
                attention_mask=batch["attention_mask"], **kwargs)
        return hidden, out, weight

    @staticmethod
    def _per_sample(action: Any, response_mask: Any, held: list[tuple[Any, Any]]) -> list[Any]:
        """Per sample, the held response tokens' values out of SkyRL's ``[B, num_actions]`` columns:
        the response mask says which columns hold sample i's response, in order."""
        out = []
        for i, (_, tokens) in enumerate(held):
            columns = response_mask[i].nonzero().squeeze(-1)
            out.append(action[i, columns[tokens]])
        return out


VARIANTS = {
    "loss": "SkyRL's Megatron policy loss in a training step (loss_form step): the wrapper's own loss_func "
            "(ppo_policy_loss, reduce_loss, entropy and KL terms, its rescale for megatron's schedule) and, from "
            "#1296, the trainer's apply_loss_reduction_to_advantages_minibatch over the step's global batch; option "
            "loss_reduction (SkyRL's default token_mean), use_kl_loss",
    "fused_lm_head": "fused_lm_head_logprob=True: from_parallel_hidden_to_logprobs(_packed_sequences) "
                     "(FusedLinearChunkedDistributedLogprob, torch backend) with the given logits as the hidden "
                     "states and an identity LM head, the entropy _fused_vocab_parallel_entropy_from_hidden (no "
                     "gradient: scenarios with entropy_coef != 0 are skipped, as SkyRL refuses them)",
}


LOSS_OPTIONS = ("loss_reduction", "use_kl_loss")


def _build(variant: str | None, config: TargetConfig) -> SkyRLTarget:
    refuse_loss_variant("skyrl", variant, config, LOSS_OPTIONS)
    return SkyRLTarget(variant, config)


target = CheckoutFactory(
    FRAMEWORK, _build,
    doc=("NovaSky-AI/SkyRL's Megatron log-probs and entropy (model_utils.py), as its policy loss calls them, on its "
         "own batch and packing (--skyrl-src, --target-src or SHARDCHECK_SKYRL_SRC)"),
    options=OPTIONS, variants=VARIANTS)
