"""Two final checkpoints, compared tensor by tensor and value by value.

Each checkpoint is read with the store's verified reader (every file's hash checked before a
byte of it is parsed), then every part of the Checkpointer's state is compared exactly: each
tensor bit for bit (dtype, shape and bytes), every other value with ``==``. What differs is
reported by kind, the way a user thinks of the state: the model, the optimizer, the
scheduler, the random streams (Python, NumPy, torch, CUDA), the data position, a plain value
set with ``ckpt[...]``, a generator given to the Checkpointer, and the step the run ended at.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbresume.checkpoint.format import SavedState
from nbresume.checkpoint.store import CheckpointStore
from nbresume.errors import CheckpointError

#: The kinds of state, in the order a report lists them.
MODEL = "model"
OPTIMIZER = "optimizer"
SCHEDULER = "scheduler"
RNG = "RNG"
LOADER = "loader position"
VALUE = "plain value"
GENERATOR = "generator"
PROGRESS = "steps trained"
OTHER = "other state"
KINDS = (PROGRESS, MODEL, OPTIMIZER, SCHEDULER, RNG, GENERATOR, LOADER, VALUE, OTHER)

#: Keys named in a report line before "and N more".
SHOWN_KEYS = 6


@dataclass
class Difference:
    """One part of the state that is not the same in the two runs."""

    kind: str
    #: The object's name (``model``, ``optimizer``), the stream (``numpy``) or the value's key.
    name: str
    #: The keys inside it that differ (``0.weight``, ``state/0/exp_avg``), with a note each.
    keys: list[tuple[str, str]] = field(default_factory=list)
    #: How many keys it has in all (0 where that means nothing).
    total: int = 0
    #: The Checkpointer's folder, where a script has several.
    folder: str = ""

    def label(self) -> str:
        """``model 'model'``, ``RNG numpy``, with the folder where a script has several."""
        where = f" in {self.folder}/" if self.folder else ""
        return (f"RNG {self.name}" if self.kind == RNG else f"{self.kind} {self.name!r}") + where

    def line(self) -> str:
        """``model 'model': 2 of 4 differ: 0.weight (by up to 3e-04), ...``"""
        if self.kind == PROGRESS:
            where = f" in {self.folder}/" if self.folder else ""
            return f"{self.kind}{where}: {self.keys[0][1]}"
        if len(self.keys) == 1 and not self.keys[0][0]:  # the whole of it: a value, a stream
            return f"{self.label()}: {self.keys[0][1]}"
        shown = []
        for key, note in self.keys[:SHOWN_KEYS]:
            shown.append(f"{key} ({note})" if note and key else key or note)
        more = len(self.keys) - SHOWN_KEYS
        text = ", ".join(shown) + (f" and {more} more" if more > 0 else "")
        count = f"{len(self.keys)} of {self.total} differ: " if self.total > 1 else "differs: "
        return f"{self.label()}: {count}{text}"


@dataclass
class Final:
    """The newest checkpoint of one Checkpointer's folder in one run, read and verified."""

    folder: Path
    step: int
    state: SavedState


@dataclass
class Comparison:
    """What the two runs' final checkpoints hold in common and where they differ."""

    differences: list[Difference]
    #: The folder name of every Checkpointer compared, with the step its checkpoints ended at.
    compared: dict[str, tuple[int, int]]
    #: The kinds of state the checkpoints hold (what "exact" covers).
    kinds: dict[str, set[str]]
    #: Folders that only one run saved into.
    missing: list[str] = field(default_factory=list)
    #: How many random generators the Checkpointers were given.
    generators: int = 0
    #: The global random streams the checkpoints hold (python, numpy, torch, cuda).
    streams: set[str] = field(default_factory=set)

    @property
    def exact(self) -> bool:
        return not self.differences and not self.missing and bool(self.compared)


#: What differs between two uninterrupted runs of a script that is reproducible at all.
_MAY_VARY = frozenset({RNG, VALUE, GENERATOR, OTHER})


def reproducible(baseline: Comparison) -> bool:
    """Whether two uninterrupted runs agree on everything that trains: the steps, the
    weights, the optimizer, the scheduler and the data position (an unseeded random stream
    that nothing draws from, or a time stamp kept as a value, may differ)."""
    return not baseline.missing and all(d.kind in _MAY_VARY for d in baseline.differences)


def final_checkpoints(root: Path) -> dict[str, Final]:
    """The newest committed checkpoint of every Checkpointer folder under ``root``, read back
    and verified (a checkpoint that does not verify raises: that is a failure of its own)."""
    found = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        store = CheckpointStore(folder, keep=None)
        latest = store.latest()
        if latest is None:
            continue
        loaded = store.load(latest.step)
        if loaded.state is None:
            raise CheckpointError("not a Checkpointer's checkpoint", where=loaded.location)
        found[folder.name] = Final(folder, latest.step, loaded.state)
    return found


def compare(first: Mapping[str, Final], second: Mapping[str, Final]) -> Comparison:
    """Compare the final checkpoints of the two runs, folder by folder."""
    several = len(set(first) | set(second)) > 1
    differences: list[Difference] = []
    compared: dict[str, tuple[int, int]] = {}
    kinds: dict[str, set[str]] = {}
    generators = 0
    streams: set[str] = set()
    missing = sorted(set(first) ^ set(second))
    for name in sorted(set(first) & set(second)):
        a, b = first[name].state, second[name].state
        compared[name] = (a.step, b.step)
        found = list(_compare_states(a, b))
        for difference in found:
            difference.folder = name if several else ""
        differences += found
        kinds[name] = _kinds_held(a)
        generators += sum(kind_of(n, t) == GENERATOR for n, t in a.objects.items())
        streams |= {s for s in ("python", "numpy", "torch", "cuda") if s in a.rng}
    differences.sort(key=lambda d: KINDS.index(d.kind))
    return Comparison(differences, compared, kinds, missing, generators, streams)


