"""input_mutated: the inputs a target is given (and the gradients fed into its outputs) stay as
they were; the first in-place write is named by its call site."""

import inspect

import pytest
import torch

from shardcheck.harness.controller.commands import runner
from shardcheck.harness.rank.checks.inplace import InputGuard, _changed
from shardcheck.harness.controller.reports.run_report import SilentReport
from shardcheck.scenarios import Sample, Scenario, get_suite
from shardcheck.targets import mutants


def _line_of(obj, text: str) -> str:
    """``file.py:LINE`` of the first line of ``obj``'s source holding ``text``."""
    lines, first = inspect.getsourcelines(obj)
    k = next(i for i, ln in enumerate(lines) if text in ln)
    return f"{inspect.getsourcefile(obj).rsplit('/', 1)[-1]}:{first + k}"


def _failures(result, kind="input_mutated"):
    return [f for v in result.verdicts for f in v.failures if f.kind == kind]


# -- the comparison and the write watch, without a world -------------------------------------------
def test_changed_is_bit_for_bit():
    a = torch.tensor([0.0, float("nan"), 1.0, 2.0])
    assert _changed(a.clone(), a) is None  # NaN equals itself
    b = a.clone()
    b[0] = -0.0  # equal as numbers, not as bits
    b[3] = 2.5
    assert _changed(b, a).tolist() == [0, 3]
    assert _changed(torch.tensor([1, 2]), torch.tensor([1, 3])).tolist() == [1]


def _here(offset: int) -> str:
    frame = inspect.currentframe().f_back
    return f"test_inplace.py:{frame.f_lineno + offset}"


def test_the_watch_names_the_first_write_and_its_phase():
    x = torch.randn(3, 4)
    y = torch.randn(3)
    guard = InputGuard(rank=0)
    guard.watch("logits", x, None, lambda k: ({"position": k}, f"element {k}"))
    guard.watch("other", y, None, lambda k: ({"position": k}, f"element {k}"))
    with guard.writes_watch():
        torch.exp(x[1], out=x[1])  # a view's out= write lands in the watched storage
        site = _here(-1)
        x.add_(1.0)  # a second write: the first is the one named
    [f] = guard.check("forward")
    assert f.field == "logits" and f.phase == "forward" and f.details["changed"] == 12
    assert f.details["op"] == "aten.exp.out" and f.details["site"][0].endswith(site), f.details
    assert "first in-place write that changed it: aten.exp.out at" in f.message
    assert guard.check("backward") == []  # reported once, in the first phase it is seen after


def test_writes_that_change_nothing_are_counted_and_the_one_that_changed_it_is_named():
    """A div_ by a temperature of 1.0 is a write into the logits, not a change of them: the write
    named is the first that changed a bit (issue 23, item 5)."""
    x = torch.randn(3, 4)
    guard = InputGuard(rank=0)
    guard.watch("logits", x, None, lambda k: ({"position": k}, f"element {k}"))
    with guard.writes_watch():
        x.div_(1.0)
        first_noop = _here(-1)
        x.mul_(1.0)
        second_noop = _here(-1)
        x.view(-1)[:1].copy_(torch.nextafter(x.view(-1)[:1], torch.tensor(float("inf"))))
        change = _here(-1)
        x.add_(1.0)  # after the change: not followed further
    [f] = guard.check("forward")
    assert f.details["op"] == "aten.copy_.default" and f.details["site"][0].endswith(change), f.details
    assert f.details["unchanged_writes"] == 2 and f.details["changed"] == 12
    assert ("first in-place write that changed it: aten.copy_.default at" in f.message
            and "2 earlier in-place writes left it unchanged: aten.div_." in f.message), f.message
    assert first_noop in f.message and second_noop in f.message and "aten.add_" not in f.message


