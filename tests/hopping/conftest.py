"""The three places of one hopping run, side by side in one test: a simulated Colab (its Drive
API server on loopback), a fake Kaggle that runs pushed notebooks for real, and a real sshd on
loopback standing in for a rented box. Each is the fixture its own folder of tests uses."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from colab.conftest import colab  # noqa: F401  (a fixture, used by name)
from kaggle.conftest import NETGUARD, net_log  # noqa: F401
from remote.conftest import child_env, ssh_keys, sshd  # noqa: F401
from testkit.fake_kaggle import FakeKaggle, serving

#: The Kaggle account of the tests' user, as the guide names it.
KAGGLE_USER = "you"


@pytest.fixture
def kaggle_site(tmp_path: Path, net_log: Path) -> Iterator[FakeKaggle]:  # noqa: F811
    """A fake Kaggle (the user ``you``) whose machines run notebooks for real; afterwards,
    every request it saw must have been meant for localhost."""
    with serving(tmp_path / "fake-kaggle", NETGUARD, username=KAGGLE_USER) as server:
        yield server
