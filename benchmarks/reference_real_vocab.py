"""The float64 reference at a real vocabulary: V = 151,936 (Qwen's), T = 32,768 rows, on CPU.

The logits (float32, 19.9 GB at the full size) are never held whole: they are generated a block
of BLOCK rows at a time. Each block, once generated, is handed in turn to the three phases, each
timed on its own (the generation is not in any phase's time, and nothing is subtracted):

- the baseline: a plain float32 ``torch.log_softmax`` and gather over the block;
- the reference's log-probs and entropy (``reference.truth.logprob_entropy``);
- its gradient (``reference.truth.loss_grad_chunks``, consumed chunk by chunk as the harness does).

On each block the three run ``--repeat`` times (3), in an order that turns round after round and
block after block, and each phase keeps its fastest run on the block: a burst of someone else's
load stretches one run, not the figure, and falls on all three phases alike. The ratios to the
baseline are printed as total over total (the sums of those fastest runs) and as the median of
the blocks' ratios. Goals (issue 24): the values
within 1.5x of the baseline, the gradient within 3x.

The peak memory of the reference is measured apart: the values and the gradient each run once
more, over the same number of rows generated as the reference asks for them, in a process of
its own (its VmHWM, the high-water mark of its own memory; ``ru_maxrss`` of a child also counts
its parent's). Goal: 0.5 GiB. ``--device cuda`` runs the same on a GPU (peak: torch's max
allocated).

Torch runs one thread (``--threads``), as the harness's ranks do (``harness/rank/main.py``): with
two, on a machine others share, every one of the reference's many small ops waits at its end for
the thread that was not scheduled, and the figures measure the machine's load.

    python benchmarks/reference_real_vocab.py [--rows 32768] [--vocab 151936] [--device cpu] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

BLOCK = 256  # rows generated at a time (and the baseline's chunk)
PHASES = ("baseline", "values", "grad")
ENTROPY_COEF = 0.01


class GeneratedRows:
    """Deterministic float32 logits, made on demand (as ScenarioData makes a scenario's, without
    holding them): rows ``start:stop`` from a generator seeded with ``start``."""

    def __init__(self, rows: int, vocab: int, device: str) -> None:
        self.num_rows, self.vocab, self.device = rows, vocab, device

    def rows(self, start: int, stop: int) -> torch.Tensor:
        g = torch.Generator(device=self.device).manual_seed(start)
        return torch.randn((stop - start, self.vocab), generator=g, device=self.device) * 2.0


def _inputs(rows: int, vocab: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    targets = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(1)).to(device)
    w = torch.rand(rows, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 2 - 1
    return targets, w


def _run(name: str, logits, targets: torch.Tensor, w: torch.Tensor, device: str) -> float:
    """One phase over ``logits`` (a [n, V] tensor or a lazy source); a checksum."""
    from shardcheck.reference.truth import logprob_entropy, loss_grad_chunks

    if name == "baseline":
        return float(torch.log_softmax(logits, dim=-1).gather(1, targets.unsqueeze(1)).sum())
    if name == "values":
        logp, entropy = logprob_entropy(logits, targets, device=device)
        return float(logp.sum() + entropy.sum())
    checksum = 0.0
    for _, grad in loss_grad_chunks(logits, targets, w, w, entropy_coef=ENTROPY_COEF, device=device):
        checksum += float(grad[0, 0])
    return checksum


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(rows: int, vocab: int, device: str, repeat: int) -> dict[str, list[float]]:
    """Seconds of each phase on each block, the block generated before any of them starts: the
    phases run ``repeat`` times in turn on the block, and each keeps its fastest (the time a
    burst of someone else's load did not stretch)."""
    src = GeneratedRows(rows, vocab, device)
    targets, w = _inputs(rows, vocab, device)
    first = src.rows(0, min(BLOCK, rows))
    for name in PHASES:  # warm up (kernels, allocator) on the first block, not timed
        _run(name, first, targets[: first.shape[0]], w[: first.shape[0]], device)
    del first
    seconds: dict[str, list[float]] = {name: [] for name in (*PHASES, "generate")}
    for k, a in enumerate(range(0, rows, BLOCK)):
        b = min(a + BLOCK, rows)
        t0 = time.perf_counter()
        block = src.rows(a, b)
        _sync(device)
        seconds["generate"].append(time.perf_counter() - t0)
        fastest = dict.fromkeys(PHASES, float("inf"))
        for r in range(repeat):
            for name in PHASES[(k + r) % 3:] + PHASES[: (k + r) % 3]:  # the order turns each round
                t0 = time.perf_counter()
                _run(name, block, targets[a:b], w[a:b], device)
                _sync(device)
                fastest[name] = min(fastest[name], time.perf_counter() - t0)
        for name in PHASES:
            seconds[name].append(fastest[name])
        del block
    return seconds


def _vm_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise KeyError("VmHWM")


def peak(name: str, rows: int, vocab: int, device: str) -> dict:
    """One phase over all the rows, generated as it asks for them (run in a process of its own)."""
    targets, w = _inputs(rows, vocab, device)
    checksum = _run(name, GeneratedRows(rows, vocab, device), targets, w, device)
    _sync(device)
    peak_bytes = torch.cuda.max_memory_allocated() if device == "cuda" else _vm_hwm()
    return {"phase": name, "peak_bytes": peak_bytes, "checksum": checksum}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32768)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each phase on each block (the fastest kept)")
    parser.add_argument("--threads", type=int, default=1, help="torch's threads (default 1, as a rank's)")
    parser.add_argument("--peak", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.peak:
        print(json.dumps(peak(args.peak, args.rows, args.vocab, args.device)))
        return
    peaks = {}
    for name in ("values", "grad"):
        out = subprocess.run([sys.executable, __file__, "--peak", name, "--rows", str(args.rows), "--vocab",
                              str(args.vocab), "--device", args.device, "--threads", str(args.threads)],
                             capture_output=True, text=True, check=True)
        peaks[name] = json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]
        print(f"peak {name:<8} {peaks[name] / 2**30:5.2f} GiB (a process of its own)", flush=True)
    load = os.getloadavg()[0]
    seconds = timed(args.rows, args.vocab, args.device, args.repeat)
    total = {name: sum(ts) for name, ts in seconds.items()}
    blocks = len(seconds["baseline"])
    print(f"T={args.rows} V={args.vocab} on {args.device} ({torch.get_num_threads()} threads, load average "
          f"{load:.1f} -> {os.getloadavg()[0]:.1f}): {blocks} blocks of {BLOCK} rows, generated in "
          f"{total['generate']:.1f} s (not counted); on each block the phases ran {args.repeat} times in turn, "
          "each keeping its fastest")
    print(f"float32 baseline      {total['baseline']:7.1f} s")
    for name, label, goal in (("values", "reference values", 1.5), ("grad", "reference gradient", 3.0)):
        ratio = total[name] / total["baseline"]
        median = statistics.median(t / b for t, b in zip(seconds[name], seconds["baseline"]))
        print(f"{label:<21} {total[name]:7.1f} s  {ratio:5.2f}x the baseline (median of the blocks' ratios "
              f"{median:.2f}x; goal <= {goal}x)")
    print(f"peak: values {peaks['values'] / 2**30:.2f} GiB, gradient {peaks['grad'] / 2**30:.2f} GiB "
          "(goal <= 0.5 GiB)")


if __name__ == "__main__":
    main()
