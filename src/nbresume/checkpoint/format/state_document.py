"""Training state without pickle: nested ``state_dict`` trees split into tensors and JSON.

A ``state_dict`` (model, optimizer, scheduler, GradScaler, StatefulDataLoader, ...) is a tree
of dicts, lists and tuples whose leaves are tensors and plain values. :func:`flatten` moves
every tensor (and NumPy array) into a flat ``{key: tensor}`` dict, destined for a safetensors
file, and turns the rest into JSON in which the types JSON lacks are tagged::

    {"$t": "tensor", "key": "state/0/exp_avg",        a tensor stored under that key,
     "dtype": "F32", "shape": [16, 8]}                 with its safetensors dtype and shape
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
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nbresume.checkpoint.format.tensorfile import _DTYPES, TensorSpec, signature
from nbresume.errors import CheckpointError, CorruptCheckpointError

#: The name (without ``.json``) of a Checkpointer's state document in a checkpoint folder.
STATE_FILE = "state"
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
                return {TAG: "ndarray", "key": key, **_declared(value)}
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
            return {TAG: "tensor", "key": key, **_declared(value)}
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
            where=where,
            fix="return tensors, numbers, strings, lists and dicts from state_dict(); "
            "nbresume never pickles, so that loading a checkpoint can never run code",
        )

    return walk(tree, []), tensors


#: Deepest nesting of a saved document: far beyond any ``state_dict`` (an optimizer's is 5
#: levels), far below what would exhaust Python's recursion limit while rebuilding it.
MAX_DEPTH = 100
#: Largest NumPy scalar item (a ``np.str_`` of 16 Ki characters is 64 KiB).
_MAX_NP_ITEMSIZE = 1 << 16
_NP_KINDS = frozenset("biufcUSmM")


#: What a JSON document nests: everything else in it is a scalar.
_CONTAINERS = (dict, list)


def check_depth(document: Tree, *, where: str, limit: int = MAX_DEPTH) -> None:
    """Refuse a document nested deeper than ``limit`` (iteratively, one level at a time: never
    a RecursionError; the memory it takes is a list of the containers of one level, never
    more references than the document holds)."""
    level = [document] if isinstance(document, _CONTAINERS) else []
    depth = 1
    while level:
        if depth > limit:
            raise CorruptCheckpointError(
                f"invalid saved state: nested deeper than {limit} levels", where=where
            )
        # Only the containers go on: the scalars, most of a document, are looked at once.
        level = [
            child
            for value in level
            for child in (value.values() if isinstance(value, dict) else value)
            if isinstance(child, _CONTAINERS)
        ]
        depth += 1


#: What parsing a JSON document may take in memory, in multiples of its size. Python's objects
#: are larger than the text they come from: an empty object (``{}``, two bytes) is some 64, a
#: list some 56, a reference to any value 8. A document whose estimated cost is more (an
#: object or a list every few bytes: no state a program saves looks like that) is refused
#: before it is parsed, so that what a checkpoint's JSON costs a reader stays a small
#: multiple of its size (the 32 MiB the largest may have would otherwise take gigabytes).
MAX_PARSE_FACTOR = 6
#: Documents this small are parsed whatever their shape.
_COST_FREE_BYTES = 1 << 20


def check_parse_cost(raw: bytes | bytearray | memoryview, *, where: str) -> None:
    """Refuse a JSON document whose parse would take more than :data:`MAX_PARSE_FACTOR`
    times its size in memory, from a count of its brackets and commas (a string that holds
    them counts them too: the estimate errs high only for such text)."""
    data = bytes(raw) if isinstance(raw, memoryview) else raw
    size = len(data)
    if size <= _COST_FREE_BYTES:
        return
    containers = data.count(b"{") + data.count(b"[")
    estimate = 72 * containers + 16 * data.count(b",")
    if estimate > MAX_PARSE_FACTOR * size:
        raise CorruptCheckpointError(
            f"the JSON document holds {containers} objects and lists in {size} bytes: "
            f"parsing it would take about {estimate >> 20} MiB of memory, more than "
            f"{MAX_PARSE_FACTOR} times its size (no saved state is laid out that densely)",
            where=where,
        )


def _declared(value: Any) -> dict[str, Any]:
    """The dtype and shape a tensor reference declares (checked against the file on load)."""

    found = signature(value)
    return {} if found is None else {"dtype": found[0], "shape": list(found[1])}


def unflatten(
    document: Tree,
    tensors: Mapping[str, Any],
    *,
    where: str,
    path: str = "",
    tensors_where: str = "",
) -> Tree:
    """Rebuild the tree that :func:`flatten` split, with ``tensors`` put back in place.

    Checks every value first: the nesting depth, known tags only, each in its exact form, and
    every tensor the document refers to present in ``tensors`` with the dtype and shape the
    reference declares (``tensors`` may hold :class:`~nbresume.checkpoint.format.TensorSpec`
    headers instead of tensors: then only that is checked). Raises
    :class:`CorruptCheckpointError` naming ``where`` (``tensors_where``, the tensor file, for
    a tensor that is missing or differs) and the key (``path`` prefixes it).
    """

    check_depth(document, where=where)

    def bad(reason: str, at: list[str], file: str = "") -> CorruptCheckpointError:
        key = "/".join(p for p in (path, *at) if p)
        return CorruptCheckpointError(
            f"invalid saved state at {key or 'the top'!r}: {reason}", where=file or where
        )

    def tensor_at(value: dict[str, Any], at: list[str]) -> Any:
        key = value["key"]
        if not isinstance(key, str) or key not in tensors:
            raise bad(f"tensor {key!r} is missing", at, tensors_where)
        tensor = tensors[key]
        if "dtype" in value:
            declared = (value["dtype"], value["shape"])
            found = signature(tensor)
            if found is None or (found[0], list(found[1])) != declared:
                shown = "unknown" if found is None else f"{list(found[1])} {found[0]}"
                raise bad(
                    f"tensor {key!r} is {shown} in the file, {declared[1]} {declared[0]} in "
                    "the saved state",
                    at,
                    tensors_where,
                )
        return tensor

    # A scalar is itself: only containers are walked (and their keys' path built), so that a
    # long list of numbers (a generator's state) costs one look per number.
    def walk(value: Tree, at: list[str]) -> Any:
        if isinstance(value, list):
            return [
                walk(v, [*at, str(i)]) if isinstance(v, _CONTAINERS) else v
                for i, v in enumerate(value)
            ]
        if not isinstance(value, dict):
            return value
        if TAG not in value:
            return {
                k: walk(v, [*at, k]) if isinstance(v, _CONTAINERS) else v for k, v in value.items()
            }
        tag = value[TAG]
        fields = set(value) - {TAG}
        if tag in ("tensor", "ndarray") and (
            fields == {"key"}
            or (
                fields == {"key", "dtype", "shape"}
                and isinstance(value["dtype"], str)
                and isinstance(value["shape"], list)
            )
        ):
            tensor = tensor_at(value, at)
            return tensor.numpy() if tag == "ndarray" and hasattr(tensor, "numpy") else tensor
        items = value.get("items")
        if tag == "tuple" and fields == {"items"} and isinstance(items, list):
            return tuple(
                walk(v, [*at, str(i)]) if isinstance(v, _CONTAINERS) else v
                for i, v in enumerate(items)
            )
        if tag == "dict" and fields == {"items"} and isinstance(items, list):
            if not all(isinstance(p, list) and len(p) == 2 for p in items):
                raise bad("a dict entry is not a [key, value] pair", at)
            out = {}
            for k, v in items:
                name = walk(k, at)
                out[_hashable(name, lambda r: bad(r, at))] = walk(v, [*at, str(name)])
            return out
        if tag == "float" and fields == {"value"} and value["value"] in ("nan", "inf", "-inf"):
            return float(value["value"])
        if tag == "bytes" and fields == {"base64"} and isinstance(value["base64"], str):
            try:
                return base64.b64decode(value["base64"], validate=True)
            except ValueError:
                raise bad("bytes are not valid base64", at) from None
        if tag == "np" and fields == {"dtype", "value"} and isinstance(value["dtype"], str):
            import numpy as np

            try:
                dtype = np.dtype(value["dtype"])
                if dtype.kind not in _NP_KINDS or dtype.itemsize > _MAX_NP_ITEMSIZE:
                    raise TypeError(dtype)
                return np.array(walk(value["value"], at), dtype=dtype)[()]
            except (TypeError, ValueError, OverflowError):
                raise bad("a NumPy scalar cannot be rebuilt", at) from None
        if tag in ("tensor", "ndarray", "tuple", "dict", "float", "bytes", "np"):
            raise bad(f"a {tag!r} value is malformed", at)
        raise bad(f"unknown tag {tag!r}", at)

    return walk(document, [])


def _hashable(key: Any, bad: Any) -> Any:
    try:
        hash(key)
    except TypeError:
        raise bad("a dict key is not hashable") from None
    return key


# -- the Checkpointer's state document ---------------------------------------------------------

#: The version of the Checkpointer's ``state.json`` document this nbresume reads and writes.
STATE_VERSION = 1


@dataclass
class SavedState:
    """A Checkpointer's ``state.json``, checked and rebuilt (tensors in place)."""

    step: int
    epoch: int
    total: int | None
    done: bool
    objects: dict[str, Any]
    values: dict[str, Any]
    rng: Any
    world_size: int = 1
    rank_rng: list[Any] = field(default_factory=list)
    sharded: list[str] = field(default_factory=list)
    #: A run that finished by leaving its loop early: ``{"loop": "steps" | "epochs", "bound":
    #: N}``, the loop and its total (or count) at that end; ``None`` otherwise.
    ended_early: dict[str, Any] | None = None
    #: Gradients pending between two optimizer steps: ``{optimizer: {"<g>.<i>": tensor}}``.
    gradients: dict[str, Any] = field(default_factory=dict)
    #: Parameter groups optimizers gained during training (checkpoint/state/optimizer_extras.py).
    added_groups: dict[str, Any] = field(default_factory=dict)


