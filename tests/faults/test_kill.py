"""kill -9 during save(): no reported checkpoint is ever lost, none is ever half visible.

A child process saves step after step (its state a pure function of the step) and is killed
with SIGKILL; this process, which never writes, then checks the folder as a restarted run
would see it, and the next child resumes from it. Kills accumulate over one folder.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from .killing import Campaign, sweep_events

KEEP = 3


def kill_campaign(tmp_path: Path, rng: random.Random, kills: int) -> Campaign:
    campaign = Campaign(tmp_path / "run", KEEP, rng, tmp_path)
    campaign.prime(saves=5)
    for _ in range(kills):
        campaign.kill_once()
    print(campaign.summary())
    return campaign


def test_random_kills_never_lose_a_reported_checkpoint(
    tmp_path: Path, fault_rng: random.Random
) -> None:
    campaign = kill_campaign(tmp_path, fault_rng, kills=36)
    # The kills reached both the uncommitted and the committed side of the protocol.
    phases = set(campaign.phases)
    assert "payload files being written" in phases
    assert phases & {
        "committed: verification read-back, retention listing",
        "retention: deleting an old checkpoint",
        "committed and pruned, not yet returned",
    }


@pytest.mark.torture
def test_random_kills_torture(tmp_path: Path, fault_rng: random.Random) -> None:
    campaign = kill_campaign(tmp_path, fault_rng, kills=300)
    assert len(campaign.phases) >= 6, campaign.summary()


@pytest.mark.parametrize("resave", [False, True], ids=["new-step", "same-step-again"])
def test_kill_before_each_file_operation_of_a_save(tmp_path: Path, resave: bool) -> None:
    points = list(sweep_events(tmp_path / "run", KEEP, resave=resave, workdir=tmp_path))
    print("\n".join(points))
    # The sweep reached the steps that matter: the rename that commits, and the one that
    # takes an old copy out of view (retention, or the replaced copy of the same step).
    assert any(" os.rename .nbresume-tmp-" in point for point in points)
    aside = "-> .nbresume-old-replaced-" if resave else "-> .nbresume-old-deleting-"
    assert any(aside in point for point in points)
