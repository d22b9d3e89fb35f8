"""verl's Megatron log-prob and entropy path, imported from a source checkout: ``--target verl``
and ``--target verl:actor`` (``--target verl:loss``, verl's policy loss in the training step on the
engine's terms, is :mod:`shardcheck.targets.verl_loss`).

verl is named by a checkout (``--verl-src DIR``, ``--target-src DIR`` or ``SHARDCHECK_VERL_SRC``);
it is never installed and its files are never written (no bytecode is cached there).
``import verl`` runs ``verl/__init__.py``, which pulls ray and the rest: the packages holding the
modules imported here (``verl``, ``verl.utils``, ``verl.utils.megatron``, ``verl.models.mcore``)
are made as empty packages over the checkout's folders, so their ``__init__.py`` is not run; every
other module is the checkout's own. Third-party modules those files import but do not use here
(tensordict, transformers, ...) are stubbed only when missing, and the report says which.
``logging.Logger.warning_once``, which transformers adds on import and verl calls, is added while
it is missing. torch.compile'd helpers (the entropy's ``mul_reduce``) run eagerly: compiling costs
seconds per process on 2 cores and is not what is checked.

``verl`` checks ``verl/utils/megatron/tensor_parallel.py``: ``vocab_parallel_entropy`` (or
``vocab_parallel_entropy_with_chunking`` with ``--target-opt entropy_chunking=true``; chunk = the
scenario's chunk size, verl's 2048 where it has none) and ``vocab_parallel_log_probs_from_logits``
(megatron-core's vocab-parallel cross entropy, negated), on the harness's rows and labels, called
as verl's call sites have called them since #2484: the entropy on the logits, the log-probs on a
clone when the entropy is also wanted (the log-prob kernel overwrites its input). The temperature
is the caller's job there: the adapter divides out of place when it is not 1.

``verl:actor`` checks the actor's own call site, which divides the logits by the temperature and
combines both functions. Which one is read from the checkout (``--target-opt call_site=``):

- ``legacy``: the ``logits_processor`` closure of ``MegatronPPOActor.forward_backward_batch``
  (``verl/workers/actor/megatron_actor.py``, removed by #6067), handed the harness's rows with
  their next-token labels and the mask of rows that score a response token, as verl's legacy
  forward built them (shifted labels, ``label_mask``) and packed them.
- ``engine``: the logits processor of ``MegatronEngineWithLMHead`` (a closure of ``forward_step``,
  later the method ``_lm_head_logits_processor``) in ``verl/workers/engine/megatron/
  transformer_impl.py``, with the arguments verl's engine forward builds: the nested token ids as
  labels and the temperatures expanded as nested, packed by verl's own thd packing
  (``preprocess_thd_engine``, before it ``preprocess_thd_no_padding`` and
  ``preprocess_packed_seqs_no_padding``; labels rolled there where the era rolls them) or bshd
  packing, and its outputs unpacked by the matching ``postprocess_*`` (which all-gathers them over
  CP). On the harness's rows (``layout=shardcheck``) a scenario whose rows verl's packing puts
  elsewhere than the harness's layout (verl pads every sequence to a multiple of tp, or of 2*tp*cp
  under CP) is skipped with the reason; a mismatch the rule misses is raised as the adapter's own
  error.
- ``auto`` (the default): the legacy actor where it still exists, else the engine.

The rows are laid out by verl's own packing (``--target-opt layout=framework``, the default): the
actor's data path (:mod:`shardcheck.targets.verl_data`) runs the call site's packing on the rollout
(the engine's ``preprocess_thd_engine`` / ``preprocess_bshd_engine`` or their predecessors; the
legacy actor's ``preprocess_packed_seqs`` on verl's padded batch), the harness learns the layout
from it, and ``compute`` runs the same packing on the real batch (``RankInputs.rollout``): labels,
label mask and temperatures packed as verl packs them, outputs unpacked by verl's postprocess.
Under CP verl's output is every token on every CP rank with the gradient only through the rank's
own rows; the adapter hands each rank its zigzag share through an autograd all-reduce over the CP
group (the harness's contract, not verl's). ``layout=shardcheck``: the harness's rows, as below.
The layout knobs are the layout arguments of those functions (``use_fp8_padding``, ...).

Both are compiled alone from the checkout's own file (its path and line numbers kept, so
tracebacks and in-place write sites name verl's lines): the modules around them import ray,
tensordict, omegaconf and megatron's whole training stack. The names they read from outside
themselves are bound as their module and caller bind them: verl's ``tensor_parallel`` functions,
torch, the module's logger, and the caller's ``calculate_entropy``, ``temperature`` and engine
config (``entropy_from_logits_with_chunking``). A name the adapter does not know refuses the
checkout (one line); nothing is guessed.
"""

from __future__ import annotations

import ast
import dataclasses
import logging
import builtins
import functools
import symtable
import types
from pathlib import Path
from typing import Any

from shardcheck.errors import BadInput
from shardcheck.scenarios.scenario import Scenario
from shardcheck.targets.base import (Capabilities, RankInputs, RankOutputs, TargetConfig, layout_description,
                                     layout_option)
from shardcheck.targets.checkout import CheckoutFactory, CheckoutTarget, refuse_loss_variant
from shardcheck.targets.source import Framework, functions_named, parameters
from shardcheck.targets.verl_data import data_path_for

