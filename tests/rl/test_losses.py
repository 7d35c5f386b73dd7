"""Policy losses, aggregation, KL and entropy terms: hand-worked values and gradient properties."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_fp8rl.rl.common import RLInputError
from megatron_fp8rl.rl.losses import (
    AGGREGATION_MODES,
    aggregate_loss,
    clipped_surrogate,
    policy_loss,
)

LN = math.log
LOSSES = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 3 + 5) / 4),
        ("seq-mean-token-sum", (6 + 5) / 2),
        ("seq-mean-token-mean", (6 / 3 + 5 / 1) / 2),
        ("seq-mean-token-sum-norm", (6 / 4 + 5 / 4) / 2),
    ],
)
def test_aggregation_modes_hand_case(mode, expected):
    assert aggregate_loss(LOSSES, MASK, mode).item() == pytest.approx(expected)


def test_aggregation_overrides():
    normalized = aggregate_loss(LOSSES, MASK, "seq-mean-token-sum-norm", max_response_length=10)
    assert normalized.item() == pytest.approx((6 / 10 + 5 / 10) / 2)
    assert aggregate_loss(LOSSES, MASK, "token-mean", denominator=22).item() == pytest.approx(0.5)
    assert aggregate_loss(LOSSES, MASK, "seq-mean-token-sum", denominator=11).item() == pytest.approx(1.0)


def test_aggregation_of_empty_mask_is_zero():
    for mode in AGGREGATION_MODES:
        assert aggregate_loss(LOSSES, torch.zeros_like(MASK), mode).item() == 0.0


def test_unknown_aggregation_mode_is_rejected():
    with pytest.raises(RLInputError, match="unknown loss aggregation mode 'token-sum'"):
        aggregate_loss(LOSSES, MASK, "token-sum")


def test_clipped_surrogate_hand_case():
    ratio = torch.tensor([1.5, 0.5, 0.5, 1.5, 5.0, 1.1])
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0, 2.0])
    plain = clipped_surrogate(ratio, advantages, clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(plain, torch.tensor([-1.28, -0.5, 0.8, 1.5, 5.0, -2.2]))
    dual = clipped_surrogate(ratio, advantages, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    torch.testing.assert_close(dual, torch.tensor([-1.28, -0.5, 0.8, 1.5, 3.0, -2.2]))


def test_clip_parameters_are_validated():
    with pytest.raises(RLInputError, match="dual_clip must be > 1"):
        clipped_surrogate(torch.ones(1), torch.ones(1), dual_clip=1.0)
    with pytest.raises(RLInputError, match="clip_low"):
        clipped_surrogate(torch.ones(1), torch.ones(1), clip_low=1.0)


def test_policy_loss_hand_case_with_metrics_and_gradient():
    ratios = torch.tensor([[1.5, 0.5, 1.0], [0.5, 5.0, 1.0]])
    logprobs = ratios.log().requires_grad_()
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    out = policy_loss(logprobs, torch.zeros(2, 3), advantages, mask, clip_high=0.28, dual_clip=3.0)
    # Token losses -1.28, -0.5, -1.0, 0.8, 3.0 over 5 tokens.
    assert out.loss.item() == pytest.approx(1.02 / 5)
    assert out.metrics["clip_frac_high"].item() == pytest.approx(0.2)
    assert out.metrics["ratio_max"].item() == pytest.approx(5.0)
    out.loss.backward()
    # d/dlogp of -A·r is -A·r / 5 where unclipped; clipped and dual-clipped tokens get 0.
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -0.1, -0.2], [0.0, 0.0, 0.0]]))


def test_gspo_hand_case():
    # Row 0: Δ = 0.1, 0.3 -> s = e^0.2 > 1 + 4e-4, A = +1: clipped at 1.0004.
    # Row 1: Δ = -0.2, 0.0 (third is padding) -> s = e^-0.1, A = -1: clipped at 0.9997.
    delta = torch.tensor([[0.1, 0.3, 0.0], [-0.2, 0.0, 9.0]], dtype=torch.float64)
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    out = policy_loss(delta, torch.zeros_like(delta), advantages, mask, ratio_level="sequence",
                      clip_low=3e-4, clip_high=4e-4, agg_mode="seq-mean-token-mean")
    assert out.loss.item() == pytest.approx((-1.0004 + 0.9997) / 2)
    assert out.metrics["ratio_max"].item() == pytest.approx(math.exp(0.2))


def test_gspo_gradient_inside_the_clip_range():
    # s_0 = e^0.05 with A = -1 stays unclipped for eps 0.1: dL/dlogp_t = -A·s_0 / |y_0| / B.
    logprobs = torch.tensor([[0.0, 0.1], [0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([[-1.0, -1.0], [0.0, 0.0]], dtype=torch.float64)
    out = policy_loss(logprobs, torch.zeros(2, 2, dtype=torch.float64), advantages, torch.ones(2, 2),
                      ratio_level="sequence", clip_low=0.1, clip_high=0.1, agg_mode="seq-mean-token-mean")
    out.loss.backward()
    expected = math.exp(0.05) / 2 / 2
    torch.testing.assert_close(logprobs.grad[0], torch.tensor([expected, expected], dtype=torch.float64))


def test_entropy_term_enters_the_total():
    logprobs = torch.full((1, 2), LN(0.5), requires_grad=True)
    entropy = torch.tensor([[2.0, 4.0]], requires_grad=True)
    out = policy_loss(logprobs, logprobs.detach(), torch.zeros(1, 2), torch.ones(1, 2),
                      entropy=entropy, entropy_coef=0.01)
    assert out.loss.item() == pytest.approx(-0.01 * 3.0)
    assert out.metrics["entropy"].item() == pytest.approx(3.0)
    out.loss.backward()
    torch.testing.assert_close(entropy.grad, torch.full((1, 2), -0.005))


def test_correction_weights_scale_token_losses():
    logprobs = torch.zeros(1, 3, requires_grad=True)
    weights = torch.tensor([[2.0, 0.0, 0.5]])
    out = policy_loss(logprobs, torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3),
                      correction_weights=weights)
    assert out.loss.item() == pytest.approx(-(2.0 + 0.0 + 0.5) / 3)
    out.loss.backward()
    torch.testing.assert_close(logprobs.grad, -weights / 3)


def test_bad_inputs_name_the_tensor():
    ok = torch.zeros(2, 3)
    with pytest.raises(RLInputError, match=r"advantages has shape \(2, 4\)"):
        policy_loss(ok, ok, torch.zeros(2, 4), ok)
    with pytest.raises(RLInputError, match=r"response_mask has shape \(3, 3\)"):
        policy_loss(ok, ok, ok, torch.ones(3, 3))
    with pytest.raises(RLInputError, match=r"old_logprobs has shape"):
        policy_loss(ok, torch.zeros(3), ok, ok)
    nan_advantages = ok.clone()
    nan_advantages[1, 2] = float("nan")
    nan_message = r"advantages has 1 non-finite value\(s\) \(first at index \(1, 2\)"
    with pytest.raises(RLInputError, match=nan_message):
        policy_loss(ok, ok, nan_advantages, ok)
    with pytest.raises(RLInputError, match="unknown ratio_level"):
        policy_loss(ok, ok, ok, ok, ratio_level="seq")


@st.composite
def batches(draw):
    rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    size = rows * cols
    finite = dict(allow_nan=False, allow_infinity=False)
    logprobs = draw(st.lists(st.floats(-8.0, 0.0, **finite), min_size=size, max_size=size))
    old = draw(st.lists(st.floats(-8.0, 0.0, **finite), min_size=size, max_size=size))
    magnitudes = draw(st.lists(st.floats(0.01, 5.0, **finite), min_size=size, max_size=size))
    signs = draw(st.lists(st.sampled_from([-1.0, 1.0]), min_size=size, max_size=size))
    mask = draw(st.lists(st.booleans(), min_size=size, max_size=size))

    def grid(values, dtype=torch.float64):
        return torch.tensor(values, dtype=dtype).reshape(rows, cols)

    return grid(logprobs), grid(old), grid(magnitudes) * grid(signs), grid(mask, torch.bool)


clip_values = st.floats(0.01, 0.5)
dual_clips = st.one_of(st.none(), st.floats(1.5, 10.0))


@settings(max_examples=60, deadline=None)
@given(batches(), clip_values, clip_values, dual_clips, st.sampled_from(AGGREGATION_MODES),
       st.sampled_from(["token", "sequence"]))
def test_ratio_one_gradient_is_plain_policy_gradient(batch, clip_low, clip_high, dual_clip, mode, level):
    logprobs, _, advantages, mask = batch
    logprobs.requires_grad_()
    out = policy_loss(logprobs, logprobs.detach(), advantages, mask, ratio_level=level,
                      clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, agg_mode=mode)
    (grad,) = torch.autograd.grad(out.loss, logprobs)
    reference_logprobs = logprobs.detach().clone().requires_grad_()
    reinforce = aggregate_loss(-advantages * reference_logprobs, mask, mode)
    (expected,) = torch.autograd.grad(reinforce, reference_logprobs)
    torch.testing.assert_close(grad, expected)


@settings(max_examples=80, deadline=None)
@given(batches(), clip_values, clip_values, dual_clips, st.sampled_from(["token", "sequence"]))
def test_clipped_tokens_get_no_gradient(batch, clip_low, clip_high, dual_clip, level):
    logprobs, old, advantages, mask = batch
    if level == "token":
        ratio = (logprobs - old).exp()
    else:  # GSPO: geometric mean of the sequence's token ratios, independently computed here.
        lengths = mask.sum(1).clamp(min=1)
        ratio = (((logprobs - old) * mask).sum(1) / lengths).exp()[:, None].expand_as(logprobs)
    logprobs.requires_grad_()
    out = policy_loss(logprobs, old, advantages, mask, ratio_level=level, clip_low=clip_low,
                      clip_high=clip_high, dual_clip=dual_clip)
    (grad,) = torch.autograd.grad(out.loss, logprobs)
    clipped = ((advantages > 0) & (ratio > 1 + clip_high)) | ((advantages < 0) & (ratio < 1 - clip_low))
    if dual_clip is not None:
        clipped |= (advantages < 0) & (ratio > dual_clip)
    assert bool((grad[clipped] == 0).all())
    free = ~clipped & mask
    # Unclipped tokens are pushed in the direction of their advantage: dL/dlogp has sign -A.
    assert bool((grad[free] * advantages[free] < 0).all())


def test_the_shadow_gate_decides_the_clip_and_the_gradient_flows_through_the_fp8_ratio():
    """decision_ratio (calibration.mode=gate): a token is clipped where the decision ratio is out
    of bounds, whatever the FP8 ratio r; an active token's gradient is d(−A·r)/dlogp = −A·r."""
    # A<0: FP8 below the bound, shadow inside (plain PPO would silence it: the over-clip the gate removes);
    # A<0: FP8 inside, shadow below; A>0: FP8 above, shadow inside; A>0: FP8 inside, shadow above;
    # A<0: shadow above the dual clip
    r = torch.tensor([[0.7, 0.9, 1.5, 1.1, 1.0]], dtype=torch.float64)
    decision = torch.tensor([[0.9, 0.7, 1.1, 1.5, 4.0]], dtype=torch.float64)
    advantages = torch.tensor([[-1.0, -2.0, 1.0, 3.0, -1.0]], dtype=torch.float64)
    old = torch.zeros_like(r)
    logprobs = r.log().requires_grad_()
    mask = torch.ones_like(r, dtype=torch.bool)
    out = policy_loss(logprobs, old, advantages, mask, clip_low=0.2, clip_high=0.2, dual_clip=3.0,
                      agg_mode="seq-mean-token-sum", decision_ratio=decision)
    (grad,) = torch.autograd.grad(out.loss, logprobs)
    torch.testing.assert_close(grad, torch.tensor([[0.7, 0.0, -1.5, 0.0, 0.0]], dtype=torch.float64))
    # the values: active −A·r, clipped −A·clip(r), dual −A·c
    torch.testing.assert_close(out.loss.detach(), torch.tensor(0.7 + 2 * 0.9 - 1.5 - 3 * 1.1 + 3.0, dtype=torch.float64))
    # the clip fractions are the decisions taken: 1 of 5 tokens low (A<0, decision 0.7), 1 high, 1 dual
    assert float(out.metrics["clip_frac_low"]) == pytest.approx(0.2) and float(out.metrics["clip_frac_high"]) == pytest.approx(0.2)
    assert float(out.metrics["dual_clip_frac"]) == pytest.approx(0.2) and float(out.metrics["ratio_min"]) == pytest.approx(0.7)
    with pytest.raises(RLInputError, match="ratio_level token"):
        policy_loss(logprobs, old, advantages, mask, ratio_level="sequence", decision_ratio=decision)


@settings(max_examples=60, deadline=None)
@given(batches(), clip_values, clip_values, dual_clips, st.sampled_from(AGGREGATION_MODES))
def test_a_gate_on_the_ratio_itself_is_plain_ppo(batch, clip_low, clip_high, dual_clip, mode):
    """decision_ratio = r gives PPO's loss and gradient (the gate changes only which ratio decides)."""
    logprobs, old, advantages, mask = batch
    plain_lp, gated_lp = logprobs.clone().requires_grad_(), logprobs.clone().requires_grad_()
    kwargs = dict(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, agg_mode=mode)
    plain = policy_loss(plain_lp, old, advantages, mask, **kwargs)
    gated = policy_loss(gated_lp, old, advantages, mask, decision_ratio=(logprobs - old).exp(), **kwargs)
    torch.testing.assert_close(gated.loss, plain.loss)
    torch.testing.assert_close(torch.autograd.grad(gated.loss, gated_lp)[0], torch.autograd.grad(plain.loss, plain_lp)[0])
