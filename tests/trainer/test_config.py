"""Run-config errors surface before any expensive work, naming the key or the file."""
import dataclasses
import re

import pytest

from megatron_fp8rl.cli import main
from megatron_fp8rl.config.loader import ConfigError, load_config
from megatron_fp8rl.trainer.config import RunConfig
from megatron_fp8rl.trainer.start import check_inputs
from tests.helpers.train import GPU_EXAMPLES


def test_unknown_key_suggests_closest(capsys):
    """A user error is one line on stderr and exit status 2; --debug raises it with its traceback."""
    assert main(["train", "model.hf_path=/x", "algorithm.clip_hihg=0.3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert re.match(r"error: .*'algorithm.clip_hihg'.*did you mean 'algorithm.clip.high'", err)
    with pytest.raises(ConfigError, match=r"'algorithm.clip_hihg'"):
        main(["--debug", "train", "model.hf_path=/x", "algorithm.clip_hihg=0.3"])



@pytest.mark.parametrize("override, message", [
    ("algorithm.name=ppo", "algorithm.name: 'ppo' is not one of"),
    ("rollout.n_samples=1", "rollout.n_samples: must be >= 2"),
    ("model.fp8=fp4", "model.fp8: 'fp4' is not one of"),
    ("checkpoint.keep_last=0", "keep_last must be >= 1"),
    ("data.reward_timeout_s=0", r"data.reward_timeout_s: must be a finite number > 0, got 0"),
    ("train.lr=0", r"train.lr: must be a finite number > 0, got 0"),
    ("train.lr=-1e-5", r"train.lr: must be a finite number > 0, got -1e-05"),
    ("train.lr=nan", r"train.lr: must be a finite number > 0, got nan"),
    ("train.weight_decay=inf", r"train.weight_decay: must be a finite number >= 0, got inf"),
    ("train.clip_grad=-1", r"train.clip_grad: must be a finite number >= 0, got -1"),
    ("train.adam_beta2=1", r"train.adam_beta2: must be in \[0, 1\), got 1"),
    ("train.distributed_optimizer=false", r"train.distributed_optimizer: false is not wired"),
    ("train.eval_every=-1", r"train.eval_every: must be >= 0"),
    ("train.micro_batch_size=0", r"train.micro_batch_size: must be >= 1"),
    ("rollout.temperature=-0.5", r"rollout.temperature: must be a finite number >= 0, got -0.5"),
    ("rollout.top_p=1.5", r"rollout.top_p: must be a finite number > 0 and <= 1, got 1.5"),
    ("rollout.top_p=0", r"rollout.top_p: must be a finite number > 0 and <= 1, got 0"),
    ("rollout.dtype=int8", r"rollout.dtype: 'int8' is not one of"),
    ("rollout.max_total_tokens=16", r"rollout.max_total_tokens: must exceed rollout.max_new_tokens \(32\)"),
    ("data.eval_size=0", r"data.eval_size: must be >= 1, got 0"),
    ("data.eval_interim_size=600", r"data.eval_interim_size: must be in \[0, data.eval_size=500\] \(0: all\), got 600"),
    ("data.eval_interim_size=-1", r"data.eval_interim_size: must be in \[0, data.eval_size=500\]"),
    ("algorithm.recompute_check_every=0", r"algorithm.recompute_check_every: must be >= 1 \(1: every step\), got 0"),
    ("data.train_size=0", r"data.train_size: must be >= 1"),
    ("data.arithmetic_ops=[add,pow]", r"data.arithmetic_ops: unknown \['pow'\]"),
    ("algorithm.agg_mode=sum", r"algorithm.agg_mode: 'sum' is not one of"),
    ("algorithm.clip.dual=0.5", r"algorithm.clip.dual: must be 0 \(off\) or a finite number > 1, got 0.5"),
    ("algorithm.calibration.rule=median", r"algorithm.calibration.rule: 'median' is not one of"),
    ("algorithm.calibration.noise_tail=0.5", r"algorithm.calibration.noise_tail: must be in \(0, 0.5\), got 0.5"),
    ("algorithm.calibration.overclip_budget=1", r"algorithm.calibration.overclip_budget: must be in \[0, 1\), got 1"),
])
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RunConfig, None, ["model.hf_path=/x", override])


def test_aligned_needs_our_backend_in_run_and_engine_config():
    """One rule (sglang_common.check_aligned_backend) for RunConfig and SGLangConfig."""
    from megatron_fp8rl.rollout.sglang_common import SGLangConfig

    with pytest.raises(ConfigError, match=r"rollout.fp8_backend: fp8=aligned needs fp8_backend='ours', found 'sglang'"):
        load_config(RunConfig, None, ["model.hf_path=/x", "model.fp8=calibrated", "rollout.fp8=aligned",
                                      "rollout.fp8_backend=sglang"])
    with pytest.raises(ValueError, match="fp8=aligned needs fp8_backend='ours', found 'sglang'"):
        SGLangConfig(model_path="/x", fp8="aligned", fp8_backend="sglang", device="cpu")
    load_config(RunConfig, None, ["model.hf_path=/x", "rollout.fp8=per_tensor", "rollout.fp8_backend=sglang"])


def test_hf_path_required():
    with pytest.raises(ConfigError, match="model.hf_path: is required"):
        load_config(RunConfig, None, [])


def test_missing_files_fail_before_work(tmp_path):
    cfg = load_config(RunConfig, None, [f"model.hf_path={tmp_path}"])
    with pytest.raises(FileNotFoundError, match="no config.json"):
        check_inputs(cfg)
    (tmp_path / "config.json").write_text("{}")
    cfg = load_config(RunConfig, None, [f"model.hf_path={tmp_path}", f"data.train={tmp_path}/none.jsonl"])
    with pytest.raises(FileNotFoundError, match="data.train=.*none.jsonl: file does not exist"):
        check_inputs(cfg)
    cfg = load_config(RunConfig, None, [f"model.hf_path={tmp_path}", "data.reward=nope:fn"])
    with pytest.raises(ValueError, match="cannot import module 'nope'"):
        check_inputs(cfg)


def test_example_run_configs_load():
    """Every run config under examples/ is valid against the schema (keys and values)."""
    from pathlib import Path

    configs = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
    assert configs
    for path in configs:
        cfg = load_config(RunConfig, path, ["model.hf_path=/x"])
        assert cfg.train.steps >= 1, path


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.old_policy=reuse"], "algorithm.old_policy: 'reuse' is not one of"),
    (["algorithm.old_policy=bypass"], "algorithm.correction: must be none with old_policy=bypass"),
    (["algorithm.noise.quantile=1.0"], r"algorithm.noise.quantile: must be in \[0.5, 1\)"),
    (["algorithm.noise.quantile=-0.1"], r"algorithm.noise.quantile: must be in \[0.5, 1\)"),
    (["algorithm.noise.log_quantiles=[0.5,1.5]"], r"algorithm.noise.log_quantiles: need levels in \(0, 1\)"),
    (["algorithm.noise.log_quantiles=[]"], r"algorithm.noise.log_quantiles: need levels in \(0, 1\)"),
    (["algorithm.noise.clip_low_max=0.1"], "algorithm.noise.clip_low_max: need clip.low <= noise.clip_low_max < 1"),
    (["algorithm.noise.clip_low_max=1.0"], "algorithm.noise.clip_low_max: need clip.low <= noise.clip_low_max < 1"),
    (["algorithm.noise.clip_high_max=0.1"], "algorithm.noise.clip_high_max: need noise.clip_high_max >= clip.high"),
    (["algorithm.noise.tis_cap_max=1.5"], "algorithm.noise.tis_cap_max: need noise.tis_cap_max >= tis_cap"),
    (["algorithm.noise.mis_low_min=-0.1"], "algorithm.noise.mis_low_min: need 0 <= noise.mis_low_min <= mis_low"),
    (["algorithm.noise.mis_low_min=0.6"], "algorithm.noise.mis_low_min: need 0 <= noise.mis_low_min <= mis_low"),
    (["algorithm.noise.mis_high_max=1.5"], "algorithm.noise.mis_high_max: need noise.mis_high_max >= mis_high"),
    (["algorithm.noise.correction=true", "algorithm.correction=none"], "algorithm.noise.correction: .*needs correction=tis or mis"),
    (["algorithm.noise.correction=true", "algorithm.tis_cap=0.5"], "algorithm.noise.correction: needs tis_cap >= 1"),
])
def test_noise_options_out_of_range_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RunConfig, None, ["model.hf_path=/x", *overrides])


