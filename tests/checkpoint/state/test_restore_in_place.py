"""A restore needs no second copy of the state: a module's parameters and buffers (and an
optimizer's state tensors) are read into in place, once every file is verified, or take the
memory the checkpoint was read into, and nothing a training loop relies on changes: the
parameter objects the optimizer holds, tied weights, memory layouts, shared memory, and the
all-or-nothing promise when a load fails."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nbresume import Checkpointer, CheckpointStore
from nbresume.errors import CheckpointError
from testkit.stateful import QUIET
from testkit.training import train_steps


class Net(nn.Module):
    """Linear layers, a BatchNorm (buffers), and an output layer tied to the input one."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16, bias=False)
        self.body = nn.Linear(16, 16)
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 8, bias=False)
        self.head.weight = nn.Parameter(self.embed.weight.t().contiguous())
        self.out = nn.Linear(16, 16, bias=False)
        self.out.weight = self.body.weight  # tied: one Parameter under two names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.out(self.norm(torch.relu(self.body(self.embed(x))))))


def build(seed: int) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [t.clone() for t in model.state_dict().values()]
    for state in optimizer.state_dict()["state"].values():
        tensors += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def assert_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype
        assert torch.equal(x, y)


def saved_run(folder: Path) -> list[torch.Tensor]:
    """Train 3 steps, save, train 3 more; return the state after all 6."""
    model, optimizer = build(seed=0)
    ckpt = Checkpointer(folder, model=model, optimizer=optimizer, **QUIET)
    train_steps(model, optimizer, range(3), batch=4)
    ckpt.save(3)
    ckpt.close()
    train_steps(model, optimizer, range(3, 6), batch=4)
    return snapshot(model, optimizer)


def test_a_restored_run_continues_bit_exactly_in_its_own_memory(tmp_path: Path) -> None:
    expected = saved_run(tmp_path / "run")
    model, optimizer = build(seed=1)
    parameters = list(model.parameters())
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    ckpt = Checkpointer(tmp_path / "run", model=model, optimizer=optimizer, **QUIET)
    assert ckpt.restore() == 3
    # The optimizer still steps the model's own parameter objects; the tie holds.
    assert all(a is b for a, b in zip(parameters, model.parameters(), strict=True))
    assert optimizer.param_groups[0]["params"] == parameters
    assert model.out.weight is model.body.weight
    # Every parameter, the tied one too, keeps its memory: the checkpoint was read into it.
    moved = {name for name, p in model.named_parameters() if p.data_ptr() != pointers[name]}
    assert moved == set()
    train_steps(model, optimizer, range(3, 6), batch=4)
    assert_equal(snapshot(model, optimizer), expected)
    # What it saves next is what it trained.
    ckpt.save(6)
    ckpt.close()
    loaded = CheckpointStore(tmp_path / "run").load()
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.tensors["model"][name], value), name


def laid_out(seed: int) -> tuple[nn.Module, torch.Tensor, nn.Module, nn.Module]:
    """A channels_last convolution, a flat buffer and a module whose two parameters are views
    of it, and a model in shared memory (Hogwild), made after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    flat = torch.zeros(6)
    viewed = nn.Module()
    viewed.a = nn.Parameter(flat[:2])  # type: ignore[assignment]
    viewed.b = nn.Parameter(flat[2:])  # type: ignore[assignment]
    return conv, flat, viewed, nn.Linear(4, 4).share_memory()


def test_layouts_shared_memory_and_views_are_kept(tmp_path: Path) -> None:
    """A channels_last weight, a model in shared memory (Hogwild) and parameters that are
    views of one flat buffer keep their layout and memory after a restore."""
    conv, _, viewed, shared = laid_out(0)
    for module in (conv, viewed, shared):
        for p in module.parameters():
            p.data.normal_()
    ckpt = Checkpointer(tmp_path / "run", conv=conv, viewed=viewed, shared=shared, **QUIET)
    ckpt.save(1)
    ckpt.close()
    expected = {name: snapshot(m, torch.optim.SGD([torch.zeros(1)])) for name, m in
                {"conv": conv, "viewed": viewed, "shared": shared}.items()}  # fmt: skip

    conv2, flat2, viewed2, shared2 = laid_out(1)
    ckpt = Checkpointer(tmp_path / "run", conv=conv2, viewed=viewed2, shared=shared2, **QUIET)
    assert ckpt.restore() == 1
    ckpt.close()
    assert conv2.weight.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(flat2, torch.cat([viewed.a.detach(), viewed.b.detach()]))
    assert viewed2.a.data_ptr() == flat2.data_ptr()
    assert all(p.is_shared() for p in shared2.parameters())
    for name, module in {"conv": conv2, "viewed": viewed2, "shared": shared2}.items():
        assert_equal(snapshot(module, torch.optim.SGD([torch.zeros(1)])), expected[name])


def test_a_load_that_fails_after_adopting_puts_every_tensor_back(tmp_path: Path) -> None:
    """A module whose load still fails (here a load hook raises, after its parameters took
    the checkpoint's memory) is left exactly as it was: values and memory."""
    saved_run(tmp_path / "run")
    model, optimizer = build(seed=1)
    before = [t.clone() for t in model.state_dict().values()]
    pointers = [t.data_ptr() for t in model.state_dict().values()]

    def refuse(module: nn.Module, keys: Any) -> None:
        raise RuntimeError("refused by a load hook")

    model.register_load_state_dict_post_hook(refuse)
    ckpt = Checkpointer(tmp_path / "run", model=model, optimizer=optimizer, **QUIET)
    with pytest.raises(CheckpointError, match="refused by a load hook"):
        ckpt.restore()
    ckpt.close()
    assert_equal([t.clone() for t in model.state_dict().values()], before)
    assert [t.data_ptr() for t in model.state_dict().values()] == pointers
