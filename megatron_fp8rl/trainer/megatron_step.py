"""One Megatron-Core optimizer step over micro-batches, at any TP/PP/DP layout.

Owns: Megatron DDP wrapping, the Megatron optimizer, and the call into Megatron's pipeline schedule.
Must not import: cli. The RL loss is passed in as a function; this module knows no RL.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import (
    MegatronOptimizer,
    OptimizerConfig,
    ParamKey,
    get_megatron_optimizer,
    get_standard_config_overrides,
)
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module

from megatron_fp8rl.compat.megatron_optim import fuse_torch_adam
from megatron_fp8rl.fp8.quantizer import weights_updated

# A micro-batch is whatever the caller's forward and loss functions read (a dict of tensors, or
# the RL step's typed trainer.batch.RolloutBatch); this module only hands it on. The loss function
# maps (micro-batch, model output) to (scalar loss, metrics dict). Model output is [batch, seq]
# per-token losses or logits.
MicroBatch = Any
LossFn = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
ForwardFn = Callable[[torch.nn.Module, MicroBatch], torch.Tensor]


@dataclass
class OptimConfig:
    """Optimizer settings for the actor (the run config's `train` section is one: trainer/config.py).
    Errors name the field ("lr: ..."); the run config prefixes its section."""

    lr: float = 1e-5
    """Adam learning rate (constant)."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables it, as Megatron-LM's --clip-grad 0; grad_norm is then
    reported as nan)."""
    distributed_optimizer: bool = True
    """Shard optimizer state over the data-parallel group (Megatron's distributed optimizer)."""
    norm_lr_mult: float = 1.0
    """Learning rate of the normalization gains (every parameter whose name holds `layernorm` or
    `layer_norm`: input, pre-MLP, q/k and final norms, local or TE spec) as a multiple of lr; 0
    freezes them. Megatron bf16 training hides a gain's update from its forward until it adds up to
    half a bf16 spacing (the gains sit on the bf16 grid: bench/bf16_update_visibility.py); this
    makes the choice explicit for an FP8 or float32 run. Megatron's param-group overrides
    (optimizer.ParamKey) carry it."""

    def __post_init__(self):
        for name, low_open in (("lr", True), ("weight_decay", False), ("clip_grad", False),
                               ("norm_lr_mult", False)):
            value = getattr(self, name)
            if not (math.isfinite(value) and (value > 0 if low_open else value >= 0)):
                raise ValueError(f"{name}: must be a finite number {'>' if low_open else '>='} 0, got {value}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name}: must be in [0, 1), got {getattr(self, name)}")


def wrap_ddp(model: torch.nn.Module, distributed_optimizer: bool) -> DistributedDataParallel:
    """Megatron DDP with fp32 grad buffers (required by the distributed optimizer). A bf16/fp16
    model (`config.bf16`/`fp16`) is first wrapped in Megatron's Float16Module, as Megatron's own
    `get_model` does: weights in half precision, first-stage inputs cast down, last-stage outputs
    cast up to fp32; the optimizer then keeps fp32 master weights (`build_optimizer`)."""
    if model.config.bf16 or model.config.fp16:
        model = Float16Module(model.config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=distributed_optimizer,
    )
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    # Megatron's schedule calls this after the last backward: without it DP gradients are never
    # reduced and tied embedding gradients are never summed across the first and last stages.
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = ddp.no_sync
    return ddp


def build_optimizer(model: DistributedDataParallel, cfg: OptimConfig) -> MegatronOptimizer:
    """Megatron's Adam(W) over the DDP-wrapped model chunk; for a bf16/fp16 model, Megatron's
    mixed-precision optimizer: fp32 master weights, stepped from the fp32 gradient buffers and
    copied back into the half-precision weights."""
    config = OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        clip_grad=cfg.clip_grad,
        use_distributed_optimizer=cfg.distributed_optimizer,
        bf16=model.config.bf16,
        fp16=model.config.fp16,
        params_dtype=model.config.params_dtype,
    )
    overrides = None  # Megatron's standard groups, as before norm_lr_mult existed
    if cfg.norm_lr_mult != 1.0:
        if not any(_is_norm(name) for name, _ in model.named_parameters()):
            raise ValueError(f"norm_lr_mult: {cfg.norm_lr_mult} set, but no parameter of the model is a "
                             f"normalization gain (no name holds 'layernorm' or 'layer_norm')")
        overrides = get_standard_config_overrides(config)
        overrides[ParamKey(name=NORM_PARAM_NAMES)] = {"lr": cfg.lr * cfg.norm_lr_mult}
    optimizer = get_megatron_optimizer(config, [model], config_overrides=overrides)
    fuse_torch_adam(optimizer)
    return optimizer


NORM_PARAM_NAMES = ("*layernorm*", "*layer_norm*")
"""Megatron names of normalization parameters (fnmatch patterns, as optimizer.ParamKey matches)."""


def _is_norm(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in NORM_PARAM_NAMES)


