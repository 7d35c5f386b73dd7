"""torchrun worker (2 processes, gloo): amaxes and calibration decisions are all-reduced (MAX)
over the given group before the scale update, so every rank ends with the same scales."""
import torch
import torch.distributed as dist

from megatron_fp8rl.fp8.formats import E4M3
from megatron_fp8rl.fp8.quantizer import CalibratedQuantizer, DelayedQuantizer
from megatron_fp8rl.fp8.recipe import CalibratedDelayedScaling, DelayedScaling


def gathered(value: torch.Tensor) -> list[float]:
    values = [torch.zeros_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(values, value)
    return [v.item() for v in values]


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    x = torch.full((64,), 2.0 * (rank + 1))  # rank 0: amax 2, rank 1: amax 4

    delayed = DelayedQuantizer(E4M3, DelayedScaling(amax_history_len=4), group)
    delayed.quantize(x)
    assert gathered(delayed.state.scale) == [112.0, 112.0], gathered(delayed.state.scale)

    local = DelayedQuantizer(E4M3, DelayedScaling(amax_history_len=4, reduce_amax=False), group)
    local.quantize(x)
    assert gathered(local.state.scale) == [224.0, 112.0]

    spec = CalibratedDelayedScaling(margin=0, amax_history_len=4)
    calibrated = CalibratedQuantizer(E4M3, spec, is_weight=False, group=group)
    calibrated.quantize(x)
    escaping = torch.full((64,), 100.0) if rank == 1 else x  # only rank 1 escapes its bound
    out = calibrated.quantize(escaping)
    assert gathered(calibrated.last_stats.recalibrated) == [1.0, 1.0]
    scale_invs = gathered(out.scale_inv)
    assert scale_invs[0] == scale_invs[1] and abs(scale_invs[0] - 100.0 / 448.0) < 1e-7, scale_invs
    print(f"rank {rank} OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
