"""The training state: from the live objects to a snapshot, and from a checkpoint back into them.

Above :mod:`~nbresume.checkpoint.store`: :mod:`.snapshot` (capture and host copies),
:mod:`.restoring` (the restore's plan, checked before anything changes, then applied),
:mod:`.generators` (the user's own random generators), :mod:`.optimizer_extras` (what an
optimizer's state_dict leaves out: pending gradients, parameter groups added in training),
:mod:`.trainable` (trainable-only state), :mod:`.data` (the resumable loader and its exact data
position), :mod:`.health` (out of memory, data wait) and :mod:`.determinism` (bit-exact
continuation on a GPU).

This package is the layer's API: the names below are what the rest of the package imports.
"""

from __future__ import annotations

from nbresume.checkpoint.format import STATE_FILE
from nbresume.checkpoint.state.data import ResumableLoader, sample_generator, sample_seed
from nbresume.checkpoint.state.determinism import apply as apply_determinism
from nbresume.checkpoint.state.determinism import describe as describe_determinism
from nbresume.checkpoint.state.generators import GeneratorState, is_generator
from nbresume.checkpoint.state.health import MIN_BATCHES, DataWaitShare, data_wait_of
from nbresume.checkpoint.state.optimizer_extras import StepWatch
from nbresume.checkpoint.state.prepared import unwrap, unwrap_loader
from nbresume.checkpoint.state.snapshot import (
    GRADIENTS_GROUP,
    RNG_GROUP,
    STAGE_BUFFERS,
    STAGE_PIECE,
    VALUES_GROUP,
    HostBuffers,
    Snapshot,
    Stager,
    capture,
    tensor_bytes,
)
from nbresume.checkpoint.state.trainable import TrainableOnly, trainable_only
from nbresume.errors import BaseMismatchError, DoesNotFit

__all__ = [
    "GRADIENTS_GROUP",
    "MIN_BATCHES",
    "RNG_GROUP",
    "STAGE_BUFFERS",
    "STAGE_PIECE",
    "STATE_FILE",
    "VALUES_GROUP",
    "BaseMismatchError",
    "DataWaitShare",
    "DoesNotFit",
    "GeneratorState",
    "HostBuffers",
    "ResumableLoader",
    "Snapshot",
    "Stager",
    "StepWatch",
    "TrainableOnly",
    "apply_determinism",
    "capture",
    "data_wait_of",
    "describe_determinism",
    "is_generator",
    "sample_generator",
    "sample_seed",
    "tensor_bytes",
    "trainable_only",
    "unwrap",
    "unwrap_loader",
]
