"""A PEFT LoRA fine-tune under the Trainer with ``nbresume.hf.Callback``, killed and resumed
(``hf_train.py --lora``: LoRA r=4 on the attention's query and value, with dropout)."""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from test_hf import EVERY, rng, train

import nbresume.hf

__all__ = ["rng"]  # the seeded-RNG fixture, shared with test_hf.py


@pytest.mark.filterwarnings("ignore:nbresume. passing over")
@pytest.mark.slow
def test_a_peft_lora_run_killed_once_ends_equal_to_its_uninterrupted_run(
    tmp_path: Path, rng: random.Random
) -> None:
    reference = train(tmp_path / "reference", "--lora")
    assert reference.returncode == 0, reference.describe()
    out = tmp_path / "out"
    killed = train(out, "--lora", "--kill", f"{rng.randint(EVERY + 2, 4 * EVERY)}:0.01")
    assert killed.returncode == -signal.SIGKILL, killed.describe()
    folder = nbresume.hf.last_checkpoint(out)
    assert folder is not None
    assert (Path(folder) / "adapter_model.safetensors").exists()  # PEFT saved the adapter only
    run = train(out, "--lora")
    assert run.returncode == 0, run.describe()
    assert run.resumed == folder, run.describe()
    assert run.final == reference.final, run.describe()
