"""The run configuration of `megatron-fp8rl train`: one dataclass tree, loaded once at the entry
point (config.loader: YAML + dotted overrides) and handed down section by section.

Owns: `RunConfig` and its sections, and their value checks (errors name the dotted key).
Must not import: cli.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar

from megatron_fp8rl.config.renamed import RENAMED_KEYS
from megatron_fp8rl.data.arithmetic import OPERATIONS
from megatron_fp8rl.fp8.recipe import (
    RECIPE_NAMES, BlockwiseScaling, CurrentScaling, Fp8Recipe, RecipeFieldError, RecipeOverrides, recipe_by_name,
)
from megatron_fp8rl.fp8.serving import Fp8ServingPlan, RolloutFp8, plan_for
from megatron_fp8rl.data.records import DatasetSchema
from megatron_fp8rl.models.hf import FP8_BACKENDS as MODEL_FP8_BACKENDS
from megatron_fp8rl.models.te_recipe import megatron_fp8_fields
from megatron_fp8rl.rl.calibrated_clipping import CALIBRATION_RULES, ClipLimits
from megatron_fp8rl.rl.kl import VERL_NAMES as KL_ESTIMATORS
from megatron_fp8rl.rl.losses import AGGREGATION_MODES
from megatron_fp8rl.rollout.sglang_common import SGLANG_DTYPES, SGLangSettings
from megatron_fp8rl.trainer.checkpoint import CheckpointConfig
from megatron_fp8rl.trainer.megatron_step import OptimConfig

ALGORITHMS = ("grpo", "dapo", "gspo")
ADVANTAGES = ("grpo", "grpo_no_std", "rloo")
CORRECTIONS = ("none", "tis", "mis")
OLD_POLICIES = ("decoupled", "bypass")
ROLLOUT_MODES = ("colocated", "disaggregated")
WEIGHT_TRANSFERS = ("tensor", "distributed", "disk")
TRAINER_FP8 = ("none", *RECIPE_NAMES)
CLIP_CALIBRATIONS = ("none", "shadow", "monitor", "gate")
CLIP_CALIBRATION_LEVELS = ("auto", "token", "sequence")
MODEL_DTYPES = ("float32", "bfloat16")
REFERENCE_PRECISIONS = ("actor", "bfloat16", "float32")
STEP_WEIGHT_SCALES = ("live", "frozen")
ROLLOUT_DTYPES = tuple(dtype for dtype in SGLANG_DTYPES if dtype != "auto")
"""SGLang's dtypes but auto: a run compares the served dtype with model.dtype."""


