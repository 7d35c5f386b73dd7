"""Weight transfer to an SGLang server over a process group (`rollout.weight_transfer=distributed`).

Owns: splitting named tensors into buckets of bounded size, and `DistributedWeightSender`: the
trainer (group rank 0) broadcasts every tensor of a bucket while the server, asked over HTTP
(`/update_weights_from_distributed`, SGLang 0.5.23), receives them into its model — gloo on CPU,
NCCL on GPU. The HTTP calls go through a `post(path, payload)` callable so this module knows no
server process. Must not import: models, convert, data, trainer, cli; nor sglang.

SGLang's protocol (read from sglang/srt/model_executor/model_runner_components/weight_updater.py):
its TP ranks join the group at `rank_offset + tp_rank`; for each request it allocates one tensor
per (name, dtype, shape) in order and posts a broadcast from group rank 0 for each; loading runs
between /begin_weight_update and /end_weight_update, which wait for running requests (the model
update lock), so generation pauses; the last bucket flushes the KV cache and sets the version.
"""
from __future__ import annotations

import socket
import threading
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from megatron_fp8rl.compat.tcp_store import free_port
from megatron_fp8rl.compat.weight_update_group import init_weight_update_group
from megatron_fp8rl.rollout.engine import RolloutEngineError

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
                self._send_bucket(bucket, version if index == len(parts) - 1 else None)
        finally:
            self.post("/end_weight_update", {})

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], version: int | None) -> None:
        payload = {
            "names": [name for name, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "group_name": GROUP_NAME,
            "flush_cache": version is not None,
        }
        if version is not None:
            payload["weight_version"] = str(version)
        receive = _Background(lambda: self.post("/update_weights_from_distributed", payload))
        sent = [t.detach().to(self.device).contiguous() for _, t in bucket]  # alive until the waits
        handles = [dist.broadcast(t, src=0, group=self.group, async_op=True) for t in sent]
        for handle in handles:
            handle.wait()
        receive.join("SGLang /update_weights_from_distributed")

    def close(self) -> None:
        """Leave the group (the server's side goes with the server)."""
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
