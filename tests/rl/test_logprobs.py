"""Chunked logprob + entropy against a full-vocab float64 log_softmax oracle; vocab-parallel at TP=2."""
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_fp8rl.rl.common import RLInputError
from megatron_fp8rl.rl.logprobs import token_logprobs_and_entropy
from tests.helpers.processes import run_torchrun

WORKER = Path(__file__).with_name("vocab_parallel_worker.py")


def oracle(logits: torch.Tensor, target_ids: torch.Tensor, temperature: float = 1.0):
    """Full-vocab float64 log_softmax: logprob of the target and entropy per position."""
    log_probs = torch.log_softmax(logits.double() / temperature, dim=-1)
    logprobs = log_probs.gather(-1, target_ids[..., None]).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logprobs, entropy


def gradients(fn, logits, target_ids, grad_logprobs, grad_entropy):
    """d/dlogits of Σ g_lp·logprob + Σ g_H·entropy (either weight may be None: that output unused)."""
    leaf = logits.detach().clone().requires_grad_()
    logprobs, entropy = fn(leaf, target_ids)
    total = 0.0
    if grad_logprobs is not None:
        total = total + (logprobs.double() * grad_logprobs).sum()
    if grad_entropy is not None:
        total = total + (entropy.double() * grad_entropy).sum()
    total.backward()
    return leaf.grad


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 13),
    vocab=st.integers(1, 40),
    chunk_size=st.integers(1, 8),
    temperature=st.sampled_from([1.0, 0.6, 1.7]),
    scale=st.sampled_from([0.1, 3.0, 30.0]),
    use=st.sampled_from(["both", "logprobs", "entropy"]),
    seed=st.integers(0, 2**16),
)
def test_chunked_matches_full_vocab_oracle(rows, vocab, chunk_size, temperature, scale, use, seed):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator, dtype=torch.float64) * scale
    target_ids = torch.randint(0, vocab, (rows,), generator=generator)

    def chunked(x, y):
        return token_logprobs_and_entropy(x, y, temperature=temperature, chunk_size=chunk_size)

    logprobs, entropy = chunked(logits, target_ids)
    expected_logprobs, expected_entropy = oracle(logits, target_ids, temperature)
    torch.testing.assert_close(logprobs, expected_logprobs)
    torch.testing.assert_close(entropy, expected_entropy)
    grad_lp = torch.randn(rows, generator=generator, dtype=torch.float64) if use != "entropy" else None
    grad_h = torch.randn(rows, generator=generator, dtype=torch.float64) if use != "logprobs" else None
    torch.testing.assert_close(
        gradients(chunked, logits, target_ids, grad_lp, grad_h),
        gradients(lambda x, y: oracle(x, y, temperature), logits, target_ids, grad_lp, grad_h),
    )


def test_batched_bf16_logits_match_oracle_in_fp32():
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 257, generator=generator) * 4).to(torch.bfloat16)
    target_ids = torch.randint(0, 257, (3, 5), generator=generator)
    logprobs, entropy = token_logprobs_and_entropy(logits, target_ids, chunk_size=4)
    assert logprobs.shape == (3, 5) and logprobs.dtype == torch.float32
    expected_logprobs, expected_entropy = oracle(logits, target_ids)  # same bf16 values, upcast
    torch.testing.assert_close(logprobs.double(), expected_logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy.double(), expected_entropy, atol=1e-5, rtol=1e-5)


def test_huge_logits_stay_finite():
    logits = torch.tensor([[1e4, 0.0, -1e4], [3e4, 3e4, 3e4]])
    logprobs, entropy = token_logprobs_and_entropy(logits, torch.tensor([1, 2]))
    expected_logprobs, expected_entropy = oracle(logits, torch.tensor([1, 2]))
    torch.testing.assert_close(logprobs.double(), expected_logprobs)
    torch.testing.assert_close(entropy.double(), expected_entropy)


def test_backward_saves_only_the_logits_and_per_token_vectors():
    """The autograd graph must not keep any [N, V] tensor besides the logits themselves."""
    rows, vocab = 64, 1000
    logits = torch.randn(rows, vocab, requires_grad=True)
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        token_logprobs_and_entropy(logits, torch.randint(0, vocab, (rows,)), chunk_size=16)
    big = [t for t in saved if t.numel() >= rows * vocab]
    assert len(big) == 1 and big[0].data_ptr() == logits.data_ptr()
    assert sum(t.numel() for t in saved if t.numel() < rows * vocab) <= 8 * rows


@pytest.mark.parametrize(
    "logits, target_ids, kwargs, message",
    [
        (torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long), {}, r"target_ids has shape \(2, 4\)"),
        (torch.zeros(2, 5), torch.zeros(2), {}, "target_ids must be integer token ids"),
        (torch.zeros(2, 5), torch.tensor([0, 5]), {}, r"target_ids must lie in \[0, 5\)"),
        (torch.zeros(2, 5), torch.tensor([-1, 0]), {}, r"target_ids must lie in \[0, 5\)"),
        (torch.zeros(2, 5), torch.tensor([0, 1]), {"temperature": 0.0}, "temperature must be > 0"),
        (torch.zeros(2, 5), torch.tensor([0, 1]), {"chunk_size": 0}, "chunk_size must be >= 1"),
    ],
)
def test_bad_inputs_are_rejected(logits, target_ids, kwargs, message):
    with pytest.raises(RLInputError, match=message):
        token_logprobs_and_entropy(logits, target_ids, **kwargs)


@pytest.mark.multiprocess
def test_vocab_parallel_tp2_matches_tp1():
    """Starts 2 processes (torchrun, gloo, TP=2): values and logits gradients equal the full-vocab ones."""
    output = run_torchrun(WORKER, 2)
    assert output.count("vocab-parallel logprobs OK") == 2, output
