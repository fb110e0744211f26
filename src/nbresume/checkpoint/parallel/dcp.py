"""torch.distributed.checkpoint (DCP) plumbing for sharded checkpoints, without pickle.

Protocol: DCP plans which rank writes and reads which shard; the storage writer here puts a
rank's shards into the pending checkpoint as one safetensors file and one JSON file (each
durable and hashed by :class:`~nbresume.checkpoint.store.PendingCheckpoint`), and the
metadata, DCP's own pickled object, as strict JSON. The storage reader reads each file it
needs once, checks it against the manifest before it parses a byte of it, and hands DCP only
those verified bytes. The ranks exchange bytes in tensor collectives, never pickled.
:mod:`nbresume.checkpoint.parallel.sharded` runs the save and the load on top of this.
"""

from __future__ import annotations

import contextlib
import io
import json
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nbresume.checkpoint.format import (
    FileEntry,
    Manifest,
    check_version,
    flatten,
    tensorfile,
    unflatten,
)
from nbresume.checkpoint.parallel import distributed
from nbresume.checkpoint.store import CheckpointStore, PendingCheckpoint, parse_json
from nbresume.errors import CheckpointError, CorruptCheckpointError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

#: The stem of the sharded files when none is given.
DEFAULT_STEM = "sharded"
METADATA_FORMAT = "nbresume-sharded"
METADATA_VERSION = 1
_MAX_METADATA_BYTES = 256 << 20
# torch dtype names a shard may have: exactly the dtypes a safetensors file of format 1 holds.
_DTYPES = frozenset(torch_name for _, torch_name, _ in tensorfile._DTYPES.values())


def metadata_name(stem: str = DEFAULT_STEM) -> str:
    """The file that makes a checkpoint sharded: ``sharded.metadata.json``."""
    return f"{stem}.metadata.json"


def shard_names(rank: int, stem: str = DEFAULT_STEM) -> tuple[str, str]:
    """The tensor file and the JSON file that ``rank`` writes."""
    return f"{stem}.rank{rank:05d}.safetensors", f"{stem}.rank{rank:05d}.json"


def is_sharded_file(name: str, stem: str = DEFAULT_STEM) -> bool:
    """Whether ``name`` is one of the sharded files (loaded by :func:`load_sharded` alone)."""
    return name == metadata_name(stem) or (
        name.startswith(f"{stem}.rank") and name.endswith((".safetensors", ".json"))
    )


# -- the ranks -----------------------------------------------------------------------------


def ranks() -> distributed.Group:
    """The job's ranks; bytes travel between them in tensor collectives, never pickled."""
    return distributed.current() or distributed.Solo()


def dcp_without_group() -> bool:
    """Whether DCP must run in this process alone (torch.distributed is not initialized)."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


def problems_of(ranks: distributed.Group, problem: str) -> list[str]:
    """Every rank's problem (``""``: none), so that all ranks take the same branch."""
    return [p.decode() for p in ranks.all_gather_bytes(problem.encode()) if p]


# -- DCP storage writer and reader --------------------------------------------------------


@dataclass(frozen=True)
class _Location:
    """Where one item lives: a file of the checkpoint and its key in that file."""

    file: str
    key: str


def _tensor_key(fqn: str, offsets: Any) -> str:
    return f"{fqn}@{','.join(str(int(o)) for o in offsets)}"


