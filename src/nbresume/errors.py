"""Every error nbresume raises to its caller: one base class, subclasses named after the domain.

Each error says where it happened, what went wrong and what to do about it, and keeps those
parts as attributes so that a panel or a log line can show them separately. An exception
that never leaves the module raising it (a signal between two of its functions, an OSError a
bucket's reader turns into a skipped checkpoint) stays in that module; so does the resume
check's ``RunFailed``, which only ``nbresume.resumecheck`` raises and catches.
"""

from __future__ import annotations

from collections.abc import Iterable


class NbresumeError(Exception):
    """Base class of nbresume's errors.

    Attributes:
        where: the place the error is about (a folder, a file, a URL), or ``""``.
        fix: what the user can do about it, in their words, or ``""``.
    """

    def __init__(self, message: str, *, where: str = "", fix: str = "") -> None:
        self.message = message
        self.where = where
        self.fix = fix
        super().__init__(self._render())

    def _render(self) -> str:
        text = self.message
        if self.where and self.where not in text:
            text = f"{self.where}: {text}"
        if self.fix:
            ended = text.endswith((".", "?", "!"))  # "did you mean every=?" ends a sentence
            text = f"{text} Fix: {self.fix}" if ended else f"{text}. Fix: {self.fix}"
        return text


class CheckpointError(NbresumeError):
    """A checkpoint could not be written, read or verified."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint exists but does not match its manifest, or its files are malformed."""


class MemoryLimitError(CheckpointError):
    """A checkpoint could not be read or written for lack of memory (an allocation refused:
    ENOMEM, the address-space limit): the checkpoint is not damaged, and is never passed
    over as if it were."""


class NoCheckpointError(CheckpointError):
    """No committed checkpoint that verifies was found."""


class StorageFullError(CheckpointError):
    """The durable folder has too few free bytes or inodes for the next checkpoint.

    Attributes:
        needed: bytes the checkpoint needs.
        free: bytes free when the check ran (``None`` when the store cannot tell).
    """

    def __init__(
        self,
        message: str,
        *,
        where: str = "",
        fix: str = "",
        needed: int = 0,
        free: int | None = None,
    ) -> None:
        self.needed = needed
        self.free = free
        super().__init__(message, where=where, fix=fix)


class StorageError(CheckpointError, OSError):
    """The storage backend failed (permissions, a vanished mount, a network store error).

    It is also an OSError, what Python raises when a file system fails, so that code that
    catches those catches it too (its ``errno`` is ``None``)."""


class FolderInUseError(CheckpointError):
    """Another live writer holds the checkpoint folder's writer lease.

    Attributes:
        holder: what the lease file says of the holder (host, pid, since, renewed, ...), or
            ``None`` where it could not be read.
    """

    def __init__(
        self, message: str, *, where: str = "", fix: str = "", holder: object = None
    ) -> None:
        self.holder = holder
        super().__init__(message, where=where, fix=fix)


class LeaseLostError(FolderInUseError):
    """This writer no longer holds the folder's lease (a newer Checkpointer in this process,
    or another process after the lease expired, took it over): it must not write there."""


_BASE_FIX = (
    "build the model from the same base weights as the run that saved the checkpoint (the same "
    "pretrained file and revision, the same layers frozen) before restoring; to fine-tune "
    "another base, start a new run in another folder"
)


class BaseMismatchError(CheckpointError):
    """The model given to a trainable-only restore is not the one the checkpoint was saved
    from: a frozen weight, a shape, a dtype or a tensor name differs.

    Attributes:
        tensor: the name of the first tensor that differs.
        differences: one line per differing tensor.
    """

    def __init__(
        self,
        message: str,
        *,
        where: str = "",
        fix: str = _BASE_FIX,
        tensor: str = "",
        differences: Iterable[str] = (),
    ) -> None:
        self.tensor = tensor
        self.differences = list(differences)
        super().__init__(message, where=where, fix=fix)


class DoesNotFit(CheckpointError):
    """A checkpoint whose saved objects differ from the live ones (names, shapes, dtypes)."""

    def __init__(
        self, message: str, *, where: str, fix: str, step: int, differences: list[str]
    ) -> None:
        self.step = step
        self.differences = differences
        super().__init__(message, where=where, fix=fix)


class UsageError(NbresumeError):
    """nbresume was called in a way it does not support."""


class ArgumentError(UsageError, ValueError, TypeError):
    """An argument of a public function has a value or a type nbresume does not take.

    The message names the call, the argument and the value; ``fix`` says what to pass. It is
    also a ValueError and a TypeError, what Python raises for a bad argument, so that code
    that catches those keeps working.
    """


class PreflightError(NbresumeError):
    """A first-cell check failed where a failure must stop the run: a Kaggle batch run (no one
    is watching it), or ``strict=True``.

    Attributes:
        report: the :class:`nbresume.preflight_checks.Report` with every check.
    """

    def __init__(
        self, message: str, *, where: str = "", fix: str = "", report: object = None
    ) -> None:
        self.report = report
        super().__init__(message, where=where, fix=fix)


class KaggleError(NbresumeError):
    """Kaggle refused a request or could not be reached.

    Attributes:
        reason: ``"quota"``, ``"sessions"``, ``"not-found"``, ``"auth"``, ``"network"`` or
            ``"other"``.
    """

    def __init__(self, message: str, *, where: str = "", fix: str = "", reason: str = "other"):
        self.reason = reason
        super().__init__(message, where=where, fix=fix)


class ChainError(NbresumeError):
    """A leg of a chain failed, or its output did not verify."""


class SecretInCheckpointError(NbresumeError):
    """What the checkpoint would upload holds a credential."""
