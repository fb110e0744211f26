"""Gradient accumulation: a save between two optimizer steps keeps the gradients accumulated
since the last one, so that a stop or a kill there resumes exactly (a save on an
accumulation boundary saves nothing more)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import nbresume
from nbresume.checkpoint.format import step_dirname

ACCUMULATE = 4


def train(
    folder: Path, *, stop_after: int | None = None, every: int = 3
) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.utils.data.TensorDataset(torch.randn(48, 4), torch.randn(48, 1))
    options = {"keep": None, "deadline": None, "quiet": True, "async_save": False}
    ck = nbresume.Checkpointer(folder, every=every, model=model, optimizer=optimizer, **options)
    batches = ck.loader(torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)).batches()
    for step in ck.steps(30):
        x, y = next(batches)
        loss = torch.nn.functional.mse_loss(model(x), y) / ACCUMULATE
        loss.backward()  # type: ignore[no-untyped-call]
        if (step + 1) % ACCUMULATE == 0:
            optimizer.step()
            optimizer.zero_grad()
        if step + 1 == stop_after:
            ck.request_stop()
    ck.close()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("stop_after", [5, 10, 13, 15])
def test_a_stop_between_two_optimizer_steps_resumes_exactly(
    tmp_path: Path, stop_after: int
) -> None:
    reference = train(tmp_path / "reference")
    train(tmp_path / "run", stop_after=stop_after)
    resumed = train(tmp_path / "run")
    for key, value in reference.items():
        assert torch.equal(resumed[key], value), f"stopped after {stop_after}: {key}"


def test_only_a_save_between_optimizer_steps_carries_gradients(tmp_path: Path) -> None:
    train(tmp_path / "run", every=2)
    saved = {}
    for folder in sorted((tmp_path / "run").iterdir()):
        if folder.name.isdigit():
            state = json.loads((folder / "state.json").read_text())
            saved[int(folder.name)] = "gradients" in state
    # Steps 4, 8, ... end with an optimizer step: nothing pending. Steps 2, 6, 10: pending.
    assert saved[4] is False
    assert saved[8] is False
    assert saved[2] is True
    assert saved[6] is True


def test_the_usual_loop_saves_no_gradients_even_at_its_end(tmp_path: Path) -> None:
    """zero_grad(), backward(), step(): the gradients left after the step are stale, not
    pending; neither the cadence's saves nor the final one carry them."""
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    options = {"keep": None, "deadline": None, "quiet": True, "async_save": False}
    ck = nbresume.Checkpointer(tmp_path, every=2, model=model, optimizer=optimizer, **options)
    for _ in ck.steps(5):
        optimizer.zero_grad()
        model(torch.randn(2, 4)).sum().backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    ck.close()
    for folder in sorted(p for p in tmp_path.iterdir() if p.name.isdigit()):
        state = json.loads((folder / "state.json").read_text())
        assert "gradients" not in state, folder.name


def test_close_takes_the_step_hook_off_the_users_optimizer_and_a_new_loop_puts_it_back(
    tmp_path: Path,
) -> None:
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    users_own = optimizer.register_step_post_hook(lambda *args: None)
    hooks = optimizer._optimizer_step_post_hooks
    options = {"keep": None, "deadline": None, "quiet": True, "async_save": False}
    ck = nbresume.Checkpointer(tmp_path, every=2, model=model, optimizer=optimizer, **options)
    assert len(hooks) == 2
    ck.close()
    assert list(hooks) == [users_own.id]  # the user's hook stays, ours is gone

    # The same Checkpointer used again: its steps are followed again (pending gradients kept).
    for _ in ck.steps(3):
        model(torch.ones(1, 4)).sum().backward()  # type: ignore[no-untyped-call]
    assert len(hooks) == 2
    state = json.loads((tmp_path / step_dirname(3) / "state.json").read_text())
    assert "gradients" in state  # no optimizer step ran: the gradients are pending
    ck.close()
    assert list(hooks) == [users_own.id]