def test_noise_options_set_by_dotted_overrides():
    cfg = load_config(RunConfig, None, [
        "model.hf_path=/x", "algorithm.old_policy=bypass", "algorithm.correction=none",
        "algorithm.noise.quantile=0.95", "algorithm.noise.log_quantiles=[0.5,0.99]",
        "algorithm.noise.clip_high_max=0.6"])
    algo = cfg.algorithm
    assert (algo.old_policy, algo.noise.quantile, algo.noise.clip_high_max) == ("bypass", 0.95, 0.6)
    assert list(algo.noise.log_quantiles) == [0.5, 0.99]
    assert load_config(RunConfig, None, ["model.hf_path=/x"]).algorithm.old_policy == "decoupled"


# GPU examples: run config -> (model layout file, trainer GPUs in the launch the example describes)
@pytest.mark.parametrize("name", sorted(GPU_EXAMPLES))
def test_gpu_examples_fit_their_model_and_gpus(name):
    """The GPU run configs' TP/PP divide their model's heads, vocab and layers, and their
    trainer GPU count."""
    from pathlib import Path

    import yaml

    from megatron_fp8rl.models.hf import check_parallel_layout

    examples = Path(__file__).resolve().parents[2] / "examples"
    cfg = load_config(RunConfig, examples / name, ["model.hf_path=/x"])
    model_file, gpus = GPU_EXAMPLES[name]
    hf = yaml.safe_load((examples / "models" / model_file).read_text())["hf_config"]
    check_parallel_layout(hf, cfg.model.tensor_parallel, cfg.model.pipeline_parallel)
    assert gpus % (cfg.model.tensor_parallel * cfg.model.pipeline_parallel) == 0, name
    assert cfg.model.fp8 != "none", name


