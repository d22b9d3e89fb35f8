"""Tests of the float64 single-device reference (``shardcheck.reference.truth``).

Every value and gradient is checked against a brute force computed in plain float64 torch (one
``[T, V]`` tensor, autograd for the gradient); the memory test runs the reference in a fresh
subprocess over a lazy row source and checks that peak RSS grows with ``chunk_rows``, not ``T``.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardcheck.reference import Rows, logprob_entropy, loss_grad_chunks, response_rows

F64 = torch.float64


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def brute_force(logits, targets, w_lp, w_ent, coef, temperature):
    """(logp, entropy, d loss / d logits) from one float64 [T, V] tensor and autograd."""
    z = logits.detach().to(F64).clone().requires_grad_(True)
    s = z / temperature
    log_sm = torch.log_softmax(s, dim=-1)
    logp = log_sm.gather(1, targets.unsqueeze(1)).squeeze(1)
    entropy = -(torch.softmax(s, dim=-1) * log_sm).sum(dim=-1)
    loss = (w_lp.to(F64) * logp).sum()
    if w_ent is not None:
        loss = loss - coef * (w_ent.to(F64) * entropy).sum()
    (grad,) = torch.autograd.grad(loss, z)
    return logp.detach(), entropy.detach(), grad


def assemble(chunks, num_rows, num_cols, chunk_rows):
    """Reassemble ``loss_grad_chunks`` output, checking chunk order, dtype and shapes."""
    out = torch.full((num_rows, num_cols), float("nan"), dtype=F64)
    expected_first = 0
    for first, grad in chunks:
        assert first == expected_first, f"chunk starts at {first}, expected {expected_first}"
        assert grad.dtype == F64
        assert grad.dim() == 2 and grad.size(1) == num_cols, tuple(grad.shape)
        assert 1 <= grad.size(0) <= chunk_rows, tuple(grad.shape)
        out[first : first + grad.size(0)] = grad
        expected_first += grad.size(0)
    assert expected_first == num_rows, f"chunks cover {expected_first} rows of {num_rows}"
    return out


def reference_all(logits, targets, w_lp, w_ent, coef, temperature, chunk_rows, columns=None):
    logp, ent = logprob_entropy(logits, targets, temperature=temperature, chunk_rows=chunk_rows)
    num_rows = targets.numel()
    vocab = logits.size(1) if isinstance(logits, torch.Tensor) else logits.vocab
    num_cols = len(range(vocab)[columns]) if columns is not None else vocab
    grad = assemble(
        loss_grad_chunks(
            logits, targets, w_lp, w_ent,
            entropy_coef=coef, temperature=temperature, chunk_rows=chunk_rows, columns=columns,
        ),
        num_rows, num_cols, chunk_rows,
    )
    return logp, ent, grad


def assert_close_to_truth(got, want, name, rtol=1e-10):
    """Tight float64 comparison; absolute floor scaled to the tensor's magnitude."""
    assert got.dtype == F64, f"{name}: dtype {got.dtype}"
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values {got}"
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * scale, msg=lambda m: f"{name}: {m}")


def make_logits(kind, num_rows, vocab, dtype, gen):
    if kind == "equal":
        z = torch.full((num_rows, vocab), 2.5)
    elif kind == "huge":
        z = torch.randn(num_rows, vocab, generator=gen, dtype=F64) * 1e4
    elif kind == "wide":
        z = torch.randn(num_rows, vocab, generator=gen, dtype=F64) * 30
    else:
        z = torch.randn(num_rows, vocab, generator=gen, dtype=F64) * 2
    return z.to(dtype)


def make_inputs(num_rows, vocab, gen, with_entropy=True):
    targets = torch.randint(0, vocab, (num_rows,), generator=gen)
    w_lp = torch.rand(num_rows, generator=gen, dtype=F64) * 2 - 0.5
    w_lp[::3] = 0.0  # some rows not scored
    w_ent = torch.rand(num_rows, generator=gen, dtype=F64) if with_entropy else None
    return targets, w_lp, w_ent


# --------------------------------------------------------------------------------------------
# 1. brute force comparison
# --------------------------------------------------------------------------------------------

