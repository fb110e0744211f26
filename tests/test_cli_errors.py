"""The ``nbresume`` command never answers a problem in the user's world with a traceback.

Each case runs the command in a process of its own (forked from the suite's warm server,
testkit.warmfork) and expects exactly one line on stderr,
``nbresume COMMAND: error: ... Fix: ...``, nothing on stdout, and exit status 1: an unknown URL
scheme, a file system package that is not installed, S3 without credentials or without a
reachable endpoint, a missing folder, a file where a folder is expected, a folder the user may
not write to, and a checkpoint that another process deletes while ``prune`` works.

No test reaches a real cloud service: S3 is pointed at a closed port on loopback.
"""

from __future__ import annotations

import ctypes
import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from nbresume import CheckpointStore
from nbresume.checkpoint.format import step_dirname
from testkit import warmfork
from testkit.cli import nbresume_argv, run_command
from testkit.ports import free_port

#: Every command that takes a checkpoint folder, with the arguments it needs besides it.
FOLDER_COMMANDS = {
    "ls": [],
    "verify": [],
    "prune": ["--keep", "1"],
    "status": [],
    "pull": ["DST"],
}


def argv_for(command: str, folder: str, tmp_path: Path) -> list[str]:
    extra = [str(tmp_path / "pulled") if a == "DST" else a for a in FOLDER_COMMANDS[command]]
    return [command, folder, *extra]


def assert_one_error_line(proc: subprocess.CompletedProcess[str], command: str) -> str:
    """The one error line (checked: exit 1, nothing else printed, no traceback, a fix)."""
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    [line] = lines
    assert line.startswith(f"nbresume {command}: error: ")
    assert "Fix: " in line
    return line


@pytest.fixture
def three(tmp_path: Path) -> Path:
    """A folder with the checkpoints of steps 100, 200, 300."""
    folder = tmp_path / "ckpt"
    store = CheckpointStore(folder, keep=None)
    for step in (100, 200, 300):
        store.save(step, tensors={"model": {"w": torch.full((16,), float(step))}})
    return folder


# -- the folder argument ------------------------------------------------------------------------


@pytest.mark.parametrize("command", FOLDER_COMMANDS)
def test_an_unknown_url_scheme(command: str, tmp_path: Path) -> None:
    proc = run_command(*argv_for(command, "nosuchscheme://bucket/run", tmp_path))
    line = assert_one_error_line(proc, command)
    assert "unknown URL scheme nosuchscheme://" in line


