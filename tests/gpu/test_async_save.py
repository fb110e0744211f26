"""A background save of a large CUDA state holds exactly the state of its step, although
training changes every weight and every optimizer moment the moment ``save()`` returns.

About 2 GB on CUDA: ten ``nn.Linear(4096, 4096)`` with AdamW's two moments. On the CPU
(``NBRESUME_GPU_TESTS_DEVICE=cpu``) the same test runs with a small model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tests.gpu.conftest import DEVICE, requires_device
from torch import nn

from nbresume import Checkpointer

pytestmark = [pytest.mark.gpu, requires_device]

#: (layers, width): about 2 GB of weights and moments on CUDA, 50 MB on the CPU.
SIZE = (10, 4096) if DEVICE == "cuda" else (4, 1024)


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    layers, width = SIZE
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers))).to(DEVICE)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the model and the optimizer, by name (the live tensors, not copies)."""
    found = {f"model.{k}": v for k, v in model.state_dict().items()}
    for index, values in optimizer.state_dict()["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                found[f"optimizer.{index}.{key}"] = value
    return found


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def test_an_async_save_holds_its_steps_state_while_training_changes_it(
    tmp_path: Path, gpu_check: Callable[[str, bool, str], None]
) -> None:
    torch.manual_seed(0)
    model, optimizer = build()
    x = torch.randn(8, SIZE[1], device=DEVICE)
    train_step(model, optimizer, x)  # the optimizer's moments exist
    ckpt = Checkpointer(tmp_path / "ckpt", every=None, keep=None, deadline=None,
                        async_save=True, quiet=True, model=model, optimizer=optimizer)  # fmt: skip
    # The copy of the moment of the save, queued on the same stream before it: nothing runs
    # between the two.
    at_save = {k: v.clone() for k, v in state(model, optimizer).items()}
    size = sum(v.numel() * v.element_size() for v in at_save.values())
    started = time.monotonic()
    ckpt.save(step=1)
    returned = time.monotonic() - started
    for _ in range(3):
        train_step(
            model, optimizer, x
        )  # at once, on the device's queue: every weight and moment changes in place
    live = state(model, optimizer)
    assert not any(torch.equal(live[k], v) for k, v in at_save.items() if k.endswith("weight"))
    ckpt.wait()
    written = time.monotonic() - started
    report = ckpt.verify()
    ckpt.close()
    assert report.ok, report.summary

    fresh_model, fresh_optimizer = build()
    again = Checkpointer(tmp_path / "ckpt", every=None, deadline=None, quiet=True,
                         model=fresh_model, optimizer=fresh_optimizer)  # fmt: skip
    assert again.restore() == 1
    again.close()
    restored = state(fresh_model, fresh_optimizer)
    differ = [k for k, v in at_save.items() if k not in restored or not torch.equal(restored[k], v)]
    extra = sorted(restored.keys() - at_save.keys())
    gpu_check(
        f"async-save-{size / 1e9:.1f}GB",
        not differ and not extra,
        f"the checkpoint holds the state of its step while training went on; "
        f"verified; save() returned after {returned:.2f} s, written after {written:.2f} s"
        + (f"; differ: {differ[:3]}" if differ else "")
        + (f"; not saved: {extra[:3]}" if extra else ""),
    )
    assert not differ, f"the checkpoint does not hold the state of its step: {differ[:5]}"
    assert not extra, extra
    del model, optimizer, fresh_model, fresh_optimizer, at_save, live, restored
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
