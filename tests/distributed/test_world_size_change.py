"""One run across machines of different shapes: a leg on two ranks, the next on one, the
next on two again (Kaggle's two T4s, then Colab's one, then Kaggle again), each leg a fresh
job on gloo that resumes from the folder the previous leg left (``legs_worker.py``).

Every leg continues from the previous leg's last checkpoint, every sample is trained exactly
once per epoch across all legs and ranks, the ranks that existed keep their random streams
and a new rank gets streams derived from the checkpoint, so the same legs run twice end with
the same bits; with a DDP model (replicated) and with an FSDP2 model (resharded).
"""

from __future__ import annotations

import io
import json
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from .rank_server import RankServer
from .teardown import RankEnd, problems

WORKER = Path(__file__).with_name("legs_worker.py")
SAMPLES = 48
#: The legs of one run: (ranks, stop after this step; None: train to the end).
LEGS = ((2, 10), (1, 16), (2, None))
#: The steps of the checkpoints left after each leg (every=3, keep=3; a stop saves its step).
KEPT_AFTER = ([6, 9, 10], [10, 13, 16], [19, 22, 24])


class Legs(RankServer):
    """The worker server: each :meth:`run` forks the ranks of one fresh job and returns
    their lines."""

    def __init__(self, tmp: Path) -> None:
        super().__init__(WORKER, tmp)


@dataclass
class Leg:
    """What the ranks of one leg printed."""

    ranks: int
    lines: list[str]

    def said(self, rank: int, word: str) -> list[str]:
        prefix = f"rank{rank} {word} "
        return [line[len(prefix) :] for line in self.lines if line.startswith(prefix)]

    def one(self, rank: int, word: str) -> str:
        (value,) = self.said(rank, word)
        return value

    def assert_ended_well(self) -> None:
        """Every rank exited 0, or died of torch's gloo teardown crash after it reported
        everything (see teardown.py)."""
        codes = {
            int(rank): int(code)
            for _, rank, code in (line.split() for line in self.lines if line.startswith("exit "))
        }
        assert sorted(codes) == list(range(self.ranks)), self.lines
        ends = []
        for rank, code in codes.items():
            own = [line for line in self.lines if line.startswith(f"rank{rank} ")]
            stderr = [line[len(f"rank{rank} stderr ") :] for line in own if " stderr " in line]
            said = tuple(line.split(" ", 1)[1] for line in own if " stderr " not in line)
            ends.append(RankEnd(rank, code, said, "\n".join(stderr)))
        trouble = problems(ends)
        assert not trouble, "; ".join(trouble) + "\n" + "\n".join(self.lines)


@dataclass
class Run:
    """The legs of one run, and what its folder held before and after each leg."""

    root: Path
    legs: list[Leg]
    kept: list[list[int]]


def steps_in(root: Path) -> list[int]:
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit())


def manifests(root: Path) -> dict[int, bytes]:
    return {step: (root / f"{step:012d}" / "manifest.json").read_bytes() for step in steps_in(root)}


def run_legs(legs: Legs, root: Path, model: str) -> Run:
    done: list[Leg] = []
    kept: list[list[int]] = []
    for ranks, stop in LEGS:
        stop_args = ("--stop-after", stop) if stop is not None else ()
        leg = Leg(ranks, legs.run("leg", ranks, root, "--model", model, *stop_args))
        leg.assert_ended_well()
        done.append(leg)
        kept.append(steps_in(root))
    return Run(root, done, kept)


@pytest.fixture(scope="module")
def legs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Legs]:
    started = Legs(tmp_path_factory.mktemp("legs-tmp"))
    yield started
    started.close()


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def runs(
    request: pytest.FixtureRequest, legs: Legs, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Run, Run]:
    """The same legs (2, 1, 2 ranks) run twice, each run in a folder of its own."""
    base = tmp_path_factory.mktemp(f"legs-{request.param}")
    return run_legs(legs, base / "a", request.param), run_legs(legs, base / "b", request.param)


def test_each_leg_resumes_from_the_previous_leg_s_last_checkpoint(runs: tuple[Run, Run]) -> None:
    run = runs[0]
    starts = [sorted({int(leg.one(r, "start")) for r in range(leg.ranks)}) for leg in run.legs]
    assert starts == [[0], [10], [16]], "\n".join(run.legs[2].lines)
    finals = [{leg.one(r, "final").split()[0] for r in range(leg.ranks)} for leg in run.legs]
    assert finals == [{"10"}, {"16"}, {"24"}]
    # Nothing newer than the checkpoint a leg resumed from was deleted: each leg resumed from
    # the newest one, and retention removed only older ones.
    assert run.kept == [list(k) for k in KEPT_AFTER]
    assert [max(kept) for kept in run.kept[:-1]] == [10, 16]


