"""Training with ``torch.distributed``: one checkpoint for the whole job, every decision shared.

With a default process group of more than one process (``torchrun``,
``torch.multiprocessing``, accelerate's ``notebook_launcher``), the Checkpointer:

1. **Saves once.** The model and optimizer of data-parallel training are replicated, so rank 0
   alone captures and writes them. Every rank sends rank 0 its own RNG states first (as bytes:
   JSON and a safetensors buffer, never pickle), which is also the point every rank must reach
   before anything is written. After a blocking save, rank 0 tells every rank the outcome:
   a failed write raises on every rank, none is left waiting.
2. **Restores the same step everywhere.** Rank 0 finds the newest checkpoint that verifies
   (falling back past corrupt ones) and tells the others its step; every rank loads exactly
   that step and puts back its own RNG states.
3. **Decides together.** A signal, a deadline, ``request_save()`` / ``request_stop()`` or a
   panel click may reach one rank only. At every step boundary the ranks combine their flags
   in one small ``all_reduce`` (max of five integers), so all of them save or stop at the same
   step; a rank that waited alone in a collective would hang the job.

Control messages go through the default group when it has a CPU backend (gloo); under a
CUDA-only backend (NCCL) nbresume creates one gloo group of its own, so that a step boundary
never waits for the GPU. :class:`Solo` stands for the one process of a program without a
process group, so that callers need no second path. Nothing here runs in a background
thread: a collective from a second thread could interleave with the training loop's own and
deadlock.
"""

from __future__ import annotations

import atexit
import json
import sys
import weakref
from collections.abc import Sequence
from typing import Any

from nbresume import errors
from nbresume.checkpoint.format import flatten, tensorfile, unflatten
from nbresume.errors import CheckpointError, NbresumeError


