"""A checkpoint of a ``torch.compile``d model restores into the plain model, and a plain
model's into a compiled one: the compiled wrapper's names carry ``_orig_mod.``, and nbresume
maps them where that makes the names match exactly (never otherwise).

The models are compiled with the ``eager`` backend: the same ``OptimizedModule`` wrapper and
names as the default backend, without generating kernels (seconds, and no C++ compiler), and
the same arithmetic as the plain model, so that a run that changes wrapper on resume can be
compared bit for bit with one that never stopped.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from nbresume import Checkpointer
from nbresume.errors import CheckpointError
from testkit.stateful import QUIET
from testkit.training import train_steps


@pytest.fixture(autouse=True)
def inductor_cache_in_the_test_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Dynamo keeps its profile of compiled frames in inductor's cache folder, which is
    # /tmp/torchinductor_<user> unless this names another (and torch then sets it in
    # os.environ itself: the monkeypatch takes it back out after the test).
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def build(*, compiled: bool, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model: nn.Module = Net()
    if compiled:
        model = torch.compile(model, backend="eager")  # type: ignore[assignment]
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the model (by its plain name) and of the optimizer's state."""
    out = {k.replace("_orig_mod.", ""): v.clone() for k, v in model.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        out |= {f"opt.{index}.{k}": v.clone() for k, v in state.items() if torch.is_tensor(v)}
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert value.dtype == b[key].dtype, key
        assert torch.equal(value, b[key]), key


@pytest.mark.parametrize(
    ("saved_compiled", "restored_compiled"),
    [(True, False), (False, True)],
    ids=["compiled-to-plain", "plain-to-compiled"],
)
def test_a_checkpoint_restores_across_torch_compile_and_resumes_bit_exactly(
    tmp_path: Path, saved_compiled: bool, restored_compiled: bool
) -> None:
    model, optimizer = build(compiled=saved_compiled)
    if saved_compiled:
        assert any(k.startswith("_orig_mod.") for k in model.state_dict())
    ckpt = Checkpointer(tmp_path / "run", model=model, optimizer=optimizer, **QUIET)
    train_steps(model, optimizer, range(4), batch=6)
    ckpt.save(4)
    ckpt.close()
    at_save = tensors(model, optimizer)
    train_steps(model, optimizer, range(4, 8), batch=6)  # the run that never stopped
    uninterrupted = tensors(model, optimizer)

    model, optimizer = build(compiled=restored_compiled, seed=1)  # other weights before
    ckpt = Checkpointer(tmp_path / "run", model=model, optimizer=optimizer, **QUIET)
    assert ckpt.restore() == 4
    assert_same(tensors(model, optimizer), at_save)
    train_steps(model, optimizer, range(4, 8), batch=6)
    ckpt.close()
    assert_same(tensors(model, optimizer), uninterrupted)


def test_names_that_differ_by_more_than_compile_are_refused_naming_compile(
    tmp_path: Path,
) -> None:
    model, optimizer = build(compiled=True)
    ckpt = Checkpointer(tmp_path / "run", model=model, optimizer=optimizer, **QUIET)
    ckpt.save(1)
    ckpt.close()

    class Other(Net):  # the plain names differ too: "head" is "out" here
        def __init__(self) -> None:
            super().__init__()
            self.out = self.head
            del self.head

    other = Other()
    before = {k: v.clone() for k, v in other.state_dict().items()}
    ckpt = Checkpointer(tmp_path / "run", model=other, **QUIET)
    with pytest.raises(CheckpointError, match=r"torch\.compile") as caught:
        ckpt.restore()
    ckpt.close()
    assert "model._orig_mod.body.0.weight" in str(caught.value)
    assert_same(dict(other.state_dict()), before)
