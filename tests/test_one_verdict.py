"""One verdict: every reader of the package says the same of every hostile folder of the tests.

Each folder holds an older checkpoint that is good and a newer one that is damaged (or, for
the control rows, intact). Every reader a user runs on such a folder (``nbresume verify``,
``restore()``, ``Checkpointer.verify()`` (which also checks that each checkpoint fits the
objects, as restore does), ``CheckpointStore.load`` (what push and Lightning's ``CheckpointIO`` read
through), ``nbresume pull``, ``nbresume push`` (to a fake Kaggle on loopback),
``nbresume.hf.last_checkpoint``, the Lightning reader) runs on it
in one bounded child process per kind of folder, and each reader's verdict on the newer
checkpoint is read from what it did: it took it (``OK``) or passed it over (``passed over``:
failed it naming it, took the older one, or refused it when it was the only one). Every row
must get one verdict from every reader, the one its damage calls for.

The corpus: the damages of ``test_hostile_folders.py`` (Trainer folders, generator states,
Lightning documents, what a checkpoint can make a reader allocate), the counters of
``test_verdict.py``, and the sharded metadata of ``distributed/test_sharded.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.distributed.test_sharded import SHARDED_DAMAGES, Cluster, assert_ended_well
from tests.test_hostile_folders import (
    BUDGET,
    CHILD,
    LIGHTNING_DAMAGES,
    MEMORY_DAMAGES,
    RNG_DAMAGES,
    TRAINER_DAMAGES,
    edit_rng,
    failed_lines,
    lightning_ckpt,
    trainer_checkpoint,
)
from tests.test_loadable import reseal
from tests.test_verdict import DAMAGES as COUNTER_DAMAGES
from tests.test_verdict import edit_state
from torch.utils.data import DataLoader, TensorDataset

from nbresume.pull import SAFE_LINE
from testkit import warmfork
from testkit.fake_kaggle import FakeKaggle

pytestmark = pytest.mark.slow

#: What every process a push test starts loads: it refuses any connection off loopback.
NETGUARD = Path(__file__).parent / "kaggle" / "netguard"

OK, PASSED_OVER = "OK", "passed over"
INTACT = "intact (the control)"


def run_ops(
    ops: list[tuple[str, str]], kaggle: Mapping[str, str] | None = None
) -> list[dict[str, Any]]:
    """The reports of ``ops`` run in one child of bounded memory (``hostile_child.py``);
    ``kaggle``: the environment that points a push at the fake Kaggle (:func:`kaggle_env`)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("NBRESUME_", "KAGGLE_"))
        and k.lower() not in ("http_proxy", "https_proxy", "no_proxy", "all_proxy")
    }
    paths = [str(CHILD.parent.parent / "src"), env.get("PYTHONPATH", "")]
    if kaggle is not None:
        env.update(kaggle)
        paths.insert(0, str(NETGUARD))  # nothing the child does leaves loopback
    env["PYTHONPATH"] = os.pathsep.join(paths)
    # The network guard is a sitecustomize, which only a starting interpreter runs: a child
    # that pushes is new, the others fork from the warm server.
    start = subprocess.run if kaggle is not None else warmfork.run
    done = start(
        [sys.executable, str(CHILD), str(BUDGET), *[part for op in ops for part in op]],
        capture_output=True,
        text=True,
        timeout=60 + 5 * len(ops),
        env=env,
    )
    output = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, output
    assert "Traceback" not in done.stdout + done.stderr, output
    reports: list[dict[str, Any]] = json.loads(done.stdout.splitlines()[-1])["reports"]
    return reports


def verdict(report: dict[str, Any], good: tuple[int, str], newer: tuple[int, str]) -> str:
    """What one reader did with the newer checkpoint of a folder whose older one (``good``)
    is intact: each a (step, folder name or path)."""
    op, result = report["op"], report["result"]
    text = report["out"] + "\n".join(report["warnings"])
    name = newer[1].rsplit("/", 1)[-1]
    if op in ("verify", "verify-objects", "verify-objects-plain"):
        failed = failed_lines(report)
        if result == 0 and not failed:
            return OK
        if result == 1 and len(failed) == 1 and name in failed[0]:
            return PASSED_OVER
    elif op == "pull":
        if result == 0 and SAFE_LINE in report["out"]:
            return OK
        if result == 1 and f"FAIL  {newer[1]}" in text and f"OK    {good[1]}" in text:
            return PASSED_OVER
    elif op == "push":
        uploaded = "uploaded as a new version" in report["out"]
        if result == 0 and uploaded and f"continues from step {newer[0]}" in report["out"]:
            return OK
        refused = f"checkpoint {newer[0]} ({name}) does not verify" in text
        if result == 1 and refused and f"pass --step {good[0]}" in text and not uploaded:
            return PASSED_OVER  # never the older step in its place, unless --step asks
    elif op in ("restore", "restore-plain", "load"):
        if result == newer[0]:
            return OK
        skipped = [w for w in report["warnings"] if "skipped" in w and name in w]
        if result == good[0] and skipped:
            return PASSED_OVER
        if str(result).startswith("error: no checkpoint verifies") and name in str(result):
            return PASSED_OVER  # the store holds the newer checkpoint alone
    elif op in ("hf", "lightning"):
        if result == newer[1]:
            return OK
        if result == good[1]:
            return PASSED_OVER
    return f"{op} did something else: {result!r} {text[-600:]!r}"


