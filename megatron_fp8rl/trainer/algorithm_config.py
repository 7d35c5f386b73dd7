"""The run configuration's algorithm section (`algorithm.*`): the RL objective, its clip interval,
Calibrated Clipping and the shadow gate, noise-calibrated corrections and KL to a reference policy.

Owns: `AlgorithmConfig` and the sections it nests (`ClipConfig`, `CalibrationConfig`, `NoiseConfig`,
`KLConfig`), their value checks, and the option names they accept. `RunConfig` (trainer/config.py)
holds it as `algorithm`; the checks across sections stay there. Must not import: cli, trainer.loop.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_fp8rl.config.checks import check as _check
from megatron_fp8rl.config.checks import check_number as _check_number
from megatron_fp8rl.rl.calibrated_clipping import CALIBRATION_RULES, ClipLimits
from megatron_fp8rl.rl.kl import VERL_NAMES as KL_ESTIMATORS

ALGORITHMS = ("grpo", "dapo", "gspo")
ADVANTAGES = ("grpo", "grpo_no_std", "rloo")
CORRECTIONS = ("none", "tis", "mis")
OLD_POLICIES = ("decoupled", "bypass")
CLIP_CALIBRATIONS = ("none", "shadow", "monitor", "gate")
CLIP_CALIBRATION_LEVELS = ("auto", "token", "sequence")
REFERENCE_PRECISIONS = ("actor", "bfloat16", "float32")


@dataclass
class ClipConfig:
    """The PPO clip interval [1 − low, 1 + high] (before any calibration or noise widening)."""

    low: float = 0.2
    """PPO epsilon below 1."""
    high: float = 0.28
    """PPO epsilon above 1 (DAPO clip-higher; set 0.2 for plain GRPO)."""
    dual: float = 0.0
    """Dual-clip PPO constant c > 1: a negative-advantage token's loss is at most −A·c, so a ratio
    far above 1 cannot push its update without bound (Ye et al. 2020); 0 turns it off."""

    def __post_init__(self):
        _check(self.low > 0 and self.high > 0, "algorithm.clip", "low and high must be > 0")
        _check(self.low < 1, "algorithm.clip.low", f"must be < 1, got {self.low}")
        _check(self.dual == 0 or (math.isfinite(self.dual) and self.dual > 1), "algorithm.clip.dual",
               f"must be 0 (off) or a finite number > 1, got {self.dual}")


@dataclass
class CalibrationConfig:
    """Calibrated Clipping (the paper's method, rl/calibrated_clipping.py)."""

    mode: str = "none"
    """One of CLIP_CALIBRATIONS: none (the plain interval [1 − clip.low, 1 + clip.high]) or shadow
    (every `every` steps a high-precision shadow forward of the same batch sets the FP8 clip bounds:
    L matches the shadow's share of clipped negative-advantage tokens, H its positive/negative
    update balance), or monitor (the same shadow forwards and diagnostic, logged as clip/*, the
    configured bounds kept: what plain FP8 clips that high precision would not), or gate (ours: the
    configured bounds, but every token's clip decision is taken on the shadow's ratio while the
    gradient flows through the FP8 ratio, so FP8 over-clips nothing by construction; the shadow
    computes log π_old of the whole batch before the update and log π_θ of every later mini-batch,
    about one forward of the batch more than shadow/monitor per step; monitor's diagnostic is
    logged as well: what the FP8 ratio would have clipped. Token-level ratios, decoupled
    old_policy). Needs an FP8 trainer (model.fp8; the shadow computes its linears in high
    precision) or a bf16 one (model.dtype=bfloat16; the shadow is its float32 forward,
    models/shadow.py). Study v3 (docs/stability.md): gate with more than one
    mini-batch on an FP8 trainer with float32 outside its GEMMs; none by default (a shadow forward
    a step; no gain shown on a bf16 trainer)."""
    every: int = 20
    """Steps between calibrations (the first step calibrates); the last bounds hold in between.
    gate: steps between the diagnostic's records among the gated steps (1: every gated step)."""
    gate_every: int = 1
    """gate only: steps between gated steps (1, k + 1, 2k + 1, ...); the steps between train as
    mode=none does (clip decided on the FP8 ratio, no shadow forward), so the gate's (2M − 1)/M
    shadow forwards a step become (2M − 1)/(M·k) (rl/step_cost.py): 9 at M = 4 is 4.9% of a
    plain FP8 step's passes, the budget of the equivalence study's gate_every9 arm."""
    level: str = "auto"
    """token (GRPO/DAPO's per-token ratio) or sequence (GSPO's sequence ratio); auto follows
    algorithm.name."""
    smoothing: float = 0.5
    """β in [0, 1): bounds ← β·previous calibrated bounds + (1 − β)·new ones (the first is taken as is)."""
    limits: ClipLimits = field(default_factory=ClipLimits)
    """Where calibrated bounds may go (rl/calibrated_clipping.py ClipLimits: low_min, low_max,
    high_min, high_max, ratios, not epsilons)."""
    rule: str = "quantile"
    """How L is calibrated (rl/calibrated_clipping.py CALIBRATION_RULES): quantile (the paper's
    α-quantile of the FP8 ratios; at small α it sits at limits.low_min, logged as clip/low_at_limit)
    or noise (ours: L = (1 − clip.low)·exp(q_δ(log r − log r_shadow)), δ = noise_tail, so FP8
    over-clips at most δ of the tokens high precision leaves at its bound, whatever α is) or budget
    (ours: the highest L <= 1 − clip.low at which FP8 clips at most overclip_budget of the
    negative-advantage values that the shadow leaves unclipped)."""
    noise_tail: float = 0.01
    """δ in (0, 0.5) of rule=noise."""
    overclip_budget: float = 0.01
    """τ in [0, 1) of rule=budget: the share of negative-advantage values FP8 may clip that the
    shadow does not (on the calibrating mini-batch)."""
    record: bool = False
    """Write each calibration's values (the FP8 ratio, the shadow ratio and the advantage of every
    value of m*, as `calibrate` sees them) to run_dir/calibration/step_<k>.safetensors, so that
    clip rules can be compared offline on a run's own ratios (bench/clip_rules.py); ~24 bytes a value."""

    def __post_init__(self):
        _check(self.mode in CLIP_CALIBRATIONS, "algorithm.calibration.mode",
               f"{self.mode!r} is not one of {CLIP_CALIBRATIONS}")
        _check(self.level in CLIP_CALIBRATION_LEVELS, "algorithm.calibration.level",
               f"{self.level!r} is not one of {CLIP_CALIBRATION_LEVELS}")
        _check(self.every >= 1, "algorithm.calibration.every", f"must be >= 1, got {self.every}")
        _check(self.gate_every >= 1, "algorithm.calibration.gate_every", f"must be >= 1, got {self.gate_every}")
        _check(self.gate_every == 1 or self.mode == "gate", "algorithm.calibration.gate_every",
               f"is wired for mode=gate only, got mode={self.mode} with gate_every={self.gate_every}")
        _check(0 <= self.smoothing < 1, "algorithm.calibration.smoothing", f"must be in [0, 1), got {self.smoothing}")
        _check(self.rule in CALIBRATION_RULES, "algorithm.calibration.rule",
               f"{self.rule!r} is not one of {CALIBRATION_RULES}")
        _check(0 < self.noise_tail < 0.5, "algorithm.calibration.noise_tail", f"must be in (0, 0.5), got {self.noise_tail}")
        _check(0 <= self.overclip_budget < 1, "algorithm.calibration.overclip_budget",
               f"must be in [0, 1), got {self.overclip_budget}")


@dataclass
class NoiseConfig:
    """Noise-calibrated thresholds: what the measured train/rollout noise Δ = log π_old − log
    π_rollout widens (rl/noise.py), and which of its quantiles are logged."""

    quantile: float = 0.9
    """α in [0.5, 1): bypass widens each clip side by the α tail of Δ,
    ε_high' = min(ε_high + (1+ε_high)·expm1(max(q_α(Δ), 0)), clip_high_max) (ε_low' alike)."""
    log_quantiles: list[float] = field(default_factory=lambda: [0.01, 0.1, 0.5, 0.9, 0.99])
    """Levels in (0, 1) of q(Δ) and q(|Δ|) logged every step as noise/delta_q<level>, noise/abs_delta_q<level>."""
    clip_low_max: float = 0.5
    """Upper limit of the widened ε_low' (>= clip.low, < 1): 1 − ε_low' >= 1 − clip_low_max."""
    clip_high_max: float = 1.0
    """Upper limit of the widened ε_high' (>= clip.high): 1 + ε_high' <= 1 + clip_high_max."""
    correction: bool = False
    """Noise-calibrated TIS cap C' = min(max(tis_cap, exp(q_α(Δ))), tis_cap_max) and MIS band
    [max(min(mis_low, exp(q_{1−α}(Δ))), mis_low_min), min(max(mis_high, exp(q_α(Δ))), mis_high_max)]."""
    tis_cap_max: float = 10.0
    """Upper limit of the calibrated TIS cap (>= algorithm.tis_cap)."""
    mis_low_min: float = 0.1
    """Lower limit of the calibrated MIS lower bound (in [0, algorithm.mis_low])."""
    mis_high_max: float = 10.0
    """Upper limit of the calibrated MIS upper bound (>= algorithm.mis_high)."""

    def __post_init__(self):
        _check(0.5 <= self.quantile < 1, "algorithm.noise.quantile", f"must be in [0.5, 1), got {self.quantile}")
        _check(len(self.log_quantiles) > 0 and all(0 < q < 1 for q in self.log_quantiles),
               "algorithm.noise.log_quantiles", f"need levels in (0, 1), got {list(self.log_quantiles)}")


@dataclass
class KLConfig:
    """KL to a reference policy (rl/kl.py; the reference model: trainer/reference.py). Off while
    coef is 0: no reference model is built and nothing is computed."""

    coef: float = 0.0
    """β >= 0 (0: off). verl: actor.kl_loss_coef with actor.use_kl_loss, or algorithm.kl_ctrl.kl_coef
    with algorithm.use_kl_in_reward (a fixed controller); slime: --kl-loss-coef."""
    estimator: str = "k3"
    """Per-token estimator (rl.kl.VERL_NAMES): k1, k2, k3, abs, or verl's names for them kl, mse,
    low_var_kl (GRPO's k3, with verl's clamps), abs. verl: actor.kl_loss_type / algorithm.kl_penalty;
    slime: --kl-loss-type."""
    in_reward: bool = False
    """false: loss += β·agg(k) with the policy loss's algorithm.agg_mode (verl actor.use_kl_loss,
    slime --use-kl-loss); true: each sequence's reward −= β·Σ_t k_t before advantages, k of the
    rollout's log-probs against the reference's (verl algorithm.use_kl_in_reward)."""
    reference_path: str = ""
    """HF checkpoint folder of the reference policy; empty: the run's initial checkpoint
    (model.hf_path). Its architecture and vocabulary must be model.hf_path's."""
    precision: str = "actor"
    """The reference's arithmetic (REFERENCE_PRECISIONS): actor (model.dtype with the actor's FP8
    recipe: FP8 end to end; its delayed-scaling state advances with its own passes, as the
    recompute's does, so its log-probs carry FP8 noise), bfloat16 or float32 (no FP8: a fixed
    function of its frozen weights). With model.fp8_backend=te, actor precision is refused (TE
    leaves forward scales unchanged in no-grad passes)."""
    offload: bool = False
    """Keep the reference's weights in host memory between its passes (GPU tier; the copy's time
    is logged as time/reference_offload_s). Refused on a process without CUDA."""

    def __post_init__(self):
        _check_number(self.coef, "algorithm.kl.coef", 0)
        _check(self.estimator in KL_ESTIMATORS, "algorithm.kl.estimator",
               f"{self.estimator!r} is not one of {tuple(KL_ESTIMATORS)}")
        _check(self.precision in REFERENCE_PRECISIONS, "algorithm.kl.precision",
               f"{self.precision!r} is not one of {REFERENCE_PRECISIONS}")
        unused = [name for name in ("in_reward", "reference_path", "offload") if getattr(self, name)]
        _check(self.coef > 0 or not unused, f"algorithm.kl.{unused[0] if unused else 'coef'}",
               f"is set but algorithm.kl.coef is 0 (KL off): set coef > 0 or leave {unused} unset")

    @property
    def enabled(self) -> bool:
        """Whether the run builds a reference model and computes the KL term."""
        return self.coef > 0


@dataclass
class AlgorithmConfig:
    """Advantages, policy loss and train/rollout mismatch correction."""

    name: str = "dapo"
    """grpo, dapo (clip-higher, dynamic sampling, token-mean, overlong shaping) or gspo."""
    advantage: str = "grpo"
    """grpo (group mean/std), grpo_no_std (Dr. GRPO), rloo (leave-one-out)."""
    clip: ClipConfig = field(default_factory=ClipConfig)
    """The PPO clip interval (low, high) and dual clip."""
    agg_mode: str = "token-mean"
    """Loss aggregation (rl.losses.AGGREGATION_MODES)."""
    dynamic_sampling: bool = True
    """Drop groups whose rewards are all equal; draw more prompts until the batch is full."""
    max_sampling_rounds: int = 3
    """Rollout rounds per step when dynamic sampling keeps too few groups."""
    overlong_buffer: int = 0
    """DAPO soft overlong punishment over the last N tokens before max_new_tokens (0: off)."""
    overlong_penalty: float = 1.0
    """Reward penalty at max_new_tokens."""
    correction: str = "tis"
    """Rollout/trainer mismatch correction: none, tis (truncated IS), mis (masked IS, icepop)."""
    tis_cap: float = 2.0
    """TIS cap C."""
    mis_low: float = 0.5
    """MIS lower ratio bound."""
    mis_high: float = 2.0
    """MIS upper ratio bound."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    old_policy: str = "decoupled"
    """π_old of the PPO ratio (one of OLD_POLICIES). decoupled: r = π_θ/π_old with the trainer's
    recomputed old logprobs; the rollout mismatch is handled only by `correction`. bypass: r =
    π_θ/π_rollout (no recompute forward) in the interval widened by the noise (rl.noise.widened_clip,
    algorithm.noise); needs correction=none (r already carries the mismatch)."""
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    """How the measured train/rollout noise widens the clip interval (bypass) and the TIS/MIS
    thresholds (noise.correction)."""
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    """Calibrated Clipping: mode, every, level, smoothing, limits."""
    recompute_check_every: int = 10
    """Where the rollout is bit-identical to the trainer (rollout.fp8=aligned, model.dtype=float32),
    the recompute of log π_old runs every N steps (steps 1, N+1, ...) as a check that it equals the
    rollout's logprobs (a difference stops the run); other steps take the rollout's logprobs as
    π_old. 1: recompute and check every step. Other runs recompute every step that needs it."""
    kl: KLConfig = field(default_factory=KLConfig)
    """KL to a reference policy: coef (0: off), estimator, in_reward, reference_path, precision, offload."""

    def __post_init__(self):
        _check(self.name in ALGORITHMS, "algorithm.name", f"{self.name!r} is not one of {ALGORITHMS}")
        _check(self.advantage in ADVANTAGES, "algorithm.advantage", f"{self.advantage!r} is not one of {ADVANTAGES}")
        _check(self.correction in CORRECTIONS, "algorithm.correction", f"{self.correction!r} is not one of {CORRECTIONS}")
        _check(self.tis_cap > 0, "algorithm.tis_cap", "must be > 0")
        _check(0 <= self.mis_low < self.mis_high, "algorithm.mis_low", "need 0 <= mis_low < mis_high")
        _check(self.recompute_check_every >= 1, "algorithm.recompute_check_every",
               f"must be >= 1 (1: every step), got {self.recompute_check_every}")
        self._check_noise_options()
        self._check_clip_calibration()

    @property
    def ratio_level(self) -> str:
        """The PPO ratio's level: sequence for GSPO, token otherwise."""
        return "sequence" if self.name == "gspo" else "token"

    def _check_clip_calibration(self):
        level, limits = self.calibration.level, self.calibration.limits
        _check(level in ("auto", self.ratio_level), "algorithm.calibration.level",
               f"{level} calibration cannot match algorithm.name={self.name}, whose "
               f"ratio is {self.ratio_level}-level; use auto or {self.ratio_level}")
        _check(self.calibration.mode != "gate" or (self.ratio_level == "token" and self.old_policy == "decoupled"),
               "algorithm.calibration.mode", f"gate is wired for token-level ratios with old_policy=decoupled "
               f"(the shadow's π_old), got algorithm.name={self.name}, old_policy={self.old_policy}")
        low, high = 1 - self.clip.low, 1 + self.clip.high
        _check(0 < limits.low_min <= low <= limits.low_max <= 1, "algorithm.calibration.limits.low_min",
               f"need 0 < limits.low_min <= 1 - clip.low <= limits.low_max <= 1, got "
               f"{limits.low_min} <= {low:g} <= {limits.low_max}")
        _check(1 <= limits.high_min <= high <= limits.high_max, "algorithm.calibration.limits.high_min",
               f"need 1 <= limits.high_min <= 1 + clip.high <= limits.high_max, got "
               f"{limits.high_min} <= {high:g} <= {limits.high_max}")

    def _check_noise_options(self):
        noise, clip = self.noise, self.clip
        _check(self.old_policy in OLD_POLICIES, "algorithm.old_policy",
               f"{self.old_policy!r} is not one of {OLD_POLICIES}")
        _check(self.old_policy == "decoupled" or self.correction == "none", "algorithm.correction",
               f"must be none with old_policy=bypass (the ratio π_θ/π_rollout already carries the "
               f"train/rollout mismatch), got {self.correction!r}")
        _check(clip.low <= noise.clip_low_max < 1, "algorithm.noise.clip_low_max",
               f"need clip.low <= noise.clip_low_max < 1, got {clip.low} and {noise.clip_low_max}")
        _check(clip.high <= noise.clip_high_max, "algorithm.noise.clip_high_max",
               f"need noise.clip_high_max >= clip.high, got {noise.clip_high_max} < {clip.high}")
        _check(noise.tis_cap_max >= self.tis_cap, "algorithm.noise.tis_cap_max",
               f"need noise.tis_cap_max >= tis_cap, got {noise.tis_cap_max} < {self.tis_cap}")
        _check(0 <= noise.mis_low_min <= self.mis_low, "algorithm.noise.mis_low_min",
               f"need 0 <= noise.mis_low_min <= mis_low, got {noise.mis_low_min} and {self.mis_low}")
        _check(noise.mis_high_max >= self.mis_high, "algorithm.noise.mis_high_max",
               f"need noise.mis_high_max >= mis_high, got {noise.mis_high_max} < {self.mis_high}")
        _check(not noise.correction or self.correction != "none", "algorithm.noise.correction",
               "calibrates the TIS/MIS thresholds: needs correction=tis or mis")
        _check(not noise.correction or (self.tis_cap >= 1 and self.mis_low <= 1 <= self.mis_high),
               "algorithm.noise.correction", "needs tis_cap >= 1 and mis_low <= 1 <= mis_high (the "
               f"calibration only widens around ρ = 1), got {self.tis_cap}, [{self.mis_low}, {self.mis_high}]")
