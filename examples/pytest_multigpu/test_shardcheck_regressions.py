"""shardcheck in a framework's own test suite: one test case per scenario of a suite.

    pytest -m multigpu examples/pytest_multigpu                       # shardcheck starts 4 ranks
    torchrun --nproc-per-node 4 -m pytest -m multigpu examples/pytest_multigpu   # every rank runs pytest
    pytest -n 2 examples/pytest_multigpu                              # with pytest-xdist

The target is ``--shardcheck-target SPEC`` (default: builtin); ``--junitxml`` gives one testcase
per scenario with the failure kind in its message.
"""

import pytest

from shardcheck.pytest_plugin import parametrize_suite

pytestmark = pytest.mark.multigpu


@parametrize_suite("regressions")
def test_regressions(shardcheck, scenario):
    shardcheck.check(scenario)
