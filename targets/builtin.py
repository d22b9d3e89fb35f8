"""shardcheck's own implementation of the contract, written as a framework would for production.

Independent of the harness's layout module on purpose: it derives every offset from the
arguments a framework has (lengths, CP rank and size, local row count), so the harness checks
it rather than agreeing with itself.

Per rank: log-softmax and entropy over the vocab-parallel logits in row chunks, one autograd
function per chunk (over TP: the row max and the target logit by all-reduce, the sums of exp
(and of p * s, with entropy) gathered and added in rank order, so that a row's bits do not
depend on the rows around it); per-sample extraction for thd, bshd,
zigzag CP; for all-gather CP, each rank's contiguous slice of every response is redistributed into
zigzag shares by one differentiable all-reduce per result key. Under Ulysses sequence
parallelism (sp), as verl's FSDP engine does it: its sp group from a DeviceMesh (dp, sp, tp) it
builds with torch's ``init_device_mesh``, as the FSDP frameworks build theirs, once per world (the
harness's ``framework_groups``); the packed tokens rolled by one, padded to a
multiple of sp and sliced as the logits are; each rank's per-row results, their padding removed,
gathered over the sp group by one all-to-all (uneven splits; its backward the transposed
all-to-all, summed); each response counted from the end of its sample, the samples from the end of
the gathered stream (responses are right-aligned). The entropy keeps its gradient only when
entropy_coef != 0; the decision is made here, once, for every caller.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardcheck.scenarios.scenario import LAYOUTS
from shardcheck.targets.base import Capabilities, RankInputs, RankOutputs, TargetBase


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    """log p(target) and entropy of softmax(logits / t) for logits split by columns over TP."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, tp_group, with_entropy, entropy_grad, comm, keep=None):  # type: ignore[override]
        v_local = logits.size(-1)
        vocab_start = dist.get_rank(tp_group) * v_local
        s = logits.float() / temperature
        row_max = s.max(dim=-1).values
        comm.all_reduce(row_max, dist.ReduceOp.MAX, tp_group, "max")
        s -= comm.normaliser(row_max).unsqueeze(-1)
        exp = s.exp()

        local = targets - vocab_start
        in_shard = (local >= 0) & (local < v_local)
        local = local.clamp(0, v_local - 1)
        # exact: only the rank holding the target column adds a non-zero
        target_logit = s.gather(-1, local.unsqueeze(-1)).squeeze(-1) * in_shard
        comm.all_reduce(target_logit, dist.ReduceOp.SUM, tp_group, "target_logit")
        # gathered here, not in a helper: the call site tells this gather from the entropy's
        sum_exp = _rank_order_sum(comm.all_gather(exp.sum(dim=-1), tp_group, "sum_exp"))

        log_sum_exp = sum_exp.log()
        log_prob = target_logit - log_sum_exp
        q = None
        if keep is not None:
            # processed log-prob: renormalised over each row's kept columns (the target is in
            # them), with its own maximum, as slime's masked softmax; the entropy is not
            kept = s.masked_fill(~keep, float("-inf"))
            keep_max = kept.max(dim=-1).values
            comm.all_reduce(keep_max, dist.ReduceOp.MAX, tp_group, "keep_max")
            kexp = (kept - keep_max.unsqueeze(-1)).exp()
            keep_sum = _rank_order_sum(comm.all_gather(kexp.sum(dim=-1), tp_group, "keep_sum_exp"))
            log_prob = target_logit - keep_max - keep_sum.log()
            q = kexp.div_(keep_sum.unsqueeze(-1))
        p = exp.div_(sum_exp.unsqueeze(-1))
        if with_entropy:
            mean_s = _rank_order_sum(comm.all_gather((p * s).sum(dim=-1), tp_group, "mean_s"))
            entropy = log_sum_exp - mean_s
        else:
            mean_s = None
            entropy = log_prob.new_zeros(0)
        ctx.entropy_grad = bool(with_entropy and entropy_grad)
        ctx.temperature = temperature
        ctx.logits_dtype = logits.dtype
        ctx.processed = q is not None
        kept_q = (q,) if q is not None else ()
        if ctx.entropy_grad:
            ctx.save_for_backward(p, local, in_shard, s, mean_s, *kept_q)
        else:
            ctx.save_for_backward(p, local, in_shard, *kept_q)
            ctx.mark_non_differentiable(entropy)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):  # type: ignore[override]
        saved = list(ctx.saved_tensors)
        q = saved.pop() if ctx.processed else None
        if ctx.entropy_grad:
            p, local, in_shard, s, mean_s = saved
        else:
            p, local, in_shard = saved
        grad = torch.zeros_like(p)
        if grad_log_prob is not None:
            grad = -(p if q is None else q) * grad_log_prob.unsqueeze(-1)
            grad.scatter_add_(-1, local.unsqueeze(-1), (grad_log_prob * in_shard).unsqueeze(-1))
        if ctx.entropy_grad and grad_entropy is not None:
            # d entropy / d s = -p * (s - sum_v p_v s_v)
            grad -= grad_entropy.unsqueeze(-1) * p * (s - mean_s.unsqueeze(-1))
        grad /= ctx.temperature
        return grad.to(ctx.logits_dtype), None, None, None, None, None, None, None


