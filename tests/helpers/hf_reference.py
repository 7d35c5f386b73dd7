"""transformers as the independent oracle for SGLang's rollouts: greedy continuations and
per-token log-softmax logprobs of given continuations, fp32 on CPU."""
from __future__ import annotations

import torch


@torch.no_grad()
def greedy(model, prompt: list[int], max_new_tokens: int, eos_token_id: int) -> list[int]:
    """HF `generate` greedy continuation, cut after the first EOS (SGLang stops there too)."""
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=eos_token_id, pad_token_id=eos_token_id,
    )[0, len(prompt):].tolist()
    return out[: out.index(eos_token_id) + 1] if eos_token_id in out else out


@torch.no_grad()
def token_logprobs(model, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """log softmax(logits)[t] of each continuation token given its prefix, temperature 1, [T]."""
    ids = torch.tensor([prompt + continuation])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(continuation)[:, None])[:, 0]


def load_state_dict(model, state_dict: dict[str, torch.Tensor]) -> None:
    """Overwrite `model`'s parameters (a subset is fine) in place."""
    own = model.state_dict()
    with torch.no_grad():
        for name, tensor in state_dict.items():
            own[name].copy_(tensor)
