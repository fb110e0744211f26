"""The document of a Lightning checkpoint (``nbresume.lightning.CheckpointIO``), checked here
so that ``verify`` refuses what loading it refuses.

A ``.ckpt`` folder is a checkpoint store whose checkpoints hold ``checkpoint.json`` (the
dictionary Lightning hands, as tagged JSON: :mod:`nbresume.checkpoint.format.state_document`)
and its tensors in ``tensors.safetensors``. Nothing here imports Lightning.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nbresume.checkpoint.format.state_document import unflatten
from nbresume.errors import CorruptCheckpointError

#: The JSON document of a Lightning checkpoint: its stem, and the format it declares.
DOCUMENT = "checkpoint"
TENSORS = "tensors"
FORMAT = "nbresume-lightning"
FORMAT_VERSION = 1


def is_lightning(documents: Mapping[str, Any], location: str) -> bool:
    """Whether the checkpoint at ``location`` (its folder) with ``documents`` (parsed JSON
    files by stem) is a Lightning checkpoint: one inside a ``.ckpt`` folder, or one whose
    ``checkpoint.json`` says so."""
    if DOCUMENT not in documents:
        return False
    document = documents[DOCUMENT]
    parent = location.rstrip("/").rsplit("/", 2)[-2] if "/" in location.rstrip("/") else ""
    return parent.endswith(".ckpt") or (
        isinstance(document, dict) and document.get("format") == FORMAT
    )


def decode(document: Any, tensors: Mapping[str, Any], *, where: str) -> dict[str, Any]:
    """The checkpoint dictionary of a Lightning checkpoint in the folder ``where``, rebuilt
    from its document and ``tensors`` (or their headers, for a check). Raises
    CorruptCheckpointError naming the file when it is not one this nbresume loads."""
    document_where = f"{where}/{DOCUMENT}.json"
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise CorruptCheckpointError(
            "not a Lightning checkpoint written by nbresume", where=document_where
        )
    if document.get("version") != FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"format version {document.get('version')!r}; this nbresume reads version "
            f"{FORMAT_VERSION} (pip install -U nbresume)",
            where=document_where,
        )
    tree = unflatten(
        document.get(DOCUMENT),
        tensors,
        where=document_where,
        tensors_where=f"{where}/{TENSORS}.safetensors",
    )
    if not isinstance(tree, dict):
        raise CorruptCheckpointError("the checkpoint is not a dictionary", where=document_where)
    return tree
