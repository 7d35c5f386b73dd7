"""bench/bf16_update_visibility.py: its measure against cases with a known answer, and a run on a
tiny checkpoint written here (a norm gain on the bf16 grid, a linear off it)."""
import pytest
import torch
from safetensors.torch import save_file

from bench import bf16_update_visibility as bench


def test_weights_on_the_bf16_grid_see_no_update_smaller_than_half_their_spacing():
    weights = torch.full((1000,), 1.0)  # bf16 spacing at 1.0 is 2^-7: half of it is 3.9e-3
    assert bench.visibility(weights, torch.full_like(weights, 1e-3)) == (0.0, 0.0)
    moved, seen = bench.visibility(weights, torch.full_like(weights, 2 ** -7))  # a whole spacing: all of it
    assert moved == 1.0 and seen == pytest.approx(1.0)


def test_weights_spread_across_the_grid_see_the_update_on_average():
    weights = 1.0 + torch.rand(200_000, generator=torch.Generator().manual_seed(0)) * 2 ** -7  # within one spacing
    moved, seen = bench.visibility(weights, torch.full_like(weights, 2 ** -9))  # a quarter spacing
    assert moved == pytest.approx(0.25, abs=0.01) and seen == pytest.approx(1.0, abs=0.05)


def test_the_bench_prints_a_row_per_kind(tmp_path, capsys):
    generator = torch.Generator().manual_seed(1)
    save_file({"model.layers.0.input_layernorm.weight": torch.ones(64),
               "model.layers.0.mlp.up_proj.weight": torch.rand(64, 64, generator=generator) * 0.1},
              str(tmp_path / "model.safetensors"))
    assert bench.main(["--model", str(tmp_path), "--steps", "1,24"]) == 0
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")}
    assert rows["norm gain"].split("|")[4].strip() == "100%" and "0.0% / 0.00 | 0.0% / 0.00 |" in rows["norm gain"]
    assert float(rows["MLP linear"].split("|")[6].split("/")[1]) > 0.5  # off the grid: most of 24 x 1e-5 seen
