"""How much memory a scenario takes on a rank: the data path's figures, its local and share
pieces, the generated logits, the float64 reference's chunks and the target's own tensors.
Arithmetic on a scenario's fields only (no torch import; tests check the mirrored figures agree
with the modules that import torch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence

from shardcheck.scenarios.layout import allgather_pieces, ulysses_local_rows, zigzag_positions
from shardcheck.scenarios.scenario import Scenario

# The data path's own figures (mirrored: their modules import torch; tests check they agree).
BLOCK_ROWS = 64  # scenarios.data.BLOCK_ROWS: logit rows are generated 64 at a time, full vocab
CHUNK_ROWS = 256  # reference.DEFAULT_CHUNK_ROWS: the float64 reference's rows per chunk, at most
# (fewer past a vocabulary of 4096: reference.chunk_rows_for; the estimate stays the upper bound)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# float64 [chunk rows, vocab] tensors alive at once in the reference: the scaled logits, the
# log-softmax, the probabilities, the gradient and one temporary (p * s, or the comparison's).
REFERENCE_F64_COPIES = 5
# A target's own float32 [rows, vocab / tp] tensors at its peak, as the builtin's: s and p saved
# for the backward, the gradient and its temporaries. Measured: 6 with the entropy gradient
# (entropy_coef != 0), 4 without.
TARGET_F32_COPIES = {True: 6, False: 4}
# Python bookkeeping per local row (row_positions tuples, the per-row target and share maps):
# measured 374 bytes a row at vocab 8 with the tensors; 256 for the Python part.
ROW_PYTHON_BYTES = 256
MAX_CHUNKS_WALKED = 20_000  # past this many reference chunks, each is bounded instead of walked



Run = tuple[int, int, int]  # (stream, start, stop): consecutive rows of one stream, as layout.Piece


def local_pieces(sc: Scenario, cp_rank: int) -> list[Run]:
    """The logit rows a (tp, ``cp_rank``) rank holds, as ``rank_layout(sc, 0, cp_rank).pieces``
    would give them, without building the layout's share (O(tokens) for a long sample)."""
    samples = sc.samples
    if sc.layout == "thd":
        return [(i, 0, s.total) for i, s in enumerate(samples)]
    if sc.layout == "bshd":
        m = max(s.total for s in samples)
        return [(i, 0, m) for i in range(len(samples))]
    if sc.layout == "zigzag":
        return [(i, r.start, r.stop) for i, s in enumerate(samples) for r in zigzag_positions(s.total, sc.cp, cp_rank)]
    if sc.sp > 1:
        return [(p.stream, p.start, p.stop) for p in allgather_pieces(sc, cp_rank, ulysses_local_rows(sc))]
    return [(p.stream, p.start, p.stop) for p in allgather_pieces(sc, cp_rank)]


def share_pieces(sc: Scenario, cp_rank: int) -> list[Run]:
    """The rows scoring the rank's share of response tokens, merged into runs as
    ``shard.share_pieces`` merges them: the rows the values' reference generates."""
    out: list[Run] = []
    for i, s in enumerate(sc.samples):
        lo, hi = s.prompt - 1, s.total - 1
        ranges = [range(0, s.total)] if sc.cp == 1 else zigzag_positions(s.total, sc.cp, cp_rank)
        for r in ranges:
            a, b = max(lo, r.start), min(hi, r.stop)
            if a >= b:
                continue
            if out and out[-1][0] == i and out[-1][2] == a:
                out[-1] = (i, out[-1][1], b)
            else:
                out.append((i, a, b))
    return out


def _blocks(start: int, stop: int) -> int:
    return 0 if stop <= start else (stop - 1) // BLOCK_ROWS - start // BLOCK_ROWS + 1


def _rows(pieces: Iterable[Run]) -> int:
    return sum(b - a for _, a, b in pieces)


def generation_bytes(pieces: Sequence[Run], vocab: int, dsize: int) -> tuple[int, int]:
    """(peak, kept) bytes of generating ``pieces``' logit rows (``PieceRows.rows``): every row
    full vocab, in whole blocks of BLOCK_ROWS drawn as float32. Peak: the blocks so far, plus the
    block being drawn (float32 randn, and its scaled float32 copy when the dtype is narrower),
    or a piece's blocks concatenated; then the pieces concatenated. Kept: what the result holds
    (a view of its piece's blocks when there is one piece)."""
    blocks = [_blocks(a, b) for _, a, b in pieces]
    kept_blocks = sum(blocks) * BLOCK_ROWS * vocab * dsize
    drawing = BLOCK_ROWS * vocab * (4 if dsize == 4 else 8)
    concat = max((n * BLOCK_ROWS * vocab * dsize for n in blocks if n > 1), default=0)
    joined = _rows(pieces) * vocab * dsize if len(pieces) > 1 else 0
    return kept_blocks + max(drawing, concat) + joined, (joined if len(pieces) > 1 else kept_blocks)


def _chunks(pieces: Sequence[Run], size: int) -> Iterator[list[Run]]:
    """``pieces`` cut into consecutive runs of ``size`` rows (the reference's chunks)."""
    chunk: list[Run] = []
    room = size
    for stream, a, b in pieces:
        while a < b:
            take = min(room, b - a)
            chunk.append((stream, a, a + take))
            a, room = a + take, room - take
            if room == 0:
                yield chunk
                chunk, room = [], size
    if chunk:
        yield chunk


