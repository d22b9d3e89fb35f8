"""OpenRLHF/OpenRLHF's actor log-probs and entropy, loaded from a source checkout: ``--target openrlhf``.

What runs is OpenRLHF's own ``Actor.forward`` (``openrlhf/models/actor.py``), compiled alone from its
file, with ``packing_samples=True``, called as its PPO actor calls it (``ppo_actor.py``:
``self.actor(sequences, action_mask, attention_mask=..., return_output=True, ring_attn_group=...,
return_entropy=entropy_coef is not None)``), on the batch its experience maker builds (each sample
``prompt + response``, right-padded by ``zero_pad_sequences``; ``action_mask`` over positions 1.., set
on the response). Inside it, all OpenRLHF's own code from the checkout:

- ``unpad_and_slice_tensor`` (``ring_attn_utils.py``): the labels rolled on the ``[B, S]`` batch
  (``torch.roll(sequences, -1, dims=1)``), the batch unpadded into one packed stream, and under ring
  attention ``get_tensor_in_current_ring_attn_rank``: the stream padded with 0 to a multiple of the
  ring size and cut into contiguous slices, the rank keeping its own;
- the model: a stand-in that hands back the rank's given logits (``[1, n, V]``) for the slice it is
  given (it checks that the token ids OpenRLHF hands it are the rows its data path laid out);
- ``output["logits"].to(torch.float32)``, then ``compute_entropy`` on them (``utils.py``, decorated
  ``@torch.compile``: run eagerly, the decorator handed a ``torch`` whose ``compile`` is the identity,
  unless ``--target-opt torch_compile=true``),
  ``log_probs_from_logits(logits, rolled, temperature=T)`` (its torch branch where flash_attn is not
  installed, flash_attn's triton cross entropy where it is), each gathered by
  ``gather_and_pad_tensor`` (all_gather over the ring group, the ring padding cut, ``pad_input``
  back to ``[B, S]``), ``[:, :-1]``, and the action mask. Under ``thd`` and ``bshd`` (below) the
  same, without a group.

The rows are OpenRLHF's own (:class:`OpenRLHFDataPath`, the target's ``data_path``): the harness
pushes a position-encoded batch through ``unpad_and_slice_tensor`` (ring, thd; bshd: the padded
batch as it is) and learns from what comes out which (sample, position) each local row holds; the
logits arrive in those rows.

The ring group is OpenRLHF's own: ``DeepspeedStrategy``'s lines that build its DeviceMesh
(``setup_distributed``: ``dp_size`` and ``init_device_mesh("cuda", (dp, ring, tp),
mesh_dim_names=("dp", "sp", "tp"))``) and set the group from it (``setup_ring_attn`` up to
``set_ring_attn_group(mesh["sp"].get_group())``), compiled alone from ``deepspeed.py`` on a
stand-in strategy, the mesh built once per world through the harness's ``framework_groups`` (its
groups checked against the harness's). The one change to those lines: ``"cuda"`` is the world's
device type (:data:`MESH_STAND_IN`). The rest of ``setup_ring_attn`` patches transformers'
attention for ring_flash_attn: the model's attention, not run here. A checkout without those lines
(before #996) gets the harness's sp group, set with ``set_ring_attn_group``.
``update_ring_attn_params`` (it hands ``cu_seqlens`` to ring_flash_attn's attention kernel, which
is the model's, not checked here) is replaced by a recorder; what it was handed is in the
notes. flash_attn (``bert_padding``'s ``unpad_input``, ``pad_input``, ``index_first_axis``,
einops' ``rearrange`` and ``utils.distributed``'s ``all_gather``) runs where it is installed; where
it is not (a CPU), torch-only stand-ins of the same semantics are given (:data:`STAND_INS`): the
all-gather's forward is ``all_gather_into_tensor``, its backward ``reduce_scatter_tensor`` (a sum),
as flash_attn's ``AllGatherFunc``.

Layouts: ``ring`` (OpenRLHF's ring attention, sp >= 2), ``thd`` (``packing_samples`` without ring
attention: the packed stream, no group) and ``bshd`` (OpenRLHF's default, ``packing_samples=False``:
the right-padded ``[B, S]`` batch handed to the model as it is, ``position_ids`` from the attention
mask, no gather). OpenRLHF has no vocab-parallel log-probs and no Megatron-style context
parallelism.

The entropy: with ``entropy_coef`` 0 OpenRLHF computes it as a logged metric only (its loss adds it
where ``entropy_coef != 0``), so the adapter returns it detached there (its values are checked, its
backward is not run: OpenRLHF's never runs); with any other coefficient it returns it as
``Actor.forward`` does, in the graph.

Temperature: ``log_probs_from_logits`` divides the logits in place (``logits.div_(T)``). Its caller
cast them to float32 first; a model whose logits are float32 already (the harness's float32
scenarios) gets its own output divided, which the harness reports as ``input_mutated``. OpenRLHF's
models are bf16 or fp16 (``--ds.param_dtype``), whose cast copies: see docs/openrlhf.md.
"""

from __future__ import annotations

import ast
import dataclasses
from typing import Any

from shardcheck.errors import BadInput
from shardcheck.scenarios.scenario import Scenario
from shardcheck.targets.base import Capabilities, RankInputs, RankOutputs, TargetConfig
from shardcheck.targets.checkout import CheckoutFactory, CheckoutTarget
from shardcheck.targets.compiled import compile_alone
from shardcheck.targets.source import Framework

