"""A small training run for the tests of ``nbresume run`` and of stops on Slurm and Kubernetes.

    python train_job.py DIR --total N [--every K] [--sleep S] [--torch] [--hold-at N]

Prints ``start N`` (the step it continues from), ``step N`` after each step and ``done`` at the
end. With ``--hold-at N`` it prints ``holding N`` at step N (its checkpoints saved so far, the
folder's writer lease held) and goes on once a line arrives on its standard input. Without
``--torch`` the model is a NumPy array, so torch is never imported (a quick start) and the run
can only start fresh; with ``--torch`` it is a small torch model that resumes.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

from nbresume import Checkpointer


class NumpyModel:
    def __init__(self) -> None:
        self.w = np.zeros(1024, dtype=np.float32)

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.w = np.asarray(state["w"], dtype=np.float32)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--total", type=int, required=True)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--sleep", type=float, default=0.05)
    parser.add_argument("--torch", action="store_true")
    parser.add_argument("--hold-at", type=int, default=None)
    args = parser.parse_args()

    state: dict[str, Any]
    if args.torch:
        import torch

        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        state = {"model": model, "optimizer": optimizer}
    else:
        state = {"model": NumpyModel()}
    ckpt = Checkpointer(
        args.dir, every=args.every, keep=3, deadline=None, async_save=False, **state
    )
    print(f"start {ckpt.restore()}", flush=True)
    for step in ckpt.steps(args.total):
        if args.torch:
            loss = model(torch.randn(4, 8)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        else:
            state["model"].w += 1
        time.sleep(args.sleep)
        print(f"step {step}", flush=True)
        if step == args.hold_at:
            print(f"holding {step}", flush=True)
            sys.stdin.readline()
    print("done", flush=True)


if __name__ == "__main__":
    main()
