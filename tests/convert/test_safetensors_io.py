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


@pytest.mark.parametrize("kernel_copy", [True, False])
def test_copy_bytes_places_row_ranges_like_safetensors(tmp_path, monkeypatch, kernel_copy):
    """Rows copied file to file (copy_file_range, or pread/pwrite where the kernel refuses it)
    land at the requested offsets and equal the rows safetensors reads."""
    import errno
    import os

    from megatron_fp8rl.convert.safetensors_io import copy_bytes

    if not kernel_copy:
        def refuse(*args, **kwargs):
            raise OSError(errno.EXDEV, "cross-device")
        monkeypatch.setattr(os, "copy_file_range", refuse, raising=False)
    tensors = _tensors()
    save_file(tensors, tmp_path / "model.safetensors")
    checkpoint = HFCheckpoint(tmp_path)
    with open(tmp_path / "out.bin", "wb") as out:
        out.write(b"x" * 3)
        for name, start, stop, at in [("a", 1, 4, 10), ("d", 0, 3, 100), ("b", 2, 7, 50)]:
            copy_bytes(*checkpoint.row_bytes(name, start, stop), out.fileno(), at)
        assert out.tell() == 3  # the file position is left alone
    data = (tmp_path / "out.bin").read_bytes()
    assert data[:3] == b"xxx"
    for name, start, stop, at in [("a", 1, 4, 10), ("d", 0, 3, 100), ("b", 2, 7, 50)]:
        want = tensors[name][start:stop].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        assert data[at:at + len(want)] == want


def test_copy_bytes_from_truncated_file_names_it(tmp_path):
    from megatron_fp8rl.convert.safetensors_io import copy_bytes

    save_file(_tensors(), tmp_path / "model.safetensors")
    path, offset, nbytes = HFCheckpoint(tmp_path).row_bytes("b", 0, 7)
    size = (tmp_path / "model.safetensors").stat().st_size
    with open(tmp_path / "out.bin", "wb") as out, \
            pytest.raises(CheckpointError, match=r"corrupt safetensors file .*model\.safetensors: unexpected end"):
        copy_bytes(path, size - 4, nbytes, out.fileno(), 0)
