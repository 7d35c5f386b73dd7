"""models/served_arithmetic.py: the SGLang-side patches that make its CPU serving arithmetic
repeatable by the trainer. A float32 lm_head row's logits do not depend on how many rows share the
call and equal the trainer's tiled output layer's; the row-by-row extend refuses what it does not
reproduce; a changed private signature is refused loudly. (Bit-identity of the attention calls:
tests/models/test_megatron_attention.py; end to end: tests/trainer/test_aligned_after_eval.py.)"""
import pytest
import torch

from megatron_fp8rl.compat import sglang_cpu
from megatron_fp8rl.compat.versions import UntestedVersionError
from megatron_fp8rl.fp8.gemm import tiled_matmul
from megatron_fp8rl.models import served_arithmetic


class _LmHead(torch.nn.Module):
    """SGLang's ParallelLMHead as _compute_lm_head reads it: a weight, no quant method."""

    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)


@pytest.fixture
def logits_processor():
    sglang_cpu.install()
    from sglang.srt.layers.logits_processor import LogitsProcessor

    saved = LogitsProcessor._compute_lm_head
    served_arithmetic.tile_cpu_lm_head()
    yield LogitsProcessor
    LogitsProcessor._compute_lm_head = saved


def test_a_row_of_logits_does_not_depend_on_the_batch(logits_processor):
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(40, 96, generator=gen), torch.randn(500, 96, generator=gen)
    head = _LmHead(weight)
    alone = [logits_processor._compute_lm_head(None, hidden[i:i + 1], head) for i in range(40)]
    batched = logits_processor._compute_lm_head(None, hidden, head)
    assert torch.equal(torch.cat(alone), batched)
    assert torch.equal(batched, tiled_matmul(hidden, weight))  # the trainer's served-layout output layer
    # an untiled GEMM gives other bits for some row (what the tiles remove)
    assert not all(torch.equal(hidden[i:i + 1] @ weight.t(), (hidden @ weight.t())[i:i + 1]) for i in range(40))


def test_a_patch_refuses_a_changed_sglang_signature(logits_processor):
    def changed(self, hidden_states, lm_head, embedding_bias=None, *, out=None, extra=None):
        return None

    logits_processor._compute_lm_head = changed
    with pytest.raises(UntestedVersionError, match="_compute_lm_head"):
        served_arithmetic.tile_cpu_lm_head()


def test_the_row_by_row_extend_refuses_a_sliding_window():
    sglang_cpu.install()
    served_arithmetic.align_torch_native_attention()
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    q = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="sliding_window_size=2"):
        TorchNativeAttnBackend._run_sdpa_forward_extend(
            None, q, torch.empty_like(q), torch.zeros(4, 2, 8), torch.zeros(4, 2, 8), torch.arange(4)[None],
            torch.tensor([0]), torch.tensor([4]), torch.tensor([0]), torch.tensor([4]), causal=True,
            sliding_window_size=2)
