"""The run configuration of `megatron-fp8rl train`: one dataclass tree, loaded once at the entry
point (config.loader: YAML + dotted overrides) and handed down section by section.

Owns: `RunConfig` and its sections but `algorithm` (trainer/algorithm_config.py), their value checks
and the checks across sections (errors name the dotted key; config/checks.py).
Must not import: cli.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from megatron_fp8rl.config.checks import check as _check
from megatron_fp8rl.config.checks import check_number as _check_number
from megatron_fp8rl.config.renamed import RENAMED_KEYS
from megatron_fp8rl.data.arithmetic import OPERATIONS
from megatron_fp8rl.fp8.recipe import (
    RECIPE_NAMES, BlockwiseScaling, CurrentScaling, Fp8Recipe, RecipeFieldError, RecipeOverrides, recipe_by_name,
)
from megatron_fp8rl.fp8.serving import Fp8ServingPlan, RolloutFp8, plan_for
from megatron_fp8rl.data.records import DatasetSchema
from megatron_fp8rl.models.hf import FP8_BACKENDS as MODEL_FP8_BACKENDS
from megatron_fp8rl.models.te_recipe import megatron_fp8_fields
from megatron_fp8rl.rl.losses import AGGREGATION_MODES
from megatron_fp8rl.rollout.sglang_common import SGLANG_DTYPES, SGLangSettings
from megatron_fp8rl.trainer.algorithm_config import AlgorithmConfig
from megatron_fp8rl.trainer.checkpoint import CheckpointConfig
from megatron_fp8rl.trainer.megatron_step import OptimConfig

ROLLOUT_MODES = ("colocated", "disaggregated")
WEIGHT_TRANSFERS = ("tensor", "distributed", "disk")
TRAINER_FP8 = ("none", *RECIPE_NAMES)
MODEL_DTYPES = ("float32", "bfloat16")
STEP_WEIGHT_SCALES = ("live", "frozen")
ROLLOUT_DTYPES = tuple(dtype for dtype in SGLANG_DTYPES if dtype != "auto")
"""SGLang's dtypes but auto: a run compares the served dtype with model.dtype."""


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
