"""What the script's globals hold at its end, noted in each run of ``nbresume check``.

A state the checkpoint lacks shows at the end of a resumed run as a value that differs from
the uninterrupted run's: an environment object's own random generator that restarted from
its seed, a counter kept in a plain variable that counted again from zero. Inside a run of
the check (``NBRESUME_CHECK_DIR`` set), the script's ``__main__`` globals are looked at
when it exits: every random generator (``random.Random``, NumPy's ``Generator`` and
``RandomState``, ``torch.Generator``), held by a global or by an attribute of one, is noted
by a digest of its state (read, never drawn from), and every whole number by its value. The
check then compares the notes of the two runs (:func:`differing`).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import sys
import types
from pathlib import Path
from typing import Any

#: The file, in the run's checkpoint folder, that a script's globals are noted in.
NOTE = ".nbresume-globals.json"


def note_at_exit(root: str) -> None:
    """Note the script's globals in ``root`` when the process exits normally."""
    atexit.register(_write, Path(root))


def _write(root: Path) -> None:
    import multiprocessing

    main = sys.modules.get("__main__")
    if main is None or multiprocessing.parent_process() is not None:
        return  # a DataLoader's worker: only the script's own process speaks for it
    with contextlib.suppress(OSError, TypeError, ValueError):
        root.mkdir(parents=True, exist_ok=True)
        (root / NOTE).write_text(json.dumps(observe(vars(main))))


#: What a script's globals hold that is code, not state.
_NOT_STATE = (
    types.ModuleType,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
)


def observe(names: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{name: {"kind": ..., "value": ...}}`` for the generators and whole numbers that
    ``names`` holds, attributes of its objects included (``env.rng``)."""
    found: dict[str, dict[str, Any]] = {}
    for name, value in names.items():
        if name.startswith("_") or isinstance(value, _NOT_STATE):
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            found[name] = {"kind": "counter", "value": value}
            continue
        kind = _generator(value)
        if kind is not None:
            found[name] = {"kind": kind, "value": _digest(value, kind)}
            continue
        attributes = getattr(value, "__dict__", None)
        if not isinstance(attributes, dict):
            continue
        for attribute, inner in attributes.items():
            kind = _generator(inner)
            if kind is not None:
                found[f"{name}.{attribute}"] = {"kind": kind, "value": _digest(inner, kind)}
    return found


def _generator(value: Any) -> str | None:
    """The kind of random generator ``value`` is, or ``None``."""
    import random

    if isinstance(value, random.Random):
        return "random.Random"
    module, name = type(value).__module__, type(value).__name__
    if module.startswith("numpy") and name in ("Generator", "RandomState"):
        return f"numpy {name}"
    if module.startswith("torch") and name == "Generator":
        return "torch.Generator"
    return None


def _digest(generator: Any, kind: str) -> str:
    """A digest of a generator's state, read without drawing from it."""
    if kind == "random.Random":
        state: Any = generator.getstate()
    elif kind == "numpy Generator":
        state = generator.bit_generator.state
    elif kind == "numpy RandomState":
        state = generator.get_state(legacy=False)
    else:
        state = generator.get_state().tolist()
    return hashlib.sha256(repr(state).encode()).hexdigest()[:16]


def read(root: Path) -> dict[str, dict[str, Any]]:
    """The globals a run noted in ``root`` (empty when it noted none)."""
    try:
        found = json.loads((root / NOTE).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def differing(
    first: dict[str, dict[str, Any]], second: dict[str, dict[str, Any]], *, leave_out: set[str]
) -> list[tuple[str, str, str]]:
    """(name, kind, note) for every global both runs noted that ended differently, those in
    ``leave_out`` aside (they differ between two uninterrupted runs too)."""
    found = []
    for name in sorted(set(first) & set(second) - leave_out):
        a, b = first[name], second[name]
        if a.get("kind") != b.get("kind") or a.get("value") == b.get("value"):
            continue
        kind = str(a.get("kind"))
        note = (
            f"{a.get('value')} in run 1, {b.get('value')} in run 2"
            if kind == "counter"
            else "its state differs at the end"
        )
        found.append((name, kind, note))
    return found
