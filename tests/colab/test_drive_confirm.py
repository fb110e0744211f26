"""Confirmation by Google Drive itself. ``ckpt.wait(durable=True)`` returns only once Drive
holds the newest checkpoint, and says so; past its timeout it raises instead of pretending.
``%%nbresume once`` records a cell only once Drive holds its marker."""

from __future__ import annotations

import json

from .conftest import Colab

SCRIPT = """
import json, sys
import numpy as np
from colab.child import RUN_PARTS, cloud, mount
import nbresume

def landed(step):
    # What the cloud holds, seen directly: the manifest and every file it names, same size.
    god = cloud()
    for run in god.find("/".join(RUN_PARTS)):
        for folder in god.children(run.id, trashed=False):
            if folder.is_folder and folder.name.isdigit() and int(folder.name) == step:
                files = {{i.name: i for i in god.children(folder.id, trashed=False)}}
                if "manifest.json" not in files:
                    return False
                try:
                    listed = json.loads(god.read(files["manifest.json"]))["files"]
                except (ValueError, KeyError):  # the manifest is still uploading
                    return False
                return all(
                    n in files and len(god.read(files[n])) == e["size"] for n, e in listed.items()
                )
    return False

class Weights:
    def __init__(self):
        self.w = np.zeros(20_000, dtype=np.float32)
    def state_dict(self):
        return {{"w": self.w}}
    def load_state_dict(self, state):
        self.w = state["w"]

folder = mount().joinpath(*RUN_PARTS)
weights = Weights()
ckpt = nbresume.Checkpointer(str(folder), every=None, deadline=None, async_save=False,
                             quiet=True, weights=weights)
weights.w += 1
ckpt.save(3)
record = {{"landed_before": landed(3)}}
try:
    confirmed = ckpt.wait(durable=True, timeout={timeout})
    record.update(confirmed=str(confirmed), step=confirmed.step)
except nbresume.CheckpointError as exc:
    record.update(error=str(exc), where=exc.where)
record["landed_after"] = landed(3)
print(json.dumps(record), flush=True)
"""


def _run(colab: Colab, script: str, *, lag: float, timeout: float) -> dict[str, object]:
    """Run ``script`` (with its ``{timeout}``) on a VM; the record it printed last."""
    proc = colab.start_script(script.format(timeout=timeout), vm="vm1", lag=lag)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, stdout.decode()
    result: dict[str, object] = json.loads(stdout.decode().strip().splitlines()[-1])
    return result


def test_wait_durable_returns_once_drive_holds_the_checkpoint_and_says_so(colab: Colab) -> None:
    seen = _run(colab, SCRIPT, lag=2.0, timeout=60)
    assert seen["landed_before"] is False  # the upload lags: a plain save is not on Drive yet
    assert seen["step"] == 3
    assert "Google Drive reports all" in str(seen["confirmed"])
    assert str(seen["confirmed"]).endswith("with the manifest's size and MD5")
    assert seen["landed_after"] is True  # when it returned, the cloud really had it


def test_wait_durable_past_its_timeout_raises_with_what_drive_reported(colab: Colab) -> None:
    seen = _run(colab, SCRIPT, lag=600, timeout=1)  # nothing uploads during the test
    assert "not confirmed by the storage" in str(seen["error"])
    assert str(seen["where"]).endswith("000000000003")
    assert seen["landed_after"] is False


ONCE = """
import json, sys
from colab.child import RUN_PARTS, mount
from nbresume.errors import StorageError
from nbresume.notebook import once

root = str(mount().joinpath(*RUN_PARTS))
record = {{}}
try:
    once.write_marker(root, "prepare", {{"seconds": 1.0}}, confirm_s={timeout})
    record["recorded"] = True
except StorageError as exc:
    record.update(recorded=False, error=str(exc))
record["read_back"] = once.read_marker(root, "prepare") is not None
print(json.dumps(record), flush=True)
"""


def test_once_on_drive_records_a_cell_when_drive_has_the_marker(colab: Colab) -> None:
    seen = _run(colab, ONCE, lag=1.0, timeout=60)
    assert seen == {"recorded": True, "read_back": True}


def test_once_on_drive_does_not_record_a_cell_drive_never_confirmed(colab: Colab) -> None:
    seen = _run(colab, ONCE, lag=600, timeout=1)  # nothing uploads during the test
    assert seen["recorded"] is False
    assert "Google Drive did not confirm" in str(seen["error"])
    assert seen["read_back"] is False  # the next "Run all" runs the cell again