TP_FILE = Path("verl/utils/megatron/tensor_parallel.py")
TP_MODULE = "verl.utils.megatron.tensor_parallel"
LEGACY_FILE = Path("verl/workers/actor/megatron_actor.py")
ENGINE_FILE = Path("verl/workers/engine/megatron/transformer_impl.py")
UTIL_FILE = Path("verl/models/mcore/util.py")
UTIL_MODULE = "verl.models.mcore.util"
TF_MODULE = "verl.utils.torch_functional"
# third-party modules verl's files import at module level but do not use on this path; stubbed
# only when missing
STUBBABLE = ("ray", "tensordict", "transformers", "flash_attn", "omegaconf", "codetiming", "hydra", "accelerate",
             "peft", "torch_npu", "mindspeed", "liger_kernel", "vllm", "sglang", "wandb", "datasets", "pandas",
             "pyarrow", "tensorboard", "mbridge", "megatron.bridge", "transformer_engine", "apex", "orjson", "PIL")
REPLAY_WHY = ("verl's Megatron log-prob path takes no replayed top-p / top-k keep sets: "
              "vocab_parallel_log_probs_from_logits and the actor's logits processor normalise over the whole "
              "vocabulary")
ALLGATHER_WHY = ("all-gather CP: verl's functions and call sites work per logit row and verl's CP output path "
                 "(postprocess_thd_engine, also in its contiguous CP layout) all-gathers every token to every CP "
                 "rank with the gradient only through the rank's own rows; the harness's all-gather contract wants "
                 "each rank's zigzag share with its gradient, a redistribution verl does not do")
FUNCTIONS = ("vocab_parallel_entropy", "vocab_parallel_log_probs_from_logits", "vocab_parallel_entropy_with_chunking",
             "vocab_parallel_sum_pi_squared")
# verl's engine packing over its history (newest first): thd, then bshd
PACKERS = (("preprocess_thd_engine", "postprocess_thd_engine"),
           ("preprocess_thd_no_padding", "postprocess_thd_no_padding"),
           ("preprocess_packed_seqs_no_padding", "postprocess_packed_seqs_no_padding"))
BSHD_PACKERS = (("preprocess_bshd_engine", "postprocess_bshd_engine"),
                ("preprocess_bshd_no_padding", "postprocess_bshd_no_padding"))
OPTIONS = {
    "call_site": "verl:actor only: legacy (MegatronPPOActor's logits_processor), engine "
                 "(MegatronEngineWithLMHead's, with verl's packing) or auto (legacy where it exists; default)",
    "entropy_chunking": "true: vocab_parallel_entropy_with_chunking with the scenario's chunk size, verl's "
                        "2048 where the scenario has none (verl's entropy_from_logits_with_chunking; default false)",
    "fused_kernels": "verl:fsdp only: torch (use_fused_kernels, the torch backend: verl's forward_with_torch_backend "
                     "and FusedLinearForPPO on the harness's logits as the last hidden states, an identity LM head) or "
                     "off (the default)",
    "layout": "verl:actor only: framework (verl's own packing lays out the rows, the default) or shardcheck (the "
              "harness's rows; the engine then skips scenarios whose rows verl's packing puts elsewhere)",
    "loss_agg_mode": "verl:loss only: verl's loss_agg_mode (agg_loss), verl's default (token-mean) unless given: "
                     "token-mean (the global batch's token mean), seq-mean-token-mean (the mean of each sample's token "
                     "mean); seq-mean-token-sum, token-sum and seq-mean-token-sum-norm are skipped, saying why",
    "loss_scale_factor": "verl:loss with loss_agg_mode=seq-mean-token-sum-norm only: batch_num_tokens sets verl's "
                         "loss_scale_factor to the global batch's masked-in count (the mode is then the token mean, "
                         "at commits where it is the global token sum over the factor)",
}
LOSS_OPTIONS = ("loss_agg_mode", "loss_scale_factor")


FRAMEWORK = Framework("verl", "verl", str(TP_FILE), ("verl",), STUBBABLE, package_inits="skip_above", eager=True,
                      clone="a clone of verl-project/verl; never pip install verl")
ENV = FRAMEWORK.env
source = FRAMEWORK.source


def _engine_site(tree: ast.Module | None) -> tuple[ast.FunctionDef, str] | None:
    """The engine's logits processor: the method, or the closure of MegatronEngineWithLMHead."""
    if tree is None:
        return None
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        if cls.name != "MegatronEngineWithLMHead":
            continue
        for fn in functions_named(cls, "_lm_head_logits_processor"):
            return fn, "MegatronEngineWithLMHead._lm_head_logits_processor"
        for fn in functions_named(cls, "logits_processor"):
            return fn, "MegatronEngineWithLMHead.forward_step.logits_processor"
    return None


def _legacy_site(tree: ast.Module | None) -> tuple[ast.FunctionDef, str] | None:
    if tree is None:
        return None
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for fn in functions_named(cls, "logits_processor"):
            return fn, f"{cls.name}.forward_backward_batch.logits_processor"
    return None


def _site_facts(fn: ast.FunctionDef) -> dict[str, Any]:
    text = ast.unparse(fn)
    calls = [n.func for n in sorted((n for n in ast.walk(fn) if isinstance(n, ast.Call)),
                                     key=lambda n: (n.lineno, n.col_offset))]
    names = [f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "" for f in calls]
    order = [n for n in names if n in ("vocab_parallel_entropy", "vocab_parallel_entropy_with_chunking",
                                       "vocab_parallel_log_probs_from_logits")]
    return {
        "params": parameters(fn),
        "temperature": "temperature" in text,
        "clones_for_entropy": ".clone()" in text,
        "first_call": order[0] if order else None,
        "rolls_label": "roll" in names,
        "entropy_chunking": "vocab_parallel_entropy_with_chunking" in names,
    }


