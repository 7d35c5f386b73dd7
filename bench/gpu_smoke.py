"""GPU kit: every GPU target of issue 64, in two calls of at most 5 minutes each
(scripts/gpu_smoke.sh run OUT --part 1, then --part 2).

Part 1 (kernels):
- linears: our FP8 linear (`fp8_linear`, the device path) for every recipe of fp8/recipe.py
  RECIPE_NAMES x gemm 'auto' and 'batch_invariant' (where `check_recipe_gemm` takes the pair for
  CUDA) against a bf16 `F.linear` measured in the same run, at Qwen3-8B's four linears (qkv
  4096->6144, o 4096->4096, gate_up 4096->24576, down 12288->4096) with 8192 tokens: forward
  (no grad) and forward+backward, each with a WARM weight cache (the FP8 weight of the last call)
  and a COLD one (`weights_updated()` before the call: the weight quantized again, as after an
  optimizer step). Speedup = bf16 ms / FP8 ms.
- gemm: the batch-invariant Triton GEMM (per tensor, 1x128 groups, 1x128 x 128x128 blocks, 1x32
  groups) against cuBLAS FP8 per tensor (`torch._scaled_mm` through `gemm.device_matmul_nt`, bf16
  out) and a bf16 matmul, TFLOP/s at the four shapes with M = 8192; its rows for M = 1..1000
  alone against M = 4096 (bit-equal required) and its max error over the fp32-accumulation bound.
Part 2 (the training step and the sync):
- step: N Qwen3-8B decoder layers (Megatron bf16 mixed precision, fp32 master weights, Adam) with
  our FP8 linears (calibrated recipe) and without, under a 128-token vocabulary so the step is the
  decoder layers'; the LM head (Qwen3-8B's 151936 x 4096, bf16 in both: not an FP8 linear) and its
  cross-entropy timed apart, forward+backward at the same tokens. Step seconds (the first step,
  which compiles, untimed), speedup, peak memory.
- sync: the colocated weight sync's parts on a Qwen3-8B-shaped stack (36 full-width layers and the
  untied 151936 vocabulary, bf16 on the device): FP8 quantization of the served weights
  (trainer/rollout_fp8.rollout_tensors, rollout.fp8=per_tensor), buckets of 512 MiB
  (weight_transfer.iter_transfer_parts, vocabulary tensors in row chunks), each flattened into one
  reused buffer (`flatten_bucket`), pickled by torch's reductions (a CUDA IPC handle / a shared
  segment) to a spawned receiver that copies every tensor out and answers. Not in it: the
  publisher's gather (it needs a 36-layer Megatron model; at TP = PP = 1 a copy per slice) and
  SGLang's own load (no SGLang on the lent GPU): the figure is a lower bound of the sync.
Compilation happens before any clock: each part first launches every variant it times once, at
the timed shapes. Each measurement runs a counted number of calls (as many as fit in REP_S after
one timed call, at least 1, at most MAX_REPS); a time guard stops starting measurements once the
part's budget (`--budget-s`) is spent and marks the rest skipped. Each part prints its tables and
one target table (every target of issue 64: figure, met / not met / not measured) and writes both,
with the JSON, to --out-dir after each item. `--tiny` runs the same code at tiny shapes on the CPU
through the device path (linear.device_kernels_on_cpu() under TRITON_INTERPRET=1, GEMMs routed and
checked as on CUDA); the default test suite runs it (tests/bench/test_gpu_smoke.py).

Run: python bench/gpu_smoke.py --part 1|2|all [--tiny] [--budget-s S] [--out-dir DIR]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import multiprocessing
import os
import pickle
import statistics
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's reductions: CUDA IPC, shared memory)
import torch.nn.functional as F

QWEN3_8B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
                hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
                rope_theta=1000000.0, hidden_act="silu", tie_word_embeddings=False)
"""Qwen3-8B's config.json."""
TINY = dict(QWEN3_8B, vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
"""Tiny shapes; intermediate 160: the down linear's K is not a multiple of 128 (ragged groups)."""
SIZES = {
    "full": dict(tokens=8192, batch=(2, 2048), step_layers=4, step_vocab=128, steps=3, invariance_m=4096,
                 probe_ms=(1, 2, 3, 7, 17, 64, 333, 1000), bucket_bytes=512 << 20, sync_rounds=2,
                 shapes=("qkv", "o", "gate_up", "down")),
    "tiny": dict(tokens=64, batch=(2, 16), step_layers=2, step_vocab=128, steps=3, invariance_m=80,
                 probe_ms=(1, 2, 3, 17, 65), bucket_bytes=16 << 10, sync_rounds=1, shapes=("down",)),
}
"""Per run size: linear tokens, micro-batch x sequence of the step, decoder layers and vocabulary of
the step, timed steps after the first, GEMM invariance M and probes, sync bucket bytes (tiny: below
the vocabulary tensors' 32 KiB, so they go in row chunks as at full size) and timed syncs, the
linear shapes timed (tiny: the ragged one; the interpreter is slow)."""
LINEAR_GEMMS = ("auto", "batch_invariant")
LINEAR_MODES = ("fwd_warm", "fwd_cold", "fwd_bwd_warm", "fwd_bwd_cold")
GEMM_LAYOUTS = {  # name: (activation block, weight block), None: per tensor
    "tensor": None, "group128": ((1, 128), (1, 128)), "block128": ((1, 128), (128, 128)), "group32": ((1, 32), (1, 32)),
}
PER_TENSOR_RECIPES = ("calibrated", "te_delayed", "megatron_delayed", "tensorwise")
STEP_RECIPE = "calibrated"
U = 2.0**-24
REP_S = 0.04
"""Seconds of calls per measurement on CUDA (after one timed call that sets the count)."""
MAX_REPS = 50
BUDGET_S = 230.0
"""Default time guard per part: scripts/gpu_smoke.sh gives a part 270 s, installation apart."""
SYNC_TARGET_S = 0.25


@dataclasses.dataclass
class Context:
    """What every item gets: the device, the shapes, and the time left."""

    device: torch.device
    hf: dict
    size: dict
    deadline: float

    def left(self) -> float:
        return self.deadline - time.perf_counter()


@dataclasses.dataclass(frozen=True)
class Item:
    """A measured item: `warm` launches every variant once (compiles), `measure` times them."""

    warm: Callable[[Context], object]
    measure: Callable[[Context, object], object]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ms(fn, ctx: Context) -> float | None:
    """Mean ms of `fn` over a counted number of calls (module docstring); None past the guard."""
    if ctx.left() < 0:
        return None
    _sync(ctx.device)
    start = time.perf_counter()
    fn()
    _sync(ctx.device)
    once = time.perf_counter() - start
    reps = max(1, min(MAX_REPS, int(REP_S / max(once, 1e-9)))) if ctx.device.type == "cuda" else 1
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(ctx.device)
    return (time.perf_counter() - start) / reps * 1e3


def linear_shapes(hf: dict) -> dict[str, tuple[int, int]]:
    """{linear: (in K, out N)} of one decoder layer (qkv and gate/up fused, as Megatron has them)."""
    heads, kv, head_dim = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    hidden, ffn = hf["hidden_size"], hf["intermediate_size"]
    return {"qkv": (hidden, (heads + 2 * kv) * head_dim), "o": (heads * head_dim, hidden),
            "gate_up": (hidden, 2 * ffn), "down": (ffn, hidden)}


def _recipe(name: str):
    """The named recipe, amaxes not all-reduced (one process)."""
    from megatron_fp8rl.fp8.recipe import recipe_by_name

    recipe = recipe_by_name(name)
    return dataclasses.replace(recipe, reduce_amax=False) if hasattr(recipe, "reduce_amax") else recipe


def linear_variants() -> tuple[list[tuple[str, str]], dict[str, str]]:
    """(recipe, gemm) pairs with a CUDA kernel, and {'recipe gemm': why refused} for the others."""
    from megatron_fp8rl.fp8.gemm import CUDA, check_recipe_gemm
    from megatron_fp8rl.fp8.recipe import RECIPE_NAMES

    taken, refused = [], {}
    for recipe in RECIPE_NAMES:
        for gemm in LINEAR_GEMMS:
            try:
                check_recipe_gemm(_recipe(recipe), gemm, CUDA)
            except ValueError as err:
                refused[f"{recipe} {gemm}"] = str(err)
                continue
            taken.append((recipe, gemm))
    return taken, refused


def _linear_calls(ctx: Context, shape: str):
    """{variant: {mode: call}} at one shape, bf16 included (variant 'bf16', fwd / fwd_bwd)."""
    from megatron_fp8rl.fp8.linear import fp8_linear
    from megatron_fp8rl.fp8.quantizer import make_quantizers, weights_updated

    k, n = linear_shapes(ctx.hf)[shape]
    tokens, device = ctx.size["tokens"], ctx.device
    x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(n, k, device=device) / k**0.5).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(tokens, n, device=device, dtype=torch.bfloat16)

    def modes(forward) -> dict[str, Callable]:
        def fwd():
            with torch.no_grad():
                forward()
        return {"fwd_warm": fwd, "fwd_cold": lambda: (weights_updated(), fwd()),
                "fwd_bwd_warm": lambda: forward().backward(dy),
                "fwd_bwd_cold": lambda: (weights_updated(), forward().backward(dy))}

    bf16 = modes(lambda: F.linear(x, weight))
    calls = {"bf16": {"fwd": bf16["fwd_warm"], "fwd_bwd": bf16["fwd_bwd_warm"]}}
    for recipe, gemm in linear_variants()[0]:
        quantizers = make_quantizers(_recipe(recipe))
        calls[f"{recipe} {gemm}"] = modes(lambda q=quantizers, g=gemm: fp8_linear(x, weight, None, q, g))
    return calls


