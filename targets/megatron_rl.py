"""NVIDIA/Megatron-LM's own RL loop (``megatron/rl/``): ``--target megatron_rl``.

What runs: ``megatron/rl/rl_utils.py:get_logprobs`` as ``train_rl.py``'s ``forward_step`` calls it
in training (``no_grad=False``; with sequence packing the bin's ``PackedSeqParams``, made by
``sequence_packing_utils.py:create_packed_seq_params_for_bin``; without, none, so that
``get_logprobs`` builds its single-sequence default), with what it calls from its own file:
``selective_log_softmax`` and, with context parallelism, ``_scatter_for_context_parallel``,
``_build_cp_scatter_cache`` and ``_CPScatterCache`` (Transformer Engine's THD partition of every
packed sequence into 2*cp chunks, a differentiable all-gather of the log-probs over CP, their
order restored). ``PackedSeqParams`` is the commit's own (``megatron/core/packed_seq_params.py``).

Megatron-LM ships its own megatron-core (0.20 at the pin), which cannot be imported next to the
installed one (0.16.1), and ``rl_utils``'s module imports the whole training stack: every
definition above is compiled alone from its file (targets/compiled.py); the checkout's
``megatron/core`` is never put on sys.path. The process groups are the installed megatron-core's
``parallel_state`` ones, which the harness builds (the loop's ``pg_collection`` is
``ProcessGroupCollection.use_mpu_process_groups()``).

The model ``get_logprobs`` calls is a stand-in that hands back the harness's logits for the tokens
it is given, after checking that those are the tokens the harness's rows hold (so the checkout's CP
partition must pick the harness's rows); with ``runtime_gather_output=True`` (what
``get_logprobs`` asks) it gathers them over TP with megatron-core's
``gather_from_tensor_model_parallel_region``, as the model's ColumnParallelLinear output layer
does (the same function in the pin's megatron-core and the installed one).

Definitions: with CP every rank returns the log-probs of every response token (gathered over
CP), and ``train_rl.py``'s ``loss_func`` sums the masked loss over the whole bin on every CP
rank, megatron-core's per-token normalisation dividing it by a token count all-reduced over
dp x cp: ``Definitions(loss_over="gathered")``. Its "entropy" (``calculate_grpo_loss``'s
``entropy_term = -current_logprobs.exp() * current_logprobs``) is the sampled token's
``-p log p``, not the distribution's entropy the reference computes: entropy scenarios are skipped,
saying so (docs/megatron-rl.md says what harness change would let it be checked). It scores the
raw logits (no temperature: ``--inference-dynamic-batching-logprobs-mode raw_logprobs``, its
default, is the same definition on the rollout side), so scenarios at a temperature other than 1
are skipped too.
"""

from __future__ import annotations

import ast
import copy
import typing
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import torch

from shardcheck.backend import gloo_safe_all_gather, ranks_on_nccl
from shardcheck.errors import BadInput
from shardcheck.scenarios.scenario import Scenario
from shardcheck.targets.areal_data import _dataclass  # @dataclass on a class compiled alone
from shardcheck.targets.base import Capabilities, Definitions, RankInputs, RankOutputs, TargetConfig
from shardcheck.targets.checkout import CheckoutFactory, CheckoutTarget
from shardcheck.targets.cpu_stand_ins import current_device_is_cpu
from shardcheck.targets.compiled import compile_alone
from shardcheck.targets.source import Framework

RL_UTILS = Path("megatron/rl/rl_utils.py")
PACKING = Path("megatron/rl/sequence_packing_utils.py")
PACKED_SEQ_PARAMS = Path("megatron/core/packed_seq_params.py")
# get_logprobs' CP path, present since #5882 (2026-08-17, "Enable context parallelism for RL training")
CP_DEFS = ("_CPScatterCache", "_build_cp_scatter_cache", "_scatter_for_context_parallel")

