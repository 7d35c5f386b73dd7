"""A crafted torch_dist checkpoint runs no code: its `.metadata` pickle and its pickled byte items
(Megatron ShardedObjects) are refused by name on every load path (our DCP reader in the
converters, Megatron-Core's dist_checkpointing.load), and genuine checkpoints still load.
In process, one rank."""
import io
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo

from megatron_fp8rl.compat.safe_dcp import UnsafeCheckpointError
from megatron_fp8rl.convert.megatron_to_hf import read_tensor_metadata

REPO = Path(__file__).resolve().parents[2]


class _RunsShell:
    """Unpickles as os.system(command)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _megatron_checkpoint(directory: Path):
    """A dist_checkpointing folder with one tensor and one ShardedObject; returns a factory of the
    sharded dict that loads it."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    def sharded(weight, extra):
        return {"w": ShardedTensor.from_rank_offsets("w", weight, replica_id=0),
                "extra": ShardedObject("extra", extra, (1,), (0,), replica_id=0)}

    directory.mkdir()
    dist_checkpointing.save(sharded(torch.arange(6.0), {"scale": torch.ones(2)}), str(directory))
    return lambda: sharded(torch.zeros(6), None)


def test_genuine_checkpoint_loads(megatron_tp1, tmp_path):
    from megatron.core import dist_checkpointing

    target = _megatron_checkpoint(tmp_path / "ckpt")
    loaded = dist_checkpointing.load(target(), str(tmp_path / "ckpt"))
    assert torch.equal(loaded["w"], torch.arange(6.0))
    assert torch.equal(loaded["extra"]["scale"], torch.ones(2))


def test_crafted_metadata_is_refused_by_megatron_load(megatron_tp1, tmp_path):
    from megatron.core import dist_checkpointing

    target = _megatron_checkpoint(tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(_RunsShell(f"touch {marker}")))
    # torch wraps the error in a CheckpointException (a BaseException); the message survives
    with pytest.raises(BaseException, match=r"ckpt/\.metadata: refusing to load global posix\.system"):
        dist_checkpointing.load(target(), str(tmp_path / "ckpt"))
    assert not marker.exists()


def test_crafted_byte_item_is_refused(megatron_tp1, tmp_path):
    """The ShardedObject's bytes point at a pickle that would run a command under torch.load."""
    from megatron.core import dist_checkpointing

    folder = tmp_path / "ckpt"
    target = _megatron_checkpoint(folder)
    metadata = FileSystemReader(str(folder)).read_metadata()
    payload = io.BytesIO()
    torch.save(_RunsShell(f"touch {tmp_path / 'pwned'}"), payload)
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith("extra"):
            with open(folder / info.relative_path, "ab") as data:
                offset = data.seek(0, os.SEEK_END)
                data.write(payload.getvalue())
            metadata.storage_data[index] = _StorageInfo(info.relative_path, offset, len(payload.getvalue()))
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(BaseException, match=r"checkpoint item extra/shard_0_1: refusing a pickled object \(Trying to load unsupported GLOBAL posix\.system"):
        dist_checkpointing.load(target(), str(folder))
    assert not (tmp_path / "pwned").exists()


def test_crafted_metadata_is_refused_by_the_converter_reader(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    marker = tmp_path / "pwned"
    (folder / ".metadata").write_bytes(pickle.dumps(_RunsShell(f"touch {marker}")))
    with pytest.raises(UnsafeCheckpointError, match=r"refusing to load global posix\.system"):
        read_tensor_metadata(folder)
    assert not marker.exists()


def test_truncated_metadata_names_the_file(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(pickle.dumps({"a": 1})[:5])
    with pytest.raises(UnsafeCheckpointError, match=r"ckpt/\.metadata: corrupt torch_dist metadata"):
        read_tensor_metadata(folder)


@pytest.mark.multiprocess
@pytest.mark.parametrize("command", [
    ["convert", "megatron-to-hf", "{ckpt}", "{out}"],
    ["export-fp8", "{ckpt}", "{out}", "--source", "megatron"],
])
def test_cli_refuses_crafted_metadata(tmp_path, command):
    """The command-line converters (a fresh process each) refuse it too; the HF config beside it
    is genuine so the metadata is the first thing read."""
    from tests.helpers.tiny_hf import save_tiny_hf

    folder = tmp_path / "ckpt"
    save_tiny_hf("qwen2", folder / "hf")
    marker = tmp_path / "pwned"
    (folder / ".metadata").write_bytes(pickle.dumps(_RunsShell(f"touch {marker}")))
    argv = [a.format(ckpt=folder, out=tmp_path / "out") for a in command]
    result = subprocess.run([sys.executable, "-m", "megatron_fp8rl.cli", *argv, "--no-progress"],
                            capture_output=True, text=True, cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert result.returncode != 0
    assert "refusing to load global posix.system" in result.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()
