"""For the stability study's tests: run directories written the way `train` writes them (tensorboard
scalars, eval_correct.json) and the run config a study arm trains with."""
import json

from torch.utils.tensorboard import SummaryWriter

from megatron_fp8rl.config.loader import load_config, save_config
from megatron_fp8rl.study.arms import COMMON
from megatron_fp8rl.trainer.config import RunConfig


def write_run(path, scalars: dict[str, list[float]], evals: dict[int, list[int]]):
    writer = SummaryWriter(str(path / "tb"))
    for tag, values in scalars.items():
        for step, value in enumerate(values, 1):
            writer.add_scalar(tag, value, step)
    writer.close()
    (path / "eval_correct.json").write_text(json.dumps({str(k): v for k, v in evals.items()}))
    return path


def run_scalars(overclip=None, entropy_end=1.0, no_number=0.0, steps=8, reward=None, truncated=0.0):
    out = {"train/entropy": [1.0] * (steps - 5) + [entropy_end] * 5, "reward/mean": reward or [0.2] * steps,
           "response/no_number_frac": [no_number] * steps, "response/repetitive_frac": [0.0] * steps,
           "response/length_mean": [10.0] * steps, "train/clip_frac_low": [0.01] * steps,
           "response/truncated_frac": [truncated] * steps}
    if overclip is not None:
        out["clip/neg_overclip_before"] = overclip
        out["clip/neg_overclip_after"] = [v / 2 for v in overclip]
    return out


def arm_config(overrides, common=COMMON):
    """The RunConfig a study arm trains with: the regime's shared overrides, then the arm's."""
    return load_config(RunConfig, None, [f"{k}={v}" for k, v in common.items()] + list(overrides))


def correct_first(count: int, problems: int) -> list[int]:
    """Per-problem results right on the first `count` of `problems`."""
    return [int(i < count) for i in range(problems)]


def write_finished_run(path, final: list[int], config_overrides=None, common=COMMON):
    """A finished study run whose last eval scored `final` (per problem): a few scalars, eval_correct.json,
    summary.json and, given the arm's overrides, the config.yaml `train` writes for them."""
    write_run(path, run_scalars(steps=6), {0: [0] * len(final), 12: final})
    (path / "summary.json").write_text("{}")
    if config_overrides is not None:
        save_config(arm_config(["model.hf_path=m", *config_overrides], common), path / "config.yaml")
    return path