@pytest.mark.parametrize("overrides, message", [
    (["model.dtype=float16"], "model.dtype: 'float16' is not one of"),
    (["model.dtype=bfloat16"], "rollout.dtype: 'float32' differs from model.dtype='bfloat16'"),
    (["rollout.dtype=bfloat16"], "rollout.dtype: 'bfloat16' differs from model.dtype='float32'"),
    (["model.dtype=bfloat16", "model.fp8=calibrated", "rollout.fp8=aligned"], "rollout.dtype: 'float32' differs"),
])
def test_dtype_mismatch_names_the_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RunConfig, None, ["model.hf_path=/x", *overrides])


def test_fp8_rollouts_may_serve_another_dtype():
    cfg = load_config(RunConfig, None, ["model.hf_path=/x", "model.dtype=bfloat16", "rollout.fp8=blockwise"])
    assert (cfg.model.dtype, cfg.rollout.dtype) == ("bfloat16", "float32")


@pytest.mark.parametrize("recipe, message", [
    ("none", r"model.fp8: rollout.fp8=aligned serves the trainer's own FP8 quantization: model.fp8 must be one of .* found 'none'"),
    ("tensorwise", r"found 'tensorwise'"),
    ("blockwise", r"found 'blockwise' \(blockwise's 128x128 weight blocks cut across the q/k/v rows"),
])
def test_aligned_rollouts_refuse_a_recipe_they_cannot_serve(recipe, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RunConfig, None, ["model.hf_path=/x", f"model.fp8={recipe}", "rollout.fp8=aligned"])


@pytest.mark.parametrize("recipe", ["groupwise", "calibrated", "te_delayed", "megatron_delayed"])
def test_aligned_rollouts_accept_the_recipes_they_serve(recipe):
    cfg = load_config(RunConfig, None, ["model.hf_path=/x", f"model.fp8={recipe}", "rollout.fp8=aligned"])
    assert cfg.trainer_fp8_gemm == "batch_invariant"


def test_dataset_schema_keys_by_override_and_checked():
    cfg = load_config(RunConfig, None, ["model.hf_path=/x", "data.schema.answer_key=reward_model.ground_truth"])
    assert (cfg.data.schema.answer_key, cfg.data.schema.prompt_key) == ("reward_model.ground_truth", "prompt")
    with pytest.raises(ConfigError, match=r"data.schema.answer_key: must name a field .* got 'a..b'"):
        load_config(RunConfig, None, ["model.hf_path=/x", "data.schema.answer_key=a..b"])


