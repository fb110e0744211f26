"""The user's own random generators are checkpointed state: given to the Checkpointer (as a
keyword or as ``ckpt[name] = g``), each one's stream continues exactly after a resume, in the
same object."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import nbresume
from nbresume.errors import ArgumentError


def draw(generators: dict[str, Any]) -> tuple[float, ...]:
    return (
        torch.rand(1, generator=generators["torch"]).item(),
        float(generators["numpy"].random()),
        generators["python"].random(),
        float(generators["legacy"].rand()),
    )


def train(folder: Path, stop_after: int | None, how: str) -> list[tuple[float, ...]]:
    """Six steps drawing from four generators of the user's; ``stop_after``: stop there."""
    generators: dict[str, Any] = {
        "torch": torch.Generator().manual_seed(1),
        "numpy": np.random.default_rng(0),
        "python": random.Random(3),
        "legacy": np.random.RandomState(5),
    }
    model = torch.nn.Linear(2, 2)
    if how == "keywords":
        ck = nbresume.Checkpointer(folder, every=2, deadline=None, quiet=True, model=model,
                                   **generators)  # fmt: skip
    else:
        ck = nbresume.Checkpointer(folder, every=2, deadline=None, quiet=True, model=model)
        for name, generator in generators.items():
            ck[name] = generator
    drawn = []
    for step in ck.steps(6):
        drawn.append(draw(generators))
        if step + 1 == stop_after:
            ck.request_stop()
    ck.close()
    for name, generator in generators.items():
        assert ck[name] is generator, "ckpt[name] is the user's own object"
    return drawn


@pytest.mark.parametrize("how", ["keywords", "items"])
def test_the_users_generators_continue_exactly_after_a_resume(tmp_path: Path, how: str) -> None:
    uninterrupted = train(tmp_path / "reference", None, how)
    first = train(tmp_path / "run", 3, how)  # stops after step 3 (between two cadence saves)
    rest = train(tmp_path / "run", None, how)
    assert first + rest == uninterrupted


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ),
    ],
)
def test_a_generator_is_restored_into_the_same_object(tmp_path: Path, device: str) -> None:
    generator = torch.Generator(device=device).manual_seed(9)
    ck = nbresume.Checkpointer(tmp_path, every=None, deadline=None, quiet=True, noise=generator)
    torch.rand(3, generator=generator, device=device)
    expected = generator.get_state()
    ck.save(block=True)
    torch.rand(3, generator=generator, device=device)
    ck.close()
    again = nbresume.Checkpointer(tmp_path, every=None, deadline=None, quiet=True, noise=generator)
    again.restore()
    assert torch.equal(generator.get_state(), expected)
    again.close()


def test_a_corrupt_mersenne_twister_position_is_refused_before_any_draw(tmp_path: Path) -> None:
    """NumPy reads a RandomState's position unchecked: out of range, the next draw reads
    outside the state and the process crashes at every restart."""
    from nbresume.checkpoint.state import GeneratorState

    legacy = np.random.RandomState(1)
    state = GeneratorState(legacy).state_dict()
    state["numpy_legacy"][2] = 10**6
    with pytest.raises(ValueError, match="position"):
        GeneratorState(np.random.RandomState(2)).load_state_dict(state)


def test_a_refusal_names_a_fix_that_is_python(tmp_path: Path) -> None:
    class Opaque:
        pass

    with pytest.raises(ArgumentError) as refused:
        nbresume.Checkpointer(tmp_path, quiet=True, thing=Opaque())
    fix = refused.value.fix
    assert "ckpt['thing'] = thing" in fix
    compile(fix.split(": ", 1)[1].split(";")[0], "fix", "exec")  # the suggested line parses
