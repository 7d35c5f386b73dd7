"""The reference policy of algorithm.kl on the CPU tier, real Megatron (TP = PP = 1 in this process,
gloo): built from the actor's converted start, its log-probs equal the actor's recomputed old
log-probs bit for bit before any update and stay put while the actor moves; a reference checkpoint
of another architecture or vocabulary is refused naming the field; offload is refused without CUDA.
Tiny random Llama converted once per module."""
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron_fp8rl.config.loader import load_config
from megatron_fp8rl.rl.advantages import grpo_advantages
from megatron_fp8rl.rollout.engine import RolloutSample
from megatron_fp8rl.trainer.actor import MegatronActor
from megatron_fp8rl.trainer.batch import build_batch
from megatron_fp8rl.trainer.algorithm_config import AlgorithmConfig, KLConfig
from megatron_fp8rl.trainer.config import ModelConfig, RunConfig, TrainConfig
from megatron_fp8rl.trainer.objective import Objective
from megatron_fp8rl.trainer.reference import ReferenceMismatchError, ReferencePolicy, build_reference
from megatron_fp8rl.trainer.rl_step import StepContext, _make_batch, _with_reference
from tests.helpers.megatron_models import converted_tiny_llama
from tests.helpers.processes import run_torchrun
from tests.helpers.tiny_hf import save_tiny_hf

MICRO_BATCH = 2
WORKER = Path(__file__).resolve().parents[1] / "workers" / "reference_layouts.py"


@pytest.fixture(scope="module")
def converted(megatron_tp1, tmp_path_factory):
    """(HF folder, run directory holding its torch_dist conversion as init_megatron)."""
    root = tmp_path_factory.mktemp("reference")
    model = converted_tiny_llama(root / "hf", root / "run" / "init_megatron")
    return model, root / "run"


def _samples(count: int = 5) -> list[RolloutSample]:
    """`count` sequences of different lengths, rollout log-prob −1 per response token."""
    generator = torch.Generator().manual_seed(5)
    samples = []
    for row in range(count):
        prompt = torch.randint(3, 120, (3 + row % 2,), generator=generator).tolist()
        response = torch.randint(3, 120, (2 + row,), generator=generator).tolist()
        samples.append(RolloutSample(row, prompt, response, [-1.0] * len(response), "length", 0))
    return samples


def _batch():
    """5 sequences (micro-batches of 2: the last one padded)."""
    samples = _samples()
    return build_batch(samples, torch.zeros(5), max(len(s.prompt_token_ids) + len(s.token_ids) for s in samples))


def _actor(model: Path, run: Path, fp8: str = "none") -> MegatronActor:
    train = TrainConfig(micro_batch_size=MICRO_BATCH)
    return MegatronActor(run / "init_megatron", ModelConfig(hf_path=str(model), fp8=fp8), train,
                         Objective(AlgorithmConfig(), max_response_length=8))


@pytest.mark.parametrize("fp8", ["none", "calibrated"])
def test_reference_equals_the_actor_before_the_first_update_and_stays_frozen(converted, fp8):
    model, run = converted
    actor = _actor(model, run, fp8)
    kl = KLConfig(coef=0.001)
    reference = build_reference(kl, run, actor, actor.model_cfg, MICRO_BATCH, "auto")
    batch, timings = _batch(), {}
    before = reference.logprobs(batch, timings)
    assert torch.equal(before, actor.old_logprobs(batch))  # bit for bit
    mask = batch.response_mask.bool()
    assert (before[mask] < 0).all()  # real log-probs, not a zero tensor both sides share
    assert not any(p.requires_grad for p in reference.model.parameters())
    start = {name: p.clone() for name, p in reference.model.named_parameters()}
    with torch.no_grad():  # the actor trains on; the reference does not follow
        for param in actor.model.parameters():
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    assert not torch.equal(actor.old_logprobs(batch), before)
    after = reference.logprobs(batch, timings)
    if fp8 == "none":
        assert torch.equal(after, before)
    # FP8: its input scales (delayed scaling) advance with its own passes, as the recompute's do;
    # its weights never move
    assert all(torch.equal(p, start[name]) for name, p in reference.model.named_parameters())
    assert timings == {}  # no offload: no copy timed


def test_bfloat16_reference_is_close_to_the_float32_one_but_not_equal(converted):
    model, run = converted
    actor = _actor(model, run)
    exact = build_reference(KLConfig(coef=0.1), run, actor, actor.model_cfg, MICRO_BATCH, "auto")
    bf16 = build_reference(KLConfig(coef=0.1, precision="bfloat16"), run, actor, actor.model_cfg, MICRO_BATCH, "auto")
    batch = _batch()
    ours, theirs = exact.logprobs(batch, {}), bf16.logprobs(batch, {})
    assert next(bf16.model.parameters()).dtype == torch.bfloat16 and theirs.dtype == torch.float32
    assert not torch.equal(ours, theirs)
    torch.testing.assert_close(theirs, ours, atol=0.1, rtol=0)


