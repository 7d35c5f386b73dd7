"""Recipe specs: defaults, validation and names."""
import dataclasses

import pytest

from megatron_fp8rl.fp8.recipe import (
    BlockwiseScaling,
    CalibratedDelayedScaling,
    DelayedScaling,
    megatron_default_delayed,
    recipe_by_name,
    te_default_delayed,
)


def test_baseline_defaults_match_te_and_megatron():
    assert (te_default_delayed().amax_history_len, te_default_delayed().amax_compute_algo) == (1024, "max")
    megatron = megatron_default_delayed()
    assert (megatron.amax_history_len, megatron.amax_compute_algo, megatron.margin) == (1, "most_recent", 0)
    assert BlockwiseScaling().weight_block == (128, 128)
    assert BlockwiseScaling().activation_block == (1, 128)


def test_calibrated_recipe_has_every_field_of_the_issue():
    names = {f.name for f in dataclasses.fields(CalibratedDelayedScaling)}
    assert names == {"fp8_format", "margin", "amax_history_len", "criterion", "saturation_budget",
                     "overflow_tolerance", "calibrate_weights_every_step", "reduce_amax"}


@pytest.mark.parametrize("build,message", [
    (lambda: CalibratedDelayedScaling(criterion="median"), "valid: max, percentile, mse"),
    (lambda: CalibratedDelayedScaling(fp8_format="e5m2"), "valid: e4m3, hybrid"),
    (lambda: DelayedScaling(amax_compute_algo="mean"), "valid: max, most_recent"),
    (lambda: CalibratedDelayedScaling(margin=-1), "margin must be an integer >= 0, found -1"),
    (lambda: CalibratedDelayedScaling(amax_history_len=0), "amax_history_len must be >= 1, found 0"),
    (lambda: CalibratedDelayedScaling(saturation_budget=1.0), r"saturation_budget must be in \[0, 1\)"),
    (lambda: CalibratedDelayedScaling(criterion="percentile", saturation_budget=0.01),
     r"overflow_tolerance \(0.0\) must be >= saturation_budget \(0.01\)"),
    (lambda: BlockwiseScaling(weight_block=(0, 128)), "weight_block must be two positive integers"),
    (lambda: recipe_by_name("fp4"), "valid: calibrated, te_delayed, megatron_delayed, tensorwise, blockwise"),
])
def test_bad_fields_raise_value_errors_naming_them(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_recipe_by_name_passes_fields():
    assert recipe_by_name("calibrated", margin=0).margin == 0
    assert recipe_by_name("te_delayed", fp8_format="e4m3").fp8_format == "e4m3"


def test_every_named_recipe_says_what_it_promises_the_rollout():
    from megatron_fp8rl.fp8.recipe import PROMISES, RECIPE_NAMES, aligned_recipe_names, promises

    assert set(PROMISES) == set(RECIPE_NAMES)
    assert aligned_recipe_names() == ("calibrated", "te_delayed", "megatron_delayed", "groupwise", "groupwise32")
    assert [promises(name).row_group for name in ("groupwise", "groupwise32", "blockwise")] == [128, 32, None]
    assert promises("calibrated").shares_scales and not promises("groupwise").shares_scales
    assert "128x128" in promises("blockwise").not_aligned_because and not promises("tensorwise").servable_aligned
    # the row group is the recipe's own: both its weight and activation blocks
    for name in ("groupwise", "groupwise32"):
        recipe = recipe_by_name(name)
        assert recipe.weight_block == recipe.activation_block == (1, promises(name).row_group)
    with pytest.raises(ValueError, match="unknown FP8 recipe 'nope'"):
        promises("nope")
