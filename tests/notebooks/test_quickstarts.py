"""The quickstart notebooks that users copy, executed as their platforms execute them.

Every notebook in ``notebooks/`` runs here with papermill on a real kernel, with small
settings, on a stand-in for its platform: Colab with the test stand-in of ``google.colab``
over a simulated Drive, Kaggle in a folder laid out like a Kaggle machine in a batch run, the
SSH one on this machine (and its script as a process of its own). The three quickstarts and
the script train the same model on the same data, so an uninterrupted run of one of them is
the reference every interrupted run must end at, bit for bit.
"""

from __future__ import annotations

import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest

from nbresume.checkpoint.store import CheckpointStore

from .conftest import (
    EVERY,
    NOTEBOOKS,
    STEPS,
    Executed,
    execute,
    finish,
    kill_kernel,
    start,
    stop,
    wait_for,
)

#: Every notebook in notebooks/, each executed by a test below.
EXECUTED = {"colab_quickstart.ipynb", "kaggle_quickstart.ipynb", "ssh_quickstart.ipynb"}
#: The frameworks' quickstarts, each executed by a test under tests/frameworks/.
EXECUTED |= {"hf_trainer_quickstart.ipynb", "lightning_quickstart.ipynb"}
SMALL = {"steps": STEPS, "every": EVERY}


def make_cgroup(folder: Path) -> Path:
    """A cgroup folder of a container with one CPU and no memory limit: ``cap_threads()`` in
    the notebooks then gives torch one thread, so every run does the same arithmetic (and
    does not fight over a loaded machine's cores)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cpu.max").write_text("100000 100000\n")
    (folder / "memory.max").write_text("max\n")
    (folder / "memory.events").write_text("oom 0\noom_kill 0\n")
    return folder


@pytest.fixture(scope="session")
def machine(base_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of every kernel: :func:`base_env` in a one-CPU container."""
    cgroup = make_cgroup(tmp_path_factory.mktemp("cgroup"))
    return {**base_env, "NBRESUME_CGROUP_ROOT": str(cgroup)}


def ssh_env(machine: dict[str, str], home: Path) -> dict[str, str]:
    """A rented box reached over SSH, with its durable folders under ``home``."""
    return {
        **machine,
        "SSH_CONNECTION": "192.0.2.10 52000 192.0.2.20 22",
        "NBRESUME_HOME": str(home),
    }


class Reference:
    """The SSH quickstart, run once without interruption; it runs in the background from its
    first use until :meth:`result` is asked for."""

    def __init__(self, machine: dict[str, str], tmp: Path) -> None:
        self.output = tmp / "out.ipynb"
        self.home = tmp / "home"
        self.process = start(
            NOTEBOOKS / "ssh_quickstart.ipynb",
            self.output,
            SMALL,
            env=ssh_env(machine, self.home),
            cwd=tmp,
        )
        self._result: Executed | None = None

    def result(self) -> Executed:
        if self._result is None:
            self._result = finish(self.process, self.output)
            assert self._result.code == 0, self._result.log
        return self._result

    @property
    def weights(self) -> str:
        return self.result().weights


@pytest.fixture(scope="session")
def reference(
    machine: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Reference]:
    ref = Reference(machine, tmp_path_factory.mktemp("reference"))
    yield ref
    stop(ref.process)


def steps_in(folder: Path) -> list[int]:
    return [info.step for info in CheckpointStore(folder, keep=None).list()]


def newest_verified(folder: Path) -> int:
    store = CheckpointStore(folder, keep=None)
    return max(r.step for r in store.verify().results if r.ok)


def cells_after(notebook: Any, start: str) -> list[Any]:
    """The code cells after the first one whose source starts with ``start``."""
    code = [c for c in notebook.cells if c.cell_type == "code"]
    index = next(i for i, c in enumerate(code) if c.source.startswith(start))
    return code[index + 1 :]


# -- the files themselves ------------------------------------------------------------------


