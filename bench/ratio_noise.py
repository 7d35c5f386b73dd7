"""How much FP8 noise the PPO ratio of a step's later mini-batches carries, per FP8 weight-scale
scheme, measured offline against a float32 shadow at the same θ (issue 61 item 4: a remedy at
<= 5% extra compute).

With M mini-batches a step, the ratio at mini-batch m >= 1 is exp(log π_θm - log π_θold) where
both logprobs come from FP8 forwards: it carries noise(θ_m) - noise(θ_old). The shadow (the same
weights, every FP8 linear in float32: models/megatron_fp8_linear.high_precision_fp8_linears) gives
the ratio without it. Per arm and seed this builds the tiny Megatron GPT the tests build (random
weights, larger) with random token sequences, or with `--model` SmolLM2-135M in Megatron with
answers it samples to the built-in arithmetic prompts, one random advantage a sequence, and runs
`--steps` RL steps, each as the trainer's: the recompute of log π_old over the whole batch at θ_old
(FP8, and the shadow's), then M mini-batches, each a training forward at θ_m, the PPO loss with
clip 0.2/0.2 on the FP8 ratio, and one Adam step (lr 1e-5, the moderate regimes'). At every
mini-batch m >= 1 (no optimizer step between the recompute and m = 0, whose FP8 ratio is exactly
1) it records, over the response tokens:
    |dlog r|     mean |log r_fp8 - log r_shadow|
    over-clip    the share of A < 0 tokens the FP8 ratio clips at 1 - eps and the shadow's does not
                 (rl/calibrated_clipping.clip_diagnostic's neg_overclip, the study's diagnostic)
and, at θ_old of the first step, the quantization's own cost: mean |log π_fp8 - log π_float32|,
and the share of FP8 weight codes the first optimizer step changed. A second table replays
groupwise32's ratios with the FP8 lower bound widened below 1 - eps (the zero-cost 'clip less'
control): over-clip and under-clip against the shadow at 1 - eps. `--boundary-only` prints, for
an HF folder's decoder weights, the share sitting at an E4M3 rounding boundary under fp32 and
power-of-two 1x32 scales (what the smallest update flips).
Arms: groupwise32 (plain, fp32 group scales, live), frozen (model.fp8_step_weight_scales=frozen:
θ_old's weight scales held through the step), pow2 (model.fp8_recipe.scale_pow2: power-of-two
scales), frozen+pow2, and the float32 trainer (no FP8: its ratio is the shadow's, 0 by
construction). Ratios are against groupwise32 measured in the same run with the same seeds; every
arm here adds no forward or backward pass (extra compute 0).

    python bench/ratio_noise.py [--model .cache/smollm2] [--seeds 1,2,3] [--steps 2] [--mini-batches 4]
        [--batch 64] [--arms groupwise32,frozen,pow2,frozen+pow2,float32] [--boundary-only]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from megatron_fp8rl.fp8.recipe import recipe_by_name  # noqa: E402
from megatron_fp8rl.rl.calibrated_clipping import ClipBounds, clip_diagnostic  # noqa: E402

ARMS = {"groupwise32": (False, False), "frozen": (True, False), "pow2": (False, True),
        "frozen+pow2": (True, True), "float32": None}
"""Arm -> (hold θ_old's weight scales, power-of-two scales); None: no FP8."""
BASELINE = "groupwise32"
CLIP = ClipBounds(0.8, 1.2)


def arm_recipe(arm: str):
    setting = ARMS[arm]
    return None if setting is None else recipe_by_name("groupwise32", scale_pow2=setting[1])


class TinyGpt:
    """The tests' tiny Megatron GPT (models/gpt.py), larger, random weights; random token
    sequences, the last `--response` positions the response, one standard-normal advantage a
    sequence (group-normalized advantages' scale)."""

    def __init__(self, args):
        self.args = args

    def describe(self) -> str:
        a = self.args
        return (f"tiny Megatron GPT, {a.layers} layers, hidden {a.hidden}, ffn {a.ffn}, vocab {a.vocab}, random "
                f"weights; random tokens, {a.batch} x {a.seq} ({a.response} response)")

    def model(self, arm: str, seed: int):
        from megatron_fp8rl.models.gpt import build_gpt_model, tiny_transformer_config
        from megatron_fp8rl.models.hf import layer_spec

        a = self.args
        torch.manual_seed(seed)  # the same initial weights in every arm
        config = tiny_transformer_config(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=4,
                                         num_query_groups=2, ffn_hidden_size=a.ffn)
        return build_gpt_model(config, a.vocab, a.seq, layer_spec=layer_spec(qk_layernorm=False,
                                                                             fp8_recipe=arm_recipe(arm)))

    def batch(self, seed: int, step: int):
        a = self.args
        generator = torch.Generator().manual_seed(1000 * seed + step)
        tokens = torch.randint(0, a.vocab, (a.batch, a.seq), generator=generator)
        advantages = torch.randn(a.batch, 1, generator=generator).expand(a.batch, a.seq - 1)
        mask = torch.zeros(a.batch, a.seq - 1, dtype=torch.bool)
        mask[:, -a.response:] = True
        return tokens, advantages, mask


class SmolLM2:
    """SmolLM2-135M-Instruct (`--model`, an HF folder) converted to Megatron once, every decoder
    linear the arm's FP8 linear (lm_head high precision, as the trainer); the batch: the built-in
    arithmetic prompts (add, mul), `--batch` / 8 prompts x 8 answers sampled by the float32 HF model
    at temperature 1, `--response` new tokens, one standard-normal advantage a sequence."""

    def __init__(self, args, workdir: Path):
        import json

        from megatron.core import dist_checkpointing  # noqa: F401  (fails early without megatron)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from megatron_fp8rl.convert.hf_to_megatron import convert_hf_to_megatron
        from megatron_fp8rl.models.hf import build_model_from_hf

        self.args, self.hf_config = args, json.loads((args.model / "config.json").read_text())
        self.checkpoint = workdir / "mcore"
        meta = build_model_from_hf(self.hf_config, device="meta")
        convert_hf_to_megatron(args.model, self.checkpoint, meta.sharded_state_dict(), progress=False)
        self.tokenizer = AutoTokenizer.from_pretrained(args.model)
        self.sampler = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        self.batches = {}

    def describe(self) -> str:
        return (f"SmolLM2-135M-Instruct ({self.args.model}), FP8 decoder linears; arithmetic prompts, "
                f"{self.args.batch} sampled answers of {self.args.response} tokens")

    def model(self, arm: str, seed: int):
        from megatron.core import dist_checkpointing

        from megatron_fp8rl.models.hf import build_model_from_hf

        model = build_model_from_hf(self.hf_config, fp8_recipe=arm_recipe(arm), use_te=False)
        sharded = {k: v for k, v in model.sharded_state_dict().items() if not k.endswith("_extra_state")}
        model.load_state_dict(dist_checkpointing.load(sharded, str(self.checkpoint)), strict=False)
        return model

    def batch(self, seed: int, step: int):
        if (seed, step) not in self.batches:
            self.batches[(seed, step)] = self._sample(seed, step)
        return self.batches[(seed, step)]

    def _sample(self, seed: int, step: int):
        from megatron_fp8rl.data.arithmetic import arithmetic_records

        a, tokenizer = self.args, self.tokenizer
        records = arithmetic_records("train", a.batch // 8, ops=("add", "mul"), seed=1000 * seed + step)
        texts = [tokenizer.apply_chat_template(list(r.messages), add_generation_prompt=True, tokenize=False)
                 for r in records]
        prompts = [tokenizer(text, add_special_tokens=False).input_ids for text in texts]
        width = max(map(len, prompts))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts]).repeat_interleave(8, 0)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]).repeat_interleave(8, 0)
        torch.manual_seed(1000 * seed + step)
        with torch.no_grad():
            out = self.sampler.generate(ids, attention_mask=attention,
                                        do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                        max_new_tokens=a.response, min_new_tokens=a.response, pad_token_id=pad)
        # left-padded prompts would shift positions; re-lay each sequence right-padded instead
        rows = [torch.tensor(prompts[i // 8] + out[i, width:].tolist()) for i in range(out.shape[0])]
        length = max(map(len, rows))
        tokens = torch.full((len(rows), length), pad, dtype=torch.long)
        mask = torch.zeros(len(rows), length - 1, dtype=torch.bool)
        for i, row in enumerate(rows):
            tokens[i, :len(row)] = row
            mask[i, len(row) - a.response - 1:len(row) - 1] = True
        generator = torch.Generator().manual_seed(1000 * seed + step)
        advantages = torch.randn(len(rows), 1, generator=generator).expand(len(rows), length - 1)
        return tokens, advantages, mask


def token_logprobs(model, tokens: torch.Tensor) -> torch.Tensor:
    """[B, S-1] log π of each next token."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    logits = model(tokens, positions, None).float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]


def shadow_logprobs(model, tokens: torch.Tensor, fp8: bool) -> torch.Tensor:
    from megatron_fp8rl.models.megatron_fp8_linear import high_precision_fp8_linears

    with torch.no_grad(), high_precision_fp8_linears(model) if fp8 else nullcontext():
        return token_logprobs(model, tokens)


def ppo_loss(logprobs, old, advantages, mask) -> torch.Tensor:
    ratio = torch.exp(logprobs - old)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(CLIP.low, CLIP.high) * advantages)
    return -(surrogate * mask).sum() / mask.sum()


def run_arm(workload, arm: str, seed: int, args) -> dict[str, list[float]]:
    """{'dlogr', 'overclip', 'moved' (mean |log r_shadow|: how far the policy really moved):
    one value per mini-batch m >= 1 of every step; 'quant': θ_old of the first step; 'codes': the
    share of FP8 weight codes that differ between θ_old and θ_1 of the first step} of one arm
    and seed."""
    from megatron_fp8rl.models.megatron_fp8_linear import held_fp8_weight_scales

    setting = ARMS[arm]
    fp8, held = setting is not None, setting is not None and setting[0]
    model = workload.model(arm, seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    found = {"dlogr": [], "overclip": [], "moved": [], "quant": [], "codes": [] if fp8 else [0.0], "ratios": []}
    rows = args.batch // args.mini_batches
    for step in range(args.steps):
        tokens, advantages, mask = workload.batch(seed, step)
        with torch.no_grad():
            old = token_logprobs(model, tokens)  # the recompute at θ_old, live scales
        shadow_old = shadow_logprobs(model, tokens, fp8)
        if step == 0:
            found["quant"].append(float((old - shadow_old).abs()[mask].mean()))
        with held_fp8_weight_scales(model) if held else nullcontext():
            old_codes = _weight_codes(model) if fp8 and step == 0 else None
            for m in range(args.mini_batches):
                part = slice(m * rows, (m + 1) * rows)
                logprobs = token_logprobs(model, tokens[part])
                if m == 1 and fp8 and step == 0:
                    found["codes"].append(_changed_share(old_codes, _weight_codes(model)))
                if m >= 1:
                    shadow = shadow_logprobs(model, tokens[part], fp8)
                    log_ratio = (logprobs.detach() - old[part])[mask[part]]
                    shadow_log_ratio = (shadow - shadow_old[part])[mask[part]]
                    found["dlogr"].append(float((log_ratio - shadow_log_ratio).abs().mean()))
                    found["moved"].append(float(shadow_log_ratio.abs().mean()))
                    found["ratios"].append((log_ratio, shadow_log_ratio, advantages[part][mask[part]]))
                    diagnostic = clip_diagnostic(log_ratio.exp(), shadow_log_ratio.exp(), advantages[part][mask[part]],
                                                 CLIP, CLIP)
                    found["overclip"].append(diagnostic["neg_overclip"])
                ppo_loss(logprobs, old[part], advantages[part], mask[part]).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    return found


def _weight_codes(model) -> list[torch.Tensor]:
    """The FP8 codes every FP8 linear's weight quantizer in force gives its current weight."""
    from megatron_fp8rl.models.megatron_fp8_linear import fp8_decoder_linears

    with torch.no_grad():
        return [module.fp8_quantizers.weight.quantize(module.weight).data.view(torch.uint8).clone()
                for _, _, module in fp8_decoder_linears(model)]


def _changed_share(before: list[torch.Tensor], after: list[torch.Tensor]) -> float:
    changed = sum(int((a != b).sum()) for a, b in zip(before, after))
    return changed / sum(a.numel() for a in before)


def _ratio(value: float, base: float) -> str:
    return "-" if base == 0 else f"{value / base:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="an HF folder (SmolLM2-135M-Instruct: .cache/smollm2); default: the tiny random GPT")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--steps", type=int, default=2, help="RL steps per arm and seed")
    parser.add_argument("--mini-batches", type=int, default=4, help="M (moderate4: 4)")
    parser.add_argument("--batch", type=int, default=64, help="sequences a step (moderate: 8 prompts x 8)")
    parser.add_argument("--seq", type=int, default=48, help="tiny GPT: tokens a sequence")
    parser.add_argument("--response", type=int, default=20, help="response tokens (moderate: 20)")
    parser.add_argument("--lr", type=float, default=1e-5, help="Adam lr (moderate: 1e-5)")
    parser.add_argument("--layers", type=int, default=4, help="tiny GPT")
    parser.add_argument("--hidden", type=int, default=256, help="tiny GPT")
    parser.add_argument("--ffn", type=int, default=704, help="tiny GPT")
    parser.add_argument("--vocab", type=int, default=2048, help="tiny GPT")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--boundary-only", action="store_true",
                        help="with --model: only the share of its decoder weights at an E4M3 rounding boundary")
    args = parser.parse_args()
    if args.boundary_only:
        print_boundary_shares(args.model)
        return
    arms, seeds = args.arms.split(","), [int(s) for s in args.seeds.split(",")]
    unknown = [arm for arm in arms if arm not in ARMS]
    if unknown or BASELINE not in arms:
        raise SystemExit(f"--arms: unknown {unknown} or no {BASELINE} (the baseline); valid: {list(ARMS)}")
    if args.batch % (8 * args.mini_batches) or args.mini_batches < 2:
        raise SystemExit(f"--batch {args.batch} must split into --mini-batches {args.mini_batches} >= 2 of whole "
                         "groups of 8")
    from megatron_fp8rl.launch import init_distributed, shutdown_distributed

    init_distributed(tensor_parallel=1, pipeline_parallel=1, seed=1)
    with tempfile.TemporaryDirectory() as workdir:
        workload = TinyGpt(args) if args.model is None else SmolLM2(args, Path(workdir))
        print(f"# python bench/ratio_noise.py {' '.join(sys.argv[1:])}")
        print(f"# {workload.describe()}; M = {args.mini_batches}, Adam lr {args.lr}, PPO clip 0.2/0.2, "
              f"{args.steps} steps, seeds {seeds}")
        results, started = {}, time.time()
        for arm in arms:
            results[arm] = {seed: run_arm(workload, arm, seed, args) for seed in seeds}
            print(f"# {arm}: done at {time.time() - started:.0f} s", flush=True)
    shutdown_distributed()
    print_table(results, arms, seeds)
    print_widened_clip(results, seeds)


def print_table(results, arms: list[str], seeds: list[int]) -> None:
    mean = lambda arm, key, seed: statistics.fmean(results[arm][seed][key])  # noqa: E731
    moved = statistics.fmean(mean(BASELINE, "moved", seed) for seed in seeds)
    print(f"\nm >= 1 (later mini-batches); the shadow's own mean |log r| there: {moved:.2e} (how far the policy moved)")
    print("\n| arm | mean abs dlog r, per seed | vs groupwise32 | A<0 over-clip, per seed | vs groupwise32 "
          "| quantization: mean abs dlogp vs float32 at θ_old | vs groupwise32 | weight codes changed by step 1 "
          "| vs groupwise32 | extra compute |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for arm in arms:
        cells = []
        for key, fmt in (("dlogr", "{:.2e}"), ("overclip", "{:.2%}"), ("quant", "{:.4f}"), ("codes", "{:.3%}")):
            per_seed = [mean(arm, key, seed) for seed in seeds]
            base = statistics.fmean(mean(BASELINE, key, seed) for seed in seeds)
            cells.append(", ".join(fmt.format(v) for v in per_seed))
            cells.append(_ratio(statistics.fmean(per_seed), base))
        print(f"| {arm} | {' | '.join(cells)} | 0 |")


def boundary_share(weight: torch.Tensor, scale_pow2: bool) -> float:
    """The share of `weight`'s elements within 2**-20 (relative) of an E4M3 rounding boundary once
    scaled by their 1x32 group's scale: the codes the smallest update flips. A checkpoint stored on
    a coarse grid (bf16, or this SmolLM2's Q4_1 origin) keeps its low mantissa bits under
    power-of-two scales, so many of its values sit exactly on ties; fp32 scales scatter them."""
    from megatron_fp8rl.fp8.formats import E4M3
    from megatron_fp8rl.fp8.quantize import blockwise_scales

    x = weight.float()
    scaled = x * blockwise_scales(x, E4M3, (1, 32), scale_pow2=scale_pow2).repeat_interleave(32, 1)[:, :x.shape[1]]
    up, down = ((scaled * (1 + sign * 2**-20)).clamp(-448, 448).to(E4M3.dtype) for sign in (1, -1))
    return float((up.view(torch.uint8) != down.view(torch.uint8)).float().mean())


def print_boundary_shares(model_dir: Path | None) -> None:
    from safetensors.torch import load_file

    if model_dir is None:
        raise SystemExit("--boundary-only needs --model (an HF folder)")
    weights = [w for name, w in sorted(load_file(str(model_dir / "model.safetensors")).items())
               if ".layers." in name and name.endswith("proj.weight")]
    print(f"# python bench/ratio_noise.py {' '.join(sys.argv[1:])}")
    print(f"# {len(weights)} decoder linear weights of {model_dir}, 1x32 groups")
    for pow2 in (False, True):
        share = statistics.fmean(boundary_share(w, pow2) for w in weights)
        print(f"{'power-of-two' if pow2 else 'fp32'} scales: {share:.3%} of the weights within 2^-20 of an "
              "E4M3 rounding boundary (mean over the linears)")


WIDER_LOWS = (0.8, 0.75, 0.7, 0.65, 0.6, 0.5)
"""FP8 lower clip bounds for the zero-cost control: plain groupwise32's ratios clipped at a lower
bound below 1 - eps, scored against the shadow's at 1 - eps = 0.8."""


def print_widened_clip(results, seeds: list[int]) -> None:
    """The 'clip less' control on the baseline's own ratios: over-clip (FP8 clips at L, the shadow
    does not at 0.8) and under-clip (the shadow clips, FP8 does not), pooled over seeds and m >= 1."""
    pooled = [torch.cat(parts) for parts in zip(*(r for seed in seeds for r in results[BASELINE][seed]["ratios"]))]
    log_ratio, shadow_log_ratio, advantages = pooled
    print(f"\nThe lower clip widened (zero-cost control), {BASELINE}'s ratios at m >= 1, seeds pooled:")
    print("\n| FP8 lower bound L | A<0 over-clip | A<0 under-clip |")
    print("|---|---|---|")
    for low in WIDER_LOWS:
        found = clip_diagnostic(log_ratio.exp(), shadow_log_ratio.exp(), advantages, ClipBounds(low, CLIP.high), CLIP)
        print(f"| {low} | {found['neg_overclip']:.2%} | {found['neg_underclip']:.2%} |")


if __name__ == "__main__":
    main()
