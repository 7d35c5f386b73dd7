"""The 'tiled' FP8 GEMM (fp8/gemm.py), the CPU tier's batch-invariant GEMM of aligned rollouts:
a row's bits do not depend on how many rows are multiplied with it, where it sits among them,
what the other rows hold, or torch's thread count; its values are the FP8 product within fp32
summation error of the exact sum ('exact', itself tested against Fraction arithmetic)."""
import pytest
import torch

from megatron_fp8rl.fp8.formats import E4M3
from megatron_fp8rl.fp8.gemm import TILE_ROWS, fp8_matmul_nt
from megatron_fp8rl.fp8.quantize import Fp8Tensor, quantize_blockwise, quantize_per_row, quantize_with_scale_inv

# (n, k): SmolLM2's down projection (1536 -> 576) is a shape where one fp32 GEMM of 1 or 2 rows
# gives other bits than of 16 on this project's CPU boxes; a partial last group (300)
SHAPES = [(576, 1536), (130, 300)]


def _activations(layout, x):
    if layout == "tensor":
        return quantize_with_scale_inv(x, x.abs().max() / 448, E4M3)
    if layout == "row":
        return quantize_per_row(x, E4M3)
    return quantize_blockwise(x, E4M3, (1, layout[1]))


def _weight(layout, w):
    if layout == "tensor":
        return quantize_with_scale_inv(w, w.abs().max() / 448, E4M3)
    if layout == "row":
        return quantize_per_row(w, E4M3)
    return quantize_blockwise(w, E4M3, layout)


def _rows(t: Fp8Tensor, index) -> Fp8Tensor:
    scale = t.scale_inv if t.granularity == "tensor" else t.scale_inv[index]
    return Fp8Tensor(t.data[index], scale, t.granularity, t.block)


def _cat(*parts: Fp8Tensor) -> Fp8Tensor:
    first = parts[0]
    scale = first.scale_inv if first.granularity == "tensor" else torch.cat([p.scale_inv for p in parts])
    return Fp8Tensor(torch.cat([p.data for p in parts]), scale, first.granularity, first.block)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


LAYOUTS = [("tensor", "tensor"), ("row", "tensor"), ("row", "row"),
           ((1, 32), (1, 32)), ((1, 128), (1, 128)), ((1, 128), (128, 128)), ("row", (1, 32))]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("a_layout,b_layout", LAYOUTS, ids=lambda v: str(v).replace(" ", ""))
def test_a_rows_bits_depend_on_that_row_only(a_layout, b_layout, n, k, threads):
    """Rows alone (1 row: the shape where untiled BLAS takes another path), in a batch of 37 (three
    tiles, the last one partial), permuted, and placed among other rows at every position of a
    tile give the same bits, with one thread and with two; so do the columns of a weight whose rows
    come in another order (row-scaled or 1-row-block weights)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(37, k, generator=gen) * torch.logspace(-2, 1, k)
        # per-tensor activations share one scale: the neighbours must come from the same range
        others = torch.randn(2 * TILE_ROWS, k, generator=gen) * torch.logspace(-2, 1, k)
        a = _activations(a_layout, torch.cat([x, others]))
        rows, neighbours = _rows(a, slice(0, 37)), _rows(a, slice(37, None))
        b = _weight(b_layout, torch.randn(n, k, generator=gen) * 0.05)
        full = fp8_matmul_nt(rows, b, "tiled")
        assert full.shape == (37, n) and full.dtype == torch.float32
        alone = torch.cat([fp8_matmul_nt(_rows(rows, slice(i, i + 1)), b, "tiled") for i in range(37)])
        assert torch.equal(_bits(alone), _bits(full))
        perm = torch.randperm(37, generator=gen)
        assert torch.equal(_bits(fp8_matmul_nt(_rows(rows, perm), b, "tiled")), _bits(full[perm]))
        for position in range(TILE_ROWS):  # row 5 among 15 other rows, at each place of one tile
            mixed = _cat(_rows(neighbours, slice(0, position)), _rows(rows, slice(5, 6)),
                         _rows(neighbours, slice(position, TILE_ROWS - 1)))
            assert torch.equal(_bits(fp8_matmul_nt(mixed, b, "tiled")[position]), _bits(full[5])), position
        # the weight's rows in another order (Megatron's interleaved qkv against SGLang's q|k|v):
        # each output column keeps its bits
        cols = torch.randperm(n, generator=gen)
        b_perm = _rows(b, cols) if b.granularity != "block" or b.block[0] == 1 else None
        if b_perm is not None:
            assert torch.equal(_bits(fp8_matmul_nt(rows, b_perm, "tiled")), _bits(full[:, cols]))
        # the values: the same FP8 product as the exact sum, within fp32 summation error
        torch.testing.assert_close(full, fp8_matmul_nt(rows, b, "exact"), rtol=2e-5, atol=2e-5 * full.abs().max().item())
    finally:
        torch.set_num_threads(before)


def test_no_rows_give_an_empty_product():
    b = quantize_with_scale_inv(torch.randn(8, 64), torch.tensor(0.01), E4M3)
    a = quantize_with_scale_inv(torch.zeros(0, 64), torch.tensor(0.01), E4M3)
    assert fp8_matmul_nt(a, b, "tiled").shape == (0, 8)