@dataclasses.dataclass(frozen=True)
class VerlEra:
    """What a verl checkout has (:func:`detect_era`). ``call_sites`` and ``packing`` are facts
    about verl's functions, as reports show them."""

    functions: tuple[str, ...]  # the tensor_parallel functions it has (of FUNCTIONS)
    entropy_compiled: bool  # _VocabParallelEntropy.forward runs under torch.compile
    # per kind ("legacy", "engine"): file, function, line and how the call site calls the functions
    call_sites: dict[str, dict[str, Any]]
    # the engine's packing functions (preprocess, postprocess, need_roll, cp_layout, bshd); None: none
    packing: dict[str, Any] | None


def detect_era(src: Path) -> VerlEra:
    """What this checkout has, read from its source: the tensor_parallel functions, the actor's
    call sites (legacy MegatronPPOActor, engine) and the engine's packing functions."""
    tp = FRAMEWORK.parse(src, TP_FILE)
    functions = [f for f in FUNCTIONS if functions_named(tp, f)]
    for needed in ("vocab_parallel_entropy", "vocab_parallel_log_probs_from_logits"):
        if needed not in functions:
            raise BadInput(f"verl at {src}: {TP_FILE} has no {needed}")
    entropy_fwd = next((fn for cls in ast.walk(tp) if isinstance(cls, ast.ClassDef)
                        and cls.name == "_VocabParallelEntropy" for fn in functions_named(cls, "forward")), None)
    call_sites: dict[str, dict[str, Any]] = {}
    packing: dict[str, Any] | None = None
    for kind, rel, find in (("legacy", LEGACY_FILE, _legacy_site), ("engine", ENGINE_FILE, _engine_site)):
        found = find(FRAMEWORK.parse(src, rel))
        if found is not None:
            fn, qualname = found
            call_sites[kind] = {"file": str(rel), "function": qualname, "line": fn.lineno, **_site_facts(fn)}
    util = FRAMEWORK.parse(src, UTIL_FILE)
    for pre, post in PACKERS:
        fns = functions_named(util, pre)
        if fns and functions_named(util, post):
            params = parameters(fns[0])
            bshd = next(((b_pre, b_post) for b_pre, b_post in BSHD_PACKERS
                         if functions_named(util, b_pre) and functions_named(util, b_post)), None)
            packing = {"preprocess": pre, "postprocess": post, "need_roll": "need_roll" in params,
                              "cp_layout": "cp_layout" in params,
                              "bshd": None if bshd is None else {"preprocess": bshd[0], "postprocess": bshd[1]}}
            break
    return VerlEra(functions=tuple(functions), call_sites=call_sites, packing=packing,
                   entropy_compiled=bool(entropy_fwd is not None and "torch.compile" in ast.unparse(entropy_fwd)))


# ----------------------------------------------------------------------------------------------
# import: verl's files without verl's package __init__ files, stubs only for missing modules


@functools.lru_cache(None)
def _warning_once(self: logging.Logger, *args: Any, **kwargs: Any) -> None:
    """transformers' ``Logger.warning_once``: each distinct message once."""
    self.warning(*args, **kwargs)


# ----------------------------------------------------------------------------------------------
# the call site, compiled alone from verl's file

_BUILTINS = frozenset(dir(builtins))


class _Config:
    """The engine's ``engine_config``: the fields set; a read of any other is recorded."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)
        self.__dict__["_missing"] = set()

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("_"):
            self.__dict__["_missing"].add(name)
        raise AttributeError(name)


def compile_call_site(src: Path, site: dict[str, Any]) -> tuple[Any, dict[str, Any], list[str]]:
    """verl's call-site function compiled alone from its file (path and line numbers kept): the
    function, its globals (filled per call) and the names it reads from outside itself."""
    path = src / site["file"]
    tree = ast.parse(path.read_text(), filename=str(path))
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.lineno == site["line"])
    fn.decorator_list = []
    module = ast.Module(body=[fn], type_ignores=[])
    table = symtable.symtable(ast.unparse(module), str(path), "exec")
    inner = next(t for t in table.get_children() if t.get_name() == fn.name)
    free = sorted(s.get_name() for s in inner.get_symbols()
                  if s.is_global() and s.is_referenced() and s.get_name() not in _BUILTINS)
    namespace: dict[str, Any] = {"__name__": f"shardcheck_verl_site_{fn.name}", "__file__": str(path)}
    exec(compile(module, str(path), "exec"), namespace)  # noqa: S102 - verl's own function, from its file
    return namespace[fn.name], namespace, free


# ----------------------------------------------------------------------------------------------
# the targets


VERL_CHUNK_DEFAULT = 2048  # verl's entropy_from_logits_chunk_size default (workers/config)


def verl_chunk(chunk_size: int) -> int:
    """The scenario's chunk size as verl's entropy chunk: -1 (no chunking) is verl's default 2048."""
    return chunk_size if chunk_size > 0 else VERL_CHUNK_DEFAULT


def _mask_rows(inputs: RankInputs) -> Any:
    """True at the local rows that score a response token (verl's legacy ``label_mask``)."""
    import torch

    mask = torch.zeros(inputs.logits.shape[0] * inputs.logits.shape[1], dtype=torch.bool, device=inputs.logits.device)
    for rows, _ in inputs.held_rows():
        mask[rows] = True
    return mask.view(inputs.logits.shape[:2])


def _take(values: Any, rows: list) -> list:
    flat = values.reshape(-1)
    return [flat[r] for r in rows]


