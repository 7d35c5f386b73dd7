"""The report's PNG figures: runs side by side over steps.

Owns: one function per figure (entropy, train/rollout mismatch, k3 KL, importance-ratio
distribution, clip fractions, reward and eval accuracy, per-layer FP8 saturation/underflow
heatmaps) and `write_plots`. Uses matplotlib's object API (Figure + Agg canvas, no pyplot), so it
never touches a global backend. A figure whose tags no run logged is skipped, not drawn empty.
Must not import: trainer code.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from megatron_fp8rl.report.logs import FP8_ROLES, RunLogs, Series

FP8_STATS = ("saturated_fraction", "underflow_fraction")
RATIO_BANDS = (("p01", "p99", 0.18), ("p10", "p90", 0.35))


@dataclass(frozen=True)
class Panel:
    """One subplot of a line figure: a tag drawn for every run that logged it."""

    tag: str
    title: str
    log_scale: bool = False


LINE_FIGURES = {
    "entropy": ("Policy entropy (nats/token)", (Panel("train/entropy", "entropy"),)),
    "mismatch": ("Train vs rollout |Δ logprob| of the sampled tokens",
                 (Panel("train/mismatch_abs_logprob_diff_mean", "mean |Δlogp|", True),
                  Panel("train/mismatch_abs_logprob_diff_max", "max |Δlogp|", True))),
    "k3_kl": ("KL(rollout ‖ train), k3 estimator", (Panel("train/mismatch_k3_kl", "k3 KL", True),)),
    "clip_fractions": ("Fractions of response tokens clipped",
                       (Panel("train/clip_frac_high", "PPO clip (A>0, ratio > 1+ε_high)"),
                        Panel("train/clip_frac_low", "PPO clip (A<0, ratio < 1-ε_low)"),
                        Panel("train/tis_clip_frac", "TIS: train/rollout ratio > cap"),
                        Panel("train/mis_drop_frac", "MIS: tokens dropped"))),
    "clip_attribution": ("Why tokens were clipped: train/rollout noise vs policy change (rl/noise.py)",
                         (Panel("noise/clip_noise_only_frac", "noise only (clipped on π_θ/π_rollout only)"),
                          Panel("noise/clip_policy_only_frac", "policy only (clipped on π_θ/π_old only)"),
                          Panel("noise/clip_both_frac", "both"))),
    "calibrated_clipping": ("Calibrated Clipping (algorithm.calibration.mode=shadow): bounds and diagnostic",
                            (Panel("clip/low", "lower bound L in force"),
                             Panel("clip/high", "upper bound H in force"),
                             Panel("clip/alpha", "α: shadow's clip share of A<0 tokens"),
                             Panel("clip/balance_shadow", "p (positive/negative update), shadow"),
                             Panel("clip/balance_fp8", "p, FP8 at the calibrated bounds"),
                             Panel("clip/neg_overclip_before", "A<0 over-clipped by FP8 vs shadow, plain bounds"),
                             Panel("clip/neg_overclip_after", "A<0 over-clipped, calibrated bounds"))),
    "training_forward_noise": ("The training forward's noise against π_old on the update's first mini-batch",
                               (Panel("noise/train_forward_abs_delta_mean", "mean |log π_θ − log π_old|"),
                                Panel("noise/train_forward_abs_delta_max", "max"))),
    "reward": ("Reward and accuracy",
               (Panel("reward/mean", "reward mean (rollouts)"),
                Panel("reward/accuracy", "rollout accuracy"),
                Panel("eval/accuracy", "greedy eval accuracy"))),
}


def _color(index: int) -> str:
    return f"C{index % 10}"


def _set_scale(ax, values: list[np.ndarray]) -> None:
    finite = np.concatenate([v[np.isfinite(v)] for v in values]) if values else np.array([])
    if finite.size and finite.min() > 0:
        ax.set_yscale("log")
    elif finite.size and finite.max() > 0:
        # exact zeros (identical trainer and rollout numerics) have no place on a log axis
        ax.set_yscale("symlog", linthresh=max(finite[finite > 0].min(), 1e-12))


def line_figure(runs: list[RunLogs], title: str, panels: tuple[Panel, ...], path: Path) -> Path | None:
    """Subplots side by side, one per panel with data, a line per run over steps."""
    present = [p for p in panels if any(run.get(p.tag) is not None for run in runs)]
    if not present:
        return None
    fig = Figure(figsize=(4.6 * len(present), 3.8), layout="constrained")
    axes = fig.subplots(1, len(present), squeeze=False)[0]
    for ax, panel in zip(axes, present):
        drawn = []
        for index, run in enumerate(runs):
            series = run.get(panel.tag)
            if series is None:
                continue
            ax.plot(series.steps, series.values, marker="o" if len(series.steps) <= 30 else None,
                    markersize=3, color=_color(index), label=run.name)
            drawn.append(series.values)
        if panel.log_scale:
            _set_scale(ax, drawn)
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    return path


def _ratio_quantiles(run: RunLogs) -> dict[str, Series] | None:
    names = ("min", "p01", "p10", "p50", "p90", "p99", "max")
    found = {n: run.get(f"train/mismatch_ratio_{n}") for n in names}
    return found if all(found.values()) else None


def _draw_train_rollout_ratio(ax, run: RunLogs, color: str) -> bool:
    quantiles = _ratio_quantiles(run)
    if quantiles is not None:
        for low, high, alpha in RATIO_BANDS:
            ax.fill_between(quantiles[low].steps, quantiles[low].values, quantiles[high].values,
                            color=color, alpha=alpha, linewidth=0, label=f"{low}–{high}")
        ax.plot(quantiles["p50"].steps, quantiles["p50"].values, color=color, label="median")
        for extreme in ("min", "max"):
            ax.plot(quantiles[extreme].steps, quantiles[extreme].values, color=color,
                    linestyle=":", linewidth=1, label="min, max" if extreme == "min" else None)
        return True
    worst = run.get("train/mismatch_abs_logprob_diff_max")
    if worst is None:
        return False
    # older runs logged no quantiles: the band exp(±max|Δ|) bounds every token's ratio
    ax.fill_between(worst.steps, np.exp(-worst.values), np.exp(worst.values), color=color,
                    alpha=0.25, linewidth=0, label="exp(±max|Δlogp|)")
    return True


def _draw_ppo_ratio(ax, run: RunLogs, color: str) -> bool:
    low, mean, high = (run.get(f"train/ratio_{n}") for n in ("min", "mean", "max"))
    if mean is None:
        return False
    if low is not None and high is not None:
        ax.fill_between(low.steps, low.values, high.values, color=color, alpha=0.25, linewidth=0,
                        label="min–max")
    ax.plot(mean.steps, mean.values, color=color, label="mean")
    return True


def ratio_figure(runs: list[RunLogs], path: Path) -> Path | None:
    """A row per run: the train/rollout importance ratio π_train/π_rollout (quantile bands, the
    ratio TIS/MIS correct) and the PPO ratio π_new/π_old (min/mean/max) over steps."""
    fig = Figure(figsize=(10, 2.4 * len(runs) + 0.6), layout="constrained")
    axes = fig.subplots(len(runs), 2, squeeze=False, sharex=True)
    drew_any = False
    for index, (run, (left, right)) in enumerate(zip(runs, axes)):
        drawn = [_draw_train_rollout_ratio(left, run, _color(index)),
                 _draw_ppo_ratio(right, run, _color(index))]
        drew_any |= any(drawn)
        for ax, has_data in zip((left, right), drawn):
            ax.axhline(1.0, color="gray", linewidth=0.8)
            ax.grid(alpha=0.3)
            if has_data:
                ax.legend(fontsize=6, loc="upper right")
            else:
                ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center")
        left.set_ylabel(run.name, fontsize=8)
    axes[0][0].set_title("train/rollout ratio π_train/π_rollout (quantiles over tokens)", fontsize=9)
    axes[0][1].set_title("PPO ratio π_new/π_old", fontsize=9)
    for ax in axes[-1]:
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if not drew_any:
        return None
    fig.savefig(path, dpi=100)
    return path


def fp8_layer_matrix(run: RunLogs, role: str, stat: str) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(layer names, steps, values [layers, steps]) of a per-layer FP8 stat; NaN where a layer
    did not log a step."""
    layers = run.fp8_layers(role, stat)
    series = [run.get(run.fp8_tag(layer, role, stat)) for layer in layers]
    steps = np.unique(np.concatenate([s.steps for s in series])) if series else np.array([], dtype=np.int64)
    matrix = np.full((len(layers), len(steps)), np.nan)
    for row, s in enumerate(series):
        matrix[row, np.searchsorted(steps, s.steps)] = s.values
    return layers, steps, matrix


