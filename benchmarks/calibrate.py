"""The machine's own limits for a given number of bytes, measured on the file system the
checkpoints go to: the ratios in every table divide by these.

- **raw write+fsync**: one file written in 8 MiB chunks from memory, ``fsync`` of the file
  and of its folder. No checkpointer can make the same bytes durable faster.
- **memory copy**: ``copy_`` of the same bytes into an existing tensor (torch's own threads).
  No asynchronous save can hand training back faster than a copy of the state.
- **raw cold read**: the file read back into memory after its cached pages were dropped
  (``posix_fadvise(DONTNEED)``, no root needed). On a virtual machine the host may cache the
  disk as well, so "cold" can be faster than the physical disk.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks._common import CHUNK, evict, fsync_path, median, timed


@dataclass
class Calibration:
    bytes: int
    write_fsync_s: float
    memcpy_s: float
    cold_read_s: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def calibrate(folder: Path, nbytes: int, reps: int = 3) -> Calibration:
    """Medians over ``reps`` of each measure, for ``nbytes`` bytes, in ``folder``."""
    import numpy as np
    import torch

    scratch = folder / "calibration"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    data = np.random.default_rng(0).integers(0, 255, size=nbytes, dtype=np.uint8)
    view = memoryview(data).cast("B")
    target = scratch / "raw.bin"

    def write() -> None:
        with open(target, "wb", buffering=0) as handle:
            for start in range(0, nbytes, CHUNK):
                handle.write(view[start : start + CHUNK])
            os.fsync(handle.fileno())
        fsync_path(scratch)

    into = bytearray(min(CHUNK, nbytes))

    def read() -> None:
        with open(target, "rb", buffering=0) as handle:
            while handle.readinto(into):
                pass

    writes, reads = [], []
    for _ in range(reps):
        target.unlink(missing_ok=True)
        os.sync()
        writes.append(timed(write))
        evict(target)
        reads.append(timed(read))
    source = torch.from_numpy(data)
    copy = torch.empty_like(source)
    copy.copy_(source)  # fault the destination's pages in once, as reused buffers are
    copies = [timed(lambda: copy.copy_(source)) for _ in range(reps)]
    shutil.rmtree(scratch, ignore_errors=True)
    return Calibration(nbytes, median(writes), median(copies), median(reads))
