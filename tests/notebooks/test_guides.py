"""The user guides say what the code does: the getting-started script runs and resumes as the
page shows, each platform guide covers every danger clock its platform reports, and every
environment variable nbresume reads is documented."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nbresume import knobs
from nbresume.checkpoint.store import CheckpointStore
from nbresume.platforms import by_name

from .conftest import ROOT

DOCS = ROOT / "docs"
EXAMPLE = DOCS / "examples" / "train.py"

#: Platform -> its guide.
GUIDES = {
    "colab": "platforms/colab.md",
    "kaggle": "platforms/kaggle.md",
    "kaggle-batch": "platforms/kaggle.md",
    "ssh": "platforms/ssh.md",
}


def table_names(page: Path) -> set[str]:
    """The first column of every table row on ``page``."""
    names = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        match = re.match(r"^\|\s*([^|]+?)\s*\|", line)
        if match:
            names.add(match.group(1).strip("`"))
    return names


@pytest.mark.parametrize("platform", sorted(GUIDES))
def test_each_platform_guide_explains_every_danger_clock(platform: str) -> None:
    clocks = {c.name for a in (True, False) for c in by_name(platform).danger_clocks(a)}
    documented = table_names(DOCS / GUIDES[platform])
    assert clocks <= documented, f"{GUIDES[platform]} lacks {sorted(clocks - documented)}"


def test_every_environment_variable_is_documented() -> None:
    documented = table_names(DOCS / "preflight.md")
    assert set(knobs.KNOBS) <= documented, sorted(set(knobs.KNOBS) - documented)


def test_the_getting_started_script_resumes_after_a_kill(
    tmp_path: Path,
) -> None:
    assert '--8<-- "docs/examples/train.py"' in (DOCS / "getting-started.md").read_text()
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        # its own temporary folder: torch makes torchinductor_<user> in it on import
        "TMPDIR": str(tmp_path),
        "NBRESUME_HOME": str(tmp_path / "home"),
        "NBRESUME_PROBE_HOST": "127.0.0.1",
        "NBRESUME_PROBE_PORT": "9",
        "NBRESUME_SESSION_START": str(time.time()),
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
    }
    folder = tmp_path / "home" / "getting-started"

    first = subprocess.Popen(
        [sys.executable, str(EXAMPLE)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not CheckpointStore(folder, keep=None).list():
            assert first.poll() is None, "the script ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within two minutes"
            time.sleep(0.01)
        first.kill()  # SIGKILL: no handler, no last save
        first.wait()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    saved = max(r.step for r in CheckpointStore(folder, keep=None).verify().results if r.ok)
    assert 0 < saved < 1000

    again = subprocess.run(
        [sys.executable, str(EXAMPLE)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[-2:] == [
        f"training from step {saved}",
        "finished: True at step 1000",
    ]
