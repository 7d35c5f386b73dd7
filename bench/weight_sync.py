"""Weight-sync cost per transfer: seconds per GB and peak extra host memory of one update into
SGLang, each as a ratio to a memcpy of the same bytes measured in the same run.

Owns: the weight-sync benchmark (issue 5: speed; issue 18 item 3: speed and memory at scale).
Weights (--weights), each served by SGLang from a checkpoint of the same layout:
- smollm2          SmolLM2-135M-Instruct's own fp32 weights (0.54 GB): an fp32 rollout's sync.
- qwen3-8b-layers  a synthetic Qwen3-8B-shaped stack: --layers full-width decoder layers (hidden
                   4096, ffn 12288, 32 q / 8 kv heads of 128, the real shapes) under a 4096-token
                   vocabulary, random bf16 weights (what a bf16 trainer's sync sends).
--fp8 sends them as a rollout.fp8=per_tensor sync does (trainer/rollout_fp8.rollout_tensors: FP8
E4M3 linears with an fp32 weight_scale each, the rest as is; aligned sends one more fp32 scalar,
input_scale, per linear: the same bytes to 1e-7), served from their per-tensor FP8 export.
Transfers (--only, one per invocation on a shared box):
- tensor       in-process `SGLangEngine` (update_weights_from_tensor inside begin/end_weight_update)
- distributed  `SGLangServer` subprocess, one gloo broadcast per bucket of --bucket-mb
- disk         the same server, a safetensors snapshot it reloads (update_weights_from_disk)
Baseline: memcpy, `dst.copy_(src)` of every tensor into preallocated tensors for speed, and a
clone of every tensor (the same bytes, newly allocated) for memory. Each update sends fresh copies
(made untimed, before it), as each sync sends a new snapshot. Speed: the median of --rounds
updates (validation included: every update runs it). Memory: this process's peak RSS during one
update (Linux VmHWM, reset through /proc/self/clear_refs) minus its RSS before, the snapshot
already made: what a sync costs the trainer rank that sends it (the server's copy is the server's).
Printed: JSON with s/GB, `speed_vs_memcpy` (memcpy s/GB / transfer s/GB: >= 0.5 is the tensor
target), peak extra MB, `memory_vs_memcpy` (extra / the clone's extra) and the per-layer bytes.

Usage: python bench/weight_sync.py --only tensor [--weights smollm2|qwen3-8b-layers] [--fp8]
       [--layers 2] [--rounds 3] [--bucket-mb 512] [--profile tensor]
The SmolLM2 folder comes from `python tools/materialize_smollm2.py .cache/smollm2`.

Measured 2026-12-01 on the shared 2-core box, one invocation per row (`--cache /tmp/ws_cache`),
load average 15-43 during the runs (speed ratios swing with it; memory does not):

| weights (GB sent)         | transfer, bucket            | s/GB | speed vs memcpy | peak extra MB (vs clone) |
|---------------------------|-----------------------------|------|-----------------|--------------------------|
| smollm2 fp32 (0.54)       | tensor, one call (before)   | 10.2 | 0.05x           | 425 (0.83x)              |
| smollm2 fp32 (0.54)       | tensor, 64 MiB, per tensor  | 52.2 | 0.02x (load 43) | 538 (1.05x)              |
| smollm2 fp32 (0.54)       | tensor, 64 MiB, flat        | 15.2 | 0.12x           | 177 (0.33x)              |
| qwen3-8b-layers fp8 (0.45)| tensor, 512 MiB, flat       | 34.4 | 0.15x           | 470 (1.06x: one bucket)  |
| smollm2 fp8 (0.22)        | distributed, 64 MiB         | 16.3 | 0.02x           | 70 (0.33x: one bucket)   |
| smollm2 fp8 (0.22)        | disk, 64 MiB shards (1)     | 20.0 | 0.04x           | 3.6 (0.02x)              |
| qwen3-8b-layers fp8 (0.45)| distributed, 512 MiB        | 31.7 | 0.03x           | 470 (1.04x: one bucket)  |
| smollm2 fp8 (0.22)        | tensor, 64 MiB, flat        | 11.2 | 0.11x           | 113 (0.52x: the embedding) |
| qwen3-8b-layers fp8 (0.45)| disk, one file              | 23.1 | 0.06x           | 218 (0.48x) (2)          |
(1) measured with one safetensors file per bucket, since reverted to one file: save_file adds
nothing (0.25 MB for the 0.45 GB file, measured alone), so shards bought no memory.
(2) all of it the finite check's fp32 upcast of the largest FP8 tensor (4096 x 12288: 201 MB);
the check now sums in chunks: 220 -> 20 MB for `validate_named_tensors` on these tensors, alone
(the rows above ran before that cut).

Where the memory goes (trainer rank 0): tensor: one bucket copied into a shared-memory buffer;
a tensor larger than the bucket goes alone, moved into shared memory (its size, transiently):
smollm2's 113 MB embedding + one 67 MB bucket = the 177 MB measured. distributed: one flat bucket
buffer (a lone tensor is broadcast from its own storage). disk: ~nothing (save_file writes the
tensors' own memory). All: validation's chunked finite check, 16 MB.
Not in these figures: the snapshot itself (`rollout_tensors` output, made before each update
here), which a sync validates in full before sending (a bad tensor is refused before any byte):
today the trainer holds the whole FP8 snapshot at once (9.4 GB at 8B) — issue 18 item 1.

Derived for the real models (shapes from their config.json; bf16 trainer; FP8 = per_tensor or
aligned sync: linears E4M3, embeddings and lm_head bf16; bucket 512 MiB = 0.54 GB), using the
measured rules: tensor = one bucket + the largest tensor above a bucket; distributed = one bucket;
disk = the chunked finite check (before the chunks: 4 bytes per element of the largest tensor,
2.5 GB for Qwen3-8B's bf16 embedding):

| model       | sync GB bf16 / FP8 | layer MB bf16 / FP8 | largest tensor       | FP8 buckets | peak extra per rank: tensor / distributed / disk | target: bucket + FP8 layer |
|-------------|--------------------|---------------------|----------------------|-------------|--------------------------------------------------|----------------------------|
| Qwen3-8B    | 16.4 / 9.4         | 386 / 193           | embed, lm_head 1.25 GB | 18        | 1.8 GB (missed) / 0.54 GB / 16 MB                | 0.73 GB                    |
| Qwen2.5-32B | 65.5 / 34.3        | 975 / 488           | embed, lm_head 1.56 GB | 64        | 2.1 GB (missed) / 0.54 GB / 16 MB                | 1.02 GB                    |

The tensor transfer misses the memory target by the embeddings alone (a tensor larger than a
bucket is moved into shared memory whole); its decoder layers fit. Seconds per sync at ratio r:
GB x memcpy s/GB / r; e.g. Qwen3-8B FP8 by tensor at the measured r = 0.15 and the fastest
memcpy measured here, 0.31 s/GB: 9.4 x 0.31 / 0.15 = 19 s (the r >= 0.5 target is missed).
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from megatron_fp8rl.compat import sglang_cpu

QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, vocab_size=4096, max_position_embeddings=4096, rms_norm_eps=1e-6,
                rope_theta=1_000_000.0, tie_word_embeddings=False, torch_dtype="bfloat16")
"""Qwen3-8B's config.json but for the layer count and the vocabulary (151936 there)."""


