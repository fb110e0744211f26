"""Progressive unfreezing: ``optimizer.add_param_group(...)`` part-way through a run. A resume
past that point gives the optimizer back the groups it gained (the code that added them does
not run again) and continues exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nbresume

UNFREEZE_AT = 2  # epoch


def train(folder: Path, *, stop_after: int | None = None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    backbone, head = model[0], model[2]
    for p in backbone.parameters():
        p.requires_grad_(False)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-2)
    data = torch.utils.data.TensorDataset(torch.randn(24, 4), torch.randn(24, 1))
    ck = nbresume.Checkpointer(folder, every=3, deadline=None, quiet=True, async_save=False,
                               model=model, optimizer=optimizer)  # fmt: skip
    loader = ck.loader(torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))
    step = 0
    for epoch in ck.epochs(5):
        if epoch == UNFREEZE_AT:  # runs once, in the epoch it unfreezes
            for p in backbone.parameters():
                p.requires_grad_(True)
            optimizer.add_param_group({"params": list(backbone.parameters()), "lr": 1e-3})
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            step += 1
            if ck.step + 1 == stop_after:
                ck.request_stop()
    ck.close()
    assert "add_param_group" not in vars(optimizer), "the optimizer is the user's own again"
    state = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    state["groups"] = torch.tensor(len(optimizer.param_groups))
    return state


@pytest.mark.parametrize("stop_after", [5, 16, 22])
def test_a_run_that_added_a_param_group_resumes_exactly(tmp_path: Path, stop_after: int) -> None:
    reference = train(tmp_path / "reference")
    train(tmp_path / "run", stop_after=stop_after)  # epoch 0, or after the unfreezing
    resumed = train(tmp_path / "run")
    for key, value in reference.items():
        assert torch.equal(resumed[key], value), f"stopped after {stop_after}: {key}"


def test_a_checkpoint_whose_groups_cannot_be_found_is_passed_over_changing_nothing(
    tmp_path: Path,
) -> None:
    train(tmp_path / "run", stop_after=16)  # saved with 2 groups from step 12 on
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model[2].parameters(), lr=1e-2)
    # The model is registered under another name: the added group's parameters are not found.
    ck = nbresume.Checkpointer(tmp_path / "run", every=None, deadline=None, quiet=True,
                               net=model, optimizer=optimizer)  # fmt: skip
    with pytest.warns(RuntimeWarning, match="2 parameter group"):
        assert ck.restore() == 12  # the newest checkpoint with one group
    assert len(optimizer.param_groups) == 1
    assert "add_param_group" not in vars(optimizer)
    ck.close()