def test_a_one_ulp_change_reads_as_two_values_and_its_ulps():
    import numpy as np

    x = torch.full((2, 2), -0.79949)
    guard = InputGuard(rank=0)
    guard.watch("logits", x, None, lambda k: ({"position": k}, f"element {k}"))
    with guard.writes_watch():
        x.view(-1)[:1].copy_(torch.nextafter(x.view(-1)[:1], torch.tensor(float("inf"))))
    [f] = guard.check("forward")
    was = float(np.float32(-0.79949))
    now = float(np.nextafter(np.float32(was), np.float32(np.inf)))
    assert (f.want, f.got) == (was, now)
    shown = f.message.split("(was ", 1)[1].split(" (1 ulp of float32))", 1)[0]
    shown_was, shown_now = shown.split(", now ")
    assert shown_was != shown_now, f.message
    # each reads back as its own float32: the digits shown tell them apart
    assert np.float32(float(shown_was)) == np.float32(was) and np.float32(float(shown_now)) == np.float32(now)


def test_a_change_no_watched_write_made_says_so():
    """numpy writes through the tensor's memory, under the dispatcher: the watch sees no write
    that changed it, and says that rather than naming the harmless one it saw."""
    x = torch.zeros(4)
    guard = InputGuard(rank=0)
    guard.watch("logits", x, None, lambda k: ({"position": k}, f"element {k}"))
    with guard.writes_watch():
        x.div_(1.0)
        x.numpy()[2] = 5.0
    [f] = guard.check("forward")
    assert "no in-place write that the watch saw changed it; 1 in-place write left it unchanged: aten.div_" in f.message
    assert "op" not in f.details and f.details["unchanged_writes"] == 1


