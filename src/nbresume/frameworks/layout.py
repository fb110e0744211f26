"""The folders frameworks write, as ``nbresume ls`` / ``verify`` / ``pull`` meet them.

A Hugging Face Trainer's ``output_dir`` holds ``checkpoint-<step>`` folders (Accelerate's
automatic naming ``checkpoint_<n>``); a Lightning ``ModelCheckpoint`` folder holds ``.ckpt``
folders, each an nbresume checkpoint store of its own. Neither is an nbresume checkpoint folder
(``000000000012/``), so the commands recognise them by their names and read them with the
integrations' own readers. Nothing here imports transformers or Lightning.

:func:`resumable` tells what a framework's own resume takes from such a folder (the checkpoint
``nbresume.hf.last_checkpoint`` or ``nbresume.lightning.last_checkpoint`` returns), for
``nbresume status`` and ``nbresume run``: the Trainer's through :mod:`nbresume.hf.resume`, and
Lightning's through :func:`newest_ckpt`, which ``nbresume.lightning.last_checkpoint`` uses.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from nbresume.checkpoint.format import parse_step_dirname
from nbresume.checkpoint.store import CheckpointStore, verify_folder
from nbresume.checkpoint.units import format_bytes
from nbresume.errors import CheckpointError

if TYPE_CHECKING:
    from nbresume.hf.folders import FolderNames

TRAINER = "trainer"
ACCELERATE = "accelerate"
LIGHTNING = "lightning"

#: How each layout is named to the user.
DESCRIPTION = {
    TRAINER: "Hugging Face Trainer checkpoints (checkpoint-N folders)",
    ACCELERATE: "Accelerate save_state checkpoints (checkpoint_N folders)",
    LIGHTNING: "Lightning checkpoints (.ckpt folders of nbresume.lightning.CheckpointIO)",
}

#: Each layout's framework, in a word.
NAME = {TRAINER: "Hugging Face Trainer", ACCELERATE: "Accelerate", LIGHTNING: "Lightning"}

#: The function a run of each layout resumes through.
RESUME = {
    TRAINER: "nbresume.hf.last_checkpoint",
    ACCELERATE: "nbresume.hf.last_checkpoint",
    LIGHTNING: "nbresume.lightning.last_checkpoint",
}


def kind_of(names: Iterable[str]) -> str | None:
    """The framework layout of a folder holding the entries ``names``; ``None`` for an
    nbresume checkpoint folder (or anything else)."""
    from nbresume.hf.folders import ACCELERATE as ACCELERATE_NAMES
    from nbresume.hf.folders import TRAINER as TRAINER_NAMES

    names = [n for n in names if not n.startswith(".")]
    if any(parse_step_dirname(n) is not None for n in names):
        return None
    if any(TRAINER_NAMES.step(n) is not None for n in names):
        return TRAINER
    if any(ACCELERATE_NAMES.step(n) is not None for n in names):
        return ACCELERATE
    if any(n.endswith(".ckpt") for n in names):
        return LIGHTNING
    return None


def local_kind(location: str) -> tuple[Path, str] | None:
    """The local folder ``location`` names and its framework layout, or ``None`` (a URL, an
    nbresume checkpoint folder, anything else)."""
    if location.startswith("file://"):
        location = location[len("file://") :]
    if "://" in location:
        return None
    path = Path(location).expanduser()
    try:
        kind = kind_of(os.listdir(path))
    except OSError:
        return None
    return None if kind is None else (path, kind)


# -- Lightning's .ckpt folders --------------------------------------------------------------


def ckpt_entries(directory: Path) -> Iterator[Path]:
    """The ``*.ckpt`` folders directly in ``directory`` (not hidden, not links), by name."""
    try:
        entries = sorted(directory.iterdir())
    except OSError:
        return
    for path in entries:
        if path.name.startswith(".") or path.suffix != ".ckpt":
            continue
        if path.is_dir() and not path.is_symlink():
            yield path


def committed(directory: Path) -> list[tuple[tuple[int, str, bool], Path, str]]:
    """Every committed checkpoint of the ``*.ckpt`` folders in ``directory``, newest first:
    ``((step, created, is_last), ckpt folder, checkpoint folder name)``. Nothing is hashed."""
    found: list[tuple[tuple[int, str, bool], Path, str]] = []
    for path in ckpt_entries(directory):
        try:
            infos = CheckpointStore(str(path), keep=None).list()
        except CheckpointError:
            continue
        last = path.name.startswith("last")
        found.extend(((i.step, i.created, last), path, i.name) for i in infos)
    found.sort(key=lambda item: item[0], reverse=True)
    return found


# -- what a framework's own resume takes --------------------------------------------------------


@dataclass(frozen=True)
class PassedOver:
    """A checkpoint newer than the one a resume takes, and why the resume passes over it."""

    path: Path
    step: int
    problem: str
    #: Whether it was committed: an uncommitted folder may be a save still in progress.
    committed: bool


@dataclass(frozen=True)
class Resumable:
    """What a framework's resume takes from its folder: the checkpoint it resumes from
    (``path``, ``None``: it starts from scratch), the newer ones it passes over (newest
    first), and when each committed checkpoint of the folder was saved (by step)."""

    kind: str
    path: Path | None = None
    step: int | None = None
    #: When ``path`` was saved (ISO 8601, as its manifest records it; "" when none).
    created: str = ""
    passed_over: tuple[PassedOver, ...] = ()
    created_times: tuple[str, ...] = ()


def newest_ckpt(folders: Iterable[Path]) -> Resumable:
    """The checkpoint ``nbresume.lightning.last_checkpoint`` resumes from among the ``.ckpt``
    folders of ``folders``: ``last*.ckpt`` first when it verifies (as Lightning's
    ``ckpt_path="last"``), else the newest other by step; every byte of it read back and
    matched with its manifest. Nothing here imports Lightning."""
    found = [item for folder in folders for item in committed(folder)]
    # ``last*.ckpt`` first: it holds every ModelCheckpoint's newest state, and a run resumed
    # from another .ckpt would pin that one forever (ModelCheckpoint never removes the
    # checkpoint a run resumed from).
    candidates = sorted(found, key=lambda item: (item[0][2], item[0][0], item[0][1]), reverse=True)
    newest: dict[int, str] = {}
    for (step, created, _), _, _ in found:
        newest[step] = max(created, newest.get(step, ""))  # last.ckpt and a best one: one save
    times = tuple(newest[step] for step in sorted(newest))
    passed: list[PassedOver] = []
    for (step, created, _), path, name in candidates:
        result = verify_folder(CheckpointStore(str(path), keep=None).backend, name)
        if result.ok:
            return Resumable(LIGHTNING, path, step, created, tuple(passed), times)
        passed.append(PassedOver(path, step, result.problem, committed=True))
    return Resumable(LIGHTNING, passed_over=tuple(passed), created_times=times)


def _pickled(directory: Path) -> list[str]:
    """``.ckpt`` files (pickles Lightning wrote without nbresume) in ``directory``."""
    try:
        return sorted(p.name for p in directory.iterdir() if p.suffix == ".ckpt" and p.is_file())
    except OSError:
        return []


# -- what the commands print ----------------------------------------------------------------


def list_lines(path: Path, kind: str) -> list[str]:
    """``nbresume ls`` of a framework's folder: its checkpoints from their manifests (not
    re-hashed)."""
    from nbresume.hf.folders import NO_MANIFEST

    lines = [f"{path}: {DESCRIPTION[kind]}"]
    rows: list[tuple[str, int, int, str]] = []
    problems: list[str] = []
    if kind == LIGHTNING:
        for ckpt in ckpt_entries(path):
            try:
                infos = CheckpointStore(str(ckpt), keep=None).list()
            except CheckpointError as exc:
                problems.append(f"BROKEN {ckpt.name}: {exc}")
                continue
            if not infos:
                problems.append(f"BROKEN {ckpt.name}: no committed checkpoint in it")
            rows += [(ckpt.name, i.step, i.size, i.created) for i in infos]
        problems += [f"NOT NBRESUME {name}: {_PICKLED}" for name in _pickled(path)]
    else:
        store, names = _framework_store(path, kind)
        by_name = {i.name: i for i in store.list()}
        for step, name in reversed(store.checkpoint_folders()):
            info = by_name.get(name)
            if info is None:
                problems.append(f"NOT COMMITTED {names.real(name)} (step {step}): {NO_MANIFEST}")
            else:
                size = _trainer_size(path / names.real(name), info.size)
                rows.append((names.real(name), info.step, size, info.created))
    if rows:
        lines.append(f"{'checkpoint':<32}  {'step':>10}  {'size':>9}  created")
        lines += [f"{n:<32}  {s:>10}  {format_bytes(b):>9}  {c}" for n, s, b, c in rows]
    lines += problems
    lines.append(f"{len(rows)} checkpoint(s) in {path} (not re-hashed: run `nbresume verify`)")
    return lines


def verify_lines(path: Path, kind: str) -> tuple[list[str], bool]:
    """``nbresume verify`` of a framework's folder: every file of every checkpoint read back
    and compared with what its save recorded; the lines and whether all verified."""
    lines = [f"{path}: {DESCRIPTION[kind]}"]
    results: list[tuple[bool, str]] = []
    if kind == LIGHTNING:
        for ckpt in ckpt_entries(path):
            try:
                report = CheckpointStore(str(ckpt), keep=None).verify()
            except CheckpointError as exc:
                results.append((False, f"FAIL  {ckpt.name}  {exc}"))
                continue
            if not report.results:
                results.append((False, f"FAIL  {ckpt.name}  no committed checkpoint in it"))
            for r in report.results:
                text = f"step {r.step}  {format_bytes(r.size)}" if r.ok else r.problem
                results.append((r.ok, f"{'OK  ' if r.ok else 'FAIL'}  {ckpt.name}  {text}"))
        results += [(False, f"FAIL  {name}  {_PICKLED}") for name in _pickled(path)]
    else:
        from nbresume.hf.folders import folder_problem

        store, names = _framework_store(path, kind)
        infos = {i.name: i for i in store.list()}
        for step, name in reversed(store.checkpoint_folders()):
            info = infos.get(name)
            problem = folder_problem(store, name, info)
            size = format_bytes(_trainer_size(path / names.real(name), info.size)) if info else ""
            text = problem or f"step {step}  {size}"
            mark = "FAIL" if problem else "OK  "
            results.append((not problem, f"{mark}  {names.real(name)}  {text}"))
    lines += [text for _, text in results]
    good = sum(ok for ok, _ in results)
    if not results:
        lines.append(f"no checkpoints in {path}: nothing verified")
        return lines, False
    lines.append(f"OK {good}/{len(results)}, errors {len(results) - good}")
    return lines, good == len(results)


#: What ``nbresume pull`` and ``push`` do with a Checkpointer's folder, and how a framework's
#: folder travels instead.
_TRAVELS = {
    "pull": (
        "copies",
        "copy the folder as it is (rsync -a, cp -r, or download it), then "
        "`nbresume verify DST` reads back every file",
    ),
    "push": (
        "uploads",
        "upload the folder as it is as a dataset version (kaggle datasets version -p DIR "
        "--dir-mode tar -m MESSAGE) and run `nbresume verify` on it in the notebook, or train "
        "into a Hugging Face bucket that every machine reads (docs/platforms/hopping.md)",
    ),
}


def travel_refusal(kind: str, command: str) -> str:
    """Why ``nbresume pull`` or ``push`` (``command``) does not take a framework's folder,
    and how that folder travels instead."""
    verb, fix = _TRAVELS[command]
    return (
        f"the source holds {DESCRIPTION[kind]}; nbresume {command} {verb} nbresume checkpoint "
        f"folders only: {fix}"
    )


_PICKLED = (
    "a .ckpt file written without nbresume (pickled): `nbresume convert-lightning FILE DIR` "
    "moves it over"
)


def _trainer_size(folder: Path, payload: int) -> int:
    """The bytes of a Trainer checkpoint: the manifest's files and the framework's own
    (``optimizer.pt``, ...), as its save recorded them."""
    from nbresume.hf.folders import framework_files

    try:
        return payload + sum(int(e["size"]) for e in framework_files(folder).values())
    except (OSError, CheckpointError):
        return payload


def _framework_store(path: Path, kind: str) -> tuple[CheckpointStore, FolderNames]:
    from nbresume.hf.folders import ACCELERATE as ACCELERATE_NAMES
    from nbresume.hf.folders import TRAINER as TRAINER_NAMES
    from nbresume.hf.folders import open_store

    names = ACCELERATE_NAMES if kind == ACCELERATE else TRAINER_NAMES
    return open_store(path, keep=None, names=names), names


__all__ = [
    "PassedOver",
    "Resumable",
    "ckpt_entries",
    "committed",
    "kind_of",
    "list_lines",
    "local_kind",
    "newest_ckpt",
    "travel_refusal",
    "verify_lines",
]
