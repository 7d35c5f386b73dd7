"""Our streaming safetensors reader and writer agree with the safetensors library."""
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_fp8rl.convert.safetensors_io import CheckpointError, HFCheckpoint, SafetensorsWriter


def _tensors():
    gen = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(5, 3, generator=gen).to(torch.bfloat16),
        "b": torch.randn(7, generator=gen),
        "c": torch.randn(2, 4, generator=gen).to(torch.float8_e4m3fn),
        "d": torch.arange(6, dtype=torch.int64).reshape(3, 2),
    }


def test_writer_output_reads_back_with_safetensors(tmp_path):
    tensors = _tensors()
    writer = SafetensorsWriter(tmp_path / "x.safetensors", [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()])
    for name in reversed(list(tensors)):  # any order
        writer.write(name, tensors[name])
    writer.close()
    with safe_open(tmp_path / "x.safetensors", "pt") as f:
        assert sorted(f.keys()) == sorted(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(f.get_tensor(name).view(torch.uint8), tensor.view(torch.uint8))


def test_reader_rows_match_safetensors(tmp_path):
    tensors = _tensors()
    save_file(tensors, tmp_path / "model.safetensors")
    checkpoint = HFCheckpoint(tmp_path)
    out = torch.empty(2, 3, dtype=torch.bfloat16)
    checkpoint.read_rows("a", 2, 4, out)
    assert torch.equal(out, tensors["a"][2:4])
    assert checkpoint.entries["c"].shape == (2, 4) and checkpoint.entries["c"].dtype == torch.float8_e4m3fn


def test_writer_refuses_undeclared_and_unwritten(tmp_path):
    writer = SafetensorsWriter(tmp_path / "x.safetensors", [("a", torch.float32, (2,))])
    with pytest.raises(CheckpointError, match="tensor b was not declared"):
        writer.write("b", torch.zeros(2))
    with pytest.raises(CheckpointError, match=r"tensor a: declared \(2,\)"):
        writer.write("a", torch.zeros(3))
    with pytest.raises(CheckpointError, match=r"never written: \['a'\]"):
        writer.close()
