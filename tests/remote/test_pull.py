"""``nbresume pull``: checkpoints come off a remote machine verified, and an interrupted pull
resumes.

The remote machine is OpenSSH's sshd on loopback, reached through a ``~/.ssh/config`` alias as
a user would reach a rented box; the pull runs as the ``nbresume`` command in a child process,
so that it can be killed, and so can the server under it.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from nbresume.checkpoint.format import step_dirname
from nbresume.checkpoint.store import LEASE_NAME, CheckpointStore, Holder
from nbresume.pull import PART_SUFFIX, SAFE_LINE, STAGING_PREFIX, STILL_WRITING
from testkit import warmfork
from testkit.cli import nbresume_argv, run_cli

from .conftest import (
    HANG_S,
    Job,
    SshServer,
    remote_run,
    train_argv,
    verified_steps,
    wait_until,
)

STEPS = [100, 200, 300]


def pull_env(server: SshServer, child_env: dict[str, str]) -> dict[str, str]:
    return {**child_env, "HOME": str(server.home)}


def run_pull(
    server: SshServer, child_env: dict[str, str], src: Path, dst: Path, *extra: str
) -> subprocess.CompletedProcess[str]:
    return warmfork.run(
        nbresume_argv("pull", *extra, server.url(src), str(dst)),
        env=pull_env(server, child_env),
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )


def same_files(a: Path, b: Path) -> bool:
    def digest(folder: Path) -> dict[str, str]:
        return {
            str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*"))
            if p.is_file()
        }

    return digest(a) == digest(b)


def interrupt_mid_file(
    server: SshServer, child_env: dict[str, str], src: Path, dst: Path, *, how: str
) -> subprocess.Popen[str]:
    """Start a rate-limited pull and, once the large file is partly copied, kill the pull
    (``how="kill"``) or the server with every connection (``how="drop"``)."""
    part = dst / f"{STAGING_PREFIX}{step_dirname(300)}" / f".model.safetensors{PART_SUFFIX}"
    pull = warmfork.popen(
        nbresume_argv("pull", "--limit-rate", "1M", server.url(src), str(dst)),
        env=pull_env(server, child_env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_until(
        lambda: (part.exists() and part.stat().st_size >= 1 << 20) or pull.poll() is not None,
        "a partly copied model file",
    )
    assert pull.poll() is None, "the pull ended before it could be interrupted"
    if how == "kill":
        pull.send_signal(signal.SIGKILL)
    else:
        server.stop()
    pull.wait(timeout=HANG_S)
    return pull


def test_a_pull_over_ssh_is_verified_and_a_second_pull_copies_nothing(
    sshd: SshServer, child_env: dict[str, str], tmp_path: Path
) -> None:
    src = tmp_path / "remote" / "run1"
    remote_run(src)
    dst = tmp_path / "local" / "run1"

    done = run_pull(sshd, child_env, src, dst)

    assert done.returncode == 0, done.stdout + done.stderr
    assert f"OK 3/3 verified in {dst}" in done.stdout
    assert SAFE_LINE in done.stdout
    assert same_files(src, dst)
    assert verified_steps(dst) == {100: True, 200: True, 300: True}
    loaded = CheckpointStore(dst).load(framework="numpy")
    assert loaded.step == 300
    assert loaded.data["state"] == {"step": 300}

    again = run_pull(sshd, child_env, src, dst)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count("already here, verified") == 3
    assert SAFE_LINE in again.stdout


@pytest.mark.parametrize("how", ["kill", "drop"], ids=["pull-killed", "connection-dropped"])
def test_an_interrupted_pull_resumes_mid_file_and_ends_verified(
    how: str, sshd: SshServer, child_env: dict[str, str], tmp_path: Path
) -> None:
    src = tmp_path / "remote" / "run1"
    remote_run(src)
    dst = tmp_path / "local"

    interrupted = interrupt_mid_file(sshd, child_env, src, dst, how=how)

    assert interrupted.stdout is not None
    said = interrupted.stdout.read()
    if how == "drop":
        assert interrupted.returncode == 1, said
        assert "INTERRUPTED" in said, said
        assert "Run the same command again" in said, said
        assert SAFE_LINE not in said
        sshd.start()  # the machine is reachable again
    # The large checkpoint is not a checkpoint locally until its manifest is there.
    assert not (dst / step_dirname(300) / "manifest.json").exists()
    assert verified_steps(dst) == {100: True, 200: True}

    resumed = run_pull(sshd, child_env, src, dst)

    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "model.safetensors continued at" in resumed.stdout, resumed.stdout
    assert SAFE_LINE in resumed.stdout
    assert same_files(src, dst)
    assert verified_steps(dst) == {100: True, 200: True, 300: True}


def test_a_corrupt_remote_file_is_named_and_nothing_is_called_safe(
    sshd: SshServer, child_env: dict[str, str], tmp_path: Path
) -> None:
    src = tmp_path / "remote"
    folders = remote_run(src, big=64 << 10)
    damaged = folders[200] / "model.safetensors"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit, same size: only the hash can tell
    damaged.write_bytes(bytes(data))
    dst = tmp_path / "local"

    done = run_pull(sshd, child_env, src, dst)

    assert done.returncode == 1, done.stdout + done.stderr
    assert f"{step_dirname(200)}/model.safetensors: xxh3-128 mismatch" in done.stdout
    assert "FAILED: 1 of 3" in done.stdout
    assert SAFE_LINE not in done.stdout
    assert verified_steps(dst) == {100: True, 300: True}
    assert not (dst / step_dirname(200) / "model.safetensors").exists()
    assert damaged.read_bytes() == bytes(data), "the pull wrote to the remote copy"


@pytest.mark.parametrize("via", ["local", "ssh"])
def test_a_job_still_training_is_never_called_safe_until_it_stopped(
    via: str,
    child_env: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    request: pytest.FixtureRequest,
) -> None:
    # A real training process, its Checkpointer between two saves: checkpoint 2 is committed
    # and the folder's writer lease held, while it waits for the test to let it go on.
    src = tmp_path / "remote" / "run1"
    job = Job(
        warmfork.popen(
            train_argv(src, 4, "--every", "2", "--hold-at", "2"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=child_env,
        )
    )
    dst = tmp_path / "local"

    def pull() -> tuple[int, str]:
        if via == "local":
            code, out, _ = run_cli(["pull", str(src), str(dst)], capsys)
            return code, out
        done = run_pull(request.getfixturevalue("sshd"), child_env, src, dst)
        return done.returncode, done.stdout + done.stderr

    try:
        job.wait_for_line("holding 2")
        code, out = pull()
    finally:
        assert job.proc.stdin is not None
        job.proc.stdin.write("go on\n")
        job.proc.stdin.close()

    assert code == STILL_WRITING, out
    assert "STILL TRAINING: 1/1 verified in" in out, out
    assert "newest step 2" in out
    assert f"a live writer holds the source's writer lease: pid {job.proc.pid} on host" in out
    assert "Pull again after it stops: the remote copy is NOT safe to tear down yet." in out
    assert SAFE_LINE not in out
    assert verified_steps(dst) == {2: True}  # what was there is pulled and verified all the same

    assert job.finish() == 0, job.output
    assert "done" in job.lines
    code, out = pull()

    assert code == 0, out
    assert f"OK 2/2 verified in {dst}" in out
    assert SAFE_LINE in out
    assert verified_steps(dst) == {2: True, 4: True}


def test_a_writer_on_another_machine_counts_until_its_lease_lapses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Over SSH the training machine's processes cannot be looked at: its lease's last renewal
    # says whether it still writes (it renews every 30 s; 180 s without one: gone).
    src = tmp_path / "remote"
    remote_run(src, big=64 << 10)
    now = time.time()

    def lease(renewed_ago: float) -> None:
        holder = Holder(
            token="0123456789abcdef",
            host="gpu-box-7",
            pid=4242,
            machine="another-boot/pid:[4026531836]",
            since=now - 3600,
            renewed=now - renewed_ago,
            program="train.py",
        )
        (src / LEASE_NAME).write_bytes(holder.to_bytes())

    lease(renewed_ago=20)
    code, out, _ = run_cli(["pull", str(src), str(tmp_path / "a")], capsys)
    assert code == STILL_WRITING, out
    assert "pid 4242 on host 'gpu-box-7' (train.py)" in out
    assert "renewed 20 s ago" in out
    assert "if it was killed, its lease lapses at" in out
    assert SAFE_LINE not in out

    lease(renewed_ago=600)  # killed without giving it back (a preemption): lapsed
    code, out, _ = run_cli(["pull", str(src), str(tmp_path / "b")], capsys)
    assert code == 0, out
    assert SAFE_LINE in out


def test_a_changed_host_key_is_refused(
    sshd: SshServer, child_env: dict[str, str], ssh_keys: Path, tmp_path: Path
) -> None:
    src = tmp_path / "remote"
    remote_run(src, big=64 << 10)
    other = (ssh_keys / "other_host_key.pub").read_text().split()
    known = sshd.home / ".ssh" / "known_hosts"
    known.write_text(f"[127.0.0.1]:{sshd.port} {other[0]} {other[1]}\n")
    dst = tmp_path / "local"

    done = run_pull(sshd, child_env, src, dst)

    assert done.returncode == 1
    assert "host key of 127.0.0.1 changed" in done.stderr
    assert "ssh-keygen -R" in done.stderr
    assert not any(dst.rglob("*.safetensors"))


def test_home_relative_paths_and_the_identity_option(
    sshd: SshServer, child_env: dict[str, str], ssh_keys: Path, tmp_path: Path
) -> None:
    # ssh://user@host:port/~/x is relative to the remote home (where SFTP starts), and -i
    # gives the key without any ~/.ssh/config.
    src = sshd.remote_home / "runs" / "x"
    remote_run(src, big=64 << 10)
    dst = tmp_path / "local"
    env = {**child_env, "HOME": str(tmp_path / "empty-home")}
    url = f"ssh://{sshd.user}@127.0.0.1:{sshd.port}/~/runs/x"

    done = warmfork.run(
        nbresume_argv("pull", "-i", str(ssh_keys / "user_key"), url, str(dst)),
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )

    assert done.returncode == 0, done.stdout + done.stderr
    assert SAFE_LINE in done.stdout
    assert same_files(src, dst)


# -- local and fsspec sources (no server needed) ------------------------------------------------


def test_only_committed_checkpoints_are_pulled_from_a_local_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "remote"
    remote_run(src, big=64 << 10)
    # A write that never committed (no manifest), as a killed writer on an object store
    # leaves it, and a hidden temporary folder: neither is a checkpoint.
    (src / step_dirname(400)).mkdir()
    (src / step_dirname(400) / "model.safetensors").write_bytes(b"half")
    (src / ".nbresume-tmp-000000000500-1-ab").mkdir()
    dst = tmp_path / "local"

    code, out, _ = run_cli(["pull", f"file://{src}", str(dst)], capsys)

    assert code == 0, out
    assert SAFE_LINE in out
    assert sorted(p.name for p in dst.iterdir()) == [step_dirname(s) for s in STEPS]
    assert verified_steps(dst) == {100: True, 200: True, 300: True}


def test_a_different_checkpoint_of_the_same_step_is_not_overwritten(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "remote"
    remote_run(src, big=64 << 10)
    dst = tmp_path / "local"
    import numpy as np

    CheckpointStore(dst).save(200, tensors={"model": {"w": np.ones(3, dtype=np.float32)}})
    before = (dst / step_dirname(200) / "model.safetensors").read_bytes()

    code, out, _ = run_cli(["pull", str(src), str(dst)], capsys)

    assert code == 1
    assert f"{dst / step_dirname(200)} holds a different checkpoint of step 200" in out
    assert SAFE_LINE not in out
    assert (dst / step_dirname(200) / "model.safetensors").read_bytes() == before


def test_nothing_to_pull_is_a_failure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    code, out, _ = run_cli(["pull", str(tmp_path / "empty"), str(tmp_path / "dst")], capsys)
    assert code == 1
    assert "no committed checkpoints" in out
    assert SAFE_LINE not in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["pull", "SRC"], "a destination folder is needed"),
        (["pull", "SRC", "s3://bucket/x"], "the destination must be a local folder"),
        (["pull", "SRC", "SRC"], "the source and the destination are the same folder"),
        (["pull", "--limit-rate", "fast", "SRC", "x"], "is not a rate"),
    ],
    ids=["no-dst", "remote-dst", "same-folder", "bad-rate"],
)
def test_usage_errors_exit_two(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "src").mkdir()
    argv = [str(tmp_path / "src") if a == "SRC" else a for a in argv]
    code, _, err = run_cli(argv, capsys)
    assert code == 2
    assert message in err


# -- a writer lease that is not a file: the error names it and the fix, at once ----------------


def odd_lease(folder: Path, kind: str) -> Path:
    """Make the source's writer lease ``kind``: a FIFO, a folder, or a link to an odd thing."""
    lease = folder / LEASE_NAME
    if kind == "fifo":
        os.mkfifo(lease)  # opened, it would wait for a writer forever
    elif kind == "folder":
        lease.mkdir()
    elif kind == "link-to-device":
        lease.symlink_to("/dev/zero")  # read, it never ends
    elif kind == "link-to-fifo":
        os.mkfifo(folder / "pipe")
        lease.symlink_to(folder / "pipe")
    else:
        lease.symlink_to(folder / "nowhere")
    return lease


