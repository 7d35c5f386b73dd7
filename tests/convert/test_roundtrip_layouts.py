"""HF -> Megatron -> HF is bit-exact for every architecture at TP in {1, 2} x PP in {1, 2}.

Each bf16 tiny HF checkpoint is converted to torch_dist in process (TP=1), loaded by Megatron
under torchrun at each layout (dist_checkpointing reshards on load; fp32 parameters), saved again
there (so the checkpoint's chunks follow that layout), converted back to HF in process and
compared tensor by tensor with the original: same names, shapes, dtypes and bits. One 4-process
torchrun run covers the four layouts (Megatron's parallel state is rebuilt per layout; smaller
layouts run with data-parallel replicas), since process start-up dominates on this machine.
The same run converts each HF checkpoint in process at each layout, as the trainer does
(trainer/actor.convert_initial_checkpoint: every rank sends its shard's chunks to rank 0), and
that checkpoint must hold the CLI converter's tensors (TP=1 meta model, one process).
"""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_fp8rl.convert.hf_to_megatron import convert_hf_to_megatron
from megatron_fp8rl.convert.megatron_to_hf import convert_megatron_to_hf
from megatron_fp8rl.models.hf import build_model_from_hf
from tests.helpers.processes import run_torchrun
from tests.helpers.tiny_hf import ARCHITECTURES, save_tiny_hf

WORKER = Path(__file__).resolve().parents[1] / "workers" / "convert_layouts.py"
LAYOUTS = {"tp1pp1": (1, 1), "tp2pp1": (2, 1), "tp1pp2": (1, 2), "tp2pp2": (2, 2)}


def _chunk_count(directory: Path, key: str) -> int:
    from torch.distributed.checkpoint import FileSystemReader

    return len(FileSystemReader(str(directory)).read_metadata().state_dict_metadata[key].chunks)


@pytest.fixture(scope="module")
def resaved(tmp_path_factory, megatron_tp1) -> Path:
    """WORKDIR/ARCH/{hf, mcore, resaved_<layout>...} for every architecture (4 processes)."""
    workdir = tmp_path_factory.mktemp("roundtrip")
    for arch in ARCHITECTURES:
        hf_dir = save_tiny_hf(arch, workdir / arch / "hf", dtype=torch.bfloat16)
        hf_config = json.loads((hf_dir / "config.json").read_text())
        meta = build_model_from_hf(hf_config, device="meta")
        convert_hf_to_megatron(hf_dir, workdir / arch / "mcore", meta.sharded_state_dict(), progress=False)
    run_torchrun(WORKER, 4, "--workdir", str(workdir), "--layouts", *LAYOUTS, "--archs", *ARCHITECTURES)
    return workdir


def _global_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint, whole (DCP reads across its chunks)."""
    import torch.distributed.checkpoint as dcp

    from megatron_fp8rl.convert.megatron_to_hf import dcp_reader

    reader = dcp_reader(directory)
    tensors = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
               for key, meta in reader.read_metadata().state_dict_metadata.items() if hasattr(meta, "size")}
    dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors


def assert_same_checkpoint(expected_dir: Path, got_dir: Path) -> None:
    expected, got = load_file(expected_dir / "model.safetensors"), load_file(got_dir / "model.safetensors")
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), f"{name} differs"
    assert json.loads((got_dir / "config.json").read_text()) == json.loads((expected_dir / "config.json").read_text())


@pytest.mark.multiprocess
@pytest.mark.parametrize("tag", sorted(LAYOUTS))
def test_roundtrip_bit_exact_at_layout(resaved: Path, tag: str):
    """4 processes (shared fixture): the checkpoint resaved at the layout converts back bit-exact."""
    for arch in ARCHITECTURES:
        back = resaved / arch / f"back_{tag}"
        convert_megatron_to_hf(resaved / arch / f"resaved_{tag}", back,
                               hf_config_dir=resaved / arch / "hf", progress=False)
        assert_same_checkpoint(resaved / arch / "hf", back)
        chunks = _chunk_count(resaved / arch / f"resaved_{tag}", "decoder.layers.mlp.linear_fc1.weight")
        assert chunks == LAYOUTS[tag][0] * 2 * 2, "the resaved checkpoint should be chunked per TP rank"


@pytest.mark.multiprocess
@pytest.mark.parametrize("tag", sorted(LAYOUTS))
def test_in_process_conversion_at_layout_equals_the_cli_converters(resaved: Path, tag: str):
    """4 processes (shared fixture): the trainer's in-process conversion at the layout writes the
    tensors the one-process converter (what `megatron-fp8rl convert hf-to-megatron` runs) wrote."""
    for arch in ARCHITECTURES:
        expected, got = _global_tensors(resaved / arch / "mcore"), _global_tensors(resaved / arch / f"initial_{tag}")
        assert sorted(got) == sorted(expected), arch
        for key, tensor in expected.items():
            assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), f"{arch} {key} differs"
