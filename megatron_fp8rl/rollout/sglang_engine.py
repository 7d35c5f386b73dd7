"""SGLang's Engine running inside this process (its scheduler and detokenizer are child processes).

Owns: `SGLangEngine`, the in-process implementation of `RolloutEngine`: start-up with the CPU tier's
stand-ins, generation with temperature-1 logprobs, validated weight updates through
`update_weights_from_tensor` between `begin_weight_update()`/`end_weight_update()`, colocated
memory release/resume through SGLang's own API, and a shutdown that stops only the processes this
engine started.
Must not import: convert, data, trainer, cli.

SGLang 0.5.23 behaviours handled here (measured on CPU):
- A child failure makes the stock Engine kill its whole process tree, the host included; the
  engine installs `compat.sglang_cpu.contain_child_failures`, so a failure becomes a
  `RolloutEngineError` on the pending call and every later one.
- `Engine.shutdown()` kills *every* child of the host process (a trainer's checkpoint manager or a
  second engine too); `shutdown` here kills only the children this engine started.
- The scheduler binds its torch.distributed port (picked at random in 22000-29999 by the parent,
  free at that moment) only seconds later; another process can take it in between, and the
  scheduler then dies during initialization. Start-up retries that failure (START_ATTEMPTS) with
  fresh ports.
- `sglang.Engine` switches multiprocessing to "spawn" for the whole host process, and this class
  sets SGLANG_RETURN_ORIGINAL_LOGPROB=1 (docs/design.md hazard 1) in the host's environment, which its
  children inherit.
"""
from __future__ import annotations

import atexit
import logging
import os
from typing import Iterable

import psutil
import torch

from megatron_fp8rl.compat import sglang_cpu
from megatron_fp8rl.rollout.engine import RolloutEngineError, RolloutSample, SamplingParams
from megatron_fp8rl.rollout.reaper import Reaper
from megatron_fp8rl.rollout.sglang_common import (
    ENGINE_ENV,
    MEMORY_TAGS,
    SGLangConfig,
    check_fp8_checkpoint,
    check_model_dir,
    engine_kwargs,
    expand_prompts,
    parse_outputs,
    sglang_sampling,
)
from megatron_fp8rl.rollout.sglang_rows import LOADER as ROWS_LOADER, row_key
from megatron_fp8rl.rollout.weight_transfer import (
    BucketBuffer,
    RowChunk,
    flatten_bucket,
    iter_transfer_parts,
    transfer_device,
    with_last,
)
from megatron_fp8rl.rollout.weights import ExpectedWeights, validated_stream


logger = logging.getLogger(__name__)

START_ATTEMPTS = 3
"""Start-up attempts when SGLang's scheduler dies during initialization (a port race; see above)."""
_RETRIED_START_FAILURE = "scheduler died during initialization"