def _warm_linears(ctx: Context) -> None:
    for shape in ctx.size["shapes"]:
        for variant in _linear_calls(ctx, shape).values():
            if ctx.left() < 0:  # the time guard: what was not warmed is skipped by its measurement too
                return
            for call in variant.values():
                call()
        _sync(ctx.device)


def _measure_linears(ctx: Context, _warmed) -> dict[str, object]:
    """{'shape K->N xT': {bf16_fwd_ms, bf16_fwd_bwd_ms, variants: {'recipe gemm': {mode: ms,
    'speedup_' + mode: bf16 ms / ms}}}}, and the refused pairs."""
    rows = {}
    for shape in ctx.size["shapes"]:
        k, n = linear_shapes(ctx.hf)[shape]
        calls = _linear_calls(ctx, shape)
        bf16 = {mode: _ms(call, ctx) for mode, call in calls.pop("bf16").items()}
        row = {"bf16_fwd_ms": bf16["fwd"], "bf16_fwd_bwd_ms": bf16["fwd_bwd"], "variants": {}}
        for variant, modes in calls.items():
            timed = {mode: _ms(call, ctx) for mode, call in modes.items()}
            for mode in LINEAR_MODES:
                base = bf16["fwd_bwd" if mode.startswith("fwd_bwd") else "fwd"]
                figure = timed[mode]
                timed[f"speedup_{mode}"] = None if figure is None or base is None else base / figure
            row["variants"][variant] = timed
        rows[f"{shape} {k}->{n} x{ctx.size['tokens']}"] = row
    return {"shapes": rows, "refused": linear_variants()[1]}


