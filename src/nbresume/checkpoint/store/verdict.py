"""The verdict on a checkpoint: complete and consistent, or damaged, from what it records.

Every reader of the package (``verify``, a restore of every strategy, ``pull``, the framework
readers, the store's choice of the newest checkpoint) runs :func:`check_checkpoint` on what it
has read of a checkpoint (the manifest, the JSON documents, the tensor files' headers) before
a byte of its state is applied, so that what one reader passes the others load, and what one
refuses the others pass over. A refusal is a :class:`CorruptCheckpointError` naming the file,
what is wrong and the fix: every reader treats it as damage.

What it checks, beyond each file's hash (checked as the file is read):

- **Sharded state** (``<stem>.metadata.json``, written by a sharded save): every tensor of
  every item is covered exactly once by its chunks (no gap, no overlap; offsets and sizes
  within the tensor's recorded size); each chunk lies in a shard file of the manifest under
  the key its offsets give, with the dtype and shape the metadata records (where the file's
  header was read), and the bytes the chunks of a file take fit in the file's recorded size;
  every shard file and every tensor in one is some chunk's; every value lies in a shard file
  of the manifest.
- **A Checkpointer's** ``state.json``: its step is the checkpoint's own; the objects it says
  are sharded are in the sharded metadata; each data loader's position is in range (a batch
  size and a number of processes of at least 1, counters that are not negative).

Only metadata already read is looked at: nothing here reads a file or touches a tensor's bytes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nbresume.checkpoint.format import Manifest, SavedState, from_torch_name, signature
from nbresume.checkpoint.store.info import LoadedCheckpoint
from nbresume.errors import CorruptCheckpointError

#: The ``format`` of a sharded checkpoint's metadata document.
SHARDED_FORMAT = "nbresume-sharded"
#: The stem of the sharded files a Checkpointer writes (``sharded.metadata.json``, ...).
SHARDED_STEM = "sharded"
_METADATA_SUFFIX = ".metadata.json"

FIX = (
    "this checkpoint was damaged or edited after it was saved, and no reader loads it: a "
    "restore passes it over for the one before. Delete its folder, or put back an intact copy"
)


def check_loaded(loaded: LoadedCheckpoint) -> None:
    """:func:`check_checkpoint` on what a reader has read of ``loaded``."""
    check_checkpoint(
        loaded.manifest,
        location=loaded.location,
        documents=loaded.data,
        tensors=loaded.tensors,
        state=loaded.state,
    )


def check_checkpoint(
    manifest: Manifest,
    *,
    location: str,
    documents: Mapping[str, Any],
    tensors: Mapping[str, Mapping[str, Any]],
    state: SavedState | None,
) -> None:
    """Raise :class:`CorruptCheckpointError` unless the checkpoint at ``location`` is complete
    and consistent (see the module's docstring).

    ``documents`` maps a JSON file's stem to its parsed document, ``tensors`` a tensor file's
    stem to its tensors or their header's specs (what the caller read: a file it did not read
    is checked against the manifest alone); ``state`` is the decoded ``state.json``, if any.
    """
    folder = location.rstrip("/")
    for file_name in manifest.files:
        if file_name.endswith(_METADATA_SUFFIX):
            stem = file_name[: -len(_METADATA_SUFFIX)]
            document = documents.get(f"{stem}.metadata")
            if isinstance(document, dict) and document.get("format") == SHARDED_FORMAT:
                _Sharded(manifest, folder, stem, documents, tensors).check(document)
    if state is not None:
        _check_state(manifest, folder, documents, state)


# -- a Checkpointer's state.json -------------------------------------------------------------


def _check_state(
    manifest: Manifest, folder: str, documents: Mapping[str, Any], state: SavedState
) -> None:
    where = f"{folder}/state.json"

    def bad(reason: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"invalid saved state: {reason}", where=where, fix=FIX)

    if state.step != manifest.step:
        raise bad(f"'step' is {state.step}, but this is the checkpoint of step {manifest.step}")
    if state.sharded:
        meta = f"{SHARDED_STEM}{_METADATA_SUFFIX}"
        if meta not in manifest.files:
            raise bad(
                f"it says {', '.join(map(repr, state.sharded))} are sharded, and the checkpoint "
                f"holds no {meta}"
            )
        document = documents.get(f"{SHARDED_STEM}.metadata")
        items = document.get("items") if isinstance(document, dict) else None
        if isinstance(items, dict):
            for name in state.sharded:
                if not any(fqn == name or fqn.startswith(f"{name}.") for fqn in items):
                    raise bad(f"it says {name!r} is sharded, and {meta} holds nothing of it")
    for name, tree in state.objects.items():
        if _is_loader_position(tree):
            problem = _loader_problem(tree)
            if problem:
                raise bad(f"the data position of {name!r}: {problem}")


def _is_loader_position(tree: Any) -> bool:
    """Whether a saved object's tree is a resumable loader's position (its keys say so)."""
    return isinstance(tree, dict) and {"seed", "epoch", "position", "batch_size"} <= tree.keys()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _loader_problem(tree: dict[str, Any]) -> str:
    """What is out of range in a loader's saved position (``""``: nothing)."""
    for key, low, optional in (
        ("batch_size", 1, True),
        ("replicas", 1, True),
        ("world_size", 1, False),
        ("batches", 0, True),
        ("position", 0, False),
        ("epoch", 0, False),
        ("finished_in", -1, False),
    ):
        if key not in tree or (optional and tree[key] is None):
            continue
        value = tree[key]
        if not _is_int(value) or value < low:
            return f"{key!r} is {value!r}, not an integer of at least {low}"
    if not _is_int(tree["seed"]):
        return f"'seed' is {tree['seed']!r}, not an integer"
    # A position at or past the epoch's recorded batches is an epoch that ended (a sampler
    # may yield more batches than its length says): the loader takes it as such.
    return ""


