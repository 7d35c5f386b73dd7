"""What a run directory was made from, so that reusing it can never train the wrong model.

Owns: `<run_dir>/provenance.json` (the starting HF checkpoint's path and content fingerprint, and
the run's config as dotted keys), written when a run first claims the folder, and
`check_run_dir`, which refuses a run whose model differs from the recorded one (its converted
`init_megatron` and checkpoints belong to that model) or whose config differs in anything but
RESUMABLE_KEYS, unless `train.resume_changed_config` (a key the recorded run predates counts
at its default: the behaviour the run had before the key existed; a renamed key, config/renamed.py, counts
under its new name). A folder holding a previous run's outputs
without a provenance record is refused too: what it was made from cannot be told. A run_dir or
checkpoint.dir this process cannot write is refused before anything starts, naming the key.
Must not import: cli.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from megatron_fp8rl.config.loader import defaults
from megatron_fp8rl.config.renamed import renamed_key
from megatron_fp8rl.convert.integrity import hf_fingerprint
from megatron_fp8rl.convert.outputs import writable_problem

PROVENANCE = "provenance.json"
RESUMABLE_KEYS = ("run_dir", "model.hf_path", "checkpoint.dir", "train.steps")
"""Keys that may differ on reuse: paths (the model's identity is its fingerprint, not its path),
and train.steps (continuing a run to more steps is the ordinary resume, as Megatron's --train-iters)."""
PREVIOUS_OUTPUTS = ("init_megatron", "checkpoints")


class RunDirError(ValueError):
    """The run directory holds another run's outputs."""


def _dotted(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_dotted(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _record(cfg) -> dict[str, Any]:
    config = json.loads(json.dumps(dataclasses.asdict(cfg)))  # tuples and lists compare alike
    return {"model.hf_path": str(Path(cfg.model.hf_path).resolve()),
            "model_fingerprint": hf_fingerprint(Path(cfg.model.hf_path)),
            "config": _dotted(config)}


def _model_mismatch(run_dir: Path, old: dict, new: dict) -> str:
    changed = sorted(name for name in set(old["model_fingerprint"]) | set(new["model_fingerprint"])
                     if old["model_fingerprint"].get(name) != new["model_fingerprint"].get(name))
    return (f"run_dir={run_dir} was made from model.hf_path={old['model.hf_path']}; this run's "
            f"model.hf_path={new['model.hf_path']} is a different checkpoint (differs in: "
            f"{', '.join(changed)}). Its converted weights and checkpoints are the other model's: "
            "use a new run_dir.")


def _config_mismatch(run_dir: Path, old: dict, new: dict, default: dict) -> str | None:
    old = {renamed_key(k): v for k, v in old.items()}  # a run recorded before a rename: its keys' new names
    old = {**{k: v for k, v in default.items() if k in new}, **old}  # keys added since: their defaults
    keys = sorted(k for k in set(old) | set(new)
                  if k not in RESUMABLE_KEYS and k != "train.resume_changed_config"
                  and old.get(k) != new.get(k))
    if not keys:
        return None
    changes = "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys)
    return (f"run_dir={run_dir} was made with a different config ({changes}); use a new run_dir, "
            "or set train.resume_changed_config=true to continue it with these values.")


def check_run_dir(cfg) -> dict[str, Any]:
    """All ranks, before anything is written: raise RunDirError if `cfg.run_dir` holds outputs of
    different inputs; returns the record claim_run_dir writes."""
    run_dir, record = Path(cfg.run_dir), _record(cfg)
    for key, folder in (("run_dir", cfg.run_dir), ("checkpoint.dir", cfg.checkpoint.dir)):
        problem = folder and writable_problem(Path(folder) / PROVENANCE)  # the folder, or where it goes
        if problem:
            raise RunDirError(f"{key}={folder}: {problem}")
    path = run_dir / PROVENANCE
    if not path.is_file():
        previous = [name for name in PREVIOUS_OUTPUTS if (run_dir / name).exists()]
        if previous:
            raise RunDirError(f"run_dir={run_dir} holds {', '.join(previous)} but no {PROVENANCE}: "
                              "what it was made from cannot be told; use a new run_dir")
        return record
    old = json.loads(path.read_text())
    if old["model_fingerprint"] != record["model_fingerprint"]:
        raise RunDirError(_model_mismatch(run_dir, old, record))
    default = _dotted(json.loads(json.dumps(defaults(type(cfg)))))
    config_error = _config_mismatch(run_dir, old["config"], record["config"], default)
    if config_error and not cfg.train.resume_changed_config:
        raise RunDirError(config_error)
    return old if not config_error else record


def claim_run_dir(run_dir: Path, record: dict[str, Any]) -> None:
    """Rank 0: write the provenance record (atomically) into `run_dir`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{PROVENANCE}.tmp"
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(run_dir / PROVENANCE)