def is_state_document(document: Any) -> bool:
    """Whether a ``state.json`` document is a Checkpointer's (and not a store user's own)."""
    return isinstance(document, dict) and bool({"version", "objects"} & document.keys())


def decode_state(
    document: Any, tensors: Mapping[str, Mapping[str, Any]], *, where: str
) -> SavedState:
    """Check a Checkpointer's ``state.json`` and rebuild every tree in it.

    ``tensors`` maps a file stem (``model``, ``rng``, ...) to that file's tensors by name; only
    the keys count when the caller only checks (``verify`` passes the header's specs). Raises
    :class:`CorruptCheckpointError` naming ``where`` and the key for anything wrong.
    """

    def bad(reason: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"invalid saved state: {reason}", where=where)

    if not isinstance(document, dict):
        raise bad("not a JSON object")
    version = document.get("version")
    if version != STATE_VERSION or isinstance(version, bool):
        raise bad(
            f"'version' is {version!r}; this nbresume reads version {STATE_VERSION} "
            "(a newer nbresume may have written it: pip install -U nbresume)"
        )

    def count(key: str, default: Any = None, *, optional: bool = False) -> Any:
        value = document.get(key, default)
        if optional and value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise bad(f"{key!r} is {value!r}, not a non-negative integer")
        return value

    step, epoch = count("step"), count("epoch")
    total = count("total", optional=True)
    done = document.get("done", False)
    if not isinstance(done, bool):
        raise bad(f"'done' is {done!r}, not true or false")
    world_size = count("world_size", 1)
    if world_size < 1:
        raise bad("'world_size' is 0")
    sharded = document.get("sharded", [])
    if not isinstance(sharded, list) or not all(isinstance(n, str) for n in sharded):
        raise bad("'sharded' is not a list of names")
    ended_early = document.get("ended_early")
    if ended_early is not None and not (
        isinstance(ended_early, dict)
        and ended_early.get("loop") in ("steps", "epochs")
        and isinstance(ended_early.get("bound"), int)
        and not isinstance(ended_early.get("bound"), bool)
        and ended_early["bound"] >= 0
    ):
        raise bad('\'ended_early\' is not {"loop": "steps" or "epochs", "bound": N}')
    objects_doc = document.get("objects")
    if not isinstance(objects_doc, dict):
        raise bad("'objects' is not an object")
    folder = where.rsplit("/", 1)[0]

    def rebuild(tree: Any, stem: str, path: str) -> Any:
        return unflatten(
            tree,
            tensors.get(stem, {}),
            where=where,
            path=path,
            tensors_where=f"{folder}/{stem}.safetensors",
        )

    objects = {name: rebuild(tree, name, f"objects/{name}") for name, tree in objects_doc.items()}
    values = rebuild(document.get("values", {}), "values", "values")
    if not isinstance(values, dict) or not all(isinstance(k, str) for k in values):
        raise bad("'values' is not an object")
    if "rng" not in document:
        raise bad("'rng' is missing")
    rng = rebuild(document["rng"], "rng", "rng")
    others = document.get("rank_rng", [])
    if not isinstance(others, list) or (world_size > 1 and len(others) != world_size - 1):
        raise bad("'rank_rng' does not hold the RNG states of every rank")
    rank_rng = [rebuild(tree, "rng", f"rank_rng/{i}") for i, tree in enumerate(others)]
    gradients = rebuild(document.get("gradients", {}), "gradients", "gradients")
    if not isinstance(gradients, dict) or not all(isinstance(v, dict) for v in gradients.values()):
        raise bad("'gradients' is not an object of optimizers' gradients")
    added_groups = document.get("added_groups", {})
    if not check_added_groups(added_groups):
        raise bad('\'added_groups\' is not {optimizer: {"from": N, "names": [[...]]}}')
    for index, tree in enumerate([rng, *rank_rng]):
        if not isinstance(tree, dict):
            raise bad(f"the RNG state of rank {index} is not an object")
        check_rng(tree, where=where)
    return SavedState(
        step=step,
        epoch=epoch,
        total=total,
        done=done,
        objects=objects,
        values=values,
        rng=rng,
        world_size=world_size,
        rank_rng=rank_rng,
        sharded=sharded,
        ended_early=ended_early,
        gradients=gradients,
        added_groups=added_groups,
    )


