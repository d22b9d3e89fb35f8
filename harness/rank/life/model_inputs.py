"""What the model is handed besides the tokens, checked against the layout the trace learned.

A framework's data path also gives the model each row's position id and the packed stream's
sequence boundaries (``cu_seqlens``, megatron's ``PackedSeqParams``). Rotary embeddings read
the first; attention reads the second. A data path that hands them on says what it built
(``DataPath.model_inputs``, optional), and this module checks it against the rows the position
trace decoded (:mod:`shardcheck.scenarios.traced_layout`). These rules hold whatever the framework:

- every row of a real sample holds its true position as its position id (under zigzag CP, the
  positions of the rank's two chunks, in that order); padding rows may hold anything;
- ``cu_seqlens`` starts at 0 and rises at every entry: no sequence has zero length;
- it holds a sequence for every sample, each at least as long as the sample; on one CP rank
  (cp 1, packed) each sample starts at the row the layout puts it at.

A wrong one is a ``layout_mismatch`` naming the row or the sequence.
"""

from __future__ import annotations

from typing import Any

import torch

from shardcheck.harness.wire import LAYOUT_MISMATCH, Failure
from shardcheck.scenarios.layout import RankLayout

MAX_LISTED = 5


def check_model_inputs(layout: RankLayout, given: dict[str, Any], rank: int) -> list[Failure]:
    """The failures of what a data path handed the model (``given``: "position_ids" and / or
    "cu_seqlens", each optional) against the rank's ``layout``."""
    found = []
    if given.get("position_ids") is not None:
        found += _positions(layout, given["position_ids"], rank)
    if given.get("cu_seqlens") is not None:
        found += _boundaries(layout, given["cu_seqlens"], rank)
    return found


def _positions(layout: RankLayout, position_ids: torch.Tensor, rank: int) -> list[Failure]:
    got = position_ids.detach().reshape(-1).cpu().tolist()
    rows = layout.row_positions()
    who = layout.built_by
    if len(got) != len(rows):
        return [Failure(LAYOUT_MISMATCH, f"{who} handed the model {len(got)} position ids for {len(rows)} local rows",
                        [rank], field="position_ids")]
    samples = layout.scenario.samples
    wrong = [(r, stream, pos) for r, (stream, pos) in enumerate(rows)
             if stream < len(samples) and pos < samples[stream].total and got[r] != pos]
    if not wrong:
        return []
    listed = "; ".join(f"row {r} (sample {s} position {p}) holds {got[r]}" for r, s, p in wrong[:MAX_LISTED])
    more = f" (+{len(wrong) - MAX_LISTED} more rows)" if len(wrong) > MAX_LISTED else ""
    _, stream, pos = wrong[0]
    return [Failure(LAYOUT_MISMATCH, f"{who} handed the model position ids that are not the rows' positions: "
                    f"{listed}{more}", [rank], field="position_ids", sample=stream, position=pos)]


def _boundaries(layout: RankLayout, cu_seqlens: torch.Tensor, rank: int) -> list[Failure]:
    cu = [int(x) for x in cu_seqlens.detach().reshape(-1).cpu().tolist()]
    who = layout.built_by
    samples = layout.scenario.samples
    if not cu or cu[0] != 0:
        return [Failure(LAYOUT_MISMATCH, f"{who} handed the model cu_seqlens {_show(cu)}: it must start at 0", [rank],
                        field="cu_seqlens")]
    empty = [k for k in range(len(cu) - 1) if cu[k + 1] <= cu[k]]
    if empty:
        k = empty[0]
        return [Failure(LAYOUT_MISMATCH, f"{who} handed the model cu_seqlens {_show(cu)}: sequence {k} has "
                        f"{'zero' if cu[k + 1] == cu[k] else 'negative'} length ({cu[k]} to {cu[k + 1]})", [rank],
                        field="cu_seqlens", sample=k if k < len(samples) else None)]
    if len(cu) - 1 < len(samples):
        return [Failure(LAYOUT_MISMATCH, f"{who} handed the model cu_seqlens {_show(cu)}: {len(cu) - 1} sequences "
                        f"for {len(samples)} samples", [rank], field="cu_seqlens")]
    short = [i for i, s in enumerate(samples) if cu[i + 1] - cu[i] < s.total]
    if short:
        i = short[0]
        return [Failure(LAYOUT_MISMATCH, f"{who} handed the model cu_seqlens {_show(cu)}: sequence {i} holds "
                        f"{cu[i + 1] - cu[i]} positions, sample {i} has {samples[i].total}", [rank],
                        field="cu_seqlens", sample=i)]
    sc = layout.scenario
    if sc.cp == 1 and sc.layout == "thd":
        starts = _first_rows(layout)
        off = [i for i in range(len(samples)) if i in starts and starts[i] != cu[i]]
        if off:
            i = off[0]
            return [Failure(LAYOUT_MISMATCH, f"{who} handed the model cu_seqlens {_show(cu)}: sequence {i} starts at "
                            f"{cu[i]}, its rows at local row {starts[i]}", [rank], field="cu_seqlens", sample=i,
                            position=0)]
    return []


def _first_rows(layout: RankLayout) -> dict[int, int]:
    """The local row of each sample's position 0."""
    out: dict[int, int] = {}
    row = 0
    for p in layout.pieces:
        if p.start == 0 and p.stream not in out:
            out[p.stream] = row
        row += p.rows
    return out


def _show(cu: list[int]) -> str:
    return str(cu) if len(cu) <= 12 else f"[{', '.join(map(str, cu[:10]))}, ... {cu[-1]}] ({len(cu)} entries)"