FRAMEWORK = Framework("megatron_rl", "Megatron-LM (megatron/rl)", str(RL_UTILS), ("megatron.rl",),
                      clone="a clone of NVIDIA/Megatron-LM (only megatron/rl and megatron/core/packed_seq_params.py "
                            "are read)")
ENV = FRAMEWORK.env
source = FRAMEWORK.source

ENTROPY_WHY = ("Megatron-LM's RL loop has no distribution entropy: its entropy_term (rl_utils.py "
               "calculate_grpo_loss) is the sampled token's -p log p, a definition the harness's reference "
               "does not have; its log-probs are checked (suite logprob)")
TEMPERATURE_WHY = ("Megatron-LM's get_logprobs scores the raw logits (no temperature; its rollout log-probs are "
                   "raw too, --inference-dynamic-batching-logprobs-mode raw_logprobs): the reference's log-probs "
                   "at temperature {t} are another definition")
ALLGATHER_WHY = ("Megatron-LM's RL loop has no all-gather CP: with CP it splits every packed sequence with "
                 "Transformer Engine's THD partition (chunks r and 2cp-1-r: the zigzag layout)")
GLOO_WHY = ("Megatron-LM's get_logprobs all-gathers the log-probs over CP with torch.distributed.nn.functional."
            "all_gather, whose backward on gloo (_AlltoAll) scatters with the CP group's rank as a global src: it "
            "fails on any CP group other than global ranks 0..cp-1 (a torch limitation, not Megatron-LM's; nccl "
            "uses reduce-scatter); --target-opt cp_all_gather=shardcheck runs it with a gloo-safe all-gather of "
            "the same contract, cp_all_gather=torch with torch's own")
ALL_GATHER = ("torch", "shardcheck")
OPTIONS = {"cp_all_gather": "under CP on a gloo world: torch (torch.distributed.nn.functional.all_gather, "
                            "get_logprobs' own; its gloo backward fails on a CP group other than global ranks "
                            "0..cp-1) or shardcheck (the same contract, a backward gloo runs on any group); unset: "
                            "such scenarios are skipped on gloo"}
STAND_INS = (
    "transformer_engine_torch.thd_get_partitioned_indices: a Python stand-in of TE's "
    "thd_partition_indices_kernel (each sequence of cu_seqlens_padded cut into 2*cp chunks, rank r "
    "taking chunks r and 2cp-1-r, sequence by sequence)",
    "the model: the harness's logits for the tokens get_logprobs hands it (checked to be the rows' "
    "tokens), gathered over TP by megatron-core 0.16.1's gather_from_tensor_model_parallel_region "
    "(runtime_gather_output=True), torch.cuda.current_device() answering 'cpu' there on a CPU world",
    "get_args(): fp16/bf16 from the scenario's dtype (fp32_output as the loop sets it)",
    "get_nvtx_range(): a no-op range (profiling only); set_model_config_attribute: sets the stand-in "
    "model's config (flash_decode off, then back)",
    "is_batch_invariant_mode_enabled(): False (the loop's default, no --batch-invariant-mode)",
    "no pin_memory().cuda() or .cuda() lies on the path run (get_logprobs keeps tokens on their device)",
)


