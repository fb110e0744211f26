"""Small stateful objects and options shared by the tests and the scripts they run."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

#: No cadence, no deadline and blocking saves, unless a test says otherwise.
QUIET: dict[str, Any] = {"every": None, "deadline": None, "async_save": False}


class Counter:
    """The smallest stateful object: how many steps the loop body ran."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.count = state["count"]


class Weights:
    """The smallest model: one numpy array (``size`` zeros at first) that training changes."""

    def __init__(self, size: int = 3, dtype: Any = np.float64) -> None:
        self.w = np.zeros(size, dtype=dtype)

    def state_dict(self) -> dict[str, np.ndarray]:
        return {"w": self.w.copy()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.w = np.asarray(state["w"]).copy()
