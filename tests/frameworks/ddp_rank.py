"""What the two-rank framework scripts (``ddp_hf_train.py``, ``ddp_lightning_train.py``) share:
one line per event on stdout, the deadline of one rank, and the end of a rank."""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def say(rank: int, line: str) -> None:
    """One write per line keeps the lines of two processes on one pipe whole."""
    sys.stdout.write(f"rank {rank} {line}\n")
    sys.stdout.flush()


def deadline_on(rank: int, spec: str) -> float | None:
    """The deadline this rank's callback gets from ``--deadline-on-rank RANK:SECONDS``
    (``None`` on the other ranks, and when the option is empty)."""
    if not spec:
        return None
    on, seconds = spec.split(":")
    return float(seconds) if int(on) == rank else None


def end_rank(rank: int, code: int) -> NoReturn:
    """End this rank with ``code`` once both ranks reported everything.

    Both ranks end together: none leaves while the other could still be in a collective. What
    would follow is torch's teardown alone, which with gloo sometimes aborts
    (tests/distributed/teardown.py) or hangs after ``destroy_process_group()``: measured with
    the Trainer script ending in ``destroy_process_group()``, 2 hangs in 86 runs with
    ``nbresume.hf.Callback`` and 1 in 74 without it. The rank ends now, with the status the
    stop asked for."""
    import torch.distributed as dist

    dist.barrier()
    say(rank, "teardown")
    os._exit(code)
