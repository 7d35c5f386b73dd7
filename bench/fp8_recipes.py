"""FP8 recipes on real SmolLM2-135M-Instruct tensors: quantization SNR, MSE, saturation, underflow.

Owns: the comparison of every FP8 scaling recipe (megatron_fp8rl/fp8/recipe.py) on the tensors an
FP8 trainer really quantizes, and the blockwise-quantization throughput check. Uses the
library's quantizers as they are (megatron_fp8rl.fp8) and megatron_fp8rl.data for prompts;
transformers is imported only to load the model. Must not import trainer, rollout or compat code.

Workload: SmolLM2-135M-Instruct in fp32 (transformers) runs `--steps` policy-gradient steps on
arithmetic prompts rendered with its chat template: sample `--new-tokens` tokens per prompt at
temperature 1, loss = -mean over response tokens of advantage * logprob with random +-1
advantages per sequence, AdamW at `--lr`, so weights, activations and gradients drift as in RL.
Every nn.Linear except lm_head is probed: its weight [N, K], its input flattened to
[tokens, K] and its output gradient [tokens, N], padding tokens dropped (what a packed-sequence
trainer quantizes); HF's separate q/k/v and gate/up projections each count as a linear (Megatron
fuses them, sharing one input quantizer). Each recipe keeps one `Fp8Quantizers` per linear
(`make_quantizers`, exactly as our FP8 linear does) and sees each tensor once per step, in step
order, before the optimizer moves the weights. Per tensor: signal = sum x^2, error =
sum (x - dq(q(x)))^2, SNR dB = 10 log10(signal / error), saturated and underflowed fractions
from the quantizer's QuantStats.
Per recipe and kind: mean SNR over tensors, MSE = total error / total elements, its ratio to
tensorwise current scaling's MSE from the same run, element-weighted saturated / underflow /
recalibrated fractions.

Step 0 is reported apart: delayed recipes have no amax history there and quantize with scale 1
(TE semantics), which says nothing about their steady state. The main table and the targets
cover steps 1..N-1 (N-1 optimizer steps of drift); the step-0 table shows the cold start.

Throughput: `quantize_blockwise` (128x128 blocks, E4M3) of a `--block-shape` tensor vs
`tensor.clone()` of the same tensor, fp32 and bf16, `--repeats` calls of each interleaved, medians;
ratio = clone time / quantize time. Measured first, while the process heap is fresh.

Threads: `--threads` (default 1). On this shared 2-core box two torch threads ran the
quantization 5x slower than one (a descheduled OpenMP thread stalls every parallel op); every
figure is a ratio measured under the same setting.

Usage: python bench/fp8_recipes.py [--model .cache/smollm2] [--steps 21] [--batch 4]
       [--new-tokens 24] [--lr 5e-5] [--quick] [--variant margin=0 --variant criterion=mse ...]
The model folder comes from `python tools/materialize_smollm2.py .cache/smollm2`. The default
run took 18 minutes on the shared 2-core box (~40 s of quantization per step); --quick, 3.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_fp8rl.fp8 import (
    E4M3,
    CalibratedDelayedScaling,
    make_quantizers,
    quantize_blockwise,
    recipe_by_name,
)
from megatron_fp8rl.fp8.formats import recipe_formats

REPO = Path(__file__).resolve().parents[1]
CALIBRATED = "calibrated"
CURRENT = "tensorwise"
DELAYED_BASELINES = ("te_delayed", "megatron_delayed")
RECIPE_NAMES = (CALIBRATED, "te_delayed", "megatron_delayed", CURRENT, "blockwise")
KINDS = ("weights", "activations", "gradients")
ROLE_OF_KIND = {"weights": "weight", "activations": "input", "gradients": "grad_output"}
PHASES = ("cold", "warm")
"""'cold': step 0 (no scaling history yet); 'warm': every later step."""
MAX_MSE_RATIO_TO_CURRENT = 1.10
MIN_BLOCKWISE_THROUGHPUT = 0.3


@dataclass
class KindTotals:
    """Error and statistics of one recipe on one kind of tensor, summed over tensors."""

    error: float = 0.0
    """Sum of (x - dq(q(x)))^2."""
    elements: int = 0
    snr_sum: float = 0.0
    """Sum of per-tensor SNR dB (tensors with signal > 0)."""
    tensors: int = 0
    saturated: float = 0.0
    """Element-weighted sum of saturated fractions."""
    underflow: float = 0.0
    """Element-weighted sum of underflow fractions."""
    recalibrated: float = 0.0
    """Element-weighted sum of the recalibrated flag / fraction."""

    def add(self, signal: float, error: float, elements: int, stats: dict) -> None:
        self.error, self.elements = self.error + error, self.elements + elements
        if signal > 0:
            self.snr_sum += snr_db(signal, error)
            self.tensors += 1
        self.saturated += stats["saturated_fraction"] * elements
        self.underflow += stats["underflow_fraction"] * elements
        self.recalibrated += stats["recalibrated"] * elements

    def summary(self) -> dict[str, float]:
        """Mean SNR dB, MSE and the element-weighted fractions."""
        n = max(self.elements, 1)
        return {
            "snr_db": self.snr_sum / max(self.tensors, 1),
            "mse": self.error / n,
            "saturated": self.saturated / n,
            "underflow": self.underflow / n,
            "recalibrated": self.recalibrated / n,
        }


def snr_db(signal: float, error: float) -> float:
    """10 log10(signal / error), capped at 300 dB for an exact quantization."""
    return 10.0 * math.log10(signal / max(error, signal * 1e-30))


def tensor_error(quantizer, x: torch.Tensor) -> tuple[float, dict]:
    """Quantize 2-D x with the stateful `quantizer`: (sum (x - dq(q(x)))^2, its stats)."""
    x = x.detach().float()
    restored = quantizer.quantize(x).dequantize(torch.float32)
    return float(torch.linalg.vector_norm(restored - x)) ** 2, quantizer.last_stats.as_floats()


def signal_energy(x: torch.Tensor) -> float:
    """sum x^2."""
    return float(torch.linalg.vector_norm(x.detach().float())) ** 2


class RecipeProbe:
    """One recipe's quantizers (one Fp8Quantizers per linear, made lazily) and its totals."""

    def __init__(self, name: str, recipe):
        self.name, self.recipe = name, recipe
        self.quantizers: dict[str, object] = {}
        self.totals = {(phase, kind): KindTotals() for phase in PHASES for kind in KINDS}

    def observe(self, layer: str, kind: str, x: torch.Tensor, signal: float, phase: str) -> None:
        """Quantize x (sum x^2 = `signal`) with this layer's quantizer of `kind`; add it up."""
        if layer not in self.quantizers:
            self.quantizers[layer] = make_quantizers(self.recipe)
        quantizer = getattr(self.quantizers[layer], ROLE_OF_KIND[kind])
        error, stats = tensor_error(quantizer, x)
        self.totals[(phase, kind)].add(signal, error, x.numel(), stats)

    def formats(self) -> str:
        forward, backward = recipe_formats(self.recipe.fp8_format)
        return f"{forward.name}/{backward.name}"


