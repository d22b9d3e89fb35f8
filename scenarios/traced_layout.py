"""A rank's layout learned from the framework's own data path, by a position-encoded trace.

A framework packs, pads and splits a rollout batch across CP ranks with its own code. To learn
where each global (sample, position) landed, the harness pushes a copy of the batch through the
same code with every token replaced by its place in the packed stream, ``1 + offset + position``
(:func:`encoded_tokens`); the framework's padding value is 0, so a local row holding 0 is padding.
:func:`decode` turns the local tensor the framework built into a :class:`RankLayout`, so every
later step (logits, reference, comparison, reports) is the one the harness's own layouts take.

:func:`harness_local_tokens` is the other direction, the harness's own arithmetic layout as a data
path: pushed through the trace it must give back exactly the layout it came from (the proof of
the mechanism, tests/test_traced_layout.py).

Pure tensor arithmetic, no processes: tested directly.
"""

from __future__ import annotations

import bisect

import torch

from shardcheck.scenarios.layout import Piece, RankLayout, rank_layout
from shardcheck.scenarios.scenario import Scenario

PAD = 0  # what a local row holds when it is padding: every framework checked pads token ids with 0


def stream_offsets(scenario: Scenario) -> list[int]:
    """Where each sample starts in the packed stream of all samples, and its end last."""
    out = [0]
    for s in scenario.samples:
        out.append(out[-1] + s.total)
    return out


def encoded_tokens(scenario: Scenario) -> list[torch.Tensor]:
    """Per sample, int64 ``[total]``: ``1 + offset + position`` (0 is left for padding)."""
    offsets = stream_offsets(scenario)
    return [torch.arange(offsets[i] + 1, offsets[i] + 1 + s.total, dtype=torch.int64)
            for i, s in enumerate(scenario.samples)]


class NotAPosition(ValueError):
    """The data path gave back a value that no position encodes (it changed token values)."""


def decode(scenario: Scenario, tp_rank: int, cp_rank: int, local: torch.Tensor, built_by: str) -> RankLayout:
    """The layout of a rank whose data path turned :func:`encoded_tokens` into ``local``.

    ``local``: ``[T]`` or ``[1, T]`` (packed) or ``[B, M]`` (padded; rows taken batch row after
    batch row). Padding rows become the tail stream at positions unique to the CP rank (the TP
    ranks of one CP rank hold the same rows, so they get the same padding logits).
    """
    sc = scenario
    if local.dim() == 1:
        local = local.unsqueeze(0)
    if local.dim() != 2:
        raise NotAPosition(f"{built_by} built tokens of shape {tuple(local.shape)}; expected [T], [1, T] or [B, M]")
    offsets = stream_offsets(sc)
    values = local.reshape(-1).tolist()
    n = len(values)
    tail = len(sc.samples)
    pad_base = cp_rank * n  # padding positions: unique per CP rank, shared by its TP ranks
    pieces: list[Piece] = []
    for row, v in enumerate(values):
        if v == PAD:
            stream, pos = tail, pad_base + row
        elif 1 <= v <= offsets[-1]:
            stream = bisect.bisect_right(offsets, v - 1) - 1
            pos = v - 1 - offsets[stream]
        else:
            raise NotAPosition(f"{built_by} put value {v} at local row {row}: neither padding (0) nor a position "
                               f"(1..{offsets[-1]}); it changed the token values it was given")
        last = pieces[-1] if pieces else None
        if last is not None and last.stream == stream and last.stop == pos:
            pieces[-1] = Piece(stream, last.start, pos + 1)
        else:
            pieces.append(Piece(stream, pos, pos + 1))
    v_local = sc.vocab // sc.tp
    shape = (local.size(0), local.size(1), v_local)
    own = rank_layout(sc, tp_rank, cp_rank)  # the output contract (each rank's share) is unchanged
    return RankLayout(sc, tp_rank, cp_rank, tuple(pieces), shape, own.columns, own.share, built_by)


def harness_local_tokens(layout: RankLayout, tokens: list[torch.Tensor]) -> torch.Tensor:
    """The tokens of the rows a harness layout holds, in its shape (0 for padding rows)."""
    samples = layout.scenario.samples
    out = torch.zeros(layout.num_rows, dtype=torch.int64)
    row = 0
    for p in layout.pieces:
        if p.stream < len(samples):
            stop = min(p.stop, samples[p.stream].total)
            if p.start < stop:
                out[row : row + stop - p.start] = tokens[p.stream][p.start : stop]
        row += p.rows
    return out.reshape(layout.shape[:2])


def row_map(layout: RankLayout) -> list[tuple[int, int] | None]:
    """(sample, position) of every local row, None for padding (however the layout names it)."""
    samples = layout.scenario.samples
    return [(s, p) if s < len(samples) and p < samples[s].total else None for s, p in layout.row_positions()]


def local_tokens_at(layout: RankLayout, tokens: list[torch.Tensor]) -> list[int]:
    """The token every local row holds if the layout is right: the sample's token, 0 for padding."""
    return [PAD if rp is None else int(tokens[rp[0]][rp[1]]) for rp in row_map(layout)]
