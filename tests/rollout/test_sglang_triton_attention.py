"""SGLang's Triton attention kernels (the GPU rollout's) run on CPU under Triton's interpreter, in a
subprocess with TRITON_INTERPRET=1 from its start (SGLang wraps its kernels when imported). What
aligning the trainer's attention with them on GPU rests on (tests/rollout/sglang_triton_attention.py):
in deterministic mode a request's rows do not depend on the batch, and the decode split count
changes the bits, so the trainer must repeat SGLang's split rule as well as its kernels."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.rollout import needs_sglang

pytestmark = [needs_sglang, pytest.mark.slow, pytest.mark.triton]
REPO = Path(__file__).resolve().parents[2]


def test_sglang_triton_attention_runs_under_the_interpreter_and_is_batch_invariant():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-W", "ignore", "-m", "tests.rollout.sglang_triton_attention"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    print(measured)
    assert measured["interpreter"]
    assert measured["extend_error"] < 1e-5 and measured["decode_error"] < 1e-5
    assert measured["extend_alone_equals_batch"] and measured["decode_alone_equals_batch"]
    assert not measured["decode_other_splits_equal"]