def _check(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ValueError(f"{key}: {message}")


def _check_number(value: float, key: str, low: float, high: float = math.inf, low_open: bool = False) -> None:
    """`key` must be a finite number in [low, high] ((low, high] when `low_open`)."""
    above = value > low if low_open else value >= low
    _check(math.isfinite(value) and above and value <= high, key,
           f"must be a finite number {'>' if low_open else '>='} {low}"
           + (f" and <= {high}" if high != math.inf else "") + f", got {value}")


@dataclass
class ModelConfig:
    """The actor."""

    hf_path: str = ""
    """Hugging Face checkpoint folder to start from (config.json, safetensors, tokenizer)."""
    tensor_parallel: int = 1
    """Megatron tensor-parallel size."""
    pipeline_parallel: int = 1
    """Megatron pipeline-parallel size."""
    fp8: str = "none"
    """Trainer FP8 recipe for every transformer linear: one of TRAINER_FP8."""
    fp8_recipe: RecipeOverrides = field(default_factory=RecipeOverrides)
    """Fields of the `fp8` recipe (fp8/recipe.py) replacing the named recipe's own values; null
    keeps them. Megatron-LM's --fp8-margin, --fp8-amax-history-len, --fp8-amax-compute-algo and
    --fp8-format are margin, amax_history_len, amax_compute_algo and fp8_format here; the
    calibrated recipe adds criterion, saturation_budget, overflow_tolerance, ...; blockwise its
    blocks. A field the named recipe lacks, or a value it refuses, is an error naming
    model.fp8_recipe.<field>."""
    fp8_backend: str = "ours"
    """Who computes the trainer's FP8 GEMMs (one of MODEL_FP8_BACKENDS): ours (our FP8 linear,
    torch._scaled_mm, on both tiers: the arithmetic aligned rollouts serve) or te (Transformer
    Engine's layers under TE's autocast with the recipe; needs CUDA and TE)."""
    dtype: str = "float32"
    """Parameter and activation dtype (one of MODEL_DTYPES). bfloat16 is Megatron mixed precision:
    bf16 weights and activations, fp32 master weights, fp32 gradient accumulation and reduction."""
    fp8_step_weight_scales: str = "live"
    """The FP8 weight scales of a step's training forwards (STEP_WEIGHT_SCALES): live (from each
    mini-batch's current weights) or frozen (θ_old's, as the recompute took them, held through the
    step's mini-batches, so a weight's code moves only where the element itself crosses a rounding
    boundary; bench/ratio_noise.py). frozen: current-scaling recipes (groupwise32, groupwise,
    blockwise, tensorwise) with fp8_backend=ours, CPU tier."""

    def __post_init__(self):
        _check(self.fp8 in TRAINER_FP8, "model.fp8", f"{self.fp8!r} is not one of {TRAINER_FP8}")
        overrides = self.fp8_recipe.set_fields()
        _check(self.fp8 != "none" or not overrides, f"model.fp8_recipe.{next(iter(overrides), '')}",
               f"sets {sorted(overrides)} but model.fp8 is none: no recipe to change")
        if self.fp8 != "none":
            self.recipe()  # refuse bad fields now, naming them
        _check(self.fp8_backend in MODEL_FP8_BACKENDS, "model.fp8_backend",
               f"{self.fp8_backend!r} is not one of {MODEL_FP8_BACKENDS}")
        _check(self.fp8_backend == "ours" or self.fp8 != "none", "model.fp8_backend",
               "te runs an FP8 recipe: set model.fp8, or use fp8_backend=ours")
        if self.fp8_backend == "te":
            try:
                megatron_fp8_fields(self.recipe())
            except ValueError as error:
                raise ValueError(f"model.fp8_backend: te cannot run model.fp8={self.fp8} as configured "
                                 f"(model.fp8_recipe): {error}; use fp8_backend=ours") from None
        _check(self.dtype in MODEL_DTYPES, "model.dtype", f"{self.dtype!r} is not one of {MODEL_DTYPES}")
        self._check_step_weight_scales()
        _check(self.tensor_parallel >= 1 and self.pipeline_parallel >= 1, "model",
               "tensor_parallel and pipeline_parallel must be >= 1")

    def _check_step_weight_scales(self) -> None:
        key = "model.fp8_step_weight_scales"
        _check(self.fp8_step_weight_scales in STEP_WEIGHT_SCALES, key,
               f"{self.fp8_step_weight_scales!r} is not one of {STEP_WEIGHT_SCALES}")
        if self.fp8_step_weight_scales == "live":
            return
        _check(self.fp8 != "none", key, "frozen holds FP8 weight scales: set model.fp8")
        _check(self.fp8_backend == "ours", key, "frozen is wired for our FP8 linear (model.fp8_backend=ours), "
               "not for TE's layers (te)")
        _check(isinstance(self.recipe(), (BlockwiseScaling, CurrentScaling)), key,
               f"frozen holds current-scaling weight scales (groupwise32, groupwise, blockwise, tensorwise); "
               f"model.fp8={self.fp8} keeps its own weight scaling state, not wired")

    def recipe(self) -> Fp8Recipe | None:
        """The trainer's FP8 recipe: the `fp8` recipe with the `fp8_recipe` fields that are set;
        None without FP8. ValueError naming model.fp8_recipe.<field> for what the recipe refuses."""
        if self.fp8 == "none":
            return None
        try:
            return recipe_by_name(self.fp8, **self.fp8_recipe.set_fields())
        except RecipeFieldError as exc:
            keys = ", ".join(f"model.fp8_recipe.{name}" for name in exc.fields)
            raise ValueError(f"{keys} (model.fp8={self.fp8}): {exc}") from None


@dataclass
class RolloutConfig(SGLangSettings):
    """Sampling, and how SGLang starts: this section is an SGLangSettings
    (rollout/sglang_common.py: dtype, device, attention_backend, max_total_tokens,
    mem_fraction_static, deterministic, log_level, fp8, activation_scheme, fp8_backend,
    memory_saver, extra; checked there), which serves model.hf_path, or its FP8 export for
    rollout.fp8, seeded with train.seed. In a run, rollout.fp8=aligned needs model.fp8 in
    fp8/recipe.py's aligned_recipe_names(): groupwise (step-0 accuracy within 1 point of float32 on mul/mul2, 5 points
    lower on add/mul; docs/fp8.md), or a per-tensor recipe such as calibrated; rollout.deterministic
    derives per-sample seeds from (train.seed, step), so a resumed run's rollouts equal an
    uninterrupted run's (exact resume), at some speed cost."""

    dtype: str = "float32"
    """Dtype SGLang serves in (ROLLOUT_DTYPES): model.dtype, unless rollout.fp8 is blockwise or
    per_tensor (then the unquantized parts, e.g. lm_head and norms, are served in it)."""
    max_total_tokens: int | None = 8192
    """SGLang KV-cache size in tokens (required on CPU; null: SGLang sizes it from
    mem_fraction_static)."""
    n_samples: int = 8
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature (logprobs are always at temperature 1)."""
    top_p: float = 1.0
    """Nucleus sampling."""
    max_new_tokens: int = 32
    """Response length cap."""
    mode: str = "colocated"
    """colocated (SGLang beside trainer rank 0, its memory released while training) or
    disaggregated (an SGLang server on other devices or nodes)."""
    server_url: str = ""
    """disaggregated: URL of a running SGLang server; empty starts one as a subprocess."""
    weight_transfer: str = "tensor"
    """How new weights reach SGLang (one of WEIGHT_TRANSFERS): tensor (update_weights_from_tensor,
    in-process), distributed (update_weights_from_distributed over a process group: gloo on CPU,
    NCCL on GPU), disk (SGLang reloads a written HF snapshot)."""
    bucket_mb: int = 512
    """Largest weight-transfer bucket, in MiB."""
    server_devices: str = ""
    """disaggregated, server started here: CUDA_VISIBLE_DEVICES of the server (e.g. "4,5,6,7");
    empty inherits this process's devices."""
    server_tp: int = 1
    """disaggregated, server started here: SGLang tensor-parallel size."""

    def __post_init__(self):
        try:
            super().__post_init__()
        except ValueError as error:
            raise ValueError(f"rollout.{error}") from None
        _check(self.n_samples >= 2, "rollout.n_samples", f"must be >= 2 for group advantages, got {self.n_samples}")
        _check(self.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1")
        _check_number(self.temperature, "rollout.temperature", 0)
        _check_number(self.top_p, "rollout.top_p", 0, 1, low_open=True)
        _check(self.dtype in ROLLOUT_DTYPES, "rollout.dtype", f"{self.dtype!r} is not one of {ROLLOUT_DTYPES} "
               "(the trainer compares its logprobs with a known served dtype)")
        _check(self.max_total_tokens is None or self.max_total_tokens > self.max_new_tokens, "rollout.max_total_tokens",
               f"must exceed rollout.max_new_tokens ({self.max_new_tokens}), got {self.max_total_tokens}")
        _check("tp_size" not in self.extra, "rollout.extra.tp_size", "use rollout.server_tp (disaggregated)")
        _check(self.mode in ROLLOUT_MODES, "rollout.mode", f"{self.mode!r} is not one of {ROLLOUT_MODES}")
        _check(self.weight_transfer in WEIGHT_TRANSFERS, "rollout.weight_transfer",
               f"{self.weight_transfer!r} is not one of {WEIGHT_TRANSFERS}")
        _check(self.bucket_mb >= 1, "rollout.bucket_mb", f"must be >= 1, got {self.bucket_mb}")
        _check(self.server_tp >= 1, "rollout.server_tp", f"must be >= 1, got {self.server_tp}")
        disaggregated = self.mode == "disaggregated"
        _check(disaggregated or not (self.server_url or self.server_devices or self.server_tp > 1),
               "rollout.mode", "server_url, server_devices and server_tp need rollout.mode=disaggregated")
        _check(not disaggregated or self.weight_transfer != "tensor", "rollout.weight_transfer",
               "tensor (update_weights_from_tensor) needs the in-process engine of rollout.mode="
               "colocated; use distributed or disk with rollout.mode=disaggregated")
        _check(disaggregated or self.weight_transfer == "tensor", "rollout.weight_transfer",
               f"{self.weight_transfer} is implemented for rollout.mode=disaggregated only; "
               "colocated uses tensor")
        _check(not (self.server_url and self.fp8_mode is not RolloutFp8.NONE), "rollout.fp8",
               f"{self.fp8} with rollout.server_url: the server must serve the FP8 checkpoint this run "
               "prepares (<run_dir>/rollout_fp8); leave server_url empty so the run starts it")
        _check(not (self.server_url and (self.server_devices or self.server_tp > 1)), "rollout.server_url",
               "a server reached by URL was started elsewhere: server_devices/server_tp do not apply")


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


@dataclass
class DataConfig:
    """Prompts and rewards."""

    train: str = "builtin:arithmetic"
    """Prompt file (.jsonl/.parquet; see data.records) or builtin:arithmetic."""
    eval: str = "builtin:arithmetic"
    """Held-out prompts for greedy evaluation (builtin:arithmetic uses the eval split)."""
    schema: DatasetSchema = field(default_factory=DatasetSchema)
    """Which fields of a prompt file's rows hold the prompt or chat, the answer and the id."""
    arithmetic_ops: list[str] = field(default_factory=lambda: ["add", "mul"])
    """Operations of the built-in task."""
    train_size: int = 2000
    """Problems drawn from the built-in train split."""
    eval_size: int = 500
    """Held-out problems evaluated at the start and the end of a run (builtin:arithmetic: drawn
    from its eval split with eval_seed; a file: its first eval_size rows)."""
    eval_seed: int = 0
    """Seed of the built-in held-out draw: fixed, not train.seed, so every seed and arm of a study
    is scored on the same problems."""
    eval_interim_size: int = 0
    """Held-out problems evaluated by the evals between the first and the last (the first N of the
    held-out list, the same N each time); 0: all eval_size."""
    reward: str = "last_number"
    """Reward: a built-in (math_verify, last_number) or 'package.module:function'."""
    reward_timeout_s: float = 10.0
    """A reward call that takes longer scores 0 and is counted."""
    prompts_per_step: int = 8
    """Prompt groups per optimizer step."""

    def __post_init__(self):
        _check(self.prompts_per_step >= 1, "data.prompts_per_step", "must be >= 1")
        _check(self.train_size >= 1, "data.train_size", f"must be >= 1, got {self.train_size}")
        _check(self.eval_size >= 1, "data.eval_size", f"must be >= 1, got {self.eval_size}")
        _check(0 <= self.eval_interim_size <= self.eval_size, "data.eval_interim_size",
               f"must be in [0, data.eval_size={self.eval_size}] (0: all), got {self.eval_interim_size}")
        unknown = sorted(set(self.arithmetic_ops) - set(OPERATIONS))
        _check(bool(self.arithmetic_ops) and not unknown, "data.arithmetic_ops",
               f"unknown {unknown or 'empty list'}; choose from {sorted(OPERATIONS)}")
        _check_number(self.reward_timeout_s, "data.reward_timeout_s", 0, low_open=True)
        for key, value in dataclasses.asdict(self.schema).items():
            _check(bool(value.strip()) and "" not in value.split("."), f"data.schema.{key}",
                   f"must name a field (dots step into nested objects), got {value!r}")


@dataclass
class TrainConfig(OptimConfig):
    """The optimization schedule, and the actor's optimizer: this section is an OptimConfig
    (trainer/megatron_step.py: train.lr, weight_decay, adam_beta1, adam_beta2, clip_grad,
    distributed_optimizer, checked there) that the actor builds its optimizer from."""

    steps: int = 10
    """RL steps (each: rollout, one or more optimizer steps, weight sync)."""
    mini_batches: int = 1
    """Optimizer steps per RL step (the batch is split into this many mini-batches)."""
    micro_batch_size: int = 8
    """Sequences per forward/backward."""
    seed: int = 1234
    """Seed for model init, data order and sampling."""
    eval_every: int = 5
    """Greedy eval every N steps (and before the first and after the last: all data.eval_size
    problems; in between data.eval_interim_size); 0: never."""
    resume_changed_config: bool = False
    """Continue a run_dir made with a different config (same model); refused otherwise."""

    def __post_init__(self):
        try:
            super().__post_init__()
        except ValueError as error:
            raise ValueError(f"train.{error}") from None
        _check(self.distributed_optimizer, "train.distributed_optimizer", "false is not wired: the actor's "
               "DDP buffers, weight sync and checkpoints run Megatron's distributed optimizer only")
        _check(self.steps >= 1, "train.steps", "must be >= 1")
        _check(self.mini_batches >= 1, "train.mini_batches", f"must be >= 1, got {self.mini_batches}")
        _check(self.micro_batch_size >= 1, "train.micro_batch_size", f"must be >= 1, got {self.micro_batch_size}")
        _check(self.eval_every >= 0, "train.eval_every", f"must be >= 0 (0: never), got {self.eval_every}")


@dataclass
class RunConfig:
    """Everything one `megatron-fp8rl train` run needs."""

    run_dir: str = "runs/rl"
    """Output folder: config.yaml, tensorboard logs, checkpoints, the final HF model."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The actor."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling and SGLang."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """RL algorithm."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts and rewards."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimization."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints (checkpoint.dir defaults to <run_dir>/checkpoints)."""

    renamed_keys: ClassVar[dict[str, str]] = RENAMED_KEYS
    """Old dotted keys the loader refuses, naming the new one (config/renamed.py)."""

    @property
    def trainer_fp8_gemm(self) -> str:
        """The GEMM of the trainer's FP8 linears: batch_invariant for aligned rollouts (the Triton
        kernel the SGLang fp8rl method also runs on GPU, 'tiled' on CPU), else auto."""
        return self.fp8_plan.trainer_gemm

    @property
    def rollout_bit_identical(self) -> bool:
        """Whether the rollout's logprobs are the trainer's recompute bit for bit: aligned FP8
        rollouts on a float32 trainer (bf16 rounds apart in SGLang's and Megatron's kernels)."""
        return self.fp8_plan.aligned and self.model.dtype == "float32"

    @property
    def fp8_plan(self) -> Fp8ServingPlan:
        """The FP8 serving plan of (model.fp8, rollout.fp8) (fp8/serving.py; built once per pair):
        what the actor, the loop, the weight publisher and the rollout checkpoint read."""
        return plan_for(self.rollout.fp8_mode, self.model.fp8)

    def __post_init__(self):
        _check(bool(self.model.hf_path), "model.hf_path", "is required (an HF checkpoint folder)")
        _check(self.algorithm.calibration.mode == "none" or self.model.fp8 != "none"
               or self.model.dtype != "float32", "algorithm.calibration.mode",
               f"{self.algorithm.calibration.mode} compares the trainer's ratios with a higher-precision "
               "shadow's: it needs an FP8 trainer (model.fp8) or a bf16 one (model.dtype=bfloat16, "
               "shadowed in float32); a float32 trainer without FP8 has nothing higher to compare with")
        _check(self.algorithm.calibration.mode == "none" or self.model.fp8_backend == "ours",
               "algorithm.calibration.mode", "the shadow's high-precision forward is wired for our FP8 linear "
               "(model.fp8_backend=ours), not for TE's layers (te)")
        _check(self.rollout.fp8_mode.own_quantization or self.rollout.dtype == self.model.dtype,
               "rollout.dtype", f"{self.rollout.dtype!r} differs from model.dtype={self.model.dtype!r}: "
               f"without FP8 rollouts (rollout.fp8={self.rollout.fp8!r}) SGLang must serve the trainer's "
               "dtype, or every logprob carries the dtype gap; set them equal")
        _check(not (self.fp8_plan.aligned and self.model.fp8_recipe.scale_pow2), "model.fp8_recipe.scale_pow2",
               "rollout.fp8=aligned is not wired for power-of-two scales: the rollout's quantization computes "
               "fp32 block scales, so its logprobs would not be the trainer's; use rollout.fp8=none or "
               "scale_pow2=false")
        _check(not (self.fp8_plan.aligned and self.model.fp8_backend == "te"), "model.fp8_backend",
               "te with rollout.fp8=aligned is not wired: aligned rollouts serve our FP8 linear's "
               "arithmetic; use model.fp8_backend=ours")
        _check(not (self.algorithm.kl.enabled and self.algorithm.kl.precision == "actor" and self.model.fp8 != "none"
                    and self.model.fp8_backend == "te"), "algorithm.kl.precision",
               "actor with model.fp8_backend=te is not wired: TE does not update forward FP8 scales in no-grad "
               "passes, and the reference runs only those; use bfloat16 or float32")
        _check(self.algorithm.agg_mode in AGGREGATION_MODES, "algorithm.agg_mode",
               f"{self.algorithm.agg_mode!r} is not one of {AGGREGATION_MODES}")
