"""Command-line entry points: `megatron-fp8rl <command>`.

Owns: argv parsing, process start-up (through launch.py) and wiring components together. The only
layer (L4, with launch.py) that reads the environment or creates process groups.
Subcommands:
  train        RL post-training from an HF checkpoint (YAML config + dotted overrides; torchrun)
  launch       `train` under torchrun, once its config, input files and run_dir have been checked
  demo         the tiny Megatron GPT on a built-in task (the smallest end-to-end check)
  convert      HF safetensors <-> Megatron torch_dist
  export-fp8   an FP8 HF checkpoint SGLang serves
  report       PNG plots and a markdown report from run directories' tensorboard logs
  stability    the FP8 stability study: one RL job under several precision arms and seeds, then report
Every command first passes the version gate (compat/versions.py; override MEGATRON_FP8RL_ALLOW_UNTESTED).
A user error (bad config value, missing or damaged input, refused output) prints as one line,
`error: ...`, exit status 2 (under torchrun, from rank 0 only); `--debug` shows the traceback
instead. torchrun itself adds its ChildFailedError traceback when a worker exits non-zero, so
`launch` checks what a worker would refuse before torchrun starts any.
"""
from __future__ import annotations

import argparse
import builtins
import json
import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import NoReturn

from megatron_fp8rl.compat import versions


USER_ERRORS = (
    ("megatron_fp8rl.config.loader", "ConfigError"),
    ("megatron_fp8rl.data.records", "DatasetError"),
    ("megatron_fp8rl.data.rewards", "RewardError"),
    ("megatron_fp8rl.convert.safetensors_io", "CheckpointError"),
    ("megatron_fp8rl.convert.outputs", "OutputExistsError"),
    ("megatron_fp8rl.convert.outputs", "OutputOverlapsInputError"),
    ("megatron_fp8rl.convert.outputs", "OutputNotWritableError"),
    ("megatron_fp8rl.compat.safe_dcp", "UnsafeCheckpointError"),
    ("megatron_fp8rl.models.family", "UnsupportedModelError"),
    ("megatron_fp8rl.trainer.run_dir", "RunDirError"),
    ("megatron_fp8rl.launch", "LaunchError"),
    ("megatron_fp8rl.report.logs", "ReportError"),
)
"""(module, class) of errors that mean the input is wrong, not the program. Looked up only in
modules already imported (an error can only come from a loaded module), so the parser stays light."""


def _is_user_error(exc: BaseException) -> bool:
    types = [getattr(sys.modules[module], name) for module, name in USER_ERRORS if module in sys.modules]
    return isinstance(exc, (FileNotFoundError, *types))


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


def _train(args: argparse.Namespace) -> int:
    from megatron_fp8rl.config.loader import load_config
    from megatron_fp8rl.launch import init_distributed, shutdown_distributed
    from megatron_fp8rl.rl.metrics import eval_verdict
    from megatron_fp8rl.trainer.config import RunConfig
    from megatron_fp8rl.trainer.loop import train
    from megatron_fp8rl.trainer.run_dir import hold_run_dir
    from megatron_fp8rl.trainer.stop import StopRequested
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # a run reads local checkpoints: its bar is the only one
    cfg = load_config(RunConfig, args.config, args.overrides)
    layout = init_distributed(cfg.model.tensor_parallel, cfg.model.pipeline_parallel, seed=cfg.train.seed)
    try:
        with hold_run_dir(Path(cfg.run_dir), layout.rank):  # one run per run_dir, for the run's life
            summary = train(cfg, layout.rank)
    except StopRequested as stopped:
        print(f"megatron-fp8rl train: {stopped}", file=sys.stderr)
        return 128 + stopped.signum
    finally:
        shutdown_distributed()
    if layout.rank == 0:
        print(json.dumps(summary, indent=2))
        print(eval_verdict(summary))
    return 0