def _seconds(call, rounds: int, fresh=dict) -> float:
    """Median seconds of `call(fresh())`, `fresh` (untimed) making its argument each round."""
    times = []
    for _ in range(rounds):
        argument = fresh()
        start = time.perf_counter()
        call(argument)
        times.append(time.perf_counter() - start)
        del argument
    return statistics.median(times)


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(f"/proc/self/status has no {field}")


def _peak_extra_bytes(call, argument=None) -> int:
    """Peak RSS of this process while `call(argument)` runs, above its RSS before."""
    gc.collect()
    before = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    call(argument)
    return _status_bytes("VmHWM") - before


def _memcpy(tensors: dict[str, torch.Tensor], rounds: int) -> tuple[float, int]:
    """(seconds of a copy into preallocated tensors, peak extra bytes of a clone)."""
    targets = {name: torch.empty_like(t) for name, t in tensors.items()}

    def copy(_):
        for name, t in tensors.items():
            targets[name].copy_(t)

    copy(None)  # touch the pages once
    seconds = _seconds(copy, rounds)
    del targets
    return seconds, _peak_extra_bytes(lambda _: [t.clone() for t in tensors.values()])


def _qwen3_layers(folder: Path, layers: int) -> Path:
    """A Qwen3-8B-shaped HF checkpoint of `layers` decoder layers with random bf16 weights
    (kept in `folder` for the next invocation)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    if (folder / "model.safetensors").is_file():
        return folder
    config = Qwen3Config(num_hidden_layers=layers, **QWEN3_8B)
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    tensors = {n: (torch.ones(s) if n.endswith("norm.weight") else torch.randn(s, generator=generator) * 0.02)
               .to(torch.bfloat16) for n, s in shapes.items()}
    folder.mkdir(parents=True, exist_ok=True)
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(folder)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _served(model: Path, fp8: bool, cache: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """(the checkpoint SGLang serves, the tensors each update sends); an FP8 export is kept in
    `cache` for the next invocation."""
    tensors = load_file(str(model / "model.safetensors"))
    if not fp8:
        return model, tensors
    from megatron_fp8rl.convert.fp8_export import Fp8ExportOptions, export_fp8
    from megatron_fp8rl.trainer.rollout_fp8 import rollout_tensors

    served = cache / f"{model.name}-fp8"
    if not (served / "config.json").is_file():
        export_fp8(model, served, Fp8ExportOptions(scheme="tensor"), progress=False, overwrite=True)
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    return served, dict(rollout_tensors(tensors.items(), layers, "per_tensor"))


def _layer_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for n, t in tensors.items() if n.startswith("model.layers.0."))


def _profiled(call, enabled: bool):
    if not enabled:
        return lambda: None
    def run():
        profiler = cProfile.Profile()
        profiler.runcall(call)
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
    return run


def _measure(transfer: str, config, tensors: dict, args) -> dict[str, float]:
    """Speed and peak extra memory of updates by `transfer` (one engine or server started)."""
    from megatron_fp8rl.rollout.sglang_engine import SGLangEngine
    from megatron_fp8rl.rollout.sglang_server import SGLangServer

    if transfer == "tensor":
        engine = SGLangEngine(config, bucket_mb=args.bucket_mb)
    else:
        engine = SGLangServer(config, weight_transfer=transfer, bucket_mb=args.bucket_mb)
    version = iter(range(1, 1000))
    # Every update sends tensors it has not sent before, as each sync's new snapshot: the tensor
    # transfer moves a tensor's storage into shared memory, so a resent one would cost nothing.
    fresh = lambda: {name: t.clone() for name, t in tensors.items()}  # noqa: E731
    with engine:
        update = lambda sent: engine.update_weights(sent.items(), next(version))  # noqa: E731
        update(fresh())  # the first distributed update also forms the process group
        peak = _peak_extra_bytes(update, fresh())
        seconds = _seconds(update, args.rounds, fresh)
        _profiled(lambda: update(fresh()), args.profile == transfer)()
    return {"seconds": seconds, "peak_extra_bytes": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="smollm2", choices=("smollm2", "qwen3-8b-layers"))
    parser.add_argument("--model", default=".cache/smollm2", help="the SmolLM2 folder")
    parser.add_argument("--fp8", action="store_true", help="send what a rollout.fp8=per_tensor sync sends")
    parser.add_argument("--layers", type=int, default=2, help="qwen3-8b-layers: decoder layers")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=512)
    parser.add_argument("--only", default="tensor", help="comma-separated: tensor,distributed,disk")
    parser.add_argument("--profile", default=None, help="cProfile one more update by this transfer")
    parser.add_argument("--cache", default=".cache/weight_sync", help="synthetic checkpoints and FP8 exports, kept")
    args = parser.parse_args()
    sglang_cpu.install()
    from megatron_fp8rl.rollout.sglang_common import SGLangConfig

    cache = Path(args.cache)
    model = Path(args.model) if args.weights == "smollm2" else _qwen3_layers(cache / f"qwen3_8b_{args.layers}_layers", args.layers)
    served, tensors = _served(model, args.fp8, cache)
    gigabytes = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e9
    config = SGLangConfig(model_path=str(served), dtype="float32", max_total_tokens=2048,
                          mem_fraction_static=0.8, fp8="per_tensor" if args.fp8 else "none")
    memcpy_s, clone_bytes = _memcpy(tensors, args.rounds)
    results = {"weights": args.weights + ("-fp8" if args.fp8 else ""), "gigabytes": gigabytes,
               "layer_mb": _layer_bytes(tensors) / 1e6, "bucket_mb": args.bucket_mb,
               "load_average": os.getloadavg()[0], "memcpy_s_per_gb": memcpy_s / gigabytes,
               "memcpy_peak_extra_mb": clone_bytes / 1e6}
    for transfer in args.only.split(","):
        measured = _measure(transfer, config, tensors, args)
        results[f"{transfer}_s_per_gb"] = measured["seconds"] / gigabytes
        results[f"{transfer}_speed_vs_memcpy"] = memcpy_s / measured["seconds"]
        results[f"{transfer}_peak_extra_mb"] = measured["peak_extra_bytes"] / 1e6
        results[f"{transfer}_memory_vs_memcpy"] = measured["peak_extra_bytes"] / clone_bytes
    results["load_average_end"] = os.getloadavg()[0]
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
