"""KL estimators against verl 0.9.1's own `kl_penalty` (fixture written once by
tests/rl/fixtures/write_verl_kl.py), hand-worked values, and their metrics and reward penalty."""
import json
import math
from pathlib import Path

import pytest
import torch

from megatron_fp8rl.rl.common import RLInputError
from megatron_fp8rl.rl.kl import ESTIMATORS, VERL_NAMES, kl_estimate, kl_metrics, sequence_kl_penalty
from megatron_fp8rl.rl.losses import AGGREGATION_MODES, policy_loss

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "verl_kl_penalty.json").read_text())


@pytest.mark.parametrize("verl_name", sorted(FIXTURE["cases"]))
def test_values_and_gradients_match_verl_on_every_row(verl_name):
    logprobs = torch.tensor(FIXTURE["logprobs"], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor(FIXTURE["ref_logprobs"], dtype=torch.float64)
    case = FIXTURE["cases"][verl_name]
    values = kl_estimate(logprobs, ref, VERL_NAMES[verl_name])
    values.sum().backward()
    for row in range(logprobs.shape[0]):
        torch.testing.assert_close(values[row].detach(), torch.tensor(case["values"][row], dtype=torch.float64),
                                   atol=1e-6, rtol=0, msg=f"{verl_name} values, row {row}")
        torch.testing.assert_close(logprobs.grad[row], torch.tensor(case["grad_logprobs"][row], dtype=torch.float64),
                                   atol=1e-6, rtol=0, msg=f"{verl_name} gradients, row {row}")


def test_the_fixture_reaches_k3s_clamps():
    """Rows 5-6 pass |δ| > 20 and values above 10, so the clamps are checked, not assumed."""
    k3 = torch.tensor(FIXTURE["cases"]["low_var_kl"]["values"])
    grad = torch.tensor(FIXTURE["cases"]["low_var_kl"]["grad_logprobs"])
    assert (k3 == 10).any() and (grad == 0).any() and (grad != 0).any()


def test_hand_worked_values_and_gradients():
    """δ = log 2 and δ = −1: k1 δ, k2 δ²/2, k3 e^−δ + δ − 1, abs |δ|; gradients 1, δ, 1 − e^−δ, sign δ."""
    delta = torch.tensor([[math.log(2), -1.0]], dtype=torch.float64)
    expected = {
        "k1": ([math.log(2), -1.0], [1.0, 1.0]),
        "k2": ([math.log(2) ** 2 / 2, 0.5], [math.log(2), -1.0]),
        "k3": ([0.5 + math.log(2) - 1, math.e - 2], [0.5, 1 - math.e]),
        "abs": ([math.log(2), 1.0], [1.0, -1.0]),
    }
    for estimator, (values, grads) in expected.items():
        logprobs = (torch.zeros_like(delta) + delta).requires_grad_(True)
        out = kl_estimate(logprobs, torch.zeros_like(delta), estimator)
        out.sum().backward()
        torch.testing.assert_close(out.detach(), torch.tensor([values], dtype=torch.float64))
        torch.testing.assert_close(logprobs.grad, torch.tensor([grads], dtype=torch.float64))


def test_no_gradient_reaches_the_reference():
    ref = torch.zeros(1, 3, requires_grad=True)
    kl_estimate(torch.ones(1, 3, requires_grad=True), ref, "k3").sum().backward()
    assert ref.grad is None


def test_every_estimator_is_zero_where_the_policies_agree():
    logprobs = -torch.rand(3, 5)
    for estimator in ESTIMATORS:
        assert torch.equal(kl_estimate(logprobs, logprobs.clone(), estimator), torch.zeros(3, 5))


def test_metrics_and_reward_penalty_count_response_tokens_only():
    penalty = torch.tensor([[1.0, 5.0, 9.0], [3.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    metrics = kl_metrics(penalty, mask)
    assert metrics["kl/mean"].item() == pytest.approx(3.0) and metrics["kl/max"].item() == 5.0
    assert torch.equal(sequence_kl_penalty(penalty, mask), torch.tensor([6.0, 3.0]))
    assert kl_metrics(penalty, torch.zeros(2, 3))["kl/max"].item() == 0.0


def test_bad_input_is_refused_by_name():
    with pytest.raises(RLInputError, match="unknown KL estimator 'low_var_kl'"):
        kl_estimate(torch.zeros(1, 2), torch.zeros(1, 2), "low_var_kl")
    with pytest.raises(RLInputError, match="ref_logprobs"):
        kl_estimate(torch.zeros(1, 2), torch.zeros(1, 3), "k1")


def test_k3_gradient_stays_finite_far_below_the_reference():
    """δ = −100 in float32: e^100 overflows; the log-ratio clamp keeps the gradient 0, not NaN (where
    |δ| > 20 the value clamp binds anyway, so the clamp's exact limit does not show in values)."""
    logprobs = torch.tensor([[-100.0, 100.0]], requires_grad=True)
    values = kl_estimate(logprobs, torch.zeros(1, 2), "k3")
    values.sum().backward()
    assert values.tolist() == [[10.0, 10.0]] and logprobs.grad.tolist() == [[0.0, 0.0]]


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_policy_loss_adds_the_kl_term_aggregated_as_the_policy_term(mode):
    """loss(β) − loss(0) = β·agg(k3) with the policy loss's mode; the gradients differ by β·∂agg(k3)."""
    generator = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(3, 5, generator=generator, dtype=torch.float64)
    ref = logprobs + 0.3 * torch.randn(3, 5, generator=generator, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    advantages = torch.randn(3, 1, generator=generator, dtype=torch.float64).expand(3, 5)

    def loss_and_grad(coef):
        leaf = logprobs.clone().requires_grad_(True)
        out = policy_loss(leaf, logprobs, advantages, mask, agg_mode=mode, ref_logprobs=ref, kl_coef=coef)
        out.loss.backward()
        return out, leaf.grad

    with_kl, grad_kl = loss_and_grad(0.25)
    without, grad = loss_and_grad(0.0)
    # hand-aggregated k3 = e^(ref−logp) − (ref−logp) − 1 over the masked tokens
    k3 = (ref - logprobs).exp() - (ref - logprobs) - 1
    m = mask.double()
    expected = {"token-mean": (k3 * m).sum() / m.sum(),
                "seq-mean-token-sum": (k3 * m).sum(1).mean(),
                "seq-mean-token-mean": ((k3 * m).sum(1) / m.sum(1)).mean(),
                "seq-mean-token-sum-norm": ((k3 * m).sum(1) / 5).mean()}[mode]
    torch.testing.assert_close(with_kl.loss - without.loss, 0.25 * expected)
    torch.testing.assert_close(with_kl.metrics["kl_loss"], expected)
    assert "kl_loss" not in without.metrics and "kl/mean" in with_kl.metrics
    assert not torch.equal(grad_kl, grad)


def test_policy_loss_refuses_a_kl_coefficient_without_reference_logprobs():
    x = torch.zeros(1, 2)
    with pytest.raises(RLInputError, match="ref_logprobs is None"):
        policy_loss(x, x, x, torch.ones(1, 2), kl_coef=0.1)
