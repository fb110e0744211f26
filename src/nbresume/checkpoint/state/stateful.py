"""What nbresume saves of an object: its ``state_dict()``, put back by ``load_state_dict()``.

The same protocol as ``torch.distributed.checkpoint.stateful.Stateful``: a model, an
optimizer, a scheduler, a GradScaler, a StatefulDataLoader, and nbresume's own wrappers (the
resumable loader, a random generator's state, a trainable-only model) all have it.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    """An object whose state is a ``state_dict()`` that ``load_state_dict()`` puts back."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> object: ...


def is_stateful(value: object) -> bool:
    """Whether ``value`` has both methods (looked up as the object answers them, so that a
    proxy that forwards them counts)."""
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


__all__ = ["Stateful", "is_stateful"]
