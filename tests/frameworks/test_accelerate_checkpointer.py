"""What ``accelerator.prepare()`` returns, given as it is to a Checkpointer and ``ck.loader()``.

``accelerate_train.py`` trains with a prepared model, ``AcceleratedOptimizer``,
``AcceleratedScheduler`` and ``DataLoaderShard``; it is killed with SIGKILL after a step drawn
at random (the seed is printed, so a failure can be run again exactly), started again until
done, and its final weights and optimizer state must be bit-identical to an uninterrupted run:
in one process, and under ``accelerate launch`` with two processes on gloo.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

import torch
from accelerate import Accelerator

import nbresume
from nbresume.errors import UsageError
from testkit.paths import with_testkit

SCRIPT = Path(__file__).with_name("accelerate_train.py")
ACCELERATE = Path(sys.executable).with_name("accelerate")
ENV = with_testkit(
    {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
)


def command(processes: int) -> list[str]:
    if processes == 1:
        return [sys.executable, str(SCRIPT)]
    # --multi_gpu is Accelerate's torchrun launcher; the script's Accelerator(cpu=True) makes
    # it a job of CPU processes on gloo.
    return [
        str(ACCELERATE), "launch", "--multi_gpu", "--num_processes", str(processes),
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(random.randrange(20000, 40000)), str(SCRIPT),
    ]  # fmt: skip


def train(processes: int, folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*command(processes), str(folder), *args],
        env=ENV,
        cwd=folder.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )


def said(run: subprocess.CompletedProcess[str], word: str) -> list[int]:
    """What each rank printed after ``word`` (``start`` or ``done``). The ranks share one
    stdout, so their lines are found wherever they are, not line by line."""
    return [int(n) for n in re.findall(rf"rank \d+ {word} (\d+)", run.stdout)]


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_prepared_objects_resume_bit_identically_after_a_kill(
    tmp_path: Path, processes: int
) -> None:
    total = 24 // processes  # 2 epochs of 48 samples in batches of 4, split across processes
    reference = train(processes, tmp_path / "reference")
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert said(reference, "done") == [total] * processes, reference.stdout

    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    kill_at = random.Random(seed).randint(4, total - 2)
    folder = tmp_path / "run"
    killed = train(processes, folder, "--kill-at", str(kill_at))
    if processes == 1:
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    else:  # the launcher reports its ranks' SIGKILL as a failure
        assert killed.returncode != 0, killed.stderr[-3000:]
        assert "Signal 9 (SIGKILL)" in killed.stderr, killed.stderr[-3000:]
    assert "done" not in killed.stdout
    resumed = train(processes, folder)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    starts = set(said(resumed, "start"))
    assert len(starts) == 1, resumed.stdout
    assert 0 < starts.pop() < kill_at, resumed.stdout
    assert said(resumed, "done") == [total] * processes, resumed.stdout

    expected = torch.load(tmp_path / "reference" / "final.pt", weights_only=True)
    final = torch.load(folder / "final.pt", weights_only=True)
    assert final.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(final[key], value), f"kill at {kill_at}: {key} differs"


def test_the_prepared_objects_are_taken_as_what_they_wrap(tmp_path: Path) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    with nbresume.Checkpointer(
        tmp_path / "run", deadline=None, quiet=True, optimizer=optimizer, scheduler=scheduler
    ) as ck:
        data = ck.loader(loader)
        assert ck.loader(loader) is data  # the same prepared loader: the same wrapper
        batches = [batch[0] for batch in data]
        assert len(batches) == 4
        assert sorted(torch.cat(batches).tolist()) == [float(i) for i in range(8)]
        ck.save(step=1, block=True)
    saved = nbresume.CheckpointStore(tmp_path / "run").latest()
    assert saved is not None
    assert saved.step == 1


def test_an_optimizer_that_never_ran_its_init_is_refused_with_the_fix(tmp_path: Path) -> None:
    """A wrapper like AcceleratedOptimizer, from another library: a UsageError that names it
    and the optimizer to pass instead, never an AttributeError from inside nbresume."""

    class Wrapping(torch.optim.Optimizer):
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

        def state_dict(self) -> dict[str, object]:
            return self.optimizer.state_dict()

    inner = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    with pytest.raises(UsageError) as raised:
        nbresume.Checkpointer(tmp_path / "run", deadline=None, quiet=True, opt=Wrapping(inner))
    assert "Wrapping" in str(raised.value)
    assert "opt=opt.optimizer" in str(raised.value)
