"""Layouts as pure arithmetic: which logit rows and vocab columns each rank holds, and which
response tokens it must return. No processes, no tensors: tested directly.

Row p of a sample's logits predicts token p + 1, so a sample with prompt P and total L is scored
by rows [P - 1, L - 1); response token j is scored by row P - 1 + j.

- thd: samples packed one after another, one batch row: ``[1, sum L, V / tp]``.
- bshd: sample i padded to M = max L in batch row i: ``[B, M, V / tp]``.
- zigzag (cp = c): each sample is cut into 2c chunks of ceil(L / 2c) rows (padded); CP rank r
  holds chunks r and 2c - 1 - r of every sample, sample after sample.
- allgather (cp = c): the packed sequence, padded to a multiple of c * tp, is cut into c
  contiguous pieces; CP rank r holds piece r. Its outputs are redistributed to zigzag shares.
- ulysses (sp = s): the packed sequence, padded at its end to a multiple of s, is cut into s
  contiguous slices (verl's ``ulysses_pad_and_slice_inputs``); SP rank r holds slice r, over the
  whole vocabulary or its TP shard. Its outputs are gathered back over the sp group.
- ring (sp = s): OpenRLHF's ring-attention split, the same rows as ulysses.
For cp > 1 a rank returns, per sample, the response tokens its zigzag chunks score (maybe none);
under sp every rank returns every response token (gathered), and takes its loss over them
divided by sp (the gather's backward hands each rank its own rows' share).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardcheck.scenarios.scenario import SP_LAYOUTS, Scenario


@dataclass(frozen=True)
class Piece:
    """Consecutive local rows holding positions [start, stop) of one stream.

    A stream is a sample (positions at or past its total length are padding) or, with
    ``stream == len(samples)``, the tail padding of the all-gather layout.
    """

    stream: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class RankLayout:
    """What one (tp_rank, cp_rank) holds and owes for a scenario; under sp, ``cp_rank`` is the
    rank's place on the sequence axis (its sp rank)."""

    scenario: Scenario
    tp_rank: int
    cp_rank: int
    pieces: tuple[Piece, ...]
    shape: tuple[int, int, int]
    columns: tuple[int, int]
    share: tuple[tuple[int, ...], ...]  # per sample: response token indices returned, in order
    # who laid the rows out: "shardcheck" (this module's arithmetic) or the framework's function
    # whose output the position trace decoded (shardcheck.scenarios.traced_layout)
    built_by: str = "shardcheck"

    @property
    def num_rows(self) -> int:
        return sum(p.rows for p in self.pieces)

    def row_positions(self) -> list[tuple[int, int]]:
        """(stream, position) of every local row, in order."""
        return [(p.stream, pos) for p in self.pieces for pos in range(p.start, p.stop)]

    def scored_token(self, stream: int, position: int) -> int | None:
        """The response token a row scores, or None for prompt, last and padding rows."""
        samples = self.scenario.samples
        if stream >= len(samples):
            return None
        s = samples[stream]
        if s.prompt - 1 <= position < s.total - 1:
            return position - (s.prompt - 1)
        return None


