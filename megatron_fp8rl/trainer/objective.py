"""The training objective of one RL step: the policy loss with train/rollout mismatch correction,
as the per-micro-batch callable the Megatron schedule runs, and its normalization.

Owns: `make_loss_fn` and `loss_denominator`. Must not import: cli, trainer.loop, trainer.rl_step.
"""
from __future__ import annotations

from megatron_fp8rl.rl.correction import masked_importance_weights, truncated_importance_weights
from megatron_fp8rl.rl.losses import policy_loss
from megatron_fp8rl.rl.metrics import mismatch_metrics
from megatron_fp8rl.trainer.batch import RolloutBatch
from megatron_fp8rl.trainer.config import RunConfig


def loss_denominator(cfg: RunConfig, mini: RolloutBatch, dp_size: int) -> float:
    """Makes each micro-batch's loss a share of the mini-batch aggregate: Megatron divides by the
    number of micro-batches and DDP averages over DP ranks, so scale both back in."""
    micro_per_rank = mini.size // dp_size // cfg.train.micro_batch_size
    if cfg.algorithm.agg_mode == "token-mean":
        count = float(mini.response_mask.sum())
    else:
        count = float((mini.response_mask.sum(dim=1) > 0).sum())
    return max(count, 1.0) / (micro_per_rank * dp_size)


def make_loss_fn(cfg: RunConfig, denominator: float):
    """The callable `(micro_batch, logprobs [B, S], entropy [B, S]) -> (loss, metrics)` that the
    Megatron schedule runs per micro-batch: mismatch metrics, TIS/MIS weights, the policy loss."""
    algo = cfg.algorithm

    def loss_fn(mb, logprobs, entropy):
        mask, old, rollout = mb["response_mask"], mb["old_logprobs"], mb["rollout_logprobs"]
        metrics = mismatch_metrics(old, rollout, mask)
        weights = None
        if algo.correction == "tis":
            correction = truncated_importance_weights(old, rollout, mask, cap=algo.tis_cap)
        elif algo.correction == "mis":
            correction = masked_importance_weights(old, rollout, mask, low=algo.mis_low, high=algo.mis_high)
        if algo.correction != "none":
            weights = correction.weights
            metrics.update(correction.metrics)
        out = policy_loss(logprobs, old, mb["advantages"], mask,
                          ratio_level="sequence" if algo.name == "gspo" else "token",
                          clip_low=algo.clip_low, clip_high=algo.clip_high, agg_mode=algo.agg_mode,
                          max_response_length=cfg.rollout.max_new_tokens, denominator=denominator,
                          correction_weights=weights, entropy=entropy, entropy_coef=algo.entropy_coef)
        return out.loss, {**out.metrics, **metrics}

    return loss_fn
