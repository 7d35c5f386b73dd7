"""Checkpoint integrity: converted torch_dist folders carry a SHA-256 manifest; a flipped bit, a
truncated or a missing file is refused at load naming the file; a crafted `.metadata` is refused
before Megatron sees it. In process, one rank."""
import json
import warnings

import pytest

from megatron_fp8rl.compat.safe_dcp import UnsafeCheckpointError
from megatron_fp8rl.convert.hf_to_megatron import convert_hf_to_megatron
from megatron_fp8rl.convert.integrity import MANIFEST, verify_manifest, verify_torch_dist
from megatron_fp8rl.convert.megatron_to_hf import convert_megatron_to_hf
from megatron_fp8rl.convert.safetensors_io import CheckpointError
from megatron_fp8rl.models.hf import build_model_from_hf
from tests.helpers.tiny_hf import save_tiny_hf


@pytest.fixture
def converted(tmp_path, megatron_tp1):
    hf_dir = save_tiny_hf("qwen2", tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    target = build_model_from_hf(config, device="meta").sharded_state_dict()
    convert_hf_to_megatron(hf_dir, tmp_path / "mcore", target, progress=False)
    return tmp_path / "mcore"


def _largest_distcp(folder):
    return max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)


def test_conversion_writes_a_manifest_that_verifies(converted):
    listed = [line.split("  ", 1)[1] for line in (converted / MANIFEST).read_text().splitlines()]
    assert ".metadata" in listed and "hf/config.json" in listed
    assert any(name.endswith(".distcp") for name in listed)
    assert verify_manifest(converted) is True
    verify_torch_dist(converted)  # its metadata loads through the restricted unpickler


def test_flipped_bit_is_refused_naming_the_file(converted, tmp_path):
    damaged = _largest_distcp(converted)
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x10
    damaged.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{damaged.name}: contents differ from {MANIFEST}"):
        convert_megatron_to_hf(converted, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_truncated_and_missing_files_are_named(converted):
    damaged = _largest_distcp(converted)
    damaged.write_bytes(damaged.read_bytes()[:100])
    (converted / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=rf"\.metadata: missing\n.*{damaged.name}: contents differ"):
        verify_torch_dist(converted)


def test_without_manifest_a_crafted_metadata_is_still_refused(converted):
    (converted / MANIFEST).unlink()
    (converted / ".metadata").write_bytes(b"cos\nsystem\n(S'true'\ntR.")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(UnsafeCheckpointError, match=r"refusing to load global os\.system"):
            verify_torch_dist(converted)
    assert any(f"no {MANIFEST}" in str(w.message) for w in caught)
