"""The training runs of the GPU resume tests, as a user writes them for a GPU.

Every run trains on the device given (``cuda``, or ``cpu`` for a dry run of the tests' logic)
until done, resuming from its folder, and prints one line per event to its log: ``start S``
(the step it resumed from), ``step N`` after every update, ``verified N`` when nbresume
verified a checkpoint, ``restored exact`` or ``restored DIFFERS ...`` (the frameworks: the
state the framework loaded, compared with the checkpoint's files), ``done N`` at the end. The
final weights and optimizer state go to ``out`` (``torch.save``, on the CPU). Kinds of run:

- ``shape``: a loop shape of ``tests/train_loop_shapes.py`` with its ``device`` option;
- ``variant``: one representative loop, a conv net with BatchNorm and dropout over a shuffled
  DataLoader whose dataset augments at random, ``ck.epochs()`` and ``ck.loader()``, in one of
  :data:`VARIANTS`: fp32, bf16 autocast, fp16 autocast with a GradScaler (also saved in
  the background), two DataLoader workers with pinned memory, a ``torch.compile``d model,
  channels_last;
- ``hf``: the Hugging Face Trainer (fp16 on CUDA) with ``nbresume.hf``;
- ``lightning``: Lightning on the device with ``nbresume.lightning``, checkpoints at epoch ends.

``python train_gpu.py run COMMAND`` runs one command (forked from the suite's warm server, or
in a new interpreter where a forked child cannot start CUDA).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import nbresume
import train_loop_shapes as shapes
import zygote

#: The representative loop's variants.
VARIANTS = ["fp32", "bf16", "fp16-scaler", "async-fp16", "workers-pin", "compile", "channels-last"]
#: The representative loop: 12 batches per epoch, 2 epochs, a checkpoint every 3 steps.
VARIANT_EPOCHS, VARIANT_BATCHES, VARIANT_BATCH_SIZE, VARIANT_EVERY = 2, 12, 8, 3
#: The Trainer: 192 rows in batches of 8 (24 steps an epoch), 48 steps, a save every 4.
HF_STEPS, HF_EVERY, HF_ROWS = 48, 4, 192
#: Lightning: 16 steps an epoch, 4 epochs, a checkpoint at each epoch's end.
LIGHTNING_EPOCHS, LIGHTNING_BATCHES = 4, 16


def say(line: str) -> None:
    """One whole line per write: the background save thread prints too."""
    os.write(1, (line + "\n").encode())


def on_verified(event: Any) -> None:
    if event.kind == "verified":
        say(f"verified {event.step}")


# -- the representative loop ---------------------------------------------------------------


class Images(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Small 3x8x8 images with labels, augmented at random on every read (a flip, a shift,
    noise), from the global torch RNG as most augmentation code does."""

    def __init__(self, count: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.images = torch.randn(count, 3, 8, 8, generator=g)
        self.labels = torch.randint(0, 10, (count,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[index]
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        image = torch.roll(image, int(torch.randint(-1, 2, ())), dims=-2)
        return image + 0.05 * torch.randn_like(image), self.labels[index]


def conv_net() -> nn.Module:
    # No pooling: adaptive pooling has no deterministic CUDA backward.
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Flatten(),
        nn.Dropout(0.2),
        nn.Linear(16 * 4 * 4, 10),
    )


def train_variant(folder: Path, variant: str, device: str, pause: float) -> dict[str, Any]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = conv_net().to(device)
    channels_last = variant == "channels-last"
    if channels_last:
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.8)
    half = {"bf16": torch.bfloat16, "fp16-scaler": torch.float16, "async-fp16": torch.float16}.get(
        variant
    )
    # A short growth interval: the loss scale changes during the run, and must come back.
    scaler = torch.amp.GradScaler(
        device, growth_interval=5, enabled=variant in ("fp16-scaler", "async-fp16")
    )
    workers = 2 if variant == "workers-pin" else 0
    data = DataLoader(
        Images(VARIANT_BATCHES * VARIANT_BATCH_SIZE),
        batch_size=VARIANT_BATCH_SIZE,
        shuffle=True,
        num_workers=workers,
        pin_memory=workers > 0 and device == "cuda",
        # This process is itself forked from the zygote: the workers are forked from it too,
        # whatever the Python version's default start method.
        multiprocessing_context="fork" if workers else None,
    )
    net = torch.compile(model) if variant == "compile" else model
    ck = nbresume.Checkpointer(
        folder,
        every=VARIANT_EVERY,
        deadline=None,
        deterministic=True,
        # Saves in the background: a GPU state copied within the GPU first, then to the host
        # while the next steps change it.
        async_save=variant == "async-fp16",
        callbacks=[on_verified],
        model=net,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
    )
    loader = ck.loader(data)
    ck.restore()
    say(f"start {ck.step}")
    for _epoch in ck.epochs(VARIANT_EPOCHS):
        for images, labels in loader:
            x = images.to(device, non_blocking=True)
            y = labels.to(device, non_blocking=True)
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            autocast = torch.autocast(device, dtype=half) if half else contextlib.nullcontext()
            with autocast:
                logits = net(x)
                noise = torch.randn(logits.shape, device=device)  # the device's RNG stream
                loss = nn.functional.cross_entropy(logits.float() + 0.1 * noise, y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if pause:
                time.sleep(pause)  # gives the test time to kill mid-run
            say(f"step {ck.step + 1}")
    ck.close()
    say(f"done {ck.step}")
    final = tensors("model", model.state_dict())
    final.update(tensors("optimizer", optimizer.state_dict()["state"]))
    final["scaler.scale"] = torch.tensor(scaler.get_scale() if scaler.is_enabled() else 1.0)
    final["scheduler.lr"] = torch.tensor(scheduler.get_last_lr())
    return final


def tensors(prefix: str, state: Any) -> dict[str, torch.Tensor]:
    """Every tensor in a nested state dict, on the CPU, by its dotted path."""
    found: dict[str, torch.Tensor] = {}
    if isinstance(state, torch.Tensor):
        found[prefix] = state.detach().to("cpu", copy=True)
    elif isinstance(state, dict):
        for key, value in state.items():
            found.update(tensors(f"{prefix}.{key}", value))
    elif isinstance(state, list | tuple):
        for index, value in enumerate(state):
            found.update(tensors(f"{prefix}.{index}", value))
    return found


def first_difference(want: dict[str, torch.Tensor], have: dict[str, torch.Tensor]) -> str:
    """The first tensor that differs, with by how much; "" when all are equal."""
    if want.keys() != have.keys():
        return f"keys differ: {sorted(want.keys() ^ have.keys())[:4]}"
    for key, value in want.items():
        other = have[key]
        if value.shape != other.shape or value.dtype != other.dtype:
            return (
                f"{key}: {tuple(value.shape)} {value.dtype} != {tuple(other.shape)} {other.dtype}"
            )
        if not torch.equal(value, other):
            gap = (value.double() - other.double()).abs().max().item()
            return f"{key} (largest difference {gap:.3g})"
    return ""


# -- the Hugging Face Trainer --------------------------------------------------------------


def train_hf(folder: Path, device: str, pause: float) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from safetensors.torch import load_file
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )
    from transformers.utils import logging as hf_logging

    import nbresume.hf

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    cuda = device == "cuda"
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(1, 64, (HF_ROWS, 12), generator=g)
    labels = (ids[:, 0] > 32).long()
    mask = torch.ones(12, dtype=torch.long)
    rows = [
        {"input_ids": ids[i], "attention_mask": mask, "labels": labels[i]} for i in range(HF_ROWS)
    ]
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=12,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        num_labels=2,
        # The eager attention: its backward is deterministic on CUDA (SDPA's is not always).
        attn_implementation="eager",
    )
    model = BertForSequenceClassification(config)
    args = TrainingArguments(
        output_dir=str(folder),
        max_steps=HF_STEPS,
        save_steps=HF_EVERY,
        save_total_limit=2,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        logging_steps=1000,
        use_cpu=not cuda,
        fp16=cuda,
        full_determinism=True,
        seed=42,
        report_to="none",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    resume = nbresume.hf.last_checkpoint(folder)

    class Report(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):  # type: ignore[no-untyped-def]
            say(f"start {state.global_step}")
            if resume is not None:
                saved = load_file(Path(resume) / "model.safetensors")
                held = {k: v.detach().cpu() for k, v in model.state_dict().items() if k in saved}
                difference = first_difference(saved, held)
                optimizer_saved = torch.load(Path(resume) / "optimizer.pt", weights_only=True)
                difference = difference or first_difference(
                    tensors("optimizer", optimizer_saved["state"]),
                    tensors("optimizer", optimizer.state_dict()["state"]),
                )
                scaler = getattr(trainer.accelerator, "scaler", None)
                if not difference and scaler is not None and (Path(resume) / "scaler.pt").exists():
                    scaler_saved = torch.load(Path(resume) / "scaler.pt", weights_only=True)
                    if scaler_saved != scaler.state_dict():
                        difference = f"scaler: {scaler_saved} != {scaler.state_dict()}"
                say(f"restored DIFFERS {difference}" if difference else "restored exact")

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if pause:
                time.sleep(pause)
            say(f"step {state.global_step}")

    callbacks = [nbresume.hf.Callback(deadline=None, callbacks=[on_verified]), Report()]
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    say(f"done {trainer.state.global_step}")
    final = tensors("model", trainer.model.state_dict())
    final.update(tensors("optimizer", trainer.optimizer.state_dict()["state"]))
    scaler = getattr(trainer.accelerator, "scaler", None)
    final["scaler.scale"] = torch.tensor(scaler.get_scale() if scaler is not None else 1.0)
    return final


# -- Lightning -----------------------------------------------------------------------------


def train_lightning(folder: Path, device: str, pause: float) -> dict[str, Any]:
    import lightning as L

    import nbresume.lightning

    class Net(L.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 2))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self.net(x)
            noise = torch.randn(logits.shape, device=self.device)  # the device's RNG stream
            return nn.functional.cross_entropy(logits + 0.1 * noise, y)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    class Report(L.Callback):  # type: ignore[misc]
        def __init__(self, resume: str | None) -> None:
            self.resume = resume

        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            say(f"start {trainer.global_step}")
            if self.resume is not None:
                saved = nbresume.lightning.CheckpointIO().load_checkpoint(self.resume)
                difference = first_difference(
                    tensors("model", saved["state_dict"]), tensors("model", pl_module.state_dict())
                ) or first_difference(
                    tensors("optimizer", saved["optimizer_states"][0]["state"]),
                    tensors("optimizer", trainer.optimizers[0].state_dict()["state"]),
                )
                say(f"restored DIFFERS {difference}" if difference else "restored exact")

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if pause:
                time.sleep(pause)
            say(f"step {trainer.global_step}")

    torch.set_num_threads(1)
    L.seed_everything(7, verbose=False)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(LIGHTNING_BATCHES * 16, 8, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    data = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    ckpts = folder / "ckpts"
    resume = nbresume.lightning.last_checkpoint(ckpts)
    last = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=ckpts,
        filename="epoch-{epoch}",
        save_top_k=1,
        save_last=True,
        save_on_train_epoch_end=True,
    )
    trainer = L.Trainer(
        max_epochs=LIGHTNING_EPOCHS,
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        deterministic=True,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[last, nbresume.lightning.Callback(deadline=None), Report(resume)],
        plugins=[nbresume.lightning.CheckpointIO()],
        default_root_dir=folder,
    )
    model = Net()
    trainer.fit(model, data, ckpt_path=resume)
    say(f"done {trainer.global_step}")
    final = tensors("model", model.state_dict())
    final.update(tensors("optimizer", trainer.optimizers[0].state_dict()["state"]))
    return final


# -- running one ----------------------------------------------------------------------------

RUNS: dict[str, Callable[[Path, str, str, float], dict[str, Any]]] = {
    "shape": lambda folder, name, device, pause: shapes.train(
        folder, name, pause=pause, device=device
    ),
    "variant": train_variant,
    "hf": lambda folder, name, device, pause: train_hf(folder, device, pause),
    "lightning": lambda folder, name, device, pause: train_lightning(folder, device, pause),
}


def _train(command: Mapping[str, Any]) -> dict[str, Any]:
    return RUNS[command["kind"]](
        Path(command["folder"]), command["name"], command["device"], command["pause"]
    )


def run(command: dict[str, Any]) -> int:
    """Run ``command`` in this process, its output appended to its log; the exit status."""
    return zygote.run_logged(command, _train)


if __name__ == "__main__":
    sys.exit(run(json.loads(sys.argv[2])))