class LinearCapture:
    """Forward hooks on every nn.Linear but lm_head: per step, each layer's weight, input
    [tokens, K] and output gradient [tokens, N], keeping only tokens where `token_mask` is set."""

    def __init__(self, model: torch.nn.Module, skip: tuple[str, ...] = ("lm_head",)):
        self.enabled = False
        self.token_mask: torch.Tensor | None = None
        self.step: dict[str, dict[str, torch.Tensor]] = {}
        self.handles = [
            module.register_forward_hook(self._hook(name))
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name.split(".")[-1] not in skip
        ]

    def _tokens(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.token_mask] if self.token_mask is not None else t.reshape(-1, t.shape[-1])

    def _hook(self, name: str):
        def hook(module, inputs, output):
            if not self.enabled:
                return
            entry = self.step.setdefault(name, {})
            entry["weights"] = module.weight.detach()
            entry["activations"] = self._tokens(inputs[0].detach())
            output.register_hook(
                lambda grad: entry.__setitem__("gradients", self._tokens(grad.detach())))
        return hook

    def take(self) -> dict[str, dict[str, torch.Tensor]]:
        step, self.step = self.step, {}
        return step

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, P] left-padded with `pad_id`, and the attention mask [B, P]."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def sample_responses(model, prompts: list[list[int]], new_tokens: int, pad_id: int, eos_id: int):
    """Sample at temperature 1: (sequence ids [B, P+R], attention mask [B, P+R], response mask
    [B, R] marking response tokens up to and including the first EOS)."""
    ids, mask = left_pad(prompts, pad_id)
    with torch.no_grad():
        sequences = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
            top_p=1.0, max_new_tokens=new_tokens, pad_token_id=pad_id, eos_token_id=eos_id,
        )
    response = sequences[:, ids.shape[1]:]
    is_eos = (response == eos_id).long()
    response_mask = (is_eos.cumsum(1) - is_eos) == 0
    full_mask = torch.cat([mask.bool(), response_mask], dim=1)
    return sequences, full_mask, response_mask


