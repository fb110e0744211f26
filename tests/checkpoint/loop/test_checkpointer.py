"""The Checkpointer in a training loop: restore, cadence, retention, async saves, plain values,
and what a checkpoint looks like to someone without nbresume."""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import nbresume
from nbresume import Checkpointer, CheckpointStore, Event
from nbresume.errors import CheckpointError, NoCheckpointError, UsageError
from testkit.stateful import QUIET, Counter


class Recorder:
    """A progress callback that keeps the events."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def __call__(self, event: Event) -> None:
        self.events.append(event)

    def steps(self, kind: str) -> list[int]:
        return [e.step for e in self.events if e.kind == kind]


def state_json(folder: Path, step: int) -> dict[str, Any]:
    """The checkpoint's state.json, read with plain json."""
    text = (folder / f"{step:012d}" / "state.json").read_text()
    document: dict[str, Any] = json.loads(text)
    return document


def steps_on_disk(folder: Path) -> list[int]:
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


# -- restore ----------------------------------------------------------------------------------


def test_restore_on_an_empty_folder_starts_at_zero_every_time(tmp_path: Path) -> None:
    counter = Counter()
    ckpt = Checkpointer(tmp_path / "run", counter=counter, **QUIET)
    assert ckpt.restore() == 0
    assert ckpt.restore() == 0
    assert not ckpt.done
    assert ckpt.latest() is None
    assert ckpt.list() == []


def test_restore_is_idempotent_after_loading(tmp_path: Path) -> None:
    first = Checkpointer(tmp_path / "run", counter=Counter(), **QUIET)
    first["counter"].count = 4
    first.save(step=4)

    counter = Counter()
    second = Checkpointer(tmp_path / "run", counter=counter, **QUIET)
    assert second.restore() == 4
    counter.count = 99  # the loop went on; restoring again must not rewind it
    assert second.restore() == 4
    assert counter.count == 99


def test_checkpoints_exist_but_none_verifies(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "run", counter=Counter(), **QUIET)
    ckpt.save(step=3)
    state = tmp_path / "run" / "000000000003" / "state.json"
    state.write_text(state.read_text().replace('"count": 0', '"count": 1'))

    fresh = Checkpointer(tmp_path / "run", counter=Counter(), **QUIET)
    with pytest.raises(NoCheckpointError, match="xxh3-128 mismatch"):
        fresh.restore()  # starting over would silently throw the run away


def test_a_corrupt_newest_checkpoint_falls_back_with_a_warning(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "run", keep=None, counter=Counter(), **QUIET)
    for step in (2, 4):
        ckpt["counter"].count = step
        ckpt.save(step=step)
    state = tmp_path / "run" / "000000000004" / "state.json"
    state.write_bytes(state.read_bytes()[:-1])

    counter = Counter()
    fresh = Checkpointer(tmp_path / "run", counter=counter, **QUIET)
    with pytest.warns(RuntimeWarning, match="000000000004"):
        assert fresh.restore() == 2
    assert counter.count == 2


def test_verify_fails_a_checkpoint_that_does_not_fit_the_objects_as_restore_does(
    tmp_path: Path,
) -> None:
    # Step 1 of the model given, step 2 of a wider one: both whole.
    for step, width in ((1, 2), (2, 3)):
        saving = Checkpointer(tmp_path / "run", model=nn.Linear(4, width), **QUIET)
        saving.save(step=step)
        saving.close()
    ckpt = Checkpointer(tmp_path / "run", model=nn.Linear(4, 2), **QUIET)
    assert CheckpointStore(tmp_path / "run").verify().ok  # whole, as every reader judges it
    report = ckpt.verify()
    assert not report.ok
    assert report.summary == "OK 1/2, errors 1"
    fits, misfit = sorted(report.results, key=lambda r: r.step)
    assert (fits.step, fits.ok, misfit.step, misfit.ok) == (1, True, 2, False)
    assert "does not fit the objects given: model.weight is [3, 4] float32 in the checkpoint" in (
        misfit.problem
    )
    assert "Fix: build the model and optimizer exactly as in the run" in misfit.problem
    assert str(misfit).startswith("FAIL  000000000002 ")
    with pytest.warns(RuntimeWarning, match="000000000002") as caught:
        assert ckpt.restore() == 1  # the same verdict: passed over, for the same reason
    assert any("model.weight is [3, 4]" in str(w.message) for w in caught)
    ckpt.close()
    wider = Checkpointer(tmp_path / "run", model=nn.Linear(4, 3), **QUIET)
    assert [r.ok for r in sorted(wider.verify().results, key=lambda r: r.step)] == [False, True]
    wider.close()


