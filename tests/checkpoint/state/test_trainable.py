"""Fine-tuning with frozen weights: a checkpoint holds what trains plus a fingerprint of the
base, resumes exactly, and refuses a different base by name.

The model is a LoRA-style adapter on frozen Linear layers: each layer ``y = W x + b`` (``W``,
``b`` frozen, from a seeded "pretrained" base) gains ``B A x`` with trainable ``A`` (r x d) and
``B`` (d x r). The size test uses d = 512 and r = 13: 4.8 % of the parameters train; the
other tests use a smaller one, to stay fast.

Run as a script (``python tests/checkpoint/state/test_trainable.py DIR TOTAL``), this file is the
child that the kill test starts: it trains with ``trainable_only=True``, saving every step.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import nbresume
from nbresume import BaseMismatchError, Checkpointer, CheckpointError, trainable_only

QUIET: dict[str, Any] = {"every": None, "deadline": None, "async_save": False}
D, RANK, LAYERS = 128, 3, 3


class LoRALinear(nn.Module):
    def __init__(self, d: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, d) * 0.02)
        self.lora_b = nn.Parameter(torch.zeros(d, rank))
        self.dropout = nn.Dropout(0.1)  # draws from the RNG: a resume must restore it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.dropout(x) @ self.lora_a.T @ self.lora_b.T


def lora_model(d: int = D, rank: int = RANK, layers: int = LAYERS, base_seed: int = 0) -> nn.Module:
    """The same "pretrained" base for a given seed; adapters drawn from the global RNG."""
    with torch.random.fork_rng():
        torch.manual_seed(base_seed)
        bases = [nn.Linear(d, d) for _ in range(layers)]
    model = nn.Sequential(*(LoRALinear(d, rank) for _ in range(layers)))
    for layer, base in zip(model, bases, strict=True):
        layer.base.load_state_dict(base.state_dict())  # type: ignore[union-attr]
    return model


def batch(step: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, d, generator=g), torch.randn(16, d, generator=g)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    x, y = batch(step, model[0].base.in_features)  # type: ignore[index]
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir())


def state_hash(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# -- what is saved, and how big it is --------------------------------------------------------


def test_five_percent_trainable_gives_a_checkpoint_a_fraction_of_the_full_one(
    tmp_path: Path,
) -> None:
    """Sizes of whole checkpoint folders (tensor files, state.json, manifest), after 2 steps:

    - "full" is what the Checkpointer saves without the wrapper: the model's whole state_dict
      plus the optimizer, built over the trainable parameters (the usual LoRA setup);
    - "trainable-only" is the same Checkpointer with ``trainable_only=True``.

    With AdamW the trainable state is 3x the trainable weights (weights and two moments):
    ~15 % of the model, against ~110 % for full, so ~7x smaller, not 10x; with SGD and
    momentum it is 2x: ~10 % against ~105 %, so ~10x. The test also compares the trainable-only
    checkpoint with the model's own state_dict alone.
    """
    ratios = {}
    for name, make in {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    }.items():
        torch.manual_seed(0)
        model = lora_model(d=512, rank=13)
        fraction = sum(p.numel() for p in trainable(model)) / sum(
            p.numel() for p in model.parameters()
        )
        assert 0.045 < fraction < 0.055
        optimizer = make(trainable(model))
        train_step(model, optimizer, 0)  # the optimizer's state exists from the first step
        sizes = {}
        for mode in ("full", "trainable-only"):
            ckpt = Checkpointer(tmp_path / name / mode, model=model, optimizer=optimizer,
                                trainable_only=mode == "trainable-only", **QUIET)  # fmt: skip
            info = ckpt.save(step=1)
            assert info is not None
            sizes[mode] = folder_bytes(tmp_path / name / mode / "000000000001")
        model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        ratios[name] = sizes["full"] / sizes["trainable-only"]
        print(f"{name}: full {sizes['full']} B, trainable-only {sizes['trainable-only']} B "
              f"({ratios[name]:.1f}x smaller; {sizes['trainable-only'] / model_bytes:.1%} of the "
              f"model's state_dict)")  # fmt: skip
        assert sizes["trainable-only"] < 0.16 * model_bytes  # measured: 15.3 % and 10.4 %
    # Measured: AdamW 7.2x, SGD with momentum 10.2x (the RNG states and state.json add ~24 kB
    # to both: not negligible at this size, in favour of neither).
    assert ratios["adamw"] > 7
    assert ratios["sgd-momentum"] > 10


def test_an_optimizer_over_all_parameters_keeps_no_state_for_the_frozen_ones(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = lora_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # frozen ones included
    for step in range(2):
        train_step(model, optimizer, step)
    params = list(model.parameters())
    held = {params[i].requires_grad for i in optimizer.state_dict()["state"]}
    assert held == {True}  # a parameter whose grad is None never gets a state
    assert len(optimizer.state_dict()["state"]) == len(trainable(model))

    torch.manual_seed(0)
    lean = lora_model()
    lean_optimizer = torch.optim.AdamW(trainable(lean), lr=1e-3)
    for step in range(2):
        train_step(lean, lean_optimizer, step)
    for which, (m, o) in {"all": (model, optimizer), "lean": (lean, lean_optimizer)}.items():
        Checkpointer(tmp_path / which, model=trainable_only(m), optimizer=o, **QUIET).save(step=2)
    all_size = folder_bytes(tmp_path / "all" / "000000000002")
    lean_size = folder_bytes(tmp_path / "lean" / "000000000002")
    assert all_size < 1.01 * lean_size  # only the parameter indices of the frozen ones more


def test_changed_buffers_are_saved_and_a_large_frozen_buffer_is_not(tmp_path: Path) -> None:
    class Tagged(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("table", torch.arange(1_000_000, dtype=torch.float32))  # 4 MB
            self.head = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))

    model = Tagged()
    wrapped = trainable_only(model)
    model.head[1].train()
    model.head(torch.randn(4, 8))  # BatchNorm's running statistics move
    ckpt = Checkpointer(tmp_path / "run", model=wrapped, **QUIET)
    ckpt.save(step=1)
    saved = set(wrapped.state_dict()["tensors"])
    assert saved == {
        "head.0.weight", "head.0.bias", "head.1.weight", "head.1.bias",
        "head.1.running_mean", "head.1.running_var", "head.1.num_batches_tracked",
    }  # fmt: skip
    assert folder_bytes(tmp_path / "run" / "000000000001") < 100_000


def test_a_layer_frozen_again_after_training_stays_saved_in_full(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = lora_model()
    wrapped = trainable_only(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model[0].base.requires_grad_(True)  # type: ignore[index]
    train_step(model, optimizer, 0)
    ckpt = Checkpointer(tmp_path / "run", model=wrapped, **QUIET)
    ckpt.save(step=1)
    model[0].base.requires_grad_(False)  # type: ignore[index]
    ckpt.save(step=2)
    assert "0.base.weight" in wrapped.state_dict()["tensors"]

    fresh = lora_model()
    Checkpointer(tmp_path / "run", model=fresh, trainable_only=True, **QUIET).restore()
    assert torch.equal(fresh[0].base.weight, model[0].base.weight)  # type: ignore[index]


# -- resume ------------------------------------------------------------------------------------


def run_steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: Iterator[int]) -> None:
    for step in steps:
        train_step(model, optimizer, step)


def test_a_resumed_run_ends_bit_identical_to_an_uninterrupted_one(tmp_path: Path) -> None:
    torch.manual_seed(1)
    reference = lora_model()
    optimizer = torch.optim.AdamW(trainable(reference), lr=1e-2)
    run_steps(reference, optimizer, iter(range(8)))

    torch.manual_seed(1)
    model = lora_model()
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-2)
    first = Checkpointer(tmp_path / "run", model=model, optimizer=optimizer,
                         trainable_only=True, **QUIET)  # fmt: skip
    run_steps(model, optimizer, first.steps(3))
    first.close()

    torch.manual_seed(99)  # the adapters start elsewhere: the checkpoint must put them back
    model = lora_model()
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-2)
    second = Checkpointer(tmp_path / "run", model=model, optimizer=optimizer,
                          trainable_only=True, **QUIET)  # fmt: skip
    assert second.restore() == 3
    run_steps(model, optimizer, second.steps(8))
    second.close()
    for (name, a), b in zip(
        reference.state_dict().items(), model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_a_run_killed_mid_training_resumes_bit_identical(tmp_path: Path) -> None:
    """A child trains with a save every step and is killed with SIGKILL after step 6; the run
    resumed (here, in the test's process) ends on the hash of a run never interrupted."""
    total = 12
    command = [sys.executable, __file__, str(tmp_path / "run"), str(total)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert child.stdout is not None
    for line in child.stdout:
        if line.startswith("step 6"):
            child.send_signal(signal.SIGKILL)  # as a preempted machine: no chance to save
            break
    child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL

    printed: list[str] = []
    resumed = kill_test_run(tmp_path / "run", total, printed.append)
    assert printed[0].startswith("start ")
    assert int(printed[0].split()[1]) >= 6, printed
    uninterrupted: list[str] = []
    assert resumed == kill_test_run(tmp_path / "reference", total, uninterrupted.append)
    assert uninterrupted[0] == "start 0"


# -- a different base --------------------------------------------------------------------------


def saved_run(folder: Path) -> None:
    torch.manual_seed(0)
    model = lora_model()
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-2)
    ckpt = Checkpointer(folder, model=model, optimizer=optimizer, trainable_only=True, **QUIET)
    run_steps(model, optimizer, ckpt.steps(2))


def test_a_changed_base_weight_is_refused_by_name(tmp_path: Path) -> None:
    saved_run(tmp_path / "run")
    model = lora_model()
    before = state_hash(model)
    with torch.no_grad():
        model[1].base.weight[3, 4] += 1e-3  # type: ignore[index]
    changed = state_hash(model)
    ckpt = Checkpointer(tmp_path / "run", model=model, trainable_only=True, **QUIET)
    with pytest.raises(BaseMismatchError, match=r"'1\.base\.weight' has other contents") as caught:
        ckpt.restore()
    assert isinstance(caught.value, CheckpointError)
    assert caught.value.tensor == "1.base.weight"
    assert "same base weights" in caught.value.fix
    assert state_hash(model) == changed != before  # refused before anything was loaded


def test_a_base_of_another_shape_or_layout_is_refused_by_name(tmp_path: Path) -> None:
    saved_run(tmp_path / "run")
    narrower = lora_model(d=D // 2)
    ckpt = Checkpointer(tmp_path / "run", model=narrower, trainable_only=True, **QUIET)
    with pytest.raises(BaseMismatchError, match=r"'0\.base\.weight' is float32 \[64, 64\] here "
                       r"and float32 \[128, 128\] in the checkpoint") as caught:  # fmt: skip
        ckpt.restore()
    assert caught.value.tensor == "0.base.weight"

    model = lora_model()
    model[2].base = nn.Linear(D, D, bias=False).requires_grad_(False)  # type: ignore[index]
    ckpt = Checkpointer(tmp_path / "run", model=model, trainable_only=True, **QUIET)
    with pytest.raises(BaseMismatchError, match=r"'2\.base\.bias' is in the checkpoint but not in"):
        ckpt.restore()


def test_the_fingerprint_is_computed_once(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = lora_model()
    wrapped = trainable_only(model)
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-2)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    ckpt = Checkpointer(tmp_path / "run", model=wrapped, optimizer=optimizer, every=1,
                        deadline=None, async_save=False)  # fmt: skip
    run_steps(model, optimizer, ckpt.steps(4))
    assert len(ckpt.list()) == 3  # keep=3 of the 4 saves
    fingerprint = wrapped.fingerprint
    assert wrapped.frozen_hashes == len(frozen)  # one per frozen tensor, for all those saves
    assert len(fingerprint) == 64

    again = trainable_only(lora_model())
    Checkpointer(tmp_path / "run", model=again, trainable_only=True, **QUIET).restore()
    assert again.frozen_hashes == len(frozen)
    assert again.fingerprint == fingerprint


def test_the_wrapper_and_its_error_are_public() -> None:
    assert {"trainable_only", "TrainableOnly", "BaseMismatchError"} <= set(nbresume.__all__)


# -- the child of the kill test ----------------------------------------------------------------


def kill_test_run(folder: Path, total: int, say: Callable[[str], object] = print) -> str:
    """Train to ``total`` with a save every step (resuming from ``folder``); the final hash."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same kernels in the child and in the test's process
    try:
        torch.manual_seed(5)
        model = lora_model(d=64, rank=2)
        optimizer = torch.optim.AdamW(trainable(model), lr=1e-2)
        ckpt = Checkpointer(folder, model=model, optimizer=optimizer, trainable_only=True,
                            every=1, deadline=None, async_save=False)  # fmt: skip
        say(f"start {ckpt.restore()}")
        for step in ckpt.steps(total):
            train_step(model, optimizer, step)
            say(f"step {step}")
        ckpt.close()
        return state_hash(model)
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    kill_test_run(Path(sys.argv[1]), int(sys.argv[2]), lambda line: print(line, flush=True))
