"""A Lightning ``Trainer`` as the tests build it: on the CPU, and quiet."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import lightning as L


def quiet_trainer(**options: Any) -> L.Trainer:
    """A ``lightning.Trainer`` on the CPU with no logger, progress bar or model summary (so a
    test's output holds only what it checks); ``options`` are the Trainer's other arguments."""
    import lightning as L

    return L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )
