"""model.fp8_step_weight_scales reaches the actor's update: with `frozen` every training forward of
the step's mini-batches quantizes each weight with θ_old's group scales (those the recompute used),
and the live quantizers are back once the step is done; with `live` each forward takes its own.
One process (gloo), a tiny random Llama, groupwise32 (1x32 groups), 3 mini-batches."""
import pytest
import torch

from megatron_fp8rl.config.loader import load_config
from megatron_fp8rl.fp8.formats import E4M3
from megatron_fp8rl.fp8.quantize import blockwise_scales
from megatron_fp8rl.fp8.quantizer import BlockQuantizer, HeldScaleWeightQuantizer
from megatron_fp8rl.trainer.actor import MegatronActor, convert_initial_checkpoint
from megatron_fp8rl.trainer.batch import RolloutBatch
from megatron_fp8rl.trainer.config import RunConfig
from megatron_fp8rl.trainer.objective import Objective
from tests.helpers.tiny_models import VOCAB_SIZE, build_tiny_model

B, S, MINI_BATCHES = 6, 10, 3


def _batch() -> RolloutBatch:
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(3, VOCAB_SIZE, (B, S), generator=generator)
    mask = torch.zeros(B, S)
    mask[:, 4:-1] = 1.0
    return RolloutBatch(tokens=tokens, position_ids=torch.arange(S).expand(B, S).contiguous(),
                        target_ids=torch.roll(tokens, -1, 1), response_mask=mask, rollout_logprobs=-mask,
                        advantages=torch.randn(B, 1, generator=generator).expand(B, S) * mask)


def _scales_seen(actor: MegatronActor):
    """Per FP8 linear: (its weight at θ_old, its live weight quantizer, [(weight quantizer, group
    scales) at each training forward of the update])."""
    batch = _batch()
    old = actor.old_logprobs(batch)
    linears = [m for m in actor.model.modules() if hasattr(m, "fp8_quantizers")]
    seen = {id(m): [] for m in linears}

    def record(module, _inputs):
        quantizer = module.fp8_quantizers.weight
        scales = quantizer.scale.clone() if isinstance(quantizer, HeldScaleWeightQuantizer) else None
        seen[id(module)].append((quantizer, scales))

    hooks = [m.register_forward_pre_hook(record) for m in linears]
    before = [(m, m.weight.detach().clone(), m.fp8_quantizers.weight) for m in linears]
    try:
        actor.update(batch, old, step=1)
    finally:
        for hook in hooks:
            hook.remove()
    return [(module, weight, live, seen[id(module)]) for module, weight, live in before]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("hf"))


def _actor(tiny_llama, step_weight_scales: str, tmp_path) -> MegatronActor:
    cfg = load_config(RunConfig, None, [f"model.hf_path={tiny_llama}", "model.fp8=groupwise32",
                                        f"model.fp8_step_weight_scales={step_weight_scales}",
                                        f"train.mini_batches={MINI_BATCHES}", "train.micro_batch_size=2",
                                        "train.lr=1e-2"])
    return MegatronActor(convert_initial_checkpoint(tiny_llama, tmp_path / "init"), cfg.model, cfg.train,
                         Objective(cfg.algorithm, max_response_length=S))


def test_frozen_holds_theta_old_scales_through_the_step_and_releases_them(megatron_tp1, tiny_llama, tmp_path):
    actor = _actor(tiny_llama, "frozen", tmp_path)
    moved = 0
    for module, old_weight, live, seen in _scales_seen(actor):
        assert len(seen) == MINI_BATCHES  # one training forward per mini-batch (one micro-batch each)
        expected = blockwise_scales(old_weight, E4M3, (1, 32))
        for quantizer, scales in seen:
            assert isinstance(quantizer, HeldScaleWeightQuantizer) and torch.equal(scales, expected)
        assert module.fp8_quantizers.weight is live and isinstance(live, BlockQuantizer)  # released
        moved += not torch.equal(blockwise_scales(module.weight.detach(), E4M3, (1, 32)), expected)
    assert moved > 0  # the updates moved group scales that the held ones did not follow


def test_live_quantizes_every_forward_with_its_own_scales(megatron_tp1, tiny_llama, tmp_path):
    actor = _actor(tiny_llama, "live", tmp_path)
    for module, _, live, seen in _scales_seen(actor):
        assert [quantizer for quantizer, _ in seen] == [live] * MINI_BATCHES
