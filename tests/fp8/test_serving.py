"""fp8/serving.py: the plan of every (trainer recipe, rollout mode) pair, refusals included, checked
against a table written out here (not derived from the module's own tables); and a source scan that
fails when a recipe name or rollout mode is compared as a string outside fp8/recipe.py and
fp8/serving.py, the one home of the FP8 serving contract."""
import ast
import json
from pathlib import Path

import pytest

from megatron_fp8rl.fp8.recipe import RECIPE_NAMES
from megatron_fp8rl.fp8.serving import ROLLOUT_FP8, Fp8ServingPlan, RolloutFp8, plan_for, served_layouts
from megatron_fp8rl.trainer.config import ModelConfig, RolloutConfig, RunConfig

TRAINER_FP8 = ("none", "calibrated", "te_delayed", "megatron_delayed", "tensorwise", "blockwise",
               "groupwise", "groupwise32")
ALIGNED_NAMES = "('calibrated', 'te_delayed', 'megatron_delayed', 'groupwise', 'groupwise32')"
BLOCKWISE_REASON = (" (blockwise's 128x128 weight blocks cut across the q/k/v rows Megatron fuses and "
                    "interleaves, so SGLang's per-tensor blocks differ; groupwise's 1x128 groups do not)")
# rollout.fp8=aligned, per trainer recipe: (shares scales, row group, served layout) or the refusal's tail
ALIGNED = {
    "calibrated": (True, None, ("tensor", "static")),
    "te_delayed": (True, None, ("tensor", "static")),
    "megatron_delayed": (True, None, ("tensor", "static")),
    "groupwise": (False, 128, ("block", "dynamic")),
    "groupwise32": (False, 32, ("block", "dynamic")),
    "tensorwise": "found 'tensorwise'",
    "blockwise": "found 'blockwise'" + BLOCKWISE_REASON,
    "none": "found 'none'",
}
# the other modes, per activation scheme: the served layout (the trainer recipe does not matter)
LAYOUTS = {
    "blockwise": {"dynamic": ("block", "dynamic"), "static": ("block", "dynamic")},
    "per_tensor": {"dynamic": ("tensor", "dynamic"), "static": ("tensor", "static")},
}


def test_the_modes_are_the_config_strings():
    assert ROLLOUT_FP8 == ("none", "blockwise", "per_tensor", "aligned")
    assert TRAINER_FP8[1:] == tuple(RECIPE_NAMES)
    assert RolloutFp8("aligned") == "aligned" and f"{RolloutFp8.PER_TENSOR}" == "per_tensor"
    assert [mode.own_quantization for mode in RolloutFp8] == [False, True, True, False]


@pytest.mark.parametrize("trainer", TRAINER_FP8)
@pytest.mark.parametrize("mode", ["none", "blockwise", "per_tensor"])
def test_non_aligned_modes_serve_their_own_quantization_for_any_recipe(trainer, mode):
    mode = RolloutFp8(mode)
    plan = plan_for(mode, trainer)
    assert (plan.rollout, plan.trainer_fp8, plan.shares_scales, plan.row_group) == (mode, trainer, False, None)
    assert (plan.fp8, plan.aligned, plan.trainer_gemm) == (mode != "none", False, "auto")
    assert plan.needs_calibration("static") == plan.static_per_tensor("static") == (mode == "per_tensor")
    assert not plan.needs_calibration("dynamic")
    for scheme in ("dynamic", "static"):
        if mode == "none":
            assert served_layouts(mode, scheme) == ()
            with pytest.raises(ValueError, match="rollout.fp8=none serves no FP8 checkpoint"):
                plan.layout(scheme)
        else:
            assert plan.layout(scheme) == LAYOUTS[mode][scheme]
            assert plan.layout(scheme) in served_layouts(mode, scheme)  # what SGLang's check accepts