class VerlTarget(CheckoutTarget):
    """verl's vocab_parallel_entropy and vocab_parallel_log_probs_from_logits from a source checkout (--verl-src / SHARDCHECK_VERL_SRC)"""

    framework = FRAMEWORK

    name = "verl"
    # verl's log-prob modules this target runs, relative to the checkout (for coverage)
    framework_files: tuple[str, ...] = (str(TP_FILE),)

    def __init__(self, src: str | None = None, options: TargetConfig | None = None) -> None:
        super().__init__(src)
        self.era = detect_era(self.src)
        config = options or TargetConfig()
        try:
            self.entropy_chunking = config.flag("entropy_chunking")
        except ValueError as exc:
            raise BadInput(f"target {self.name!r}: {exc}") from None
        if self.entropy_chunking and "vocab_parallel_entropy_with_chunking" not in self.era.functions:
            raise BadInput(f"verl at {self.short()} has no vocab_parallel_entropy_with_chunking "
                           "(entropy_chunking=true needs #6446 or later)")
        self.capabilities = self._capabilities()
        self._modules: dict[str, types.ModuleType] | None = None

    def _capabilities(self) -> Capabilities:
        return Capabilities(
            layouts=frozenset({"thd", "bshd", "zigzag"}), entropy=True,
            layout_reasons=(("allgather", ALLGATHER_WHY),), reasons=(("replay_keep", REPLAY_WHY),))

    def forget(self) -> None:
        self._modules = None
        self.__dict__.pop("_site", None)

    def description(self) -> dict[str, Any]:
        return {"entropy_chunking": self.entropy_chunking,
                "not_run": "the __init__.py of the verl packages holding the modules imported (verl/__init__.py "
                           "imports ray); torch.compile runs eagerly",
                "logging": "logging.Logger.warning_once, which transformers adds on import and verl calls, is "
                           "added while verl is imported here when missing"}

    def modules(self, names: tuple[str, ...] = (TP_MODULE,)) -> dict[str, types.ModuleType]:
        if self._modules is None or any(n not in self._modules for n in names):
            if self._modules is not None:
                self.release()
            if not hasattr(logging.Logger, "warning_once"):
                # verl calls logger.warning_once on its module loggers (megatron_actor, models/mcore/util):
                # a method transformers adds to logging.Logger on import, as it is in every verl run
                logging.Logger.warning_once = _warning_once  # type: ignore[attr-defined]
                self.checkout.undo_later(lambda: delattr(logging.Logger, "warning_once"))
            self._modules = {name: self.import_module(name) for name in names}
        return self._modules

    def _entropy(self, tp: types.ModuleType, logits: Any, chunk_size: int) -> Any:
        if self.entropy_chunking:
            return tp.vocab_parallel_entropy_with_chunking(logits, chunk_size=verl_chunk(chunk_size))
        return tp.vocab_parallel_entropy(logits)

    def repro_call(self) -> str | None:
        """How a repro script calls verl: the functions, or the legacy actor's closure, on shardcheck's
        rows (the engine's call site, verl's packing and entropy chunking are not written yet)."""
        plain = type(self) is VerlTarget
        legacy = isinstance(self, VerlActorTarget) and self.kind == "legacy" and self.data_path is None
        return REPRO_CALL if (plain or legacy) and not self.entropy_chunking else None

    def compute(self, inputs: RankInputs) -> RankOutputs:
        tp = self.modules()[TP_MODULE]
        logits = inputs.logits
        if inputs.temperature != 1.0:  # the functions take none: the caller divides
            logits = logits / inputs.temperature
        labels = inputs.row_labels().view(logits.shape[:2])
        entropy = None
        if inputs.with_entropy:
            entropy = self._entropy(tp, logits, inputs.chunk_size)
            logits = logits.clone()  # as verl's call sites since #2484: the log-prob kernel overwrites it
        log_probs = tp.vocab_parallel_log_probs_from_logits(logits, labels)
        rows = inputs.scored_rows()
        return RankOutputs(_take(log_probs, rows), _take(entropy, rows) if entropy is not None else None)


