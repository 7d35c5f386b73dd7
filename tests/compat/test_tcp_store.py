"""Rendezvous stores we host listen on their address only: before, torch's TCPStore listened on
every interface ('::') even for a 127.0.0.1 rendezvous. In process, one rank."""
import datetime

import psutil
import torch.distributed as dist

from megatron_fp8rl.compat.tcp_store import bound_store


def _listeners(port: int) -> list[str]:
    return sorted(c.laddr.ip for c in psutil.Process().net_connections()
                  if c.status == psutil.CONN_LISTEN and c.laddr.port == port)


def test_bound_store_listens_on_its_host_only():
    timeout = datetime.timedelta(seconds=30)
    host = bound_store("127.0.0.1", 0, 2, True, timeout, wait_for_workers=False)
    client = bound_store("127.0.0.1", host.port, 2, False, timeout)
    client.set("key", "value")
    assert host.get("key") == b"value"
    assert _listeners(host.port) == ["127.0.0.1"]


def test_a_plain_process_rendezvous_is_loopback_only(megatron_tp1):
    store = dist.distributed_c10d._get_default_store().underlying_store
    assert _listeners(store.port) == ["127.0.0.1"]
