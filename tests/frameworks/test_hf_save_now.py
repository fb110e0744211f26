"""The panel's "Save now" while a Trainer trains: a verified ``checkpoint-N`` at the next step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

import nbresume.hf
from nbresume.notebook.progress import Tracker


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.linear(x).squeeze(-1), y)}


class PressSaveNow(TrainerCallback):
    """Presses the panel's "Save now" once, after ``at`` steps."""

    def __init__(self, tracker: Tracker, at: int) -> None:
        self.tracker = tracker
        self.at = at
        self.said = ""

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if state.global_step == self.at:
            self.said = self.tracker.request_save()


def test_save_now_while_training_saves_the_trainer_at_the_next_step(tmp_path: Path) -> None:
    tracker = Tracker()
    tracker.start()
    try:
        generator = torch.Generator().manual_seed(0)
        data = [
            {"x": torch.randn(4, generator=generator), "y": torch.tensor(0.5)} for _ in range(32)
        ]
        press = PressSaveNow(tracker, at=3)
        args = TrainingArguments(
            output_dir=str(tmp_path / "out"),
            max_steps=6,
            per_device_train_batch_size=4,
            save_strategy="no",  # no save of its own: only the one asked for
            logging_strategy="no",
            report_to=[],
            use_cpu=True,
            dataloader_num_workers=0,
        )
        trainer = Trainer(
            model=Tiny(),
            args=args,
            train_dataset=data,
            callbacks=[press, nbresume.hf.Callback(deadline=None)],
        )
        trainer.train()
        assert press.said.startswith("save requested"), press.said
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoint-3"]
        assert nbresume.hf.last_checkpoint(tmp_path / "out") == str(
            tmp_path / "out" / "checkpoint-3"
        )
        shown = tracker.snapshot()
        assert shown.last is not None
        assert shown.last.step == 3
    finally:
        tracker.stop()
