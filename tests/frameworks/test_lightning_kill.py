"""Lightning runs killed with SIGKILL and started again, unchanged, as real processes.

``lightning_train.py`` fits a small LightningModule (dropout, a shuffled DataLoader with two
workers and augmentation) with ``nbresume.lightning.CheckpointIO`` and ``Callback``;
``ModelCheckpoint`` saves ``last.ckpt`` and keeps the 2 best by a monitored score. Each test
kills it at chosen random moments (inside a save, inside ``save_top_k``'s removal, between
steps), starts the same command again until it finishes, and compares what it left with an
uninterrupted run.

The random moments come from ``random.Random(seed)``; the seed is printed, so a failure can be
run again exactly.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("lightning")

import torch
from safetensors.torch import load_file
from tests.session_run import run_in_session

import nbresume
import nbresume.lightning
from testkit import warmfork

SCRIPT = Path(__file__).with_name("lightning_train.py")
pytestmark = pytest.mark.slow


def run(root: Path, *args: str, kill: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NBRESUME_TEST_KILL": kill}
    root.mkdir(parents=True, exist_ok=True)
    runs = len(list(root.glob("run-*.err")))
    try:
        return run_in_session(
            [sys.executable, str(SCRIPT), str(root), *args],
            env=env,
            timeout=300,
            output=root / f"run-{runs}",
        )
    except subprocess.TimeoutExpired:  # its threads' stacks are at the end of its stderr
        log = (root / "events.log").read_text() if (root / "events.log").exists() else ""
        stderr = (root / f"run-{runs}.err").read_text(errors="replace")
        pytest.fail(f"the run (kill plan {kill!r}) hung; its events:\n{log[-1500:]}\n"
                    f"its stderr:\n{stderr[-8000:]}")  # fmt: skip


def events(root: Path) -> list[str]:
    return (root / "events.log").read_text().splitlines()


def starts(root: Path) -> list[str]:
    return [line.split(" ", 1)[1] for line in events(root) if line.startswith("start ")]


def resumed_steps(root: Path) -> list[int]:
    """The global step each restart resumed at (the first step it ran, less one)."""
    lines = events(root)
    found = []
    for index, line in enumerate(lines):
        if line.startswith("start ") and index:
            after = next(x for x in lines[index + 1 :] if x.startswith("step "))
            found.append(int(after.split()[1]) - 1)
    return found


def weights(root: Path) -> dict[str, torch.Tensor]:
    return load_file(root / "final.safetensors")


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def kept(root: Path) -> dict[str, int]:
    """The .ckpt folders left, each with the step of its newest checkpoint; each verifies."""
    found = {}
    for ckpt in sorted((root / "ckpts").iterdir()):
        assert ckpt.is_dir(), ckpt
        assert not ckpt.name.startswith("."), ckpt
        report = nbresume.verify(ckpt)
        assert report.ok, report.summary
        found[ckpt.name] = max(r.step for r in report.results)
    return found


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Uninterrupted runs: checkpoints every 5 steps, and at epoch ends only."""
    roots = {}
    for mode, args in (("steps", ()), ("epochs", ("--epoch-end",))):
        root = tmp_path_factory.mktemp(f"reference-{mode}")
        done = run(root, *args)
        assert done.returncode == 0, done.stderr[-3000:]
        roots[mode] = root
    return roots


def finish(root: Path, *args: str, kills: list[str]) -> None:
    """Start the run once per kill plan (each must die by SIGKILL), then once to the end."""
    for plan in kills:
        killed = run(root, *args, kill=plan)
        assert killed.returncode == -signal.SIGKILL, (plan, killed.stderr[-3000:])
    done = run(root, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert events(root)[-1] == "done"


def test_killed_twice_finishes_and_resumes_later_each_time(
    tmp_path: Path, reference: dict[str, Path]
) -> None:
    seed = random.randrange(1 << 30)
    chance = random.Random(seed)
    print(f"seed {seed}")
    # One kill inside a save (a few ms into it), one between steps, in either order.
    inside = f"save:{chance.randint(2, 5)}:{chance.uniform(0.0, 0.02):.4f}"
    between = f"step:{chance.randint(36, 56)}:0"
    finish(tmp_path, kills=[inside, between])

    assert len(starts(tmp_path)) == 3
    resumed = resumed_steps(tmp_path)
    assert len(resumed) == 2
    assert 0 < resumed[0] < resumed[1], resumed
    assert "last.ckpt" in kept(tmp_path)
    # The callback makes the train loader resumable: Lightning continues the epoch at the
    # exact batch, with the same samples and augmentation.
    difference = max_difference(weights(tmp_path), weights(reference["steps"]))
    print(f"resumed at {resumed}; largest weight difference {difference:.3g}")
    assert difference == 0.0, f"resumed at {resumed}: the weights differ by {difference:.3g}"


def test_epoch_end_checkpoints_resume_exactly_and_keep_the_top_k(
    tmp_path: Path, reference: dict[str, Path]
) -> None:
    """Checkpoints at epoch ends (with the callback's RNG states), killed inside
    save_top_k's removal of a checkpoint that fell out of the top 2 and inside a save: the
    weights are bit-exact and the .ckpt left are exactly the uninterrupted run's."""
    seed = random.randrange(1 << 30)
    chance = random.Random(seed)
    print(f"seed {seed}")
    removal = f"remove:{chance.randint(1, 3)}:{chance.choice([0.0, 0.001, 0.003])}"
    # Counted from the restart, which saves at least twice (its last epoch end: 2 .ckpt).
    inside = f"save:{chance.randint(1, 2)}:{chance.uniform(0.0, 0.01):.4f}"
    finish(tmp_path, "--epoch-end", kills=[removal, inside])
    assert kept(tmp_path) == kept(reference["epochs"])
    assert max_difference(weights(tmp_path), weights(reference["epochs"])) == 0.0


@pytest.mark.torture
@pytest.mark.parametrize("removal", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("delay", [0.0, 0.001, 0.003])
def test_save_top_k_keeps_the_right_checkpoints_when_killed_during_removal(
    tmp_path: Path, reference: dict[str, Path], removal: int, delay: float
) -> None:
    """Every removal, killed at once or a few ms into it."""
    finish(tmp_path, "--epoch-end", kills=[f"remove:{removal}:{delay}"])
    assert kept(tmp_path) == kept(reference["epochs"])
    assert max_difference(weights(tmp_path), weights(reference["epochs"])) == 0.0


def test_sigterm_saves_last_then_exits(tmp_path: Path) -> None:
    """SIGTERM at any step: a verified last.ckpt of the step it stopped at, then exit 143."""
    env = {**os.environ, "NBRESUME_TEST_KILL": ""}
    process = warmfork.popen(
        [sys.executable, str(SCRIPT), str(tmp_path)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    log = tmp_path / "events.log"
    while not (log.exists() and "step 12" in log.read_text()):
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, err[-3000:]
    stopped = int(next(x for x in reversed(events(tmp_path)) if x.startswith("step ")).split()[1])
    last = tmp_path / "ckpts" / "last.ckpt"
    assert nbresume.verify(last).ok
    assert nbresume.CheckpointStore(last).latest().step == stopped  # type: ignore[union-attr]
    assert nbresume.lightning.last_checkpoint(tmp_path / "ckpts") == str(last)
