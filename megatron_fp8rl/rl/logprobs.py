"""Per-token logprobs and entropy from logits, chunked over tokens, optionally vocab-parallel.

For logits x_t ∈ R^V at temperature τ, z = x/τ, p = softmax(z):
    logprob_t = z_{y_t} − logsumexp(z)
    entropy_t = −Σ_j p_j log p_j = logsumexp(z) − Σ_j p_j z_j
Gradients (what the custom backward computes, per token):
    ∂logprob/∂z_j = 1[j = y_t] − p_j          ∂entropy/∂z_j = −p_j (log p_j + entropy)
    ∂/∂x = ∂/∂z / τ

Memory: a naive implementation materializes several [N, V] tensors (log_softmax, softmax, their
product) and autograd keeps some of them for backward. Here the forward walks over row chunks
holding two fp32 [chunk, V] buffers (reused) and saves only the logits (a reference, not a copy)
and four [N] vectors; the backward recomputes each chunk's softmax and writes the gradient
straight into one logits-shaped tensor. Arithmetic is fp32 (fp64 for fp64 logits) whatever the
logits' dtype. Logits must be finite. On one vocab shard at τ = 1 the logprob is torch.log_softmax
at the target (SGLang's formula, so aligned rollouts and their recompute share the bits); the
entropy and the gradient come from the max-shifted sums as below.

Vocab parallel (Megatron's layout, as in `vocab_parallel_cross_entropy`): rank r of the tensor-
parallel group holds logits[..., r·V_p : (r+1)·V_p]; target ids are global. The forward needs two
all-reduces (row max, then the stacked per-row sums); the backward needs none, because the
per-token results are replicated and every rank computes the same loss from them (as Megatron does
after its vocab-parallel cross entropy), so every rank receives the same output gradients.

Owns: these two functions and their autograd. Must not import: megatron (the caller passes the
process group, e.g. `parallel_state.get_tensor_model_parallel_group()`), or anything from
megatron_fp8rl outside rl/ (layer L0).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_fp8rl.rl.common import RLInputError

CHUNK_ELEMENTS = 2**25
"""Default chunk budget: rows per chunk = max(1, CHUNK_ELEMENTS // V_p), i.e. 128 MiB per fp32 buffer."""


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logprob of each target token and the entropy of each position's distribution (full vocab).

    Args:
        logits: [..., V] any float dtype (bf16 is fine; math is done in fp32). Pass them in their
            memory order (e.g. Megatron's [S, B, V]) and permute target_ids to match: a
            non-contiguous view is copied by the reshape to [N, V].
        target_ids: [...] integer token ids in [0, V) (the next tokens: already shifted).
        temperature: τ > 0; the logits are divided by it (match the rollout's sampling temperature).
        chunk_size: rows per chunk; default from CHUNK_ELEMENTS.

    Returns:
        (logprobs, entropy), each [...] in fp32 (fp64 for fp64 logits), differentiable w.r.t. logits.
    """
    return _apply(logits, target_ids, None, temperature, chunk_size)


def vocab_parallel_logprobs_and_entropy(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs_and_entropy` over logits split along the vocabulary across `group`.

    Args:
        logits: [..., V_p], this rank's contiguous vocab shard (rank r holds ids r·V_p ... (r+1)·V_p − 1).
        target_ids: [...] global token ids in [0, V_p · group size), the same on every rank.
        group: the tensor-parallel process group.

    Returns:
        (logprobs, entropy), each [...], identical on every rank of the group.
    """
    return _apply(logits, target_ids, group, temperature, chunk_size)


def _apply(logits, target_ids, group, temperature, chunk_size):
    if logits.ndim < 1 or target_ids.shape != logits.shape[:-1]:
        raise RLInputError(
            f"target_ids has shape {tuple(target_ids.shape)} but logits has shape "
            f"{tuple(logits.shape)}; target_ids must be logits' shape without the vocab dim"
        )
    if target_ids.dtype.is_floating_point or target_ids.dtype == torch.bool:
        raise RLInputError(f"target_ids must be integer token ids, got dtype {target_ids.dtype}")
    if not temperature > 0:
        raise RLInputError(f"temperature must be > 0, got {temperature}")
    if logits.shape[-1] == 0:
        raise RLInputError(f"logits has an empty vocab dimension: shape {tuple(logits.shape)}")
    if chunk_size is not None and chunk_size < 1:
        raise RLInputError(f"chunk_size must be >= 1, got {chunk_size}")
    shard_vocab = logits.shape[-1]
    world = 1 if group is None else dist.get_world_size(group)
    if target_ids.numel() and (int(target_ids.min()) < 0 or int(target_ids.max()) >= shard_vocab * world):
        raise RLInputError(
            f"target_ids must lie in [0, {shard_vocab * world}), got range "
            f"[{int(target_ids.min())}, {int(target_ids.max())}]"
        )
    rows = chunk_size or max(1, CHUNK_ELEMENTS // max(shard_vocab, 1))
    logprobs, entropy = _LogprobEntropy.apply(
        logits.reshape(-1, shard_vocab), target_ids.reshape(-1), group, float(temperature), rows
    )
    return logprobs.reshape(target_ids.shape), entropy.reshape(target_ids.shape)


def _chunk_buffers(logits: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    """Two fp32 (fp64 for fp64 logits) [chunk, V_p] work buffers, reused by every chunk.

    Reusing them (rather than allocating per chunk) keeps the memory at two chunks and avoids
    the page faults of fresh large allocations, which cost more than the arithmetic on CPU.
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    rows = min(chunk_rows, logits.shape[0])
    return torch.empty(2, rows, logits.shape[1], dtype=dtype, device=logits.device)


def _scaled_minus(out: torch.Tensor, logits_chunk: torch.Tensor, temperature: float,
                  offset: torch.Tensor) -> torch.Tensor:
    """out ← x/τ − offset (per row), computed in out's dtype; returns out."""
    out.copy_(logits_chunk)
    if temperature != 1.0:
        out.div_(temperature)
    return out.sub_(offset[:, None])


def _local_targets(target_ids: torch.Tensor, shard_vocab: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets as column indices in this rank's shard (0 where not here) and whether they are here."""
    vocab_start = 0 if group is None else dist.get_rank(group) * shard_vocab
    local = target_ids - vocab_start
    in_shard = (local >= 0) & (local < shard_vocab)
    return torch.where(in_shard, local, torch.zeros_like(local)), in_shard


def _is_one_shard(group) -> bool:
    return group is None or dist.get_world_size(group) == 1


def _log_softmax_at(logits_chunk: torch.Tensor, targets: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """torch.log_softmax over the full vocabulary at temperature 1, at each row's target: the
    formula SGLang's sampler returns its logprobs with (sampler.py, deterministic inference), so an
    aligned recompute has the rollout's bits (the max-shifted sums round apart from it by ~1e-6,
    issue #44). `buffer` [count, V] receives the log-softmax."""
    torch.log_softmax(logits_chunk.to(buffer.dtype), dim=1, out=buffer)
    return buffer.gather(1, targets[:, None]).squeeze(1)


def _all_reduce(tensor: torch.Tensor, op, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


class _LogprobEntropy(torch.autograd.Function):
    """Chunked (and optionally vocab-parallel) logprob + entropy with a recomputing backward."""

    @staticmethod
    def forward(ctx, logits, target_ids, group, temperature, chunk_rows):
        ctx.set_materialize_grads(False)
        num_rows, shard_vocab = logits.shape
        buffers = _chunk_buffers(logits, chunk_rows)
        local_targets, in_shard = _local_targets(target_ids, shard_vocab, group)
        # max_j z_j = max_j x_j / τ (τ > 0); subtracting it keeps every exp() <= 1.
        row_max = logits.amax(dim=1).to(buffers.dtype) / temperature
        _all_reduce(row_max, dist.ReduceOp.MAX, group)
        # Per-row sums over this shard with z' = z − max z: Σ exp(z'), Σ exp(z')·z', and z'_target
        # (0 when the target lives on another rank).
        sums = torch.zeros(3, num_rows, dtype=buffers.dtype, device=logits.device)
        log_softmax = _is_one_shard(group) and temperature == 1.0
        direct = torch.empty(num_rows if log_softmax else 0, dtype=buffers.dtype, device=logits.device)
        for start in range(0, num_rows, chunk_rows):
            rows = slice(start, start + chunk_rows)
            count = min(chunk_rows, num_rows - start)
            if log_softmax:  # SGLang's formula, so the same bits (`_log_softmax_at`)
                direct[rows] = _log_softmax_at(logits[rows], local_targets[rows], buffers[1, :count])
            shifted = _scaled_minus(buffers[0, :count], logits[rows], temperature, row_max[rows])
            target_shifted = shifted.gather(1, local_targets[rows, None]).squeeze(1)
            sums[2, rows] = torch.where(in_shard[rows], target_shifted, 0.0)
            exp_shifted = torch.exp(shifted, out=buffers[1, :count])
            sums[0, rows] = exp_shifted.sum(dim=1)
            sums[1, rows] = exp_shifted.mul_(shifted).sum(dim=1)
        _all_reduce(sums, dist.ReduceOp.SUM, group)
        shifted_normalizer = sums[0].log()
        logprobs = direct if log_softmax else sums[2] - shifted_normalizer
        entropy = shifted_normalizer - sums[1] / sums[0]
        log_normalizer = row_max + shifted_normalizer  # logsumexp_j z_j over the whole vocabulary
        ctx.save_for_backward(logits, local_targets, in_shard, log_normalizer, entropy)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        return logprobs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, grad_entropy):
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None
        logits, local_targets, in_shard, log_normalizer, entropy = ctx.saved_tensors
        chunk_rows = ctx.chunk_rows
        buffers = _chunk_buffers(logits, chunk_rows)
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            count = min(chunk_rows, logits.shape[0] - start)
            grad_logits[rows] = _chunk_grad(
                buffers[:, :count], logits[rows], local_targets[rows], in_shard[rows],
                log_normalizer[rows], entropy[rows],
                None if grad_logprobs is None else grad_logprobs[rows],
                None if grad_entropy is None else grad_entropy[rows], ctx.temperature,
            )
        return grad_logits, None, None, None, None


def _chunk_grad(buffers, logits_chunk, local_targets, in_shard, log_normalizer, entropy,
                grad_logprobs, grad_entropy, temperature):
    """∂loss/∂x for one chunk: (g_lp·(onehot − p) − g_H·p·(log p + H)) / τ, recomputing p.

    Works in the two [count, V_p] `buffers`; returns a view of one of them.
    """
    log_probs = _scaled_minus(buffers[0], logits_chunk, temperature, log_normalizer)
    probs = torch.exp(log_probs, out=buffers[1])
    if grad_entropy is not None:
        coefficient = log_probs.add_(entropy[:, None]).mul_(grad_entropy[:, None])
        if grad_logprobs is not None:
            coefficient.add_(grad_logprobs[:, None])
        grad = coefficient.mul_(probs).neg_()
    else:
        grad = probs.mul_(-grad_logprobs[:, None])
    if grad_logprobs is not None:
        target_grad = torch.where(in_shard, grad_logprobs, 0.0).to(grad.dtype)
        grad.scatter_add_(1, local_targets[:, None], target_grad[:, None])
    return grad if temperature == 1.0 else grad.div_(temperature)
