"""Tiny random-weight Hugging Face checkpoints for the rollout tests, built offline.

Each checkpoint is a transformers model made from a small config (random weights, fp32,
safetensors) plus a word-level tokenizer over a synthetic vocabulary, saved into one folder that
both transformers and SGLang load. Prompts are token ids, so the tokenizer only has to exist.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen3Config

VOCAB_SIZE = 128
LM_HEAD_GAIN = 3.0
EOS_TOKEN_ID = 1
# Small enough to start and run in seconds on two cores; head_dim 16 keeps attention kernels generic.
_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    bos_token_id=0,
    eos_token_id=EOS_TOKEN_ID,
    pad_token_id=2,
    tie_word_embeddings=False,
    dtype="float32",
)
CONFIGS = {
    "qwen3": lambda: Qwen3Config(**_COMMON, rms_norm_eps=1e-6, rope_theta=10000.0),
    "llama": lambda: LlamaConfig(**_COMMON, rms_norm_eps=1e-5, rope_theta=10000.0),
}


def tiny_tokenizer(vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Word-level tokenizer: token i is the word `w{i}`; ids 0/1/2 are bos/eos/pad."""
    specials = ["<s>", "</s>", "<pad>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<pad>"
    )


def build_tiny_model(family: str, out_dir: Path, seed: int | None = None) -> Path:
    """Save a random-weight `family` ("qwen3" or "llama") checkpoint and tokenizer into `out_dir`."""
    seed = sorted(CONFIGS).index(family) if seed is None else seed
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[family]())
    _spread_weights(model, seed)
    model.generation_config.do_sample = False
    model.save_pretrained(out_dir, safe_serialization=True)
    tiny_tokenizer().save_pretrained(out_dir)
    return Path(out_dir)


def build_tiny_rl_inputs(root: Path) -> tuple[Path, Path]:
    """A tiny random Llama and a 16-row JSONL of 4-word prompts (answer "w4") under `root`, for
    short end-to-end RL runs, with 8 more prompts held out beside it (`held_out_prompts`);
    returns (model folder, prompt file)."""
    model = build_tiny_model("llama", root / "model")
    generator = torch.Generator().manual_seed(0)
    prompts = root / "prompts.jsonl"
    for path, rows in ((prompts, 16), (held_out_prompts(prompts), 8)):
        with open(path, "w") as handle:
            for _ in range(rows):
                words = " ".join(f"w{int(i)}" for i in torch.randint(3, 128, (4,), generator=generator))
                handle.write(json.dumps({"prompt": words, "answer": "w4"}) + "\n")
    return model, prompts


def held_out_prompts(prompts: Path) -> Path:
    """The held-out prompt file `build_tiny_rl_inputs` writes beside its training `prompts`
    (a run refuses held-out prompts it trains on)."""
    return prompts.with_name("held_out_prompts.jsonl")


def _spread_weights(model: torch.nn.Module, seed: int) -> None:
    """Unit-variance activations and an lm_head LM_HEAD_GAIN times larger, so logits are peaked:
    greedy choices then have clear margins and comparing two engines' argmax does not hinge on ties."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.copy_(_random_weight(name, param.shape, gen))


def _random_weight(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    gain = LM_HEAD_GAIN if name == "lm_head.weight" else 1.0
    return torch.randn(shape, generator=gen) * (gain / shape[1] ** 0.5)


def load_hf(model_dir: Path) -> torch.nn.Module:
    """The transformers reference model in fp32, eval mode."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def random_state_dict(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """New random weights with the same names and shapes as the checkpoint in `model_dir`."""
    model = load_hf(model_dir)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, param in model.state_dict().items():
        if param.dim() == 2:
            out[name] = _random_weight(name, param.shape, gen)
        else:  # norm weights around 1
            out[name] = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
    return out
