"""The markdown report: what was compared, tables of final figures, and the embedded plots.

Owns: `final_figures` (the per-run numbers of the tables) and `write_report` (the entry point of
`megatron-fp8rl report`). Must not import: trainer code.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from megatron_fp8rl.report.logs import SETTING_KEYS, RunLogs, load_run
from megatron_fp8rl.report.plots import LINE_FIGURES, write_plots

FIGURE_NOTES = {
    "reward": "Rollout reward and accuracy per step; greedy accuracy on held-out prompts at each eval.",
    "entropy": "Mean per-token policy entropy of the trained tokens. A surge means the policy is "
               "collapsing towards noise.",
    "mismatch": "How far the trainer's logprob of each sampled token is from the rollout engine's "
                "(log scale): the FP8 noise the importance ratio inherits.",
    "k3_kl": "KL(π_rollout ‖ π_train) estimated with k3 on the sampled tokens (log scale).",
    "ratio": "Left: distribution over tokens of the train/rollout importance ratio (shaded "
             "p01–p99 and p10–p90, median line, dotted min/max; per micro-batch quantiles "
             "averaged over the step's micro-batches). Right: the PPO ratio π_new/π_old.",
    "clip_fractions": "Fractions of response tokens silenced by the PPO clip (high/low) and by "
                      "mismatch correction (TIS cap, MIS band).",
    "clip_attribution": "Fractions of response tokens the PPO clip would silence because of the "
                        "train/rollout noise alone, because of the policy change alone, or both "
                        "(logged by the noise-aware objective).",
    "calibrated_clipping": "Calibrated Clipping's clip bounds in force, the shadow's clip share α of "
                           "negative-advantage tokens, the positive/negative update balance p, and on "
                           "calibration steps the share of negative-advantage tokens the FP8 ratio clips "
                           "and the high-precision shadow's does not, with the plain and the calibrated bounds.",
    "training_forward_noise": "|log π_θ − log π_old| of the update's first forward, where θ = θ_old: zero "
                              "when the training forward computes exactly what π_old was computed with "
                              "(aligned FP8); otherwise the FP8 noise every PPO ratio carries.",
}


def _values(run: RunLogs, tag: str) -> np.ndarray | None:
    series = run.get(tag)
    if series is None:
        return None
    values = series.values[np.isfinite(series.values)]
    return values if values.size else None


def _last(run: RunLogs, tag: str) -> float | None:
    values = _values(run, tag)
    return None if values is None else float(values[-1])


def _mean(run: RunLogs, tag: str) -> float | None:
    values = _values(run, tag)
    return None if values is None else float(values.mean())


def _first_to_last(run: RunLogs, tag: str) -> str:
    values = _values(run, tag)
    return "—" if values is None else f"{_fmt(values[0])} → {_fmt(values[-1])}"


def final_figures(run: RunLogs) -> dict[str, float | str | None]:
    """The numbers of the report's tables for one run: final and mean values over steps."""
    entropy = _values(run, "train/entropy")
    return {
        "steps": int(run.get("reward/mean").steps[-1]) if run.get("reward/mean") else None,
        "reward_final": _last(run, "reward/mean"),
        "reward_mean": _mean(run, "reward/mean"),
        "eval_accuracy": _first_to_last(run, "eval/accuracy"),
        "entropy": _first_to_last(run, "train/entropy"),
        "entropy_max_over_first": (float(entropy.max() / entropy[0])
                                   if entropy is not None and entropy[0] > 0 else None),
        "abs_logprob_diff_mean": _mean(run, "train/mismatch_abs_logprob_diff_mean"),
        "abs_logprob_diff_final": _last(run, "train/mismatch_abs_logprob_diff_mean"),
        "k3_kl_mean": _mean(run, "train/mismatch_k3_kl"),
        "ratio_p01_mean": _mean(run, "train/mismatch_ratio_p01"),
        "ratio_p99_mean": _mean(run, "train/mismatch_ratio_p99"),
        "clip_frac_high_mean": _mean(run, "train/clip_frac_high"),
        "clip_frac_low_mean": _mean(run, "train/clip_frac_low"),
        "tis_clip_frac_mean": _mean(run, "train/tis_clip_frac"),
        "fp8_input_saturated_mean": _mean(run, "fp8/input/saturated_fraction_mean"),
        "fp8_weight_underflow_mean": _mean(run, "fp8/weight/underflow_fraction_mean"),
        "fp8_grad_underflow_mean": _mean(run, "fp8/grad_output/underflow_fraction_mean"),
        "seconds": run.summary.get("seconds"),
    }