def check_added_groups(document: Any) -> bool:
    """Whether ``document`` is a valid ``added_groups`` member (the parameter groups optimizers
    gained during training: :mod:`~nbresume.checkpoint.state.optimizer_extras`)."""
    return isinstance(document, dict) and all(
        isinstance(entry, dict)
        and isinstance(entry.get("from"), int)
        and not isinstance(entry.get("from"), bool)
        and entry["from"] >= 1
        and isinstance(entry.get("names"), list)
        and all(
            isinstance(group, list) and all(isinstance(n, str) for n in group)
            for group in entry["names"]
        )
        and isinstance(entry.get("requires_grad"), list)
        and [len(g) if isinstance(g, list) else -1 for g in entry["requires_grad"]]
        == [len(g) for g in entry["names"]]
        and all(isinstance(f, bool) for g in entry["requires_grad"] for f in g)
        for entry in document.values()
    )


def check_rng(state: Mapping[str, Any], *, where: str) -> None:
    """Refuse RNG states that :func:`restore_rng` could not put back, without touching the
    process's generators (each state is tried on a generator of its own, and the bytes of the
    torch CPU and CUDA states are checked as torch checks them: a CUDA state is applied only
    on a GPU, after the others). Tensors may be NumPy arrays (``verify`` reads them without
    torch) or :class:`~nbresume.checkpoint.format.TensorSpec` headers: then only their
    dtype and rank are checked."""

    try:
        if "python" in state:
            version, internal, gauss = state["python"]
            random.Random().setstate((version, tuple(internal), gauss))  # noqa: S311
        if "numpy" in state:
            import numpy as np

            numpy_state = tuple(_numpy_stand_in(v) for v in state["numpy"])
            if len(numpy_state) > 2:
                check_mt19937_position(numpy_state[2])  # NumPy itself does not check it
            np.random.RandomState().set_state(numpy_state)
        if "torch" in state:
            torch_state = state["torch"]
            if not _is_byte_tensor(torch_state):
                raise TypeError("the torch RNG state is not a byte tensor")
            if not isinstance(torch_state, TensorSpec):
                check_torch_cpu_state(_bytes_of(torch_state))
            if type(torch_state).__module__.startswith("torch"):
                import torch

                torch.Generator().set_state(torch_state)
        cuda = state.get("cuda")
        if cuda is not None and (
            not isinstance(cuda, list) or not all(_is_byte_tensor(t) for t in cuda)
        ):
            raise TypeError("the CUDA RNG states are not byte tensors")
        for value in cuda or []:
            if not isinstance(value, TensorSpec):
                check_cuda_state(_bytes_of(value))
    except Exception as exc:
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise CorruptCheckpointError(
            f"invalid saved state: an RNG state cannot be restored ({reason})", where=where
        ) from None