class Group:
    """The processes of the job, seen from one of them, with the few collectives nbresume
    needs. Every method is a collective: every rank must call it, in the same order."""

    def __init__(self, group: Any, rank: int, world_size: int) -> None:
        self._group = group
        self.rank = rank
        self.world_size = world_size

    def __repr__(self) -> str:
        return f"Group(rank={self.rank}, world_size={self.world_size})"

    def agree(self, flags: Sequence[int]) -> list[int]:
        """The element-wise maximum of ``flags`` over all ranks (for 0/1 flags: any rank)."""
        import torch
        import torch.distributed as dist

        values = torch.tensor([int(f) for f in flags], dtype=torch.int64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self._group)
        return [int(v) for v in values.tolist()]

    def raise_any(self, error: BaseException | None, elsewhere: NbresumeError) -> None:
        """Raise ``error`` on this rank where it is not ``None``, and ``elsewhere`` on every
        other rank when any rank has one: none goes on alone after a step another failed."""
        (failed,) = self.agree([error is not None])
        if error is not None:
            raise error
        if failed:
            raise elsewhere

    def broadcast_ints(self, values: Sequence[int]) -> list[int]:
        """Rank 0's ``values`` on every rank (the others pass as many placeholders)."""
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([int(v) for v in values], dtype=torch.int64)
        dist.broadcast(tensor, src=0, group=self._group)
        return [int(v) for v in tensor.tolist()]

    def broadcast_bytes(self, data: bytes) -> bytes:
        """Rank 0's ``data`` on every rank (what the others pass is ignored)."""
        import torch
        import torch.distributed as dist

        (size,) = self.broadcast_ints([len(data) if self.rank == 0 else 0])
        if size == 0:
            return b""
        buffer = _as_tensor(data) if self.rank == 0 else torch.empty(size, dtype=torch.uint8)
        dist.broadcast(buffer, src=0, group=self._group)
        return buffer.numpy().tobytes()

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order, on every rank."""
        import torch
        import torch.distributed as dist

        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self._group)
        counts = [int(s.item()) for s in sizes]
        longest = max(counts)
        if longest == 0:
            return [b"" for _ in counts]
        padded = torch.zeros(longest, dtype=torch.uint8)
        if data:
            padded[: len(data)] = _as_tensor(data)
        out = [torch.empty(longest, dtype=torch.uint8) for _ in counts]
        dist.all_gather(out, padded, group=self._group)
        return [o[:n].numpy().tobytes() for o, n in zip(out, counts, strict=True)]

    def broadcast_error(self, error: BaseException | None) -> BaseException | None:
        """Rank 0's error (or ``None``) on every rank: rank 0 gets its own back, the others an
        error of the same nbresume class with the same message, place and fix."""
        payload = b""
        if self.rank == 0 and error is not None:
            payload = json.dumps(_describe(error)).encode()
        payload = self.broadcast_bytes(payload)
        if self.rank == 0:
            return error
        if not payload:
            return None
        return _rebuild(json.loads(payload))


class Solo(Group):
    """One process and no process group: every collective returns this process's own part,
    so that the code of a save or a restore reads the same with one process as with many."""

    def __init__(self) -> None:
        super().__init__(None, 0, 1)

    def agree(self, flags: Sequence[int]) -> list[int]:
        return [int(f) for f in flags]

    def broadcast_ints(self, values: Sequence[int]) -> list[int]:
        return [int(v) for v in values]

    def broadcast_bytes(self, data: bytes) -> bytes:
        return data

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        return [data]

    def broadcast_error(self, error: BaseException | None) -> BaseException | None:
        return error


#: The group of the last lookup: (the default group it was made for, nbresume's group). The
#: default group is held weakly, and the cache is emptied at exit: a process group that
#: outlives ``destroy_process_group()`` into interpreter shutdown can abort the process there
#: (gloo's threads: "terminate called without an active exception").
_CACHE: list[tuple[weakref.ref[Any], Group]] = []
atexit.register(_CACHE.clear)


def current() -> Group | None:
    """The job's processes when ``torch.distributed`` runs with more than one, else ``None``.

    Looks only: nothing is imported when the program has not imported ``torch.distributed``.
    """
    dist: Any = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    world_size = int(dist.get_world_size())
    if world_size < 2:
        return None
    world = dist.group.WORLD
    for made_for, group in _CACHE:
        if made_for() is world:
            return group
    backend = str(dist.get_backend()).lower()
    # "gloo", "mpi" or a mixed "cpu:gloo,cuda:nccl" carry CPU tensors; NCCL alone does not.
    own = None if ("gloo" in backend or "mpi" in backend) else dist.new_group(backend="gloo")
    group = Group(own, int(dist.get_rank()), world_size)
    _CACHE[:] = [(weakref.ref(world), group)]
    return group


def pack(tree: Any, *, name: str) -> bytes:
    """``tree`` (tensors, arrays and plain values) as bytes, without pickle: the length of a
    JSON document, the document, then a safetensors buffer of its tensors."""
    document, tensors = flatten(tree, name=name)
    text = json.dumps(document).encode()
    encoded = tensorfile.encode(tensors)
    return b"".join([len(text).to_bytes(8, "little"), text, *map(bytes, encoded.chunks())])


def unpack(data: bytes, *, where: str) -> Any:
    """The tree that :func:`pack` turned into ``data``."""
    size = int.from_bytes(data[:8], "little")
    document = json.loads(data[8 : 8 + size])
    tensors = tensorfile.decode(bytearray(data[8 + size :]), where=where)
    return unflatten(document, tensors, where=where)


def gather(group: Group, tree: Any, *, name: str, where: str) -> list[Any] | None:
    """Every rank's ``tree`` on rank 0, in rank order (``None`` on the other ranks): the
    point every rank reaches before a save writes anything."""
    packed = group.all_gather_bytes(pack(tree, name=name))
    if group.rank != 0:
        return None
    return [unpack(data, where=f"{where} (rank {r})") for r, data in enumerate(packed)]


def _as_tensor(data: bytes) -> Any:
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _describe(error: BaseException) -> dict[str, str]:
    if isinstance(error, NbresumeError):
        return {
            "kind": type(error).__name__,
            "message": error.message,
            "where": error.where,
            "fix": error.fix,
        }
    return {"kind": "", "message": f"{type(error).__name__}: {error}", "where": "", "fix": ""}


def _rebuild(described: dict[str, str]) -> NbresumeError:
    kind = getattr(errors, described.get("kind") or "CheckpointError", None)
    if not (isinstance(kind, type) and issubclass(kind, CheckpointError)):
        kind = CheckpointError
    return kind(
        f"on rank 0: {described['message']}",
        where=described.get("where", ""),
        fix=described.get("fix", ""),
    )
