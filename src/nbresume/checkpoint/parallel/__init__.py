"""Training with ``torch.distributed``: one checkpoint for a job, replicated or sharded.

Above :mod:`~nbresume.checkpoint.state`: :mod:`.distributed` (collectives: every rank's RNG
states and decisions, as bytes, never pickle), :mod:`.dcp` (DCP's storage writer and reader
over a pending checkpoint) and :mod:`.sharded` (sharded state saved and loaded through DCP).

This package is the layer's API: the names below are what the rest of the package imports.
"""

from __future__ import annotations

from nbresume.checkpoint.parallel.distributed import Group
from nbresume.checkpoint.parallel.distributed import current as current_group
from nbresume.checkpoint.parallel.sharded import (
    Gather,
    is_sharded_object,
    load_sharded,
    loadable_state,
    save_sharded,
)

__all__ = [
    "Gather",
    "Group",
    "current_group",
    "is_sharded_object",
    "load_sharded",
    "loadable_state",
    "save_sharded",
]
