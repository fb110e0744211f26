"""The Hugging Face Trainer with ``nbresume.hf.Callback``, as real processes.

``hf_train.py`` trains a small BERT classifier built from a config (dropout, a shuffled data
set, nothing downloaded) for 48 steps, saving every 4 with ``save_total_limit=2``, and resumes
from ``nbresume.hf.last_checkpoint``. The tests kill it with SIGKILL at random moments (inside
a save among them), stop it with a deadline and SIGTERM, damage its checkpoints, and compare
the final weights with an uninterrupted run's. The random moments come from a seeded
``random.Random``; the seed is printed, and ``NBRESUME_HF_SEED=<seed>`` replays a failure.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import nbresume.hf
from nbresume.checkpoint.store import CheckpointStore
from testkit import warmfork

SCRIPT = Path(__file__).with_name("hf_train.py")
STEPS, EVERY = 48, 4


@dataclass
class Run:
    returncode: int
    lines: list[str]
    stderr: str

    @property
    def resumed(self) -> str:
        return next(line.split(" ", 1)[1] for line in self.lines if line.startswith("resume "))

    @property
    def resumed_step(self) -> int:
        return 0 if self.resumed == "None" else int(self.resumed.rsplit("-", 1)[1])

    @property
    def saved(self) -> list[int]:
        return [int(line.split()[1]) for line in self.lines if line.startswith("saved ")]

    @property
    def final(self) -> str | None:
        return next((line.split()[1] for line in self.lines if line.startswith("final ")), None)

    def describe(self) -> str:
        return f"exit {self.returncode}\n" + "\n".join(self.lines) + "\n" + self.stderr[-3000:]


def environment(home: Path) -> dict[str, str]:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(home),
        "OMP_NUM_THREADS": "1",
    }


def train(out: Path, *args: str, term_after: int | None = None) -> Run:
    """Run the script on ``out``; with ``term_after``, send SIGTERM once it printed that step."""
    child = warmfork.popen(
        [sys.executable, str(SCRIPT), str(out), *args],
        env=environment(out.parent / "hf-home"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    assert child.stderr is not None
    lines = []
    for line in child.stdout:
        lines.append(line.strip())
        if term_after is not None and line.strip() == f"step {term_after}":
            child.send_signal(signal.SIGTERM)
    stderr = child.stderr.read()
    return Run(child.wait(timeout=300), lines, stderr)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """The final weights' hash of an uninterrupted run, and its output folder."""
    out = tmp_path_factory.mktemp("reference") / "out"
    run = train(out)
    assert run.returncode == 0, run.describe()
    assert run.final, run.describe()
    assert run.saved == list(range(EVERY, STEPS + 1, EVERY)), run.describe()
    return run.final, out


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    seed = int(os.environ.get("NBRESUME_HF_SEED") or random.SystemRandom().randrange(10**9))
    print(f"{request.node.nodeid}: seed {seed} (replay: NBRESUME_HF_SEED={seed})")
    return random.Random(seed)


def test_every_checkpoint_is_verified_and_save_total_limit_is_applied_by_nbresume(
    reference: tuple[str, Path],
) -> None:
    _, out = reference
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "checkpoint-44",
        "checkpoint-48",
    ]
    assert not [p for p in out.iterdir() if p.name.startswith(".nbresume-tmp")]
    assert nbresume.hf.last_checkpoint(out) == str(out / "checkpoint-48")
    # Still a normal Trainer checkpoint: the model loads with from_pretrained.
    from transformers import BertForSequenceClassification

    model = BertForSequenceClassification.from_pretrained(out / "checkpoint-48")
    assert model.config.num_hidden_layers == 2


def test_a_fresh_output_folder_has_no_checkpoint(tmp_path: Path) -> None:
    assert nbresume.hf.last_checkpoint(tmp_path / "missing") is None
    (tmp_path / "empty").mkdir()
    assert nbresume.hf.last_checkpoint(tmp_path / "empty") is None
    with pytest.raises(nbresume.UsageError, match="URL"):
        nbresume.hf.last_checkpoint("s3://bucket/run")  # the Trainer resumes from a local folder