def _short_layer(name: str) -> str:
    for prefix in ("module.", "decoder.", "layers."):
        name = name.removeprefix(prefix)
    return name.replace("self_attention.", "attn.")


def fp8_heatmap(run: RunLogs, path: Path) -> Path | None:
    """Layer x step heatmaps of the saturated and underflowed fractions, a row per role
    (input, weight, grad_output) the run logged. None for a run without an FP8 trainer."""
    roles = [role for role in FP8_ROLES if run.fp8_layers(role, FP8_STATS[0])]
    if not roles:
        return None
    first = run.fp8_layers(roles[0], FP8_STATS[0])
    fig = Figure(figsize=(12, max(3.0, 0.09 * len(first) + 1.6) * len(roles)), layout="constrained")
    axes = fig.subplots(len(roles), len(FP8_STATS), squeeze=False)
    for role, row in zip(roles, axes):
        for stat, ax in zip(FP8_STATS, row):
            layers, steps, matrix = fp8_layer_matrix(run, role, stat)
            # fixed at 0 from below so an all-zero map reads as zero, not as mid-scale
            top = np.nanmax(matrix) if np.isfinite(matrix).any() else 0.0
            image = ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap="magma",
                              vmin=0.0, vmax=max(float(top), 1e-6),
                              extent=(steps[0] - 0.5, steps[-1] + 0.5, len(layers) - 0.5, -0.5))
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            fig.colorbar(image, ax=ax, fraction=0.04)
            stride = max(1, len(layers) // 24)
            ax.set_yticks(range(0, len(layers), stride),
                          [_short_layer(n) for n in layers[::stride]], fontsize=6)
            ax.set_title(f"{role}: {stat.replace('_', ' ')}", fontsize=9)
            ax.set_xlabel("step")
    fig.suptitle(f"{run.name}: FP8 per-layer saturation and underflow")
    fig.savefig(path, dpi=100)
    return path


def write_plots(runs: list[RunLogs], out_dir: Path) -> dict[str, Path]:
    """Every figure that has data, as `{figure name: PNG path}` (fp8 heatmaps: `fp8_<run>`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, (title, panels) in LINE_FIGURES.items():
        written[name] = line_figure(runs, title, panels, out_dir / f"{name}.png")
    written["ratio"] = ratio_figure(runs, out_dir / "ratio.png")
    for run in runs:
        written[f"fp8_{run.name}"] = fp8_heatmap(run, out_dir / f"fp8_{run.name}.png")
    return {name: path for name, path in written.items() if path is not None}
