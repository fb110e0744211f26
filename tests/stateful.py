"""Small stateful objects and options shared by the Checkpointer's tests."""

from __future__ import annotations

from typing import Any

#: No cadence, no deadline and blocking saves, unless a test says otherwise.
QUIET: dict[str, Any] = {"every": None, "deadline": None, "async_save": False}


class Counter:
    """The smallest stateful object: how many steps the loop body ran."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.count = state["count"]