def test_fp8_recipe_fields_are_settable_and_checked():
    cfg = load_config(RunConfig, None, ["model.hf_path=/x", "model.fp8=calibrated", "model.fp8_recipe.margin=0",
                                        "model.fp8_recipe.criterion=mse", "model.fp8_recipe.amax_history_len=16"])
    recipe = cfg.model.recipe()
    assert (recipe.margin, recipe.criterion, recipe.amax_history_len) == (0, "mse", 16)
    assert load_config(RunConfig, None, ["model.hf_path=/x", "model.fp8=blockwise",
                                         "model.fp8_recipe.weight_block=[64,128]"]).model.recipe().weight_block == (64, 128)
    for overrides, message in (
            (["model.fp8=calibrated", "model.fp8_recipe.criterion_x=mse"],
             r"unknown config key 'model.fp8_recipe.criterion_x'; did you mean 'model.fp8_recipe.criterion'"),
            (["model.fp8=calibrated", "model.fp8_recipe.margin=two"], r"bad value for 'model.fp8_recipe.margin'"),
            (["model.fp8=calibrated", "model.fp8_recipe.margin=-1"],
             r"model.fp8_recipe.margin \(model.fp8=calibrated\): margin must be an integer >= 0, found -1"),
            (["model.fp8=calibrated", "model.fp8_recipe.margin=0", "model.fp8_recipe.fp8_format=e5m2"],
             r"model.fp8_recipe.fp8_format \(model.fp8=calibrated\): unknown FP8 recipe format 'e5m2'"),
            (["model.fp8=calibrated", "model.fp8_recipe.amax_compute_algo=most_recent"],
             r"model.fp8_recipe.amax_compute_algo \(model.fp8=calibrated\): not a field of the 'calibrated' recipe "
             r"\(fields: fp8_format, margin,"),
            (["model.fp8=groupwise", "model.fp8_recipe.weight_block=[128,128]"],
             r"model.fp8_recipe.weight_block \(model.fp8=groupwise\): not a field of the 'groupwise' recipe "
             r"\(fields: fp8_format, scale_pow2\)"),
            (["model.fp8=groupwise32", "model.fp8_recipe.activation_block=[1,128]"],
             r"model.fp8_recipe.activation_block \(model.fp8=groupwise32\): not a field of the 'groupwise32' "
             r"recipe \(fields: fp8_format, scale_pow2\)"),
            (["model.fp8_recipe.margin=0"], r"model.fp8_recipe.margin: sets \['margin'\] but model.fp8 is none")):
        with pytest.raises(ConfigError, match=message):
            load_config(RunConfig, None, ["model.hf_path=/x", *overrides])


@pytest.mark.parametrize("overrides, message", [
    (["model.fp8_step_weight_scales=held"], r"model.fp8_step_weight_scales: 'held' is not one of \('live', 'frozen'\)"),
    (["model.fp8_step_weight_scales=frozen"], r"model.fp8_step_weight_scales: frozen holds FP8 weight scales: set model.fp8"),
    (["model.fp8=calibrated", "model.fp8_step_weight_scales=frozen"],
     r"model.fp8_step_weight_scales: .* model.fp8=calibrated keeps its own weight scaling state, not wired"),
    (["model.fp8=groupwise32", "rollout.fp8=aligned", "model.fp8_recipe.scale_pow2=true"],
     r"model.fp8_recipe.scale_pow2: rollout.fp8=aligned is not wired for power-of-two scales"),
    (["model.fp8=blockwise", "model.fp8_backend=te", "model.fp8_recipe.scale_pow2=true"],
     r"model.fp8_backend: te cannot run .* scale_pow2=True is not wired to TE"),
])
def test_step_scale_remedies_refuse_what_is_not_wired(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RunConfig, None, ["model.hf_path=/x", *overrides])


def test_step_scale_remedies_reach_the_model_config():
    cfg = load_config(RunConfig, None, ["model.hf_path=/x", "model.fp8=groupwise32", "model.fp8_step_weight_scales=frozen",
                                        "model.fp8_recipe.scale_pow2=true"])
    assert cfg.model.fp8_step_weight_scales == "frozen" and cfg.model.recipe().scale_pow2
    assert load_config(RunConfig, None, ["model.hf_path=/x"]).model.fp8_step_weight_scales == "live"


