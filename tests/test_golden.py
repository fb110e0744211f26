"""Checkpoints written in format v1 keep loading, forever.

tests/golden/v1 holds a checkpoint committed once (by tests/golden/make_golden.py). These
tests load it with today's code and compare every value with the recipe, recomputed here on
its own, so that a change to the reader that breaks old checkpoints cannot pass.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import safetensors.torch
import torch

from nbresume import CheckpointStore
from testkit.paths import ROOT

GOLDEN = Path(__file__).parent / "golden"
V1 = GOLDEN / "v1"


def expected_tensors() -> dict[str, dict[str, torch.Tensor]]:
    return {
        "model": {
            "linear.weight": torch.tensor(
                [
                    [-0.5, -0.375, -0.25, -0.125],
                    [0.0, 0.125, 0.25, 0.375],
                    [0.5, 0.625, 0.75, 0.875],
                ]
            ),
            "linear.bias": torch.tensor([0.0, 0.25, 0.5], dtype=torch.float16),
            "embed": torch.tensor([[-1.0, -0.5, 0.0], [0.5, 1.0, 1.5]], dtype=torch.bfloat16),
            "counts": torch.tensor([-(2**40) + 1_000_003 * i for i in range(5)]),
            "codes": torch.tensor([-4, -3, -2, -1, 0, 1, 2, 3], dtype=torch.int8),
            "mask": torch.tensor([True, False, False, True, False, False]),
            "scale": torch.tensor(-2.75, dtype=torch.float64),
            "empty": torch.zeros(0, 4),
        },
        "optimizer": {
            "state.0.exp_avg": torch.tensor([-0.125 * i for i in range(12)]).reshape(3, 4),
            "state.0.step": torch.tensor(1500.0),
        },
    }


@pytest.fixture
def golden_copy(tmp_path: Path) -> Path:
    """The committed fixture, copied so that no test can change it."""
    return Path(shutil.copytree(V1, tmp_path / "v1"))


def test_the_v1_golden_checkpoint_verifies(golden_copy: Path) -> None:
    report = CheckpointStore(golden_copy).verify()
    assert report.summary == "OK 1/1, errors 0"


def test_the_v1_golden_checkpoint_loads_exactly(golden_copy: Path) -> None:
    store = CheckpointStore(golden_copy)
    [info] = store.list()
    assert info.step == 1500
    assert info.created == "2024-01-01T00:00:00+00:00"
    assert dict(info.metrics) == {"val_loss": 0.375}
    assert info.manifest.format_version == 1

    loaded = store.load()
    assert loaded.step == 1500
    assert loaded.data == {
        "state": {
            "step": 1500,
            "epoch": 3,
            "lr": 0.001,
            "name": "golden v1",
            "rng": {"seed": 1234, "sequence": [1, 2, 3]},
        }
    }
    expected = expected_tensors()
    assert set(loaded.tensors) == set(expected)
    for stem, group in expected.items():
        assert set(loaded.tensors[stem]) == set(group)
        for name, want in group.items():
            got = loaded.tensors[stem][name]
            assert got.dtype == want.dtype, name
            assert got.shape == want.shape, name
            assert torch.equal(got, want), name


def test_the_official_library_reads_the_golden_files() -> None:
    for stem, group in expected_tensors().items():
        official = safetensors.torch.load_file(str(V1 / "000000001500" / f"{stem}.safetensors"))
        assert set(official) == set(group)
        for name, want in group.items():
            assert torch.equal(official[name], want), name


def test_the_golden_files_are_committed_not_ignored() -> None:
    files = sorted(p for p in V1.rglob("*") if p.is_file())
    assert [p.name for p in files] == [
        "manifest.json",
        "model.safetensors",
        "optimizer.safetensors",
        "state.json",
    ]
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(
        ["git", "check-ignore", *map(str, files)], cwd=GOLDEN, capture_output=True, text=True
    )
    assert ignored.returncode == 1, f"ignored by .gitignore: {ignored.stdout}"
