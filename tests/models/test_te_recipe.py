"""Our recipe against Transformer Engine's own code: TE's recipe module validates our subclass,
and TE's delayed-scaling update (`_default_sf_compute`, `_amax_and_scale_update`) equals ours.
TE's real sources come from its pinned wheel (tests/helpers/te_wheel.py); no TE install."""
import dataclasses
import math

import pytest
import torch

from megatron_fp8rl.fp8.quantize import scale_from_bound
from megatron_fp8rl.fp8.recipe import CalibratedDelayedScaling
from megatron_fp8rl.fp8.scaling import DelayedScalingState
from megatron_fp8rl.models import te_recipe

SF_CASES = [  # (amax, old scale, fp8_max, margin)
    (1.0, 1.0, 448.0, 0),
    (3.6503565, 2.0, 448.0, 0),
    (3.6503565, 2.0, 448.0, 3),
    (0.0, 5.0, 448.0, 0),  # amax 0: keep old
    (-1.0, 5.0, 448.0, 1),  # negative: keep old
    (math.nan, 7.0, 57344.0, 0),  # NaN: keep old
    (math.inf, 7.0, 57344.0, 2),  # inf: keep old
    (1e-40, 1.0, 448.0, 0),  # scale overflows fp32: FP32_MAX
    (3e38, 1.0, 448.0, 0),
    (57344.0, 0.25, 57344.0, 1),
    (1e-3, 1.0, 57344.0, 5),
]


def test_te_validation_accepts_our_recipe(te_recipe_module):
    spec = CalibratedDelayedScaling(criterion="percentile", saturation_budget=1e-4,
                                    overflow_tolerance=1e-3, amax_history_len=32, margin=2)
    recipe = te_recipe.to_te_recipe(spec, te_recipe_module)
    assert isinstance(recipe, te_recipe_module.DelayedScaling)
    assert type(recipe).delayed() and type(recipe).float8_per_tensor_scaling()
    assert recipe.fp8_format is te_recipe_module.Format.HYBRID
    assert recipe.amax_compute_algo is te_recipe.te_amax_compute
    assert recipe.scaling_factor_compute_algo is te_recipe.te_scaling_factor_compute
    assert te_recipe.from_te_recipe(recipe) == spec


def test_te_validation_runs_on_our_subclass(te_recipe_module):
    cls = te_recipe.te_recipe_class(te_recipe_module)
    with pytest.raises(ValueError, match="Pure E5M2 training is not supported"):  # pydantic's
        cls(fp8_format=te_recipe_module.Format.E5M2)
    with pytest.raises(ValueError, match="valid: max, percentile, mse"):
        cls(criterion="p99")


def test_repr_lists_every_field_and_tells_configs_apart(te_recipe_module):
    variants = [CalibratedDelayedScaling()] + [
        dataclasses.replace(CalibratedDelayedScaling(), **change)
        for change in ({"margin": 0}, {"fp8_format": "e4m3"}, {"amax_history_len": 8},
                       {"criterion": "mse"}, {"saturation_budget": 1e-3, "overflow_tolerance": 1e-3},
                       {"overflow_tolerance": 0.01}, {"calibrate_weights_every_step": False},
                       {"reduce_amax": False})
    ]
    reprs = [repr(te_recipe.to_te_recipe(spec, te_recipe_module)) for spec in variants]
    assert len(set(reprs)) == len(reprs)
    for spec, text in zip(variants, reprs):
        for name, value in dataclasses.asdict(spec).items():
            shown = {"fp8_format": "format"}.get(name, name)
            expected = value.upper() if name == "fp8_format" else value
            assert f"{shown}={expected}" in text, (name, text)
        assert text.startswith("recipe_type=CalibratedDelayedScaling")


@pytest.mark.parametrize("amax,old,fp8_max,margin", SF_CASES)
def test_scale_formula_equals_te_default_sf_compute(te_scaling_functions, amax, old, fp8_max, margin):
    te_sf = te_scaling_functions["_default_sf_compute"]
    te_scale = te_sf(torch.tensor([amax]), torch.tensor([old]), fp8_max, margin)
    ours = scale_from_bound(torch.tensor([amax]), fp8_max, margin, torch.tensor([old]))
    assert torch.equal(ours.view(torch.int32), te_scale.view(torch.int32)), (ours, te_scale)
    assert torch.isfinite(ours).all() and (ours > 0).all()


