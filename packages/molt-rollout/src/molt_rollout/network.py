"""Where a run's servers listen and how they are dialled: loopback and no token on one node; on
several, each engine on its node's address, requiring the run's token (`Authorization: Bearer`,
random per run or `MOLT_API_TOKEN`). See docs/operating.md."""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass, field
from urllib.parse import urlsplit

LOOPBACK = "127.0.0.1"
TOKEN_ENV = "MOLT_API_TOKEN"  # a token of the user's choosing instead of a random one


def node_address() -> str:
    """This process's node's address as Ray knows it (loopback without Ray)."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else LOOPBACK


@dataclass(frozen=True)
class Network:
    """The run's addressing: `multi_node` False is loopback everywhere, no token."""

    multi_node: bool = False
    token: str | None = field(default=None, repr=False)  # never in a log line

    def __post_init__(self) -> None:
        if self.multi_node and not self.token:
            raise ValueError("servers reachable from other nodes need a token")

    @classmethod
    def of_cluster(cls) -> Network:
        """The driver's choice, once per run, from the Ray cluster it joined."""
        import ray

        multi_node = sum(1 for node in ray.nodes() if node["Alive"]) > 1
        token = os.environ.get(TOKEN_ENV) or (secrets.token_urlsafe(32) if multi_node else None)
        return cls(multi_node, token)

    def host(self) -> str:
        """The address a server started in this process listens on and is dialled at."""
        return node_address() if self.multi_node else LOOPBACK

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}


SINGLE_NODE = Network()  # the default of every component: loopback, no token


def free_port(host: str = LOOPBACK) -> int:
    """A port free on `host` now (a server started next binds it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class UnreachableError(ConnectionError):
    """A server on another node could not be dialled; the message names both ends."""


def check_reachable(url: str, what: str, timeout_s: float = 10.0) -> None:
    parts = urlsplit(url if "://" in url else f"tcp://{url}")
    host, port = parts.hostname or "", parts.port or 80
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as error:
        raise UnreachableError(
            f"{what}: this node ({node_address()}) cannot connect to {host} port {port} "
            f"({error}); is the port open between the two nodes?"
        ) from None