def packing_mismatch(sc: Scenario) -> str | None:
    """Why verl's engine packing would put this scenario's rows elsewhere than the harness, or None.

    Its thd packing pads every sequence to a multiple of tp (cp = 1) or of 2*tp*cp and gives CP
    rank r chunks r and 2cp-1-r of it; its bshd packing pads the batch to a multiple of tp."""
    tp, cp = sc.tp, sc.cp
    lengths = [s.total for s in sc.samples]
    packing = "verl's engine packing (preprocess_thd_engine, formerly *_no_padding)"
    if sc.layout == "thd":
        bad = [n for n in lengths if n % tp]
        if bad:
            return (f"{packing} pads every sequence to a multiple of tp={tp}; lengths {bad} are not, so its rows "
                    "are not the harness's (packed without padding)")
    elif sc.layout == "zigzag":
        bad = [n for n in lengths if -(-n // (2 * cp * tp)) * tp != -(-n // (2 * cp))]
        if bad:
            return (f"{packing} pads every sequence to a multiple of 2*tp*cp={2 * tp * cp} before its zigzag split; "
                    f"for lengths {bad} its CP chunks are longer than the harness's (ceil(L/{2 * cp}) rows), so "
                    "its rows are not the harness's")
    elif sc.layout == "bshd":
        if max(lengths) % tp:
            return (f"verl's engine bshd packing pads the batch to a multiple of tp={tp}; the longest sample "
                    f"({max(lengths)}) is not, so its rows are not the harness's ({max(lengths)} a batch row)")
    return None


class VerlActorTarget(VerlTarget):
    """verl's actor call site: temperature, entropy and log-probs as MegatronPPOActor (legacy) or
    MegatronEngineWithLMHead (with verl's own packing) compute them"""

    name = "verl:actor"

    def __init__(self, src: str | None = None, options: TargetConfig | None = None) -> None:
        config = options or TargetConfig()
        choice = config.get("call_site", "auto")
        if choice not in ("auto", "legacy", "engine"):
            raise BadInput(f"target 'verl:actor': option call_site={choice!r}: expected legacy, engine or auto")
        layout = layout_option(config, "target 'verl:actor': ")
        self._choice, self.layout_option = choice, layout
        self.data_path = None
        super().__init__(src, options)
        sites = self.era.call_sites
        kind = ("legacy" if "legacy" in sites else "engine") if choice == "auto" else choice
        if kind not in sites:
            where = {"legacy": f"no logits_processor in {LEGACY_FILE}",
                     "engine": f"no MegatronEngineWithLMHead logits processor in {ENGINE_FILE}"}
            missing = [where[k] for k in (("legacy", "engine") if choice == "auto" else (kind,))]
            raise BadInput(f"verl at {self.short()} has no actor call site to check: {'; '.join(missing)}")
        self.kind, self.site = kind, sites[kind]
        if kind == "engine":
            if self.era.packing is None:
                raise BadInput(f"verl at {self.short()}: an engine call site but no packing functions in {UTIL_FILE}")
            if "label_mask" in self.site["params"]:
                raise BadInput(f"verl at {self.short()}: the engine call site takes label_mask, which the "
                               "adapter does not build (the engine forward of that era is not followed)")
        if self.entropy_chunking and not self.site["entropy_chunking"]:
            raise BadInput(f"target 'verl:actor': entropy_chunking=true, but the {kind} call site at {self.short()} "
                           "never calls vocab_parallel_entropy_with_chunking")
        if layout == "framework":
            self.data_path = data_path_for(self, kind, self.era.packing)
        self.framework_files = (str(TP_FILE), str(UTIL_FILE), self.site["file"])
        self.capabilities = self._capabilities()
        self.missing_config: set[str] = set()

    def _capabilities(self) -> Capabilities:
        if getattr(self, "kind", None) != "engine":
            return super()._capabilities()
        has_bshd = self.era.packing["bshd"]
        reasons = [("allgather", ALLGATHER_WHY)]
        if not has_bshd:
            reasons.append(("bshd", f"verl at {self.short()}: the engine packs thd only (no preprocess_bshd_engine "
                                    f"or preprocess_bshd_no_padding in {UTIL_FILE})"))
        # with no data path of its own the adapter packs the harness's samples with verl's packing
        # functions: a scenario whose rows they put elsewhere than the harness's layout is skipped
        return Capabilities(layouts=frozenset({"thd", "zigzag"} | ({"bshd"} if has_bshd else set())),
                            entropy=True, layout_reasons=tuple(reasons),
                            rule=packing_mismatch if self.data_path is None else None,
                            reasons=(("replay_keep", REPLAY_WHY),))

    def description(self) -> dict[str, Any]:
        out = super().description()
        out.update({"call_site": {"kind": self.kind, **self.site}, "call_site_option": self._choice,
                    "config_read_but_not_set": sorted(self.missing_config),
                    "data_path": layout_description(self.data_path, self.layout_option, "no packing"),
                    "framework_files": list(self.framework_files)})
        if self.kind == "engine":
            out["packing"] = self.era.packing
        return out

    def module_names(self) -> tuple[str, ...]:
        """verl's modules this call site (and its data path) import."""
        if self.kind == "legacy":
            return (TP_MODULE,) + ((UTIL_MODULE,) if self.data_path is not None else ())
        return (TP_MODULE, UTIL_MODULE) + ((TF_MODULE,) if "temperature" in self.site["params"] else ())

    def _site_function(self) -> tuple[Any, dict[str, Any], list[str]]:
        if getattr(self, "_site", None) is None:
            self.modules(self.module_names())
            fn, namespace, free = compile_call_site(self.src, self.site)
            unknown = [n for n in free if n not in self._known_free()] + [
                p for p in self.site["params"] if p not in self._known_free() | {"logits", "label", "label_mask"}]
            if unknown:
                raise BadInput(f"verl at {self.short()}: {self.site['function']} reads {', '.join(unknown)}, which "
                               "the adapter does not know how to set")
            self._site = (fn, namespace, free)
        return self._site

    @staticmethod
    def _known_free() -> set[str]:
        return {"torch", "logger", "calculate_entropy", "temperature", "calculate_sum_pi_squared",
                "distillation_use_topk", "distillation_only", "logits_processor_func", "batch", "data_format",
                "self", *FUNCTIONS}

    def _context(self, inputs: RankInputs) -> dict[str, Any]:
        """What the call site's caller binds: module names and the closure's free variables."""
        import torch

        tp = self._modules[TP_MODULE]
        logger = logging.getLogger(str(self.src / self.site["file"]))  # as verl's module: getLogger(__file__)
        engine = types.SimpleNamespace(engine_config=_Config(
            entropy_from_logits_with_chunking=self.entropy_chunking,
            entropy_from_logits_chunk_size=verl_chunk(inputs.chunk_size)))
        values: dict[str, Any] = {
            "torch": torch, "logger": logger, "calculate_entropy": inputs.with_entropy,
            "temperature": inputs.temperature, "calculate_sum_pi_squared": False, "distillation_use_topk": False,
            "distillation_only": False, "logits_processor_func": None, "batch": None,
            "data_format": inputs.qkv_format, "self": engine,
        }
        values.update({f: getattr(tp, f) for f in FUNCTIONS if hasattr(tp, f)})
        return values

    def _caller(self, inputs: RankInputs) -> tuple[Any, dict[str, Any]]:
        """The call site bound as its caller binds it: ``call(logits, args)`` and the context."""
        fn, namespace, free = self._site_function()
        context = self._context(inputs)
        namespace.update({k: context[k] for k in free})
        params = self.site["params"]
        lead = [context["self"]] if params[:1] == ["self"] else []
        # keyword parameters (the method's calculate_entropy, data_format, ...) as its caller binds them
        keywords = {p: context[p] for p in params[len(lead) + 1:] if p in context and p not in ("label", "temperature")}

        def call(logits: Any, args: dict[str, Any]) -> dict[str, Any]:
            return fn(*lead, logits, **args, **keywords)

        return call, context

    def compute(self, inputs: RankInputs) -> RankOutputs:
        call, context = self._caller(inputs)
        try:
            if inputs.rollout is not None:  # verl's own packing laid out the rows: run it on the real batch
                if self.kind == "legacy":
                    return self._legacy_packed(call, inputs)
                return self._engine_packed(call, inputs)
            return self._legacy(call, inputs) if self.kind == "legacy" else self._engine(call, inputs)
        finally:
            self.missing_config |= context["self"].engine_config.__dict__["_missing"]

    def _legacy(self, call: Any, inputs: RankInputs) -> RankOutputs:
        """MegatronPPOActor's closure on the harness's rows: shifted labels and the label mask, as
        the legacy forward_step built them (label[:, -R-1:-1] = responses) and packed them."""
        labels = inputs.row_labels().view(inputs.logits.shape[:2])
        args = {"label": labels, "label_mask": _mask_rows(inputs)}
        ret = call(inputs.logits, {p: args[p] for p in self.site["params"] if p in args})
        rows = inputs.scored_rows()
        entropy = ret.get("entropy")
        return RankOutputs(_take(ret["log_probs"], rows), _take(entropy, rows) if entropy is not None else None)

    def _engine(self, call: Any, inputs: RankInputs) -> RankOutputs:
        """MegatronEngineWithLMHead's logits processor with the arguments verl's engine forward
        builds (forward_step, then gptmodel_forward_model_engine): nested ids, ``label`` a clone of
        them, per-sample temperatures expanded as nested, each packed by verl's preprocess, and
        the outputs unpacked by verl's postprocess."""
        import torch

        mods = self._modules
        util = mods[UTIL_MODULE]
        packing = self.era.packing
        device = inputs.logits.device
        batch_size = len(inputs.tokens)
        input_ids = torch.nested.as_nested_tensor([t.to(device) for t in inputs.tokens], layout=torch.jagged)
        lp_args: dict[str, Any] = {"label": input_ids.clone()}
        if "temperature" in self.site["params"]:
            temperature = torch.tensor([inputs.temperature] * batch_size, device=device).to(torch.float32)
            lp_args["temperature"] = mods[TF_MODULE].expand_as_nested(temperature, input_ids)
        if inputs.layout == "bshd":
            pre, post = getattr(util, packing["bshd"]["preprocess"]), getattr(util, packing["bshd"]["postprocess"])
            _, mask_bshd, _ = pre(input_ids, pre_process=True)
            args = {k: pre(v, pre_process=True, need_roll=(k == "label"))[0] for k, v in lp_args.items()}
            self._check_rows(inputs, lambda ids: pre(ids, pre_process=True)[0])
            ret = call(inputs.logits, args)
            out = {k: post(v, mask_bshd, post_process=True) for k, v in ret.items()}
        else:
            pre, post = getattr(util, packing["preprocess"]), getattr(util, packing["postprocess"])
            roll = {"need_roll": True} if packing["need_roll"] else {}
            packed_seq_params = pre(input_ids, pre_process=True)[1]
            args = {k: pre(v, pre_process=True, **(roll if k == "label" else {}))[0] for k, v in lp_args.items()}
            self._check_rows(inputs, lambda ids: pre(ids, pre_process=True)[0])
            ret = call(inputs.logits, args)
            out = {k: post(v, packed_seq_params, input_ids, batch_size, post_process=True) for k, v in ret.items()}
        samples = inputs.rank_layout.scenario.samples
        share = inputs.rank_layout.share

        def pick(nested: Any) -> list:
            return [nested[i][torch.tensor([samples[i].prompt - 1 + j for j in share[i]], dtype=torch.int64,
                                           device=device)] for i in range(batch_size)]

        return RankOutputs(pick(out["log_probs"]), pick(out["entropy"]) if "entropy" in out else None)

    def _legacy_packed(self, call: Any, inputs: RankInputs) -> RankOutputs:
        """MegatronPPOActor's forward on the rollout batch: its label (position ids with the
        responses written at ``[:, -R-1:-1]``) and label mask built from verl's padded batch, all
        three packed by verl's preprocess_packed_seqs (the data path), the closure called on the
        logits laid out as that packing laid out the rows, its outputs unpacked by
        postprocess_packed_seqs and cut to ``[:, -R-1:-1]``, as the actor does."""
        path = self.data_path
        rollout = inputs.rollout.to(inputs.logits.device)
        batch = path.batch(rollout)
        mask, knobs = batch["attention_mask"], rollout.knobs
        packed_seq_params = path.pack(batch["input_ids"], mask, knobs)[1]
        response_length = batch["responses"].size(1)
        label = batch["position_ids"].clone()
        label[:, -response_length - 1 : -1] = batch["responses"]
        label_mask = mask.clone()
        label_mask[:, : -response_length - 1] = False
        label_mask[:, -1] = False
        args = {"label": path.pack(label, mask, knobs)[0], "label_mask": path.pack(label_mask, mask, knobs)[0]}
        ret = call(inputs.logits, {p: args[p] for p in self.site["params"] if p in args})
        post = path.util().postprocess_packed_seqs
        batch_size, seq_len = mask.shape
        out = {k: post(v, packed_seq_params, mask, batch_size, seq_len, post_process=True)[:, -response_length - 1 : -1]
               for k, v in ret.items()}
        responses = rollout.response_lengths

        def per_sample(values: Any) -> list:
            return [values[i, : responses[i]] for i in range(batch_size)]

        return self._outputs(inputs, {k: per_sample(v) for k, v in out.items()})

    def _engine_packed(self, call: Any, inputs: RankInputs) -> RankOutputs:
        """MegatronEngineWithLMHead's logits processor on the rollout batch (:meth:`_engine_forward`),
        each sample's response tokens cut from its outputs."""
        rollout = inputs.rollout
        out = self._engine_forward(call, inputs)
        prompts = [t - r for t, r in zip(rollout.total_lengths, rollout.response_lengths)]

        def per_sample(nested: Any) -> list:
            return [nested[i][prompts[i] - 1 : prompts[i] - 1 + rollout.response_lengths[i]]
                    for i in range(len(rollout.tokens))]

        return self._outputs(inputs, {k: per_sample(v) for k, v in out.items()})

    def _engine_forward(self, call: Any, inputs: RankInputs) -> dict[str, Any]:
        """What verl's engine forward returns for the rollout batch (its ``model_output``): the
        logits processor with the arguments the forward builds (nested ids, ``label`` a clone of
        them, per-sample temperatures expanded as nested, each packed by verl's preprocess: the
        data path, with the scenario's layout knobs; labels rolled where it rolls them), its
        outputs unpacked by verl's postprocess (which all-gathers them over CP): per key a nested
        tensor, every sample's whole sequence."""
        import torch

        path = self.data_path
        rollout = inputs.rollout.to(inputs.logits.device)
        knobs, layout = rollout.knobs, rollout.layout
        batch_size = len(rollout.tokens)
        input_ids = path.nested(rollout.tokens)
        lp_args: dict[str, Any] = {"label": input_ids.clone()}
        if "temperature" in self.site["params"]:
            temperature = torch.tensor([inputs.temperature] * batch_size, device=inputs.logits.device).to(torch.float32)
            lp_args["temperature"] = self._modules[TF_MODULE].expand_as_nested(temperature, input_ids)
        post_name = path.pre(layout)[1]
        post = getattr(path.util(), post_name)
        if layout == "bshd":
            _, mask_bshd, _ = path.pack(input_ids, layout, knobs)
            args = {k: path.pack(v, layout, knobs, need_roll=(k == "label"))[0] for k, v in lp_args.items()}
            ret = call(inputs.logits, args)
            out = {k: post(v, mask_bshd, post_process=True) for k, v in ret.items()}
        else:
            packed_seq_params = path.pack(input_ids, layout, knobs)[1]
            args = {k: path.pack(v, layout, knobs, need_roll=(k == "label"))[0] for k, v in lp_args.items()}
            ret = call(inputs.logits, args)
            post_args = path.kwargs(post_name, {k: v for k, v in knobs.items() if k == "cp_layout"})
            out = {k: post(v, packed_seq_params, input_ids, batch_size, post_process=True, **post_args)
                   for k, v in ret.items()}
        return out

    def _outputs(self, inputs: RankInputs, out: dict[str, list]) -> RankOutputs:
        """Per sample, the rank's share of verl's per-response-token outputs. verl's CP output is
        every token on every CP rank, its gradient only through the rank's own rows (each CP rank
        computes the whole loss); the harness's contract is each rank's zigzag share with its
        gradient. Under CP each rank therefore keeps the tokens its own rows score (where verl's
        packing put them: the traced layout) and an all-reduce over the CP group with autograd
        (torch.distributed.nn, its backward all-reduces the gradient) hands every token to the rank
        whose share holds it: the adapter's conversion, not verl's."""
        import torch

        share = inputs.rank_layout.share
        if inputs.cp_size == 1:
            return RankOutputs(*[([v[list(share[i])] for i, v in enumerate(out[k])] if k in out else None)
                                 for k in ("log_probs", "entropy")])
        from torch.distributed.nn.functional import all_reduce

        from shardcheck.scenarios.traced_layout import row_map

        samples = inputs.rank_layout.scenario.samples
        held = {rp for rp in row_map(inputs.rank_layout) if rp is not None}
        device = inputs.logits.device
        own = torch.cat([torch.tensor([(i, s.prompt - 1 + j) in held for j in range(s.response)], dtype=torch.bool)
                         for i, s in enumerate(samples)]).to(device)
        result: dict[str, list] = {}
        for key in ("log_probs", "entropy"):
            if key not in out:
                continue
            flat = torch.cat(list(out[key]))
            whole = all_reduce(torch.where(own, flat, torch.zeros_like(flat)), group=inputs.cp_group)
            parts = whole.split([s.response for s in samples])
            result[key] = [parts[i][list(share[i])] for i in range(len(samples))]
        return RankOutputs(result["log_probs"], result.get("entropy"))

    def _check_rows(self, inputs: RankInputs, pack: Any) -> None:
        """verl's packing of position codes must put every token on the row the harness put it on
        (the skip rule's promise); else the adapter's error, never a silent misalignment."""
        import torch

        layout = inputs.rank_layout
        samples = layout.scenario.samples
        big = 1 << 20
        codes = torch.nested.as_nested_tensor(
            [torch.arange(s.total, dtype=torch.int64) + (i + 1) * big for i, s in enumerate(samples)],
            layout=torch.jagged)
        got = pack(codes).reshape(-1).cpu()
        want = torch.tensor([(stream + 1) * big + pos if stream < len(samples) and pos < samples[stream].total else 0
                             for stream, pos in layout.row_positions()], dtype=torch.int64)
        if got.shape != want.shape or not torch.equal(got, want):
            raise RuntimeError(f"shardcheck's verl adapter: verl's packing puts this scenario's tokens on other rows "
                               f"than the harness ({tuple(got.shape)} vs {tuple(want.shape)} rows); its skip rule "
                               "(packing_mismatch) is wrong here")


# How a `shardcheck repro` script calls verl (see harness/controller/commands/repro.py): as VerlTarget and
# VerlActorTarget (legacy call site) do on the harness's rows, from the checkout.
REPRO_CALL = '''
def call_code_under_test(logits, rank):
    """verl's functions from rank.src as shardcheck's verl target calls them; variant actor: the legacy closure."""
    import ast, importlib, inspect, logging  # noqa: E401
    from megatron.core import parallel_state as mpu

    for name in ("verl", "verl.utils", "verl.utils.megatron"):  # empty packages: verl/__init__.py imports ray
        sys.modules.setdefault(name, type(sys)(name)).__path__ = [os.path.join(rank.src, *name.split("."))]
    torch._dynamo.config.disable = True  # its torch.compile'd helpers run eagerly, as shardcheck runs them
    mpu.initialize_model_parallel(rank.tp_size, context_parallel_size=rank.cp_size)  # each rank's process calls this once
    tp = importlib.import_module("verl.utils.megatron.tensor_parallel")
    n, shape = len(rank.tokens), logits.shape[:2]
    scores = [s < n and rank.total_lengths[s] - rank.response_lengths[s] - 1 <= p < rank.total_lengths[s] - 1
              for s, p in rank.rows]  # the rows that score a response token: label_mask
    label = torch.tensor([int(rank.tokens[s][p + 1]) if ok else 0 for (s, p), ok in zip(rank.rows, scores)]).view(shape)
    if rank.variant == "actor":  # with the names forward_backward_batch binds around it
        path = os.path.join(rank.src, "verl/workers/actor/megatron_actor.py")
        fn = next(f for f in ast.walk(ast.parse(open(path).read(), path))
                  if isinstance(f, ast.FunctionDef) and f.name == "logits_processor")
        fn.decorator_list = []
        logging.Logger.warning_once = getattr(logging.Logger, "warning_once", logging.Logger.warning)  # transformers'
        names = {**vars(tp), "torch": torch, "logger": logging.getLogger(path), "calculate_entropy": rank.with_entropy,
                 "temperature": rank.temperature}
        exec(compile(ast.Module([fn], []), path, "exec"), names)
        given, fn = {"label": label, "label_mask": torch.tensor(scores).view(shape)}, names["logits_processor"]
        out = fn(logits, **{k: given[k] for k in list(inspect.signature(fn).parameters)[1:]})
        log_probs, entropy = out["log_probs"], out.get("entropy")
    else:  # the caller divides by the temperature; the log-prob kernel overwrites its input: a clone
        logits = logits / rank.temperature if rank.temperature != 1.0 else logits
        entropy = tp.vocab_parallel_entropy(logits) if rank.with_entropy else None
        log_probs = tp.vocab_parallel_log_probs_from_logits(logits.clone() if rank.with_entropy else logits, label)
    held = [[r for r, (s, _) in enumerate(rank.rows) if s == i and scores[r]] for i in range(n)]  # in position order
    return [log_probs.reshape(-1)[r] for r in held], None if entropy is None else [entropy.reshape(-1)[r] for r in held]
'''


def _build(variant: str | None, config: TargetConfig) -> VerlTarget:
    refuse_loss_variant("verl", variant, config, LOSS_OPTIONS)
    if variant == "fsdp":  # its own module builds on this one: the registered factory builds it
        raise BadInput("verl:fsdp is built by the registered target (shardcheck.targets.frameworks: "
                       "--target verl:fsdp)")
    if config.get("fused_kernels") is not None:
        raise BadInput("target 'verl': option fused_kernels applies to verl:fsdp only")
    if variant is None:
        if config.get("call_site") is not None:
            raise BadInput("target 'verl': option call_site applies to verl:actor only")
        return VerlTarget(config.src, config)
    return VerlActorTarget(config.src, config)


target = CheckoutFactory(
    FRAMEWORK, _build,
    doc=("verl's Megatron log-prob and entropy functions from a source checkout (--verl-src, --target-src or "
         "SHARDCHECK_VERL_SRC)\n\nWith the variant ``actor``, the actor's own call site that combines them with "
         "the temperature."),
    options=OPTIONS, variants={"actor": " ".join((VerlActorTarget.__doc__ or "").split()),
                               "loss": "verl's policy loss in the training step: losses.py's ppo_loss (agg_loss, "
                                       "compute_policy_loss_vanilla) on the engine's model output, with the engine's "
                                       "global batch info and its rescale for megatron-core's schedule "
                                       "(transformer_impl.py, compiled alone); option loss_agg_mode",
                               "fsdp": "verl's FSDP engine: FSDPEngineWithLMHead.prepare_model_inputs / "
                                       "prepare_model_outputs (compiled alone) with verl's Ulysses pad, slice and "
                                       "gather (layouts thd, bshd, ulysses; tp 1)"})