def make_writer(pending: PendingCheckpoint, stem: str) -> Any:
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
    from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
    from torch.futures import Future

    class Writer(StorageWriter):
        """Writes a rank's shards into the pending checkpoint: one safetensors file plus one
        JSON file, each durable and hashed."""

        def __init__(self) -> None:
            super().__init__()
            self.rank = 0

        def reset(self, checkpoint_id: Any = None) -> None:
            pass

        def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            self.rank = int(kwargs.get("rank") or 0)

        def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
            return plan

        def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
            return plans

        def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
            tensor_file, json_file = shard_names(self.rank, stem)
            tensors: dict[str, Any] = {}
            values: dict[str, Any] = {}
            results = []
            for item in plan.items:
                data: Any = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    raw = data.getvalue()
                    values[item.index.fqn] = json.loads(raw)
                    location = _Location(json_file, item.index.fqn)
                    size = len(raw)
                else:
                    assert item.tensor_data is not None
                    key = _tensor_key(item.index.fqn, item.tensor_data.chunk.offsets)
                    tensors[key] = data.detach()
                    location = _Location(tensor_file, key)
                    size = data.numel() * data.element_size()
                results.append(
                    WriteResult(index=item.index, size_in_bytes=size, storage_data=location)
                )
            if tensors:
                encoded = list(tensorfile.encode(tensors).chunks())
                pending.write_files([(tensor_file, encoded)], keep=False)
            if values:
                text = json.dumps(values, indent=1).encode()
                pending.write_files([(json_file, [text])], keep=False)
            future: Future[list[WriteResult]] = Future()
            future.set_result(results)
            return future

        def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
            text = encode_metadata(metadata, results)
            pending.write_files([(metadata_name(stem), [text])], keep=False)

        def storage_meta(self) -> Any:
            return None

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return False

    return Writer()


def make_save_planner() -> Any:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    class SavePlanner(DefaultSavePlanner):
        """DCP's planner, but the non-tensor leaves become JSON instead of torch.save pickles."""

        def transform_object(self, write_item: WriteItem, object: Any) -> Any:
            if write_item.type != WriteItemType.BYTE_IO:
                return object
            fqn = write_item.index.fqn
            try:
                document, tensors = flatten(object, name=fqn)
            except (TypeError, ValueError, CheckpointError) as exc:
                raise CheckpointError(
                    f"the value at {fqn!r} of the sharded state cannot be saved: {exc}",
                    fix="keep non-tensor values to numbers, strings, lists, tuples and dicts",
                ) from None
            if tensors:
                raise CheckpointError(
                    f"the value at {fqn!r} of the sharded state holds tensors inside a "
                    "container DCP does not traverse",
                    fix="put those tensors in a dict or a list of the state_dict",
                )
            return io.BytesIO(json.dumps(document).encode())

    return SavePlanner(dedup_save_to_lowest_rank=True)


def make_load_planner() -> Any:
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import ReadItem

    class LoadPlanner(DefaultLoadPlanner):
        """DCP's planner, reading the non-tensor leaves from JSON (never torch.load)."""

        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            obj = unflatten(json.loads(value.getvalue()), {}, where=fqn)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return LoadPlanner()


