"""The one interface between the harness and an implementation under test.

A target is an object with ``name``, ``capabilities``, ``describe()`` and ``compute(inputs)``.
The harness builds each rank's :class:`RankInputs` (slime's calling convention, made explicit),
calls ``compute`` on every rank, and differentiates the loss of the returned per-sample outputs.
A scenario outside a target's capabilities is reported as skipped with the reason.

A target whose code under test is a whole loss (a policy loss that calls the log-prob code
itself) sets ``loss_form = "policy"``: it then gets :class:`PolicyBatch` inputs, returns its own
scalar ``loss`` in :class:`RankOutputs`, and the harness checks that loss and its gradient.

A target whose loss is the one a training step hands megatron-core's schedule sets
``loss_form = "step"``: the harness runs the whole step around it (docs/training.md). Each
micro-batch's ``compute`` gets :class:`PolicyBatch` inputs and :class:`StepInputs`, and returns
its loss as megatron-core's loss function does (``loss``, and ``num_tokens`` for the per-token
form); the harness checks the gradient the optimizer sees against the objective the target
declares (:class:`Definitions` ``objective``). Optionally such a target has
``logged_loss(reported, sizes)``: the loss its framework logs for the step, aggregated by the
framework's own code from what each micro-batch reported (``RankOutputs.reported``, in order)
and :class:`StepSizes`; called on every rank once the schedule has run (it may all-reduce),
its value is checked against the objective's over the global batch (``logged_loss``). None
where the framework's commit aggregates none. A step target may also have
``split_batch(scenario)``: per data-parallel replica, the sample indices of its micro-batches as
its framework splits the global batch (None where its commit has no splitter of its own).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Protocol, TypeVar, runtime_checkable

import torch

from shardcheck.run_config import OPTS_ENV, SRC_ENV, RunConfig, active, environment_target
from shardcheck.scenarios.data import OBJECTIVES
from shardcheck.scenarios.layout import local_held_rows, local_row_targets, local_share_rows
from shardcheck.scenarios.scenario import DTYPES, MEGATRON_LAYOUTS, Scenario

T = TypeVar("T")


@dataclass(frozen=True)
class Capabilities:
    """What a target supports; ``reasons`` says why not ("entropy", "entropy_grad", "layout",
    "dtype", "tp", "cp", "sampling", "replay_keep" keys). ``tp_sizes``/``cp_sizes``: the sizes it
    runs at (None: any), so a target without vocab-parallel or context-parallel code says
    ``tp_sizes=frozenset({1})``. The fields after ``reasons`` came later: they follow it so that
    a call passing the first ones by position means what it did.

    ``layout_reasons``: why a given layout outside ``layouts`` is not supported ((layout, reason)
    pairs), where one reason for every layout ("layout" in ``reasons``) says too little.
    ``rule``: the target's own condition on a scenario (its framework's shape or padding
    requirements, say), asked only once every capability above holds: a skip reason, or None to
    run it."""

    # the Megatron family's four by default (what a target written before the sequence-parallel
    # layouts supported): a target that runs ``ulysses`` says so
    layouts: frozenset[str] = frozenset(MEGATRON_LAYOUTS)
    entropy: bool = True
    dtypes: frozenset[str] = frozenset(DTYPES)
    # applies RankInputs.keep_sets (a replayed top-p / top-k keep set per response token)
    replay_keep: bool = False
    # applies RankInputs.top_k / top_p (a top-k then top-p filter of the logits, NeMo-RL's)
    sampling: bool = False
    tp_sizes: frozenset[int] | None = None
    cp_sizes: frozenset[int] | None = None
    reasons: tuple[tuple[str, str], ...] = ()
    # the entropy it returns has a gradient (False: a metric only, so a loss with an entropy term,
    # entropy_coef != 0, is outside what it supports)
    entropy_grad: bool = True
    layout_reasons: tuple[tuple[str, str], ...] = ()
    rule: Callable[[Scenario], str | None] | None = None

    def skip_reason(self, scenario: Scenario) -> str | None:
        why = dict(self.reasons)
        if scenario.layout not in self.layouts:
            return dict(self.layout_reasons).get(scenario.layout) or why.get("layout") or (
                f"layout {scenario.layout} not supported (supports {', '.join(sorted(self.layouts))})")
        if scenario.with_entropy and not self.entropy:
            return why.get("entropy") or "entropy not supported"
        if scenario.with_entropy and scenario.entropy_coef != 0 and not self.entropy_grad:
            return why.get("entropy_grad") or "its entropy has no gradient: entropy_coef must be 0"
        if scenario.dtype not in self.dtypes:
            return why.get("dtype") or (
                f"dtype {scenario.dtype} not supported (supports {', '.join(sorted(self.dtypes))})")
        for key, size, sizes in (("tp", scenario.tp, self.tp_sizes), ("cp", scenario.cp, self.cp_sizes)):
            if sizes is not None and size not in sizes:
                return why.get(key) or f"{key} {size} not supported (supports {', '.join(map(str, sorted(sizes)))})"
        if scenario.sampling and not self.sampling:
            return why.get("sampling") or "applies no top-k / top-p filter to the logits (sampling scenarios)"
        if scenario.replay_keep and not self.replay_keep:
            return why.get("replay_keep") or "does not apply replayed keep sets (top-p / top-k replay)"
        return self.rule(scenario) if self.rule is not None else None


@dataclass(frozen=True)
class TargetConfig:
    """What a user gives a target besides its name: ``--target-src DIR`` (a source checkout) and
    ``--target-opt KEY=VALUE`` (repeatable). A factory that takes a ``config`` argument gets it;
    one that declares ``options = {KEY: help}`` has unknown keys refused (one line, exit 2).
    A run carries it in its :class:`~shardcheck.run_config.RunConfig` (:meth:`of_run`),
    which reaches every rank inside each ``run`` message; :meth:`to_environment` and
    :meth:`from_environment` (the variables :data:`SRC_ENV`, :data:`OPTS_ENV`) are kept for
    callers written before it."""

    src: str | None = None
    options: tuple[tuple[str, str], ...] = ()

    @classmethod
    def given(cls, src: str | None, options: tuple[tuple[str, str], ...] = ()) -> "TargetConfig":
        """From what a user gave: ``src`` a folder (made absolute; ValueError naming it when it is
        not one), ``options`` (KEY, VALUE) pairs (:func:`parse_option`)."""
        import os

        if src is not None and not os.path.isdir(src):
            raise ValueError(f"{src!r} is not a directory")
        return cls(os.path.abspath(src) if src else None, tuple(options))

    @classmethod
    def of_run(cls, config: RunConfig) -> "TargetConfig":
        """The config ``config``'s target is built with: ``--target-src``, or the checkout of the
        target's own framework, and the options."""
        return cls(config.checkout(), config.target_options)

    def get(self, key: str, default: str | None = None) -> str | None:
        return dict(self.options).get(key, default)

    def flag(self, key: str, default: bool = False) -> bool:
        """A yes/no option: 1/true/yes/on or 0/false/no/off; ValueError for anything else."""
        value = self.get(key)
        if value is None:
            return default
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"option {key}={value!r}: expected true or false")

    def to_environment(self) -> dict[str, str]:
        """Deprecated (the harness hands a RunConfig to its ranks): the config as the variables
        :meth:`from_environment` reads."""
        import json

        env = {OPTS_ENV: json.dumps([list(kv) for kv in self.options])} if self.options else {}
        if self.src is not None:
            env[SRC_ENV] = self.src
        return env

    @classmethod
    def from_environment(cls, environ: Any = None) -> "TargetConfig":
        """Deprecated: the config in ``environ``'s :data:`SRC_ENV` and :data:`OPTS_ENV`. Without
        ``environ``, in a process running a command, the config of the run in effect (that of the
        command line, which no longer writes those variables), else this process's variables."""
        import os

        if environ is None:
            running = active()
            if running is not None:
                return cls.of_run(running)
        return cls(*environment_target(os.environ if environ is None else environ))


