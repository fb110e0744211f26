"""One training run hopping through one bucket URL: the docs' hop_train.py in one process, then
in two (torchrun, gloo on CPU), then in one again, each leg continuing from the newest
checkpoint the bucket confirms; it ends with the same weights as the same legs on a local
folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import HopLegs

from .conftest import URL
from .standin import HubStandIn


@pytest.mark.slow
def test_bucket_hop_one_then_two_processes_then_one_ends_as_on_a_local_folder(
    hub: HubStandIn, hop_legs: HopLegs, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    through_bucket = hop_legs.run(URL, tmp_path)
    assert [step for step, _, _ in through_bucket] == [8, 16, 24]
    assert through_bucket == hop_legs.on_a_folder
