"""The noise-aware options of the objective (algorithm.old_policy, algorithm.noise.*).

Without a process group: at zero train/rollout noise every option's loss and gradient are bit-equal
to plain DAPO/GSPO (`policy_loss` without the options); with a known noise the bypass interval is
the widened one. End to end (`megatron-fp8rl train`, tiny random Llama, real SGLang, FP8 trainer,
1 torchrun process + SGLang's 2 per run, two runs): bypass skips the recompute, measures the noise
floor from the first forward and logs noise/ metrics; decoupled logs the same floor from the
recompute, and both see the same noise.
"""
import dataclasses
import math

import pytest
import torch

from megatron_fp8rl.config.loader import load_config
from megatron_fp8rl.rl.calibrated_clipping import ClipBounds
from megatron_fp8rl.rl.losses import policy_loss
from megatron_fp8rl.rl.noise import estimate_noise
from megatron_fp8rl.trainer.config import RunConfig
from megatron_fp8rl.trainer.batch import RolloutBatch
from megatron_fp8rl.trainer.objective import MiniBatchTerms, Objective, noise_levels
from tests.helpers.train import run_train, tb_scalars

B, S = 6, 9
DENOMINATOR = 17.0


def _micro_batch(noise: float):
    generator = torch.Generator().manual_seed(3)
    mask = (torch.rand(B, S, generator=generator) < 0.8).float()
    rollout = -torch.rand(B, S, generator=generator) * 3 * mask
    advantages = torch.randn(B, 1, generator=generator).expand(B, S) * mask
    moved = rollout + 0.4 * torch.randn(B, S, generator=generator) * mask  # the policy after updates
    entropy = torch.rand(B, S, generator=generator)
    old = rollout + noise * mask
    ids = torch.zeros(B, S, dtype=torch.long)  # the objective reads no token ids
    return RolloutBatch(tokens=ids, position_ids=ids, target_ids=ids, response_mask=mask, rollout_logprobs=rollout,
                        advantages=advantages, old_logprobs=old), moved, entropy


def _loss_and_grad(cfg, mb, logprobs, entropy, noise=None, clip_bounds=None):
    """The run's objective (built from cfg.algorithm) on one micro-batch: loss, d loss/d logprobs,
    metrics."""
    leaf = logprobs.clone().requires_grad_()
    objective = Objective(cfg.algorithm, cfg.rollout.max_new_tokens)
    loss, metrics = objective.loss(MiniBatchTerms(DENOMINATOR, noise, clip_bounds=clip_bounds), mb, leaf, entropy)
    loss.backward()
    return loss.detach(), leaf.grad, metrics


def _without_old(mb):
    return dataclasses.replace(mb, old_logprobs=None)


def _plain(cfg, mb, logprobs, entropy, old):
    leaf = logprobs.clone().requires_grad_()
    out = policy_loss(leaf, old, mb.advantages, mb.response_mask,
                      ratio_level="sequence" if cfg.algorithm.name == "gspo" else "token",
                      clip_low=cfg.algorithm.clip.low, clip_high=cfg.algorithm.clip.high,
                      agg_mode=cfg.algorithm.agg_mode, max_response_length=cfg.rollout.max_new_tokens,
                      denominator=DENOMINATOR, entropy=entropy)
    out.loss.backward()
    return out.loss.detach(), leaf.grad


OPTIONS = [
    ["algorithm.correction=none"],
    ["algorithm.correction=tis"],
    ["algorithm.correction=mis"],
    ["algorithm.correction=tis", "algorithm.noise.correction=true"],
    ["algorithm.correction=mis", "algorithm.noise.correction=true", "algorithm.noise.quantile=0.99"],
    ["algorithm.old_policy=bypass", "algorithm.correction=none"],
    ["algorithm.old_policy=bypass", "algorithm.correction=none", "algorithm.noise.quantile=0.5"],
]


@pytest.mark.parametrize("name", ["dapo", "gspo"])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(x.split(".")[1] for x in o))
@pytest.mark.parametrize("first_forward", [False, True], ids=["updated", "first_forward"])
def test_zero_noise_reduces_every_option_to_plain_policy_loss(name, options, first_forward):
    cfg = load_config(RunConfig, None, ["model.hf_path=/x", f"algorithm.name={name}", *options])
    mb, moved, entropy = _micro_batch(noise=0.0)
    # first_forward: the parameters are still θ_old, so log π_θ equals the (noise-free) rollout's
    logprobs = mb.rollout_logprobs.clone() if first_forward else moved
    bypass = cfg.algorithm.old_policy == "bypass"
    noise = None
    if not (bypass and first_forward):  # bypass's first mini-batch measures the floor itself
        noise = estimate_noise(mb.old_logprobs, mb.rollout_logprobs, mb.response_mask,
                               noise_levels(cfg.algorithm), "sequence" if name == "gspo" else "token")
    if bypass:
        mb = _without_old(mb)
    loss, grad, metrics = _loss_and_grad(cfg, mb, logprobs, entropy, noise)
    plain_loss, plain_grad = _plain(cfg, mb, logprobs, entropy, mb.rollout_logprobs)
    assert torch.equal(loss, plain_loss)
    assert torch.equal(grad, plain_grad)
    assert float(metrics["noise/clip_high"]) == cfg.algorithm.clip.high
    assert float(metrics["noise/source_first_forward"]) == float(bypass)


