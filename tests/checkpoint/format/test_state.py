"""Training state without pickle: real state_dicts survive flatten -> files -> unflatten exactly.

The round trip goes through what a checkpoint really holds: the JSON document is dumped and
parsed with plain ``json``, the tensors are written as safetensors bytes and read back.
"""

from __future__ import annotations

import copy
import json
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import nbresume
from nbresume.checkpoint.format import capture_rng, flatten, restore_rng, tensorfile, unflatten
from nbresume.errors import CheckpointError

# -- helpers --------------------------------------------------------------------------------


def through_files(tree: Any) -> Any:
    """flatten, then what a checkpoint does with the parts, then unflatten."""
    document, tensors = flatten(tree, name="obj")
    text = json.dumps(document, allow_nan=False)  # strict JSON: nan/inf must be tagged
    buffer = bytearray(b"".join(bytes(c) for c in tensorfile.encode(tensors).chunks()))
    read_back = tensorfile.decode(buffer, where="test")
    return unflatten(json.loads(text), read_back, where="test")


def assert_identical(expected: Any, actual: Any, path: str = "", *, ordered: bool = True) -> None:
    """Same structure, same types, same values (nan equal to nan, tensors bit for bit).

    An OrderedDict (what ``Module.state_dict()`` returns) comes back a dict, which keeps its
    order and which ``load_state_dict`` takes alike.
    """
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path}: {type(actual)} is not a dict"
    else:
        assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), path
        assert actual.device.type == "cpu", path
        left = expected.detach().contiguous().reshape(-1).view(torch.uint8)
        right = actual.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(left, right), f"{path}: tensor bytes differ"
    elif isinstance(expected, np.ndarray):
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), path
        assert expected.tobytes() == actual.tobytes(), f"{path}: array bytes differ"
    elif isinstance(expected, dict):
        if ordered:
            assert list(actual) == list(expected), f"{path}: keys or their order differ"
        assert set(actual) == set(expected), f"{path}: keys differ"
        for key in expected:
            assert_identical(expected[key], actual[key], f"{path}/{key}", ordered=ordered)
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), path
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            assert_identical(e, a, f"{path}/{i}", ordered=ordered)
    elif isinstance(expected, (float, np.floating)) and math.isnan(expected):
        assert math.isnan(actual), path
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    inputs = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, 6, generator=inputs)
    return model(x.to(next(model.parameters()).dtype)).float().pow(2).mean()


def trained(optimizer_factory: Callable[..., torch.optim.Optimizer], steps: int = 3) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))
    optimizer = optimizer_factory(model.parameters())
    for step in range(steps):
        optimizer.zero_grad()
        loss_of(model, step).backward()
        optimizer.step()
    return model, optimizer


# -- real state_dicts -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "factory",
    [
        pytest.param(lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1), id="adamw"),
        pytest.param(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True), id="sgd"),
        pytest.param(lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True), id="adam-amsgrad"),
    ],
)
def test_optimizer_state_round_trips_exactly(
    factory: Callable[..., torch.optim.Optimizer],
) -> None:
    _, optimizer = trained(factory)
    state = optimizer.state_dict()
    assert state["state"], "the optimizer must have state after a step"
    assert_identical(state, through_files(state))


def scheduler_cases() -> dict[str, Callable[[torch.optim.Optimizer], Any]]:
    sched = torch.optim.lr_scheduler
    return {
        "onecycle": lambda o: sched.OneCycleLR(o, max_lr=0.1, total_steps=20),
        "cosine": lambda o: sched.CosineAnnealingLR(o, T_max=7, eta_min=1e-4),
        "lambda": lambda o: sched.LambdaLR(o, lambda epoch: 0.95**epoch),
        "sequential": lambda o: sched.SequentialLR(
            o,
            [sched.LinearLR(o, start_factor=0.1, total_iters=2), sched.ExponentialLR(o, 0.9)],
            milestones=[2],
        ),
    }