def check_table(rows: dict[str, list[str]]) -> None:
    """Every row got one verdict from every reader: OK for the control, else passed over."""
    wrong = {
        name: verdicts
        for name, verdicts in rows.items()
        if set(verdicts) != {OK if name == INTACT else PASSED_OVER}
    }
    assert not wrong, "\n".join(f"{name}: {verdicts}" for name, verdicts in wrong.items())


@pytest.fixture(scope="module")
def kaggle_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A fake Kaggle on loopback that ``push`` uploads to, and the environment that points the
    real kaggle client at it behind the tests' network guard; afterwards, nothing tried to
    leave loopback."""
    if importlib.util.find_spec("kaggle") is None:
        pytest.skip("push needs the kaggle client: pip install 'nbresume[kaggle]'")
    folder = tmp_path_factory.mktemp("kaggle")
    server = FakeKaggle(folder / "server")
    server.sitecustomize_dir = NETGUARD
    server.start()
    log = folder / "refused-connections.log"
    log.touch()
    (folder / "config").mkdir()
    env = {**server.client_env(folder / "config"), "NBRESUME_TEST_NET_LOG": str(log)}
    try:
        yield env
    finally:
        server.stop()
    assert log.read_text() == "", "a push tried to leave loopback"
    assert server.violations == [], server.violations


# -- a Checkpointer's run ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of :func:`hostile_child.build` saved at steps 10 and 20 with a data loader's
    position (3 and 6 batches into its first epoch)."""
    from tests.hostile_child import build

    from nbresume import Checkpointer

    folder = tmp_path_factory.mktemp("template") / "run"
    model, optimizer = build()
    loader = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4, shuffle=True)
    ckpt = Checkpointer(
        folder, model=model, optimizer=optimizer, loader=loader, every=None, deadline=None,
        async_save=False, keep=None, quiet=True,
    )  # fmt: skip
    for index, _ in enumerate(ckpt.loader(), start=1):
        if index == 3:
            ckpt.save(10)
        if index == 6:
            ckpt.save(20)
            break
    ckpt.close()
    return folder


def with_reseal(damage: Callable[[Path], str]) -> Callable[[Path], None]:
    def damaged(folder: Path) -> None:
        damage(folder)
        reseal(folder)

    return damaged


RUN_DAMAGES: dict[str, Callable[[Path], Any]] = {
    INTACT: lambda folder: None,
    "model.safetensors missing": lambda folder: (folder / "model.safetensors").unlink(),
    **{name: (lambda f, c=change: edit_rng(f, c)) for name, change in RNG_DAMAGES.items()},
    **{name: with_reseal(damage) for name, damage in MEMORY_DAMAGES.items()},
    **{
        name: (lambda f, c=change: edit_state(f, c))
        for name, (change, _) in COUNTER_DAMAGES.items()
    },
}


def check_damaged_copies(
    template: Path,
    damages: dict[str, Callable[[Path], Any]],
    tmp_path: Path,
    restore: str,
    kaggle: Mapping[str, str],
    *,
    good: int,
    newer: int,
) -> None:
    """Each damage done to the step ``newer`` of its own copy of the run ``template``: verify,
    ``restore`` and the same Checkpointer's ``verify()`` (``verify-objects`` with the objects of
    ``restore``), load, pull and push (to the fake Kaggle ``kaggle`` points at) each give every
    copy the same verdict (``good`` is the step before, which is intact)."""
    ops, rows = [], list(damages)
    verify_objects = restore.replace("restore", "verify-objects")
    for index, name in enumerate(rows):
        run = Path(shutil.copytree(template, tmp_path / f"run{index}"))
        damages[name](run / f"{newer:012d}")
        ops += [("verify", str(run)), (restore, str(run)), (verify_objects, str(run))]
        ops.append(("load", str(run)))
        ops.append(("pull", f"{run}:{tmp_path / f'pulled{index}'}"))
        ops.append(("push", str(run)))
    reports = run_ops(ops, kaggle)
    steps = (good, f"{good:012d}"), (newer, f"{newer:012d}")
    check_table(
        {
            name: [verdict(r, *steps) for r in reports[6 * index : 6 * index + 6]]
            for index, name in enumerate(rows)
        }
    )


