"""One training run hopping platforms, as docs/platforms/hopping.md tells it, by both routes: by a
copy per hop (``nbresume push`` to a Kaggle dataset, ``pull`` onto the box, ``pull`` home), and
through one bucket URL. The three places (:mod:`hopping.legs`): a simulated Colab
(one process), a fake Kaggle batch run on two processes (torchrun, gloo on CPU, Internet on),
a real sshd on loopback standing in for a rented box (one process). Every leg's folder is the
same ``hf://buckets`` URL on the stand-in Hub: nothing is pushed or pulled between legs, each
continues from the newest checkpoint the bucket confirms, and ``nbresume pull`` brings the
finished run home from the bucket, verified.

The journey by a copy per hop runs first: every move verified, and what the guide shows each
command print is what it printed. The bucket's journey ends with the same weights after each
leg, and the same final ``model.safetensors`` bit for bit: the same legs run twice, through
other stores, end with the same bits.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from colab.conftest import Colab, colab  # noqa: F401  (fixtures, used by name)
from hopping.conftest import kaggle_site, net_log  # noqa: F401
from hopping.legs import COLAB_STOP, KAGGLE_STOP, TOTAL, World, check_guide, hop
from nbresume.checkpoint.format import step_dirname
from remote.conftest import SshServer, child_env, ssh_keys, sshd  # noqa: F401
from testkit.fake_kaggle import FakeKaggle

from .conftest import BUCKET, TOKEN, URL
from .standin import HubStandIn


@pytest.fixture
def reach(
    hub: HubStandIn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[HubStandIn, dict[str, str]]:
    """The stand-in Hub, and what every leg needs to reach its bucket: the Hub's address, the
    token (a secret named HF_TOKEN, as the guide says), the client's caches in the test's
    folder. Set in this process's environment too, which the Colab VMs start from."""
    env = {
        "HF_ENDPOINT": hub.url,
        "HF_TOKEN": TOKEN,
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_XET_CACHE": os.environ["HF_XET_CACHE"],
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        # The Kaggle client's requests go through the fake Kaggle as a proxy (localhost); the
        # stand-in Hub is reached directly.
        "NO_PROXY": "127.0.0.1",
        "no_proxy": "127.0.0.1",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return hub, env


@pytest.mark.slow
def test_one_run_hops_from_colab_to_kaggle_s_two_processes_to_an_ssh_box_by_copies_and_by_bucket(
    reach: tuple[HubStandIn, dict[str, str]],
    colab: Colab,  # noqa: F811
    kaggle_site: FakeKaggle,  # noqa: F811
    sshd: SshServer,  # noqa: F811
    child_env: dict[str, str],  # noqa: F811
) -> None:
    pytest.importorskip("torch")
    hub, env = reach
    child_env.update(env)  # the box's environment, and the laptop's
    kaggle_site.run_env.update(env)  # the Kaggle machines'
    world = World(colab.tmp, colab, kaggle_site, sshd, child_env)

    by_copies = hop(world, "hop-demo")
    # Each leg resumed from the previous leg's last checkpoint and stopped where its session
    # ended; the last one finished the training.
    steps = [(step, state) for step, state, _ in by_copies.finals]
    assert steps == [
        (COLAB_STOP, "to be continued"),
        (KAGGLE_STOP, "to be continued"),
        (TOTAL, "the training is done"),
    ]
    # Every move verified: the push copied and checked the checkpoint before uploading it,
    # Kaggle's nbresume.init verified it again as it seeded /kaggle/working, the pulls checked
    # every file against its manifest.
    push = by_copies.said["push"][1]
    assert f"OK    {COLAB_STOP:012d}" in push, push
    assert "verified" in push, push
    assert "OK 3/3" in by_copies.said["pull-kaggle"][1], by_copies.said["pull-kaggle"][1]
    assert "the remote copy is safe to tear down" in by_copies.said["pull-home"][1]
    assert by_copies.home_copy is not None
    assert sorted(p.name for p in by_copies.home_copy.iterdir() if p.name.isdigit()) == [
        f"{s:012d}" for s in (KAGGLE_STOP, 20, TOTAL)
    ]
    # What the guide shows each command print is what these commands printed.
    check_guide(world, by_copies)

    through_bucket = hop(world, "hop-bucket", URL)

    # Each leg continued from the previous leg's newest checkpoint in the bucket (the legs
    # assert "continuing from step 8 on 2 process(es)" and "from step 16 on 1"), stopped where
    # its session ended, and the last one finished the training: with the same weights, leg by
    # leg, as the journey by copies.
    steps = [(step, state) for step, state, _ in through_bucket.finals]
    assert steps == [
        (COLAB_STOP, "to be continued"),
        (KAGGLE_STOP, "to be continued"),
        (TOTAL, "the training is done"),
    ]
    assert through_bucket.finals == by_copies.finals
    # Nothing moved between the legs but through the bucket: no dataset was pushed.
    assert "push" not in through_bucket.said
    assert "pull-kaggle" not in through_bucket.said
    # Home from the bucket, every file verified; the final weights are the copy route's bits.
    assert "the remote copy is safe to tear down" in through_bucket.said["pull-home"][1]
    assert through_bucket.home_copy is not None
    assert by_copies.home_copy is not None
    model = f"{TOTAL:012d}/model.safetensors"
    assert (through_bucket.home_copy / model).read_bytes() == (
        by_copies.home_copy / model
    ).read_bytes()
    # The bucket holds the run's newest checkpoints, the last one the finished training.
    assert step_dirname(TOTAL) in {path.split("/", 1)[0] for path in hub.files(BUCKET)}
    assert hub.unknown == []
