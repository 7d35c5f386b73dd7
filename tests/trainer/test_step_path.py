"""docs/design.md's "path of one RL step" is the path a real step takes: at every `optimizer.step()` of a
`megatron-fp8rl train` run, the package's functions on the stack from `cli.py:_train` down are
exactly the hops it lists, and there are at most four. 1 torchrun process + SGLang's 2."""
import json
import re
from pathlib import Path

import pytest

from tests.helpers.processes import REPO, run_torchrun
from tests.helpers.train import base_train_args

WORKER = REPO / "tests" / "workers" / "step_path.py"


def readme_step_path() -> list[str]:
    """The hops docs/design.md lists after "The path of one RL step", e.g. ["cli.py:_train", ...,
    "optimizer.step()"] (paths relative to megatron_fp8rl/)."""
    text = (REPO / "docs" / "design.md").read_text()
    section = text[text.index("The path of one RL step"):]
    line = next(line for line in section.splitlines() if "->" in line)
    return re.findall(r"`([^`]+)`", line)


def test_readme_lists_the_path_in_at_most_four_hops():
    hops = readme_step_path()
    assert hops[0] == "cli.py:_train" and hops[-1] == "optimizer.step()", hops
    assert len(hops) - 1 <= 4, hops


@pytest.mark.multiprocess
def test_every_optimizer_step_takes_the_readme_path(tiny_run_inputs, tmp_path):
    """One step of two mini-batches (no dynamic sampling, so the step always trains): two optimizer
    steps, each called from the listed functions."""
    out = tmp_path / "stacks.json"
    run_torchrun(WORKER, 1, str(out), "train", *base_train_args(*tiny_run_inputs), f"run_dir={tmp_path / 'run'}",
                 "train.steps=1", "train.eval_every=0", "train.mini_batches=2", "train.micro_batch_size=2",
                 "algorithm.dynamic_sampling=false", timeout=900)
    stacks = json.loads(out.read_text())
    assert len(stacks) == 2, stacks
    for stack in stacks:
        assert stack[stack.index("cli.py:_train"):] == readme_step_path()[:-1], stack
