"""Memory and CPU as the container's cgroup says, from cgroup files laid out as the kernel
writes them (v2 unified tree, and the v1 per-controller trees)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import nbresume
from nbresume.platforms.cgroup import read_cpu, read_memory

GB = 1024**3


@pytest.fixture
def cgroup(clean_platform: Path) -> Path:
    return clean_platform / "cgroup"


def _write(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


def _events(oom_kill: int) -> str:
    return f"low 0\nhigh 0\nmax 12\noom {oom_kill}\noom_kill {oom_kill}\noom_group_kill 0\n"


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0))


# -- memory ----------------------------------------------------------------------------------


def test_v2_limit_and_use_are_reported(cgroup: Path) -> None:
    _write(
        cgroup,
        {
            "memory.max": f"{16 * GB}\n",
            "memory.current": f"{3 * GB}\n",
            "memory.events": _events(0),
        },
    )
    facts = read_memory()
    assert (facts.limit, facts.current, facts.oom_kills) == (16 * GB, 3 * GB, 0)
    check = nbresume.preflight()["memory"]
    assert check.status == "ok"
    assert "limit 17.2 GB" in check.seen  # 16 GiB in the decimal units of disk tools
    assert "no OOM kills" in check.seen


def test_v2_oom_kills_are_a_warning_that_explains_a_bare_killed(cgroup: Path) -> None:
    _write(cgroup, {"memory.max": f"{8 * GB}\n", "memory.events": _events(3)})
    check = nbresume.preflight()["memory"]
    assert check.status == "warn"
    assert "killed 3 process(es)" in check.seen
    assert "num_workers" in check.fix
    assert "137" in check.fix


def test_v2_without_a_limit(cgroup: Path) -> None:
    _write(cgroup, {"memory.max": "max\n", "memory.events": _events(0)})
    assert read_memory().limit is None
    check = nbresume.preflight()["memory"]
    assert check.status == "ok"
    assert check.seen.startswith("no container limit")


def test_v2_memory_nearly_full_is_a_warning(cgroup: Path) -> None:
    _write(
        cgroup,
        {"memory.max": f"{4 * GB}\n", "memory.current": f"{4 * GB - 1000}\n", "memory.events": ""},
    )
    check = nbresume.preflight()["memory"]
    assert check.status == "warn"
    assert "90%" in check.seen


def test_v1_limit_and_oom_kills(cgroup: Path) -> None:
    _write(
        cgroup / "memory",
        {
            "memory.limit_in_bytes": f"{2 * GB}\n",
            "memory.usage_in_bytes": f"{GB}\n",
            "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n",
        },
    )
    facts = read_memory()
    assert (facts.limit, facts.current, facts.oom_kills) == (2 * GB, GB, 1)
    assert nbresume.preflight()["memory"].status == "warn"


def test_v1_unlimited_is_no_limit(cgroup: Path) -> None:
    _write(cgroup / "memory", {"memory.limit_in_bytes": "9223372036854771712\n"})
    assert read_memory().limit is None


# -- CPU ---------------------------------------------------------------------------------------


def test_v2_quota_below_the_cores_warns_and_offers_cap_threads(
    cgroup: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if _usable_cores() < 2:
        pytest.skip("needs a machine with at least 2 cores to oversubscribe")
    _write(cgroup, {"cpu.max": "50000 100000\n"})  # half a CPU
    facts = read_cpu()
    assert facts.quota == 0.5
    assert facts.usable == 1
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        monkeypatch.setenv(name, "")  # so that what cap_threads sets is undone after the test
        monkeypatch.delenv(name)
    try:
        if torch is not None:
            # As a fresh process has it (an earlier test of this worker may have left one).
            torch.set_num_threads(2)
        check = nbresume.preflight()["cpu"]
        assert check.status == "warn"
        assert "quota 0.5 CPUs" in check.seen
        assert "nbresume.cap_threads()" in check.fix

        assert nbresume.cap_threads() == 1
        assert os.environ["OMP_NUM_THREADS"] == "1"
        assert os.environ["MKL_NUM_THREADS"] == "1"
        if torch is not None:
            assert torch.get_num_threads() == 1
        # With the pools capped, the check passes.
        assert nbresume.preflight()["cpu"].status == "ok"
    finally:
        if torch is not None and before is not None:
            torch.set_num_threads(before)


def test_v2_no_quota(cgroup: Path) -> None:
    _write(cgroup, {"cpu.max": "max 100000\n"})
    facts = read_cpu()
    assert facts.quota is None
    assert facts.usable == _usable_cores()
    check = nbresume.preflight()["cpu"]
    assert "no CPU quota" in check.seen


def test_v2_quota_above_the_cores_is_bounded_by_the_cores(cgroup: Path) -> None:
    _write(cgroup, {"cpu.max": f"{(_usable_cores() + 4) * 100000} 100000\n"})
    assert read_cpu().usable == _usable_cores()


def test_v1_quota(cgroup: Path) -> None:
    _write(cgroup / "cpu", {"cpu.cfs_quota_us": "150000\n", "cpu.cfs_period_us": "100000\n"})
    facts = read_cpu()
    assert facts.quota == 1.5
    assert facts.usable == 1


def test_v1_minus_one_is_no_quota(cgroup: Path) -> None:
    _write(cgroup / "cpu", {"cpu.cfs_quota_us": "-1\n", "cpu.cfs_period_us": "100000\n"})
    assert read_cpu().quota is None


def test_cap_threads_refuses_zero() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        nbresume.cap_threads(0)