def _thd_get_partitioned_indices(cu_seqlens: torch.Tensor, total_tokens: int, world_size: int,
                                 rank: int) -> torch.Tensor:
    """Transformer Engine's THD partition index on a CPU world: the token positions of the packed
    stream ``rank`` holds, sequence by sequence, the first half of its share of each sequence
    being chunk ``rank`` and the second chunk ``2*world_size-1-rank`` (TE asserts each boundary
    divisible by 2*world_size; megatron's packer aligns them so)."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if any(b % (2 * world_size) for b in bounds):
        raise AssertionError(f"thd_get_partitioned_indices: cu_seqlens {bounds} not divisible by 2*{world_size}")
    out: list[int] = []
    for start, end in zip(bounds, bounds[1:]):
        chunk = (end - start) // (2 * world_size)
        for c in (rank, 2 * world_size - 1 - rank):
            out.extend(range(start + c * chunk, start + (c + 1) * chunk))
    # TE fills total_tokens // world_size positions; megatron's bins end at cu_seqlens[-1]
    if len(out) != total_tokens // world_size:
        raise AssertionError(f"thd_get_partitioned_indices: cu_seqlens end at {bounds[-1]}, total_tokens {total_tokens}")
    return torch.tensor(out, dtype=torch.int32, device=cu_seqlens.device)


class _Over:
    """A module as the compiled code reads it, some attributes replaced (the rest its own)."""

    def __init__(self, base: Any, **over: Any) -> None:
        self._base, self._over = base, over

    def __getattr__(self, name: str) -> Any:
        return self._over[name] if name in self._over else getattr(self._base, name)


class _HarnessModel(torch.nn.Module):
    """The model get_logprobs calls: the harness's logits for the rows it holds."""

    def __init__(self, inputs: RankInputs, pg_collection: Any) -> None:
        super().__init__()
        self.config = SimpleNamespace(flash_decode=False)
        self.pg_collection = pg_collection
        self._inputs = inputs

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor, attention_mask: Any,
                packed_seq_params: Any = None, runtime_gather_output: bool | None = None,
                fp32_output: bool = True) -> torch.Tensor:
        # logits for other tokens than the rows hold would check nothing: get_logprobs must hand
        # this rank's model its share of the bin, as the harness laid it out
        self._inputs.check_model_tokens(tokens, "Megatron-LM's get_logprobs")
        logits = self._inputs.logits
        if runtime_gather_output and self._inputs.tp_size > 1:
            from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

            with current_device_is_cpu():
                logits = gather_from_tensor_model_parallel_region(logits, self.pg_collection.tp)
        return logits


@dataclass(frozen=True)
class RlEra:
    """What the checkout's get_logprobs path offers."""

    cp_scatter: bool  # get_logprobs splits the bin over CP itself (#5882)
    packing_multiple: bool  # create_packed_seq_params_for_bin takes seq_length_multiple (#5882)