def test_verify_without_objects_checks_wholeness_only(tmp_path: Path) -> None:
    saving = Checkpointer(tmp_path / "run", model=nn.Linear(4, 2), **QUIET)
    saving.save(step=1)
    saving.close()
    ckpt = Checkpointer(tmp_path / "run", **QUIET)
    ckpt["note"] = "a plain value"  # a value is no object to fit
    report = ckpt.verify()
    assert report.ok
    assert report.summary == "OK 1/1, errors 0"
    weights = tmp_path / "run" / "000000000001" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 1
    weights.write_bytes(raw)
    (damaged,) = ckpt.verify().results
    assert not damaged.ok
    assert "mismatch" in damaged.problem
    assert damaged == CheckpointStore(tmp_path / "run").verify().results[0]
    ckpt.close()


def test_an_uncommitted_folder_is_not_a_checkpoint() -> None:
    # What a writer killed mid-save leaves on an object store: files, but no manifest.
    import fsspec

    url = f"memory://nbresume-test-{uuid.uuid4().hex}/run"
    fs = fsspec.filesystem("memory")
    root = url.removeprefix("memory://")
    fs.makedirs(f"{root}/000000000003", exist_ok=True)
    fs.pipe_file(f"{root}/000000000003/counter.safetensors", b"half of a file")
    try:
        ckpt = Checkpointer(url, counter=Counter(), **QUIET)
        assert ckpt.restore() == 0
        assert list(ckpt.steps(2)) == [0, 1]
        assert [i.step for i in ckpt.list()] == [2]
    finally:
        fs.rm(root.split("/")[0], recursive=True)


# -- the step loop ----------------------------------------------------------------------------


def test_steps_saves_on_cadence_and_at_the_end(tmp_path: Path) -> None:
    counter, recorder = Counter(), Recorder()
    ckpt = Checkpointer(
        tmp_path / "run", every=3, keep=None, deadline=None, callbacks=[recorder], counter=counter
    )
    seen = []
    for step in ckpt.steps(10):
        seen.append(step)
        counter.count += 1
    assert seen == list(range(10))
    assert recorder.steps("verified") == [3, 6, 9, 10]
    assert ckpt.done
    # Each checkpoint holds the state exactly as it was at its step boundary.
    for step in (3, 6, 9, 10):
        document = state_json(tmp_path / "run", step)
        assert document["step"] == step
        assert document["objects"]["counter"] == {"count": step}
        assert document["done"] is (step == 10)


def test_keep_bounds_the_checkpoints_on_disk(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "run", every=3, keep=2, deadline=None, counter=Counter())
    for _ in ckpt.steps(10):
        pass
    assert steps_on_disk(tmp_path / "run") == [9, 10]
    assert [i.step for i in ckpt.list()] == [9, 10]
    assert ckpt.verify().ok


def test_a_finished_run_trains_no_further_step(tmp_path: Path) -> None:
    first = Checkpointer(tmp_path / "run", every=4, deadline=None, counter=Counter())
    for _ in first.steps(6):
        first["counter"].count += 1
    first.close()

    counter = Counter()
    again = Checkpointer(tmp_path / "run", every=4, deadline=None, counter=counter)
    assert again.restore() == 6
    assert again.done
    assert list(again.steps(6)) == []
    assert counter.count == 6
    assert [i.step for i in again.list()] == [4, 6], "nothing new was saved"


class SessionEnded(Exception):
    """The end of a session, as an exception out of the loop's body (a kill, in-process)."""


def test_an_interrupted_loop_resumes_after_the_last_checkpoint(tmp_path: Path) -> None:
    first = Checkpointer(tmp_path / "run", every=3, deadline=None, counter=Counter())
    try:
        for step in first.steps(10):
            if step == 5:
                raise SessionEnded  # step 5 never finished
            first["counter"].count += 1
    except SessionEnded:
        first.close()
    assert not first.done

    counter = Counter()
    second = Checkpointer(tmp_path / "run", every=3, deadline=None, counter=counter)
    assert list(second.steps(10)) == list(range(3, 10))
    assert counter.count == 3
    assert second.done


def test_a_longer_total_continues_a_finished_run(tmp_path: Path) -> None:
    first = Checkpointer(tmp_path / "run", **QUIET)
    assert list(first.steps(3)) == [0, 1, 2]
    second = Checkpointer(tmp_path / "run", **QUIET)
    try:
        for step in second.steps(6):
            if step == 4:
                raise SessionEnded
    except SessionEnded:
        second.close()
    assert not second.done, "the longer run is not finished"
    third = Checkpointer(tmp_path / "run", **QUIET)
    assert list(third.steps(6)) == [3, 4, 5]
    assert third.done