def _gemm_operands(layout: str, x: torch.Tensor, w: torch.Tensor):
    from megatron_fp8rl.fp8.formats import E4M3
    from megatron_fp8rl.fp8.quantize import quantize_blockwise, quantize_per_tensor

    if GEMM_LAYOUTS[layout] is None:
        return quantize_per_tensor(x, E4M3), quantize_per_tensor(w, E4M3)
    a_block, b_block = GEMM_LAYOUTS[layout]
    return quantize_blockwise(x, E4M3, a_block), quantize_blockwise(w, E4M3, b_block)


def _gemm_inputs(m: int, n: int, k: int, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k], w [n, k] fp32, drawn on `device` (drawing 16384 x 12288 on the host took seconds)."""
    gen = torch.Generator(device).manual_seed(seed)
    return torch.randn(m, k, generator=gen, device=device), torch.randn(n, k, generator=gen, device=device) * 0.02


def _gemm_calls(ctx: Context, shape: str) -> dict[str, tuple[Callable, str]]:
    """{name: (call, kernel)}: bf16, cuBLAS per tensor, and the Triton GEMM per layout (bf16 out)."""
    from megatron_fp8rl.fp8.gemm import device_kernel, device_matmul_nt

    k, n = linear_shapes(ctx.hf)[shape]
    x, w = _gemm_inputs(ctx.size["tokens"], n, k, ctx.device)
    x16, w16 = x.bfloat16(), w.bfloat16()
    calls = {"bf16": (lambda: F.linear(x16, w16), "bf16")}
    for layout in GEMM_LAYOUTS:
        a, b = _gemm_operands(layout, x, w)
        if layout == "tensor":
            calls["cublas_tensor"] = (lambda a=a, b=b: device_matmul_nt(a, b, "scaled_mm", torch.bfloat16),
                                      device_kernel(a, b, "scaled_mm"))
        calls[f"triton_{layout}"] = (lambda a=a, b=b: device_matmul_nt(a, b, "triton_invariant", torch.bfloat16),
                                     device_kernel(a, b, "triton_invariant"))
    return calls


def _warm_gemm(ctx: Context) -> None:
    for shape in ctx.size["shapes"]:
        for call, _ in _gemm_calls(ctx, shape).values():
            call()
    _sync(ctx.device)


def _measure_gemm(ctx: Context, _warmed) -> dict[str, object]:
    """Per shape: ms, TFLOP/s and kernel of each call, Triton per tensor / cuBLAS per tensor and
    each layout / bf16; then the rows / error checks per layout."""
    speed = {}
    for shape in ctx.size["shapes"]:
        k, n = linear_shapes(ctx.hf)[shape]
        m = ctx.size["tokens"]
        row = {}
        for name, (call, kernel) in _gemm_calls(ctx, shape).items():
            ms = _ms(call, ctx)
            row[name] = {"kernel": kernel, "ms": ms, "tflops": None if ms is None else 2 * m * n * k / ms / 1e9}
        ms_of = {name: entry["ms"] for name, entry in row.items()}
        ready = all(v is not None for v in ms_of.values())
        row["tensor_vs_cublas"] = ms_of["cublas_tensor"] / ms_of["triton_tensor"] if ready else None
        for layout in GEMM_LAYOUTS:
            row[f"{layout}_vs_bf16"] = ms_of["bf16"] / ms_of[f"triton_{layout}"] if ready else None
        speed[f"{shape} M={m} N={n} K={k}"] = row
    k, n = linear_shapes(ctx.hf)["qkv"]
    checks = {layout: _gemm_checks(ctx, layout, n, k) for layout in GEMM_LAYOUTS if ctx.left() > 0}
    return {"speed": speed, "checks": checks}


def _triton(a, b):
    from megatron_fp8rl.fp8.gemm import device_matmul_nt

    return device_matmul_nt(a, b, "triton_invariant", torch.float32)


def _gemm_checks(ctx: Context, layout: str, n: int, k: int) -> dict[str, object]:
    """Rows of M = probe_ms alone against the same rows of M = invariance_m (bit-equal?), and
    the first 64 rows' max error over the fp32-accumulation bound against a float64 oracle."""
    a, b = _gemm_operands(layout, *_gemm_inputs(ctx.size["invariance_m"], n, k, ctx.device, seed=1))
    full = _triton(a, b)
    unequal = []
    for m in ctx.size["probe_ms"]:
        scale_inv = a.scale_inv if a.granularity == "tensor" else a.scale_inv[:m].contiguous()
        rows = type(a)(a.data[:m].contiguous(), scale_inv, a.granularity, a.block)
        if not torch.equal(_triton(rows, b), full[:m]):
            unequal.append(m)
    head = slice(0, min(64, full.shape[0]))
    a_head, b_values = a.dequantize()[head].double(), b.dequantize().double()
    reference, magnitude = a_head @ b_values.t(), a_head.abs() @ b_values.abs().t()
    group = k if GEMM_LAYOUTS[layout] is None else GEMM_LAYOUTS[layout][0][1]
    terms = k + 4 if GEMM_LAYOUTS[layout] is None else group + 2 + math.ceil(k / group)
    ratio = ((full[head].double() - reference).abs() / (terms * U * magnitude).clamp_min(1e-300)).max().item()
    return {"rows_bit_equal": not unequal, "unequal_ms": unequal, "max_error_over_bound": ratio}



