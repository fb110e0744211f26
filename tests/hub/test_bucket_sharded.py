"""A sharded save to a bucket: two FSDP2 ranks (forked processes, gloo on loopback, the worker
of ``tests/distributed``) each upload their own shards to one ``hf://buckets`` URL on the
stand-in Hub, the bucket confirms every rank's files by the records each rank wrote, and two
fresh ranks restore the newest step exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from distributed.test_sharded import Cluster, assert_ended_well, said
from nbresume.checkpoint.store import CheckpointStore

from .conftest import URL
from .standin import HubStandIn


@pytest.mark.slow
def test_bucket_fsdp2_shards_of_two_ranks_are_confirmed_and_restored(
    hub: HubStandIn, tmp_path: Path
) -> None:
    expected = tmp_path / "expected"
    expected.mkdir()
    cluster = Cluster()  # started now: its ranks inherit the stand-in Hub's address and token
    try:
        lines = cluster.run("save", URL, expected)
        assert_ended_well(lines)
        assert said(lines, 0, "saved") == said(lines, 1, "saved") == ["1", "2", "3"], lines

        # Read as a stranger: each rank's shards are files of the newest checkpoint, and the
        # bucket reports every one of them with the size and xet_hash its rank computed.
        store = CheckpointStore(URL, keep=None)
        newest = store.latest()
        assert newest is not None
        assert newest.step == 3
        shards = {"sharded.rank00000.safetensors", "sharded.rank00001.safetensors"}
        assert shards <= set(newest.manifest.files)
        confirmed, how = store.backend.confirm(newest.name, newest.manifest)
        assert confirmed, how

        lines = cluster.run("restore", URL, expected)
        assert_ended_well(lines)
        assert said(lines, 0, "restored") == said(lines, 1, "restored") == ["3 same"], lines
    finally:
        cluster.close()
    assert hub.unknown == []
