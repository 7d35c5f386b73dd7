"""The GPU kit's CPU path (bench/gpu_smoke.py --tiny: every item, the CUDA-only ones reported as
skipped by name, the JSON written), so the kit does not rot between GPU loans; and its runner
(failures recorded, JSON after each item, the budget). The kit runs in a subprocess (`python -S`,
no site-packages) that sees only what the GPU machine will have: the standard library, torch
and its own dependencies, and the wheelhouse of scripts/gpu_smoke.sh (megatron-core, numpy,
packaging) -- an import of anything else (einops, yaml, transformers, sglang, ...) fails there as
it would there. Two processes (the kit and its spawned
weight receiver), ~20 s."""
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench import gpu_smoke
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


def _kit(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    path = f"{REPO}{os.pathsep}{_gpu_machine_site(tmp_path / 'site')}"
    out = tmp_path / "kit.json"
    done = subprocess.run([sys.executable, "-S", "bench/gpu_smoke.py", "--tiny", "--out", str(out), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={"PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PATH": ""})
    return done, out


@pytest.mark.multiprocess
@pytest.mark.triton  # the kit switches Triton's interpreter on itself (CPU); marked for the selection
def test_smoke_kit_cpu_path_runs_with_only_the_gpu_machines_packages(tmp_path):
    assert _wheelhouse_packages() == {"megatron", "numpy", "packaging"}
    done, out = _kit(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(done.stdout[done.stdout.index("\n{") + 1:]) == result  # printed = written
    items = {name: entry for name, entry in result.items() if isinstance(entry, dict)}
    assert set(items) == set(gpu_smoke.ITEMS) and result["device"] == "cpu"
    assert items.pop("sync_debug") == {"status": "skipped", "reason": "needs CUDA", "seconds": 0.0}
    assert {entry["status"] for entry in items.values()} == {"ok"}, {n: e.get("error") for n, e in items.items()}
    _check_linears(items["linears"]["result"])
    _check_gemm(items["gemm"]["result"])
    step = items["megatron_step"]["result"]
    for name in ("bf16", "bf16+fp8"):
        losses = step[name]["losses"]
        assert len(losses) == 3 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert step["bf16"]["losses"] != step["bf16+fp8"]["losses"] and step["speedup_step"] > 0  # FP8 ran
    scales = items["recipe_scales"]["result"]
    assert scales["scales_equal"] and scales["codes_equal"]
    probe = items["batch_invariance"]["result"]["per_tensor"]
    assert set(probe) == {"1", "16", "64"} and probe["64"]["bit_equal"]
    ipc = items["weight_ipc"]["result"]  # the spawned receiver got the layer bit for bit, and exited
    assert ipc["bucket_device"] == "cpu" and ipc["bit_equal"] and ipc["exit_code"] == 0
    assert ipc["sync_s"] > ipc["receiver_copy_s"] > 0 and ipc["speed_vs_memcpy"] > 0
    figures = {row["target"]: row["figure"] for row in result["targets"]}
    assert len(figures) == len(result["targets"]) == 2 * len(gpu_smoke.RECIPES) + 9
    unmeasured = {name for name, figure in figures.items() if figure is None}
    cuda_only = {name for name in figures if "without a host sync" in name or "peak memory" in name}
    assert len(cuda_only) == 2 and unmeasured == cuda_only  # every other figure measured on the CPU


def _check_linears(rows: dict) -> None:
    shapes = {"qkv 64->128", "o 64->64", "gate_up 64->320", "down 160->64"}
    want = {f"{shape} x64 {recipe} {gemm}" for shape in shapes for recipe in gpu_smoke.RECIPES
            for gemm in gpu_smoke.LINEAR_GEMMS}
    assert set(rows) == want
    assert all(row["speedup_fwd"] > 0 and row["speedup_fwd_bwd"] > 0 for row in rows.values()), rows


def _check_gemm(result: dict) -> None:
    assert len(result["speed"]) == 4 * 2  # four shapes x M = 3, 64
    for row in result["speed"].values():
        assert row["tensor_vs_scaled_mm"] > 0 and all(row[f"{layout}_ms"] > 0 for layout in gpu_smoke.GEMM_LAYOUTS)
    assert set(result["checks"]) == set(gpu_smoke.GEMM_LAYOUTS)
    for check in result["checks"].values():
        assert check["rows_bit_equal"] and check["unequal_ms"] == [] and 0 <= check["max_error_over_bound"] <= 1


def test_kit_records_a_failing_item_writes_after_each_and_skips_past_the_budget(tmp_path):
    """The runner itself: an item's exception is its entry, not the run's end; the JSON on disk
    holds every finished item when the next one runs; past the budget items are skipped by name."""
    import torch

    out, seen = tmp_path / "kit.json", []

    def failing(ctx):
        raise ValueError("no FP8 kernel for this")

    def reads_the_file(ctx):
        seen.append(json.loads(out.read_text()))
        return 1

    ctx = gpu_smoke.Context(torch.device("cpu"), gpu_smoke.TINY, gpu_smoke.SIZES["tiny"], time.perf_counter() + 60)
    items = {"boom": gpu_smoke.Item(failing), "next": gpu_smoke.Item(reads_the_file),
             "cuda": gpu_smoke.Item(reads_the_file, needs_cuda=True)}
    results = gpu_smoke.run_items(items, ctx, {}, out)
    assert results["boom"]["status"] == "failed" and results["boom"]["error"] == "ValueError: no FP8 kernel for this"
    assert seen[0]["boom"]["status"] == "failed" and results["next"] == {"status": "ok", "result": 1,
                                                                        "seconds": results["next"]["seconds"]}
    assert results["cuda"]["reason"] == "needs CUDA" and json.loads(out.read_text()) == results
    ctx.deadline = time.perf_counter() - 1
    late = gpu_smoke.run_items({"next": gpu_smoke.Item(reads_the_file)}, ctx, {}, None)
    assert late["next"]["status"] == "skipped" and late["next"]["reason"] == "budget spent" and len(seen) == 1
