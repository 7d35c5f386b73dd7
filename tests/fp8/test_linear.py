"""Our FP8 linear: forward/backward equal GEMMs of the same FP8 operands, the GEMM backends
agree, gradients use E5M2 under hybrid, weights are re-calibrated in no-grad passes, and the
scaling state survives a checkpoint."""
import io
from fractions import Fraction

import pytest
import torch

from megatron_fp8rl.fp8.formats import E4M3, E5M2
from megatron_fp8rl.fp8.gemm import fp8_matmul_nt
from megatron_fp8rl.fp8.linear import Fp8Linear, fp8_linear
from megatron_fp8rl.fp8.quantize import (
    Fp8Tensor, quantize_blockwise, quantize_per_row, quantize_per_tensor, quantize_with_scale_inv,
)
from megatron_fp8rl.fp8.quantizer import make_quantizers
from megatron_fp8rl.fp8.recipe import (
    BlockwiseScaling,
    CalibratedDelayedScaling,
    CurrentScaling,
    te_default_delayed,
)


def operands(seed=0, m=12, k=40, n=24):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, m // 2, k, generator=gen)
    weight = torch.randn(n, k, generator=gen) * 0.1
    bias = torch.randn(n, generator=gen)
    dy = torch.randn(2, m // 2, n, generator=gen) * 1e-3
    return x, weight, bias, dy


def run(recipe, gemm, x, weight, bias, dy):
    x, weight, bias = (t.clone().requires_grad_() for t in (x, weight, bias))
    y = fp8_linear(x, weight, bias, make_quantizers(recipe), gemm)
    y.backward(dy)
    return y, x.grad, weight.grad, bias.grad


@pytest.mark.parametrize("fp8_format,grad_fmt", [("hybrid", E5M2), ("e4m3", E4M3)])
@pytest.mark.parametrize("gemm", ["scaled_mm", "fp32_accumulate", "exact"])
def test_current_scaling_equals_gemms_of_the_fp8_operands(fp8_format, grad_fmt, gemm):
    x, weight, bias, dy = operands()
    y, dx, dw, db = run(CurrentScaling(fp8_format=fp8_format), gemm, x, weight, bias, dy)
    xq = quantize_per_tensor(x.reshape(-1, 40), E4M3).dequantize()
    wq = quantize_per_tensor(weight, E4M3).dequantize()
    gq = quantize_per_tensor(dy.reshape(-1, 24), grad_fmt).dequantize()
    torch.testing.assert_close(y.reshape(-1, 24), xq @ wq.t() + bias, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx.reshape(-1, 40), gq @ wq, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(dw, gq.t() @ xq, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(db, dy.reshape(-1, 24).sum(0))


def test_gemm_backends_agree_to_fp32_rounding():
    x, weight, bias, dy = operands(1)
    recipe = CalibratedDelayedScaling()
    scaled = run(recipe, "scaled_mm", x, weight, bias, dy)
    emulated = run(recipe, "fp32_accumulate", x, weight, bias, dy)
    for a, b in zip(scaled, emulated):  # summation order only: errors ~1e-7 of the largest term
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())


def _wide_e4m3(shape, seed):
    """E4M3 values across the whole format (subnormals to 448), as per-tensor FP8 operands."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-10, 9, shape, generator=gen).float())
    return quantize_with_scale_inv(values.clamp(-448, 448), torch.tensor(1.0), E4M3)


def test_exact_gemm_is_the_exactly_rounded_sum_whatever_the_row_count():
    """'exact' is the fp32 rounding of the exact rational sum of the FP8 products (oracle:
    Fraction arithmetic), so a row computed alone, in a batch, or with the columns permuted has
    the same bits; the fp32 GEMM's rows depend on the batch (why SGLang's decode and the trainer's
    recompute disagreed in the last bits before, then by whole FP8 codes 30 layers later)."""
    a, b = _wide_e4m3((64, 1536), 0), _wide_e4m3((96, 1536), 1)
    full = fp8_matmul_nt(a, b, "exact")
    a_rows, b_rows = a.data.float().tolist(), b.data.float().tolist()
    for i, j in ((0, 0), (5, 17), (63, 95)):
        exact = sum(Fraction(x) * Fraction(y) for x, y in zip(a_rows[i], b_rows[j]))
        assert full[i, j].item() == float(torch.tensor(float(exact), dtype=torch.float64).float())
    single_rows = torch.cat([fp8_matmul_nt(_rows(a, i), b, "exact") for i in range(64)])
    assert torch.equal(single_rows, full)
    perm = torch.randperm(96, generator=torch.Generator().manual_seed(2))
    assert torch.equal(fp8_matmul_nt(a, _rows(b, perm), "exact"), full[:, perm])


def test_exact_gemm_with_row_scales_is_row_invariant():
    """Per-token activations x per-tensor or per-channel weights: each output is the exactly
    rounded FP8 sum times its row's and its column's multipliers, whatever the row count."""
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(40, 576, generator=gen), torch.randn(96, 576, generator=gen)
    a = quantize_per_row(x, E4M3)
    for b in (quantize_per_row(w, E4M3), quantize_with_scale_inv(w, w.abs().amax() / 448, E4M3)):
        full = fp8_matmul_nt(a, b, "exact")
        codes = (a.data.double() @ b.data.double().t()).float()
        b_scale = b.scale_inv.float().reshape(1, -1) if b.granularity == "row" else b.scale_inv.float()
        assert torch.equal(full, codes * a.scale_inv.float() * b_scale)
        rows = [fp8_matmul_nt(Fp8Tensor(a.data[i:i + 1], a.scale_inv[i:i + 1], "row"), b, "exact")
                for i in range(40)]
        assert torch.equal(torch.cat(rows), full)
        torch.testing.assert_close(full, a.dequantize() @ b.dequantize().t(), rtol=1e-5, atol=1e-4)


def _grouped_oracle(a, b, i, j, weight_block) -> float:
    """y[i, j] of 'exact' on block operands by its definition: 0.0 plus, over the K groups in
    order, the group's exact FP8 sum (Fraction arithmetic) times its two multipliers in fp64
    (Python floats are IEEE fp64); the caller rounds it to fp32."""
    width, total = a.block[1], 0.0
    a_codes, b_codes = a.data[i].float().tolist(), b.data[j].float().tolist()
    for g, start in enumerate(range(0, len(a_codes), width)):
        exact = sum(Fraction(p) * Fraction(q) for p, q in
                    zip(a_codes[start:start + width], b_codes[start:start + width]))
        total += float(exact) * a.scale_inv[i, g].item() * b.scale_inv[j // weight_block[0], g].item()
    return total


def _fp32_bits(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.float64).float().view(torch.int32)


def _block_rows(t, rows):
    return Fp8Tensor(t.data[rows], t.scale_inv[rows], "block", t.block)


@pytest.mark.parametrize("weight_block", [(1, 128), (128, 128), (1, 32)])
@pytest.mark.parametrize("m,k", [(24, 576), (1, 576), (133, 300), (70, 128)])
def test_exact_gemm_with_group_scales_is_row_invariant(weight_block, m, k):
    """1x128 activation groups x 1x128 or 128x128 weight blocks, and 1x32 x 1x32 (groupwise32)
    (K = 576 and 300: a partial last group; M = 1, and M = 133 across the row chunks of the
    computation): each output, bit for bit
    (zero signs included: an all -0 row of x gives +0, as 0.0 + ... does), is the oracle's sum
    rounded once to fp32; a row alone, in a batch or with the rows permuted has the same bits."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 1, k)
    x[m // 2] = -0.0
    a = quantize_blockwise(x, E4M3, (1, weight_block[1]))
    b = quantize_blockwise(torch.randn(130, k, generator=gen) * 0.05, E4M3, weight_block)
    full = fp8_matmul_nt(a, b, "exact")
    for i, j in {(0, 0), (m // 2, 3), (m - 1, 129), (m * 3 // 4, 64)}:
        assert torch.equal(full[i, j].view(torch.int32), _fp32_bits(_grouped_oracle(a, b, i, j, weight_block)))
    rows = [fp8_matmul_nt(_block_rows(a, slice(i, i + 1)), b, "exact") for i in range(m)]
    assert torch.equal(torch.cat(rows).view(torch.int32), full.view(torch.int32))
    perm = torch.randperm(m, generator=gen)
    assert torch.equal(fp8_matmul_nt(_block_rows(a, perm), b, "exact").view(torch.int32), full[perm].view(torch.int32))
    torch.testing.assert_close(full, a.dequantize() @ b.dequantize().t(), rtol=1e-5, atol=1e-4)


def _rows(t, rows):
    index = torch.tensor([rows]) if isinstance(rows, int) else rows
    return quantize_with_scale_inv(t.data.float()[index], torch.tensor(1.0), E4M3)


def test_scaled_mm_path_calls_torch_scaled_mm(monkeypatch):
    calls = []
    original = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(a[0].dtype) or original(*a, **k))
    run(te_default_delayed(), "scaled_mm", *operands())
    assert calls == [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e5m2]  # fprop, dgrad, wgrad


def test_blockwise_runs_dequantized_gemms_of_block_fp8_values():
    x, weight, bias, dy = operands(2, m=6, k=300, n=130)
    y, dx, dw, db = run(BlockwiseScaling(), "auto", x, weight, bias, dy)
    xq = quantize_blockwise(x.reshape(-1, 300), E4M3, (1, 128)).dequantize()
    wq = quantize_blockwise(weight, E4M3, (128, 128)).dequantize()
    gq = quantize_blockwise(dy.reshape(-1, 130), E4M3, (1, 128)).dequantize()
    torch.testing.assert_close(y.reshape(-1, 130), xq @ wq.t() + bias)
    torch.testing.assert_close(dx.reshape(-1, 300), gq @ wq)
    torch.testing.assert_close(dw, gq.t() @ xq)


def test_bf16_master_weights_keep_their_dtype():
    layer = Fp8Linear(32, 16, dtype=torch.bfloat16)
    x = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    assert layer.weight.grad.dtype == torch.bfloat16


def test_no_grad_pass_quantizes_weights_with_their_current_bound():
    """Logprob recomputation runs without grad; TE would reuse a stale forward scale there."""
    layer = Fp8Linear(32, 16, recipe=CalibratedDelayedScaling(margin=0))
    x = torch.randn(4, 32)
    layer(x).sum().backward()
    with torch.no_grad():
        layer.weight.mul_(8.0)
        layer(x)
    expected = 448.0 / layer.weight.abs().max()
    assert layer.fp8_stats()["weight"].scale.item() == pytest.approx(expected.item(), rel=1e-6)


def test_scaling_state_survives_a_checkpoint():
    torch.manual_seed(0)
    layer = Fp8Linear(32, 16, recipe=te_default_delayed())
    x = torch.randn(8, 32)
    for _ in range(3):
        layer(x * 3).sum().backward()
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    restored = Fp8Linear(32, 16, recipe=te_default_delayed())
    restored.load_state_dict(torch.load(buffer))
    for role in ("input", "weight", "grad_output"):
        ours, theirs = getattr(layer.fp8_quantizers, role).state, getattr(restored.fp8_quantizers, role).state
        assert torch.equal(ours.scale, theirs.scale) and ours.scale.item() != 1.0
        assert torch.equal(ours.amax_history, theirs.amax_history)
    assert torch.equal(layer(x), restored(x))


def test_load_rejects_foreign_extra_state_and_unknown_gemm():
    layer = Fp8Linear(8, 4)
    state = layer.state_dict()
    state["_extra_state"] = {"version": 99}
    with pytest.raises(ValueError, match="Fp8Linear: FP8 extra state must be a dict with version 1, found 99"):
        layer.load_state_dict(state)
    with pytest.raises(ValueError, match="valid: auto, batch_invariant, scaled_mm, fp32_accumulate, exact, tiled, triton_invariant"):
        Fp8Linear(8, 4, gemm="cublas")
    with pytest.raises(ValueError, match="input has 5 features"):
        layer(torch.randn(2, 5))