def parse_option(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` -> (KEY, VALUE); ValueError for anything else."""
    key, eq, value = text.partition("=")
    if not eq or not key.strip():
        raise ValueError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value


# SRC_ENV, OPTS_ENV: the run configuration's (shardcheck/run_config.py), imported above and kept here


@dataclass
class PolicyBatch:
    """What a policy loss needs besides logits and tokens (``loss_form = "policy"`` only).

    Per sample: ``advantages`` and ``old_log_probs`` hold the rank's share of response tokens
    (the same order as the outputs; ``old_log_probs`` are the float64 truth rounded to float32,
    so the importance ratio is 1 and no clipping acts); ``loss_masks`` holds the whole response
    (int32), as slime's callers pass it.
    """

    advantages: list[torch.Tensor]
    old_log_probs: list[torch.Tensor]
    loss_masks: list[torch.Tensor]


@dataclass(frozen=True)
class StepInputs:
    """Where a micro-batch stands in its training step (``loss_form = "step"`` only): what a
    framework's loss function is told by its training loop.

    ``samples``: the global indices of the micro-batch's samples; ``global_batch_size``: the
    samples of the whole step over every data-parallel replica (what slime calls
    ``step_global_batch_size``); ``dp_size``/``dp_rank``: megatron-core's data-parallel group.

    What a framework's trainer computes over more than the micro-batch before its loss runs (a
    count of valid tokens over the replica or the global batch, advantages normalised over the
    mini-batch): ``replica_samples``, the global indices of every sample this replica's micro-
    batches hold; ``loss_masks`` and ``advantages``, per sample of the scenario (index = global
    index), the whole response, as :class:`PolicyBatch` holds them. The global batch is
    ``global_batch_size // len(loss_masks)`` copies of those samples (a world with more
    data-parallel ranks than the scenario's ``dp`` holds copies of it).
    """

    micro_batch: int
    num_microbatches: int
    global_batch_size: int
    dp_size: int
    dp_rank: int
    samples: tuple[int, ...]
    replica_samples: tuple[int, ...] = ()
    loss_masks: tuple[torch.Tensor, ...] = ()
    advantages: tuple[torch.Tensor, ...] = ()

    @property
    def copies(self) -> int:
        """How many copies of the scenario's samples the global batch holds."""
        return self.global_batch_size // max(1, len(self.loss_masks))


@dataclass(frozen=True)
class StepSizes:
    """What a step target's ``logged_loss`` is told of the step once its schedule has run: its
    sizes, and the group its framework all-reduces what it logs over (megatron-core's
    data-parallel group with CP)."""

    num_microbatches: int
    global_batch_size: int
    dp_size: int
    cp_size: int
    dp_cp_group: Any


@dataclass
class Rollout:
    """The rollout-level batch a framework's data path receives, before it packs, pads, splits
    across CP ranks or rolls labels: per sample its full token ids (int64 ``[total]``), lengths
    and loss mask (int32 ``[response]``), the layout mode and the layout knobs (the framework's
    defaults with the scenario's ``layout_knobs`` over them)."""

    tokens: list[torch.Tensor]
    total_lengths: list[int]
    response_lengths: list[int]
    loss_masks: list[torch.Tensor]
    layout: str
    knobs: dict[str, Any] = field(default_factory=dict)

    @property
    def allgather_cp(self) -> bool:
        return self.layout == "allgather"

    def to(self, device: Any) -> "Rollout":
        """The same batch with its tensors on ``device`` (where the rank's logits are)."""
        import dataclasses

        return dataclasses.replace(self, tokens=[t.to(device) for t in self.tokens],
                                   loss_masks=[m.to(device) for m in self.loss_masks])


@dataclass(frozen=True)
class Definitions:
    """How a framework defines what it returns, where that differs from the reference's default;
    the reference follows, and every report says which definition was checked (an adapter never
    converts an output to the default itself).

    ``entropy_sign``: -1 where the framework's entropy is ``sum p log p`` (the negative entropy);
    the reference's entropy and its entropy term's gradient are then negated.

    ``loss_over``: "share" (the default: with CP each rank returns, and takes the loss over, its
    zigzag share of each response), "held" (the tokens its own rows score, as the layout put them:
    the framework's, where it owns it, may pad and split otherwise than the harness) or "gathered" (each CP rank returns every response token, as
    gathered over CP, and takes the loss over the whole gathered sequence divided by the CP size:
    NeMo-RL's convention). The reference's gradient is the same global loss's either way; under
    "gathered" a backward that does not sum the CP ranks' gradients is off by the CP size.

    ``entropy_over``: the same for the entropy where it differs from the log-probs' (None: as
    ``loss_over``), or "held": with CP each rank returns, and takes the loss over, the tokens its
    own rows score as the layout put them (the framework's, where it owns it). NeMo-RL gathers
    its log-probs over CP but computes its entropy on each rank's own rows: ``loss_over=
    "gathered", entropy_over="held"``."""

    entropy_sign: int = 1
    entropy_source: str = ""  # whose definition, e.g. "NeMo-RL's ChunkedDistributedEntropy"
    loss_over: str = "share"
    loss_source: str = ""
    entropy_over: str | None = None
    # loss_form "step": the objective over the whole global batch whose gradient the optimizer
    # must see: "sample_mean" (each sample's masked token mean, averaged over the samples) or
    # "token_mean" (every masked-in token of the global batch weighs the same); the source names
    # the framework's own knob, e.g. "slime's calculate_per_token_loss=False"
    objective: str = ""
    objective_source: str = ""
    # token_mean: each sample counts at least this many tokens in the denominator (slime's
    # clamp_min(loss_mask.sum(), 1): a sample whose every token is masked counts one)
    token_floor: int = 0

    @property
    def entropy_loss_over(self) -> str:
        """What the entropy's loss is taken over: its own declaration, else the log-probs'."""
        return self.entropy_over or self.loss_over

    def describe(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.objective:
            floor = (f"; a sample counts at least {self.token_floor} token{'s' if self.token_floor > 1 else ''} in the "
                     "count" if self.token_floor and self.objective == "token_mean" else "")
            out["objective"] = (f"{OBJECTIVES[self.objective]} ({self.objective_source or 'the target'}{floor}), over "
                                "the global batch, as the optimizer sees it after the training step")
        if self.entropy_sign != 1:
            out["entropy"] = (f"sum p log p, the negative entropy ({self.entropy_source}); the reference's entropy "
                              "and its gradient are negated to match")
        if "gathered" in (self.loss_over, self.entropy_loss_over):
            fields = {"log-probs": self.loss_over, "entropy": self.entropy_loss_over}
            gathered = " and ".join(f for f, over in fields.items() if over == "gathered")
            own = [(f, over) for f, over in fields.items() if over != "gathered"]
            where = {"held": "the tokens each rank's own rows score", "share": "each rank's own share"}
            out["loss"] = (f"over the whole gathered sequence on every CP rank, divided by the CP size "
                           f"({self.loss_source}); every CP rank's {gathered} checked for every response token"
                           + (f"; the {own[0][0]} on {where[own[0][1]]}" if own else ""))
        elif "held" in (self.loss_over, self.entropy_loss_over):
            held = " and ".join(f for f, over in (("log-probs", self.loss_over), ("entropy", self.entropy_loss_over))
                                if over == "held")
            out["loss"] = (f"with CP each rank's {held} on the tokens its own rows score, as the layout put them "
                           f"({self.loss_source or 'the framework'}), the loss over those")
        return out


def definitions(target: Target) -> Definitions:
    """The definitions ``target`` declares (the reference's defaults where it declares none)."""
    return target.definitions or Definitions()


def description(target: Target) -> dict[str, Any]:
    """``target.describe()`` with the definitions it declares, for every report."""
    out = dict(target.describe())
    declared = definitions(target).describe()
    if declared:
        out["definitions"] = declared
    return out


@dataclass(frozen=True)
class Knob:
    """A knob of a framework's data path that changes its layout: its default (the framework's)
    and what a value must be (``check`` returns why a value is wrong, or None)."""

    default: Any
    help: str
    check: Any = None  # Callable[[Any], str | None]
    # Callable[[Any], str | None]: why this machine cannot run a valid value (a skip, not a finding)
    unavailable: Any = None

    def problem(self, value: Any) -> str | None:
        return self.check(value) if self.check is not None else None


def positive_int(value: Any) -> str | None:
    """A Knob check: an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"must be an integer >= 1, got {value!r}"
    return None


def positive_int_or_none(value: Any) -> str | None:
    """A Knob check: an integer >= 1, or None (off)."""
    return None if value is None else positive_int(value)


LAYOUT_OPTION = ("framework", "shardcheck")


def layout_option(config: TargetConfig | None, where: str = "", framework: str = "framework") -> str:
    """A framework target's ``layout`` option: framework (its data path lays out the rows, the
    default) or shardcheck (the harness's rows); anything else is BadInput naming ``where``."""
    from shardcheck.errors import BadInput

    value = config.get("layout", "framework") if config is not None else "framework"
    if value not in LAYOUT_OPTION:
        raise BadInput(f"{where}option layout={value!r}: expected {framework} or shardcheck")
    return value


def layout_description(path: "DataPath | None", layout: str, absent: str) -> str:
    """What lays out a framework target's rows, for describe(): its data path, or the harness
    and why (``absent``: what the checkout lacks)."""
    if path is not None:
        return path.name
    return f"shardcheck's layout ({'layout=shardcheck' if layout != 'framework' else absent})"


@runtime_checkable
class DataPath(Protocol):
    """A framework's own code from the rollout batch to what one rank's model receives.

    ``name`` says what runs (``file.py:function``). ``builds(scenario)``: whether it lays out
    this scenario (None) or why not (the harness then lays it out itself, and says so).
    ``local_tokens(rollout)``: this rank's token ids as the framework's model would receive
    them (``[1, T]`` packed or ``[B, M]`` padded; 0 where it pads), built by the framework's own
    code with the process groups the harness set up. The harness calls it with a
    position-encoded rollout to learn the layout (:mod:`shardcheck.scenarios.traced_layout`) and
    with the real one to see that the framework laid the real tokens out the same way.

    Optional, ``model_inputs(rollout)``: what else the framework's code hands this rank's model,
    as a dict with "position_ids" (one per local row, flattened as the tokens) and / or
    "cu_seqlens" (the packed stream's sequence boundaries); the harness checks them against the
    learned layout (:mod:`shardcheck.harness.rank.life.model_inputs`).
    """

    name: str

    def knobs(self) -> dict[str, Knob]: ...

    def builds(self, scenario: Scenario) -> str | None: ...

    def local_tokens(self, rollout: Rollout) -> torch.Tensor: ...


def data_path(target: Target) -> DataPath | None:
    """The target's own data path, if it has one."""
    return target.data_path


def knob_skip_reason(target: Target, scenario: Scenario) -> str | None:
    """Why ``target`` cannot run ``scenario``'s layout knobs (it has no such knob: a skip), or
    None; BadInput (one line, exit 2) for a value the knob does not take."""
    if not scenario.layout_knobs:  # first: asked of every scenario of a file of half a million
        return None
    from shardcheck.errors import BadInput

    path = data_path(target)
    if path is None:
        return (f"target {target.name} lays out no rows with a framework's code: it has no "
                f"layout knob {scenario.layout_knobs[0][0]}")
    knobs = path.knobs()
    for key, value in scenario.layout_knobs:
        if key not in knobs:
            return (f"{path.name} has no layout knob {key} at this commit "
                    f"(knobs: {', '.join(sorted(knobs)) or 'none'})")
        problem = knobs[key].problem(value)
        if problem is not None:
            raise BadInput(f"scenario {scenario.name!r}: layout knob {key} {problem}")
        why = knobs[key].unavailable(value) if knobs[key].unavailable is not None else None
        if why:
            return f"{path.name}: layout knob {key}={value!r} cannot run here: {why}"
    return path.builds(scenario)


def resolved_knobs(path: DataPath, scenario: Scenario) -> dict[str, Any]:
    """The data path's defaults with the scenario's knobs over them."""
    return {k: knob.default for k, knob in path.knobs().items()} | dict(scenario.layout_knobs)


@dataclass
class RankInputs:
    """What one rank hands the implementation.

    ``logits`` requires grad and is not a leaf (an op's output, as a model's logits are):
    ``[1, T_local, V/tp]`` for thd, zigzag and allgather, ``[B, M, V/tp]`` for bshd. ``tokens``
    holds every sample's full token ids. The harness checks that nothing here is changed.
    """

    logits: torch.Tensor
    tokens: list[torch.Tensor]
    total_lengths: list[int]
    response_lengths: list[int]
    layout: str
    with_entropy: bool
    entropy_coef: float
    temperature: float
    chunk_size: int
    max_seq_lens: list[int] | None
    tp_group: Any
    cp_group: Any
    tp_rank: int
    tp_size: int
    cp_rank: int
    cp_size: int
    # The harness's own layout for this rank (shardcheck.scenarios.layout.RankLayout). Adapters of
    # code that does only part of the job may use it; an implementation under test must not.
    rank_layout: Any = None
    policy: PolicyBatch | None = None
    # per sample, per response token (all of them, not the rank's share): the ids the rollout's
    # sampler kept, or None where none was recorded; None when the scenario replays none
    keep_sets: list[list[tuple[int, ...] | None]] | None = None
    # the sampler's filter (scenarios with top_k / top_p): the log-prob is renormalised over the
    # tokens a top-k then top-p filter of the temperature-scaled logits keeps; 0 and 1.0: off
    top_k: int = 0
    top_p: float = 1.0
    # the rollout batch, for a target with its own data path (``data_path``): it runs its
    # framework's code on it (the logits above are laid out as that code lays out the rows)
    rollout: Rollout | None = None
    # loss_form "step": the micro-batch's place in the training step
    step: StepInputs | None = None
    # the DTensor family's sequence parallelism (layout ``ulysses``): the sp group (a real group
    # of the ranks holding one sequence's slices, TP fastest as megatron orders ranks), this rank's
    # place in it and its size; None / 0 / 1 for every other layout. Under sp, cp_group is None.
    sp_group: Any = None
    sp_rank: int = 0
    sp_size: int = 1
    # the harness's owner of process groups (its ``framework_groups``), through which a target has
    # its framework's own code build the framework's groups once per world: see framework_groups
    world: Any = None

    def framework_groups(self, key: Hashable, build: Callable[[], T],
                         roles: Callable[[T], Mapping[str, Any]]) -> T:
        """What ``build()`` returns: the framework's own code building its process groups (its
        ``init_device_mesh``), run by every rank of the world the first time a key is asked for
        in a layout and kept for the world's life (group creation is collective: every rank asks
        with the same key, at the same point of ``compute``). ``roles(built)`` names the groups
        the framework calls collectives in ("sp", "tp", "dp", "cp", "dp_cp", "world"); the
        harness checks that each holds the ranks its own group of that role holds, refusing the
        world alike on every rank otherwise (the harness's error, never the target's finding),
        and the trace labels them by their role. Without a harness (a RankInputs built by hand)
        ``build()`` is simply called."""
        if self.world is None:
            return build()
        return self.world.framework_groups(key, build, roles)

    def row_labels(self) -> torch.Tensor:
        """The next token each local logit row predicts, rows flattened (``logits.view(-1, V/tp)``;
        bshd: batch row after batch row); 0 where a row predicts none (a sample's last row,
        padding). On the logits' device."""
        return local_row_targets(self.rank_layout, self.tokens).to(self.logits.device)

    def scored_rows(self) -> list[torch.Tensor] | None:
        """Per sample, the flattened local rows that score this rank's share of the response, in
        the order the outputs take; None when some of the share is scored on another rank
        (all-gather CP: see :meth:`held_rows`)."""
        rows = local_share_rows(self.rank_layout)
        return None if rows is None else [r.to(self.logits.device) for r in rows]

    def row_tokens(self) -> torch.Tensor:
        """The token id each local row holds (0 on padding), int64 in the logits' row shape
        (``logits.shape[:2]``), on the CPU: what a framework's own code must hand this rank's
        model for these logits to be that model's output."""
        from shardcheck.scenarios.traced_layout import local_tokens_at

        return torch.tensor(local_tokens_at(self.rank_layout, self.tokens), dtype=torch.int64).reshape(
            self.logits.shape[:2])

    def check_model_tokens(self, ids: torch.Tensor, who: str) -> None:
        """RuntimeError naming ``who`` (an adapter, and whose code built ``ids``) unless ``ids``,
        what the framework's code hands this rank's model, are :meth:`row_tokens`: logits laid out
        elsewhere than the framework lays out its inputs would check nothing."""
        want, got = self.row_tokens(), ids.detach().cpu().to(torch.int64)
        if got.numel() != want.numel() or not torch.equal(got.reshape(-1), want.reshape(-1)):
            raise RuntimeError(f"{who} hands this rank's model other tokens ({got.reshape(-1).tolist()}) than the "
                               f"harness's rows hold ({want.reshape(-1).tolist()})")

    def held_rows(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sample, the response tokens this rank's own rows score: (flattened local rows,
        response token indices), in position order. With all-gather CP these are the rank's
        contiguous slice, which the target must redistribute to the share it returns."""
        device = self.logits.device
        return [(rows.to(device), tokens.to(device)) for rows, tokens in local_held_rows(self.rank_layout)]

    @property
    def allgather_cp(self) -> bool:
        return self.layout == "allgather"

    @property
    def qkv_format(self) -> str:
        return "bshd" if self.layout == "bshd" else "thd"


@dataclass
class RankOutputs:
    """Per sample, this rank's share of the response log-probs (and entropy), 1-D each; for a
    ``loss_form = "policy"`` target also the scalar ``loss`` it computed on this rank."""

    log_probs: list[torch.Tensor]
    entropy: list[torch.Tensor | None] | None = None
    notes: dict[str, Any] = field(default_factory=dict)
    loss: torch.Tensor | None = None
    # loss_form "step": what megatron-core's loss function returns besides the loss. ``num_tokens``
    # (a tensor) makes it the 3-tuple form (loss, num_tokens, reported), None the 2-tuple form
    # (loss, reported); ``reported`` is what it logs
    num_tokens: Any = None
    reported: dict[str, Any] | None = None


def loss_form(target: Target) -> str:
    """"weighted" (the harness builds the loss) unless the target says "policy" or "step"."""
    return target.loss_form


def step_batches(target: Target, scenario: Scenario) -> tuple[list[list[tuple[int, ...]]], str]:
    """Per data-parallel replica of ``scenario``, the sample indices of its micro-batches, and
    whose split it is: the target's own ``split_batch(scenario)`` (its framework's splitter)
    where it has one that answers, else megatron's rules (:mod:`shardcheck.scenarios.batch`).
    ValueError where the framework's splitter refuses the sizes."""
    batches = target.split_batch(scenario)
    if batches is not None:
        return batches, f"{target.name}'s split_batch"
    return [scenario.micro_batches(r) for r in range(scenario.dp)], "megatron's rules (scenarios/batch.py)"


def step_skip_reason(target: Target, scenario: Scenario) -> str | None:
    """Why ``target`` cannot run ``scenario``'s training step (its loss is not a training
    step's, or its framework's splitter refuses the global batch), or None."""
    if scenario.step and loss_form(target) == "step":
        try:
            step_batches(target, scenario)
        except ValueError as exc:
            return f"{target.name} cannot split this global batch: {exc}"
    if scenario.step and loss_form(target) != "step":
        count = len(scenario.micro_batches(0))
        return (f"a training step (dp {scenario.dp}, {count} micro-batch{'es' if count > 1 else ''} a replica), and "
                f"{target.name}'s loss is not one (a target with loss_form 'step' runs it: "
                "docs/training.md)")
    return None


# The Target contract's version, and what each version added (docs/targets.md, "The contract").
# A plugin written against any of them runs unchanged: what it lacks takes TargetBase's default,
# with a one-line notice in the run's header (targets.contract.adopt).
CONTRACT_VERSION = 7
CONTRACT_HISTORY: dict[int, tuple[str, tuple[str, ...]]] = {
    1: ("2026-12-02", ("name", "capabilities", "describe", "compute", "loss_form", "invariance")),
    2: ("2026-12-03", ("data_path", "training_loss", "src", "framework_files")),
    3: ("2026-12-04", ("definitions",)),
    4: ("2026-12-04", ("release",)),
    5: ("2026-12-05", ("repro_call", "split_batch", "logged_loss", "calculate_per_token_loss")),
    6: ("2026-12-05", ("contract", "declares", "implementation")),
    7: ("2026-12-05", ("backward_context",)),
}


@runtime_checkable
class Target(Protocol):
    """Every member the harness reads of a target. ``name``, ``capabilities``, ``describe()`` and
    ``compute()`` are a target's own; the others have defaults in :class:`TargetBase`, which a
    target derives from (a plugin that does not is adopted: ``targets.contract``)."""

    name: str
    capabilities: Capabilities
    # "weighted" (the harness builds the loss), "policy" or "step" (the module docstring)
    loss_form: str
    # the contract ``shardcheck invariance`` holds the target to: {"packing": "bitwise", "tp":
    # "ulp:8", ...} (its axes: ``shardcheck invariance --help``)
    invariance: Mapping[str, str]
    # where its definitions differ from the reference's
    definitions: Definitions
    # its framework's own data path (None: the harness lays the rows out)
    data_path: DataPath | None
    # its loss is a training step's: with CP the model's own CP collective runs in backward
    training_loss: bool
    # megatron-core's calculate_per_token_loss as its framework sets it (None: from the objective)
    calculate_per_token_loss: bool | None
    # its framework's checkout, and the files of it that --coverage reports on
    src: Any
    framework_files: tuple[str, ...]
    contract: int

    def describe(self) -> dict[str, Any]:
        """Name, version and anything else a report should carry."""
        ...

    def compute(self, inputs: RankInputs) -> RankOutputs: ...

    def release(self) -> None:
        """Undo whatever the target set in the process (imports, stubs, settings) when the rank
        moves on to another target."""
        ...

    def repro_call(self) -> str | None:
        """How a standalone script calls its code (``shardcheck repro``); None: it cannot say."""
        ...

    def split_batch(self, scenario: Scenario) -> list[list[tuple[int, ...]]] | None:
        """Per data-parallel replica, its micro-batches' sample indices as its framework splits
        the global batch; None: megatron's rules."""
        ...

    def logged_loss(self, reported: list[dict[str, Any]], sizes: StepSizes) -> Any:
        """The loss its framework logs for a training step (the module docstring); None where
        its commit aggregates none."""
        ...

    def backward_context(self) -> AbstractContextManager[Any]:
        """What the backward of its outputs must run inside, as its framework's training loop
        runs it (``torch.distributed.tensor.parallel.loss_parallel()``: its backward handlers
        are only installed there); the harness enters it around the backward."""
        ...

    def declares(self, member: str) -> bool:
        """Whether the target has ``member`` of its own, not TargetBase's default."""
        ...

    def implementation(self) -> Any:
        """The object whose code is under test (itself, or an adopted plugin)."""
        ...


class TargetBase:
    """The defaults of every optional member of :class:`Target`: a target derives from it and
    sets ``name``, ``capabilities``, ``describe()`` and ``compute()``."""

    contract: int = CONTRACT_VERSION
    name: str
    capabilities: Capabilities = Capabilities()
    loss_form: str = "weighted"
    invariance: Mapping[str, str] = MappingProxyType({})
    definitions: Definitions = Definitions()
    data_path: DataPath | None = None
    training_loss: bool = False
    calculate_per_token_loss: bool | None = None
    src: Any = None
    framework_files: tuple[str, ...] = ()

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}

    def compute(self, inputs: RankInputs) -> RankOutputs:
        raise TypeError(f"target {self.name!r} defines no compute()")

    def release(self) -> None:
        """Nothing to undo: the target sets nothing process-wide."""

    def repro_call(self) -> str | None:
        return None

    def split_batch(self, scenario: Scenario) -> list[list[tuple[int, ...]]] | None:
        return None

    def logged_loss(self, reported: list[dict[str, Any]], sizes: StepSizes) -> Any:
        return None

    def backward_context(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def declares(self, member: str) -> bool:
        if member not in OPTIONAL_MEMBERS:
            raise ValueError(f"{member!r} is not an optional member of the Target contract")
        return getattr(type(self), member, None) is not getattr(TargetBase, member)

    def implementation(self) -> Any:
        return self


# what a target may leave to TargetBase, in the order the contract added it
REQUIRED_MEMBERS = ("name", "capabilities", "describe", "compute")  # a target's own, no default
BASE_MEMBERS = ("contract", "declares", "implementation")  # TargetBase's own: what it says of a target
OPTIONAL_MEMBERS = tuple(m for _, (_, added) in sorted(CONTRACT_HISTORY.items()) for m in added
                         if m not in REQUIRED_MEMBERS + BASE_MEMBERS)
