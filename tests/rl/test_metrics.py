"""RL step metrics against hand-worked numbers; padding never counts."""
import math

import pytest

import torch

from megatron_fp8rl.rl.metrics import clip_metrics, entropy_metrics, eval_verdict, garbled_flags, mismatch_metrics


def test_clip_metrics_hand_case():
    ratio = torch.tensor([[1.5, 1.25, 1.0, 9.0], [0.5, 4.0, 1.1, 100.0]])
    advantages = torch.tensor([[1.0, 1.0, -1.0, 1.0], [-1.0, -1.0, 0.0, -1.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.bool)  # 9.0 and 100.0 are padding
    metrics = clip_metrics(ratio, advantages, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    # Upper clip: 1.5 (A>0; 1.25 is inside 1 + 0.28). Lower clip: 0.5 (A<0). Dual clip: 4.0 (A<0, > 3).
    assert metrics["clip_frac_high"].item() == pytest.approx(1 / 6)
    assert metrics["clip_frac_low"].item() == pytest.approx(1 / 6)
    assert metrics["dual_clip_frac"].item() == pytest.approx(1 / 6)
    assert metrics["ratio_min"].item() == 0.5
    assert metrics["ratio_max"].item() == 4.0
    assert math.isclose(metrics["ratio_mean"].item(), (1.5 + 1.25 + 1.0 + 0.5 + 4.0 + 1.1) / 6, rel_tol=1e-6)


def test_clip_metrics_without_dual_clip_reports_zero():
    ratio = torch.tensor([[10.0]])
    metrics = clip_metrics(ratio, -torch.ones(1, 1), torch.ones(1, 1), clip_low=0.2, clip_high=0.2)
    assert metrics["dual_clip_frac"].item() == 0.0


def test_mismatch_metrics_hand_case():
    delta = torch.tensor([[math.log(2.0), -math.log(4.0), 0.0, 5.0]])
    rollout = torch.full((1, 4), -1.0)
    mask = torch.tensor([[1, 1, 1, 0]])
    metrics = mismatch_metrics(rollout + delta, rollout, mask)
    ln2 = math.log(2.0)
    assert math.isclose(metrics["mismatch_abs_logprob_diff_mean"].item(), ln2, rel_tol=1e-6)
    assert math.isclose(metrics["mismatch_abs_logprob_diff_max"].item(), 2 * ln2, rel_tol=1e-6)
    # k3 = exp(Δ) - 1 - Δ: (1 - ln2) + (-0.75 + 2 ln2) + 0 = 0.25 + ln2 over 3 tokens.
    assert math.isclose(metrics["mismatch_k3_kl"].item(), (0.25 + ln2) / 3, rel_tol=1e-5)
    assert math.isclose(metrics["mismatch_prob_error"].item(), 2.0, rel_tol=1e-6)


def test_empty_mask_gives_zero_means_and_nan_extrema():
    metrics = mismatch_metrics(torch.zeros(1, 2), torch.ones(1, 2), torch.zeros(1, 2))
    assert metrics["mismatch_abs_logprob_diff_mean"].item() == 0.0
    assert math.isnan(metrics["mismatch_abs_logprob_diff_max"].item())


def test_entropy_metric_is_masked_mean():
    entropy = torch.tensor([[1.0, 2.0, 50.0], [3.0, 70.0, 80.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert entropy_metrics(entropy, mask)["entropy"].item() == 2.0


def test_paired_eval_change_counts_and_exact_mcnemar():
    import math

    from megatron_fp8rl.rl.metrics import paired_eval_change

    before = [False] * 10 + [True] * 5 + [False, True]
    after = [True] * 9 + [False] + [True] * 4 + [False] + [False, True]
    out = paired_eval_change(before, after)
    assert (out["gained"], out["lost"]) == (9, 1)
    # two-sided binomial(10, 1/2) tail at 1: 2 * (1 + 10) / 1024
    assert math.isclose(out["mcnemar_p"], 22 / 1024)
    assert paired_eval_change([True, False], [True, False]) == {"gained": 0.0, "lost": 0.0, "mcnemar_p": 1.0}
    assert paired_eval_change([False] * 3, [True, True, False])["mcnemar_p"] == 0.5  # 2 * 1/4
    with pytest.raises(ValueError, match="2 results before, 3 after"):
        paired_eval_change([True, False], [True, False, True])


def test_eval_verdict_follows_the_paired_test_not_the_accuracy_gap():
    summary = {"eval/accuracy_start": 0.18, "eval/accuracy": 0.46, "eval/gained": 63.0, "eval/lost": 7.0,
               "eval/mcnemar_p": 2.3e-12}
    assert eval_verdict(summary) == ("verdict: the model learned: held-out greedy accuracy 0.180 -> 0.460 "
                                     "(63 problems gained, 7 lost, McNemar p = 2.3e-12)")
    worse = dict(summary, **{"eval/accuracy": 0.065, "eval/gained": 3.0, "eval/lost": 24.0, "eval/mcnemar_p": 4.9e-5})
    assert eval_verdict(worse).startswith("verdict: the model got worse: ")
    # 9 gained against 2 lost (p = 0.065) is not significant at 0.01
    noise = dict(summary, **{"eval/accuracy": 0.2, "eval/gained": 9.0, "eval/lost": 2.0, "eval/mcnemar_p": 0.065})
    assert eval_verdict(noise).startswith("verdict: no significant change at p < 0.01: ")
    assert eval_verdict(noise, alpha=0.1).startswith("verdict: the model learned")
    assert "no verdict" in eval_verdict({"eval/accuracy": 0.2})


@pytest.mark.parametrize("text,ids,expected", [
    ("The answer is 42.", [5, 6, 7, 8, 9], (False, False)),
    ("the the the", [1, 1, 1], (True, False)),  # one 3-gram, seen once
    ("1 1 1 1 1", [3, 3, 3, 3, 3], (False, True)),  # (3, 3, 3) three times
    ("ab ab ab", [4, 5, 4, 5, 4, 5], (True, False)),  # (4, 5, 4) and (5, 4, 5): twice each
    ("ab ab ab a", [4, 5, 4, 5, 4, 5, 4], (True, True)),  # (4, 5, 4) three times
    ("", [], (True, False)),
])
def test_garbled_flags(text, ids, expected):
    assert garbled_flags(text, ids) == expected