def _lm_forward(chunk, batch):
    return chunk(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])


def _mean_loss(batch, per_token_loss):
    loss = per_token_loss.float().mean()
    return loss, {"loss": loss.detach()}


def _step_run(ctx: Context, recipe) -> dict[str, object]:
    """Steps of the step model (decoder layers, small vocabulary), the first untimed."""
    from megatron_fp8rl.models.hf import build_model_from_hf
    from megatron_fp8rl.trainer.megatron_step import OptimConfig, build_optimizer, train_step, wrap_ddp

    hf = dict(ctx.hf, num_hidden_layers=ctx.size["step_layers"], vocab_size=ctx.size["step_vocab"])
    micro, seq = ctx.size["batch"]
    device = ctx.device
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, hf["vocab_size"], (micro, seq + 1), generator=gen).to(device)
    data = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
            "position_ids": torch.arange(seq, device=device).expand(micro, seq)}
    gc.collect()  # the other variant's model and optimizer (Megatron's DDP holds cycles): not in this peak
    torch.manual_seed(0)
    model = wrap_ddp(build_model_from_hf(hf, params_dtype=torch.bfloat16, fp8_recipe=recipe), True)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-4))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, times = [], []
    for _ in range(1 + ctx.size["steps"]):
        if ctx.left() < 0:
            break
        _sync(device)
        start = time.perf_counter()
        losses.append(train_step(model, optimizer, [data], _lm_forward, _mean_loss, seq, micro).metrics["loss"])
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    del model, optimizer
    return {"losses": losses, "step_s": statistics.median(times[1:]) if len(times) > 1 else None, "peak_gib": peak}