# (T, V, temperature, kind, dtype, entropy_coef, w_entropy present, chunk_rows)
CASES = [
    (10, 37, 1.0, "randn", torch.float64, 0.0, True, 3),
    (10, 13, 0.3, "randn", torch.float32, 0.5, True, 1),
    (7, 64, 1.7, "wide", torch.bfloat16, 0.2, True, 4),
    (10, 37, 1.7, "randn", torch.float64, 0.5, False, 3),  # w_entropy=None, coef != 0
    (6, 16, 1.0, "equal", torch.float64, 0.7, True, 5),
    (6, 13, 0.3, "equal", torch.float32, 0.7, True, 2),
    (9, 37, 1.0, "huge", torch.float64, 0.4, True, 3),
    (9, 40, 1.7, "huge", torch.float32, -0.4, True, 256),
    (9, 13, 0.3, "huge", torch.bfloat16, 1.0, True, 1),
    (5, 1, 1.0, "randn", torch.float64, 0.5, True, 2),
    (5, 1, 0.3, "randn", torch.bfloat16, 0.5, True, 1),
    (12, 37, 0.3, "wide", torch.float32, 0.0, False, 12),
]


def _case_id(case):
    t, v, temp, kind, dtype, coef, ent, chunk = case
    return f"T{t}-V{v}-t{temp}-{kind}-{str(dtype)[6:]}-c{coef}-{'went' if ent else 'noent'}-ch{chunk}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_matches_brute_force(case):
    num_rows, vocab, temperature, kind, dtype, coef, with_ent, chunk_rows = case
    gen = torch.Generator().manual_seed(zlib.crc32(_case_id(case).encode()))
    logits = make_logits(kind, num_rows, vocab, dtype, gen)
    targets, w_lp, w_ent = make_inputs(num_rows, vocab, gen, with_ent)
    original = logits.clone()

    want_lp, want_ent, want_grad = brute_force(logits, targets, w_lp, w_ent, coef, temperature)
    assert torch.isfinite(want_grad).all()
    got_lp, got_ent, got_grad = reference_all(
        logits, targets, w_lp, w_ent, coef, temperature, chunk_rows
    )
    assert_close_to_truth(got_lp, want_lp, "logp")
    assert_close_to_truth(got_ent, want_ent, "entropy")
    assert_close_to_truth(got_grad, want_grad, "grad")

    # a column subset of the gradient is exactly that slice of the full gradient
    a, b = vocab // 3, vocab - vocab // 4
    _, _, got_sub = reference_all(
        logits, targets, w_lp, w_ent, coef, temperature, chunk_rows, columns=slice(a, b)
    )
    assert_close_to_truth(got_sub, want_grad[:, a:b], f"grad[:, {a}:{b}]")
    torch.testing.assert_close(got_sub, got_grad[:, a:b], rtol=0, atol=0)

    # the inputs are not modified
    assert torch.equal(logits, original)

    if kind == "equal":
        log_v = math.log(vocab)
        torch.testing.assert_close(got_ent, torch.full_like(got_ent, log_v), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got_lp, torch.full_like(got_lp, -log_v), rtol=1e-12, atol=1e-12)
        # uniform p: the entropy term vanishes, d/dz = w_lp * (onehot - 1/V) / t
        expected = -w_lp.unsqueeze(1).expand(num_rows, vocab) / vocab
        expected = expected.clone().scatter_add_(1, targets.unsqueeze(1), w_lp.unsqueeze(1))
        assert_close_to_truth(got_grad, expected / temperature, "uniform grad")
    if vocab == 1:
        assert torch.equal(got_lp, torch.zeros(num_rows, dtype=F64)), got_lp
        assert torch.equal(got_ent, torch.zeros(num_rows, dtype=F64)), got_ent
        assert torch.equal(got_grad, torch.zeros(num_rows, 1, dtype=F64)), got_grad
    if dtype != torch.float64:
        # the given low-precision values are upcast exactly: within a few float64 ulps of the
        # brute force's log-probs (torch.log_softmax on the same float64 values)
        ulp = torch.finfo(F64).eps * want_lp.abs().clamp(min=1.0)
        assert ((got_lp - want_lp).abs() <= 4 * ulp).all(), ((got_lp - want_lp).abs() / ulp).max()


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    num_rows=st.integers(1, 12),
    vocab=st.integers(1, 50),
    temperature=st.sampled_from([0.3, 0.5, 1.0, 1.7, 2.5]),
    kind=st.sampled_from(["randn", "wide", "huge", "equal"]),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
    coef=st.sampled_from([0.0, 0.3, -0.2, 1.0]),
    with_ent=st.booleans(),
    chunk_rows=st.integers(1, 14),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_matches_brute_force_random(
    num_rows, vocab, temperature, kind, dtype, coef, with_ent, chunk_rows, seed, data
):
    gen = torch.Generator().manual_seed(seed)
    logits = make_logits(kind, num_rows, vocab, dtype, gen)
    targets, w_lp, w_ent = make_inputs(num_rows, vocab, gen, with_ent)
    a = data.draw(st.integers(0, vocab), label="col_start")
    b = data.draw(st.integers(a, vocab), label="col_stop")

    want_lp, want_ent, want_grad = brute_force(logits, targets, w_lp, w_ent, coef, temperature)
    got_lp, got_ent, got_grad = reference_all(
        logits, targets, w_lp, w_ent, coef, temperature, chunk_rows
    )
    assert_close_to_truth(got_lp, want_lp, "logp")
    assert_close_to_truth(got_ent, want_ent, "entropy")
    assert_close_to_truth(got_grad, want_grad, "grad")
    _, _, got_sub = reference_all(
        logits, targets, w_lp, w_ent, coef, temperature, chunk_rows, columns=slice(a, b)
    )
    assert_close_to_truth(got_sub, want_grad[:, a:b], f"grad[:, {a}:{b}]")


