"""Replayed keep sets: for each response token, the tokens the rollout's sampler kept (its top-p
nucleus or top-k set), which a processed log-prob is renormalised over (``reference.truth``).

Generated from the seed and the sample's ``data_id``, like the rest of a scenario's data, with
the edges that break the index code of a keep mask: a set of the target alone, the whole
vocabulary, a set straddling the boundary of two tensor-parallel vocabulary shards, a set that
leaves the target out (it is kept anyway), an empty set, and trailing response tokens with no
recorded set (slime's ragged ``offsets`` end early). Plain data: one tuple of sorted token ids per
response token, or None.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

import torch

KeepSets = list  # list[tuple[int, ...] | None], one entry per response token

EDGES = ("target_only", "whole_vocab", "straddle", "without_target", "empty")


def keep_sets(seed: int, data_id: int, targets: Sequence[int], vocab: int) -> KeepSets:
    """One keep set per response token (``targets``: the response tokens). The first tokens
    take the edges in turn, then random sets; the last quarter of a response of 4 or more
    tokens has none recorded. Nothing here depends on the layout (a sample's keep sets are the
    same at any tp or cp): the straddling set sits on the middle of the vocabulary, a shard
    boundary for every even tp."""
    rng = random.Random(int.from_bytes(hashlib.blake2b(repr((seed, "keep", data_id)).encode(),
                                                       digest_size=8).digest(), "little"))
    n = len(targets)
    recorded = n - n // 4 if n >= 4 else n
    out: KeepSets = []
    for r in range(recorded):
        y = int(targets[r])
        edge = EDGES[r] if r < len(EDGES) else None
        if edge == "target_only":
            ids = {y}
        elif edge == "whole_vocab":
            ids = set(range(vocab))
        elif edge == "straddle":
            b = vocab // 2
            ids = {v for v in (b - 2, b - 1, b, b + 1) if 0 <= v < vocab}
        elif edge == "without_target":
            ids = set(rng.sample([v for v in range(vocab) if v != y], min(3, vocab - 1)))
        elif edge == "empty":
            ids = set()
        else:
            ids = set(rng.sample(range(vocab), rng.randint(1, vocab)))
        out.append(tuple(sorted(ids)))
    return out + [None] * (n - recorded)


def to_ids_offsets(sets: KeepSets) -> tuple[list[int], list[int]]:
    """slime's replay format: the ids of every recorded set one after the other, and offsets
    with set r at ``ids[offsets[r]:offsets[r + 1]]``; unrecorded sets can only end the list."""
    ids: list[int] = []
    offsets = [0]
    for r, s in enumerate(sets):
        if s is None:
            if any(t is not None for t in sets[r:]):
                raise ValueError(f"keep set {r} is not recorded but a later one is: slime's offsets cannot say so")
            break
        ids.extend(s)
        offsets.append(len(ids))
    return ids, offsets


def check_keep_sets(sets: KeepSets, response: int, vocab: int, where: str) -> None:
    """ValueError naming the first problem: a count that is not the response's, or a token
    outside the vocabulary."""
    if len(sets) != response:
        raise ValueError(f"{where}: {len(sets)} keep sets for {response} response tokens")
    for r, s in enumerate(sets):
        for v in s or ():
            if not isinstance(v, int) or not 0 <= v < vocab:
                raise ValueError(f"{where}: keep set {r} names token {v!r}, outside the vocabulary of {vocab}")


def sampling_keep(s: torch.Tensor, top_k: int, top_p: float) -> list[tuple[int, ...]]:
    """The keep set of each row of temperature-scaled logits ``s`` ``[rows, V]`` under a top-k
    then top-p filter, as NeMo-RL's ``apply_top_k_top_p`` (after vLLM) defines it: top-k keeps
    every logit at least the k-th largest; top-p then keeps, in ascending order of the filtered
    distribution, the tokens whose cumulative probability exceeds 1 - p, and always the largest.
    0 and 1.0 switch a filter off."""
    s = s.to(torch.float64)
    if top_k > 0:
        kth = s.topk(top_k, dim=-1).values[..., -1:]
        s = s.masked_fill(s < kth, float("-inf"))
    keep = torch.isfinite(s)
    if top_p < 1.0:
        ascending, order = s.sort(dim=-1)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        kept = cumulative > 1 - top_p
        kept[..., -1] = True
        keep = keep & torch.zeros_like(kept).scatter(-1, order, kept)
    return [tuple(row.nonzero().flatten().tolist()) for row in keep]


def draw_inside(seed: int, data_id: int, sets: Sequence[Sequence[int]]) -> list[int]:
    """One token from each set, as a sampler would have drawn it (uniformly: which one does not
    matter to a log-prob check, only that it was kept)."""
    rng = random.Random(int.from_bytes(hashlib.blake2b(repr((seed, "sampled", data_id)).encode(),
                                                       digest_size=8).digest(), "little"))
    return [rng.choice(list(ids)) for ids in sets]