def test_scale_formula_equals_te_on_random_vectors(te_scaling_functions):
    gen = torch.Generator().manual_seed(5)
    amax = torch.rand(10000, generator=gen) * torch.exp2(torch.randint(-60, 60, (10000,), generator=gen).float())
    old = torch.rand(10000, generator=gen) + 0.5
    te_scale = te_scaling_functions["_default_sf_compute"](amax, old.clone(), 448.0, 1)
    assert torch.equal(scale_from_bound(amax, 448.0, 1, old), te_scale)


AMAX_SEQUENCE = [0.5, 2.0, 0.0, 1.5, math.nan, 0.25, 3.0, 0.1, 0.1, 0.1, 0.1, 7.0]


@pytest.mark.parametrize("history_len,algo,margin", [(4, "max", 0), (1, "most_recent", 0),
                                                     (3, "most_recent", 2), (1024, "max", 1)])
def test_delayed_update_equals_te(te_recipe_module, te_scaling_functions, history_len, algo, margin):
    """Step by step, our DelayedScalingState and TE's _amax_and_scale_update give the same
    scales and histories (TE's history is [L, n_quantizers]; here n = 1)."""
    recipe = te_recipe_module.DelayedScaling(margin=margin, amax_history_len=history_len,
                                             amax_compute_algo=algo)
    te_history, te_scale = torch.zeros(history_len, 1), torch.ones(1)
    ours = DelayedScalingState(history_len)
    for amax in AMAX_SEQUENCE:
        te_history[0] = amax  # TE's cast kernel writes the step's amax into row 0
        te_scaling_functions["_amax_and_scale_update"](te_history, te_scale, 448.0, recipe)
        ours.record(torch.tensor(amax))
        ours.update(algo, 448.0, margin)
        assert torch.equal(ours.scale.reshape(1), te_scale), (amax, ours.scale, te_scale)
        assert torch.allclose(ours.amax_history, te_history[:, 0], rtol=0, atol=0, equal_nan=True)


def test_te_update_through_our_hooks_equals_our_update(te_recipe_module, te_scaling_functions):
    """TE's unfused update path with our recipe's callables gives our 'max'-window scales."""
    spec = CalibratedDelayedScaling(amax_history_len=3, margin=1)
    recipe = te_recipe.to_te_recipe(spec, te_recipe_module)
    te_history, te_scale = torch.zeros(3, 2), torch.ones(2)
    ours = [DelayedScalingState(3), DelayedScalingState(3)]
    for step, amax in enumerate(AMAX_SEQUENCE):
        te_history[0] = torch.tensor([amax, 2.0 * step + 1])
        te_scaling_functions["_amax_and_scale_update"](te_history, te_scale, 448.0, recipe)
        for column, state in enumerate(ours):
            state.record(te_history.new_tensor([amax, 2.0 * step + 1])[column])
            state.update("max", 448.0, spec.margin)
            assert torch.equal(state.scale, te_scale[column])
    assert torch.isfinite(te_scale).all()


def test_megatron_recipe_selection_returns_our_recipe(te_recipe_module):
    from types import SimpleNamespace

    from megatron.core import fp8_utils
    from megatron.core.enums import Fp8Recipe

    original = fp8_utils.get_fp8_recipe
    uninstall = te_recipe.install_megatron_recipe(CalibratedDelayedScaling())
    try:
        chosen = fp8_utils.get_fp8_recipe(SimpleNamespace(fp8="hybrid", fp8_recipe=Fp8Recipe.delayed))
        assert type(chosen).__name__ == "CalibratedDelayedScaling"
        assert isinstance(chosen, te_recipe_module.DelayedScaling)
        assert fp8_utils.get_fp8_recipe(SimpleNamespace(fp8="hybrid", fp8_recipe="delayed")) is chosen
        assert fp8_utils.get_fp8_recipe(SimpleNamespace(fp8="e4m3", fp8_recipe="tensorwise")) is None
        with pytest.raises(ValueError, match="config.fp8 is 'e4m3'"):
            fp8_utils.get_fp8_recipe(SimpleNamespace(fp8="e4m3", fp8_recipe="delayed"))
    finally:
        uninstall()
    assert fp8_utils.get_fp8_recipe is original
