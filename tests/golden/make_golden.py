"""Write the golden checkpoint of a format version into tests/golden/<version>/.

Run once per format version, from the repository root::

    .venv/bin/python tests/golden/make_golden.py        # v1: SHA-256
    .venv/bin/python tests/golden/make_golden.py v1.1   # v1.1: XXH3-128, named in the manifest

The files are committed and never regenerated for an existing version: tests/test_golden.py and
tests/checkpoint/format/test_hash_format.py load them with the current code, so that every
checkpoint ever written in these formats keeps loading. Both versions hold the same values (v1.1's
tensor files are byte for byte v1's; its manifest names XXH3-128). The values follow a fixed recipe
(test_golden.py recomputes it on its own), and the manifest's "created" is fixed, so the output is
the same byte for byte on every run.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from nbresume import CheckpointStore
from nbresume.checkpoint.format import MANIFEST_NAME, parse_manifest, step_dirname

STEP = 1500
CREATED = "2024-01-01T00:00:00+00:00"
WRITER = "nbresume golden v1"


def tensors() -> dict[str, dict[str, torch.Tensor]]:
    return {
        "model": {
            "linear.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 8 - 0.5,
            "linear.bias": torch.arange(3, dtype=torch.float16) * 0.25,
            "embed": (torch.arange(6, dtype=torch.float32) * 0.5 - 1)
            .to(torch.bfloat16)
            .reshape(2, 3),
            "counts": torch.arange(5, dtype=torch.int64) * 1_000_003 - 2**40,
            "codes": torch.arange(-4, 4, dtype=torch.int8),
            "mask": torch.arange(6) % 3 == 0,
            "scale": torch.tensor(-2.75, dtype=torch.float64),
            "empty": torch.zeros(0, 4),
        },
        "optimizer": {
            "state.0.exp_avg": torch.arange(12, dtype=torch.float32).reshape(3, 4) * -0.125,
            "state.0.step": torch.tensor(float(STEP)),
        },
    }


def data() -> dict[str, Any]:
    return {
        "state": {
            "step": STEP,
            "epoch": 3,
            "lr": 0.001,
            "name": "golden v1",
            "rng": {"seed": 1234, "sequence": [1, 2, 3]},
        }
    }


METRICS = {"val_loss": 0.375}


#: The hash each golden version is written with.
HASHES = {"v1": "sha256", "v1.1": "xxh3-128"}


def main(out: Path, algorithm: str = "sha256") -> None:
    with tempfile.TemporaryDirectory() as scratch:
        store = CheckpointStore(scratch, keep=None, check_space=False, hash=algorithm)
        store.save(STEP, tensors=tensors(), data=data(), metrics=METRICS)
        folder = Path(scratch) / step_dirname(STEP)
        manifest_path = folder / MANIFEST_NAME
        manifest = parse_manifest(manifest_path.read_bytes(), where=str(manifest_path))
        fixed = dataclasses.replace(manifest, created=CREATED, writer=WRITER)
        manifest_path.write_bytes(fixed.to_bytes())
        target = out / step_dirname(STEP)
        shutil.rmtree(target, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)
        shutil.copytree(folder, target)
    print(f"wrote {target}")


if __name__ == "__main__":
    version = sys.argv[1] if len(sys.argv) > 1 else "v1"
    main(Path(__file__).parent / version, HASHES[version])
