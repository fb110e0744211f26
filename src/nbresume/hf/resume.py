"""Finding the checkpoint to resume from, and Accelerate's ``save_state`` made verified."""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

from nbresume.checkpoint.format import TEMP_PREFIX
from nbresume.checkpoint.store import CheckpointInfo
from nbresume.errors import CorruptCheckpointError, UsageError
from nbresume.frameworks import layout
from nbresume.hf.folders import (
    ACCELERATE,
    TRAINER,
    FolderNames,
    commit_folder,
    folder_problem,
    fsync,
    local_path,
    open_store,
    verify,
)


def last_checkpoint(output_dir: str | os.PathLike[str]) -> str | None:
    """The newest ``checkpoint-N`` folder of ``output_dir`` that verifies, as a path for
    ``trainer.train(resume_from_checkpoint=...)``; ``None`` when there is none (a fresh run),
    so that the same cell works on the first run and on every rerun.

    Every file of the candidate is read back and checked against its manifest. A newer folder
    that is incomplete (cut short by a disconnect, or never committed) or damaged is passed
    over with a warning that names it. Folders of Accelerate's automatic naming
    (``checkpoint_N``) are found the same way. ``output_dir`` is a local path or a folder on
    the mounted Google Drive (``file://`` URLs too).
    """
    found = find_checkpoint(output_dir)
    for passed in found.passed_over:
        warnings.warn(
            f"nbresume: passing over {passed.path} (step {passed.step}): {passed.problem}",
            RuntimeWarning,
            stacklevel=2,
        )
    return None if found.path is None else str(found.path)


def find_checkpoint(output_dir: str | os.PathLike[str]) -> layout.Resumable:
    """What :func:`last_checkpoint` resumes from (its folder, step and creation time), the
    newer folders it passes over and why, and when each committed checkpoint was saved: the
    same search, for ``nbresume status`` and ``nbresume run``, which say so without warnings."""
    path = local_path(output_dir)
    if not path.is_dir():
        return layout.Resumable(layout.TRAINER)
    names = _names_in(path)
    kind = layout.ACCELERATE if names is ACCELERATE else layout.TRAINER
    store = open_store(path, keep=None, names=names)
    infos = store.list()
    committed = {info.name: info for info in infos}
    times = tuple(info.created for info in infos)
    passed: list[layout.PassedOver] = []
    for step, name in store.checkpoint_folders():
        real = names.real(name)
        if not (path / real).is_dir():
            continue  # an older copy moved aside while its step was replaced
        info = committed.get(name)
        problem = folder_problem(store, name, info)
        if not problem:
            created = info.created if info is not None else ""
            return layout.Resumable(kind, path / real, step, created, tuple(passed), times)
        passed.append(layout.PassedOver(path / real, step, problem, committed=info is not None))
    return layout.Resumable(kind, passed_over=tuple(passed), created_times=times)


def save_state(
    accelerator: Any, output_dir: str | os.PathLike[str] | None = None, **kwargs: Any
) -> str:
    """``accelerator.save_state(output_dir, **kwargs)``, then commit the folder it wrote as a
    verified nbresume checkpoint; return the folder.

    The folder's name must end with its step or iteration (``checkpoint_3`` of Accelerate's
    automatic naming, ``step-1500``): that number orders the checkpoints, and
    :func:`last_checkpoint` on the parent folder returns the newest that verifies. Only the
    main process commits; every process waits for it.
    """
    folder = Path(accelerator.save_state(output_dir, **kwargs))
    if accelerator.is_main_process:
        match = re.fullmatch(r"(.*?)(0|[1-9][0-9]*)", folder.name)
        if match is None:
            raise UsageError(
                f"{folder} has no step number at the end of its name",
                where=str(folder),
                fix="save into a folder named like step-1500, or use "
                "ProjectConfiguration(automatic_checkpoint_naming=True)",
            )
        store = open_store(folder.parent, keep=None, names=FolderNames(match.group(1)))
        commit_folder(store, int(match.group(2))).commit()
    accelerator.wait_for_everyone()
    return str(folder)


def _names_in(path: Path) -> FolderNames:
    """The naming of the checkpoint folders in ``path``: the Trainer's unless there are only
    Accelerate's."""
    names = [p.name for p in path.iterdir()]
    if not any(TRAINER.step(n) is not None for n in names) and any(
        ACCELERATE.step(n) is not None for n in names
    ):
        return ACCELERATE
    return TRAINER


def seed_from(folders: list[Path], root: Path) -> CheckpointInfo | None:
    """Copy the newest ``checkpoint-N`` that verifies among ``folders`` (the previous runs'
    output folders, attached as inputs) into ``root``, unless ``root`` has one as new: the
    seed of a Kaggle chain's next session. Copied into a hidden folder, made durable, renamed
    into place and verified there; returns the copy, or ``None`` when nothing was copied."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a damaged input checkpoint is just not a candidate
        here = last_checkpoint(root) if root.is_dir() else None
        newest_here = TRAINER.step(Path(here).name) if here else None
        sources = [
            (step, -order, Path(folder), name)
            for order, folder in enumerate(folders)
            for name in os.listdir(folder)
            if (step := TRAINER.step(name)) is not None
        ]
        for step, _, folder, name in sorted(sources, reverse=True):
            if newest_here is not None and step <= newest_here:
                return None
            source = open_store(folder, keep=None)
            info = next((i for i in source.list() if i.step == step), None)
            if info is None or verify(source, info):
                continue
            return _copy_folder(folder / name, root, step)
    return None


def _copy_folder(source: Path, root: Path, step: int) -> CheckpointInfo:
    root.mkdir(parents=True, exist_ok=True)
    target = open_store(root, keep=None)
    aside = root / f"{TEMP_PREFIX}seed-{source.name}"
    shutil.rmtree(aside, ignore_errors=True)
    shutil.copytree(source, aside)
    for path in aside.iterdir():
        fsync(path)
    if (root / source.name).exists():
        shutil.rmtree(root / source.name)  # older than the seed, or never committed
    os.rename(aside, root / source.name)
    fsync(root)
    info = next(i for i in target.list() if i.step == step)
    problem = verify(target, info)
    if problem:
        shutil.rmtree(root / source.name, ignore_errors=True)
        raise CorruptCheckpointError(
            f"{source.name} copied from {source} does not verify: {problem}",
            where=str(root),
            fix="check the free space and the disk of the output folder, then run again",
        )
    return info
