"""Early stopping as users write it: ``break`` out of ``steps()`` or ``epochs()``.

Leaving the loop by ``break`` ends the run there: ``close()`` (or the interpreter's exit) saves
that step as finished, and the same code run again trains no further. A ``request_stop()``
before the break keeps the run unfinished; a loop left by an exception saves nothing beyond
the newest checkpoint. A metric given to ``save()`` at the last step of a run is kept by the
loop's final save of the same step.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import nbresume
from nbresume.checkpoint.store import CheckpointStore
from testkit import warmfork

QUIET: dict[str, Any] = {"deadline": None, "quiet": True, "async_save": False}


def state(folder: Path, step: int) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((folder / f"{step:012d}" / "state.json").read_text())
    return document


def steps_on_disk(folder: Path) -> list[int]:
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


Trained = tuple[nbresume.Checkpointer, list[int], torch.Tensor]


def train_steps(
    folder: Path, *, patience_at: int | None, stop_first: bool = False, total: int = 20
) -> Trained:
    """A steps() loop that breaks once ``patience_at`` steps are done."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = nbresume.Checkpointer(folder, every=5, model=model, optimizer=opt, **QUIET)
    trained = []
    for step in ck.steps(total):
        loss = model(torch.randn(4, 3)).pow(2).mean()
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        trained.append(step)
        if patience_at is not None and step + 1 == patience_at:
            if stop_first:
                ck.request_stop("paused by hand")
            break
    ck.close()
    return ck, trained, model.weight.detach().clone()


def test_a_break_out_of_steps_saves_the_end_and_a_rerun_trains_no_further(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    ck, trained, weight = train_steps(folder, patience_at=8)
    assert trained == list(range(8))
    assert ck.done
    assert steps_on_disk(folder) == [5, 8], "the break's step is saved"
    assert state(folder, 8)["done"] is True
    assert state(folder, 8)["ended_early"] == {"loop": "steps", "bound": 20}
    again, trained_again, weight_again = train_steps(folder, patience_at=8)
    assert trained_again == [], "the same code run again trains no further"
    assert again.done
    assert again.step == 8
    assert torch.equal(weight_again, weight)
    assert CheckpointStore(folder, keep=None).verify().ok


def test_a_larger_total_after_an_early_end_trains_on(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    train_steps(folder, patience_at=8)
    _, trained, _ = train_steps(folder, patience_at=None, total=30)
    assert trained == list(range(8, 30))


def test_request_stop_before_the_break_keeps_the_run_unfinished(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    ck, _, _ = train_steps(folder, patience_at=8, stop_first=True)
    assert not ck.done
    assert state(folder, 8)["done"] is False
    assert "ended_early" not in state(folder, 8)
    _, trained, _ = train_steps(folder, patience_at=None)
    assert trained == list(range(8, 20)), "the rest of the run trains"


def test_a_loop_left_by_an_exception_saves_nothing_more(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    model = torch.nn.Linear(3, 1)
    ck = nbresume.Checkpointer(folder, every=5, model=model, **QUIET)

    def train() -> None:
        try:
            for step in ck.steps(20):
                if step == 7:
                    raise RuntimeError("loss diverged")
        finally:
            ck.close()

    with pytest.raises(RuntimeError, match="diverged"):
        train()
    assert steps_on_disk(folder) == [5]
    assert not ck.done


def test_a_break_out_of_epochs_saves_the_end_of_that_epoch(tmp_path: Path) -> None:
    folder = tmp_path / "run"

    def run() -> tuple[nbresume.Checkpointer, list[int]]:
        data = torch.utils.data.DataLoader(torch.arange(12.0), batch_size=4, shuffle=True)
        ck = nbresume.Checkpointer(folder, every=None, **QUIET)
        loader = ck.loader(data)
        epochs = []
        best, patience = float("inf"), 0
        ck["best"], ck["patience"] = best, patience
        for epoch in ck.epochs(10):
            for _batch in loader:
                pass
            epochs.append(epoch)
            val = [3.0, 2.0, 2.5, 2.6][min(epoch, 3)]  # improves, then stops improving
            if val < ck["best"]:
                ck["best"], ck["patience"] = val, 0
            else:
                ck["patience"] += 1
            if ck["patience"] >= 2:
                break
        ck.close()
        return ck, epochs

    ck, epochs = run()
    assert epochs == [0, 1, 2, 3]
    assert ck.done
    saved = state(folder, steps_on_disk(folder)[-1])
    assert saved["epoch"] == 4, "the checkpoint of the end of the epoch the break left"
    assert saved["ended_early"] == {"loop": "epochs", "bound": 10}
    again, epochs_again = run()
    assert epochs_again == []
    assert again.done


SCRIPT = """
import sys, torch, nbresume
ck = nbresume.Checkpointer(sys.argv[1], every=5, deadline=None, quiet=True, async_save=False,
                           model=torch.nn.Linear(2, 2))
for step in ck.steps(20):
    if step + 1 == 8:
        if sys.argv[2] == "raise":
            raise RuntimeError("diverged")
        break
print("left the loop")
"""


@pytest.mark.parametrize("how", ["break", "raise"])
def test_a_script_that_ends_after_the_loop_without_close(tmp_path: Path, how: str) -> None:
    """The interpreter's exit does what close() does: a break is the end, an uncaught
    exception is not."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    folder = tmp_path / "run"
    done = warmfork.run([sys.executable, str(script), str(folder), how],
                        capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    if how == "break":
        assert done.returncode == 0, done.stderr
        assert steps_on_disk(folder) == [5, 8]
        assert state(folder, 8)["done"] is True
    else:
        assert done.returncode == 1
        assert "diverged" in done.stderr
        assert steps_on_disk(folder) == [5]


def test_a_metric_saved_at_the_last_step_is_kept_by_the_final_save(tmp_path: Path) -> None:
    folder = tmp_path / "run"

    def run(total: int, losses: dict[int, float]) -> nbresume.Checkpointer:
        ck = nbresume.Checkpointer(folder, every=None, keep=1, keep_best=("val_loss", "min"),
                                   **QUIET)  # fmt: skip
        for step in ck.steps(total):
            if step + 1 in losses:
                ck.save(metric=losses[step + 1])
        ck.close()
        return ck

    ck = run(10, {5: 3.0, 10: 0.1})
    final = next(i for i in ck.list() if i.step == 10)
    assert final.metrics == {"val_loss": 0.1}, "the loop's final save kept the metric"
    again = run(15, {15: 2.0})  # continued: retention keeps the true best
    kept = {i.step: i.metrics for i in again.list()}
    assert kept[10] == {"val_loss": 0.1}
    assert 5 not in kept
