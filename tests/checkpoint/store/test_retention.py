"""The keep policy at its edges: which checkpoints retention deletes, given which count as kept.

The store's own tests (test_store.py) run the same policy on real folders after real saves;
here each rule is pinned on the checkpoints' records alone."""

from __future__ import annotations

from collections.abc import Collection

import pytest

from nbresume import ArgumentError, Checkpointer, CheckpointStore
from nbresume.checkpoint.format import Manifest, step_dirname
from nbresume.checkpoint.store import CheckpointInfo, KeepPolicy


def infos(*metrics: dict[str, float]) -> list[CheckpointInfo]:
    """Checkpoints of steps 1, 2, ... (oldest first), each saved with its metrics."""
    return [
        CheckpointInfo(step, step_dirname(step), "mem", Manifest(step, {}, metrics=m))
        for step, m in enumerate(metrics, start=1)
    ]


def doomed(
    policy: KeepPolicy, checkpoints: list[CheckpointInfo], bad: Collection[int] = ()
) -> list[int]:
    """The steps ``policy`` deletes, where the steps in ``bad`` do not count as kept."""
    return [i.step for i in policy.doomed(checkpoints, lambda i: i.step not in bad)]


def test_keep_one_deletes_all_but_the_newest() -> None:
    assert doomed(KeepPolicy.of("t", 1), infos({}, {}, {}, {})) == [1, 2, 3]
    assert doomed(KeepPolicy.of("t", 1), infos({})) == []


def test_keep_none_keeps_everything_even_with_keep_best() -> None:
    policy = KeepPolicy.of("t", None, ("loss", "min", 1))
    assert doomed(policy, infos({"loss": 3}, {"loss": 2}, {"loss": 1})) == []


def test_the_newest_that_counts_is_kept_and_nothing_newer_is_deleted() -> None:
    # Steps 3 and 4 do not count as kept (corrupt, or not yet confirmed by Drive): keep=1
    # keeps step 2, deletes the older one and leaves the newer ones for the user to inspect.
    assert doomed(KeepPolicy.of("t", 1), infos({}, {}, {}, {}), bad={3, 4}) == [1]
    # None counts: nothing is deleted on the strength of a bad copy.
    assert doomed(KeepPolicy.of("t", 2), infos({}, {}, {}), bad={1, 2, 3}) == []


def test_a_checkpoint_that_does_not_count_is_never_deleted() -> None:
    # Step 2 is asked (it would be one of the two newest) and fails: it stays.
    assert doomed(KeepPolicy.of("t", 2), infos({}, {}, {}, {}, {}), bad={4}) == [1, 2]


@pytest.mark.parametrize(
    ("mode", "best"),
    [("min", 2), ("max", 4)],  # the lowest loss is step 2's, the highest step 4's
)
def test_keep_best_by_mode(mode: str, best: int) -> None:
    checkpoints = infos({"loss": 0.5}, {"loss": 0.1}, {"loss": 0.3}, {"loss": 0.9}, {"loss": 0.4})
    policy = KeepPolicy.of("t", 1, ("loss", mode, 1))
    kept = {1, 2, 3, 4, 5} - set(doomed(policy, checkpoints))
    assert kept == {best, 5}


def test_keep_best_ties_keep_the_older_checkpoint() -> None:
    checkpoints = infos({"acc": 0.9}, {"acc": 0.9}, {"acc": 0.1}, {"acc": 0.2})
    for mode in ("max", "min"):
        policy = KeepPolicy.of("t", 1, ("acc", mode, 1))
        kept = {1, 2, 3, 4} - set(doomed(policy, checkpoints))
        assert kept == ({1, 4} if mode == "max" else {3, 4})


def test_keep_best_count_defaults_to_keep() -> None:
    checkpoints = infos({"loss": 1}, {"loss": 2}, {"loss": 3}, {"loss": 9}, {"loss": 8})
    assert doomed(KeepPolicy.of("t", 2, ("loss", "min")), checkpoints) == [3]


def test_a_checkpoint_saved_without_the_metric_is_kept_only_as_one_of_the_newest() -> None:
    checkpoints = infos({"loss": 0.2}, {}, {"acc": 0.5}, {"loss": 0.7}, {})
    policy = KeepPolicy.of("t", 1, ("loss", "min", 2))
    assert doomed(policy, checkpoints) == [2, 3]


def test_the_policy_has_the_short_forms_and_names_the_metric() -> None:
    policy = KeepPolicy.of("t", 3, ["val_loss", "min"])
    assert (policy.newest, policy.keep_best, policy.metric_name) == (
        3,
        ("val_loss", "min", 0),
        "val_loss",
    )
    assert KeepPolicy.of("t", 3).metric_name == "metric"
    assert policy.but("t", keep=1) == KeepPolicy(1, "val_loss", "min", 0)
    assert policy.but("t", keep_best=("acc", "max", 2)) == KeepPolicy(3, "acc", "max", 2)
    store = CheckpointStore("memory://retention-short-forms", keep=2, keep_best=("acc", "max"))
    assert (store.keep, store.keep_best) == (2, ("acc", "max", 0))


@pytest.mark.parametrize(
    ("keep", "keep_best", "says"),
    [
        (0, None, "keep must be at least 1"),
        ("3", None, "str is not a number of checkpoints"),
        (3, ("loss", "minimum"), "the mode must be 'min' or 'max'"),
        (3, ("loss", "min", 0), "the count must be a positive integer"),
        (3, "loss", "it needs the metric and min or max"),
    ],
)
def test_a_wrong_short_form_is_refused_naming_it(
    keep: object, keep_best: object, says: str
) -> None:
    with pytest.raises(ArgumentError, match=says) as raised:
        KeepPolicy.of("Checkpointer", keep, keep_best)
    assert raised.value.where.startswith("Checkpointer")
    with pytest.raises(ArgumentError, match=says):
        KeepPolicy.of("t", 3).but("CheckpointStore.prune", keep, keep_best)


def test_a_misspelled_keep_argument_names_the_option(tmp_path: object) -> None:
    with pytest.raises(ArgumentError, match="did you mean keep_best="):
        Checkpointer(tmp_path, keep_bset=("loss", "min"))


def test_each_checkpoint_is_read_back_at_most_once_and_only_until_enough_are_kept() -> None:
    # Asking whether a checkpoint counts may read all its bytes back: the best are asked in
    # rank order only until enough of them count, the newest only until enough of them do.
    checkpoints = infos(*({"loss": float(10 - i)} for i in range(10)))
    asked: list[int] = []

    def counts(info: CheckpointInfo) -> bool:
        asked.append(info.step)
        return True

    gone = KeepPolicy(newest=1, metric="loss", mode="max", best=2).doomed(checkpoints, counts)
    assert sorted(asked) == [1, 2, 10]  # the newest (step 10), then the two highest losses
    assert len(asked) == len(set(asked))
    assert [i.step for i in gone] == list(range(3, 10))