def _rank_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The TP ranks' partial sums added in rank order. A ring all-reduce adds an element's
    partials in an order set by the element's place in the buffer, so a row's result would
    change with the rows packed around it; gathering the partials and adding them in rank order
    keeps every row's bits independent of its neighbours (batch invariance)."""
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


class _AllReduceSum(torch.autograd.Function):
    """Sum over a group; the gradient of a sum of replicas is the sum of their gradients."""

    @staticmethod
    def forward(ctx, x, group, comm):  # type: ignore[override]
        ctx.group, ctx.comm = group, comm
        y = x.clone()
        comm.all_reduce(y, dist.ReduceOp.SUM, group, "redistribute")
        return y

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, dist.ReduceOp.SUM, ctx.group, "redistribute_grad")
        return grad, None, None


class _GatherUnpadded(torch.autograd.Function):
    """Every SP rank's rows (its padding removed: ``counts[r]`` rows from rank r, in rank order)
    on every rank, by one all-to-all with uneven splits; backward: the transposed all-to-all, each
    rank's rows of every peer's gradient summed (the gradient of a gathered copy on every rank)."""

    @staticmethod
    def forward(ctx, x, counts, group, comm):  # type: ignore[override]
        ctx.counts, ctx.group, ctx.comm, ctx.mine = counts, group, comm, x.size(0)
        sp = len(counts)
        out = x.new_empty(sum(counts))
        comm.all_to_all(out, torch.cat([x.contiguous()] * sp), counts, [x.size(0)] * sp, group, "gather")
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        sp = len(ctx.counts)
        back = grad.new_empty(ctx.mine * sp)
        ctx.comm.all_to_all(back, grad.contiguous(), [ctx.mine] * sp, ctx.counts, ctx.group, "gather_grad")
        return back.view(sp, ctx.mine).sum(0), None, None, None


