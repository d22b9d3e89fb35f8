"""modelscope/ms-swift's Megatron GRPO trainer (``megatron rlhf --rlhf_type grpo``) from a source
checkout: ``--target ms_swift``.

What runs is ``MegatronGRPOTrainer.forward_step`` (swift/megatron/trainers/grpo_trainer.py),
compiled alone with everything it calls from ms-swift's own files (targets/ms_swift_path.py):
``prepare_batch`` (the label roll, the packed-sequence params, the CP split through
``get_batch_on_this_cp_rank``), the temperature (``logits.div_``),
``compute_logps_and_entropy_from_logits`` (vocab_parallel_utils.py: its own vocab-parallel
log-softmax, gather and entropy over megatron-core's TP group), ``reconstruct_tensor_cp`` (an
all-gather over CP whose backward keeps only the rank's own chunk: ``output_list[cp_rank] =
tensor``) and ``pad_logps_back_to_batch``. Its output is what the trainer's loss_func gets: per
sample, every token of the sequence on every CP rank, of which the response tokens are picked
with ms-swift's own completion mask (``build_completion_mask_and_seq_lengths``).

Definition under CP: every CP rank holds the whole sequence, but the gradient only reaches the
rank's own chunk, and megatron-core multiplies a two-value loss by the CP size
(schedules.py forward_step) while DDP averages over dp x cp: each rank's gradient is its own
rows' share of the global loss's. So the target returns each rank's zigzag share (the default
definition), taken from the gathered tensor. The two-value loss itself is the training step's.

The model is a stand-in: it checks that the tokens ms-swift's ``prepare_batch`` hands it are the
harness's rows and returns a fresh copy of the harness's logits, as a model's forward returns a
tensor of its own (forward_step divides it in place by the temperature: harmless on a model's
output, nothing else reads it; on the harness's own logits it would be the harness's tensor).

A `shardcheck repro` script (REPRO_CALL) runs the same: forward_step and the same callees compiled
alone from the checkout the script is given, the collator's output written as here, the CP split
the zigzag stand-in (a script takes no mcore-bridge checkout).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from shardcheck.errors import BadInput
from shardcheck.targets.base import Capabilities, RankInputs, RankOutputs, TargetConfig
from shardcheck.targets.checkout import CheckoutFactory, CheckoutTarget
from shardcheck.targets.ms_swift_path import (BRIDGE_FILE, FILES, GRPO_FILE, VOCAB_MODULE, GrpoForwardPath,
                                              megatron_args)
from shardcheck.targets.source import Framework

# the checked path imports nothing else of ms-swift's; its modules' package __init__s pull its stack
FRAMEWORK = Framework("ms_swift", "ms-swift", str(GRPO_FILE), ("swift",), (), package_inits="skip", eager=True,
                      clone="a clone of modelscope/ms-swift")
ENV = FRAMEWORK.env
BRIDGE_ENV = "SHARDCHECK_MCORE_BRIDGE_SRC"
OPTIONS = {"mcore_bridge": f"a checkout of modelscope/mcore-bridge whose split_cp_inputs splits the CP rows "
                           f"(default: {BRIDGE_ENV}; without one the harness's zigzag split stands in)"}
source = FRAMEWORK.source


def bridge_source(config: TargetConfig) -> Path | None:
    """The mcore-bridge checkout given (option, else the environment), or None; BadInput (one
    line) for a folder that is not one."""
    value = config.get("mcore_bridge") or os.environ.get(BRIDGE_ENV)
    if not value:
        return None
    path = Path(value).expanduser().resolve()
    if not (path / BRIDGE_FILE).is_file():
        raise BadInput(f"{str(path)!r} is not an mcore-bridge checkout (no {BRIDGE_FILE})")
    return path


class MsSwiftTarget(CheckoutTarget):
    """ms-swift's Megatron GRPO forward_step from a source checkout (--ms-swift-src / SHARDCHECK_MS_SWIFT_SRC)"""

    framework = FRAMEWORK
    name = "ms_swift"
    framework_files = tuple(str(f) for f in FILES)

    def __init__(self, src: str | None = None, bridge: Path | None = None) -> None:
        super().__init__(src)
        self.bridge = bridge
        self.capabilities = Capabilities(
            layouts=frozenset({"thd", "zigzag", "bshd"}),
            layout_reasons=(("allgather", "ms-swift splits CP per sequence (mcore-bridge's split_cp_inputs: zigzag, "
                                          "or contiguous per sequence); it has no all-gather CP over the packed "
                                          "stream"),),
            reasons=(("replay_keep", "ms-swift's Megatron GRPO log-probs are not renormalised over a replayed "
                                     "top-p / top-k keep set"),))
        self._path: GrpoForwardPath | None = None

    def forget(self) -> None:
        self._path = None

    def description(self) -> dict[str, Any]:
        split = (f"mcore-bridge's split_cp_inputs from {self.bridge} ({BRIDGE_FILE}; its pin_memory().cuda() index "
                 "kept on the CPU on a CPU world)" if self.bridge is not None else
                 "the harness's zigzag split of each cu_seqlens segment, standing in for mcore-bridge's "
                 "split_cp_inputs (no mcore-bridge checkout given)")
        return {"entry_point": f"{GRPO_FILE}:MegatronGRPOTrainer.forward_step, compiled alone",
                "cp_split": split,
                "collator": "swift/template/base.py _data_collator's Megatron output written by the target (prompt "
                            "labels -100, each sample padded to a multiple of 2*cp, packed or right-padded)",
                "model": "a stand-in: checks prepare_batch's input_ids are the harness's rows, returns a fresh copy "
                         "of the harness's logits (forward_step divides its model's output in place)",
                "entropy": "computed as the trainer computes it (compute_entropy); its GRPO loss only masks by it "
                           "and logs it, never differentiates it",
                "chunk_size": "not applied: the trainer calls compute_logps_and_entropy_from_logits with its default "
                              "entropy_chunk_size (512)"}

    def repro_call(self) -> str | None:
        """How a repro script calls ms-swift (REPRO_CALL): forward_step and its callees, compiled
        alone from the same files, on the same rows (the harness's zigzag split for CP)."""
        return REPRO_CALL

    def _forward(self) -> GrpoForwardPath:
        if self._path is None:
            vocab = self.import_module(VOCAB_MODULE)
            self._path = GrpoForwardPath(self.src, vocab, self.bridge)
        return self._path

    def _model(self, inputs: RankInputs) -> Any:
        def model(input_ids: Any, **rest: Any) -> Any:
            inputs.check_model_tokens(input_ids, "ms-swift's prepare_batch")
            return inputs.logits.clone()  # a model's own output tensor (module docstring)
        return model

    def compute(self, inputs: RankInputs) -> RankOutputs:
        path = self._forward()
        padding_free = inputs.layout != "bshd"
        collated = path.collate(inputs.tokens, inputs.response_lengths, inputs.cp_size, padding_free,
                                inputs.logits.device)
        args = megatron_args(padding_free=padding_free, tp=inputs.tp_size, cp=inputs.cp_size)
        logps, entropy, _ = path.forward_step(collated, args, self._model(inputs), inputs.temperature,
                                              inputs.with_entropy)
        mask = collated.completion_mask
        held = [tokens for _, tokens in inputs.held_rows()]  # the rank's zigzag share (all of it at cp 1)
        out_lp = [logps[i][mask[i]][held[i]] for i in range(len(held))]
        out_ent = None if entropy is None else [entropy[i][mask[i]][held[i]] for i in range(len(held))]
        return RankOutputs(out_lp, out_ent)


