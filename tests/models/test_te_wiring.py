"""model.fp8_backend=te wired for real, checked on CPU against TE's own recipe module (from the
pinned wheel, tests/helpers/te_wheel.py; no TE install, no GPU, no network): the TransformerConfig
that reaches Megatron carries the recipe's fp8 fields, Megatron's recipe selection (what its
`get_fp8_context` hands TE's autocast) returns our calibrated recipe, and every combination that
is not wired is refused by name before any work."""
import dataclasses

import pytest
import torch

from megatron_fp8rl.config.loader import ConfigError, load_config
from megatron_fp8rl.fp8.recipe import BlockwiseScaling, CalibratedDelayedScaling, CurrentScaling, recipe_by_name
from megatron_fp8rl.models import te_recipe
from megatron_fp8rl.models.hf import check_fp8_backend, te_fp8_overrides, transformer_config_from_hf
from megatron_fp8rl.trainer.config import RunConfig
from megatron_fp8rl.trainer.start import check_inputs
from tests.helpers.tiny_hf import tiny_hf_config

EXPECTED_FIELDS = {
    "calibrated": {"fp8": "hybrid", "fp8_recipe": "delayed", "fp8_margin": 1, "fp8_amax_history_len": 4,
                   "fp8_amax_compute_algo": "max"},
    "te_delayed": {"fp8": "hybrid", "fp8_recipe": "delayed", "fp8_margin": 0, "fp8_amax_history_len": 1024,
                   "fp8_amax_compute_algo": "max"},
    "megatron_delayed": {"fp8": "hybrid", "fp8_recipe": "delayed", "fp8_margin": 0, "fp8_amax_history_len": 1,
                         "fp8_amax_compute_algo": "most_recent"},
    "tensorwise": {"fp8": "hybrid", "fp8_recipe": "tensorwise"},
    "blockwise": {"fp8": "e4m3", "fp8_recipe": "blockwise"},
}


@pytest.fixture
def megatron_recipe_hook():
    """Megatron's own recipe selection is back in place after the test."""
    from megatron.core import fp8_utils

    original = fp8_utils.get_fp8_recipe
    yield fp8_utils
    fp8_utils.get_fp8_recipe = original


@pytest.mark.parametrize("name", sorted(EXPECTED_FIELDS))
def test_each_recipe_reaches_megatrons_config(name, megatron_recipe_hook, te_recipe_module):
    overrides = te_fp8_overrides(recipe_by_name(name))
    config = transformer_config_from_hf(tiny_hf_config("qwen3"), **overrides)
    assert {key: getattr(config, key) for key in EXPECTED_FIELDS[name]} == EXPECTED_FIELDS[name]
    if name in ("te_delayed", "megatron_delayed"):  # what Megatron's TEDelayedScaling builds
        te = te_recipe_module.DelayedScaling(margin=config.fp8_margin, amax_history_len=config.fp8_amax_history_len,
                                             amax_compute_algo=config.fp8_amax_compute_algo)
        spec = recipe_by_name(name)
        assert (te.margin, te.amax_history_len, te.amax_compute_algo) == (
            spec.margin, spec.amax_history_len, spec.amax_compute_algo)


def test_calibrated_recipe_is_what_megatrons_autocast_gets(megatron_recipe_hook, te_recipe_module):
    spec = CalibratedDelayedScaling(margin=2, amax_history_len=8, criterion="percentile",
                                    saturation_budget=1e-4, overflow_tolerance=1e-3)
    config = transformer_config_from_hf(tiny_hf_config("qwen3"), **te_fp8_overrides(spec))
    chosen = megatron_recipe_hook.get_fp8_recipe(config)
    assert isinstance(chosen, te_recipe_module.DelayedScaling)
    assert type(chosen).__name__ == "CalibratedDelayedScaling"
    assert chosen.scaling_factor_compute_algo is te_recipe.te_scaling_factor_compute
    assert te_recipe.from_te_recipe(chosen) == spec
    # a later baseline build gives Megatron its own selection back (no TE here: it returns None)
    te_fp8_overrides(recipe_by_name("te_delayed"))
    assert megatron_recipe_hook.get_fp8_recipe(config) is None


