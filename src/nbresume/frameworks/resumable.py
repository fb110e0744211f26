"""What a framework's own resume takes from a folder of its layout: the one search over every
layout (:mod:`nbresume.frameworks.layout` names them), above both the layouts and
``nbresume.hf``'s search of the Trainer's and Accelerate's folders."""

from __future__ import annotations

from pathlib import Path

from nbresume.frameworks.layout import LIGHTNING, Resumable, newest_ckpt
from nbresume.hf.resume import find_checkpoint


def resumable(path: Path, kind: str) -> Resumable:
    """What the framework's own resume takes from its folder ``path`` of layout ``kind``
    (:func:`~nbresume.frameworks.layout.kind_of`): the Trainer's and Accelerate's through
    ``nbresume.hf``'s own search, Lightning's through
    :func:`~nbresume.frameworks.layout.newest_ckpt`. Every file of the checkpoint found is read
    back."""
    if kind == LIGHTNING:
        return newest_ckpt([path])
    return find_checkpoint(path)
