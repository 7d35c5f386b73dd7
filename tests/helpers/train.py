"""`megatron-fp8rl train` under torchrun on a tiny random Llama with the real SGLang engine (each
run: the torchrun workers + SGLang's 2), and the tensorboard scalars it wrote."""
import json
import re
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_fp8rl.compat.tcp_store import free_port
from megatron_fp8rl.rl.metrics import eval_verdict
from tests.helpers.processes import REPO, run_torchrun
from tests.helpers.tiny_models import held_out_prompts

CLI = REPO / "megatron_fp8rl" / "cli.py"


def base_train_args(model: Path, prompts: Path) -> list[str]:
    """The overrides every test run starts from: 2 steps of 2 prompts x 4 samples of 6 tokens."""
    return [f"model.hf_path={model}", f"data.train={prompts}", f"data.eval={held_out_prompts(prompts)}",
            "data.eval_size=8",
            "data.reward=tests.trainer.reward_fns:first_word_even", "train.steps=2", "rollout.n_samples=4",
            "data.prompts_per_step=2", "rollout.max_new_tokens=6", "train.micro_batch_size=4",
            "train.eval_every=2", "train.lr=1e-3"]


def train_command(inputs, run_dir: Path, *overrides: str) -> list[str]:
    """torchrun (1 process) running `train` with the base overrides, for tests that start it
    themselves (to signal or kill it)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", str(CLI), "train", *base_train_args(*inputs),
            f"run_dir={run_dir}", *overrides]


def run_train(inputs, run_dir: Path, nproc: int, *overrides: str) -> dict:
    """Run `train` to the end under torchrun with `nproc` processes; returns its summary."""
    output = run_torchrun(CLI, nproc, "train", *base_train_args(*inputs), f"run_dir={run_dir}", *overrides,
                          timeout=900)
    summary = json.loads(re.search(r"^\{.*?^\}", output, re.S | re.M).group(0))
    assert eval_verdict(summary) in output.splitlines(), "the run ends with its eval verdict"
    return summary


def tb_scalars(run_dir: Path) -> dict[str, list[float]]:
    """tag -> values of the run's tensorboard scalars."""
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def tb_texts(run_dir: Path, tag: str) -> list[str]:
    """The run's tensorboard text entries under `tag`, in step order."""
    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"tensors": 0})
    events.Reload()
    return [e.tensor_proto.string_val[0].decode() for e in events.Tensors(f"{tag}/text_summary")]


GPU_EXAMPLES = {"qwen3_8b_dapo_fp8.yaml": ("qwen3_8b.yaml", 8), "qwen2_5_32b_grpo_fp8.yaml": ("qwen2_5_32b.yaml", 24)}
"""The GPU run configs in examples/: {config: (model layout in examples/models, trainer GPUs)}."""
