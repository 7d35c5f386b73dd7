"""The GPU smoke kit's CPU path (bench/gpu_smoke.py --tiny), so the kit does not rot between GPU
loans. It runs in a subprocess (`python -S`, no site-packages) that sees only what the GPU machine
will have: the standard library, torch and its own dependencies, and the wheelhouse of
scripts/gpu_smoke.sh (megatron-core, numpy, packaging) -- an import of anything else (einops, yaml,
transformers, sglang, ...) fails there as it would there. Two processes (the kit and its spawned
weight receiver), ~10 s."""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.processes import REPO

GPU_MACHINE_PACKAGES = {
    # torch 2.11 and the packages its wheel depends on
    "torch", "torchgen", "functorch", "triton", "typing_extensions", "sympy", "mpmath", "networkx",
    "jinja2", "markupsafe", "filelock", "fsspec", "setuptools", "pkg_resources", "_distutils_hack",
    # scripts/gpu_smoke.sh's wheelhouse
    "megatron", "megatron_core", "numpy", "packaging",
}
"""Top-level names (packages and their .dist-info) of site-packages the GPU machine will have."""


def _gpu_machine_site(folder: Path) -> Path:
    """A folder of links to this venv's site-packages entries that the GPU machine has."""
    site = Path(torch.__file__).parents[1]
    folder.mkdir()
    for entry in site.iterdir():
        if entry.name.split("-")[0].split(".")[0].lower() in GPU_MACHINE_PACKAGES:
            (folder / entry.name).symlink_to(entry)
    return folder


def _wheelhouse_packages() -> set[str]:
    script = (REPO / "scripts" / "gpu_smoke.sh").read_text()
    packages = re.search(r"^PACKAGES=\((.*)\)$", script, re.M).group(1)
    return {re.split(r"[=<>]", name.strip('"'))[0].replace("-core", "") for name in packages.split()}


@pytest.mark.multiprocess
def test_smoke_kit_cpu_path_runs_with_only_the_gpu_machines_packages(tmp_path):
    assert _wheelhouse_packages() == {"megatron", "numpy", "packaging"}
    path = f"{REPO}{os.pathsep}{_gpu_machine_site(tmp_path / 'site')}"
    done = subprocess.run([sys.executable, "-S", "bench/gpu_smoke.py", "--tiny"], capture_output=True, text=True,
                          cwd=REPO, timeout=300, env={"PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout[done.stdout.index("{"):])
    assert result["device"] == "cpu" and len(result["linears"]) == 4
    assert all(row["ratio_fwd"] > 0 and row["ratio_fwd_bwd"] > 0 for row in result["linears"].values())
    step = result["megatron_step"]
    for name in ("bf16", "bf16+fp8"):
        losses = step[name]["losses"]
        assert len(losses) == 3 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert step["bf16"]["losses"] != step["bf16+fp8"]["losses"]  # the FP8 linears ran
    assert result["recipe_scales"]["scales_equal"] and result["recipe_scales"]["codes_equal"]
    probe = result["batch_invariance"]["per_tensor"]
    assert set(probe) == {"1", "16", "64"} and probe["64"]["bit_equal"]
    ipc = result["weight_ipc"]  # the spawned receiver got the layer bit for bit, and exited
    assert ipc["bucket_device"] == "cpu" and ipc["bit_equal"] and ipc["exit_code"] == 0
    assert ipc["sync_s"] > ipc["receiver_copy_s"] > 0 and ipc["speed_vs_memcpy"] > 0
