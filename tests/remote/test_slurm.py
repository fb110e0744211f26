"""Stops on Slurm and Kubernetes: real signals to a real training process.

Inside a Slurm job (``SLURM_JOB_ID`` set) SIGUSR1, the warning ``--signal=B:USR1@N`` asks for,
saves at the next step boundary and then asks Slurm to requeue the job. ``scontrol`` is a
stand-in (``tests/remote/bin/scontrol``) that records its arguments and which checkpoints
were committed when it was called; the rest is real. On Kubernetes, SIGTERM saves and exits
143 within the grace period.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from nbresume.checkpoint.format import step_dirname
from nbresume.slurm import REQUEUED_MARK
from testkit.cli import nbresume_argv

from .conftest import (
    final_marker,
    log_lines,
    read_state,
    start_job,
    train_argv,
    verified_steps,
)

SLURM = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train"}


def stop(
    tmp_path: Path, env: dict[str, str], signum: int
) -> tuple[int, list[int], dict[int, bool], str]:
    """Train until step 5, send ``signum``; return the exit status, the steps made, the
    checkpoints (step -> verifies) and what the stand-in scontrol recorded."""
    ckpt = tmp_path / "ckpt"
    env = {**env, "SCONTROL_WATCH": str(ckpt)}
    job = start_job(train_argv(ckpt, 10_000, "--every", "1000"), env)
    job.wait_for_line("step 5")
    job.proc.send_signal(signum)
    code = job.finish()
    record = Path(env["SCONTROL_RECORD"])
    calls = record.read_text() if record.exists() else ""
    return code, job.steps(), verified_steps(ckpt), calls + "\n" + job.output


@pytest.mark.parametrize(
    ("extra", "job_id"),
    [({}, "4242"), ({"SLURM_ARRAY_JOB_ID": "4000", "SLURM_ARRAY_TASK_ID": "7"}, "4000_7")],
    ids=["job", "array-task"],
)
def test_sigusr1_saves_at_a_step_boundary_then_requeues(
    extra: dict[str, str], job_id: str, tmp_path: Path, child_env: dict[str, str]
) -> None:
    code, steps, saved, calls = stop(tmp_path, {**child_env, **SLURM, **extra}, signal.SIGUSR1)

    assert code == 128 + signal.SIGUSR1, calls
    stopped_at = steps[-1] + 1  # the boundary after the last step made
    assert saved == {stopped_at: True}, calls
    # One request, for this job, made after the checkpoint was committed.
    assert calls.count("argv: ") == 1, calls
    assert f"argv: requeue {job_id}\ncommitted: {step_dirname(stopped_at)}\n" in calls
    assert f"{REQUEUED_MARK} {job_id}" in calls


def test_sigterm_on_slurm_saves_without_a_requeue_unless_asked(
    tmp_path: Path, child_env: dict[str, str]
) -> None:
    # SIGTERM also comes from `scancel`: a job a person cancelled must not come back.
    code, steps, saved, calls = stop(tmp_path / "a", {**child_env, **SLURM}, signal.SIGTERM)
    assert code == 143
    assert saved == {steps[-1] + 1: True}
    assert "argv:" not in calls

    env = {**child_env, **SLURM, "NBRESUME_SLURM_REQUEUE": "always"}
    code, steps, saved, calls = stop(tmp_path / "b", env, signal.SIGTERM)
    assert code == 143
    assert saved == {steps[-1] + 1: True}
    assert "argv: requeue 4242" in calls


def test_a_refused_requeue_still_saves_and_says_what_to_do(
    tmp_path: Path, child_env: dict[str, str]
) -> None:
    refusal = "scontrol: error: Requested operation is presently disabled for job 4242"
    env = {**child_env, **SLURM, "SCONTROL_REFUSE": refusal}

    code, steps, saved, calls = stop(tmp_path, env, signal.SIGUSR1)

    assert code == 128 + signal.SIGUSR1
    assert saved == {steps[-1] + 1: True}
    assert f"Slurm refused to requeue job 4242: {refusal}" in calls
    assert "sbatch --requeue" in calls
    assert REQUEUED_MARK not in calls


def test_only_the_first_task_of_a_job_asks_for_the_requeue(
    tmp_path: Path, child_env: dict[str, str]
) -> None:
    env = {**child_env, **SLURM, "SLURM_PROCID": "1"}
    code, _, saved, calls = stop(tmp_path, env, signal.SIGUSR1)
    assert code == 128 + signal.SIGUSR1
    assert all(saved.values())
    assert saved
    assert "argv:" not in calls


def test_sigterm_on_kubernetes_saves_and_exits_143(
    tmp_path: Path, child_env: dict[str, str]
) -> None:
    env = {**child_env, "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
    code, steps, saved, calls = stop(tmp_path, env, signal.SIGTERM)
    assert code == 143
    assert saved == {steps[-1] + 1: True}
    assert "argv:" not in calls  # scontrol is on PATH, but this is not a Slurm job


def test_nbresume_run_does_not_start_a_requeued_job_again(
    tmp_path: Path, child_env: dict[str, str]
) -> None:
    # The job got SIGUSR1 itself (Slurm signals a job step's processes) and asked Slurm to
    # requeue it: starting it again here would race the copy Slurm starts.
    ckpt = tmp_path / "ckpt"
    env = {**child_env, **SLURM, "SCONTROL_WATCH": str(ckpt)}
    runner = start_job(
        nbresume_argv(
            "run", "--retries", "3", "--backoff", "0", "--dir", str(ckpt), "--",
            *train_argv(ckpt, 10_000, "--every", "1000"),
        ),
        env,
    )  # fmt: skip
    log = ckpt / "nbresume-run.log"
    runner.wait_for_line("step 5")
    state = read_state(log)
    assert state is not None
    assert state.pid is not None

    os.kill(state.pid, signal.SIGUSR1)
    code = runner.finish()

    assert code == 128 + signal.SIGUSR1, runner.output
    lines = log_lines(log)
    assert sum("attempt " in line for line in lines) == 1, lines
    assert "the job asked Slurm to requeue it" in lines[-2]
    assert final_marker(log).startswith("[nbresume run] exit 138 after ")