def damaged_copy(reference: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    return out


def passed_over(out: Path) -> tuple[str | None, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = nbresume.hf.last_checkpoint(out)
    return found, [str(w.message) for w in caught]


@pytest.mark.parametrize(
    "victim",
    [
        "config.json",
        "manifest.json",
        "model.safetensors",
        "nbresume_framework_files.json",
        "optimizer.pt",
        "rng_state.pth",
        "scheduler.pt",
        "trainer_state.json",
        "training_args.bin",
    ],
)
def test_a_truncated_file_of_the_newest_checkpoint_is_passed_over_with_a_warning(
    reference: tuple[str, Path], tmp_path: Path, victim: str
) -> None:
    out = damaged_copy(reference[1], tmp_path)
    path = out / "checkpoint-48" / victim
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    found, messages = passed_over(out)
    assert found == str(out / "checkpoint-44")
    assert any("checkpoint-48" in m for m in messages), messages


def test_a_checkpoint_cut_short_by_a_disconnect_is_passed_over(
    reference: tuple[str, Path], tmp_path: Path
) -> None:
    out = damaged_copy(reference[1], tmp_path)
    folder = out / "checkpoint-52"  # what a kill in the middle of the Trainer's own save leaves
    folder.mkdir()
    data = (out / "checkpoint-48" / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 3])
    found, messages = passed_over(out)
    assert found == str(out / "checkpoint-48")
    assert any("checkpoint-52" in m and "incomplete" in m for m in messages), messages


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:nbresume. passing over")
def test_a_bit_flip_is_passed_over_and_the_trainer_resumes_from_the_checkpoint_before(
    reference: tuple[str, Path], tmp_path: Path, rng: random.Random
) -> None:
    final, source = reference
    out = damaged_copy(source, tmp_path)
    victim = out / "checkpoint-48" / rng.choice(["model.safetensors", "optimizer.pt"])
    data = bytearray(victim.read_bytes())
    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    victim.write_bytes(bytes(data))
    found, messages = passed_over(out)
    assert found == str(out / "checkpoint-44")
    assert any("checkpoint-48" in m for m in messages), messages
    run = train(out)
    assert run.returncode == 0, run.describe()
    assert run.resumed == str(out / "checkpoint-44"), run.describe()
    assert run.final == final, run.describe()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:nbresume. passing over")
def test_a_trainer_killed_twice_ends_with_the_weights_of_an_uninterrupted_run(
    reference: tuple[str, Path], tmp_path: Path, rng: random.Random
) -> None:
    final, _ = reference
    out = tmp_path / "out"
    resumed = [0]
    for _ in range(2):
        # A step that ends with a save, killed 0-50 ms later, is killed inside the save.
        step = rng.randint(resumed[-1] + EVERY + 2, resumed[-1] + 3 * EVERY + 2)
        delay = rng.choice([0.0, 0.001, 0.01, 0.05])
        killed = train(out, "--kill", f"{step}:{delay}")
        assert killed.returncode == -signal.SIGKILL, killed.describe()
        assert killed.resumed_step == resumed[-1], killed.describe()
        found = nbresume.hf.last_checkpoint(out)
        assert found is not None
        resumed.append(int(found.rsplit("-", 1)[1]))
        assert resumed[-1] > resumed[-2], f"no progress: {resumed}"
    run = train(out)
    assert run.returncode == 0, run.describe()
    assert run.resumed_step == resumed[-1], run.describe()
    assert run.final == final, f"resumed at {resumed[1:]}: the final weights differ"


@pytest.mark.slow
def test_a_deadline_and_sigterm_stop_with_a_verified_checkpoint_that_resumes_exactly(
    reference: tuple[str, Path], tmp_path: Path
) -> None:
    final, _ = reference
    out = tmp_path / "out"
    # A deadline that is already near: the Trainer saves after its first step and stops.
    early = train(out, "--deadline", "0.001")
    assert early.returncode == 0, early.describe()
    assert early.saved == [1], early.describe()
    assert early.final is not None, early.describe()
    assert nbresume.hf.last_checkpoint(out) == str(out / "checkpoint-1")
    # SIGTERM: it saves at the next step boundary, then exits as SIGTERM asks (143).
    stopped = train(out, term_after=6)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.describe()
    assert stopped.resumed_step == 1
    last = stopped.saved[-1]
    assert last > 6, stopped.describe()  # saved at the step boundary after the signal
    assert nbresume.hf.last_checkpoint(out) == str(out / f"checkpoint-{last}")
    assert "received SIGTERM" in stopped.stderr, stopped.describe()
    run = train(out)
    assert run.returncode == 0, run.describe()
    assert run.resumed_step == last, run.describe()
    assert run.final == final, f"resumed at 1 and {last}: the final weights differ"
    assert CheckpointStore(out).list() == []  # the store's own folders: none were written


def test_a_kaggle_session_is_seeded_with_the_newest_trainer_checkpoint_that_verifies(
    reference: tuple[str, Path], tmp_path: Path
) -> None:
    from nbresume.platforms.kaggle import seed_from_inputs

    # The previous session's output, attached as an input; its newest checkpoint is damaged.
    previous = tmp_path / "input" / "clf-output" / "nbresume" / "clf"
    shutil.copytree(reference[1], previous)
    victim = previous / "checkpoint-48" / "optimizer.pt"
    victim.write_bytes(victim.read_bytes()[:100])
    root = tmp_path / "working" / "nbresume" / "clf"
    root.mkdir(parents=True)
    seeded = seed_from_inputs("clf", root, tmp_path / "input")
    assert seeded is not None
    assert seeded.step == 44
    assert nbresume.hf.last_checkpoint(root) == str(root / "checkpoint-44")
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-44"]
    # A rerun of the same session: what is there is as new, nothing is copied again.
    assert seed_from_inputs("clf", root, tmp_path / "input") is None
