"""The single-device truth in float64: per-token log-prob, entropy, and the loss gradient.

Everything works in row chunks, so no ``[T, V]`` float64 tensor is ever held: peak memory grows
with ``chunk_rows * V``, not with ``T * V``. Inputs may be a tensor or a lazy :class:`Rows`
source (which generates rows on demand), on CPU or CUDA.

Definitions (as slime computes them, from the same temperature-scaled logits ``s = z / t``):
    logp(y) = log_softmax(s)[y]          entropy = -sum_v p_v log p_v,  p = softmax(s)
Loss family whose gradient is given:
    loss = sum(w_lp * logp) - entropy_coef * sum(w_ent * entropy)
    d loss / d z = (w_lp * (onehot(y) - p) + entropy_coef * w_ent * p * (s - sum_v p_v s_v)) / t

Processed log-probs (top-p / top-k replay, as slime's ``log_prob_keep_mask``): a row may carry a
keep set K, the tokens the rollout's sampler kept. Its log-prob is renormalised over K and the
target (always kept), its entropy stays over the whole vocabulary:
    logp(y) = s_y - log sum_{v in K + {y}} exp(s_v)     (q = that renormalised softmax)
    d logp / d z = (onehot(y) - q) / t        (the entropy's term is unchanged)
Rows without a keep set are unprocessed. An empty K leaves the target alone: logp = 0.

How: one exp an element, the values as the gradient. With d = s - max s, e = exp(d), S = sum e
and L = log S: logp(y) = d_y - L, and the entropy -sum p log p = L - sum e d / S (p = e / S).
(torch.log_softmax would give the log-probs within a few float64 ulps, at a second exp an
element for p.) Since s - sum p s = d - sum p d,
    d loss / d z = e * (alpha d - alpha sum_v p_v d_v - w_lp) / (S t) + w_lp onehot(y) / t,
alpha = entropy_coef * w_ent, computed only over the columns asked for (-w_lp q / t apart where a
row has a keep set).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

DEFAULT_CHUNK_ROWS = 256  # at most; fewer at a large vocabulary (chunk_rows_for)
CHUNK_BYTES = 4 * 2**20  # one float64 [rows, V] chunk: small enough that the allocator reuses it


def chunk_rows_for(vocab: int | None) -> int:
    """Rows per chunk by default: DEFAULT_CHUNK_ROWS, or as many as keep a float64 [rows, V]
    tensor within CHUNK_BYTES (at V = 151,936: 3 rows, 3.6 MB). A chunk the size of the heap's
    reusable blocks is not handed back to the kernel and faulted in again each time, which at a
    real vocabulary cost more than the arithmetic (and it bounds the peak: a handful of chunks).
    Measured at V = 151,936 (benchmarks/reference_real_vocab.py, one thread): 3 rows a chunk
    as fast as 1, 6 rows 5-50% slower (the chunk's tensors then fill the shared cache)."""
    if not vocab:
        return DEFAULT_CHUNK_ROWS
    return max(1, min(DEFAULT_CHUNK_ROWS, CHUNK_BYTES // (8 * vocab)))


@runtime_checkable
class Rows(Protocol):
    """A lazily materialised ``[num_rows, vocab]`` matrix."""

    num_rows: int

    def rows(self, start: int, stop: int) -> torch.Tensor: ...


class TensorRows:
    """A :class:`Rows` view of an in-memory ``[T, V]`` tensor."""

    def __init__(self, logits: torch.Tensor) -> None:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [T, V], got shape {tuple(logits.shape)}")
        self.logits = logits
        self.num_rows = logits.size(0)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return self.logits[start:stop]


def as_rows(logits: torch.Tensor | Rows) -> Rows:
    return TensorRows(logits) if isinstance(logits, torch.Tensor) else logits


class _Buffers:
    """The two float64 [chunk, V] work tensors of one call, allocated once and reused chunk after
    chunk: at a real vocabulary, allocating (and faulting in) fresh ones for every chunk cost
    more than the arithmetic, and let the heap grow with fragments."""

    def __init__(self) -> None:
        self.pair: tuple[torch.Tensor, torch.Tensor] | None = None

    def take(self, rows: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.pair[0] if self.pair is not None else None
        if a is None or a.shape[0] < rows or a.shape[1] != vocab or a.device != device:
            self.pair = a = None  # the old pair goes before the new one is made
            self.pair = tuple(torch.empty(rows, vocab, dtype=torch.float64, device=device) for _ in range(2))
        return self.pair[0][:rows], self.pair[1][:rows]


def _row_dots(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_v a_v b_v of each row, float64 [rows]: one BLAS dot a row where the rows are few and
    long (at V = 151,936 the batched forms took 2-5x longer: einsum's bmm, vecdot's product
    tensor), ``vecdot`` for many short ones."""
    if a.shape[0] > 16:
        return torch.linalg.vecdot(a, b)
    return torch.stack([torch.dot(x, y) for x, y in zip(a, b)])


def _scaled(z: torch.Tensor, temperature: float, out: torch.Tensor) -> torch.Tensor:
    """s = z / t, float64, into ``out`` (the upcast is exact, the division rounds once)."""
    out.copy_(z)
    if temperature != 1.0:
        out.div_(temperature)
    return out


def _shifted_exp(z: torch.Tensor, temperature: float, buffers: _Buffers,
                 device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One exp an element, for the values and the gradient alike: d = s - max s and e = exp(d)
    (in the chunk's two work buffers; every e in (0, 1]), and S = sum e [rows, 1] (>= 1)."""
    d, e = buffers.take(z.shape[0], z.shape[-1], device or z.device)
    _scaled(z, temperature, d)
    d.sub_(d.amax(dim=-1, keepdim=True))
    torch.exp(d, out=e)
    return d, e, e.sum(dim=-1, keepdim=True)


Keep = Mapping[int, Sequence[int]]  # row -> the token ids its sampler kept (rows absent: all)


def _check(source: Rows, targets: torch.Tensor, chunk_rows: int, keep: Keep | None = None,
           vocab: int | None = None) -> None:
    if targets.dim() != 1 or targets.numel() != source.num_rows:
        raise ValueError(f"targets must be [{source.num_rows}], got shape {tuple(targets.shape)}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    for row, ids in (keep or {}).items():
        if not 0 <= row < source.num_rows:
            raise ValueError(f"keep set for row {row}, outside the {source.num_rows} rows")
        bad = [i for i in ids if vocab is not None and not 0 <= i < vocab]
        if bad:
            raise ValueError(f"keep set of row {row} names token {bad[0]}, outside the vocabulary of {vocab}")


def _keep_mask(keep: Keep | None, start: int, stop: int, targets: torch.Tensor, vocab: int,
               device: torch.device) -> torch.Tensor | None:
    """[stop - start, vocab] bool: what each row's log-prob is normalised over (None: every
    row of the chunk over the whole vocabulary)."""
    rows = [r for r in range(start, stop) if r in (keep or {})]
    if not rows:
        return None
    mask = torch.ones(stop - start, vocab, dtype=torch.bool, device=device)
    for r in rows:
        mask[r - start] = False
        ids = list(keep[r]) + [int(targets[r])]  # the target is always kept
        mask[r - start, torch.tensor(ids, dtype=torch.long, device=device)] = True
    return mask


def _vocab(source: Rows) -> int | None:
    return source.rows(0, 1).shape[-1] if source.num_rows else None


def logprob_entropy(
    logits: torch.Tensor | Rows,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_rows: int | None = None,
    device: torch.device | str | None = None,
    keep: Keep | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row log-prob of ``targets`` and entropy, float64 ``[T]`` each (on ``device``); a row
    in ``keep`` has its log-prob renormalised over its keep set and target. ``chunk_rows``:
    default :func:`chunk_rows_for` the vocabulary."""
    source = as_rows(logits)
    vocab = _vocab(source) if keep or chunk_rows is None else None  # a lazy source makes a row to tell
    chunk_rows = chunk_rows if chunk_rows is not None else chunk_rows_for(vocab)
    _check(source, targets, chunk_rows, keep, vocab if keep else None)
    device = torch.device(device) if device is not None else None
    # the results are written into tensors made up front: small tensors kept one per chunk would
    # pin pieces of the freed chunks and fragment the heap (at V = 151,936, T = 32,768: 17.7 GiB)
    logps = torch.empty(source.num_rows, dtype=torch.float64, device=device)
    entropies = torch.empty(source.num_rows, dtype=torch.float64, device=device)
    buffers = _Buffers()
    for start in range(0, source.num_rows, chunk_rows):
        stop = min(start + chunk_rows, source.num_rows)
        z = source.rows(start, stop)
        d, e, total = _shifted_exp(z, temperature, buffers, device)
        big_s = total.squeeze(1)
        log_s = torch.log(big_s)
        y = targets[start:stop].to(d.device).unsqueeze(1)
        if logps.device != d.device:  # device None: wherever the logits are
            logps, entropies = logps.to(d.device), entropies.to(d.device)
        mask = _keep_mask(keep, start, stop, targets, d.shape[-1], d.device)
        if mask is None:
            logps[start:stop] = d.gather(1, y).squeeze(1) - log_s
        else:  # over each row's keep set where it has one
            logps[start:stop] = torch.log_softmax(d.masked_fill(~mask, float("-inf")), dim=-1).gather(1, y).squeeze(1)
        del mask
        # exp underflow gives e = 0 exactly with d finite: 0 * log 0 = 0. A dot product a row,
        # no [chunk, V] temporary.
        entropies[start:stop] = log_s - _row_dots(e, d) / big_s
    return logps, entropies


def loss_grad_chunks(
    logits: torch.Tensor | Rows,
    targets: torch.Tensor,
    w_logprob: torch.Tensor,
    w_entropy: torch.Tensor | None,
    *,
    entropy_coef: float = 0.0,
    temperature: float = 1.0,
    chunk_rows: int | None = None,
    columns: slice | None = None,
    device: torch.device | str | None = None,
    keep: Keep | None = None,
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield ``(first_row, grad)`` chunks of d loss / d logits, float64 ``[n, len(columns)]``.

    ``w_logprob[i]`` / ``w_entropy[i]`` weight row i's log-prob / entropy in the loss; a row that
    is not scored has weight 0. ``w_entropy=None`` means no entropy term at all. ``keep``: the
    rows whose log-prob is processed (see the module's docstring). Arguments are checked at the
    call, not at the first ``next()``. ``chunk_rows``: default :func:`chunk_rows_for` the vocabulary.
    """
    source = as_rows(logits)
    vocab = _vocab(source) if keep or chunk_rows is None else None  # a lazy source makes a row to tell
    chunk_rows = chunk_rows if chunk_rows is not None else chunk_rows_for(vocab)
    _check(source, targets, chunk_rows, keep, vocab if keep else None)
    return _grad_chunks(source, targets, w_logprob, w_entropy, entropy_coef, temperature, chunk_rows,
                        columns if columns is not None else slice(None),
                        torch.device(device) if device is not None else None, keep)


def _grad_chunks(
    source: Rows, targets: torch.Tensor, w_logprob: torch.Tensor, w_entropy: torch.Tensor | None,
    entropy_coef: float, temperature: float, chunk_rows: int, columns: slice, device: torch.device | None,
    keep: Keep | None = None,
) -> Iterator[tuple[int, torch.Tensor]]:
    buffers = _Buffers()
    for start in range(0, source.num_rows, chunk_rows):
        stop = min(start + chunk_rows, source.num_rows)
        z = source.rows(start, stop)
        vocab = z.shape[-1]
        d, e, total = _shifted_exp(z, temperature, buffers, device)  # s - sum p s = d - sum p d
        scale = total * temperature  # p / t = e / scale
        w_lp = w_logprob[start:stop].to(device=d.device, dtype=torch.float64).unsqueeze(1)
        mask = _keep_mask(keep, start, stop, targets, vocab, d.device)
        # the log-prob's softmax where it is not p: over each row's keep set (before d changes)
        q = None if mask is None else torch.softmax(d.masked_fill(~mask, float("-inf")), dim=-1)
        del mask
        b = -w_lp if q is None else torch.zeros_like(w_lp)  # -w_lp p, when q is p
        lo, hi, step = columns.indices(vocab)
        cols = slice(lo, hi) if step == 1 else slice(None)  # a stepped slice: whole, then sliced
        dc, ec = d[:, cols], e[:, cols]
        if w_entropy is not None and entropy_coef != 0:
            alpha = entropy_coef * w_entropy[start:stop].to(device=d.device, dtype=torch.float64).unsqueeze(1)
            mean = _row_dots(e, d).unsqueeze(1) / total  # sum_v p_v d_v
            # (alpha p (d - mean) - w_lp p) / t = e * (alpha d + b - alpha mean) / (S t): addcmul
            # rounds an element alike wherever the columns start (the tests' column slices check it)
            grad = torch.addcmul((b - alpha * mean) / scale, dc, alpha / scale).mul_(ec)
        else:
            grad = torch.mul(ec, b / scale)
        del d, e, dc, ec  # buffers, overwritten by the next chunk; only the gradient is the caller's
        if q is not None:
            grad.addcmul_(q[:, cols], w_lp / temperature, value=-1)
            del q
        if grad.shape[1]:  # + w_lp onehot(y) / t, where y is among the columns
            y = targets[start:stop].to(grad.device).unsqueeze(1) - (lo if step == 1 else 0)
            inside = (y >= 0) & (y < grad.shape[1])
            grad.scatter_add_(1, y.clamp(0, grad.shape[1] - 1), torch.where(inside, w_lp / temperature, 0.0))
        yield start, grad if step == 1 else grad[:, columns]
        del grad


def response_rows(total: int, response: int) -> slice:
    """Rows of a sample's logits that score its response: row p predicts token p + 1."""
    prompt = total - response
    return slice(prompt - 1, total - 1)