def policy_gradient_loss(model, sequences, full_mask, response_mask, advantages) -> torch.Tensor:
    """-sum(advantage * logprob over response tokens) / number of response tokens."""
    prompt_len = sequences.shape[1] - response_mask.shape[1]
    logits = model(input_ids=sequences, attention_mask=full_mask.long()).logits
    logits = logits[:, prompt_len - 1:-1].float()
    logprobs = torch.log_softmax(logits, -1).gather(-1, sequences[:, prompt_len:, None]).squeeze(-1)
    weights = advantages[:, None] * response_mask
    return -(weights * logprobs).sum() / response_mask.sum().clamp(min=1)


def training_steps(model, prompt_batches, new_tokens: int, lr: float, pad_id: int, eos_id: int,
                   seed: int = 0):
    """Run one policy-gradient step per prompt batch; yields each step's captured tensors
    ({layer: {kind: tensor}}) after the backward and before the optimizer moves the weights."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    capture = LinearCapture(model)
    try:
        for prompts in prompt_batches:
            sequences, full_mask, response_mask = sample_responses(
                model, prompts, new_tokens, pad_id, eos_id)
            advantages = torch.randint(0, 2, (len(prompts),), generator=generator).float() * 2 - 1
            capture.enabled, capture.token_mask = True, full_mask
            loss = policy_gradient_loss(model, sequences, full_mask, response_mask, advantages)
            loss.backward()
            capture.enabled = False
            yield capture.take()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        capture.remove()


def measure_recipes(model, prompt_batches, recipes: dict, new_tokens: int, lr: float,
                    pad_id: int, eos_id: int, seed: int = 0, log=None) -> dict[str, RecipeProbe]:
    """Every recipe's totals over the policy-gradient steps (one step per prompt batch)."""
    probes = {name: RecipeProbe(name, recipe) for name, recipe in recipes.items()}
    model.train()
    steps = training_steps(model, prompt_batches, new_tokens, lr, pad_id, eos_id, seed)
    for step, captured in enumerate(steps):
        started = time.perf_counter()
        tokens = observe_step(probes, captured, PHASES[0] if step == 0 else PHASES[1])
        del captured  # free the step's tensors before the optimizer step allocates
        if log is not None:
            log(f"step {step}: {tokens} tokens, quantized in {time.perf_counter() - started:.1f} s")
    return probes


def observe_step(probes: dict[str, RecipeProbe], captured: dict, phase: str) -> int:
    """Feed one step's tensors ({layer: {kind: tensor}}) to every recipe; returns the tokens."""
    with torch.no_grad():
        for layer, tensors in captured.items():
            for kind in KINDS:
                signal = signal_energy(tensors[kind])
                for probe in probes.values():
                    probe.observe(layer, kind, tensors[kind], signal, phase)
            release_freed_memory()
    return next(iter(captured.values()))["activations"].shape[0]


def release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc `malloc_trim`; a no-op elsewhere).

    Why: the quantizers' small long-lived state tensors land between the large temporaries of
    each quantization, so glibc cannot shrink its heap. Measured here without it: resident
    memory grew by ~1 GB per recipe during the first step (13 GB with 8 recipes).
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def summaries(probes: dict[str, RecipeProbe], phase: str) -> dict[str, dict[str, dict]]:
    """{recipe: {kind: summary}} with 'mse_vs_current' = MSE / tensorwise current scaling's."""
    table = {name: {kind: probe.totals[(phase, kind)].summary() for kind in KINDS}
             for name, probe in probes.items()}
    for name in table:
        for kind in KINDS:
            reference = table[CURRENT][kind]["mse"]
            mse = table[name][kind]["mse"]
            table[name][kind]["mse_vs_current"] = mse / reference if reference else math.nan
    return table


