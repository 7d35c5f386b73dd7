"""Weight-sync cost per transfer: seconds per GB and peak extra host memory of one update into
SGLang, each as a ratio to a memcpy of the same bytes measured in the same run.

Owns: the weight-sync benchmark (issue 5: speed; issue 18 item 3: speed and memory at scale).
Weights (--weights), each served by SGLang from a checkpoint of the same layout:
- smollm2          SmolLM2-135M-Instruct's own fp32 weights (0.54 GB): an fp32 rollout's sync.
- qwen3-8b-layers  a synthetic Qwen3-8B-shaped stack: --layers full-width decoder layers (hidden
                   4096, ffn 12288, 32 q / 8 kv heads of 128, the real shapes) under a --vocab
                   vocabulary (4096; Qwen3-8B's own is 151936, untied), random bf16 weights (what
                   a bf16 trainer's sync sends).
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
target), peak extra MB, `memory_vs_memcpy` (extra / the clone's extra), the per-layer bytes, and
`three_pass_floor_vs_memcpy`: the finite check + a copy into a reused buffer + a copy out of it, in
this process, nothing else (`_three_pass_floor`): the most a sync through a buffer can reach.

Usage: python bench/weight_sync.py --only tensor [--weights smollm2|qwen3-8b-layers] [--fp8]
       [--layers 2] [--vocab 4096] [--rounds 3] [--bucket-mb 512] [--profile tensor]
The SmolLM2 folder comes from `python tools/materialize_smollm2.py .cache/smollm2`.

Measured on the 2-core box, one invocation per row (`--cache /tmp/ws_cache`, --rounds 5; 2 for
the 2.9 GB rows). 2026-12-03: the reused bucket buffer and the vocabulary row chunks, against the
code before them (a worktree of 60d80be). 2026-12-04: the host bucket buffer kept between syncs,
against the code before it (a worktree of 4ae1c44 with PYTHONPATH set to it, same day; the box
was slower than the day before: load average 0.3-2.1, the benches' own processes included):

| weights (GB sent)                      | transfer, bucket     | s/GB 12-03: before -> after | 12-04: before -> kept buffer | vs memcpy 12-04: before -> kept | peak extra MB 12-04 (held between syncs) |
|----------------------------------------|----------------------|-----------------------------|------------------------------|---------------------------------|------------------------------------------|
| smollm2 fp32 (0.54)                    | tensor, 512 MiB      | -                           | 0.94 -> 0.33                 | 0.10x -> 0.23x                  | 536 (536)                                |
| smollm2 fp32 (0.54)                    | tensor, 64 MiB       | 1.17 -> 0.56                | - -> 0.56                    | - -> 0.16x                      | 67 (67)                                  |
| smollm2 fp8 (0.22)                     | tensor, 64 MiB       | 3.54 -> 2.01                | 2.01 -> 1.82                 | 0.05x -> 0.05x                  | 67 (67)                                  |
| smollm2 fp8 (0.22)                     | distributed, 64 MiB  | 4.03 -> 2.77                | - -> 2.76                    | - -> 0.03x                      | 67 (67)                                  |
| qwen3-8b-layers fp8, vocab 151936 (2.9)| tensor, 512 MiB      | 1.81 -> 1.17                | - -> 1.30                    | - -> 0.05x                      | 554 (537); target 730                    |
| qwen3-8b-layers fp8, vocab 151936 (2.9)| distributed, 512 MiB | - -> 1.85                   | 3.10 -> 2.38                 | 0.02x -> 0.03x                  | 386 (386); target 730                    |
memcpy ran at 0.048-0.097 s/GB. The 2.9 GB rows are 2 full-width Qwen3-8B layers (193 MB each in
FP8) and Qwen3-8B's real untied bf16 embedding and lm_head (1245 MB each). Peak memory target
(issue 18): one bucket + one FP8 layer = 537 + 193 = 730 MB: met by both transfers, the buffer
held between syncs included (the bench adds it to the peak it measures during a later sync).

What changed: (1) every bucket of a sync is copied into one flat buffer (`BucketBuffer`), reused:
a fresh shared-memory segment per bucket (allocation and first touch: 35-45 ms per 64 MiB,
against 3 ms to refill a touched one) was 0.37 s of a 0.72 s SmolLM2 sync. (2) An embedding or
lm_head larger than a bucket goes in row chunks of a bucket each, loaded by
`rollout/sglang_rows.load_vocab_rows` (SGLang's custom_weight_loader hook) into the rows its TP
rank holds; before, it was moved into shared memory whole (1.25 GB at Qwen3-8B). (3) The finite
check reads FP8 codes as bytes (`weights._fp8_finite`): 0.25 -> 0.02 s for SmolLM2's FP8 linears.
(4) 2026-12-04: a host buffer is kept between syncs (a CUDA one is not: the train phase's memory).
At 512 MiB, allocating the shared segment (0.11 s) and unmapping it (0.09 s) were 0.20 s of a
0.44 s SmolLM2 fp32 sync (cProfile). The cost is one bucket of host memory held through the
train phase, which SGLang's CPU tier does not release for it either.

Where a sync's time goes now (cProfile, `--profile tensor`): smollm2 fp32 at 512 MiB, 0.19 s for
0.54 GB: SGLang's update calls 0.10 s (its load_weights alone about 0.05 s, timed once inside
its scheduler with a throwaway custom loader; memcpy of the same bytes: 0.035 s), the copy into
the buffer 0.05 s, the finite check 0.03 s. qwen3-8b-layers fp8 (2026-12-03), 2.7 s for 2.9 GB: SGLang's
end_weight_update 1.71 s (the CPU tier's FP8 method rebuilds the fp64 code copies its 'exact'
GEMM reads: an FP8 -> fp64 conversion of every linear, 0.25 s for one 4096 x 12288 weight with
torch's .double(), no faster through a 256-entry lookup table (0.34 s); no such copy where
another GEMM runs), SGLang loading the buckets 0.48 s, the copies into the buffer 0.27 s, the
finite check 0.22 s (the bf16 embeddings).

The speed target (tensor >= 0.5x memcpy) is missed, and out of reach of a sync through a shared
buffer on this CPU. Such a sync copies the bytes in and SGLang copies them out, and the check
reads them once more. Those three passes alone, in one process with nothing else
(`three_pass_floor_vs_memcpy`), reach 0.29-0.36x (smollm2) and 0.43x (qwen3-8b-layers fp8, vocab
151936). The transport alone, no check and no SGLang (the earlier kit's `weight_ipc` item, now inside `bench/gpu_smoke.py --part 2`'s sync: one
Qwen3-8B layer, 336 MB, copied into the kept shared buffer, pickled by torch's reductions, copied
out in a spawned process), reached 0.30x and 0.36x in two runs. Its receiver's copy out of a
freshly mapped segment took 0.045-0.052 s against 0.025 s for memcpy. The tensor transfer now
reaches 0.23x in fp32, 63% of its three-pass floor. In FP8, the server's rebuild of its code
copies dominates (above).
On a GPU, a CUDA snapshot's buckets stay on the device (`transfer_device`: one device-to-device
copy, a CUDA IPC handle, SGLang's copy out). That path is written, and is item 5 of the GPU smoke
kit, but it has not run on a GPU; and the actor gathers its snapshot into host memory, on a GPU
too (`WeightPublisher.hf_tensors_in_memory`), so training does not take it yet.

Derived for the real models (shapes from their config.json; bf16 trainer; FP8 = per_tensor or
aligned sync: linears E4M3, embeddings and lm_head bf16; bucket 512 MiB = 0.54 GB), using the
measured rules: tensor = one bucket (the embedding and lm_head go in row chunks); distributed =
one bucket, or the largest tensor when it goes alone from its own storage (no copy); disk = the
chunked finite check. On the CPU tier the tensor and distributed buckets are also held between
syncs; on a GPU neither is (a new CUDA bucket per call, the NCCL buffer released at the sync's
end), and the tensor bucket is device memory, not host:

| model       | sync GB bf16 / FP8 | layer MB bf16 / FP8 | largest tensor         | FP8 buckets | peak extra per rank: tensor / distributed / disk | target: bucket + FP8 layer |
|-------------|--------------------|---------------------|------------------------|-------------|--------------------------------------------------|----------------------------|
| Qwen3-8B    | 16.4 / 9.4         | 386 / 193           | embed, lm_head 1.25 GB | 18          | 0.54 GB / 0.54 GB / 16 MB                        | 0.73 GB                    |
| Qwen2.5-32B | 65.5 / 34.3        | 975 / 488           | embed, lm_head 1.56 GB | 64          | 0.54 GB / 0.54 GB / 16 MB                        | 1.02 GB                    |

Not in these figures: the snapshot itself (`rollout_tensors` output, made before each update
here). In training it is a `WeightSnapshot` (2026-12-04): its layout (names, shapes, dtypes, from
the same conversion run on meta tensors) is checked before any byte is sent (a bad name, shape or
dtype is refused then), and its tensors are gathered, quantized and sent bucket by bucket, so
rank 0 holds at most 3 buckets of them plus the tensor that overflowed the last
(tests/rollout/test_sglang_engine.py, `..._holding_a_few_buckets`): 3 x 0.54 + 1.56 = 3.2 GB at
Qwen2.5-32B, where holding the whole update, as before, was 34 GB in FP8 (65 GB bf16). The disk
transfer writes it the same way, as safetensors shards of a bucket each, which the server loads
once all are written.
Seconds per sync at ratio r: GB x memcpy s/GB / r; e.g. Qwen3-8B FP8 by tensor at the measured
1.17 s/GB: 9.4 x 1.17 = 11 s on this CPU, 6.7 s of it the FP8 method's rebuild.
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


def _three_pass_floor(tensors: dict[str, torch.Tensor], rounds: int) -> float:
    """Seconds of the three passes any sync through a shared buffer makes over the bytes, with
    nothing else: the finite check (`validate_named_tensors`, without a served checkpoint to
    compare names against), a copy into one reused buffer, and a copy out of it into preallocated
    tensors (SGLang's into its parameters), bucket by bucket, no process boundary."""
    from megatron_fp8rl.rollout.weights import _all_finite
    from megatron_fp8rl.rollout.weight_transfer import BucketBuffer, buckets, flatten_bucket

    targets = {name: torch.empty_like(t) for name, t in tensors.items()}
    buffer = BucketBuffer(torch.device("cpu"))

    def sync(_):
        assert all(_all_finite(t) for t in tensors.values())
        for bucket in buckets(tensors.items(), 512 * 2**20):
            ordered, flat = flatten_bucket(bucket, torch.device("cpu"), buffer)
            offset = 0
            for name, t in ordered:
                nbytes = t.numel() * t.element_size()
                targets[name].view(-1).view(torch.uint8).copy_(flat[offset:offset + nbytes])
                offset += nbytes

    sync(None)  # touch the pages once
    return _seconds(sync, rounds)


def _qwen3_layers(folder: Path, layers: int, vocab: int) -> Path:
    """A Qwen3-8B-shaped HF checkpoint of `layers` decoder layers and a `vocab`-token vocabulary
    with random bf16 weights (kept in `folder` for the next invocation)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    if (folder / "model.safetensors").is_file():
        return folder
    config = Qwen3Config(num_hidden_layers=layers, **{**QWEN3_8B, "vocab_size": vocab})
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
    from megatron_fp8rl.fp8.serving import RolloutFp8, plan_for
    from megatron_fp8rl.trainer.rollout_fp8 import rollout_tensors

    served = cache / f"{model.name}-fp8"
    if not (served / "config.json").is_file():
        export_fp8(model, served, Fp8ExportOptions(scheme="tensor"), progress=False, overwrite=True)
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    return served, dict(rollout_tensors(tensors.items(), layers, plan_for(RolloutFp8.PER_TENSOR, "none")))


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
        held = _held_bytes(engine)
        peak = _peak_extra_bytes(update, fresh()) + held
        seconds = _seconds(update, args.rounds, fresh)
        _profiled(lambda: update(fresh()), args.profile == transfer)()
    return {"seconds": seconds, "peak_extra_bytes": peak, "held_bytes": held}


def _held_bytes(engine) -> int:
    """The bucket buffer a transfer keeps between syncs (allocated by the first, so not in a
    later sync's peak above its RSS before: added to it)."""
    sender = getattr(engine, "_sender", None)
    buffer = engine.buffer if hasattr(engine, "buffer") else (sender.buffer if sender is not None else None)
    return 0 if buffer is None else buffer.nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="smollm2", choices=("smollm2", "qwen3-8b-layers"))
    parser.add_argument("--model", default=".cache/smollm2", help="the SmolLM2 folder")
    parser.add_argument("--fp8", action="store_true", help="send what a rollout.fp8=per_tensor sync sends")
    parser.add_argument("--layers", type=int, default=2, help="qwen3-8b-layers: decoder layers")
    parser.add_argument("--vocab", type=int, default=4096, help="qwen3-8b-layers: vocabulary (Qwen3-8B's: 151936)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=512)
    parser.add_argument("--only", default="tensor", help="comma-separated: tensor,distributed,disk")
    parser.add_argument("--profile", default=None, help="cProfile one more update by this transfer")
    parser.add_argument("--cache", default=".cache/weight_sync", help="synthetic checkpoints and FP8 exports, kept")
    args = parser.parse_args()
    sglang_cpu.install()
    from megatron_fp8rl.rollout.sglang_common import SGLangConfig

    cache = Path(args.cache)
    model = Path(args.model) if args.weights == "smollm2" else _qwen3_layers(
        cache / (f"qwen3_8b_{args.layers}_layers" + (f"_vocab{args.vocab}" if args.vocab != 4096 else "")), args.layers, args.vocab)
    served, tensors = _served(model, args.fp8, cache)
    gigabytes = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e9
    config = SGLangConfig(model_path=str(served), dtype="float32", max_total_tokens=2048,
                          mem_fraction_static=0.8, fp8="per_tensor" if args.fp8 else "none")
    memcpy_s, clone_bytes = _memcpy(tensors, args.rounds)
    floor_s = _three_pass_floor(tensors, args.rounds)
    results = {"weights": args.weights + ("-fp8" if args.fp8 else ""), "gigabytes": gigabytes,
               "layer_mb": _layer_bytes(tensors) / 1e6, "bucket_mb": args.bucket_mb,
               "largest_tensor_mb": max(t.numel() * t.element_size() for t in tensors.values()) / 1e6,
               "load_average": os.getloadavg()[0], "memcpy_s_per_gb": memcpy_s / gigabytes,
               "memcpy_peak_extra_mb": clone_bytes / 1e6, "three_pass_floor_s_per_gb": floor_s / gigabytes,
               "three_pass_floor_vs_memcpy": memcpy_s / floor_s}
    for transfer in args.only.split(","):
        measured = _measure(transfer, config, tensors, args)
        results[f"{transfer}_s_per_gb"] = measured["seconds"] / gigabytes
        results[f"{transfer}_speed_vs_memcpy"] = memcpy_s / measured["seconds"]
        results[f"{transfer}_peak_extra_mb"] = measured["peak_extra_bytes"] / 1e6
        results[f"{transfer}_held_between_syncs_mb"] = measured["held_bytes"] / 1e6
        results[f"{transfer}_memory_vs_memcpy"] = measured["peak_extra_bytes"] / clone_bytes
    results["load_average_end"] = os.getloadavg()[0]
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
