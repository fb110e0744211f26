"""Launch a framework's training script as a two-rank ``torchrun`` job on the CPU (gloo), and
read how its ranks stopped.

The scripts (``ddp_hf_train.py``, ``ddp_lightning_train.py``) print ``rank R ...`` lines, as
the Checkpointer's DDP worker does, so that :class:`tests.distributed.job.Job` reads them.
"""

from __future__ import annotations

import signal
import tempfile
from pathlib import Path

from tests.distributed.job import TORCHRUN, Job
from tests.distributed.teardown import RankEnd


def torchrun(script: Path, directory: Path, *args: str) -> Job:
    """``torchrun --nproc-per-node 2 SCRIPT DIRECTORY ARGS``; each rank's stderr in a file of
    its own (``--redirects 2``), to tell which rank wrote what."""
    log_dir = Path(tempfile.mkdtemp(prefix="torchrun-logs-", dir=directory.parent))
    command = [
        str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.2",
        "--log-dir", str(log_dir), "--redirects", "2", str(script), str(directory), *args,
    ]  # fmt: skip
    return Job(command, log_dir)


def ended_as_asked(end: RankEnd, code: int) -> bool:
    """Whether a rank that printed ``stopped CODE`` then ``teardown`` ended with that status.

    The scripts end their ranks with ``os._exit`` (torch's gloo teardown is skipped). Also
    accepted, when the status is not 0: torchrun's own SIGTERM after the rank's last line, as
    torchrun stops the job's other ranks as soon as one rank ends with a failure status, and
    the two ranks end with 143 a moment apart."""
    if end.said[-2:] != (f"stopped {code}", "teardown"):
        return False
    if end.code == code:
        return True
    return code != 0 and end.code == -signal.SIGTERM and end.stopped_by_launcher


def stopped_together(job: Job, code: int) -> int:
    """Read ``job`` to its end; check that both ranks stopped at the same step, after one
    save, with the exit status ``code``; return that step."""
    job.finish()
    stopping = [job.of(rank, "event stopping") for rank in (0, 1)]
    assert stopping[0] == stopping[1], job.describe()
    assert len(stopping[0]) == 1, job.describe()
    step = int(stopping[0][0])
    assert job.of(0, "event verified")[-1:] == [str(step)], job.describe()  # rank 0 saved it
    assert job.of(1, "event save_started") == [], job.describe()  # rank 1 writes nothing
    ends = job.ends()
    assert [end.rank for end in ends] == [0, 1], job.describe()
    for end in ends:
        assert ended_as_asked(end, code), f"rank {end.rank}: exit {end.code}\n{job.describe()}"
    return step
