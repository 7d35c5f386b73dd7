"""Export an HF (BF16/FP32) or Megatron torch_dist checkpoint as an FP8 HF checkpoint for SGLang.

    python tools/export_fp8.py SRC OUT [--source hf|megatron] [--scheme block|tensor]
        [--activation-scheme static --calibration-prompts prompts.txt | --bounds bounds.json]
        [--keep-first-layers N] [--keep-last-layers N] [--overwrite]

Same as `megatron-fp8rl export-fp8`.
"""
from __future__ import annotations

import argparse
import os
import sys

from megatron_fp8rl.compat import versions
from megatron_fp8rl.convert.cli_commands import add_export_fp8_arguments, run_export_fp8
from megatron_fp8rl.convert.safetensors_io import CheckpointError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_export_fp8_arguments(parser)
    args = parser.parse_args(argv)
    versions.gate(os.environ)
    try:
        return run_export_fp8(args)
    except (CheckpointError, FileExistsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
