"""Weight-sync speed: seconds per GB of `update_weights` into SGLang, as a ratio to a memcpy.

Owns: the weight-sync benchmark of issue 5 (target: >= 0.2x memcpy speed on CPU). One process
sends the same named tensors (SmolLM2-135M-Instruct's own fp32 weights, ~0.54 GB, or a larger
synthetic set with --repeat) by each transfer:
- tensor       in-process `SGLangEngine` (update_weights_from_tensor between begin/end_weight_update)
- distributed  `SGLangServer` subprocess, broadcast over a gloo group in buckets of --bucket-mb
               (update_weights_from_distributed)
- disk         the same server, a safetensors snapshot it reloads (update_weights_from_disk)
Baseline, measured in the same run: `dst.copy_(src)` of every tensor (the same bytes) into
preallocated tensors. Each figure is the median of --rounds updates (validation included: it is
part of every update). The box is shared and noisy: read the ratios, not absolute speeds.

Usage: python bench/weight_sync.py [--model .cache/smollm2] [--rounds 3] [--bucket-mb 512]
       [--only tensor,distributed,disk] [--profile distributed]
The model folder comes from `python tools/materialize_smollm2.py .cache/smollm2`.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from megatron_fp8rl.compat import sglang_cpu


def _seconds(call, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _memcpy_seconds(tensors: dict[str, torch.Tensor], rounds: int) -> float:
    targets = {name: torch.empty_like(t) for name, t in tensors.items()}

    def copy():
        for name, t in tensors.items():
            targets[name].copy_(t)

    copy()  # touch the pages once
    return _seconds(copy, rounds)


def _profiled(name: str, profile: str | None, call):
    if name != profile:
        return call
    def run():
        profiler = cProfile.Profile()
        profiler.runcall(call)
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=".cache/smollm2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=512)
    parser.add_argument("--only", default="tensor,distributed,disk")
    parser.add_argument("--profile", default=None, help="cProfile one more update by this transfer")
    args = parser.parse_args()
    sglang_cpu.install()
    from megatron_fp8rl.rollout.sglang_common import SGLangConfig
    from megatron_fp8rl.rollout.sglang_engine import SGLangEngine
    from megatron_fp8rl.rollout.sglang_server import SGLangServer

    model = Path(args.model)
    tensors = load_file(str(model / "model.safetensors"))
    gigabytes = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e9
    config = SGLangConfig(model_path=str(model), dtype="float32", max_total_tokens=2048, mem_fraction_static=0.8)
    memcpy = _memcpy_seconds(tensors, args.rounds)
    results = {"gigabytes": gigabytes, "memcpy_s_per_gb": memcpy / gigabytes}
    only = args.only.split(",")
    version = iter(range(1, 1000))
    if {"distributed", "disk"} & set(only):
        with SGLangServer(config, weight_transfer="distributed", bucket_mb=args.bucket_mb) as server:
            for transfer in ("distributed", "disk"):
                if transfer in only:
                    server.weight_transfer = transfer
                    update = lambda: server.update_weights(tensors.items(), next(version))  # noqa: E731
                    update()  # the first distributed update also forms the process group
                    results[f"{transfer}_s_per_gb"] = _seconds(update, args.rounds) / gigabytes
                    _profiled(transfer, args.profile, update)()
    if "tensor" in only:
        with SGLangEngine(config) as engine:
            update = lambda: engine.update_weights(tensors.items(), next(version))  # noqa: E731
            update()
            results["tensor_s_per_gb"] = _seconds(update, args.rounds) / gigabytes
            _profiled("tensor", args.profile, update)()
    for transfer in ("tensor", "distributed", "disk"):
        if f"{transfer}_s_per_gb" in results:
            results[f"{transfer}_speed_vs_memcpy"] = results["memcpy_s_per_gb"] / results[f"{transfer}_s_per_gb"]
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