def _fmt(value) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"


TABLES = (
    ("Outcome", (("steps", "steps"), ("reward (final)", "reward_final"), ("reward (mean)", "reward_mean"),
                 ("eval accuracy first → last", "eval_accuracy"), ("entropy first → last", "entropy"),
                 ("entropy max / first", "entropy_max_over_first"), ("train loop s", "seconds"))),
    ("Train/rollout mismatch (means over steps)",
     (("mean |Δlogp|", "abs_logprob_diff_mean"), ("mean |Δlogp| (final step)", "abs_logprob_diff_final"),
      ("k3 KL", "k3_kl_mean"), ("ratio p01", "ratio_p01_mean"), ("ratio p99", "ratio_p99_mean"),
      ("PPO clip high", "clip_frac_high_mean"), ("PPO clip low", "clip_frac_low_mean"),
      ("TIS clip", "tis_clip_frac_mean"))),
    ("FP8 trainer quantization (means over layers and steps)",
     (("input saturated", "fp8_input_saturated_mean"), ("weight underflow", "fp8_weight_underflow_mean"),
      ("grad underflow", "fp8_grad_underflow_mean"))),
)


def _up_to(run: RunLogs, tag: str, step: int) -> np.ndarray | None:
    """The finite values of `tag` logged at steps <= `step`; None when there are none."""
    series = run.get(tag)
    if series is None:
        return None
    keep = (series.steps <= step) & np.isfinite(series.values)
    return series.values[keep] if keep.any() else None


def entropy_drift(run: RunLogs, step: int) -> float | None:
    """max over logged steps t <= `step` of |H_t - H_first| / H_first (train/entropy)."""
    values = _up_to(run, "train/entropy", step)
    if values is None or values[0] <= 0:
        return None
    return float(np.max(np.abs(values - values[0])) / values[0])


def _best(scores: dict[str, float], highest: bool) -> str:
    target = max(scores.values()) if highest else min(scores.values())
    return ", ".join(f"`{name}`" for name, value in scores.items() if value == target)


def verdict(runs: list[RunLogs]) -> list[str]:
    """Markdown lines: at the last step every run reached, which run has the highest held-out
    accuracy and the smallest entropy drift, and the mean |Δlogp| of each precision pair against
    the high-precision pair (none/none). Empty for a single run."""
    last_steps = [int(run.get("reward/mean").steps[-1]) for run in runs if run.get("reward/mean")]
    if len(runs) < 2 or len(last_steps) < len(runs):
        return []
    step = min(last_steps)
    lines = ["## Verdict", "", f"Compared at step {step}, the last step every run reached."]
    accuracy = {}
    for run in runs:
        found = _up_to(run, "eval/accuracy", step)
        if found is not None:
            accuracy[run.name] = float(found[-1])
    if accuracy:
        sizes = {run.eval_size for run in runs if run.name in accuracy}
        noise = ""
        if len(sizes) == 1 and None not in sizes:
            n = sizes.pop()
            p = float(np.mean(list(accuracy.values())))
            noise = (f" One eval has {n} problems: a binomial standard error of "
                     f"{math.sqrt(max(p * (1 - p), 1e-12) / n):.3f} at the mean accuracy {p:.3f}, so "
                     "differences below about twice that are noise.")
        ranked = sorted(accuracy.items(), key=lambda item: -item[1])
        lines += ["", f"- Highest held-out greedy accuracy: {_best(accuracy, True)} "
                      f"({ranked[0][1]:.3f}; all: " + ", ".join(f"{n} {v:.3f}" for n, v in ranked) + ")." + noise]
    drift = {run.name: d for run in runs if (d := entropy_drift(run, step)) is not None}
    if drift:
        ranked = sorted(drift.items(), key=lambda item: item[1])
        lines.append(f"- Smallest entropy drift (max |H_t − H_first| / H_first over steps <= {step}): "
                     f"{_best(drift, False)} ({ranked[0][1]:.3f}; all: "
                     + ", ".join(f"{n} {v:.3f}" for n, v in ranked) + ").")
    by_precision: dict[tuple[str, str], list[float]] = {}
    for run in runs:
        found = _up_to(run, "train/mismatch_abs_logprob_diff_mean", step)
        if found is not None:
            key = (run.settings.get("model.fp8", "?"), run.settings.get("rollout.fp8", "?"))
            by_precision.setdefault(key, []).append(float(found.mean()))
    if by_precision:
        means = {key: float(np.mean(values)) for key, values in by_precision.items()}
        base = means.get(("none", "none"))
        parts = [f"{trainer}/{rollout} {value:.3g}" + (f" ({value / base:.2f}x)" if base else "")
                 for (trainer, rollout), value in sorted(means.items(), key=lambda item: item[1])]
        lines.append("- Mean |Δlogp| train vs rollout by trainer/rollout precision (averaged over "
                     "steps and corrections" + ("; ratio to none/none" if base else "") + "): "
                     + ", ".join(parts) + ".")
    return lines + [""]


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def _table(runs: list[RunLogs], figures: list[dict], columns) -> list[str]:
    header = ["run", *SETTING_KEYS, *(title for title, _ in columns)]
    lines = [_row(header), "|" + "---|" * len(header)]
    for run, numbers in zip(runs, figures):
        lines.append(_row([run.name, *(run.settings[key] for key in SETTING_KEYS),
                           *(_fmt(numbers[key]) for _, key in columns)]))
    return lines