def test_every_sample_is_trained_once_per_epoch_across_legs_and_ranks(
    runs: tuple[Run, Run],
) -> None:
    run = runs[0]
    trained: dict[int, list[int]] = {0: [], 1: []}
    steps: list[int] = []
    for leg in run.legs:
        for rank in range(leg.ranks):
            for line in leg.said(rank, "batch"):
                step, epoch, indices = line.split()
                trained[int(epoch)] += [int(i) for i in indices.split(",")]
                if rank == 0:
                    steps.append(int(step))
    assert steps == list(range(1, 25)), "each step once, in order"
    for epoch, samples in trained.items():
        repeated = sorted(i for i, n in Counter(samples).items() if n > 1)
        assert sorted(samples) == list(range(SAMPLES)), f"epoch {epoch}: repeated {repeated}"


def test_the_same_legs_run_twice_end_with_the_same_bits(runs: tuple[Run, Run]) -> None:
    first, second = runs
    for one, other in zip(first.legs, second.legs, strict=True):
        finals = {one.one(r, "final") for r in range(one.ranks)}
        assert len(finals) == 1, "the ranks of a leg hold the same model"
        assert finals == {other.one(r, "final") for r in range(other.ranks)}


def test_ranks_that_existed_keep_their_streams_and_a_new_rank_gets_derived_ones(
    runs: tuple[Run, Run],
) -> None:
    first, second = runs
    one, two, three = first.legs
    # Rank 0 continues its own streams from leg to leg.
    assert two.one(0, "rng-start") == one.one(0, "rng-end")
    assert three.one(0, "rng-start") == two.one(0, "rng-end")
    # Rank 1 of the last leg had no streams in the one-rank checkpoint: it gets new ones,
    # neither its seeded ones (1234 + rank) nor rank 0's, and the same in both runs.
    new = three.one(1, "rng-start")
    assert new not in (one.one(1, "rng-start"), three.one(0, "rng-start"))
    assert new == second.legs[2].one(1, "rng-start")


def test_the_change_of_world_size_is_said_once_by_the_leading_rank(runs: tuple[Run, Run]) -> None:
    said = [
        [(r, w) for r in range(leg.ranks) for w in leg.said(r, "warning") if "world size" in w]
        for leg in runs[0].legs
    ]
    assert [[(r, w.split(" at step")[0]) for r, w in leg] for leg in said] == [
        [],
        [(0, "nbresume: the world size changed from 2 to 1 process(es)")],
        [(0, "nbresume: the world size changed from 1 to 2 process(es)")],
    ]
    text = said[2][0][1]
    assert "rank 1 gets streams derived from the checkpoint" in text
    assert "reproducible (the same legs give the same bits)" in text
    assert "not bit-identical to a run that never changed shape" in text


