"""The rank server's jobs (``rank_server.run_job``, which the sharded, world-size and DDP tests
run their ranks through): a job whose port another process took between its drawing and rank
0 listening on it is started again on another port; a job that fails for another reason is
not started again."""

from __future__ import annotations

import os
import shutil
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from . import rank_server

pytestmark = pytest.mark.proc  # the ranks are forked from this process


@pytest.fixture
def held_port() -> Iterator[int]:
    """A loopback port another process of the machine listens on."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def first_drawn(monkeypatch: pytest.MonkeyPatch, port: int) -> None:
    """The first port the rank server draws is ``port``, as if another process took it after
    it was drawn; the next ones are free."""
    drawn = iter([port])
    real = rank_server.free_port
    monkeypatch.setattr(rank_server, "free_port", lambda: next(drawn, None) or real())


def listening_rank(attempts: Path) -> Callable[[int, int, int, list[str]], int]:
    """A rank as torch's process group starts one: rank 0 listens on the job's port (an
    ``OSError`` "Address already in use" where it is taken) and notes each attempt."""

    def run_rank(rank: int, world: int, port: int, argv: list[str]) -> int:
        if rank == 0:
            with attempts.open("a") as noted:
                noted.write(f"{port}\n")
            with socket.socket() as server:
                server.bind(("127.0.0.1", port))
                server.listen()
                print(f"listening on {port}", file=sys.stderr)
        return 0

    return run_rank


def stderr_of(errors: str, rank: int) -> str:
    return Path(errors, str(rank)).read_text()


def test_a_job_whose_port_was_taken_is_started_again_on_another_port(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, held_port: int
) -> None:
    first_drawn(monkeypatch, held_port)
    attempts = tmp_path / "attempts"
    codes, errors = rank_server.run_job(listening_rank(attempts), 2, [])
    try:
        assert codes == {0: 0, 1: 0}
        first, second = [int(p) for p in attempts.read_text().split()]
        assert first == held_port
        assert second != held_port
        assert stderr_of(errors, 0) == f"listening on {second}\n"
        # The failed attempt's stderr files are gone with it: only this job's folder is left.
        left = [p for p in os.listdir(os.path.dirname(errors)) if p.startswith("ranks-stderr-")]
        assert left == [os.path.basename(errors)]
    finally:
        shutil.rmtree(errors, ignore_errors=True)


def test_a_job_that_fails_for_another_reason_runs_once_and_its_traceback_is_kept(
    tmp_path: Path,
) -> None:
    attempts = tmp_path / "attempts"

    def run_rank(rank: int, world: int, port: int, argv: list[str]) -> int:
        if rank == 0:
            with attempts.open("a") as noted:
                noted.write(f"{port}\n")
            raise ValueError("the rank's own mistake")
        return 0

    codes, errors = rank_server.run_job(run_rank, 2, [])
    try:
        assert codes == {0: 1, 1: 0}
        assert len(attempts.read_text().split()) == 1
        assert "ValueError: the rank's own mistake" in stderr_of(errors, 0)
    finally:
        shutil.rmtree(errors, ignore_errors=True)
