"""Smoke tests of bench/fp8_recipes.py: its core on a tiny random Llama (seconds, no SmolLM2),
and its error measurement catching a deliberately broken quantizer."""
from __future__ import annotations

import math

import pytest
import torch

from bench import fp8_recipes as bench
from megatron_fp8rl.fp8 import (
    CalibratedDelayedScaling,
    CurrentScaling,
    DelayedScaling,
    make_quantizers,
)

VOCAB, EOS, PAD = 96, 2, 0


def tiny_llama():
    """A 2-layer random LlamaForCausalLM (hidden 64, MLP 160, GQA 4/2 heads), fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=EOS, pad_token_id=PAD)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def prompt_batches(steps: int, batch: int) -> list[list[list[int]]]:
    generator = torch.Generator().manual_seed(1)
    return [[torch.randint(3, VOCAB, (5 + row,), generator=generator).tolist()
             for row in range(batch)] for _ in range(steps)]


@pytest.fixture(scope="module")
def probes():
    model = tiny_llama()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    logged = []
    result = bench.measure_recipes(model, prompt_batches(steps=3, batch=3), bench.default_recipes(),
                                   new_tokens=6, lr=1e-3, pad_id=PAD, eos_id=EOS, log=logged.append)
    moved = any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    return result, logged, moved


def test_every_recipe_and_kind_has_finite_figures(probes):
    result, logged, moved = probes
    assert len(logged) == 3 and moved, "three optimizer steps must run and move the weights"
    assert list(result) == list(bench.RECIPE_NAMES)
    for phase in bench.PHASES:
        table = bench.summaries(result, phase)
        for name in bench.RECIPE_NAMES:
            for kind in bench.KINDS:
                row = table[name][kind]
                assert all(math.isfinite(value) for value in row.values()), (phase, name, kind, row)
                assert result[name].totals[(phase, kind)].tensors == (28 if phase == "warm" else 14)
        assert table[bench.CURRENT]["activations"]["mse_vs_current"] == 1.0


def test_printed_tables_name_every_recipe_and_kind(probes):
    result, _, _ = probes
    text = bench.format_table(result, "warm")
    rows = [line.split() for line in text.splitlines()[2:]]
    expected = {(name, kind) for name in bench.RECIPE_NAMES for kind in bench.KINDS}
    assert {(row[0], row[2]) for row in rows} == expected
    ratios = bench.format_ratios(result, "warm")
    assert all(name in ratios for name in bench.RECIPE_NAMES if name != bench.CALIBRATED)
    targets = bench.recipe_targets(result)
    assert len(targets) == 7 and all(isinstance(met, bool) for _, met, _ in targets)


def test_capture_drops_padding_and_skips_lm_head():
    model = tiny_llama()
    capture = bench.LinearCapture(model)
    ids, mask = bench.left_pad([[5, 6, 7], [8, 9]], PAD)
    capture.enabled, capture.token_mask = True, mask.bool()
    model(input_ids=ids, attention_mask=mask).logits.sum().backward()
    captured = capture.take()
    capture.remove()
    assert len(captured) == 2 * 7 and not any("lm_head" in name for name in captured)
    for tensors in captured.values():
        assert tensors["activations"].shape[0] == tensors["gradients"].shape[0] == 5
        weight_shape = (tensors["gradients"].shape[1], tensors["activations"].shape[1])
        assert tensors["weights"].shape == weight_shape


def test_error_measurement_catches_a_broken_quantizer():
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(0))
    healthy = make_quantizers(CurrentScaling()).input
    signal = bench.signal_energy(x)
    error, stats = bench.tensor_error(healthy, x)
    assert bench.snr_db(signal, error) > 20.0 and stats["saturated_fraction"] == 0.0
    broken = make_quantizers(DelayedScaling()).input
    broken.state.scale = torch.tensor(448.0 / (float(x.abs().max()) / 16))  # bound 16x too small
    error, stats = bench.tensor_error(broken, x)
    assert bench.snr_db(signal, error) < 10.0 and stats["saturated_fraction"] > 0.01


def test_variant_parsing():
    name, recipe = bench.parse_variant("margin=0,amax_history_len=4,criterion=mse")
    assert name == "calibrated[margin=0,amax_history_len=4,criterion=mse]"
    assert recipe == CalibratedDelayedScaling(margin=0, amax_history_len=4, criterion="mse")
    with pytest.raises(ValueError, match="unknown field"):
        bench.parse_variant("window=3")


def test_blockwise_throughput_reports_a_ratio():
    result = bench.blockwise_throughput((256, 384), torch.float32, repeats=2)
    assert result["ratio"] > 0 and "throughput ratio" in bench.format_throughput(result)


@pytest.mark.parametrize("layout", ["finite", "inf_nan", "transposed", "bf16", "ragged"])
def test_fast_blockwise_amax_is_bit_identical_to_finite_amax(layout):
    """quantize_blockwise's CPU amax (max x, -min x; what the throughput check times) against
    the finite_amax definition, including blocks holding inf / NaN and non-contiguous input."""
    from megatron_fp8rl.fp8 import E4M3, quantize_blockwise
    from megatron_fp8rl.fp8.quantize import finite_amax, quantize, scale_from_bound

    x = torch.randn(256, 384, generator=torch.Generator().manual_seed(2)) * 3
    if layout == "inf_nan":
        x[3, 5], x[200, 300], x[130, 2] = float("inf"), float("-inf"), float("nan")
    elif layout == "transposed":
        x = x.t()
    elif layout == "bf16":
        x = x.to(torch.bfloat16)
    elif layout == "ragged":
        x = x[:250, :300]
    result = quantize_blockwise(x, E4M3)
    rows, cols = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, -cols % 128, 0, -rows % 128))
    blocks = padded.reshape(padded.shape[0] // 128, 128, padded.shape[1] // 128, 128)
    scale = scale_from_bound(finite_amax(blocks, dim=(1, 3)), E4M3.max)
    expected = quantize(blocks, scale[:, None, :, None], E4M3).reshape(padded.shape)[:rows, :cols]
    assert torch.equal(result.scale_inv, scale.reciprocal())
    assert torch.equal(result.data.view(torch.uint8), expected.contiguous().view(torch.uint8))


def test_calibrated_window_of_one_predicts_from_the_previous_step():
    """amax_history_len=1 keeps the previous step's bound (the bench found it recalibrating
    every step: the roll empties a one-row window, which read as 'no bound yet')."""
    spec = CalibratedDelayedScaling(margin=1, amax_history_len=1)
    quantizer = make_quantizers(spec).input
    generator = torch.Generator().manual_seed(3)
    first = torch.randn(64, 64, generator=generator)
    quantizer.quantize(first)
    assert quantizer.last_stats.recalibrated.item() == 1.0
    out = quantizer.quantize(first * 0.5)  # inside the predicted bound 2 * amax(first)
    assert quantizer.last_stats.recalibrated.item() == 0.0
    assert out.scale_inv.item() == pytest.approx(2 * first.abs().max().item() / 448.0, rel=1e-6)
    quantizer.quantize(first * 4)  # escapes it: recalibrated at once
    assert quantizer.last_stats.recalibrated.item() == 1.0
