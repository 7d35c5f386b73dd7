"""RL math (layer L0): advantages, policy losses, mismatch correction, DAPO sampling, logprobs, metrics.

Pure tensor-in/tensor-out functions; imports torch and the standard library only, never megatron,
the model code, or any other megatron_fp8rl package. Modules:
    advantages   GRPO (with/without std), RLOO; per-sequence values onto tokens
    losses       PPO clip (clip-higher, dual clip), GSPO ratio, aggregation modes, KL, entropy bonus
    correction   TIS and MIS/IcePop weights between rollout and trainer policies
    noise        train/rollout noise floor, noise-calibrated clip/TIS/MIS thresholds, clip attribution
    sampling     DAPO dynamic sampling and overlong reward shaping
    logprobs     chunked and vocab-parallel logprob + entropy with a memory-light backward
    metrics      clip fractions, ratio and mismatch statistics, entropy
    common       input checks (RLInputError) and masked reductions
"""
