"""Sharded state (FSDP2, DTensor, ShardedTensor) in a checkpoint, through DCP.

When no rank can hold the whole model, every rank writes its own shards. The layout is a
variant of format v1 (docs/format.md, "Sharded checkpoints"); the checkpoint folder holds::

    000000001500/
        sharded.metadata.json             where every shard lives: DCP's metadata, as JSON
        sharded.rank00000.safetensors     the tensor shards rank 0 wrote
        sharded.rank00000.json            the non-tensor leaves rank 0 wrote, as JSON (if any)
        sharded.rank00001.safetensors
        state.json                        what rank 0 saves besides (``data=``, ``tensors=``)
        manifest.json                     written last: every file above, size and SHA-256

torch.distributed.checkpoint (DCP) plans which rank writes which shard and which rank reads
what; nbresume's own storage writer and reader put the bytes on disk, so nothing is pickled:
shards are safetensors files, the metadata and the non-tensor leaves are JSON.

The save protocol (every rank calls :func:`save_sharded`; rank 0 coordinates):

1. Rank 0 cleans up after a killed writer and creates the temporary folder
   (:meth:`Store.begin`); its name is broadcast to every rank.
2. DCP plans the save; every rank writes its files into the temporary folder, hashing each
   byte on its way to the file; rank 0 writes the metadata file once all ranks have written,
   then the files of ``data=`` and ``tensors=``.
3. Every rank's file names, sizes and hashes are gathered to rank 0 (as JSON bytes in tensor
   collectives: no pickle). A failure on any rank removes the temporary folder on rank 0 and
   raises on every rank.
4. Rank 0 writes ``manifest.json``, commits (rename into place), verifies the checkpoint as
   the store now has it and applies retention, exactly as :meth:`CheckpointStore.save` does,
   then tells every rank the outcome.

A kill at any moment before step 4's commit leaves only a hidden temporary folder, which no
reader takes and the next save removes.

Loading (every rank calls :func:`load_sharded`): rank 0 picks the newest checkpoint and
broadcasts its manifest's bytes; every rank reads each file it needs once, checks its size and
SHA-256 against the manifest, and parses only those verified bytes: the metadata, the files
outside the shards, and (in DCP's planning phase, before any tensor is copied) the shard files
its plan reads; the shard files no rank reads are hashed by a rank in turn. A file that fails
makes every rank pass over that checkpoint with a warning and try the next older one.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

from nbresume.checkpoint import distributed, tensorfile
from nbresume.checkpoint.format import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    FileEntry,
    Manifest,
    parse_manifest,
    step_dirname,
)
from nbresume.checkpoint.state import flatten, unflatten
from nbresume.checkpoint.store import (
    CheckpointInfo,
    CheckpointStore,
    LoadedCheckpoint,
    _check_file,
    _decode_state,
    _parse_json,
)
from nbresume.errors import (
    CheckpointError,
    CorruptCheckpointError,
    NoCheckpointError,
    UsageError,
)

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


def is_sharded(info: CheckpointInfo | Manifest, stem: str = DEFAULT_STEM) -> bool:
    """Whether a checkpoint holds sharded state (its manifest names the metadata file)."""
    manifest = info.manifest if isinstance(info, CheckpointInfo) else info
    return metadata_name(stem) in manifest.files


def is_sharded_file(name: str, stem: str = DEFAULT_STEM) -> bool:
    """Whether ``name`` is one of the sharded files (loaded by :func:`load_sharded` alone)."""
    return name == metadata_name(stem) or (
        name.startswith(f"{stem}.rank") and name.endswith((".safetensors", ".json"))
    )


def _sharded_types() -> tuple[type, ...]:
    """The sharded tensor classes the program has imported: none were imported, none exist
    (so that a program without them imports nothing here)."""
    found = []
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and hasattr(dtensor, "DTensor"):
        found.append(dtensor.DTensor)
    legacy = sys.modules.get("torch.distributed._shard.sharded_tensor.api")
    if legacy is not None and hasattr(legacy, "ShardedTensor"):
        found.append(legacy.ShardedTensor)
    return tuple(found)


def has_sharded_tensors(tree: Any) -> bool:
    """Whether a ``state_dict`` tree holds a DTensor or a ShardedTensor anywhere."""
    kinds = _sharded_types()
    return bool(kinds) and _holds(tree, kinds)


def _holds(tree: Any, kinds: tuple[type, ...]) -> bool:
    if isinstance(tree, Mapping):
        return any(_holds(v, kinds) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(_holds(v, kinds) for v in tree)
    return isinstance(tree, kinds)


# Stateful objects whose state is never sharded, and whose state_dict() need not be asked.
_NEVER_SHARDED = (
    "nbresume.",
    "torch.utils.data",
    "torchdata",
    "torch.optim.lr_scheduler",
    "torch.amp",
    "torch.cuda.amp",
)


def is_sharded_object(obj: Any) -> bool:
    """Whether a stateful object's state is sharded: a module or an optimizer over DTensor
    (or ShardedTensor) parameters, or anything whose ``state_dict()`` holds one. An optimizer
    counts before its first step too, when its state is still empty."""
    if not _sharded_types() or type(obj).__module__.startswith(_NEVER_SHARDED):
        return False
    import torch

    if isinstance(obj, torch.optim.Optimizer):
        return has_sharded_tensors([g.get("params", []) for g in obj.param_groups])
    if isinstance(obj, torch.nn.Module):
        return has_sharded_tensors(list(obj.parameters())) or has_sharded_tensors(
            list(obj.buffers())
        )
    return has_sharded_tensors(obj.state_dict())


def loadable_state(obj: Any) -> Any:
    """``obj.state_dict()``, ready to be loaded into in place. An optimizer that has not
    stepped yet has no state to receive the saved one: it is given zeroed state first (a step
    with zero gradients and a zero learning rate, as DCP's own ``get_state_dict`` does)."""
    import torch

    if isinstance(obj, torch.optim.Optimizer) and not obj.state:
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        _init_optim_state(obj)
    return obj.state_dict()


# -- the ranks -----------------------------------------------------------------------------


class _Solo:
    """This process alone (no process group, or a group of one): every collective is a no-op."""

    rank = 0
    world_size = 1

    def broadcast_bytes(self, data: bytes) -> bytes:
        return data

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        return [data]


_Ranks = Union["distributed.Group", _Solo]


def _ranks() -> _Ranks:
    """The job's ranks; bytes travel between them in tensor collectives, never pickled."""
    return distributed.current() or _Solo()


def _dcp_without_group() -> bool:
    """Whether DCP must run in this process alone (torch.distributed is not initialized)."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


def _problems(ranks: _Ranks, problem: str) -> list[str]:
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


def _make_writer(store: CheckpointStore, folder: str, stem: str) -> Any:
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
    from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
    from torch.futures import Future

    class Writer(StorageWriter):
        """Writes a rank's shards as one safetensors file plus one JSON file, hashing them."""

        def __init__(self) -> None:
            super().__init__()
            self.rank = 0
            self.entries: dict[str, FileEntry] = {}

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
                encoded = tensorfile.encode(tensors)
                self.entries[tensor_file] = store._write_file(folder, tensor_file, encoded.chunks())
            if values:
                text = json.dumps(values, indent=1).encode()
                self.entries[json_file] = store._write_file(folder, json_file, [text])
            future: Future[list[WriteResult]] = Future()
            future.set_result(results)
            return future

        def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
            text = _encode_metadata(metadata, results)
            name = metadata_name(stem)
            self.entries[name] = store._write_file(folder, name, [text])

        def storage_meta(self) -> Any:
            return None

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return False

    return Writer()


def _make_save_planner() -> Any:
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


def _make_load_planner() -> Any:
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


def _make_reader(
    store: CheckpointStore,
    *,
    name: str,
    manifest: Manifest,
    metadata: Metadata,
    stem: str,
    group: _Ranks,
) -> Any:
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
    from torch.distributed.checkpoint.storage import StorageReader
    from torch.futures import Future

    class Reader(StorageReader):
        """Reads each shard file once, checks it against the manifest, then parses those bytes.

        Every file the local plan needs is read and checked in ``prepare_local_plan``: DCP
        runs that on every rank before any rank copies a tensor, so a bad file stops the load
        everywhere before anything was loaded.
        """

        def __init__(self) -> None:
            super().__init__()
            self.storage_data: dict[Any, _Location] = metadata.storage_data
            self.files: dict[str, dict[str, Any]] = {}
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
            where = store.store.child(name, file_name)
            if entry is None:
                raise CorruptCheckpointError(
                    "the sharded metadata names a file the manifest does not list", where=where
                )
            return _read_verified(store, name, file_name, entry)

        def _parse(self, file_name: str, buffer: memoryview) -> dict[str, Any]:
            where = store.store.child(name, file_name)
            if file_name.endswith(".safetensors"):
                return tensorfile.decode(buffer, where=where, framework="torch")
            try:
                values = json.loads(str(buffer, "utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError):
                raise CorruptCheckpointError("not valid JSON", where=where) from None
            if not isinstance(values, dict):
                raise CorruptCheckpointError("not a JSON object", where=where)
            return values

        def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
            return plans

        def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
            for item in plan.items:
                location = self.storage_data[item.storage_index]
                where = store.store.child(name, location.file)
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
            future: Future[None] = Future()
            future.set_result(None)
            return future

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return False

    return Reader()


# -- the metadata file -------------------------------------------------------------------


def _encode_metadata(metadata: Metadata, results: list[list[Any]]) -> bytes:
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


def _decode_metadata(data: bytes, *, where: str, manifest: Manifest) -> Metadata:
    """Parse the metadata file strictly: anything unexpected is a corrupt checkpoint."""
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

    try:
        document = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise bad("not valid UTF-8 JSON") from None
    if not isinstance(document, dict) or document.get("format") != METADATA_FORMAT:
        raise bad(f"'format' is not {METADATA_FORMAT!r}")
    if document.get("format_version") != METADATA_VERSION:
        raise CorruptCheckpointError(
            f"sharded metadata version {document.get('format_version')!r} is not supported "
            f"by this nbresume (it reads [{METADATA_VERSION}])",
            where=where,
            fix="upgrade nbresume: pip install -U nbresume",
        )
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


def _read_verified(
    store: CheckpointStore, name: str, file_name: str, entry: FileEntry
) -> memoryview:
    """A file's bytes, read once, after its size and hashes matched the manifest."""
    return store._read_verified(name, {file_name: entry})[file_name]


# -- save ----------------------------------------------------------------------------------


def save_sharded(
    store: CheckpointStore,
    step: int,
    state_dict: dict[str, Any],
    *,
    data: Mapping[str, Any] | None = None,
    tensors: Mapping[str, Mapping[str, Any]] | None = None,
    metrics: Mapping[str, float] | None = None,
    stem: str = DEFAULT_STEM,
    on_committed: Callable[[CheckpointInfo], None] | None = None,
) -> CheckpointInfo:
    """Write, commit and verify the checkpoint of ``step`` from every rank's shards.

    Every rank of the job (torch.distributed's default group) calls it with its own
    ``state_dict`` (DTensors, ShardedTensors, plain tensors and JSON-able values, nested in
    dicts and lists, as ``torch.distributed.checkpoint.save`` takes it). ``data`` and
    ``tensors`` are what rank 0 saves besides, as :meth:`CheckpointStore.save` takes them
    (other ranks' are ignored); ``on_committed`` is called on rank 0 between the commit and
    the verification. Returns on every rank only after the checkpoint is committed and
    verified; raises the same error on every rank otherwise.
    """
    from torch.distributed.checkpoint.state_dict_saver import save

    group = _ranks()
    final = step_dirname(step)
    extra: list[tuple[str, int, Any]] = []
    folder, problem = "", ""
    if group.rank == 0:
        try:
            if data or tensors:
                extra = store._encode(tensors or {}, data or {})
                clash = [n for n, _, _ in extra if is_sharded_file(n, stem)]
                if clash:
                    raise UsageError(
                        f"{clash[0]} is the name of a sharded file",
                        fix=f"rename that entry of data= or tensors=, or pass stem= other than "
                        f"{stem!r}",
                    )
            store.store.recover(current="")
            folder = store.store.begin(final)
        except OSError as exc:
            problem = str(store._translate(exc, 0, 0))
        except CheckpointError as exc:
            problem = str(exc)
    folder_or_problem = group.broadcast_bytes((folder or "\0" + problem).encode()).decode()
    if folder_or_problem.startswith("\0"):
        raise CheckpointError(
            f"the sharded checkpoint of step {step} could not be started: {folder_or_problem[1:]}",
            where=store.location,
        )
    folder = folder_or_problem

    writer = _make_writer(store, folder, stem)
    local_error: BaseException | None = None
    try:
        with _quiet_single_process():
            save(
                state_dict,
                storage_writer=writer,
                planner=_make_save_planner(),
                no_dist=_dcp_without_group(),
            )
        if group.rank == 0:
            for file_name, _, chunks in extra:
                writer.entries[file_name] = store._write_file(folder, file_name, chunks)
    except Exception as exc:
        local_error = exc
    report = {
        "problem": _problem_text(local_error),
        "files": {n: e.to_json() for n, e in writer.entries.items()},
    }
    try:
        reports = [json.loads(r) for r in group.all_gather_bytes(json.dumps(report).encode())]
    except BaseException:
        # A rank is gone (killed, its host lost): nothing can be committed.
        if group.rank == 0:
            store.store.discard(folder)
        raise
    problems = [f"rank {i}: {r['problem']}" for i, r in enumerate(reports) if r["problem"]]

    outcome, manifest_bytes = "", b""
    if group.rank == 0:
        if problems:
            store.store.discard(folder)
        else:
            try:
                manifest_bytes = _commit(
                    store,
                    step,
                    folder=folder,
                    reports=reports,
                    metrics=metrics,
                    on_committed=on_committed,
                )
            except (OSError, CheckpointError) as exc:
                outcome = _problem_text(exc)
    if problems:
        if isinstance(local_error, CheckpointError):
            raise local_error
        raise CheckpointError(
            f"the sharded checkpoint of step {step} was not saved: " + "; ".join(problems),
            where=store.location,
            fix="the partial checkpoint was removed and earlier ones are intact; "
            "see the first rank's error",
        ) from local_error
    shared = group.broadcast_bytes(
        ("\0" + outcome if outcome else manifest_bytes.decode()).encode()
    )
    if shared.startswith(b"\0"):
        raise CheckpointError(
            f"the sharded checkpoint of step {step} was not saved: {shared[1:].decode()}",
            where=store.location,
        )
    manifest = parse_manifest(shared, where=store.store.child(final, MANIFEST_NAME))
    return CheckpointInfo(step, final, store.store.child(final), manifest)


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is intended."""
    with warnings.catch_warnings():
        if _dcp_without_group():
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _problem_text(exc: BaseException | None) -> str:
    if exc is None:
        return ""
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0] if len(text) > 2000 else text


def _commit(
    store: CheckpointStore,
    step: int,
    *,
    folder: str,
    reports: list[dict[str, Any]],
    metrics: Mapping[str, float] | None,
    on_committed: Callable[[CheckpointInfo], None] | None,
) -> bytes:
    """Rank 0: the manifest, the commit, the read-back verification, retention."""
    entries: dict[str, FileEntry] = {}
    for report in reports:
        for file_name, entry in report["files"].items():
            entries[file_name] = FileEntry(entry["size"], entry["sha256"], entry.get("md5"))
    _, manifest_bytes = store._commit(
        step, folder, entries, metrics=metrics, on_committed=on_committed
    )
    return manifest_bytes


# -- load ----------------------------------------------------------------------------------


def load_sharded(
    store: CheckpointStore,
    state_dict: dict[str, Any],
    *,
    step: int | None = None,
    stem: str = DEFAULT_STEM,
    check: Callable[[LoadedCheckpoint], None] | None = None,
) -> LoadedCheckpoint:
    """Load the newest sharded checkpoint that verifies (or exactly the one of ``step``) into
    ``state_dict``, in place, as ``torch.distributed.checkpoint.load`` does.

    ``check`` is called on every rank with the checkpoint's other files, before any shard is
    loaded: a :class:`CheckpointError` it raises on any rank passes the checkpoint over, as a
    failed verification does.

    Every rank calls it with its own ``state_dict`` (its DTensors receive their shards).
    Returns the checkpoint's other files (``data``, ``tensors``) too. A newer checkpoint that
    fails verification is passed over on every rank with a warning; raises
    :class:`NoCheckpointError` when none verifies.
    """
    group = _ranks()
    candidates: list[str] = []
    if group.rank == 0:
        candidates = [name for s, name in store._checkpoint_folders() if step is None or s == step]
    skipped: list[str] = []
    index = 0
    while True:
        name = group.broadcast_bytes(candidates[index].encode() if index < len(candidates) else b"")
        index += 1
        if not name:
            break
        folder = name.decode()
        raw, problem = b"", ""
        if group.rank == 0:
            try:
                raw = bytes(store.store.read_bytes(folder, MANIFEST_NAME, limit=MAX_MANIFEST_BYTES))
            except FileNotFoundError:
                problem = "\0"  # never committed: not a checkpoint, nothing to warn about
            except OSError as exc:
                where = store.store.child(folder, MANIFEST_NAME)
                problem = f"{where}: cannot read the manifest: {exc}"
        shared = group.broadcast_bytes(b"\0" + problem.encode() if problem else raw)
        if shared.startswith(b"\0"):
            if shared[1:]:
                skipped.append(shared[1:].decode())
            continue
        try:
            loaded = _load_folder(
                store,
                folder,
                shared,
                state_dict=state_dict,
                stem=stem,
                group=group,
                check=check,
            )
        except CorruptCheckpointError as exc:
            skipped.append(str(exc))
            continue
        if skipped:
            warnings.warn(
                f"nbresume: skipped {len(skipped)} newer checkpoint(s) that failed "
                f"verification ({'; '.join(skipped)}); using step {loaded.step}",
                RuntimeWarning,
                stacklevel=2,
            )
        return loaded
    if step is not None and not skipped:
        raise NoCheckpointError(f"there is no checkpoint of step {step}", where=store.location)
    if skipped:
        raise NoCheckpointError(
            f"no checkpoint verifies ({len(skipped)} checked): " + "; ".join(skipped),
            where=store.location,
            fix="run `nbresume verify` on the folder for details",
        )
    raise NoCheckpointError("there is no checkpoint yet", where=store.location)


def _load_folder(
    store: CheckpointStore,
    folder: str,
    manifest_bytes: bytes,
    *,
    state_dict: dict[str, Any],
    stem: str,
    group: _Ranks,
    check: Callable[[LoadedCheckpoint], None] | None = None,
) -> LoadedCheckpoint:
    """Every rank: verify and load one checkpoint, or raise the same error on every rank."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import load

    from nbresume.checkpoint.format import parse_step_dirname
    from nbresume.checkpoint.storage import replaced_step

    step = parse_step_dirname(replaced_step(folder) or folder)
    assert step is not None
    where = store.store.child(folder, MANIFEST_NAME)
    manifest = parse_manifest(manifest_bytes, where=where, expected_step=step)
    meta_name = metadata_name(stem)
    if meta_name not in manifest.files:
        raise CheckpointError(
            f"the checkpoint of step {step} holds no sharded state ({meta_name} is missing)",
            where=store.store.child(folder),
            fix="it was saved without sharded tensors; load it with CheckpointStore.load()",
        )

    # Rank 0 reads the metadata once; every rank checks the hash of the bytes it parses.
    raw, problem = b"", ""
    if group.rank == 0:
        try:
            raw = bytes(_read_verified(store, folder, meta_name, manifest.files[meta_name]))
        except CorruptCheckpointError as exc:
            problem = str(exc)
    shared = group.broadcast_bytes(b"\0" + problem.encode() if problem else raw)
    if shared.startswith(b"\0"):
        raise CorruptCheckpointError(shared[1:].decode())
    loaded = LoadedCheckpoint(step, store.store.child(folder), manifest)
    problem = ""
    try:
        entry = manifest.files[meta_name]
        _check_file(
            store.store.child(folder, meta_name),
            entry,
            len(shared),
            hashlib.sha256(shared).hexdigest(),
            hashlib.md5(shared, usedforsecurity=False) if entry.md5 else None,
        )
        metadata = _decode_metadata(
            shared, where=store.store.child(folder, meta_name), manifest=manifest
        )
        # The files outside the shards, which every rank loads (small: state.json, RNGs).
        for file_name, entry in manifest.files.items():
            if is_sharded_file(file_name, stem):
                continue
            buffer = _read_verified(store, folder, file_name, entry)
            file_where = store.store.child(folder, file_name)
            file_stem, kind = file_name.rsplit(".", 1)
            if kind == "safetensors":
                loaded.tensors[file_stem] = tensorfile.decode(buffer, where=file_where)
            else:
                loaded.data[file_stem] = _parse_json(buffer, where=file_where)
        loaded.state = _decode_state(
            loaded.data, loaded.tensors, where=store.store.child(folder, "state.json")
        )
        if check is not None:
            check(loaded)
    except CheckpointError as exc:
        problem = str(exc)
    problems = _problems(group, problem)
    if problems:
        raise CorruptCheckpointError("; ".join(dict.fromkeys(problems)))

    reader = _make_reader(
        store, name=folder, manifest=manifest, metadata=metadata, stem=stem, group=group
    )
    other = ""
    try:
        with _quiet_single_process():
            load(
                state_dict,
                storage_reader=reader,
                planner=_make_load_planner(),
                no_dist=_dcp_without_group(),
            )
    except (CheckpointException, CheckpointError, RuntimeError, ValueError, KeyError) as exc:
        other = "" if reader.problem else _problem_text(exc)
    verdicts = group.all_gather_bytes(json.dumps([reader.problem, other]).encode())
    corrupt = [json.loads(v)[0] for v in verdicts if json.loads(v)[0]]
    failed = [json.loads(v)[1] for v in verdicts if json.loads(v)[1]]
    if corrupt:
        raise CorruptCheckpointError("; ".join(dict.fromkeys(corrupt)))
    if failed:
        raise CheckpointError(
            f"the sharded state of step {step} does not fit the state_dict given: {failed[0]}",
            where=store.store.child(folder),
            fix="load it into the same model and optimizer layout it was saved from "
            "(the same parameter names and shapes; the number of ranks may differ)",
        )
    return loaded


__all__ = [
    "DEFAULT_STEM",
    "has_sharded_tensors",
    "is_sharded",
    "is_sharded_file",
    "is_sharded_object",
    "load_sharded",
    "loadable_state",
    "metadata_name",
    "save_sharded",
    "shard_names",
]