def make_reader(
    store: CheckpointStore | None,
    *,
    name: str,
    manifest: Manifest,
    metadata: Metadata,
    stem: str,
    group: distributed.Group,
    preloaded: Mapping[str, dict[str, Any]] | None = None,
) -> Any:
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
    from torch.distributed.checkpoint.storage import StorageReader
    from torch.futures import Future

    def where_of(file_name: str) -> str:
        """The file's place, for messages (``name`` is the folder itself without a store)."""
        return f"{name}/{file_name}" if store is None else store.backend.child(name, file_name)

    class Reader(StorageReader):
        """Reads each shard file once, checks it against the manifest, then parses those bytes.

        Every file the local plan needs is read and checked in ``prepare_local_plan``: DCP
        runs that on every rank before any rank copies a tensor, so a bad file stops the load
        everywhere before anything was loaded. With ``preloaded`` (file name -> its tensors or
        values, read and checked already: a checkpoint read whole in one process) nothing
        is read.
        """

        def __init__(self) -> None:
            super().__init__()
            self.storage_data: dict[Any, _Location] = metadata.storage_data
            self.files: dict[str, dict[str, Any]] = dict(preloaded or {})
            self.problem = ""

        def reset(self, checkpoint_id: Any = None) -> None:
            pass

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            return metadata

        def set_up_storage_reader(
            self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
        ) -> None:
            pass

        def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
            if preloaded is not None:
                return plan
            needed = sorted({self.storage_data[item.storage_index].file for item in plan.items})
            # The shard files no plan reads are still checked, each by one rank in turn.
            shards = sorted(
                n for n in manifest.files if is_sharded_file(n, stem) and n != metadata_name(stem)
            )
            try:
                for file_name in needed:
                    self.files[file_name] = self._parse(file_name, self._read(file_name))
                for file_name in shards[group.rank :: group.world_size]:
                    if file_name not in self.files:
                        self._read(file_name)
            except CorruptCheckpointError as exc:
                self.problem = str(exc)
                raise
            return plan

        def _read(self, file_name: str) -> memoryview:
            entry = manifest.files.get(file_name)
            where = where_of(file_name)
            if entry is None:
                raise CorruptCheckpointError(
                    "the sharded metadata names a file the manifest does not list", where=where
                )
            assert store is not None, "a preloaded reader reads nothing"
            return read_verified(store, name, file_name, entry)

        def _parse(self, file_name: str, buffer: memoryview) -> dict[str, Any]:
            where = where_of(file_name)
            if file_name.endswith(".safetensors"):
                return tensorfile.decode(buffer, where=where, framework="torch")
            values = parse_json(buffer, where=where)
            if not isinstance(values, dict):
                raise CorruptCheckpointError("not a JSON object", where=where)
            return values

        def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
            return plans

        def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
            try:
                self._read_items(plan, planner)
            except CorruptCheckpointError as exc:
                self.problem = str(exc)  # damage, passed over as such: not a misfit
                raise
            future: Future[None] = Future()
            future.set_result(None)
            return future

        def _read_items(self, plan: LoadPlan, planner: LoadPlanner) -> None:
            for item in plan.items:
                location = self.storage_data[item.storage_index]
                where = where_of(location.file)
                if location.file not in self.files:  # a plan changed after its local step
                    self.files[location.file] = self._parse(
                        location.file, self._read(location.file)
                    )
                content = self.files[location.file]
                if location.key not in content:
                    raise CorruptCheckpointError(f"{location.key!r} is missing", where=where)
                if item.type == LoadItemType.BYTE_IO:
                    text = json.dumps(content[location.key]).encode()
                    planner.load_bytes(item, io.BytesIO(text))
                    continue
                stored = content[location.key]
                piece = stored
                for dim, (offset, length) in enumerate(
                    zip(item.storage_offsets, item.lengths, strict=True)
                ):
                    if piece.size(dim) < offset + length:
                        raise CorruptCheckpointError(
                            f"{location.key!r} is smaller than the metadata says", where=where
                        )
                    piece = piece.narrow(dim, offset, length)
                target = planner.resolve_tensor(item).detach()
                if target.size() != piece.size() or target.dtype != piece.dtype:
                    raise CorruptCheckpointError(
                        f"{location.key!r} is {piece.dtype}{list(piece.size())}, the "
                        f"metadata says {target.dtype}{list(target.size())}",
                        where=where,
                    )
                target.copy_(piece)
                planner.commit_tensor(item, target)

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return False

    return Reader()


# -- the metadata file -------------------------------------------------------------------


def encode_metadata(metadata: Metadata, results: list[list[Any]]) -> bytes:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    locations: dict[Any, _Location] = {}
    for rank_results in results:
        for result in rank_results:
            locations[result.index] = result.storage_data
    items: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            where = locations[MetadataIndex(fqn)]
            items[fqn] = {"kind": "value", "file": where.file, "key": where.key}
            continue
        chunks = []
        for chunk in md.chunks:
            where = locations[MetadataIndex(fqn, chunk.offsets)]
            chunks.append(
                {
                    "offsets": [int(o) for o in chunk.offsets],
                    "sizes": [int(s) for s in chunk.sizes],
                    "file": where.file,
                    "key": where.key,
                }
            )
        items[fqn] = {
            "kind": "tensor",
            "dtype": str(md.properties.dtype).removeprefix("torch."),
            "size": [int(s) for s in md.size],
            "requires_grad": bool(md.properties.requires_grad),
            "chunks": chunks,
        }
    document = {
        "format": METADATA_FORMAT,
        "format_version": METADATA_VERSION,
        "items": items,
    }
    return json.dumps(document, indent=1).encode()