@pytest.mark.parametrize("field, value", [("vocab_size", 256), ("num_hidden_layers", 3),
                                          ("architectures", ["Qwen3ForCausalLM"])])
def test_a_reference_of_another_architecture_is_refused_naming_the_field(converted, tmp_path, field, value):
    model, run = converted
    other = tmp_path / "other"
    shutil.copytree(model, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, field: value}))
    actor = _actor(model, run)
    with pytest.raises(ReferenceMismatchError, match=f"config.json field {field} is .*the actor's"):
        build_reference(KLConfig(coef=0.1, reference_path=str(other)), tmp_path / "run", actor, actor.model_cfg,
                        MICRO_BATCH, "auto")
    assert not (tmp_path / "run" / "reference_megatron").exists()  # refused before any conversion


def test_offload_is_refused_by_name_without_cuda(converted):
    model, run = converted
    with pytest.raises(ValueError, match="algorithm.kl.offload: .*no CUDA device"):
        ReferencePolicy(run / "init_megatron", json.loads((model / "config.json").read_text()),
                        ModelConfig(hf_path=str(model)), KLConfig(coef=0.1, offload=True), MICRO_BATCH)


@pytest.mark.parametrize("in_reward", [False, True])
def test_the_step_attaches_the_reference_or_folds_the_kl_into_the_rewards(converted, in_reward):
    """rl_step's reference phase: the batch carries log π_ref (timed); in_reward: the advantages
    are GRPO's of reward_i − β·Σ_t k3(rollout_t, ref_t), worked out here from the formula (one
    group of 4; rollout log-probs within ~0.3 of the reference's, inside k3's clamps)."""
    model, run = converted
    cfg = load_config(RunConfig, None, [f"model.hf_path={model}", "rollout.n_samples=4", "algorithm.name=grpo",
                                        f"train.micro_batch_size={MICRO_BATCH}", "algorithm.kl.coef=0.5",
                                        f"algorithm.kl.in_reward={str(in_reward).lower()}"])
    actor = _actor(model, run)
    reference = build_reference(cfg.algorithm.kl, run, actor, actor.model_cfg, MICRO_BATCH, "auto")
    ctx = StepContext(cfg=cfg, actor=actor, engine=None, reward_fn=None, decode=None, reference=reference)
    samples, rewards = _samples(4), torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    first = reference.logprobs(_make_batch(cfg, samples, rewards), {})
    noise = torch.Generator().manual_seed(2)
    samples = [  # the "rollout": the reference's log-probs plus noise
        dataclasses.replace(sample, logprobs=(first[row, len(sample.prompt_token_ids) - 1:][:len(sample.token_ids)]
                                              + 0.3 * torch.randn(len(sample.token_ids), generator=noise)).tolist())
        for row, sample in enumerate(samples)]
    batch = _make_batch(cfg, samples, rewards)
    out, metrics = _with_reference(ctx, batch, samples, rewards)
    assert torch.equal(out.ref_logprobs, first) and "time/reference_s" in ctx.timings
    if not in_reward:
        assert metrics == {} and torch.equal(out.advantages, batch.advantages)
        return
    mask = batch.response_mask
    gap = (out.ref_logprobs - batch.rollout_logprobs) * mask
    k3 = (gap.exp() - gap - 1) * mask
    assert 0 < float(k3.max()) < 10  # inside verl's clamp
    expected = grpo_advantages((rewards.flatten() - 0.5 * k3.sum(1)).view(1, 4)).flatten()[:, None] * mask
    torch.testing.assert_close(out.advantages, expected)
    assert not torch.allclose(out.advantages, batch.advantages, atol=1e-3)
    assert metrics["kl/max"] == pytest.approx(float(k3.max()))


@pytest.mark.multiprocess
def test_reference_at_the_actors_tp_and_pp_layouts(tmp_path):
    """2 processes (torchrun, gloo): TP2 and PP2. The reference equals the actor's recompute bit
    for bit on the last stage, and the first stage holds the same values (tests/workers/reference_layouts.py)."""
    save_tiny_hf("llama", tmp_path / "hf", dtype=torch.float32)
    layouts = ("tp2pp1", "tp1pp2")
    run_torchrun(WORKER, 2, "--workdir", str(tmp_path), "--layouts", *layouts)
    for tag in layouts:
        assert json.loads((tmp_path / f"result_{tag}.json").read_text()) == {"ranks": 2}
