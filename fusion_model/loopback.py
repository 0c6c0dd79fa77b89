"""Make torch's rendezvous store listen on the master address only, never on every interface.

torch's TCPStore server binds the wildcard address whatever host it is given, so a one-node run on
127.0.0.1 still accepted connections from the network on its rendezvous port. TCPStore can instead
serve a socket it is handed (`master_listen_fd`); this binds that socket to the master address first.
Patched where a store is made: torchrun's static rendezvous (its agent hosts the store its ranks use),
the env:// rendezvous (Lightning's ddp_spawn, where rank 0 hosts it) and the c10d rendezvous of a run
across hosts (host 0's agent hosts the rendezvous store at the endpoint; the agent of node rank 0 also
hosts the store its ranks share, at its `--local-addr`). Multi-node runs name a reachable address, and
each store listens on that address alone.
"""

from __future__ import annotations

import importlib
import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist

_LISTENERS: list[socket.socket] = []  # kept open for the store's lifetime (the process's)


def _bound_listener(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(4096)
    _LISTENERS.append(sock)
    return sock


def tcp_store(host_name: str, port: int, world_size: int | None = None, is_master: bool = False,
              timeout: timedelta = timedelta(seconds=300), *args: Any, **kwargs: Any) -> dist.TCPStore:
    """`TCPStore` with the same arguments; a master store serves a socket bound to `host_name` only."""
    if is_master and not args and kwargs.get("master_listen_fd") is None:
        sock = _bound_listener(host_name, port)
        # libuv is the backend that accepts a listening socket (the legacy one does not)
        kwargs.update(master_listen_fd=sock.fileno(), use_libuv=True)
        port = sock.getsockname()[1]
    return dist.TCPStore(host_name, port, world_size, is_master, timeout, *args, **kwargs)


def _shared_store_server(self: Any, master_addr: str, master_port: int) -> dist.TCPStore:
    """`DynamicRendezvousHandler._create_tcp_store_server`, on `master_addr` (the node's --local-addr) only."""
    return tcp_store(master_addr, master_port, is_master=True, multi_tenant=True)


def bind_stores_to_master_addr() -> None:
    """Route the rendezvous modules' store construction through `tcp_store` (idempotent)."""
    # by module name: `torch.distributed.rendezvous` as an attribute is the function, not the module
    for name in ("torch.distributed.rendezvous", "torch.distributed.elastic.rendezvous.static_tcp_rendezvous",
                 "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend"):
        importlib.import_module(name).TCPStore = tcp_store  # type: ignore[attr-defined]
    dynamic = importlib.import_module("torch.distributed.elastic.rendezvous.dynamic_rendezvous")
    dynamic.DynamicRendezvousHandler._create_tcp_store_server = _shared_store_server  # type: ignore[method-assign]
