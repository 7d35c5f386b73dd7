"""Command-line entry points: `megatron-fp8rl <command>`.

Owns: argv parsing, process start-up (through launch.py) and wiring components together. The only
layer (L4, with launch.py) that reads the environment or creates process groups.
Subcommands: `demo` (the CPU demo; run it under torchrun for TP/PP/DP).
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path


def _add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensor-parallel", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pipeline-parallel", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--seed", type=int, default=1234, help="model initialization seed")


def _demo(args: argparse.Namespace) -> int:
    from megatron_fp8rl.launch import init_distributed, shutdown_distributed
    from megatron_fp8rl.trainer.demo import DemoConfig, run_demo

    layout = init_distributed(args.tensor_parallel, args.pipeline_parallel, seed=args.seed)
    cfg = DemoConfig(steps=args.steps, run_dir=Path(args.run_dir))
    summary = run_demo(cfg, is_logging_rank=layout.rank == 0)
    if layout.rank == 0:
        summary.update(tensor_parallel=layout.tensor_parallel,
                       pipeline_parallel=layout.pipeline_parallel,
                       data_parallel=layout.data_parallel, tensorboard=str(cfg.run_dir))
        print(json.dumps(summary, indent=2))
    shutdown_distributed()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-fp8rl", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train the tiny Megatron GPT on the built-in CPU task")
    _add_layout_arguments(demo)
    demo.add_argument("--steps", type=int, default=200, help="optimizer steps")
    demo.add_argument("--run-dir", default="runs/demo", help="tensorboard log directory")
    demo.set_defaults(func=_demo)
    return parser


def _quiet_known_library_warnings() -> None:
    """Megatron warns at import that apex/TE are absent and about deprecated gloo collectives;
    on the CPU tier that is expected and would bury the progress bar."""
    for pattern in (".*Apex (are|is) not installed", "full scope is deprecated",
                    ".*is deprecated. Please use `torch.distributed", "The .grad attribute of a Tensor"):
        warnings.filterwarnings("ignore", message=pattern)


def main(argv: list[str] | None = None) -> int:
    _quiet_known_library_warnings()
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
