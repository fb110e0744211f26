"""Train a large CPU state under a real cgroup memory limit with async saves; report.

Run as ``python memory_limit_child.py CGROUP VERSION RUN_DIR STATE_MB [--copy-anyway]``:
CGROUP is a freshly made cgroup folder (VERSION ``1`` or ``2``) with no limit yet. The child
moves itself into it before importing torch, builds the state, then sets the limit itself:
what it uses then (its anonymous memory) plus half the state. A full host copy of the state
needs the whole state more, so it cannot fit; a save written from the live tensors can.
``--copy-anyway`` makes the copy whatever the memory (the control: it must be killed).

Prints one JSON object on its last line: the limit, the sha256 of every saved tensor, the
warnings nbresume logged. The test makes the assertions.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sys
from pathlib import Path

MB = 1 << 20
#: The state's tensors: each this many MiB.
PIECE_MB = 64


def memory_stat(folder: Path, key: str) -> int:
    for line in (folder / "memory.stat").read_text().splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    raise KeyError(key)


def main() -> None:
    cgroup, version, run_dir, state_mb = (
        Path(sys.argv[1]),
        sys.argv[2],
        sys.argv[3],
        int(sys.argv[4]),
    )
    copy_anyway = "--copy-anyway" in sys.argv
    # Everything this process allocates from here on is charged to the cgroup.
    (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    import torch
    from torch import nn

    import nbresume
    from nbresume.checkpoint.loop import saver

    if copy_anyway:
        saver.HOST_SHARE = math.inf

    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("nbresume").addHandler(Keep(level=logging.WARNING))

    class Big(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            count = state_mb // PIECE_MB
            self.weights = nn.ParameterList(
                nn.Parameter(torch.full((PIECE_MB * MB // 4,), float(i))) for i in range(count)
            )

    model = Big()
    anon = memory_stat(cgroup, "total_rss" if version == "1" else "anon")
    limit = anon + state_mb * MB // 2
    (cgroup / ("memory.limit_in_bytes" if version == "1" else "memory.max")).write_text(str(limit))
    # No swap either: where a machine has some, what does not fit is killed, not swapped out.
    swap = cgroup / ("memory.memsw.limit_in_bytes" if version == "1" else "memory.swap.max")
    if swap.exists():
        swap.write_text(str(limit) if version == "1" else "0")

    ckpt = nbresume.Checkpointer(run_dir, every=1, deadline=None, async_save=True, quiet=True,
                                 keep=2, model=model)  # fmt: skip
    for _ in ckpt.steps(3):
        with torch.no_grad():
            for weight in model.weights:
                weight.add_(1.0)  # in place: the state stays the size it is
    ckpt.close()
    digests = {
        name: hashlib.sha256(value.numpy()).hexdigest()
        for name, value in model.state_dict().items()
    }
    report = {"limit": limit, "anon": anon, "step": ckpt.step, "digests": digests,
              "warnings": warnings}  # fmt: skip
    print(json.dumps(report))


if __name__ == "__main__":
    main()
