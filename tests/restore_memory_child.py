"""Save or restore a CPU state of STATE_MB, optionally inside a memory limit; report.

Run as ``python restore_memory_child.py ACTION RUN_DIR STATE_MB [LIMIT]``: ACTION is ``save``
(build the model and its optimizer's state, then an async save, which writes from the live
tensors where a copy does not fit) or ``restore`` (build them afresh, the optimizer without
state, and restore). The state is half parameters, half the optimizer's momentum. LIMIT is
``cgroup:FOLDER`` (a cgroup v1 or v2 folder whose limit the test set: the child moves itself
into it before it imports anything large) or ``as:BYTES`` (``RLIMIT_AS``: BYTES more address
space than the child has mapped once torch and nbresume are imported
and an optimizer built).

Prints one JSON object on its last line (``{"error": class, "message": text}``, exit status
3, where the save or restore raised): the step, the base (resident memory once imported),
the peak (``VmHWM``), the state's bytes, a sha256 of every tensor, the warnings logged. The
test makes the assertions.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import resource
import sys
from pathlib import Path

MB = 1 << 20
PIECE_MB = 32


def status(field: str) -> int:
    """A size from ``/proc/self/status`` in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def main() -> None:
    action, run_dir, state_mb = sys.argv[1], sys.argv[2], int(sys.argv[3])
    limit = sys.argv[4] if len(sys.argv) > 4 else ""
    if limit.startswith("cgroup:"):
        (Path(limit.removeprefix("cgroup:")) / "cgroup.procs").write_text(str(os.getpid()))

    import torch
    from torch import nn

    import nbresume

    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("nbresume").addHandler(Keep(level=logging.WARNING))
    # What building an optimizer imports counts in the base.
    torch.optim.SGD([torch.zeros(1)], lr=0.1)
    if limit.startswith("as:"):
        bound = status("VmSize") + int(limit.removeprefix("as:"))
        resource.setrlimit(resource.RLIMIT_AS, (bound, bound))
    base = status("VmRSS")
    count = max(1, state_mb // 2 // PIECE_MB)
    model = nn.ParameterList(
        nn.Parameter(torch.full((PIECE_MB * MB // 4,), float(i))) for i in range(count)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)

    ckpt = nbresume.Checkpointer(run_dir, every=None, deadline=None, quiet=True,
                                 async_save=True, model=model, optimizer=optimizer)  # fmt: skip
    try:
        if action == "save":  # the state a step gives, without the step's gradients
            for index, parameter in enumerate(model):
                optimizer.state[parameter]["momentum_buffer"] = torch.full_like(parameter, -index)
            ckpt.save(step=1)
            ckpt.wait()
            step = 1
        else:
            step = ckpt.restore()
    except Exception as exc:  # what the user would see: reported for the test to judge
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
        sys.exit(3)
    peak = status("VmHWM")
    ckpt.close()
    state = {f"model.{n}": v for n, v in model.state_dict().items()}
    for index, value in optimizer.state_dict()["state"].items():
        state[f"momentum.{index}"] = value["momentum_buffer"]
    digests = {n: hashlib.sha256(v.numpy()).hexdigest() for n, v in state.items()}
    report = {
        "step": step,
        "base": base,
        "peak": peak,
        "state_bytes": sum(v.nbytes for v in state.values()),
        "digests": digests,
        "warnings": warnings,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
