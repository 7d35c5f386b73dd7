"""GPU smoke kit: the five GPU-tier facts the CPU machine cannot measure, in one run (scripts/gpu_smoke.sh).

1. linears: our FP8 linear (calibrated recipe, gemm 'auto' = torch._scaled_mm on CUDA) against a
   bf16 `F.linear` at Qwen3-8B's linear shapes, forward and forward+backward; ratio FP8/bf16.
2. megatron_step: a few Qwen3-8B-shaped decoder layers in Megatron bf16 mixed precision
   (model.dtype=bfloat16: Float16Module, fp32 master weights), trained for a few steps with our
   FP8 linears and without; loss per step, step time, ratio, peak memory.
3. recipe_scales: the calibrated recipe's quantizer fed the same tensors on the device and on the
   CPU: are its scales and FP8 codes bit-identical (the aligned rollout depends on it)?
4. batch_invariance: does row i of `torch._scaled_mm(x[:M], w^T)` change with M (per-tensor and
   row-wise scales)? Bit-equal rows are what a batch-invariant FP8 GEMM must give.
5. weight_ipc: the colocated weight sync's transport without SGLang (the GPU machine has none):
   one decoder layer's HF tensors (bf16, down_proj as FP8 with its scale) flattened into one
   bucket as `SGLangEngine` does (`transfer_device`, `flatten_bucket`: on CUDA a bucket on the
   GPU, on the CPU the kept shared-memory buffer), pickled by torch's reductions (a CUDA IPC
   handle / a shared segment), rebuilt in a spawned process that copies every tensor out into
   its own tensors on the same device: bit-equal? seconds per sync against a memcpy of the same
   bytes (the ratio bench/weight_sync.py reports for the tensor transfer on the CPU). On the
   2-core CPU box (`--ipc-only`, a 336 MB Qwen3-8B layer, 2026-12-04): bit-equal, 0.30x and 0.36x
   memcpy in two runs; not yet run on a GPU.
`--tiny` runs the same code on tiny shapes on the CPU (the default test suite runs it, so the kit
does not rot). Prints one JSON document; `--out` also writes it.

Run: python bench/gpu_smoke.py [--tiny] [--ipc-only] [--out result.json]  (the GPU machine: scripts/gpu_smoke.sh run)
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import pickle
import statistics
import time
from pathlib import Path

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's reductions: CUDA IPC, shared memory)
import torch.nn.functional as F

QWEN3_8B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
                hidden_size=4096, intermediate_size=12288, num_hidden_layers=4, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
                rope_theta=1000000.0, hidden_act="silu", tie_word_embeddings=False)
"""Qwen3-8B's config.json, 4 of its 36 layers."""
TINY = dict(QWEN3_8B, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
SIZES = {  # (tokens per GEMM, micro-batch x sequence of the Megatron step, batch-invariance Ms)
    "full": (8192, (2, 2048), (1, 16, 128, 1024, 8192)),
    "tiny": (64, (2, 16), (1, 16, 64)),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, reps: int) -> float:
    """Median seconds of `fn` over `reps` runs after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def linear_shapes(hf: dict) -> dict[str, tuple[int, int]]:
    """{linear: (in K, out N)} of one decoder layer (qkv and gate/up fused, as Megatron has them)."""
    heads, kv, head_dim = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    hidden, ffn = hf["hidden_size"], hf["intermediate_size"]
    return {"qkv": (hidden, (heads + 2 * kv) * head_dim), "proj": (heads * head_dim, hidden),
            "fc1": (hidden, 2 * ffn), "fc2": (ffn, hidden)}


def linears(hf: dict, tokens: int, device: torch.device, reps: int) -> dict[str, dict[str, float]]:
    """Seconds of bf16 F.linear and of our FP8 linear per shape, forward and forward+backward."""
    from megatron_fp8rl.fp8.linear import fp8_linear
    from megatron_fp8rl.fp8.quantizer import make_quantizers
    from megatron_fp8rl.fp8.recipe import CalibratedDelayedScaling

    results = {}
    for name, (k, n) in linear_shapes(hf).items():
        x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        weight = (torch.randn(n, k, device=device) / k**0.5).to(torch.bfloat16).requires_grad_()
        quantizers = make_quantizers(CalibratedDelayedScaling(reduce_amax=False))
        cases = {"bf16": lambda: F.linear(x, weight), "fp8": lambda: fp8_linear(x, weight, None, quantizers)}
        row = {}
        for case, forward in cases.items():
            with torch.no_grad():
                row[f"{case}_fwd_s"] = _time(forward, device, reps)
            row[f"{case}_fwd_bwd_s"] = _time(lambda: forward().sum().backward(), device, reps)
        row["ratio_fwd"] = row["fp8_fwd_s"] / row["bf16_fwd_s"]
        row["ratio_fwd_bwd"] = row["fp8_fwd_bwd_s"] / row["bf16_fwd_bwd_s"]
        results[f"{name} {k}->{n} x{tokens}"] = row
    return results


def _lm_forward(chunk, batch):
    return chunk(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])


def _mean_loss(batch, per_token_loss):
    loss = per_token_loss.float().mean()
    return loss, {"loss": loss.detach()}


def megatron_step(hf: dict, batch: tuple[int, int], device: torch.device, steps: int = 3) -> dict[str, dict]:
    """Megatron bf16 training steps of `hf`'s layers with our FP8 linears and without."""
    from megatron_fp8rl.fp8.recipe import CalibratedDelayedScaling
    from megatron_fp8rl.models.hf import build_model_from_hf
    from megatron_fp8rl.trainer.megatron_step import OptimConfig, build_optimizer, train_step, wrap_ddp

    micro, seq = batch
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, hf["vocab_size"], (micro, seq + 1), generator=gen).to(device)
    data = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
            "position_ids": torch.arange(seq, device=device).expand(micro, seq)}
    results = {}
    for name, recipe in (("bf16", None), ("bf16+fp8", CalibratedDelayedScaling())):
        torch.manual_seed(0)
        model = wrap_ddp(build_model_from_hf(hf, params_dtype=torch.bfloat16, fp8_recipe=recipe), True)
        optimizer = build_optimizer(model, OptimConfig(lr=1e-4))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        losses, times = [], []
        for _ in range(steps):
            _sync(device)
            start = time.perf_counter()
            result = train_step(model, optimizer, [data], _lm_forward, _mean_loss, seq, micro)
            _sync(device)
            times.append(time.perf_counter() - start)
            losses.append(result.metrics["loss"])
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        results[name] = {"losses": losses, "step_s": times[-1], "peak_gib": peak}
        del model, optimizer
    results["ratio_step"] = results["bf16+fp8"]["step_s"] / results["bf16"]["step_s"]
    return results


