"""The harness, in two sides that share one wire.

- :mod:`rank` runs in the rank processes: groups, shards, the target, comparison, the collective
  trace and the lockstep check.
- :mod:`controller` drives a world of them: world, runner, verdicts, reports, fuzz, invariance,
  bisect.
- :mod:`wire` is the only thing both import to talk: messages, :class:`wire.RankResult`,
  :class:`wire.Failure`. :mod:`layout` (the sharding arithmetic) and :mod:`backend` (the
  backend and device decisions) are pure functions both sides use.

Read the data path straight through: scenario -> :mod:`layout` -> :mod:`rank.shard` -> target ->
outputs -> :mod:`rank.compare` -> :mod:`wire` -> :mod:`controller.verdict` -> :mod:`controller.report`.
"""