TORCHRUN_OPTIONS = ("nproc-per-node", "nnodes", "node-rank", "master-addr", "master-port", "rdzv-backend",
                    "rdzv-endpoint", "rdzv-id", "max-restarts")
"""torchrun's options `launch` passes on (the layout and rendezvous of a run)."""


def _check_train(cfg, single_node: bool) -> None:
    """What a `train` worker refuses before its first slow step, checked in this process: input
    files, reward, FP8 backend, datasets, the run_dir's provenance and (`single_node`) its lock: on
    several nodes the run's own rank 0 may hold it already when a later node's launcher checks."""
    from megatron_fp8rl.trainer.run_dir import check_run_dir, check_run_dir_free
    from megatron_fp8rl.trainer.start import check_inputs, run_records

    check_inputs(cfg)
    run_records(cfg)  # both datasets, and the held-out problems disjoint from the training prompts
    check_run_dir(cfg)
    if single_node:
        check_run_dir_free(Path(cfg.run_dir))


def _launch(args: argparse.Namespace) -> NoReturn:
    """Check the train config (keys, values, files, run_dir), then replace this process with
    torchrun running `train` on it: a config error is one line and exit 2, before any worker."""
    from megatron_fp8rl.config.loader import load_config
    from megatron_fp8rl.trainer.config import RunConfig

    cfg = load_config(RunConfig, args.config, args.overrides)
    if str(args.nproc_per_node).isdigit() and str(args.nnodes or 1).isdigit():  # not torchrun's auto/ranges
        from megatron_fp8rl.launch import check_layout

        check_layout(int(args.nproc_per_node) * int(args.nnodes or 1), cfg.model.tensor_parallel,
                     cfg.model.pipeline_parallel)
    _check_train(cfg, single_node=str(args.nnodes or 1) == "1")
    launcher = [f"--{option}={value}" for option in TORCHRUN_OPTIONS
                if (value := getattr(args, option.replace("-", "_"))) is not None]
    debug = ["--debug"] if args.debug else []
    config = ["--config", args.config] if args.config else []
    command = [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "megatron_fp8rl.cli", *debug,
               "train", *config, *args.overrides]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, command)


def _convert(args: argparse.Namespace) -> int:
    from megatron_fp8rl.convert.cli_commands import run_convert

    if args.direction != "hf-to-megatron":
        return run_convert(args)
    from megatron_fp8rl.launch import init_distributed, shutdown_distributed
    from megatron_fp8rl.models.hf import build_conversion_target

    init_distributed(1, 1)
    try:
        return run_convert(args, build_conversion_target)
    finally:
        shutdown_distributed()


def _export_fp8(args: argparse.Namespace) -> int:
    from megatron_fp8rl.convert.cli_commands import run_export_fp8

    return run_export_fp8(args) or 0


def _report(args: argparse.Namespace) -> int:
    from megatron_fp8rl.report.logs import ReportError
    from megatron_fp8rl.report.markdown import write_report

    try:
        path = write_report(args.run_dirs, args.out)
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path} and its plots")
    return 0


def _stability(args: argparse.Namespace) -> int:
    from megatron_fp8rl.study.runner import run_study

    return run_study(args)


