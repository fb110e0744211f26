"""The Trainer under DDP: ``torchrun --nproc-per-node 2 ddp_hf_train.py OUTPUT_DIR [--steps N]
[--save-steps N] [--deadline-on-rank R:SECONDS]``.

The model and data of ``hf_train.py`` (a small BERT with dropout, nothing downloaded), trained
by two CPU processes on gloo with ``nbresume.hf.Callback()``, resumed from
``nbresume.hf.last_checkpoint(OUTPUT_DIR)``. ``--deadline-on-rank`` gives that one rank a
deadline of SECONDS from its start (the other has none). Every rank prints lines the tests read:
``rank R pid P``, ``rank R resume NAME`` (``None`` on a fresh run), ``rank R start S``,
``rank R step S``, ``rank R event KIND S`` (nbresume's events but steps), then
``rank R final HASH`` when the training ran to its end or ``rank R stopped CODE`` when it
stopped on a signal or a deadline (the exit status it asked for), then ``rank R teardown``
just before the rank ends (``ddp_rank.end_rank``: torch's own teardown is skipped).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from ddp_rank import deadline_on, end_rank, say
from hf_train import arguments, dataset, model, weights_hash
from transformers import PrinterCallback, Trainer, TrainerCallback
from transformers.utils import logging as hf_logging

import nbresume.hf


class Report(TrainerCallback):
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        say(self.rank, f"start {state.global_step}")

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        say(self.rank, f"step {state.global_step}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--save-steps", type=int, default=1000)
    parser.add_argument("--deadline-on-rank", default="", help="RANK:SECONDS")
    options = parser.parse_args()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    say(rank, f"pid {os.getpid()}")
    deadline = deadline_on(rank, options.deadline_on_rank)

    def trace(event: Any) -> None:
        if event.kind != "step":
            say(rank, f"event {event.kind} {event.step}")

    args = arguments(
        options.output_dir,
        options.steps,
        options.save_steps,
        logging_steps=1000,
        ddp_backend="gloo",
    )
    watcher = nbresume.hf.Callback(deadline=deadline, callbacks=[trace])
    callbacks = [watcher, Report(rank)]
    trainer = Trainer(model=model(False), args=args, train_dataset=dataset(), callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # its unflushed prints would cut the ranks' lines
    resume = nbresume.hf.last_checkpoint(options.output_dir)
    say(rank, f"resume {Path(resume).name if resume else None}")
    code = 0
    try:
        trainer.train(resume_from_checkpoint=resume)
    except SystemExit as stop:  # stopped on a signal: the status that signal asks for
        code = stop.code if isinstance(stop.code, int) else 1
    if watcher.stop_reason:
        say(rank, f"stopped {code}")
    else:
        say(rank, f"final {weights_hash(trainer.model)}")
    end_rank(rank, code)


if __name__ == "__main__":
    sys.exit(main())
