"""What an FP8 granularity costs the served model before any training: greedy accuracy on the
built-in task and mean |Δlogp| against float32, per granularity, in one run.

Every decoder linear of the HF model (lm_head and embeddings stay high precision) computes
y = QDQ_a(x) @ QDQ_w(W)^T + b, where QDQ is E4M3 quantize-dequantize with megatron_fp8rl.fp8's own
quantizers (the values an FP8 GEMM multiplies; its fp32 accumulation differs only in rounding):
    tensor/static   weights per tensor, activations per tensor with a static bound (the max
                    amax over a calibration pass on 16 training prompts): today's aligned FP8
    tensor/token    weights per tensor, activations per token (row-wise, batch-invariant)
    channel/token   weights per output channel, activations per token
    block/group     weights per 128x128 block, activations per 1x128 group (DeepSeek/SGLang)
    group/group     weights per 1x128 group (each output channel's K in groups of 128),
                    activations per 1x128 group: the `groupwise` recipe
    group32/group32 1x32 groups on both sides (MXFP8's block length, with fp32 scales): the
                    `groupwise32` recipe, the CPU demo's
    group32p2/group32p2  the same with power-of-two scales (MXFP8's UE8M0; scale_pow2)
    none            on either side: that operand stays float32 (which side costs the accuracy)
    ...@F:L         the first F and the last L decoder layers stay float32 (Megatron-LM's
                    --first-last-layers-bf16 idea), e.g. group/group@1:1
The baseline is the same model in float32, measured in the same run: greedy accuracy on the same
problems (with the problems gained/lost and McNemar's p), and mean |Δlogp| over the response
tokens of float32's own greedy answers (teacher-forced).

    python bench/fp8_accuracy.py [--model .cache/smollm2] [--problems 300] [--ops add,mul] [--seed 1234]
(--ops defaults to the CPU demo's task, examples/cpu_demo.yaml's data.arithmetic_ops; --seed picks
the problems; the trainer's own eval set is `--seed <train.seed>`.)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from megatron_fp8rl.data.arithmetic import arithmetic_records  # noqa: E402
from megatron_fp8rl.data.rewards import last_number_reward  # noqa: E402
from megatron_fp8rl.fp8.formats import E4M3  # noqa: E402
from megatron_fp8rl.fp8.quantize import (  # noqa: E402
    finite_amax,
    quantize,
    quantize_blockwise,
    quantize_per_row,
    scale_from_bound,
)
from megatron_fp8rl.rl.metrics import paired_eval_change  # noqa: E402


def per_tensor(x: torch.Tensor, bound: torch.Tensor | None = None) -> torch.Tensor:
    scale = scale_from_bound(finite_amax(x) if bound is None else bound, E4M3.max, 0)
    return quantize(x, scale, E4M3).float() / scale


def per_row(x: torch.Tensor) -> torch.Tensor:
    q = quantize_per_row(x.reshape(-1, x.shape[-1]), E4M3)
    return (q.data.float() * q.scale_inv.reshape(-1, 1)).reshape(x.shape)


def per_block(x: torch.Tensor, block: tuple[int, int], scale_pow2: bool = False) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    return quantize_blockwise(flat, E4M3, block, scale_pow2=scale_pow2).dequantize().reshape(x.shape)


WEIGHTS = {"tensor": per_tensor, "channel": per_row, "block": lambda w: per_block(w, (128, 128)),
           "group": lambda w: per_block(w, (1, 128)), "group32": lambda w: per_block(w, (1, 32)),
           "group32p2": lambda w: per_block(w, (1, 32), scale_pow2=True), "none": lambda w: w}
ACTIVATIONS = {"token": per_row, "group": lambda x: per_block(x, (1, 128)),
               "group32": lambda x: per_block(x, (1, 32)),
               "group32p2": lambda x: per_block(x, (1, 32), scale_pow2=True), "none": lambda x: x}
GRANULARITIES = ("tensor/static", "tensor/token", "channel/token", "block/group", "group/group")


def parse_granularity(text: str) -> tuple[str, str, int, int]:
    """'weights/activations[@first:last]' -> (weights, activations, first, last)."""
    scheme, _, kept = text.partition("@")
    weights, _, activations = scheme.partition("/")
    if weights not in WEIGHTS or (activations not in ACTIVATIONS and activations != "static"):
        raise SystemExit(f"--granularities: unknown {text!r} (weights: {sorted(WEIGHTS)}; "
                         f"activations: {sorted(ACTIVATIONS) + ['static']})")
    first, _, last = kept.partition(":") if kept else ("0", "", "0")
    return weights, activations, int(first), int(last or 0)


def decoder_linears(model) -> list[torch.nn.Linear]:
    return [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]


class QdqLinear(torch.nn.Module):
    """y = QDQ_a(x) @ QDQ_w(W)^T + b; `static` records the activation amax instead (calibration)."""

    def __init__(self, linear: torch.nn.Linear, weight_qdq, activation: str):
        super().__init__()
        self.weight, self.bias = weight_qdq(linear.weight.detach().float()), linear.bias
        self.activation, self.bound, self.calibrating = activation, None, False

    def forward(self, x):
        if self.activation == "static":
            amax = finite_amax(x.detach().float())
            if self.calibrating:
                self.bound = amax if self.bound is None else torch.maximum(self.bound, amax)
                return torch.nn.functional.linear(x, self.weight, self.bias)
            x = per_tensor(x.float(), self.bound)
        else:
            x = ACTIVATIONS[self.activation](x.float())
        return torch.nn.functional.linear(x, self.weight, self.bias)


def quantized_copy(model_dir: Path, granularity: str, calibration: list[str], tokenizer):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    weights, activations, first, last = parse_granularity(granularity)
    layers = model.model.layers
    wrapped = []
    for layer in list(layers)[first:len(layers) - last]:
        for parent in layer.modules():
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, QdqLinear(child, WEIGHTS[weights], activations))
                    wrapped.append(getattr(parent, name))
    if activations == "static":
        for module in wrapped:
            module.calibrating = True
        with torch.no_grad():
            model(**tokenizer(calibration, return_tensors="pt", padding=True))
        for module in wrapped:
            module.calibrating = False
    return model


def greedy(model, tokenizer, texts: list[str], max_new_tokens: int, chunk: int = 50) -> list[list[int]]:
    out = []
    for start in range(0, len(texts), chunk):
        batch = tokenizer(texts[start:start + chunk], return_tensors="pt", padding=True)
        with torch.no_grad():
            ids = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, temperature=None, top_p=None, top_k=None)
        out += [row[batch.input_ids.shape[1]:].tolist() for row in ids]
    return out


def response_logprobs(model, tokenizer, texts: list[str], responses: list[list[int]]) -> list[torch.Tensor]:
    found = []
    for text, response in zip(texts, responses):
        prompt = tokenizer(text, return_tensors="pt").input_ids[0]
        ids = torch.cat([prompt, torch.tensor(response, dtype=torch.long)])[None]
        with torch.no_grad():
            logits = model(ids).logits[0, prompt.numel() - 1:-1].float()
        found.append(torch.log_softmax(logits, -1).gather(-1, ids[0, prompt.numel():, None])[:, 0])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / ".cache" / "smollm2")
    parser.add_argument("--problems", type=int, default=300)
    parser.add_argument("--ops", default="add,mul", help="arithmetic ops (default: the CPU demo's)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--logprob-problems", type=int, default=64)
    parser.add_argument("--granularities", default=",".join(GRANULARITIES))
    parser.add_argument("--seed", type=int, default=1234,
                        help="the problems' seed (the trainer's eval uses train.seed)")
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    ops = tuple(args.ops.split(","))
    chat = lambda r: tokenizer.apply_chat_template(list(r.messages), add_generation_prompt=True, tokenize=False)  # noqa: E731
    records = arithmetic_records("eval", args.problems, ops=ops, seed=args.seed)
    texts = [chat(r) for r in records]
    calibration = [chat(r) for r in arithmetic_records("train", 16, ops=ops, seed=args.seed)]
    reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    base = greedy(reference, tokenizer, texts, args.max_new_tokens)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    base_correct = [last_number_reward(decode(ids), r.answer) > 0 for ids, r in zip(base, records)]
    few = slice(0, args.logprob_problems)
    base_logprobs = response_logprobs(reference, tokenizer, texts[few], base[few])
    print(f"float32: greedy accuracy {sum(base_correct) / len(records):.3f} on {len(records)} problems")
    print("\n| granularity (weights/activations) | greedy acc | vs float32 | gained/lost | McNemar p | mean abs dlogp |")
    print("|---|---|---|---|---|---|")
    print(f"| float32 | {sum(base_correct) / len(records):.3f} | 0 | - | - | 0 |")
    granularities = args.granularities.split(",")
    for granularity in granularities:
        parse_granularity(granularity)
    for granularity in granularities:
        model = quantized_copy(args.model, granularity, calibration, tokenizer)
        answers = greedy(model, tokenizer, texts, args.max_new_tokens)
        correct = [last_number_reward(decode(ids), r.answer) > 0 for ids, r in zip(answers, records)]
        change = paired_eval_change(base_correct, correct)
        deltas = torch.cat([(a - b).abs() for a, b in
                            zip(response_logprobs(model, tokenizer, texts[few], base[few]), base_logprobs)])
        accuracy = sum(correct) / len(records)
        print(f"| {granularity} | {accuracy:.3f} | {accuracy - sum(base_correct) / len(records):+.3f} "
              f"| {change['gained']:.0f}/{change['lost']:.0f} | {change['mcnemar_p']:.3g} | {deltas.mean():.4f} |",
              flush=True)


if __name__ == "__main__":
    main()
