"""model.fp8_recipe in a run's YAML reaches the FP8 linears the actor builds: the recipe object
every linear runs and the quantizer state it sizes from it. One process (gloo), a tiny random Llama."""
from megatron_fp8rl.config.loader import load_config
from megatron_fp8rl.fp8.recipe import DelayedScaling
from megatron_fp8rl.trainer.actor import MegatronActor, convert_initial_checkpoint
from megatron_fp8rl.trainer.config import RunConfig
from megatron_fp8rl.trainer.megatron_step import OptimConfig
from megatron_fp8rl.trainer.objective import Objective
from tests.rollout.tiny_models import build_tiny_model

YAML = """
model:
  fp8: megatron_delayed
  fp8_recipe:
    margin: 2
    amax_history_len: 16
    amax_compute_algo: max
"""


def test_yaml_recipe_fields_reach_the_actors_fp8_linears(megatron_tp1, tmp_path):
    model = build_tiny_model("llama", tmp_path / "hf")
    (tmp_path / "run.yaml").write_text(YAML)
    cfg = load_config(RunConfig, tmp_path / "run.yaml", [f"model.hf_path={model}"])
    actor = MegatronActor(convert_initial_checkpoint(model, tmp_path / "init"), cfg.model, OptimConfig(), cfg.train,
                          Objective(cfg.algorithm, max_response_length=8))
    linears = [m for m in actor.model.modules() if hasattr(m, "fp8_quantizers")]
    assert len(linears) == 2 * 4  # qkv, proj, fc1, fc2 in each of the tiny model's 2 layers
    expected = DelayedScaling(margin=2, amax_history_len=16, amax_compute_algo="max")
    for linear in linears:
        assert linear.fp8_recipe == expected
        assert linear.fp8_quantizers.input.state.amax_history.shape[0] == 16
