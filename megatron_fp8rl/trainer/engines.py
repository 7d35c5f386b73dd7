"""Starting the run's rollout engine on global rank 0.

Owns: `start_engine` (the colocated SGLang engine, or the SGLang server of rollout.mode=
disaggregated) and `sglang_config` (the rollout section serving this run's checkpoint).
Must not import: cli, trainer.loop, trainer.rl_step.
"""
from __future__ import annotations

from pathlib import Path

from megatron_fp8rl.rollout.engine import RolloutEngine
from megatron_fp8rl.trainer.config import RunConfig
from megatron_fp8rl.trainer.rollout_start import rollout_model_path


def start_engine(cfg: RunConfig) -> RolloutEngine:
    """Rank 0: the rollout engine of rollout.mode, serving from the first rollout on what every
    weight sync will send (`rollout_model_path`). The caller shuts it down."""
    return _start_server(cfg) if cfg.rollout.mode == "disaggregated" else _start_colocated(cfg)


def sglang_config(cfg: RunConfig):
    """The rollout section (an SGLangSettings) serving this run's checkpoint, seeded with train.seed."""
    from megatron_fp8rl.rollout.sglang_common import SGLangConfig

    return SGLangConfig.serving(cfg.rollout, rollout_model_path(cfg), random_seed=cfg.train.seed)


def _start_colocated(cfg: RunConfig):
    """The in-process SGLang engine beside trainer rank 0."""
    from megatron_fp8rl.rollout.sglang_engine import SGLangEngine

    return SGLangEngine(sglang_config(cfg), bucket_mb=cfg.rollout.bucket_mb)


def _start_server(cfg: RunConfig):
    """rollout.mode=disaggregated: an SGLang server subprocess (on rollout.server_devices) or the
    server at rollout.server_url, fed by rollout.weight_transfer (distributed or disk)."""
    from megatron_fp8rl.rollout.sglang_server import SGLangServer

    rollout, run_dir = cfg.rollout, Path(cfg.run_dir)
    config = sglang_config(cfg)
    if rollout.server_tp > 1:
        config.extra = {**config.extra, "tp_size": rollout.server_tp}
    return SGLangServer(config, url=rollout.server_url or None, weight_transfer=rollout.weight_transfer,
                        bucket_mb=rollout.bucket_mb, devices=rollout.server_devices or None,
                        update_dir=run_dir / "weight_updates", log_path=run_dir / "sglang_server.log")
