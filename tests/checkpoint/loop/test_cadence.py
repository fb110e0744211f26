"""When to save (every N steps, every duration, Young/Daly) and when to stop (the deadline)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from nbresume.checkpoint.loop import deadline as deadline_module
from nbresume.checkpoint.loop.cadence import AUTO_FIRST_SAVE_S, Cadence
from nbresume.checkpoint.loop.deadline import HOUR, resolve_deadline, session_started_at
from nbresume.checkpoint.units import parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90s", 90.0),
        ("15min", 900.0),
        ("2h", 7200.0),
        ("1.5h", 5400.0),
        ("500ms", 0.5),
        ("45", 45.0),
        (" 3 m ", 180.0),
        ("2HR", 7200.0),
        (".5d", 43200.0),
        ("10 secs", 10.0),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "h", "15 parsecs", "-5s", "1h30min", "1e3s", "5 s s", "2w"])
def test_parse_duration_refuses_what_is_not_a_duration(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_every_n_steps() -> None:
    cadence = Cadence(3)
    # Time plays no part: a day without 3 steps is not due, 3 steps in no time are.
    assert not cadence.due(2, seconds_since=86400.0)
    assert cadence.due(3, seconds_since=0.0)
    assert cadence.due(4, seconds_since=0.0)


@pytest.mark.parametrize(("every", "seconds"), [("15min", 900.0), (90.0, 90.0), ("1.5h", 5400.0)])
def test_every_duration(every: str | float, seconds: float) -> None:
    cadence = Cadence(every)
    assert not cadence.due(10**6, seconds_since=seconds - 0.001)
    assert cadence.due(1, seconds_since=seconds)


def test_never_on_cadence() -> None:
    cadence = Cadence(None)
    assert not cadence.due(10**9, seconds_since=10**9)


@pytest.mark.parametrize(
    ("every", "says"), [(0, "at least 1 step"), (-5, "at least 1 step"), (True, "bool"),
                        ("soon", "not a duration")]
)  # fmt: skip
def test_bad_cadence_is_refused(every: object, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        Cadence(every)  # type: ignore[arg-type]


def test_auto_waits_for_a_measured_save_then_uses_young_daly() -> None:
    cadence = Cadence("auto", mtbf_s=6 * 3600.0)
    # Nothing measured yet: the first save comes after a fixed time, whatever the steps.
    assert cadence.interval_steps() is None
    assert not cadence.due(10**6, seconds_since=AUTO_FIRST_SAVE_S - 1)
    assert cadence.due(1, seconds_since=AUTO_FIRST_SAVE_S)

    cadence.observe_save(4.0)
    cadence.observe_step(0.25)
    # W = sqrt(2 * MTBF * C) = sqrt(2 * 21600 s * 4 s) = sqrt(172800) = 415.69 s; 0.25 s a step.
    assert cadence.interval_steps() == 1662
    assert cadence.interval_steps() == math.floor(math.sqrt(2 * 21600 * 4.0) / 0.25)
    assert not cadence.due(1661, seconds_since=10**6)
    assert cadence.due(1662, seconds_since=0.0)


def test_auto_follows_the_measured_costs() -> None:
    cadence = Cadence("auto", mtbf_s=3600.0)
    cadence.observe_save(2.0)
    cadence.observe_step(1.0)
    short = cadence.interval_steps()  # sqrt(2 * 3600 * 2) = 120 s -> 120 steps
    assert short == 120
    for _ in range(50):
        cadence.observe_save(8.0)  # saves became 4x dearer: save half as often
    dear = cadence.interval_steps()
    assert dear is not None
    assert dear == pytest.approx(240, abs=2)
    for _ in range(200):
        cadence.observe_step(0.01)  # steps became 100x faster: more steps per interval
    fast = cadence.interval_steps()
    assert fast is not None
    assert fast == pytest.approx(24000, rel=0.01)


def test_auto_never_goes_below_one_step() -> None:
    cadence = Cadence("auto", mtbf_s=1.0)
    cadence.observe_save(0.000001)
    cadence.observe_step(3600.0)
    assert cadence.interval_steps() == 1


# -- deadline ---------------------------------------------------------------------------------


@pytest.fixture
def no_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither Kaggle's nor Colab's environment markers."""
    monkeypatch.delenv("KAGGLE_KERNEL_RUN_TYPE", raising=False)
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)


def test_no_deadline() -> None:
    assert resolve_deadline(None) == (None, "")


@pytest.mark.parametrize(("value", "seconds"), [(600, 600.0), (90.5, 90.5), ("2h", 7200.0)])
def test_a_deadline_counts_from_now(value: float | str, seconds: float) -> None:
    before = time.time()
    at, source = resolve_deadline(value)
    after = time.time()
    assert at is not None
    assert before + seconds <= at <= after + seconds
    assert str(value) in source


def test_a_bad_deadline_is_refused() -> None:
    with pytest.raises(ValueError, match="deadline="):
        resolve_deadline(True)
    with pytest.raises(ValueError, match="duration"):
        resolve_deadline("tomorrow")


def test_auto_without_a_platform_has_no_deadline(no_platform: None) -> None:
    if Path("/var/colab/hostname").exists():
        pytest.skip("this machine is a Colab VM")
    assert resolve_deadline("auto") == (None, "")


def test_auto_on_kaggle_ends_at_the_session_cap(
    no_platform: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Batch")
    at, source = resolve_deadline("auto")
    assert at is not None
    gpu = Path("/dev/nvidia0").exists()
    cap = 9 * HOUR if gpu else 12 * HOUR
    assert "Kaggle" in source
    # Counted from the session's real start, not from now: a run resumed late gets less.
    assert at == pytest.approx(session_started_at() + cap, abs=5.0)
    assert at <= time.time() + cap + 5.0


def test_auto_on_colab_ends_at_the_vm_lifetime(
    no_platform: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLAB_RELEASE_TAG", "release-colab_20240101-060000_RC00")
    at, source = resolve_deadline("auto")
    assert at is not None
    assert "Colab" in source
    assert at == pytest.approx(session_started_at() + 12 * HOUR, abs=5.0)


def test_the_session_started_before_this_process() -> None:
    # The session clock must not restart with a new Python process (a notebook's kernel
    # restart keeps the VM and its cap).
    assert session_started_at() <= deadline_module._PROCESS_STARTED + 1.0
