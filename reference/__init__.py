"""The float64 single-device reference (the truth every target is compared with)."""

from shardcheck.reference.truth import (
    DEFAULT_CHUNK_ROWS,
    Keep,
    Rows,
    TensorRows,
    as_rows,
    logprob_entropy,
    loss_grad_chunks,
    response_rows,
)

__all__ = [
    "DEFAULT_CHUNK_ROWS",
    "Keep",
    "Rows",
    "TensorRows",
    "as_rows",
    "logprob_entropy",
    "loss_grad_chunks",
    "response_rows",
]
