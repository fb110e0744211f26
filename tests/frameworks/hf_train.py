"""A tiny Trainer run that the tests start, kill and start again.

Usage: ``python hf_train.py OUTPUT_DIR [--steps N] [--save-steps N] [--keep N] [--lora]
[--no-callback] [--final FILE]``. A small BERT classifier built from a config (nothing is
downloaded), with dropout, trained on a shuffled synthetic data set. It resumes from
``nbresume.hf.last_checkpoint(OUTPUT_DIR)`` and prints one line per event:
``resume <path or None>``, ``step N``, ``saved N``, ``final <sha256 of the weights>``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.utils import logging as hf_logging

import nbresume.hf

VOCAB, LENGTH, ROWS = 64, 12, 192


def dataset() -> list[dict[str, torch.Tensor]]:
    """Token ids made directly (no tokenizer): the label is whether the first id is large."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(1, VOCAB, (ROWS, LENGTH), generator=g)
    labels = (ids[:, 0] > VOCAB // 2).long()
    mask = torch.ones(LENGTH, dtype=torch.long)
    return [{"input_ids": ids[i], "attention_mask": mask, "labels": labels[i]} for i in range(ROWS)]


def model(lora: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=LENGTH,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        num_labels=2,
    )
    net = BertForSequenceClassification(config)
    if lora:
        from peft import LoraConfig, get_peft_model

        net = get_peft_model(
            net,
            LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["query", "value"]),
        )
    return net


class Report(TrainerCallback):
    """Prints what the test reads, flushed at once; kills the process with SIGKILL ``delay``
    seconds after step ``kill_at`` ended (on a save step: in the middle of the save)."""

    def __init__(self, kill_at: int, delay: float) -> None:
        self.kill_at, self.delay = kill_at, delay

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        print(f"step {state.global_step}", flush=True)
        if state.global_step == self.kill_at:
            timer = threading.Timer(self.delay, os.kill, (os.getpid(), signal.SIGKILL))
            timer.daemon = True
            timer.start()

    def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        print(f"saved {state.global_step}", flush=True)


def event_log(path: str) -> Callable[[Any], None]:
    """A callback of nbresume's events: each (but steps) one JSON line, flushed at once."""
    handle = open(path, "a", buffering=1)  # noqa: SIM115 -- open until the process ends

    def record(event: Any) -> None:
        if event.kind != "step":
            line = {"kind": event.kind, "step": event.step, "t": time.time(), **event.data}
            handle.write(json.dumps(line, default=str) + "\n")
            handle.flush()

    return record


def weights_hash(net: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(net.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def arguments(output_dir: str, steps: int, save_steps: int, **options: Any) -> TrainingArguments:
    """The Trainer's arguments every run of these scripts shares (batches of 8, seed 42, on the
    CPU, no reports, no progress bars); ``options`` are the run's own."""
    return TrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        save_steps=save_steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        use_cpu=True,
        report_to="none",
        dataloader_num_workers=0,
        seed=42,
        disable_tqdm=True,
        **options,
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--save-steps", type=int, default=4)
    parser.add_argument("--keep", type=int, default=2)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--no-callback", action="store_true")
    parser.add_argument("--deadline", type=float, default=None)
    parser.add_argument("--final", default="")
    parser.add_argument("--kill", default="0:0", help="STEP:SECONDS: SIGKILL after that step")
    parser.add_argument("--drive", action="store_true", help="OUTPUT_DIR is below MyDrive")
    parser.add_argument("--events", default="", help="append nbresume's events here (JSON)")
    options = parser.parse_args()
    hf_logging.set_verbosity_error()
    if options.drive:
        from nbresume import knobs
        from nbresume.platforms.drive import mount_drive

        options.output_dir = str(mount_drive(str(knobs.drive_mount())) / options.output_dir)
    torch.set_num_threads(1)
    args = arguments(
        options.output_dir,
        options.steps,
        options.save_steps,
        save_total_limit=options.keep,
        logging_steps=4,
    )
    kill_at, delay = options.kill.split(":")
    callbacks: list[TrainerCallback] = [Report(int(kill_at), float(delay))]
    if not options.no_callback:
        events = [event_log(options.events)] if options.events else []
        callbacks.insert(0, nbresume.hf.Callback(deadline=options.deadline, callbacks=events))
    net = model(options.lora)
    trainer = Trainer(model=net, args=args, train_dataset=dataset(), callbacks=callbacks)
    resume = nbresume.hf.last_checkpoint(options.output_dir)
    print(f"resume {resume}", flush=True)
    trainer.train(resume_from_checkpoint=resume)
    final = weights_hash(trainer.model)
    if options.final:
        from safetensors.torch import save_file

        state = trainer.model.state_dict()
        save_file({k: v.detach().contiguous() for k, v in state.items()}, options.final)
    print(f"final {final}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
