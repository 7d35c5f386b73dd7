"""FP8 rollouts on SmolLM2-135M-Instruct: SGLang throughput and trainer-vs-rollout mismatch.

Owns: the rollout benchmark of issue 5. One process: a Megatron rank (TP=1, gloo, CPU shims) as
the trainer and the real SGLang engine (device cpu, one engine at a time) as the rollout.
Settings (rollout / trainer; every rollout samples the same prompts at temperature 1):
- fp32/fp32       SGLang float32 vs the float32 Megatron model (the baseline of the speed ratios)
- bf16/bf16       SGLang bfloat16 vs the Megatron model in bfloat16
- blockwise/bf16  our FP8 method on a 128x128-block export vs the bfloat16 trainer
- blockwise/blockwise  same rollout vs a Megatron trainer with the blockwise FP8 recipe
- aligned/calibrated   the aligned rollout (trainer/rollout_fp8.py: start checkpoint, then a sync
                  with the trainer's FP8 weights and scales after a calibrating forward) vs the
                  calibrated FP8 trainer recomputing with the served scales frozen
- ulp-noise floor  no rollout: the same frozen-scale trainer against itself with every FP8 linear's
                  input multiplied by 1 + {-1, 0, 1} * 2**-23 (random): what the aligned pair
                  shows when the arithmetic before each quantization is merely close rather than
                  identical (DESIGN hazard 3; FP8 rounding amplifies ulp differences through 30
                  layers). The aligned row avoids it with identical arithmetic on both sides: the
                  batch-invariant FP8 GEMM ('tiled' on CPU, fp8/gemm.py: a row's bits whatever
                  the batch) and the
                  trainer's attention repeating SGLang's torch_native calls
                  (models/megatron_attention.py, the trainer's logprob forward does the same).
Mismatch per setting over all sampled tokens (rl.metrics.mismatch_metrics): mean |delta logp|,
k3 KL(rollout || trainer), exp(mean |delta logp|). Throughput: generated tokens / generate seconds
(engine start excluded), as a ratio to fp32 measured in the same run. The box is shared and noisy:
read ratios, not absolute speeds. Target (issue 5): aligned/calibrated mean |delta logp| at least
5x lower than blockwise/bf16.

Usage: python bench/rollout.py [--model .cache/smollm2] [--prompts 8] [--samples 2]
       [--new-tokens 24] [--work DIR]
The model folder comes from `python tools/materialize_smollm2.py .cache/smollm2`.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from megatron_fp8rl.compat import sglang_cpu


def _megatron(hf_dir: Path, mcore: Path, recipe=None, dtype=torch.float32):
    from megatron.core import dist_checkpointing

    from megatron_fp8rl.convert.hf_to_megatron import convert_hf_to_megatron
    from megatron_fp8rl.models.hf import build_model_from_hf

    hf_config = json.loads((hf_dir / "config.json").read_text())
    if not mcore.exists():
        meta = build_model_from_hf(hf_config, device="meta")
        convert_hf_to_megatron(hf_dir, mcore, meta.sharded_state_dict(), progress=False)
    # the trainer's GEMM under aligned rollouts (RunConfig.trainer_fp8_gemm)
    model = build_model_from_hf(hf_config, fp8_recipe=recipe, params_dtype=dtype, fp8_gemm="batch_invariant").eval()
    sharded = {k: v for k, v in model.sharded_state_dict().items() if not k.endswith("_extra_state")}
    model.load_state_dict(dist_checkpointing.load(sharded, str(mcore)), strict=False)
    return model


@torch.no_grad()
def _trainer_logprobs(model, samples, scales=None, ulp_noise=False) -> torch.Tensor:
    """Logprobs of the sampled tokens, attention called as SGLang called it; `ulp_noise`: each FP8 linear's input times
    1 + {-1, 0, 1} * 2**-23 (seeded), the size of SGLang's remaining fp32 differences."""
    from megatron_fp8rl.models.megatron_attention import sglang_call_layout
    from megatron_fp8rl.models.megatron_fp8_linear import fp8_decoder_linears, frozen_fp8_scales

    generator = torch.Generator().manual_seed(0)

    def perturb(module, args):
        noise = torch.randint(-1, 2, args[0].shape, generator=generator).to(args[0].dtype)
        return (args[0] * (1 + 2.0**-23 * noise),) + tuple(args[1:])

    hooks = [m.register_forward_pre_hook(perturb) for _, _, m in fp8_decoder_linears(model)] if ulp_noise else []
    out = []
    for s in samples:
        tokens = torch.tensor([s.prompt_token_ids + s.token_ids])
        with (frozen_fp8_scales(model, scales) if scales is not None else nullcontext(),
              sglang_call_layout([len(s.prompt_token_ids)])):
            logits = model(tokens, torch.arange(tokens.shape[1])[None], None)[0].float()
        logprobs = torch.log_softmax(logits[len(s.prompt_token_ids) - 1:-1], dim=-1)
        out.append(logprobs.gather(1, torch.tensor(s.token_ids)[:, None])[:, 0])
    for hook in hooks:
        hook.remove()
    return torch.cat(out)


