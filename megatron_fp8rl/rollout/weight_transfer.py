"""Weight transfer to an SGLang server over a process group (`rollout.weight_transfer=distributed`).

Owns: splitting named tensors into buckets of bounded size (and vocabulary tensors larger than a
bucket into row chunks), the reused flat bucket buffer, and `DistributedWeightSender`: the
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
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from megatron_fp8rl.compat.tcp_store import free_port
from megatron_fp8rl.rollout.engine import RolloutEngineError
from megatron_fp8rl.rollout.weight_update_group import init_weight_update_group

GROUP_NAME = "megatron_fp8rl_weights"


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
                 ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of tensors, each at most `bucket_bytes` (a larger tensor goes alone),
    each yielded as soon as the stream has filled it."""
    current, size = [], 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > bucket_bytes:
            yield current
            current, size = [], 0
        current.append((name, tensor))
        size += nbytes
    if current:
        yield current


def buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """`iter_buckets`, all of them."""
    return list(iter_buckets(named_tensors, bucket_bytes))


def with_last(items: Iterable) -> Iterator[tuple[object, bool]]:
    """(item, whether it is the last), one item ahead of the consumer: a stream's last bucket
    carries the weight version, and a stream does not know its length."""
    iterator = iter(items)
    try:
        pending = next(iterator)
    except StopIteration:
        return
    for item in iterator:
        yield pending, False
        pending = item
    yield pending, True


@dataclass(frozen=True)
class RowChunk:
    """Rows [start, start + len(rows)) of the vocabulary tensor `name` (one transfer call)."""

    name: str
    start: int
    rows: torch.Tensor


def is_vocab_tensor(name: str) -> bool:
    """The HF tensors SGLang holds vocabulary-parallel (rows split over its TP ranks), which a
    transfer may send in row chunks: the input embedding and an untied lm_head."""
    return name.endswith("embed_tokens.weight") or name == "lm_head.weight"


