"""nbresume on a simulated Colab: "saved" means Google Drive itself has it.

Every VM is a real process with the stand-in ``google.colab``; Google's side is a real HTTP
server asked through the real google-api-python-client. See ``conftest.py``.
"""

from __future__ import annotations

import time

import pytest

from .conftest import Colab, records, wait_until

RUN = ["nbresume", "x"]


def test_a_checkpoint_lost_with_the_vm_was_never_called_saved_and_the_run_resumes_from_drive(
    colab: Colab,
) -> None:
    # The same training, never interrupted, in a local folder (alongside, to save time).
    ref, ref_out = colab.start(
        "train", "--total", "300", "--every", "1000", "--local", str(colab.tmp / "ref"), vm="ref",
        lag=0,
    )  # fmt: skip
    # VM 1 trains and saves every 5 steps; uploads lag 1.5 s behind. It is killed the moment a
    # checkpoint has verified locally while an older one is already confirmed on Drive.
    proc, out = colab.start(
        "train", "--total", "300", "--every", "5", "--sleep", "0.03", vm="vm1", lag=1.5
    )

    def lost_one_pending() -> bool:
        seen = records(out)
        durable = [r["step"] for r in seen if r["kind"] == "durable"]
        syncing = [r for r in seen if r["kind"] == "syncing"]
        # The newest checkpoint was written well within the lag: it cannot have uploaded.
        return (
            bool(durable)
            and syncing[-1]["step"] > max(durable)
            and (time.time() - syncing[-1]["t"] < 0.5)
        )

    wait_until(lambda: lost_one_pending() or proc.poll() is not None, what="a durable checkpoint")
    assert proc.poll() is None, proc.communicate()[1].decode()
    colab.kill(proc)

    seen = records(out)
    assert {"kind": "store", "store": "DriveStore"}.items() <= seen[0].items()
    on_cloud = {s for s, ok in colab.cloud_landed(RUN).items() if ok}
    verified = {r["step"] for r in seen if r["kind"] == "verified"}
    syncing = {r["step"] for r in seen if r["kind"] == "syncing"}
    lost = {s for s in syncing if s > max(on_cloud)}
    assert lost, "the scenario needs a checkpoint that verified locally but never uploaded"
    assert lost <= verified  # verified where it was written: in the mount's local cache

    # The promise: nothing was reported saved that Drive did not have at that moment (or
    # that retention had deleted since, which it does only to checkpoints Drive confirmed).
    durable = [r for r in seen if r["kind"] == "durable"]
    assert durable
    assert all(r["cloud_has_it"] or r["deleted"] for r in durable), durable
    assert not {r["step"] for r in durable} & lost

    # A fresh VM (new process, new empty mount, same Drive) resumes from what really landed.
    vm2 = colab.run("train", "--total", "300", "--every", "100", vm="vm2", lag=0.2)
    resumed = next(r["step"] for r in vm2 if r["kind"] == "resumed")
    assert resumed == max(on_cloud)
    finished = next(r for r in vm2 if r["kind"] == "finished")
    assert finished["step"] == 300

    # ... and ends bit-identical to the run that was never interrupted.
    assert ref.wait(timeout=120) == 0, ref.communicate()[1].decode()
    reference = next(r for r in records(ref_out) if r["kind"] == "finished")
    assert reference["weights"] == finished["weights"]


def test_a_checkpoint_is_syncing_until_drive_reports_it_then_durable(colab: Colab) -> None:
    seen = colab.run("sync", lag=2.0)
    kinds = [r["kind"] for r in seen]
    assert kinds.index("verified") < kinds.index("syncing") < kinds.index("durable")
    after_save = next(r for r in seen if r["kind"] == "status_after_save")
    assert not after_save["cloud_has_it"]
    assert after_save["state"].split(":")[0] in ("missing", "syncing")
    # Every state reported before "durable" was a not-saved one, and "durable" came only when
    # the cloud really had every file.
    before = seen[: kinds.index("durable")]
    assert all(r["state"] != "saved" for r in before if r["kind"] == "syncing")
    assert next(r for r in seen if r["kind"] == "durable")["cloud_has_it"]
    assert next(r for r in seen if r["kind"] == "status_at_end")["state"] == "saved"