def check_mt19937_position(position: Any) -> None:
    """Refuse a Mersenne Twister position outside 0..624. NumPy reads it without checking:
    out of range, the next draw reads outside its state (a crash at every restart, not an
    error)."""
    if not isinstance(position, int) or isinstance(position, bool) or not 0 <= position <= 624:
        raise ValueError(f"the Mersenne Twister position {position!r} is not in 0..624")


#: The size of torch's CPU generator state (``CPUGeneratorImplState``), and the Mersenne
#: Twister's state length.
TORCH_CPU_STATE_BYTES = 5056
_MT_N = 624


def check_torch_cpu_state(data: bytes) -> None:
    """Refuse a torch CPU generator state that ``torch.Generator.set_state`` refuses: not
    its size, not seeded, or a position (``left``, ``next``) outside the Mersenne Twister."""
    if len(data) != TORCH_CPU_STATE_BYTES:
        raise ValueError(f"the torch CPU state is {len(data)} bytes, not {TORCH_CPU_STATE_BYTES}")
    left, seeded, following = struct.unpack_from("<iIQ", data, 8)
    if not seeded or not 1 <= left <= _MT_N or following & 0xFFFFFFFF > _MT_N:
        raise ValueError("the torch CPU state is not a valid Mersenne Twister state")


