"""The harness: layouts and shards, the world of ranks, comparison, verdicts and reports.

Read the data path straight through: scenario -> :mod:`layout` -> :mod:`shard` -> target ->
outputs -> :mod:`compare` (reference) -> :mod:`verdict` -> :mod:`report`. :mod:`world` (the
controller) and :mod:`rank` (the rank processes) talk through :mod:`protocol`.
"""
