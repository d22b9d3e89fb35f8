"""verl's own data path for ``verl:actor``: the packing verl's Megatron forward runs on a batch
before the model, from the target's checkout (``verl/models/mcore/util.py``).

- engine call site: ``preprocess_thd_engine`` (before it ``preprocess_thd_no_padding`` and
  ``preprocess_packed_seqs_no_padding``) on the nested token ids, as ``gptmodel_forward_model_engine``
  calls it; bshd scenarios ``preprocess_bshd_engine`` (or ``preprocess_bshd_no_padding``). verl pads
  every sequence to a multiple of tp, or of 2*tp*cp under zigzag CP.
- legacy call site (``MegatronPPOActor``, removed by #6067): ``preprocess_packed_seqs(input_ids,
  attention_mask)`` on verl's batch, prompts left-padded and responses right-padded to the batch's
  longest (``input_ids = [prompts | responses]``), as ``gptmodel_forward`` packs it for thd.

The layout knobs are the arguments of those functions that change the rows (``use_fp8_padding``,
``pad_to_length_bucket``, ``min_local_rows``, ``cp_layout``, ``forced_max_seqlen``), where the
checkout's functions take them; their defaults are what verl's forward passes without fp8 or
dynamic CP. Each is passed only to the functions that take it.

Nothing of verl's is wrapped, cast or patched: what its functions raise propagates.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import torch

from shardcheck.scenarios.scenario import Scenario
from shardcheck.targets.base import Knob, Rollout, positive_int_or_none

UTIL_FILE = Path("verl/models/mcore/util.py")
UTIL_MODULE = "verl.models.mcore.util"
CP_LAYOUTS = ("zigzag", "contiguous")


def _bool(value: Any) -> str | None:
    return None if isinstance(value, bool) else f"must be true or false, got {value!r}"



def _cp_layout(value: Any) -> str | None:
    return None if value in CP_LAYOUTS else f"must be one of {', '.join(CP_LAYOUTS)}, got {value!r}"


KNOBS = {  # name: (check, help)
    "use_fp8_padding": (_bool, "verl's FP8 padding (model config fp8 e4m3/hybrid): each sequence padded to "
                               "lcm(16, align), the packed buffer's total to 128 * align"),
    "pad_to_length_bucket": (positive_int_or_none, "pad the packed buffer's total to a multiple of this bucket "
                                                "(the last sequence takes the padding); None: off"),
    "min_local_rows": (positive_int_or_none, "pad the packed buffer to at least cp * this many rows (the last "
                                          "sequence takes the padding); None: off"),
    "cp_layout": (_cp_layout, "how verl shards the packed rows across CP ranks: zigzag (chunks r and 2cp-1-r "
                              "of every sequence) or contiguous (one interval of the padded buffer each)"),
    "forced_max_seqlen": (positive_int_or_none, "bshd: pad every batch row to this length (before tp/cp alignment) "
                                             "instead of the batch's longest; None: off"),
}


def _contiguous_here(value: Any) -> str | None:
    """verl's contiguous CP layout needs a megatron-core whose PackedSeqParams has
    cp_partition_mode (verl raises otherwise): this machine's, not verl's, limit."""
    if value != "contiguous":
        return None
    import dataclasses

    from megatron.core.packed_seq_params import PackedSeqParams

    if "cp_partition_mode" in {f.name for f in dataclasses.fields(PackedSeqParams)}:
        return None
    import megatron.core

    return (f"verl's contiguous CP layout needs PackedSeqParams.cp_partition_mode, which megatron-core "
            f"{getattr(megatron.core, '__version__', '?')} here does not have")


def read_signatures(src: Path) -> dict[str, dict[str, Any]]:
    """The parameters and literal defaults of every top-level function in the checkout's util.py."""
    path = src / UTIL_FILE
    if not path.is_file():
        return {}
    tree = ast.parse(path.read_text(), filename=str(path))
    out: dict[str, dict[str, Any]] = {}
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
        args = fn.args.posonlyargs + fn.args.args
        defaults: dict[str, Any] = {}
        for a, d in list(zip(args[len(args) - len(fn.args.defaults):], fn.args.defaults)) + [
                (a, d) for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults) if d is not None]:
            try:
                defaults[a.arg] = ast.literal_eval(d)
            except ValueError:
                pass
        out[fn.name] = {"params": [a.arg for a in args + fn.args.kwonlyargs], "defaults": defaults,
                        "line": fn.lineno}
    return out


class _VerlPacking:
    """What both call sites share: the checkout's util module, its knobs."""

    functions: tuple[str, ...] = ()

    def __init__(self, target: Any, signatures: dict[str, dict[str, Any]]) -> None:
        self.target = target  # imports (and releases) verl's modules
        self.signatures = signatures

    def util(self) -> Any:
        return self.target.modules(self.target.module_names())[UTIL_MODULE]

    def knobs(self) -> dict[str, Knob]:
        out: dict[str, Knob] = {}
        for fn in self.functions:
            sig = self.signatures.get(fn)
            for name in (sig or {}).get("params", ()):
                if name in KNOBS and name not in out:
                    check, help_ = KNOBS[name]
                    out[name] = Knob(sig["defaults"].get(name), f"{help_} ({fn})", check,
                                     _contiguous_here if name == "cp_layout" else None)
        return out

    def kwargs(self, function: str, knobs: dict[str, Any]) -> dict[str, Any]:
        """The knobs ``function`` takes, as verl's forward passes them."""
        params = self.signatures[function]["params"]
        return {k: v for k, v in knobs.items() if k in params}

    def _commit(self) -> str:
        return self.target.short()