def _mismatch(samples, trainer_logprobs: torch.Tensor) -> dict[str, float]:
    return _mismatch_of(trainer_logprobs, torch.tensor([lp for s in samples for lp in s.logprobs]))


def _mismatch_of(trainer_logprobs: torch.Tensor, rollout: torch.Tensor) -> dict[str, float]:
    from megatron_fp8rl.rl.metrics import mismatch_metrics

    rollout = rollout[None]
    metrics = mismatch_metrics(trainer_logprobs[None], rollout, torch.ones_like(rollout))
    return {k: float(metrics[f"mismatch_{k}"]) for k in ("abs_logprob_diff_mean", "k3_kl", "prob_error")}


def _rollout(model_dir: Path, args, prompts, fp8="none", dtype="float32", before=None):
    """Start an engine, run `before(engine)` if given, sample; returns (samples, tokens/s)."""
    from megatron_fp8rl.rollout.engine import SamplingParams
    from megatron_fp8rl.rollout.sglang_common import SGLangConfig
    from megatron_fp8rl.rollout.sglang_engine import SGLangEngine

    config = SGLangConfig(model_path=str(model_dir), dtype=dtype, max_total_tokens=4096,
                          mem_fraction_static=0.8, fp8=fp8, random_seed=0)
    engine = SGLangEngine(config)
    try:
        if before is not None:
            before(engine)
        sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)
        engine.generate(prompts[:1], SamplingParams(max_new_tokens=4))  # warm-up
        start = time.perf_counter()
        samples = engine.generate(prompts, sampling, n=args.samples)
        seconds = time.perf_counter() - start
    finally:
        engine.shutdown()
    return samples, sum(len(s.token_ids) for s in samples) / seconds


