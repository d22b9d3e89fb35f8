"""Hypothesis strategies that generate valid scenarios, biased toward the lengths that break
sharded code.

Every strategy yields plain data (:class:`Scenario`, :class:`Sample`, ints, strings) that passes
validation, so a property test never spends an example on a rejected input. They compose::

    from hypothesis import given
    from shardcheck.strategies import scenarios

    @given(scenarios(tp=2, cp=2, layout="allgather", vocab=[8, 16]))
    def test_mine(sc): ...

Bias: a sample's total length is drawn uniformly or from the zigzag padding edges (a multiple of
2 * cp, one less, one more); its response starts on, just before or just after a row where a
rank's share begins or ends (a zigzag chunk, an all-gather piece, a ``log_probs_chunk_size``
chunk of the local rows), or has length 1, or leaves a prompt of 1, or sits behind a long prompt
(so some CP rank holds none of it). Counts run from one sample to many.

Shrinking: every choice lists its simplest value first (tp 1, the smallest cp and vocab, thd,
no chunking, a response of length 1, temperature 1, no entropy term), lengths shrink toward 2
and the sample list toward one sample, so a failure shrinks to the fewest samples, the
shortest lengths and the smallest vocabulary that still fail.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, TypeVar

from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from shardcheck.errors import BadInput
from shardcheck.scenarios.scenario import (DTYPES, LAYOUTS, Sample, Scenario, chunk_size_problem,
                                           entropy_problem, layout_fits, layout_problem, sequence_sizes)

T = TypeVar("T")

TPS = (1, 2)  # the defaults fit a world of 4 ranks
CPS = (1, 2)
# Columns per TP rank. One column is a legal edge (a shard whose max is its only logit); the
# rest stay small because the cost of a scenario grows with the vocabulary, not its meaning.
VOCAB_PER_RANK = (1, 2, 3, 4, 8, 16)
MAX_TOTAL = 40
MAX_SAMPLES = 6
CHUNK_SIZES = (-1, 1, 2, 3, 4, 5, 7, 8, 16)
MAX_CHUNKS = 8  # per rank, for the default chunk sizes (see coarsen_chunk_size)
TEMPERATURES = (1.0, 0.5, 0.8, 1.7)
# (with_entropy, entropy_coef): no entropy term first, then the gradient-free entropy
# (coef 0, slime's default), then coefficients of either sign.
ENTROPY = ((False, 0.0), (True, 0.0), (True, 0.1), (True, -0.05))
# (top_k, top_p) of a sampler's filter (NeMo-RL's processed log-prob), none first; a top_k past
# the vocabulary is clamped to it
SAMPLING = ((0, 1.0), (1, 1.0), (4, 1.0), (0, 0.8), (8, 0.9), (0, 0.3))

_Choice = Any  # a value, a collection of values, or a strategy


def _choices(value: _Choice, default: Sequence[T]) -> SearchStrategy[T]:
    """A strategy from what a caller passed: None (the default values), one value, several
    values (simplest first), or a strategy of their own."""
    if isinstance(value, SearchStrategy):
        return value
    if value is None:
        return st.sampled_from(tuple(default))
    if isinstance(value, (str, int, float)):
        return st.just(value)
    values = tuple(value)
    if not values:
        raise BadInput("an empty set of choices cannot generate anything")
    return st.sampled_from(values)


def _as_values(value: _Choice, default: Sequence[T]) -> tuple[T, ...] | None:
    """The values a choice stands for when it is not a strategy (None when it is)."""
    if isinstance(value, SearchStrategy):
        return None
    if value is None:
        return tuple(default)
    if isinstance(value, (str, int, float)):
        return (value,)  # type: ignore[return-value]
    return tuple(value)


def layouts(cp: int | None = None, allowed: Collection[str] | None = None, *,
            seq: int | None = None) -> SearchStrategy[str]:
    """A layout valid at ``cp`` with sp 1 (any layout when cp is None), among ``allowed``;
    ``seq``: valid with its sequence sharded over that many ranks, cp for the CP layouts or sp
    for the SP layouts (:func:`~shardcheck.scenarios.scenario.sequence_sizes`)."""
    names = [name for name in LAYOUTS if allowed is None or name in allowed]
    if cp is not None:
        names = [name for name in names if layout_problem(name, cp) is None]
    if seq is not None:
        names = [name for name in names if layout_fits(name, seq)]
    if not names:
        at = f"cp={cp}" if seq is None else f"a sequence sharded over {seq}"
        raise BadInput(f"no layout among {sorted(allowed or LAYOUTS)} is valid at {at}")
    return st.sampled_from(names)


def vocabs(tp: int = 1, per_rank: Sequence[int] = VOCAB_PER_RANK) -> SearchStrategy[int]:
    """A vocabulary size divisible by ``tp``, smallest first."""
    return st.sampled_from(tuple(tp * v for v in sorted(per_rank)))


def chunk_sizes(values: Sequence[int] = CHUNK_SIZES) -> SearchStrategy[int]:
    """``log_probs_chunk_size``: -1 (no chunking) first, then small sizes that split local rows
    into uneven chunks."""
    return st.sampled_from(tuple(values))


def temperatures(values: Sequence[float] = TEMPERATURES) -> SearchStrategy[float]:
    return st.sampled_from(tuple(values))


def entropy_settings(values: Sequence[tuple[bool, float]] = ENTROPY) -> SearchStrategy[tuple[bool, float]]:
    """(with_entropy, entropy_coef) pairs that validate: a non-zero coefficient needs entropy."""
    for with_entropy, coef in values:
        if problem := entropy_problem(with_entropy, coef):
            raise BadInput(problem)
    return st.sampled_from(tuple(values))


def lengths(cp: int = 1, *, min_total: int = 2, max_total: int = MAX_TOTAL) -> SearchStrategy[int]:
    """A sample's total length: uniform, or (two times in three) on a zigzag padding edge:
    2 * cp * k (no padding), one less (one padded row) or one more (a whole extra row per chunk,
    nearly all padding)."""
    if not 2 <= min_total <= max_total:
        raise BadInput(f"lengths need 2 <= min_total <= max_total, got {min_total}, {max_total}")
    unit = 2 * cp
    ks = range(1, max_total // unit + 2)
    exact = [unit * k for k in ks if min_total <= unit * k <= max_total]
    near = sorted({t for k in ks for t in (unit * k - 1, unit * k + 1) if min_total <= t <= max_total} - set(exact))
    return st.one_of(st.integers(min_total, max_total), *(st.sampled_from(e) for e in (exact, near) if e))


# How a sample's response is placed, simplest first (a failure shrinks toward response 1);
# on an edge three times in seven, as that is where sharded code breaks.
_ONE, _BOUNDARY, _PROMPT_ONE, _LONG_PROMPT, _ANY = "one", "boundary", "prompt_one", "long_prompt", "any"
_PLACEMENTS = (_ONE, _BOUNDARY, _PROMPT_ONE, _BOUNDARY, _LONG_PROMPT, _BOUNDARY, _ANY)
_OFFSETS = (0, -1, 0, 1)  # on the edge, one row before it, on it, one row after it


@st.composite
def _sample_plan(draw: Any, cp: int, max_total: int) -> tuple[int, bool, str, int, int]:
    """A total length and how to place its response once every total (hence every rank's share
    of the sample) is known: (total, same as the previous sample's, placement, pick, offset).
    Equal totals put all-gather piece boundaries on sample boundaries."""
    total = draw(lengths(cp, max_total=max_total))
    repeat = draw(st.sampled_from((False, False, False, True)))
    placement = draw(st.sampled_from(_PLACEMENTS))
    pick = draw(st.integers(0, 2 * max_total)) if placement in (_BOUNDARY, _LONG_PROMPT, _ANY) else 0
    offset = draw(st.sampled_from(_OFFSETS)) if placement == _BOUNDARY else 0
    return total, repeat, placement, pick, offset


def boundary_positions(totals: Sequence[int], *, tp: int = 1, cp: int = 1, layout: str = "thd",
                       chunk_size: int = -1) -> list[list[int]]:
    """Per sample, the positions (row indices within the sample) where some rank's rows of it
    begin or end, or where a ``log_probs_chunk_size`` chunk of some rank's local rows begins.

    A response starting at one of these is split exactly at a rank or chunk edge. Derived from
    the harness's layout arithmetic, which depends on the totals only.
    """
    from shardcheck.scenarios.layout import rank_layout

    sketch = _sketch(totals, tp, cp, layout, chunk_size)
    found: list[set[int]] = [set() for _ in totals]
    for cp_rank in range(cp):
        rank = rank_layout(sketch, 0, cp_rank)
        for piece in rank.pieces:
            if piece.stream < len(totals):
                found[piece.stream] |= {piece.start, piece.stop}
        if chunk_size > 0:
            for row, (stream, position) in enumerate(rank.row_positions()):
                if row % chunk_size == 0 and stream < len(totals):
                    found[stream].add(position)
    # a response starts at position P - 1 for a prompt P in [1, total - 1]; position 0 (prompt
    # 1) is a placement of its own
    return [sorted(p for p in s if 0 < p <= t - 2) for s, t in zip(found, totals)]


def _response(total: int, placement: str, pick: int, offset: int, edges: Sequence[int]) -> int:
    if placement == _ONE:
        return 1
    if placement == _PROMPT_ONE:
        return total - 1
    if placement == _LONG_PROMPT:
        return 1 + pick % max(1, (total - 1) // 4)
    if placement == _ANY:
        return 1 + pick % (total - 1)
    # the latest edge first: shrinking pick toward 0 then shortens the response
    first_scored = edges[-1 - pick % len(edges)] + offset if edges else pick % (total - 1)
    first_scored = min(max(first_scored, 0), total - 2)
    return total - 1 - first_scored  # the response starts on (or next to) the edge


def _local_rows(totals: Sequence[int], tp: int, cp: int, layout: str) -> int:
    """The most rows any rank holds (the rows its chunks split)."""
    from shardcheck.scenarios.layout import rank_layout

    sketch = _sketch(totals, tp, cp, layout)
    return max(rank_layout(sketch, 0, r).num_rows for r in range(cp))


def _sketch(totals: Sequence[int], tp: int, seq: int, layout: str, chunk_size: int = -1) -> Scenario:
    """The layout of these totals alone, its sequence sharded over ``seq`` ranks (cp, or sp for
    the SP layouts: the search draws one sequence size for either family)."""
    cp, sp = sequence_sizes(layout, seq)
    return Scenario("sketch", tuple(Sample(t, 1) for t in totals), vocab=tp, tp=tp, cp=cp, sp=sp, layout=layout,
                    log_probs_chunk_size=chunk_size)


def coarsen_chunk_size(chunk_size: int, local_rows: int, max_chunks: int = MAX_CHUNKS) -> int:
    """A chunk size giving at most ``max_chunks`` chunks per rank: each chunk costs 3 or 4
    collectives, and one split (or a one-row tail) tests a boundary as well as fifty."""
    if chunk_size <= 0 or -(-local_rows // chunk_size) <= max_chunks:
        return chunk_size
    return -(-local_rows // max_chunks)


@st.composite
def _batch(draw: Any, *, tp: int, cp: int, layout: str, chunk_size: SearchStrategy[int], min_size: int,
           max_size: int, max_total: int, coarsen: bool) -> tuple[tuple[Sample, ...], int]:
    """Samples and the chunk size: the chunk size and the totals first, then each response placed
    against the edges both make (a plan per sample, so dropping a sample drops all of it)."""
    chunk = draw(chunk_size)
    plans = draw(st.lists(_sample_plan(cp, max_total), min_size=min_size, max_size=max_size))
    totals: list[int] = []
    for total, repeat, *_ in plans:
        totals.append(totals[-1] if repeat and totals else total)
    if coarsen:
        chunk = coarsen_chunk_size(chunk, _local_rows(totals, tp, cp, layout))
    edges = boundary_positions(totals, tp=tp, cp=cp, layout=layout, chunk_size=chunk)
    batch = tuple(Sample(total, _response(total, placement, pick, offset, e))
                  for total, (_, _, placement, pick, offset), e in zip(totals, plans, edges))
    return batch, chunk


def samples(*, tp: int = 1, cp: int = 1, layout: str = "thd", chunk_size: int = -1, min_size: int = 1,
            max_size: int = MAX_SAMPLES, max_total: int = MAX_TOTAL) -> SearchStrategy[tuple[Sample, ...]]:
    """A batch of samples for one layout, responses placed against that layout's rank and chunk
    edges (which depend on every total, hence the two steps)."""
    if not 1 <= min_size <= max_size:
        raise BadInput(f"samples need 1 <= min_size <= max_size, got {min_size}, {max_size}")
    if max_total < 2:
        raise BadInput(f"max_total must be >= 2 (a prompt and a response token), got {max_total}")
    if not (_is_int(tp) and tp >= 1 and _is_int(cp) and cp >= 1) or not layout_fits(layout, cp):
        raise BadInput(f"samples: layout {layout!r} with tp={tp} cp={cp} is not a valid combination")
    if problem := chunk_size_problem(chunk_size):
        raise BadInput(problem)
    return _batch(tp=tp, cp=cp, layout=layout, chunk_size=st.just(chunk_size), min_size=min_size,
                  max_size=max_size, max_total=max_total, coarsen=False).map(lambda pair: pair[0])


def scenarios(
    *,
    tp: _Choice = None,
    cp: _Choice = None,
    layout: _Choice = None,
    vocab: _Choice = None,
    ranks: int | None = None,
    chunk_size: _Choice = None,
    temperature: _Choice = None,
    entropy: _Choice = None,
    dtype: _Choice = "float32",
    seed: _Choice = None,
    replay_keep: _Choice = False,
    sampling: _Choice = ((0, 1.0),),
    min_samples: int = 1,
    max_samples: int = MAX_SAMPLES,
    max_total: int = MAX_TOTAL,
    name: str = "fuzz",
) -> SearchStrategy[Scenario]:
    """Valid scenarios. Each of tp (default 1, 2), cp (default 1, 2), layout, vocab, chunk_size,
    temperature, entropy ((with_entropy, entropy_coef) pairs), dtype, seed and replay_keep
    (whether samples carry replayed top-p / top-k keep sets; default False) and sampling
    ((top_k, top_p) pairs of a sampler's filter; default none) may be one value,
    several (the first is where shrinking heads) or a strategy. ``ranks``: only (tp, cp) with
    tp * cp dividing it, so every scenario fits a world of that many ranks. Only vocab sizes tp
    divides are drawn. Default chunk sizes are coarsened to at most MAX_CHUNKS chunks per rank;
    chunk sizes given are used as they are. What cannot give a single valid scenario is
    BadInput here, not a rejection of every example later."""
    values = {key: _as_values(value, default) for key, value, default in (
        ("tp", tp, TPS), ("cp", cp, CPS), ("layout", layout, LAYOUTS), ("vocab", vocab, ()),
        ("chunk_size", chunk_size, CHUNK_SIZES), ("entropy", entropy, ENTROPY), ("dtype", dtype, DTYPES),
        ("replay_keep", replay_keep, (False, True)), ("sampling", sampling, SAMPLING))}
    if vocab is None:
        values["vocab"] = None  # drawn per tp (vocabs), always divisible
    _check(values, ranks, min_samples, max_samples, max_total)
    return _scenarios(tp=tp, cp=cp, layout=layout, vocab=vocab, ranks=ranks, chunk_size=chunk_size,
                      temperature=temperature, entropy=entropy, dtype=dtype, seed=seed, replay_keep=replay_keep,
                      sampling=sampling, min_samples=min_samples,
                      max_samples=max_samples, max_total=max_total, name=name, layout_values=values["layout"],
                      cp_values=values["cp"], vocab_values=values["vocab"])


@st.composite
def _scenarios(draw: Any, *, tp: _Choice, cp: _Choice, layout: _Choice, vocab: _Choice, ranks: int | None,
               chunk_size: _Choice, temperature: _Choice, entropy: _Choice, dtype: _Choice, seed: _Choice,
               replay_keep: _Choice, sampling: _Choice, min_samples: int, max_samples: int, max_total: int, name: str,
               layout_values: tuple[str, ...] | None, cp_values: tuple[int, ...] | None,
               vocab_values: tuple[int, ...] | None) -> Scenario:
    t = draw(_choices(tp, TPS))
    if cp_values is not None:  # only the cp values that combine with this tp
        fitting = [c for c in cp_values if _fits(t, c, layout_values, ranks)]
        assume(fitting)
        c = draw(st.sampled_from(fitting))
    else:
        c = draw(_choices(cp, CPS))
        assume(_fits(t, c, layout_values, ranks))
    if layout_values is not None:
        lay = draw(layouts(allowed=layout_values, seq=c))
    else:
        lay = draw(_choices(layout, LAYOUTS))
        assume(layout_fits(lay, c))
    batch, chunk = draw(_batch(tp=t, cp=c, layout=lay, chunk_size=_choices(chunk_size, CHUNK_SIZES),
                               min_size=min_samples, max_size=max_samples, max_total=max_total,
                               coarsen=chunk_size is None))
    if vocab is None:
        v = draw(vocabs(t))
    elif vocab_values is not None:
        divisible = [v for v in vocab_values if v % t == 0]
        assume(divisible)
        v = draw(st.sampled_from(divisible))
    else:
        v = draw(vocab)
        assume(v % t == 0)
    with_entropy, coef = draw(_choices(entropy, ENTROPY))
    replay = draw(_choices(replay_keep, (False, True)))
    top_k, top_p = (0, 1.0) if replay else draw(_choices(sampling, SAMPLING))  # one definition at a time
    seq_cp, seq_sp = sequence_sizes(lay, c)
    return Scenario(
        name=name, samples=batch, vocab=v, tp=t, cp=seq_cp, sp=seq_sp, layout=lay, with_entropy=with_entropy,
        entropy_coef=coef, log_probs_chunk_size=chunk, temperature=draw(_choices(temperature, TEMPERATURES)),
        dtype=draw(_choices(dtype, DTYPES)),
        seed=draw(_choices(seed, ()) if seed is not None else st.integers(0, 2**16)),
        replay_keep=replay, top_k=min(top_k, v), top_p=top_p,
    )


def _fits(tp: int, cp: int, layouts_: Sequence[str] | None, ranks: int | None) -> bool:
    if ranks is not None and ranks % (tp * cp):
        return False
    return layouts_ is None or any(layout_fits(name, cp) for name in layouts_)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check(values: dict[str, tuple | None], ranks: int | None, min_samples: int, max_samples: int,
           max_total: int) -> None:
    """Say at construction, not by rejecting every example, when nothing valid can be drawn."""
    tps, cps, names = values["tp"], values["cp"], values["layout"]
    for key in ("tp", "cp", "vocab"):
        for v in values[key] or ():
            if not _is_int(v) or v < 1:
                raise BadInput(f"{key} values must be integers >= 1, got {v!r}")
    for v in values["chunk_size"] or ():
        if problem := chunk_size_problem(v):
            raise BadInput(problem)
    for name in names or ():
        if name not in LAYOUTS:
            raise BadInput(f"layout {name!r} is not one of {', '.join(LAYOUTS)}")
    for pair in values["sampling"] or ():
        if not (isinstance(pair, tuple) and len(pair) == 2 and _is_int(pair[0]) and pair[0] >= 0
                and isinstance(pair[1], (int, float)) and 0 < pair[1] <= 1):
            raise BadInput(f"sampling values must be (top_k >= 0, 0 < top_p <= 1) pairs, got {pair!r}")
    for r in values["replay_keep"] or ():
        if not isinstance(r, bool):
            raise BadInput(f"replay_keep values must be true or false, got {r!r}")
    for d in values["dtype"] or ():
        if d not in DTYPES:
            raise BadInput(f"dtype {d!r} is not one of {', '.join(DTYPES)}")
    for with_entropy, coef in values["entropy"] or ():
        if problem := entropy_problem(with_entropy, coef):
            raise BadInput(problem)
    if ranks is not None and (not _is_int(ranks) or ranks < 1):
        raise BadInput(f"ranks must be an integer >= 1, got {ranks!r}")
    if not 1 <= min_samples <= max_samples:
        raise BadInput(f"need 1 <= min_samples <= max_samples, got {min_samples}, {max_samples}")
    if max_total < 2:
        raise BadInput(f"max_total must be >= 2 (a prompt and a response token), got {max_total}")
    if tps is not None and cps is not None and not any(_fits(t, c, names, ranks) for t in tps for c in cps):
        where = f" in a world of {ranks} ranks" if ranks is not None else ""
        raise BadInput(f"no tp in {list(tps)} and cp in {list(cps)} give a valid scenario with layouts "
                       f"{list(names or LAYOUTS)}{where}")
    if tps is not None and values["vocab"] is not None and not any(v % t == 0 for v in values["vocab"] for t in tps):
        raise BadInput(f"no vocab in {list(values['vocab'])} is divisible by a tp in {list(tps)}")


__all__ = [
    "boundary_positions",
    "chunk_sizes",
    "coarsen_chunk_size",
    "entropy_settings",
    "layout_fits",
    "layouts",
    "lengths",
    "samples",
    "scenarios",
    "temperatures",
    "vocabs",
]