def decode_metadata(data: bytes, *, where: str, manifest: Manifest) -> Metadata:
    """Parse the metadata file strictly: anything unexpected is a corrupt checkpoint."""
    try:
        document = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise CorruptCheckpointError(
            "invalid sharded metadata: not valid UTF-8 JSON", where=where
        ) from None
    return metadata_of(document, where=where, manifest=manifest)


def metadata_of(document: Any, *, where: str, manifest: Manifest) -> Metadata:
    """DCP's metadata from the parsed metadata document, checked strictly: anything
    unexpected is a corrupt checkpoint."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    def bad(reason: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"invalid sharded metadata: {reason}", where=where)

    def counts(value: Any, what: str) -> list[int]:
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
        ):
            raise bad(f"{what} is not a list of non-negative integers")
        return value

    def location(entry: dict[str, Any], fqn: str) -> _Location:
        file, key = entry.get("file"), entry.get("key")
        if not isinstance(file, str) or file not in manifest.files or not isinstance(key, str):
            raise bad(f"the file of {fqn!r} is not one the manifest lists")
        return _Location(file, key)

    if not isinstance(document, dict) or document.get("format") != METADATA_FORMAT:
        raise bad(f"'format' is not {METADATA_FORMAT!r}")
    version = document.get("format_version")
    check_version(version, {METADATA_VERSION}, what="sharded metadata version", where=where)
    items = document.get("items")
    if not isinstance(items, dict):
        raise bad("'items' is not an object")
    state: dict[str, Any] = {}
    storage: dict[Any, _Location] = {}
    for fqn, entry in items.items():
        if not isinstance(entry, dict):
            raise bad(f"the entry of {fqn!r} is not an object")
        if entry.get("kind") == "value":
            state[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn)] = location(entry, fqn)
            continue
        if entry.get("kind") != "tensor":
            raise bad(f"the entry of {fqn!r} has an unknown kind")
        dtype = entry.get("dtype")
        if dtype not in _DTYPES:
            raise bad(f"{fqn!r} has dtype {dtype!r}, which format 1 does not hold")
        size = counts(entry.get("size"), f"the size of {fqn!r}")
        chunks = entry.get("chunks")
        if not isinstance(chunks, list) or not all(isinstance(c, dict) for c in chunks):
            raise bad(f"the chunks of {fqn!r} are not a list of objects")
        parsed = []
        for chunk in chunks:
            offsets = counts(chunk.get("offsets"), f"a chunk offset of {fqn!r}")
            sizes = counts(chunk.get("sizes"), f"a chunk size of {fqn!r}")
            if (
                len(offsets) != len(size)
                or len(sizes) != len(size)
                or any(o + s > d for o, s, d in zip(offsets, sizes, size, strict=True))
            ):
                raise bad(f"a chunk of {fqn!r} lies outside the tensor")
            parsed.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            storage[MetadataIndex(fqn, offsets)] = location(chunk, fqn)
        properties = TensorProperties(
            dtype=getattr(torch, dtype), requires_grad=entry.get("requires_grad") is True
        )
        state[fqn] = TensorStorageMetadata(properties, torch.Size(size), parsed)
    return Metadata(
        state_dict_metadata=state,
        storage_data=storage,
        storage_meta=StorageMeta(),
    )


def read_verified(
    store: CheckpointStore, name: str, file_name: str, entry: FileEntry
) -> memoryview:
    """A file's bytes, read once, after its size and hashes matched the manifest."""
    return store.read_files(name, {file_name: entry})[file_name]


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is intended."""
    with warnings.catch_warnings():
        if dcp_without_group():
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def problem_text(exc: BaseException | None) -> str:
    if exc is None:
        return ""
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0] if len(text) > 2000 else text
