"""Peak memory and time of per-token logprob + entropy: chunked (rl/logprobs.py) vs naive.

Workload: N = 8,192 tokens over a V = 151,936 vocabulary (Qwen's), bf16 logits by default
(2.5 GB; fp32 logits would make the naive training pass need ~30 GB, more than this machine has).
Two passes are measured:
    forward  logprobs + entropy under no_grad (the trainer's old-logprob recomputation);
    train    forward + backward of Σ (logprob + 0.01·entropy) into the logits' gradient.

Naive baseline: what verl does (`logprobs_from_logits_naive` + `entropy_from_logits`):
log_softmax, gather, softmax, logsumexp and Σ p·x over the whole [N, V] tensor in the logits'
dtype, with autograd. It computes in bf16 when the logits are bf16, so it is the *lighter* naive
variant; upcasting to fp32 first (as Megatron's cross entropy does) would double its memory.
Chunked: `token_logprobs_and_entropy` (fp32 math per chunk, recomputing backward).

Measurement: each (pass, variant) runs in its own subprocess, so allocator state never leaks
between variants. The child fills the logits a few rows at a time (no large transient), then
resets the kernel's peak-RSS counter (`echo 5 > /proc/self/clear_refs` resets VmHWM to the current
RSS), runs the pass `--repeats` times, and reports peak extra memory = VmHWM − RSS before the
pass. That counts every byte the process touched (torch's CPU allocator hands large blocks back to
the OS on free, so RSS follows live tensors), including the logits' gradient in the train pass,
which both variants must produce. Time is the fastest of the repeats (the box is shared and
noisy). Ratios are chunked / naive from the same run.

Usage: python bench/logprob_memory.py [--tokens 8192] [--vocab 151936] [--dtype bf16|fp32]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
PASSES = ("forward", "train")
VARIANTS = ("naive", "chunked")


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    return int(match.group(1))


def _naive(logits, target_ids):
    import torch

    log_probs = torch.log_softmax(logits, dim=-1)
    logprobs = log_probs.gather(-1, target_ids[:, None]).squeeze(-1)
    probs = torch.softmax(logits, dim=-1)
    entropy = torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
    return logprobs.float(), entropy.float()


def _chunked(logits, target_ids, chunk_size):
    from megatron_fp8rl.rl.logprobs import token_logprobs_and_entropy

    return token_logprobs_and_entropy(logits, target_ids, chunk_size=chunk_size)


def _make_inputs(tokens: int, vocab: int, dtype_name: str):
    import torch

    generator = torch.Generator().manual_seed(0)
    logits = torch.empty(tokens, vocab, dtype=getattr(torch, dtype_name))
    for start in range(0, tokens, 8):  # a few rows at a time: no transient larger than ~10 MB
        rows = logits[start:start + 8]
        rows.copy_(torch.randn(rows.shape, generator=generator) * 3)
    return logits, torch.randint(0, vocab, (tokens,), generator=generator)


def run_child(args: argparse.Namespace) -> None:
    import torch

    logits, target_ids = _make_inputs(args.tokens, args.vocab, DTYPES[args.dtype])
    if args.variant == "naive":
        def compute(x):
            return _naive(x, target_ids)
    else:
        def compute(x):
            return _chunked(x, target_ids, args.chunk_size)
    Path("/proc/self/clear_refs").write_text("5")
    baseline_kib = _status_kib("VmRSS")
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        if args.pass_name == "forward":
            with torch.no_grad():
                compute(logits)
        else:
            leaf = logits.requires_grad_()
            leaf.grad = None
            logprobs, entropy = compute(leaf)
            (logprobs + 0.01 * entropy).sum().backward()
        seconds.append(time.perf_counter() - start)
    peak_extra = (_status_kib("VmHWM") - baseline_kib) * 1024
    print(json.dumps({"peak_extra_bytes": peak_extra, "seconds": min(seconds)}))


def _available_bytes() -> int:
    match = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
    return int(match.group(1)) * 1024


def _measure(args: argparse.Namespace, pass_name: str, variant: str) -> dict | None:
    logits_bytes = args.tokens * args.vocab * (2 if args.dtype == "bf16" else 4)
    # The logits plus the measured peak extra (naive train ~7.2x the logits, naive forward ~3x),
    # with some headroom and 1 GiB left to neighbours on the shared machine.
    need = logits_bytes * (8.5 if variant == "naive" and pass_name == "train" else 4.5) + 2**30
    if _available_bytes() < need:
        print(f"skip {pass_name}/{variant}: needs ~{need / 2**30:.1f} GiB, "
              f"{_available_bytes() / 2**30:.1f} GiB available", file=sys.stderr)
        return None
    cmd = [sys.executable, __file__, "--child", "--pass-name", pass_name, "--variant", variant,
           "--tokens", str(args.tokens), "--vocab", str(args.vocab), "--dtype", args.dtype,
           "--repeats", str(args.repeats)]
    if args.chunk_size:
        cmd += ["--chunk-size", str(args.chunk_size)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    if proc.returncode != 0:
        raise RuntimeError(f"{pass_name}/{variant} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-size", type=int, default=None,
                        help="rows per chunk (default: rl/logprobs.py's)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pass-name", choices=PASSES, help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(args)
        return
    gib = args.tokens * args.vocab * (2 if args.dtype == "bf16" else 4) / 2**30
    print(f"logprob + entropy, {args.tokens} tokens x {args.vocab} vocab, {args.dtype} logits "
          f"({gib:.2f} GiB), best of {args.repeats}")
    print(f"{'pass':<8} {'variant':<8} {'peak extra MiB':>15} {'seconds':>9}")
    for pass_name in PASSES:
        results = {}
        for variant in VARIANTS:
            results[variant] = _measure(args, pass_name, variant)
            if results[variant]:
                print(f"{pass_name:<8} {variant:<8} {results[variant]['peak_extra_bytes'] / 2**20:>15.0f} "
                      f"{results[variant]['seconds']:>9.2f}", flush=True)
        if results["naive"] and results["chunked"]:
            memory = results["chunked"]["peak_extra_bytes"] / results["naive"]["peak_extra_bytes"]
            speed = results["chunked"]["seconds"] / results["naive"]["seconds"]
            print(f"{pass_name:<8} ratio    memory {memory:.3f}x (target <= 0.25x)   "
                  f"time {speed:.2f}x (target <= 1.3x)", flush=True)


if __name__ == "__main__":
    main()
