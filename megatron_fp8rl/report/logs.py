"""A training run as the report sees it: tensorboard scalar series and the precision settings.

Owns: `RunLogs`, `Series`, `load_run` and the naming of per-layer FP8 tags
(`fp8/<module>.<role>/<stat>`, written by trainer/fp8_observation.py fp8_metrics).
Must not import: trainer code (it reads files; the tag names are the interface).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

# config.yaml keys that tell precision settings apart in the report's tables.
SETTING_KEYS = ("model.fp8", "rollout.fp8", "algorithm.correction")
FP8_ROLES = ("input", "weight", "grad_output")


class ReportError(ValueError):
    """A run directory the report cannot read (the message names the path)."""


@dataclass
class Series:
    """One scalar over steps; steps ascending and unique."""

    steps: np.ndarray
    values: np.ndarray


@dataclass
class RunLogs:
    """What the report needs of one run directory."""

    name: str
    """Label in plots and tables (the run directory's name)."""
    run_dir: Path
    scalars: dict[str, Series]
    settings: dict[str, str] = field(default_factory=dict)
    """SETTING_KEYS -> value from the run's config.yaml ('?' when absent)."""
    summary: dict = field(default_factory=dict)
    """summary.json of a finished run ({} while it runs)."""
    eval_size: int | None = None
    """Held-out problems per greedy eval (config.yaml data.eval_size; None when absent)."""
    texts: dict[str, dict[int, str]] = field(default_factory=dict)
    """tag -> {step: text} of the run's tensorboard text (samples/responses, reward/first_error)."""
    started: float = math.nan
    """Unix time in the name of the run's first event file (events.out.tfevents.<time>.<host>...):
    when its training began, so which code made it (NaN when no name carries one)."""

    def get(self, tag: str) -> Series | None:
        return self.scalars.get(tag)

    def fp8_layers(self, role: str, stat: str) -> list[str]:
        """Module names with a per-layer `stat` for `role`, in model order (layer numbers sort
        numerically)."""
        pattern = re.compile(rf"^fp8/(.+)\.{re.escape(role)}/{re.escape(stat)}$")
        names = [m.group(1) for tag in self.scalars if (m := pattern.match(tag))]
        return sorted(names, key=_natural_key)

    def fp8_tag(self, layer: str, role: str, stat: str) -> str:
        return f"fp8/{layer}.{role}/{stat}"


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _tensorboard_dir(run_dir: Path) -> Path:
    if (run_dir / "tb").is_dir():
        return run_dir / "tb"
    if any(run_dir.glob("events.out.tfevents.*")):
        return run_dir
    raise ReportError(f"{run_dir}: no tensorboard logs (expected {run_dir / 'tb'} with "
                      "events.out.tfevents.* files, as `megatron-fp8rl train` writes)")


def _started(tb_dir: Path) -> float:
    stamps = [int(part[3]) for f in tb_dir.glob("events.out.tfevents.*")
              if len(part := f.name.split(".")) > 3 and part[3].isdigit()]
    return float(min(stamps)) if stamps else math.nan


def _read_events(tb_dir: Path) -> tuple[dict[str, Series], dict[str, dict[int, str]]]:
    """(scalars, texts) of the event files in one pass."""
    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    suffix = "/text_summary"
    texts = {tag[:-len(suffix)]: {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors(tag)}
             for tag in events.Tags()["tensors"] if tag.endswith(suffix)}
    scalars = {}
    for tag in events.Tags()["scalars"]:
        # a resumed run logs some steps again: the last value written for a step wins
        by_step = {event.step: event.value for event in events.Scalars(tag)}
        steps = np.array(sorted(by_step), dtype=np.int64)
        scalars[tag] = Series(steps, np.array([by_step[s] for s in steps], dtype=np.float64))
    return scalars, texts


def _config(run_dir: Path) -> dict:
    path = run_dir / "config.yaml"
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def _settings(config: dict) -> dict[str, str]:
    settings = {}
    for key in SETTING_KEYS:
        value = config
        for part in key.split("."):
            value = value.get(part, "?") if isinstance(value, dict) else "?"
        settings[key] = str(value)
    return settings


def load_run(run_dir: str | Path, name: str | None = None) -> RunLogs:
    """Read `run_dir` (a `megatron-fp8rl train` run directory, or a folder of event files)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: run directory does not exist")
    tb_dir = _tensorboard_dir(run_dir)
    scalars, texts = _read_events(tb_dir)
    if not scalars:
        raise ReportError(f"{run_dir}: tensorboard logs hold no scalars yet")
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    config = _config(run_dir)
    eval_size = (config.get("data") or {}).get("eval_size")
    return RunLogs(name or run_dir.resolve().name, run_dir, scalars, _settings(config), summary,
                   eval_size if isinstance(eval_size, int) else None, texts, _started(tb_dir))