@pytest.mark.parametrize("trainer", TRAINER_FP8)
def test_aligned_serves_what_the_recipe_promises_or_is_refused_naming_model_fp8(trainer):
    expected = ALIGNED[trainer]
    if isinstance(expected, str):
        message = ("model.fp8: rollout.fp8=aligned serves the trainer's own FP8 quantization: model.fp8 must be "
                   f"one of {ALIGNED_NAMES}, {expected}")
        with pytest.raises(ValueError) as error:
            plan_for(RolloutFp8.ALIGNED, trainer)
        assert str(error.value) == message
        if trainer != "none":  # the run config refuses the pair with the same message
            with pytest.raises(ValueError) as error:
                RunConfig(model=ModelConfig(hf_path="x", fp8=trainer), rollout=RolloutConfig(fp8="aligned"))
            assert str(error.value) == message
        return
    shares, group, layout = expected
    plan = plan_for(RolloutFp8.ALIGNED, trainer)
    assert (plan.fp8, plan.aligned, plan.shares_scales, plan.row_group) == (True, True, shares, group)
    assert plan.trainer_gemm == "batch_invariant"
    assert plan.needs_calibration("dynamic") == plan.needs_calibration("static") == shares
    assert not plan.static_per_tensor("static")
    for scheme in ("dynamic", "static"):
        assert plan.layout(scheme) == layout and layout in served_layouts(RolloutFp8.ALIGNED, scheme)


def test_the_run_config_holds_the_plan_of_its_pair_built_once():
    cfg = RunConfig(model=ModelConfig(hf_path="x", fp8="groupwise32"), rollout=RolloutConfig(fp8="aligned"))
    assert cfg.fp8_plan == Fp8ServingPlan(RolloutFp8.ALIGNED, "groupwise32", False, 32)
    assert cfg.fp8_plan is cfg.fp8_plan is plan_for(RolloutFp8.ALIGNED, "groupwise32")
    assert cfg.trainer_fp8_gemm == "batch_invariant"
    with pytest.raises(ValueError, match=r"rollout.fp8: 'fp16' is not one of \('none', 'blockwise'"):
        RunConfig(model=ModelConfig(hf_path="x"), rollout=RolloutConfig(fp8="fp16"))


def test_a_mode_string_passed_between_modules_is_refused_naming_the_type():
    """Strings only at the config: a module handed 'aligned' (equal to RolloutFp8.ALIGNED as a
    str) instead of the enum or the plan raises at the call, even after the enum's plan is cached."""
    from megatron_fp8rl.fp8.serving import require_plan
    from megatron_fp8rl.trainer.rollout_fp8 import rollout_tensors, write_rollout_checkpoint
    from megatron_fp8rl.trainer.weight_publisher import WeightPublisher

    plan_for(RolloutFp8.ALIGNED, "groupwise")
    mode_error = r"plan_for: the rollout FP8 mode must be a RolloutFp8 \(fp8/serving.py; .*found str 'aligned'"
    with pytest.raises(TypeError, match=mode_error):
        plan_for("aligned", "groupwise")
    with pytest.raises(TypeError, match=r"served_layouts: the rollout FP8 mode must be a RolloutFp8 .*found str"):
        served_layouts("per_tensor", "static")
    plan_error = r"expected an Fp8ServingPlan \(fp8/serving.py plan_for; a run's is RunConfig.fp8_plan\), found "
    with pytest.raises(TypeError, match="rollout_tensors: " + plan_error + "str 'per_tensor'"):
        rollout_tensors([], 2, "per_tensor")
    with pytest.raises(TypeError, match="write_rollout_checkpoint: " + plan_error + "RolloutFp8"):
        write_rollout_checkpoint([], Path("hf"), Path("out"), RolloutFp8.PER_TENSOR, "static")
    with pytest.raises(TypeError, match="WeightPublisher: " + plan_error + "str 'none'"):
        WeightPublisher(None, {}, "none")
    assert require_plan(plan_for(RolloutFp8.NONE, "none"), "here").rollout is RolloutFp8.NONE


# --- no recipe name or rollout mode compared as a string outside the contract's home -------------

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_fp8rl"
HOME = {"fp8/recipe.py", "fp8/serving.py"}
LABELS = {"study/arms.py": "the study's arms are labelled after the recipes they run ('tensorwise' is the key "
                             "arm); a label, set by dotted overrides, not a config value read back"}
