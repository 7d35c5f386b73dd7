"""SGLang's bf16 linears and lm_head on the CPU engine run as fp32 GEMMs rounded once
(compat/bf16_gemm.py, patched in by our `sglang.srt.plugins` entry point).

Oracle: the fp32 GEMM of the same bf16 values, rounded to bf16, computed here without any patch.
The shapes are ones where the CPU's native bf16 kernel gives other bits in some elements, so the
equality checks can fail; float32 calls must come back exactly as SGLang computes them.
"""
import types

import pytest
import torch
import torch.nn.functional as F

from megatron_fp8rl.compat import sglang_cpu
from tests.helpers.rollout import needs_sglang

pytestmark = needs_sglang


@pytest.fixture(scope="module")
def patched():
    sglang_cpu.install()
    from megatron_fp8rl.rollout.sglang_fp8 import register
    from sglang.srt.layers.logits_processor import LogitsProcessor
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    register()  # what load_plugins() runs in SGLang's processes
    register()  # idempotent: one wrapper, not two
    assert getattr(UnquantizedLinearMethod.apply, "megatron_fp8rl_bf16_gemms", False)
    assert not getattr(UnquantizedLinearMethod.apply.__wrapped__, "megatron_fp8rl_bf16_gemms", False)
    return UnquantizedLinearMethod, LogitsProcessor


def _operands(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1536, generator=gen).to(dtype)
    w = torch.randn(576, 1536, generator=gen).to(dtype)
    b = torch.randn(576, generator=gen).to(dtype)
    return x, w, b


def test_unquantized_linear_bf16_is_the_fp32_gemm_rounded_once(patched):
    method, _ = patched
    x, w, b = _operands(torch.bfloat16)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(w, requires_grad=False)
    served = method().apply(layer, x, b)
    oracle = F.linear(x.float(), w.float(), b.float()).bfloat16()
    native = F.linear(x, w, b)
    assert served.dtype == torch.bfloat16 and torch.equal(served, oracle)
    assert not torch.equal(native, oracle)  # the native kernel's bits differ: the check can fail
    torch.testing.assert_close(served.float(), native.float(), rtol=2 ** -6, atol=1e-2)

    x32, w32, b32 = _operands(torch.float32)
    layer.weight = torch.nn.Parameter(w32, requires_grad=False)
    assert torch.equal(method().apply(layer, x32, b32), F.linear(x32, w32, b32))


def test_lm_head_bf16_is_the_fp32_gemm_rounded_once(patched):
    _, processor_class = patched
    hidden, vocab, _ = _operands(torch.bfloat16)
    processor = processor_class.__new__(processor_class)  # only the lm_head GEMM is exercised
    processor.use_fp32_lm_head = processor.use_fp32_lm_head_output = False
    processor.rl_on_policy_target = None
    lm_head = types.SimpleNamespace(weight=vocab)
    logits = processor._compute_lm_head(hidden, lm_head)
    oracle = (hidden.float() @ vocab.float().T).bfloat16()
    assert logits.dtype == torch.bfloat16 and torch.equal(logits, oracle)
    assert not torch.equal(hidden @ vocab.T, oracle)