def test_a_write_in_backward_is_named_in_backward():
    class ScalesIncoming(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            grad.mul_(3.0)
            return grad

    leaf = torch.randn(4, requires_grad=True)
    out = ScalesIncoming.apply(leaf)
    fed = torch.ones(4)
    guard = InputGuard(rank=0)
    guard.watch("grad of log_probs", fed, None, lambda k: ({"token": k}, f"token {k}"))
    with guard.writes_watch():
        torch.autograd.backward([out], [fed])
    [f] = guard.check("backward")
    assert f.phase == "backward" and f.details["write_phase"] == "backward" and f.details["op"] == "aten.mul_.Tensor"
    assert f.got == 3.0 and f.want == 1.0


# -- on a world ------------------------------------------------------------------------------------


@pytest.mark.world
def test_megatron_cross_entropy_writes_into_its_logits_in_forward(world):
    """megatron-core 0.16's vocab_parallel_cross_entropy subtracts the max and exponentiates in the
    caller's float32 logits (Megatron-LM issue 1594): `run --target megatron --suite logprob`, here
    one scenario of each layout megatron runs at temperature 1 and one at another temperature
    (every failing scenario is run again to name the write: the whole suite took 6 s)."""
    runs = [sc for sc in get_suite("logprob") if sc.layout != "allgather"]
    chosen = [next(sc for sc in runs if sc.layout == layout and sc.temperature == 1.0)
              for layout in ("thd", "bshd", "zigzag")] + [next(sc for sc in runs if sc.temperature != 1.0)]
    result = runner.run(chosen, "megatron", reporter=SilentReport(), world=world)
    assert result.exit_code == 1
    found = _failures(result)
    assert found and {f.kind for v in result.verdicts for f in v.failures} == {"input_mutated"}
    for f in found:
        assert f.phase == "forward" and f.field == "logits" and f.details["op"] == "aten.sub_.Tensor"
        assert f.details["site"][0].startswith("megatron/core/tensor_parallel/cross_entropy.py:"), f.details
        assert f.details["changed"] == f.details["elements"]
    # at temperature != 1 the adapter's division makes the copy megatron writes into
    passed = {v.scenario.name for v in result.verdicts if v.status == "pass"}
    assert passed == {chosen[-1].name} and len(found) >= 3


@pytest.mark.world
def test_logits_divided_in_place_are_named_where_and_at_which_element(world):
    sc = get_suite("regressions")[2]  # thd tp 2, temperature 0.9
    result = runner.run([sc], "builtin:inplace_temperature", reporter=SilentReport(), world=world)
    found = _failures(result)
    assert {v.status for v in result.verdicts} == {"fail"}
    assert {f.kind for v in result.verdicts for f in v.failures} == {"input_mutated"}  # values stay right
    site = _line_of(mutants.InplaceTemperature, "inputs.logits.div_(")
    by_column = {f.column: f for f in found}
    assert set(by_column) == {0, sc.vocab // 2}  # TP rank 0's first column, TP rank 1's
    for f in found:
        assert (f.field, f.phase, f.sample, f.position) == ("logits", "forward", 0, 0)
        assert f.details["site"][0].endswith(site) and "aten.div_" in f.details["op"]
        assert f.got == pytest.approx(f.want / sc.temperature)


@pytest.mark.world
def test_without_the_input_check_the_rest_is_still_checked_and_the_report_says_so(world):
    """run --no-inplace: a target known to write into its logits is still held to its values."""
    from shardcheck.harness.controller.reports.run_report import render_table

    sc = get_suite("regressions")[2]
    result = runner.run([sc], "builtin:inplace_temperature", reporter=SilentReport(), world=world, inplace=False)
    assert result.verdicts[0].status == "pass", result.verdicts[0].headline()
    assert "not checked: whether the target leaves its inputs unchanged" in render_table(result.verdicts, result.info)
    [v] = runner.run([sc], "builtin:chunk_off_by_one", reporter=SilentReport(), world=world, inplace=False).verdicts
    assert v.status == "fail" and "value_mismatch" in v.kinds


@pytest.mark.world
def test_a_gradient_scaled_in_place_in_backward_is_found(world):
    sc = get_suite("regressions")[2]
    result = runner.run([sc], "builtin:inplace_grad_output", reporter=SilentReport(), world=world)
    found = _failures(result)
    assert {f.kind for v in result.verdicts for f in v.failures} == {"input_mutated"}
    assert {(f.field, f.phase) for f in found} == {("grad of log_probs", "backward")}
    assert {f.sample for f in found} == {0, 1, 2}
    site = _line_of(mutants._LossScaled, "grad.mul_(")
    for f in found:
        assert f.details["site"][0].endswith(site) and f.token == 0
        assert f.got == pytest.approx(f.want * mutants._LossScaled.SCALE)


@pytest.mark.world
def test_tokens_and_policy_inputs_are_watched_and_a_harmless_write_is_allowed(world):
    sc = Scenario("w", (Sample(11, 4), Sample(9, 6), Sample(7, 2)), vocab=16, tp=2, entropy_coef=0.1, seed=4)
    [v] = runner.run([sc], "plants:MutateTokens", reporter=SilentReport(), world=world).verdicts
    [f] = {f.identity(): f for f in v.failures if f.kind == "input_mutated"}.values()
    assert (f.field, f.sample, f.position, f.phase) == ("tokens", 1, 3, "forward")
    assert f.details["site"][0].startswith("plants.py:") or "tests/plants.py" in f.details["site"][0]
    [v] = runner.run([sc], "plants:PolicyLossMutatesAdvantages", reporter=SilentReport(), world=world).verdicts
    fields = {f.field for f in v.failures if f.kind == "input_mutated"}
    assert fields == {"advantages"}, [f.message for f in v.failures]
    # a write that changes no value is no finding, and writing into the given logits is allowed
    [v] = runner.run([sc], "plants:InplaceSameValues", reporter=SilentReport(), world=world).verdicts
    assert v.status == "pass", v.headline()


def test_a_change_that_does_not_repeat_when_explained_says_so():
    from shardcheck.harness.controller.commands.runner import _explained, _unexplained
    from shardcheck.harness.controller.reports.verdict import Failure, Verdict
    from shardcheck.harness.wire import EXPLAIN

    sc = Scenario("x", (Sample(5, 2),), vocab=4)
    first = Verdict(sc, "fail", [Failure("input_mutated", "logits changed in forward", [0], field="logits",
                                         details={EXPLAIN: True})])
    assert _unexplained(first)
    kept = _explained(first, Verdict(sc, "pass", seconds=2.0))
    assert kept is first and kept.seconds == 2.0 and "did not happen again when the scenario was run" in kept.failures[0].message
    assert EXPLAIN not in kept.failures[0].details
    first = Verdict(sc, "fail", [Failure("input_mutated", "logits changed in forward", [0], field="logits",
                                         details={EXPLAIN: True})])
    explained = Verdict(sc, "fail", [Failure("input_mutated", "m", [0], details={"site": ["a.py:1"]})])
    assert _explained(first, explained) is explained and not _unexplained(explained)