@pytest.mark.parametrize("name", list(scheduler_cases()))
def test_scheduler_state_round_trips_and_resumes_the_same_lrs(name: str) -> None:
    def build() -> tuple[torch.optim.Optimizer, Any]:
        model = nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return optimizer, scheduler_cases()[name](optimizer)

    optimizer, scheduler = build()
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    state = scheduler.state_dict()
    restored = through_files(state)
    assert_identical(state, restored)

    fresh_optimizer, fresh = build()
    fresh.load_state_dict(restored)
    fresh_optimizer.load_state_dict(through_files(optimizer.state_dict()))
    for _ in range(5):
        optimizer.step()
        scheduler.step()
        fresh_optimizer.step()
        fresh.step()
        assert fresh.get_last_lr() == scheduler.get_last_lr()


def test_grad_scaler_state_round_trips() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    model, optimizer = trained(lambda p: torch.optim.SGD(p, lr=0.01))
    for step in range(4):
        optimizer.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        scaler.step(optimizer)
        scaler.update()
    state = scaler.state_dict()
    assert state["_growth_tracker"] == 1
    assert state["scale"] == 2.0**11
    assert_identical(state, through_files(state))


def test_model_with_buffers_and_half_precision_round_trips() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3), nn.Linear(3, 3))
    model(torch.randn(16, 4))  # moves the running statistics and num_batches_tracked
    model[2].to(torch.bfloat16)
    model[3].to(torch.float16)
    state = model.state_dict()
    dtypes = {v.dtype for v in state.values()}
    assert {torch.float32, torch.bfloat16, torch.float16, torch.int64} <= dtypes
    assert int(state["1.num_batches_tracked"]) == 1
    assert_identical(state, through_files(state))


def test_plain_values_round_trip_with_their_types() -> None:
    tree = {
        "tuple": (1, (2.5, "x"), None),
        "int keys": {0: "zero", 7: [1, 2], -3: {"nested": True}},
        "mixed keys": {1: "a", "1": "b", (2, 3): "tuple key"},
        "a key named like the tag": {"$t": "not a tag"},
        "floats": [float("nan"), float("inf"), -float("inf"), -0.0, 1e-300],
        "bytes": b"\x00\x80\xffpickle?",
        "numpy scalars": [
            np.float64(1.5),
            np.float32(-2.0),
            np.int64(-7),
            np.uint8(200),
            np.bool_(True),
            np.float64("nan"),
        ],
        "numpy arrays": [
            np.arange(6, dtype=np.int32).reshape(2, 3),
            np.array([0.5, np.nan], dtype=np.float64),
            np.zeros(0, np.uint32),
        ],
        "nested lists": [[[]], [[1, [2, [3, "deep"]]]]],
        "torch": [torch.tensor(3), torch.zeros(0, 4), torch.Size([2, 3])],
        "empty": {},
    }
    expected = dict(tree)
    expected["torch"] = [torch.tensor(3), torch.zeros(0, 4), (2, 3)]  # a Size comes back a tuple
    assert_identical(expected, through_files(tree))


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        pytest.param(lambda: 0, "function", id="lambda"),
        pytest.param(object(), "object", id="object"),
        pytest.param(Path("/tmp"), "Path", id="path"),
        pytest.param({1, 2}, "set", id="set"),
    ],
)
def test_anything_else_is_refused_with_its_path(value: Any, kind: str) -> None:
    tree = {"state": {3: {"exp_avg": torch.zeros(1)}}, "groups": [{"lr": 0.1, "hook": value}]}
    with pytest.raises(CheckpointError, match=kind) as caught:
        flatten(tree, name="optimizer")
    assert "optimizer/groups/0/hook" in str(caught.value)
    assert "pickle" in caught.value.fix


# -- random number generators -----------------------------------------------------------------


