"""One training run hopping through one bucket URL: the docs' hop_train.py in one process, then
in two (torchrun, gloo on CPU), then in one again, each leg continuing from the newest
checkpoint the bucket confirms; it ends with the same weights as the same legs on a local
folder."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.paths import ROOT

from .conftest import URL
from .standin import HubStandIn

SCRIPT = ROOT / "docs" / "examples" / "hop_train.py"
FINAL = re.compile(r"stopped at step (\d+) \((.+?)\); weights ([0-9a-f]{16})")
#: Where the first two legs' sessions end (a save, then the loop stops); the third finishes.
LEGS = [(1, "8"), (2, "16"), (1, "")]


def journey(location: str, tmp: Path) -> list[tuple[int, str, str]]:
    finals = []
    for processes, stop in LEGS:
        env = {k: v for k, v in os.environ.items() if not k.startswith("NBRESUME_")}
        env.update(NBRESUME_HOME=str(tmp / "home"), TMPDIR=str(tmp), OMP_NUM_THREADS="1")
        if stop:
            env["NBRESUME_STOP_AT_STEP"] = stop
        if processes == 1:
            argv = [sys.executable, str(SCRIPT), location]
        else:
            torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
            assert torchrun is not None
            argv = [torchrun, "--standalone", f"--nproc_per_node={processes}", str(SCRIPT),
                    location]  # fmt: skip
        done = subprocess.run(argv, env=env, cwd=tmp, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        found = FINAL.findall(done.stdout)
        assert found, done.stdout + done.stderr
        step, state, weights = found[-1]
        finals.append((int(step), state, weights))
    return finals


@pytest.mark.slow
def test_bucket_hop_one_then_two_processes_then_one_ends_as_on_a_local_folder(
    hub: HubStandIn, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    (tmp_path / "bucket-leg").mkdir()
    (tmp_path / "local-leg").mkdir()
    through_bucket = journey(URL, tmp_path / "bucket-leg")
    on_a_folder = journey(str(tmp_path / "local-leg" / "run"), tmp_path / "local-leg")
    assert [step for step, _, _ in through_bucket] == [8, 16, 24]
    assert through_bucket == on_a_folder
