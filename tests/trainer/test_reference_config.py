"""The algorithm.kl section: defaults off, verl/slime names accepted, bad values refused naming the
dotted key (the reference model itself: tests/trainer/test_reference.py)."""
import pytest

from megatron_fp8rl.config.loader import load_config
from megatron_fp8rl.trainer.config import RunConfig


def _load(*overrides: str) -> RunConfig:
    return load_config(RunConfig, None, ["model.hf_path=/x", *overrides])


def test_kl_is_off_by_default():
    kl = _load().algorithm.kl
    assert kl.coef == 0 and not kl.enabled and not kl.in_reward and kl.precision == "actor"


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs", "kl", "mse", "low_var_kl"])
def test_our_and_verls_estimator_names_load(estimator):
    kl = _load("algorithm.kl.coef=0.001", f"algorithm.kl.estimator={estimator}").algorithm.kl
    assert kl.enabled and kl.estimator == estimator


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.kl.coef=-0.1"], r"algorithm.kl.coef: must be a finite number >= 0, got -0.1"),
    (["algorithm.kl.coef=nan"], r"algorithm.kl.coef: must be a finite number >= 0, got nan"),
    (["algorithm.kl.coef=0.1", "algorithm.kl.estimator=full"], r"algorithm.kl.estimator: 'full' is not one of"),
    (["algorithm.kl.coef=0.1", "algorithm.kl.precision=fp16"], r"algorithm.kl.precision: 'fp16' is not one of"),
    (["algorithm.kl.in_reward=true"], r"algorithm.kl.in_reward: is set but algorithm.kl.coef is 0"),
    (["algorithm.kl.reference_path=/ref"], r"algorithm.kl.reference_path: is set but algorithm.kl.coef is 0"),
    (["algorithm.kl.coef=0.1", "model.fp8=te_delayed", "model.fp8_backend=te"],
     r"algorithm.kl.precision: actor with model.fp8_backend=te is not wired"),
])
def test_bad_kl_settings_name_the_key(overrides, message):
    with pytest.raises(Exception, match=message):
        _load(*overrides)


def test_a_te_actor_takes_a_high_precision_reference():
    cfg = _load("algorithm.kl.coef=0.1", "model.fp8=te_delayed", "model.fp8_backend=te", "algorithm.kl.precision=bfloat16")
    assert cfg.algorithm.kl.precision == "bfloat16"