def run(args) -> dict[str, dict[str, float]]:
    from transformers import AutoTokenizer

    from megatron_fp8rl.convert.fp8_export import Fp8ExportOptions, export_fp8
    from megatron_fp8rl.data.arithmetic import arithmetic_records
    from megatron_fp8rl.data.records import prompt_token_ids
    from megatron_fp8rl.fp8.recipe import BlockwiseScaling, CalibratedDelayedScaling
    from megatron_fp8rl.models.megatron_fp8_linear import shared_fp8_scales
    from megatron_fp8rl.fp8.serving import RolloutFp8, plan_for
    from megatron_fp8rl.trainer.rollout_fp8 import prepare_rollout_checkpoint, rollout_tensors, served_scales
    from safetensors.torch import load_file

    hf_dir, work = Path(args.model), Path(args.work)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    prompts = [prompt_token_ids(r, tokenizer) for r in arithmetic_records("eval", args.prompts, seed=1)]
    mcore = work / "mcore"
    results = {}

    samples, tps = _rollout(hf_dir, args, prompts)
    _record(results, "fp32/fp32", {**_mismatch(samples, _trainer_logprobs(_megatron(hf_dir, mcore), samples)), "tokens_per_s": tps})
    bf16_trainer = _megatron(hf_dir, mcore, dtype=torch.bfloat16)
    samples, tps = _rollout(hf_dir, args, prompts, dtype="bfloat16")
    _record(results, "bf16/bf16", {**_mismatch(samples, _trainer_logprobs(bf16_trainer, samples)), "tokens_per_s": tps})

    export_fp8(hf_dir, work / "block", Fp8ExportOptions(scheme="block"), overwrite=True, progress=False)
    samples, tps = _rollout(work / "block", args, prompts, fp8="blockwise")
    _record(results, "blockwise/bf16", {**_mismatch(samples, _trainer_logprobs(bf16_trainer, samples)), "tokens_per_s": tps})
    del bf16_trainer
    block_trainer = _megatron(hf_dir, mcore, BlockwiseScaling())
    _record(results, "blockwise/blockwise", {**_mismatch(samples, _trainer_logprobs(block_trainer, samples)), "tokens_per_s": tps})
    del block_trainer

    trainer = _megatron(hf_dir, mcore, CalibratedDelayedScaling())
    texts = [tokenizer.decode(p) for p in prompts]
    plan = plan_for(RolloutFp8.ALIGNED, "calibrated")
    served = prepare_rollout_checkpoint(hf_dir, work / "aligned", plan, "static", texts)
    _trainer_logprobs(trainer, [_Prompt(p) for p in prompts])  # calibrating forward (the trainer's)
    scales = shared_fp8_scales(trainer)
    hf_weights = load_file(hf_dir / "model.safetensors")
    num_layers = int(json.loads((hf_dir / "config.json").read_text())["num_hidden_layers"])
    sync = lambda engine: engine.update_weights(  # noqa: E731
        rollout_tensors(((n, t.float()) for n, t in hf_weights.items()), num_layers, plan, scales), version=1)
    samples, tps = _rollout(served, args, prompts, fp8="aligned", before=sync)
    assert served_scales(served)  # the start checkpoint is aligned too (the test checks it)
    _record(results, "aligned/calibrated", {**_mismatch(samples, _trainer_logprobs(trainer, samples, scales)), "tokens_per_s": tps})
    noisy = _trainer_logprobs(trainer, samples, scales, ulp_noise=True)
    _record(results, "ulp-noise floor", {**_mismatch_of(noisy, _trainer_logprobs(trainer, samples, scales)),
                                         "tokens_per_s": float("nan")})
    return results


def _record(results: dict, name: str, row: dict[str, float]) -> None:
    """Keep a setting's figures and print them at once (a long run shows progress)."""
    results[name] = row
    print(f"[rollout bench] {name}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()), flush=True)


class _Prompt:
    """A prompt as a sample with one generated token (its last), for a calibrating forward."""

    def __init__(self, ids):
        self.prompt_token_ids, self.token_ids = ids[:-1], ids[-1:]


def report(results: dict[str, dict[str, float]]) -> None:
    base = results["fp32/fp32"]["tokens_per_s"]
    print(f"{'rollout/trainer':22s} {'mean|dlogp|':>12s} {'k3 KL':>10s} {'exp(mean)':>10s} {'tok/s':>8s} {'vs fp32':>8s}")
    for name, row in results.items():
        print(f"{name:22s} {row['abs_logprob_diff_mean']:12.2e} {row['k3_kl']:10.2e} {row['prob_error']:10.5f} "
              f"{row['tokens_per_s']:8.1f} {row['tokens_per_s'] / base:7.2f}x")
    ratio = results["blockwise/bf16"]["abs_logprob_diff_mean"] / results["aligned/calibrated"]["abs_logprob_diff_mean"]
    print(f"blockwise/bf16 mismatch / aligned/calibrated mismatch = {ratio:.1f}x (target >= 5x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=".cache/smollm2")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    args = parser.parse_args()
    sglang_cpu.install()
    from megatron_fp8rl.launch import init_distributed, shutdown_distributed

    init_distributed(tensor_parallel=1, pipeline_parallel=1, seed=3)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args.work = args.work or tmp
            report(run(args))
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main()
