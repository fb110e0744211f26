"""What each save of a run of ``nbresume check`` held, and the first save where two runs differ.

The final checkpoints say *that* a resumed run ended differently, not *from when*. Inside a
run of the check (``NBRESUME_CHECK_DIR`` set), every checkpoint a save commits is read back
once more, in the script's process, and noted as a fingerprint: one short digest per tensor
and per value, under the name a report gives it (``model 'model'`` and ``0.weight``,
``optimizer 'optimizer'`` and ``param_groups/0/lr``, ``RNG numpy``). The notes are one line
per save, appended to :data:`NOTES` in the run's folder; they outlive the retention that
deletes older checkpoints. The check then finds the first step both runs saved whose notes
differ (:func:`first_difference`), leaving out what differs between the two uninterrupted
runs too.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbresume.resumecheck.compare import PROGRESS, RNG, VALUE, Difference, kind_of

#: The file, in the run's folder, that the fingerprint of every save is appended to.
NOTES = ".nbresume-saves.jsonl"
#: Names shown in a report line before "and N more".
SHOWN = 6

#: ``{label: {key: digest}}``: ``label`` names a part of the state as a report does.
Fingerprint = dict[str, dict[str, str]]


def note_saves(root: str) -> Callable[[object], None]:
    """The ``saved`` steering of a check run: each committed checkpoint is noted in
    ``root``/:data:`NOTES` (a failure to note one is not the training's: it is passed over)."""
    notes = Path(root) / NOTES

    def saved(info: object) -> None:
        with contextlib.suppress(Exception):
            _note(notes, info)

    return saved


def _note(notes: Path, info: Any) -> None:
    from nbresume.checkpoint.store import CheckpointStore

    folder = Path(info.location)
    store = folder.parent if folder.name == info.name else folder
    state = CheckpointStore(store, keep=None).load(info.step).state
    if state is None:
        return
    line = json.dumps({"folder": store.name, "step": info.step, "held": fingerprint(state)})
    # One write of one line, appended: processes of one run (ranks) do not mix their lines.
    handle = os.open(notes, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(handle, (line + "\n").encode())
    finally:
        os.close(handle)


def fingerprint(state: Any) -> Fingerprint:
    """A digest of every tensor and value a Checkpointer's saved state holds, by name."""
    found: Fingerprint = {PROGRESS: {"": _digest((state.step, state.epoch, state.done))}}
    for name, tree in state.objects.items():
        found[Difference(kind_of(name, tree), name).label()] = dict(_leaves(tree))
    for key, value in state.values.items():
        found[Difference(VALUE, key).label()] = dict(_leaves(value))
    for stream, value in (state.rng or {}).items():
        if stream in ("python", "numpy", "torch", "cuda"):
            found[Difference(RNG, stream).label()] = {"": _digest(value)}
    return found


def _leaves(tree: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(key, digest) for every leaf of a tree, keyed as :func:`compare.differences` keys it."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, f"{path}/{key}" if path else str(key))
    elif isinstance(tree, (list, tuple)) and any(
        isinstance(v, (dict, list, tuple)) or _array(v) is not None for v in tree
    ):
        for index, value in enumerate(tree):
            yield from _leaves(value, f"{path}/{index}" if path else str(index))
    else:
        yield path, _digest(tree)


def _array(value: Any) -> Any:
    """A tensor's or an array's bytes, dtype and shape (``None`` for any other value)."""
    module, name = type(value).__module__, type(value).__name__
    if module.startswith("torch") and name in ("Tensor", "Parameter"):
        flat = value.detach().cpu().contiguous().flatten()
        return str(flat.dtype), tuple(value.shape), flat.view(_uint8()).numpy().tobytes()
    if module == "numpy" and name == "ndarray":
        return str(value.dtype), value.shape, value.tobytes()
    return None


def _uint8() -> Any:
    import torch

    return torch.uint8


def _digest(value: Any) -> str:
    array = _array(value)
    data = repr(array).encode() if array is not None else repr(value).encode()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def read(root: Path) -> dict[str, dict[int, Fingerprint]]:
    """``{folder: {step: fingerprint}}`` noted in a run's folder (a step saved twice, before
    and after a kill, keeps its last note; a line cut short by a kill is passed over)."""
    found: dict[str, dict[int, Fingerprint]] = {}
    try:
        lines = (root / NOTES).read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        try:
            note = json.loads(line)
            found.setdefault(str(note["folder"]), {})[int(note["step"])] = note["held"]
        except (ValueError, KeyError, TypeError):
            continue
    return found


@dataclass(frozen=True)
class FirstDifference:
    """The first step both runs saved whose states differ, and what differs there."""

    step: int
    #: The Checkpointer's folder, where a script has several ("" otherwise).
    folder: str
    #: ``(label, keys)``: each part of the state that differs there, with its keys.
    parts: list[tuple[str, list[str]]]
    #: The steps both runs saved before it, all the same (the newest of them, 0 if none).
    same_until: int

    def names(self) -> str:
        """``model 'model': 0.weight, 0.bias; optimizer 'optimizer': param_groups/0/lr``"""
        shown = []
        for label, keys in self.parts:
            listed = ", ".join(keys[:SHOWN]) + (
                f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
            )
            shown.append(f"{label}: {listed}" if any(keys) else label)
        return "; ".join(shown)


def first_difference(
    first: dict[str, dict[int, Fingerprint]],
    again: dict[str, dict[int, Fingerprint]],
    second: dict[str, dict[int, Fingerprint]],
) -> FirstDifference | None:
    """The first save at which the uninterrupted run (``first``) and the resumed one
    (``second``) differ; what differs between ``first`` and ``again`` (the other
    uninterrupted run) at any step is left out, as it is not the resume's doing."""
    varies = {
        (label, key)
        for folder, steps in first.items()
        for step, held in steps.items()
        for label, key in _differing(held, again.get(folder, {}).get(step))
    }
    found: FirstDifference | None = None
    several = len(first) > 1
    for folder in sorted(set(first) & set(second)):
        same = 0
        for step in sorted(set(first[folder]) & set(second[folder])):
            keys = [
                (label, key)
                for label, key in _differing(first[folder][step], second[folder][step])
                if (label, key) not in varies
            ]
            if not keys:
                same = step
                continue
            if found is None or step < found.step:
                parts: dict[str, list[str]] = {}
                for label, key in keys:
                    parts.setdefault(label, []).append(key)
                found = FirstDifference(step, folder if several else "", list(parts.items()), same)
            break
    return found


def _differing(a: Fingerprint, b: Fingerprint | None) -> Iterator[tuple[str, str]]:
    """(label, key) of every digest that differs between two fingerprints (none when the
    second run did not note that step)."""
    if b is None:
        return
    for label in list(a) + [name for name in b if name not in a]:
        x, y = a.get(label, {}), b.get(label, {})
        for key in list(x) + [k for k in y if k not in x]:
            if x.get(key) != y.get(key):
                yield label, key