def test_the_status_line_says_the_world_size_changed(legs: Legs, tmp_path: Path) -> None:
    """A one-process leg in this process (no process group) after a two-rank leg: restoring
    the two-rank checkpoint puts the change in the live line of a terminal."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler

    import nbresume
    from nbresume.notebook.progress import Tracker
    from nbresume.notebook.status_line import StatusLine

    from .legs_worker import Numbered

    folder = tmp_path / "run"
    Leg(2, legs.run("leg", 2, folder, "--stop-after", 10)).assert_ended_well()
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    sampler = DistributedSampler(Numbered(), num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = DataLoader(sampler.dataset, batch_size=4, sampler=sampler)
    tracker = Tracker()
    screen = io.StringIO()
    line = StatusLine(tracker, screen, tty=True)
    tracker.add_view(line)
    ck = nbresume.Checkpointer(
        folder, every=None, deadline=None, quiet=True, model=model, optimizer=optimizer
    )
    tracker.attach(ck)
    data = ck.loader(loader)
    rng_before = torch.get_rng_state()
    try:
        assert ck.restore() == 10
        assert ck.reshaped == (2, 1)
        assert data.position == 10  # 40 samples: 10 batches of 1 process x 4
        assert not torch.equal(torch.get_rng_state(), rng_before)  # rank 0's streams
        assert "world size 2 → 1: reproducible, not identical" in line.line(tracker.snapshot())
        assert tracker.snapshot().message.startswith("the world size changed from 2 to 1")
    finally:
        ck.close()
        torch.set_rng_state(rng_before)


def test_a_global_batch_that_does_not_divide_is_refused_with_the_fix(
    legs: Legs, tmp_path: Path
) -> None:
    root = tmp_path / "run"
    first = Leg(2, legs.run("leg", 2, root, "--stop-after", 5))  # 20 samples of epoch 0
    first.assert_ended_well()
    before = manifests(root)
    refused = Leg(1, legs.run("leg", 1, root, "--batch", 3))
    (error,) = refused.said(0, "error")
    assert error.startswith("UsageError the global batch changed from 4 (2 process(es) x "), error
    assert "20 samples of it were trained" in error
    assert "Fix: keep the global batch: batch_size = 4 // world_size" in error
    assert refused.said(0, "start") == []  # refused at the restore, before any step
    # The folder is as the first leg left it: nothing passed over, nothing written.
    assert manifests(root) == before
    again = Leg(1, legs.run("leg", 1, root, "--stop-after", 7))  # 4 per batch divides 20
    again.assert_ended_well()
    assert again.one(0, "start") == "5"


def test_a_loader_state_that_does_not_say_how_its_data_was_split_is_refused_mid_epoch(
    legs: Legs, forge_manifest: Callable[..., Path], tmp_path: Path
) -> None:
    """A checkpoint of an earlier nbresume, whose loader state holds no ``replicas``: in a job
    of another number of processes its epoch cannot be found exactly."""
    root = tmp_path / "run"
    Leg(2, legs.run("leg", 2, root, "--stop-after", 5)).assert_ended_well()
    newest = root / "000000000005"
    state = json.loads((newest / "state.json").read_text())
    for key in ("replicas", "batches"):
        del state["objects"]["loader"][key]
    (newest / "state.json").write_text(json.dumps(state))
    forge_manifest(newest)
    refused = Leg(1, legs.run("leg", 1, root))
    error = refused.one(0, "error")
    assert "an nbresume that did not record how the data was split" in error, error
    assert "Fix: finish this epoch with 2 process(es)" in error
    assert refused.said(0, "start") == []
    assert steps_in(root) == [3, 5]


@pytest.mark.parametrize("field", ["replicas", "batch_size"])
def test_a_loader_position_of_zero_replicas_or_batch_is_passed_over_at_another_world_size(
    legs: Legs, forge_manifest: Callable[..., Path], tmp_path: Path, field: str
) -> None:
    """A loader position that records 0 processes or a batch of 0 cannot be split again for
    another number of processes: a job of one process passes over the checkpoint as damage,
    naming it, and resumes from the one before, as a job of the same size does."""
    root = tmp_path / "run"
    Leg(2, legs.run("leg", 2, root, "--stop-after", 5)).assert_ended_well()
    newest = root / "000000000005"
    state = json.loads((newest / "state.json").read_text())
    state["objects"]["loader"][field] = 0
    (newest / "state.json").write_text(json.dumps(state))
    forge_manifest(newest)
    resumed = Leg(1, legs.run("leg", 1, root, "--stop-after", 7))
    resumed.assert_ended_well()
    assert resumed.said(0, "error") == []
    assert resumed.one(0, "start") == "3"
    skipped = [w for w in resumed.said(0, "warning") if "000000000005" in w]
    assert len(skipped) == 1, resumed.said(0, "warning")
    assert f"'{field}' is 0" in skipped[0], skipped


def test_each_rank_s_own_seeded_streams_survive_the_wrapped_loader(
    legs: Legs, tmp_path: Path
) -> None:
    """``torch.manual_seed(1234 + rank)`` (and random, NumPy) in each rank: taking batches
    through ``ck.loader(dl)`` draws nothing from them."""
    job = Leg(2, legs.run("streams", 2, tmp_path / "run"))
    job.assert_ended_well()
    assert job.said(0, "streams") == job.said(1, "streams") == ["same"]


def test_a_data_parallel_job_gathers_what_fsdp2_ranks_saved(legs: Legs, tmp_path: Path) -> None:
    """Two FSDP2 ranks save at step 10; a job of two plain DDP ranks resumes from it: each
    process gathers the shards into its whole model and optimizer, and the run ends with
    the bits of one that went on sharded."""
    sharded, plain = tmp_path / "sharded", tmp_path / "plain"
    for root in (sharded, plain):
        Leg(2, legs.run("leg", 2, root, "--model", "fsdp", "--stop-after", 10)).assert_ended_well()
    went_on = Leg(2, legs.run("leg", 2, sharded, "--model", "fsdp"))
    went_on.assert_ended_well()
    switched = Leg(2, legs.run("leg", 2, plain, "--model", "ddp"))
    switched.assert_ended_well()

    assert switched.one(0, "start") == switched.one(1, "start") == "10"
    assert not [w for r in (0, 1) for w in switched.said(r, "warning") if "skipped" in w]
    assert switched.one(0, "final") == switched.one(1, "final") == went_on.one(0, "final")
