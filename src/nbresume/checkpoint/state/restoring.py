"""Restoring a checkpoint into the live objects: check everything, then apply all or nothing.

The protocol of one restore, whatever the distributed mode:

1. **Plan** (:func:`plan`): decode the checkpoint's ``state.json`` and this rank's RNG states,
   and compare every saved object with the live one (names, shapes, dtypes of modules and
   optimizers). Nothing is changed. A checkpoint that does not fit raises
   :class:`DoesNotFit`, so that the store's reader passes it over for the next older one;
   when none fits, :func:`no_fit` is the one error the caller raises. A checkpoint of a job
   of another number of processes is planned like any other: this rank's RNG states are its
   own where the saving job had this rank, else derived from the checkpoint
   (:func:`rank_rng`), and a wrapped loader checks that its epoch continues exactly in the
   new shape, or raises the :class:`~nbresume.errors.UsageError` that refuses the restore
   (never a reason to pass the checkpoint over for an older one).
2. **Apply** (:func:`apply`): put the checked plan into the RNGs and every object. Objects
   whose state could not be checked are loaded first, each after a snapshot of its state; if
   a load still fails, every object loaded so far and the RNGs are put back as they were.
   Saved state of objects not registered yet is kept for when they are.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nbresume import knobs
from nbresume.checkpoint.format import (
    STATE_FILE,
    SavedState,
    TensorSpec,
    capture_rng,
    decode_state,
    is_state_document,
    restore_rng,
    signature,
    torch_name,
)
from nbresume.checkpoint.state import optimizer_extras
from nbresume.checkpoint.state.data import ResumableLoader
from nbresume.checkpoint.state.trainable import TrainableOnly
from nbresume.checkpoint.store import LoadedCheckpoint
from nbresume.errors import (
    CheckpointError,
    CorruptCheckpointError,
    DoesNotFit,
    NbresumeError,
    UsageError,
)


@dataclass
class RestorePlan:
    """A checkpoint checked against the live objects, ready to be put into them."""

    where: str
    saved: SavedState
    rng: Any
    missing: list[str]
    #: Optimizers given back the parameter groups they gained in training (undone if the
    #: plan is not applied in full).
    grown: list[optimizer_extras.Grown] = field(default_factory=list)
    #: This process's rank and the number of processes of the job that restores.
    rank: int = 0
    world_size: int = 1
    #: Reads the saved bytes into the live tensors the plan's trees hold (the restore
    #: reads into the objects' own memory: :func:`targets`); the first act of :func:`apply`.
    fill: Callable[[], None] | None = None

    @property
    def reshaped(self) -> bool:
        """Whether the job that restores has another number of processes than the one that
        saved the checkpoint."""
        return self.saved.world_size != self.world_size


def plan(
    loaded: LoadedCheckpoint, objects: Mapping[str, Any], *, rank: int, world_size: int
) -> RestorePlan:
    """Decode and check everything a restore needs from ``loaded`` without changing
    anything: the state document, this rank's RNG states, and the match between every
    saved object and the live one (names, shapes, dtypes)."""
    where = f"{loaded.location}/{STATE_FILE}.json"
    saved = loaded.state
    if saved is None:
        document = loaded.data.get(STATE_FILE)
        if not is_state_document(document):
            raise CorruptCheckpointError(
                "state.json is missing or is not a Checkpointer's state", where=where
            )
        saved = decode_state(document, loaded.tensors, where=where)
    rng = rank_rng(saved, rank=rank)
    # Groups an optimizer gained in training go back in first, so that it can be compared.
    grown = optimizer_extras.grow_groups(saved.added_groups, saved.objects, objects)
    try:
        checked = _checked_plan(loaded, saved, rng, objects, where=where, grown=grown)
        _check_loaders(saved, objects, world_size=world_size)
    except BaseException:
        optimizer_extras.shrink_groups(grown)
        raise
    checked.rank, checked.world_size = rank, world_size
    checked.fill = loaded.fill
    return checked


def check_fits(heads: LoadedCheckpoint, objects: Mapping[str, Any]) -> None:
    """Compare the saved modules and optimizers of ``heads`` (a checkpoint whose tensors are
    their headers' :class:`~nbresume.checkpoint.format.TensorSpec`: dtype and shape, no
    bytes) with the live ones, as :func:`plan` compares them, before a byte of the tensors
    is read: raises :class:`DoesNotFit` (or CorruptCheckpointError) and changes nothing."""
    where = f"{heads.location}/{STATE_FILE}.json"
    saved = heads.state
    if saved is None:
        raise CorruptCheckpointError(
            "state.json is missing or is not a Checkpointer's state", where=where
        )
    grown = optimizer_extras.grow_groups(saved.added_groups, saved.objects, objects)
    try:
        _checked_plan(heads, saved, None, objects, where=where, grown=grown)
    finally:
        optimizer_extras.shrink_groups(grown)


def _check_loaders(saved: SavedState, objects: Mapping[str, Any], *, world_size: int) -> None:
    """Refuse, before anything is loaded (never by passing the checkpoint over), a wrapped
    loader whose epoch cannot continue exactly in this job: another batch size or number of
    processes where the samples trained do not make whole batches of the new shape, another
    kind of sampler, or a loader state that does not say how its data was split (an earlier
    nbresume) in a job of another number of processes."""
    for name, tree in saved.objects.items():
        loader = objects.get(name)
        if not isinstance(loader, ResumableLoader) or not isinstance(tree, Mapping):
            continue
        unrecorded = "replicas" not in tree and "world_size" not in tree
        if unrecorded and saved.world_size != world_size and tree.get("position"):
            raise UsageError(
                f"{name!r} was saved in the middle of epoch {tree.get('epoch')} by a job of "
                f"{saved.world_size} process(es) and an nbresume that did not record how the "
                f"data was split across them; this job has {world_size}, so the rest of the "
                "epoch cannot be found exactly",
                fix=f"finish this epoch with {saved.world_size} process(es); a new number of "
                "processes from the start of an epoch needs nothing",
            )
        loader.check_state(tree)


def _checked_plan(
    loaded: LoadedCheckpoint,
    saved: SavedState,
    rng: Any,
    objects: Mapping[str, Any],
    *,
    where: str,
    grown: list[optimizer_extras.Grown],
) -> RestorePlan:
    differences: list[str] = []
    files: list[str] = []  # the tensor files of the objects that differ
    for name, tree in saved.objects.items():
        if name in objects:
            try:
                found = _differences(name, objects[name], tree)
            except Exception as exc:  # a saved tree of an unexpected form
                found = [f"{name}: the saved state cannot be compared with it ({exc!r})"]
            differences += found
            if found and f"{name}.safetensors" in loaded.manifest.files:
                files.append(f"{loaded.location}/{name}.safetensors")
    if differences:
        shown = "; ".join(differences[:8])
        more = f"; and {len(differences) - 8} more" if len(differences) > 8 else ""
        raise DoesNotFit(
            f"the checkpoint of step {loaded.step} does not fit the objects given: {shown}{more}",
            where=", ".join(files) or where,
            fix=_NO_FIT_FIX,
            step=loaded.step,
            differences=differences,
        )
    missing = sorted(objects.keys() - saved.objects.keys() - set(saved.sharded))
    return RestorePlan(loaded.location, saved, rng, missing, grown)


def apply(checked: RestorePlan, objects: Mapping[str, Any], pending: dict[str, Any]) -> None:
    """Put a checked plan into the RNGs and every object, all or nothing: objects whose
    state was not checked against a live copy are loaded first, each after a snapshot, and
    if one still fails, every one loaded so far and the RNGs are put back as they were.
    Saved state of objects not in ``objects`` goes into ``pending``."""
    saved = checked.saved
    rng_before = capture_rng()
    # Unchecked objects first (each can be put back), then optimizers, whose loading has
    # more ways to fail than a module's, and the modules last.
    order = sorted(
        (n for n in saved.objects if n in objects),
        key=lambda n: (_is_checked_kind(objects[n]), is_module(objects[n])),
    )
    undo: list[tuple[str, Any, Any]] = []
    fill, checked.fill = checked.fill, None
    try:
        restore_rng(checked.rng)
        for name in order:
            obj = objects[name]
            if fill is not None and _is_checked_kind(obj):
                # Every object that could still refuse its state is loaded: the saved bytes
                # go into the live tensors (targets) now. A file that changed since it was
                # verified raises here, and what was loaded is put back.
                fill()
                fill = None
            before = None if _is_checked_kind(obj) else _snapshot(obj)
            if before is not None:
                undo.append((name, obj, before))  # the failing one too: it may be half done
            load_object(name, obj, saved.objects[name])
        if fill is not None:
            fill()
    except BaseException:
        for _, obj, before in reversed(undo):
            with contextlib.suppress(Exception):
                obj.load_state_dict(before)
        optimizer_extras.shrink_groups(checked.grown)
        restore_rng(rng_before)
        raise
    for name, tree in saved.objects.items():
        if name not in objects:
            pending[name] = tree
    for name in checked.missing:
        warnings.warn(
            f"nbresume: the checkpoint at {checked.where} holds no state for {name!r}; "
            "it keeps its current state",
            RuntimeWarning,
            stacklevel=_outside_nbresume(),
        )


def load_object(name: str, obj: Any, tree: Any) -> None:
    """``obj.load_state_dict(tree)``, its failure named and given a fix.

    A torch module's parameters and buffers take the checked tensors read from the
    checkpoint as their storage instead of copying them (:func:`adopt_storages`): a restore
    reads each byte once, into memory that becomes the module's own. Should the load still
    fail, each one gets its former storage back.
    """
    adopted: list[tuple[Any, Any]] = []
    try:
        if is_module(obj) and isinstance(tree, Mapping):
            live = obj.state_dict(keep_vars=True)
            tree = compiled_renamed(tree, live) or tree
            tree, adopted = adopt_storages(live, tree)
        obj.load_state_dict(tree)
    except BaseException as exc:
        for tensor, before in reversed(adopted):
            tensor.data = before
        if isinstance(exc, NbresumeError) or not isinstance(exc, Exception):
            raise  # it names what is wrong and the fix already (or it is an interrupt)
        raise CheckpointError(
            f"restoring {name!r} failed: {exc}",
            where=name,
            fix="the object must be built exactly as in the run that saved it "
            "(same model, optimizer and parameter groups)",
        ) from exc


def adopt_storages(
    live: Mapping[str, Any], tree: Mapping[str, Any]
) -> tuple[dict[str, Any], list[Any]]:
    """Point each of a module's parameters and buffers (``live``: its
    ``state_dict(keep_vars=True)``) at its saved tensor (``tensor.data = saved``) where that
    is the same as copying it, and return the tree to load (each
    adopted entry replaced by the live tensor itself, so that ``load_state_dict`` still runs
    its checks and hooks and copies nothing) with the (tensor, former storage) pairs.

    Only a plain, contiguous host tensor that owns its storage is adopted, from a saved
    tensor of the same dtype, shape and layout: views into a larger buffer, other layouts
    (channels_last), shared or pinned memory, devices and tensor subclasses are copied as
    before, so that nothing the model relies on changes but where its bytes live. A tied
    weight (one tensor under several names) is adopted once, when its saved copies are
    equal. The saved tensors were hashed and checked before this runs.
    """
    import torch

    plain = (torch.Tensor, torch.nn.Parameter)
    # Storage -> the live tensors on it, and tensor -> the names it is saved under. Only
    # plain tensors: a subclass (FSDP2's DTensor) may have no storage of its own to ask about.
    on_storage: dict[int, set[int]] = {}
    names: dict[int, list[str]] = {}
    for key, value in live.items():
        if type(value) in plain and value.device.type == "cpu":
            on_storage.setdefault(value.untyped_storage().data_ptr(), set()).add(id(value))
            names.setdefault(id(value), []).append(key)
    # Saved memory -> the names that hold it: no memory is adopted by two live tensors.
    holders: dict[int, set[str]] = {}
    for key, value in tree.items():
        if type(value) is torch.Tensor:
            holders.setdefault(value.data_ptr(), set()).add(key)
    out = dict(tree)
    adopted: list[tuple[Any, Any]] = []
    for keys in names.values():
        target = live[keys[0]]
        saved: list[Any] = [tree.get(key) for key in keys]
        last = saved[-1]  # what load_state_dict would leave in a tied weight
        if last is target:
            continue  # its saved bytes were read into it (targets)
        if (
            all(type(value) is torch.Tensor for value in saved)
            and last.device.type == "cpu"
            and last.dtype == target.dtype
            and last.shape == target.shape
            and last.nbytes > 0
            and not last.requires_grad
            and last.is_contiguous()
            and target.is_contiguous()
            and target.storage_offset() == 0
            and target.untyped_storage().nbytes() == target.nbytes
            and len(on_storage[target.untyped_storage().data_ptr()]) == 1
            and not target.is_shared()  # shared with other processes (Hogwild)
            and not target.is_pinned()
            and holders[last.data_ptr()] <= set(keys)
            and all(torch.equal(value, last) for value in saved[:-1])
        ):
            adopted.append((target, target.data))
            target.data = last
            out.update(dict.fromkeys(keys, target))
    return out, adopted


def targets(heads: LoadedCheckpoint, objects: Mapping[str, Any]) -> dict[str, dict[Any, Any]]:
    """The live tensors a checkpoint's tensors can be read into, per tensor file and by their
    byte range in it (``heads``: a checkpoint that fits, its tensors their headers'
    :class:`~nbresume.checkpoint.format.TensorSpec`): a module's parameters and buffers and
    an optimizer's state tensors, where the live one is a plain, contiguous tensor in host
    memory of the saved dtype and shape, the only live tensor on its memory. Reading into them
    is what ``load_state_dict`` would do with the saved bytes, without a second copy of the
    state in memory. A tied weight takes the bytes of the name ``load_state_dict`` copies last
    (the other copies are read as before); tensors on a GPU, views, other layouts and
    subclasses are read as before."""
    torch = sys.modules.get("torch")
    saved = heads.state
    if torch is None or saved is None:
        return {}
    pairs: list[tuple[str, Any, Any]] = []  # (file, saved spec, live tensor)
    for name, tree in saved.objects.items():
        obj = objects.get(name)
        if not _loads_as_torch_does(obj, torch):
            continue  # its own load may refuse the state: read as before, put back if it does
        if isinstance(obj, torch.nn.Module) and isinstance(tree, Mapping):
            live = obj.state_dict(keep_vars=True)
            found = [(tree[key], live[key]) for key in tree if key in live]
        elif isinstance(obj, torch.optim.Optimizer):
            found = _optimizer_pairs(obj, tree)
        else:
            continue
        pairs += [(f"{name}.safetensors", spec, tensor) for spec, tensor in found]
    # Memory -> the live tensors on it: only the one tensor of its memory is read into.
    on_memory: dict[int, set[int]] = {}
    for _, _, tensor in pairs:
        if type(tensor) in (torch.Tensor, torch.nn.Parameter):
            on_memory.setdefault(tensor.untyped_storage().data_ptr(), set()).add(id(tensor))
    out: dict[str, dict[Any, Any]] = {}
    taken: dict[int, tuple[str, Any]] = {}  # live tensor -> the (file, range) it takes
    for file_name, spec, tensor in pairs:
        if (
            isinstance(spec, TensorSpec)
            and spec.end > spec.start
            and type(tensor) in (torch.Tensor, torch.nn.Parameter)
            and tensor.device.type == "cpu"
            and tensor.layout == torch.strided
            and tensor.is_contiguous()
            and not tensor.is_conj()
            and not tensor.is_neg()
            and signature(tensor) == signature(spec)
            and len(on_memory[tensor.untyped_storage().data_ptr()]) == 1
        ):
            earlier = taken.pop(id(tensor), None)
            if earlier is not None:  # a tied weight: the last name's bytes are what stays
                del out[earlier[0]][earlier[1]]
            span = (spec.start, spec.end)
            out.setdefault(file_name, {})[span] = tensor
            taken[id(tensor)] = (file_name, span)
    return {file_name: spans for file_name, spans in out.items() if spans}


def _loads_as_torch_does(obj: Any, torch: Any) -> bool:
    """Whether ``obj`` is a module or optimizer whose load is torch's own, without hooks: a
    checked state then loads without fail, so its tensors may be written before it is loaded.
    A module of torch's own classes (BatchNorm's handling of an old state) counts as such."""
    if isinstance(obj, torch.nn.Module):
        for module in obj.modules():
            kind = type(module)
            if (
                module._load_state_dict_pre_hooks
                or module._load_state_dict_post_hooks
                or kind.load_state_dict is not torch.nn.Module.load_state_dict
                or (
                    kind._load_from_state_dict is not torch.nn.Module._load_from_state_dict
                    and not kind._load_from_state_dict.__module__.startswith("torch.")
                )
            ):
                return False
        return True
    if isinstance(obj, torch.optim.Optimizer):
        return (
            type(obj).load_state_dict is torch.optim.Optimizer.load_state_dict
            and not getattr(obj, "_optimizer_load_state_dict_pre_hooks", None)
            and not getattr(obj, "_optimizer_load_state_dict_post_hooks", None)
        )
    return False


def _optimizer_pairs(optimizer: Any, tree: Any) -> list[tuple[Any, Any]]:
    """(saved spec, live state tensor) of every state tensor an optimizer already holds,
    paired as torch pairs them: parameters by position within the groups."""
    if not isinstance(tree, Mapping):
        return []
    state, groups = tree.get("state"), tree.get("param_groups")
    if not isinstance(state, Mapping) or not isinstance(groups, list):
        return []
    if len(groups) != len(optimizer.param_groups):
        return []
    out = []
    for saved_group, live_group in zip(groups, optimizer.param_groups, strict=True):
        ids = saved_group.get("params") if isinstance(saved_group, Mapping) else None
        if not isinstance(ids, list) or len(ids) != len(live_group["params"]):
            return []
        for saved_id, parameter in zip(ids, live_group["params"], strict=True):
            saved_state = state.get(saved_id) if isinstance(saved_id, int) else None
            live_state = optimizer.state.get(parameter)
            if isinstance(saved_state, Mapping) and isinstance(live_state, Mapping):
                out += [(v, live_state[k]) for k, v in saved_state.items() if k in live_state]
    return out


def devices(objects: Mapping[str, Any]) -> dict[str, Any]:
    """The tensor file of each module and optimizer whose tensors all live on one CUDA
    device, mapped to that device: a restore reads those files straight onto it
    (:class:`~nbresume.checkpoint.store.reading.DeviceReader`) rather than into host memory as
    large as the file, then copied. Objects on the host, spread over devices, or of other
    kinds are read into host memory as before.

    NBRESUME_GPU_DIRECT_READ=0 turns this off (restores then go through host memory); the GPU
    suite runs it (``tests/gpu/test_device_restore.py`` and every resume check)."""
    torch = sys.modules.get("torch")
    if torch is None or not knobs.gpu_direct_read() or not torch.cuda.is_available():
        return {}
    out: dict[str, Any] = {}
    for name, obj in objects.items():
        if isinstance(obj, torch.nn.Module):
            tensors = list(obj.state_dict(keep_vars=True).values())
        elif isinstance(obj, torch.optim.Optimizer):
            tensors = [p for group in obj.param_groups for p in group["params"]]
        else:
            continue
        found = {t.device for t in tensors if isinstance(t, torch.Tensor)}
        if len(found) == 1 and next(iter(found)).type == "cuda":
            out[f"{name}.safetensors"] = next(iter(found))
    return out


def _outside_nbresume() -> int:
    """The ``stacklevel`` of a warning that points at the first caller outside nbresume."""
    package = os.path.dirname(os.path.dirname(__file__))
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def is_module(value: Any) -> bool:
    torch_nn = sys.modules.get("torch.nn")
    return torch_nn is not None and isinstance(value, torch_nn.Module)


def rank_rng(saved: SavedState, *, rank: int) -> Any:
    """This rank's RNG states from a checked ``state.json``, whatever the number of processes
    of the job that saved it: a rank that job had gets its own states back; a rank it did not
    have (the job grew) gets streams derived from the checkpoint (:func:`derived_rng`)."""
    if rank < saved.world_size:
        return saved.rng if rank == 0 else saved.rank_rng[rank - 1]
    return derived_rng(saved.rng, rank=rank, step=saved.step)


def derived_rng(base: Mapping[str, Any], *, rank: int, step: int) -> dict[str, Any]:
    """Random streams for ``rank`` of a job larger than the one that saved a checkpoint, in
    the form :func:`~nbresume.checkpoint.format.capture_rng` gives: every generator ``base``
    (rank 0's saved states) holds, each seeded from the checkpoint's step, the rank, and rank
    0's saved state of the same generator only, so that a stream the user seeded is derived
    the same way every time even where another one was not seeded (Python's ``random``, left
    to the system's entropy, then changes nothing but its own derived stream). The same
    checkpoint gives the same rank the same streams every time; other ranks and other
    checkpoints get others."""
    import hashlib
    import json
    import random

    def seed(kind: str, saved: bytes) -> int:
        digest = hashlib.blake2b(
            f"nbresume rank streams:{kind}:{step}:{rank}:".encode(), digest_size=8
        )
        digest.update(saved)
        return int.from_bytes(digest.digest(), "little") >> 1

    def saved_json(kind: str) -> bytes:
        return json.dumps(base.get(kind), default=str).encode()

    python = random.Random(seed("python", saved_json("python")))  # noqa: S311
    state: dict[str, Any] = {"python": python.getstate()}
    if "numpy" in base:
        import numpy as np

        state["numpy"] = np.random.RandomState(
            seed("numpy", saved_json("numpy")) % 2**32
        ).get_state()
    torch_state = base.get("torch")
    if torch_state is not None:
        import torch

        torch_seed = seed("torch", torch_state.contiguous().numpy().tobytes())
        state["torch"] = torch.Generator().manual_seed(torch_seed).get_state()
        if base.get("cuda") and torch.cuda.is_available():
            count = min(len(base["cuda"]), torch.cuda.device_count())
            state["cuda"] = [
                torch.Generator(device=f"cuda:{index}")
                .manual_seed(seed("cuda", base["cuda"][index].contiguous().numpy().tobytes()))
                .get_state()
                for index in range(count)
            ]
    return state


def reshaped_notice(saved_world_size: int, world_size: int, step: int) -> str:
    """What a run resumed with another number of processes says once: the change, what was
    kept, and what it means for exactness."""
    kept = min(saved_world_size, world_size)
    streams = f"{_ranks(0, kept - 1)} {'keeps its' if kept == 1 else 'keep their'} random streams"
    if world_size > saved_world_size:
        new = _ranks(saved_world_size, world_size - 1)
        streams += f", {new} {'gets' if world_size - kept == 1 else 'get'} streams derived "
        streams += "from the checkpoint"
    return (
        f"the world size changed from {saved_world_size} to {world_size} process(es) at step "
        f"{step}: the run continues from its newest checkpoint (model, optimizer and values as "
        "saved, sharded state resharded, the data position kept over the whole job so that "
        f"every sample is trained once per epoch; {streams}). From here the run is "
        "reproducible (the same legs give the same bits) but not bit-identical to a run that "
        "never changed shape: the gradients are summed in another order, and other processes "
        "draw other random numbers"
    )


def _ranks(first: int, last: int) -> str:
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


_NO_FIT_FIX = (
    "build the model and optimizer exactly as in the run that saved these checkpoints to "
    "resume it; to train the changed model from scratch, start a new run: a new run name or "
    "another dir= (nbresume never starts over on its own)"
)
#: Per-parameter optimizer state that has the parameter's shape in torch's own optimizers.
_PARAMETER_SHAPED = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta",
     "sum", "exp_inf", "ax", "prev", "step_size", "grad_avg"}
)  # fmt: skip


def no_fit(newest: DoesNotFit, misfits: list[DoesNotFit], location: str) -> CheckpointError:
    """The one error of a restore that found no checkpoint fitting the objects given."""
    steps = ", ".join(str(m.step) for m in misfits) or str(newest.step)
    shown = "; ".join(newest.differences[:8])
    more = f"; and {len(newest.differences) - 8} more" if len(newest.differences) > 8 else ""
    return CheckpointError(
        f"no checkpoint in {location} fits the objects given: the model or optimizer "
        f"changed (checked step(s) {steps}). Step {newest.step} differs: {shown}{more}",
        where=newest.where,
        fix=_NO_FIT_FIX,
    )


def _is_checked_kind(obj: Any) -> bool:
    """Whether ``obj``'s saved state is checked against it before anything is loaded: torch
    modules and optimizers (compared here), and a trainable-only model (whose own load checks
    everything before it changes anything). Other objects are snapshotted instead."""
    if isinstance(obj, TrainableOnly):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))


def _snapshot(obj: Any) -> Any:
    """A copy of a small object's state to put back if a restore fails (``None`` if it
    cannot be copied)."""
    import copy

    try:
        return copy.deepcopy(obj.state_dict())
    except Exception:
        return None


def _describe(value: Any) -> str:
    if isinstance(value, TensorSpec):  # a header's: its safetensors dtype, named as torch's
        return f"{list(value.shape)} {torch_name(value.dtype)}"
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    return type(value).__name__


def _same_tensor_kind(saved: Any, live: Any) -> bool:
    if isinstance(saved, TensorSpec):
        return signature(saved) == signature(live)
    if not (hasattr(saved, "shape") and hasattr(saved, "dtype")):
        return False
    return tuple(saved.shape) == tuple(live.shape) and saved.dtype == live.dtype


def _is_tensor(value: Any, torch: Any) -> bool:
    """A saved tensor: a torch tensor, or a header's description of one."""
    return isinstance(value, (torch.Tensor, TensorSpec))


def _differences(name: str, obj: Any, tree: Any) -> list[str]:
    """What differs between the saved state ``tree`` of ``name`` and the live ``obj``."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    if isinstance(obj, torch.nn.Module):
        return _module_differences(name, obj.state_dict(), tree, torch)
    if isinstance(obj, torch.optim.Optimizer):
        return _optimizer_differences(name, obj, tree, torch)
    return []


#: The attribute under which ``torch.compile``'s wrapper holds the module it compiled.
_COMPILED = "_orig_mod"


def compiled_renamed(saved: Mapping[str, Any], live: Mapping[str, Any]) -> dict[str, Any] | None:
    """``saved`` with its keys renamed to ``live``'s where the two differ only by the
    ``_orig_mod.`` that ``torch.compile`` puts in a compiled module's names (a compiled
    model's checkpoint restored into the plain model, or the other way), else ``None``.

    Only an exact match renames: once every ``_orig_mod`` is left out of the names, each
    saved name must be one live name and each live name one saved name."""
    if saved.keys() == live.keys():
        return None
    plain_saved = {_without_compile(key): key for key in saved}
    plain_live = {_without_compile(key): key for key in live}
    if (
        len(plain_saved) != len(saved)
        or len(plain_live) != len(live)
        or plain_saved.keys() != plain_live.keys()
    ):
        return None
    return {plain_live[plain]: saved[key] for plain, key in plain_saved.items()}


def _without_compile(key: str) -> str:
    return ".".join(part for part in key.split(".") if part != _COMPILED)


def _module_differences(name: str, live: Mapping[str, Any], saved: Any, torch: Any) -> list[str]:
    if not isinstance(saved, Mapping):
        return [f"{name}: the checkpoint holds a {type(saved).__name__}, not a state_dict"]
    saved = compiled_renamed(saved, live) or saved
    out = []
    for key, value in saved.items():
        if key not in live:
            out.append(f"{name}.{key} {_describe(value)} is in the checkpoint, not in the model")
        elif isinstance(live[key], torch.Tensor) and not _same_tensor_kind(value, live[key]):
            out.append(
                f"{name}.{key} is {_describe(value)} in the checkpoint, {_describe(live[key])} here"
            )
    out += [
        f"{name}.{key} {_describe(value)} is in the model, not in the checkpoint"
        for key, value in live.items()
        if key not in saved
    ]
    if out and any(_COMPILED in key.split(".") for key in [*saved, *live]):
        out.insert(
            0,
            f"{name}: the names differ by torch.compile's '{_COMPILED}.' in another way than "
            "a compiled and a plain copy of one model do (compile the model, or not, as in "
            "the run that saved it)",
        )
    return out


def _optimizer_differences(name: str, obj: Any, saved: Any, torch: Any) -> list[str]:
    live = obj.state_dict()
    if (
        not isinstance(saved, Mapping)
        or not isinstance(saved.get("state"), Mapping)
        or not isinstance(saved.get("param_groups"), list)
        or not all(
            isinstance(g, Mapping)
            and isinstance(g.get("params"), list)
            and all(isinstance(p, int) and not isinstance(p, bool) for p in g["params"])
            for g in saved["param_groups"]
        )
    ):
        return [f"{name}: the checkpoint does not hold an optimizer's state_dict"]
    saved_groups, live_groups = saved["param_groups"], live["param_groups"]
    if len(saved_groups) != len(live_groups):
        return [
            f"{name}: {len(saved_groups)} parameter group(s) in the checkpoint, "
            f"{len(live_groups)} here"
        ]
    out = []
    # torch pairs saved and live parameters by position within the groups.
    parameters: dict[Any, tuple[Any, Any]] = {}
    for index, (saved_group, live_group, params) in enumerate(
        zip(saved_groups, live_groups, obj.param_groups, strict=True)
    ):
        if len(saved_group["params"]) != len(live_group["params"]):
            out.append(
                f"{name}: parameter group {index} has {len(saved_group['params'])} "
                f"parameter(s) in the checkpoint, {len(live_group['params'])} here"
            )
            continue
        for saved_id, live_id, parameter in zip(
            saved_group["params"], live_group["params"], params["params"], strict=True
        ):
            parameters[saved_id] = (live_id, parameter)
    if out:
        return out
    builtin = type(obj).__module__.startswith("torch.optim")
    for saved_id, saved_state in saved["state"].items():
        if saved_id not in parameters or not isinstance(saved_state, Mapping):
            out.append(f"{name}: state for parameter {saved_id!r}, which no group holds")
            continue
        live_id, parameter = parameters[saved_id]
        live_state = live["state"].get(live_id)
        for key, value in saved_state.items():
            if not _is_tensor(value, torch):
                if live_state is not None and isinstance(live_state.get(key), torch.Tensor):
                    out.append(
                        f"{name}.state[{saved_id}].{key} is a {type(value).__name__} in the "
                        f"checkpoint, a tensor {_describe(live_state[key])} here"
                    )
                continue
            if live_state is not None and isinstance(live_state.get(key), torch.Tensor):
                expected = live_state[key]
                if not _same_tensor_kind(value, expected):
                    out.append(
                        f"{name}.state[{saved_id}].{key} is {_describe(value)} in the "
                        f"checkpoint, {_describe(expected)} here"
                    )
            elif builtin and key in _PARAMETER_SHAPED and value.shape != parameter.shape:
                out.append(
                    f"{name}.state[{saved_id}].{key} is {_describe(value)} in the checkpoint, "
                    f"its parameter is {_describe(parameter)} here"
                )
        if live_state is not None and set(live_state) != set(saved_state):
            out.append(
                f"{name}.state[{saved_id}] holds {sorted(map(str, saved_state))} in the "
                f"checkpoint, {sorted(map(str, live_state))} here"
            )
    return out