def draws() -> tuple[Any, ...]:
    return (
        random.random(),
        random.gauss(0, 1),
        np.random.rand(3).tolist(),
        np.random.standard_normal(),
        torch.rand(3).tolist(),
        torch.randn(2).tolist(),
    )


def test_rng_states_continue_exactly_after_restore() -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    # An odd number of Gaussian draws leaves a cached value in Python's and NumPy's state.
    random.gauss(0, 1)
    np.random.standard_normal()
    assert random.getstate()[2] is not None
    assert np.random.get_state()[3] == 1

    captured = through_files(capture_rng())
    first = draws()
    for _ in range(5):
        draws()  # move every generator far away
    restore_rng(captured)
    assert draws() == first


# -- through the whole Checkpointer ----------------------------------------------------------


def build_run(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=20)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}


def train_step(run: dict[str, Any], step: int) -> None:
    run["model"].train()
    run["optimizer"].zero_grad()
    run["scaler"].scale(loss_of(run["model"], step)).backward()
    run["scaler"].step(run["optimizer"])
    run["scaler"].update()
    run["scheduler"].step()


def test_checkpointer_restores_fresh_objects_that_then_train_identically(tmp_path: Path) -> None:
    options: dict[str, Any] = {"every": None, "deadline": None, "async_save": False}
    run = build_run(seed=0)
    for step in range(5):
        train_step(run, step)
    ckpt = nbresume.Checkpointer(tmp_path / "run", **options, **run)
    ckpt.save(step=5)
    ckpt.close()
    saved = {name: copy.deepcopy(obj.state_dict()) for name, obj in run.items()}
    for step in range(5, 9):  # dropout draws from the global RNG, saved with the checkpoint
        train_step(run, step)

    fresh = build_run(seed=123)  # other initial weights: everything must come from the file
    resumed = nbresume.Checkpointer(tmp_path / "run", **options, **fresh)
    assert resumed.restore() == 5
    # The key order of a state_dict is not part of the state: load_state_dict matches by name.
    for name, obj in fresh.items():
        assert_identical(saved[name], obj.state_dict(), name, ordered=False)
    for step in range(5, 9):
        train_step(fresh, step)
    for name in run:
        assert_identical(run[name].state_dict(), fresh[name].state_dict(), name, ordered=False)


def test_checkpoint_holds_only_json_and_safetensors(tmp_path: Path) -> None:
    from safetensors import safe_open

    ckpt = nbresume.Checkpointer(
        tmp_path / "run", every=None, deadline=None, async_save=False, **build_run(0)
    )
    ckpt["history"] = {"losses": [1.0, float("nan")], "betas": (0.9, 0.99)}
    info = ckpt.save(step=1)
    assert info is not None
    folder = Path(info.location)
    names = sorted(p.name for p in folder.iterdir())
    assert "state.json" in names
    assert "manifest.json" in names
    for path in folder.iterdir():
        if path.suffix == ".json":
            json.loads(path.read_text())  # plain JSON, no extensions
        else:
            assert path.suffix == ".safetensors"
            with safe_open(str(path), framework="pt") as handle:
                assert list(handle.keys())


def nested(levels: int) -> Any:
    """A document of ``levels`` nested containers (lists and objects in turn), each level
    also holding scalars beside the next one."""
    document: Any = [1, "x", None]
    for level in range(1, levels):
        document = {"a": 1.5, "next": document} if level % 2 else [True, document, 2]
    return document


@pytest.mark.parametrize("levels", [1, 7, 100])
def test_a_saved_tree_nested_up_to_the_limit_is_rebuilt(levels: int) -> None:
    document = nested(levels)
    assert unflatten(document, {}, where="test") == document


@pytest.mark.parametrize("levels", [101, 5000])
def test_a_saved_tree_nested_past_the_limit_is_refused_as_damage(levels: int) -> None:
    with pytest.raises(nbresume.CorruptCheckpointError, match="nested deeper than 100 levels"):
        unflatten(nested(levels), {}, where="test")
