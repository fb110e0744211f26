"""``deterministic=True`` in the order users write it, on a real GPU.

``model.cuda()`` starts CUDA but allocates no cuBLAS workspace: asking for determinism after it
is in time and must say nothing. After a matmul has run, a workspace of the old size exists:
nbresume releases it (the next matmul allocates a deterministic one) and says so. Each case runs
in a fresh interpreter, where CUDA has not started yet.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tests.gpu.conftest import requires_cuda

from testkit.paths import ROOT

pytestmark = [pytest.mark.gpu, requires_cuda]

SCRIPT = """
import json, logging, os, sys
import torch
from nbresume import Checkpointer

records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append((record.levelname, record.getMessage()))
logging.getLogger("nbresume").addHandler(Keep())
logging.getLogger("nbresume").setLevel(logging.INFO)

model = torch.nn.Linear(256, 256).cuda()
x = torch.randn(64, 256, device="cuda")
if sys.argv[2] == "matmul-first":
    model(x).sum().item()
ck = Checkpointer(sys.argv[1], deterministic=True, every=None, deadline=None, quiet=True,
                  model=model)
first = model(x)
second = model(x)
ck.close()
print(json.dumps({
    "records": records,
    "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    "same": bool(torch.equal(first, second)),
}))
"""


def run(tmp_path: Path, order: str) -> dict[str, object]:
    script = tmp_path / "order.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ck"), order],
        capture_output=True, text=True, timeout=300, check=False, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    facts: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return facts


def about_late_determinism(records: object) -> list[str]:
    """What nbresume said of determinism asked for after CUDA started (not the line that
    lists the settings and their cost, said in every case)."""
    assert isinstance(records, list)
    return [
        f"{level}: {text}"
        for level, text in records
        if "came after a CUDA matmul" in text or "after CUDA started" in text
    ]


def test_deterministic_after_model_cuda_is_in_time_and_says_nothing(tmp_path: Path) -> None:
    facts = run(tmp_path, "cuda-first")
    assert facts["cublas"] == ":4096:8"
    assert about_late_determinism(facts["records"]) == []
    assert facts["same"]
    print("GPU-CHECK deterministic after model.cuda(): no warning, CUBLAS_WORKSPACE_CONFIG set")


def test_deterministic_after_a_matmul_renews_cublas_workspaces_and_says_so(
    tmp_path: Path,
) -> None:
    facts = run(tmp_path, "matmul-first")
    said = about_late_determinism(facts["records"])
    assert len(said) == 1, said
    assert said[0].startswith("INFO: nbresume: deterministic=True came after a CUDA matmul")
    assert facts["same"]
    print(f"GPU-CHECK deterministic after a matmul: workspaces renewed ({said[0]})")