RING_FILE = "openrlhf/models/ring_attn_utils.py"
UTILS_FILE = "openrlhf/models/utils.py"
ACTOR_FILE = "openrlhf/models/actor.py"
DEEPSPEED_FILE = "openrlhf/utils/deepspeed/deepspeed.py"
RING_FUNCTIONS = ("set_ring_attn_group", "get_ring_attn_group", "get_tensor_in_current_ring_attn_rank",
                  "unpad_and_slice_tensor", "gather_and_pad_tensor")
UTILS_FUNCTIONS = ("_logsumexp_by_chunk", "log_probs_from_logits", "compute_entropy")
# read by Actor only on the branches that load a HF model (pretrain_or_model a str): never called here
ACTOR_OFF_PATH = ("LoraConfig", "TaskType", "get_peft_model", "LoraLayer", "AutoModelForCausalLM",
                  "AutoModelForImageTextToText", "BitsAndBytesConfig", "HfDeepSpeedConfig",
                  "_patch_zero3_weight_mapping", "set_z3_leaf_modules")

FRAMEWORK = Framework("openrlhf", "OpenRLHF", RING_FILE, ("openrlhf",), package_inits="skip", eager=False,
                      clone="a clone of OpenRLHF/OpenRLHF")
ENV = FRAMEWORK.env

OPTIONS = {
    "torch_compile": "true: run compute_entropy as OpenRLHF decorates it (@torch.compile; about 15 s of "
                     "compiling per process on a CPU) instead of eagerly (the default: the decorator applied as "
                     "the identity)",
}

TP_WHY = ("OpenRLHF's actor has no vocab-parallel log-probs: log_probs_from_logits and compute_entropy take each "
          "row's logits over the whole vocabulary, with no process group (tp 1)")
CP_WHY = ("OpenRLHF has no Megatron-style context parallelism: its sequence parallelism is ring attention "
          "(layout ring, --ds.ring_attn_size)")
LAYOUT_WHY = {
    "zigzag": "OpenRLHF's ring attention splits the packed stream contiguously (no zigzag): layout ring",
    "allgather": "OpenRLHF has no all-gather CP; its ring split is layout ring",
    "ulysses": "OpenRLHF has no Ulysses sequence parallelism: its sequence parallelism is ring attention (layout "
               "ring), which splits the same rows but gathers its outputs with flash_attn's all_gather",
}
REPLAY_WHY = "OpenRLHF's actor normalises over the whole vocabulary: it replays no keep sets"
SAMPLING_WHY = "OpenRLHF's actor applies no top-k / top-p filter to the training logits (only the temperature)"


# -- flash_attn's functions, torch only ---------------------------------------------------------------
# OpenRLHF imports these from flash_attn (bert_padding, utils.distributed) and einops; they are not
# installed where there is no GPU build. Each has the semantics of flash_attn 2.8.3's (the version
# OpenRLHF's requirements pin), forward and backward.

