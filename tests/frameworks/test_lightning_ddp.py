"""Lightning's ``ddp`` strategy on two CPU processes (gloo, started by ``torchrun``): a stop
that reaches one rank only (a signal, that rank's own deadline) stops both ranks at the same
step, after one verified ``last.ckpt``, and a rerun of the same command resumes from it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from tests.frameworks.ddp_job import stopped_together, torchrun

import nbresume.lightning
from nbresume.checkpoint.store import CheckpointStore

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("ddp_lightning_train.py")


def newest(last: Path) -> int:
    """The step of the newest verified checkpoint in the ``last.ckpt`` folder."""
    store = CheckpointStore(last)
    assert store.verify().ok
    latest = store.latest()
    assert latest is not None
    return latest.step


def test_sigterm_to_one_rank_saves_last_ckpt_and_a_rerun_resumes_from_it(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    last = root / "ckpts" / "last.ckpt"
    first = torchrun(SCRIPT, root)  # 1000 steps: far more than the signal gives it time for
    first.wait_for("rank 1 step 3")
    os.kill(first.pid(1), signal.SIGTERM)
    step = stopped_together(first, 128 + signal.SIGTERM)
    assert first.of(0, "final") == first.of(1, "final") == [], first.describe()
    assert sorted(p.name for p in (root / "ckpts").iterdir()) == ["last.ckpt"]
    assert newest(last) == step
    assert nbresume.lightning.last_checkpoint(root / "ckpts") == str(last)

    # The same command again, with a deadline on rank 0 alone that is already near: both
    # ranks resume from that checkpoint and stop together after the next step.
    again = torchrun(SCRIPT, root, "--deadline-on-rank", "0:0.5")
    after = stopped_together(again, 0)
    assert again.of(0, "resume") == again.of(1, "resume") == ["last.ckpt"]
    assert again.of(0, "start") == again.of(1, "start") == [str(step)]
    assert after == step + 1, again.describe()
    assert newest(last) == after
