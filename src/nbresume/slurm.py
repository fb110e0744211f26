"""Slurm: after a stop signal was saved, ask Slurm to put the job back in the queue.

A batch job submitted with ``#SBATCH --signal=B:USR1@360`` receives SIGUSR1 six minutes
before its time limit. The :class:`~nbresume.Checkpointer` saves at the next step boundary and
stops; then, inside a Slurm job, it calls :func:`after_stop_save`, which runs
``scontrol requeue <job>``. Slurm ends the job and starts the same script again later, and
that script resumes from the checkpoint just saved.

Which signals lead to a requeue is the knob ``NBRESUME_SLURM_REQUEUE``:

- ``auto`` (the default): after SIGUSR1 only. SIGUSR1 comes only when the job asked for it
  (``--signal``), while SIGTERM also comes from ``scancel``: a job that a person cancelled must
  not come back by itself. Slurm requeues a preempted job on its own when the partition's
  preemption mode says so.
- ``always``: after SIGUSR1 and SIGTERM.
- ``never``: never; the job saves and exits.

Only the first task of a job (``SLURM_PROCID`` 0) asks, and a job array's task is named
``<array job>_<task>``. Whether Slurm accepts is up to the job (``sbatch --requeue``) and the
cluster (``JobRequeue``); a refusal is printed with the fix, and the checkpoint is saved either
way.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

from nbresume import knobs
from nbresume.errors import UsageError

#: Printed (to standard error) when a job asked Slurm to requeue it: ``nbresume run`` looks
#: for it, so that it does not start the command again itself.
REQUEUED_MARK = "nbresume: asked Slurm to requeue job"

#: How long ``scontrol`` may take: the job's grace time is short.
SCONTROL_TIMEOUT_S = 30.0


def job_id() -> str | None:
    """The id ``scontrol requeue`` takes for this job (``<array job>_<task>`` in an array),
    or ``None`` outside a Slurm job."""
    job = os.environ.get("SLURM_JOB_ID", "").strip()
    if not job:
        return None
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID", "").strip()
    task = os.environ.get("SLURM_ARRAY_TASK_ID", "").strip()
    if array_job and task:
        return f"{array_job}_{task}"
    return job


def requeue_signals() -> frozenset[int]:
    """The stop signals after which the job asks to be requeued (see the module docstring)."""
    mode = knobs.slurm_requeue()
    if mode == "never":
        return frozenset()
    if mode == "always":
        return frozenset({signal.SIGUSR1, signal.SIGTERM})
    return frozenset({signal.SIGUSR1})


def should_requeue(signum: int) -> bool:
    """Whether a stop on ``signum`` ends with a requeue request, here and now."""
    if job_id() is None:
        return False
    if os.environ.get("SLURM_PROCID", "0").strip() not in ("", "0"):
        return False  # one request per job: the first task makes it
    return signum in requeue_signals()


def after_stop_save(signum: int, step: int) -> bool:
    """Called once the checkpoint of ``step`` is saved after the stop signal ``signum``: in a
    Slurm job, ask Slurm to requeue it. Returns whether Slurm accepted. Never raises: the
    checkpoint is saved, and the process exits next whatever happens here."""
    try:
        wanted = should_requeue(signum)
    except UsageError as exc:
        _say(f"nbresume: saved step {step}; the job was not requeued: {exc}")
        return False
    if not wanted:
        return False
    job = job_id()
    assert job is not None
    name = signal.Signals(signum).name
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        _say(
            f"nbresume: saved step {step} after {name}, but scontrol is not on PATH, so Slurm "
            f"job {job} was not requeued. Fix: resubmit the same script (it resumes from step "
            f"{step}), or load Slurm's tools in the job script"
        )
        return False
    try:
        done = subprocess.run(
            [scontrol, "requeue", job],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=SCONTROL_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        _say(f"nbresume: saved step {step}; `scontrol requeue {job}` failed: {exc}")
        return False
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip() or f"exit status {done.returncode}"
        _say(
            f"nbresume: saved step {step}; Slurm refused to requeue job {job}: {said}. Fix: "
            "submit with `sbatch --requeue` (the cluster must allow requeueing), or resubmit "
            f"the same script: it resumes from step {step}"
        )
        return False
    _say(f"{REQUEUED_MARK} {job} (after {name}, with step {step} saved)")
    return True


def _say(message: str) -> None:
    # Standard error, not logging: the line must reach the job's log whatever logging is set
    # up, since `nbresume run` and the user read it there.
    print(message, file=sys.stderr, flush=True)
