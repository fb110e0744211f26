"""The folders frameworks write, as ``nbresume ls`` / ``verify`` / ``pull`` meet them.

A Hugging Face Trainer's ``output_dir`` holds ``checkpoint-<step>`` folders (Accelerate's
automatic naming ``checkpoint_<n>``); a Lightning ``ModelCheckpoint`` folder holds ``.ckpt``
folders, each an nbresume checkpoint store of its own. Neither is an nbresume checkpoint folder
(``000000000012/``), so the commands recognise them by their names and read them with the
integrations' own readers. Nothing here imports transformers or Lightning.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from nbresume.checkpoint.format import parse_step_dirname
from nbresume.checkpoint.store import CheckpointStore
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


def pull_refusal(kind: str) -> str:
    """Why ``nbresume pull`` does not copy a framework's folder, and what to do."""
    return (
        f"the source holds {DESCRIPTION[kind]}; nbresume pull copies nbresume checkpoint "
        "folders only: copy the folder as it is (rsync -a, cp -r, or download it), then "
        "`nbresume verify DST` reads back every file"
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
    "ckpt_entries",
    "committed",
    "kind_of",
    "list_lines",
    "local_kind",
    "pull_refusal",
    "verify_lines",
]
