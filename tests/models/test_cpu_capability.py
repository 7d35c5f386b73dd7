"""Alignment does not depend on the CPU's vector capability: the bit-identity tests of the aligned
pieces (SGLang's torch_native attention calls against the trainer's call layout at 1/2 threads on
either side, and the groupwise FP8 plugin against the trainer's FP8 linear) pass with torch's
kernels forced to each capability this CPU can run (ATEN_CPU_CAPABILITY, read once at import, so
each capability gets its own process).

Both sides of an aligned run share one capability: the SGLang engine's scheduler is a child of the
trainer and inherits its environment. Across capabilities the elementwise kernels themselves round
differently (measured on an AVX2 box, torch 2.13, one thread: SDPA, SiLU, RMSNorm and log-softmax
differ by 1e-6 to 5e-5 between `default` and `avx2`), so a disaggregated server on another kind of
CPU must be started with the trainer's capability (docs/fp8.md, "What is exact where")."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ALIGNED_BIT_TESTS = [
    "tests/models/test_megatron_attention.py::test_call_layout_gives_sglang_torch_native_bits",
    "tests/rollout/test_sglang_fp8_gemm.py::test_groupwise_plugin_equals_trainer_bit_for_bit",
]


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.multiprocess
@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_alignment_holds_under_each_forced_cpu_capability(capability):
    needs = {"avx2": {"avx2"}, "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}}.get(capability, set())
    if not needs <= _cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(needs - _cpu_flags())}: torch cannot run {capability} kernels")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    seen = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                          env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert seen == capability.upper(), f"torch ran {seen} kernels, not the forced {capability}"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                             *ALIGNED_BIT_TESTS], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, f"ATEN_CPU_CAPABILITY={capability}:\n{result.stdout[-4000:]}"
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