def _top_level(tree: ast.Module | None) -> dict[str, ast.AST]:
    return {} if tree is None else {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


class MegatronRlTarget(CheckoutTarget):
    """Megatron-LM's RL get_logprobs from a source checkout (--megatron-rl-src / SHARDCHECK_MEGATRON_RL_SRC)"""

    framework = FRAMEWORK
    name = "megatron_rl"
    framework_files = (str(RL_UTILS), str(PACKING), str(PACKED_SEQ_PARAMS))

    def __init__(self, src: str | None = None, cp_all_gather: str | None = None) -> None:
        if cp_all_gather is not None and cp_all_gather not in ALL_GATHER:
            raise BadInput(f"target 'megatron_rl': option cp_all_gather={cp_all_gather!r}: expected torch or shardcheck")
        self.cp_all_gather = cp_all_gather
        super().__init__(src)
        defs = _top_level(FRAMEWORK.parse(self.src, RL_UTILS))
        packing = _top_level(FRAMEWORK.parse(self.src, PACKING)).get("create_packed_seq_params_for_bin")
        self.era = RlEra(cp_scatter=all(d in defs for d in CP_DEFS),
                         packing_multiple=packing is not None and "seq_length_multiple" in
                         [a.arg for a in packing.args.args])  # type: ignore[attr-defined]
        self.capabilities = Capabilities(
            layouts=frozenset({"thd", "zigzag", "bshd"}), entropy=False,
            reasons=(("entropy", ENTROPY_WHY),), layout_reasons=(("allgather", ALLGATHER_WHY),),
            rule=self._rule)
        self.definitions = Definitions(
            loss_over="gathered",
            loss_source="Megatron-LM's get_logprobs all-gathers the log-probs over CP; train_rl.py's loss_func sums "
                        "the masked loss over the whole bin on every CP rank, megatron-core dividing by the token "
                        "count all-reduced over dp x cp")
        self._fns: dict[str, Any] | None = None

    def repro_call(self) -> str | None:
        """How a repro script calls get_logprobs (REPRO_CALL): the same stand-ins; not under CP."""
        return REPRO_CALL

    def _rule(self, scenario: Scenario) -> str | None:
        if scenario.temperature != 1.0:
            return TEMPERATURE_WHY.format(t=scenario.temperature)
        if scenario.cp > 1 and self.era.cp_scatter and self.cp_all_gather is None and not ranks_on_nccl():
            return GLOO_WHY
        return None

    def forget(self) -> None:
        self._fns = None

    def description(self) -> dict[str, Any]:
        return {"runs": "megatron/rl/rl_utils.py:get_logprobs (no_grad=False, as train_rl.py's forward_step) with "
                        "selective_log_softmax" + (" and the CP scatter / all-gather" if self.era.cp_scatter else "")
                        + ", compiled alone; PackedSeqParams from sequence_packing_utils.py:"
                        "create_packed_seq_params_for_bin and megatron/core/packed_seq_params.py, compiled alone",
                "data_path": "the harness's rows: bins of the samples in order (padded to 2*cp with CP, as the packer "
                             "aligns slots), the response slices cut from get_logprobs' [batch, seq-1] output at the "
                             "samples' offsets (what the loop's loss mask keeps); megatron's SequencePacker is not run",
                "parallel_state": "megatron-core 0.16.1's parallel_state groups (the harness's), as the loop's "
                                  "ProcessGroupCollection.use_mpu_process_groups()",
                "stand_ins": list(STAND_INS),
                "cp_all_gather": {None: "torch's own on nccl; on gloo cp > 1 is skipped (torch's gloo backward)",
                                  "torch": "torch.distributed.nn.functional.all_gather, get_logprobs' own",
                                  "shardcheck": "shardcheck's gloo-safe all-gather (all-gather; backward: the "
                                                "gradients all-reduced, the rank's slice kept = reduce-scatter SUM) "
                                                "instead of torch's"}[self.cp_all_gather]}

    def _functions(self) -> dict[str, Any]:
        if self._fns is None:
            from megatron.core.pipeline_parallel.utils import is_pp_last_stage
            from megatron.core.utils import get_attr_wrapped_model

            params = compile_alone(self.src / PACKED_SEQ_PARAMS, ["PackedSeqParams"],
                                   {"dataclass": _dataclass, "torch": torch, "Tensor": torch.Tensor,
                                    "dist": torch.distributed})
            packed_seq_params = params["PackedSeqParams"]
            packing = compile_alone(self.src / PACKING, ["PackingInfo", "create_packed_seq_params_for_bin"],
                                    {"dataclass": _dataclass, "np": np, "torch": torch, "typing": typing, "List": List,
                                     "Dict": Dict, "Optional": Optional, "PackedSeqParams": packed_seq_params})
            self._args = SimpleNamespace(fp16=False, bf16=False)

            @contextmanager
            def nvtx_range(msg: str, time: bool = False, log_level: int = 1) -> Iterator[None]:
                yield

            # get_logprobs reaches the all-gather as torch.distributed.nn.functional.all_gather: asked to, the
            # gloo-safe one of the same contract stands there (everything else is torch's)
            torch_seen = torch if self.cp_all_gather != "shardcheck" else _Over(torch, distributed=_Over(
                torch.distributed, nn=_Over(torch.distributed.nn, functional=_Over(
                    torch.distributed.nn.functional, all_gather=gloo_safe_all_gather))))
            given = {"torch": torch_seen, "copy": copy, "dataclass": _dataclass, "nullcontext": nullcontext,
                     "PackedSeqParams": packed_seq_params, "get_args": lambda: self._args,
                     "get_attr_wrapped_model": get_attr_wrapped_model, "is_pp_last_stage": is_pp_last_stage,
                     "get_nvtx_range": lambda: nvtx_range,
                     "set_model_config_attribute": lambda model, attr, value: setattr(model.config, attr, value),
                     "is_batch_invariant_mode_enabled": lambda: False,
                     "HAVE_TEX": True, "tex": SimpleNamespace(thd_get_partitioned_indices=_thd_get_partitioned_indices)}
            names = ["selective_log_softmax", "get_logprobs"] + (list(CP_DEFS) if self.era.cp_scatter else [])
            # get_default_packed_seq_params: only for sequence_packing=True without params, which the loop never does
            rl = compile_alone(self.src / RL_UTILS, names, given, off_path=["get_default_packed_seq_params"])
            self._fns = {"get_logprobs": rl["get_logprobs"], "PackingInfo": packing["PackingInfo"],
                         "bin_params": packing["create_packed_seq_params_for_bin"]}
        return self._fns

    def _bin_params(self, lengths: list[int], slots: list[int], align: int, device: torch.device) -> Any:
        """The bin's PackedSeqParams as the loop's packer makes them: samples in order at their
        (2*cp-aligned) slots, the bin ending where the last slot does."""
        fns = self._functions()
        starts = [int(s) for s in np.cumsum([0] + slots)]
        n = len(lengths)
        info = fns["PackingInfo"](bin_seq_indices=[list(range(n))], seq_starts={0: starts if self.era.packing_multiple
                                                                                else starts[:-1]},
                                  seq_lengths=list(lengths), seq_to_bin_idx=[0] * n, packing_algo="fifo")
        kwargs: dict[str, Any] = {}
        if self.era.packing_multiple:
            kwargs["seq_length_multiple"] = align
        return fns["bin_params"](packing_info=info, bin_idx=0, bin_size=starts[-1], max_sequences_per_bin=n,
                                 device=device, **kwargs)

    def compute(self, inputs: RankInputs) -> RankOutputs:
        from megatron.core import parallel_state as mpu

        get_logprobs = self._functions()["get_logprobs"]
        self._args.fp16 = inputs.logits.dtype == torch.float16
        self._args.bf16 = inputs.logits.dtype == torch.bfloat16
        device = inputs.logits.device
        pg = SimpleNamespace(cp=mpu.get_context_parallel_group(), tp=mpu.get_tensor_model_parallel_group(),
                             pp=mpu.get_pipeline_model_parallel_group())
        model = _HarnessModel(inputs, pg)
        tokens = [t.to(device) for t in inputs.tokens]
        prompts = [total - response for total, response in zip(inputs.total_lengths, inputs.response_lengths)]
        if inputs.layout == "bshd":
            # the loop without sequence packing: a [batch, max] batch, get_logprobs' own PackedSeqParams
            width = inputs.logits.shape[1]
            batch = torch.zeros(len(tokens), width, dtype=torch.long, device=device)
            for i, t in enumerate(tokens):
                batch[i, : t.numel()] = t
            positions = torch.arange(width, device=device).expand(len(tokens), width)
            out = get_logprobs(model, batch, positions, no_grad=False, sequence_packing=False)
            rows = [out[i, p - 1: total - 1] for i, (p, total) in enumerate(zip(prompts, inputs.total_lengths))]
            return RankOutputs(rows)
        # sequence packing: one bin of every sample, each slot a multiple of 2*cp with CP
        align = 2 * inputs.cp_size if inputs.cp_size > 1 else 1
        slots = [-(-total // align) * align for total in inputs.total_lengths]
        packed = torch.zeros(1, sum(slots), dtype=torch.long, device=device)
        positions = torch.zeros(1, sum(slots), dtype=torch.long, device=device)
        offsets = [int(o) for o in np.cumsum([0] + slots[:-1])]
        for t, o, slot in zip(tokens, offsets, slots):
            packed[0, o: o + t.numel()] = t
            positions[0, o: o + slot] = torch.arange(slot, device=device)
        params = self._bin_params(list(inputs.total_lengths), slots, align, device)
        out = get_logprobs(model, packed, positions, no_grad=False, packed_seq_params=params)
        rows = [out[0, o + p - 1: o + total - 1] for o, p, total in zip(offsets, prompts, inputs.total_lengths)]
        return RankOutputs(rows)


# How a `shardcheck repro` script calls Megatron-LM (harness/controller/commands/repro.py): get_logprobs and
# selective_log_softmax compiled alone from rank.src with the target's stand-ins, the logits gathered over TP as
# the target's model does; not under CP (repro refuses it: the target's CP loss is over the gathered sequence).
REPRO_CALL = '''
def call_code_under_test(logits, rank):
    """Megatron-LM's get_logprobs from rank.src, as shardcheck's megatron_rl target calls it."""
    import ast, contextlib  # noqa: E401
    from megatron.core import parallel_state as mpu, tensor_parallel
    mpu.initialize_model_parallel(rank.tp_size)  # each rank's process calls this once
    if not torch.cuda.is_available():  # where megatron-core's TP gather allocates: the CPU
        torch.cuda.current_device = lambda: "cpu"
    path = os.path.join(rank.src, "megatron", "rl", "rl_utils.py")  # its module imports Megatron-LM's whole stack
    defs = [n for n in ast.parse(open(path).read()).body
            if isinstance(n, ast.FunctionDef) and n.name in ("selective_log_softmax", "get_logprobs")]
    args = SimpleNamespace(fp16=logits.dtype == torch.float16, bf16=logits.dtype == torch.bfloat16)
    ns = {"torch": torch, "nullcontext": contextlib.nullcontext, "get_args": lambda: args,
          "get_nvtx_range": lambda: lambda msg, time=False, log_level=1: contextlib.nullcontext(),  # profiling only
          "get_attr_wrapped_model": lambda model, attr: getattr(model, attr),
          "is_pp_last_stage": lambda group: True, "is_batch_invariant_mode_enabled": lambda: False,
          "set_model_config_attribute": lambda model, attr, value: setattr(model.config, attr, value),
          "PackedSeqParams": lambda **kw: SimpleNamespace(**kw)}
    exec(compile(ast.Module(defs, []), path, "exec"), ns)

    def model(tokens, position_ids, attention_mask, runtime_gather_output=None, **kw):  # these logits, these rows
        gather = runtime_gather_output and rank.tp_size > 1  # the output layer's TP gather, as the target's model
        return tensor_parallel.gather_from_tensor_model_parallel_region(logits) if gather else logits

    model.config, model.pg_collection = SimpleNamespace(flash_decode=False), SimpleNamespace(cp=None, pp=None)
    totals, prompts = rank.total_lengths, [t - r for t, r in zip(rank.total_lengths, rank.response_lengths)]
    if rank.layout == "bshd":
        batch = torch.zeros(logits.shape[:2], dtype=torch.long, device=logits.device)
        for i, t in enumerate(rank.tokens):
            batch[i, : t.numel()] = t
        out = ns["get_logprobs"](model, batch, torch.zeros_like(batch), no_grad=False, sequence_packing=False)
        return [out[i, p - 1: t - 1] for i, (p, t) in enumerate(zip(prompts, totals))], None
    packed = torch.cat(list(rank.tokens)).unsqueeze(0)
    out = ns["get_logprobs"](model, packed, torch.zeros_like(packed), no_grad=False, sequence_packing=False)
    starts = [sum(totals[:i]) for i in range(len(totals))]
    return [out[0, o + p - 1: o + t - 1] for o, p, t in zip(starts, prompts, totals)], None
'''


def _build(variant: str | None, config: TargetConfig) -> MegatronRlTarget:
    unknown = sorted({k for k, _ in config.options} - set(OPTIONS))
    if unknown:
        raise BadInput(f"target 'megatron_rl' has no option {unknown[0]} (options: {', '.join(OPTIONS)})")
    return MegatronRlTarget(config.src, config.get("cp_all_gather"))


target = CheckoutFactory(
    FRAMEWORK, _build, options=OPTIONS,
    doc=("Megatron-LM's RL get_logprobs (megatron/rl/rl_utils.py, compiled alone: its megatron-core is not "
         "imported) on the harness's rows, with its CP scatter / all-gather (--megatron-rl-src, --target-src or "
         "SHARDCHECK_MEGATRON_RL_SRC)"))