def _measure_step(ctx: Context, _warmed) -> dict[str, object]:
    """The step with and without FP8 linears, and the LM head apart (module docstring)."""
    results = {"layers": ctx.size["step_layers"], "recipe": STEP_RECIPE,
               "bf16": _step_run(ctx, None), "bf16+fp8": _step_run(ctx, _recipe(STEP_RECIPE))}
    bf16, fp8 = results["bf16"], results["bf16+fp8"]
    results["speedup_step"] = bf16["step_s"] / fp8["step_s"] if bf16["step_s"] and fp8["step_s"] else None
    results["peak_fp8_over_bf16"] = fp8["peak_gib"] / bf16["peak_gib"] if bf16["peak_gib"] else None
    tokens, hidden, vocab = math.prod(ctx.size["batch"]), ctx.hf["hidden_size"], ctx.hf["vocab_size"]
    x = torch.randn(tokens, hidden, device=ctx.device, dtype=torch.bfloat16, requires_grad=True)
    head = (torch.randn(vocab, hidden, device=ctx.device) / hidden**0.5).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device=ctx.device)
    results["lm_head_fwd_bwd_ms"] = _ms(lambda: F.cross_entropy(F.linear(x, head).float(), labels).backward(), ctx)
    return results


def _stack(hf: dict, device: torch.device) -> dict[str, torch.Tensor]:
    """A Qwen3-shaped stack's HF tensors, bf16 on `device` (random: the sync moves bytes)."""
    heads, kv, head_dim = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    hidden, ffn, vocab = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    layer = {"self_attn.q_proj.weight": (heads * head_dim, hidden), "self_attn.k_proj.weight": (kv * head_dim, hidden),
             "self_attn.v_proj.weight": (kv * head_dim, hidden), "self_attn.o_proj.weight": (hidden, heads * head_dim),
             "self_attn.q_norm.weight": (head_dim,), "self_attn.k_norm.weight": (head_dim,),
             "mlp.gate_proj.weight": (ffn, hidden), "mlp.up_proj.weight": (ffn, hidden),
             "mlp.down_proj.weight": (hidden, ffn), "input_layernorm.weight": (hidden,),
             "post_attention_layernorm.weight": (hidden,)}
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for index in range(hf["num_hidden_layers"]):
        shapes.update({f"model.layers.{index}.{name}": shape for name, shape in layer.items()})
    shapes.update({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    gen = torch.Generator(device).manual_seed(3)
    return {name: (torch.randn(shape, generator=gen, device=device) * 0.02).to(torch.bfloat16)
            for name, shape in shapes.items()}


def _served(ctx: Context, stack: dict[str, torch.Tensor]):
    """The stream a rollout.fp8=per_tensor sync sends (FP8 linears with their weight_scale)."""
    from megatron_fp8rl.fp8.serving import RolloutFp8, plan_for
    from megatron_fp8rl.trainer.rollout_fp8 import rollout_tensors

    return rollout_tensors(iter(stack.items()), ctx.hf["num_hidden_layers"], plan_for(RolloutFp8.PER_TENSOR, STEP_RECIPE))


def _receiver(conn, device_name: str) -> None:
    """The spawned side of the sync: per bucket, rebuild it, copy each tensor out into its own
    tensor (allocated at the first sync), answer the seconds; b"end" ends it, answered with the
    byte sums of what it holds."""
    device, targets = torch.device(device_name), {}
    while (message := conn.recv_bytes()) != b"end":
        start = time.perf_counter()
        flat, layout = pickle.loads(message)
        for key, low, high in layout:
            if key not in targets:
                targets[key] = torch.empty(high - low, dtype=torch.uint8, device=device)
            targets[key].copy_(flat[low:high])
        _sync(device)
        del flat
        conn.send(time.perf_counter() - start)
    conn.send(_digest(targets.items()))


def _digest(named_bytes) -> dict[str, int]:
    """{name: sum of its bytes} (int64): what the receiver holds, against what was sent."""
    return {name: int(data.sum(dtype=torch.int64)) for name, data in named_bytes}


def _sent_digest(ctx: Context, stack) -> dict[str, int]:
    """`_digest` of the served stream as the buckets cut it (vocabulary row chunks by name@row)."""
    from megatron_fp8rl.rollout.weight_transfer import RowChunk, iter_transfer_parts

    named = []
    for part in iter_transfer_parts(_served(ctx, stack), ctx.size["bucket_bytes"]):
        bucket = [(f"{part.name}@{part.start}", part.rows)] if isinstance(part, RowChunk) else part
        named += [(name, t.detach().contiguous().reshape(-1).view(torch.uint8)) for name, t in bucket]
    return _digest(named)


def _send_sync(ctx: Context, stack, conn, buffer) -> tuple[float, float, int]:
    """One sync of the served stream through buckets to the receiver: (seconds, receiver's copy
    seconds, bytes)."""
    from multiprocessing.reduction import ForkingPickler

    from megatron_fp8rl.rollout.weight_transfer import RowChunk, flatten_bucket, iter_transfer_parts

    _sync(ctx.device)
    start, copied, sent = time.perf_counter(), 0.0, 0
    for part in iter_transfer_parts(_served(ctx, stack), ctx.size["bucket_bytes"]):
        bucket = [(f"{part.name}@{part.start}", part.rows)] if isinstance(part, RowChunk) else part
        ordered, flat = flatten_bucket(bucket, ctx.device, buffer)
        layout, offset = [], 0
        for name, tensor in ordered:
            layout.append((name, offset, offset + tensor.numel() * tensor.element_size()))
            offset += tensor.numel() * tensor.element_size()
        conn.send_bytes(bytes(ForkingPickler.dumps((flat, layout))))
        copied += conn.recv()
        sent += offset
        del flat
    _sync(ctx.device)
    return time.perf_counter() - start, copied, sent


def _measure_sync(ctx: Context, _warmed) -> dict[str, object]:
    """The sync's parts on the Qwen3-8B-shaped stack (module docstring); the first sync opens the
    receiver's mappings / IPC handles and allocates its tensors: untimed."""
    from megatron_fp8rl.rollout.weight_transfer import BucketBuffer

    stack = _stack(ctx.hf, ctx.device)
    quantize_s = _ms(lambda: [None for _ in _served(ctx, stack)], ctx)
    buffer = BucketBuffer(ctx.device, shared=ctx.device.type == "cpu")
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    receiver = context.Process(target=_receiver, args=(theirs, str(ctx.device)), daemon=True)
    receiver.start()
    syncs, received = [], None
    try:
        for _ in range(1 + ctx.size["sync_rounds"]):
            if ctx.left() < 0:
                break
            syncs.append(_send_sync(ctx, stack, ours, buffer))
        ours.send_bytes(b"end")
        received = ours.recv()
    finally:
        receiver.join(timeout=60)
        if receiver.is_alive():
            receiver.kill()
    timed = syncs[1:]
    return {"layers": ctx.hf["num_hidden_layers"], "stack_gb": sum(t.numel() * 2 for t in stack.values()) / 1e9,
            "sent_gb": syncs[0][2] / 1e9 if syncs else None,
            "quantize_s": None if quantize_s is None else quantize_s / 1e3,
            "sync_s": statistics.median(s for s, _, _ in timed) if timed else None,
            "receiver_copy_s": statistics.median(c for _, c, _ in timed) if timed else None,
            "bit_equal": bool(syncs) and received == _sent_digest(ctx, stack),
            "not_timed": "the publisher's gather (a 36-layer Megatron model) and SGLang's load (no SGLang)",
            "exit_code": receiver.exitcode}


def _no_warm(ctx: Context) -> None:
    """The step's first step and the sync's first sync are their warm-ups (untimed)."""


PARTS = {
    "1": {"linears": Item(_warm_linears, _measure_linears), "gemm": Item(_warm_gemm, _measure_gemm)},
    "2": {"step": Item(_no_warm, _measure_step), "sync": Item(_no_warm, _measure_sync)},
}
"""The kit's two parts (one lent-GPU call each) and their items, in run order."""


def run_part(items: dict[str, Item], ctx: Context, results: dict, out: Path | None) -> dict:
    """Warm every item (compilation before any clock), then measure each into results[name] =
    {status: ok | failed | skipped, seconds, result | error | reason}, writing `out` after each
    item; then results['targets']. A failure is its item's entry, not the part's end."""
    warmed = {}
    for name, item in items.items():
        try:
            start = time.perf_counter()
            warmed[name] = item.warm(ctx)
            results.setdefault("warm_s", {})[name] = round(time.perf_counter() - start, 2)
        except Exception as err:  # recorded; the other items still run
            results[name] = _failure(err)
    for name, item in items.items():
        start = time.perf_counter()
        if name in results:
            entry = results[name]
        elif ctx.left() < 0:
            entry = {"status": "skipped", "reason": "time guard: the part's budget was spent"}
        else:
            try:
                entry = {"status": "ok", "result": item.measure(ctx, warmed.get(name))}
            except Exception as err:  # recorded; the other items still run
                entry = _failure(err)
        entry["seconds"] = round(time.perf_counter() - start, 2)
        results[name] = entry
        print(f"# {name}: {entry['status']} in {entry['seconds']} s", flush=True)
        _write(results, out)
    results["targets"] = targets(results)
    _write(results, out)
    return results


def _failure(err: Exception) -> dict:
    return {"status": "failed", "error": f"{type(err).__name__}: {err}"[:2000], "traceback": traceback.format_exc()[-3000:]}


def _write(results: dict, out: Path | None) -> None:
    if out is not None:
        partial = out.with_name(out.name + ".partial")
        partial.write_text(json.dumps(results, indent=1))
        partial.replace(out)


def _result(results: dict, name: str) -> dict:
    entry = results.get(name, {})
    return (entry.get("result") or {}) if entry.get("status") == "ok" else {}


def _linear_target(results: dict, recipes: tuple[str, ...]) -> tuple[float | None, str]:
    """Min fwd+bwd speedup (gemm=auto, warm cache) over `recipes` x the timed shapes, and where."""
    shapes = _result(results, "linears").get("shapes", {})
    found = [(row["variants"].get(f"{recipe} auto", {}).get("speedup_fwd_bwd_warm"), f"{recipe} {shape}")
             for shape, row in shapes.items() for recipe in recipes]
    if not found or any(figure is None for figure, _ in found):
        return None, ""
    return min(found)


def targets(results: dict) -> list[dict]:
    """Every GPU target of issue 64 with this run's figure: met, not met, or not measured."""
    step, gemm, sync = _result(results, "step"), _result(results, "gemm"), _result(results, "sync")
    ratios = [row.get("tensor_vs_cublas") for row in gemm.get("speed", {}).values()]
    invariant = min(ratios) if ratios and None not in ratios else None
    rows = [
        ("per-tensor linear fwd+bwd / bf16 (calibrated, te_delayed, megatron_delayed, tensorwise; gemm=auto; "
         "warm weight cache; min over recipes and shapes) >= 1.5", *_linear_target(results, PER_TENSOR_RECIPES), 1.5, ">="),
        ("1x128 / 128x128 linear fwd+bwd / bf16 (groupwise, blockwise; gemm=auto; warm; min) >= 1.3",
         *_linear_target(results, ("groupwise", "blockwise")), 1.3, ">="),
        ("1x32 linear fwd+bwd / bf16 (groupwise32; gemm=auto; warm; min) >= 1.0",
         *_linear_target(results, ("groupwise32",)), 1.0, ">="),
        (f"decoder-layer step / bf16 ({STEP_RECIPE}; LM head apart) >= 1.3", step.get("speedup_step"),
         f"{step['layers']} layers" if step else "", 1.3, ">="),
        ("decoder-layer step peak memory FP8 / bf16 <= 1.0", step.get("peak_fp8_over_bf16"), "", 1.0, "<="),
        ("invariant GEMM per tensor / cuBLAS FP8 per tensor (min over shapes) >= 0.8", invariant, "", 0.8, ">="),
    ]
    table = [_target(*row) for row in rows]
    figure = sync.get("sync_s")
    status = "not measured" if figure is None or figure <= SYNC_TARGET_S else "not met"
    table.append({"target": f"colocated sync of the Qwen3-8B-shaped stack <= {SYNC_TARGET_S} s", "figure": figure,
                  "status": status, "where": "lower bound: quantization, buckets, IPC and the receiver's copy; "
                                             "not timed: " + sync.get("not_timed", "the sync")})
    return table


def _target(name: str, figure, where: str, want: float, op: str) -> dict:
    if figure is None:
        status, where = "not measured", where or "not in this run (its part was not run, failed or hit the time guard)"
    else:
        status = "met" if (figure >= want if op == ">=" else figure <= want) else "not met"
    return {"target": name, "figure": figure, "status": status, "where": where}


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


def _table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]) + "\n"


