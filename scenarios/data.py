"""Deterministic inputs of a scenario: logits, tokens and loss weights, generated from its seed.

Every rank generates only what it holds, and the same row always gets the same values wherever
it is generated: rows come in fixed blocks, each drawn from a generator keyed by
(seed, stream identity, block). A stream is a sample (its positions past the sample's end are
padding) or the tail padding of the packed all-gather sequence. A sample's identity is its
``data_id`` (default: its index), not its place in the batch, so a sample moved to another place,
packed with other samples or alone, carries the same tokens, logits and weights.
"""

from __future__ import annotations

import hashlib

import torch

from shardcheck.scenarios.scenario import Scenario, data_id

BLOCK_ROWS = 64
LOGIT_SCALE = 2.0
PAD_SCALE = 4.0  # padding rows are garbage, not zeros: an implementation must ignore them

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def _generator(*key: object) -> torch.Generator:
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


LOSS_FORMS = ("weighted", "policy", "step")
# a training step's objectives over the global batch (loss "step"), as every report words them
OBJECTIVES = {
    "sample_mean": "each sample's masked token mean, averaged over the samples",
    "token_mean": "the mean over every masked-in token of the global batch",
}
MASKED_FRACTION = 0.15  # policy form: response tokens whose loss mask is 0


class ScenarioData:
    """The inputs of one scenario; cheap to build, generates lazily.

    ``loss`` is the form of the loss whose gradient is checked (see :meth:`loss_weights`):
    "weighted" when the harness builds the loss from a target's outputs, "policy" when the
    target computes a PPO policy loss itself from the advantages and loss masks given here,
    "step" when that loss runs in a training step over the scenario as the global batch, whose
    ``objective`` ("sample_mean" or "token_mean") the target declares.
    """

    def __init__(self, scenario: Scenario, loss: str = "weighted", objective: str = "sample_mean",
                 token_floor: int = 0) -> None:
        if loss not in LOSS_FORMS:
            raise ValueError(f"loss form must be one of {LOSS_FORMS}, got {loss!r}")
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
        self.scenario = scenario
        self.loss = loss
        self.objective = objective
        self.token_floor = token_floor  # token_mean: each sample counts at least this many
        self._masked_in: int | None = None
        self.dtype = torch_dtype(scenario.dtype)
        self.tail_stream = len(scenario.samples)
        self._token_cache: dict[int, torch.Tensor] = {}
        self._keep_cache: dict[int, list] = {}

    def tokens(self, sample: int) -> torch.Tensor:
        """The sample's token ids, int64 ``[total]``."""
        if sample not in self._token_cache:
            s = self.scenario
            g = _generator(s.seed, "tokens", data_id(s, sample))
            total = s.samples[sample].total
            tokens = torch.randint(0, s.vocab, (total,), generator=g, dtype=torch.int64)
            if s.sampling:  # each response token drawn from its row's filtered set
                from shardcheck.scenarios.keep import draw_inside

                prompt = s.samples[sample].prompt
                tokens[prompt:] = torch.tensor(draw_inside(s.seed, data_id(s, sample), self._sampled(sample)))
            self._token_cache[sample] = tokens
        return self._token_cache[sample].clone()

    def _sampled(self, sample: int) -> list[tuple[int, ...]]:
        """A sampling scenario's keep set of each response token, filtered from the logits (as
        the scenario's dtype holds them) at the scenario's temperature."""
        if sample not in self._keep_cache:
            from shardcheck.scenarios.keep import sampling_keep

            s = self.scenario
            prompt, total = s.samples[sample].prompt, s.samples[sample].total
            rows = self.logit_rows(sample, prompt - 1, total - 1).to(torch.float64) / s.temperature
            self._keep_cache[sample] = sampling_keep(rows, s.top_k, s.top_p)
        return self._keep_cache[sample]

    def keep_sets(self, sample: int) -> list[tuple[int, ...] | None] | None:
        """Per response token, the ids its sampler kept (None: none recorded); None for a
        scenario without replayed keep sets."""
        s = self.scenario
        if not s.replay_keep:
            return None
        if sample not in self._keep_cache and s.keep_sets is not None:  # given as they are
            self._keep_cache[sample] = list(s.keep_sets[sample])
        if sample not in self._keep_cache:
            from shardcheck.scenarios.keep import keep_sets

            response = self.tokens(sample)[s.samples[sample].prompt:].tolist()
            self._keep_cache[sample] = keep_sets(s.seed, data_id(s, sample), response, s.vocab)
        return list(self._keep_cache[sample])

    def keep_at(self, stream: int, pos: int) -> tuple[int, ...] | None:
        """The keep set of the token row ``pos`` of ``stream`` predicts, replayed or filtered
        from the logits (None: unprocessed)."""
        if stream >= len(self.scenario.samples) or not self.scenario.processed:
            return None
        if stream not in self._keep_cache:
            self._sampled(stream) if self.scenario.sampling else self.keep_sets(stream)
        sets = self._keep_cache[stream]  # read in place: this is asked once per row
        j = pos + 1 - self.scenario.samples[stream].prompt  # row pos predicts token pos + 1
        return sets[j] if 0 <= j < len(sets) else None

    def logit_rows(self, stream: int, start: int, stop: int) -> torch.Tensor:
        """Logit rows ``[start, stop)`` of a stream, ``[stop - start, vocab]`` in the scenario dtype.

        For a sample stream, rows at or past the sample's total length are padding.
        """
        if stop <= start:
            return torch.empty((0, self.scenario.vocab), dtype=self.dtype)
        first, last = start // BLOCK_ROWS, (stop - 1) // BLOCK_ROWS
        blocks = [self._block(stream, b) for b in range(first, last + 1)]
        rows = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
        offset = first * BLOCK_ROWS
        return rows[start - offset : stop - offset]

    def _block(self, stream: int, block: int) -> torch.Tensor:
        s = self.scenario
        positions = torch.arange(block * BLOCK_ROWS, (block + 1) * BLOCK_ROWS)
        if stream == self.tail_stream:
            g = _generator(s.seed, "logits", "tail", block)
            is_pad = torch.ones(BLOCK_ROWS, dtype=torch.bool)
        else:
            g = _generator(s.seed, "logits", data_id(s, stream), block)
            is_pad = positions >= s.samples[stream].total
        rows = torch.randn((BLOCK_ROWS, s.vocab), generator=g, dtype=torch.float32)
        scale = torch.where(is_pad, PAD_SCALE, LOGIT_SCALE).unsqueeze(1)
        return (rows * scale).to(self.dtype)

    def loss_weights(self, sample: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per response token weights ``(w_logprob, w_entropy)``, float32 ``[response]`` each, of
        loss = sum(w_logprob * logp) - entropy_coef * sum(w_entropy * entropy).

        "weighted": independent uniform weights in [-1, 1].
        "step": the same PPO loss reduced over the whole scenario, the global batch, by the
        objective: "sample_mean" divides sample i's terms by D_i * n (n samples), "token_mean" by
        the masked-in tokens of every sample.
        "policy": the per-sample token mean of a PPO policy loss at ratio 1 (old log-probs equal
        to the current ones, so no clipping acts; KL off): with advantages A, loss mask m and
        D = max(sum m, 1), loss = sum(-A * m / D * ratio) - entropy_coef * sum(m / D * entropy),
        whose gradient is that of w_logprob = -A * m / D, w_entropy = m / D.
        """
        if self.loss in ("policy", "step"):
            mask = self.loss_mask(sample).float()
            denom: torch.Tensor | float = mask.sum().clamp_min(1)
            if self.loss == "step":  # the same PPO loss, reduced over the whole batch by the objective
                denom = (float(self.masked_in_tokens()) if self.objective == "token_mean"
                         else float(denom) * len(self.scenario.samples))
            return -self.advantages(sample) * mask / denom, mask / denom
        s = self.scenario
        g = _generator(s.seed, "weights", data_id(s, sample))
        w = torch.rand((2, s.samples[sample].response), generator=g, dtype=torch.float32) * 2 - 1
        return w[0].clone(), w[1].clone()

    def masked_in_tokens(self) -> int:
        """The response tokens of every sample whose loss mask is 1, each sample counting at least
        ``token_floor`` (and the whole at least 1): a token mean's denominator over the global batch."""
        if self._masked_in is None:
            self._masked_in = max(1, sum(max(int(self.loss_mask(i).sum()), self.token_floor)
                                         for i in range(len(self.scenario.samples))))
        return self._masked_in

    def advantages(self, sample: int) -> torch.Tensor:
        """Per response token advantages, float32 in [-1, 1] (the policy loss form)."""
        s = self.scenario
        g = _generator(s.seed, "advantages", data_id(s, sample))
        return torch.rand(s.samples[sample].response, generator=g, dtype=torch.float32) * 2 - 1

    def loss_mask(self, sample: int) -> torch.Tensor:
        """Per response token loss mask, int32 0/1, mostly 1 (the policy loss form)."""
        s = self.scenario
        g = _generator(s.seed, "loss_mask", data_id(s, sample))
        return (torch.rand(s.samples[sample].response, generator=g) >= MASKED_FRACTION).to(torch.int32)
