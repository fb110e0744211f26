"""One adapter per checkpointer, each used the way its documentation tells a user to.

Every adapter opens a session on a folder, a model and an optimizer, and offers:

- ``save(step)``: returns when the training thread may go on (what "blocked" times);
- ``wait()``: returns when the tool says the checkpoint is complete (what "done" times; it is
  "durable" only for the tools that fsync, see ``Tool.fsync``);
- ``restore()``: the tool's documented resume path; the step resumed from, or ``None`` when
  there is nothing to resume from (a fresh start).

How each tool is called, and what its resume path is, is listed in ``benchmarks/README.md``.

DCP runs in one process without a process group: torch 2.13 accepts that (``no_dist=True``;
without it, it warns and assumes the same). Lightning's checkpoint IO plugins are used
directly rather than through a ``Trainer``, so that only the IO is timed; the dict saved has
the keys a Trainer's checkpoint has for the model and optimizer (``state_dict``,
``optimizer_states``, ``global_step``).
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from benchmarks._common import flat_optimizer, fsync_path, unflat_optimizer


class Session(Protocol):
    def save(self, step: int) -> None: ...
    def wait(self) -> None: ...
    def restore(self) -> int | None: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class Tool:
    name: str
    library: str  # the module that must be importable
    is_async: bool
    fsync: bool  # whether "done" means fsynced (durable), not only handed to the OS
    opener: Callable[[Path, Any, Any], Session]

    def missing(self) -> str | None:
        """Why this tool cannot run here, or ``None``."""
        if importlib.util.find_spec(self.library) is None:
            return "not installed"
        return None

    def open(self, folder: Path, model: Any, optimizer: Any) -> Session:
        folder.mkdir(parents=True, exist_ok=True)
        return self.opener(folder, model, optimizer)

    def import_library(self) -> None:
        """Import what the session needs, so that a measurement does not count the import."""
        for module in _IMPORTS[self.library]:
            importlib.import_module(module)


_IMPORTS = {
    "torch": ["torch"],
    "torch.distributed.checkpoint": [
        "torch.distributed.checkpoint",
        "torch.distributed.checkpoint.state_dict",
    ],
    "lightning": ["lightning.fabric.plugins.io.torch_io", "lightning.pytorch.plugins.io"],
    "accelerate": ["accelerate", "accelerate.utils"],
    "nbresume": ["nbresume"],
    "safetensors": ["safetensors", "safetensors.torch"],
}


class TorchSave:
    def __init__(self, folder: Path, model: Any, optimizer: Any, *, fsync: bool) -> None:
        self.folder, self.model, self.optimizer, self.fsync = folder, model, optimizer, fsync
        self.path = folder / "checkpoint.pt"

    def save(self, step: int) -> None:
        import torch

        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        torch.save({**state, "step": step}, self.path)
        if self.fsync:
            fsync_path(self.path)
            fsync_path(self.folder)

    def wait(self) -> None:
        pass

    def restore(self) -> int | None:
        import torch

        if not self.path.exists():
            return None
        checkpoint = torch.load(self.path, weights_only=True)
        self.model.load_state_dict(checkpoint["model"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        return int(checkpoint["step"])

    def close(self) -> None:
        pass


class Safetensors:
    """The model and the optimizer's state in two safetensors files (the param groups and the
    step in the metadata), loaded with ``load_file``: the files mapped copy-on-write, nothing
    checked. A loader, not a checkpointer: only the resume suite runs it (:data:`LOADERS`)."""

    def __init__(self, folder: Path, model: Any, optimizer: Any) -> None:
        self.folder, self.model, self.optimizer = folder, model, optimizer

    def save(self, step: int) -> None:
        import safetensors.torch

        tensors, groups = flat_optimizer(self.optimizer)
        safetensors.torch.save_file(self.model.state_dict(), self.folder / "model.safetensors")
        metadata = {"param_groups": groups, "step": str(step)}
        safetensors.torch.save_file(tensors, self.folder / "optimizer.safetensors", metadata)

    def wait(self) -> None:
        pass

    def restore(self) -> int | None:
        import safetensors
        import safetensors.torch

        optimizer_file = self.folder / "optimizer.safetensors"
        if not optimizer_file.exists():
            return None
        self.model.load_state_dict(safetensors.torch.load_file(self.folder / "model.safetensors"))
        with safetensors.safe_open(optimizer_file, framework="pt") as handle:
            metadata = handle.metadata() or {}
        tensors = safetensors.torch.load_file(optimizer_file)
        self.optimizer.load_state_dict(unflat_optimizer(tensors, metadata["param_groups"]))
        return int(metadata["step"])

    def close(self) -> None:
        pass


class DCP:
    def __init__(self, folder: Path, model: Any, optimizer: Any, *, background: bool) -> None:
        self.model, self.optimizer, self.background = model, optimizer, background
        self.path = folder / "checkpoint"
        self.future: Any = None

    def _state(self, step: int) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state, "step": step}

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        if self.background:
            self.wait()  # DCP's documented pattern: one async save in flight
            self.future = dcp.async_save(self._state(step), checkpoint_id=self.path, no_dist=True)
        else:
            dcp.save(self._state(step), checkpoint_id=self.path, no_dist=True)

    def wait(self) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None

    def restore(self) -> int | None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        if not self.path.exists():
            return None
        state = self._state(0)
        dcp.load(state, checkpoint_id=self.path, no_dist=True)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
        return int(state["step"])

    def close(self) -> None:
        self.wait()


class Lightning:
    def __init__(self, folder: Path, model: Any, optimizer: Any, *, background: bool) -> None:
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

        self.model, self.optimizer, self.background = model, optimizer, background
        self.path = folder / "last.ckpt"
        self.io: Any = TorchCheckpointIO()
        if background:
            from lightning.pytorch.plugins.io import AsyncCheckpointIO

            self.io = AsyncCheckpointIO(TorchCheckpointIO())

    def save(self, step: int) -> None:
        checkpoint = {
            "state_dict": self.model.state_dict(),
            "optimizer_states": [self.optimizer.state_dict()],
            "global_step": step,
        }
        self.io.save_checkpoint(checkpoint, self.path)

    def wait(self) -> None:
        if self.background:
            self.io.teardown()  # waits for every queued save; the next save starts a new pool

    def restore(self) -> int | None:
        if not self.path.exists():
            return None
        checkpoint = self.io.load_checkpoint(self.path)
        self.model.load_state_dict(checkpoint["state_dict"])
        self.optimizer.load_state_dict(checkpoint["optimizer_states"][0])
        return int(checkpoint["global_step"])

    def close(self) -> None:
        self.wait()


class _Step:
    """The step, registered with Accelerate so that ``save_state`` stores it."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


