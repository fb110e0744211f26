"""``deterministic=True``: what it sets, and what nbresume promises with and without it.

Switching determinism on changes process-wide PyTorch settings, so those checks run in a
fresh interpreter. Whether it makes a resumed CUDA run bit-identical is checked on a GPU
(``tests/gpu/``); here only what can be seen without one.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import nbresume
from nbresume import Checkpointer
from nbresume.checkpoint.state import determinism
from nbresume.errors import ArgumentError
from testkit import warmfork

SCRIPT = """
import json, os, sys
import torch
import nbresume
from nbresume import Checkpointer
from nbresume.checkpoint.state import determinism

where = sys.argv[1]
facts = {"before": determinism.enabled()}
if sys.argv[2] == "init":
    run = nbresume.init("det", dir=where, deterministic=True, quiet=True)
else:
    Checkpointer(where, deterministic=True, every=None, deadline=None, quiet=True,
                 model=torch.nn.Linear(2, 2)).close()
facts.update(
    after=determinism.enabled(),
    algorithms=torch.are_deterministic_algorithms_enabled(),
    cudnn_deterministic=torch.backends.cudnn.deterministic,
    cudnn_benchmark=torch.backends.cudnn.benchmark,
    cublas=os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    describe=determinism.describe(gpu=True)[1],
)
print(json.dumps(facts))
"""


def _run(tmp_path: Path, how: str) -> dict[str, object]:
    script = tmp_path / "det.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {"CUBLAS_WORKSPACE_CONFIG": ""}  # as a fresh notebook has it: unset
    done = warmfork.run(
        [sys.executable, str(script), str(tmp_path / "ckpt"), how],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**_environ(), **env},
    )
    assert done.returncode == 0, done.stderr
    facts: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return facts


def _environ() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}


@pytest.mark.slow
@pytest.mark.parametrize("how", ["checkpointer", "init"])
def test_deterministic_sets_what_pytorch_needs(tmp_path: Path, how: str) -> None:
    facts = _run(tmp_path, how)
    assert facts["before"] is False
    assert facts["after"] is True
    assert facts["algorithms"] is True
    assert facts["cudnn_deterministic"] is True
    assert facts["cudnn_benchmark"] is False
    assert facts["cublas"] == ":4096:8"
    assert "bit for bit" in str(facts["describe"])


def test_a_wrong_value_is_refused_before_anything_changes(tmp_path: Path) -> None:
    with pytest.raises(ArgumentError, match="deterministic"):
        Checkpointer(tmp_path, deterministic="yes", model=torch.nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="deterministic"):
        nbresume.init("det", dir=str(tmp_path), deterministic=1, quiet=True)  # type: ignore[arg-type]
    assert not determinism.enabled()


def test_what_is_promised_without_it() -> None:
    if determinism.enabled():
        pytest.skip("this process runs deterministically already")
    status, seen, fix = determinism.describe(gpu=True)
    assert status == "ok"
    assert "may differ from an uninterrupted run in the last bits" in seen
    assert "bit for bit" not in seen  # never claimed for a GPU not made deterministic
    assert "deterministic=True" in fix
    assert determinism.COST.split(";")[0] in fix
    status, seen, _ = determinism.describe(gpu=False)
    assert "bit for bit" in seen
