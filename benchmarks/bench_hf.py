"""What ``nbresume.hf.Callback`` adds to each save of a Hugging Face Trainer.

A BERT classifier built from a config (``--hidden``, ``--layers``; nothing is downloaded) is
trained on the CPU with ``save_steps=1`` for ``--saves`` steps, once without the callback and
once with it. Measured per save (medians):

  trainer save      the Trainer's own ``_save_checkpoint``: model, optimizer, scheduler, RNG
                    and trainer state written into ``checkpoint-N``
  nbresume commit   the callback's ``on_save``: the folder moved into a pending checkpoint,
                    every file fsynced and hashed, the manifest written, the rename, the
                    read-back verification and retention

and the ratio of the two (the overhead of the callback per save). Run from the repository root:

    .venv/bin/python -m benchmarks.bench_hf --saves 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._common import conditions, measured, publish, timing

RESULTS = Path(__file__).with_name("results") / "hf.md"


def measure(hidden: int, layers: int, saves: int, scratch: Path) -> dict[str, Any]:
    """Train ``saves`` steps saving at each, with and without the callback; the timings."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        Trainer,
        TrainingArguments,
    )
    from transformers.utils import logging as hf_logging

    import nbresume.hf

    hf_logging.set_verbosity_error()
    trainer_s: list[float] = []
    commit_s: list[float] = []

    class TimedTrainer(Trainer):  # type: ignore[misc]
        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            with timing(trainer_s):
                super()._save_checkpoint(model, trial)

    class TimedCallback(nbresume.hf.Callback):  # type: ignore[misc,name-defined]
        def on_save(self, *args: Any, **kwargs: Any) -> None:
            with timing(commit_s):
                super().on_save(*args, **kwargs)

    rows = 64
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 1000, (rows, 16), generator=g)
    data = [{"input_ids": ids[i], "labels": ids[i, 0] % 2} for i in range(rows)]
    sizes: dict[str, int] = {}
    plain_trainer_s: list[float] = []
    for with_callback in (False, True):
        torch.manual_seed(0)
        config = BertConfig(vocab_size=1000, hidden_size=hidden, num_hidden_layers=layers,
                            num_attention_heads=max(1, hidden // 64), intermediate_size=4 * hidden,
                            max_position_embeddings=16, num_labels=2)  # fmt: skip
        out = scratch / ("callback" if with_callback else "plain")
        args = TrainingArguments(output_dir=str(out), max_steps=saves, save_steps=1,
                                 per_device_train_batch_size=8, use_cpu=True, report_to="none",
                                 disable_tqdm=True, save_total_limit=2)  # fmt: skip
        callbacks = [TimedCallback(deadline=None)] if with_callback else []
        trainer = TimedTrainer(model=BertForSequenceClassification(config), args=args,
                               train_dataset=data, callbacks=callbacks)  # fmt: skip
        trainer.train()
        if not with_callback:
            plain_trainer_s, trainer_s = list(trainer_s), []
        newest = max(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        sizes["callback" if with_callback else "plain"] = sum(
            p.stat().st_size for p in newest.iterdir()
        )
    return {
        "trainer_plain_s": plain_trainer_s,
        "trainer_s": trainer_s,
        "commit_s": commit_s,
        "bytes": sizes["plain"],
    }


def render(result: dict[str, Any], meta: dict[str, Any]) -> str:
    plain = statistics.median(result["trainer_plain_s"])
    trainer = statistics.median(result["trainer_s"])
    commit = statistics.median(result["commit_s"])

    def every(values: list[float]) -> str:
        return ", ".join(f"{v:.3f}" for v in values)

    return "\n".join([
        "# The Trainer's save with and without nbresume.hf.Callback",
        "",
        f"Command: `{meta['command']}`",
        "",
        conditions(meta),
        "",
        f"One checkpoint: {result['bytes'] / 1e6:.1f} MB (model, optimizer, scheduler, RNG, "
        "trainer state).",
        "",
        "| Per save | Median (s) | Every save (s) |",
        "|---|---|---|",
        f"| Trainer's save, no callback | {plain:.3f} | {every(result['trainer_plain_s'])} |",
        f"| Trainer's save, with the callback | {trainer:.3f} | {every(result['trainer_s'])} |",
        f"| nbresume's commit (on_save) | {commit:.3f} | {every(result['commit_s'])} |",
        "",
        f"**Overhead per save: {commit / trainer:.2f}x the Trainer's own save** "
        f"(the save takes {(trainer + commit) / trainer:.2f}x as long with the callback).",
        "",
    ])  # fmt: skip


def run(hidden: int, layers: int, saves: int, scratch: Path, command: str) -> tuple[str, dict]:
    """Every measurement; the page and the raw numbers."""
    result = measured(lambda: measure(hidden, layers, saves, scratch), scratch, command)
    return render(result, result["meta"]), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--saves", type=int, default=8)
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary folder)")
    args = parser.parse_args()
    command = (
        f".venv/bin/python -m benchmarks.bench_hf --hidden {args.hidden} --layers {args.layers} "
        f"--saves {args.saves}"
    )
    with tempfile.TemporaryDirectory(prefix="bench-hf-", dir=args.dir) as scratch:
        page, _ = run(args.hidden, args.layers, args.saves, Path(scratch) / "hf", command)
    publish(page, RESULTS)


if __name__ == "__main__":
    main()