OLD_LISTS = ("SHARED_SCALE_RECIPES", "ROW_GROUP_RECIPES", "ALIGNED_RECIPES", "FIXED_FIELDS")
# "none" is left out: it is also every other switch's off value (algorithm.correction, calibration.mode).
NAMES = (set(RECIPE_NAMES) | set(ROLLOUT_FP8)) - {"none"}


def _named(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in NAMES
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(_named(item) for item in node.elts)


def string_comparisons(source: str) -> list[str]:
    """'line N: ...' for each comparison of a recipe name or rollout mode string (==, !=, in, not in,
    as a literal or a literal tuple/list/set), and each use of the old name lists."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(_named(side) for side in (node.left, *node.comparators)):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Name) and node.id in OLD_LISTS:
            found.append(f"line {node.lineno}: {node.id}")
    return found


@pytest.mark.parametrize("snippet", ['x = mode == "groupwise32"', 'ok = fp8 in ("blockwise", "per_tensor")',
                                     'if "aligned" != cfg.rollout.fp8: pass', 'y = name not in ["calibrated"]',
                                     "z = trainer in ROW_GROUP_RECIPES"])
def test_the_scan_sees_a_comparison(snippet):
    assert string_comparisons(snippet), snippet


def test_the_scan_leaves_other_strings_alone():
    assert not string_comparisons('a = mode == "none"; b = {"aligned": 1}\nfor n in ("aligned", "x"): pass\n'
                                  'RolloutFp8(fp8) is RolloutFp8.ALIGNED')


def test_no_recipe_name_or_rollout_mode_is_compared_outside_fp8_recipe_and_serving():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel not in HOME and rel not in LABELS:
            found.update({f"{rel} {hit}": None for hit in string_comparisons(path.read_text())})
    assert not found, ("compare the FP8 serving plan (fp8/serving.py, RunConfig.fp8_plan) or the recipe's "
                       f"promises (fp8/recipe.py), not names: {list(found)}")


# --- the SGLang side reads the same layouts -----------------------------------------------------

def _checkpoint(tmp_path, name: str, quant: dict | None) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"quantization_config": quant} if quant else {}))
    (folder / "model.safetensors").write_bytes(b"")  # check_fp8_checkpoint reads config.json only
    return folder


BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [1, 128]}
TENSOR_STATIC = {"quant_method": "fp8", "activation_scheme": "static"}


@pytest.mark.parametrize("mode, scheme, quant, refusal", [
    ("none", "dynamic", None, None),
    ("none", "dynamic", BLOCK, "has a quantization_config (fp8) but the rollout fp8 mode is none"),
    ("blockwise", "dynamic", BLOCK, None),
    ("blockwise", "dynamic", TENSOR_STATIC, "rollout fp8=blockwise (activation_scheme=dynamic) expects a "
                                            "block/dynamic FP8 checkpoint; {path} is tensor/static"),
    ("per_tensor", "static", TENSOR_STATIC, None),
    ("per_tensor", "dynamic", TENSOR_STATIC, "expects a tensor/dynamic FP8 checkpoint; {path} is tensor/static"),
    ("aligned", "dynamic", TENSOR_STATIC, None),
    ("aligned", "dynamic", BLOCK, None),
    ("aligned", "dynamic", None, "rollout fp8=aligned needs an FP8 checkpoint"),
])
def test_sglang_checks_the_served_checkpoint_against_the_modes_layouts(tmp_path, mode, scheme, quant, refusal):
    from megatron_fp8rl.rollout.engine import RolloutEngineError
    from megatron_fp8rl.rollout.sglang_common import SGLangConfig, check_fp8_checkpoint, engine_kwargs

    folder = _checkpoint(tmp_path, "ckpt", quant)
    config = SGLangConfig(model_path=str(folder), device="cpu", fp8=mode, activation_scheme=scheme)
    assert config.fp8_mode is RolloutFp8(mode)
    assert engine_kwargs(config).get("quantization") == (None if mode == "none" else "fp8rl")
    if refusal is None:
        check_fp8_checkpoint(config)
        return
    with pytest.raises(RolloutEngineError) as error:
        check_fp8_checkpoint(config)
    assert refusal.format(path=folder) in str(error.value)
