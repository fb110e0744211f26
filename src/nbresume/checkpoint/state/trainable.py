"""Trainable-only state: checkpoints of a fine-tuning run hold only what training changes.

When most of a model is frozen (LoRA and other adapters, a frozen backbone under a new head),
a full ``state_dict`` is mostly the base weights, which every run loads from the same place
anyway. :class:`TrainableOnly` wraps the module and gives the Checkpointer a state that holds:

- every parameter with ``requires_grad=True`` (or that had it at an earlier save), in full;
- every persistent buffer whose contents differ from what they were when the wrapper was
  created (BatchNorm running statistics of layers in train mode, counters), in full;
- for everything else (frozen parameters, buffers that never changed), only a fingerprint:
  each tensor's name, dtype, shape and SHA-256, and one SHA-256 over those records.

The buffer rule asks the tensors, not the modules: a buffer is saved exactly when it changed,
whether its module was in train mode, in eval mode, or updated by hand, so nothing that
changed can be left out; a large buffer that never changes costs a hash per save and no bytes.
Frozen parameters are hashed once per wrapper (they do not change) and the digests are cached.

On restore the wrapper compares the fingerprint with the model it wraps before it changes
anything: a different tensor name, shape, dtype or content raises :class:`BaseMismatchError`,
which names the first differing tensor. Only then are the saved tensors copied in place, so an
optimizer built over the model's parameters keeps pointing at them.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from nbresume.errors import BaseMismatchError, CheckpointError, CorruptCheckpointError, UsageError

if TYPE_CHECKING:
    import torch

FORMAT = "nbresume-trainable"
VERSION = 1


def tensor_sha256(tensor: torch.Tensor) -> str:
    """The SHA-256 of a tensor's bytes: its elements in C order, in the machine's byte order
    (little-endian on every platform torch supports)."""
    import torch

    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    digest = hashlib.sha256()
    if flat.numel():
        digest.update(flat.view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _record(name: str, tensor: torch.Tensor, sha256: str) -> list[Any]:
    return [name, _dtype_name(tensor), list(tensor.shape), sha256]


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def fingerprint_of(records: Iterable[list[Any]]) -> str:
    """One SHA-256 over per-tensor records ``[name, dtype, shape, sha256]``, in name order:
    one line ``name<TAB>dtype<TAB>shape<TAB>sha256`` per tensor, shape as ``2x3``."""
    digest = hashlib.sha256()
    for name, dtype, shape, sha in sorted(records, key=lambda r: str(r[0])):
        dims = "x".join(str(int(d)) for d in shape)
        digest.update(f"{name}\t{dtype}\t{dims}\t{sha}\n".encode())
    return digest.hexdigest()


class TrainableOnly:
    """A stateful view of ``module`` whose state is only what fine-tuning changes.

    Give it to a Checkpointer in place of the model (``model=nbresume.trainable_only(model)``,
    or ``Checkpointer(..., trainable_only=True)``, which wraps every ``nn.Module``). Wrap the
    model once its base weights are loaded and its layers frozen, before training: buffers are
    saved when they differ from what they were at that moment.

    Attributes:
        module: the wrapped module.
        frozen_hashes: how many frozen tensors this wrapper has hashed: each frozen parameter
            once, however many saves and restores follow.
        fingerprint_seconds: the time spent hashing frozen parameters so far.
    """

    def __init__(self, module: Any) -> None:
        import torch

        if not isinstance(module, torch.nn.Module):
            raise UsageError(
                f"trainable_only() takes a torch.nn.Module, not a {type(module).__name__}",
                fix="pass the model itself: trainable_only(model)",
            )
        for name, param in module.named_parameters():
            if any(cls.__name__ == "DTensor" for cls in type(param).__mro__):
                raise UsageError(
                    f"trainable_only() cannot fingerprint {name!r}: it is sharded across ranks "
                    "(a DTensor)",
                    fix="checkpoint a sharded model without trainable_only",
                )
        self.module: torch.nn.Module = module
        self.frozen_hashes = 0
        self.fingerprint_seconds = 0.0
        self._cache: dict[str, tuple[tuple[Any, ...], str]] = {}
        #: Parameters that trained at some save (or were restored in full): frozen later, they
        #: no longer hold the base's values, so they stay saved in full.
        self._trained: set[str] = set()
        _, buffers = self._split()
        #: The buffers' digests as the base had them: a buffer is saved once it differs.
        self._reference = {name: tensor_sha256(t) for name, t in buffers.items()}

    # -- the model's state, split --------------------------------------------------------------

    def _split(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The module's state entries (as its ``state_dict`` names them): parameters, buffers."""
        ids = {id(p) for p in self.module.parameters()}
        params: dict[str, torch.Tensor] = {}
        buffers: dict[str, torch.Tensor] = {}
        for name, tensor in self.module.state_dict(keep_vars=True).items():
            (params if id(tensor) in ids else buffers)[name] = tensor
        return params, buffers

    def _frozen_sha256(self, name: str, tensor: torch.Tensor) -> str:
        """A frozen parameter's digest, computed once: frozen weights do not change."""
        identity = (id(tensor), tensor.data_ptr(), tuple(tensor.shape), tensor.dtype,
                    tensor.device)  # fmt: skip
        cached = self._cache.get(name)
        if cached is not None and cached[0] == identity:
            return cached[1]
        started = time.perf_counter()
        sha = tensor_sha256(tensor)
        self.fingerprint_seconds += time.perf_counter() - started
        self.frozen_hashes += 1
        self._cache[name] = (identity, sha)
        return sha

    def _frozen_records(
        self, params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], list[list[Any]]]:
        """What is saved in full, and the records of the frozen part."""
        saved: dict[str, torch.Tensor] = {}
        records: list[list[Any]] = []
        for name, tensor in params.items():
            if tensor.requires_grad or name in self._trained:
                self._trained.add(name)
                saved[name] = tensor.detach()
            else:
                records.append(_record(name, tensor, self._frozen_sha256(name, tensor)))
        for name, tensor in buffers.items():
            sha = tensor_sha256(tensor)
            if sha != self._reference.get(name):
                saved[name] = tensor.detach()
            else:
                records.append(_record(name, tensor, sha))
        records.sort(key=lambda r: str(r[0]))
        return saved, records

    @property
    def fingerprint(self) -> str:
        """The SHA-256 of the frozen part as it is now (see :func:`fingerprint_of`)."""
        return fingerprint_of(self._frozen_records(*self._split())[1])

    # -- the Stateful protocol -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The trainable tensors and changed buffers, in full; the frozen part as a fingerprint."""
        saved, records = self._frozen_records(*self._split())
        return {
            "format": FORMAT,
            "version": VERSION,
            "tensors": saved,
            "frozen": {"sha256": fingerprint_of(records), "tensors": records},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Check the frozen part against the checkpoint's fingerprint, then copy the saved
        tensors in place. Nothing changes unless everything matches."""
        import torch

        saved, records = _parse(state)
        params, buffers = self._split()
        live: dict[str, torch.Tensor] = {**params, **buffers}
        problems: list[tuple[str, str]] = []
        missing = [n for n in [*saved, *records] if n not in live]
        problems += [(n, f"{n!r} is in the checkpoint but not in this model") for n in missing]
        problems += [
            (n, f"{n!r} is in this model but not in the checkpoint")
            for n in live
            if n not in saved and n not in records
        ]
        # In the model's order, the base first: a different base is the likely cause.
        for name, tensor in live.items():
            if name in records:
                dtype, shape, _ = records[name]
                problems += _shape_problems(name, tensor, dtype, shape)
        for name, tensor in live.items():
            if name in saved:
                problems += _shape_problems(
                    name, tensor, _dtype_name(saved[name]), list(saved[name].shape)
                )
        if not problems:  # the names and shapes agree: compare the contents
            for name, tensor in live.items():  # in the model's order: the first is named
                if name not in records:
                    continue
                sha = records[name][2]
                here = (
                    self._frozen_sha256(name, tensor)
                    if name in params and not tensor.requires_grad
                    else tensor_sha256(tensor)
                )
                if here != sha:
                    line = f"{name!r} has other contents (sha256 {here[:12]}... here, "
                    problems.append((name, f"{line}{sha[:12]}... in the checkpoint)"))
        if problems:
            first, line = problems[0]
            others = len(problems) - 1
            more = f" (and {others} more tensor{'s' if others > 1 else ''})" if others else ""
            raise BaseMismatchError(
                f"this model is not the base the checkpoint was trained on: {line}{more}",
                tensor=first,
                differences=[text for _, text in problems],
            )
        with torch.no_grad():
            for name, tensor in saved.items():
                live[name].copy_(tensor)
                self._cache.pop(name, None)  # a frozen parameter given new contents
                if name in params:
                    self._trained.add(name)

    def __repr__(self) -> str:
        return f"TrainableOnly({type(self.module).__name__})"


def _shape_problems(
    name: str, tensor: torch.Tensor, dtype: str, shape: list[int]
) -> list[tuple[str, str]]:
    here_dtype, here_shape = _dtype_name(tensor), list(tensor.shape)
    if here_dtype != dtype or here_shape != shape:
        return [(name, f"{name!r} is {here_dtype} {here_shape} here and {dtype} {shape} in the "
                       "checkpoint")]  # fmt: skip
    return []


def _parse(
    state: Mapping[str, Any],
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, list[int], str]]]:
    """The saved tensors and the frozen records of a trainable-only state, validated."""
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        raise CheckpointError(
            "the checkpoint does not hold a trainable-only state (it was saved from the model "
            "itself, not from trainable_only(model))",
            fix="restore it as it was saved: pass the model without trainable_only, or start a "
            "new run in another folder",
        )
    if state.get("version") != VERSION:
        raise CorruptCheckpointError(
            f"trainable-only state of version {state.get('version')!r}: this nbresume reads "
            f"version {VERSION}",
            fix="pip install -U nbresume",
        )
    try:
        saved = dict(state["tensors"])
        records = {
            str(name): (str(dtype), [int(d) for d in shape], str(sha))
            for name, dtype, shape, sha in state["frozen"]["tensors"]
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"invalid trainable-only state: {exc}") from None
    return saved, records


def trainable_only(module: Any) -> TrainableOnly:
    """Checkpoint only what fine-tuning changes: ``Checkpointer(dir, model=trainable_only(m))``.

    The checkpoint holds the parameters with ``requires_grad=True`` and the buffers that
    changed; the frozen weights are recorded by their SHA-256 only, and a restore onto a
    different base raises :class:`BaseMismatchError` naming the tensor that differs.
    """
    return TrainableOnly(module)
