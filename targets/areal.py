"""inclusionAI/AReaL's vocab-parallel log-probs and entropy and its Megatron engine's call sites,
loaded from a source checkout: ``--target areal`` and its variants.

What is checked:

- ``areal`` (the default): ``gather_logprobs_entropy`` / ``gather_logprobs``
  (``areal/utils/functional/vocab_parallel.py``; before 62d41759c the megatron path of
  ``areal/utils/functional.py``, ``_VocabParallelEntropy`` plus megatron-core's
  ``vocab_parallel_cross_entropy``) on each rank's rows, as the Megatron engine calls them: the
  TP group passed explicitly (``tp_group``, None at tp = 1), the temperature passed in (AReaL
  divides inside, out of place), ``chunk_size`` the scenario's or AReaL's 1024, labels the next
  token of each row. The functions are row-wise, so under CP each rank scores its own rows
  (``Definitions(loss_over="held")``). Rows of thd and zigzag are laid out by AReaL's own packing
  (:mod:`shardcheck.targets.areal_data`); bshd rows by shardcheck, as the functions' contract
  (any leading dimensions; chunks are then batch rows): AReaL's engines never call them so.
- ``areal:engine``: ``MegatronEngine.train_batch``'s path, compiled from its file:
  ``forward_backward_batch`` -> ``forward_step`` -> ``_compute_logprobs_and_loss`` on AReaL's packed
  micro-batch; the log-probs and entropy checked are those AReaL's loss receives.
- ``areal:loss``: the PPO actor's loss in the training step (``loss_form = "step"``): ``train_batch``
  itself, as ``PPOActor._ppo_update`` calls it, through to ``grpo_loss_fn`` ->
  ``ppo_actor_loss_fn`` and the loss weight it scales by (:mod:`shardcheck.targets.areal_loss`).
- ``areal:forward``: ``forward_batch``'s path (``compute_logp``: the reference and teacher
  models, the proximal log-probs): ``forward_backward_batch`` -> ``_compute_forward_result`` ->
  ``reorder_and_pad_outputs``; log-probs only. AReaL runs it under ``no_grad``; its gradient is
  checked too.

The definition under CP follows the commit: from 95e2379d0 AReaL reassembles the CP-local
log-probs on every CP rank (``reassemble_cp_packed_logprobs``: an all-gather whose backward sums
over CP) and normalises the loss weight over DP and CP, so every CP rank's loss is the whole
sequence's divided by cp: ``loss_over="gathered"``. Before d58cca56f it all-gathered the logits
with the gradient kept on each rank's own rows (the others detached) and normalised over DP
only: ``loss_over="held"``.

CPU: torch's differentiable all-gather (``torch.distributed.nn.functional.all_gather``, which
``reassemble_cp_packed_logprobs`` calls) has, on gloo, a backward that scatters with the group's
rank as a global ``src`` (``_AlltoAll``): it fails on any CP group other than global ranks
0..cp-1 (tp > 1, or a data-parallel replica). ``areal:engine`` under CP at such commits is
therefore skipped on a gloo world with that reason; ``--target-opt cp_all_gather=torch`` runs
torch's own (right where the CP group is ranks 0..cp-1), ``cp_all_gather=shardcheck`` hands
AReaL's function an all-gather with the same contract whose backward gloo runs on any group (the
report says which). AReaL's code is never changed.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from pathlib import Path
from typing import Any

from shardcheck.backend import ranks_on_nccl
from shardcheck.errors import BadInput
from shardcheck.scenarios.scenario import MEGATRON_LAYOUTS, Scenario
from shardcheck.targets.areal_data import (DATA_FILE, ENGINE_FILE, GLOO_SAFE_DIST_F, TRAIN_ENGINE_FILE,
                                           ArealDataPath, ArealEnginePath, engine_facts, packing_facts)
from shardcheck.targets.base import (Capabilities, Definitions, RankInputs, RankOutputs, TargetConfig,
                                     layout_description, layout_option)
from shardcheck.targets.checkout import CheckoutFactory, CheckoutTarget, refuse_loss_variant
from shardcheck.targets.compiled import compile_alone
from shardcheck.targets.source import Framework, functions_named, parameters

VOCAB_PARALLEL_FILE = Path("areal/utils/functional/vocab_parallel.py")
MPU_FILE = Path("areal/utils/functional.py")  # until 62d41759c
MPU_ENTROPY_FILE = Path("areal/utils/mcore/functional.py")
MPU_ENTROPY_MODULE = "areal.utils.mcore.functional"
ENTRY_POINTS = ("gather_logprobs", "gather_logprobs_entropy")
AREAL_CHUNK = 1024  # gather_logprobs(_entropy)'s chunk_size default, the one every engine call uses

FRAMEWORK = Framework("areal", "AReaL", str(ENGINE_FILE), ("areal",), package_inits="skip", eager=True,
                      clone="a clone of inclusionAI/AReaL; never pip install areal")
ENV = FRAMEWORK.env
source = FRAMEWORK.source

VARIANTS = {
    "engine": "MegatronEngine.train_batch's path compiled from its file: forward_backward_batch -> forward_step "
              "(labels rolled over the padded buffer and split under CP) -> _compute_logprobs_and_loss "
              "(gather_logprobs_entropy; under CP reassemble_cp_packed_logprobs + unpad_logits); what AReaL's "
              "loss receives is checked; thd and zigzag on AReaL's packing",
    "loss": "AReaL's PPO actor loss in the training step (megatron-core's schedule and DDP around it): "
            "MegatronEngine.train_batch compiled from its file, called as PPOActor._ppo_update calls it "
            "(loss_fn=functools.partial(grpo_loss_fn, ...), loss_weight_fn counting the loss mask), its "
            "total_loss_weight all-reduced over DP x CP and its loss_multiplier; grpo_loss_fn -> ppo_actor_loss_fn; "
            "the global batch's token mean declared; thd and zigzag on AReaL's packing",
    "forward": "MegatronEngine.forward_batch's path (compute_logp: reference, teacher and proximal log-probs): "
               "forward_backward_batch -> _compute_forward_result (gather_logprobs) -> reorder_and_pad_outputs; "
               "log-probs only; thd and zigzag on AReaL's packing",
    "fsdp": "AReaL's FSDP engine with Ulysses SP and vocab-parallel TP: FSDPEngine._prepare_mb_inputs -> "
            "_compute_logprobs_and_loss (_compute_logprobs_entropy: gather_logprobs_entropy, _sp_all_gather, "
            "[:-ulysses_pad_size], [:-pad_length]) compiled alone from areal/engine/fsdp_engine.py; thd and "
            "ulysses; before 0369627d4 (path=forward) PPOActor.compute_logp -> FSDPEngine.forward with the "
            "Ulysses gather inline (shardcheck.targets.areal_fsdp)",
}

OPTIONS = {
    "layout": "framework (AReaL's pack_tensor_dict -> pad_mb_list -> preprocess_packed_seqs_context_parallel lays "
              "out thd and zigzag rows, the default) or shardcheck (the harness's rows; the default variant only)",
    "cp_all_gather": "areal:engine and areal:loss under CP on a gloo world: torch "
                     "(torch.distributed.nn.functional.all_gather, "
                     "AReaL's own; its gloo backward fails on a CP group other than global ranks 0..cp-1) or "
                     "shardcheck (the same contract, a backward gloo runs on any group); unset: such scenarios are "
                     "skipped with the reason (on nccl torch's own runs)",
    "entropy_bonus": "areal:loss only: none (AReaL's: its PPO actor loss has no entropy term; a scenario with "
                     "entropy_coef != 0 is skipped, saying so) or adapter (the adapter adds -entropy_coef x the "
                     "micro-batch's masked token mean of AReaL's entropy to grpo_loss_fn's loss: its own term)",
    "path": "areal:fsdp only: train (train_batch's _compute_logprobs_and_loss, the default) or forward "
            "(forward_batch's _compute_forward_result, log-probs only)",
}
TRAIN_PATH_VARIANTS = ("engine", "loss")  # the variants on train_batch's path (reassemble_cp_packed_logprobs)
ALL_GATHER = ("torch", "shardcheck")


def _closure(tree: ast.Module, roots: tuple[str, ...]) -> list[str]:
    """The top-level definitions ``roots`` read, transitively (what compiling them alone needs)."""
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    todo, seen = [r for r in roots if r in defs], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += [n.id for n in ast.walk(defs[name]) if isinstance(n, ast.Name) and n.id in defs and n.id not in seen]
    return sorted(seen, key=lambda n: defs[n].lineno)


@dataclasses.dataclass(frozen=True)
class ArealEra:
    """What an AReaL checkout offers (:func:`detect_era`). ``packing`` and ``engine`` are the data
    path's and the engine's own facts (areal_data.packing_facts, engine_facts), read by them."""

    functions: str  # "vocab_parallel" (tp_group explicit) or "mpu" (the TP group from parallel_state)
    functions_file: str  # the file gather_logprobs(_entropy) are in
    packing: dict[str, Any] | None  # None: no packing the adapter can run
    engine: dict[str, Any] | None  # None: the engine's methods are not the ones the variants call


def detect_era(src: Path) -> ArealEra:
    """What this checkout offers, from its source: which log-prob functions, its packing, its
    engine's call sites (nothing is imported)."""
    vocab_parallel = FRAMEWORK.parse(src, VOCAB_PARALLEL_FILE)
    fn = functions_named(vocab_parallel, "gather_logprobs_entropy")
    if fn and "tp_group" in parameters(fn[0]):
        functions, where = "vocab_parallel", VOCAB_PARALLEL_FILE
    elif functions_named(FRAMEWORK.parse(src, MPU_FILE), "gather_logprobs_entropy") and \
            functions_named(FRAMEWORK.parse(src, MPU_ENTROPY_FILE), "forward"):
        # e0d09c323..62d41759c: the TP group from megatron's parallel_state, the entropy verl's copy
        functions, where = "mpu", MPU_FILE
    else:
        raise BadInput(f"AReaL at {src} has neither {VOCAB_PARALLEL_FILE} (gather_logprobs_entropy with tp_group) "
                       f"nor {MPU_FILE} with {MPU_ENTROPY_FILE}")
    return ArealEra(functions=functions, functions_file=str(where), packing=packing_facts(src),
                    engine=engine_facts(src))


