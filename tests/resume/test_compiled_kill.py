"""A ``torch.compile``d model killed with SIGKILL resumes as a plain model, and a plain model's
run as a compiled one, bit-identical to a plain run that was never interrupted.

The run is ``train_cnn.py`` of the exact-resume tests (dropout, AdamW, OneCycleLR, clipping, a
shuffled DataLoader with two workers and augmentation), killed as they kill it: the whole
process group, a few steps after a save was verified, at a step drawn at random. The model is
compiled with the ``eager`` backend: the same ``OptimizedModule`` wrapper and ``_orig_mod.``
names as the default backend, and the same arithmetic as the plain model (no generated
kernels, no C++ compiler), so that the runs compare bit for bit. Whatever TorchInductor
would cache goes into the test's own folder (``TORCHINDUCTOR_CACHE_DIR``). The compiled runs
are new interpreters, not children of the suite's warm server: dynamo is then set up as a
user's script sets it up.
"""

from __future__ import annotations

import signal
import tempfile
from pathlib import Path

import pytest

from nbresume.checkpoint.store import CheckpointStore

from .conftest import Reference, SeededRandom
from .runner import checkpoints, finished_cleanly, train
from .test_bitexact import EVERY, TOTAL, aim, check_run

KILLED = -signal.SIGKILL


def options(backend: str | None) -> list[str]:
    return ["--mode", "steps", "--every", str(EVERY), *(["--compile", backend] if backend else [])]


def inductor_folders() -> set[str]:
    """TorchInductor's default cache folders in the temporary folder."""
    return {p.name for p in Path(tempfile.gettempdir()).glob("torchinductor_*")}


@pytest.mark.slow  # three training processes, one or two of them compiling
@pytest.mark.parametrize(
    "route",
    [("eager", None), (None, "eager")],
    ids=["compiled-killed-plain-resumed", "plain-killed-compiled-resumed"],
)
def test_a_compiled_model_killed_after_a_save_resumes_bit_exactly_across_compile(
    tmp_path: Path,
    resume_rng: SeededRandom,
    reference: Reference,
    route: tuple[str | None, str | None],
) -> None:
    killed, resumed = route  # the backend of the killed run, and of the run that finishes
    run_dir = tmp_path / "run"
    before = inductor_folders()
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    target = aim("mid-epoch", 0, TOTAL, resume_rng)
    assert target is not None

    def context() -> str:
        return f"{resume_rng.replay()}; killed {target.label}"

    run = train(run_dir, TOTAL, *options(killed), trigger=target.trigger, env=env, warm=False)
    assert run.signalled, f"the run ended before the kill\n{context()}\n{run.describe()}"
    assert run.returncode == KILLED, f"not killed\n{context()}\n{run.describe()}"
    check_run(run, 0, context)
    found = checkpoints(run_dir)
    assert found, f"after the kill, no checkpoint is there\n{context()}"
    assert all(found.values()), f"a checkpoint does not verify: {found}\n{context()}"
    # The checkpoint holds the names of the model it was saved from.
    saved = CheckpointStore(run_dir, keep=None).load(max(found)).state
    assert saved is not None
    names = list(saved.objects["model"])
    assert all(n.startswith("_orig_mod.") for n in names) == (killed is not None), names

    final = train(run_dir, TOTAL, *options(resumed), env=env, warm=False)
    check_run(final, max(found), context)
    problem = finished_cleanly(final, TOTAL)
    assert not problem, f"the last run did not finish: {problem}\n{context()}\n{final.describe()}"
    assert final.final == reference("steps", TOTAL), (
        f"the resumed run is not bit-identical to the uninterrupted plain run\n{context()}"
    )
    assert inductor_folders() <= before, "a torchinductor_* folder was left in the temp folder"
