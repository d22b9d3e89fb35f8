"""From a scenario's global data to one rank's local inputs, and from the rank's outputs back
to global (sample, response token) positions."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from shardcheck.scenarios.layout import Piece, RankLayout, local_held_rows
from shardcheck.reference import logprob_entropy
from shardcheck.scenarios.data import ScenarioData
from shardcheck.targets.base import PolicyBatch


class PieceRows:
    """The rows of a list of pieces as one lazily generated ``[n, V]`` matrix (a reference Rows)."""

    def __init__(self, data: ScenarioData, pieces: Sequence[Piece]) -> None:
        self.data = data
        self.pieces = list(pieces)
        self.starts = [0]
        for p in self.pieces:
            self.starts.append(self.starts[-1] + p.rows)
        self.num_rows = self.starts[-1]

    def keep(self) -> dict[int, tuple[int, ...]] | None:
        """The reference's keep sets of these rows, by row (None: the scenario replays none)."""
        if not self.data.scenario.processed:
            return None
        out = {}
        for p, base in zip(self.pieces, self.starts):
            for r in range(p.rows):
                ids = self.data.keep_at(p.stream, p.start + r)
                if ids is not None:
                    out[base + r] = ids
        return out

    def rows(self, start: int, stop: int) -> torch.Tensor:
        out = []
        k = max(bisect.bisect_right(self.starts, start) - 1, 0)
        while start < stop and k < len(self.pieces):
            piece, base = self.pieces[k], self.starts[k]
            a, b = start - base, min(stop - base, piece.rows)
            out.append(self.data.logit_rows(piece.stream, piece.start + a, piece.start + b))
            start, k = base + b, k + 1
        if not out:
            return self.data.logit_rows(0, 0, 0)
        return torch.cat(out) if len(out) > 1 else out[0]


def local_logits(data: ScenarioData, layout: RankLayout) -> torch.Tensor:
    """The rank's logits in the layout's shape, its vocab columns only, as a fresh leaf."""
    rows = PieceRows(data, layout.pieces).rows(0, layout.num_rows)
    a, b = layout.columns
    return rows[:, a:b].contiguous().reshape(layout.shape)


def row_targets_and_weights(
    data: ScenarioData, layout: RankLayout
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per local row: the token it scores and its (w_logprob, w_entropy) in the global loss.

    Rows that score no response token get token 0 and weight 0.
    """
    n = layout.num_rows
    targets = torch.zeros(n, dtype=torch.int64)
    w_lp = torch.zeros(n, dtype=torch.float32)
    w_ent = torch.zeros(n, dtype=torch.float32)
    weights, tokens = {}, {}
    for row, (stream, pos) in enumerate(layout.row_positions()):
        j = layout.scored_token(stream, pos)
        if j is None:
            continue
        if stream not in weights:  # once per sample, not per row
            weights[stream], tokens[stream] = data.loss_weights(stream), data.tokens(stream)
        targets[row] = tokens[stream][pos + 1]
        w_lp[row] = weights[stream][0][j]
        w_ent[row] = weights[stream][1][j]
    return targets, w_lp, w_ent


def share_pieces(layout: RankLayout) -> list[Piece]:
    """The logit rows scoring the rank's share, as pieces (runs of consecutive tokens)."""
    pieces: list[Piece] = []
    for i, tokens in enumerate(layout.share):
        first = layout.scenario.samples[i].prompt - 1
        for j in tokens:
            row = first + j
            last = pieces[-1] if pieces else None
            if last is not None and last.stream == i and last.stop == row:
                pieces[-1] = Piece(i, last.start, row + 1)
            else:
                pieces.append(Piece(i, row, row + 1))
    return pieces


def share_targets(data: ScenarioData, layout: RankLayout) -> torch.Tensor:
    """The token each share row scores, concatenated over samples."""
    out = [data.tokens(i)[layout.scenario.samples[i].prompt + torch.tensor(js, dtype=torch.int64)]
           for i, js in enumerate(layout.share)]
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


def global_positions(layout: RankLayout) -> list[tuple[int, int]]:
    """(sample, response token) of every element of the rank's concatenated outputs."""
    return [(i, j) for i, js in enumerate(layout.share) for j in js]


def owed_layout(layout: RankLayout, loss_over: str) -> RankLayout:
    """The layout of what a rank owes: its share; under a "gathered" definition with CP every
    response token of every sample (the target's outputs gathered over CP); under "held" the
    tokens its own rows score, as the layout (the framework's, where it owns it) put them."""
    if loss_over not in ("gathered", "held") or layout.scenario.cp == 1:
        return layout
    import dataclasses

    if loss_over == "held":
        return dataclasses.replace(layout, share=tuple(tuple(tokens.tolist()) for _, tokens in local_held_rows(layout)))
    return dataclasses.replace(layout, share=tuple(tuple(range(s.response)) for s in layout.scenario.samples))


def share_weights(data: ScenarioData, layout: RankLayout) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sample, the loss weights of the rank's share tokens, in output order."""
    out = []
    for i, js in enumerate(layout.share):
        w_lp, w_ent = data.loss_weights(i)
        idx = torch.tensor(js, dtype=torch.int64)
        out.append((w_lp[idx], w_ent[idx]))
    return out


def share_truth(data: ScenarioData, layout: RankLayout, device: torch.device | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference (log-probs, entropy) of the rank's share, float64 on the CPU, concatenated
    over samples; computed on ``device`` (a GPU, in row chunks) when one is given."""
    rows = PieceRows(data, share_pieces(layout))
    lp, ent = logprob_entropy(rows, share_targets(data, layout), temperature=layout.scenario.temperature,
                              device=device, keep=rows.keep())
    return lp.cpu(), ent.cpu()


def policy_batch(data: ScenarioData, layout: RankLayout) -> PolicyBatch:
    """A policy loss's extra inputs for the rank: advantages and old log-probs of its share (the
    truth, so the importance ratio is 1), and whole-response loss masks."""
    truth, _ = share_truth(data, layout)
    old = truth.float().split([len(js) for js in layout.share])
    advantages = [data.advantages(i)[torch.tensor(js, dtype=torch.int64)] for i, js in enumerate(layout.share)]
    masks = [data.loss_mask(i) for i in range(len(layout.share))]
    return PolicyBatch(advantages=advantages, old_log_probs=list(old), loss_masks=masks)
