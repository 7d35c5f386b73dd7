"""SGLang as an HTTP server in a child process, and the client the trainer uses to talk to it.

Owns: `SGLangServer` (a `RolloutEngine`): starting SGLang's HTTP server
(`python -m megatron_fp8rl.rollout.sglang_launch`, i.e. sglang.launch_server plus the CPU tier's
seeded-sampling shims) on a loopback port with the CPU tier's stand-ins, optionally on chosen
devices, or connecting to a running server by URL; waiting for /health, an HTTP client with
timeouts and bounded retries, weight updates from disk (/update_weights_from_disk) or over a
process group (/update_weights_from_distributed, rollout/weight_transfer.py), and a shutdown that
also happens when this process dies (the server gets PR_SET_PDEATHSIG=SIGKILL; SGLang's own children
die with the server). A server reached by URL is never shut down by us.
Must not import: models, convert, data, trainer, cli; nor sglang (the server runs in its own process).

No /update_weights_from_tensor here: it ships torch's multiprocessing handles, which for CPU
tensors are file descriptors that cannot travel over HTTP. The disk transfer needs a file system
the server also sees (`update_dir`).
"""
from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable

from urllib.parse import urlparse

import psutil
import requests
import torch
from safetensors.torch import save_file

from megatron_fp8rl.compat import sglang_cpu
from megatron_fp8rl.compat.process_env import torchrun_free_env
from megatron_fp8rl.compat.tcp_store import free_port
from megatron_fp8rl.rollout.engine import RolloutEngineError, RolloutSample, SamplingParams
from megatron_fp8rl.rollout.reaper import Reaper, die_with_parent
from megatron_fp8rl.rollout.sglang_common import (
    ENGINE_ENV,
    SGLangConfig,
    check_fp8_checkpoint,
    expand_prompts,
    parse_outputs,
    server_argv,
    sglang_sampling,
)
from megatron_fp8rl.rollout.weight_transfer import DistributedWeightSender, iter_buckets
from megatron_fp8rl.rollout.weights import ExpectedWeights, unshared, validated_stream

TRANSFERS = ("disk", "distributed")
START_ATTEMPTS = 3
"""Start-ups tried when the server loses its port to another process (a fresh port each time)."""



def check_port_free(host: str, port: int) -> None:
    """Raise RolloutEngineError naming host:port when something already holds it."""
    with socket.socket() as sock:
        # Mirror the server's SO_REUSEADDR: only a live listener, not a TIME_WAIT leftover, blocks it.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise PortTakenError(f"cannot start SGLang server: port {host}:{port} is already in use") from err
            raise RolloutEngineError(f"cannot start SGLang server on {host}:{port}: {err}") from err


class PortTakenError(RolloutEngineError):
    """The server's HTTP port is (or was, when it had to bind it) held by another process."""


def port_holder(host: str, port: int, server_pid: int) -> str | None:
    """Who listens on `host`:`port` when it is not the process `server_pid` (the server's HTTP
    listener), e.g. "pid 123 (python)"; None when nobody does or the server itself does."""
    try:
        socket.create_connection((host, port), timeout=1.0).close()
    except OSError:
        return None  # nothing accepts there: the server has not bound it yet
    try:
        if any(_listens(c, port) for c in psutil.Process(server_pid).net_connections("tcp")):
            return None
    except psutil.NoSuchProcess:
        return None  # the caller sees the exit next
    pids = sorted({c.pid for c in psutil.net_connections("tcp") if _listens(c, port) and c.pid})
    return ", ".join(f"pid {pid} ({_process_name(pid)})" for pid in pids) or "a process of another user"


def _listens(connection, port: int) -> bool:
    return connection.status == psutil.CONN_LISTEN and connection.laddr.port == port


def _process_name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return "gone"


