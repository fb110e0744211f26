"""A restore fits where the save fitted: it takes the state and a few small buffers, never a
second copy of the state.

The saved bytes are read into the model's own parameters and the optimizer's own state
(once every file is verified), and an optimizer without state yet gets its state allocated
once. Each run is a child process (``restore_memory_child.py``: forked from the warm server,
or a new interpreter where it joins a cgroup) whose peak resident memory (``VmHWM``) beyond
what its imports took is measured (a 256 MiB restore took 266 MiB in a new process, 269 in a
forked one); the slow tests run a 1.5 GB state's save and restore inside a real 2.5 GiB
limit, a memory cgroup and ``RLIMIT_AS``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.test_memory_limit import fresh_cgroup, oom_kills

from nbresume import CheckpointStore
from testkit import warmfork

CHILD = Path(__file__).with_name("restore_memory_child.py")
MB = 1 << 20
GIB = 1 << 30
#: What a restore may take beyond the state: a quarter of it, or 64 MiB for a small one.
MARGIN = 0.25

#: Every test runs children that build and write hundreds of MB (the slowest, gigabytes).
pytestmark = pytest.mark.slow


def run(
    action: str, run_dir: Path, state_mb: int, limit: str = "", *, fails: bool = False
) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBRESUME_")}
    # A child that joins a cgroup must be new: it moves itself in before it imports anything,
    # so that what the imports take counts against the limit. Others fork from the warm
    # server (their base and peak are their own, measured from after the fork).
    start = subprocess.run if limit.startswith("cgroup:") else warmfork.run
    result = start(
        [sys.executable, str(CHILD), action, str(run_dir), str(state_mb), limit],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    output = result.stdout[-2000:] + result.stderr[-4000:]
    assert result.returncode == (3 if fails else 0), f"{action}: exit {result.returncode}\n{output}"
    report: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return report


def assert_restored_in_bounded_memory(saved: dict[str, Any], restored: dict[str, Any]) -> None:
    assert restored["step"] == 1
    assert restored["digests"] == saved["digests"]
    state = restored["state_bytes"]
    taken = restored["peak"] - restored["base"]
    assert taken <= state + max(MARGIN * state, 64 * MB), (
        f"the restore took {taken / MB:.0f} MiB for a state of {state / MB:.0f} MiB"
    )


def test_a_restore_takes_the_state_and_a_small_buffer_not_twice_the_state(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    saved = run("save", run_dir, 256)
    restored = run("restore", run_dir, 256)
    assert_restored_in_bounded_memory(saved, restored)


# -- a 1.5 GB state inside a real limit of 2.5 GiB ---------------------------------------------

STATE_MB = 1536
LIMIT = 5 * GIB // 2


@pytest.fixture
def limited_cgroup() -> Iterator[tuple[Path, str]]:
    """A fresh memory cgroup limited to :data:`LIMIT` without swap, removed afterwards."""
    with fresh_cgroup() as (folder, version):
        if version == "1":
            (folder / "memory.limit_in_bytes").write_text(str(LIMIT))
            swap = folder / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(str(LIMIT))
        else:
            (folder / "memory.max").write_text(str(LIMIT))
            if (folder / "memory.swap.max").exists():
                (folder / "memory.swap.max").write_text("0")
        yield folder, version


def test_a_large_state_saves_and_restores_inside_a_memory_cgroup(
    limited_cgroup: tuple[Path, str], tmp_path: Path
) -> None:
    folder, version = limited_cgroup
    run_dir = tmp_path / "run"
    saved = run("save", run_dir, STATE_MB, f"cgroup:{folder}")
    restored = run("restore", run_dir, STATE_MB, f"cgroup:{folder}")
    assert oom_kills(folder, version) == 0
    assert_restored_in_bounded_memory(saved, restored)
    assert CheckpointStore(run_dir).verify().ok


def test_a_large_state_saves_and_restores_inside_an_address_space_limit(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    saved = run("save", run_dir, STATE_MB, f"as:{LIMIT}")
    restored = run("restore", run_dir, STATE_MB, f"as:{LIMIT}")
    assert_restored_in_bounded_memory(saved, restored)
    assert CheckpointStore(run_dir).verify().ok


# -- an address-space limit (ulimit -v) ---------------------------------------------------------


def test_an_async_save_under_an_address_space_limit_is_written_from_the_live_tensors(
    tmp_path: Path,
) -> None:
    # 256 MiB of state and 192 MiB of address space left once it is built: a copy for the
    # background write cannot be mapped. The limit is seen (it bounds the memory a save may
    # take, as a cgroup's does): the save is written from the live tensors, and says why.
    run_dir = tmp_path / "run"
    saved = run("save", run_dir, 256, f"as:{448 * MB}")
    assert saved["step"] == 1
    told = [w for w in saved["warnings"] if "copying it into host memory would take" in w]
    assert len(told) == 1, saved["warnings"]
    assert "address-space limit (ulimit -v)" in told[0]
    assert CheckpointStore(run_dir).verify().ok


def test_a_restore_out_of_memory_says_memory_and_verify_finds_the_checkpoint_fine(
    tmp_path: Path,
) -> None:
    # The model (128 MiB) fits in the limit, its optimizer's state (128 MiB more) does not.
    run_dir = tmp_path / "run"
    saved = run("save", run_dir, 256)
    failed = run("restore", run_dir, 256, f"as:{256 * MB}", fails=True)
    assert failed["error"] == "MemoryLimitError", failed
    assert "out of memory while reading the checkpoint" in failed["message"]
    assert "address-space limit (ulimit -v)" in failed["message"]
    assert "ulimit -v unlimited" in failed["message"]
    assert "verif" not in failed["message"].split(".")[0]  # not "no checkpoint verifies"
    assert CheckpointStore(run_dir).verify().ok
    # With the memory there, the same checkpoint restores.
    restored = run("restore", run_dir, 256)
    assert restored["digests"] == saved["digests"]