# -- the epoch loop ---------------------------------------------------------------------------


def batches_of(count: int) -> DataLoader[Any]:
    return DataLoader(list(range(count)), batch_size=4, shuffle=True)  # 10 -> 3 batches


def test_epochs_count_a_step_per_batch(tmp_path: Path) -> None:
    recorder = Recorder()
    ckpt = Checkpointer(tmp_path / "run", every=2, keep=None, deadline=None, callbacks=[recorder])
    loader = ckpt.loader(batches_of(10))
    seen: list[tuple[int, int]] = []
    for epoch in ckpt.epochs(2):
        for batch in loader:
            seen.append((epoch, len(batch)))
    assert [e for e, _ in seen] == [0, 0, 0, 1, 1, 1]
    assert sorted(n for _, n in seen[:3]) == [2, 4, 4]
    assert ckpt.step == 6
    assert ckpt.epoch == 2
    assert recorder.steps("verified") == [2, 4, 6]
    mid_epoch = state_json(tmp_path / "run", 4)
    assert mid_epoch["epoch"] == 1
    assert mid_epoch["objects"]["loader"]["epoch"] == 1
    assert mid_epoch["objects"]["loader"]["position"] == 1


def test_an_epoch_loop_resumes_at_the_next_batch(tmp_path: Path) -> None:
    def run(where: str, stop_after: int | None = None) -> tuple[Checkpointer, list[list[int]]]:
        torch.manual_seed(0)
        ckpt = Checkpointer(tmp_path / where, every=2, deadline=None)
        loader = ckpt.loader(batches_of(10))
        seen: list[list[int]] = []
        for _ in ckpt.epochs(3):
            for batch in loader:
                seen.append(batch.tolist())
                if len(seen) == stop_after:
                    ckpt.close()
                    return ckpt, seen  # killed while working on this batch
        ckpt.close()
        return ckpt, seen

    _, reference = run("reference")
    _, head = run("run", stop_after=6)  # the last checkpoint is at step 4: epoch 1, batch 2 next
    ckpt, tail = run("run")
    assert ckpt.restored_step == 4
    assert head[:4] + tail == reference
    assert ckpt.done


# -- metrics, values, names --------------------------------------------------------------------


def test_keep_best_keeps_the_best_by_metric(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "run", keep=1, keep_best=("val_loss", "min"), **QUIET)
    for step, loss in [(1, 0.5), (2, 0.2), (3, 0.9), (4, 0.7)]:
        ckpt.save(step=step, metric=loss)
    assert steps_on_disk(tmp_path / "run") == [2, 4]
    best = next(i for i in ckpt.list() if i.step == 2)
    assert best.metrics == {"val_loss": 0.2}


def test_keep_best_max_with_a_dict_of_metrics(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "run", keep=1, keep_best=("acc", "max", 2), **QUIET)
    for step, acc in [(1, 0.5), (2, 0.8), (3, 0.6), (4, 0.7), (5, 0.1)]:
        ckpt.save(step=step, metric={"acc": acc, "loss": 1 - acc})
    assert steps_on_disk(tmp_path / "run") == [2, 4, 5]


def test_plain_values_are_saved_and_restored(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "run", **QUIET)
    ckpt["best"] = 0.0
    assert ckpt["best"] == 0.0
    ckpt["best"] = 0.5
    ckpt["history"] = [(1, 0.25), (2, float("inf"))]
    ckpt.save(step=2)

    again = Checkpointer(tmp_path / "run", **QUIET)
    again["best"] = 0.0
    assert again["best"] == 0.0, "the value set until restore()"
    assert again.restore() == 2
    assert again["best"] == 0.5
    assert again["history"] == [(1, 0.25), (2, float("inf"))]
    with pytest.raises(KeyError):
        again["never set"]


def test_a_plain_dict_keeps_its_order(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "run", **QUIET)
    ckpt["classes"] = {"zebra": 0, "ant": 1, "moose": 2}  # e.g. turned into a label list
    ckpt.save(step=1)
    again = Checkpointer(tmp_path / "run", **QUIET)
    again.restore()
    assert list(again["classes"]) == ["zebra", "ant", "moose"]