def format_table(probes: dict[str, RecipeProbe], phase: str) -> str:
    """One row per recipe x kind: SNR dB, MSE / tensorwise, saturated %, underflow %, recal %."""
    table = summaries(probes, phase)
    width = max(len(name) for name in probes)
    header = (f"{'recipe':<{width}} {'fmt':<10} {'kind':<12} {'SNR dB':>7} {'MSE/tensorwise':>15} "
              f"{'saturated %':>12} {'underflow %':>12} {'recal %':>8}")
    lines = [header, "-" * len(header)]
    for name, probe in probes.items():
        for kind in KINDS:
            row = table[name][kind]
            lines.append(
                f"{name:<{width}} {probe.formats():<10} {kind:<12} {row['snr_db']:>7.2f} "
                f"{row['mse_vs_current']:>15.4f} {100 * row['saturated']:>12.5f} "
                f"{100 * row['underflow']:>12.4f} {100 * row['recalibrated']:>8.2f}")
    return "\n".join(lines)


def format_ratios(probes: dict[str, RecipeProbe], phase: str, recipe: str = CALIBRATED) -> str:
    """`recipe`'s MSE divided by each other recipe's MSE, per kind (< 1: `recipe` is better)."""
    table = summaries(probes, phase)
    others = [name for name in probes if name != recipe]
    widths = [max(len(name), 10) for name in others]
    header = f"{'kind':<12} " + " ".join(f"{name:>{w}}" for name, w in zip(others, widths))
    lines = [f"MSE of {recipe} / MSE of baseline ({phase}):", header]
    for kind in KINDS:
        ratios = [table[recipe][kind]["mse"] / table[name][kind]["mse"]
                  if table[name][kind]["mse"] else math.nan for name in others]
        lines.append(f"{kind:<12} " + " ".join(f"{r:>{w}.4f}" for r, w in zip(ratios, widths)))
    return "\n".join(lines)


def recipe_targets(probes: dict[str, RecipeProbe], phase: str = "warm") -> list[tuple]:
    """The issue's recipe targets for the calibrated default: (target, met, figures)."""
    table = summaries(probes, phase)
    calibrated = table[CALIBRATED]
    results = []
    for kind in ("activations", "gradients"):
        for baseline in DELAYED_BASELINES:
            ratio = calibrated[kind]["mse"] / table[baseline][kind]["mse"]
            results.append((f"{kind}: MSE below {baseline}", ratio < 1.0, f"ratio {ratio:.4f}"))
        ratio = calibrated[kind]["mse_vs_current"]
        results.append((f"{kind}: MSE within 10% of {CURRENT}", ratio <= MAX_MSE_RATIO_TO_CURRENT,
                        f"ratio {ratio:.4f} (limit {MAX_MSE_RATIO_TO_CURRENT})"))
    budget = probes[CALIBRATED].recipe.saturation_budget
    worst = max(calibrated[kind]["saturated"] for kind in KINDS)
    results.append(("saturation within the calibrated budget (all kinds)", worst <= budget,
                    f"max saturated fraction {worst:.3g}, budget {budget:g}"))
    return results


def paired_medians(first, second, repeats: int) -> tuple[float, float]:
    """Median wall times of `repeats` calls of `first` and of `second`, the calls interleaved
    (first, second, first, ...) so load changes on a shared machine hit both alike; one warm-up
    call of each."""
    first(), second()
    times = ([], [])
    for _ in range(repeats):
        for fn, bucket in zip((first, second), times):
            started = time.perf_counter()
            fn()
            bucket.append(time.perf_counter() - started)
    return statistics.median(times[0]), statistics.median(times[1])


def blockwise_throughput(shape: tuple[int, int], dtype: torch.dtype, repeats: int = 9) -> dict:
    """quantize_blockwise (128x128, E4M3) vs clone of one random [N, K] tensor: seconds, ratio."""
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    copy, quantize = paired_medians(
        lambda: tensor.clone(), lambda: quantize_blockwise(tensor, E4M3), repeats)
    return {"shape": shape, "dtype": dtype, "copy_s": copy, "quantize_s": quantize,
            "ratio": copy / quantize}


def format_throughput(result: dict) -> str:
    gib = result["shape"][0] * result["shape"][1] * result["dtype"].itemsize / 2**30
    return (f"blockwise quantize {tuple(result['shape'])} {dtype_name(result['dtype'])}: "
            f"clone {1e3 * result['copy_s']:.1f} ms ({gib / result['copy_s']:.2f} GiB/s), "
            f"quantize_blockwise {1e3 * result['quantize_s']:.1f} ms "
            f"({gib / result['quantize_s']:.2f} GiB/s of input), "
            f"throughput ratio {result['ratio']:.3f}x of a plain copy")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def parse_variant(text: str) -> tuple[str, CalibratedDelayedScaling]:
    """'margin=0,criterion=mse' -> ('calibrated[margin=0,criterion=mse]', recipe); field types
    follow CalibratedDelayedScaling's defaults."""
    defaults = {f.name: f.default for f in dataclasses.fields(CalibratedDelayedScaling)}
    fields_ = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key not in defaults:
            raise ValueError(f"--variant: unknown field {key!r}; valid: {', '.join(defaults)}")
        kind = type(defaults[key])
        fields_[key] = value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
    return f"{CALIBRATED}[{text}]", CalibratedDelayedScaling(**fields_)


