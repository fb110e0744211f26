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

1. Rank 0 begins the pending checkpoint (:meth:`CheckpointStore.begin`: it cleans up after
   a killed writer and creates the temporary folder); the folder's name is broadcast, and
   every other rank joins it (:meth:`CheckpointStore.join`).
2. DCP plans the save; every rank writes its files into the pending folder through the
   pending layer (:mod:`nbresume.checkpoint.parallel.dcp`), each durable and hashed; rank 0
   writes the metadata file once all ranks have written, then the files of ``data=`` and
   ``tensors=``.
3. Every rank's file names, sizes and hashes are gathered to rank 0 (as JSON bytes in tensor
   collectives: no pickle). A failure on any rank removes the temporary folder on rank 0 and
   raises on every rank.
4. Rank 0 records every rank's files in its pending checkpoint and commits it: the manifest,
   the rename into place, the verification of the checkpoint as the store now has it and
   retention, as for every checkpoint (:mod:`nbresume.checkpoint.store.pending`); then it tells
   every rank the outcome.

A kill at any moment before step 4's commit leaves only a hidden temporary folder, which no
reader takes and the next save removes.

Loading (every rank calls :func:`load_sharded`): rank 0 picks the newest checkpoint and
broadcasts its manifest's bytes; every rank reads each file it needs once, checks its size and
SHA-256 against the manifest, and parses only those verified bytes: the metadata, the files
outside the shards, and (in DCP's planning phase, before any tensor is copied) the shard files
its plan reads; the shard files no rank reads are hashed by a rank in turn. A file that fails
makes every rank pass over that checkpoint with a warning and try the next older one: the
reading policy of every reader (:func:`nbresume.checkpoint.store.newest_that_loads`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from nbresume.checkpoint.backends import replaced_step
from nbresume.checkpoint.format import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    FileEntry,
    Manifest,
    parse_manifest,
    parse_step_dirname,
    step_dirname,
)
from nbresume.checkpoint.parallel.dcp import (
    DEFAULT_STEM,
    dcp_without_group,
    decode_metadata,
    is_sharded_file,
    make_load_planner,
    make_reader,
    make_save_planner,
    make_writer,
    metadata_name,
    metadata_of,
    problem_text,
    problems_of,
    quiet_single_process,
    ranks,
    read_verified,
    shard_names,
)
from nbresume.checkpoint.parallel.distributed import Group, Solo
from nbresume.checkpoint.state import DoesNotFit, restoring
from nbresume.checkpoint.store import (
    CheckpointInfo,
    CheckpointStore,
    LoadedCheckpoint,
    PendingCheckpoint,
    check_bytes,
    check_checkpoint,
    decode_files,
    encode,
    newest_that_loads,
)
from nbresume.errors import (
    CheckpointError,
    CorruptCheckpointError,
    StorageError,
    UsageError,
)


def is_sharded(info: CheckpointInfo | Manifest, stem: str = DEFAULT_STEM) -> bool:
    """Whether a checkpoint holds sharded state (its manifest names the metadata file)."""
    manifest = info.manifest if isinstance(info, CheckpointInfo) else info
    return metadata_name(stem) in manifest.files


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

    group = ranks()
    final = step_dirname(step)
    extra: list[tuple[str, Any]] = []
    pending: PendingCheckpoint | None = None
    problem = ""
    if group.rank == 0:
        try:
            if data or tensors:
                extra = encode(tensors or {}, data or {})
                clash = [n for n, _ in extra if is_sharded_file(n, stem)]
                if clash:
                    raise UsageError(
                        f"{clash[0]} is the name of a sharded file",
                        fix=f"rename that entry of data= or tensors=, or pass stem= other than "
                        f"{stem!r}",
                    )
            pending = store.begin(step)
        except CheckpointError as exc:
            problem = str(exc)
    folder = pending.folder if pending is not None else ""
    folder_or_problem = group.broadcast_bytes((folder or "\0" + problem).encode()).decode()
    if folder_or_problem.startswith("\0"):
        raise CheckpointError(
            f"the sharded checkpoint of step {step} could not be started: {folder_or_problem[1:]}",
            where=store.location,
        )
    if pending is None:  # every other rank writes into the folder rank 0 began
        pending = store.join(step, folder_or_problem)

    local_error: BaseException | None = None
    try:
        with quiet_single_process():
            save(
                state_dict,
                storage_writer=make_writer(pending, stem),
                planner=make_save_planner(),
                no_dist=dcp_without_group(),
            )
        if group.rank == 0 and extra:
            pending.write_files(extra, keep=False)
    except Exception as exc:
        local_error = exc
    report = {
        "problem": problem_text(local_error),
        "files": {n: e.to_json() for n, e in pending.entries.items()},
    }
    try:
        reports = [json.loads(r) for r in group.all_gather_bytes(json.dumps(report).encode())]
    except BaseException:
        # A rank is gone (killed, its host lost): nothing can be committed.
        pending.discard()
        raise
    problems = [f"rank {i}: {r['problem']}" for i, r in enumerate(reports) if r["problem"]]

    outcome, manifest_bytes = "", b""
    if group.rank == 0:
        if problems:
            pending.discard()
        else:
            try:
                for rank_report in reports:
                    files = rank_report["files"].items()
                    pending.add_entries({n: FileEntry.from_json(e) for n, e in files})
                pending.commit(metrics, on_committed=on_committed)
                manifest_bytes = pending.manifest_bytes
            except (OSError, CheckpointError) as exc:
                outcome = problem_text(exc)
            finally:
                pending.discard()  # nothing is left after a failed commit
    else:
        pending.discard()  # a handle only: the folder is rank 0's to commit or remove
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
    manifest = parse_manifest(shared, where=store.backend.child(final, MANIFEST_NAME))
    return CheckpointInfo(step, final, store.backend.child(final), manifest)


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
    group = ranks()
    candidates: list[str] = []
    if group.rank == 0:
        candidates = [name for s, name in store.checkpoint_folders() if step is None or s == step]

    def broadcast_candidates() -> Iterator[tuple[int, str]]:
        """Rank 0's candidates, one at a time, the same on every rank."""
        index = 0
        while name := group.broadcast_bytes(
            candidates[index].encode() if index < len(candidates) else b""
        ):
            index += 1
            folder = name.decode()
            found = parse_step_dirname(replaced_step(folder) or folder)
            assert found is not None
            yield found, folder

    def load_one(found_step: int, folder: str) -> LoadedCheckpoint | None:
        raw, problem = b"", ""
        if group.rank == 0:
            try:
                raw = bytes(
                    store.backend.read_bytes(folder, MANIFEST_NAME, limit=MAX_MANIFEST_BYTES)
                )
            except FileNotFoundError:
                problem = "\0"  # never committed: not a checkpoint, nothing to warn about
            except StorageError:
                raise  # the store failed: not a damaged checkpoint
            except OSError as exc:
                where = store.backend.child(folder, MANIFEST_NAME)
                problem = f"{where}: cannot read the manifest: {exc}"
        shared = group.broadcast_bytes(b"\0" + problem.encode() if problem else raw)
        if shared.startswith(b"\0"):
            if shared[1:]:
                raise CorruptCheckpointError(shared[1:].decode())
            return None
        return _load_folder(
            store, folder, shared, state_dict=state_dict, stem=stem, group=group, check=check
        )

    return newest_that_loads(broadcast_candidates(), load_one, location=store.location, step=step)


def _load_folder(
    store: CheckpointStore,
    folder: str,
    manifest_bytes: bytes,
    *,
    state_dict: dict[str, Any],
    stem: str,
    group: Group,
    check: Callable[[LoadedCheckpoint], None] | None = None,
) -> LoadedCheckpoint:
    """Every rank: verify and load one checkpoint, or raise the same error on every rank."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import load

    step = parse_step_dirname(replaced_step(folder) or folder)
    assert step is not None
    where = store.backend.child(folder, MANIFEST_NAME)
    manifest = parse_manifest(manifest_bytes, where=where, expected_step=step)
    meta_name = metadata_name(stem)
    if meta_name not in manifest.files:
        raise CheckpointError(
            f"the checkpoint of step {step} holds no sharded state ({meta_name} is missing)",
            where=store.backend.child(folder),
            fix="it was saved without sharded tensors; load it with CheckpointStore.load()",
        )

    # Rank 0 reads the metadata once; every rank checks the hash of the bytes it parses.
    raw, problem = b"", ""
    if group.rank == 0:
        try:
            raw = bytes(read_verified(store, folder, meta_name, manifest.files[meta_name]))
        except CorruptCheckpointError as exc:
            problem = str(exc)
    shared = group.broadcast_bytes(b"\0" + problem.encode() if problem else raw)
    if shared.startswith(b"\0"):
        raise CorruptCheckpointError(shared[1:].decode())
    loaded = LoadedCheckpoint(step, store.backend.child(folder), manifest)
    problem = ""
    try:
        entry = manifest.files[meta_name]
        check_bytes(store.backend.child(folder, meta_name), entry, shared)
        metadata = decode_metadata(
            shared, where=store.backend.child(folder, meta_name), manifest=manifest
        )
        # The files outside the shards, which every rank loads (small: state.json, RNGs).
        others = {n: e for n, e in manifest.files.items() if not is_sharded_file(n, stem)}
        decode_files(store.backend, folder, store.read_files(folder, others), loaded)
        # Complete and consistent (every tensor covered once by chunks that are in their
        # files), from the metadata and the shard files' headers, before a shard is read.
        # Rank 0 reads the headers (the others check the rest): its verdict reaches them all.
        shard_files = {
            n: e
            for n, e in manifest.files.items()
            if is_sharded_file(n, stem) and n.endswith(".safetensors")
        }
        headers = store.read_headers(folder, shard_files) if group.rank == 0 else {}
        check_checkpoint(
            manifest,
            location=loaded.location,
            documents={**loaded.data, meta_name.removesuffix(".json"): json.loads(shared)},
            tensors={**loaded.tensors, **headers},
            state=loaded.state,
        )
        if check is not None:
            check(loaded)
    except CheckpointError as exc:
        problem = str(exc)
    problems = problems_of(group, problem)
    if problems:
        raise CorruptCheckpointError("; ".join(dict.fromkeys(problems)))

    reader = make_reader(
        store, name=folder, manifest=manifest, metadata=metadata, stem=stem, group=group
    )
    other = ""
    try:
        with quiet_single_process():
            load(
                state_dict,
                storage_reader=reader,
                planner=make_load_planner(),
                no_dist=dcp_without_group(),
            )
    except (CheckpointException, CheckpointError, RuntimeError, ValueError, KeyError) as exc:
        other = "" if reader.problem else problem_text(exc)
    verdicts = group.all_gather_bytes(json.dumps([reader.problem, other]).encode())
    corrupt = [json.loads(v)[0] for v in verdicts if json.loads(v)[0]]
    failed = [json.loads(v)[1] for v in verdicts if json.loads(v)[1]]
    if corrupt:
        raise CorruptCheckpointError("; ".join(dict.fromkeys(corrupt)))
    if failed:
        raise CheckpointError(
            f"the sharded state of step {step} does not fit the state_dict given: {failed[0]}",
            where=store.backend.child(folder),
            fix="load it into the same model and optimizer layout it was saved from "
            "(the same parameter names and shapes; the number of ranks may differ)",
        )
    return loaded


# -- a sharded checkpoint into plain objects, in one process --------------------------------


class Gather:
    """The sharded state of a checkpoint read whole (every rank's shard files in
    ``loaded.tensors``, as :meth:`CheckpointStore.load` reads it) put into plain, unsharded
    objects: what a sharded restore does when the number of ranks changes, here for one
    process without a process group (each process of a replicated job does the same).

    Made from the checkpoint and the live objects, it checks without changing anything that
    every object the checkpoint says is sharded fits what its metadata records (names, sizes,
    dtypes), raising :class:`~nbresume.checkpoint.state.DoesNotFit` otherwise (an optimizer
    that has not stepped yet is given zeroed state to receive the saved one, as DCP does:
    :meth:`undo` takes it back). :meth:`load` then copies every chunk into place, each
    tensor whole, and loads each object's state.
    """

    def __init__(
        self, loaded: LoadedCheckpoint, objects: Mapping[str, Any], *, stem: str = DEFAULT_STEM
    ) -> None:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        saved = loaded.state
        self.loaded = loaded
        self.stem = stem
        names = [n for n in (saved.sharded if saved is not None else []) if n in objects]
        self.objects = {n: objects[n] for n in names}
        where = f"{loaded.location}/{metadata_name(stem)}"
        document = loaded.data.get(metadata_name(stem).removesuffix(".json"))
        if names and document is None:
            raise CorruptCheckpointError(f"{metadata_name(stem)} is missing", where=where)
        self.metadata = (
            metadata_of(document, where=where, manifest=loaded.manifest) if names else None
        )
        self.fresh = [o for o in self.objects.values() if _is_optimizer(o) and not o.state]
        self.states = {n: loadable_state(o) for n, o in self.objects.items()}
        if self.metadata is None:
            return
        items = self.metadata.state_dict_metadata
        flat, _ = flatten_state_dict(dict(self.states))
        differences = []
        for fqn, value in flat.items():
            saved_item = items.get(fqn)
            if saved_item is None:
                differences.append(f"{fqn} is here, not in the checkpoint")
            elif isinstance(saved_item, TensorStorageMetadata):
                size, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
                if size != saved_item.size or dtype != saved_item.properties.dtype:
                    differences.append(
                        f"{fqn} is {list(saved_item.size)} "
                        f"{str(saved_item.properties.dtype).removeprefix('torch.')} in the "
                        f"checkpoint, {_described(value)} here"
                    )
        differences += [
            f"{fqn} is in the checkpoint, not here"
            for fqn in items
            if fqn not in flat and fqn.split(".", 1)[0] in self.objects
        ]
        if differences:
            self.undo()
            shown = "; ".join(differences[:8])
            more = f"; and {len(differences) - 8} more" if len(differences) > 8 else ""
            raise DoesNotFit(
                f"the sharded state of step {loaded.step} does not fit the objects given: "
                f"{shown}{more}",
                where=where,
                fix="build the model and optimizer exactly as in the run that saved it (the "
                "number of processes and the sharding may differ)",
                step=loaded.step,
                differences=differences,
            )

    def undo(self) -> None:
        """Take back the zeroed state given to optimizers that had not stepped."""
        for optimizer in self.fresh:
            optimizer.state.clear()

    def load(self) -> None:
        """Copy every chunk into the objects' tensors, then load each object's state."""
        from torch.distributed.checkpoint.state_dict_loader import load

        if self.metadata is None:
            return
        files = {
            name: self.loaded.tensors[stem]
            if name.endswith(".safetensors")
            else self.loaded.data[stem]
            for name in self.loaded.manifest.files
            if is_sharded_file(name, self.stem) and name != metadata_name(self.stem)
            for stem in [name.rsplit(".", 1)[0]]
        }
        reader = make_reader(
            None,
            name=self.loaded.location,
            manifest=self.loaded.manifest,
            metadata=self.metadata,
            stem=self.stem,
            group=Solo(),
            preloaded=files,
        )
        with quiet_single_process():
            load(self.states, storage_reader=reader, planner=make_load_planner(), no_dist=True)
        for name, state in self.states.items():
            restoring.load_object(name, self.objects[name], state)


def _is_optimizer(obj: Any) -> bool:
    import torch

    return isinstance(obj, torch.optim.Optimizer)


def _described(value: Any) -> str:
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    return type(value).__name__


__all__ = [
    "DEFAULT_STEM",
    "Gather",
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
