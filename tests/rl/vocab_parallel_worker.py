"""torchrun worker (2 processes, TP=2): vocab-parallel logprob/entropy and gradients equal TP=1.

Every rank builds the same full-vocab logits, keeps its Megatron vocab shard, and checks
`vocab_parallel_logprobs_and_entropy` (values, and the gradient of its shard) against the
single-rank chunked function on the full logits and a float64 log_softmax oracle.
"""
import torch
import torch.distributed as dist

from megatron_fp8rl.rl.common import RLInputError
from megatron_fp8rl.rl.logprobs import token_logprobs_and_entropy, vocab_parallel_logprobs_and_entropy


def _grad(fn, logits, grad_logprobs, grad_entropy):
    leaf = logits.detach().clone().requires_grad_()
    logprobs, entropy = fn(leaf)
    total = (logprobs * grad_logprobs).sum()
    if grad_entropy is not None:
        total = total + (entropy * grad_entropy).sum()
    total.backward()
    return logprobs.detach(), entropy.detach(), leaf.grad


def check(group, rank: int, world: int, dtype: torch.dtype, temperature: float) -> None:
    generator = torch.Generator().manual_seed(7)
    tokens, vocab = 37, 50
    full = (torch.randn(tokens, vocab, generator=generator, dtype=torch.float64) * 4).to(dtype)
    target_ids = torch.randint(0, vocab, (tokens,), generator=generator)
    target_ids[:2] = torch.tensor([0, vocab - 1])  # both shards' edges
    grad_lp = torch.randn(tokens, generator=generator, dtype=torch.float64).to(dtype)
    grad_h = torch.randn(tokens, generator=generator, dtype=torch.float64).to(dtype)
    shard_vocab = vocab // world
    shard = full[:, rank * shard_vocab:(rank + 1) * shard_vocab]

    def parallel(x):
        return vocab_parallel_logprobs_and_entropy(x, target_ids, group, temperature=temperature,
                                                   chunk_size=5)

    def single(x):
        return token_logprobs_and_entropy(x, target_ids, temperature=temperature, chunk_size=5)

    def oracle(x):
        log_probs = torch.log_softmax(x.double() / temperature, dim=-1)
        return log_probs.gather(1, target_ids[:, None]).squeeze(1), -(log_probs.exp() * log_probs).sum(1)

    for grad_entropy in (grad_h, None):
        lp, ent, grad = _grad(parallel, shard, grad_lp, grad_entropy)
        lp1, ent1, grad1 = _grad(single, full, grad_lp, grad_entropy)
        oracle_grad_h = None if grad_entropy is None else grad_h.double()
        lp0, ent0, grad0 = _grad(oracle, full, grad_lp.double(), oracle_grad_h)
        torch.testing.assert_close(lp, lp1)
        torch.testing.assert_close(ent, ent1)
        torch.testing.assert_close(grad, grad1[:, rank * shard_vocab:(rank + 1) * shard_vocab])
        tolerance = {} if dtype == torch.float64 else {"atol": 1e-5, "rtol": 1e-5}
        torch.testing.assert_close(lp.double(), lp0, **tolerance)
        torch.testing.assert_close(ent.double(), ent0, **tolerance)
        grad0_shard = grad0[:, rank * shard_vocab:(rank + 1) * shard_vocab]
        torch.testing.assert_close(grad.double(), grad0_shard.double(), **tolerance)
    gathered = [torch.empty_like(lp) for _ in range(world)]
    dist.all_gather(gathered, lp, group=group)
    assert all(torch.equal(g, gathered[0]) for g in gathered), "ranks disagree on logprobs"


def main() -> None:
    from megatron.core import parallel_state

    from megatron_fp8rl.launch import init_distributed, shutdown_distributed

    init_distributed(tensor_parallel=2)
    group = parallel_state.get_tensor_model_parallel_group()
    rank = parallel_state.get_tensor_model_parallel_rank()
    world = parallel_state.get_tensor_model_parallel_world_size()
    assert world == 2
    check(group, rank, world, torch.float64, 1.0)
    check(group, rank, world, torch.float32, 0.7)
    try:
        vocab_parallel_logprobs_and_entropy(torch.zeros(2, 25), torch.tensor([0, 50]), group)
    except RLInputError as error:
        assert "[0, 50)" in str(error), error
    else:
        raise AssertionError("target id 50 with a 2 x 25 vocab was accepted")
    print(f"rank {rank}: vocab-parallel logprobs OK", flush=True)
    shutdown_distributed()


if __name__ == "__main__":
    main()