def test_every_quickstart_is_a_clean_parameterised_notebook_that_starts_with_init() -> None:
    found = {p.name for p in NOTEBOOKS.glob("*.ipynb")}
    assert found == EXECUTED, "each notebook in notebooks/ needs an execution test here"
    for name in sorted(found):
        notebook = nbformat.read(NOTEBOOKS / name, as_version=nbformat.NO_CONVERT)
        nbformat.validate(notebook)
        assert notebook.nbformat == 4
        # Kaggle's batch runner (papermill) stops without a kernel name.
        assert notebook.metadata.kernelspec.name == "python3"
        code = [c for c in notebook.cells if c.cell_type == "code"]
        assert all(c.outputs == [] and c.execution_count is None for c in code), (
            f"{name}: outputs must be cleared"
        )
        tagged = [c for c in code if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{name}: one cell tagged 'parameters'"
        assert code[0] is tagged[0], f"{name}: the settings come first"
        assert "steps = " in tagged[0].source
        assert "name = " in tagged[0].source
        # The first cell that does anything checks the machine.
        assert "nbresume.init(name" in code[1].source, f"{name}: init right after the settings"
        assert sum(c.cell_type == "markdown" for c in notebook.cells) >= len(code), (
            f"{name}: a tutorial explains each step"
        )


# -- SSH: the reference, the script, a killed kernel ---------------------------------------


def test_the_ssh_quickstart_trains_verifies_and_matches_its_script(
    reference: Reference, machine: dict[str, str], tmp_path: Path
) -> None:
    # The script for `nbresume run`, alongside the notebook: the same training.
    script = subprocess.Popen(
        [sys.executable, str(NOTEBOOKS / "ssh_train.py"), "--steps", str(STEPS), "--every",
         str(EVERY), "--dir", str(tmp_path / "script-run")],
        env={**ssh_env(machine, tmp_path / "home"), "NBRESUME_SESSION_START": str(time.time())},
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        notebook = reference.result()
        out, err = script.communicate(timeout=300)
    finally:
        if script.poll() is None:
            script.kill()
            script.wait()

    text = notebook.text
    assert "nbresume preflight on SSH box:" in text
    assert notebook.start == 0
    assert f"training finished at step {STEPS}" in text
    assert "OK 3/3, errors 0" in text
    kept = steps_in(reference.home / "ssh-quickstart")
    assert kept == [STEPS - 2 * EVERY, STEPS - EVERY, STEPS]

    assert script.returncode == 0, out + err
    assert f"training from step 0 of {STEPS}\n" in out
    assert f"weights sha256: {notebook.weights}\n" in out  # bit for bit the same
    assert steps_in(tmp_path / "script-run")[-1] == STEPS


def test_a_kernel_killed_mid_training_resumes_from_its_last_checkpoint_bit_exact(
    reference: Reference, machine: dict[str, str], tmp_path: Path
) -> None:
    notebook = NOTEBOOKS / "ssh_quickstart.ipynb"
    env = ssh_env(machine, tmp_path / "home")
    folder = tmp_path / "home" / "ssh-quickstart"

    first = start(notebook, tmp_path / "first.ipynb", SMALL, env=env, cwd=tmp_path)
    wait_for("a checkpoint", lambda: bool(steps_in(folder)), first)
    kill_kernel(first)
    killed = finish(first, tmp_path / "first.ipynb")
    assert killed.code != 0  # papermill reports the dead kernel
    saved = newest_verified(folder)
    assert 0 < saved < STEPS, "the kill must land after a save and before the end"

    # "Run all" again: the same notebook, the same settings.
    again = execute(notebook, tmp_path / "again.ipynb", SMALL, env=env, cwd=tmp_path)
    assert again.code == 0, again.log
    assert again.start == saved  # resumed, not restarted
    assert f"training finished at step {STEPS}" in again.text
    assert again.weights == reference.weights


# -- Colab ---------------------------------------------------------------------------------


def colab_env(
    machine: dict[str, str], tmp_path: Path, server: Any, vm: str, open_port: int
) -> dict[str, str]:
    """One Colab runtime: its own mount point over the shared simulated Drive."""
    (tmp_path / vm).mkdir()
    return {
        **machine,
        "COLAB_RELEASE_TAG": "nbresume-test-standin",
        "COLAB_STANDIN_ROOT": str(tmp_path / "cloud"),
        "COLAB_STANDIN_API_URL": server.url,
        "COLAB_STANDIN_UPLOAD_LAG_S": "0.3",
        "NBRESUME_DRIVE_API_URL": server.url,
        "NBRESUME_DRIVE_MOUNT": str(tmp_path / vm / "drive"),
        "NBRESUME_DRIVE_POLL_S": "0.1",
        "NBRESUME_PROBE_PORT": str(open_port),  # Colab runtimes have internet
    }


def test_colab_a_new_runtime_continues_from_what_reached_drive_bit_exact(
    reference: Reference, machine: dict[str, str], tmp_path: Path, cloud: Any, open_port: int
) -> None:
    from colab.godview import landed

    god, server = cloud
    notebook = NOTEBOOKS / "colab_quickstart.ipynb"
    run = ["nbresume", "colab-quickstart"]

    def on_drive() -> set[int]:
        return {step for step, whole in landed(god, run).items() if whole}

    # Runtime 1 disconnects (its kernel and Drive's uploader die at once) after Drive has a
    # checkpoint: whatever had not uploaded by then is gone.
    env1 = colab_env(machine, tmp_path, server, "vm1", open_port)
    first = start(notebook, tmp_path / "vm1.ipynb", SMALL, env=env1, cwd=tmp_path / "vm1")
    wait_for("a checkpoint on Drive", lambda: bool(on_drive()), first)
    kill_kernel(first)
    assert finish(first, tmp_path / "vm1.ipynb").code != 0
    landed_steps = on_drive()
    assert max(landed_steps) < STEPS, "the disconnect must come before the end"

    # Runtime 2: a fresh VM, Drive mounted again, "Run all".
    env2 = colab_env(machine, tmp_path, server, "vm2", open_port)
    second = execute(notebook, tmp_path / "vm2.ipynb", SMALL, env=env2, cwd=tmp_path / "vm2")
    assert second.code == 0, second.log
    text = second.text
    assert "nbresume preflight on Google Colab" in text
    # No GPU here: on Colab a failed check warns, and the run goes on.
    assert "FAIL accelerator" in text
    assert second.start == max(landed_steps)
    assert f"training finished at step {STEPS}" in text
    assert second.weights == reference.weights
    # The last cell waited until Drive itself had the final checkpoint, and said so.
    assert f"{STEPS:012d}: Google Drive reports all " in text
    assert "with the manifest's size and MD5" in text
    assert STEPS in on_drive()


# -- Kaggle --------------------------------------------------------------------------------


def kaggle_machine(
    machine: dict[str, str], root: Path, open_port: int, attach: Path | None = None
) -> tuple[dict[str, str], Path]:
    """A folder laid out like a Kaggle machine, in a batch run (Save & Run All); ``attach``
    is an earlier version's output, attached read-only as Kaggle attaches a notebook's."""
    kaggle = root / "kaggle"
    for sub in ("working", "input", "temp"):
        (kaggle / sub).mkdir(parents=True)
    if attach is not None:
        target = kaggle / "input" / "notebooks" / "tester" / "nbresume-quickstart"
        shutil.copytree(attach, target)
        for path in sorted(target.rglob("*"), reverse=True):
            path.chmod(stat.S_IMODE(path.stat().st_mode) & ~0o222)
    env = {
        **machine,
        "KAGGLE_KERNEL_RUN_TYPE": "Batch",
        "KAGGLE_URL_BASE": "http://localhost",
        "NBRESUME_KAGGLE_ROOT": str(kaggle),
        "NBRESUME_PROBE_PORT": str(open_port),  # internet on
    }
    return env, kaggle / "working"


def writable(folder: Path) -> None:
    for path in folder.rglob("*"):
        path.chmod(stat.S_IMODE(path.stat().st_mode) | 0o700)


def test_kaggle_versions_continue_each_other_to_the_same_weights(
    reference: Reference, machine: dict[str, str], tmp_path: Path, open_port: int
) -> None:
    notebook = NOTEBOOKS / "kaggle_quickstart.ipynb"
    settings = {**SMALL, "accelerator": "cpu"}
    cut = 3 * EVERY - 7  # not on a save: the stop itself must save

    # Version 1 reaches the session deadline (NBRESUME_SMOKE_STEPS stops the loop exactly as
    # the deadline does: save, then leave the loop) and completes without an error.
    env1, working1 = kaggle_machine(machine, tmp_path / "v1", open_port)
    v1 = execute(
        notebook,
        tmp_path / "v1.ipynb",
        settings,
        env={**env1, "NBRESUME_SMOKE_STEPS": str(cut)},
        cwd=working1,
    )
    assert v1.code == 0, v1.log
    assert "nbresume preflight on Kaggle (Save & Run All): " in v1.text
    assert f"stopped at step {cut}:" in v1.text
    output = working1 / "nbresume" / "kaggle-quickstart"
    assert newest_verified(output) == cut

    # Version 2 has version 1's output attached as input and continues from it.
    env2, working2 = kaggle_machine(machine, tmp_path / "v2", open_port, attach=working1)
    try:
        v2 = execute(notebook, tmp_path / "v2.ipynb", settings, env=env2, cwd=working2)
    finally:
        writable(tmp_path / "v2" / "kaggle" / "input")
    assert v2.code == 0, v2.log
    assert f"continued from step {cut} of an attached input" in v2.text
    assert v2.start == cut
    assert f"training finished at step {STEPS}" in v2.text
    assert v2.weights == reference.weights
    assert newest_verified(working2 / "nbresume" / "kaggle-quickstart") == STEPS


def test_kaggle_a_batch_run_on_the_wrong_machine_stops_at_its_first_cell(
    machine: dict[str, str], tmp_path: Path, open_port: int
) -> None:
    env, working = kaggle_machine(machine, tmp_path, open_port)
    ran = execute(
        NOTEBOOKS / "kaggle_quickstart.ipynb",
        tmp_path / "out.ipynb",
        {**SMALL, "accelerator": "gpu"},  # committed without a GPU
        env=env,
        cwd=working,
    )
    assert ran.code != 0
    notebook = ran.notebook
    init = next(c for c in notebook.cells if "nbresume.init(name" in c.source)
    [error] = [o for o in init.outputs if o.output_type == "error"]
    assert error.ename == "PreflightError"
    assert "accelerator" in error.evalue
    assert "GPU" in error.evalue
    assert all(c.execution_count is None for c in cells_after(notebook, "import glob"))
    assert not (working / "nbresume").exists()  # it failed before anything was prepared
