"""The rank side: what runs in each rank process, scenario after scenario.

:mod:`main` (the process loop and the runner) -> :mod:`groups` (megatron's process groups) ->
:mod:`shard` (the rank's inputs, from the layout) -> the target -> :mod:`loss` (the gradient fed
into its outputs) -> :mod:`compare` (against the reference) and :mod:`inplace` (its inputs
unchanged), with :mod:`trace` and :mod:`lockstep` watching every collective. Nothing here
imports the controller side; results leave through :mod:`shardcheck.harness.wire`.
"""
