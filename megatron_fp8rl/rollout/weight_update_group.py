"""A process group between trainer rank 0 and an SGLang server, outside torchrun's world.

Owns: `init_weight_update_group`, the trainer's side of SGLang's `init_weights_update_group`
(SGLang 0.5.23, `sglang.srt.utils.common.init_custom_process_group`): a TCP rendezvous hosted by
group rank 0, a `PrefixStore` named after the group, and torch's private
`_new_process_group_helper` — the only way to make a group whose members are not all in the
default (torchrun) world. Both sides must build the group the same way, so this mirrors SGLang's
function line for line; re-check it when torch or SGLang move. Must not import: trainer,
cli (layer L3 imports only L0-L2 of ours).
"""
from __future__ import annotations

import datetime

import torch.distributed as dist

from megatron_fp8rl.compat.tcp_store import bound_store
from megatron_fp8rl.compat.versions import expect


def init_weight_update_group(backend: str, master_address: str, master_port: int, rank: int,
                             world_size: int, group_name: str, timeout_s: float = 600.0):
    """Join (rank 0: host) the group `group_name`; blocks until all `world_size` members joined.
    Collectives on it take group ranks as `src` (an identity map is registered)."""
    from torch.distributed import distributed_c10d as c10d

    # torch's private helper and group registry, checked to be what this was written against
    new_group = expect(c10d, "_new_process_group_helper", dist="torch", params=(
        "group_size", "group_rank", "global_ranks_in_group", "backend", "store", "group_name",
        "backend_options", "timeout", "pg_tag", "device_id", "group_desc"))
    group_ranks = expect(expect(c10d, "_world", dist="torch"), "pg_group_ranks", dist="torch")

    timeout = datetime.timedelta(seconds=timeout_s)
    # The TCPStore SGLang's tcp:// rendezvous makes, built directly: inside a torchrun worker
    # (TORCHELASTIC_USE_AGENT_STORE=True) `rendezvous` would use the elastic agent's store instead
    # of hosting one on master_port, and the server would wait on an empty port forever.
    # Hosted bound to master_address only (compat/tcp_store.py), not on every interface.
    store = bound_store(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
                        wait_for_workers=False, multi_tenant=True)
    group, _ = new_group(world_size, rank, [], dist.Backend(backend), c10d.PrefixStore(group_name, store),
                         group_name=group_name, backend_options=None, timeout=timeout, device_id=None)
    group_ranks[group] = {i: i for i in range(world_size)}
    return group
