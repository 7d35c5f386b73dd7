"""The GPU kit's CPU dry run (bench/gpu_smoke.py --tiny: both parts through the device path under
Triton's interpreter, GEMMs routed and checked as on CUDA, the JSON, tables and target table
written), so a crash shows here before a GPU loan; and its runner (warm-ups first, failures
recorded, JSON after each item, the time guard). The kit runs in a subprocess (`python -S`,
no site-packages) that sees only what the GPU machine will have: the standard library, torch
and its own dependencies, and the wheelhouse of scripts/gpu_smoke.sh (megatron-core, numpy,
packaging, safetensors, tqdm) -- an import of anything else (einops, yaml, transformers, sglang, ...) fails there as
it would there. Two processes (the kit and its spawned
weight receiver), ~35 s."""
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
    "megatron", "megatron_core", "numpy", "packaging", "safetensors", "tqdm",
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


def _kit(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    path = f"{REPO}{os.pathsep}{_gpu_machine_site(tmp_path / 'site')}"
    return subprocess.run([sys.executable, "-S", "bench/gpu_smoke.py", "--tiny", "--out-dir", str(tmp_path), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={"PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PATH": ""})


TARGETS = 7
"""issue 64's GPU targets: three linear ones, the step's speed and memory, the invariant GEMM, the sync."""


@pytest.mark.multiprocess
@pytest.mark.triton  # the kit switches Triton's interpreter on itself (CPU); marked for the selection
def test_smoke_kit_both_parts_run_the_device_path_with_only_the_gpu_machines_packages(tmp_path):
    assert _wheelhouse_packages() == {"megatron", "numpy", "packaging", "safetensors", "tqdm"}
    done = _kit(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    parts = {part: json.loads((tmp_path / f"gpu_smoke_part{part}.json").read_text()) for part in gpu_smoke.PARTS}
    for part, result in parts.items():
        assert result["device"] == "cpu" and result["device_path"], part  # the CUDA path's code, interpreted
        items = {name: result[name] for name in gpu_smoke.PARTS[part]}
        assert {entry["status"] for entry in items.values()} == {"ok"}, {n: e.get("error") for n, e in items.items()}
        assert [row["target"] for row in result["targets"]] == [row["target"] for row in _targets(tmp_path)]
        assert "| target | figure | status | where |" in (tmp_path / f"gpu_smoke_part{part}.md").read_text()
    _check_linears(parts["1"]["linears"]["result"])
    _check_gemm(parts["1"]["gemm"]["result"])
    _check_step(parts["2"]["step"]["result"])
    sync = parts["2"]["sync"]["result"]  # the spawned receiver got every bucket and exited
    assert sync["exit_code"] == 0 and sync["bit_equal"] and sync["sync_s"] > sync["receiver_copy_s"] > 0 and sync["quantize_s"] > 0
    assert 0 < sync["sent_gb"] < sync["stack_gb"]  # FP8 linears: fewer bytes than the bf16 stack
    targets = _targets(tmp_path)
    assert len(targets) == TARGETS and all(row["status"] in ("met", "not met", "not measured") for row in targets)
    unmeasured = {row["target"] for row in targets if row["figure"] is None}
    assert unmeasured == {row["target"] for row in targets if "peak memory" in row["target"]}  # CUDA only
    assert [row["status"] for row in targets if row["figure"] is None] == ["not measured"]
    assert targets[-1]["status"] == "not measured" and "not timed" in targets[-1]["where"]  # a lower bound


def _targets(tmp_path: Path) -> list[dict]:
    return json.loads((tmp_path / "gpu_smoke_targets.json").read_text())


def _check_linears(result: dict) -> None:
    from megatron_fp8rl.fp8.recipe import RECIPE_NAMES

    assert set(result["shapes"]) == {"down 160->64 x64"}
    variants = result["shapes"]["down 160->64 x64"]["variants"]
    assert set(variants) | set(result["refused"]) == {f"{r} {g}" for r in RECIPE_NAMES for g in gpu_smoke.LINEAR_GEMMS}
    assert {f"{r} auto" for r in RECIPE_NAMES} <= set(variants)
    for timed in variants.values():
        assert all(timed[mode] > 0 and timed[f"speedup_{mode}"] > 0 for mode in gpu_smoke.LINEAR_MODES), timed


def _check_gemm(result: dict) -> None:
    (row,) = result["speed"].values()
    assert row["cublas_tensor"]["kernel"] == "cublas_tensor" and row["tensor_vs_cublas"] > 0
    assert {row[f"triton_{layout}"]["kernel"] for layout in gpu_smoke.GEMM_LAYOUTS} == {"triton"}
    assert set(result["checks"]) == set(gpu_smoke.GEMM_LAYOUTS)
    for check in result["checks"].values():
        assert check["rows_bit_equal"] and check["unequal_ms"] == [] and 0 <= check["max_error_over_bound"] <= 1


def _check_step(step: dict) -> None:
    for name in ("bf16", "bf16+fp8"):
        losses = step[name]["losses"]
        assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert step["bf16"]["losses"] != step["bf16+fp8"]["losses"] and step["speedup_step"] > 0  # FP8 ran
    assert step["lm_head_fwd_bwd_ms"] > 0


def test_kit_warms_every_item_first_records_a_failure_writes_after_each_and_stops_at_the_guard(tmp_path):
    """The runner itself: every item's warm-up runs before any measurement; an item's exception is
    its entry, not the part's end; the JSON on disk holds every finished item when the next one
    runs; past the budget measurements are skipped by name."""
    out, seen, order = tmp_path / "kit.json", [], []

    def failing(ctx, warmed):
        order.append("measure")
        raise ValueError("no FP8 kernel for this")

    def reads_the_file(ctx, warmed):
        order.append("measure")
        seen.append(json.loads(out.read_text()))
        return warmed

    ctx = gpu_smoke.Context(torch.device("cpu"), gpu_smoke.TINY, gpu_smoke.SIZES["tiny"], time.perf_counter() + 60)
    items = {"boom": gpu_smoke.Item(lambda ctx: order.append("warm"), failing),
             "next": gpu_smoke.Item(lambda ctx: order.append("warm") or 7, reads_the_file)}
    results = gpu_smoke.run_part(items, ctx, {}, out)
    assert order == ["warm", "warm", "measure", "measure"]
    assert results["boom"]["status"] == "failed" and results["boom"]["error"] == "ValueError: no FP8 kernel for this"
    assert seen[0]["boom"]["status"] == "failed" and results["next"]["result"] == 7
    assert json.loads(out.read_text()) == results and len(results["targets"]) == TARGETS
    ctx.deadline = time.perf_counter() - 1
    late = gpu_smoke.run_part({"next": gpu_smoke.Item(lambda ctx: None, reads_the_file)}, ctx, {}, None)
    assert late["next"]["status"] == "skipped" and "time guard" in late["next"]["reason"] and len(seen) == 1
    assert {row["status"] for row in late["targets"]} == {"not measured"}