@dataclass
class StepResult:
    """What one optimizer step reports (loss metrics are averaged over micro-batches and DP)."""

    metrics: dict[str, float]
    grad_norm: float
    update_successful: bool


def train_step(
    model: DistributedDataParallel,
    optimizer: MegatronOptimizer,
    micro_batches: list[MicroBatch],
    forward_fn: ForwardFn,
    loss_fn: LossFn,
    seq_length: int,
    micro_batch_size: int,
) -> StepResult:
    """Forward/backward over `micro_batches` through Megatron's schedule, then one optimizer step.

    The schedule divides each micro-batch loss by the number of micro-batches; DDP averages
    gradients over data-parallel ranks. Metrics come back on every rank (broadcast from the last
    pipeline stage and averaged over DP).
    """
    losses = forward_backward(model, optimizer, micro_batches, forward_fn, loss_fn, seq_length, micro_batch_size)
    stepped = optimizer.step()
    weights_updated()  # the device path's FP8 weight cache (fp8/device_quantize.py)
    return step_result(losses, stepped)


def forward_backward(
    model: DistributedDataParallel,
    optimizer: MegatronOptimizer,
    micro_batches: list[MicroBatch],
    forward_fn: ForwardFn,
    loss_fn: LossFn,
    seq_length: int,
    micro_batch_size: int,
) -> list[dict[str, torch.Tensor]]:
    """Zeroed gradients, then forward/backward over `micro_batches` through Megatron's schedule:
    what `train_step` does before `optimizer.step()`, for a caller that steps the optimizer itself
    (trainer.actor.MegatronActor.update). Returns the per-micro-batch metrics (`step_result`)."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    return _run_schedule(model, micro_batches, forward_fn, loss_fn, seq_length, micro_batch_size,
                         forward_only=False)


def step_result(losses: list[dict[str, torch.Tensor]], optimizer_step: tuple) -> StepResult:
    """The StepResult of `forward_backward`'s metrics and what `optimizer.step()` returned."""
    update_successful, grad_norm, _ = optimizer_step
    return StepResult(
        metrics=_reduce_metrics(losses),
        grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
        update_successful=bool(update_successful),
    )


def forward_only(
    model: DistributedDataParallel,
    micro_batches: list[MicroBatch],
    forward_fn: ForwardFn,
    collect_fn: LossFn,
    seq_length: int,
    micro_batch_size: int,
) -> list[dict[str, torch.Tensor]]:
    """Forward over `micro_batches` without gradients through Megatron's schedule.

    Returns what `collect_fn` put in its metrics dict, one dict per micro-batch, on the last
    pipeline stage; an empty list on other stages. All micro-batches must share one shape.
    """
    with torch.no_grad():
        return _run_schedule(model, micro_batches, forward_fn, collect_fn, seq_length, micro_batch_size,
                             forward_only=True)


def _run_schedule(model, micro_batches: list[MicroBatch], forward_fn: ForwardFn, loss_fn: LossFn,
                  seq_length: int, micro_batch_size: int, forward_only: bool) -> list[dict[str, torch.Tensor]]:
    """Megatron's forward(/backward) schedule for this layout over `micro_batches`."""

    def forward_step(data_iterator: Iterator[MicroBatch], chunk: torch.nn.Module):
        batch = next(data_iterator)
        output = forward_fn(chunk, batch)
        return output, lambda out: _detached_metrics(*loss_fn(batch, out))

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=model,
        num_microbatches=len(micro_batches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


def _detached_metrics(
    loss: torch.Tensor, metrics: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Copy metrics out of the autograd graph. Megatron's schedule divides the returned loss by the
    number of micro-batches *in place*, so a metric that aliases the loss would be divided too."""
    return loss, {name: value.detach().clone() for name, value in metrics.items()}


def _reduce_metrics(per_micro_batch: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Average metrics over micro-batches and DP ranks; broadcast from the last pipeline stage."""
    names = sorted(per_micro_batch[0]) if per_micro_batch else []
    device = _comm_device()
    count = torch.tensor([len(names)], dtype=torch.float64, device=device)
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    last = parallel_state.get_pipeline_model_parallel_last_rank()
    torch.distributed.broadcast(count, src=last, group=pp_group)
    values = torch.zeros(int(count.item()), dtype=torch.float64, device=device)
    if per_micro_batch:
        values = torch.stack(
            [torch.stack([mb[n].detach().double().reshape(()) for mb in per_micro_batch]).mean()
             for n in names]
        ).to(device)
    torch.distributed.broadcast(values, src=last, group=pp_group)
    dp_group = parallel_state.get_data_parallel_group()
    torch.distributed.all_reduce(values, group=dp_group)
    values /= torch.distributed.get_world_size(dp_group)
    names_list = [names]
    torch.distributed.broadcast_object_list(names_list, src=last, group=pp_group)
    return dict(zip(names_list[0], values.tolist()))


def _comm_device() -> torch.device:
    """Where collective buffers live: the current GPU under NCCL, the CPU under gloo."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