def _add_report_commands(commands) -> None:
    report = commands.add_parser("report", help="plots and a markdown report from run directories")
    report.add_argument("run_dirs", nargs="+", help="run directories (each with tb/) to compare")
    report.add_argument("--out", required=True, help="output folder for the PNGs and report.md")
    report.set_defaults(func=_report)
    from megatron_fp8rl.study.runner import add_study_arguments

    stability = commands.add_parser("stability", help="the FP8 stability study (issue 23) and its report")
    add_study_arguments(stability)
    stability.set_defaults(func=_stability)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-fp8rl", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train the tiny Megatron GPT on the built-in CPU task")
    _add_layout_arguments(demo)
    demo.add_argument("--steps", type=int, default=200, help="optimizer steps")
    demo.add_argument("--run-dir", default="runs/demo", help="tensorboard log directory")
    demo.set_defaults(func=_demo)
    train = commands.add_parser("train", help="RL post-training (run under torchrun for TP/PP/DP)")
    train.add_argument("--config", default=None, help="YAML run config (see examples/)")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=20 model.fp8=calibrated")
    train.set_defaults(func=_train)
    launch = commands.add_parser("launch", help="check the train config and inputs, then run `train` under torchrun")
    for option in TORCHRUN_OPTIONS:
        launch.add_argument(f"--{option}", help=f"torchrun's --{option}")
    launch.add_argument("--config", default=None, help="YAML run config (see examples/)")
    launch.add_argument("overrides", nargs="*", help="dotted overrides, as for train")
    launch.set_defaults(func=_launch)
    from megatron_fp8rl.convert.cli_commands import add_convert_arguments, add_export_fp8_arguments

    add_convert_arguments(commands)
    commands.choices["convert"].set_defaults(func=_convert)
    export = commands.add_parser("export-fp8", help="write an FP8 HF checkpoint for SGLang")
    add_export_fp8_arguments(export)
    export.set_defaults(func=_export_fp8)
    _add_report_commands(commands)
    return parser


EXPECTED_WARNINGS = (
    ("UserWarning", "Transformer Engine and Apex are not installed"),  # Megatron: local fallbacks
    ("UserWarning", "Apex is not installed"),
    ("UserWarning", "full scope is deprecated"),  # Megatron's own default cuda_graph_scope
    ("UserWarning", "The .grad attribute of a Tensor"),
    ("FutureWarning", "`torch.distributed."),  # collectives Megatron 0.16 calls, renamed in torch 2.13
    ("FutureWarning", "`load_state_dict` is deprecated"),  # Megatron's dist_checkpointing on torch 2.13
    ("FutureWarning", "Please use DTensor instead and we are deprecating ShardedTensor"),
    ("UserWarning", "Only CUDA"),  # SGLang: its AWQ/GGUF kernels are GPU-only (we use neither)
    ("UserWarning", "Triton is not supported on current platform"),  # SGLang: CPU fallback
)
"""(category, start of the message) of library warnings that are expected on the CPU tier and
would bury the progress bar. Errors are never filtered."""


EXPECTED_LOG_LINES = (
    ("sglang.srt.entrypoints.engine", "Using custom SIGQUIT handler"),  # logged at ERROR level
)
"""(logger, start of the message) of library log records that report nothing wrong."""


def _quiet_known_library_logs() -> None:
    """Drop EXPECTED_LOG_LINES (logger filters: every other record of those loggers still shows)."""
    for name, start in EXPECTED_LOG_LINES:
        logging.getLogger(name).addFilter(lambda record, start=start: not record.getMessage().startswith(start))


def _quiet_known_library_warnings(env=os.environ) -> None:
    """Ignore EXPECTED_WARNINGS here and, through PYTHONWARNINGS, in the processes this one
    starts (SGLang's scheduler and detokenizer, an SGLang server subprocess), which do not inherit
    this process's filters."""
    for category, start in EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(start), category=getattr(builtins, category))
    # PYTHONWARNINGS splits on commas and matches a message's start literally
    present = [entry for entry in env.get("PYTHONWARNINGS", "").split(",") if entry]
    ours = [f"ignore:{start}:{category}" for category, start in EXPECTED_WARNINGS]
    env["PYTHONWARNINGS"] = ",".join(present + [entry for entry in ours if entry not in present])


def main(argv: list[str] | None = None) -> int:
    _quiet_known_library_warnings()
    _quiet_known_library_logs()
    versions.gate(os.environ)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except Exception as exc:
        if args.debug or not _is_user_error(exc):
            raise
        if os.environ.get("RANK", "0") == "0":  # every torchrun worker meets the same error
            print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