def test_entropy_coef_zero_ignores_entropy_weights():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(10, 37, generator=gen, dtype=F64)
    targets, w_lp, w_ent = make_inputs(10, 37, gen)
    _, _, g_none = reference_all(logits, targets, w_lp, None, 0.0, 1.3, 3)
    _, _, g_zero = reference_all(logits, targets, w_lp, w_ent, 0.0, 1.3, 3)
    _, _, g_coef = reference_all(logits, targets, w_lp, w_ent, 0.5, 1.3, 3)
    assert torch.equal(g_none, g_zero)
    assert (g_coef - g_zero).abs().max() > 1e-3  # the entropy term really contributes


def test_device_argument_and_empty_input():
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(5, 13, generator=gen)
    targets = torch.randint(0, 13, (5,), generator=gen)
    lp, ent = logprob_entropy(logits, targets, chunk_rows=2)
    lp_d, ent_d = logprob_entropy(logits, targets, chunk_rows=2, device="cpu")
    assert torch.equal(lp, lp_d) and torch.equal(ent, ent_d)
    lp0, ent0 = logprob_entropy(torch.zeros(0, 13), torch.zeros(0, dtype=torch.long))
    assert lp0.shape == (0,) and ent0.shape == (0,) and lp0.dtype == ent0.dtype == F64
    chunks = list(
        loss_grad_chunks(torch.zeros(0, 13), torch.zeros(0, dtype=torch.long), torch.zeros(0), None)
    )
    assert chunks == []


def _written_out(z_row, y, w_lp, w_ent, coef, temperature, kept=None):
    """(logp, entropy, d loss / d z) of one row, written out in Python floats (math.exp,
    math.fsum), from the definitions in the reference's docstring: an independent float64
    computation, sharing no code with the reference."""
    s = [x / temperature for x in z_row]
    m = max(s)
    e = [math.exp(x - m) for x in s]
    total = math.fsum(e)
    p = [x / total for x in e]
    log_z = m + math.log(total)
    entropy = -math.fsum(pv * (sv - log_z) for pv, sv in zip(p, s))
    mean = m + math.fsum(pv * (sv - m) for pv, sv in zip(p, s))  # sum_v p_v s_v, shifted for accuracy
    pool = range(len(s)) if kept is None else sorted(set(kept) | {y})
    mk = max(s[v] for v in pool)
    total_k = math.fsum(math.exp(s[v] - mk) for v in pool)
    q = [0.0] * len(s)
    for v in pool:
        q[v] = math.exp(s[v] - mk) / total_k
    logp = (s[y] - mk) - math.log(total_k)
    grad = []
    for v in range(len(s)):
        g = w_lp * ((1.0 if v == y else 0.0) - q[v])
        if w_ent is not None:
            g += coef * w_ent * p[v] * ((s[v] - m) - (mean - m))
        grad.append(g / temperature)
    return logp, entropy, grad


