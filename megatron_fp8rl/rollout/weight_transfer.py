"""Weight transfer to an SGLang server over a process group (`rollout.weight_transfer=distributed`).

Owns: splitting named tensors into buckets of bounded size, and `DistributedWeightSender`: the
trainer (group rank 0) broadcasts every tensor of a bucket while the server, asked over HTTP
(`/update_weights_from_distributed`, SGLang 0.5.23), receives them into its model — gloo on CPU,
NCCL on GPU. The HTTP calls go through a `post(path, payload)` callable so this module knows no
server process. Must not import: models, convert, data, trainer, cli; nor sglang.

SGLang's protocol (read from sglang/srt/model_executor/model_runner_components/weight_updater.py):
its TP ranks join the group at `rank_offset + tp_rank`; with `load_format="flattened_bucket"` each
request allocates one uint8 buffer for the bucket's (name, dtype, shape) list, laid out back to
back in order, and receives it in one broadcast from group rank 0; loading runs between
/begin_weight_update and /end_weight_update, which wait for running requests (the model update
lock), so generation pauses; the last bucket flushes the KV cache and sets the version. The
flattened format is what carries FP8: gloo has no float8 types ("Invalid scalar type"), bytes it
has; and one broadcast per bucket instead of one per tensor.
"""
from __future__ import annotations

import contextlib
import socket
import threading
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from megatron_fp8rl.compat.tcp_store import free_port
from megatron_fp8rl.rollout.engine import RolloutEngineError
from megatron_fp8rl.rollout.weight_update_group import init_weight_update_group

GROUP_NAME = "megatron_fp8rl_weights"


def buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of tensors, each at most `bucket_bytes` (a larger tensor goes alone)."""
    out, current, size = [], [], 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > bucket_bytes:
            out.append(current)
            current, size = [], 0
        current.append((name, tensor))
        size += nbytes
    if current:
        out.append(current)
    return out


def flatten_bucket(bucket: list[tuple[str, torch.Tensor]], device: torch.device,
                   shared: bool = False) -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor]:
    """The bucket's tensors ordered widest element first, and their bytes back to back in that
    order as one uint8 tensor on `device` (SGLang's flattened-bucket layout). The order keeps every
    tensor's byte offset a multiple of its element size, which the receiver requires (an fp32
    scale after an odd-sized FP8 weight would not be). A lone tensor already on `device` is sent
    from its own storage, without a copy. `shared`: the buffer is allocated in shared memory (CPU),
    so handing it to another process copies nothing more."""
    ordered = sorted(bucket, key=lambda item: -item[1].element_size())  # stable: same order within a width
    if len(ordered) == 1 and ordered[0][1].device == device:
        return ordered, _bytes(ordered[0][1])
    flat = torch.empty(sum(t.numel() * t.element_size() for _, t in ordered), dtype=torch.uint8, device=device)
    if shared:
        flat.share_memory_()
    offset = 0
    for _, tensor in ordered:
        data = _bytes(tensor)
        flat[offset:offset + data.numel()].copy_(data)
        offset += data.numel()
    return ordered, flat


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def local_address_towards(host: str) -> str:
    """This machine's address on the route to `host` (what the server dials to join the group)."""
    if host in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # UDP connect sends nothing; it only picks the route
        return probe.getsockname()[0]


class _Background:
    """One HTTP call on a thread, so this thread can take part in the collective it triggers."""

    def __init__(self, call: Callable[[], dict]):
        self.result, self.error = None, None
        self._thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self._thread.start()

    def _run(self, call):
        try:
            self.result = call()
        except BaseException as err:  # re-raised on the caller's thread by join()
            self.error = err

    def join(self, what: str) -> dict:
        self._thread.join()
        return self._result(what)

    def outcome(self, what: str, timeout_s: float) -> str:
        """What the call ended with, waiting at most `timeout_s` (for an error message)."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return f"{what} had not answered after {timeout_s:.0f} s"
        try:
            self._result(what)
        except RolloutEngineError as err:
            return str(err)
        return f"{what} answered {self.result}"

    def _result(self, what: str) -> dict:
        if self.error is not None:
            raise RolloutEngineError(f"{what}: {self.error}") from self.error
        if isinstance(self.result, dict) and self.result.get("success") is False:
            raise RolloutEngineError(f"{what} failed: {self.result.get('message')}")
        return self.result


class DistributedWeightSender:
    """Trainer side of SGLang's `update_weights_from_distributed` for one server."""

    def __init__(self, post: Callable[[str, dict], dict], server_host: str, server_tp: int,
                 bucket_bytes: int, backend: str | None = None, timeout_s: float = 600.0):
        self.post, self.bucket_bytes = post, bucket_bytes
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        address = local_address_towards(server_host)
        port = free_port(address)
        join = _Background(lambda: self.post("/init_weights_update_group", {
            "master_address": address, "master_port": port, "rank_offset": 1,
            "world_size": 1 + server_tp, "group_name": GROUP_NAME, "backend": self.backend}))
        try:
            self.group = init_weight_update_group(self.backend, address, port, 0, 1 + server_tp,
                                                  GROUP_NAME, timeout_s=timeout_s)
        except Exception as err:
            raise RolloutEngineError(
                f"weight-update group {GROUP_NAME} on {address}:{port} ({self.backend}, "
                f"{1 + server_tp} members) did not form: {err}") from err
        join.join("SGLang /init_weights_update_group")

    def send(self, named_tensors: list[tuple[str, torch.Tensor]], version: int) -> None:
        """Broadcast every tensor, bucket by bucket; the server loads them and reports `version`."""
        self.post("/begin_weight_update", {})
        try:
            parts = buckets(named_tensors, self.bucket_bytes)
            for index, bucket in enumerate(parts):
                where = f"bucket {index + 1} of {len(parts)} ({len(bucket)} tensors from {bucket[0][0]!r})"
                self._send_bucket(bucket, version if index == len(parts) - 1 else None, where)
        except BaseException:
            # The error that stopped the transfer is the one to report; a dead server cannot
            # end the update, and a live one must not keep its update lock.
            with contextlib.suppress(RolloutEngineError):
                self.post("/end_weight_update", {})
            raise
        self.post("/end_weight_update", {})

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], version: int | None, where: str) -> None:
        ordered, flat = flatten_bucket(bucket, self.device)
        payload = {
            "names": [name for name, _ in ordered],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in ordered],
            "shapes": [list(t.shape) for _, t in ordered],
            "group_name": GROUP_NAME,
            "flush_cache": version is not None,
            "load_format": "flattened_bucket",
        }
        if version is not None:
            payload["weight_version"] = str(version)
        what = "SGLang /update_weights_from_distributed"
        receive = _Background(lambda: self.post("/update_weights_from_distributed", payload))
        try:
            dist.broadcast(flat, src=0, group=self.group)
        except RuntimeError as err:  # gloo/NCCL: the server's end of the group went away
            raise RolloutEngineError(f"weight transfer broke at {where}: the broadcast failed ({err}); "
                                     f"{receive.outcome(what, timeout_s=30.0)}") from err
        receive.join(f"{what}, {where}")

    def close(self) -> None:
        """Leave the group (the server's side goes with the server)."""
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
