"""Benchmark: HF -> Megatron conversion throughput against `cp` of the same bytes, and peak RSS.

A synthetic checkpoint in Qwen3 layout (random BF16, 20 layers of hidden 2048, untied 32k
vocabulary: ~2.2 GB in 1 GB safetensors shards) is generated once and cached (default
~/.cache/megatron_fp8rl/bench_convert). Each run then times, alternating, ROUNDS times each (best
of each kept; shared machines are noisy):
  baseline: `cp -r` of the checkpoint folder (coreutils cp: copy_file_range, page cache to page
  cache inside the kernel);
  conversion: a child process that builds the meta model and runs convert_hf_to_megatron; its
  conversion time is measured inside the child (interpreter and Megatron imports excluded, also
  reported end to end), its peak RSS from rusage;
  with --baseline-repo DIR, also the conversion of another checkout (e.g. `git worktree add
  /tmp/convert_old <commit>`), timed in the same rounds, for a before/after in the same conditions.
Fairness: the source is read once before timing, so every run reads it from the page cache; before
each timed run the previous output is deleted and `sync` is run (untimed), so no run pays for
another's writeback; outputs are not synced (neither cp nor the conversion fsyncs).
Prints the throughput ratio (cp time / conversion time; target >= 0.5) and peak RSS against
2 GB + 3 x the largest tensor (the target). Needs ~7 GB of free disk.

    python bench/convert.py [--cache DIR] [--workdir DIR] [--rounds N] [--threads N]
                            [--baseline-repo DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2048,
    "intermediate_size": 6144, "num_hidden_layers": 20, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 32768, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    "hidden_act": "silu", "dtype": "bfloat16",
}
SHARD_BYTES = 2**30


def qwen3_tensors(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of a Qwen3 checkpoint with config `c`."""
    h, f, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    names = [("model.embed_tokens.weight", (c["vocab_size"], h))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                  (p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                  (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
                  (p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,)),
                  (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                  (p + "mlp.down_proj.weight", (h, f))]
    return names + [("model.norm.weight", (h,)), ("lm_head.weight", (c["vocab_size"], h))]


def generate(directory: Path) -> None:
    """Write the synthetic checkpoint tensor by tensor (bounded memory), then mark it complete."""
    from megatron_fp8rl.convert.safetensors_io import INDEX_FILE, SafetensorsWriter

    tensors, shards, size = qwen3_tensors(CONFIG), [[]], 0
    for name, shape in tensors:
        nbytes = torch.Size(shape).numel() * 2
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    directory.mkdir(parents=True, exist_ok=True)
    generator, weight_map = torch.Generator().manual_seed(0), {}
    for index, shard in enumerate(shards):
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        writer = SafetensorsWriter(directory / file, [(n, torch.bfloat16, s) for n, s in shard])
        for name, shape in shard:
            writer.write(name, torch.randn(shape, generator=generator).mul_(0.02).to(torch.bfloat16))
            weight_map[name] = file
        writer.close()
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=2))
    (directory / "COMPLETE").write_text("ok")


def _timed(cmd: list[str], repo: Path = REPO) -> tuple[float, int, str]:
    """(seconds, peak RSS in bytes, stdout) of one child command, run after an untimed sync."""
    os.sync()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=repo, env=dict(os.environ, PYTHONPATH=str(repo)),
                            stdout=subprocess.PIPE, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed")
    return elapsed, usage.ru_maxrss * 1024, out


def child(source: Path, output: Path, threads: int) -> None:
    """Convert in this process, the way tools/convert_hf_to_megatron.py does; print the time."""
    from megatron_fp8rl.convert.hf_to_megatron import convert_hf_to_megatron
    from megatron_fp8rl.launch import init_distributed, shutdown_distributed
    from megatron_fp8rl.models.hf import build_model_from_hf

    init_distributed(1, 1)
    start = time.perf_counter()
    model = build_model_from_hf(json.loads((source / "config.json").read_text()), device="meta")
    convert_hf_to_megatron(source, output, model.sharded_state_dict(), progress=False, threads=threads)
    print(json.dumps({"seconds": time.perf_counter() - start}))
    shutdown_distributed()


class _Conversions:
    """Times of one checkout's conversion over the rounds."""

    def __init__(self, repo: Path, label: str):
        self.repo, self.label = repo, label
        self.seconds: list[float] = []
        self.end_to_end: list[float] = []
        self.peak_rss = 0

    def run(self, source: Path, output: Path, threads: int) -> None:
        script = self.repo / "bench" / "convert.py"
        seconds, rss, out = _timed([sys.executable, str(script), "--child", str(source), str(output),
                                    "--threads", str(threads)], self.repo)
        shutil.rmtree(output)
        self.seconds.append(json.loads(out.strip().splitlines()[-1])["seconds"])
        self.end_to_end.append(seconds)
        self.peak_rss = max(self.peak_rss, rss)

    def report(self, total: int, cp_times: list[float], budget: int) -> None:
        cp_seconds = min(cp_times)
        gb, best = 2**30, min(self.seconds)
        print(f"{self.label}: {best:.2f} s  ({total / gb / best:.2f} GiB/s); end to end with "
              f"interpreter and Megatron start-up {min(self.end_to_end):.1f} s; runs "
              f"{[round(t, 2) for t in self.seconds]}")
        print(f"  throughput ratio conversion/cp: {cp_seconds / best:.2f}  (target >= 0.5); "
              f"end to end {cp_seconds / min(self.end_to_end):.2f}; medians "
              f"{statistics.median(cp_times) / statistics.median(self.seconds):.2f}")
        print(f"  peak RSS: {self.peak_rss / gb:.2f} GiB  (target <= 2 GiB + 3 x largest = "
              f"{budget / gb:.2f} GiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache/megatron_fp8rl/bench_convert")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="conversion writer threads")
    parser.add_argument("--baseline-repo", type=Path, default=None,
                        help="another checkout whose conversion is timed in the same rounds")
    parser.add_argument("--child", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child, args.threads)
    source = args.cache / "qwen3_synthetic"
    if not (source / "COMPLETE").exists():
        shutil.rmtree(source, ignore_errors=True)
        print(f"generating the synthetic checkpoint in {source} (once)")
        generate(source)
    total = sum(p.stat().st_size for p in source.glob("*.safetensors"))
    largest = max(torch.Size(s).numel() * 2 for _, s in qwen3_tensors(CONFIG))
    workdir = Path(tempfile.mkdtemp(dir=args.workdir, prefix="bench_convert_"))
    runs = [_Conversions(REPO, "conversion")]
    if args.baseline_repo:
        runs.append(_Conversions(args.baseline_repo.resolve(), f"conversion of {args.baseline_repo}"))
    cp_times = []
    try:
        subprocess.run(["cat", *map(str, source.glob("*.safetensors"))], stdout=subprocess.DEVNULL, check=True)
        for _ in range(args.rounds):
            cp_times.append(_timed(["cp", "-r", str(source), str(workdir / "copy")])[0])
            shutil.rmtree(workdir / "copy")
            for conversions in runs:
                conversions.run(source, workdir / "mcore", args.threads)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    cp_seconds = min(cp_times)
    print(f"checkpoint: {total / 2**30:.2f} GiB, largest tensor {largest / 2**20:.0f} MiB; load "
          f"average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"cp: {cp_seconds:.2f} s  ({total / 2**30 / cp_seconds:.2f} GiB/s); runs "
          f"{[round(t, 2) for t in cp_times]} (best of each used)")
    for conversions in runs:
        conversions.report(total, cp_times, 2 * 2**30 + 3 * largest)


if __name__ == "__main__":
    main()