class SGLangEngine:
    """`RolloutEngine` backed by `sglang.Engine` in this process."""

    def __init__(self, config: SGLangConfig, bucket_mb: float = 512):
        """`bucket_mb`: the largest group of tensors one `update_weights_from_tensor` call
        carries. A CPU snapshot's buckets are copied into one shared-memory buffer of that size,
        allocated at the first sync and kept until `shutdown`: host memory, which SGLang's CPU
        tier does not release for the train phase either, and the sync it saves costs more than
        the copies (bench/weight_sync.py). A CUDA snapshot's buckets stay on its GPU
        (`transfer_device`). A larger embedding or lm_head goes in row chunks of that size; any
        other larger tensor goes alone (and the buffer grows to it)."""
        self.config = config
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.buffer = BucketBuffer(torch.device("cpu"), shared=True)
        check_model_dir(config.model_path)
        check_fp8_checkpoint(config)
        self.expected = ExpectedWeights.from_checkpoint(config.model_path)
        self.weight_version = config.initial_weight_version
        self._failure: str | None = None
        self._child_pids: set[int] = set()
        self._engine = None
        self._released: set[str] = set()
        self._start()

    def _start(self) -> None:
        if self.config.resolved_device() == "cpu":
            sglang_cpu.install()
        os.environ.update(ENGINE_ENV)
        for attempt in range(1, START_ATTEMPTS + 1):
            before = {p.pid for p in psutil.Process().children(recursive=True)}
            try:
                self._engine = sglang_cpu.start_engine({**engine_kwargs(self.config), "custom_sigquit_handler": self._on_signal,
                                                        "custom_weight_loader": [ROWS_LOADER]})
                break
            except BaseException as err:
                self._child_pids = {p.pid for p in psutil.Process().children(recursive=True)} - before
                self._kill_children()
                if attempt < START_ATTEMPTS and _RETRIED_START_FAILURE in str(err):
                    logger.warning("SGLang start-up attempt %d/%d failed (%s%s); retrying with fresh ports",
                                   attempt, START_ATTEMPTS, err, self._failure_note())
                    self._failure = None
                    continue
                raise RolloutEngineError(
                    f"SGLang could not start on model directory {self.config.model_path}"
                    f"{f' (attempt {attempt} of {START_ATTEMPTS})' if attempt > 1 else ''}: "
                    f"{type(err).__name__}: {err}{self._failure_note()}"
                ) from err
        self._child_pids = {p.pid for p in psutil.Process().children(recursive=True)} - before
        self._reaper = Reaper(sorted(self._child_pids))  # they die with this process, even on kill -9
        sglang_cpu.contain_child_failures(self._engine, self._on_child_failure)

    def _on_signal(self, signum, frame) -> None:
        self._failure = "an SGLang child process failed (SIGQUIT)"

    def _on_child_failure(self) -> None:
        self._failure = "an SGLang child process (scheduler or detokenizer) failed"
        self._engine.loop.stop()

    def _failure_note(self) -> str:
        return f" ({self._failure}; see SGLang's log above)" if self._failure else ""

    def _run(self, what: str, call):
        """Run one engine call; a dead engine or a child failure becomes a RolloutEngineError."""
        if self._engine is None:
            raise RolloutEngineError(f"{what}: the SGLang engine is shut down")
        if self._failure:
            raise RolloutEngineError(f"{what}: the SGLang engine is dead: {self._failure}")
        try:
            return call()
        except RuntimeError as err:
            if self._failure:
                raise RolloutEngineError(f"{what}: the SGLang engine died: {self._failure}") from err
            raise

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams, n: int = 1) -> list[RolloutSample]:
        """n samples per prompt (prompt-major), with temperature-1 logprobs and the weight version."""
        self._check_resident("generate", MEMORY_TAGS)
        expanded = expand_prompts(prompt_token_ids, n)
        outputs = self._run(
            "generate",
            lambda: self._engine.generate(
                input_ids=expanded, sampling_params=sglang_sampling(sampling, len(expanded)), return_logprob=True
            ),
        )
        return parse_outputs(outputs, [list(p) for p in prompt_token_ids], n, self.config.initial_weight_version)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Validate the update against the served checkpoint, then load it in one session, part
        by part as the stream fills them (`rollout.weights.validated_stream`: a `WeightSnapshot`'s
        layout is checked before anything is sent; any other iterable is checked whole first).
        A refused update raises `WeightUpdateError` and leaves the served weights unchanged."""
        self._check_resident("update_weights", ("weights",))
        checked = validated_stream(named_tensors, self.expected)
        self._expect_success("begin_weight_update", lambda: self._engine.begin_weight_update())
        try:
            for part, last in with_last(iter_transfer_parts(checked, self.bucket_bytes)):
                self._update_part(part, str(version) if last else None)
        finally:
            self._expect_success("end_weight_update", lambda: self._engine.end_weight_update())
        self.weight_version = version

    def _update_part(self, part: list[tuple[str, torch.Tensor]] | RowChunk, version: str | None) -> None:
        """One update_weights_from_tensor call; the last (with `version`) flushes the KV cache.
        A bucket travels as one flat buffer (SGLang's flattened-bucket format): on the CPU one
        copy of its bytes into the kept shared segment, where a list of tensors cost a segment each
        (measured at SmolLM2 size, fp32: 10.2 s/GB, 0.05x memcpy, per tensor). A CUDA bucket
        is flattened on its GPU into a new tensor, which torch's reductions send as a CUDA IPC
        handle (with SGLang's device-UUID patch, as its scheduler expects): one device-to-device
        copy and no host memory. A new one per bucket, not a reused one: torch keeps a sent CUDA
        block from reuse until the receiver has let it go, and the scheduler's copies out of it
        run on its own stream. A row chunk goes the same way to `sglang_rows.load_vocab_rows`."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

        tensors = [part.rows] if isinstance(part, RowChunk) else [t for _, t in part]
        device = transfer_device(tensors)
        buffer = self.buffer if device.type == "cpu" else None
        if device.type == "cuda":
            from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

            monkey_patch_torch_reductions()
        if isinstance(part, RowChunk):
            _, flat = flatten_bucket([(part.name, part.rows)], device, buffer)
            rows = flat.view(part.rows.dtype).view(part.rows.shape)
            payload, load_format = [(row_key(part.name, part.start), rows)], ROWS_LOADER
        else:
            ordered, flat = flatten_bucket(part, device, buffer)
            metadata, offset = [], 0
            for name, tensor in ordered:
                nbytes = tensor.numel() * tensor.element_size()
                metadata.append(FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, offset, offset + nbytes, nbytes))
                offset += nbytes
            payload, load_format = {"flattened_tensor": flat, "metadata": metadata}, "flattened_bucket"
        request = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[MultiprocessingSerializer.serialize(payload)],
            load_format=load_format,
            flush_cache=version is not None,
            weight_version=version,
        )
        manager = self._engine.tokenizer_manager
        self._expect_success(
            "update_weights_from_tensor",
            lambda: self._engine.loop.run_until_complete(manager.update_weights_from_tensor(request, None)),
        )

    def _expect_success(self, what: str, call) -> None:
        result = self._run(what, call)
        success, message = result[0], result[1]
        if not success:
            raise RolloutEngineError(f"SGLang {what} failed: {message}")

    def release_memory(self) -> None:
        """Colocated mode, before the train phase: SGLang's `release_memory_occupation` for its
        weights, KV cache and CUDA graphs. On a GPU (`memory_saver`) their device memory is freed;
        on the CPU SGLang runs the same protocol (cache flushed, buffers stashed) but frees
        nothing: torch_memory_saver hooks CUDA allocations only. Until `resume_memory` gives them
        back, `generate` (and, while the weights are released, `update_weights`) raise."""
        if self._released:
            raise RolloutEngineError(f"release_memory: {sorted(self._released)} are already released")
        self._run("release_memory", lambda: self._engine.release_memory_occupation(list(MEMORY_TAGS)))
        self._released = set(MEMORY_TAGS)

    def resume_memory(self, tags: Iterable[str] | None = None) -> None:
        """Take back what `release_memory` freed, of `tags` (MEMORY_TAGS; None: all): the weights
        before a weight sync writes them, the rest after it. Tags not released are skipped."""
        tags = MEMORY_TAGS if tags is None else tuple(tags)
        unknown = set(tags) - set(MEMORY_TAGS)
        if unknown:
            raise ValueError(f"resume_memory: unknown tags {sorted(unknown)}; known: {MEMORY_TAGS}")
        released = [tag for tag in MEMORY_TAGS if tag in set(tags) & self._released]
        if released:
            self._run("resume_memory", lambda: self._engine.resume_memory_occupation(released))
            self._released -= set(released)

    def _check_resident(self, what: str, tags: Iterable[str]) -> None:
        released = sorted(set(tags) & self._released)
        if released:
            raise RolloutEngineError(f"{what}: SGLang's {', '.join(released)} memory is released "
                                     "(release_memory); call resume_memory first")

    def health(self) -> bool:
        """Whether the engine is up and its child processes are alive."""
        if self._engine is None or self._failure:
            return False
        return all(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in self._child_pids)

    def shutdown(self) -> None:
        """Stop this engine's child processes (only those). Idempotent."""
        if self._engine is None:
            return
        watchdog = getattr(self._engine.tokenizer_manager, "_subprocess_watchdog", None)
        if watchdog is not None:
            watchdog.stop()
        self._kill_children()
        self._reaper.stop()
        self.buffer.release()
        sglang_cpu.close_sockets(self._engine, self._engine.tokenizer_manager)
        # The stock Engine registered its own shutdown, which kills every child of this process.
        atexit.unregister(self._engine.shutdown)
        self._engine = None

    def _kill_children(self) -> None:
        procs = []
        for pid in self._child_pids:
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                continue
        for proc in procs:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                continue
        psutil.wait_procs(procs, timeout=30)
        self._child_pids = set()

    def __enter__(self) -> "SGLangEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
