"""The user's own random generators as checkpointed state.

A ``torch.Generator`` (on any device), a NumPy ``Generator`` or ``RandomState`` and a
``random.Random`` hold a random stream the training loop draws from, like the global ones
nbresume always saves. Given to the Checkpointer (``Checkpointer(..., noise=g)`` or
``ckpt["noise"] = g``), each is wrapped in a :class:`GeneratorState`: its state is saved with
every checkpoint and put back into the same object by ``restore()``, so that the stream
continues exactly. The states are plain values and tensors (never a pickle).
"""

from __future__ import annotations

import random
from typing import Any

from nbresume.checkpoint.format import check_mt19937_position


def is_generator(value: Any) -> bool:
    """Whether ``value`` is a random generator whose state nbresume can save."""
    if isinstance(value, random.Random):
        return True
    kind = type(value)
    if kind.__module__.startswith("torch") and kind.__name__ == "Generator":
        return True
    module = kind.__module__
    return module.startswith("numpy.random") and kind.__name__ in ("Generator", "RandomState")


class GeneratorState:
    """``state_dict()`` / ``load_state_dict()`` for one of the user's generators."""

    def __init__(self, generator: Any) -> None:
        self.generator = generator

    def __repr__(self) -> str:
        return f"GeneratorState({self.generator!r})"

    def state_dict(self) -> dict[str, Any]:
        generator = self.generator
        if isinstance(generator, random.Random):
            version, internal, gauss = generator.getstate()
            return {"python": [version, list(internal), gauss]}
        kind = type(generator).__name__
        if kind == "Generator" and hasattr(generator, "get_state"):  # torch
            return {"torch": generator.get_state(), "device": str(generator.device)}
        if kind == "Generator":  # NumPy: its bit generator's state (ints and arrays)
            return {"numpy": generator.bit_generator.state}
        return {"numpy_legacy": list(generator.get_state())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        generator = self.generator
        if isinstance(generator, random.Random):
            version, internal, gauss = state["python"]
            generator.setstate((version, tuple(internal), gauss))
        elif "torch" in state:
            generator.set_state(state["torch"])
        elif "numpy" in state:
            inner = state["numpy"].get("state")
            if isinstance(inner, dict) and "pos" in inner:  # MT19937
                check_mt19937_position(inner["pos"])
            generator.bit_generator.state = state["numpy"]
        else:
            legacy = tuple(state["numpy_legacy"])
            check_mt19937_position(legacy[2])
            generator.set_state(legacy)
