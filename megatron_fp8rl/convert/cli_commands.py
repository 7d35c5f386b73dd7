"""Command-line arguments and dispatch for `megatron-fp8rl convert ...` and the tools/ scripts.

Owns: `add_convert_arguments(subparsers)` (the `convert hf-to-megatron` and
`convert megatron-to-hf` subcommands), `run_convert(args, build_meta_model)`, and
`add_export_fp8_arguments(parser)` / `run_export_fp8(args)` (`export-fp8`).
The HF -> Megatron direction needs the target GPTModel's layout; the entry point passes
`build_meta_model(hf_config, tensor_parallel, pipeline_parallel)`: it starts nothing itself and
returns the GPTModel built on the meta device at TP=1/PP=1, after checking that the checkpoint
will load at the given TP/PP: megatron_fp8rl.models.hf.build_conversion_target
(tools/convert_hf_to_megatron.py shows the wiring).
Must not import: rollout, data, trainer, cli.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

MetaModelBuilder = Callable[[dict, int, int], "torch.nn.Module"]
"""(HF config dict, target TP, target PP) -> GPTModel on the meta device at TP=1/PP=1."""

DTYPE_NAMES = ("bfloat16", "float16", "float32")
EXPORT_SCHEMES = ("block", "tensor")
"""fp8_export.SCHEMES, repeated here so that building the parser imports neither torch nor
megatron (`--help` in well under a second; tests/test_cli.py checks both agree)."""
DEFAULT_SHARD_GB = 5.0
"""megatron_to_hf.DEFAULT_SHARD_BYTES in GiB (checked alike)."""


def _dtype(name: str | None):
    import torch

    return getattr(torch, name) if name else None


def add_hf_to_megatron_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `convert hf-to-megatron` (also tools/convert_hf_to_megatron.py)."""
    parser.add_argument("hf_dir", type=Path, help="HF checkpoint folder (config.json + safetensors)")
    parser.add_argument("output_dir", type=Path, help="torch_dist checkpoint folder to create")
    parser.add_argument("--tensor-parallel", type=int, default=1,
                        help="check the checkpoint will load at this TP (it loads at any valid TP)")
    parser.add_argument("--pipeline-parallel", type=int, default=1,
                        help="check the checkpoint will load at this PP (it loads at any valid PP)")
    _add_common(parser)
    parser.add_argument("--threads", type=int, default=1, help="writer threads (files)")


