"""The real megatron-core on CPU: the tiny GPT trained at TP=2, PP=2 and DP=2 (distributed
optimizer) must reproduce the TP=1 run, in float32 and in bf16 mixed precision, and
dist_checkpointing must reshard TP=2 -> TP=1 exactly.

Starts torchrun workers (tests/workers/gpt_layouts.py): per dtype one 1-process reference run,
three 2-process runs, and one 1-process verification run per resharded checkpoint.
"""
import json
from pathlib import Path

import pytest

from tests.helpers.processes import run_torchrun

WORKER = Path(__file__).resolve().parents[1] / "workers" / "gpt_layouts.py"
RTOL = {
    # fp32 on CPU; different layouts sum partial products in different orders. Measured agreement
    # is ~1e-7 relative; 1e-5 is loose enough for summation order and tight enough to catch a
    # missing gradient reduction (which moved the grad norm by >15% when it was absent).
    "float32": 1e-5,
    # bf16: a layout changes where activations are rounded to bf16 (TP row-parallel outputs are
    # reduced as bf16 partial sums; PP sends bf16 activations), each rounding off by at most the
    # unit roundoff u = 2**-8 relative. Loss and grad norm average many such elements, so they stay
    # within u: measured 1e-4 (loss) and 1.9e-3 (grad norm, TP=2) over 3 steps. u is still 40x
    # below the 15% a missing gradient reduction causes.
    "bfloat16": 2**-8,
}
LAYOUTS = {"tp2": ("2", "1"), "pp2": ("1", "2"), "dp2": ("1", "1")}
PRECISION = {  # what the forward, the optimizer and the gradient buffers hold, per model dtype
    "float32": {"model": ["torch.float32"], "master": ["torch.float32"], "main_grad": ["torch.float32"]},
    "bfloat16": {"model": ["torch.bfloat16"], "master": ["torch.float32"], "main_grad": ["torch.float32"]},
}


@pytest.fixture(scope="module", params=sorted(RTOL))
def reference(request, tmp_path_factory) -> tuple[Path, str]:
    workdir = tmp_path_factory.mktemp(f"layouts_{request.param}")
    run_torchrun(WORKER, 1, "reference", "--workdir", str(workdir), "--tag", "tp1", "--dtype", request.param)
    return workdir, request.param


def _result(workdir: Path, tag: str) -> dict:
    return json.loads((workdir / f"{tag}.json").read_text())


def _compare(workdir: Path, dtype: str, tag: str) -> None:
    tp, pp = LAYOUTS[tag]
    run_torchrun(WORKER, 2, "compare", "--workdir", str(workdir), "--tag", tag, "--tp", tp, "--pp", pp,
                 "--dtype", dtype)


@pytest.mark.multiprocess
@pytest.mark.parametrize("tag", sorted(LAYOUTS))
def test_layout_matches_tp1(reference: tuple[Path, str], tag: str):
    """2 processes: losses and grad norms of 3 Adam steps equal the TP=1 run of the same dtype,
    and the run trains in that dtype (bf16: bf16 weights, fp32 master weights and gradients)."""
    workdir, dtype = reference
    _compare(workdir, dtype, tag)
    expected, got = _result(workdir, "tp1"), _result(workdir, tag)
    assert got["precision"] == expected["precision"] == PRECISION[dtype]
    expected, got = expected["history"], got["history"]
    assert len(got) == len(expected) == 3
    for step, (want, have) in enumerate(zip(expected, got)):
        for key in ("lm_loss", "grad_norm"):
            assert have[key] == pytest.approx(want[key], rel=RTOL[dtype]), f"step {step} {key} at {tag}"
    # the run must have learned something, or equal losses would prove little
    assert got[-1]["grad_norm"] > 0


@pytest.mark.multiprocess
def test_checkpoint_saved_at_tp2_loads_at_tp1_bit_exact(reference: tuple[Path, str]):
    """1 process: the TP=2 run's resaved initial weights, loaded at TP=1, equal the original."""
    workdir, dtype = reference
    if not (workdir / "resaved_tp2").exists():
        _compare(workdir, dtype, "tp2")
    run_torchrun(WORKER, 1, "verify", "--workdir", str(workdir), "--tag", "tp2", "--dtype", dtype)
    report = json.loads((workdir / "verify_tp2.json").read_text())
    assert report["compared"] >= 10
    assert report["mismatched"] == []
