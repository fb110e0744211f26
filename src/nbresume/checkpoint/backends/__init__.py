"""Storage backends: where checkpoint folders live, behind one protocol.

The layer above :mod:`~nbresume.checkpoint.format`: :mod:`.base` states the protocol
(:class:`Backend`) and the value a backend answers about durability (:class:`Durability`);
:mod:`.registry` maps a location to its backend, importing a registered backend's module only
when a location of its kind is opened. The built-in backends: a POSIX folder (:mod:`.local`,
which also removes deleted checkpoints in the background), any fsspec file system
(:mod:`.fsspec_store`), Google Drive's mount (:mod:`.drive`), a Hugging Face Storage Bucket
(:mod:`.hf_bucket`, imported only when an ``hf://buckets/`` URL is opened). How a checkpoint
is committed through a backend is described at the top of :mod:`nbresume.checkpoint.store.store`.

This package is the layer's API: the names below are what the rest of the package imports.
"""

from __future__ import annotations

from nbresume.checkpoint.backends.base import (
    DELETING_PREFIX,
    FAILED,
    MISSING,
    READ_CHUNK,
    REPLACED_PREFIX,
    SAVED,
    SMALL_FILE_LIMIT,
    SYNCING,
    Backend,
    Durability,
    FreeSpace,
    handle_size,
    read_into,
    replaced_step,
)
from nbresume.checkpoint.backends.drive import DriveApi, DriveStore
from nbresume.checkpoint.backends.fsspec_store import FsspecStore
from nbresume.checkpoint.backends.local import LocalStore, fsync_folder, wait_for_removals
from nbresume.checkpoint.backends.registry import (
    SCHEME_PACKAGES,
    backend_kind,
    check_location,
    get_backend_class,
    open_store,
    register_backend,
)

__all__ = [
    "DELETING_PREFIX",
    "FAILED",
    "MISSING",
    "READ_CHUNK",
    "REPLACED_PREFIX",
    "SAVED",
    "SCHEME_PACKAGES",
    "SMALL_FILE_LIMIT",
    "SYNCING",
    "Backend",
    "DriveApi",
    "DriveStore",
    "Durability",
    "FreeSpace",
    "FsspecStore",
    "LocalStore",
    "backend_kind",
    "check_location",
    "fsync_folder",
    "get_backend_class",
    "handle_size",
    "open_store",
    "read_into",
    "register_backend",
    "replaced_step",
    "wait_for_removals",
]
