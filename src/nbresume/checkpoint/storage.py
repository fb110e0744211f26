"""Where checkpoints live: the names of :mod:`nbresume.checkpoint.backends`, in one place.

Protocol: none of its own. The backend protocol is stated in
:mod:`nbresume.checkpoint.backends.base`; the backends (local, fsspec, Google Drive) and the
registry that picks one for a location live in :mod:`nbresume.checkpoint.backends`. How a
checkpoint is committed through a backend is described at the top of
:mod:`nbresume.checkpoint.store`.
"""

from __future__ import annotations

from nbresume.checkpoint.backends.base import (
    DELETING_PREFIX,
    READ_CHUNK,
    REPLACED_PREFIX,
    SMALL_FILE_LIMIT,
    Backend,
    FreeSpace,
    Store,
    handle_size,
    read_into,
    replaced_step,
)
from nbresume.checkpoint.backends.fsspec_store import FsspecStore
from nbresume.checkpoint.backends.local import LocalStore, fsync_folder
from nbresume.checkpoint.backends.registry import check_location, open_store, register_backend

__all__ = [
    "DELETING_PREFIX",
    "READ_CHUNK",
    "REPLACED_PREFIX",
    "SMALL_FILE_LIMIT",
    "Backend",
    "FreeSpace",
    "FsspecStore",
    "LocalStore",
    "Store",
    "check_location",
    "fsync_folder",
    "handle_size",
    "open_store",
    "read_into",
    "register_backend",
    "replaced_step",
]
