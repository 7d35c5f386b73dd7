"""torchrun worker (2 processes, gloo, TRITON_INTERPRET=1 from the test): the device path's stateful
quantizers (fp8/device_quantize.py) all-reduce what the CPU quantizers all-reduce, between the two
launches of the scaling kernel (fp8/triton_scaling.py), and end every call with the CPU quantizers'
codes, scales and state, bit for bit, on tensors whose ranges differ per rank."""
import os

import torch
import torch.distributed as dist

from megatron_fp8rl.fp8.device_quantize import device_quantize
from megatron_fp8rl.fp8.quantizer import make_quantizers
from megatron_fp8rl.fp8.recipe import recipe_by_name


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "the test sets TRITON_INTERPRET=1"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    gen = torch.Generator().manual_seed(rank)
    # rank 1's tensors are 4x wider; the third step escapes every predicted bound
    steps = [torch.randn(40, 160, generator=gen) * (1 + 3 * rank) * scale for scale in (1.0, 0.1, 50.0)]
    for name in ("calibrated", "te_delayed", "megatron_delayed"):
        for role in ("input", "weight", "grad_output"):
            cpu, device = (getattr(make_quantizers(recipe_by_name(name), group), role) for _ in range(2))
            for step, x in enumerate(steps):
                expected, got = cpu.quantize(x), device_quantize(device, x, transposed=True)
                where = f"{name} {role} step {step}"
                assert _same(got.data, expected.data) and _same(got.scale_inv, expected.scale_inv.float()), where
                assert _same(device.state.amax_history, cpu.state.amax_history), where
                assert _same(device.state.scale, cpu.state.scale), where
            scales = [torch.zeros_like(device.state.scale) for _ in range(2)]
            dist.all_gather(scales, device.state.scale)
            assert _same(scales[0], scales[1]), f"{name} {role}: the ranks' scales differ: {scales}"
    print(f"rank {rank} OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
