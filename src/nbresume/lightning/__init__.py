"""nbresume for PyTorch Lightning: verified checkpoints without pickle, and resumable runs.

``pip install "nbresume[lightning]"``; ``import nbresume`` never imports Lightning, this
module does::

    trainer = L.Trainer(plugins=[nbresume.lightning.CheckpointIO()],
                        callbacks=[nbresume.lightning.Callback()], ...)
    trainer.fit(model, datamodule, ckpt_path=nbresume.lightning.last_checkpoint(trainer))
"""

from __future__ import annotations

from nbresume.lightning.callback import Callback
from nbresume.lightning.checkpoint_io import CheckpointIO
from nbresume.lightning.find import last_checkpoint

__all__ = ["Callback", "CheckpointIO", "last_checkpoint"]
