"""nbresume for the Hugging Face Trainer and Accelerate (``pip install "nbresume[hf]"``).

::

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[nbresume.hf.Callback()])
    trainer.train(resume_from_checkpoint=nbresume.hf.last_checkpoint(args.output_dir))

:class:`Callback` makes every ``checkpoint-N`` the Trainer writes a verified nbresume
checkpoint, applies ``save_total_limit`` after verification, and stops the Trainer cleanly
before the session deadline and on signals. :func:`last_checkpoint` returns the newest
``checkpoint-N`` that verifies (``None`` on a fresh run). :func:`save_state` does the same for
Accelerate's ``Accelerator.save_state``. Importing this module does not import transformers;
``nbresume.hf.Callback`` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nbresume.hf.resume import last_checkpoint, save_state

if TYPE_CHECKING:
    from nbresume.hf.callback import Callback


def __getattr__(name: str) -> Any:
    if name == "Callback":
        from nbresume.hf.callback import Callback

        return Callback
    raise AttributeError(f"module 'nbresume.hf' has no attribute {name!r}")


__all__ = ["Callback", "last_checkpoint", "save_state"]