def test_bypass_widens_the_interval_by_the_measured_noise():
    """Δ = +0.1 on every token, measured by the first forward: ε_high' = 1.28·e^0.1 − 1, ε_low kept;
    the loss is policy_loss against the rollout logprobs with exactly those epsilons."""
    cfg = load_config(RunConfig, None, ["model.hf_path=/x", "algorithm.old_policy=bypass",
                                        "algorithm.correction=none"])
    mb, _, entropy = _micro_batch(noise=0.1)
    logprobs, mb = mb.old_logprobs, _without_old(mb)  # the first forward sees log π_old = rollout + Δ
    loss, grad, metrics = _loss_and_grad(cfg, mb, logprobs, entropy)
    clip_high = float(metrics["noise/clip_high"])
    assert clip_high == pytest.approx(1.28 * math.exp(0.1) - 1, rel=1e-6)
    assert float(metrics["noise/clip_low"]) == 0.2
    assert float(metrics["noise/delta_q0.5"]) == pytest.approx(0.1, abs=1e-6)
    leaf = logprobs.clone().requires_grad_()
    widened = policy_loss(leaf, mb.rollout_logprobs, mb.advantages, mb.response_mask,
                          clip_low=0.2, clip_high=clip_high, denominator=DENOMINATOR, entropy=entropy,
                          max_response_length=cfg.rollout.max_new_tokens)
    widened.loss.backward()
    torch.testing.assert_close(loss, widened.loss.detach())
    torch.testing.assert_close(grad, leaf.grad)
    # r_R = e^0.1 ≈ 1.105 is inside [0.8, 1.28]: nothing is clipped for noise
    assert float(metrics["noise/clip_noise_only_frac"]) == 0.0


STEP_TAGS = ("noise/delta_q0.5", "noise/delta_q0.9", "noise/abs_delta_q0.9", "noise/abs_delta_q0.99",
             "noise/clip_low", "noise/clip_high", "noise/clip_noise_only_frac",
             "noise/clip_policy_only_frac", "noise/clip_both_frac", "noise/source_first_forward",
             "noise/count", "train/pg_loss")


@pytest.mark.slow  # ~120 s (two runs); the options' arithmetic is tested above without processes
@pytest.mark.multiprocess
def test_bypass_and_decoupled_end_to_end(tiny_run_inputs, tmp_path):
    """FP8 trainer against fp32 rollouts (real noise), one step of two mini-batches each mode."""
    common = ("model.fp8=calibrated", "train.steps=1", "train.eval_every=0", "train.mini_batches=2",
              "algorithm.dynamic_sampling=false")
    run_train(tiny_run_inputs, tmp_path / "bypass", 1, *common, "algorithm.old_policy=bypass",
           "algorithm.correction=none")
    run_train(tiny_run_inputs, tmp_path / "decoupled", 1, *common, "algorithm.noise.correction=true")
    bypass, decoupled = tb_scalars(tmp_path / "bypass"), tb_scalars(tmp_path / "decoupled")
    for scalars in (bypass, decoupled):
        for tag in STEP_TAGS:
            assert tag in scalars and len(scalars[tag]) == 1, f"{tag}: {sorted(scalars)}"
    assert bypass["noise/source_first_forward"] == [1.0] and decoupled["noise/source_first_forward"] == [0.0]
    assert "noise/tis_cap" in decoupled and "noise/tis_cap" not in bypass
    # same seed and weights: step 1 samples the same tokens, so both modes measure the same FP8
    # noise — bypass from the training forward at θ_old, decoupled from the recompute
    typical = decoupled["noise/abs_delta_q0.9"][0]
    assert typical > 1e-4, "FP8 trainer vs fp32 rollout should show real noise"
    assert bypass["noise/abs_delta_q0.9"][0] == pytest.approx(typical, rel=0.5)
    # bypass widens only by what it measured, within the configured limits; decoupled does not widen
    assert 0.28 < bypass["noise/clip_high"][0] <= 1.0 and 0.2 <= bypass["noise/clip_low"][0] <= 0.5
    assert decoupled["noise/clip_high"] == [pytest.approx(0.28)]
    assert bypass["time/recompute_s"][0] < 0.1 * decoupled["time/recompute_s"][0]


@pytest.mark.parametrize("options", [["algorithm.correction=none"],
                                     ["algorithm.old_policy=bypass", "algorithm.correction=none"]],
                         ids=["decoupled", "bypass"])
