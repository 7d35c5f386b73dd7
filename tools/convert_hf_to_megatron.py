"""Convert an HF checkpoint (Llama 3.x, Qwen2/2.5, Qwen3) into a Megatron-Core torch_dist checkpoint.

    python tools/convert_hf_to_megatron.py HF_DIR OUT_DIR [--overwrite] [--dtype bfloat16]

The output loads at any TP/PP (`--tensor-parallel/--pipeline-parallel` only check a layout up
front). Runs as one process. Same as `megatron-fp8rl convert hf-to-megatron`.
"""
from __future__ import annotations

import argparse
import sys

from megatron_fp8rl.convert.cli_commands import add_hf_to_megatron_arguments, run_hf_to_megatron
from megatron_fp8rl.convert.safetensors_io import CheckpointError
from megatron_fp8rl.models.family import UnsupportedModelError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_hf_to_megatron_arguments(parser)
    args = parser.parse_args(argv)
    from megatron_fp8rl.launch import init_distributed, shutdown_distributed
    from megatron_fp8rl.models.hf import build_conversion_target

    init_distributed(1, 1)
    try:
        run_hf_to_megatron(args, build_conversion_target)
    except (CheckpointError, UnsupportedModelError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
