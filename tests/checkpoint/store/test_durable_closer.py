"""Files made durable in worker threads (``DurableCloser``): an interrupt that arrives while a
file is being handed to the workers never leaves the save waiting forever for it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import IO

import pytest

from nbresume.checkpoint.backends.local import LocalStore
from nbresume.checkpoint.store import hashing


class SlowStore(LocalStore):
    """A local folder whose fsync takes until ``release`` is set, as on a slow disk."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.release = threading.Event()
        self.durable: list[str] = []

    def close_durably(self, handle: IO[bytes]) -> None:
        self.release.wait(30)
        super().close_durably(handle)
        self.durable.append(Path(handle.name).name)


def opened(tmp_path: Path, name: str) -> IO[bytes]:
    handle = (tmp_path / name).open("wb")
    handle.write(b"x" * 100)
    return handle


def test_an_interrupt_while_a_file_is_handed_over_leaves_abandon_waiting_for_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = SlowStore(tmp_path)
    store.release.set()
    closer = hashing.DurableCloser(store, threaded=True)
    first = opened(tmp_path, "a")
    closer.close(first)

    def interrupted(job: object) -> bool:
        raise KeyboardInterrupt  # Ctrl-C before the file reached the workers' queue

    monkeypatch.setattr(hashing._WORKERS, "submit", interrupted)
    second = opened(tmp_path, "b")
    with pytest.raises(KeyboardInterrupt):
        closer.close(second)

    finished = threading.Event()
    waiter = threading.Thread(target=lambda: (closer.abandon(), finished.set()), daemon=True)
    waiter.start()
    assert finished.wait(10), "abandon() waits for a file no worker will ever take"
    assert first.closed
    assert second.closed


def test_abandon_waits_for_the_file_a_worker_is_making_durable(tmp_path: Path) -> None:
    store = SlowStore(tmp_path)
    closer = hashing.DurableCloser(store, threaded=True)
    handle = opened(tmp_path, "a")
    closer.close(handle)

    finished = threading.Event()
    waiter = threading.Thread(target=lambda: (closer.abandon(), finished.set()), daemon=True)
    waiter.start()
    # Either the worker has it (abandon waits for its fsync) or abandon closed it first.
    if not finished.wait(0.5):
        assert not handle.closed
        store.release.set()
        assert finished.wait(10)
        assert store.durable == ["a"]
    assert handle.closed
    store.release.set()


def test_finish_makes_every_file_durable_and_raises_the_first_failure(tmp_path: Path) -> None:
    store = SlowStore(tmp_path)
    store.release.set()
    closer = hashing.DurableCloser(store, threaded=True)
    handles = [opened(tmp_path, name) for name in "abcd"]
    for handle in handles:
        closer.close(handle)
    closer.finish()
    assert sorted(store.durable) == list("abcd")
    assert all(handle.closed for handle in handles)

    broken = hashing.DurableCloser(store, threaded=True)
    bad = opened(tmp_path, "e")
    bad.close()  # fsync of a closed file fails
    broken.close(bad)
    with pytest.raises(ValueError, match="closed file"):
        broken.finish()
