"""Training state without pickle: nested ``state_dict`` trees split into tensors and JSON.

A ``state_dict`` (model, optimizer, scheduler, GradScaler, StatefulDataLoader, ...) is a tree
of dicts, lists and tuples whose leaves are tensors and plain values. :func:`flatten` moves
every tensor (and NumPy array) into a flat ``{key: tensor}`` dict, destined for a safetensors
file, and turns the rest into JSON in which the types JSON lacks are tagged::

    {"$t": "tensor", "key": "state/0/exp_avg"}        a tensor stored under that key
    {"$t": "tuple", "items": [...]}                    a tuple (optimizer betas, RNG states)
    {"$t": "dict", "items": [[key, value], ...]}       a dict with non-string keys
    {"$t": "float", "value": "nan"}                    nan, inf, -inf
    {"$t": "bytes", "base64": "..."}                   bytes
    {"$t": "ndarray", "key": "..."}                    a NumPy array stored as a tensor
    {"$t": "np", "dtype": "int64", "value": 3}         a NumPy scalar

:func:`unflatten` reverses it exactly. Anything else is refused with the path of the value,
because the only general alternative is pickle, and loading pickle can run code.
"""

from __future__ import annotations

import base64
import math
import random
from collections.abc import Mapping
from typing import Any

from nbresume.errors import CheckpointError, CorruptCheckpointError

TAG = "$t"
Tree = Any


def flatten(tree: Tree, *, name: str) -> tuple[Tree, dict[str, Any]]:
    """Split ``tree`` into a JSON-able document and a flat ``{key: tensor}`` dict."""
    tensors: dict[str, Any] = {}

    def key_for(path: list[str]) -> str:
        base = "/".join(path) or "value"
        key, n = base, 1
        while key in tensors:
            key, n = f"{base}~{n}", n + 1
        return key

    def walk(value: Any, path: list[str]) -> Tree:
        module = type(value).__module__
        # NumPy first: np.float64 and np.str_ are also float and str, and would lose their type.
        if module == "numpy":
            import numpy as np

            if isinstance(value, np.ndarray):
                key = key_for(path)
                tensors[key] = value
                return {TAG: "ndarray", "key": key}
            if isinstance(value, np.generic):
                return {TAG: "np", "dtype": value.dtype.str, "value": walk(value.item(), path)}
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return value
        if isinstance(value, float):
            if math.isfinite(value):
                return value
            return {TAG: "float", "value": repr(value)}
        if module.startswith("torch") and type(value).__name__ in ("Tensor", "Parameter"):
            key = key_for(path)
            tensors[key] = value
            return {TAG: "tensor", "key": key}
        if module.startswith("torch") and type(value).__name__ == "Size":
            return {TAG: "tuple", "items": [int(d) for d in value]}
        if isinstance(value, Mapping):
            if all(isinstance(k, str) and k != TAG for k in value):
                return {k: walk(v, [*path, k]) for k, v in value.items()}
            return {
                TAG: "dict",
                "items": [[walk(k, path), walk(v, [*path, str(k)])] for k, v in value.items()],
            }
        if isinstance(value, tuple):
            return {TAG: "tuple", "items": [walk(v, [*path, str(i)]) for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [walk(v, [*path, str(i)]) for i, v in enumerate(value)]
        if isinstance(value, (bytes, bytearray)):
            return {TAG: "bytes", "base64": base64.b64encode(bytes(value)).decode("ascii")}
        where = "/".join([name, *path])
        raise CheckpointError(
            f"cannot store {where!r}: a {type(value).__module__}.{type(value).__qualname__} is "
            "neither a tensor nor a plain value",
            fix="return tensors, numbers, strings, lists and dicts from state_dict(); "
            "nbresume never pickles, so that loading a checkpoint can never run code",
        )

    return walk(tree, []), tensors


def unflatten(document: Tree, tensors: Mapping[str, Any], *, where: str) -> Tree:
    """Rebuild the tree that :func:`flatten` split, with ``tensors`` put back in place."""

    def bad(reason: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"invalid saved state: {reason}", where=where)

    def walk(value: Tree) -> Any:
        if isinstance(value, list):
            return [walk(v) for v in value]
        if not isinstance(value, dict):
            return value
        tag = value.get(TAG)
        if tag is None:
            return {k: walk(v) for k, v in value.items()}
        if tag in ("tensor", "ndarray"):
            key = value.get("key")
            if not isinstance(key, str) or key not in tensors:
                raise bad(f"tensor {key!r} is missing")
            tensor = tensors[key]
            return tensor.numpy() if tag == "ndarray" and hasattr(tensor, "numpy") else tensor
        items = value.get("items")
        if tag == "tuple" and isinstance(items, list):
            return tuple(walk(v) for v in items)
        if tag == "dict" and isinstance(items, list):
            if not all(isinstance(p, list) and len(p) == 2 for p in items):
                raise bad("a dict entry is not a [key, value] pair")
            return {_hashable(walk(k), bad): walk(v) for k, v in items}
        if tag == "float" and value.get("value") in ("nan", "inf", "-inf"):
            return float(value["value"])
        if tag == "bytes" and isinstance(value.get("base64"), str):
            try:
                return base64.b64decode(value["base64"], validate=True)
            except ValueError:
                raise bad("bytes are not valid base64") from None
        if tag == "np":
            import numpy as np

            try:
                return np.array(walk(value.get("value")), dtype=np.dtype(value.get("dtype")))[()]
            except (TypeError, ValueError):
                raise bad("a NumPy scalar cannot be rebuilt") from None
        raise bad(f"unknown tag {tag!r}")

    return walk(document)


def _hashable(key: Any, bad: Any) -> Any:
    try:
        hash(key)
    except TypeError:
        raise bad("a dict key is not hashable") from None
    return key


# -- random number generators ---------------------------------------------------------------


def capture_rng() -> dict[str, Any]:
    """The state of every RNG a training loop draws from: Python, NumPy, torch CPU and CUDA.

    Libraries that are not imported are not touched (capturing must not import them).
    """
    import sys

    state: dict[str, Any] = {"python": random.getstate()}
    if "numpy" in sys.modules:
        import numpy as np

        state["numpy"] = np.random.get_state()
    if "torch" in sys.modules:
        import torch

        state["torch"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Put back what :func:`capture_rng` captured."""
    if "python" in state:
        value = state["python"]
        # JSON has no tuples inside a tuple: rebuild random.setstate's exact shape.
        version, internal, gauss = value
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        import numpy as np

        np.random.set_state(tuple(state["numpy"]))
    if "torch" in state:
        import torch

        torch.set_rng_state(state["torch"])
        cuda = state.get("cuda")
        if cuda:
            if not torch.cuda.is_available():
                import warnings

                warnings.warn(
                    "nbresume: the checkpoint holds CUDA RNG states but CUDA is not available "
                    "here; GPU randomness will not continue exactly",
                    RuntimeWarning,
                    stacklevel=2,
                )
            else:
                count = min(len(cuda), torch.cuda.device_count())
                for index in range(count):
                    torch.cuda.set_rng_state(cuda[index], index)
