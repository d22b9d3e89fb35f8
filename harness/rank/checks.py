"""The checks a rank runs on every scenario, in the order they are called at each point of its
life (see :mod:`shardcheck.harness.rank.pipeline`): the one place they are listed. A plugin or a
test adds its own through ``SHARDCHECK_CHECKS``."""

from __future__ import annotations

from shardcheck.harness.rank.compare import ReferenceComparison
from shardcheck.harness.rank.form import OutputForm
from shardcheck.harness.rank.inplace import InputsUnchanged
from shardcheck.harness.rank.lockstep import CollectiveTrace
from shardcheck.harness.rank.outputs import OutputCapture
from shardcheck.harness.rank.pipeline import Check

# CollectiveTrace first: it frames the scenario (every collective from its begin on is traced);
# InputsUnchanged next: a write into the inputs is seen before anything reads them again;
# OutputForm before the comparison: it ends the life where the outputs cannot be read
CHECKS: tuple[type[Check], ...] = (CollectiveTrace, InputsUnchanged, OutputForm, ReferenceComparison, OutputCapture)