def check_cuda_state(data: bytes) -> None:
    """Refuse a CUDA generator state that ``torch.cuda.set_rng_state`` refuses: a seed (8
    bytes) and a Philox offset (8 more) that must be a multiple of 4."""
    if len(data) not in (8, 16):
        raise ValueError(f"a CUDA RNG state is {len(data)} bytes, not 16")
    if len(data) == 16 and struct.unpack_from("<Q", data, 8)[0] % 4:
        raise ValueError("the offset of a CUDA RNG state is not a multiple of 4")


def _bytes_of(value: Any) -> bytes:
    """The bytes of a 1-D byte tensor (torch or NumPy)."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return bytes(value.tobytes())


def _numpy_stand_in(value: Any) -> Any:
    """A zero array in place of a small tensor header, so NumPy can check the rest."""

    if not isinstance(value, TensorSpec):
        return value
    import numpy as np

    np_dtype = _DTYPES[value.dtype][2]
    if np_dtype is None or value.end - value.start > 1 << 20:
        raise TypeError(f"a {value.dtype} tensor of shape {list(value.shape)}")
    return np.zeros(value.shape, dtype=np_dtype)


def _is_byte_tensor(value: Any) -> bool:

    if isinstance(value, TensorSpec):
        return value.dtype == "U8" and len(value.shape) == 1
    module = type(value).__module__
    if module.startswith("numpy"):
        return bool(value.dtype.kind == "u" and value.dtype.itemsize == 1 and value.ndim == 1)
    if not module.startswith("torch"):
        return False
    import torch

    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1


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
