"""This machine's TCP ports: TCPStores that listen on one address instead of every interface, and
the one free-port helper.

Owns: `bound_store(...)` and `free_port(host)` (every component that picks a port for a listener
it does not bind itself, such as torchrun's master port or SGLang's HTTP port, calls it).
torch 2.13's TCPStore server listens on all interfaces ('::') whatever host it is given, so a
rendezvous meant for this machine (127.0.0.1) is reachable from the network. The hosting side here
binds a socket to `host`:`port` itself and hands it to the store (`master_listen_fd`); clients are
unchanged. Stores made by torchrun's agent are torchrun's.
Must not import: anything of ours above layer L1.
"""
from __future__ import annotations

import datetime
import socket

import torch.distributed as dist


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listened on a moment ago. Another process may take it
    before the caller's listener binds it: callers that start a server detect that and retry."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def bound_store(host: str, port: int, world_size: int, is_master: bool,
                timeout: datetime.timedelta, **options) -> dist.TCPStore:
    """A TCPStore on `host`:`port` (port 0 on the master: any free one; read `.port`)."""
    if not is_master:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout, **options)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen()
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(host, sock.getsockname()[1], world_size, is_master=True, timeout=timeout,
                         master_listen_fd=sock.detach(), **options)