class VerlEngineDataPath(_VerlPacking):
    """verl's engine packing (thd: preprocess_thd_engine or its predecessors; bshd:
    preprocess_bshd_engine or preprocess_bshd_no_padding)."""

    def __init__(self, target: Any, signatures: dict[str, dict[str, Any]], packing: dict[str, Any]) -> None:
        super().__init__(target, signatures)
        self.packing = packing
        bshd = packing.get("bshd")
        self.functions = (packing["preprocess"],) + ((bshd["preprocess"],) if bshd else ())
        self.name = f"{UTIL_FILE}:{packing['preprocess']}" + (f" / {bshd['preprocess']}" if bshd else "")

    def builds(self, scenario: Scenario) -> str | None:
        if scenario.layout == "allgather":
            return (f"verl at {self._commit()} has no all-gather CP layout of its own in its packing "
                    f"({self.packing['preprocess']}); rows laid out by shardcheck")
        if scenario.layout == "bshd":
            if not self.packing.get("bshd"):
                return f"verl at {self._commit()} has no engine bshd packing; rows laid out by shardcheck"
            if scenario.cp > 1:
                return ("bshd under CP is not followed through verl's engine bshd packing by this adapter; rows "
                        "laid out by shardcheck")
        return None

    def pre(self, layout: str) -> tuple[str, str]:
        if layout == "bshd":
            return self.packing["bshd"]["preprocess"], self.packing["bshd"]["postprocess"]
        return self.packing["preprocess"], self.packing["postprocess"]

    def nested(self, tokens: list[torch.Tensor]) -> Any:
        return torch.nested.as_nested_tensor(list(tokens), layout=torch.jagged)

    def pack(self, values: Any, layout: str, knobs: dict[str, Any], need_roll: bool = False) -> tuple:
        """verl's preprocess of one nested tensor, with the knobs it takes (need_roll where it has it)."""
        name = self.pre(layout)[0]
        kwargs = self.kwargs(name, knobs)
        if need_roll and "need_roll" in self.signatures[name]["params"]:
            kwargs["need_roll"] = True
        return getattr(self.util(), name)(values, pre_process=True, **kwargs)

    def local_tokens(self, rollout: Rollout) -> torch.Tensor:
        return self.pack(self.nested(rollout.tokens), rollout.layout, rollout.knobs)[0]

    def model_inputs(self, rollout: Rollout) -> dict[str, Any]:
        """What the packing hands the model besides the tokens: the PackedSeqParams' boundaries
        (the padded ones where it has them) and, where it returns them, the rows' position ids."""
        packed = self.pack(self.nested(rollout.tokens), rollout.layout, rollout.knobs)
        out: dict[str, Any] = {}
        params = packed[1] if len(packed) > 1 else None
        if params is not None and hasattr(params, "cu_seqlens_q"):
            padded = getattr(params, "cu_seqlens_q_padded", None)
            out["cu_seqlens"] = padded if padded is not None else params.cu_seqlens_q
        if len(packed) > 2 and packed[2] is not None:
            out["position_ids"] = packed[2]
        return out


class VerlLegacyDataPath(_VerlPacking):
    """verl's legacy actor packing: preprocess_packed_seqs on the padded batch."""

    functions = ("preprocess_packed_seqs",)
    name = f"{UTIL_FILE}:preprocess_packed_seqs"

    def builds(self, scenario: Scenario) -> str | None:
        if scenario.layout == "allgather":
            return (f"verl at {self._commit()} has no all-gather CP layout of its own (preprocess_packed_seqs "
                    "splits zigzag only); rows laid out by shardcheck")
        if scenario.layout == "bshd":
            return ("the legacy actor's bshd forward (preprocess_bshd) is not followed by this adapter; rows laid "
                    "out by shardcheck")
        return None

    @staticmethod
    def batch(rollout: Rollout) -> dict[str, torch.Tensor]:
        """verl's rollout batch: ``input_ids`` [B, max prompt + max response] with prompts
        left-padded and responses right-padded (pad id 0), ``attention_mask`` (bool),
        ``position_ids`` (cumsum of the mask - 1, clipped at 0) and ``responses``."""
        prompts = [t - r for t, r in zip(rollout.total_lengths, rollout.response_lengths)]
        max_p, max_r = max(prompts), max(rollout.response_lengths)
        b = len(rollout.tokens)
        device = rollout.tokens[0].device
        input_ids = torch.zeros(b, max_p + max_r, dtype=torch.int64, device=device)
        mask = torch.zeros(b, max_p + max_r, dtype=torch.bool, device=device)
        for i, (tok, p) in enumerate(zip(rollout.tokens, prompts)):
            r = len(tok) - p
            input_ids[i, max_p - p : max_p + r] = tok
            mask[i, max_p - p : max_p + r] = True
        position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
        return {"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids,
                "responses": input_ids[:, max_p:]}

    def pack(self, values: torch.Tensor, attention_mask: torch.Tensor, knobs: dict[str, Any]) -> tuple:
        kwargs = self.kwargs("preprocess_packed_seqs", knobs)
        return self.util().preprocess_packed_seqs(values, attention_mask, pre_process=True, **kwargs)

    def local_tokens(self, rollout: Rollout) -> torch.Tensor:
        batch = self.batch(rollout)
        return self.pack(batch["input_ids"], batch["attention_mask"], rollout.knobs)[0]


def data_path_for(target: Any, kind: str, packing: dict[str, Any] | None) -> _VerlPacking | None:
    """The data path of ``verl:actor`` at this call site, or None where the checkout has no packing
    for it."""
    signatures = read_signatures(target.src)
    if kind == "engine":
        if packing is None or packing["preprocess"] not in signatures:
            return None
        return VerlEngineDataPath(target, signatures, packing)
    if "preprocess_packed_seqs" not in signatures or "postprocess_packed_seqs" not in signatures:
        return None
    return VerlLegacyDataPath(target, signatures)
