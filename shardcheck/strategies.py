"""Hypothesis strategies for writing your own property tests against a target.

    from hypothesis import given, settings
    from shardcheck.strategies import scenarios

The strategies live in :mod:`shardcheck.scenarios.strategies`; this is the short public name.
"""

from shardcheck.scenarios.strategies import *  # noqa: F401,F403  (the names its __all__ lists)
from shardcheck.scenarios.strategies import __all__  # noqa: F401
