"""The float64 reference at a real vocabulary: V = 151,936 (Qwen's), T = 32,768 rows, on CPU.

Each phase runs in a process of its own, so its peak RSS is its own: generating the logits alone
(the rows every phase reads, float32, made chunk by chunk: the [T, V] matrix, 19.9 GB, is never
held), the baseline (a plain float32 ``torch.log_softmax`` and gather over the same rows, chunk by
chunk), the reference's log-probs and entropy (``reference.truth.logprob_entropy``), and its
gradient (``reference.truth.loss_grad_chunks``, consumed chunk by chunk as the harness does).
Prints seconds (with and without the generation every phase pays) and peak RSS, and the ratio
of the reference's values to the baseline. Goals (issue 15): peak <= 2 GiB, values within 3x of
the float32 baseline. ``--device cuda`` runs the same on a GPU (peak: torch's max allocated).

    python benchmarks/reference_real_vocab.py [--rows 32768] [--vocab 151936] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

CHUNK = 256  # the reference's own default (reference.truth.DEFAULT_CHUNK_ROWS)


class GeneratedRows:
    """Deterministic float32 logits, made on demand in blocks of CHUNK rows (as ScenarioData makes
    a scenario's, without holding them)."""

    def __init__(self, rows: int, vocab: int, device: str) -> None:
        self.num_rows, self.vocab, self.device = rows, vocab, device

    def rows(self, start: int, stop: int) -> torch.Tensor:
        g = torch.Generator(device=self.device).manual_seed(start)
        return torch.randn((stop - start, self.vocab), generator=g, device=self.device) * 2.0


def _phase(name: str, rows: int, vocab: int, device: str) -> dict:
    from shardcheck.reference.truth import logprob_entropy, loss_grad_chunks

    src = GeneratedRows(rows, vocab, device)
    targets = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(1)).to(device)
    t0 = time.perf_counter()
    checksum = 0.0
    if name == "generate":
        for a in range(0, rows, CHUNK):
            checksum += float(src.rows(a, min(a + CHUNK, rows))[0, 0])
    elif name == "baseline":
        for a in range(0, rows, CHUNK):
            b = min(a + CHUNK, rows)
            logp = torch.log_softmax(src.rows(a, b), dim=-1).gather(1, targets[a:b].unsqueeze(1))
            checksum += float(logp.sum())
    elif name == "values":
        logp, entropy = logprob_entropy(src, targets, device=device)
        checksum = float(logp.sum() + entropy.sum())
    elif name == "grad":
        w = torch.rand(rows, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 2 - 1
        for _, grad in loss_grad_chunks(src, targets, w, w, entropy_coef=0.01, device=device):
            checksum += float(grad[0, 0])
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"phase": name, "seconds": time.perf_counter() - t0, "peak_bytes": peak, "checksum": checksum}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32768)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(_phase(args.phase, args.rows, args.vocab, args.device)))
        return
    results = {}
    for name in ("generate", "baseline", "values", "grad"):
        out = subprocess.run([sys.executable, __file__, "--phase", name, "--rows", str(args.rows), "--vocab",
                              str(args.vocab), "--device", args.device], capture_output=True, text=True, check=True)
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
        r = results[name]
        print(f"{name:<9} {r['seconds']:8.1f} s   peak {r['peak_bytes'] / 2**30:5.2f} GiB", flush=True)
    gen = results["generate"]["seconds"]
    base, values, grad = (results[k]["seconds"] - gen for k in ("baseline", "values", "grad"))
    print(f"T={args.rows} V={args.vocab} on {args.device}, generation ({gen:.1f} s) taken out: float32 baseline "
          f"{base:.1f} s, reference values {values:.1f} s ({values / base:.2f}x the baseline; goal <= 3x), "
          f"gradient {grad:.1f} s ({grad / base:.2f}x); peak {max(r['peak_bytes'] for r in results.values()) / 2**30:.2f}"
          " GiB (goal <= 2 GiB)")


if __name__ == "__main__":
    main()