# -- sharded state -----------------------------------------------------------------------------


@dataclass
class _Sharded:
    """The cross-checks of one sharded metadata document against the checkpoint's files."""

    manifest: Manifest
    folder: str
    stem: str
    documents: Mapping[str, Any]
    tensors: Mapping[str, Mapping[str, Any]]
    #: (file, key) of every chunk and value, and the bytes of each tensor file's chunks.
    referenced: dict[str, set[str]] = field(default_factory=dict, init=False)
    bytes: dict[str, int] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.where = f"{self.folder}/{self.stem}{_METADATA_SUFFIX}"
        self.shard_file = re.compile(re.escape(self.stem) + r"\.rank\d{5}\.(safetensors|json)")

    def bad(self, reason: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"the sharded metadata does not match the checkpoint: {reason}",
            where=self.where,
            fix=FIX,
        )

    def check(self, document: dict[str, Any]) -> None:
        items = document.get("items")
        if not isinstance(items, dict):
            raise self.bad("'items' is not an object")
        for fqn, item in items.items():
            if not isinstance(item, dict):
                raise self.bad(f"the entry of {fqn!r} is not an object")
            if item.get("kind") == "value":
                self.place(fqn, item, "json")
            elif item.get("kind") == "tensor":
                self.check_tensor(fqn, item)
            else:
                raise self.bad(f"the entry of {fqn!r} has an unknown kind")
        self.check_files()

    def place(self, fqn: str, entry: dict[str, Any], kind: str) -> tuple[str, str]:
        """The (file, key) of a chunk or value: a shard file of the manifest, a key of its own."""
        file, key = entry.get("file"), entry.get("key")
        if not isinstance(file, str) or not isinstance(key, str):
            raise self.bad(f"{fqn!r} names no file and key")
        if file not in self.manifest.files:
            raise self.bad(f"{fqn!r} lies in {file!r}, which the checkpoint does not hold")
        match = self.shard_file.fullmatch(file)
        if match is None or match.group(1) != kind:
            raise self.bad(f"{fqn!r} lies in {file!r}, which is not a {kind} shard file")
        keys = self.referenced.setdefault(file, set())
        if key in keys:
            raise self.bad(f"two entries lie under {key!r} of {file!r}")
        keys.add(key)
        if kind == "json":
            values = self.documents.get(file.rsplit(".", 1)[0])
            if isinstance(values, dict) and key not in values:
                raise self.bad(f"{file} holds no {key!r}, where the value {fqn!r} lies")
        return file, key

    def check_tensor(self, fqn: str, item: dict[str, Any]) -> None:
        dtype = item.get("dtype")
        known = from_torch_name(dtype) if isinstance(dtype, str) else None
        if known is None:
            raise self.bad(f"{fqn!r} has dtype {dtype!r}, which a checkpoint does not hold")
        st_dtype, itemsize = known
        size = _counts(item.get("size"))
        if size is None:
            raise self.bad(f"the size of {fqn!r} is not a list of non-negative integers")
        chunks = item.get("chunks")
        if not isinstance(chunks, list):
            raise self.bad(f"the chunks of {fqn!r} are not a list")
        boxes: list[tuple[list[int], list[int]]] = []
        covered = 0
        for chunk in chunks:
            if not isinstance(chunk, dict):
                raise self.bad(f"a chunk of {fqn!r} is not an object")
            offsets, sizes = _counts(chunk.get("offsets")), _counts(chunk.get("sizes"))
            if offsets is None or sizes is None:
                raise self.bad(f"a chunk of {fqn!r} has offsets or sizes that are not counts")
            if len(offsets) != len(size) or len(sizes) != len(size):
                raise self.bad(
                    f"a chunk of {fqn!r} has {len(offsets)} offsets and {len(sizes)} sizes, "
                    f"the tensor {len(size)} dimensions"
                )
            if any(o + s > d for o, s, d in zip(offsets, sizes, size, strict=True)):
                raise self.bad(
                    f"the chunk of {fqn!r} at {offsets} of size {sizes} lies outside its "
                    f"size {size}"
                )
            file, key = self.place(fqn, chunk, "safetensors")
            if key != f"{fqn}@{','.join(str(o) for o in offsets)}":
                raise self.bad(f"the chunk of {fqn!r} at {offsets} lies under {key!r}")
            volume = math.prod(sizes)
            self.bytes[file] = self.bytes.get(file, 0) + volume * itemsize
            stored = self.tensors.get(file.rsplit(".", 1)[0])
            if stored is not None:
                if key not in stored:
                    raise self.bad(f"{file} holds no {key!r}, the chunk of {fqn!r} at {offsets}")
                found = signature(stored[key])
                if found != (st_dtype, tuple(sizes)):
                    what = "another dtype" if found is None else f"{found[0]} {list(found[1])}"
                    raise self.bad(
                        f"{key!r} in {file} is {what}, the metadata says {st_dtype} {sizes}"
                    )
            if volume:
                covered += volume
                boxes.append((offsets, sizes))
        whole = math.prod(size)
        overlap = _overlap(boxes)
        if overlap is not None:
            (a, sa), (b, sb) = overlap
            raise self.bad(
                f"two chunks of {fqn!r} overlap (at {a} of size {sa} and at {b} of size {sb})"
            )
        if covered != whole:
            raise self.bad(
                f"the chunks of {fqn!r} cover {covered} of its {whole} elements (size {size}): "
                "part of the tensor is in no shard"
            )

    def check_files(self) -> None:
        """Every shard file is some entry's; each tensor file holds its chunks' bytes and no
        tensor that no chunk names."""
        for file_name, entry in self.manifest.files.items():
            if self.shard_file.fullmatch(file_name) is None:
                continue
            keys = self.referenced.get(file_name)
            if not keys:
                raise self.bad(f"{file_name} is in the checkpoint, and no entry lies in it")
            if not file_name.endswith(".safetensors"):
                continue
            # 8 bytes of header length and at least a 2-byte header come before the data.
            if self.bytes.get(file_name, 0) + 10 > entry.size:
                raise self.bad(
                    f"the chunks in {file_name} take {self.bytes.get(file_name, 0)} bytes, more "
                    f"than "
                    f"its {entry.size} bytes hold"
                )
            stored = self.tensors.get(file_name.rsplit(".", 1)[0])
            if stored is not None:
                unnamed = sorted(set(stored) - keys)
                if unnamed:
                    raise self.bad(f"{file_name} holds {unnamed[0]!r}, which no chunk names")