def default_recipes(variants: list[str] = ()) -> dict:
    """The five recipes at their defaults, then any calibrated variants."""
    recipes = {name: recipe_by_name(name) for name in RECIPE_NAMES}
    recipes.update(parse_variant(text) for text in variants)
    return recipes


def arithmetic_prompt_batches(tokenizer, steps: int, batch: int, seed: int = 0) -> list:
    """`steps` batches of `batch` chat-templated arithmetic prompts (token ids), no repeats."""
    from megatron_fp8rl.data.arithmetic import arithmetic_records
    from megatron_fp8rl.data.records import prompt_token_ids

    records = arithmetic_records("train", steps * batch, ops=("add", "sub", "mul"), seed=seed)
    ids = [prompt_token_ids(record, tokenizer) for record in records]
    return [ids[start:start + batch] for start in range(0, len(ids), batch)]


def load_smollm2(model_dir: Path):
    """(fp32 LlamaForCausalLM, tokenizer) from a materialized HF folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"{model_dir} holds no HF model; run: "
                         f"python tools/materialize_smollm2.py {model_dir}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model, tokenizer


def report_recipes(probes: dict[str, RecipeProbe]) -> None:
    print(f"\n== steps 1..N-1 (warm; targets use these) ==\n{format_table(probes, 'warm')}")
    print(f"\n{format_ratios(probes, 'warm')}")
    print(f"\n== step 0 only (cold: delayed recipes have no history, scale 1) ==\n"
          f"{format_table(probes, 'cold')}")
    print("\ntargets (calibrated default, steps 1..N-1):")
    for target, met, figures in recipe_targets(probes):
        print(f"  [{'MET' if met else 'MISSED'}] {target}: {figures}")


def report_throughput(shape: tuple[int, int], repeats: int) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        result = blockwise_throughput(shape, dtype, repeats)
        met = result["ratio"] >= MIN_BLOCKWISE_THROUGHPUT
        print(format_throughput(result))
        print(f"  [{'MET' if met else 'MISSED'}] blockwise throughput >= "
              f"{MIN_BLOCKWISE_THROUGHPUT}x of a plain copy ({dtype_name(dtype)})")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / ".cache" / "smollm2")
    parser.add_argument("--steps", type=int, default=21,
                        help="policy-gradient steps (step 0 reported apart, targets use the rest)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--new-tokens", type=int, default=24, help="sampled response tokens")
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variant", action="append", default=[],
                        help="extra calibrated recipe, e.g. margin=0,criterion=mse (repeatable)")
    parser.add_argument("--block-shape", type=int, nargs=2, default=(4096, 4096))
    parser.add_argument("--repeats", type=int, default=9, help="timed runs per throughput figure")
    parser.add_argument("--skip-recipes", action="store_true", help="throughput only")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: on this shared 2-core box 2 ran 5x slower)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 4 steps of 2 sequences, 3 throughput repeats")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.batch = min(args.steps, 4), min(args.batch, 2)
        args.repeats = min(args.repeats, 3)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    report_throughput(tuple(args.block_shape), args.repeats)  # first: a fresh process's heap
    if args.skip_recipes:
        return 0
    model, tokenizer = load_smollm2(args.model)
    batches = arithmetic_prompt_batches(tokenizer, args.steps, args.batch, args.seed)
    print(f"\nSmolLM2-135M-Instruct fp32: {args.steps} steps x {args.batch} sequences, "
          f"{args.new_tokens} sampled tokens, AdamW lr {args.lr}")
    started = time.perf_counter()
    probes = measure_recipes(model, batches, default_recipes(args.variant), args.new_tokens,
                             args.lr, tokenizer.pad_token_id, tokenizer.eos_token_id, args.seed,
                             log=lambda line: print(line, flush=True))
    print(f"recipes measured in {time.perf_counter() - started:.0f} s")
    report_recipes(probes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
