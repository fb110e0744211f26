"""The stand-in itself: it behaves like Colab where nbresume's tests rely on it, and it can never
take the real ``google.colab``'s place."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .conftest import Colab, wait_until

IMPORT_BOTH = "import google.colab, colab_standin; print(google.colab.STANDIN)"


def python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("module", ["google.colab", "colab_standin"])
def test_the_stand_in_refuses_to_load_on_a_colab_runtime(
    colab: Colab, tmp_path: Path, module: str
) -> None:
    marker = tmp_path / "hostname"  # what /var/colab/hostname is on a Colab VM
    env = colab.env("vm1", lag=1.0, extra={"COLAB_STANDIN_MARKER": str(marker)})
    assert python(IMPORT_BOTH, env).stdout.strip() == "True"  # no marker: it loads
    marker.write_text("colab-vm\n")
    result = python(f"import {module}", env)
    assert result.returncode != 0
    assert "ImportError: this google.colab is nbresume's test stand-in" in result.stderr
    assert "pip uninstall nbresume-test-google-colab" in result.stderr


def test_a_vm_that_dies_loses_what_had_not_uploaded(colab: Colab) -> None:
    writer = colab.start_script(
        """
        import os, sys, time
        from google.colab import drive
        drive.mount(os.environ["NBRESUME_DRIVE_MOUNT"])
        mydrive = os.path.join(os.environ["NBRESUME_DRIVE_MOUNT"], "MyDrive")
        with open(os.path.join(mydrive, "early.txt"), "w") as f:
            f.write("uploaded")
        print("wrote early", flush=True)
        sys.stdin.readline()
        with open(os.path.join(mydrive, "late.txt"), "w") as f:
            f.write("still in the local cache")
        print("wrote late", flush=True)
        time.sleep(600)
        """,
        vm="vm1",
        lag=0.3,
    )
    assert writer.stdout is not None
    assert writer.stdin is not None
    assert writer.stdout.readline().startswith(b"Mounted at ")
    assert writer.stdout.readline().strip() == b"wrote early"

    def early_uploaded() -> bool:
        return any(colab.cloud.read(i) == b"uploaded" for i in colab.cloud.find("early.txt"))

    wait_until(early_uploaded, what="the upload of early.txt")
    writer.stdin.write(b"\n")
    writer.stdin.flush()
    assert writer.stdout.readline().strip() == b"wrote late"
    colab.kill(writer)  # well within the lag: late.txt is still only in the VM's cache

    fresh = python(
        """
        import json, os
        from google.colab import drive
        drive.mount(os.environ["NBRESUME_DRIVE_MOUNT"])
        mydrive = os.path.join(os.environ["NBRESUME_DRIVE_MOUNT"], "MyDrive")
        print(json.dumps({n: open(os.path.join(mydrive, n)).read() for n in os.listdir(mydrive)}))
        """,
        colab.env("vm2", lag=0.3),
    )
    assert fresh.returncode == 0, fresh.stderr
    seen = json.loads(fresh.stdout.splitlines()[-1])
    assert seen["early.txt"] == "uploaded"
    # An empty placeholder may have reached Drive (files show up empty before their content
    # does), but never the content.
    assert seen.get("late.txt", "") == ""