def rearrange(x: Any, pattern: str, **sizes: int) -> Any:
    """einops.rearrange for the two patterns ring_attn_utils and bert_padding use."""
    if pattern == "b s ... -> (b s) ...":
        return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    if pattern == "(b s) ... -> b s ...":
        b = sizes["b"]
        return x.reshape(b, x.shape[0] // b, *x.shape[1:])
    raise NotImplementedError(f"rearrange pattern {pattern!r} (shardcheck's stand-in has two)")


def index_first_axis(x: Any, indices: Any) -> Any:
    """flash_attn's IndexFirstAxis: the rows ``indices`` of ``x`` (backward: scattered into zeros)."""
    return x[indices]


def pad_input(hidden: Any, indices: Any, batch: int, seqlen: int) -> Any:
    """flash_attn's pad_input: ``hidden`` scattered into ``batch * seqlen`` zero rows at ``indices``
    (IndexPutFirstAxis; backward: the rows gathered), as ``[batch, seqlen, ...]``."""
    out = hidden.new_zeros(batch * seqlen, *hidden.shape[1:]).index_put((indices,), hidden)
    return rearrange(out, "(b s) ... -> b s ...", b=batch)


def unpad_input(hidden: Any, attention_mask: Any, unused_mask: Any = None) -> tuple[Any, Any, Any, int, Any]:
    """flash_attn (>= 2.7)'s unpad_input, its five results."""
    import torch
    import torch.nn.functional as F

    masks = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens = masks.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(masks.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return (index_first_axis(rearrange(hidden, "b s ... -> (b s) ..."), indices), indices, cu_seqlens,
            int(seqlens.max().item()), used)


def _all_gather_function() -> Any:
    import torch
    import torch.distributed as dist

    class AllGatherFunc(torch.autograd.Function):
        """flash_attn.utils.distributed.AllGatherFunc: forward all_gather_into_tensor along the first
        axis, backward reduce_scatter_tensor (a sum over the group)."""

        @staticmethod
        def forward(ctx: Any, input_: Any, process_group: Any) -> Any:  # type: ignore[override]
            ctx.process_group = process_group
            world = dist.get_world_size(process_group)
            output = torch.empty(world * input_.shape[0], *input_.shape[1:], dtype=input_.dtype, device=input_.device)
            dist.all_gather_into_tensor(output, input_.contiguous(), group=process_group)
            return output

        @staticmethod
        def backward(ctx: Any, grad_output: Any) -> Any:  # type: ignore[override]
            world = dist.get_world_size(ctx.process_group)
            grad = grad_output.contiguous()
            grad_input = torch.empty(grad.shape[0] // world, *grad.shape[1:], dtype=grad.dtype, device=grad.device)
            dist.reduce_scatter_tensor(grad_input, grad, group=ctx.process_group)
            return grad_input, None

    return AllGatherFunc


def flash_attn_functions() -> dict[str, Any]:
    """What ring_attn_utils imports from flash_attn and einops: theirs where installed, else the
    stand-ins above."""
    try:
        from einops import rearrange as real_rearrange
        from flash_attn.bert_padding import index_first_axis as real_index
        from flash_attn.bert_padding import pad_input as real_pad
        from flash_attn.bert_padding import unpad_input as real_unpad
        from flash_attn.utils.distributed import all_gather as real_all_gather
    except ImportError:
        return {"unpad_input": unpad_input, "pad_input": pad_input, "index_first_axis": index_first_axis,
                "rearrange": rearrange, "all_gather": _all_gather_function().apply}
    return {"unpad_input": real_unpad, "pad_input": real_pad, "index_first_axis": real_index,
            "rearrange": real_rearrange, "all_gather": real_all_gather}


def flash_attn_installed() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("flash_attn") is not None
    except (ImportError, ValueError):
        return False


STAND_INS = ("flash_attn.bert_padding.unpad_input, pad_input, index_first_axis and einops.rearrange, and "
             "flash_attn.utils.distributed.all_gather (AllGatherFunc: all_gather_into_tensor forward, "
             "reduce_scatter_tensor sum backward), torch-only with flash_attn 2.8.3's semantics")


@dataclasses.dataclass(frozen=True)
class OpenRLHFEra:
    """What the checkout offers, read from its source (nothing imported)."""

    forward_params: tuple[str, ...]  # Actor.forward's parameters
    entropy_compiled: bool  # compute_entropy is decorated (@torch.compile)
    temperature_in_log_probs: bool  # log_probs_from_logits takes temperature (#857, 45898fd7, on)
    entropy_temperature: bool  # compute_entropy takes a temperature (not at the pin)
    # DeepspeedStrategy builds its DeviceMesh (dp, sp, tp) and takes the ring group from it (#996,
    # f5b45490, on): the ring group comes from those lines (mesh_lines)
    strategy_mesh: bool = False


def _defs(tree: ast.Module | None) -> dict[str, Any]:
    return {n.name: n for n in (tree.body if tree else []) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def _params(fn: ast.FunctionDef) -> tuple[str, ...]:
    return tuple(a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs)


def detect_era(src: Any) -> OpenRLHFEra:
    """What the checkout's three files offer; BadInput naming what a tree this target reads lacks."""
    ring, utils, actor = (_defs(FRAMEWORK.parse(src, rel)) for rel in (RING_FILE, UTILS_FILE, ACTOR_FILE))
    for rel, defs, names in ((RING_FILE, ring, RING_FUNCTIONS), (UTILS_FILE, utils, UTILS_FUNCTIONS),
                             (ACTOR_FILE, actor, ("Actor",))):
        absent = [n for n in names if n not in defs]
        if absent:
            raise BadInput(f"OpenRLHF at {src} has no {', '.join(absent)} in {rel}: not a tree the openrlhf target "
                           "reads (the unpad / roll / slice / gather path came with #923, 9673a87c)")
    forward = next((n for n in actor["Actor"].body if isinstance(n, ast.FunctionDef) and n.name == "forward"), None)
    params = _params(forward) if forward is not None else ()
    for needed in ("sequences", "action_mask", "attention_mask", "return_output", "ring_attn_group", "return_entropy"):
        if needed not in params:
            raise BadInput(f"OpenRLHF at {src}: Actor.forward takes no {needed} (takes {', '.join(params)}): not a "
                           "tree the openrlhf target reads")
    entropy = utils["compute_entropy"]
    return OpenRLHFEra(
        forward_params=params,
        entropy_compiled=any("compile" in ast.unparse(d) for d in entropy.decorator_list),
        temperature_in_log_probs="temperature" in _params(utils["log_probs_from_logits"]),
        entropy_temperature="temperature" in _params(entropy),
        strategy_mesh=mesh_lines(src)[0] is not None,
    )


# -- DeepspeedStrategy's mesh and ring group, lifted --------------------------------------------------
# deepspeed.py imports deepspeed, transformers and peft at its top: the lines that build the mesh and
# set the ring group are lifted out of their methods alone, their def lines and line numbers kept.

STRATEGY = "DeepspeedStrategy"
# what the lifted lines read from outside themselves (the rest of setup_distributed is DeepSpeed's
# start-up, not lifted)
MESH_GIVEN = ("dist", "init_device_mesh", "set_ring_attn_group", "timedelta")
MESH_STAND_IN = ('init_device_mesh\'s device "cuda" (setup_distributed) replaced by the world\'s device type (the '
                 'logits\': "cpu" on a gloo world; unchanged on a CUDA one): that one string constant of the lifted '
                 "lines, nothing else of them changed")


@dataclasses.dataclass(frozen=True)
class MeshLines:
    """setup_distributed and setup_ring_attn, each its own def with its body cut to the lines lifted."""

    module: ast.Module
    lines: str  # where they are, for the report ("deepspeed.py:103-108, 119-126")

    def key(self) -> str:
        """The lines' own text, hashed: the mesh they built is kept for the world's life, and only
        the same lines (another instance of this target, the same commit) may take it over."""
        import hashlib

        return hashlib.sha1(ast.unparse(self.module).encode()).hexdigest()[:12]


def _is_call(node: ast.AST, name: str) -> bool:
    """Whether ``node`` is a call of ``name`` (a bare name or ``self.name``)."""
    return isinstance(node, ast.Call) and ((isinstance(node.func, ast.Name) and node.func.id == name) or
                                           (isinstance(node.func, ast.Attribute) and node.func.attr == name))


def _calls(stmt: ast.AST, name: str) -> bool:
    return any(_is_call(n, name) for n in ast.walk(stmt))


def _device(module: ast.AST) -> ast.Constant | None:
    """init_device_mesh's device where it is the literal "cuda": the one node the stand-in replaces."""
    call = next((n for n in ast.walk(module) if _is_call(n, "init_device_mesh")), None)
    first = call.args[0] if call is not None and call.args else None
    return first if isinstance(first, ast.Constant) and first.value == "cuda" else None


def _assigns(stmt: ast.stmt, names: tuple[str, ...]) -> bool:
    return isinstance(stmt, ast.Assign) and any(
        (isinstance(t, ast.Name) and t.id in names) or (isinstance(t, ast.Attribute) and t.attr in names)
        for t in stmt.targets)


def mesh_lines(src: Any) -> tuple[MeshLines | None, str]:
    """DeepspeedStrategy's mesh lines in the checkout (setup_distributed's ``self.world_size``,
    ``dp_size``, ``init_device_mesh("cuda", (dp, ring, tp), mesh_dim_names=("dp", "sp", "tp"))`` and
    ``self.setup_ring_attn(mesh)``; setup_ring_attn up to and including ``set_ring_attn_group(group)``),
    or None and why not (an older tree: the harness's sp group is then set, as before)."""
    import copy
    import symtable

    from shardcheck.targets.compiled import names_read

    tree = FRAMEWORK.parse(src, DEEPSPEED_FILE)
    strategy = next((n for n in (tree.body if tree else []) if isinstance(n, ast.ClassDef) and n.name == STRATEGY),
                    None)
    if strategy is None:
        return None, f"no {STRATEGY} in {DEEPSPEED_FILE}" if tree else f"no {DEEPSPEED_FILE}"
    methods = {n.name: n for n in strategy.body if isinstance(n, ast.FunctionDef)}
    distributed, ring = methods.get("setup_distributed"), methods.get("setup_ring_attn")
    if distributed is None or ring is None:
        return None, f"{STRATEGY} has no setup_distributed / setup_ring_attn"
    body = distributed.body
    mesh = next((i for i, s in enumerate(body) if _calls(s, "init_device_mesh")), None)
    call = next((i for i, s in enumerate(body) if mesh is not None and i > mesh and _calls(s, "setup_ring_attn")), None)
    if mesh is None or call is None:
        return None, f"{STRATEGY}.setup_distributed builds no init_device_mesh handed to setup_ring_attn"
    start = mesh
    while start > 0 and _assigns(body[start - 1], ("world_size", "dp_size")):
        start -= 1
    setter = next((i for i, s in enumerate(ring.body) if _calls(s, "set_ring_attn_group")), None)
    if setter is None:
        return None, f"{STRATEGY}.setup_ring_attn calls no set_ring_attn_group"
    distributed, ring = copy.deepcopy(distributed), copy.deepcopy(ring)
    distributed.body, ring.body = distributed.body[start:call + 1], ring.body[:setter + 1]
    module = ast.Module(body=[distributed, ring], type_ignores=[])
    if _device(module) is None:
        return None, f"{STRATEGY}.setup_distributed's init_device_mesh is not on the literal device \"cuda\""
    table = symtable.symtable(ast.unparse(module), DEEPSPEED_FILE, "exec")
    # the defaults (setup_distributed's timeout=timedelta(...)) are read at module level
    read = {s.get_name() for s in table.get_symbols() if s.is_referenced() and s.is_global()}
    read |= set().union(*(names_read(child) for child in table.get_children()))
    unknown = sorted(read - set(MESH_GIVEN) - set(dir(__import__("builtins"))))
    if unknown:
        return None, f"{STRATEGY}'s mesh lines read {', '.join(unknown)}, which the target does not give"
    where = (f"{DEEPSPEED_FILE}:{distributed.body[0].lineno}-{distributed.body[-1].end_lineno}, "
             f"{ring.body[0].lineno}-{ring.body[-1].end_lineno}")
    return MeshLines(module, where), ""


def _torch_without_compile() -> Any:
    """torch as utils.py reads it, but ``torch.compile(fn)`` is ``fn``: its decorated function runs
    eagerly, as written."""
    import types

    import torch

    class Torch(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

        @staticmethod
        def compile(fn: Any = None, **options: Any) -> Any:
            return fn if fn is not None else (lambda f: f)

    return Torch("torch")


class _ModelOutput(dict):
    """What a HF model returns as far as Actor.forward uses it: ``output["logits"]`` and attributes
    set on it (``output.entropy``)."""


def _stand_in_model(logits: Any, expected: Any, seen: dict[str, Any]) -> Any:
    """The model Actor wraps (its nn.Module branch): it hands back the rank's given logits for the
    token ids OpenRLHF hands it, after checking they are the rows those logits are for."""
    import torch

    class GivenLogits(torch.nn.Module):
        def forward(self, input_ids: Any, attention_mask: Any = None, position_ids: Any = None, **kw: Any) -> Any:
            seen.update(input_ids=input_ids.detach().cpu(), attention_mask=attention_mask,
                        position_ids=None if position_ids is None else position_ids.detach().cpu())
            if tuple(input_ids.shape) != tuple(logits.shape[:2]) or not torch.equal(input_ids.cpu(), expected):
                raise ValueError(f"OpenRLHF handed its model token ids {input_ids.tolist()} on this rank; the "
                                 f"layout's rows (the given logits' tokens) are {expected.tolist()}")
            return _ModelOutput(logits=logits)

    return GivenLogits()


def right_padded_batch(tokens: Any, lengths: list[int], responses: list[int]) -> tuple[Any, Any, Any]:
    """The experience maker's batch: prompt + response per sample, right-padded with 0
    (zero_pad_sequences), the attention mask, and the action mask over positions 1.. (set on the
    response: ``action_mask[start:end] = 1``, then ``[:, 1:]``)."""
    import torch

    batch, seqlen = len(lengths), max(lengths)
    sequences = torch.zeros(batch, seqlen, dtype=torch.long)
    attention_mask = torch.zeros(batch, seqlen, dtype=torch.long)
    action_mask = torch.zeros(batch, seqlen - 1, dtype=torch.bool)
    for i, (row, total, response) in enumerate(zip(tokens, lengths, responses)):
        sequences[i, :total] = row[:total].cpu()
        attention_mask[i, :total] = 1
        action_mask[i, total - response - 1:total - 1] = True
    return sequences, attention_mask, action_mask


PACKED_NAME = f"{RING_FILE}:unpad_and_slice_tensor"
BSHD_NAME = (f"{ACTOR_FILE}:Actor.forward with packing_samples=False (the experience maker's right-padded batch, "
             "handed to the model as it is)")


class OpenRLHFDataPath:
    """OpenRLHF's own layout of a rank's rows: under ring and thd, ``unpad_and_slice_tensor``
    (compiled alone from the checkout: the batch unpadded into one packed stream and, with a ring
    group, ``get_tensor_in_current_ring_attn_rank``'s pad and contiguous slice); under bshd the
    right-padded batch itself. The ring group is megatron-core's context-parallel group (the
    harness's sp group) at sp > 1, set with OpenRLHF's ``set_ring_attn_group`` and put back after
    (the slicing calls no collective: it reads the group's rank and size only, alike in the
    strategy mesh's sp group that compute uses, checked to hold the same ranks);
    ``update_ring_attn_params`` is the target's recorder."""

    name = PACKED_NAME

    def __init__(self, namespace: Any) -> None:
        self._namespace = namespace  # the target's compiled functions (its recorder inside)

    def knobs(self) -> dict[str, Any]:
        return {}

    def builds(self, scenario: Scenario) -> str | None:
        return None  # ring, thd and bshd: the target's only layouts

    def local_tokens(self, rollout: Any) -> Any:
        sequences, attention_mask, _ = right_padded_batch(rollout.tokens, rollout.total_lengths,
                                                          rollout.response_lengths)
        if rollout.layout == "bshd":  # packing_samples=False: Actor.forward hands the model the batch
            self.name = BSHD_NAME
            return sequences
        self.name = PACKED_NAME
        from megatron.core import parallel_state as mpu

        ns = self._namespace()
        group = mpu.get_context_parallel_group() if mpu.get_context_parallel_world_size() > 1 else None
        before = ns["get_ring_attn_group"]()
        ns["set_ring_attn_group"](group)  # DeepspeedStrategy.setup_ring_attn
        try:
            return ns["unpad_and_slice_tensor"](sequences, attention_mask, group)[0]
        finally:
            ns["set_ring_attn_group"](before)


class OpenRLHFTarget(CheckoutTarget):
    """OpenRLHF's Actor.forward with packing and ring attention (log-probs and entropy), on its own batch, unpadding, slicing and gather (--openrlhf-src, --target-src or SHARDCHECK_OPENRLHF_SRC)"""

    framework = FRAMEWORK
    name = "openrlhf"
    framework_files = (ACTOR_FILE, RING_FILE, UTILS_FILE)

    def __init__(self, config: TargetConfig) -> None:
        try:
            self.torch_compile = config.flag("torch_compile")
        except ValueError as exc:
            raise BadInput(f"target 'openrlhf': {exc}") from None
        super().__init__(config.src)
        self.era = detect_era(self.src)
        if not self.era.temperature_in_log_probs:
            raise BadInput(f"OpenRLHF at {self.short()}: log_probs_from_logits takes no temperature (before #857, "
                           "45898fd7): not a tree the openrlhf target reads")
        self.capabilities = Capabilities(
            layouts=frozenset({"ring", "thd", "bshd"}), entropy=True, entropy_grad=True, replay_keep=False,
            sampling=False,
            tp_sizes=frozenset({1}), cp_sizes=frozenset({1}), layout_reasons=tuple(LAYOUT_WHY.items()),
            reasons=(("tp", TP_WHY), ("cp", CP_WHY), ("replay_keep", REPLAY_WHY), ("sampling", SAMPLING_WHY)),
            rule=self._rule)
        self._ns: dict[str, Any] | None = None
        self.mesh, self.mesh_why = mesh_lines(self.src)
        if self.mesh is not None:
            self.framework_files = (*self.framework_files, DEEPSPEED_FILE)
        self._strategies: dict[str, type] = {}  # per device type: the lifted DeepspeedStrategy
        self.cu_seqlens: list[list[int]] = []
        self.data_path = OpenRLHFDataPath(self._namespace)

    @staticmethod
    def _rule(scenario: Scenario) -> str | None:
        if scenario.layout == "ring" and scenario.sp < 2:
            return "ring attention needs a ring of 2 ranks or more (sp >= 2); at sp 1 OpenRLHF's packed path is thd"
        return None

    def forget(self) -> None:
        if self._ns is not None:
            self._ns["set_ring_attn_group"](None)
        self._ns = None
        self._strategies.clear()  # their setup_ring_attn sets the namespace just dropped

    def description(self) -> dict[str, Any]:
        compiled = self.torch_compile or not self.era.entropy_compiled
        entropy = ("compute_entropy as decorated (@torch.compile)" if compiled else
                   "compute_entropy run eagerly, its @torch.compile applied as the identity (torch.compile's "
                   "import costs seconds a rank; --target-opt torch_compile=true runs it compiled)")
        return {
            "calls": ("Actor.forward(sequences, action_mask, attention_mask=, return_output=True, ring_attn_group=the "
                      "ring group (None for thd and bshd), return_entropy=with_entropy) with packing_samples=True "
                      "(ring, thd) or False (bshd), compiled alone "
                      f"from {ACTOR_FILE}; inside it unpad_and_slice_tensor, get_tensor_in_current_ring_attn_rank and "
                      f"gather_and_pad_tensor ({RING_FILE}), {entropy} and log_probs_from_logits ({UTILS_FILE})"),
            "batch": ("each sample prompt + response, right-padded to [B, S] (zero_pad_sequences), action_mask "
                      "[B, S - 1] on the response: what the experience maker builds; each response read out of "
                      "action_log_probs and output.entropy[:, -A:] by the action mask"),
            "data_path": (f"{PACKED_NAME} (ring, thd; with the ring group set, get_tensor_in_current_ring_attn_rank) "
                          f"and {BSHD_NAME} (bshd): the rows learned through the position trace"),
            "model": ("a stand-in handing back the rank's given logits, after checking the token ids OpenRLHF hands it "
                      "are the rows the data path laid out"),
            "ring_group": self._ring_group_described(),
            "update_ring_attn_params": "replaced by a recorder (ring_flash_attn's attention is the model's)",
            "flash_attn": ("installed: its bert_padding, utils.distributed.all_gather and (in log_probs_from_logits) "
                           "triton cross entropy run" if flash_attn_installed() else
                           f"not installed: log_probs_from_logits takes its torch branch; stand-ins: {STAND_INS}"),
            "entropy_coef_0": "the entropy returned detached (OpenRLHF logs it, its loss leaves it out)",
            "chunk_size": "not taken: OpenRLHF's logsumexp runs in chunks of 1024 rows of its own",
            "framework_files": list(self.framework_files),
            **({"stand_ins": [MESH_STAND_IN]} if self.mesh is not None else {}),
        }

    def _ring_group_described(self) -> str:
        if self.mesh is None:
            return (f"set_ring_attn_group(the harness's sp group), as DeepspeedStrategy.setup_ring_attn does ("
                    f"{self.mesh_why}: the checkout's strategy builds no mesh this target lifts)")
        return (f"OpenRLHF's own DeepspeedStrategy lines ({self.mesh.lines}), compiled alone on a stand-in strategy "
                "(world_size, ring_attn_size = sp, ds_tensor_parallel_size = 1): setup_distributed's dp_size and "
                "init_device_mesh(..., (dp_size, ring_attn_size, tp), mesh_dim_names=(\"dp\", \"sp\", \"tp\")), "
                "once per world and layout through the harness's framework_groups (its dp, sp and tp groups checked "
                "against the harness's), then setup_ring_attn up to set_ring_attn_group(mesh[\"sp\"].get_group()) "
                "before every ring call; the rest of setup_ring_attn (ring_flash_attn's patch of transformers' "
                "attention) is the model's attention, not run here; ring layout only (at sp 1 setup_ring_attn sets "
                "nothing and thd / bshd take no group)")

    # ---- loading ----------------------------------------------------------------------------

    def _namespace(self) -> dict[str, Any]:
        """OpenRLHF's functions and Actor, each compiled alone from its file (their modules import
        flash_attn, deepspeed, peft and transformers at the top)."""
        if self._ns is not None:
            return self._ns
        import typing

        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        recorded = self.cu_seqlens

        def update_ring_attn_params(cu_seqlens: Any) -> None:
            """OpenRLHF's hands cu_seqlens to ring_flash_attn's kernel (the model's): recorded."""
            recorded.append([int(c) for c in cu_seqlens])

        try:
            ring = compile_alone(self.src / RING_FILE, RING_FUNCTIONS, {
                "torch": torch, "dist": dist, **flash_attn_functions(), "RING_ATTN_GROUP": None,
                "update_ring_attn_params": update_ring_attn_params})
            # eager: compute_entropy's decorator sees a torch whose compile hands the function back
            # (torch.compile's first use imports torch._dynamo: seconds a rank)
            utils = compile_alone(self.src / UTILS_FILE, UTILS_FUNCTIONS,
                                  {"torch": torch if self.torch_compile else _torch_without_compile(), "F": F})
            entropy = utils["compute_entropy"]
            actor = compile_alone(self.src / ACTOR_FILE, ["Actor"], {
                "torch": torch, "dist": dist, "nn": torch.nn, "Optional": typing.Optional,
                "unpad_and_slice_tensor": ring["unpad_and_slice_tensor"],
                "gather_and_pad_tensor": ring["gather_and_pad_tensor"],
                "compute_entropy": entropy, "log_probs_from_logits": utils["log_probs_from_logits"]},
                off_path=ACTOR_OFF_PATH)
        except LookupError as exc:
            raise BadInput(f"OpenRLHF at {self.short()}: {exc}") from None
        self._ns = {**ring, "Actor": actor["Actor"], "compute_entropy": entropy}
        return self._ns

    def _strategy(self, device_type: str) -> type:
        """DeepspeedStrategy with the two lifted methods, init_device_mesh on ``device_type``
        (MESH_STAND_IN), compiled against this target's namespace (its set_ring_attn_group)."""
        if device_type in self._strategies:
            return self._strategies[device_type]
        import __future__
        import copy
        from datetime import timedelta

        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        assert self.mesh is not None
        module = copy.deepcopy(self.mesh.module)
        device = _device(module)
        assert device is not None  # mesh_lines found it
        device.value = device_type
        path = self.src / DEEPSPEED_FILE
        given = {"dist": dist, "init_device_mesh": init_device_mesh, "timedelta": timedelta,
                 "set_ring_attn_group": self._namespace()["set_ring_attn_group"]}
        namespace: dict[str, Any] = {"__name__": "shardcheck_compiled_deepspeed", "__file__": str(path), **given}
        code = compile(module, str(path), "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True)
        exec(code, namespace)  # noqa: S102 - OpenRLHF's own lines, from its file
        strategy = type(STRATEGY, (), {"setup_distributed": namespace["setup_distributed"],
                                       "setup_ring_attn": namespace["setup_ring_attn"]})
        self._strategies[device_type] = strategy
        return strategy

    def _ring_group(self, inputs: RankInputs) -> Any:
        """The ring group as OpenRLHF's strategy sets it (``set_ring_attn_group``) and its actor is
        handed it (``strategy.ring_attn_group``, i.e. ``get_ring_attn_group()``): from the checkout's
        own mesh lines where it has them, else the harness's sp group."""
        ns = self._namespace()
        if self.mesh is None or inputs.world is None:  # no mesh lines, or no harness to build groups with
            ns["set_ring_attn_group"](inputs.sp_group)  # DeepspeedStrategy.setup_ring_attn
            return inputs.sp_group
        import torch.distributed as dist

        cls = self._strategy(inputs.logits.device.type)
        world = dist.get_world_size()
        shape = (world // inputs.sp_size, inputs.sp_size, 1)

        def build() -> Any:
            strategy = cls()
            strategy.world_size, strategy.ring_attn_size, strategy.ds_tensor_parallel_size = world, inputs.sp_size, 1
            strategy.setup_distributed()
            return strategy

        strategy = inputs.framework_groups(
            ("openrlhf", shape, self.mesh.key()), build,
            lambda s: {role: s.ds_device_mesh[role].get_group() for role in ("dp", "sp", "tp")})
        # the mesh is kept for the world's life, but the group OpenRLHF's functions read is this
        # namespace's global, which thd / bshd scenarios, the data path and forget() set in
        # between (and the mesh may have been built by another instance of this target): its own
        # setup_ring_attn, from this instance's lines, sets it again
        cls.setup_ring_attn(strategy, strategy.ds_device_mesh)
        return ns["get_ring_attn_group"]()

    # ---- the call ---------------------------------------------------------------------------

    def compute(self, inputs: RankInputs) -> RankOutputs:
        ns = self._namespace()
        logits = inputs.logits
        device = logits.device
        ring, packed = inputs.layout == "ring", inputs.layout != "bshd"
        group = self._ring_group(inputs) if ring else None
        if not ring:
            ns["set_ring_attn_group"](None)  # ring_attn_size 1: no ring group
        rollout = inputs.rollout  # the real batch its data path laid out (the logits are in its rows)
        # the experience maker's batch: prompt + response per sample, right-padded (pad id 0)
        sequences, attention_mask, action_mask = right_padded_batch(
            rollout.tokens, rollout.total_lengths, rollout.response_lengths)
        batch = len(rollout.total_lengths)
        expected = inputs.row_tokens()  # the rows the position trace learned from the data path
        seen: dict[str, Any] = {}
        actor = ns["Actor"](_stand_in_model(logits, expected, seen), temperature=inputs.temperature)
        actor.packing_samples = packed  # set only on its str branch (a HF model loaded by name)
        self.cu_seqlens.clear()
        action_log_probs, output = actor(
            sequences.to(device), action_mask.to(device), attention_mask=attention_mask.to(device),
            return_output=True, ring_attn_group=group, return_entropy=inputs.with_entropy)
        width = action_mask.shape[1]
        masks = [action_mask[i].nonzero().squeeze(-1).to(device) for i in range(batch)]
        log_probs = [action_log_probs[i, cols] for i, cols in enumerate(masks)]
        entropy = None
        if inputs.with_entropy:  # ppo_actor: output.entropy[:, -action_mask.shape[1]:] under the action mask
            values = output.entropy[:, -width:]
            if inputs.entropy_coef == 0:
                # --actor.entropy_coef 0: a logged metric, never in the loss ("if entropy_coef != 0: loss -=
                # ..."), so its backward never runs in OpenRLHF's training; the values are still checked
                values = values.detach()
            entropy = [values[i, cols] for i, cols in enumerate(masks)]
        notes = {"position_ids": seen["position_ids"].reshape(-1).tolist()}
        if ring:
            notes["cu_seqlens"] = self.cu_seqlens[-1] if self.cu_seqlens else None  # ring_flash_attn's, recorded
        return RankOutputs(log_probs, entropy, notes=notes)

    def repro_call(self) -> str | None:
        """How a repro script calls OpenRLHF: the same Actor.forward, compiled from rank.src (its
        compute_entropy eager, as the default here)."""
        return None if self.torch_compile else REPRO_CALL



# How a `shardcheck repro` script calls OpenRLHF (harness/controller/commands/repro.py): torch alone.
REPRO_CALL = '''
def call_code_under_test(logits, rank):
    """OpenRLHF's Actor.forward as shardcheck's openrlhf target calls it, from rank.src (flash_attn: torch-only stand-ins)."""
    import ast, typing  # noqa: E401
    F, ws, flat = torch.nn.functional, dist.get_world_size, lambda x, *a, **k: x.reshape(-1, *x.shape[2:])  # einops' (b s)
    coll = lambda fn, x, g, rows: (lambda out: fn(out, x.contiguous(), group=g) or out)(x.new_empty(rows, *x.shape[1:]))  # noqa: E731
    gather = type("AllGatherFunc", (torch.autograd.Function,), {  # flash_attn's: backward reduce_scatter (a sum)
        "forward": staticmethod(lambda ctx, x, g: setattr(ctx, "g", g) or coll(dist.all_gather_into_tensor, x, g, ws(g) * len(x))),
        "backward": staticmethod(lambda ctx, y: (coll(dist.reduce_scatter_tensor, y, ctx.g, len(y) // ws(ctx.g)), None))})
    def unpad_input(h, mask):  # noqa: E306  flash_attn.bert_padding's, its 5 results
        i, n = mask.flatten().nonzero().flatten(), mask.sum(-1, dtype=torch.int32)
        return flat(h)[i], i, F.pad(n.cumsum(0, dtype=torch.int32), (1, 0)), int(n.max()), n
    ns = dict(torch=torch, dist=dist, nn=torch.nn, F=F, Optional=typing.Optional, unpad_input=unpad_input, rearrange=flat,
              pad_input=lambda h, i, b, s: h.new_zeros(b * s, *h.shape[1:]).index_put((i,), h).reshape(b, s, *h.shape[1:]),
              index_first_axis=lambda x, i: x[i], all_gather=gather.apply, update_ring_attn_params=lambda cu: None)  # ring_flash_attn's
    for rel in ("ring_attn_utils.py", "utils.py", "actor.py"):  # compiled alone: the modules import flash_attn, deepspeed, peft
        path = os.path.join(rank.src, "openrlhf", "models", rel)
        defs = [n for n in ast.parse(open(path).read()).body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name not in ns]
        [setattr(n, "decorator_list", []) for n in defs]  # compute_entropy's @torch.compile: eager (the same findings)
        exec(compile(ast.Module(defs, []), path, "exec", __import__("__future__").annotations.compiler_flag), ns)
    S, n, r = max(rank.total_lengths), torch.tensor(rank.total_lengths)[:, None], torch.tensor(rank.response_lengths)[:, None]
    seq = torch.stack([F.pad(t[:k].cpu(), (0, S - k)) for t, k in zip(rank.tokens, rank.total_lengths)])  # right-padded
    att, act = (torch.arange(S) < n).long(), (torch.arange(1, S) >= n - r) & (torch.arange(1, S) < n)  # action mask [B, S-1]
    ns["set_ring_attn_group"](group := rank.sp_group if rank.layout == "ring" else None)  # DeepspeedStrategy.setup_ring_attn
    actor = ns["Actor"](type("M", (torch.nn.Module,), {"forward": lambda *a, **k: type("O", (dict,), {})(logits=logits)})(),
                        temperature=rank.temperature)  # the model: the given logits
    actor.packing_samples, dev = rank.layout != "bshd", logits.device
    lp, out = actor(seq.to(dev), act.to(dev), attention_mask=att.to(dev), return_output=True, ring_attn_group=group,
                    return_entropy=rank.with_entropy)
    cols = [row.nonzero().squeeze(-1).to(dev) for row in act]
    ent = None if not rank.with_entropy else out.entropy[:, -act.shape[1]:].detach() if rank.entropy_coef == 0 else out.entropy[:, -act.shape[1]:]
    return [lp[i, c] for i, c in enumerate(cols)], None if ent is None else [ent[i, c] for i, c in enumerate(cols)]
'''


def _build(variant: str | None, config: TargetConfig) -> OpenRLHFTarget:
    return OpenRLHFTarget(config)


target = CheckoutFactory(
    FRAMEWORK, _build,
    doc=("OpenRLHF's actor log-probs and entropy (Actor.forward with packing and ring attention: "
         "unpad_and_slice_tensor, compute_entropy, log_probs_from_logits, gather_and_pad_tensor) "
         "(--openrlhf-src, --target-src or SHARDCHECK_OPENRLHF_SRC)"),
    options=OPTIONS)
