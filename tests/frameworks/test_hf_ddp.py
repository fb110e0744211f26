"""The Trainer under DDP (two CPU processes on gloo, started by ``torchrun``): a stop that
reaches one rank only (a signal, that rank's own deadline) stops both ranks at the same step,
after one verified ``checkpoint-N``, and a rerun of the same command resumes from it."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from tests.frameworks.ddp_job import stopped_together, torchrun

import nbresume.hf
from nbresume.hf.folders import FILES_NAME

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("ddp_hf_train.py")


def test_sigterm_to_one_rank_saves_one_checkpoint_and_a_rerun_resumes_from_it(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    first = torchrun(SCRIPT, out)  # 1000 steps: far more than the signal gives it time for
    first.wait_for("rank 1 step 3")
    os.kill(first.pid(1), signal.SIGTERM)
    step = stopped_together(first, 128 + signal.SIGTERM)
    assert first.of(0, "final") == first.of(1, "final") == [], first.describe()
    assert sorted(p.name for p in out.iterdir()) == [f"checkpoint-{step}"]
    assert nbresume.hf.last_checkpoint(out) == str(out / f"checkpoint-{step}")  # verified
    # Each rank wrote its own RNG state into the folder: both are in the commit.
    listed = json.loads((out / f"checkpoint-{step}" / FILES_NAME).read_text())["files"]
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(listed)

    # The same command again, with a deadline on rank 1 alone that is already near: both
    # ranks resume from that checkpoint and stop together after the next step.
    again = torchrun(SCRIPT, out, "--deadline-on-rank", "1:0.5")
    after = stopped_together(again, 0)
    assert again.of(0, "resume") == again.of(1, "resume") == [f"checkpoint-{step}"]
    assert again.of(0, "start") == again.of(1, "start") == [str(step)]
    assert after == step + 1, again.describe()
    assert nbresume.hf.last_checkpoint(out) == str(out / f"checkpoint-{after}")