@pytest.mark.parametrize("name, history, algo", [("te_delayed", 1024, "max"), ("megatron_delayed", 1, "most_recent")])
def test_delayed_recipes_take_megatron_lms_fp8_flags_over_their_own_defaults(name, history, algo):
    """--fp8-margin, --fp8-amax-history-len, --fp8-amax-compute-algo: unset fields keep the name's values."""
    named = load_config(RunConfig, None, ["model.hf_path=/x", f"model.fp8={name}"]).model.recipe()
    assert (named.margin, named.amax_history_len, named.amax_compute_algo) == (0, history, algo)
    recipe = load_config(RunConfig, None, ["model.hf_path=/x", f"model.fp8={name}", "model.fp8_recipe.margin=1",
                                           "model.fp8_recipe.amax_history_len=16"]).model.recipe()
    assert (recipe.margin, recipe.amax_history_len, recipe.amax_compute_algo) == (1, 16, algo)

def test_rollout_section_is_the_sglang_settings_the_engine_starts_with(tmp_path):
    """Every SGLangSettings field set under rollout reaches the SGLangConfig the run starts SGLang
    with, beside the served checkpoint and train.seed; engine_kwargs passes them on."""
    from megatron_fp8rl.rollout.sglang_common import SGLangSettings, engine_kwargs
    from megatron_fp8rl.trainer.engines import sglang_config

    cfg = load_config(RunConfig, None, [f"model.hf_path={tmp_path}", "model.dtype=bfloat16", "rollout.dtype=bfloat16",
                                        "rollout.device=cpu", "rollout.attention_backend=triton",
                                        "rollout.max_total_tokens=4096", "rollout.mem_fraction_static=0.5",
                                        "rollout.deterministic=true", "rollout.log_level=info",
                                        "rollout.activation_scheme=static", "rollout.fp8_backend=sglang",
                                        "rollout.memory_saver=false", "rollout.extra.chunked_prefill_size=256",
                                        "train.seed=7"])
    config = sglang_config(cfg)
    names = [f.name for f in dataclasses.fields(SGLangSettings)]
    assert {name: getattr(config, name) for name in names} == {name: getattr(cfg.rollout, name) for name in names}
    assert {name: getattr(config, name) for name in names} != {name: getattr(SGLangSettings(), name) for name in names}
    kwargs = engine_kwargs(config)
    assert (kwargs["model_path"], kwargs["random_seed"], kwargs["dtype"]) == (str(tmp_path), 7, "bfloat16")
    assert (kwargs["attention_backend"], kwargs["mem_fraction_static"], kwargs["chunked_prefill_size"]) == ("triton", 0.5, 256)


@pytest.mark.parametrize("override, message", [
    ("rollout.memory_saver=true", r"rollout.memory_saver: torch_memory_saver frees CUDA memory only"),
    ("rollout.dtype=auto", r"rollout.dtype: 'auto' is not one of \('float32', 'bfloat16', 'float16'\)"),
    ("rollout.extra.tp_size=2", r"rollout.extra.tp_size: use rollout.server_tp"),
    ("rollout.activation_scheme=per_token", r"rollout.activation_scheme: 'per_token' is not one of"),
])
def test_sglang_settings_checks_name_the_rollout_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RunConfig, None, ["model.hf_path=/x", "rollout.device=cpu", override])


@pytest.mark.parametrize("overrides, message", [
    (["model.fp8=groupwise"], r"blocks \(1, 128\)/\(1, 128\): TE's Float8BlockScaling uses \(128, 128\)/\(1, 128\) only"),
    (["model.fp8=calibrated", "model.fp8_recipe.reduce_amax=false"], r"reduce_amax=False: Megatron's TE recipes"),
    (["model.fp8=tensorwise", "model.fp8_recipe.margin=1"], r"margin=1: TE's Float8CurrentScaling"),
])
def test_te_backend_refuses_at_load_what_megatrons_te_recipes_cannot_carry(overrides, message):
    """Checked when the config is loaded, not when the actor builds its model on every rank."""
    with pytest.raises(ConfigError, match=r"model.fp8_backend: te cannot run model.fp8=\w+ as configured .*" + message):
        load_config(RunConfig, None, ["model.hf_path=/x", "model.fp8_backend=te", *overrides])
    load_config(RunConfig, None, ["model.hf_path=/x", *overrides])  # ours runs them


