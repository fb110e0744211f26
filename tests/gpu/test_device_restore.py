"""A model and its optimizer on a GPU: the restore reads their tensor files straight onto the
GPU (pinned pieces, a stream of its own) and the blocking save writes them through pinned
pieces, with the same bytes and an exact resume; an optimizer's step count stays in host
memory, where AdamW expects it.

These need an NVIDIA GPU: ``pytest -m gpu tests/gpu`` (DEVELOPERS.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.gpu.conftest import requires_cuda
from torch import nn

from nbresume import Checkpointer, CheckpointStore
from nbresume.checkpoint.state import restoring
from nbresume.checkpoint.store import reading
from testkit.training import assert_restored_exactly

pytestmark = [pytest.mark.gpu, requires_cuda]


def trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(512, 512), nn.BatchNorm1d(512), nn.Linear(512, 64)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(16, 512, device="cuda")).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_a_gpu_model_is_restored_onto_the_gpu_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reading, "DEVICE_PIECE", 1 << 16)  # many pieces through the ring
    monkeypatch.setenv("NBRESUME_GPU_DIRECT_READ", "1")
    model, optimizer = trained(0)
    with Checkpointer(tmp_path, every=None, deadline=None, model=model, optimizer=optimizer) as ck:
        ck.save(2)
    # The blocking save's files (through pinned pieces) hold the model's bytes.
    saved = CheckpointStore(tmp_path).load().tensors["model"]
    for key, value in model.state_dict().items():
        assert torch.equal(saved[key], value.cpu()), key
    restored, restored_opt = trained(1)
    placed = restoring.devices({"model": restored, "optimizer": restored_opt})
    assert placed == {
        "model.safetensors": torch.device("cuda", 0),
        "optimizer.safetensors": torch.device("cuda", 0),
    }
    with Checkpointer(
        tmp_path, every=None, deadline=None, model=restored, optimizer=restored_opt
    ) as ck:
        assert ck.restore() == 2
    assert_restored_exactly(model, optimizer, restored, restored_opt)
    x = torch.randn(16, 512, device="cuda")
    for net, opt in ((model, optimizer), (restored, restored_opt)):
        net(x).square().mean().backward()
        opt.step()
    for key, value in model.state_dict().items():
        assert torch.equal(restored.state_dict()[key], value), key
