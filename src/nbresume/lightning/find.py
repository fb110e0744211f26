"""``last_checkpoint``: the newest Lightning checkpoint that verifies, for ``ckpt_path=``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from nbresume.errors import UsageError
from nbresume.frameworks.layout import newest_ckpt


def last_checkpoint(where: Any) -> str | None:
    """The ``.ckpt`` path of the newest checkpoint that verifies, or ``None``.

    ``last.ckpt`` (any ``last*.ckpt``) comes first when it verifies, as for Lightning's
    ``ckpt_path="last"``; else the newest other ``.ckpt`` by step.

    ``where`` is a ``Trainer`` (the folders of its ``ModelCheckpoint`` callbacks) or a folder
    of ``.ckpt`` checkpoints. Every byte of the checkpoint returned was read and matched its
    manifest; newer ones that do not verify are passed over. Pass the result to
    ``trainer.fit(..., ckpt_path=...)``: ``None`` starts from scratch.
    """
    # The search itself needs no Lightning: `nbresume status` and `nbresume run` use it too.
    found = newest_ckpt(checkpoint_dirs(where))
    return None if found.path is None else str(found.path)


def checkpoint_dirs(where: Any) -> list[Path]:
    """The folders a ``Trainer`` saves its checkpoints to (every version of its logger's
    folder, since a restarted run logs to a new version), or ``[where]`` for a folder."""
    if isinstance(where, (str, os.PathLike)):
        return [Path(os.fspath(where))]
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    if not isinstance(where, Trainer):
        raise UsageError(
            f"last_checkpoint() takes a Trainer or a folder, not a {type(where).__name__}",
            where="nbresume.lightning.last_checkpoint",
            fix="pass the Trainer, or the folder ModelCheckpoint saves to",
        )
    folders: list[Path] = []
    for callback in where.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            folders.append(Path(os.fspath(callback.dirpath)))
            continue
        # Not resolved before fit(): where ModelCheckpoint will put them, as Lightning does.
        if where.loggers:
            logger = where.loggers[0]
            base = Path(os.fspath(logger.save_dir or where.default_root_dir))
            name = logger.name
            root = base / str(name) if name else base
            folders.extend(sorted(root.glob("*/checkpoints")))
        else:
            folders.append(Path(os.fspath(where.default_root_dir)) / "checkpoints")
    return folders
