"""A rendezvous store that listens only on the rendezvous address.

torch 2.13's `TCPStore` server binds every interface (`::`, or `0.0.0.0` without IPv6) whatever
`host_name` it is given: the host is only what clients dial. The store takes no credentials, so
anyone who reaches the node could read and write the run's keys (ranks' addresses, NCCL ids)
while it lives — the whole run, since torchrun's workers keep using the agent's store. `TCPStore`
does accept a socket that is already listening (`master_listen_fd`, the libuv and the legacy
backend alike); `bound_tcp_store` makes that socket on the address `host_name` resolves to:
127.0.0.1 for a single-node run, the head node's cluster address on Slurm.

`install()` puts it in place of `TCPStore` where torchrun's rendezvous backends (static, c10d,
dynamic) and the `env://` handler create their stores; `megatron_rl.launch` calls it before
running torchrun, `devices.init_distributed` before a worker's rendezvous.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

import torch.distributed as dist

TCPSTORE = dist.TCPStore
"""torch's own class (`install` replaces the name in torch's modules)."""
_PARAMS = ("world_size", "is_master", "timeout", "wait_for_workers", "multi_tenant", "master_listen_fd", "use_libuv")
"""`TCPStore`'s parameters after (host_name, port), in order."""


MULTI_NODE = False
"""Set by `install(multi_node=True)`: a loopback rendezvous address is then an error."""


class RendezvousAddressError(Exception):
    """The rendezvous host does not resolve to an address that other nodes can reach. Not a
    `RuntimeError` on purpose: torchrun's c10d backend takes those for "another process hosts
    the store" and retries as a client, which would hide this message behind a timeout."""


def bound_tcp_store(host_name: str, port: int, *args: Any, **kwargs: Any) -> dist.TCPStore:
    """`TCPStore(host_name, port, ...)`; the server (is_master) listens on `host_name`'s address only."""
    params = dict(zip(_PARAMS, args), **kwargs)
    if params.get("is_master") and params.get("master_listen_fd") is None:
        sock = listen_on(host_name, port)
        port = sock.getsockname()[1]                      # port 0 = any free port, as TCPStore does
        params["master_listen_fd"] = sock.detach()        # the store owns (and closes) the socket
    return TCPSTORE(host_name, port, **params)


def listen_on(host_name: str, port: int, multi_node: bool | None = None) -> socket.socket:
    """A listening TCP socket on the first address `host_name` resolves to."""
    family, _, _, _, address = socket.getaddrinfo(host_name, port, type=socket.SOCK_STREAM)[0]
    ip = ipaddress.ip_address(address[0])
    if ip.is_unspecified:
        raise RendezvousAddressError(f"rendezvous host {host_name!r} is the wildcard address {ip}: "
                                     "name the node (or 127.0.0.1 for one node)")
    if (MULTI_NODE if multi_node is None else multi_node) and ip.is_loopback:
        literal = host_name == address[0]
        where = "is a loopback address" if literal else f"resolves to {ip} on this node"
        fix = "name the node or its cluster address" if literal else \
            f"it must resolve to the node's cluster address (check /etc/hosts for a '{ip} {host_name}' line)"
        raise RendezvousAddressError(f"rendezvous host {host_name!r} {where}, which the other nodes of a multi-node "
                                     f"run cannot reach: {fix}; torchrun's --local-addr sets the address of "
                                     "its second store")
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as TCPStore's own server does
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        # What TCPStore raises when it cannot listen: the c10d backend then joins as a client.
        raise dist.DistNetworkError(f"cannot listen on {address[0]}:{port} (rendezvous host {host_name!r}): "
                                    f"{e}") from e
    return sock


def install(multi_node: bool = False) -> None:
    """Make every store that torch's rendezvous code creates in this process a bound one."""
    import torch.distributed.rendezvous as env_rendezvous
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous

    global MULTI_NODE
    MULTI_NODE = multi_node
    # `dist` serves the dynamic rendezvous and elastic's utilities; the others imported the name.
    for module in (dist, env_rendezvous, c10d_rendezvous_backend, static_tcp_rendezvous):
        setattr(module, "TCPStore", bound_tcp_store)  # noqa: B010