def tables(results: dict) -> str:
    """The part's tables (what ran) and the target table, as markdown."""
    text = []
    for shape, row in _result(results, "linears").get("shapes", {}).items():
        text.append(f"linears {shape}: bf16 fwd {_fmt(row['bf16_fwd_ms'])} ms, fwd+bwd {_fmt(row['bf16_fwd_bwd_ms'])} ms; "
                    "FP8 speedup (bf16 / FP8)\n")
        text.append(_table(["variant", *LINEAR_MODES], [[v, *(t[f"speedup_{m}"] for m in LINEAR_MODES)]
                                                        for v, t in row["variants"].items()]))
    gemm = _result(results, "gemm")
    for shape, row in gemm.get("speed", {}).items():
        calls = [[name, e["kernel"], e["ms"], e["tflops"]] for name, e in row.items() if isinstance(e, dict)]
        text.append(f"GEMM {shape}: Triton per tensor / cuBLAS {_fmt(row['tensor_vs_cublas'])}\n")
        text.append(_table(["call", "kernel", "ms", "TFLOP/s"], calls))
    if gemm.get("checks"):
        text.append(_table(["layout", "rows bit-equal", "max error / bound"],
                           [[k, c["rows_bit_equal"], c["max_error_over_bound"]] for k, c in gemm["checks"].items()]))
    step = _result(results, "step")
    if step:
        text.append(f"step: {step['layers']} layers, speedup {_fmt(step['speedup_step'])}, "
                    f"LM head fwd+bwd {_fmt(step['lm_head_fwd_bwd_ms'])} ms (bf16, apart)\n")
        text.append(_table(["variant", "step s", "peak GiB", "losses"],
                           [[v, step[v]["step_s"], step[v]["peak_gib"], step[v]["losses"]] for v in ("bf16", "bf16+fp8")]))
    sync = _result(results, "sync")
    if sync:
        text.append(_table(["sync part", "figure"], [[k, v] for k, v in sync.items()]))
    failed = [[n, e.get("status"), e.get("error") or e.get("reason")] for n, e in results.items()
              if isinstance(e, dict) and e.get("status") in ("failed", "skipped")]
    if failed:
        text.append(_table(["item", "status", "why"], failed))
    text.append(_table(["target", "figure", "status", "where"],
                       [[r["target"], r["figure"], r["status"], r["where"]] for r in results["targets"]]))
    return "\n".join(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=(*PARTS, "all"), default="all", help="which part to run (one call each)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (on the CPU: the device path, the CI run)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="per part: no measurement starts after this")
    parser.add_argument("--out-dir", type=Path, help="write gpu_smoke_partN.json (after each item) and .md here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # the device path's kernels on CPU tensors
    from megatron_fp8rl.fp8.linear import _DEVICE_KERNELS_ON_CPU, device_kernels_on_cpu
    from megatron_fp8rl.launch import init_distributed, shutdown_distributed

    device = init_distributed(1, 1, seed=0).device
    on_cpu = device_kernels_on_cpu() if device.type == "cpu" else contextlib.nullcontext()
    merged = {}
    try:
        with on_cpu:
            for part in PARTS if args.part == "all" else (args.part,):
                ctx = Context(device, TINY if args.tiny else QWEN3_8B, SIZES["tiny" if args.tiny else "full"],
                              time.perf_counter() + args.budget_s)
                results = {"part": part, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                           "device_path": device.type == "cuda" or _DEVICE_KERNELS_ON_CPU[0], "torch": torch.__version__,
                           "shapes": "tiny" if args.tiny else "full", "budget_s": args.budget_s}
                out = args.out_dir / f"gpu_smoke_part{part}.json" if args.out_dir else None
                merged.update(run_part(PARTS[part], ctx, results, out))
                report = tables(results)
                print(report, flush=True)
                if out is not None:
                    out.with_suffix(".md").write_text(report)
            if args.part == "all":  # both parts' figures in one target table
                merged["targets"] = targets(merged)
                report = "both parts:\n" + _table(["target", "figure", "status"],
                                                  [[r["target"], r["figure"], r["status"]] for r in merged["targets"]])
                print(report, flush=True)
                if args.out_dir:
                    (args.out_dir / "gpu_smoke_targets.json").write_text(json.dumps(merged["targets"], indent=1))
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main()
