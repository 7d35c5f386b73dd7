"""Convert a Megatron-Core torch_dist checkpoint (saved at any TP/PP) into an HF checkpoint.

    python tools/convert_megatron_to_hf.py MEGATRON_DIR OUT_DIR [--hf-config DIR] [--overwrite]

Runs as one process without a process group. Same as `megatron-fp8rl convert megatron-to-hf`.
"""
from __future__ import annotations

import argparse
import os
import sys

from megatron_fp8rl.compat import versions
from megatron_fp8rl.convert.cli_commands import add_megatron_to_hf_arguments, run_megatron_to_hf
from megatron_fp8rl.convert.safetensors_io import CheckpointError
from megatron_fp8rl.models.family import UnsupportedModelError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_megatron_to_hf_arguments(parser)
    args = parser.parse_args(argv)
    versions.gate(os.environ)
    try:
        run_megatron_to_hf(args)
    except (CheckpointError, UnsupportedModelError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