# (T, V, temperature, entropy_coef, w_entropy present, chunk_rows, logits' common offset)
WRITTEN_OUT_CASES = [
    (5, 9, 1.0, 0.3, True, 2, 0.0),
    (5, 9, 0.7, -0.5, True, 1, 0.0),
    (6, 11, 1.3, 0.0, True, 4, 0.0),
    (4, 8, 0.7, 0.4, False, 3, 0.0),
    (5, 9, 0.7, 0.3, True, 5, 1000.0),  # a large common offset: the shift by the row's max
    (3, 1, 0.5, 0.3, True, 2, 0.0),
]


@pytest.mark.parametrize("case", WRITTEN_OUT_CASES, ids=[f"T{c[0]}-V{c[1]}-t{c[2]}-c{c[3]}-off{c[6]}"
                                                        for c in WRITTEN_OUT_CASES])
def test_matches_the_formulas_written_out(case):
    """The reference's values and gradient (one exp per element: d = s - max s and exp(d), the
    gradient e * (alpha d + b) / (S t), the column range computed alone) against the formulas
    written out element by element; also peaked rows, a keep set, and column ranges that hold
    the target, miss it, are empty, or step."""
    num_rows, vocab, temperature, coef, with_ent, chunk_rows, offset = case
    gen = torch.Generator().manual_seed(vocab * 31 + num_rows)
    logits = torch.randn(num_rows, vocab, generator=gen, dtype=F64) * 2 + offset
    if vocab > 1:
        logits[0, 1] += 40.0  # a peaked row: p nearly one-hot, most p_v tiny
    targets = torch.randint(0, vocab, (num_rows,), generator=gen)
    w_lp = torch.rand(num_rows, generator=gen, dtype=F64) * 2 - 0.5
    w_ent = torch.rand(num_rows, generator=gen, dtype=F64) if with_ent else None
    keep = {num_rows - 1: [0, vocab - 1]} if vocab > 2 else None
    rows = [
        _written_out(logits[r].tolist(), int(targets[r]), float(w_lp[r]),
                     float(w_ent[r]) if with_ent else None, coef, temperature,
                     (keep or {}).get(r))
        for r in range(num_rows)
    ]
    want_lp = torch.tensor([r[0] for r in rows], dtype=F64)
    want_ent = torch.tensor([r[1] for r in rows], dtype=F64)
    want_grad = torch.tensor([r[2] for r in rows], dtype=F64)

    got_lp, got_ent = logprob_entropy(logits, targets, temperature=temperature, chunk_rows=chunk_rows, keep=keep)
    torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_ent, want_ent, rtol=0, atol=1e-12)
    columns = [None, slice(1, vocab - 1), slice(vocab // 2, vocab // 2), slice(0, None, 3), slice(1, None, 2)]
    full = None
    for cols in columns:
        got = assemble(
            loss_grad_chunks(logits, targets, w_lp, w_ent, entropy_coef=coef, temperature=temperature,
                             chunk_rows=chunk_rows, columns=cols, keep=keep),
            num_rows, len(range(vocab)[cols or slice(None)]), chunk_rows,
        )
        torch.testing.assert_close(got, want_grad[:, cols or slice(None)], rtol=0, atol=1e-12,
                                   msg=lambda m: f"columns {cols}: {m}")
        if cols is None:
            full = got
        else:  # a column range is exactly that slice of the whole gradient
            torch.testing.assert_close(got, full[:, cols], rtol=0, atol=0, msg=lambda m: f"columns {cols}: {m}")


# --------------------------------------------------------------------------------------------
# 2. lazy Rows source
# --------------------------------------------------------------------------------------------


class SeededRows:
    """Row i is ``randn(V)`` from a generator seeded with ``seed + i``: any range, any order."""

    def __init__(self, num_rows, vocab, seed, scale=3.0, dtype=torch.float32):
        self.num_rows, self.vocab, self.seed, self.scale, self.dtype = (
            num_rows, vocab, seed, scale, dtype,
        )
        self.calls = []

    def rows(self, start, stop):
        self.calls.append((start, stop))
        gen = torch.Generator()
        out = torch.empty(stop - start, self.vocab, dtype=F64)
        for i in range(start, stop):
            gen.manual_seed(self.seed + i)
            out[i - start] = torch.randn(self.vocab, generator=gen, dtype=F64) * self.scale
        return out.to(self.dtype)


@pytest.mark.parametrize("chunk_rows", [1, 3, 4, 64])
def test_rows_source_matches_tensor(chunk_rows):
    num_rows, vocab = 11, 37
    src = SeededRows(num_rows, vocab, seed=1234)
    assert isinstance(src, Rows)
    full = SeededRows(num_rows, vocab, seed=1234).rows(0, num_rows)
    gen = torch.Generator().manual_seed(99)
    targets, w_lp, w_ent = make_inputs(num_rows, vocab, gen)

    lazy = reference_all(src, targets, w_lp, w_ent, 0.3, 0.7, chunk_rows)
    # the source is read chunk by chunk, never whole (unless one chunk covers it)
    assert src.calls, "rows() never called"
    assert all(0 <= a < b <= num_rows and b - a <= chunk_rows for a, b in src.calls), src.calls
    eager = reference_all(full, targets, w_lp, w_ent, 0.3, 0.7, chunk_rows)
    for name, x, y in zip(("logp", "entropy", "grad"), lazy, eager):
        assert torch.equal(x, y), f"{name}: Rows source differs from the tensor"
    truth = brute_force(full, targets, w_lp, w_ent, 0.3, 0.7)
    for name, x, y in zip(("logp", "entropy", "grad"), lazy, truth):
        assert_close_to_truth(x, y, name)


# --------------------------------------------------------------------------------------------
# 3. memory: peak grows with the chunk, not with T * V
# --------------------------------------------------------------------------------------------

_MEM_SCRIPT = textwrap.dedent(
    """
    import resource, sys, torch
    from shardcheck.reference import logprob_entropy, loss_grad_chunks

    T, V, CHUNK = (int(a) for a in sys.argv[1:4])

    def status_kib(key):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
        raise KeyError(key)

    class Lazy:
        def __init__(self, n, v, seed):
            self.num_rows, self.v, self.seed = n, v, seed
        def rows(self, a, b):  # generated on demand: the full [T, V] never exists
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + a)
            return torch.randn(b - a, self.v, generator=g)

    # warm up (imports, kernels, allocator) on a tiny problem
    w = Lazy(4, 16, 1)
    t4 = torch.zeros(4, dtype=torch.long)
    logprob_entropy(w, t4, chunk_rows=2, temperature=0.7)
    for _ in loss_grad_chunks(w, t4, torch.ones(4), torch.ones(4), entropy_coef=0.1,
                              temperature=0.7, chunk_rows=2):
        pass

    # Reset this process's high-water mark to its current RSS, so the transient peak of
    # `import torch` is not counted (Linux >= 4.0; if refused, the growth is under-reported
    # and the test's lower-bound check fails rather than passing vacuously).
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = 1
    except OSError:
        reset = 0
    before = status_kib("VmHWM")
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    src = Lazy(T, V, 7)
    targets = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(3))
    w = torch.ones(T, dtype=torch.float64)
    lp, ent = logprob_entropy(src, targets, chunk_rows=CHUNK, temperature=0.7)
    assert lp.shape == (T,) and bool(torch.isfinite(lp).all() and torch.isfinite(ent).all())
    rows = 0
    for first, g in loss_grad_chunks(src, targets, w, w, entropy_coef=0.01, temperature=0.7,
                                     chunk_rows=CHUNK):
        assert first == rows and g.shape[1] == V
        rows += g.shape[0]
    assert rows == T
    del g
    after = status_kib("VmHWM")
    maxrss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # bytes: peak growth (VmHWM), ru_maxrss growth, reset flag
    print((after - before) * 1024, (maxrss_after - maxrss_before) * 1024, reset)
    """
)

MEM_V = 32768
MEM_T = 256
MEM_CHUNK = 16
MIB = 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB and glibc")
def _peak_memory(folder):
    """The three measuring processes, in the background: {config: (hwm growth, ru_maxrss growth, reset)}."""
    # Peak RSS is read as VmHWM of the child, i.e. the high-water mark that ru_maxrss reports
    # for the process's own image. ru_maxrss itself is not usable from a child of pytest: on
    # exec, Linux folds the parent's (pytest + torch, hundreds of MiB) peak into the child's
    # ru_maxrss, which then hides the reference's growth (measured: 0 MiB for chunk 16).
    env = dict(os.environ)
    # Pin glibc's (otherwise dynamic) mmap threshold so that every large tensor is its own
    # mapping, returned to the OS when freed: peak RSS then tracks the live tensors. Without it
    # heap fragmentation makes ru_maxrss erratic (measured 136 MiB vs 960 MiB for the same run).
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    env.setdefault("OMP_NUM_THREADS", "1")
    configs = {
        "base": (MEM_T, MEM_CHUNK),
        "4x rows": (4 * MEM_T, MEM_CHUNK),
        "4x chunk": (MEM_T, 4 * MEM_CHUNK),
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", _MEM_SCRIPT, str(t), str(MEM_V), str(c)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        for name, (t, c) in configs.items()
    }
    measured = {}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"{name}: subprocess failed:\n{err}"
            measured[name] = tuple(map(int, out.strip().splitlines()[-1].split()))
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
    return configs, measured


BACKGROUND = {"peak-memory": (_peak_memory, 180)}


@pytest.mark.background("peak-memory")
def test_peak_memory_grows_with_chunk_not_with_rows(background):
    configs, measured = background("peak-memory")
    growth, maxrss, resets = ({name: m[k] for name, m in measured.items()} for k in range(3))

    figures = ", ".join(
        f"{name} (T={t}, chunk={c}): {growth[name] / MIB:.1f} MiB"
        f" [ru_maxrss growth {maxrss[name] / MIB:.1f} MiB, hwm reset={resets[name]}]"
        for name, (t, c) in configs.items()
    )
    print(f"\npeak RSS growth, V={MEM_V}: {figures}")
    chunk_bytes = MEM_CHUNK * MEM_V * 8
    naive_4x = 4 * MEM_T * MEM_V * 8

    # the measurement sees the work: at least one float64 chunk was live
    assert growth["base"] >= chunk_bytes, f"implausibly small growth: {figures}"
    # (a) 4x the rows at a fixed chunk: about the same peak, far below a float64 [T, V]
    assert growth["4x rows"] <= 1.25 * growth["base"] + 4 * MIB, f"grows with T: {figures}"
    assert growth["4x rows"] <= naive_4x / 4, (
        f"not far below the naive [T, V] float64 ({naive_4x / MIB:.0f} MiB): {figures}"
    )
    # (b) 4x the chunk at a fixed T: clearly more
    assert growth["4x chunk"] >= 2.5 * growth["base"], f"does not grow with the chunk: {figures}"


# --------------------------------------------------------------------------------------------
# 4. response_rows
# --------------------------------------------------------------------------------------------


def test_response_rows():
    assert response_rows(8, 3) == slice(4, 7)
    assert list(range(8)[response_rows(8, 3)]) == [4, 5, 6]
    for total in (2, 5, 8):
        assert response_rows(total, total - 1) == slice(0, total - 1)  # prompt of length 1
    # row p predicts token p + 1: the response tokens are the last `response` of the sample
    tokens = list(range(100, 108))
    rows = range(8)[response_rows(8, 3)]
    assert [tokens[p + 1] for p in rows] == tokens[-3:]


# --------------------------------------------------------------------------------------------
# 5. bad arguments
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "targets",
    [torch.zeros(4, dtype=torch.long), torch.zeros(6, dtype=torch.long),
     torch.zeros(5, 1, dtype=torch.long)],
    ids=["short", "long", "2d"],
)
def test_bad_targets_raise(targets):
    logits = torch.randn(5, 7)
    w = torch.ones(5)
    with pytest.raises(ValueError, match="targets"):
        logprob_entropy(logits, targets)
    with pytest.raises(ValueError, match="targets"):
        list(loss_grad_chunks(logits, targets, w, w, entropy_coef=0.1))
    with pytest.raises(ValueError, match="targets"):
        logprob_entropy(SeededRows(5, 7, 0), targets)


@pytest.mark.parametrize("chunk_rows", [0, -1])
def test_bad_chunk_rows_raise(chunk_rows):
    logits = torch.randn(5, 7)
    targets = torch.zeros(5, dtype=torch.long)
    w = torch.ones(5)
    # match the message: range(0, T, 0) would raise a ValueError of its own
    with pytest.raises(ValueError, match="chunk_rows"):
        logprob_entropy(logits, targets, chunk_rows=chunk_rows)
    with pytest.raises(ValueError, match="chunk_rows"):
        list(loss_grad_chunks(logits, targets, w, w, chunk_rows=chunk_rows))


def test_bad_logits_shape_raises():
    with pytest.raises(ValueError):
        logprob_entropy(torch.randn(5), torch.zeros(5, dtype=torch.long))