def test_every_reader_gives_a_checkpointer_s_run_the_same_verdict(
    run_template: Path, kaggle_env: dict[str, str], tmp_path: Path
) -> None:
    check_damaged_copies(
        run_template, RUN_DAMAGES, tmp_path, "restore", kaggle_env, good=10, newer=20
    )


# -- a run two FSDP2 ranks saved, read in one process ----------------------------------------


@pytest.fixture(scope="module")
def sharded_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Checkpointer's run of an FSDP2 model and optimizer on two ranks, steps 2 and 3."""
    base = tmp_path_factory.mktemp("fsdp2")
    cluster = Cluster()
    try:
        lines = cluster.run("train", base / "run", base, "--total", 6, "--stop-after", 3)
    finally:
        cluster.close()
    assert_ended_well(lines)
    return base / "run"


def shards_removed(folder: Path) -> None:
    """The sharded files gone and out of the manifest: what is left hashes right, and its
    state.json still says the model and optimizer are sharded."""
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    for name in [n for n in manifest["files"] if n.startswith("sharded.")]:
        del manifest["files"][name]
        (folder / name).unlink()
    path.write_text(json.dumps(manifest))


def sharded_object_unknown(folder: Path) -> None:
    def change(state: dict[str, Any]) -> None:
        state["sharded"] = [*state["sharded"], "ema"]

    edit_state(folder, change)


def test_every_reader_gives_a_sharded_run_the_same_verdict(
    sharded_template: Path, kaggle_env: dict[str, str], tmp_path: Path
) -> None:
    damages: dict[str, Callable[[Path], Any]] = {
        INTACT: lambda folder: None,
        **SHARDED_DAMAGES,
        "the sharded files removed, and the manifest's entries": shards_removed,
        "a sharded object the metadata does not hold": sharded_object_unknown,
    }
    check_damaged_copies(
        sharded_template, damages, tmp_path, "restore-plain", kaggle_env, good=2, newer=3
    )


# -- the frameworks' folders --------------------------------------------------------------------


def test_every_reader_gives_a_trainer_s_output_dir_the_same_verdict(tmp_path: Path) -> None:
    damages: dict[str, Callable[[Path], Any]] = {INTACT: lambda folder: None, **TRAINER_DAMAGES}
    ops, rows = [], list(damages)
    for index, name in enumerate(rows):
        out = tmp_path / f"out{index}"
        trainer_checkpoint(out, 2)
        damages[name](trainer_checkpoint(out, 4))
        ops += [("verify", str(out)), ("hf", str(out))]
    reports = run_ops(ops)
    table = {}
    for index, name in enumerate(rows):
        out = tmp_path / f"out{index}"
        good, newer = (2, str(out / "checkpoint-2")), (4, str(out / "checkpoint-4"))
        table[name] = [verdict(r, good, newer) for r in reports[2 * index : 2 * index + 2]]
    check_table(table)
    assert not any(p.name == "ran" for p in tmp_path.iterdir())  # nothing in a pickle ran


def test_every_reader_gives_a_lightning_folder_the_same_verdict(tmp_path: Path) -> None:
    damages: dict[str, Callable[[Path], Any]] = {INTACT: lambda folder: None, **LIGHTNING_DAMAGES}
    ops, rows = [], list(damages)
    for index, name in enumerate(rows):
        folder = tmp_path / f"checkpoints{index}"
        lightning_ckpt(folder / "epoch=0-step=2.ckpt", 2)
        damages[name](lightning_ckpt(folder / "epoch=0-step=4.ckpt", 4))
        ops += [("verify", str(folder)), ("lightning", str(folder))]
        ops.append(("load", str(folder / "epoch=0-step=4.ckpt")))
    reports = run_ops(ops)
    table = {}
    for index, name in enumerate(rows):
        folder = tmp_path / f"checkpoints{index}"
        good = (2, str(folder / "epoch=0-step=2.ckpt"))
        newer = (4, str(folder / "epoch=0-step=4.ckpt"))
        table[name] = [verdict(r, good, newer) for r in reports[3 * index : 3 * index + 3]]
    check_table(table)
