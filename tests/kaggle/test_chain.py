"""``nbresume commit --chain`` / ``nbresume chain``: a training run that no single session can
hold, carried leg after leg through Kaggle, ends exactly where an uninterrupted run ends."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from testkit.fake_kaggle import FakeKaggle

from .conftest import commit, copy_notebook, nbresume, user_env

#: Session cap of a leg, in seconds. deadline="auto" stops 120 s (plus a few saves and steps)
#: before a platform cap, so a leg trains for what is left of 15 s once the kernel started:
#: at most about 27 steps, so the 56 steps need at least three legs on any machine.
LEG_CAP_S = 136
TOTAL_STEPS = 56  # as in notebooks/train_chain.ipynb


def weights(folder: Path) -> tuple[str, int, bool, str]:
    """What the training notebook's last cell wrote: hash, step, done, why it stopped."""
    digest, step, done, reason = (folder / "weights.sha256").read_text().split("\n")[:4]
    return digest, int(step), done == "True", reason


@pytest.mark.slow
def test_legs_cut_by_the_session_cap_end_bit_identical_to_one_uninterrupted_run(
    tmp_path: Path, kaggle_server: FakeKaggle
) -> None:
    user = tmp_path / "user"
    env = user_env(tmp_path, kaggle_server)
    owner = kaggle_server.username

    # The same training in one session long enough for it (it runs alongside the chain).
    reference = copy_notebook("train_chain.ipynb", user / "reference")
    pushed = commit(
        tmp_path,
        kaggle_server,
        reference,
        "train-reference",
        *("--no-smoke", "--no-internet", "--timeout", "3600"),
    )
    assert pushed.code == 0, pushed.text

    chained = copy_notebook("train_chain.ipynb", user / "chained")
    result = commit(
        tmp_path,
        kaggle_server,
        chained,
        "train-chained",
        *("--no-smoke", "--no-internet", "--timeout", str(LEG_CAP_S), "--chain"),
        *("--legs", "20", "--poll", "0.25", "-o", str(user / "legs")),
        timeout=900,
    )
    assert result.code == 0, result.text
    legs = sorted((user / "legs").iterdir())
    assert len(legs) >= 3, result.out
    records = [weights(leg) for leg in legs]

    # Every leg but the last was cut short by the session cap, each one further along.
    steps = [step for _, step, _, _ in records]
    assert steps == sorted(set(steps)), steps
    for _, step, done, reason in records[:-1]:
        assert not done
        assert 0 < step < TOTAL_STEPS
        assert "session deadline" in reason
    assert records[-1][1:3] == (TOTAL_STEPS, True)
    assert f"done: the training finished in leg {len(legs)}" in result.out

    # Legs alternate between the two notebooks, each with the previous leg's output attached.
    saves = [r.body for r in kaggle_server.requests if r.path.endswith("/SaveKernel")]
    chain_pushes = [b for b in saves if b["slug"] != f"{owner}/train-reference"]
    slugs = [b["slug"].split("/")[1] for b in chain_pushes]
    assert slugs == [("train-chained", "train-chained-b")[i % 2] for i in range(len(legs))]
    for previous, push in itertools.pairwise(chain_pushes):
        assert push["kernelDataSources"] == [previous["slug"]]
        assert push["sessionTimeoutSeconds"] == LEG_CAP_S

    # The reference, followed as a chain of one leg.
    followed = nbresume(
        [
            "chain",
            f"{owner}/train-reference",
            "--legs",
            "1",
            "--poll",
            "0.25",
            "-o",
            str(user / "reference-output"),
        ],
        cwd=user,
        env=env,
        timeout=600,
    )
    assert followed.code == 0, followed.text
    [reference_leg] = sorted((user / "reference-output").iterdir())
    expected = weights(reference_leg)
    assert expected[1:3] == (TOTAL_STEPS, True)
    assert records[-1][0] == expected[0]  # bit-identical weights


@pytest.mark.slow
def test_a_leg_that_fails_stops_the_chain_with_its_message(
    tmp_path: Path, kaggle_server: FakeKaggle
) -> None:
    notebook = copy_notebook("runaway.ipynb", tmp_path / "user")
    env = user_env(tmp_path, kaggle_server)
    ref = f"{kaggle_server.username}/runaway-run"
    result = commit(
        tmp_path,
        kaggle_server,
        notebook,
        "runaway-run",
        *("--no-smoke", "--no-internet", "--timeout", "5", "--chain", "--poll", "0.25"),
    )
    assert result.code == 1
    assert "leg 1 (" in result.err
    assert "ended ERROR: The session ran past its limit of 5 seconds" in result.err
    assert kaggle_server.api_calls().count("SaveKernel") == 1  # no next leg

    status = nbresume(["status", ref], cwd=notebook.parent, env=env)
    assert status.code == 1
    assert f"{ref}: ERROR" in status.out
    assert "ran past its limit" in status.out
