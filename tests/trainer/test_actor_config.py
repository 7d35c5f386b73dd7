"""A run's YAML reaches what the actor builds: model.fp8_recipe the recipe every FP8 linear runs
(and the quantizer state it sizes from it), the train section the Megatron optimizer; and the
checkpoint the rollout engine starts from, made by the actor: aligned scales carry the configured
recipe's margin, static per-tensor input scales the actor's own input maxima. One process
(gloo), a tiny random Llama."""
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from megatron_fp8rl.config.loader import load_config
from megatron_fp8rl.fp8.recipe import DelayedScaling
from megatron_fp8rl.trainer.actor import MegatronActor, convert_initial_checkpoint
from megatron_fp8rl.trainer.config import RunConfig
from megatron_fp8rl.trainer.rollout_start import rollout_model_path, write_rollout_start
from megatron_fp8rl.trainer.objective import Objective
from megatron_fp8rl.trainer.rollout_fp8 import served_scales
from megatron_fp8rl.trainer.start import training_records
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


def _start_checkpoint(model, run_dir, overrides):
    """The FP8 checkpoint a run with `overrides` starts its rollout engine from (made by the actor)."""
    cfg = load_config(RunConfig, None, [f"model.hf_path={model}", f"run_dir={run_dir}", "data.train_size=16",
                                        *overrides])
    actor = MegatronActor(convert_initial_checkpoint(model, run_dir / "init"), cfg.model, cfg.train,
                          Objective(cfg.algorithm, max_response_length=8), serving=cfg.fp8_plan)
    write_rollout_start(cfg, actor, AutoTokenizer.from_pretrained(model), training_records(cfg))
    return actor, rollout_model_path(cfg)


def test_recipe_margin_reaches_the_aligned_rollout_checkpoint(megatron_tp1, tmp_path):
    """Aligned rollouts serve the trainer's bounds: margin 3 instead of calibrated's own 1 makes
    every served weight and input scale (a dequantization multiplier, bound / fp8_max) 4x larger;
    the actor remembers exactly what it served."""
    model = build_tiny_model("llama", tmp_path / "hf")
    served = {}
    for margin in (None, 3):
        actor, checkpoint = _start_checkpoint(model, tmp_path / str(margin), [
            "model.fp8=calibrated", "rollout.fp8=aligned", *([f"model.fp8_recipe.margin={margin}"] if margin else [])])
        served[margin] = served_scales(checkpoint)
        assert actor.publisher.served_scales().keys() == served[margin].keys()
        assert all(torch.equal(a, b) for key, pair in served[margin].items()
                   for a, b in zip(actor.publisher.served_scales()[key], pair))
    assert served[None].keys() == served[3].keys() and len(served[3]) == 2 * 4
    for key, (weight, inputs) in served[None].items():
        assert torch.allclose(served[3][key][0], 4 * weight) and torch.allclose(served[3][key][1], 4 * inputs), key


def test_static_per_tensor_start_checkpoint_takes_the_actors_input_maxima(megatron_tp1, tmp_path):
    """rollout.fp8=per_tensor with static activations from a float32 trainer: the start checkpoint's
    input scales are the max |input| of each linear over the calibration prompts / 448, measured
    on the actor (an HF transformers forward of the same weights on the same prompts is the
    oracle: fused q/k/v and gate/up get their common input's bound)."""
    from transformers import AutoModelForCausalLM

    from megatron_fp8rl.data.records import prompt_token_ids

    model = build_tiny_model("llama", tmp_path / "hf")
    _, checkpoint = _start_checkpoint(model, tmp_path / "run", ["rollout.fp8=per_tensor",
                                                                 "rollout.activation_scheme=static"])
    scales = {name: tensor for name, tensor in load_file(next(checkpoint.glob("*.safetensors"))).items()
              if name.endswith(".input_scale")}
    cfg = load_config(RunConfig, None, [f"model.hf_path={model}", "data.train_size=16"])
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [prompt_token_ids(r, tokenizer) for r in training_records(cfg)[:16]]
    hf, maxima = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval(), {}
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            module.register_forward_pre_hook(lambda m, args, name=name: maxima.__setitem__(
                name, max(maxima.get(name, 0.0), float(args[0].abs().max()))))
    with torch.no_grad():
        for ids in prompts:
            hf(torch.tensor([ids]))
    assert sorted(scales) == sorted(f"{name}.input_scale" for name in maxima) and len(scales) == 2 * 7
    for name, bound in maxima.items():
        torch.testing.assert_close(scales[f"{name}.input_scale"], torch.tensor(bound / 448), rtol=1e-5, atol=0)


def test_the_actor_takes_a_serving_plan_for_its_own_recipe(tmp_path):
    """Refused before any file is read or model built: a mode string (the old `rollout_fp8`
    argument), and a plan made for another model.fp8."""
    from megatron_fp8rl.fp8.serving import RolloutFp8, plan_for
    from megatron_fp8rl.trainer.algorithm_config import AlgorithmConfig
    from megatron_fp8rl.trainer.config import ModelConfig, TrainConfig

    objective = Objective(AlgorithmConfig(), max_response_length=8)
    model_cfg = ModelConfig(hf_path=str(tmp_path / "absent"), fp8="calibrated")
    with pytest.raises(TypeError, match=r"MegatronActor\(serving=...\): expected an Fp8ServingPlan .* found str 'aligned'"):
        MegatronActor(tmp_path / "init", model_cfg, TrainConfig(), objective, serving="aligned")
    with pytest.raises(ValueError, match="the serving plan is for model.fp8=groupwise, this actor's model.fp8 is calibrated"):
        MegatronActor(tmp_path / "init", model_cfg, TrainConfig(), objective,
                      serving=plan_for(RolloutFp8.ALIGNED, "groupwise"))