def recipe_scales(device: torch.device, shape: tuple[int, int], steps: int = 6) -> dict[str, object]:
    """The calibrated quantizer on `device` and on the CPU, fed the same tensors (growing, with an
    outlier from step 3 on, so that the bound is recalibrated): equal scales and FP8 codes?"""
    from megatron_fp8rl.fp8.quantizer import make_quantizers
    from megatron_fp8rl.fp8.recipe import CalibratedDelayedScaling

    recipe = CalibratedDelayedScaling(reduce_amax=False)
    pair = {"device": make_quantizers(recipe).input, "cpu": make_quantizers(recipe).input}
    gen = torch.Generator().manual_seed(1)
    scales, codes_equal = [], []
    for step in range(steps):
        x = torch.randn(shape, generator=gen) * (1 + step)
        if step >= 3:
            x[0, 0] = 1000.0 * (1 + step)
        on_device, on_cpu = pair["device"].quantize(x.to(device)), pair["cpu"].quantize(x)
        scales.append([float(pair["device"].state.scale), float(pair["cpu"].state.scale)])
        codes_equal.append(torch.equal(on_device.data.cpu().view(torch.uint8), on_cpu.data.view(torch.uint8)))
    return {"scales_device_cpu": scales, "scales_equal": all(a == b for a, b in scales),
            "codes_equal": all(codes_equal)}


def batch_invariance(device: torch.device, k: int, n: int, ms: tuple[int, ...]) -> dict[str, dict]:
    """For each M: is `_scaled_mm(x[:M], w^T)` bit-equal, row for row, to the largest M's rows?"""
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(max(ms), k, generator=gen) * 2).to(torch.float8_e4m3fn).to(device)
    w = (torch.randn(n, k, generator=gen) * 2).to(torch.float8_e4m3fn).to(device)
    one = torch.ones((), device=device)
    scalings = {  # (scales for M rows, output dtype): CUDA's row-wise scaling outputs bf16 only
        "per_tensor": (lambda m: (one, one), torch.float32),
        "row_wise": (lambda m: (torch.ones(m, 1, device=device), torch.ones(1, n, device=device)),
                     torch.bfloat16),
    }
    results = {}
    for name, (scales, out_dtype) in scalings.items():
        try:
            full = torch._scaled_mm(x, w.t(), *scales(max(ms)), out_dtype=out_dtype)
            rows = {m: torch._scaled_mm(x[:m], w.t(), *scales(m), out_dtype=out_dtype) for m in ms}
        except RuntimeError as err:  # a probe: an unsupported scaling on this device is a finding
            results[name] = {"error": str(err).splitlines()[0]}
            continue
        results[name] = {str(m): {"bit_equal": torch.equal(out, full[:m]),
                                  "max_abs_diff": float((out.float() - full[:m].float()).abs().max())}
                         for m, out in rows.items()}
    return results