@pytest.mark.parametrize("name", ["state", "rng", "values", "manifest"])
def test_reserved_names_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(UsageError, match=name):
        Checkpointer(tmp_path / "run", **QUIET, **{name: 1})
    ckpt = Checkpointer(tmp_path / "run", **QUIET)
    with pytest.raises(UsageError, match=name):
        ckpt[name] = 1


def test_names_that_cannot_name_a_file_are_refused(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "run", **QUIET)
    with pytest.raises(UsageError):
        ckpt["../escape"] = 1
    ckpt["counter"] = Counter()
    with pytest.raises(UsageError, match="stateful"):
        ckpt["counter"] = 3


def test_a_value_that_cannot_be_stored_is_refused_when_given(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "run", **QUIET)
    with pytest.raises(CheckpointError, match="hook"):
        ckpt["hook"] = lambda: None


# -- async saves ------------------------------------------------------------------------------


class Gate:
    """A callback that holds the background writer at its first event until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.writer_threads: set[str] = set()

    def __call__(self, event: Event) -> None:
        if event.kind == "save_started":
            self.writer_threads.add(threading.current_thread().name)
            self.entered.set()
            assert self.release.wait(timeout=60), "the test never released the writer"


def test_async_save_returns_before_the_write_and_keeps_the_snapshot(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gate, recorder = Gate(), Recorder()
    ckpt = Checkpointer(
        tmp_path / "run", every=None, deadline=None, callbacks=[gate, recorder], model=model
    )
    assert ckpt.save(step=1) is None  # returned while the writer is held at the gate
    assert gate.entered.wait(timeout=60)
    assert threading.current_thread().name not in gate.writer_threads
    assert ckpt.list() == []
    with torch.no_grad():
        model.weight.add_(1.0)  # training goes on; the checkpoint must hold step 1's weights
    gate.release.set()
    ckpt.wait()
    assert recorder.steps("verified") == [1]
    assert ckpt.verify().ok
    restored = nn.Linear(64, 64)
    assert Checkpointer(tmp_path / "run", model=restored, **QUIET).restore() == 1
    for key, value in restored.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_a_blocking_save_returns_the_verified_checkpoint(tmp_path: Path) -> None:
    recorder = Recorder()
    ckpt = Checkpointer(tmp_path / "run", every=None, deadline=None, callbacks=[recorder])
    info = ckpt.save(step=7, block=True)
    assert info is not None
    assert info.step == 7
    assert recorder.steps("verified") == [7]
    assert [e.kind for e in recorder.events] == ["save_started", "committed", "verified"]


def test_the_context_manager_waits_for_the_save_in_flight(tmp_path: Path) -> None:
    def slow_writer(event: Event) -> None:
        if event.kind == "save_started":
            time.sleep(0.5)  # a slow disk; leaving the block must still wait for it

    recorder = Recorder()
    with Checkpointer(
        tmp_path / "run", every=None, deadline=None, callbacks=[slow_writer, recorder]
    ) as ckpt:
        ckpt["x"] = 1
        assert ckpt.save(step=1) is None
    assert recorder.steps("verified") == [1]
    assert [i.step for i in nbresume.CheckpointStore(tmp_path / "run").list()] == [1]


def test_a_failed_background_save_is_raised_in_the_training_thread(tmp_path: Path) -> None:
    target = tmp_path / "run"
    target.write_text("a file where the folder should be")
    ckpt = Checkpointer(target, every=None, deadline=None)
    ckpt["x"] = 1
    assert ckpt.save(step=1) is None
    with pytest.raises(CheckpointError, match="background save failed"):
        ckpt.wait()
    ckpt.wait()  # reported once


# -- what users can do without nbresume -------------------------------------------------------


def test_model_weights_open_with_the_safetensors_library(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8), nn.BatchNorm1d(8), nn.Linear(8, 10))
    model[2].weight = model[0].weight  # tied weights: two names, one tensor
    model[1].to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters())
    ckpt = Checkpointer(tmp_path / "run", model=model, optimizer=optimizer, **QUIET)
    info = ckpt.save(step=1)
    assert info is not None

    weights = load_file(str(Path(info.location) / "model.safetensors"))
    expected = model.state_dict()
    assert set(weights) == set(expected)
    for key, value in expected.items():
        assert weights[key].dtype == value.dtype, key
        assert torch.equal(weights[key], value), key
    fresh = nn.Sequential(nn.Embedding(10, 8), nn.BatchNorm1d(8), nn.Linear(8, 10))
    fresh[1].to(torch.bfloat16)
    fresh.load_state_dict(weights)  # the file is a plain state_dict, usable anywhere


def _fail_saves_after_step_3(
    tmp_path: Path, seen: list[int], *, fix_and_stop: bool
) -> Checkpointer:
    """Train until a background save really fails (the folder replaced by a file after the
    save of step 3), wait until that failure is known, then go on (or fix it and ask to stop)."""
    folder, moved = tmp_path / "run", tmp_path / "moved"
    failed = threading.Event()

    def on_event(event: Event) -> None:
        if event.kind == "failed":
            failed.set()

    ckpt = Checkpointer(
        folder, every=3, keep=2, deadline=None, model=nn.Linear(2, 2), callbacks=[on_event]
    )
    for step in ckpt.steps(100):
        seen.append(step)
        if step == 3:
            ckpt.wait()  # the save of step 3 is on disk
            folder.rename(moved)
            folder.write_text("a file where the checkpoints were")
        if step == 6:  # the save of step 6 started at the last boundary and cannot succeed
            assert failed.wait(30)
            while any(t.name == "nbresume-save" for t in threading.enumerate()):
                time.sleep(0.01)
            if fix_and_stop:
                folder.unlink()
                moved.rename(folder)
                ckpt.request_stop("asked to stop")
    return ckpt


def test_a_failed_background_save_is_raised_at_the_next_step_boundary(tmp_path: Path) -> None:
    seen: list[int] = []
    with pytest.raises(CheckpointError, match="background save failed"):
        _fail_saves_after_step_3(tmp_path, seen, fix_and_stop=False)
    # Raised at the first boundary after the failure was known, not `every` steps later.
    assert seen[-1] == 6


def test_a_background_failure_is_known_while_its_thread_is_still_ending() -> None:
    """The failure is kept as the save thread's last act; a thread can outlive that by a
    while under load (gone from ``threading.enumerate()``, still alive), and a step boundary
    in that window must already raise, not one boundary later."""
    from nbresume.checkpoint.loop.saver import BackgroundSave

    background = BackgroundSave()
    background.start(lambda: 1 / 0)
    background.wait()
    release = threading.Event()
    ending = threading.Thread(target=release.wait)  # the save's thread, not quite gone
    ending.start()
    background._thread = ending
    try:
        assert ending.is_alive()
        assert background.failed
        assert isinstance(background.take_error(), ZeroDivisionError)
        assert not background.failed
    finally:
        release.set()
        ending.join()


def test_a_stop_after_a_failed_background_save_still_saves(tmp_path: Path) -> None:
    seen: list[int] = []
    ckpt = _fail_saves_after_step_3(tmp_path, seen, fix_and_stop=True)
    assert seen[-1] == 6
    assert ckpt.stop_reason == "asked to stop"
    assert not ckpt.done
    latest = ckpt.latest()
    assert latest is not None
    assert latest.step == 7
    assert ckpt.verify().ok


def _train_with_body_saves(
    folder: Path, mode: str, kill_after_save: int | None
) -> dict[str, torch.Tensor] | None:
    """Train with the save inside the loop body (after the update, with a metric), as users
    write it; "die" right after the save number ``kill_after_save``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(24, 4), torch.randn(24, 1))
    loader = DataLoader(data, batch_size=4, shuffle=True)
    ckpt = Checkpointer(folder, every=None, keep=None, deadline=None, async_save=False,
                        keep_best=("loss", "min"), model=model, optimizer=optimizer,
                        loader=loader)  # fmt: skip
    batches = ckpt.loader()
    saves = 0

    def update(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item()

    if mode == "steps":
        stream = batches.batches()
        for step in ckpt.steps(15):
            loss = update(*next(stream))
            if step % 4 == 1:
                ckpt.save(metric=loss)  # after the update: the checkpoint of step + 1
                saves += 1
                if saves == kill_after_save:
                    return None
    else:
        for _epoch in ckpt.epochs(4):
            for x, y in batches:
                loss = update(x, y)
            ckpt.save(metric=loss)  # at the end of the epoch, after its last batch
            saves += 1
            if saves == kill_after_save:
                return None
    assert ckpt.done
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("mode", ["steps", "epochs"])
@pytest.mark.parametrize("kill_after_save", [1, 2])
def test_a_save_inside_the_loop_body_resumes_exactly(
    tmp_path: Path, mode: str, kill_after_save: int
) -> None:
    reference = _train_with_body_saves(tmp_path / "reference", mode, None)
    assert _train_with_body_saves(tmp_path / "run", mode, kill_after_save) is None
    resumed = _train_with_body_saves(tmp_path / "run", mode, None)
    assert reference is not None
    assert resumed is not None
    for key, value in reference.items():
        assert torch.equal(resumed[key], value), key
