"""Loaded by every Python process the Kaggle tests start (this folder is on PYTHONPATH): a
socket audit hook that refuses any connection or name lookup that is not loopback, and writes
what it refused to the file named by NBRESUME_TEST_NET_LOG, which the tests check is empty.
Nothing a test starts can reach Kaggle, or anything else, for real. With
NBRESUME_TEST_HIDE_NBRESUME=1 it also hides the development nbresume (a machine of the fake
Kaggle whose image does not have it)."""

from __future__ import annotations

import ipaddress
import os
import socket
import sys

_LOG = os.environ.get("NBRESUME_TEST_NET_LOG", "")
_LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


def _is_loopback(host: object) -> bool:
    if host is None:
        return True
    if isinstance(host, bytes):
        host = host.decode(errors="replace")
    if not isinstance(host, str):
        return False
    host = host.strip("[]")
    if host.lower() in _LOCAL_NAMES or host == "":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def _refuse(what: str) -> None:
    if _LOG:
        with open(_LOG, "a", encoding="utf-8") as log:
            log.write(f"{os.getpid()} {what}\n")
    raise PermissionError(f"test network guard: {what} is not loopback")


def _hook(event: str, args: tuple[object, ...]) -> None:
    if event == "socket.connect":
        sock, address = args[0], args[1]
        family = getattr(sock, "family", None)
        inet = family in (socket.AF_INET, socket.AF_INET6) and isinstance(address, tuple)
        if inet and not _is_loopback(address[0]):
            _refuse(f"connect to {address[0]}:{address[1]}")
    elif event == "socket.getaddrinfo" and not _is_loopback(args[0]):
        _refuse(f"name lookup of {args[0]!r}")


sys.addaudithook(_hook)


def _hide_nbresume() -> None:
    """A machine of the fake Kaggle whose image has no nbresume: drop the development copy
    from the import path, so that only what the notebook installs can be imported."""
    installed = os.environ.get("PIP_TARGET", "")
    for entry in list(sys.path):
        development = entry and os.path.isfile(os.path.join(entry, "nbresume", "__init__.py"))
        if development and entry != installed:
            sys.path.remove(entry)


if os.environ.get("NBRESUME_TEST_HIDE_NBRESUME") == "1":
    _hide_nbresume()
