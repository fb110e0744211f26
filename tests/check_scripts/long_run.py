"""A long run (60,000 steps, a save after each under `nbresume check`) of a NumPy vector: its
whole run cannot be covered in a few seconds."""

import numpy as np
import torch

import nbresume


class Weights:
    def __init__(self) -> None:
        self.w = np.zeros(3)

    def state_dict(self) -> dict[str, np.ndarray]:
        return {"w": self.w.copy()}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        self.w = np.asarray(state["w"]).copy()


torch.manual_seed(0)
weights = Weights()
ckpt = nbresume.Checkpointer("runs/long", weights=weights, async_save=False, quiet=True)
ckpt.restore()
for step in ckpt.steps(60_000):
    weights.w += step
ckpt.close()
