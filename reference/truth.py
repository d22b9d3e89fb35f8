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
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

DEFAULT_CHUNK_ROWS = 256


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


def _chunk_stats(
    z: torch.Tensor, temperature: float, device: torch.device | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(s, log p, p, entropy) of one chunk, float64."""
    s = z.to(device=device or z.device, dtype=torch.float64) / temperature
    logp_all = torch.log_softmax(s, dim=-1)
    p = logp_all.exp()
    # -sum p log p, with 0 * log 0 = 0 (exp underflow gives p = 0 exactly, log p finite)
    entropy = -(p * logp_all).sum(dim=-1)
    return s, logp_all, p, entropy


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
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    device: torch.device | str | None = None,
    keep: Keep | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row log-prob of ``targets`` and entropy, float64 ``[T]`` each (on ``device``); a row
    in ``keep`` has its log-prob renormalised over its keep set and target."""
    source = as_rows(logits)
    _check(source, targets, chunk_rows, keep, _vocab(source) if keep else None)
    device = torch.device(device) if device is not None else None
    logps, entropies = [], []
    for start in range(0, source.num_rows, chunk_rows):
        stop = min(start + chunk_rows, source.num_rows)
        s, logp_all, _, entropy = _chunk_stats(source.rows(start, stop), temperature, device)
        mask = _keep_mask(keep, start, stop, targets, s.shape[-1], s.device)
        if mask is not None:
            logp_all = torch.log_softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
        del s
        y = targets[start:stop].to(logp_all.device).unsqueeze(1)
        logps.append(logp_all.gather(1, y).squeeze(1))
        entropies.append(entropy)
    if not logps:
        empty = torch.empty(0, dtype=torch.float64, device=device)
        return empty, empty.clone()
    return torch.cat(logps), torch.cat(entropies)


def loss_grad_chunks(
    logits: torch.Tensor | Rows,
    targets: torch.Tensor,
    w_logprob: torch.Tensor,
    w_entropy: torch.Tensor | None,
    *,
    entropy_coef: float = 0.0,
    temperature: float = 1.0,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    columns: slice | None = None,
    device: torch.device | str | None = None,
    keep: Keep | None = None,
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield ``(first_row, grad)`` chunks of d loss / d logits, float64 ``[n, len(columns)]``.

    ``w_logprob[i]`` / ``w_entropy[i]`` weight row i's log-prob / entropy in the loss; a row that
    is not scored has weight 0. ``w_entropy=None`` means no entropy term at all. ``keep``: the
    rows whose log-prob is processed (see the module's docstring). Arguments are checked at the
    call, not at the first ``next()``.
    """
    source = as_rows(logits)
    _check(source, targets, chunk_rows, keep, _vocab(source) if keep else None)
    return _grad_chunks(source, targets, w_logprob, w_entropy, entropy_coef, temperature, chunk_rows,
                        columns if columns is not None else slice(None),
                        torch.device(device) if device is not None else None, keep)


def _grad_chunks(
    source: Rows, targets: torch.Tensor, w_logprob: torch.Tensor, w_entropy: torch.Tensor | None,
    entropy_coef: float, temperature: float, chunk_rows: int, columns: slice, device: torch.device | None,
    keep: Keep | None = None,
) -> Iterator[tuple[int, torch.Tensor]]:
    for start in range(0, source.num_rows, chunk_rows):
        stop = min(start + chunk_rows, source.num_rows)
        s, _, p, _ = _chunk_stats(source.rows(start, stop), temperature, device)
        w_lp = w_logprob[start:stop].to(device=s.device, dtype=torch.float64).unsqueeze(1)
        mask = _keep_mask(keep, start, stop, targets, s.shape[-1], s.device)
        # the log-prob's softmax: over each row's keep set where it has one
        q = p if mask is None else torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
        grad = -w_lp * q
        del q, mask
        grad.scatter_add_(1, targets[start:stop].to(s.device).unsqueeze(1), w_lp)
        if w_entropy is not None and entropy_coef != 0:
            w_ent = w_entropy[start:stop].to(device=s.device, dtype=torch.float64).unsqueeze(1)
            s -= (p * s).sum(dim=-1, keepdim=True)  # s - sum_v p_v s_v, in place
            grad.addcmul_(p * s, entropy_coef * w_ent)
        del s, p  # only the yielded chunk stays alive while the caller looks at it
        grad /= temperature
        yield start, grad[:, columns]
        del grad


def response_rows(total: int, response: int) -> slice:
    """Rows of a sample's logits that score its response: row p predicts token p + 1."""
    prompt = total - response
    return slice(prompt - 1, total - 1)