@pytest.mark.parametrize("recipe, message", [
    (CurrentScaling(margin=1), "margin=1: TE's Float8CurrentScaling"),
    (BlockwiseScaling(weight_block=(64, 64)), r"blocks \(64, 64\).*Float8BlockScaling"),
    (dataclasses.replace(CalibratedDelayedScaling(), reduce_amax=False), "reduce_amax=False"),
])
def test_recipes_te_cannot_carry_are_refused(recipe, message):
    with pytest.raises(ValueError, match=message):
        te_recipe.megatron_fp8_fields(recipe)


@pytest.mark.parametrize("overrides, message", [
    (["model.fp8_backend=tf"], "model.fp8_backend: 'tf' is not one of"),
    (["model.fp8_backend=te"], "model.fp8_backend: te runs an FP8 recipe: set model.fp8"),
    (["model.fp8_backend=te", "model.fp8=calibrated", "rollout.fp8=aligned"],
     "model.fp8_backend: te with rollout.fp8=aligned is not wired"),
])
def test_unwired_config_combinations_name_the_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RunConfig, None, ["model.hf_path=/x", *overrides])


def test_te_backend_refused_at_train_start_without_cuda(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    cfg = load_config(RunConfig, None, [f"model.hf_path={tmp_path}", "model.fp8=calibrated", "model.fp8_backend=te"])
    with pytest.raises(ValueError, match=r"model.fp8_backend=te \(model.fp8=calibrated\) needs CUDA"):
        check_inputs(cfg)


def test_te_backend_refused_when_cuda_has_no_transformer_engine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="CUDA is available but transformer_engine is not installed"):
        check_fp8_backend("tensorwise", "te")
    check_fp8_backend("tensorwise", "ours")


def test_recipe_with_backend_ours_keeps_our_fp8_linears_where_te_is_usable(monkeypatch):
    """Before: with TE usable, layer_spec returned TE's spec and dropped the recipe (FP8 silently
    off). Now a recipe without backend te always gets our FP8 linears in the local spec."""
    import importlib.util

    from megatron_fp8rl.models import hf
    from megatron_fp8rl.models.megatron_fp8_linear import Fp8ColumnParallelLinear, Fp8RowParallelLinear

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "transformer_engine" else real_find_spec(name, *a))
    assert hf.transformer_engine_usable()
    spec = hf.layer_spec(qk_layernorm=True, fp8_recipe=CalibratedDelayedScaling())
    attention, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp.submodules
    assert (attention.linear_qkv.module, attention.linear_proj.module) == (Fp8ColumnParallelLinear, Fp8RowParallelLinear)
    assert (mlp.linear_fc1.module, mlp.linear_fc2.module) == (Fp8ColumnParallelLinear, Fp8RowParallelLinear)


def test_aligned_rollouts_build_the_trainer_on_the_batch_invariant_gemm(megatron_tp1):
    """rollout.fp8=aligned: the trainer's FP8 linears run gemm=batch_invariant (the Triton kernel
    the SGLang fp8rl method runs on GPU, 'exact' on CPU); other runs keep auto."""
    from megatron_fp8rl.config.loader import load_config
    from megatron_fp8rl.fp8.recipe import CalibratedDelayedScaling
    from megatron_fp8rl.models.hf import build_model_from_hf
    from megatron_fp8rl.models.megatron_fp8_linear import fp8_decoder_linears
    from megatron_fp8rl.trainer.config import RunConfig
    from tests.helpers.tiny_hf import tiny_hf_config

    base = ["model.hf_path=/x", "model.fp8=calibrated"]
    aligned = load_config(RunConfig, None, [*base, "rollout.fp8=aligned"])
    assert aligned.trainer_fp8_gemm == "batch_invariant"
    assert load_config(RunConfig, None, base).trainer_fp8_gemm == "auto"
    config = tiny_hf_config("llama").to_dict()
    model = build_model_from_hf(config, fp8_recipe=CalibratedDelayedScaling(), fp8_gemm=aligned.trainer_fp8_gemm)
    gemms = {module.fp8_gemm for _, _, module in fp8_decoder_linears(model)}
    assert gemms == {"batch_invariant"}
