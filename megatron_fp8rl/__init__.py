"""megatron_fp8rl: Megatron-Core RL post-training with the whole pipeline in FP8."""

__version__ = "0.1.0"