class SGLangServer:
    """`RolloutEngine` backed by an SGLang HTTP server in a child process."""

    def __init__(
        self,
        config: SGLangConfig,
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_timeout_s: float = 600.0,
        request_timeout_s: float = 300.0,
        retries: int = 2,
        log_path: str | Path | None = None,
        url: str | None = None,
        weight_transfer: str = "disk",
        bucket_mb: float = 512,
        devices: str | None = None,
        update_dir: str | Path | None = None,
    ):
        """`url`: connect to a running server (model_path must be the checkpoint it serves)
        instead of starting one. `devices`: CUDA_VISIBLE_DEVICES of a started server (its TP size
        is `config.extra["tp_size"]`). `update_dir`: where disk transfers write (default: a
        temporary folder of this process)."""
        if weight_transfer not in TRANSFERS:
            raise ValueError(f"weight_transfer={weight_transfer!r}: an SGLang server takes one of {TRANSFERS}")
        self.config = config
        self.external = url is not None
        if self.external:
            parsed = urlparse(url)
            if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
                raise RolloutEngineError(f"server_url={url!r}: expected http://HOST:PORT")
            host, port = parsed.hostname, parsed.port
        self.host = host
        self.port = port
        self.requested_port = port
        self.startup_timeout_s = startup_timeout_s
        self.request_timeout_s = request_timeout_s
        self.retries = retries
        self.weight_transfer, self.bucket_bytes, self.devices = weight_transfer, int(bucket_mb * 2**20), devices
        check_fp8_checkpoint(config)
        self.expected = ExpectedWeights.from_checkpoint(config.model_path)
        self.weight_version = config.initial_weight_version
        self._workdir = tempfile.TemporaryDirectory(prefix="sglang_server_")
        self.update_dir = Path(update_dir) if update_dir else Path(self._workdir.name)
        self.log_path = Path(log_path) if log_path else Path(self._workdir.name) / "server.log"
        self._session = requests.Session()
        self._proc: subprocess.Popen | None = None
        self._sender: DistributedWeightSender | None = None
        if self.external:
            self._connect()
        else:
            self.start()

    def _connect(self) -> None:
        """Check that the server at `url` answers before any training starts."""
        if not self.health():
            raise RolloutEngineError(
                f"rollout.server_url={self.url}: no SGLang server answers /health there "
                f"(start one with `python -m sglang.launch_server --model-path {self.config.model_path} "
                f"--host {self.host} --port {self.port}`)")
        info = self._get("/model_info")
        self.weight_version = _int_version(info.get("weight_version"), self.config.initial_weight_version)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        """Start the server (again, after a crash or shutdown) and wait until /health answers 200.
        A (re)started server serves the checkpoint on disk: the weight version resets.
        A server that loses its port to another process during start-up is stopped at once and,
        when the port was ours to choose, started again on a fresh one (`START_ATTEMPTS` in all)."""
        if self.external:
            raise RolloutEngineError(f"the SGLang server at {self.url} was not started here; restart it there")
        self.shutdown()
        self.weight_version = self.config.initial_weight_version
        lost = []
        for _ in range(START_ATTEMPTS):
            self.port = self.requested_port or free_port(self.host)
            try:
                check_port_free(self.host, self.port)
                self._launch()
                self._wait_healthy()
                return
            except PortTakenError as err:
                if self.requested_port is not None:
                    raise
                lost.append(str(err))
        raise RolloutEngineError(f"SGLang server lost its port {START_ATTEMPTS} times during start-up: "
                                 + "; ".join(lost))

    def _launch(self) -> None:
        """Start the server process on `self.port` (output appended to the log)."""
        # Without torchrun's variables: a server started from a torchrun worker would otherwise
        # join the trainer's rendezvous and hang (compat/process_env.py).
        env = torchrun_free_env()
        if self.config.resolved_device() == "cpu":
            env = sglang_cpu.subprocess_env(env)
        env.update(ENGINE_ENV)
        if self.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.devices
        argv = [sys.executable, "-m", "megatron_fp8rl.rollout.sglang_launch",
                *server_argv(self.config, self.host, self.port)]
        with self.log_path.open("ab") as log:
            self._log_start = log.tell()
            self._proc = subprocess.Popen(
                argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent, start_new_session=True,
            )
        self._reaper = Reaper([-self._proc.pid])  # its own session: the server and its SGLang children

    def _wait_healthy(self) -> None:
        """Until /health answers: raise at once when the process exits (PortTakenError when its log
        says a port was in use) or another process listens on its port (uvicorn then logs the bind
        error but the server process stays up without serving, seen for 600 s)."""
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self.shutdown()  # SGLang children it left behind go with its process group
                port_lost = "address already in use" in self._log_since_launch().lower()
                raise (PortTakenError if port_lost else RolloutEngineError)(
                    f"SGLang server for {self.config.model_path} on {self.url} exited with code {code} "
                    f"during start-up; last lines of {self.log_path}:\n{self.log_tail()}"
                )
            holder = port_holder(self.host, self.port, self._proc.pid)
            if holder is not None:
                self.shutdown()
                raise PortTakenError(f"port {self.host}:{self.port} of the starting SGLang server was "
                                     f"taken by {holder}")
            if self.health():
                return
            time.sleep(0.5)
        self.shutdown()
        raise RolloutEngineError(
            f"SGLang server on {self.url} not healthy after {self.startup_timeout_s:.0f} s; "
            f"last lines of {self.log_path}:\n{self.log_tail()}"
        )

    def _log_since_launch(self) -> str:
        try:
            with self.log_path.open("rb") as log:
                log.seek(self._log_start)
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _post(self, path: str, payload: dict, timeout_s: float | None = None) -> dict | list:
        """POST with a timeout; retries only when the connection could not be made (the request
        never reached the server), and never once the server process is gone."""
        timeout = timeout_s or self.request_timeout_s
        for attempt in range(self.retries + 1):
            self._check_alive(path)
            try:
                response = self._session.post(self.url + path, json=payload, timeout=(5.0, timeout))
            except requests.ConnectionError as err:
                if attempt == self.retries or (not self.external and (self._proc is None or self._proc.poll() is not None)):
                    self._check_alive(path)
                    raise RolloutEngineError(f"SGLang server {self.url}{path}: connection failed: {err}") from err
                time.sleep(0.5 * 2**attempt)
                continue
            except requests.Timeout as err:
                raise RolloutEngineError(f"SGLang server {self.url}{path}: no answer within {timeout:.0f} s") from err
            if response.status_code != 200:
                raise RolloutEngineError(
                    f"SGLang server {self.url}{path}: HTTP {response.status_code}: {response.text[:500]}"
                )
            return response.json()
        raise AssertionError("unreachable")

    def _get(self, path: str) -> dict:
        try:
            response = self._session.get(self.url + path, timeout=(5.0, self.request_timeout_s))
        except requests.RequestException as err:
            raise RolloutEngineError(f"SGLang server {self.url}{path}: {err}") from err
        if response.status_code != 200:
            raise RolloutEngineError(f"SGLang server {self.url}{path}: HTTP {response.status_code}: {response.text[:500]}")
        return response.json()

    def _check_alive(self, what: str) -> None:
        if self.external:
            return
        if self._proc is None:
            raise RolloutEngineError(f"SGLang server {self.url}{what}: the server is not running")
        code = self._proc.poll()
        if code is not None:
            raise RolloutEngineError(
                f"SGLang server {self.url}{what}: the server process (pid {self._proc.pid}) died with "
                f"code {code}; last lines of {self.log_path}:\n{self.log_tail(10)}"
            )

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams, n: int = 1) -> list[RolloutSample]:
        """n samples per prompt (prompt-major), with temperature-1 logprobs and the weight version."""
        expanded = expand_prompts(prompt_token_ids, n)
        outputs = self._post(
            "/generate",
            {"input_ids": expanded, "sampling_params": sglang_sampling(sampling, len(expanded)), "return_logprob": True},
        )
        return parse_outputs(outputs, [list(p) for p in prompt_token_ids], n, self.config.initial_weight_version)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Validate the update against the served checkpoint, then send it (disk or distributed,
        see the class). A refused update raises before anything reaches the server. Distributed
        sends a `WeightSnapshot` bucket by bucket as it comes (`validated_stream`); disk writes
        it shard by shard the same way, then the server loads them all."""
        checked = validated_stream(named_tensors, self.expected)
        if self.weight_transfer == "distributed":
            self._send_distributed(checked, version)
        else:
            self._update_from_disk(checked, version)
        self.weight_version = version

    def _send_distributed(self, checked: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Broadcast over the weight-update group (formed on first use). A transfer that fails
        leaves the group: its other end may be gone (a restarted server forms a new one on the
        next update) or hold a half-received bucket."""
        if self._sender is None:
            self._sender = DistributedWeightSender(self._post, self.host, self.server_tp(), self.bucket_bytes)
        try:
            self._sender.send(checked, version)
        except BaseException:
            self._sender.close()
            self._sender = None
            raise

    def server_tp(self) -> int:
        """Tensor-parallel size of the server (its ranks join the weight-update group)."""
        return int(self._get("/server_info").get("tp_size", 1))

    def _update_from_disk(self, checked: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Write the update into `update_dir` as safetensors shards of at most a bucket each, as
        the stream fills them (rank 0 holds one shard's tensors, not the update), and then have
        the server load the folder (/update_weights_from_disk). Nothing reaches the server before
        every shard is written, so a streamed tensor refused midway leaves it untouched. The
        shards are removed afterwards. `save_file` writes from the tensors' own memory
        (bench/weight_sync.py: 3.6 MB extra for a 0.22 GB sync)."""
        update_dir = self.update_dir / f"weights_v{version}"
        update_dir.mkdir(parents=True, exist_ok=True)
        for stale in update_dir.glob("*.safetensors"):  # an interrupted earlier try of this version
            stale.unlink()
        for name in ("config.json", "generation_config.json"):
            source = Path(self.config.model_path) / name
            if source.is_file():
                (update_dir / name).write_bytes(source.read_bytes())
        shards: list[Path] = []
        try:
            for index, bucket in enumerate(iter_buckets(checked, self.bucket_bytes)):
                shards.append(update_dir / f"model-{index + 1:05d}.safetensors")
                save_file(unshared(bucket), str(shards[-1]))
            result = self._post(
                "/update_weights_from_disk", {"model_path": str(update_dir), "weight_version": str(version)}
            )
        finally:
            for shard in shards:
                shard.unlink(missing_ok=True)
        if not result.get("success"):
            raise RolloutEngineError(f"SGLang update_weights_from_disk failed: {result.get('message')}")

    def release_memory(self) -> None:
        """Colocated mode. On CPU a no-op: SGLang's memory release (torch_memory_saver) is CUDA-only."""
        if self.config.resolved_device() != "cpu":
            self._post("/release_memory_occupation", {})

    def resume_memory(self) -> None:
        """Colocated mode: undo `release_memory` (no-op on CPU)."""
        if self.config.resolved_device() != "cpu":
            self._post("/resume_memory_occupation", {})

    def health(self) -> bool:
        """Whether the server (process, when started here) is alive and /health answers 200 within 5 s."""
        if not self.external and (self._proc is None or self._proc.poll() is not None):
            return False
        try:
            return self._session.get(self.url + "/health", timeout=5.0).status_code == 200
        except requests.RequestException:
            return False

    def shutdown(self) -> None:
        """SIGTERM the server's process group, SIGKILL it after 15 s (a server reached by URL is
        left running). Idempotent."""
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        if self._proc is None:
            return
        proc, self._proc = self._proc, None
        self._reaper.stop()
        for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 15.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue

    def kill(self) -> None:
        """SIGKILL the server process alone (tests: a crash); its SGLang children follow it."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()

    def close(self) -> None:
        """Shut down and remove the work folder."""
        self.shutdown()
        self._session.close()
        self._workdir.cleanup()

    def __enter__(self) -> "SGLangServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _int_version(label, default: int) -> int:
    try:
        return int(label)
    except (TypeError, ValueError):
        return default
