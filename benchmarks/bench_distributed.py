"""What the shared stop decision costs per step under torch.distributed (gloo, loopback).

Two ranks, forked from one process. For each rank it times:

- ``agree``: the one all_reduce (max of five int64) a step boundary makes;
- ``loop``: a whole step boundary of ``Checkpointer.steps()`` with nothing due (the flag
  exchange plus the bookkeeping), against an empty ``range()`` loop of the same length.

    .venv/bin/python benchmarks/bench_distributed.py [--steps 2000]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time


def rank_main(rank: int, port: int, steps: int, folder: str) -> None:
    import torch.distributed as dist

    import nbresume
    from nbresume.checkpoint.parallel import distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = distributed.current()
    assert group is not None
    samples = []
    for _ in range(steps):
        started = time.perf_counter()
        group.agree([0, 0, 0, 0, 0])
        samples.append(time.perf_counter() - started)
    ckpt = nbresume.Checkpointer(folder, every=None, deadline=None, async_save=False)
    started = time.perf_counter()
    for _ in ckpt.steps(steps):
        pass
    loop = (time.perf_counter() - started) / steps
    started = time.perf_counter()
    for _ in range(steps):
        pass
    bare = (time.perf_counter() - started) / steps
    samples.sort()
    print(
        f"rank {rank}: agree median {statistics.median(samples) * 1e6:.0f} us, "
        f"p95 {samples[int(0.95 * len(samples))] * 1e6:.0f} us; "
        f"steps() boundary {(loop - bare) * 1e6:.0f} us per step (includes the final save / "
        f"{steps})",
        flush=True,
    )
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    import torch  # imported once, before the fork

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        children = []
        for rank in range(2):
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    rank_main(rank, port, args.steps, folder)
                except BaseException:
                    code = 1
                    raise
                finally:
                    os._exit(code)
            children.append(pid)
        failed = [os.waitpid(pid, 0)[1] for pid in children]
    return 1 if any(failed) else 0


if __name__ == "__main__":
    sys.exit(main())
