"""Hypothesis strategies for writing your own property tests against a target.

    from hypothesis import given, settings
    from shardcheck.strategies import scenarios

The strategies live in :mod:`shardcheck.scenarios.strategies`; this is the short public name.
"""

from shardcheck.scenarios.strategies import (
    boundary_positions,
    chunk_sizes,
    coarsen_chunk_size,
    entropy_settings,
    layout_fits,
    layouts,
    lengths,
    samples,
    scenarios,
    temperatures,
    vocabs,
)

__all__ = [
    "boundary_positions",
    "chunk_sizes",
    "coarsen_chunk_size",
    "entropy_settings",
    "layout_fits",
    "layouts",
    "lengths",
    "samples",
    "scenarios",
    "temperatures",
    "vocabs",
]
