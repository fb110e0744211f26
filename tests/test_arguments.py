"""Every argument of the public API is checked when it is given: a wrong one is refused with an
error that names the call, the argument, the value and the fix, before anything is created or
changed on disk; a misspelled option is named, never saved as training state."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from nbresume import Checkpointer, CheckpointStore
from nbresume.errors import ArgumentError, NbresumeError, UsageError
from testkit.stateful import QUIET, Counter


def refused(call: str, fix: str) -> Any:
    """``pytest.raises`` for an ArgumentError whose message starts with ``call`` (which names
    the argument and its value) and whose fix says ``fix``."""
    return pytest.raises(ArgumentError, match=re.escape(call) + "(?s:.*)Fix: .*" + re.escape(fix))


def steps_on_disk(folder: Path) -> list[int]:
    if not folder.exists():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


def three_checkpoints(folder: Path) -> None:
    ckpt = Checkpointer(folder, keep=None, **QUIET)
    ckpt["x"] = 1
    for step in (1, 2, 3):
        ckpt.save(step=step)
    ckpt.close()
    assert steps_on_disk(folder) == [1, 2, 3]


# -- the errors ---------------------------------------------------------------------------------


def test_an_argument_error_is_a_usage_error_and_what_python_raises_for_bad_arguments(
    tmp_path: Path,
) -> None:
    for catch in (ArgumentError, UsageError, NbresumeError, ValueError, TypeError):
        with pytest.raises(catch):
            Checkpointer(tmp_path / "run", keep="3")


# -- misspelled options and plain values --------------------------------------------------------


def test_misspelled_options_are_named_and_nothing_is_created(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    with refused("Checkpointer(evry=2)", "every=") as caught:
        Checkpointer(tmp_path / "run", evry=2, kep=1, model=model)
    assert "did you mean every=?" in str(caught.value)
    assert "ckpt['evry'] = 2" in caught.value.fix
    with pytest.raises(ArgumentError, match=re.escape("did you mean keep=?")):
        Checkpointer(tmp_path / "run", kep=1, model=model)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("typo", "option"),
    [("evry", "every"), ("keep_bset", "keep_best"), ("deadlien", "deadline"),
     ("asyncsave", "async_save"), ("callback", "callbacks"),
     ("storage_option", "storage_options"), ("trainable", "trainable_only")],
)  # fmt: skip
def test_every_option_is_suggested_for_its_misspelling(
    tmp_path: Path, typo: str, option: str
) -> None:
    with pytest.raises(ArgumentError, match=re.escape(f"did you mean {option}=?")):
        Checkpointer(tmp_path / "run", **QUIET, **{typo: 1})


def test_a_stateful_object_under_a_name_close_to_an_option_is_taken(tmp_path: Path) -> None:
    counter = Counter()
    counter.count = 7
    ckpt = Checkpointer(tmp_path / "run", kep=counter, **QUIET)  # a name the user chose
    ckpt.save(step=1)
    again = Checkpointer(tmp_path / "run", kep=Counter(), **QUIET)
    assert again.restore() == 1
    assert again["kep"].count == 7


@pytest.mark.parametrize("value", [0.0, 3, "resnet", {"lr": 0.1}, [1, 2], (1, 2)])
def test_a_plain_value_as_a_keyword_is_refused_with_the_fix(tmp_path: Path, value: Any) -> None:
    with refused(f"Checkpointer(best_acc={value!r})", f"ckpt['best_acc'] = {value!r}") as caught:
        Checkpointer(tmp_path / "run", best_acc=value, **QUIET)
    assert "not a stateful object" in str(caught.value)
    assert not (tmp_path / "run").exists()


def test_plain_values_are_set_with_setitem_and_restored(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "run", counter=Counter(), **QUIET)
    ckpt["best_acc"] = 0.75
    ckpt["classes"] = ["cat", "dog"]
    ckpt.save(step=1)
    again = Checkpointer(tmp_path / "run", counter=Counter(), **QUIET)
    again.restore()
    assert again["best_acc"] == 0.75
    assert again["classes"] == ["cat", "dog"]


def test_none_and_a_class_are_refused_as_objects(tmp_path: Path) -> None:
    with refused("Checkpointer(scheduler=None)", "leave scheduler= out"):
        Checkpointer(tmp_path / "run", scheduler=None, **QUIET)
    with refused("Checkpointer(model=<class", "model=Linear(...)"):
        Checkpointer(tmp_path / "run", model=nn.Linear, **QUIET)


def test_models_optimizers_and_dataloaders_are_taken(tmp_path: Path) -> None:
    from torch.utils.data import DataLoader

    model = nn.Linear(2, 2)
    loader = DataLoader(list(range(8)), batch_size=2)
    ckpt = Checkpointer(
        tmp_path / "run",
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loader=loader,
        **QUIET,
    )
    assert ckpt.loader().loader is loader
    assert ckpt["model"] is model


# -- a refused call changes nothing --------------------------------------------------------------


def test_keep_true_on_a_folder_with_three_checkpoints_deletes_none(tmp_path: Path) -> None:
    three_checkpoints(tmp_path / "run")
    with refused("Checkpointer(keep=True)", "keep=None keeps every checkpoint"):
        Checkpointer(tmp_path / "run", keep=True, **QUIET)
    with refused("CheckpointStore.prune(keep=True)", "keep=3"):
        CheckpointStore(tmp_path / "run", keep=None).prune(keep=True)
    with refused("CheckpointStore.prune(keep=0)", "keep=None"):
        CheckpointStore(tmp_path / "run", keep=None).prune(keep=0)
    assert steps_on_disk(tmp_path / "run") == [1, 2, 3]


def test_an_empty_dir_is_refused_rather_than_the_current_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    three_checkpoints(tmp_path)
    monkeypatch.chdir(tmp_path)
    for empty in ("", "  "):
        with refused(f"Checkpointer(dir={empty!r})", 'dir="runs/exp1"'):
            Checkpointer(empty, keep=1, **QUIET)
    assert steps_on_disk(tmp_path) == [1, 2, 3]


def test_a_refused_loop_saves_nothing(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "run", counter=Counter(), **QUIET)
    with refused("Checkpointer.steps(total=-1)", "ckpt.steps(10_000)"):
        list(ckpt.steps(-1))
    assert steps_on_disk(tmp_path / "run") == []


# -- Checkpointer(...) -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dir", "says", "fix"),
    [
        (None, "Checkpointer(dir=None): a folder is needed", 'dir="runs/exp1"'),
        (123, "Checkpointer(dir=123): an int is not a folder", "pathlib.Path"),
        (b"runs", "Checkpointer(dir=b'runs')", 'dir="runs/exp1"'),
        ("nosuchscheme://x", "nosuchscheme:// is not a URL scheme fsspec knows", "memory://"),
    ],
)
def test_dir_is_checked(dir: Any, says: str, fix: str) -> None:
    with pytest.raises(ArgumentError, match=re.escape(says) + "(?s:.*)" + re.escape(fix)):
        Checkpointer(dir, **QUIET)


def test_a_path_and_a_url_are_taken(tmp_path: Path) -> None:
    assert Checkpointer(tmp_path / "run", **QUIET).store.location == str(tmp_path / "run")
    url = f"memory://nbresume-arguments-{tmp_path.name}"
    ckpt = Checkpointer(url, counter=Counter(), **QUIET)
    assert ckpt.save(step=1) is not None


def test_a_scheme_whose_package_is_missing_says_what_to_install(tmp_path: Path) -> None:
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("gcsfs is installed here")
    with pytest.raises(UsageError, match="pip install gcsfs"):
        Checkpointer("gs://bucket/run", **QUIET)


@pytest.mark.parametrize(
    ("every", "says"),
    [
        (0, "Checkpointer(every=0): a cadence is at least 1 step"),
        (-5, "Checkpointer(every=-5)"),
        (True, "Checkpointer(every=True): a bool is not a cadence"),
        (float("nan"), "Checkpointer(every=nan)"),
        (-1.0, "Checkpointer(every=-1.0)"),
        ([1], "Checkpointer(every=[1]): a list is not a cadence"),
        ("soon", "Checkpointer(every='soon')"),
        ("0s", "Checkpointer(every='0s')"),
        ("500", "Checkpointer(every='500'): a number without a unit"),
    ],
)
def test_every_is_checked(tmp_path: Path, every: Any, says: str) -> None:
    fix = "every=None" if every not in ("500",) else 'every="500s"'
    with refused(says, fix):
        Checkpointer(tmp_path / "run", every=every, deadline=None)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("every", "steps", "seconds", "auto"),
    [(2, 2, None, False), (np.int64(3), 3, None, False), (90.0, None, 90.0, False),
     ("15min", None, 900.0, False), ("auto", None, None, True), (None, None, None, False)],
)  # fmt: skip
def test_every_takes_steps_seconds_durations_auto_and_none(
    tmp_path: Path, every: Any, steps: int | None, seconds: float | None, auto: bool
) -> None:
    cadence = Checkpointer(tmp_path / "run", every=every, deadline=None).cadence
    assert (cadence.steps, cadence.seconds, cadence.auto) == (steps, seconds, auto)


def test_every_n_steps_saves_on_the_cadence(tmp_path: Path) -> None:
    ckpt = Checkpointer(
        tmp_path / "run", every=2, keep=None, deadline=None, async_save=False, c=Counter()
    )
    assert list(ckpt.steps(5)) == [0, 1, 2, 3, 4]
    assert steps_on_disk(tmp_path / "run") == [2, 4, 5]


@pytest.mark.parametrize(
    ("keep", "says"),
    [
        (True, "Checkpointer(keep=True): a bool is not a number of checkpoints"),
        (1.5, "Checkpointer(keep=1.5): a float is not a number of checkpoints"),
        ("3", "Checkpointer(keep='3'): a str is not a number of checkpoints"),
        (0, "Checkpointer(keep=0): keep must be at least 1"),
        (-2, "Checkpointer(keep=-2)"),
    ],
)
def test_keep_is_checked(tmp_path: Path, keep: Any, says: str) -> None:
    with refused(says, "keep=None keeps every checkpoint"):
        Checkpointer(tmp_path / "run", keep=keep, **QUIET)


def test_keep_one_and_keep_none(tmp_path: Path) -> None:
    for keep, expected in ((1, [3]), (None, [1, 2, 3])):
        folder = tmp_path / f"keep-{keep}"
        ckpt = Checkpointer(folder, keep=keep, c=Counter(), **QUIET)
        for step in (1, 2, 3):
            ckpt.save(step=step)
        assert steps_on_disk(folder) == expected


@pytest.mark.parametrize(
    ("keep_best", "says", "fix"),
    [
        (("loss",), "Checkpointer(keep_best=('loss',))", 'keep_best=("val_loss", "min")'),
        ("loss", "Checkpointer(keep_best='loss')", 'keep_best=("loss", "min")'),
        (("loss", "median"), "the mode must be 'min' or 'max'", '("loss", "max")'),
        (("loss", "min", 0), "the count must be a positive integer", '("loss", "min", 2)'),
        (("loss", "min", 1.5), "the count must be a positive integer", '("loss", "min", 2)'),
        ((3, "min"), "the metric must be a name", 'keep_best=("val_loss", "min")'),
        (("loss", "min", 2, 4), "(metric, mode) or (metric, mode, count)", "keep_best="),
    ],
)
def test_keep_best_is_checked(tmp_path: Path, keep_best: Any, says: str, fix: str) -> None:
    with refused(says, fix):
        Checkpointer(tmp_path / "run", keep_best=keep_best, **QUIET)
    with refused(says.replace("Checkpointer(", "CheckpointStore("), fix):
        CheckpointStore(tmp_path / "run", keep_best=keep_best)


def test_keep_best_as_a_list_keeps_the_best(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "run", keep=1, keep_best=["loss", "min"], **QUIET)
    ckpt["x"] = 0
    for step, loss in [(1, 0.5), (2, 0.2), (3, 0.9)]:
        ckpt.save(step=step, metric=loss)
    assert steps_on_disk(tmp_path / "run") == [2, 3]


@pytest.mark.parametrize(
    ("deadline", "says"),
    [
        (-1, "Checkpointer(deadline=-1): it must be a time of more than 0 seconds"),
        (0, "Checkpointer(deadline=0)"),
        (float("inf"), "Checkpointer(deadline=inf)"),
        (True, "Checkpointer(deadline=True): a bool is not a deadline"),
        ("tomorrow", "Checkpointer(deadline='tomorrow')"),
        ([3600], "Checkpointer(deadline=[3600]): a list is not a deadline"),
    ],
)
def test_deadline_is_checked(tmp_path: Path, deadline: Any, says: str) -> None:
    with refused(says, 'deadline="auto"'):
        Checkpointer(tmp_path / "run", every=None, deadline=deadline)


def test_a_deadline_in_seconds_or_as_a_duration_is_taken(tmp_path: Path) -> None:
    import time

    for deadline, seconds in ((3600, 3600.0), ("2h", 7200.0)):
        ckpt = Checkpointer(tmp_path / "run", every=None, deadline=deadline)
        assert ckpt.deadline is not None
        assert math.isclose(ckpt.deadline - time.time(), seconds, abs_tol=60)


@pytest.mark.parametrize("argument", ["async_save", "trainable_only"])
@pytest.mark.parametrize("value", [1, "yes", None])
def test_flags_are_true_or_false(tmp_path: Path, argument: str, value: Any) -> None:
    with refused(f"Checkpointer({argument}={value!r})", f"{argument}=True or {argument}=False"):
        Checkpointer(tmp_path / "run", every=None, deadline=None, **{argument: value})


@pytest.mark.parametrize(
    ("callbacks", "says", "fix"),
    [
        (print, "Checkpointer(callbacks=<built-in function print>)", "callbacks=[function]"),
        ([1], "Checkpointer(callbacks=[1]): 1 cannot be called", "callbacks=[function, ...]"),
        ("log", "Checkpointer(callbacks='log')", "callbacks=[function, ...]"),
    ],
)
def test_callbacks_is_a_list_of_callables(
    tmp_path: Path, callbacks: Any, says: str, fix: str
) -> None:
    with refused(says, fix):
        Checkpointer(tmp_path / "run", callbacks=callbacks, **QUIET)


@pytest.mark.parametrize("options", ["endpoint_url=x", {1: 2}])
def test_storage_options_is_a_mapping(tmp_path: Path, options: Any) -> None:
    with refused(f"Checkpointer(storage_options={options!r})", "storage_options={"):
        Checkpointer("memory://nbresume-arguments", storage_options=options, **QUIET)


# -- the loops and save() ------------------------------------------------------------------------


@pytest.mark.parametrize("total", [-1, 1.5, "10", True, None])
def test_steps_total_is_a_whole_number(tmp_path: Path, total: Any) -> None:
    ckpt = Checkpointer(tmp_path / "run", c=Counter(), **QUIET)
    with refused(f"Checkpointer.steps(total={total!r})", "ckpt.steps(10_000)"):
        ckpt.steps(total)  # at the call, before any iteration


@pytest.mark.parametrize("count", [-1, 2.0, "3", False])
def test_epochs_count_is_a_whole_number(tmp_path: Path, count: Any) -> None:
    ckpt = Checkpointer(tmp_path / "run", c=Counter(), **QUIET)
    with refused(f"Checkpointer.epochs(count={count!r})", "ckpt.epochs(90)"):
        ckpt.epochs(count)  # at the call, before any iteration


def test_zero_steps_and_numpy_totals_are_taken(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "run", c=Counter(), **QUIET)
    assert list(ckpt.steps(0)) == []
    assert ckpt.done
    assert list(ckpt.steps(np.int64(2))) == [0, 1]


@pytest.mark.parametrize(
    ("kwargs", "says", "fix"),
    [
        ({"step": -1}, "Checkpointer.save(step=-1): it must be at least 0", "ckpt.save()"),
        ({"step": 1.5}, "Checkpointer.save(step=1.5): a float is not", "ckpt.save(step=1500)"),
        ({"step": "3"}, "Checkpointer.save(step='3')", "ckpt.save(step=1500)"),
        ({"block": 1}, "Checkpointer.save(block=1)", "block=True or block=False"),
        ({"metric": "abc"}, "Checkpointer.save(metric='abc'): 'abc' is not a number", "metric="),
        ({"metric": True}, "Checkpointer.save(metric=True)", "metric=0.25"),
        ({"metric": {"acc": "0.9"}}, "Checkpointer.save(metric={'acc': '0.9'})", "metric="),
        ({"metric": {1: 0.5}}, "the name 1 is not a str", "metric="),
        ({"metric": torch.ones(3)}, "is not one number", "metric="),
    ],
)
def test_save_arguments_are_checked_and_nothing_is_written(
    tmp_path: Path, kwargs: dict[str, Any], says: str, fix: str
) -> None:
    ckpt = Checkpointer(tmp_path / "run", c=Counter(), **QUIET)
    with refused(says, fix):
        ckpt.save(**kwargs)
    assert steps_on_disk(tmp_path / "run") == []


def test_metrics_may_be_numbers_tensors_and_numpy_scalars(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "run", keep=None, c=Counter(), **QUIET)
    saved = [
        ckpt.save(step=1, metric=torch.tensor(0.25)),
        ckpt.save(step=2, metric={"acc": np.float32(0.5), "n": 3}),
        # A diverged loss is a number too: the checkpoint is saved, the metric not recorded.
        ckpt.save(step=3, metric=float("nan")),
    ]
    assert [dict(info.metrics) for info in saved if info] == [
        {"metric": 0.25},
        {"acc": 0.5, "n": 3.0},
        {},
    ]
    assert steps_on_disk(tmp_path / "run") == [1, 2, 3]


# -- CheckpointStore ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "says", "fix"),
    [
        ({"keep": 0}, "CheckpointStore(keep=0)", "keep=None keeps every checkpoint"),
        ({"keep": True}, "CheckpointStore(keep=True)", "keep=None keeps every checkpoint"),
        ({"md5": "yes"}, "CheckpointStore(md5='yes')", "md5=True or md5=False"),
        ({"check_space": None}, "CheckpointStore(check_space=None)", "check_space=True"),
        ({"storage_options": ["a"]}, "CheckpointStore(storage_options=['a'])", "storage_opt"),
    ],
)
def test_checkpoint_store_arguments_are_checked(
    tmp_path: Path, kwargs: dict[str, Any], says: str, fix: str
) -> None:
    with refused(says, fix):
        CheckpointStore(tmp_path / "run", **kwargs)


@pytest.mark.parametrize(
    ("location", "fix"),
    [(None, 'location="runs/exp1"'), ("", 'location="runs/exp1"'),
     (42, 'location="runs/exp1"'), ("nosuchscheme://x", "one of fsspec's schemes")],
)  # fmt: skip
def test_checkpoint_store_location_is_checked(location: Any, fix: str) -> None:
    with refused(f"CheckpointStore(location={location!r})", fix):
        CheckpointStore(location)


def test_prune_keep_best_is_checked_and_a_valid_prune_works(tmp_path: Path) -> None:
    three_checkpoints(tmp_path / "run")
    store = CheckpointStore(tmp_path / "run", keep=None)
    with refused("CheckpointStore.prune(keep_best='loss')", 'keep_best=("loss", "min")'):
        store.prune(keep=1, keep_best="loss")
    assert steps_on_disk(tmp_path / "run") == [1, 2, 3]
    assert store.prune(keep=2) == [1]
    assert steps_on_disk(tmp_path / "run") == [2, 3]
