"""A scenario: one sharded computation to check, as plain data that round-trips through JSON.

Nothing big is stored: logits, tokens and loss weights are generated from ``seed`` on every rank
(see :mod:`shardcheck.scenarios.data`), so a scenario travels to the ranks as a few hundred bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from shardcheck.errors import BadInput
from shardcheck.scenarios.batch import replica_micro_batches, token_budget_split

# thd, bshd and the Megatron family's context-parallel layouts (zigzag ring CP, all-gather CP),
# then the other family's sequence-parallel ones: ulysses (verl's, AReaL's Ulysses) and ring
# (OpenRLHF's ring attention) cut the packed sequence, padded to a multiple of sp, into sp
# contiguous slices and gather the outputs back; their rows are the same, the attention that
# shards them is not, and a target names the one it runs
LAYOUTS = ("thd", "bshd", "zigzag", "allgather", "ulysses", "ring")
MEGATRON_LAYOUTS = ("thd", "bshd", "zigzag", "allgather")
CP_LAYOUTS = ("zigzag", "allgather")
SP_LAYOUTS = ("ulysses", "ring")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Sample:
    """One sequence: ``total`` tokens of which the last ``response`` are scored.

    ``data_id`` names the data the sample carries: its tokens, logits and loss weights are drawn
    from (scenario seed, data_id), never from its place in the batch, so the same sample packed
    elsewhere, alone or in another order carries the same data (the invariance check needs that).
    None: the sample's index in the scenario.
    """

    total: int
    response: int
    data_id: int | None = None

    @property
    def prompt(self) -> int:
        return self.total - self.response


@dataclass(frozen=True)
class Scenario:
    name: str
    samples: tuple[Sample, ...]
    vocab: int
    tp: int = 1
    cp: int = 1
    layout: str = "thd"
    with_entropy: bool = True
    entropy_coef: float = 0.0
    log_probs_chunk_size: int = -1
    temperature: float = 1.0
    dtype: str = "float32"
    seed: int = 0
    # each response token carries the keep set the rollout's sampler kept (top-p / top-k replay,
    # scenarios.keep); its log-prob is renormalised over it, its entropy is not
    replay_keep: bool = False
    # the keep set filtered from the logits themselves (NeMo-RL's / vLLM's top-k then top-p on
    # the temperature-scaled logits, scenarios.keep.sampling_keep); 0 and 1.0: no filter. The
    # response tokens are drawn from their row's set, as a sampler with these settings would
    top_k: int = 0
    top_p: float = 1.0
    # replayed sets given as they are (with replay_keep), e.g. a real rollout's: per sample, per
    # response token, the kept ids or null (none recorded; only at the end, as slime's offsets)
    keep_sets: tuple[tuple[tuple[int, ...] | None, ...], ...] | None = None
    # knobs of the framework's own data path that change its layout (slime's pad_multiplier, ...),
    # as (name, value) pairs sorted by name; JSON: an object. Empty: the framework's defaults. A
    # target whose data path has no such knob skips the scenario with the reason.
    layout_knobs: tuple[tuple[str, Any], ...] = ()
    # the training step (scenarios.batch): the samples are the global batch, split over ``dp``
    # data-parallel replicas (the world is dp x tp x cp), each replica's share into micro-batches of
    # ``micro_batch_size`` samples (0: one micro-batch) or, with ``micro_batch_tokens``, of at most
    # that many tokens (dynamic batching). A target whose loss is not a training step's
    # (loss_form "step") skips a scenario that sets any of them.
    dp: int = 1
    micro_batch_size: int = 0
    micro_batch_tokens: int = 0
    # the sequence-parallel degree of the DTensor family's layouts (``SP_LAYOUTS``): each rank
    # holds a contiguous slice of the packed sequence and the outputs are gathered over the sp
    # group; 1 for every other layout (cp is the Megatron family's sequence axis)
    sp: int = 1
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        # Accept lists of pairs or dicts (what JSON gives) and normalise to Sample tuples.
        object.__setattr__(self, "samples", tuple(_as_sample(s, self.name) for s in self.samples))
        if self.keep_sets is not None:
            object.__setattr__(self, "keep_sets", _as_keep_sets(self.keep_sets, self.name))
        object.__setattr__(self, "layout_knobs", _as_knobs(self.layout_knobs, self.name))
        validate(self)

    # JSON -----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["samples"] = [[s.total, s.response] + ([s.data_id] if s.data_id not in (None, i) else [])
                         for i, s in enumerate(self.samples)]
        for name, off in (("top_k", 0), ("top_p", 1.0), ("keep_sets", None), ("layout_knobs", ()), ("dp", 1),
                          ("micro_batch_size", 0), ("micro_batch_tokens", 0), ("sp", 1)):
            # written when on: older keys hold
            if d[name] == off:
                del d[name]
        if self.keep_sets is not None:
            d["keep_sets"] = [[None if k is None else list(k) for k in sets] for sets in self.keep_sets]
        if self.layout_knobs:
            d["layout_knobs"] = dict(self.layout_knobs)
        return d

    @classmethod
    def from_dict(cls, data: Any) -> Scenario:
        if not isinstance(data, dict):
            raise BadInput(f"a scenario must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise BadInput(f"scenario {data.get('name', '?')!r}: unknown field(s) {', '.join(unknown)}")
        missing = [k for k in ("name", "samples", "vocab") if k not in data]
        if missing:
            raise BadInput(f"scenario {data.get('name', '?')!r}: missing field(s) {', '.join(missing)}")
        try:
            return cls(**data)
        except TypeError as exc:  # a wrong type deep inside, e.g. samples=3
            raise BadInput(f"scenario {data.get('name', '?')!r}: {exc}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Scenario:
        return cls.from_dict(json.loads(text))

    @property
    def key(self) -> str:
        """Content hash (canonical JSON without name/description): same computation, same key."""
        d = self.to_dict()
        d.pop("name")
        d.pop("description")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def sampling(self) -> bool:
        """Whether log-probs are processed by a top-k / top-p filter of the logits."""
        return self.top_k > 0 or self.top_p < 1.0

    @property
    def processed(self) -> bool:
        """Whether the log-probs are renormalised over a keep set (replayed or filtered)."""
        return self.replay_keep or self.sampling

    @property
    def ranks(self) -> int:
        """The ranks one copy of the scenario takes: dp x tp x cp x sp (cp or sp is 1)."""
        return self.dp * self.tp * self.cp * self.sp

    @property
    def seq(self) -> int:
        """How many ranks the sequence is sharded over: cp (the Megatron family's context
        parallelism) or sp (the DTensor family's sequence parallelism); the other is 1."""
        return self.cp * self.sp

    @property
    def step(self) -> bool:
        """Whether the scenario asks for a training step: several replicas or micro-batches."""
        return self.dp > 1 or self.micro_batch_size > 0 or self.micro_batch_tokens > 0

    def micro_batches(self, replica: int) -> list[tuple[int, ...]]:
        """The sample indices of each micro-batch data-parallel replica ``replica`` runs, in order
        (:mod:`shardcheck.scenarios.batch`)."""
        return replica_micro_batches([s.total for s in self.samples], self.dp, replica, self.micro_batch_size,
                                     self.micro_batch_tokens)

    def micro_batch(self, samples: tuple[int, ...]) -> Scenario:
        """One micro-batch as a scenario of its own: those samples (their data unchanged: each
        keeps its data_id), the same layout and settings, no training step."""
        picked = tuple(Sample(self.samples[i].total, self.samples[i].response, data_id(self, i)) for i in samples)
        keep = tuple(self.keep_sets[i] for i in samples) if self.keep_sets is not None else None
        return dataclasses.replace(self, samples=picked, keep_sets=keep, dp=1, micro_batch_size=0,
                                   micro_batch_tokens=0)

    def summary(self) -> str:
        lengths = ",".join(f"{s.total}/{s.response}" for s in self.samples[:4])
        more = f",+{len(self.samples) - 4}" if len(self.samples) > 4 else ""
        knobs = "".join(f" {k}={v}" for k, v in self.layout_knobs)
        step = (f" dp={self.dp}" if self.dp > 1 else "") + (f" mbs={self.micro_batch_size}" if self.micro_batch_size
                                                            else "") + (
            f" mbt={self.micro_batch_tokens}" if self.micro_batch_tokens else "")
        seq = f"sp={self.sp}" if self.sp > 1 else f"cp={self.cp}"
        return f"{self.layout} tp={self.tp} {seq}{step} V={self.vocab} [{lengths}{more}]{knobs}"


def _as_sample(value: Any, name: str) -> Sample:
    if isinstance(value, Sample):
        return value
    if isinstance(value, dict) and {"total", "response"} <= set(value) <= {"total", "response", "data_id"}:
        return Sample(value["total"], value["response"], value.get("data_id"))
    if isinstance(value, (list, tuple)) and len(value) in (2, 3):
        return Sample(*value)
    raise BadInput(f"scenario {name!r}: a sample must be [total, response] or [total, response, data_id], "
                   f"got {value!r}")


def _as_keep_sets(value: Any, name: str) -> tuple:
    """Lists (what JSON gives) to tuples, so the scenario stays hashable and comparable."""
    def bad() -> BadInput:
        return BadInput(f"scenario {name!r}: keep_sets must be a list per sample of keep sets (a list of token "
                        f"ids, or null), got {value!r:.80}")

    if not isinstance(value, (list, tuple)):
        raise bad()
    out = []
    for sets in value:
        if not isinstance(sets, (list, tuple)):
            raise bad()
        row = []
        for k in sets:
            if k is not None and not isinstance(k, (list, tuple)):
                raise bad()
            row.append(None if k is None else tuple(k))
        out.append(tuple(row))
    return tuple(out)


def _as_knobs(value: Any, name: str) -> tuple[tuple[str, Any], ...]:
    """An object of knob -> scalar (what JSON gives) or pairs, as sorted pairs (hashable)."""
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        pairs = [tuple(p) for p in value]
    else:
        raise BadInput(f"scenario {name!r}: layout_knobs must be an object of knob: value, got {value!r:.80}")
    for key, v in pairs:
        if not isinstance(key, str) or not key:
            raise BadInput(f"scenario {name!r}: layout_knobs: a knob name must be a non-empty string, got {key!r}")
        if not isinstance(v, (bool, int, float, str)):
            raise BadInput(f"scenario {name!r}: layout_knobs: {key} must be a number, true/false or a string, "
                           f"got {v!r:.40}")
    if len({k for k, _ in pairs}) != len(pairs):
        raise BadInput(f"scenario {name!r}: layout_knobs names a knob twice")
    return tuple(sorted(pairs))


def data_id(scenario: Scenario, index: int) -> int:
    """The identity sample ``index`` draws its data from."""
    d = scenario.samples[index].data_id
    return index if d is None else d


# The rules a scenario's settings obey, one function each: validate() raises what they say, and the
# hypothesis strategies (strategies.py) draw only what they accept and refuse what they refuse.


def layout_problem(layout: str, cp: int, sp: int = 1) -> str | None:
    """What is wrong with ``layout`` at this cp and sp, or None: CP layouts need cp >= 2 and sp 1,
    SP layouts sp >= 2 and cp 1, the others cp 1 and sp 1."""
    if layout in SP_LAYOUTS:
        if sp < 2:
            return f"layout {layout} needs sp >= 2, got sp={sp}"
        if cp != 1:
            return f"layout {layout} is sequence parallel over sp: cp must be 1, got {cp}"
        return None
    if sp != 1:
        return (f"layout {layout} has no sequence parallelism: sp must be 1, got {sp} (sp layouts: "
                f"{', '.join(SP_LAYOUTS)})")
    if layout in CP_LAYOUTS and cp < 2:
        return f"layout {layout} needs cp >= 2, got cp={cp}"
    if layout not in CP_LAYOUTS and cp != 1:
        return f"layout {layout} has no context parallelism: cp must be 1, got {cp}"
    return None


def sequence_sizes(layout: str, seq: int) -> tuple[int, int]:
    """(cp, sp) of ``layout`` when its sequence is sharded over ``seq`` ranks: sp layouts shard
    it over sp, the others over cp (the search draws one sequence size, whichever layout)."""
    return (1, seq) if layout in SP_LAYOUTS else (seq, 1)


def layout_fits(layout: str, seq: int) -> bool:
    """Whether validation accepts ``layout`` with its sequence sharded over ``seq`` ranks (cp for
    the CP layouts, sp for the SP layouts)."""
    return layout_problem(layout, *sequence_sizes(layout, seq)) is None


def entropy_problem(with_entropy: Any, entropy_coef: Any) -> str | None:
    """What is wrong with (with_entropy, entropy_coef), or None: a non-zero coefficient needs entropy."""
    if not isinstance(with_entropy, bool):
        return f"with_entropy must be true or false, got {with_entropy!r}"
    if not isinstance(entropy_coef, (int, float)) or isinstance(entropy_coef, bool):
        return f"entropy_coef must be a number, got {entropy_coef!r}"
    if not math.isfinite(entropy_coef):
        return f"entropy_coef must be finite, got {entropy_coef!r}"
    if entropy_coef != 0 and not with_entropy:
        return f"entropy_coef {entropy_coef} needs with_entropy=true"
    return None


def chunk_size_problem(chunk_size: Any) -> str | None:
    """What is wrong with a ``log_probs_chunk_size``, or None: -1 (no chunking) or >= 1."""
    if not _is_int(chunk_size) or chunk_size == 0 or chunk_size < -1:
        return f"log_probs_chunk_size must be -1 (no chunking) or >= 1, got {chunk_size!r}"
    return None


def step_problem(s: Scenario) -> str | None:
    """What is wrong with a scenario's training step (dp, micro-batch rule), or None."""
    if s.dp < 1:
        return f"dp must be >= 1, got {s.dp}"
    if s.micro_batch_size < 0 or s.micro_batch_tokens < 0:
        return "micro_batch_size and micro_batch_tokens must be >= 0 (0: off)"
    if s.micro_batch_size and s.micro_batch_tokens:
        return ("micro_batch_size and micro_batch_tokens are two rules for splitting a replica's samples (a fixed "
                "size, a token budget): give one")
    n = len(s.samples)
    if n % s.dp:
        return f"{n} samples cannot be split evenly over dp {s.dp} replicas"
    if s.micro_batch_size and (n // s.dp) % s.micro_batch_size:
        return (f"a replica's {n // s.dp} samples cannot be split into micro-batches of {s.micro_batch_size} "
                f"(global batch {n} = dp {s.dp} x micro_batch_size x micro-batches)")
    if s.micro_batch_tokens:
        longest = max(smp.total for smp in s.samples)
        if longest > s.micro_batch_tokens:
            return f"a sample of {longest} tokens does not fit micro_batch_tokens {s.micro_batch_tokens}"
        try:
            token_budget_split([smp.total for smp in s.samples], s.dp, s.micro_batch_tokens)
        except ValueError as exc:
            return str(exc)
    return None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _validate_keep_sets(s: Scenario, bad: Any) -> None:
    if not s.replay_keep:
        raise bad("keep_sets are replayed keep sets: give replay_keep true with them")
    if len(s.keep_sets) != len(s.samples):
        raise bad(f"keep_sets has {len(s.keep_sets)} entries for {len(s.samples)} samples")
    for i, (sets, smp) in enumerate(zip(s.keep_sets, s.samples)):
        if len(sets) != smp.response:
            raise bad(f"sample {i}: {len(sets)} keep sets for {smp.response} response tokens")
        for r, k in enumerate(sets):
            if k is None:
                if any(later is not None for later in sets[r:]):
                    raise bad(f"sample {i}: keep set {r} is null but a later one is not (unrecorded sets "
                              "can only end the list)")
                break
            for v in k:
                if not _is_int(v) or not 0 <= v < s.vocab:
                    raise bad(f"sample {i}: keep set {r} names token {v!r}, outside the vocabulary of {s.vocab}")


def validate(s: Scenario) -> None:
    """Reject what cannot be, with one message naming the scenario and the field."""

    def bad(msg: str) -> BadInput:
        return BadInput(f"scenario {s.name!r}: {msg}")

    if not isinstance(s.name, str) or not s.name:
        raise BadInput(f"scenario name must be a non-empty string, got {s.name!r}")
    if not s.samples:
        raise bad("needs at least one sample")
    for i, smp in enumerate(s.samples):
        if not (_is_int(smp.total) and _is_int(smp.response)):
            raise bad(f"sample {i}: lengths must be integers, got [{smp.total!r}, {smp.response!r}]")
        if smp.total < 2:  # a prompt token and a response token at least
            raise bad(f"sample {i}: total length {smp.total} must be at least 2 (a prompt token and a response token)")
        if smp.response < 1:
            raise bad(f"sample {i}: response length {smp.response} must be at least 1")
        if smp.data_id is not None and not (_is_int(smp.data_id) and smp.data_id >= 0):
            raise bad(f"sample {i}: data_id must be an integer >= 0, got {smp.data_id!r}")
        if smp.response > smp.total - 1:
            raise bad(
                f"sample {i}: response length {smp.response} > total length {smp.total} - 1 "
                "(the prompt needs at least one token)"
            )
    ids = [data_id(s, i) for i in range(len(s.samples))]
    if len(set(ids)) != len(ids):
        dup = next(x for x in ids if ids.count(x) > 1)
        raise bad(f"two samples carry data_id {dup} (a sample's data_id defaults to its index)")
    for fname in ("vocab", "tp", "cp", "sp", "log_probs_chunk_size", "seed", "dp", "micro_batch_size",
                  "micro_batch_tokens"):
        if not _is_int(getattr(s, fname)):
            raise bad(f"{fname} must be an integer, got {getattr(s, fname)!r}")
    if s.vocab < 1:
        raise bad(f"vocab {s.vocab} < 1")
    if not isinstance(s.replay_keep, bool):
        raise bad(f"replay_keep must be true or false, got {s.replay_keep!r}")
    if not _is_int(s.top_k) or not 0 <= s.top_k <= s.vocab:
        raise bad(f"top_k must be an integer in [0, vocab {s.vocab}] (0: no top-k), got {s.top_k!r}")
    if isinstance(s.top_p, bool) or not isinstance(s.top_p, (int, float)) or not 0 < s.top_p <= 1:
        raise bad(f"top_p must be a number in (0, 1] (1: no top-p), got {s.top_p!r}")
    if s.keep_sets is not None:
        _validate_keep_sets(s, bad)
    if s.replay_keep and (s.top_k > 0 or s.top_p < 1):
        raise bad("replay_keep and top_k / top_p are two definitions of a processed log-prob (replayed sets, "
                  "or sets filtered from the logits): give one")
    if s.tp < 1 or s.cp < 1 or s.sp < 1:
        raise bad(f"tp, cp and sp must be >= 1, got tp={s.tp} cp={s.cp} sp={s.sp}")
    if s.vocab % s.tp:
        raise bad(f"vocab {s.vocab} is not divisible by tp {s.tp}")
    problem = step_problem(s)
    if problem:
        raise bad(problem)
    if s.layout not in LAYOUTS:
        raise bad(f"layout {s.layout!r} is not one of {', '.join(LAYOUTS)}")
    for problem in (layout_problem(s.layout, s.cp, s.sp), entropy_problem(s.with_entropy, s.entropy_coef),
                    chunk_size_problem(s.log_probs_chunk_size)):
        if problem:
            raise bad(problem)
    if not isinstance(s.temperature, (int, float)) or isinstance(s.temperature, bool):
        raise bad(f"temperature must be a number, got {s.temperature!r}")
    if not (math.isfinite(s.temperature) and s.temperature > 0):
        raise bad(f"temperature must be finite and > 0, got {s.temperature}")
    if s.dtype not in DTYPES:
        raise bad(f"dtype {s.dtype!r} is not one of {', '.join(DTYPES)}")
    if not isinstance(s.description, str):
        raise bad("description must be a string")
