"""What the store reports: a committed checkpoint, a verification, a loaded checkpoint."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nbresume.checkpoint.format import Manifest, state_document
from nbresume.checkpoint.units import format_bytes


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint as its manifest describes it (not yet re-verified)."""

    step: int
    name: str
    location: str
    manifest: Manifest

    @property
    def size(self) -> int:
        return self.manifest.payload_bytes

    @property
    def metrics(self) -> Mapping[str, float]:
        return self.manifest.metrics

    @property
    def created(self) -> str:
        return self.manifest.created


@dataclass(frozen=True)
class VerifyResult:
    """The outcome of checking one checkpoint folder against its manifest."""

    name: str
    step: int
    location: str
    ok: bool
    problem: str = ""
    size: int = 0

    def __str__(self) -> str:
        if self.ok:
            return f"OK    {self.name}  step {self.step}  {format_bytes(self.size)}"
        return f"FAIL  {self.name}  {self.problem}"


@dataclass(frozen=True)
class VerifyReport:
    """Every checkpoint of a folder, checked."""

    location: str
    results: tuple[VerifyResult, ...]
    #: Step folders without a manifest: saves that never committed (on an object store, what
    #: an interrupted write leaves until the next save cleans it). Not checkpoints, not errors.
    uncommitted: tuple[str, ...] = ()
    #: Checkpoints that were deleted while they were being read: the folder's writer applied
    #: its retention meanwhile (``keep``). Gone, not damaged: neither checked nor errors.
    removed: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True when there is at least one checkpoint and every one verified."""
        return bool(self.results) and all(r.ok for r in self.results)

    @property
    def summary(self) -> str:
        good = sum(r.ok for r in self.results)
        return f"OK {good}/{len(self.results)}, errors {len(self.results) - good}"


@dataclass
class LoadedCheckpoint:
    """A checkpoint read back and verified: its tensors, its JSON documents and its manifest."""

    step: int
    location: str
    manifest: Manifest
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    #: Newer checkpoints that failed verification and were passed over, newest first.
    skipped: list[VerifyResult] = field(default_factory=list)
    #: ``state.json`` checked and rebuilt, when it is a Checkpointer's (else ``None``).
    state: state_document.SavedState | None = None
    #: Reads the saved bytes into the live tensors the checkpoint's tensors are (a restore
    #: that reads into the objects' own memory: :mod:`~nbresume.checkpoint.store.streaming`);
    #: ``None`` when there are none. Called once, when the restore is applied.
    fill: Callable[[], None] | None = None