@pytest.mark.parametrize("command", FOLDER_COMMANDS)
def test_a_missing_folder(command: str, tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "folder"
    proc = run_command(*argv_for(command, str(missing), tmp_path))
    line = assert_one_error_line(proc, command)
    assert f"{missing}: no such folder" in line
    assert not missing.exists()  # nothing was created on the way


@pytest.mark.parametrize("command", FOLDER_COMMANDS)
def test_a_file_where_a_folder_is_expected(command: str, tmp_path: Path) -> None:
    weights = tmp_path / "weights.pt"
    weights.write_bytes(b"not a folder")
    proc = run_command(*argv_for(command, str(weights), tmp_path))
    line = assert_one_error_line(proc, command)
    assert f"{weights}: this is a file, not a folder" in line


# -- object stores ------------------------------------------------------------------------------

#: Run the command in a Python where the given packages cannot be imported, as on a machine
#: where they were never installed.
WITHOUT_PACKAGES = textwrap.dedent(
    """
    import sys
    for name in sys.argv[1].split(","):
        sys.modules[name] = None  # `import name` now raises ImportError
    from nbresume.cli import main
    sys.exit(main(sys.argv[2:]))
    """
)


@pytest.mark.parametrize(
    ("url", "package", "install"),
    [
        ("s3://bucket/run", "s3fs", 'pip install "nbresume[s3]"'),
        ("gs://bucket/run", "gcsfs", "pip install gcsfs"),
    ],
)
@pytest.mark.parametrize("command", FOLDER_COMMANDS)
def test_a_file_system_package_that_is_not_installed(
    command: str, url: str, package: str, install: str, tmp_path: Path
) -> None:
    proc = warmfork.run(
        [sys.executable, "-c", WITHOUT_PACKAGES, package, *argv_for(command, url, tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = assert_one_error_line(proc, command)
    assert f"need the package {package}, which is not installed" in line
    assert line.endswith(f"Fix: {install}")


@pytest.fixture
def s3_env(tmp_path: Path) -> dict[str, str]:
    """An environment without any AWS credentials, S3 pointed at a closed loopback port, and
    the instance metadata service (another place credentials come from) turned off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}",
        AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE=str(tmp_path / "no-aws-config"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-aws-credentials"),
        AWS_DEFAULT_REGION="us-east-1",
        AWS_MAX_ATTEMPTS="1",
        HOME=str(tmp_path / "home"),
    )
    return env


@pytest.mark.parametrize("command", FOLDER_COMMANDS)
def test_s3_without_credentials(command: str, s3_env: dict[str, str], tmp_path: Path) -> None:
    pytest.importorskip("s3fs")
    proc = run_command(*argv_for(command, "s3://bucket/run", tmp_path), env=s3_env)
    line = assert_one_error_line(proc, command)
    assert "no S3 credentials found" in line
    assert "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in line
    assert not (tmp_path / "pulled").exists()  # pull created nothing


def test_s3_endpoint_that_cannot_be_reached(s3_env: dict[str, str], tmp_path: Path) -> None:
    pytest.importorskip("s3fs")
    s3_env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    proc = run_command("ls", "s3://bucket/run", env=s3_env)
    line = assert_one_error_line(proc, "ls")
    assert "cannot reach the S3 endpoint" in line
    assert s3_env["AWS_ENDPOINT_URL"] in line


# -- prune: a folder it may not change, a checkpoint deleted under it ---------------------------


def without_override() -> None:
    """In the child, before it runs the command: root loses the capabilities that ignore file
    permissions, so it meets them as any user does (a no-op for other users)."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    pr_capbset_drop, cap_dac_override, cap_fowner = 24, 1, 3
    for cap in (cap_dac_override, cap_fowner):
        if libc.prctl(pr_capbset_drop, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.fixture
def read_only(three: Path) -> Iterator[Path]:
    """``three``, its folder made read-only (its checkpoints can be read, not deleted)."""
    mode = stat.S_IMODE(three.stat().st_mode)
    three.chmod(mode & ~0o222)
    yield three
    three.chmod(mode)


def test_prune_on_a_folder_it_may_not_change(read_only: Path) -> None:
    probe = subprocess.run(["true"], preexec_fn=without_override, capture_output=True)
    if probe.returncode != 0:
        pytest.skip("cannot drop root's capabilities here")
    before = sorted(os.listdir(read_only))
    # A real process: what it drops before it starts needs preexec_fn, which a fork from the
    # warm server cannot take.
    proc = subprocess.run(
        nbresume_argv("prune", str(read_only), "--keep", "1"),
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=without_override,
    )
    line = assert_one_error_line(proc, "prune")
    assert "permission denied" in line
    assert str(read_only) in line
    assert "needs write access" in line
    assert sorted(os.listdir(read_only)) == before


#: ``nbresume prune`` in a process where, just as prune withdraws its first checkpoint, another
#: process (``rm -rf``) deletes that very checkpoint first, as a running training's own
#: retention does. Python's audit hook sees the rename that withdraws it.
PRUNE_RACING_A_DELETE = textwrap.dedent(
    """
    import os, subprocess, sys
    from nbresume.cli import main

    folder = sys.argv[1]
    raced = []

    def hook(event, args):
        if event != "os.rename" or raced:
            return
        source = os.fsdecode(args[0])
        if os.path.dirname(source) == folder and os.path.basename(source).isdigit():
            raced.append(source)
            subprocess.run(["rm", "-rf", source], check=True)

    sys.addaudithook(hook)
    code = main(["prune", folder, "--keep", "1"])
    print("raced" if raced else "no race", flush=True)
    sys.exit(code)
    """
)


def test_prune_when_another_process_deletes_a_checkpoint_first(three: Path) -> None:
    proc = warmfork.run(
        [sys.executable, "-c", PRUNE_RACING_A_DELETE, str(three)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.stdout == "raced\n", proc.stdout + proc.stderr
    proc.stdout = ""
    line = assert_one_error_line(proc, "prune")
    assert "a checkpoint disappeared while it was being pruned" in line
    assert str(three / step_dirname(100)) in line
    assert "run `nbresume prune` again" in line
    # Only the raced checkpoint is gone; the newest is kept, the other waits for the next prune.
    assert sorted(os.listdir(three)) == [step_dirname(200), step_dirname(300)]
