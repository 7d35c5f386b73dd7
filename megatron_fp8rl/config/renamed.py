"""Config keys that moved: the run config's old dotted keys and where they live now.

Owns: `RENAMED_KEYS` (old dotted key -> new dotted key; `AlgorithmConfig` nested its clip,
calibration and noise groups) and `renamed_key`. The loader refuses an old key in a YAML file or an
override with one line naming the new key (`RunConfig.renamed_keys`); code that reads a config.yaml
written before the rename (run_dir resume, the study's run reuse) looks a key up under both names.
Must not import: anything of ours (a table).
"""
from __future__ import annotations

RENAMED_KEYS: dict[str, str] = {
    "algorithm.clip_low": "algorithm.clip.low",
    "algorithm.clip_high": "algorithm.clip.high",
    "algorithm.dual_clip": "algorithm.clip.dual",
    "algorithm.clip_calibration": "algorithm.calibration.mode",
    "algorithm.clip_calibration_every": "algorithm.calibration.every",
    "algorithm.clip_calibration_level": "algorithm.calibration.level",
    "algorithm.clip_calibration_smoothing": "algorithm.calibration.smoothing",
    "algorithm.clip_calibration_low_min": "algorithm.calibration.limits.low_min",
    "algorithm.clip_calibration_low_max": "algorithm.calibration.limits.low_max",
    "algorithm.clip_calibration_high_min": "algorithm.calibration.limits.high_min",
    "algorithm.clip_calibration_high_max": "algorithm.calibration.limits.high_max",
    "algorithm.noise_quantile": "algorithm.noise.quantile",
    "algorithm.noise_log_quantiles": "algorithm.noise.log_quantiles",
    "algorithm.noise_clip_low_max": "algorithm.noise.clip_low_max",
    "algorithm.noise_clip_high_max": "algorithm.noise.clip_high_max",
    "algorithm.noise_correction": "algorithm.noise.correction",
    "algorithm.noise_tis_cap_max": "algorithm.noise.tis_cap_max",
    "algorithm.noise_mis_low_min": "algorithm.noise.mis_low_min",
    "algorithm.noise_mis_high_max": "algorithm.noise.mis_high_max",
}
"""Old dotted key -> new dotted key (renamed 2026-12-05, issue 45 item 2)."""

OLD_KEYS: dict[str, str] = {new: old for old, new in RENAMED_KEYS.items()}
"""New dotted key -> the old key a config.yaml written before the rename holds it under."""


def renamed_key(key: str) -> str:
    """`key` as it is named now (itself unless it is an old key of RENAMED_KEYS)."""
    return RENAMED_KEYS.get(key, key)