def _compare_states(a: SavedState, b: SavedState) -> Iterator[Difference]:
    if (a.step, a.epoch, a.done) != (b.step, b.epoch, b.done):
        yield Difference(PROGRESS, "", [("", _progress(a, b))])
    for name in sorted(set(a.objects) | set(b.objects)):
        tree = a.objects.get(name, b.objects.get(name))
        kind = kind_of(name, tree)
        if name not in a.objects or name not in b.objects:
            run = 1 if name in a.objects else 2
            yield Difference(kind, name, [("", f"only run {run} saved it")])
            continue
        keys = list(differences(a.objects[name], b.objects[name]))
        if keys:
            yield Difference(kind, name, keys, total=count_leaves(tree))
    for key in sorted(set(a.values) | set(b.values)):
        found = list(differences(a.values.get(key, _ABSENT), b.values.get(key, _ABSENT)))
        if found:
            yield Difference(VALUE, key, [(k, note) for k, note in found])
    for stream in ("python", "numpy", "torch", "cuda"):
        if stream in a.rng or stream in b.rng:
            found = list(differences(a.rng.get(stream, _ABSENT), b.rng.get(stream, _ABSENT)))
            if found:
                yield Difference(RNG, stream, [("", "its state differs at the end")])


def _progress(a: SavedState, b: SavedState) -> str:
    def ended(state: SavedState, run: int) -> str:
        how = "finished" if state.done else "stopped"
        epoch = f" (epoch {state.epoch})" if state.epoch else ""
        return f"run {run} {how} at step {state.step}{epoch}"

    return f"{ended(a, 1)}, {ended(b, 2)}"


def kind_of(name: str, tree: Any) -> str:
    """The kind of a saved object, from the shape of its state (its name where that says
    nothing): a model, an optimizer, a scheduler, a loader, a generator, or other state."""
    keys = set(tree) if isinstance(tree, dict) else set()
    if {"state", "param_groups"} <= keys:
        return OPTIMIZER
    if keys & {"last_epoch", "base_lrs", "_step_count"}:
        return SCHEDULER
    if {"seed", "epoch", "position"} <= keys or "loader" in name.lower():
        return LOADER
    if keys and keys <= {"python", "numpy", "numpy_legacy", "torch", "device"}:
        return GENERATOR
    if keys and (tree.get("format") == "nbresume-trainable" or all(map(_is_array, tree.values()))):
        return MODEL
    return OTHER


def _kinds_held(state: SavedState) -> set[str]:
    held = {kind_of(name, tree) for name, tree in state.objects.items()}
    if state.values:
        held.add(VALUE)
    return held | {RNG}


class _Absent:
    def __repr__(self) -> str:
        return "absent"


_ABSENT = _Absent()


def _is_array(value: Any) -> bool:
    module = type(value).__module__
    return (module.startswith("torch") and type(value).__name__ in ("Tensor", "Parameter")) or (
        module == "numpy" and type(value).__name__ == "ndarray"
    )


def count_leaves(tree: Any) -> int:
    """How many tensors and plain values a tree holds."""
    if isinstance(tree, dict):
        return sum(count_leaves(v) for v in tree.values())
    if isinstance(tree, (list, tuple)) and not all(isinstance(v, (int, float)) for v in tree):
        return sum(count_leaves(v) for v in tree)
    return 1


def differences(a: Any, b: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(key, note) for every place where two trees differ; tensors are compared bit for bit."""
    if _is_array(a) or _is_array(b):
        note = _array_difference(a, b)
        if note:
            yield path, note
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            inner = f"{path}/{key}" if path else str(key)
            yield from differences(a.get(key, _ABSENT), b.get(key, _ABSENT), inner)
        return
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            yield path, f"{len(a)} items in run 1, {len(b)} in run 2"
            return
        if all(not isinstance(v, (dict, list, tuple)) and not _is_array(v) for v in (*a, *b)):
            if list(a) != list(b):  # a flat list (an RNG's internal state): one difference
                yield path, "differs"
            return
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            yield from differences(x, y, f"{path}/{index}" if path else str(index))
        return
    if type(a) is not type(b) or not _same(a, b):
        yield path, f"{_short(a)} in run 1, {_short(b)} in run 2"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True  # nan and nan: the same value
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _array_difference(a: Any, b: Any) -> str:
    """``""`` when two tensors (or arrays) are bit-identical, else what differs."""
    import numpy as np
    import torch

    if not (_is_array(a) and _is_array(b)):
        return "a tensor in one run only"
    x = torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a.detach()
    y = torch.from_numpy(np.ascontiguousarray(b)) if isinstance(b, np.ndarray) else b.detach()
    if x.dtype != y.dtype or x.shape != y.shape:
        return f"{list(x.shape)} {x.dtype} in run 1, {list(y.shape)} {y.dtype} in run 2"
    x, y = x.cpu().contiguous().flatten(), y.cpu().contiguous().flatten()
    if torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
        return ""
    if x.is_floating_point():
        largest = (x.double() - y.double()).abs().nan_to_num(nan=float("inf")).max().item()
        return f"by up to {largest:.2g}"
    changed = int((x != y).sum().item())
    return f"{changed} of {x.numel()} values differ" if x.numel() > 1 else f"{x[0]} vs {y[0]}"
