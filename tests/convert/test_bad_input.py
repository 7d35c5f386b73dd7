"""Conversion refuses bad input with errors that name the tensor (and both shapes), and never
leaves partial output: unknown architectures, missing/unexpected/mis-shaped tensors in either
direction, corrupt safetensors, existing outputs, interrupted runs. In process, one rank."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_fp8rl.convert import hf_to_megatron, megatron_to_hf
from megatron_fp8rl.convert.fp8_export import Fp8ExportOptions, export_fp8
from megatron_fp8rl.convert.hf_to_megatron import convert_hf_to_megatron
from megatron_fp8rl.convert.megatron_to_hf import convert_megatron_to_hf
from megatron_fp8rl.convert.outputs import OutputExistsError, OutputOverlapsInputError
from megatron_fp8rl.convert.safetensors_io import CheckpointError
from megatron_fp8rl.models.family import UnsupportedModelError
from megatron_fp8rl.models.hf import build_model_from_hf
from tests.helpers.processes import REPO, meet_permission_bits
from tests.helpers.tiny_hf import save_tiny_hf

K_PROJ = "model.layers.1.self_attn.k_proj.weight"


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, megatron_tp1):
    """(HF folder, its sharded_state_dict factory, converted torch_dist folder)."""
    root = tmp_path_factory.mktemp("bad_input")
    hf_dir = save_tiny_hf("qwen2", root / "hf")
    config = json.loads((hf_dir / "config.json").read_text())

    def target():
        return build_model_from_hf(config, device="meta").sharded_state_dict()

    convert_hf_to_megatron(hf_dir, root / "mcore", target(), progress=False)
    return hf_dir, target, root / "mcore"


def _edited_copy(hf_dir: Path, tmp_path: Path, edit) -> Path:
    """A copy of `hf_dir` whose tensors went through `edit(dict)`."""
    out = tmp_path / "edited"
    shutil.copytree(hf_dir, out)
    tensors = load_file(out / "model.safetensors")
    edit(tensors)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _assert_no_output(path: Path) -> None:
    assert not path.exists()
    assert not [p for p in path.parent.iterdir() if p.name.startswith(f".{path.name}.")]


def test_missing_hf_tensor_is_named(qwen2, tmp_path):
    hf_dir, target, _ = qwen2
    edited = _edited_copy(hf_dir, tmp_path, lambda t: t.pop(K_PROJ))
    with pytest.raises(CheckpointError, match=rf"missing HF tensor {K_PROJ} \(expected shape \(32, 64\)"):
        convert_hf_to_megatron(edited, tmp_path / "out", target(), progress=False)
    _assert_no_output(tmp_path / "out")


def test_a_missing_shard_of_a_parallel_target_is_named(qwen2, tmp_path):
    """The chunks given (a parallel model's shards: other_shards) must cover every tensor."""
    hf_dir, target, _ = qwen2
    shards = hf_to_megatron.main_replica_shards(target())
    dropped = next(s for s in shards if s.key == "decoder.layers.mlp.linear_fc2.weight")
    with pytest.raises(CheckpointError, match=r"decoder\.layers\.mlp\.linear_fc2\.weight: the chunks given cover "
                                              r"\d+ of its \d+ elements"):
        convert_hf_to_megatron(hf_dir, tmp_path / "out", {}, progress=False,
                               other_shards=[s for s in shards if s is not dropped])
    _assert_no_output(tmp_path / "out")


def test_unexpected_hf_tensor_is_named(qwen2, tmp_path):
    hf_dir, target, _ = qwen2
    edited = _edited_copy(hf_dir, tmp_path, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"unexpected HF tensors.*model\.layers\.0\.extra\.weight \(3,\)"):
        convert_hf_to_megatron(edited, tmp_path / "out", target(), progress=False)


def test_shape_mismatch_names_tensor_and_both_shapes(qwen2, tmp_path):
    hf_dir, target, _ = qwen2
    edited = _edited_copy(hf_dir, tmp_path, lambda t: t.update({K_PROJ: torch.zeros(16, 64, dtype=torch.bfloat16)}))
    with pytest.raises(CheckpointError, match=rf"{K_PROJ}: expected shape \(32, 64\).*found \(16, 64\)"):
        convert_hf_to_megatron(edited, tmp_path / "out", target(), progress=False)


@pytest.mark.parametrize("damage, match", [
    (lambda raw: raw[: len(raw) - 100], "truncated"),
    (lambda raw: raw[:8] + b"#" + raw[9:], "header is not JSON"),
    (lambda raw: raw[:5], "shorter than the 8-byte header"),
])
def test_corrupt_safetensors_is_a_clear_error(qwen2, tmp_path, damage, match):
    hf_dir, target, _ = qwen2
    shutil.copytree(hf_dir, tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(CheckpointError, match=f"corrupt safetensors file .*model.safetensors: .*{match}"):
        convert_hf_to_megatron(tmp_path / "hf", tmp_path / "out", target(), progress=False)


def test_unknown_architecture_lists_supported(qwen2, tmp_path):
    hf_dir, target, _ = qwen2
    shutil.copytree(hf_dir, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        convert_hf_to_megatron(tmp_path / "hf", tmp_path / "out", target(), progress=False)


def test_existing_output_refused_unless_overwrite(qwen2, tmp_path):
    hf_dir, target, mcore = qwen2
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    with pytest.raises(OutputExistsError, match="--overwrite"):
        convert_hf_to_megatron(hf_dir, tmp_path / "out", target(), progress=False)
    with pytest.raises(OutputExistsError, match="--overwrite"):
        convert_megatron_to_hf(mcore, tmp_path / "out", progress=False)
    assert (tmp_path / "out" / "keep").exists()
    convert_hf_to_megatron(hf_dir, tmp_path / "out", target(), overwrite=True, progress=False)
    assert not (tmp_path / "out" / "keep").exists() and (tmp_path / "out" / ".metadata").exists()


@pytest.mark.parametrize("where", ["same", "inside", "around"])
def test_output_overlapping_the_input_is_refused_even_with_overwrite(qwen2, tmp_path, where):
    """--overwrite on the input itself, a folder inside it or one holding it would destroy it."""
    hf_dir, target, mcore = qwen2
    copies = {name: shutil.copytree(src, tmp_path / "inputs" / name) for name, src in
              (("hf", hf_dir), ("mcore", mcore))}
    before = {p: p.read_bytes() for folder in copies.values() for p in folder.rglob("*") if p.is_file()}

    def output(source):
        return {"same": source, "inside": source / "out", "around": tmp_path / "inputs"}[where]
    calls = [
        lambda: convert_hf_to_megatron(copies["hf"], output(copies["hf"]), target(), overwrite=True,
                                       progress=False),
        lambda: convert_megatron_to_hf(copies["mcore"], output(copies["mcore"]), overwrite=True,
                                       progress=False),
        lambda: export_fp8(copies["mcore"], output(copies["mcore"]), Fp8ExportOptions(),
                           source="megatron", overwrite=True, progress=False),
        lambda: export_fp8(copies["hf"], output(copies["hf"]), Fp8ExportOptions(), overwrite=True,
                           progress=False),
    ]
    for call in calls:
        with pytest.raises(OutputOverlapsInputError, match="overlaps the input .*would destroy the input"):
            call()
    assert before == {p: p.read_bytes() for p in before}


def _interrupt_after(calls: int, function):
    count = {"n": 0}

    def wrapper(*args, **kwargs):
        count["n"] += 1
        if count["n"] > calls:
            raise KeyboardInterrupt
        return function(*args, **kwargs)
    return wrapper


@pytest.mark.parametrize("threads", [1, 2])
def test_interrupted_conversion_leaves_no_output(qwen2, tmp_path, monkeypatch, threads):
    hf_dir, target, mcore = qwen2
    # chunks kept in the HF dtype are copied file to file; cast ones go through read_chunk
    monkeypatch.setattr(hf_to_megatron, "copy_bytes", _interrupt_after(3, hf_to_megatron.copy_bytes))
    with pytest.raises(KeyboardInterrupt):
        convert_hf_to_megatron(hf_dir, tmp_path / "mcore", target(), progress=False, threads=threads)
    _assert_no_output(tmp_path / "mcore")
    monkeypatch.setattr(hf_to_megatron, "read_chunk", _interrupt_after(3, hf_to_megatron.read_chunk))
    with pytest.raises(KeyboardInterrupt):
        convert_hf_to_megatron(hf_dir, tmp_path / "mcore", target(), progress=False,
                               dtype=torch.float32, threads=threads)
    _assert_no_output(tmp_path / "mcore")
    monkeypatch.setattr(megatron_to_hf, "read_unit", _interrupt_after(3, megatron_to_hf.read_unit))
    with pytest.raises(KeyboardInterrupt):
        convert_megatron_to_hf(mcore, tmp_path / "hf", progress=False)
    _assert_no_output(tmp_path / "hf")


def _config_dir(hf_dir: Path, tmp_path: Path, **changes) -> Path:
    out = tmp_path / "config"
    out.mkdir()
    config = json.loads((hf_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    return out


@pytest.mark.parametrize("changes, match", [
    ({"architectures": ["LlamaForCausalLM"]}, r"unexpected Megatron tensors .*decoder\.layers\.self_attention\.linear_qkv\.bias"),
    ({"tie_word_embeddings": False}, r"missing Megatron tensor output_layer\.weight"),
    ({"num_hidden_layers": 3}, r"linear_qkv.*: 2 layers, config num_hidden_layers=3"),
    ({"num_key_value_heads": 1}, r"linear_qkv.weight: 128 rows, but the qkv layout .* makes 96"),
])
def test_megatron_checkpoint_not_matching_config(qwen2, tmp_path, changes, match):
    hf_dir, _, mcore = qwen2
    with pytest.raises(CheckpointError, match=match):
        convert_megatron_to_hf(mcore, tmp_path / "out", hf_config_dir=_config_dir(hf_dir, tmp_path, **changes),
                               progress=False)
    _assert_no_output(tmp_path / "out")


def test_not_a_megatron_checkpoint(qwen2, tmp_path):
    hf_dir, _, _ = qwen2
    with pytest.raises(CheckpointError, match="not a torch_dist checkpoint"):
        convert_megatron_to_hf(hf_dir, tmp_path / "out", hf_config_dir=hf_dir, progress=False)


def test_stale_partials_of_killed_writers_are_removed_at_the_next_start(qwen2, tmp_path):
    """kill -9 mid-conversion leaves `.out.partial-<pid>`; the next conversion of `out` removes it
    (and only temporaries of processes that no longer exist)."""
    import subprocess

    hf_dir, target, _ = qwen2
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f".out.partial-{dead.pid}"
    (stale / "sub").mkdir(parents=True)
    alive = tmp_path / f".out.partial-{os.getppid()}"
    alive.mkdir()
    convert_hf_to_megatron(hf_dir, tmp_path / "out", target(), progress=False)
    assert not stale.exists() and alive.exists() and (tmp_path / "out" / ".metadata").is_file()


_EACH_COMMAND = """
import json, sys
from megatron_fp8rl.cli import main
for argv in json.loads(sys.argv[1]):
    print("exit", main(argv), file=sys.stderr, flush=True)
"""
_WRITE_AFTER_LOSING_PERMISSION = """
import sys
from pathlib import Path
from megatron_fp8rl.convert.outputs import atomic_output
with atomic_output(Path(sys.argv[1])) as tmp:
    tmp.chmod(0o555)  # the temporary becomes unwritable under the writer
    (tmp / "model.safetensors").write_bytes(b"")
"""


def _unprivileged(*argv: str) -> subprocess.CompletedProcess:
    """One Python process (the CLI's imports once) meeting file permission bits even as root."""
    return subprocess.run([sys.executable, "-c", *argv], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          preexec_fn=meet_permission_bits)


@pytest.mark.multiprocess
def test_unwritable_output_is_refused_naming_it_not_the_hidden_temporary(qwen2, tmp_path):
    """convert (both directions) and export-fp8 into a folder this process may not write: a one-line
    error (exit 2) naming the user's output and 'permission denied', before any work; nothing written.
    Before: a traceback naming `.out.partial-<pid>` after the whole conversion."""
    hf_dir, _, mcore = qwen2
    readonly = tmp_path / "readonly"
    readonly.mkdir(mode=0o555)
    out = readonly / "out"
    commands = [["convert", "hf-to-megatron", str(hf_dir), str(out), "--no-progress"],
                ["convert", "megatron-to-hf", str(mcore), str(out), "--no-progress"],
                ["export-fp8", str(hf_dir), str(out), "--no-progress"],
                ["export-fp8", str(mcore), str(out), "--source", "megatron", "--no-progress"]]
    done = _unprivileged(_EACH_COMMAND, json.dumps(commands))
    want = f"error: cannot write output {out}: permission denied: cannot create entries in {readonly}"
    assert done.stderr.count(want + "\nexit 2") == len(commands), done.stderr[-3000:]
    assert ".partial" not in done.stderr and list(readonly.iterdir()) == []


def test_a_failed_write_inside_the_temporary_names_the_output(tmp_path):
    out = tmp_path / "out"
    done = _unprivileged(_WRITE_AFTER_LOSING_PERMISSION, str(out))
    assert (f"OutputNotWritableError: cannot write output {out} (writing model.safetensors): "
            "Permission denied") in done.stderr, done.stderr[-3000:]
    assert not out.exists() and list(tmp_path.iterdir()) == []
