"""Loopback ports for the tests' servers and for the connections that must be refused."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback port nothing listens on now: a server can take it, and until one does a
    connection to it is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
