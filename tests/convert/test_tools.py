"""The command-line tools end to end, and the HF output as transformers sees it.

tools/convert_hf_to_megatron.py and tools/convert_megatron_to_hf.py run as subprocesses (one
process each): exit status 0, an existing output refused with status 2 and a message naming
--overwrite. The HF side is written in several safetensors shards (small --max-shard-gb) with an
index, and transformers loads that folder and gives the same logits as the original model.
"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.tiny_hf import VOCAB, save_tiny_hf

pytestmark = pytest.mark.multiprocess
TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _tool(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOLS / name), *map(str, args)], capture_output=True,
                          text=True, timeout=300, cwd=TOOLS.parent)


def test_tools_round_trip_and_transformers_loads_the_output(tmp_path):
    from transformers import AutoModelForCausalLM

    hf_dir = save_tiny_hf("qwen3", tmp_path / "hf", dtype=torch.float32)
    done = _tool("convert_hf_to_megatron.py", hf_dir, tmp_path / "mcore", "--no-progress",
                 "--tensor-parallel", "2", "--pipeline-parallel", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    refused = _tool("convert_hf_to_megatron.py", hf_dir, tmp_path / "mcore", "--no-progress")
    assert refused.returncode == 2 and "--overwrite" in refused.stderr
    done = _tool("convert_megatron_to_hf.py", tmp_path / "mcore", tmp_path / "back", "--no-progress",
                 "--max-shard-gb", str(100_000 / 2**30))
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(list((tmp_path / "back").glob("model-*-of-*.safetensors"))) > 1
    assert (tmp_path / "back" / "model.safetensors.index.json").exists()
    tokens = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(hf_dir).eval()(tokens).logits
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()(tokens).logits
    assert torch.equal(got, expected)


def test_bad_layout_is_refused_before_writing(tmp_path):
    hf_dir = save_tiny_hf("llama", tmp_path / "hf")
    done = _tool("convert_hf_to_megatron.py", hf_dir, tmp_path / "mcore", "--tensor-parallel", "4")
    assert done.returncode == 2 and "num_key_value_heads=2" in done.stderr
    assert not (tmp_path / "mcore").exists()
