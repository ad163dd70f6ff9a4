"""A TCP port that is free on a host right now (rollout servers, rendezvous stores, NCCL groups).

Free-then-bind: another process can take the port before its user binds it, so the users that
can (a server's first start, a one-node launch) start again on a new one when that happens."""

from __future__ import annotations

import socket


def free_port(host: str) -> int:
    """A port free on `host`'s address (a bracketed IPv6 literal accepted, as torchrun writes them)."""
    family, _, _, _, address = socket.getaddrinfo(host.strip("[]"), 0, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind(address)
        return int(s.getsockname()[1])