# How a `shardcheck repro` script calls ms-swift (harness/controller/commands/repro.py): as MsSwiftTarget does,
# forward_step and its callees compiled alone from rank.src (ms_swift_path.py), vocab_parallel_utils.py run whole
# (torch and megatron-core alone), megatron-core's groups built; the CP split is the zigzag stand-in (no mcore-bridge).
REPRO_CALL = '''
def call_code_under_test(logits, rank):
    """ms-swift's MegatronGRPOTrainer.forward_step from rank.src as shardcheck's ms_swift target calls it: it and its callees compiled alone."""
    import ast, collections.abc, functools, megatron.core.packed_seq_params as psp, megatron.core.parallel_state as mpu  # noqa: E401
    F, no, dev, cp, free = torch.nn.functional, lambda *a, **k: False, logits.device, rank.cp_size, rank.layout != "bshd"
    mpu.initialize_model_parallel(rank.tp_size, context_parallel_size=cp)
    def alone(rel, names, ns):  # noqa: E306  the named functions (methods too: each name is defined once) of a file, ns their globals
        defs = [n for n in ast.walk(ast.parse(open(os.path.join(rank.src, "swift", rel)).read())) if isinstance(n, ast.FunctionDef) and n.name in names]
        return exec(compile(ast.Module(defs, []), os.path.join(rank.src, "swift", rel), "exec", __import__("__future__").annotations.compiler_flag), ns) or ns
    def split_cp_inputs(x, cu, dim):  # noqa: E306  mcore-bridge's zigzag: chunks r and 2cp-1-r of each cu_seqlens segment
        b, c, r = [0, x.shape[dim]] if cu is None else cu.tolist(), 2 * cp, rank.cp_rank
        return x.index_select(dim, torch.cat([torch.arange(a + k * (e - a) // c, a + (k + 1) * (e - a) // c) for a, e in zip(b, b[1:]) for k in (r, c - 1 - r)]).to(x.device))
    rl = alone("rlhf_trainers/utils.py", ["pad_logps_back_to_batch", "build_completion_mask_and_seq_lengths"],  # with transformers_utils.py's
               alone("utils/transformers_utils.py", ["get_packed_seq_params"], {"torch": torch}))  # get_packed_seq_params, as it imports
    ns = dict(mpu=mpu, PackedSeqParams=psp.PackedSeqParams, is_torch_npu_available=no, Mapping=collections.abc.Mapping, partial=functools.partial,
              _should_use_npu_generated_attention_mask=no, _get_packed_seq_params=rl["get_packed_seq_params"], get_current_device=lambda: dev,
              split_cp_inputs=split_cp_inputs, profiling_decorator=lambda fn: fn, pad_logps_back_to_batch=rl["pad_logps_back_to_batch"])
    exec(compile(open(p := os.path.join(rank.src, "swift/megatron/trainers/vocab_parallel_utils.py")).read(), p, "exec"), ns)  # whole: torch, megatron-core
    [alone(rel, names.split(), ns) for rel, names in (("megatron/utils/utils.py", "get_packed_seq_params"), ("utils/torch_utils.py", "to_device"),
     ("megatron/utils/megatron_lm_utils.py", "get_batch_on_this_cp_rank"), ("megatron/trainers/utils.py", "get_batch_on_this_pp_rank prepare_batch "
      "reconstruct_tensor_cp"), ("megatron/trainers/grpo_trainer.py", "forward_step"))]  # forward_step: a method, compiled as a function
    ids = [F.pad(t, (0, -len(t) % (2 * cp) if cp > 1 else 0)) for t in rank.tokens]  # template/base.py _data_collator: padded to 2 * cp,
    labels = [torch.where(torch.arange(len(i), device=dev) < n - r, -100, i) for i, n, r in zip(ids, rank.total_lengths, rank.response_lengths)]  # prompt -100
    w, pos, at = max(map(len, ids)), [torch.arange(len(i), device=dev) for i in ids], lambda xs, v=0: torch.stack([F.pad(x, (0, w - len(x)), value=v) for x in xs])
    batch = dict({"input_ids": torch.cat(ids)[None], "labels": torch.cat(labels)[None], "position_ids": torch.cat(pos)[None]} if free else {  # packed
        "input_ids": at(ids), "labels": at(labels, -100), "position_ids": at(pos), "attention_mask": ~torch.stack(  # right-padded, inverted 4-D causal mask
            [torch.ones(w, w, dtype=torch.bool, device=dev).tril() & (torch.arange(w, device=dev) < n) for n in rank.total_lengths])[:, None]}, seq_lens=rank.total_lengths)
    mask, lens, _ = rl["build_completion_mask_and_seq_lengths"](batch["labels"], len(ids), padding_free=free, encoded_batch=batch, device=dev)
    args = SimpleNamespace(task_type="causal_lm", pipeline_model_parallel_size=1, padding_free=free, is_multimodal=False, sequence_parallel=False,
                           cp_partition_mode="zigzag", tensor_model_parallel_size=rank.tp_size, context_parallel_size=cp)  # megatron_args.py's defaults
    trainer = SimpleNamespace(args=args, temperature=rank.temperature, compute_entropy=rank.with_entropy, enable_routing_replay=False, micro_batch_size=len(ids),
                              loss_func=print, _prepare_batch=lambda d, vp_stage=None: ns["prepare_batch"](args, d, vp_stage))  # the model: its own output
    lp, loss = ns["forward_step"](trainer, iter([dict(batch, grpo_batch=SimpleNamespace(completion_mask=mask, seq_lengths=lens))]), lambda **k: logits.clone())
    pick = lambda x: None if x is None else [x[i][mask[i]][rank.share[i]] for i in range(len(ids))]  # noqa: E731  the rank's share
    return pick(lp), pick(loss.keywords["data"]["per_token_entropy"])
'''


def _build(variant: str | None, config: TargetConfig) -> MsSwiftTarget:
    return MsSwiftTarget(config.src, bridge_source(config))


target = CheckoutFactory(
    FRAMEWORK, _build, options=OPTIONS,
    doc=("modelscope/ms-swift's Megatron GRPO forward_step (grpo_trainer.py: prepare_batch, vocab_parallel_utils's "
         "log-probs and entropy, reconstruct_tensor_cp, pad_logps_back_to_batch) on the harness's rows (--ms-swift-src, "
         "--target-src or SHARDCHECK_MS_SWIFT_SRC; --target-opt mcore_bridge=DIR for mcore-bridge's CP split)"))