def _counts(value: Any) -> list[int] | None:
    if not isinstance(value, list) or not all(_is_int(v) and v >= 0 for v in value):
        return None
    return value


def _overlap(
    boxes: list[tuple[list[int], list[int]]],
) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]] | None:
    """Two of ``boxes`` (offsets, sizes; none empty) that share an element, or ``None``.

    A sweep along the dimension with the most distinct offsets: a box is compared only with
    the boxes it meets along that dimension (one, for the row blocks of FSDP)."""
    if len(boxes) < 2:
        return None
    dims = len(boxes[0][0])
    if dims == 0:
        return boxes[0], boxes[1]  # a scalar: any two chunks hold the same element
    axis = max(range(dims), key=lambda d: len({offsets[d] for offsets, _ in boxes}))
    active: list[tuple[list[int], list[int]]] = []
    for box in sorted(boxes, key=lambda b: b[0][axis]):
        start = box[0][axis]
        active = [a for a in active if a[0][axis] + a[1][axis] > start]
        for other in active:
            if all(
                o1 < o2 + s2 and o2 < o1 + s1
                for o1, s1, o2, s2 in zip(box[0], box[1], other[0], other[1], strict=True)
            ):
                return other, box
        active.append(box)
    return None


__all__ = ["FIX", "SHARDED_FORMAT", "SHARDED_STEM", "check_checkpoint", "check_loaded"]