def zigzag_chunk(total: int, cp: int) -> int:
    return -(-total // (2 * cp))


def zigzag_positions(total: int, cp: int, cp_rank: int) -> list[range]:
    """The two position ranges of a sample a zigzag CP rank holds, in local order."""
    k = zigzag_chunk(total, cp)
    return [range(cp_rank * k, (cp_rank + 1) * k), range((2 * cp - 1 - cp_rank) * k, (2 * cp - cp_rank) * k)]


def zigzag_share(total: int, response: int, cp: int, cp_rank: int) -> tuple[int, ...]:
    prompt = total - response
    return tuple(
        p - (prompt - 1)
        for chunk in zigzag_positions(total, cp, cp_rank)
        for p in chunk
        if prompt - 1 <= p < total - 1
    )


def allgather_local_rows(scenario: Scenario) -> int:
    """Rows per CP rank in the all-gather layout (packed length padded to a multiple of cp * tp)."""
    total = sum(s.total for s in scenario.samples)
    unit = scenario.cp * scenario.tp
    return -(-total // unit) * unit // scenario.cp


def ulysses_local_rows(scenario: Scenario) -> int:
    """Rows per SP rank in the Ulysses layout (packed length padded to a multiple of sp)."""
    total = sum(s.total for s in scenario.samples)
    return -(-total // scenario.sp)


def allgather_pieces(scenario: Scenario, cp_rank: int, local: int | None = None) -> list[Piece]:
    """The pieces of contiguous slice ``cp_rank`` of the packed sequence, ``local`` rows a slice
    (all-gather CP's by default; the Ulysses layout cuts the same way, into its own slices)."""
    local = allgather_local_rows(scenario) if local is None else local
    lo, hi = cp_rank * local, (cp_rank + 1) * local
    pieces, offset = [], 0
    for i, s in enumerate(scenario.samples):
        a, b = max(lo, offset), min(hi, offset + s.total)
        if a < b:
            pieces.append(Piece(i, a - offset, b - offset))
        offset += s.total
    if hi > offset:  # tail padding, positions counted from the end of the packed samples
        pieces.append(Piece(len(scenario.samples), max(lo, offset) - offset, hi - offset))
    return pieces


def rank_layout(scenario: Scenario, tp_rank: int, cp_rank: int) -> RankLayout:
    sc = scenario
    if not (0 <= tp_rank < sc.tp and 0 <= cp_rank < sc.seq):
        raise ValueError(f"rank (tp={tp_rank}, cp={cp_rank}) outside tp={sc.tp} cp={sc.cp} sp={sc.sp}")
    v_local = sc.vocab // sc.tp
    columns = (tp_rank * v_local, (tp_rank + 1) * v_local)
    samples = sc.samples
    if sc.layout == "thd":
        pieces = [Piece(i, 0, s.total) for i, s in enumerate(samples)]
        shape = (1, sum(s.total for s in samples), v_local)
    elif sc.layout == "bshd":
        m = max(s.total for s in samples)
        pieces = [Piece(i, 0, m) for i in range(len(samples))]
        shape = (len(samples), m, v_local)
    elif sc.layout == "zigzag":
        pieces = [
            Piece(i, chunk.start, chunk.stop)
            for i, s in enumerate(samples)
            for chunk in zigzag_positions(s.total, sc.cp, cp_rank)
        ]
        shape = (1, sum(p.rows for p in pieces), v_local)
    elif sc.layout == "allgather":
        pieces = allgather_pieces(sc, cp_rank)
        shape = (1, allgather_local_rows(sc), v_local)
    elif sc.layout in SP_LAYOUTS:
        pieces = allgather_pieces(sc, cp_rank, ulysses_local_rows(sc))
        shape = (1, ulysses_local_rows(sc), v_local)
    else:  # validation makes this unreachable; keep the error named
        raise ValueError(f"unknown layout {sc.layout!r}")
    if sc.cp == 1:  # sp included: every rank owes every response token, gathered
        share = tuple(tuple(range(s.response)) for s in samples)
    else:
        share = tuple(zigzag_share(s.total, s.response, sc.cp, cp_rank) for s in samples)
    return RankLayout(sc, tp_rank, cp_rank, tuple(pieces), shape, columns, share)


# The rows of a rank, as tensors: what a target asks (RankInputs.row_labels, scored_rows,
# held_rows), and what a rank owes under a framework's own layout.

def local_row_targets(layout: RankLayout, tokens: list[torch.Tensor]) -> torch.Tensor:
    """The token every local row predicts (0 where it predicts none: last, padding rows)."""
    samples = layout.scenario.samples
    out = torch.zeros(layout.num_rows, dtype=torch.int64)
    for row, (stream, pos) in enumerate(layout.row_positions()):
        if stream < len(samples) and pos + 1 < samples[stream].total:
            out[row] = tokens[stream][pos + 1]
    return out


def local_share_rows(layout: RankLayout) -> list[torch.Tensor] | None:
    """Per sample, the local rows scoring the rank's share, in output order; None when some share
    row is held by another rank (all-gather CP: the values must be redistributed)."""
    where = {rp: row for row, rp in enumerate(layout.row_positions())}
    out = []
    for i, js in enumerate(layout.share):
        first = layout.scenario.samples[i].prompt - 1
        rows = [where.get((i, first + j)) for j in js]
        if any(r is None for r in rows):
            return None
        out.append(torch.tensor(rows, dtype=torch.int64))
    return out


def local_held_rows(layout: RankLayout) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sample, (local rows, response token indices) of the response tokens this rank's own
    rows score, in position order (all-gather CP: the rank's contiguous slice)."""
    held: list[tuple[list[int], list[int]]] = [([], []) for _ in layout.scenario.samples]
    for row, (stream, pos) in enumerate(layout.row_positions()):
        j = layout.scored_token(stream, pos)
        if j is not None:
            held[stream][0].append(row)
            held[stream][1].append(j)
    return [(torch.tensor(r, dtype=torch.int64), torch.tensor(j, dtype=torch.int64)) for r, j in held]
