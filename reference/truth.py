"""The single-device truth in float64: per-token log-prob, entropy, and the loss gradient.

Everything works in row chunks, so no ``[T, V]`` float64 tensor is ever held: peak memory grows
with ``chunk_rows * V``, not with ``T * V``. Inputs may be a tensor or a lazy :class:`Rows`
source (which generates rows on demand), on CPU or CUDA.

Definitions (as slime computes them, from the same temperature-scaled logits ``s = z / t``):
    logp(y) = log_softmax(s)[y]          entropy = -sum_v p_v log p_v,  p = softmax(s)
Loss family whose gradient is given:
    loss = sum(w_lp * logp) - entropy_coef * sum(w_ent * entropy)
    d loss / d z = (w_lp * (onehot(y) - p) + entropy_coef * w_ent * p * (s - sum_v p_v s_v)) / t
"""

from __future__ import annotations

from collections.abc import Iterator
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


def _check(source: Rows, targets: torch.Tensor, chunk_rows: int) -> None:
    if targets.dim() != 1 or targets.numel() != source.num_rows:
        raise ValueError(f"targets must be [{source.num_rows}], got shape {tuple(targets.shape)}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")


def logprob_entropy(
    logits: torch.Tensor | Rows,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row log-prob of ``targets`` and entropy, float64 ``[T]`` each (on ``device``)."""
    source = as_rows(logits)
    _check(source, targets, chunk_rows)
    device = torch.device(device) if device is not None else None
    logps, entropies = [], []
    for start in range(0, source.num_rows, chunk_rows):
        stop = min(start + chunk_rows, source.num_rows)
        _, logp_all, _, entropy = _chunk_stats(source.rows(start, stop), temperature, device)
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
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield ``(first_row, grad)`` chunks of d loss / d logits, float64 ``[n, len(columns)]``.

    ``w_logprob[i]`` / ``w_entropy[i]`` weight row i's log-prob / entropy in the loss; a row that
    is not scored has weight 0. ``w_entropy=None`` means no entropy term at all. Arguments are
    checked at the call, not at the first ``next()``.
    """
    source = as_rows(logits)
    _check(source, targets, chunk_rows)
    return _grad_chunks(source, targets, w_logprob, w_entropy, entropy_coef, temperature, chunk_rows,
                        columns if columns is not None else slice(None),
                        torch.device(device) if device is not None else None)


def _grad_chunks(
    source: Rows, targets: torch.Tensor, w_logprob: torch.Tensor, w_entropy: torch.Tensor | None,
    entropy_coef: float, temperature: float, chunk_rows: int, columns: slice, device: torch.device | None,
) -> Iterator[tuple[int, torch.Tensor]]:
    for start in range(0, source.num_rows, chunk_rows):
        stop = min(start + chunk_rows, source.num_rows)
        s, _, p, _ = _chunk_stats(source.rows(start, stop), temperature, device)
        w_lp = w_logprob[start:stop].to(device=s.device, dtype=torch.float64).unsqueeze(1)
        grad = -w_lp * p
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
