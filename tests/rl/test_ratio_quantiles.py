"""Quantiles of the train/rollout importance ratio in rl.metrics.mismatch_metrics, against
torch.quantile on the kept tokens (the independent oracle) and a hand case."""
import math

import pytest
import torch

from megatron_fp8rl.rl.metrics import RATIO_QUANTILES, mismatch_metrics


def test_ratio_quantiles_hand_case():
    # kept ratios 0.25, 1, 2 (the masked-out token has ratio e^5 and must not count)
    delta = torch.tensor([[math.log(2.0), -math.log(4.0), 0.0, 5.0]])
    rollout = torch.full((1, 4), -1.0)
    metrics = mismatch_metrics(rollout + delta, rollout, torch.tensor([[1, 1, 1, 0]]))
    assert metrics["mismatch_ratio_min"].item() == pytest.approx(0.25)
    assert metrics["mismatch_ratio_p50"].item() == pytest.approx(1.0)
    assert metrics["mismatch_ratio_max"].item() == pytest.approx(2.0)
    # position 0.9 * 2 = 1.8 between 1 and 2
    assert metrics["mismatch_ratio_p90"].item() == pytest.approx(1.8)


@pytest.mark.parametrize("seed", range(5))
def test_ratio_quantiles_match_torch_quantile(seed):
    generator = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(6, 37, generator=generator) * 5
    train = rollout + torch.randn(6, 37, generator=generator) * 0.3
    mask = torch.rand(6, 37, generator=generator) > 0.4
    metrics = mismatch_metrics(train, rollout, mask)
    kept = (train - rollout).exp()[mask]
    expected = torch.quantile(kept, torch.tensor([q for _, q in RATIO_QUANTILES]))
    for (name, _), value in zip(RATIO_QUANTILES, expected):
        assert metrics[f"mismatch_ratio_{name}"].item() == pytest.approx(value.item(), rel=1e-5), name


def test_ratio_quantiles_are_nan_without_tokens():
    metrics = mismatch_metrics(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    assert all(math.isnan(metrics[f"mismatch_ratio_{name}"].item()) for name, _ in RATIO_QUANTILES)
