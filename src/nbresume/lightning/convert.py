"""Move an existing Lightning run over: a pickled ``.ckpt`` read once, written verified."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from nbresume.errors import CheckpointError, UsageError
from nbresume.lightning.checkpoint_io import CheckpointIO


def convert(source: str | os.PathLike[str], folder: str | os.PathLike[str]) -> Path:
    """Read the Lightning checkpoint file ``source`` once, with ``torch.load(weights_only=True)``
    (plain tensors and containers only: no code in it can run), and write it into ``folder``
    as the nbresume checkpoint ``folder/<same name>.ckpt``; return that path.

    ``ModelCheckpoint(dirpath=folder)`` and ``nbresume.lightning.last_checkpoint(folder)``
    then continue the run from it.
    """
    import torch

    path = Path(source)
    if path.is_dir():
        raise UsageError(
            f"{path} is a folder: already an nbresume checkpoint, or not a .ckpt file",
            where=str(path),
            fix="give the .ckpt file Lightning wrote (such as last.ckpt)",
        )
    if not path.is_file():
        raise UsageError("there is no such file", where=str(path), fix="give a .ckpt file")
    try:
        checkpoint: Any = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(
            f"torch.load(weights_only=True) refused the checkpoint: {reason}",
            where=str(path),
            fix="it holds objects other than tensors and plain values (often in "
            "hyper_parameters); if you trust the file, load it yourself, replace those "
            "values with plain ones, torch.save it and convert that",
        ) from None
    if not isinstance(checkpoint, dict):
        raise CheckpointError(
            f"a Lightning checkpoint is a dictionary, this file holds a "
            f"{type(checkpoint).__name__}",
            where=str(path),
        )
    target = Path(folder) / (path.name if path.suffix == ".ckpt" else f"{path.name}.ckpt")
    CheckpointIO().save_checkpoint(checkpoint, target)
    return target