def _unique_names(runs: list[RunLogs]) -> None:
    seen: dict[str, int] = {}
    for run in runs:
        base = re.sub(r"[^\w.-]", "_", run.name)
        seen[base] = seen.get(base, 0) + 1
        run.name = base if seen[base] == 1 else f"{base}_{seen[base]}"


def write_report(run_dirs: list[str | Path], out_dir: str | Path, title: str = "Training report",
                 preamble: str = "", names: list[str] | None = None) -> Path:
    """Read the runs, write every figure with data and `report.md` into `out_dir`; returns the
    markdown path. `preamble` (markdown) goes under the title; `names` label the runs (default:
    their directory names)."""
    if not run_dirs:
        raise ValueError("write_report needs at least one run directory")
    runs = [load_run(d, name) for d, name in zip(run_dirs, names or [None] * len(run_dirs))]
    _unique_names(runs)
    out_dir = Path(out_dir)
    plots = write_plots(runs, out_dir)
    figures = [final_figures(run) for run in runs]
    lines = [f"# {title}", ""]
    if preamble:
        lines += [preamble, ""]
    lines += ["Runs: " + ", ".join(f"`{run.name}` ({run.run_dir})" for run in runs), ""]
    lines += verdict(runs)
    for heading, columns in TABLES:
        if heading.startswith("FP8") and all(f["fp8_input_saturated_mean"] is None for f in figures):
            continue
        lines += [f"## {heading}", "", *_table(runs, figures, columns), ""]
    lines += ["## Plots", ""]
    for name in ("reward", "entropy", "mismatch", "k3_kl", "ratio", "clip_fractions", "clip_attribution",
                 "calibrated_clipping", "training_forward_noise"):
        if name in plots:
            heading = LINE_FIGURES[name][0] if name in LINE_FIGURES else "Importance ratios"
            lines += [f"### {heading}", "", FIGURE_NOTES[name], "", f"![{name}]({plots[name].name})", ""]
    fp8_plots = [(run, plots[f"fp8_{run.name}"]) for run in runs if f"fp8_{run.name}" in plots]
    if fp8_plots:
        lines += ["### FP8 per-layer saturation and underflow", "",
                  "Fraction of each quantized tensor's elements that saturated at the FP8 maximum or "
                  "flushed to zero, per layer (rows) and step (columns), for runs with an FP8 trainer.", ""]
        lines += [f"![fp8 {run.name}]({path.name})\n" for run, path in fp8_plots]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
