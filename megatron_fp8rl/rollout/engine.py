"""The rollout engine interface: what the trainer asks of whatever serves rollouts.

Owns: `SamplingParams`, `RolloutSample`, the `RolloutEngine` protocol and the rollout error types.
Must not import: convert, data, trainer, cli (layer L3 imports only L0-L2 of ours).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol

import torch


class RolloutEngineError(RuntimeError):
    """The rollout engine could not start, answer or stay alive; the message says which and why."""


class WeightUpdateError(ValueError):
    """A weight update was refused before it reached the engine; the engine keeps its old weights."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample continuations. Validated where it is made."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy. Logprobs are always returned at temperature 1."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 keeps all."""
    max_new_tokens: int = 128
    """Upper bound on generated tokens per sample."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a sample (in addition to the model's EOS); the stop token is kept."""
    seed: int | None = None
    """Base seed; sample j of a call gets seed + j. SGLang honours it only with deterministic
    inference enabled (`SGLangConfig.deterministic`)."""

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (all) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass(frozen=True)
class RolloutSample:
    """One generated continuation of one prompt."""

    prompt_index: int
    """Index of the prompt in the `generate` call."""
    prompt_token_ids: list[int]
    """The prompt, as given."""
    token_ids: list[int]
    """Generated tokens, [T]; includes the stop token when one ended the sample."""
    logprobs: list[float]
    """Per generated token log p(token | prefix) at temperature 1, [T] (the rollout logprobs)."""
    finish_reason: str
    """"stop" (EOS or a stop token), "length" (max_new_tokens) or "abort"."""
    weight_version: int
    """Version of the weights that generated every token of this sample."""
    meta: dict = field(default_factory=dict, compare=False)
    """Engine-specific details (e.g. SGLang's weight-version spans), for logs only."""


class RolloutEngine(Protocol):
    """What the trainer needs from a rollout engine. Implementations: `SGLangEngine` (in-process)
    and `SGLangServer` (a server subprocess behind HTTP)."""

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams, n: int = 1) -> list[RolloutSample]:
        """n samples per prompt, ordered prompt-major: [p0s0, p0s1, ..., p1s0, ...]."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace weights (HF names, full shapes); later samples report `version`. Validates every
        name and shape first and raises `WeightUpdateError` without touching the engine."""

    def release_memory(self) -> None:
        """Colocated mode: free weights and KV cache so the trainer can use the memory."""

    def resume_memory(self, tags: Iterable[str] | None = None) -> None:
        """Colocated mode: take the memory of `tags` (None: all) back after `release_memory`:
        the weights before a weight sync, the rest after it."""

    def health(self) -> bool:
        """Whether the engine answers."""

    def shutdown(self) -> None:
        """Stop the engine and every process it started. Idempotent."""