def assert_named_with_the_fix(done: subprocess.CompletedProcess[str], lease: str) -> None:
    said = done.stdout + done.stderr
    assert done.returncode == 1, said
    assert "nbresume pull: error: cannot tell whether a training still writes in" in done.stderr
    assert lease in done.stderr
    assert f"rm {lease}" in done.stderr or f"mv {lease}" in done.stderr, said
    assert "then pull again" in done.stderr
    assert "INTERRUPTED" not in said  # not a dropped connection: running again changes nothing
    assert "Run the same command again" not in said
    assert SAFE_LINE not in said


ODD_LEASES = ["fifo", "folder", "link-to-device", "link-to-fifo", "dangling-link"]


@pytest.mark.parametrize("kind", ODD_LEASES)
def test_a_lease_that_is_not_a_file_is_named_with_the_fix(
    kind: str, tmp_path: Path, child_env: dict[str, str]
) -> None:
    src = tmp_path / "remote"
    remote_run(src, big=64 << 10)
    lease = odd_lease(src, kind)
    done = warmfork.run(
        nbresume_argv("pull", str(src), str(tmp_path / "dst")),
        env=child_env,
        capture_output=True,
        text=True,
        timeout=HANG_S,  # a FIFO opened for reading would wait here for ever
    )
    assert_named_with_the_fix(done, str(lease))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_an_unreadable_lease_is_named_with_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "remote"
    remote_run(src, big=64 << 10)
    (src / LEASE_NAME).write_bytes(b"{}")
    (src / LEASE_NAME).chmod(0)
    code, out, err = run_cli(["pull", str(src), str(tmp_path / "dst")], capsys)
    assert code == 1, out + err
    assert f"cannot read the writer lease {src / LEASE_NAME} (permission denied)" in err
    assert "chmod a+r" in err
    assert "INTERRUPTED" not in out + err


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_over_ssh_a_lease_that_is_not_a_file_is_named_at_once_never_waited_on(
    kind: str, sshd: SshServer, child_env: dict[str, str], tmp_path: Path
) -> None:
    src = tmp_path / "remote" / "run1"
    remote_run(src, big=64 << 10)
    lease = odd_lease(src, kind)
    done = warmfork.run(
        nbresume_argv("pull", sshd.url(src), str(tmp_path / "local")),
        env=pull_env(sshd, child_env),
        capture_output=True,
        text=True,
        timeout=60,  # the SFTP server that opens a FIFO waits for a writer, and the pull too
    )
    assert_named_with_the_fix(done, str(lease))
