"""The loop control that the Checkpointer and a framework's watch share: steering by
nbresume's own tools as a provided value, job-wide agreement as named flags, and signals
that are the user's again once the loop ends."""

from __future__ import annotations

import signal
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

import nbresume
from nbresume.checkpoint import hooks
from nbresume.checkpoint.loop import BoundaryFlags, Decision, LoopControl, RunningLoop
from nbresume.checkpoint.store import CheckpointStore
from nbresume.frameworks.watch import Watch


@pytest.fixture
def steered() -> Iterator[list[hooks.Steering]]:
    """Steer this process's loops as a tool of nbresume's would (``nbresume check``)."""
    given: list[hooks.Steering] = [hooks.Steering()]
    before = hooks._steering
    hooks.provide_steering(lambda: given[0])
    yield given
    hooks.provide_steering(before)


def test_a_provided_stop_step_stops_a_checkpointers_loop_there(
    tmp_path: Path, steered: list[hooks.Steering]
) -> None:
    steered[0] = hooks.Steering(stop_at_step=3, stop_at_reason="the check's budget")
    model = torch.nn.Linear(2, 2)
    ckpt = nbresume.Checkpointer(tmp_path / "run", every=None, quiet=True, model=model)
    assert list(ckpt.steps(10)) == [0, 1, 2]
    assert not ckpt.done
    assert ckpt.stop_reason == "the check's budget"
    latest = ckpt.latest()
    assert latest is not None
    assert latest.step == 3
    ckpt.close()


def test_a_provided_folder_takes_the_checkpoints_elsewhere(
    tmp_path: Path, steered: list[hooks.Steering]
) -> None:
    sandbox = tmp_path / "sandbox"
    steered[0] = hooks.Steering(folder=lambda original: str(sandbox))
    ckpt = nbresume.Checkpointer(tmp_path / "run", quiet=True, model=torch.nn.Linear(2, 2))
    list(ckpt.steps(1))
    ckpt.close()
    assert [info.step for info in CheckpointStore(sandbox).list()] == [1]
    assert not (tmp_path / "run").exists()


def test_a_framework_loop_is_not_stopped_by_the_steering(
    tmp_path: Path, steered: list[hooks.Steering]
) -> None:
    steered[0] = hooks.Steering(stop_at_step=1, smoke_steps=1)
    watch = Watch(CheckpointStore(tmp_path / "run"), deadline=None, announce=False)
    watch.start(step=0, total=10)
    watch.step_done(5)
    assert watch.decide() == ("", False)
    watch.finish(5, done=True)


def test_flags_are_agreed_as_the_maximum_over_the_job(tmp_path: Path) -> None:
    """What another process saw (a signal, a request) becomes this one's at the same step."""
    control = LoopControl(CheckpointStore(tmp_path / "run"), deadline=None)
    other = [1, int(signal.SIGTERM), 0, 1, 0]  # another process: stop on SIGTERM, save due

    def agree(flags: Sequence[int]) -> list[int]:
        return [max(a, b) for a, b in zip(flags, other, strict=True)]

    agreed = control.agree(BoundaryFlags(save=True), agree)
    assert agreed == BoundaryFlags(stop=True, signum=signal.SIGTERM, save=True, due=True)
    assert control.signum == signal.SIGTERM  # this process ends as the signalled one does
    assert control.reason_of(agreed, "") == "another process of the job received SIGTERM"
    assert control.reason_of(agreed, "asked") == "asked"
    assert BoundaryFlags(due=True).agreed(None) == BoundaryFlags(due=True)


def test_a_signal_is_a_request_while_the_loop_runs_and_the_users_handler_after(
    tmp_path: Path,
) -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        control = LoopControl(CheckpointStore(tmp_path / "run"), deadline=None)
        with control.signals():
            signal.raise_signal(signal.SIGUSR1)
            assert control.why_stop(0) == "received SIGUSR1"
        assert seen == []
        signal.raise_signal(signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]  # the user's own handler is back
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_requests_are_dropped_when_a_new_loop_begins(tmp_path: Path) -> None:
    control = LoopControl(CheckpointStore(tmp_path / "run"), deadline=None)
    control.request_stop("old request")
    control.begin(0)
    assert control.why_stop(0) == ""
    control.request_save()
    assert control.take_save_request()
    assert not control.take_save_request()


def test_the_panel_reads_a_checkpointer_and_a_framework_watch_alike(tmp_path: Path) -> None:
    ckpt = nbresume.Checkpointer(tmp_path / "a", quiet=True, model=torch.nn.Linear(2, 2))
    watch = Watch(CheckpointStore(tmp_path / "b"), deadline=None, announce=False)
    try:
        for loop in (ckpt, watch):
            assert isinstance(loop, RunningLoop)
            assert not loop.started
        list(ckpt.steps(1))
        watch.start(step=0, total=2)
        assert ckpt.started
        assert watch.started
    finally:
        ckpt.close()
        watch.close()


# -- the step boundary's decision: save, stop, or go on -----------------------------------------


def test_every_one_saves_at_every_boundary_and_counts_from_the_last_save(tmp_path: Path) -> None:
    control = LoopControl(CheckpointStore(tmp_path / "run"), every=1, deadline=None)
    control.begin(0)
    assert control.decide(1, None, on_cadence=True) == Decision(save=True)
    control.saved(1)
    assert control.decide(1, None, on_cadence=True) == Decision()  # step 1 is saved
    assert control.decide(2, None, on_cadence=True) == Decision(save=True)
    # A process whose clock does not lead the job (or a framework's loop) leaves the cadence
    # to the leading one.
    assert control.decide(2, None, on_cadence=False) == Decision()


def test_a_save_request_is_answered_once(tmp_path: Path) -> None:
    control = LoopControl(CheckpointStore(tmp_path / "run"), every=None, deadline=None)
    control.begin(0)
    control.request_save()
    assert control.decide(4, None, on_cadence=True) == Decision(save=True)
    assert control.decide(5, None, on_cadence=True) == Decision()
    # A stop's save answers a save request made at the same boundary.
    control.request_save()
    control.request_stop("enough")
    assert control.decide(6, None, on_cadence=True) == Decision(stop="enough", save=True)
    assert not control.take_save_request()


def test_another_processs_signal_and_failure_are_this_ones(tmp_path: Path) -> None:
    control = LoopControl(CheckpointStore(tmp_path / "run"), every=None, deadline=None)
    control.begin(0)
    other = [1, int(signal.SIGTERM), 0, 0, 1]  # another process: stop on SIGTERM, save failed

    def agree(flags: Sequence[int]) -> list[int]:
        return [max(a, b) for a, b in zip(flags, other, strict=True)]

    assert control.decide(3, agree, on_cadence=True) == Decision(
        stop="another process of the job received SIGTERM",
        signum=signal.SIGTERM,
        failed=True,
    )
    assert control.signum == signal.SIGTERM


def test_a_typed_cadence_that_could_mean_steps_or_seconds_is_refused(tmp_path: Path) -> None:
    with pytest.raises(nbresume.ArgumentError, match="could mean steps or seconds") as raised:
        nbresume.Checkpointer(tmp_path / "run", every="5", model=torch.nn.Linear(2, 2))
    assert raised.value.fix == 'every=5 for steps, every="5s" for seconds'
    with pytest.raises(nbresume.ArgumentError, match="did you mean every="):
        nbresume.Checkpointer(tmp_path / "run", evry=5, model=torch.nn.Linear(2, 2))
    assert not (tmp_path / "run").exists()  # a refused call creates nothing