def add_megatron_to_hf_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `convert megatron-to-hf` (also tools/convert_megatron_to_hf.py)."""
    parser.add_argument("megatron_dir", type=Path, help="torch_dist checkpoint folder (any TP/PP)")
    parser.add_argument("output_dir", type=Path, help="HF checkpoint folder to create")
    parser.add_argument("--hf-config", type=Path, default=None,
                        help="folder with the model's config.json and tokenizer "
                             "(default: the hf/ folder stored in the checkpoint)")
    parser.add_argument("--key-prefix", default="",
                        help="prefix of the model keys in the checkpoint, e.g. 'model.'")
    parser.add_argument("--max-shard-gb", type=float, default=DEFAULT_SHARD_GB,
                        help="largest safetensors file, in GiB")
    _add_common(parser)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                        help="stored element type (default: keep the source's)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_convert_arguments(subparsers) -> None:
    """Add `convert {hf-to-megatron,megatron-to-hf}` to an argparse subparsers object."""
    convert = subparsers.add_parser("convert", help="convert checkpoints between HF and Megatron")
    directions = convert.add_subparsers(dest="direction", required=True)
    add_hf_to_megatron_arguments(directions.add_parser(
        "hf-to-megatron", help="HF safetensors -> Megatron torch_dist"))
    add_megatron_to_hf_arguments(directions.add_parser(
        "megatron-to-hf", help="Megatron torch_dist (any TP/PP) -> HF safetensors"))


def run_hf_to_megatron(args: argparse.Namespace, build_meta_model: MetaModelBuilder) -> None:
    """Run `convert hf-to-megatron` (the caller has started a one-process group)."""
    from megatron_fp8rl.convert.hf_to_megatron import convert_hf_to_megatron

    hf_config = json.loads((Path(args.hf_dir) / "config.json").read_text())
    model = build_meta_model(hf_config, args.tensor_parallel, args.pipeline_parallel)
    plan = convert_hf_to_megatron(args.hf_dir, args.output_dir, model.sharded_state_dict(),
                                  overwrite=args.overwrite, dtype=_dtype(args.dtype),
                                  progress=not args.no_progress, threads=args.threads)
    print(f"wrote {len(plan.tasks)} tensor chunks to {args.output_dir}")


def run_megatron_to_hf(args: argparse.Namespace) -> None:
    """Run `convert megatron-to-hf` (needs no process group)."""
    from megatron_fp8rl.convert.megatron_to_hf import convert_megatron_to_hf

    weight_map = convert_megatron_to_hf(
        args.megatron_dir, args.output_dir, hf_config_dir=args.hf_config,
        overwrite=args.overwrite, dtype=_dtype(args.dtype), key_prefix=args.key_prefix,
        max_shard_bytes=int(args.max_shard_gb * 2**30), progress=not args.no_progress)
    print(f"wrote {len(weight_map)} HF tensors to {args.output_dir}")


def run_convert(args: argparse.Namespace, build_meta_model: MetaModelBuilder | None = None) -> int:
    """Dispatch `convert <direction>`; returns the exit status."""
    if args.direction == "hf-to-megatron":
        if build_meta_model is None:
            raise ValueError("convert hf-to-megatron needs build_meta_model from the entry point")
        run_hf_to_megatron(args, build_meta_model)
    else:
        run_megatron_to_hf(args)
    return 0


def add_export_fp8_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `export-fp8` (also tools/export_fp8.py)."""
    parser.add_argument("source_dir", type=Path, help="HF folder or torch_dist checkpoint")
    parser.add_argument("output_dir", type=Path, help="FP8 HF folder to create")
    parser.add_argument("--source", choices=["hf", "megatron"], default="hf")
    parser.add_argument("--hf-config", type=Path, default=None,
                        help="folder with config.json/tokenizer (default: the source's)")
    parser.add_argument("--key-prefix", default="", help="model key prefix in a Megatron checkpoint")
    parser.add_argument("--scheme", choices=EXPORT_SCHEMES, default="block",
                        help="block: 128x128 weight_scale_inv; tensor: per-tensor weight_scale")
    parser.add_argument("--activation-scheme", choices=["dynamic", "static"], default="dynamic")
    parser.add_argument("--calibration-prompts", type=Path, default=None,
                        help="text file, one prompt per line: static input scales from max |x| "
                             "(HF source; uses its tokenizer)")
    parser.add_argument("--bounds", type=Path, default=None,
                        help="JSON {module: {weight, input}} bounds from the calibrated recipe")
    parser.add_argument("--keep-first-layers", type=int, default=0, help="leave N first layers in BF16")
    parser.add_argument("--keep-last-layers", type=int, default=0, help="leave N last layers in BF16")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_export_fp8(args: argparse.Namespace) -> int:
    """Run `export-fp8` (needs no process group)."""
    from megatron_fp8rl.convert.fp8_calibration import calibrate_input_bounds, load_bounds
    from megatron_fp8rl.convert.fp8_export import Fp8ExportOptions, export_fp8

    bounds = load_bounds(args.bounds) if args.bounds else {}
    if args.calibration_prompts:
        prompts = [p for p in args.calibration_prompts.read_text().splitlines() if p.strip()]
        calibrated = calibrate_input_bounds(args.hf_config or args.source_dir, prompts)
        for module, entry in calibrated.items():
            bounds.setdefault(module, {}).setdefault("input", entry["input"])
    options = Fp8ExportOptions(scheme=args.scheme, activation_scheme=args.activation_scheme,
                               keep_first_layers=args.keep_first_layers,
                               keep_last_layers=args.keep_last_layers, bounds=bounds)
    weight_map = export_fp8(args.source_dir, args.output_dir, options, source=args.source,
                            hf_config_dir=args.hf_config, overwrite=args.overwrite,
                            key_prefix=args.key_prefix, progress=not args.no_progress)
    print(f"wrote {len(weight_map)} tensors to {args.output_dir}")
    return 0
