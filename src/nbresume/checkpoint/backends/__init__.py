"""Storage backends: where checkpoint folders live, behind one protocol.

:mod:`~nbresume.checkpoint.backends.base` states the protocol (:class:`Backend`);
:mod:`~nbresume.checkpoint.backends.registry` maps a location to its backend and imports the
backend's module only when a location of that kind is opened. The backends: a POSIX folder
(:mod:`.local`), any fsspec file system (:mod:`.fsspec_store`), Google Drive's mount
(:mod:`.drive`).
"""

from __future__ import annotations

from nbresume.checkpoint.backends.base import Backend, FreeSpace, Store
from nbresume.checkpoint.backends.registry import (
    check_location,
    get_backend_class,
    open_store,
    register_backend,
)

__all__ = [
    "Backend",
    "FreeSpace",
    "Store",
    "check_location",
    "get_backend_class",
    "open_store",
    "register_backend",
]
