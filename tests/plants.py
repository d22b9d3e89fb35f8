"""Targets with a bug planted on purpose, each a real code path through the builtin target.

Used as ``--target plants:NAME`` with ``tests/`` on PYTHONPATH. Each plants one bug at a
known place, so a test can check the harness names exactly that place.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from shardcheck.scenarios.layout import rank_layout
from shardcheck.scenarios import Scenario
from shardcheck.targets import RankInputs, RankOutputs, TargetBase
from shardcheck.targets.builtin import BuiltinTarget

SAMPLE, TOKEN, COLUMN = 1, 3, 5


def _layout(inputs: RankInputs):
    sc = Scenario(name="plant", samples=list(zip(inputs.total_lengths, inputs.response_lengths)),
                  vocab=inputs.logits.size(-1) * inputs.tp_size, tp=inputs.tp_size, cp=inputs.cp_size,
                  layout=inputs.layout)
    return rank_layout(sc, inputs.tp_rank, inputs.cp_rank)


class CorruptValue(BuiltinTarget):
    """builtin, with the log-prob of sample 1, response token 3 off by 0.5 (on whichever rank holds it)"""

    name = "plants:CorruptValue"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        out = super().compute(inputs)
        share = _layout(inputs).share[SAMPLE]
        if TOKEN in share:
            bump = torch.zeros_like(out.log_probs[SAMPLE])
            bump[share.index(TOKEN)] = 0.5
            out.log_probs[SAMPLE] = out.log_probs[SAMPLE] + bump
        return out


class _OnBackward(torch.autograd.Function):
    """Identity in forward; in backward, ``hook(grad)`` gives the gradient passed on."""

    @staticmethod
    def forward(ctx, logits, hook):  # type: ignore[override]
        ctx.hook = hook
        return logits.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return ctx.hook(grad), None


def _nudge(row: int, column: int):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1, grad.size(-1))[row, column] += 0.25
        return grad

    return hook


class CorruptGrad(BuiltinTarget):
    """builtin, with d loss / d logits wrong at the row scoring sample 1 token 3, vocab column 5"""

    name = "plants:CorruptGrad"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        layout = _layout(inputs)
        prompt = inputs.total_lengths[SAMPLE] - inputs.response_lengths[SAMPLE]
        want = (SAMPLE, prompt - 1 + TOKEN)
        lo, hi = layout.columns
        rows = layout.row_positions()
        if want in rows and lo <= COLUMN < hi:
            inputs.logits = _OnBackward.apply(inputs.logits, _nudge(rows.index(want), COLUMN - lo))
        return super().compute(inputs)


class RaiseOnCpRank1(BuiltinTarget):
    """builtin, but CP rank 1 raises before its first collective"""

    name = "plants:RaiseOnCpRank1"
    computed = False

    def describe(self) -> dict:
        # what a target learns only on the ranks (slime: its era, the stubs it needed)
        return {**super().describe(), "seen_on_a_rank": self.computed}

    def compute(self, inputs: RankInputs) -> RankOutputs:
        self.computed = True
        if inputs.cp_rank == 1:
            raise RuntimeError("planted failure on cp rank 1")
        return super().compute(inputs)


# -- one extra collective on one rank, through each route that reaches the backend -------------

def _extra_call(route: str, group) -> None:
    t = torch.ones(3)
    if route == "dist":
        torch.distributed.all_reduce(t, group=group)
    elif route == "dist_nn":
        import torch.distributed.nn.functional as dnn

        dnn.all_reduce(t, group=group)
    elif route == "functional":
        import torch.distributed._functional_collectives as fc

        fc.wait_tensor(fc.all_reduce(t, "sum", group))
    elif route == "megatron":
        from megatron.core.tensor_parallel import mappings

        mappings.reduce_from_tensor_model_parallel_region(t)
    else:
        raise ValueError(route)


class ExtraCall(BuiltinTarget):
    """builtin, plus one extra all-reduce over TP on TP rank 1 only, through one route"""

    def __init__(self, route: str, phase: str) -> None:
        self.route, self.phase = route, phase
        self.name = f"plants:extra_{route}_{phase}"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        if inputs.tp_rank == 1:
            if self.phase == "forward":
                _extra_call(self.route, inputs.tp_group)
            else:
                route, group = self.route, inputs.tp_group

                def hook(grad: torch.Tensor) -> torch.Tensor:
                    _extra_call(route, group)
                    return grad

                inputs.logits = _OnBackward.apply(inputs.logits, hook)
        return super().compute(inputs)


def _factory(route: str, phase: str):
    def make() -> ExtraCall:
        return ExtraCall(route, phase)

    return make


ROUTES = ("dist", "dist_nn", "functional", "megatron")
for _route in ROUTES:
    for _phase in ("forward", "backward"):
        globals()[f"extra_{_route}_{_phase}"] = _factory(_route, _phase)


class DieOnCpRank1(BuiltinTarget):
    """builtin, but the process of CP rank 1 exits abruptly before its first collective"""

    name = "plants:DieOnCpRank1"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        if inputs.cp_rank == 1:
            import os

            os._exit(3)
        return super().compute(inputs)


class AllRoutes(BuiltinTarget):
    """builtin, plus the same set of collectives on every rank through every route the trace must
    see (forward and backward), all over the TP group; the outputs are unchanged."""

    name = "plants:AllRoutes"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        import threading

        import torch.distributed as dist
        import torch.distributed._functional_collectives as fc
        import torch.distributed.nn.functional as dnn
        from megatron.core.tensor_parallel import mappings

        g, n, me = inputs.tp_group, inputs.tp_size, inputs.tp_rank
        ranks = dist.get_process_group_ranks(g)
        t = torch.ones(4)
        dist.all_reduce(t, group=g)
        dist.all_reduce(t, group=g, async_op=True).wait()
        dist.all_gather([torch.empty(4) for _ in range(n)], t, group=g)
        dist.all_gather_into_tensor(torch.empty(4 * n), t, group=g)
        dist.reduce_scatter_tensor(torch.empty(4), torch.ones(4 * n), group=g)
        dist.broadcast(t, src=ranks[0], group=g)
        dist.all_to_all_single(torch.empty(2 * n), torch.ones(2 * n), group=g)
        dist.barrier(group=g)
        if n > 1:  # point-to-point: rank 0 and 1 of the group exchange
            if me == 0:
                dist.send(torch.ones(2), dst=ranks[1], group=g)
            elif me == 1:
                dist.recv(torch.empty(2), src=ranks[0], group=g)
        fc.wait_tensor(fc.all_reduce(torch.ones(3), "sum", g))
        fc.wait_tensor(fc.all_gather_tensor(torch.ones(3), 0, g))
        fc.wait_tensor(fc.reduce_scatter_tensor(torch.ones(3 * n), "sum", 0, g))
        worker = threading.Thread(target=dist.all_reduce, args=(torch.ones(5),), kwargs={"group": g})
        worker.start()
        worker.join()
        # Differentiable routes, joined into the outputs with weight zero so their backward runs.
        x = inputs.logits.sum() * 0 + torch.ones(4)
        y = dnn.all_reduce(x, group=g).sum()  # (dnn.all_gather's backward assumes the world group)
        y = y + fc.wait_tensor(fc.all_gather_tensor_autograd(x, 0, g)).sum()
        y = y + mappings.reduce_from_tensor_model_parallel_region(x).sum()
        y = y + mappings.copy_to_tensor_model_parallel_region(x).sum()
        out = super().compute(inputs)
        out.log_probs[0] = out.log_probs[0] + 0 * y
        return out


class PolicyLoss(BuiltinTarget):
    """A correct PPO policy loss (per-sample token mean, ratio exp(logp - old)) around builtin:
    the harness checks its loss value and gradient in the "policy" loss form"""

    name = "plants:PolicyLoss"
    loss_form = "policy"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        out = super().compute(inputs)
        out.loss = self.loss(inputs, out)
        return out

    def denominator(self, mask: torch.Tensor, share_mask: torch.Tensor) -> torch.Tensor:
        return mask.sum().clamp_min(1)

    def loss(self, inputs: RankInputs, out: RankOutputs) -> torch.Tensor:
        policy, share = inputs.policy, inputs.rank_layout.share
        total = inputs.logits.sum() * 0
        for i, js in enumerate(share):
            mask = policy.loss_masks[i].float()
            share_mask = mask[torch.tensor(js, dtype=torch.int64)]
            ratio = (out.log_probs[i] - policy.old_log_probs[i]).exp()
            denom = self.denominator(mask, share_mask)
            total = total + (-policy.advantages[i] * ratio * share_mask).sum() / denom
            if out.entropy is not None:
                total = total - inputs.entropy_coef * (out.entropy[i] * share_mask).sum() / denom
        return total


class PolicyLossLocalDenominator(PolicyLoss):
    """PolicyLoss, dividing by the rank's share of the mask instead of the sample's whole mask:
    right without CP, wrong values and gradients with it"""

    name = "plants:PolicyLossLocalDenominator"

    def denominator(self, mask: torch.Tensor, share_mask: torch.Tensor) -> torch.Tensor:
        return share_mask.sum().clamp_min(1)


class PolicyLossOffset(PolicyLoss):
    """PolicyLoss plus a constant 0.25: a wrong loss value with a right gradient"""

    name = "plants:PolicyLossOffset"

    def loss(self, inputs: RankInputs, out: RankOutputs) -> torch.Tensor:
        return super().loss(inputs, out) + 0.25


class PolicyLossNotScalar(PolicyLoss):
    """PolicyLoss returned as a 1-element-per-sample vector instead of a scalar"""

    name = "plants:PolicyLossNotScalar"

    def loss(self, inputs: RankInputs, out: RankOutputs) -> torch.Tensor:
        return super().loss(inputs, out).reshape(1).repeat(2)


class MutateTokens(BuiltinTarget):
    """builtin, which first overwrites token 3 of sample 1 in the token list it was given"""

    name = "plants:MutateTokens"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        out = super().compute(inputs)
        tokens = inputs.tokens[SAMPLE]
        tokens[TOKEN] = (tokens[TOKEN] + 1) % (inputs.logits.size(-1) * inputs.tp_size)  # the planted write
        return out


class PolicyLossMutatesAdvantages(PolicyLoss):
    """PolicyLoss that centres the advantages it was given, in place (the caller's tensors)"""

    name = "plants:PolicyLossMutatesAdvantages"

    def loss(self, inputs: RankInputs, out: RankOutputs) -> torch.Tensor:
        for adv in inputs.policy.advantages:
            if adv.numel() > 1:
                adv.sub_(adv.mean())  # the planted write
        return super().loss(inputs, out)


class InplaceSameValues(BuiltinTarget):
    """builtin, which multiplies the logits it was given by 1 in place: a write that changes
    nothing (and that autograd allows on a model's output, so it must not be a rank error)"""

    name = "plants:InplaceSameValues"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        inputs.logits.mul_(1.0)
        return super().compute(inputs)


class RaiseEverywhere(BuiltinTarget):
    """builtin, which raises the same error at the same place on every rank"""

    name = "plants:RaiseEverywhere"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        raise ValueError("planted failure on every rank")


class CorruptValueThenRaiseInBackward(CorruptValue):
    """CorruptValue (a wrong log-prob, found in the forward), whose backward then raises"""

    name = "plants:CorruptValueThenRaiseInBackward"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("planted failure in backward")

        out = super().compute(inputs)
        out.log_probs = [_OnBackward.apply(lp, hook) for lp in out.log_probs]
        return out


class PrintsALine(BuiltinTarget):
    """builtin, which prints the same line on every rank and scenario (as import-time warnings do)"""

    name = "plants:PrintsALine"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        print("planted: a line every rank prints", flush=True)
        return super().compute(inputs)


RELEASED: list[str] = []  # names of the Releasable targets released in this process


class Releasable(BuiltinTarget):
    """builtin, with a process-wide setting that release() undoes (as the slime adapter's)"""

    name = "plants:Releasable"

    def release(self) -> None:
        RELEASED.append(self.name)


class PrintsAnEnvironmentVariable(BuiltinTarget):
    """builtin, which prints SHARDCHECK_TEST_PROBE as the rank sees it"""

    name = "plants:PrintsAnEnvironmentVariable"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        print("probe:", os.environ.get("SHARDCHECK_TEST_PROBE"), flush=True)
        return super().compute(inputs)


class ReturnsNone(BuiltinTarget):
    """compute returns None"""

    name = "plants:ReturnsNone"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        super().compute(inputs)
        return None  # type: ignore[return-value]


class HalfOutputs(BuiltinTarget):
    """builtin, with its log-probs cast to float16"""

    name = "plants:HalfOutputs"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        out = super().compute(inputs)
        out.log_probs = [lp.half() for lp in out.log_probs]
        return out


class DetachedOutputs(BuiltinTarget):
    """builtin, with its entropy detached from the graph"""

    name = "plants:DetachedOutputs"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        out = super().compute(inputs)
        out.entropy = [e.detach() if e is not None else None for e in out.entropy]
        return out


class MetaOutputs(BuiltinTarget):
    """builtin, with its log-probs on the meta device (another device than the logits')"""

    name = "plants:MetaOutputs"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        out = super().compute(inputs)
        out.log_probs = [lp.to("meta") for lp in out.log_probs]
        return out


class LongOutputs(BuiltinTarget):
    """builtin, with its log-probs cast to int64"""

    name = "plants:LongOutputs"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        out = super().compute(inputs)
        out.log_probs = [lp.long() for lp in out.log_probs]
        return out


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


class SpinsOnRankOne(BuiltinTarget):
    """builtin, except that rank 1 never returns from compute (a busy loop, not a collective)"""

    name = "plants:SpinsOnRankOne"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        if _global_rank() == 1:
            while True:
                pass
        return super().compute(inputs)


class RankOneDiesWhileRankZeroWorks(BuiltinTarget):
    """rank 1 exits at once; rank 0 works for 3 s before its first collective"""

    name = "plants:RankOneDiesWhileRankZeroWorks"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        import time

        if _global_rank() == 1:
            os._exit(3)
        time.sleep(3.0)
        return super().compute(inputs)


class RankOneDiesRankZeroSpins(BuiltinTarget):
    """rank 1 exits at once; rank 0 never returns from compute"""

    name = "plants:RankOneDiesRankZeroSpins"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        if _global_rank() == 1:
            os._exit(3)
        while True:
            pass


class RankOneSleeps(BuiltinTarget):
    """rank 1 sleeps 30 s in compute (to be killed meanwhile)"""

    name = "plants:RankOneSleeps"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        import time

        if _global_rank() == 1:
            time.sleep(30.0)
        return super().compute(inputs)


class ReplayKeepTp1(BuiltinTarget):
    """processed log-probs written plainly, for tp = cp = 1 thd: each response token's log-prob
    renormalised over its replayed keep set and its target, the entropy over the whole vocabulary"""

    name = "plants:ReplayKeepTp1"
    capabilities = BuiltinTarget.capabilities.__class__(layouts=frozenset({"thd"}), replay_keep=True)
    renormalise = True

    def compute(self, inputs: RankInputs) -> RankOutputs:
        assert inputs.tp_size == 1 and inputs.cp_size == 1
        rows = inputs.logits[0] / inputs.temperature
        log_probs, entropies, offset = [], [], 0
        for i, (total, response) in enumerate(zip(inputs.total_lengths, inputs.response_lengths)):
            prompt = total - response
            s = rows[offset + prompt - 1: offset + total - 1]  # row p predicts token p + 1
            targets = inputs.tokens[i][prompt:]
            lps = []
            for j in range(response):
                kept = inputs.keep_sets[i][j] if inputs.keep_sets else None
                row = s[j]
                if kept is not None and self.renormalise:
                    mask = torch.zeros_like(row, dtype=torch.bool)
                    mask[list(kept) + [int(targets[j])]] = True
                    row = row.masked_fill(~mask, float("-inf"))
                lps.append(torch.log_softmax(row, -1)[targets[j]])
            log_probs.append(torch.stack(lps))
            entropies.append(-(torch.softmax(s, -1) * torch.log_softmax(s, -1)).sum(-1))
            offset += total
        return RankOutputs(log_probs=log_probs, entropy=entropies if inputs.with_entropy else None)


class ReplayKeepIgnored(ReplayKeepTp1):
    """claims to apply the replayed keep sets, and ignores them"""

    name = "plants:ReplayKeepIgnored"
    renormalise = False


class WithoutReplayKeep(BuiltinTarget):
    """builtin, as a target that does not say it applies replayed keep sets"""

    name = "plants:WithoutReplayKeep"
    capabilities = BuiltinTarget.capabilities.__class__()


class OneDevice:
    """a target without parallel code, as OpenRLHF's log_probs_from_logits is: a plain log-softmax
    on one device's logits (tp 1, cp 1), labels and rows from the public helpers"""

    name = "plants:one_device"

    def release(self) -> None:
        """Nothing to undo."""

    def __init__(self, config) -> None:
        from shardcheck.targets import Capabilities

        self.config = config
        self.capabilities = Capabilities(
            layouts=frozenset({"thd", "bshd"}), tp_sizes=frozenset({1}), cp_sizes=frozenset({1}),
            entropy=config.flag("entropy", True), dtypes=frozenset({"float32"}), replay_keep=True, sampling=True,
            reasons=(("tp", "no vocab-parallel code: one device's logits"), ("cp", "no context-parallel code")))

    def describe(self) -> dict:
        return {"name": self.name, "version": "0", "src": self.config.src, "options": dict(self.config.options)}

    def compute(self, inputs: RankInputs) -> RankOutputs:
        rows = inputs.logits.reshape(-1, inputs.logits.size(-1)).float() / inputs.temperature
        labels = inputs.row_labels()
        if self.config.flag("shift_labels"):  # the planted bug: the labels one row late
            labels = labels.roll(1)
        logp = torch.log_softmax(rows, -1)
        token_logp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        share = inputs.scored_rows()
        if inputs.keep_sets is not None:  # processed: renormalised over the kept ids and the label
            keep = torch.zeros_like(rows, dtype=torch.bool)
            for r, sets in zip(share, inputs.keep_sets):
                for row, kept in zip(r.tolist(), sets):
                    keep[row, list(kept) if kept is not None else slice(None)] = True
            keep[torch.arange(len(labels)), labels] = True
            processed = torch.log_softmax(rows.masked_fill(~keep, float("-inf")), -1)
            token_logp = processed.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        if inputs.top_k > 0 or inputs.top_p < 1:  # the sampler's filter, from the logits themselves
            kept = rows.masked_fill(~_sampler_keep(rows.detach(), inputs.top_k, inputs.top_p), float("-inf"))
            token_logp = torch.log_softmax(kept, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        return RankOutputs([token_logp[r] for r in share],
                           [entropy[r] for r in share] if inputs.with_entropy else None)


def one_device(config=None) -> OneDevice:
    from shardcheck.targets import TargetConfig

    return OneDevice(config or TargetConfig())


one_device.options = {"entropy": "compute the entropy (default true)",
                      "shift_labels": "take each row's label one row late (a planted bug)"}


def _sampler_keep(s: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """A top-k then top-p filter's keep mask, plainly, in the logits' precision."""
    keep = torch.ones_like(s, dtype=torch.bool)
    if top_k > 0:
        keep &= s >= s.topk(top_k, dim=-1).values[:, -1:]
    if top_p < 1:
        ascending, order = s.masked_fill(~keep, float("-inf")).sort(dim=-1)
        kept = ascending.softmax(-1).cumsum(-1) > 1 - top_p
        kept[:, -1] = True
        keep &= torch.zeros_like(kept).scatter(-1, order, kept)
    return keep


class SamplingTp1(BuiltinTarget):
    """a top-k then top-p filter of the logits written plainly in float32, for tp = cp = 1 thd:
    each response token's log-prob renormalised over what the filter keeps"""

    name = "plants:SamplingTp1"
    capabilities = BuiltinTarget.capabilities.__class__(layouts=frozenset({"thd"}), sampling=True,
                                                         tp_sizes=frozenset({1}))
    filtered = True

    def compute(self, inputs: RankInputs) -> RankOutputs:
        rows = inputs.logits[0].float() / inputs.temperature
        labels = inputs.row_labels()
        if self.filtered:
            rows = rows.masked_fill(~_sampler_keep(rows.detach(), inputs.top_k, inputs.top_p), float("-inf"))
        logp = torch.log_softmax(rows, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        plain = inputs.logits[0].float() / inputs.temperature
        entropy = -(torch.softmax(plain, -1) * torch.log_softmax(plain, -1)).sum(-1)
        share = inputs.scored_rows()
        return RankOutputs([logp[r] for r in share], [entropy[r] for r in share] if inputs.with_entropy else None)


class SamplingIgnored(SamplingTp1):
    """claims to apply the top-k / top-p filter, and does not"""

    name = "plants:SamplingIgnored"
    filtered = False


class _SplitOffByOne:
    """A framework's data path whose zigzag split takes each sample's second chunk one position
    early: the last position of chunk 2c-1-r is never held, the one before the chunk twice."""

    name = "tests/plants.py:_SplitOffByOne"

    def knobs(self):
        return {}

    def builds(self, scenario):
        return None

    def local_tokens(self, rollout):
        import dataclasses

        from shardcheck.scenarios.traced_layout import harness_local_tokens
        from shardcheck.targets.own_layout import OwnDataPath

        layout = OwnDataPath().layout(rollout)
        if rollout.layout == "zigzag":
            pieces = list(layout.pieces)
            pieces[1::2] = [dataclasses.replace(p, start=p.start - 1, stop=p.stop - 1) for p in pieces[1::2]]
            layout = dataclasses.replace(layout, pieces=tuple(pieces))
        return harness_local_tokens(layout, rollout.tokens)


class CpSplitOffByOne(BuiltinTarget):
    """builtin behind a data path whose zigzag CP split is off by one (the second chunk of each
    sample starts a position early)"""

    name = "plants:CpSplitOffByOne"
    data_path = _SplitOffByOne()


class _ValueDependentPath(_SplitOffByOne):
    """A data path that drops every row whose token is 3 (a layout that depends on the values)."""

    name = "tests/plants.py:_ValueDependentPath"

    def local_tokens(self, rollout):
        from shardcheck.scenarios.traced_layout import harness_local_tokens
        from shardcheck.targets.own_layout import OwnDataPath

        tokens = harness_local_tokens(OwnDataPath().layout(rollout), rollout.tokens)
        return tokens.masked_fill(tokens == 3, 0)


class ValueDependentLayout(BuiltinTarget):
    """builtin behind a data path that pads over every token 3 (its layout depends on the token values)"""

    name = "plants:ValueDependentLayout"
    data_path = _ValueDependentPath()


class _SlimeLikePadding(_SplitOffByOne):
    """The harness's layout padded as slime's get_batch pads: each rank's packed rows to a multiple
    of tp * pad_multiplier, with all-gather CP the packed stream to cp * tp * pad_multiplier."""

    name = "tests/plants.py:_SlimeLikePadding"

    def knobs(self):
        from shardcheck.targets.base import Knob, positive_int

        return {"pad_multiplier": Knob(128, "rows padded to a multiple of tp * pad_multiplier", positive_int)}

    def builds(self, scenario):
        return "pads packed layouts only" if scenario.layout == "bshd" else None

    def local_tokens(self, rollout):
        from megatron.core import parallel_state as mpu

        tp, cp = mpu.get_tensor_model_parallel_world_size(), mpu.get_context_parallel_world_size()
        unit = tp * rollout.knobs["pad_multiplier"]
        if rollout.layout == "allgather":
            stream = torch.cat(rollout.tokens)
            stream = torch.nn.functional.pad(stream, (0, -len(stream) % (cp * unit)))
            return stream.chunk(cp)[mpu.get_context_parallel_rank()].unsqueeze(0)
        from shardcheck.scenarios.traced_layout import harness_local_tokens
        from shardcheck.targets.own_layout import OwnDataPath

        rows = harness_local_tokens(OwnDataPath().layout(rollout), rollout.tokens).reshape(-1)
        return torch.nn.functional.pad(rows, (0, -len(rows) % unit)).unsqueeze(0)


class SlimeLikePadding(BuiltinTarget):
    """builtin behind a data path that pads as slime's get_batch does (knob pad_multiplier, default 128)"""

    name = "plants:SlimeLikePadding"
    data_path = _SlimeLikePadding()


class MeasuredBuiltin(BuiltinTarget):
    """builtin, naming its own module as the framework's file (--coverage measures targets/builtin.py)"""

    name = "plants:MeasuredBuiltin"
    framework_files = ("builtin.py",)

    @property
    def src(self):
        import shardcheck.targets.builtin as module

        return os.path.dirname(module.__file__)


class NegativeEntropy(BuiltinTarget):
    """builtin returning sum p log p (the negative entropy, as NeMo-RL's ChunkedDistributedEntropy
    does) and declaring that definition: the reference follows, so it passes."""

    name = "plants:NegativeEntropy"

    def __init__(self, declared: bool = True) -> None:
        super().__init__()
        from shardcheck.targets.base import Definitions

        if declared:
            self.definitions = Definitions(entropy_sign=-1, entropy_source="a plant")

    def compute(self, inputs: RankInputs) -> RankOutputs:
        out = super().compute(inputs)
        return RankOutputs(out.log_probs, [-e for e in out.entropy] if out.entropy is not None else None)


def NegativeEntropyUndeclared() -> NegativeEntropy:  # noqa: N802 - a target factory, named as the plant
    """The same values without the declaration: the reference's default, so it fails."""
    return NegativeEntropy(declared=False)


class _SumOverCpOwnGradOnly(torch.autograd.Function):
    """All-reduce over the CP group whose backward keeps each rank's own gradient (no sum of the
    CP ranks' gradients): right only when each rank's loss covers just its own tokens."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        import torch.distributed as dist

        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


def _gathered(inputs: RankInputs, outs, sums_grads: bool) -> list:
    """Per sample, every response token's value, each rank's share put in place and summed over CP."""
    from torch.distributed.nn.functional import all_reduce

    full = []
    for i, (out, js) in enumerate(zip(outs, inputs.rank_layout.share)):
        whole = out.new_zeros(inputs.response_lengths[i]).index_put((torch.tensor(js, dtype=torch.int64,
                                                                                   device=out.device),), out)
        full.append(all_reduce(whole, group=inputs.cp_group) if sums_grads
                    else _SumOverCpOwnGradOnly.apply(whole, inputs.cp_group))
    return full


class GatheredLoss(BuiltinTarget):
    """builtin whose outputs are gathered over CP, every token on every CP rank, with the loss over
    the whole gathered sequence / cp (NeMo-RL's convention), declared: the reference follows."""

    name = "plants:GatheredLoss"
    sums_grads = True

    def __init__(self) -> None:
        super().__init__()
        from shardcheck.targets.base import Definitions

        self.definitions = Definitions(loss_over="gathered", loss_source="a plant")

    def compute(self, inputs: RankInputs) -> RankOutputs:
        out = super().compute(inputs)
        return RankOutputs(_gathered(inputs, out.log_probs, self.sums_grads),
                           _gathered(inputs, out.entropy, self.sums_grads) if out.entropy is not None else None)


class GatheredLogProbs(BuiltinTarget):
    """NeMo-RL's shape: log-probs gathered over CP (every token on every CP rank, loss over the
    gathered sequence / cp), the entropy on each rank's own rows; declared field by field."""

    name = "plants:GatheredLogProbs"
    entropy_over: str | None = "held"

    def __init__(self) -> None:
        super().__init__()
        from shardcheck.targets.base import Definitions

        self.definitions = Definitions(loss_over="gathered", entropy_over=self.entropy_over, loss_source="a plant")

    def compute(self, inputs: RankInputs) -> RankOutputs:
        out = super().compute(inputs)
        # on the harness's zigzag rows the tokens a rank's rows score are its share
        return RankOutputs(_gathered(inputs, out.log_probs, True), out.entropy)


class GatheredLogProbsEntropyUndeclared(GatheredLogProbs):
    """The same declaring only ``loss_over``: its own-rows entropy is then short of the tokens owed."""

    name = "plants:GatheredLogProbsEntropyUndeclared"
    entropy_over = None


class GatheredLossNoGradSum(GatheredLoss):
    """The same with a gather whose backward does not sum the CP ranks' gradients: under the
    gathered convention each rank's gradient is 1/cp of the truth."""

    name = "plants:GatheredLossNoGradSum"
    sums_grads = False


class ShareOfGatheredNoGradSum(BuiltinTarget):
    """That faulty gather under the share convention (each rank hands back only its share): its
    missing gradient sum is invisible there, so it passes."""

    name = "plants:ShareOfGatheredNoGradSum"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        out = super().compute(inputs)
        share = inputs.rank_layout.share

        def own(full):
            return [f[torch.tensor(js, dtype=torch.int64, device=f.device)] for f, js in zip(full, share)]

        return RankOutputs(own(_gathered(inputs, out.log_probs, False)),
                           own(_gathered(inputs, out.entropy, False)) if out.entropy is not None else None)


class _NudgesSavedLogitsInBackward(torch.autograd.Function):
    """Identity; its backward moves the first element of the logits it saw in the forward to the
    next float up, in place: a change of one ulp, made in the backward (as verl's entropy
    backward writes into its logits)."""

    @staticmethod
    def forward(ctx, logits):  # type: ignore[override]
        ctx.logits = logits  # kept as is, not saved for backward: autograd's version check would object
        return logits.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        first = ctx.logits.detach().view(-1)[:1]
        first.copy_(torch.nextafter(first, torch.full_like(first, float("inf"))))  # the planted write
        return grad


class NoOpWritesThenOneUlpInBackward(BuiltinTarget):
    """builtin, which divides the logits it is given by a temperature of 1.0 in place twice (no bit
    changes) and, in the backward, moves their first element up by one ulp: values and gradients
    stay right; the write that changed the logits is the backward's, not the first division"""

    name = "plants:NoOpWritesThenOneUlpInBackward"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        import dataclasses

        inputs.logits.div_(1.0)  # the first no-op write
        inputs.logits.div_(1.0)  # the second
        return super().compute(dataclasses.replace(inputs, logits=_NudgesSavedLogitsInBackward.apply(inputs.logits)))


def _framework_entropy_for_logging(entropy: torch.Tensor) -> torch.Tensor:
    """As a framework that computes its entropy for logging only, under no_grad."""
    with torch.no_grad():
        return entropy.clone()  # the planted cut: the values stay right


class EntropyLeftGraphInFramework(BuiltinTarget):
    """builtin, whose entropy passes through a function (standing for the framework's) that
    makes it under torch.no_grad(): right values, no gradient through the entropy term"""

    name = "plants:EntropyLeftGraphInFramework"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        out = super().compute(inputs)
        out.entropy = [_framework_entropy_for_logging(e) for e in out.entropy]
        return out


class GradScaledInPlaceAndCorruptValue(BuiltinTarget):
    """builtin whose log-probs' backward scales the gradient fed into them in place, in every
    scenario (an in-place write known to be there), and whose log-prob of sample 1, response
    token 3 is off by 0.5 (a wrong value only where there is such a token)"""

    name = "plants:GradScaledInPlaceAndCorruptValue"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        from shardcheck.targets.mutants import _LossScaled

        out = super().compute(inputs)
        share = _layout(inputs).share
        if len(share) > SAMPLE and TOKEN in share[SAMPLE]:
            bump = torch.zeros_like(out.log_probs[SAMPLE])
            bump[share[SAMPLE].index(TOKEN)] = 0.5
            out.log_probs[SAMPLE] = out.log_probs[SAMPLE] + bump
        out.log_probs = [_LossScaled.apply(lp) if lp.requires_grad else lp for lp in out.log_probs]
        return out


class CallsElsewhereWhilePeersWait(BuiltinTarget):
    """builtin at tp 2 cp 2, except that before the real work the CP-rank-1 TP group (ranks 2, 3)
    spends 4 s on 40 small all-reduces among themselves, while ranks 0 and 1 do the same calls at
    once and then wait for them in a CP-group all-reduce: slow, making progress, never hung"""

    name = "plants:CallsElsewhereWhilePeersWait"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        import time

        import torch.distributed as dist

        for _ in range(40):
            if inputs.cp_rank == 1:
                time.sleep(0.1)
            dist.all_reduce(torch.zeros(1), group=inputs.tp_group)
        dist.all_reduce(torch.zeros(1), group=inputs.cp_group)
        return super().compute(inputs)


@contextlib.contextmanager
def machine_loaded(per_core: int = 2) -> Iterator[None]:
    """The machine loaded as a busy CI runner is: ``per_core`` busy processes for each core this
    process may run on, for as long as the block lasts (killed, and waited for, after)."""
    import subprocess
    import sys

    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(per_core * len(os.sched_getaffinity(0)))]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def hog_cpu() -> int:
    """The CPU StarvedOnRankOne's rank 1 and the test's hog share."""
    return max(os.sched_getaffinity(0))


def _work_at_idle_priority_on_the_hog_cpu() -> None:
    """This process onto hog_cpu() at SCHED_IDLE (it runs only when that CPU has nothing else to
    do), then 0.3 s of CPU work."""
    import time

    os.sched_setaffinity(0, {hog_cpu()})
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    spent = time.process_time()
    while time.process_time() - spent < 0.3:
        pass


class StarvedOnRankOne(BuiltinTarget):
    """builtin, except that rank 1 first moves onto hog_cpu() at SCHED_IDLE (it runs only when that
    CPU has nothing else to do) and does 0.3 s of work: with a busy process on that CPU it waits
    for the CPU, not for its code"""

    name = "plants:StarvedOnRankOne"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        if _global_rank() == 1:
            _work_at_idle_priority_on_the_hog_cpu()
        return super().compute(inputs)


class StarvedOnRankOneCorruptValue(CorruptValue):
    """CorruptValue, and rank 1 starved as in StarvedOnRankOne: on a world of two replicas, rank 1's
    replica misses its deadline while the other finds the wrong value"""

    name = "plants:StarvedOnRankOneCorruptValue"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        if _global_rank() == 1:
            _work_at_idle_priority_on_the_hog_cpu()
        return super().compute(inputs)


class SlowPerRank(BuiltinTarget):
    """builtin, except that every rank first sleeps 0.5 s: slow, never hung"""

    name = "plants:SlowPerRank"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        import time

        time.sleep(0.5)
        return super().compute(inputs)


class StarvedEverywhere(BuiltinTarget):
    """builtin, except that each rank first moves onto hog_cpu() at SCHED_IDLE and does 0.3 s of
    work (a simulation process: every simulated rank is it)"""

    name = "plants:StarvedEverywhere"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        _work_at_idle_priority_on_the_hog_cpu()
        return super().compute(inputs)


# -- wrong only where a careless comparison would not look (issue 26) ---------------------------

def _shifted_at(t: torch.Tensor, k: int, shift: float) -> torch.Tensor:
    """``t`` with ``shift`` added at ``k`` only, by an add that keeps the gradient: every other
    element keeps its bits (x + 0.0 is x)."""
    bump = torch.zeros_like(t)
    bump[k] = shift
    return t + bump


def _set_nan(row: int, column: int):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1, grad.size(-1))[row, column] = float("nan")
        return grad

    return hook


class NanLogProbAndGrad(BuiltinTarget):
    """builtin, with NaN for the log-prob of sample 1, response token 3 and for d loss / d logits
    at the row scoring that token, vocab column 5 (on whichever ranks hold them)"""

    name = "plants:NanLogProbAndGrad"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        layout = _layout(inputs)
        prompt = inputs.total_lengths[SAMPLE] - inputs.response_lengths[SAMPLE]
        rows = layout.row_positions()
        lo, hi = layout.columns
        if (SAMPLE, prompt - 1 + TOKEN) in rows and lo <= COLUMN < hi:
            inputs.logits = _OnBackward.apply(inputs.logits, _set_nan(rows.index((SAMPLE, prompt - 1 + TOKEN)),
                                                                      COLUMN - lo))
        out = super().compute(inputs)
        share = layout.share[SAMPLE]
        if TOKEN in share:
            out.log_probs[SAMPLE] = _shifted_at(out.log_probs[SAMPLE], share.index(TOKEN), float("nan"))
        return out


class CorruptLastToken(BuiltinTarget):
    """builtin, with the log-prob of the last sample's last response token off by 0.5 (on
    whichever rank holds it): the last element a rank returns, where an off-by-one stops short"""

    name = "plants:CorruptLastToken"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        out = super().compute(inputs)
        last = len(inputs.response_lengths) - 1
        token = inputs.response_lengths[last] - 1
        share = _layout(inputs).share[last]
        if token in share:
            out.log_probs[last] = _shifted_at(out.log_probs[last], share.index(token), 0.5)
        return out


class OneUlpUpFirstInBatch(BuiltinTarget):
    """builtin, whose first sample in the call has its first response token's log-prob moved to
    the next float up: one ulp, and only for the sample placed first (an order-dependent result)"""

    name = "plants:OneUlpUpFirstInBatch"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        out = super().compute(inputs)
        share = _layout(inputs).share[0]
        if 0 in share:
            lp = out.log_probs[0].detach()
            k = share.index(0)
            # the step to the next float is exact, and so is adding it back
            step = torch.nextafter(lp[k], torch.tensor(float("inf"), dtype=lp.dtype)) - lp[k]
            out.log_probs[0] = _shifted_at(out.log_probs[0], k, float(step))
        return out


from shardcheck.targets.builtin_loss import BuiltinLoss  # noqa: E402  (the step plants below)


class StepLossMissesLogits(BuiltinLoss):
    """builtin:loss, whose loss on a rank with no response token in its share is a fresh zero that
    does not reach the logits: the model's CP collective in backward is skipped there (a hang in
    training, slime's before #1678)"""

    def compute(self, inputs: RankInputs) -> RankOutputs:
        out = super().compute(inputs)
        if all(lp.numel() == 0 for lp in out.log_probs):
            out.loss = torch.zeros((), requires_grad=True) * 1.0  # in the graph, not the logits'.
        return out


class RefusesItsCheckout(BuiltinTarget):
    """builtin whose adapter refuses, on the rank, the checkout it was given (as a framework
    commit it cannot import is refused): shardcheck's own error, not a finding of the code"""

    name = "plants:RefusesItsCheckout"

    def compute(self, inputs: RankInputs) -> RankOutputs:
        from shardcheck.errors import BadInput

        raise BadInput("slime at /x cannot be imported: no module named slime.backends (its first commit)")


class LossParallelBackwardOutside(TargetBase):
    """torch:loss_parallel with no backward context: its backward runs outside loss_parallel(),
    as a training loop that leaves the context before loss.backward() does (torch's handlers are
    gone there: the backward raises)"""

    name = "plants:LossParallelBackwardOutside"

    def __init__(self):
        from shardcheck.targets.torch_parallel import LossParallelTarget

        self.inner = LossParallelTarget()
        self.capabilities = self.inner.capabilities

    def compute(self, inputs: RankInputs) -> RankOutputs:
        return self.inner.compute(inputs)


def loss_parallel_backward_outside() -> LossParallelBackwardOutside:
    return LossParallelBackwardOutside()


class SpMeshOutermost(BuiltinTarget):
    """builtin, its DeviceMesh built (sp, dp, tp): its sp groups stride over the data-parallel
    copies ([0, 2] and [1, 3] at sp 2 in 4 ranks), where the harness's hold neighbours ([0, 1],
    [2, 3]). A framework may order its mesh so; the harness, which lays each rank's batch out by
    its own groups, must refuse such a world, alike on every rank, as its own error."""

    name = "plants:SpMeshOutermost"

    def sp_group(self, inputs: RankInputs):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        shape = (inputs.sp_size, dist.get_world_size() // (inputs.sp_size * inputs.tp_size), inputs.tp_size)
        mesh = inputs.framework_groups(
            ("plant", shape),
            lambda: init_device_mesh("cpu", shape, mesh_dim_names=("sp", "dp", "tp")),
            lambda m: {name: m[name].get_group() for name in ("dp", "sp", "tp")})
        return mesh["sp"].get_group()
