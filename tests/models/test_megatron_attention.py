"""SdpaAttention: under `sglang_call_layout` its output has exactly the bits of SGLang's own
torch_native attention code serving the same sequences (prefill, a radix-cache prefix hit, then
decode steps in a shrinking batch); outside it, it is Megatron's causal attention (values and
gradients) to fp32 rounding; bad layouts are refused with the numbers that are wrong."""
import pytest
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_fp8rl.compat import sglang_cpu
from megatron_fp8rl.models.served_arithmetic import align_torch_native_attention
from megatron_fp8rl.models.megatron_attention import SdpaAttention, sglang_call_layout

HEADS, GROUPS, DIM = 9, 3, 64  # SmolLM2-135M's attention (GQA 3:1)


def _attention(cls, **config_overrides):
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, kv_channels=DIM, attention_dropout=0.0,
                               **config_overrides)
    return cls(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")


def _qkv(seq, batch, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((seq, batch, HEADS, DIM), (seq, batch, GROUPS, DIM), (seq, batch, GROUPS, DIM))
    return [torch.randn(s, generator=gen).to(dtype) for s in shapes]


def _sglang_serving(q, k, v, prompts, lengths, cached):
    """What SGLang's TorchNativeAttnBackend computes for these sequences: one extend batch (request
    b has its first cached[b] prompt tokens in the radix cache already, as the n-th sample of a
    prompt has), then one decode batch per generated token, finished requests dropping out.
    The KV cache is filled with each sequence's own k/v rows, as SGLang's forward stores them."""
    sglang_cpu.install()
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend as backend

    align_torch_native_attention()  # what our SGLang plugin does in the scheduler

    seq, batch = q.shape[:2]
    k_cache = k.transpose(0, 1).reshape(batch * seq, GROUPS, DIM).contiguous()
    v_cache = v.transpose(0, 1).reshape(batch * seq, GROUPS, DIM).contiguous()
    req_to_token = torch.arange(batch * seq).reshape(batch, seq)
    out = torch.zeros_like(q)
    common = dict(k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token,
                  scaling=DIM ** -0.5, enable_gqa=True)
    query = torch.cat([q[cached[b]:prompts[b], b] for b in range(batch)])
    extended = torch.empty_like(query)
    backend._run_sdpa_forward_extend(
        None, query, extended, req_pool_indices=torch.arange(batch), seq_lens=torch.tensor(prompts),
        extend_prefix_lens=torch.tensor(cached),
        extend_seq_lens=torch.tensor([p - c for p, c in zip(prompts, cached)]), causal=True, **common)
    for b, rows in enumerate(torch.split(extended, [p - c for p, c in zip(prompts, cached)])):
        out[cached[b]:prompts[b], b] = rows
    for step in range(max(lengths) - min(prompts)):
        running = [b for b in range(batch) if prompts[b] + step < lengths[b]]
        if not running:
            continue
        rows = [prompts[b] + step for b in running]
        query = torch.stack([q[r, b] for r, b in zip(rows, running)])
        decoded = torch.empty_like(query)
        backend._run_sdpa_forward_decode(
            None, query, decoded, req_pool_indices=torch.tensor(running),
            seq_lens=torch.tensor(rows) + 1, causal=False, **common)
        for i, (r, b) in enumerate(zip(rows, running)):
            out[r, b] = decoded[i]
    return out


def _with_threads(count, fn, *args):
    saved = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("threads", [(1, 1), (2, 2), (1, 2), (2, 1)], ids=lambda t: f"sglang{t[0]}-trainer{t[1]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_call_layout_gives_sglang_torch_native_bits(megatron_tp1, dtype, threads):
    """Whatever thread count either side runs with (SGLang's scheduler and the trainer need not
    agree): models/served_arithmetic.py runs the aligned calls single-threaded on both."""
    prompts, lengths, cached = [13, 20, 13, 7], [40, 31, 36, 25], [0, 0, 12, 5]
    q, k, v = _qkv(40, 4, dtype)
    k[:13, 2], v[:13, 2] = k[:13, 0], v[:13, 0]  # request 2 shares request 0's prompt (radix hit)
    q[:13, 2] = q[:13, 0]
    # request 3's first 5 tokens were cached by request 1, a prompt of another length (after an
    # eval, issue #44): its keys came from a 20-row prefill, its own 2 prompt rows are an extend
    k[:5, 3], v[:5, 3], q[:5, 3] = k[:5, 1], v[:5, 1], q[:5, 1]
    expected = _with_threads(threads[0], _sglang_serving, q, k, v, prompts, lengths, cached)

    def trainer():
        with torch.no_grad(), sglang_call_layout(prompts):
            return _attention(SdpaAttention)(q, k, v, None).reshape(q.shape)

    ours = _with_threads(threads[1], trainer)
    for b, length in enumerate(lengths):
        assert torch.equal(ours[cached[b]:length, b], expected[cached[b]:length, b]), f"sequence {b}"
    assert torch.equal(ours[:12, 2], expected[:12, 0])  # the cached rows were served for request 0
    assert torch.equal(ours[:5, 3], expected[:5, 1])  # and these for request 1


def test_outside_the_layout_it_is_megatron_causal_attention(megatron_tp1):
    q, k, v = _qkv(24, 2, torch.float32, seed=1)
    grads = []
    outputs = []
    for cls in (SdpaAttention, DotProductAttention):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = _attention(cls)(*leaves, None)
        out.square().sum().backward()
        outputs.append(out)
        grads.append([t.grad for t in leaves])
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-6)
    for ours, megatron in zip(*grads):
        torch.testing.assert_close(ours, megatron, rtol=1e-4, atol=1e-5)


def test_bad_layouts_and_configs_are_refused(megatron_tp1):
    q, k, v = _qkv(10, 2, torch.float32)
    attention = _attention(SdpaAttention)
    with pytest.raises(ValueError, match="3 prompt lengths for a batch of 2 sequences"):
        with sglang_call_layout([4, 4, 4]):
            attention(q, k, v, None)
    with pytest.raises(ValueError, match="prompt length 11 outside 1..10"):
        with sglang_call_layout([4, 11]):
            attention(q, k, v, None)
    with pytest.raises(ValueError, match="explicit masks are not supported"):
        attention(q, k, v, torch.ones(1, 1, 10, 10, dtype=torch.bool))
    with pytest.raises(ValueError, match="SdpaAttention: window_size not supported"):
        _attention(SdpaAttention, window_size=(4, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_forward_in_the_layout_has_the_served_value_and_the_batched_gradient(megatron_tp1, dtype):
    """Under autograd (the aligned training forward) the layout's output equals the no-grad
    served calls bit for bit, and its input gradients equal those of the one batched call."""
    prompts = [13, 20, 7]
    q, k, v = _qkv(30, 3, dtype, seed=2)
    attention = _attention(SdpaAttention)
    with torch.no_grad(), sglang_call_layout(prompts):
        served = attention(q, k, v, None)
    weights = torch.randn(served.shape, generator=torch.Generator().manual_seed(5))  # a linear loss:
    results = []  # the same upstream gradient whatever the output's last bits
    for layout in (True, False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if layout:
            with sglang_call_layout(prompts):
                out = attention(*leaves, None)
        else:
            out = attention(*leaves, None)
        (out.float() * weights).sum().backward()
        results.append((out.detach(), [t.grad for t in leaves]))
    (trained, layout_grads), (batched, batched_grads) = results
    assert torch.equal(trained, served)
    assert not torch.equal(batched, served)  # the two layouts differ in the last bits
    assert all(torch.equal(a, b) for a, b in zip(layout_grads, batched_grads))


def test_the_aligned_calls_run_single_threaded_on_both_sides(megatron_tp1):
    """The pin itself: inside SGLang's torch_native SDPA calls and the trainer's layout calls torch
    runs one intra-op thread, and the caller's count is back afterwards."""
    import torch.nn.functional as functional

    from megatron_fp8rl.models import megatron_attention

    seen = []
    original = functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return original(*args, **kwargs)

    q, k, v = _qkv(12, 2, torch.float32)
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        megatron_attention.scaled_dot_product_attention = recording
        import sglang.srt.layers.attention.torch_native_backend as native
        native_original = native.scaled_dot_product_attention
        native.scaled_dot_product_attention = recording
        try:
            _sglang_serving(q, k, v, [5, 7], [12, 10], [0, 0])
            with torch.no_grad(), sglang_call_layout([5, 7]):
                _attention(SdpaAttention)(q, k, v, None)
        finally:
            megatron_attention.scaled_dot_product_attention = original
            native.scaled_dot_product_attention = native_original
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(saved)
    assert len(seen) > 10 and set(seen) == {1}, seen


def test_the_output_layer_computes_served_tiles_inside_the_layout_only(megatron_tp1):
    """Megatron's real ColumnParallelLinear.forward reaches the patched _forward_impl with the
    keywords it reads: inside the layout the logits are the tiles' bits carrying the GEMM's
    gradient (_ValueOf), outside they are Megatron's own GEMM's."""
    from megatron_fp8rl.fp8.gemm import tiled_matmul
    from megatron_fp8rl.models.hf import build_model_from_hf
    from tests.helpers.tiny_hf import tiny_hf_config

    model = build_model_from_hf(tiny_hf_config("llama").to_dict())
    layer, weight = model.output_layer, model.shared_embedding_or_output_weight()  # tied or not
    hidden = torch.randn(7, 3, weight.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        served = tiled_matmul(hidden.reshape(-1, hidden.shape[-1]), weight).reshape(7, 3, -1)
    with sglang_call_layout([7, 7, 7]):
        inside = layer(hidden, weight=weight)[0]
    outside = layer(hidden, weight=weight)[0]
    assert torch.equal(inside, served) and type(inside.grad_fn).__name__ == "_ValueOfBackward"
    assert type(outside.grad_fn).__name__ != "_ValueOfBackward"
    torch.testing.assert_close(outside, served, atol=1e-5, rtol=0)
