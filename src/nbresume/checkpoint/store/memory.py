"""Running out of memory while a checkpoint is read or written: told apart from damage.

An allocation the system refuses (``ENOMEM`` from a mapping or a read, Python's MemoryError,
torch's allocator failing) says nothing about the checkpoint: a restore that took it for
damage would pass over every checkpoint as broken ("no checkpoint verifies") while ``nbresume
verify`` finds them fine. It is reported as :class:`~nbresume.errors.MemoryLimitError`,
naming the limit that bounds this process (:func:`~nbresume.checkpoint.hooks.available_memory`)
and the fix.
"""

from __future__ import annotations

import errno

from nbresume.checkpoint import hooks
from nbresume.checkpoint.units import format_bytes
from nbresume.errors import MemoryLimitError

#: What torch's host allocator and CUDA's say when an allocation fails.
_ALLOCATOR_WORDS = (
    "can't allocate memory",
    "cannot allocate memory",
    "not enough memory",
    "out of memory",
)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation the system refused."""
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, OSError):
        return exc.errno == errno.ENOMEM
    if isinstance(exc, RuntimeError):
        text = str(exc).lower()
        return any(words in text for words in _ALLOCATOR_WORDS)
    return False


def memory_error(exc: BaseException, *, doing: str, where: str) -> MemoryLimitError:
    """The error for ``exc`` (an allocation refused) while ``doing`` something at ``where``."""
    available, bound = hooks.available_memory()
    limit = (
        f"; this process may allocate {format_bytes(available)} more ({bound})"
        if available is not None
        else ""
    )
    reason = (str(exc).splitlines() or [type(exc).__name__])[0]
    return MemoryLimitError(
        f"out of memory while {doing} ({reason}){limit}. The checkpoint is not damaged "
        "(`nbresume verify` checks it without loading it)",
        where=where,
        fix="give the process more memory (a larger memory limit, `ulimit -v unlimited`, a "
        "machine with more RAM) or free some before this runs",
    )
