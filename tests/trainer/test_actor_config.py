"""A run's YAML reaches what the actor builds: model.fp8_recipe the recipe every FP8 linear runs
(and the quantizer state it sizes from it), the train section the Megatron optimizer; and the
checkpoint aligned rollouts start from: its scales carry the configured recipe's margin. One
process (gloo), a tiny random Llama."""
import torch

from megatron_fp8rl.config.loader import load_config
from megatron_fp8rl.fp8.recipe import DelayedScaling
from megatron_fp8rl.trainer.actor import MegatronActor, convert_initial_checkpoint
from megatron_fp8rl.trainer.config import RunConfig
from megatron_fp8rl.trainer.loop import _rollout_model_path
from megatron_fp8rl.trainer.objective import Objective
from megatron_fp8rl.trainer.rollout_fp8 import served_scales
from tests.helpers.tiny_models import build_tiny_model

YAML = """
model:
  fp8: megatron_delayed
  fp8_recipe:
    margin: 2
    amax_history_len: 16
    amax_compute_algo: max
train:
  lr: 3.0e-4
  weight_decay: 0.1
  adam_beta1: 0.8
  adam_beta2: 0.95
  clip_grad: 0.5
"""


def test_yaml_recipe_and_optimizer_fields_reach_the_actor(megatron_tp1, tmp_path):
    model = build_tiny_model("llama", tmp_path / "hf")
    (tmp_path / "run.yaml").write_text(YAML)
    cfg = load_config(RunConfig, tmp_path / "run.yaml", [f"model.hf_path={model}"])
    actor = MegatronActor(convert_initial_checkpoint(model, tmp_path / "init"), cfg.model, cfg.train,
                          Objective(cfg.algorithm, max_response_length=8))
    linears = [m for m in actor.model.modules() if hasattr(m, "fp8_quantizers")]
    assert len(linears) == 2 * 4  # qkv, proj, fc1, fc2 in each of the tiny model's 2 layers
    expected = DelayedScaling(margin=2, amax_history_len=16, amax_compute_algo="max")
    for linear in linears:
        assert linear.fp8_recipe == expected
        assert linear.fp8_quantizers.input.state.amax_history.shape[0] == 16
    parts = actor.optimizer.chained_optimizers
    groups = [group for part in parts for group in part.optimizer.param_groups]
    assert {(group["lr"], group["betas"]) for group in groups} == {(3e-4, (0.8, 0.95))}
    assert max(group["weight_decay"] for group in groups) == 0.1
    assert {part.config.clip_grad for part in parts} == {0.5}


def test_recipe_margin_reaches_the_aligned_rollout_checkpoint(tmp_path):
    """Aligned rollouts serve the trainer's bounds: margin 3 instead of calibrated's own 1 makes
    every served weight and input scale (a dequantization multiplier, bound / fp8_max) 4x larger."""
    model = build_tiny_model("llama", tmp_path / "hf")
    served = {}
    for margin in (None, 3):
        overrides = [f"model.hf_path={model}", f"run_dir={tmp_path / str(margin)}", "model.fp8=calibrated",
                     "rollout.fp8=aligned", "data.train_size=16"]
        cfg = load_config(RunConfig, None, overrides + ([f"model.fp8_recipe.margin={margin}"] if margin else []))
        served[margin] = served_scales(_rollout_model_path(cfg))
    assert served[None].keys() == served[3].keys() and len(served[3]) == 2 * 4
    for key, (weight, inputs) in served[None].items():
        assert torch.allclose(served[3][key][0], 4 * weight) and torch.allclose(served[3][key][1], 4 * inputs), key