def iter_transfer_parts(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
                        ) -> Iterator[list[tuple[str, torch.Tensor]] | RowChunk]:
    """`iter_buckets`, except that a vocabulary tensor larger than a bucket becomes row chunks of
    at most `bucket_bytes` each (`RowChunk`), so no transfer buffer outgrows a bucket for it: at
    8B-32B the embedding and lm_head (1.2-1.6 GB in bf16) are the only tensors above a 512 MiB
    bucket. Any other tensor larger than a bucket still goes alone. Lazy: a part is yielded as
    soon as the stream has filled it."""
    small: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes <= bucket_bytes or not is_vocab_tensor(name) or tensor.dim() != 2:
            if small and size + nbytes > bucket_bytes:
                yield small
                small, size = [], 0
            small.append((name, tensor))
            size += nbytes
            continue
        if small:
            yield small
            small, size = [], 0
        per_chunk = max(1, bucket_bytes // (tensor.shape[1] * tensor.element_size()))
        for start in range(0, tensor.shape[0], per_chunk):
            yield RowChunk(name, start, tensor[start:start + per_chunk])
    if small:
        yield small


def transfer_parts(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
                   ) -> list[list[tuple[str, torch.Tensor]] | RowChunk]:
    """`iter_transfer_parts`, all of them."""
    return list(iter_transfer_parts(named_tensors, bucket_bytes))


class BucketBuffer:
    """One flat byte buffer that every bucket of a sync is copied into. A fresh shared-memory
    segment per bucket cost more than the rest of the transfer: allocating and first touching
    64 MiB of shared memory took 35-45 ms, refilling a touched one 3 ms (measured on the 2-core
    box), and the fresh SmolLM2 segments were 0.37 s of a 0.72 s sync. It grows to the largest
    bucket asked for (a tensor that goes alone can make it larger than a bucket). Its owner
    decides whether it lives past a sync (`release`): the in-process engine keeps its host
    buffer (a 512 MiB segment's allocation and unmapping were 0.20 s of a 0.44 s SmolLM2 sync);
    a device buffer (NCCL) is released, its memory being the train phase's."""

    def __init__(self, device: torch.device, shared: bool = False):
        """`shared`: a CPU buffer in shared memory, so that handing it to another process (SGLang's
        scheduler, through torch's multiprocessing reductions) copies nothing more."""
        self.device, self.shared = device, shared
        self._buffer: torch.Tensor | None = None
        self.allocations = 0
        """Buffers allocated so far (a kept buffer is allocated once, unless a bucket outgrows it)."""

    def take(self, nbytes: int) -> torch.Tensor:
        """The first `nbytes` bytes of the buffer (uint8), grown first when smaller."""
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None
            if self.shared:
                storage = torch.UntypedStorage._new_shared(nbytes)  # allocated in place: no copy
                self._buffer = torch.empty(0, dtype=torch.uint8).set_(storage)
            else:
                self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.allocations += 1
        return self._buffer[:nbytes]

    @property
    def nbytes(self) -> int:
        """Bytes held now (0 before the first bucket and after `release`)."""
        return 0 if self._buffer is None else self._buffer.numel()

    def release(self) -> None:
        self._buffer = None


def flatten_bucket(bucket: list[tuple[str, torch.Tensor]], device: torch.device,
                   buffer: BucketBuffer | None = None) -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor]:
    """The bucket's tensors ordered widest element first, and their bytes back to back in that
    order as one uint8 tensor on `device` (SGLang's flattened-bucket layout). The order keeps every
    tensor's byte offset a multiple of its element size, which the receiver requires (an fp32
    scale after an odd-sized FP8 weight would not be). `buffer`: the bytes go into it (its first
    bytes, valid until the next bucket), else into a new tensor. A lone tensor already on
    `device` is sent from its own storage, without a copy, unless the buffer is a shared one."""
    ordered = sorted(bucket, key=lambda item: -item[1].element_size())  # stable: same order within a width
    if (buffer is None or not buffer.shared) and len(ordered) == 1 and ordered[0][1].device == device:
        return ordered, _bytes(ordered[0][1])
    total = sum(t.numel() * t.element_size() for _, t in ordered)
    flat = buffer.take(total) if buffer is not None else torch.empty(total, dtype=torch.uint8, device=device)
    offset = 0
    for _, tensor in ordered:
        data = _bytes(tensor)
        flat[offset:offset + data.numel()].copy_(data)
        offset += data.numel()
    return ordered, flat


def transfer_device(tensors: Iterable[torch.Tensor]) -> torch.device:
    """Where a bucket of `tensors` is flattened for a transfer: the CUDA device of the first CUDA
    tensor (a GPU snapshot stays on the GPU: its bucket goes to SGLang as a CUDA IPC handle, not
    through host memory), else the CPU."""
    for tensor in tensors:
        if tensor.device.type == "cuda":
            return tensor.device
    return torch.device("cpu")


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
        self.buffer = BucketBuffer(self.device)
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

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Broadcast every tensor, bucket by bucket as the stream fills them; the server loads
        them and reports `version`."""
        self.post("/begin_weight_update", {})
        try:
            self._send_all(named_tensors, version)
        except BaseException:
            # The error that stopped the transfer is the one to report; a dead server cannot
            # end the update, and a live one must not keep its update lock.
            with contextlib.suppress(RolloutEngineError):
                self.post("/end_weight_update", {})
            raise
        self.post("/end_weight_update", {})

    def _send_all(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        try:
            for index, (bucket, last) in enumerate(with_last(iter_buckets(named_tensors, self.bucket_bytes))):
                where = f"bucket {index + 1}{' (the last)' if last else ''} ({len(bucket)} tensors from {bucket[0][0]!r})"
                self._send_bucket(bucket, version if last else None, where)
        finally:
            if self.device.type != "cpu":
                self.buffer.release()  # the train phase's device memory; a host buffer is kept

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], version: int | None, where: str) -> None:
        ordered, flat = flatten_bucket(bucket, self.device, self.buffer)
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
        self.buffer.release()
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