class ArealTarget(CheckoutTarget):
    """AReaL's gather_logprobs(_entropy) and its Megatron engine's call sites, from a checkout (see the
    module docstring)."""

    framework = FRAMEWORK

    def __init__(self, variant: str | None, config: TargetConfig) -> None:
        self.variant = variant
        self.name = "areal" if variant is None else f"areal:{variant}"
        self.layout_option = layout_option(config, f"target {self.name!r}: ")
        self.cp_all_gather = config.get("cp_all_gather")
        if self.cp_all_gather is not None and self.cp_all_gather not in ALL_GATHER:
            raise BadInput(f"target {self.name!r}: option cp_all_gather={self.cp_all_gather!r}: expected torch or "
                           "shardcheck")
        super().__init__(config.src)
        self.era = detect_era(self.src)
        packing, engine = self.era.packing, self.era.engine
        self.data_path = ArealDataPath(self.src, packing) if packing and self.layout_option == "framework" else None
        if variant is not None:
            if engine is None:
                raise BadInput(f"AReaL at {self.short()} has no MegatronEngine.forward_backward_batch / "
                               "_compute_logprobs_and_loss / _compute_forward_result (they came with 0369627d4): "
                               "use the default areal target")
            if self.data_path is None:
                raise BadInput(f"target {self.name!r} runs on AReaL's own packing ({DATA_FILE}); "
                               f"{'layout=shardcheck was asked' if packing else 'this checkout has none'}")
        reassembles = bool(engine and engine["reassembles"]) and variant is not None
        self.definitions = Definitions(
            loss_over="gathered" if reassembles else "held",
            loss_source=self._loss_source(reassembles))
        self.framework_files = tuple(dict.fromkeys(
            [self.era.functions_file] + ([str(MPU_ENTROPY_FILE)] if self.era.functions == "mpu" else [])
            + ([str(DATA_FILE), packing["cp_file"]] if self.data_path is not None else [])
            + ([str(ENGINE_FILE), str(TRAIN_ENGINE_FILE)] if variant is not None else [])))
        self.capabilities = self._capabilities()
        self._fns: dict[str, Any] | None = None
        self._engine: ArealEnginePath | None = None

    def _loss_source(self, reassembles: bool) -> str:
        """Whose convention the declared definition is, at this commit."""
        if reassembles:
            return ("AReaL's reassemble_cp_packed_logprobs: every CP rank holds every token, its loss weight "
                    "normalised over DP and CP")
        if self.variant is None:
            return "AReaL's log-probs are computed on each CP rank's own rows"
        if self.era.engine["cp_local"]:
            return "AReaL's loss is handed each CP rank's own log-probs (d58cca56f until 95e2379d0)"
        return "AReaL's engine gathers the logits over CP, the gradient kept on each rank's own rows"

    # ---- what runs ------------------------------------------------------------------------

    def _all_gather_rule(self, scenario: Scenario) -> str | None:
        """areal:engine under CP where AReaL reassembles with torch's all-gather, on a gloo world."""
        if scenario.cp == 1 or self.variant not in TRAIN_PATH_VARIANTS or not self.era.engine["reassembles"] \
                or self.cp_all_gather is not None or ranks_on_nccl():
            return None
        return ("AReaL's reassemble_cp_packed_logprobs calls torch.distributed.nn.functional.all_gather, whose "
                "backward on gloo (_AlltoAll) scatters with the CP group's rank as a global src: it fails on any CP "
                "group other than global ranks 0..cp-1 (a torch limitation, not AReaL's); --target-opt "
                "cp_all_gather=torch runs it anyway, cp_all_gather=shardcheck with a gloo-safe all-gather of the "
                "same contract; nccl runs torch's own")

    def _capabilities(self) -> Capabilities:
        engine = self.variant is not None
        reasons = {"allgather": "AReaL has no all-gather CP: its Megatron CP is zigzag (2*cp load-balanced chunks "
                                "per sequence, preprocess_packed_seqs_context_parallel) only"}
        if engine:
            reasons["bshd"] = "AReaL's Megatron engine packs every batch (pack_tensor_dict): thd and zigzag only"

        def rule(scenario: Scenario) -> str | None:
            built = self.data_path.builds(scenario) if engine and self.data_path is not None else None
            return built or self._all_gather_rule(scenario)

        return Capabilities(
            layouts=frozenset(MEGATRON_LAYOUTS) - set(reasons), layout_reasons=tuple(reasons.items()), rule=rule,
            entropy=self.variant != "forward",
            reasons=(("entropy", "forward_batch computes log-probs only (_compute_forward_result: gather_logprobs)"),
                     ("replay_keep", "AReaL normalises over the whole vocabulary: it replays no keep sets"),
                     ("sampling", "AReaL applies no top-k / top-p filter to the training logits")))

    def _functions(self) -> dict[str, Any]:
        """gather_logprobs(_entropy) of this commit, compiled alone from their file (its module imports
        areal.infra.platforms, which pulls transformers): the module's own top-level lines, the NPU
        check and the torch.compile of the tp = 1 helpers, are not run (they run eagerly)."""
        if self._fns is None:
            import torch
            import torch.distributed as dist

            path = self.src / self.era.functions_file
            tree = FRAMEWORK.parse(self.src, self.era.functions_file)
            given: dict[str, Any] = {"torch": torch, "dist": dist, "functools": functools}
            if self.era.functions == "mpu":
                from megatron.core import parallel_state as mpu
                from megatron.core import tensor_parallel

                # AReaL's module as it is (torch and megatron only): its torch.compile'd helper runs eagerly
                entropy = self.import_module(MPU_ENTROPY_MODULE)._VocabParallelEntropy
                given.update(mpu=mpu, tensor_parallel=tensor_parallel, _VocabParallelEntropy=entropy)
            try:
                self._fns = compile_alone(path, _closure(tree, ENTRY_POINTS), given)
            except LookupError as exc:
                raise BadInput(f"AReaL at {self.short()}: {exc}") from None
        return self._fns

    def _engine_path(self) -> ArealEnginePath:
        if self._engine is None:
            import torch.distributed.nn.functional as dist_f

            fns = self._functions()
            try:
                self._engine = ArealEnginePath(self.src, self.era.engine, self.data_path,
                                               {n: fns[n] for n in ENTRY_POINTS},
                                               GLOO_SAFE_DIST_F if self.cp_all_gather == "shardcheck" else dist_f)
            except LookupError as exc:
                raise BadInput(f"AReaL at {self.short()}: {exc}") from None
        return self._engine

    def compute(self, inputs: RankInputs) -> RankOutputs:
        if self.variant is None:
            return self._call_functions(inputs)
        if inputs.rollout is None:
            raise ValueError(f"{self.name} runs on AReaL's packing, and the harness handed it no rollout")
        import torch

        from shardcheck.scenarios.traced_layout import local_tokens_at

        rows = torch.tensor(local_tokens_at(inputs.rank_layout, inputs.tokens), dtype=torch.int64)
        rollout = inputs.rollout.to(inputs.logits.device)
        owed = self._owed(inputs)
        starts = [0]
        for total in inputs.total_lengths[:-1]:
            starts.append(starts[-1] + total)
        if self.variant == "forward":
            out = self._engine_path().forward(inputs.logits, rows, rollout, inputs.temperature)
            return RankOutputs([out[i, (total - response - 1) + js.to(out.device)] for i, (total, response, js)
                                in enumerate(zip(inputs.total_lengths, inputs.response_lengths, owed))])
        logprobs, entropy, fed = self._engine_path().train(inputs.logits, rows, rollout, inputs.temperature)
        # what AReaL's loss reads: its inputs' packing (cu_seqlens), row p scoring token p + 1
        cu = [int(c) for c in fed["cu_seqlens"].tolist()]
        picks = [cu[i] + (total - response - 1) + js.to(logprobs.device) for i, (total, response, js)
                 in enumerate(zip(inputs.total_lengths, inputs.response_lengths, owed))]
        ent = None
        if inputs.with_entropy:
            # AReaL's losses never differentiate the entropy (grpo_loss_fn: entropy.detach()); the
            # scenario's entropy_coef asks for its gradient
            kept = entropy if inputs.entropy_coef else entropy.detach()
            ent = [kept[p] for p in picks]
        return RankOutputs([logprobs[p] for p in picks], ent)

    def _owed(self, inputs: RankInputs) -> list[Any]:
        """Per sample, the response tokens this rank returns: every one where every CP rank holds the
        whole sequence (declared gathered), else those its own rows score."""
        import torch

        if self.definitions.loss_over == "gathered" and inputs.cp_size > 1:
            return [torch.arange(response) for response in inputs.response_lengths]
        return [tokens for _, tokens in inputs.held_rows()]

    def _call_functions(self, inputs: RankInputs) -> RankOutputs:
        fns = self._functions()
        logits = inputs.logits if inputs.layout == "bshd" else inputs.logits[0]
        labels = inputs.row_labels().view(logits.shape[:-1])
        kwargs: dict[str, Any] = {"temperature": inputs.temperature,
                                  "chunk_size": inputs.chunk_size if inputs.chunk_size > 0 else AREAL_CHUNK}
        if self.era.functions == "vocab_parallel":  # before 62d41759c the TP group came from parallel_state
            kwargs["tp_group"] = inputs.tp_group if inputs.tp_size > 1 else None
        entropy = None
        if inputs.with_entropy:
            log_probs, entropy = fns["gather_logprobs_entropy"](logits, labels, **kwargs)
            # AReaL's losses never differentiate the entropy (grpo_loss_fn: entropy.detach()); the
            # scenario's entropy_coef asks for its gradient
            entropy = (entropy if inputs.entropy_coef else entropy.detach()).reshape(-1)
        else:
            log_probs = fns["gather_logprobs"](logits, labels, **kwargs)
        flat = log_probs.reshape(-1)
        held = [rows for rows, _ in inputs.held_rows()]  # declared: loss_over="held"
        return RankOutputs([flat[r] for r in held], None if entropy is None else [entropy[r] for r in held])

    # ---- report -----------------------------------------------------------------------------

    def forget(self) -> None:
        self._fns = None
        self._engine = None
        if self.data_path is not None:
            self.data_path.release()

    def description(self) -> dict[str, Any]:
        era = self.era
        functions = ("gather_logprobs_entropy / gather_logprobs (tp_group explicit)" if era.functions ==
                     "vocab_parallel" else "gather_logprobs_entropy / gather_logprobs (TP group from parallel_state; "
                                           "_VocabParallelEntropy + megatron-core's vocab_parallel_cross_entropy)")
        out: dict[str, Any] = {
            "functions": f"{era.functions_file}: {functions}",
            "data_path": layout_description(self.data_path, self.layout_option,
                                            "no packing" if not era.packing else "bshd"),
            "temperature": "passed in: AReaL divides the logits by it inside, out of place",
            "entropy": "-sum p log p; detached where the scenario's entropy_coef is 0, as AReaL's losses detach it",
            "framework_files": list(self.framework_files),
            "not_run": ["the functions' module top level (the NPU check, torch.compile of the tp=1 helpers: they "
                        "run eagerly)"],
        }
        if self.variant is None:
            out["chunk_size"] = f"the scenario's, else AReaL's {AREAL_CHUNK}"
            out["bshd"] = "the functions' contract (any leading dimensions), laid out by shardcheck: AReaL packs thd"
        else:
            out["chunk_size"] = f"AReaL's {AREAL_CHUNK} (the engine passes none)"
            out["stand_ins"] = ["the Megatron model (the harness's logits for the rows it is handed)",
                                "megatron's no-pipelining schedule (one forward step and its loss_func per "
                                "micro-batch; the harness's backward)",
                                "the loss (a recorder of what AReaL hands it)",
                                "the engine object (config.temperature)",
                                "the micro-batch split (one micro-batch: AReaL's default mb_spec)"]
            out["not_run"] += ["_prepare_mb_list's split_padded_tensor_dict_into_mb_list (one micro-batch)",
                               "the loss scaling (local weight / total weight * loss multiplier)"]
            if self.variant in TRAIN_PATH_VARIANTS and era.engine["reassembles"]:
                out["cp_all_gather"] = {
                    None: "torch's own on nccl; on gloo cp > 1 is skipped (torch's gloo backward)",
                    "torch": "torch.distributed.nn.functional.all_gather, AReaL's own",
                    "shardcheck": "shardcheck's gloo-safe all-gather (all-gather; backward: the gradients "
                                  "all-reduced, the rank's slice kept = reduce-scatter SUM) instead of torch's"}[
                    self.cp_all_gather]
        return out


def _build(variant: str | None, config: TargetConfig) -> ArealTarget:
    refuse_loss_variant("areal", variant, config, ("entropy_bonus",))
    if variant == "fsdp":  # its own module builds on this one: the registered factory builds it
        raise BadInput("areal:fsdp is built by the registered target (shardcheck.targets.frameworks: "
                       "--target areal:fsdp)")
    if config.get("path") is not None:
        raise BadInput("target 'areal': option path applies to areal:fsdp only")
    return ArealTarget(variant, config)


target = CheckoutFactory(
    FRAMEWORK, _build,
    doc=("inclusionAI/AReaL's gather_logprobs(_entropy) and its Megatron engine's call sites from a source checkout "
         "(--areal-src, --target-src or SHARDCHECK_AREAL_SRC)"),
    options=OPTIONS, variants=VARIANTS)
