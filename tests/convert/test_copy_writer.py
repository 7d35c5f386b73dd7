"""The torch_dist files the HF -> Megatron conversion writes file to file (copy_file_range into
holes torch.save leaves under skip_data) hold, record by record, what torch.save of the assembled
chunk holds: the same zip layout, the same records (bar the per-save serialization id), the same
storage bytes (its zip CRC is left zero), and the same tensor when torch.load reads it. The assembled chunk is read_chunk's (plain reads, QKV interleave and gate/up fuse in
memory), an independent path. Qwen3 has both interleaved and fused tensors. In process, one rank."""
import io
import json
import zipfile

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from megatron_fp8rl.convert.hf_to_megatron import convert_hf_to_megatron, read_chunk
from megatron_fp8rl.convert.safetensors_io import HFCheckpoint
from megatron_fp8rl.models.hf import build_model_from_hf
from tests.helpers.tiny_hf import save_tiny_hf


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, megatron_tp1):
    hf_dir = save_tiny_hf("qwen3", tmp_path_factory.mktemp("copy_writer") / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    return hf_dir, lambda: build_model_from_hf(config, device="meta").sharded_state_dict()


def _records(directory):
    """{(key, offsets): record bytes} of every tensor chunk of a torch_dist folder, and the files."""
    metadata = FileSystemReader(directory).read_metadata()
    records, files = {}, set()
    for index, info in metadata.storage_data.items():
        files.add(info.relative_path)
        with open(directory / info.relative_path, "rb") as f:
            f.seek(info.offset)
            records[(index.fqn, tuple(index.offset or ()))] = f.read(info.length)
    return records, files


@pytest.mark.parametrize("threads", [1, 2])
def test_copied_records_are_torch_save_of_the_assembled_chunk(qwen3, tmp_path, threads):
    hf_dir, target = qwen3
    plan = convert_hf_to_megatron(hf_dir, tmp_path / "mcore", target(), progress=False, threads=threads)
    records, files = _records(tmp_path / "mcore")
    assert len(files) == threads
    checkpoint = HFCheckpoint(hf_dir)
    assert any(len(task.sources) > 2 for task in plan.tasks.values())  # QKV interleaved per group
    for key, task in plan.tasks.items():
        record = records[key]
        expected = read_chunk(task, checkpoint)
        assert torch.equal(torch.load(io.BytesIO(record), weights_only=True).view(torch.uint8),
                           expected.view(torch.uint8)), key
        reference = io.BytesIO()
        torch.save(expected, reference)
        assert len(record) == len(reference.getvalue()), key
        ours, theirs = zipfile.ZipFile(io.BytesIO(record)), zipfile.ZipFile(reference)
        layout = [(i.filename, i.header_offset, i.file_size, i.compress_type) for i in theirs.infolist()]
        assert [(i.filename, i.header_offset, i.file_size, i.compress_type)
                for i in ours.infolist()] == layout, key
        for info in ours.infolist():
            if info.filename.endswith("/data/0"):  # the storage: compared above, CRC not written
                assert info.CRC == 0, key
            elif not info.filename.endswith("/.data/serialization_id"):  # hashed from the CRCs
                assert ours.read(info) == theirs.read(info.filename), (key, info.filename)  # CRC-checked


def test_cast_chunks_are_plain_torch_save(qwen3, tmp_path):
    hf_dir, target = qwen3
    plan = convert_hf_to_megatron(hf_dir, tmp_path / "mcore", target(), progress=False,
                                  dtype=torch.float32)
    records, _ = _records(tmp_path / "mcore")
    checkpoint = HFCheckpoint(hf_dir)
    for key, task in plan.tasks.items():
        reference = io.BytesIO()
        torch.save(read_chunk(task, checkpoint), reference)
        assert records[key] == reference.getvalue(), key
