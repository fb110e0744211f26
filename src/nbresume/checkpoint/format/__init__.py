"""The checkpoint's format: bytes to objects and back, with no I/O.

The layer above the root (:mod:`nbresume.checkpoint`): :mod:`.manifest` (the manifest, the
commit marker, and the names of a checkpoint folder; docs/format.md), :mod:`.tensorfile`
(safetensors files, read and written without pickle), :mod:`.state_document` (training state as
tensors and tagged JSON, the Checkpointer's ``state.json`` and the RNG states in it) and
:mod:`.lightning_format` (the document of a Lightning checkpoint). It imports only the root.

This package is the layer's API: the names below are what the rest of the package imports.
"""

from __future__ import annotations

from nbresume.checkpoint.format.lightning_format import DOCUMENT as LIGHTNING_DOCUMENT
from nbresume.checkpoint.format.lightning_format import FORMAT as LIGHTNING_FORMAT
from nbresume.checkpoint.format.lightning_format import FORMAT_VERSION as LIGHTNING_FORMAT_VERSION
from nbresume.checkpoint.format.lightning_format import TENSORS as LIGHTNING_TENSORS
from nbresume.checkpoint.format.lightning_format import decode as decode_lightning
from nbresume.checkpoint.format.manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    HASH_ALGORITHM,
    HASH_DIGITS,
    MANIFEST_NAME,
    MAX_JSON_BYTES,
    MAX_MANIFEST_BYTES,
    RETIRED_PREFIX,
    TEMP_PREFIX,
    FileEntry,
    Manifest,
    check_version,
    created_time,
    is_valid_file_name,
    parse_manifest,
    parse_step_dirname,
    step_dirname,
)
from nbresume.checkpoint.format.state_document import (
    STATE_FILE,
    STATE_VERSION,
    SavedState,
    capture_rng,
    check_mt19937_position,
    check_rng,
    decode_state,
    flatten,
    is_state_document,
    restore_rng,
    unflatten,
)
from nbresume.checkpoint.format.tensorfile import (
    TensorSpec,
    from_torch_name,
    signature,
    torch_name,
)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "HASH_ALGORITHM",
    "HASH_DIGITS",
    "LIGHTNING_DOCUMENT",
    "LIGHTNING_FORMAT",
    "LIGHTNING_FORMAT_VERSION",
    "LIGHTNING_TENSORS",
    "MANIFEST_NAME",
    "MAX_JSON_BYTES",
    "MAX_MANIFEST_BYTES",
    "RETIRED_PREFIX",
    "STATE_FILE",
    "STATE_VERSION",
    "TEMP_PREFIX",
    "FileEntry",
    "Manifest",
    "SavedState",
    "TensorSpec",
    "capture_rng",
    "check_mt19937_position",
    "check_rng",
    "check_version",
    "created_time",
    "decode_lightning",
    "decode_state",
    "flatten",
    "from_torch_name",
    "is_state_document",
    "is_valid_file_name",
    "parse_manifest",
    "parse_step_dirname",
    "restore_rng",
    "signature",
    "step_dirname",
    "torch_name",
    "unflatten",
]
