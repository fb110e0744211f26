"""Large saves take the paths that small ones skip: a snapshot copied in several pieces by two
threads, and files past the size where their pages start going to the disk while they are
written. Both must give back exactly what was saved."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from nbresume import Checkpointer, CheckpointStore
from nbresume.checkpoint.backends.local import WRITE_BEHIND_BYTES
from nbresume.checkpoint.state.snapshot import COPY_PIECE

QUIET = {"every": None, "deadline": None}


class Wide(nn.Module):
    """Parameters past several copy pieces, plus one that is not contiguous in its buffer."""

    def __init__(self) -> None:
        super().__init__()
        count = 3 * COPY_PIECE // 4 + 17  # float32: three pieces and a partial one
        self.big = nn.Parameter(torch.randn(count))
        self.small = nn.Linear(8, 8)
        self.register_buffer("strided", torch.randn(16, 16).t())


def test_an_async_snapshot_of_large_tensors_restores_exactly(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Wide()
    ckpt = Checkpointer(tmp_path / "run", async_save=True, model=model, **QUIET)
    for step in (1, 2):  # the second save copies into the buffers the first one made
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        assert ckpt.save(step=step) is None
        with torch.no_grad():
            model.big.add_(1.0)  # training goes on while the write runs
        ckpt.wait()
    ckpt.close()
    restored = Wide()
    assert Checkpointer(tmp_path / "run", model=restored, **QUIET).restore() == 2
    for key, value in restored.state_dict().items():
        assert torch.equal(value, saved[key]), key


def test_a_file_past_the_write_behind_size_loads_back_exactly(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(1)
    tensor = torch.randint(0, 255, (WRITE_BEHIND_BYTES * 2 + 4099,), dtype=torch.uint8,
                           generator=generator)  # fmt: skip
    store = CheckpointStore(tmp_path / "store")
    store.save(1, tensors={"weights": {"w": tensor}, "other": {"x": torch.ones(3)}})
    assert store.verify().ok
    loaded = store.load()
    assert torch.equal(loaded.tensors["weights"]["w"], tensor)