def reference_bytes(pieces: Sequence[Run], vocab: int, dsize: int) -> int:
    """Peak bytes of the float64 reference over ``pieces`` (``reference.truth``): chunk after
    chunk of CHUNK_ROWS rows, each generated (full vocab, see :func:`generation_bytes`) and then
    held while REFERENCE_F64_COPIES float64 [chunk, vocab] tensors are alive."""
    rows = _rows(pieces)
    if rows == 0:
        return 0
    if rows > CHUNK_ROWS * MAX_CHUNKS_WALKED:  # bound a chunk: every piece in it adds a block at each end
        shortest = max(1, min(b - a for _, a, b in pieces if b > a))
        k = min(len(pieces), CHUNK_ROWS // shortest + 2)  # the most pieces a chunk can touch
        gen_rows = min(CHUNK_ROWS + 2 * BLOCK_ROWS * k, sum(_blocks(a, b) for _, a, b in pieces) * BLOCK_ROWS)
        kept = gen_rows * vocab * dsize + (CHUNK_ROWS * vocab * dsize if k > 1 else 0)
        peak = kept + max(BLOCK_ROWS * vocab * 8, gen_rows * vocab * dsize)
        return max(peak, kept + REFERENCE_F64_COPIES * CHUNK_ROWS * vocab * 8)
    worst = 0
    for chunk in _chunks(pieces, CHUNK_ROWS):
        peak, kept = generation_bytes(chunk, vocab, dsize)
        worst = max(worst, peak, kept + REFERENCE_F64_COPIES * _rows(chunk) * vocab * 8)
    return worst


def rank_bytes(sc: Scenario, cp_rank: int = 0, *, reference: bool = True, outputs: bool = False) -> int:
    """Peak bytes one rank of ``sc`` (at ``cp_rank``) allocates for the scenario, by phase
    (``harness.rank.main.RankRunner._run``), the largest phase counted:

    - the local logits (``shard.local_logits``): rows generated full vocab, see
      :func:`generation_bytes`; then its vocab columns copied (tp > 1) or viewed (tp = 1: the
      generated rows, block padding included, stay as the leaf);
    - the target: the leaf, the copy handed to the target (R x V/tp, the dtype's size), and the
      target's own TARGET_F32_COPIES float32 R x V/tp tensors;
    - the comparison (``reference``): the leaf, the copy, the gradient and its float64 copy, and
      the reference's chunk (:func:`reference_bytes`) over the local rows (the gradient) or the
      share rows (the values), whichever is larger;
    - the outputs sent back (``outputs``, invariance): the gradient, its copy and the pickle;
    - plus ROW_PYTHON_BYTES a local row.

    Measured peaks (VmHWM minus the idle rank's VmRSS, builtin target, gloo) against this:
    vocab 2e6, one sample 10/5: 1.89 GiB (estimate 2.00 GiB); vocab 2e5, one sample 2000/1000:
    9.61 GiB (9.58), tp=2 5.85 (5.82), entropy_coef 0.1 11.98 (11.96), bfloat16 7.78 (7.47);
    100/50: 1.12 (1.23); 20 samples of 30/10: 4.35 (4.33); zigzag cp=2: 3.23 (3.59); vocab 5e6:
    4.64 (4.99). tests/test_limits.py keeps them (MEASURED) within -15 % / +25 %.
    """
    dsize = DTYPE_BYTES[sc.dtype]
    vocab, local_vocab = sc.vocab, sc.vocab // sc.tp
    pieces = local_pieces(sc, cp_rank)
    rows = _rows(pieces)
    generated, kept = generation_bytes(pieces, vocab, dsize)
    leaf = kept if sc.tp == 1 else rows * local_vocab * dsize
    local = rows * local_vocab
    held = leaf + local * dsize  # the leaf and the copy the target is given
    entropy_grad = sc.with_entropy and sc.entropy_coef != 0
    phases = [generated, held + TARGET_F32_COPIES[entropy_grad] * local * 4]
    if reference:
        values = reference_bytes(share_pieces(sc, cp_rank), vocab, dsize)
        grad = local * (dsize + 8) + reference_bytes(pieces, vocab, dsize)
        phases.append(held + max(values, grad))
    if outputs:
        phases.append(held + 3 * local * dsize)
    return max(phases) + ROW_PYTHON_BYTES * rows


def shape_key(scenario: Scenario) -> tuple:
    """Every field but those that cannot change what a rank allocates (its name, description and
    seed): scenarios with one key have one estimate."""
    return tuple(getattr(scenario, f) for f in _SHAPE_FIELDS)


def scenario_bytes(scenario: Scenario, *, reference: bool = True, outputs: bool = False) -> int:
    """Peak bytes a rank allocates for ``scenario``: the most over its CP ranks (TP ranks differ
    only in which columns they keep, data-parallel replicas repeat one of them). Why it is what
    it is: :func:`rank_bytes`. An estimate, within about 25 % of the measured peaks, mostly
    above; the target's own share is the builtin target's."""
    return max(rank_bytes(scenario, r, reference=reference, outputs=outputs) for r in range(scenario.seq))


_SHAPE_FIELDS = tuple(f.name for f in dataclasses.fields(Scenario) if f.name not in ("name", "description", "seed"))