def test_calibrated_bounds_replace_the_clip_interval(options):
    """Calibrated Clipping's bounds [L, H] are the loss's interval (bypass's noise widening does
    not apply on top), bit-equal to policy_loss with ε_low = 1 − L, ε_high = H − 1; and with
    calibration.mode=shadow configured but before any calibration (bounds None), the loss is
    bit-equal to calibration.mode=none."""
    cfg = load_config(RunConfig, None, ["model.hf_path=/x", "model.fp8=calibrated",
                                        "algorithm.calibration.mode=shadow", *options])
    mb, moved, entropy = _micro_batch(noise=0.1)
    bypass = cfg.algorithm.old_policy == "bypass"
    old = mb.rollout_logprobs if bypass else mb.old_logprobs
    noise = estimate_noise(mb.old_logprobs, mb.rollout_logprobs, mb.response_mask,
                           noise_levels(cfg.algorithm), "token")
    if bypass:
        mb = _without_old(mb)
    bounds = ClipBounds(0.7, 1.45)
    loss, grad, metrics = _loss_and_grad(cfg, mb, moved, entropy, noise, clip_bounds=bounds)
    eps_low, eps_high = bounds.epsilons()
    leaf = moved.clone().requires_grad_()
    expected = policy_loss(leaf, old, mb.advantages, mb.response_mask, clip_low=eps_low,
                           clip_high=eps_high, denominator=DENOMINATOR, entropy=entropy,
                           max_response_length=cfg.rollout.max_new_tokens)
    expected.loss.backward()
    assert torch.equal(loss, expected.loss.detach()) and torch.equal(grad, leaf.grad)
    assert float(metrics["noise/clip_low"]) == eps_low and float(metrics["noise/clip_high"]) == eps_high
    plain = load_config(RunConfig, None, ["model.hf_path=/x", "model.fp8=calibrated", *options])
    for config, clip_bounds in ((cfg, None), (plain, None)):
        got = _loss_and_grad(config, mb, moved, entropy, noise, clip_bounds=clip_bounds)
        assert torch.equal(got[0], _loss_and_grad(plain, mb, moved, entropy, noise)[0])


def test_clip_calibration_config_is_checked():
    for mode in ("shadow", "monitor"):
        with pytest.raises(ValueError, match=f"algorithm.calibration.mode: {mode} compares the trainer's ratios "
                                             "with a higher-precision shadow's: it needs an FP8 trainer"):
            load_config(RunConfig, None, ["model.hf_path=/x", f"algorithm.calibration.mode={mode}"])
        bf16 = load_config(RunConfig, None, ["model.hf_path=/x", f"algorithm.calibration.mode={mode}",
                                             "model.dtype=bfloat16", "rollout.dtype=bfloat16"])
        assert bf16.algorithm.calibration.mode == mode  # a bf16 trainer is shadowed in float32
    with pytest.raises(ValueError, match="algorithm.calibration.level: token calibration cannot match"):
        load_config(RunConfig, None, ["model.hf_path=/x", "algorithm.name=gspo",
                                      "algorithm.calibration.level=token"])
    with pytest.raises(ValueError, match="algorithm.calibration.limits.low_min: need 0 <"):
        load_config(RunConfig, None, ["model.hf_path=/x", "algorithm.calibration.limits.low_min=0.9"])
    with pytest.raises(ValueError, match="algorithm.calibration.limits.high_min: need 1 <="):
        load_config(RunConfig, None, ["model.hf_path=/x", "algorithm.calibration.limits.high_max=1.1"])
    with pytest.raises(ValueError, match="algorithm.calibration.every: must be >= 1"):
        load_config(RunConfig, None, ["model.hf_path=/x", "algorithm.calibration.every=0"])


def test_dual_clip_reaches_the_loss_from_the_config():
    """algorithm.clip.dual=3 is policy_loss's dual_clip=3: negative-advantage tokens whose ratio is
    far above 1 have their loss capped at −3·A (the plain run's loss differs on this batch)."""
    cfg = load_config(RunConfig, None, ["model.hf_path=/x", "algorithm.clip.dual=3", "algorithm.correction=none"])
    mb, moved, entropy = _micro_batch(noise=0.0)
    logprobs = moved + 2.0 * mb.response_mask  # ratios of e^2 ≈ 7.4 > 3
    loss, grad, _ = _loss_and_grad(cfg, mb, logprobs, entropy, estimate_noise(
        mb.old_logprobs, mb.rollout_logprobs, mb.response_mask, noise_levels(cfg.algorithm), "token"))
    leaf = logprobs.clone().requires_grad_()
    capped = policy_loss(leaf, mb.old_logprobs, mb.advantages, mb.response_mask, clip_low=0.2, clip_high=0.28,
                         max_response_length=cfg.rollout.max_new_tokens, denominator=DENOMINATOR, entropy=entropy,
                         dual_clip=3.0)
    capped.loss.backward()
    assert torch.equal(loss, capped.loss.detach())
    assert torch.equal(grad, leaf.grad)
    plain, _ = _plain(cfg, mb, logprobs, entropy, mb.old_logprobs)
    assert not torch.equal(loss, plain)