def _layer_tensors(hf: dict, device: torch.device) -> dict[str, torch.Tensor]:
    """One decoder layer's HF tensors as an FP8 sync sends them (seeded, made on the CPU): bf16,
    but down_proj as FP8 E4M3 with an fp32 weight_scale."""
    heads, kv, head_dim = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    hidden, ffn = hf["hidden_size"], hf["intermediate_size"]
    shapes = {"self_attn.q_proj.weight": (heads * head_dim, hidden), "self_attn.k_proj.weight": (kv * head_dim, hidden),
              "self_attn.v_proj.weight": (kv * head_dim, hidden), "self_attn.o_proj.weight": (hidden, heads * head_dim),
              "mlp.gate_proj.weight": (ffn, hidden), "mlp.up_proj.weight": (ffn, hidden),
              "input_layernorm.weight": (hidden,)}
    gen = torch.Generator().manual_seed(3)
    tensors = {name: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16) for name, shape in shapes.items()}
    tensors["mlp.down_proj.weight"] = torch.randn(hidden, ffn, generator=gen).to(torch.float8_e4m3fn)
    tensors["mlp.down_proj.weight_scale"] = torch.tensor(0.01)
    return {f"model.layers.0.{name}": t.to(device) for name, t in tensors.items()}


def _ipc_receiver(conn, hf: dict, device_name: str) -> None:
    """The spawned side of `weight_ipc`: rebuild each bucket, copy it out, answer the seconds that
    took, then whether the copies are bit-equal to its own copy of the layer; an empty message
    ends it."""
    device = torch.device(device_name)
    expected = _layer_tensors(hf, device)
    targets = {name: torch.empty_like(t) for name, t in expected.items()}
    while message := conn.recv_bytes():
        start = time.perf_counter()
        flat, layout = pickle.loads(message)
        for name, low, high in layout:
            targets[name].reshape(-1).view(torch.uint8).copy_(flat[low:high])
        _sync(device)
        del flat
        conn.send(time.perf_counter() - start)  # the sync's end; the check below is not timed
        conn.send(all(torch.equal(targets[n].reshape(-1).view(torch.uint8), expected[n].reshape(-1).view(torch.uint8))
                      for n in expected))


def weight_ipc(hf: dict, device: torch.device, rounds: int = 3) -> dict[str, object]:
    """One layer through the colocated sync's transport into a spawned process (see item 5)."""
    from multiprocessing.reduction import ForkingPickler

    from megatron_fp8rl.rollout.weight_transfer import BucketBuffer, flatten_bucket, transfer_device

    tensors = _layer_tensors(hf, device)
    where = transfer_device(tensors.values())
    buffer = BucketBuffer(where, shared=True) if where.type == "cpu" else None
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    targets = {name: torch.empty_like(t) for name, t in tensors.items()}
    memcpy_s = _time(lambda: [targets[n].copy_(t) for n, t in tensors.items()], device, rounds)
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    receiver = context.Process(target=_ipc_receiver, args=(theirs, hf, str(device)), daemon=True)
    receiver.start()
    syncs, received, equal = [], [], []
    try:
        for _ in range(rounds + 1):  # the first opens the receiver's mapping / IPC handle: not timed
            _sync(device)
            start = time.perf_counter()
            ordered, flat = flatten_bucket(list(tensors.items()), where, buffer)
            layout, offset = [], 0
            for name, t in ordered:
                layout.append((name, offset, offset + t.numel() * t.element_size()))
                offset += t.numel() * t.element_size()
            ours.send_bytes(bytes(ForkingPickler.dumps((flat, layout))))
            received.append(ours.recv())
            syncs.append(time.perf_counter() - start)
            equal.append(ours.recv())
            del flat
        ours.send_bytes(b"")
    finally:
        receiver.join(timeout=60)
        if receiver.is_alive():
            receiver.kill()
    sync_s, receive_s = statistics.median(syncs[1:]), statistics.median(received[1:])
    return {"bucket_device": str(where), "bucket_mb": nbytes / 1e6, "bit_equal": all(equal),
            "memcpy_s": memcpy_s, "sync_s": sync_s, "receiver_copy_s": receive_s,
            "speed_vs_memcpy": memcpy_s / sync_s, "exit_code": receiver.exitcode}


def run(tiny: bool) -> dict[str, object]:
    from megatron_fp8rl.launch import init_distributed, shutdown_distributed

    hf, size = (TINY, "tiny") if tiny else (QWEN3_8B, "full")
    tokens, batch, ms = SIZES[size]
    layout = init_distributed(1, 1, seed=0)
    device = layout.device
    try:
        k, n = linear_shapes(hf)["fc1"]
        return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "torch": torch.__version__, "shapes": size,
                "linears": linears(hf, tokens, device, reps=3 if tiny else 10),
                "megatron_step": megatron_step(hf, batch, device),
                "recipe_scales": recipe_scales(device, (tokens, hf["hidden_size"])),
                "batch_invariance": batch_invariance(device, k, n, ms),
                "weight_ipc": weight_ipc(hf, device)}
    finally:
        shutdown_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (the CI path)")
    parser.add_argument("--out", type=Path, help="also write the JSON result here")
    parser.add_argument("--ipc-only", action="store_true",
                        help="item 5 alone, at the chosen shapes, on CUDA if there is one, else the CPU")
    args = parser.parse_args()
    if args.ipc_only:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        outcome = {"weight_ipc": weight_ipc(TINY if args.tiny else QWEN3_8B, device)}
    else:
        outcome = run(args.tiny)
    result = json.dumps(outcome, indent=1)
    print(result, flush=True)
    if args.out is not None:
        args.out.write_text(result)


if __name__ == "__main__":
    main()
