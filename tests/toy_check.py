"""A check of a new kind, in a module of its own, as a plugin would write one:
``positive_log_prob``, a log-prob above 0 (a probability above 1). tests/test_check_pipeline.py
registers it through SHARDCHECK_CHECKS; nothing else in the harness names it.

Also here: the target it catches, builtin with every log-prob of sample 0 raised by 100."""

from __future__ import annotations

from shardcheck.harness.rank.pipeline import Check, Life
from shardcheck.harness.wire import Failure
from shardcheck.targets.base import RankInputs, RankOutputs
from shardcheck.targets.builtin import BuiltinTarget

KIND = "positive_log_prob"


class PositiveLogProb(Check):
    kind = KIND

    def after_forward(self, life: Life) -> None:
        for i, lp in enumerate(life.outputs.log_probs):
            above = (lp.detach() > 0).nonzero().flatten().tolist()
            if above:
                life.found.append(Failure(self.kind, f"log_probs of sample {i}: {len(above)} above 0, the first "
                                                     f"{lp[above[0]].item():.4g}", [life.rank], field="log_probs",
                                          sample=i))


class RaisedLogProbs(BuiltinTarget):
    """builtin with sample 0's log-probs raised by 100"""

    name = "toy:RaisedLogProbs"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        out = super().compute(inputs)
        out.log_probs[0] = out.log_probs[0] + 100.0
        return out


class BrokenCheck(Check):
    """A plugin's check with a bug of its own: its hook raises on every scenario."""

    kind = "broken"

    def after_forward(self, life: Life) -> None:
        raise KeyError("a field this check expected")
