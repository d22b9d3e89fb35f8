"""The reference for processed log-probs (a top-p / top-k keep set per row), against brute force:
the renormalised log-prob written out with math.exp, its gradient by autograd on that formula."""

import math

import pytest
import torch

from shardcheck.reference import logprob_entropy, loss_grad_chunks

V, T = 7, 6
TEMPERATURE = 0.7
# row -> kept ids: one token (the target), the whole vocabulary, the target outside its set,
# an empty set, a set straddling two halves of the vocabulary; row 5 has none (unprocessed)
KEEP = {0: [3], 1: list(range(V)), 2: [0, 1], 3: [], 4: [2, 3, 4, 5]}


@pytest.fixture
def case():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(T, V, generator=g, dtype=torch.float64) * 3
    targets = torch.tensor([3, 5, 6, 2, 0, 4])
    return logits, targets


def _brute_logp(s: list[float], y: int, kept: list[int] | None) -> float:
    pool = range(len(s)) if kept is None else sorted(set(kept) | {y})
    return s[y] - math.log(sum(math.exp(s[v]) for v in pool))


def _brute_entropy(s: list[float]) -> float:
    z = sum(math.exp(x) for x in s)
    return -sum(math.exp(x) / z * (x - math.log(z)) for x in s)


def test_processed_values_are_the_renormalised_log_prob_and_the_whole_entropy(case):
    logits, targets = case
    lp, ent = logprob_entropy(logits, targets, temperature=TEMPERATURE, keep=KEEP, chunk_rows=4)
    for r in range(T):
        s = (logits[r] / TEMPERATURE).tolist()
        y = int(targets[r])
        assert lp[r].item() == pytest.approx(_brute_logp(s, y, KEEP.get(r)), abs=1e-12), r
        assert ent[r].item() == pytest.approx(_brute_entropy(s), abs=1e-12), r
    assert lp[0].item() == 0.0 and lp[3].item() == 0.0  # only the target left to normalise over
    plain, _ = logprob_entropy(logits, targets, temperature=TEMPERATURE)
    assert lp[1].item() == pytest.approx(plain[1].item(), abs=1e-12)  # the whole vocabulary kept
    assert lp[5].item() == plain[5].item()  # no keep set: unprocessed
    assert lp[2].item() > plain[2].item()  # renormalised over fewer tokens


@pytest.mark.parametrize("entropy_coef", [0.0, 0.3])
def test_processed_gradient_is_autograd_of_the_brute_formula(case, entropy_coef):
    logits, targets = case
    w_lp = torch.tensor([1.0, 0.5, 2.0, 1.0, 0.0, 1.5], dtype=torch.float64)
    w_ent = torch.tensor([0.5, 1.0, 1.0, 0.0, 2.0, 1.0], dtype=torch.float64)
    z = logits.clone().requires_grad_()
    loss = 0.0
    for r in range(T):
        s = z[r] / TEMPERATURE
        y = int(targets[r])
        pool = list(range(V)) if r not in KEEP else sorted(set(KEEP[r]) | {y})
        loss = loss + w_lp[r] * (s[y] - torch.logsumexp(s[pool], 0))
        p = torch.softmax(s, 0)
        loss = loss - entropy_coef * w_ent[r] * -(p * torch.log_softmax(s, 0)).sum()
    (want,) = torch.autograd.grad(loss, z)
    got = torch.zeros_like(logits)
    for start, chunk in loss_grad_chunks(logits, targets, w_lp, w_ent, entropy_coef=entropy_coef,
                                         temperature=TEMPERATURE, chunk_rows=4, keep=KEEP):
        got[start:start + chunk.shape[0]] = chunk
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_a_keep_set_outside_the_vocabulary_or_the_rows_is_refused(case):
    logits, targets = case
    with pytest.raises(ValueError, match="names token 7, outside the vocabulary of 7"):
        logprob_entropy(logits, targets, keep={0: [1, 7]})
    with pytest.raises(ValueError, match="keep set for row 6, outside the 6 rows"):
        loss_grad_chunks(logits, targets, torch.ones(T), None, keep={6: [1]})