def test_every_renamed_key_fails_in_one_line_naming_the_new_key(tmp_path, capsys):
    """The flat algorithm keys before the clip/calibration/noise groups (config/renamed.py): each,
    as an override and in a YAML file, is refused with one line that names its new key, and each
    new key is a key of the schema (a set value reaches it)."""
    from megatron_fp8rl.config.renamed import RENAMED_KEYS

    assert len(RENAMED_KEYS) == 19
    for old, new in RENAMED_KEYS.items():
        with pytest.raises(ConfigError, match=rf"^override: '{re.escape(old)}' was renamed: use '{re.escape(new)}'$"):
            load_config(RunConfig, None, ["model.hf_path=/x", f"{old}=1"])
        section, leaf = old.split(".")
        path = tmp_path / f"{leaf}.yaml"
        path.write_text(f"model:\n  hf_path: /x\n{section}:\n  {leaf}: 1\n")
        with pytest.raises(ConfigError, match=rf"'{re.escape(old)}' was renamed: use '{re.escape(new)}'$"):
            load_config(RunConfig, path)
        node = load_config(RunConfig, None, ["model.hf_path=/x"])
        for part in new.split(".")[:-1]:
            node = getattr(node, part)
        assert hasattr(node, new.rsplit(".", 1)[1]), new
    assert main(["train", "model.hf_path=/x", "algorithm.clip_low=0.3"]) == 2
    err = capsys.readouterr().err
    assert err == "error: override: 'algorithm.clip_low' was renamed: use 'algorithm.clip.low'\n"


def test_nested_algorithm_groups_take_yaml_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  hf_path: /x\n  fp8: calibrated\nalgorithm:\n  clip:\n    low: 0.25\n    high: 0.3\n"
                    "  calibration:\n    mode: shadow\n    limits:\n      high_max: 1.7\n")
    algo = load_config(RunConfig, path, ["algorithm.calibration.every=3", "algorithm.noise.quantile=0.95"]).algorithm
    assert (algo.clip.low, algo.clip.high, algo.clip.dual) == (0.25, 0.3, 0.0)
    assert (algo.calibration.mode, algo.calibration.every, algo.calibration.limits.high_max) == ("shadow", 3, 1.7)
    assert (algo.calibration.limits.low_min, algo.noise.quantile) == (0.5, 0.95)  # defaults kept beside set fields


@pytest.mark.parametrize("override, found", [("algorithm.name=gspo", "algorithm.name=gspo, old_policy=decoupled"),
                                             ("algorithm.old_policy=bypass", "algorithm.name=grpo, old_policy=bypass")])
def test_the_shadow_gate_refuses_what_it_is_not_wired_for(override, found):
    """calibration.mode=gate decides the clip on token-level shadow ratios against the shadow's
    π_old: GSPO's sequence ratio and bypass (no π_old) are refused by name."""
    base = ["model.hf_path=/x", "model.fp8=groupwise32", "algorithm.name=grpo", "algorithm.calibration.mode=gate"]
    assert load_config(RunConfig, None, base).algorithm.calibration.mode == "gate"
    extra = ["algorithm.correction=none"] if "bypass" in override else []
    with pytest.raises(ConfigError, match=rf"algorithm.calibration.mode: gate is wired for token-level ratios with "
                                          rf"old_policy=decoupled .*got {found}"):
        load_config(RunConfig, None, [*base, override, *extra])


@pytest.mark.parametrize("mode", ["none", "shadow", "monitor"])
def test_gate_every_is_refused_without_the_gate(mode):
    """calibration.gate_every thins the gate's steps; under any other mode it would be silently
    ignored, so it is refused by name (and a gate_every below 1 under the gate too)."""
    base = ["model.hf_path=/x", "model.fp8=groupwise32", "algorithm.name=grpo"]
    gated = load_config(RunConfig, None, [*base, "algorithm.calibration.mode=gate", "algorithm.calibration.gate_every=9"])
    assert gated.algorithm.calibration.gate_every == 9
    with pytest.raises(ConfigError, match=rf"algorithm.calibration.gate_every: is wired for mode=gate only, "
                                          rf"got mode={mode} with gate_every=9"):
        load_config(RunConfig, None, [*base, f"algorithm.calibration.mode={mode}", "algorithm.calibration.gate_every=9"])
    with pytest.raises(ConfigError, match="algorithm.calibration.gate_every: must be >= 1, got 0"):
        load_config(RunConfig, None, [*base, "algorithm.calibration.mode=gate", "algorithm.calibration.gate_every=0"])
