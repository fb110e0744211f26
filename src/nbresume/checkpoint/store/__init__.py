"""The verified checkpoint store: write, commit, verify, keep, load, and one writer per folder.

Above :mod:`~nbresume.checkpoint.format` and :mod:`~nbresume.checkpoint.backends`:
:mod:`.pending` (a checkpoint being written, and its commit), :mod:`.hashing` (files written
and read while they are hashed), :mod:`.reading` (verified reads, verification and the reading
policy), :mod:`.verdict` (whether a checkpoint is complete and consistent, for every reader),
:mod:`.info` (what the store reports), :mod:`.retention` (which checkpoints are kept),
:mod:`.store` (:class:`CheckpointStore`: retention, the newest checkpoint that verifies),
:mod:`.lease` (the writer lease and its holder).

This package is the layer's API: the names in ``__all__`` below are what the rest of the
package imports, and they are for the package only (users import from ``nbresume`` itself),
except :class:`PendingCheckpoint`, which docs/api.md documents here.
"""

from __future__ import annotations

from nbresume.checkpoint.store.hashing import (
    Digests,
    check_bytes,
    check_hashes,
    default_hash,
    read_header,
)
from nbresume.checkpoint.store.info import (
    CheckpointInfo,
    LoadedCheckpoint,
    VerifyReport,
    VerifyResult,
)
from nbresume.checkpoint.store.lease import (
    FUTURE_TOLERANCE_S,
    LEASE_NAME,
    Holder,
    WriterLease,
    acquire_writer_lease,
    format_utc,
    holding,
    live_holder,
    this_process,
)
from nbresume.checkpoint.store.memory import is_out_of_memory, memory_error
from nbresume.checkpoint.store.pending import PendingCheckpoint, encode
from nbresume.checkpoint.store.reading import (
    decode_files,
    has_manifest,
    newest_that_loads,
    parse_json,
    verify_folder,
)
from nbresume.checkpoint.store.retention import KeepBest, KeepPolicy
from nbresume.checkpoint.store.store import CheckpointStore, verify
from nbresume.checkpoint.store.verdict import check_checkpoint, check_loaded

__all__ = [
    "FUTURE_TOLERANCE_S",
    "LEASE_NAME",
    "CheckpointInfo",
    "CheckpointStore",
    "Digests",
    "Holder",
    "KeepBest",
    "KeepPolicy",
    "LoadedCheckpoint",
    "PendingCheckpoint",
    "VerifyReport",
    "VerifyResult",
    "WriterLease",
    "acquire_writer_lease",
    "check_bytes",
    "check_checkpoint",
    "check_hashes",
    "check_loaded",
    "decode_files",
    "default_hash",
    "encode",
    "format_utc",
    "has_manifest",
    "holding",
    "is_out_of_memory",
    "live_holder",
    "memory_error",
    "newest_that_loads",
    "parse_json",
    "read_header",
    "this_process",
    "verify",
    "verify_folder",
]