class Accelerate:
    def __init__(self, folder: Path, model: Any, optimizer: Any) -> None:
        from accelerate import Accelerator
        from accelerate.utils import ProjectConfiguration

        config = ProjectConfiguration(
            project_dir=str(folder), automatic_checkpoint_naming=True, total_limit=3
        )
        self.accelerator = Accelerator(cpu=True, project_config=config)
        self.accelerator.prepare(model, optimizer)
        self.counter = _Step()
        self.accelerator.register_for_checkpointing(self.counter)
        self.checkpoints = folder / "checkpoints"

    def save(self, step: int) -> None:
        self.counter.step = step
        self.accelerator.save_state()

    def wait(self) -> None:
        pass

    def restore(self) -> int | None:
        if not self.checkpoints.is_dir() or not any(self.checkpoints.iterdir()):
            return None
        self.accelerator.load_state()
        newest = max(int(re.findall(r"\d+", p.name)[-1]) for p in self.checkpoints.iterdir())
        # save_state refuses an existing folder: a resumed run must continue the numbering.
        self.accelerator.project_configuration.iteration = newest + 1
        return self.counter.step

    def close(self) -> None:
        pass


class Nbresume:
    def __init__(self, folder: Path, model: Any, optimizer: Any, *, background: bool) -> None:
        import nbresume

        self.ckpt = nbresume.Checkpointer(
            folder,
            every=None,
            deadline=None,
            async_save=background,
            model=model,
            optimizer=optimizer,
        )

    def save(self, step: int) -> None:
        self.ckpt.save(step)

    def wait(self) -> None:
        self.ckpt.wait()

    def restore(self) -> int | None:
        step = self.ckpt.restore()
        return step if self.ckpt.restored_step is not None else None

    def close(self) -> None:
        self.ckpt.close()


TOOLS = [
    Tool("torch.save", "torch", False, False, lambda f, m, o: TorchSave(f, m, o, fsync=False)),
    Tool("torch.save + fsync", "torch", False, True,
         lambda f, m, o: TorchSave(f, m, o, fsync=True)),
    Tool("DCP", "torch.distributed.checkpoint", False, True,
         lambda f, m, o: DCP(f, m, o, background=False)),
    Tool("DCP async", "torch.distributed.checkpoint", True, True,
         lambda f, m, o: DCP(f, m, o, background=True)),
    Tool("Lightning", "lightning", False, False,
         lambda f, m, o: Lightning(f, m, o, background=False)),
    Tool("Lightning async", "lightning", True, False,
         lambda f, m, o: Lightning(f, m, o, background=True)),
    Tool("Accelerate", "accelerate", False, False, Accelerate),
    Tool("nbresume", "nbresume", False, True,
         lambda f, m, o: Nbresume(f, m, o, background=False)),
    Tool("nbresume async", "nbresume", True, True,
         lambda f, m, o: Nbresume(f, m, o, background=True)),
]  # fmt: skip
BY_NAME = {tool.name: tool for tool in TOOLS}
#: Every tool the resume suite can restore with: the checkpointers, and the plain loader that
#: maps its files instead of reading them (safetensors).
LOADERS = {**BY_NAME, "safetensors": Tool("safetensors", "safetensors", False, False, Safetensors)}
#: Tools whose restore is the same code as another's: the resume suite runs one of each.
SAME_RESTORE = {
    "torch.save + fsync": "torch.save",
    "DCP async": "DCP",
    "Lightning async": "Lightning",
    "nbresume async": "nbresume",
}
