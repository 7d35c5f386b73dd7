"""The CPU-tier stand-ins for SGLang's CUDA-only imports (megatron_fp8rl.compat.sglang_cpu).
Runs in a fresh interpreter (1 child process, which spawns 1 more) so this session's sys.path is untouched."""
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="stand-ins are installed only without CUDA"),
              pytest.mark.multiprocess]

SCRIPT = textwrap.dedent(
    """
    import multiprocessing as mp
    from megatron_fp8rl.compat import sglang_cpu

    def where():
        import sgl_kernel, torchvision
        return sgl_kernel.__file__, torchvision.__file__

    if __name__ == "__main__":
        assert sglang_cpu.install()
        import os, sgl_kernel, torchvision.transforms as T
        assert os.environ["SGLANG_USE_CPU_ENGINE"] == "1"
        assert T.InterpolationMode.BICUBIC is T.InterpolationMode.BICUBIC
        for call in (lambda: T.Resize(3), lambda: sgl_kernel.assign_req_to_token_pool_cpu(1)):
            try:
                call()
                raise SystemExit("a stand-in call did not raise")
            except sglang_cpu.StandInCalledError as err:
                print("RAISED", err)
        try:
            from sgl_kernel import flash_attn_varlen_func
            raise SystemExit("strict stand-in offered an unknown name")
        except ImportError:
            print("IMPORTERROR ok")
        with mp.get_context("spawn").Pool(1) as pool:
            print("CHILD", *pool.apply(where))
    """
)


def test_standins_raise_when_called_and_reach_spawned_children(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torchvision.transforms.Resize was called, but it is a CPU-tier stand-in" in done.stdout
    assert "sgl_kernel.assign_req_to_token_pool_cpu was called" in done.stdout
    assert "IMPORTERROR ok" in done.stdout
    child = next(line for line in done.stdout.splitlines() if line.startswith("CHILD"))
    assert child.count("sglang_cpu_standins") == 2, child
