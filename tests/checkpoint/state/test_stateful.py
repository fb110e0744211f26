"""What nbresume saves of an object is what DCP saves of it: the ``Stateful`` protocol, which a
model, an optimizer and nbresume's own wrappers all have, and a plain value has not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.stateful import Stateful as DcpStateful
from torch.utils.data import DataLoader

import nbresume
from nbresume.checkpoint.state import (
    GeneratorState,
    ResumableLoader,
    Stateful,
    TrainableOnly,
    is_stateful,
)


def test_what_a_checkpointer_saves_is_stateful_as_dcp_types_it() -> None:
    model = torch.nn.Linear(2, 2)
    saved = [
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        ResumableLoader(DataLoader(list(range(4)))),
        GeneratorState(torch.Generator()),
        TrainableOnly(torch.nn.Linear(2, 2)),
    ]
    for value in saved:
        assert is_stateful(value)
        assert isinstance(value, Stateful)
        assert isinstance(value, DcpStateful)


@pytest.mark.parametrize("value", [3, "text", {"a": 1}, None])
def test_a_plain_value_is_not_stateful(value: object) -> None:
    assert not is_stateful(value)


def test_an_object_whose_methods_are_not_callable_is_a_value_not_state(tmp_path: Path) -> None:
    """A ``state_dict`` attribute that is not a method does not make an object stateful: it
    is refused as a plain value when set, rather than failing at the first save."""

    class Named:
        state_dict = "not a method"
        load_state_dict = "nor this"

    assert not is_stateful(Named())
    ckpt = nbresume.Checkpointer(tmp_path / "run", quiet=True, model=torch.nn.Linear(2, 2))
    try:
        with pytest.raises(nbresume.NbresumeError):
            ckpt["named"] = Named()
    finally:
        ckpt.close()