class BuiltinTarget(TargetBase):
    """shardcheck's own production-style implementation (all layouts, entropy, fp32/bf16/fp16)"""

    name = "builtin"
    capabilities = Capabilities(replay_keep=True, layouts=frozenset(LAYOUTS))
    # What ``shardcheck invariance`` holds it to: the same sample gives the same bits in any
    # layout, packing, order or micro-batch, at a given tp. Across tp sizes the vocab sums are
    # split differently, so no bound is promised there (docs/invariance.md gives the measured figures).
    invariance = {axis: "bitwise" for axis in
                  ("rerun", "cp", "cp_mode", "format", "chunk", "packing", "order", "split", "sp")}
    # per local row, the replayed keep set it renormalises over (set by compute; None: none)
    _row_keep: list | None = None

    def describe(self) -> dict[str, Any]:
        from shardcheck import __version__

        return {"name": self.name, "version": __version__}

    # -- the seams the mutants (targets/mutants.py) vary ----------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: Any, group: Any, step: str) -> None:
        """Every all-reduce goes through here; ``step`` names it (max, target_logit,
        redistribute, redistribute_grad)."""
        dist.all_reduce(tensor, op=op, group=group)

    def all_gather(self, tensor: torch.Tensor, group: Any, step: str) -> list[torch.Tensor]:
        """Every all-gather goes through here: each rank's ``tensor``, in rank order; ``step``
        names it (sum_exp, mean_s)."""
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return parts

    def all_to_all(self, out: torch.Tensor, tensor: torch.Tensor, out_splits: list[int], in_splits: list[int],
                   group: Any, step: str) -> None:
        """Every all-to-all goes through here (Ulysses' gather and its gradient: ``step`` gather,
        gather_grad)."""
        dist.all_to_all_single(out, tensor, out_splits, in_splits, group=group)

    def normaliser(self, row_max: torch.Tensor) -> torch.Tensor:
        """What each row's scaled logits are shifted by before exp: the row's own maximum, so a
        row's result depends on that row alone (nothing about its neighbours or the layout)."""
        return row_max

    def entropy_grad_wanted(self, inputs: RankInputs) -> bool:
        """Keep the entropy's gradient only when the loss can use it (decided once, here)."""
        return inputs.with_entropy and inputs.entropy_coef != 0

    def extract(self, values: torch.Tensor, slices: list[Any], key: str) -> list[torch.Tensor | None]:
        """Per sample, this rank's local part of a per-row result."""
        return [values[s] for s in slices]

    def chunk_targets(self, targets: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """The tokens the rows [start, stop) of a chunk predict."""
        return targets[start:stop]

    def keep_mask(self, start: int, stop: int, targets: torch.Tensor, v_local: int, inputs: RankInputs
                  ) -> torch.Tensor | None:
        """[stop - start, v_local] bool: the local vocabulary columns each row's log-prob is
        normalised over (a replayed keep set and the target; every column for an unprocessed
        row); None when nothing in the chunk is processed."""
        keep = self._row_keep[start:stop] if self._row_keep is not None else []
        if all(k is None for k in keep):
            return None
        vocab_start = inputs.tp_rank * v_local
        mask = torch.ones(stop - start, v_local, dtype=torch.bool, device=inputs.logits.device)
        for r, ids in enumerate(keep):
            if ids is None:
                continue
            mask[r] = False
            cols = self.keep_columns((*ids, int(targets[r])), vocab_start, v_local)
            if cols:
                mask[r, cols] = True
        return mask

    def keep_columns(self, ids: tuple[int, ...], vocab_start: int, v_local: int) -> list[int]:
        """The local columns of the vocabulary ids this TP rank holds."""
        return [v - vocab_start for v in ids if vocab_start <= v < vocab_start + v_local]

    def keep_rows(self, inputs: RankInputs, sample: int, local0: int, pos0: int, count: int,
                  half: int | None = None) -> None:
        """Record the keep sets of ``count`` local rows from ``local0``, which predict the tokens
        after positions ``pos0 ...`` of ``sample`` (``half``: which zigzag half they are)."""
        if self._row_keep is None or inputs.keep_sets is None:  # also a layout walk outside compute
            return
        sets = inputs.keep_sets[sample] or []
        prompt = inputs.total_lengths[sample] - inputs.response_lengths[sample]
        for k in range(count):
            j = pos0 + k + 1 - prompt
            if 0 <= j < len(sets):
                self._row_keep[local0 + k] = sets[j]

    def ulysses_labels(self, rolled: torch.Tensor, sp_rank: int, n_rows: int) -> torch.Tensor:
        """This SP rank's slice of the rolled, padded packed tokens: the rows its logits hold."""
        return rolled[sp_rank * n_rows:(sp_rank + 1) * n_rows]

    def ulysses_real_rows(self, packed: int, sp_rank: int, n_rows: int) -> int:
        """How many of an SP rank's rows are real tokens (the rest is the padding to sp)."""
        return max(0, min(n_rows, packed - sp_rank * n_rows))

    def ulysses_gather(self, value: torch.Tensor, inputs: RankInputs, counts: list[int]) -> torch.Tensor:
        """Every rank's real rows, in sequence order, on every rank (padding removed first)."""
        return _GatherUnpadded.apply(value[:counts[inputs.sp_rank]], counts, self.sp_group(inputs), self)

    def sp_group(self, inputs: RankInputs) -> Any:
        """The sp group of its own DeviceMesh (dp, sp[, tp]), built by ``init_device_mesh`` once per
        world as the FSDP frameworks build theirs; the given sp group outside a harness."""
        if inputs.world is None:
            return inputs.sp_group
        from torch.distributed.device_mesh import init_device_mesh

        # (dp, sp), as verl's; a tp dimension only where there is TP (a simulated world of 64 ranks
        # would make 64 one-rank groups per rank for nothing)
        dims = {"dp": dist.get_world_size() // (inputs.sp_size * inputs.tp_size), "sp": inputs.sp_size,
                **({"tp": inputs.tp_size} if inputs.tp_size > 1 else {})}
        mesh = inputs.framework_groups(
            ("builtin", tuple(dims.items())),
            lambda: init_device_mesh(inputs.logits.device.type, tuple(dims.values()), mesh_dim_names=tuple(dims)),
            lambda m: {name: m[name].get_group() for name in dims})
        return mesh["sp"].get_group()

    def contribution(self, value: torch.Tensor, before: int, response: int) -> torch.Tensor:
        """A sample's full-response vector holding this rank's all-gather slice (zeros elsewhere)."""
        return torch.nn.functional.pad(value, (before, response - before - value.numel()))

    # -- the entry point ------------------------------------------------------------------
    def release(self) -> None:
        """Nothing to undo: it sets nothing process-wide."""

    def compute(self, inputs: RankInputs) -> RankOutputs:
        logits = inputs.logits
        if logits.dim() != 3:
            raise ValueError(f"logits must be 3-D, got shape {tuple(logits.shape)}")
        rows = logits.reshape(-1, logits.size(-1))
        self._row_keep = [None] * rows.size(0) if inputs.keep_sets is not None else None
        if inputs.sp_size > 1:
            return self.ulysses(rows, inputs)
        targets, slices = self.row_targets_and_slices(inputs, rows.size(0))
        log_prob, entropy = self.log_probs_and_entropy(rows, targets, inputs, self.entropy_grad_wanted(inputs))
        res = {"log_probs": self.extract(log_prob, slices, "log_probs")}
        if inputs.with_entropy:
            res["entropy"] = self.extract(entropy, slices, "entropy")
        if inputs.allgather_cp:
            res = {k: self.redistribute_allgather(v, inputs, rows.size(0)) for k, v in res.items()}
        return RankOutputs(res["log_probs"], res.get("entropy"))

    def ulysses(self, rows: torch.Tensor, inputs: RankInputs) -> RankOutputs:
        """Ulysses sequence parallelism (the module docstring): this rank's slice of the packed
        sequence in, every response token out."""
        self.sp_group(inputs)  # its mesh, before anything else (a framework builds it at start-up)
        sp, n = inputs.sp_size, rows.size(0)
        lengths = inputs.total_lengths
        packed = sum(lengths)
        tokens = torch.cat([t[:total] for t, total in zip(inputs.tokens, lengths)]).to(rows.device)
        # row p predicts token p + 1 (a sample's last row predicts the next sample's first: unscored)
        rolled = torch.nn.functional.pad(torch.roll(tokens, -1), (0, n * sp - packed + 1))
        labels = self.ulysses_labels(rolled, inputs.sp_rank, n)
        lo, seq_start = inputs.sp_rank * n, 0
        for i, total in enumerate(lengths):  # the replayed keep sets of this slice's rows
            a, b = max(lo, seq_start), min(lo + n, seq_start + total - 1)
            if a < b:
                self.keep_rows(inputs, i, a - lo, a - seq_start, b - a)
            seq_start += total
        log_prob, entropy = self.log_probs_and_entropy(rows, labels, inputs, self.entropy_grad_wanted(inputs))
        counts = [self.ulysses_real_rows(packed, r, n) for r in range(sp)]
        res = {"log_probs": log_prob}
        if inputs.with_entropy:
            res["entropy"] = entropy
        out: dict[str, list[torch.Tensor]] = {}
        for key, value in res.items():
            stream = self.ulysses_gather(value, inputs, counts)
            end, per_sample = stream.size(0), []
            for total, response in reversed(list(zip(lengths, inputs.response_lengths))):
                per_sample.append(stream[end - response - 1:end - 1])
                end -= total
            out[key] = per_sample[::-1]
        return RankOutputs(out["log_probs"], out.get("entropy"))

    # -- vocab-parallel math, in chunks -------------------------------------------------
    def log_probs_and_entropy(
        self, rows: torch.Tensor, targets: torch.Tensor, inputs: RankInputs, entropy_grad: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = rows.size(0)
        if n == 0:
            empty = rows.new_zeros(0, dtype=torch.float32) + rows.sum()  # keeps the graph
            return empty, empty.clone()
        step = inputs.chunk_size if inputs.chunk_size > 0 else n
        lps, ents = [], []
        for start in range(0, n, step):
            chunk_targets = self.chunk_targets(targets, start, start + step)
            lp, ent = _VocabParallelLogProbEntropy.apply(
                rows[start : start + step], chunk_targets, inputs.temperature,
                inputs.tp_group, inputs.with_entropy, entropy_grad, self,
                self.keep_mask(start, min(start + step, n), chunk_targets, rows.size(-1), inputs),
            )
            lps.append(lp)
            ents.append(ent)
        return torch.cat(lps), torch.cat(ents)

    # -- layouts ----------------------------------------------------------------------------
    def row_targets_and_slices(self, inputs: RankInputs, n_rows: int) -> tuple[torch.Tensor, list[Any]]:
        """The token each local row predicts, and per sample the local rows scoring its response
        (an index tensor or slice, in the order the rank returns them)."""
        device = inputs.logits.device
        targets = torch.zeros(n_rows, dtype=torch.int64, device=device)
        slices: list[Any] = []
        if inputs.cp_size > 1 and not inputs.allgather_cp:
            return self._zigzag(inputs, targets)
        if inputs.allgather_cp:
            return self._allgather(inputs, targets, n_rows)
        stride = None
        if inputs.qkv_format == "bshd":
            if not inputs.max_seq_lens:
                raise ValueError("bshd needs max_seq_lens")
            stride = inputs.max_seq_lens[0]
        offset = 0
        for i, (tokens, total, response) in enumerate(
            zip(inputs.tokens, inputs.total_lengths, inputs.response_lengths)
        ):
            base = i * stride if stride is not None else offset
            targets[base : base + total - 1] = tokens[1:total].to(device)
            self.keep_rows(inputs, i, base, 0, total - 1)
            slices.append(slice(base + total - response - 1, base + total - 1))
            offset += total
        return targets, slices

    def _zigzag(self, inputs: RankInputs, targets: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
        c, r = inputs.cp_size, inputs.cp_rank
        slices: list[Any] = []
        base = 0
        for i, (tokens, total, response) in enumerate(
                zip(inputs.tokens, inputs.total_lengths, inputs.response_lengths)):
            k = (total + 2 * c - 1) // (2 * c)
            first_scored, end_scored = total - response - 1, total - 1
            rows = []
            for half, chunk in enumerate((r, 2 * c - 1 - r)):
                lo, hi = chunk * k, (chunk + 1) * k
                local0 = base + half * k
                valid_hi = min(hi, total - 1)  # rows that predict a real token
                if lo < valid_hi:
                    targets[local0 : local0 + valid_hi - lo] = tokens[lo + 1 : valid_hi + 1].to(targets.device)
                    self.keep_rows(inputs, i, local0, lo, valid_hi - lo, half)
                a, b = max(lo, first_scored), min(hi, end_scored)
                if a < b:
                    rows.append(torch.arange(local0 + a - lo, local0 + b - lo, device=targets.device))
            slices.append(torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64, device=targets.device))
            base += 2 * k
        return targets, slices

    def _allgather(self, inputs: RankInputs, targets: torch.Tensor, n_rows: int) -> tuple[torch.Tensor, list[Any]]:
        lo = inputs.cp_rank * n_rows
        hi = lo + n_rows
        slices: list[Any] = []
        seq_start = 0
        for i, (tokens, total, response) in enumerate(
                zip(inputs.tokens, inputs.total_lengths, inputs.response_lengths)):
            # rows of this sample that predict a real token: global [seq_start, seq_start + total - 1)
            a, b = max(lo, seq_start), min(hi, seq_start + total - 1)
            if a < b:
                targets[a - lo : b - lo] = tokens[a - seq_start + 1 : b - seq_start + 1].to(targets.device)
                self.keep_rows(inputs, i, a - lo, a - seq_start, b - a)
            first = seq_start + total - response - 1
            a, b = max(lo, first), min(hi, seq_start + total - 1)
            slices.append(slice(a - lo, b - lo) if a < b else slice(0, 0))
            seq_start += total
        return targets, slices

    def redistribute_allgather(
        self, values: list[torch.Tensor], inputs: RankInputs, n_rows: int
    ) -> list[torch.Tensor]:
        """Each rank's contiguous slices -> full responses (one all-reduce) -> zigzag shares.

        Every rank builds its contribution from its own computed values (empty where it holds
        none), so the all-reduce is in the autograd graph on every rank or on none.
        """
        lo = inputs.cp_rank * n_rows
        parts = []
        seq_start = 0
        for value, total, response in zip(values, inputs.total_lengths, inputs.response_lengths):
            first = seq_start + total - response - 1
            before = max(lo, first) - first if value.numel() else 0
            parts.append(self.contribution(value, before, response))
            seq_start += total
        full = _AllReduceSum.apply(torch.cat(parts), inputs.cp_group, self)
        shares = []
        for resp, total, response in zip(full.split(inputs.response_lengths), inputs.total_lengths,
                                         inputs.response_lengths):
            ranges = share_ranges(total, response, inputs.cp_size, inputs.cp_rank)
            shares.append(torch.cat([resp[a:b] for a, b in ranges]))
        return shares

    def repro_call(self) -> str | None:
        """How a `shardcheck repro` script calls this target: by name, so only for the classes
        the script can load from the source tree (not a subclass written elsewhere, a test's plant)."""
        return REPRO_CALL if type(self).__module__ in ("shardcheck.targets.builtin", "shardcheck.targets.mutants") else None


# How a `shardcheck repro` script calls this target (see harness/controller/commands/repro.py): shardcheck's
# own implementation is loaded from its source tree, folder by folder as pyproject.toml maps them,
# so the script needs torch and that tree, not an installed shardcheck.
REPRO_CALL = '''
def call_code_under_test(logits, rank):
    """shardcheck's builtin target (rank.variant: the bug a mutant plants; None: none), loaded from
    its source tree rank.src, called as shardcheck calls it: compute(RankInputs)."""
    import importlib.util
    for name, folder in (("shardcheck", "shardcheck"), ("shardcheck.scenarios", "scenarios"),
                         ("shardcheck.targets", "targets")):
        if name not in sys.modules:
            path = os.path.join(rank.src, folder)
            spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                          submodule_search_locations=[path])
            sys.modules[name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(sys.modules[name])
    from shardcheck.targets.base import RankInputs
    from shardcheck.targets.mutants import builtin

    given = {k: v for k, v in vars(rank).items() if k in RankInputs.__dataclass_fields__}
    out = builtin(rank.variant).compute(RankInputs(logits=logits, **given))
    return out.log_probs, out.entropy
'''


def share_ranges(total: int, response: int, cp: int, cp_rank: int) -> list[tuple[int, int]]:
    """The response tokens a CP rank returns for one sample, as [a, b) ranges of token indices:
    the tokens its two zigzag chunks (rows of ceil(total / 2cp)) score; the whole response at cp 1."""
    if cp == 1:
        return [(0, response)]
    k = (total + 2 * cp - 1) // (2 * cp)
    first = total - response - 1  # the row scoring the first response token
    ranges = []
    for chunk in (cp_rank, 2 * cp - 1 - cp_rank):
        a, b = max(chunk * k, first), min((chunk + 1) * k, total - 1)
        ranges.append((a - first, b - first) if a < b else (0, 0))
    return ranges