def test_flush_pushes_what_is_pending_and_reports_what_landed(colab: Colab) -> None:
    seen = colab.run("flush", lag=600)  # nothing would upload on its own during the test
    before = next(r for r in seen if r["kind"] == "before")
    assert not any(before["landed"].values())
    assert all(state.split(":")[0] in ("missing", "syncing") for state in before["states"].values())
    report = next(r for r in seen if r["kind"] == "report")
    assert report["error"] == ""
    assert report["saved"] == [1, 2]
    assert report["not_saved"] == []
    after = next(r for r in seen if r["kind"] == "after")
    assert after["landed"] == {"1": True, "2": True}
    assert after["mount"] == []  # flush_and_unmount leaves the mount point empty


# Room for one checkpoint (40 kB of floats) but not two.
@pytest.mark.parametrize("colab", [60_000], indirect=True)
def test_flush_that_cannot_finish_reports_which_checkpoints_did_not_land(colab: Colab) -> None:
    seen = colab.run("flush", "--floats", "10000", "--timeout-ms", "1000", lag=600)
    report = next(r for r in seen if r["kind"] == "report")
    assert report["error"] == "flush_and_unmount failed"
    assert report["saved"] == [1], report["text"]
    assert report["not_saved"] == [2], report["text"]
    assert next(r for r in seen if r["kind"] == "after")["landed"] == {"1": True, "2": False}


# Room for about six checkpoints of 400 kB: ten saves fit only if retention frees the quota.
QUOTA = 2_500_000


@pytest.mark.parametrize("colab", [QUOTA], indirect=True)
def test_retention_on_drive_gives_the_quota_back(colab: Colab) -> None:
    seen = colab.run("retention", "--saves", "10", "--floats", "100000", lag=0.2)
    assert seen[0]["store"] == "DriveStore"
    saves = [r for r in seen if r["kind"] == "saved"]
    assert [r["step"] for r in saves] == list(range(1, 11))
    assert all(r["landed"] for r in saves)
    assert all(r["trash"] == 0 for r in saves)
    end = next(r for r in seen if r["kind"] == "end")
    assert end["trash"] == 0
    on_cloud = sorted(int(s) for s, ok in end["on_cloud"].items() if ok)
    assert on_cloud == end["kept"]
    assert len(on_cloud) <= 3
    assert end["usage"] <= 3 * 410_000


@pytest.mark.parametrize("colab", [QUOTA], indirect=True)
def test_deleting_through_the_mount_alone_fills_drive_with_trash(colab: Colab) -> None:
    # The reason for the above: without the API, deleted checkpoints stay in the trash and
    # use the quota until Drive is full and new checkpoints never arrive.
    seen = colab.run(
        "retention", "--mode", "mount", "--saves", "10", "--floats", "100000", "--wait", "3",
        lag=0.2,
    )  # fmt: skip
    saves = [r for r in seen if r["kind"] == "saved"]
    assert saves[-1]["landed"] is False
    assert saves[-1]["trash"] > QUOTA // 2


def test_init_on_colab_mounts_drive_and_keeps_checkpoints_in_mydrive(colab: Colab) -> None:
    marker = colab.tmp / "hostname"
    marker.write_text("colab-vm\n")
    seen = colab.run("init", env={"NBRESUME_COLAB_MARKER": str(marker)})
    result = next(r for r in seen if r["kind"] == "init")
    mount = colab.tmp / "vm1" / "drive"
    assert result["platform"] == "colab"
    assert result["dir"] == str(mount / "MyDrive" / "nbresume" / "x") == result["again"]
    assert result["store"] == "DriveStore"
    assert result["landed"] == {"5": True}
    assert any(r["kind"] == "durable" and r["step"] == 5 for r in seen)


def test_a_plain_path_on_the_drive_mount_gets_drive_checks_without_init(colab: Colab) -> None:
    seen = colab.run("plain-path")
    result = next(r for r in seen if r["kind"] == "plain")
    assert result["drive_loaded_before"] is False
    assert result["store"] == "DriveStore"


def test_mount_failures_name_the_place_and_the_fix(colab: Colab) -> None:
    busy = colab.tmp / "busy"
    busy.mkdir()
    (busy / "leftover.txt").write_text("from an earlier mount")
    seen = colab.run("mount-errors", "--mountpoint", str(busy))
    errors = {r["mountpoint"]: r for r in seen if r["kind"] == "error"}
    assert "Mountpoint must not already contain files" in errors[str(busy)]["message"]
    assert "Disconnect and delete runtime" in errors[str(busy)]["fix"]
    assert "Mountpoint must not contain a space" in errors[f"{busy} with space"]["message"]
