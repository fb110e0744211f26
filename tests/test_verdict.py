"""The verdict on a Checkpointer's counters: a data position or a step out of range is damage.

A checkpoint whose ``state.json`` was edited (its manifest resealed, so that every hash
matches) to record a loader position of another shape that cannot be (``replicas`` or
``batch_size`` of 0) or a step that is not its own is refused by ``verify``, passed over by a
restore for the checkpoint before, with a warning that names the file and what is wrong.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.test_loadable import reseal
from torch.utils.data import DataLoader, TensorDataset

from nbresume import Checkpointer, CheckpointStore


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, DataLoader[Any]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(64, 4))
    return model, optimizer, DataLoader(data, batch_size=4, shuffle=True)


def checkpointer(folder: Path) -> Checkpointer:
    model, optimizer, loader = build()
    return Checkpointer(
        folder, model=model, optimizer=optimizer, loader=loader, every=None, deadline=None,
        async_save=False, keep=None, quiet=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run saved at steps 3 and 6, in the middle of its first epoch."""
    folder = tmp_path_factory.mktemp("verdict") / "run"
    ckpt = checkpointer(folder)
    for index, _ in enumerate(ckpt.loader(), start=1):
        if index in (3, 6):
            ckpt.save(index)
        if index == 6:
            break
    ckpt.close()
    return folder


def edit_state(folder: Path, change: Callable[[dict[str, Any]], None]) -> None:
    path = folder / "state.json"
    state = json.loads(path.read_text())
    change(state)
    path.write_text(json.dumps(state))
    reseal(folder)


def loader_field(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(state: dict[str, Any]) -> None:
        assert state["objects"]["loader"]["position"] == 6
        state["objects"]["loader"][key] = value

    return change


def step(state: dict[str, Any]) -> None:
    state["step"] = 999999


DAMAGES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "replicas of 0": (loader_field("replicas", 0), "'replicas' is 0,"),
    "a batch size of 0": (loader_field("batch_size", 0), "'batch_size' is 0,"),
    "a negative batch size": (loader_field("batch_size", -4), "'batch_size' is -4"),
    "a negative position": (loader_field("position", -1), "'position' is -1,"),
    "a step that is not the checkpoint's": (step, "'step' is 999999"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_counter_out_of_range_is_refused_by_verify_and_passed_over_by_restore(
    template: Path, tmp_path: Path, damage: str
) -> None:
    change, said = DAMAGES[damage]
    run = tmp_path / "run"
    shutil.copytree(template, run)
    edit_state(run / "000000000006", change)

    report = CheckpointStore(run).verify()
    assert [(r.step, r.ok) for r in report.results] == [(3, True), (6, False)]
    problem = report.results[-1].problem
    assert "000000000006/state.json" in problem, problem
    assert said in problem, problem

    ckpt = checkpointer(run)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ckpt.restore() == 3
    ckpt.close()
    skipped = [str(w.message) for w in caught if "skipped" in str(w.message)]
    assert len(skipped) == 1, skipped
    assert said in skipped[0], skipped
    with pytest.warns(RuntimeWarning, match=said):
        assert CheckpointStore(run).load().step == 3
