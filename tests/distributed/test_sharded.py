"""Sharded checkpoints: FSDP2 shards through torch.distributed.checkpoint, inside the commit
protocol. Two real ranks (forked processes, gloo on loopback) save and restore; this process
only starts them, damages files between runs, and reads the checkpoint folder as a stranger.

The single-process tests at the end run the same code without a process group (one rank).
"""

from __future__ import annotations

import json
import pickle
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from tests.test_loadable import reseal

from nbresume.checkpoint.format import MANIFEST_NAME, TEMP_PREFIX
from nbresume.checkpoint.parallel import load_sharded, save_sharded
from nbresume.checkpoint.store import CheckpointStore
from nbresume.errors import CheckpointError, NoCheckpointError

from .rank_server import RankServer
from .teardown import RankEnd, problems

WORKER = Path(__file__).parent / "sharded_worker.py"


class Cluster(RankServer):
    """The worker server: each :meth:`run` forks the ranks of one fresh job and returns
    their lines."""

    def __init__(self) -> None:
        super().__init__(WORKER)


def said(lines: list[str], rank: int, word: str) -> list[str]:
    """What ``rank`` printed after ``word`` (one entry per such line)."""
    prefix = f"rank{rank} {word} "
    return [line[len(prefix) :] for line in lines if line.startswith(prefix)]


def exits(lines: list[str]) -> dict[int, int]:
    return {
        int(rank): int(code)
        for _, rank, code in (line.split() for line in lines if line.startswith("exit "))
    }


def assert_ended_well(lines: list[str]) -> None:
    """Both ranks exited 0, or one died of torch's gloo teardown crash after it reported
    everything (see teardown.py)."""
    codes = exits(lines)
    assert sorted(codes) == [0, 1], lines
    ends = []
    for rank, code in codes.items():
        prefix, stderr = f"rank{rank} ", f"rank{rank} stderr "
        own = [line for line in lines if line.startswith(prefix)]
        ends.append(
            RankEnd(
                rank,
                code,
                tuple(line[len(prefix) :] for line in own if not line.startswith(stderr)),
                "\n".join(line[len(stderr) :] for line in own if line.startswith(stderr)),
            )
        )
    trouble = problems(ends)
    assert not trouble, "; ".join(trouble) + "\n" + "\n".join(lines)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    started = Cluster()
    yield started
    started.close()


@pytest.fixture(scope="module")
def saved(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Steps 1, 2 and 3 of a two-rank FSDP2 run, and the full state of each step."""
    base = tmp_path_factory.mktemp("sharded")
    root, expected = base / "root", base / "expected"
    expected.mkdir()
    lines = cluster.run("save", root, expected)
    assert_ended_well(lines)
    assert said(lines, 0, "saved") == said(lines, 1, "saved") == ["1", "2", "3"], lines
    return root, expected


def copy_of(saved: tuple[Path, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved[0], tmp_path / "root"))


def test_every_rank_s_shards_are_in_one_manifest(saved: tuple[Path, Path], tmp_path: Path) -> None:
    root = copy_of(saved, tmp_path)
    newest = root / "000000000003"
    manifest = json.loads((newest / MANIFEST_NAME).read_text())
    # The manifest describes exactly what is on disk: each rank's shards, the metadata, the
    # rest of the state, and nothing else.
    on_disk = {p.name for p in newest.iterdir()} - {MANIFEST_NAME}
    assert set(manifest["files"]) == on_disk
    assert {
        "sharded.metadata.json",
        "sharded.rank00000.safetensors",
        "sharded.rank00001.safetensors",
        "progress.json",
    } <= on_disk
    assert CheckpointStore(root).verify().summary == "OK 3/3, errors 0"


def test_a_flipped_byte_or_a_planted_pickle_is_refused_before_anything_loads(
    cluster: Cluster, saved: tuple[Path, Path], tmp_path: Path
) -> None:
    root = copy_of(saved, tmp_path)
    shard = root / "000000000003" / "sharded.rank00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    # A metadata file that runs code when unpickled: it would create `marker`.
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_CreatesFile(str(marker)))
    (root / "000000000002" / "sharded.metadata.json").write_bytes(payload)

    lines = cluster.run("restore", root, saved[1])

    assert_ended_well(lines)
    # Both ranks pass over steps 3 and 2 with the store's warning, and load step 1 exactly.
    assert said(lines, 0, "restored") == said(lines, 1, "restored") == ["1 same"], lines
    for rank in (0, 1):
        [warning] = said(lines, rank, "warning")
        assert warning.startswith("nbresume: skipped 2 newer checkpoint(s)"), warning
        assert "000000000003/sharded.rank00001.safetensors" in warning
        assert "000000000002/sharded.metadata.json" in warning
        assert "xxh3-128 mismatch" in warning
        assert warning.endswith("using step 1")
    assert not marker.exists()


def kill_save(cluster: Cluster, root: Path, expected: Path, rank: int, at: str) -> None:
    """With steps 1-3 in ``root``, kill ``rank`` inside the save of step 4 (before it creates
    the file ``at`` in the temporary folder, or with ``commit`` before the rename into place)."""
    lines = cluster.run(
        "save", root, expected, "--kill-at-step", 4, "--kill-rank", rank, "--kill-file", at,
        "--kill-only",
    )  # fmt: skip
    assert exits(lines)[rank] == -9, lines
    assert exits(lines)[1 - rank] != 0, lines  # its peer lost, the other rank fails
    assert not said(lines, 0, "saved"), lines
    assert [info.step for info in CheckpointStore(root).list()] == [1, 2, 3]
    assert CheckpointStore(root).verify().summary == "OK 3/3, errors 0"


def test_a_kill_during_a_sharded_save_leaves_nothing_restore_would_take(
    cluster: Cluster, saved: tuple[Path, Path], tmp_path: Path
) -> None:
    root, expected = copy_of(saved, tmp_path), saved[1]
    # Rank 0 dies just before it renames the complete folder of step 4, manifest included,
    # into place: every rank's files are in the hidden folder, and it still is no checkpoint.
    kill_save(cluster, root, expected, rank=0, at="commit")
    [leftover] = [p for p in root.iterdir() if p.name.startswith(TEMP_PREFIX)]
    assert "000000000004" in leftover.name
    assert {"manifest.json", "sharded.rank00001.safetensors"} <= {
        p.name for p in leftover.iterdir()
    }

    # Fresh processes restore step 3 on every rank, exactly as it was saved.
    lines = cluster.run("restore", root, expected)

    assert_ended_well(lines)
    assert said(lines, 0, "restored") == said(lines, 1, "restored") == ["3 same"], lines
    assert not said(lines, 0, "warning"), lines


@pytest.mark.torture
@pytest.mark.parametrize(
    ("rank", "at"),
    [
        (1, "sharded.rank00001.safetensors"),
        (0, "sharded.rank00000.safetensors"),
        (0, "sharded.metadata.json"),
        (0, "progress.json"),
        (0, "manifest.json"),
        (0, "commit"),
    ],
)
def test_a_kill_at_any_point_of_a_sharded_save_leaves_the_last_checkpoint(
    cluster: Cluster, saved: tuple[Path, Path], tmp_path: Path, rank: int, at: str
) -> None:
    root, expected = copy_of(saved, tmp_path), saved[1]
    kill_save(cluster, root, expected, rank=rank, at=at)

    lines = cluster.run("restore", root, expected)

    assert said(lines, 0, "restored") == said(lines, 1, "restored") == ["3 same"], lines


def test_a_checkpointer_of_an_fsdp2_model_resumes_bit_exact(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The Checkpointer takes the sharded model and optimizer as any other: a run stopped at
    step 3 and resumed ends with the weights of a run that was never interrupted."""
    lines = cluster.run("train", tmp_path / "whole", tmp_path, "--total", 6)
    assert_ended_well(lines)
    [uninterrupted] = said(lines, 0, "final")
    assert said(lines, 1, "final") == [uninterrupted]
    assert uninterrupted.startswith("6 ")

    lines = cluster.run("train", tmp_path / "run", tmp_path, "--total", 6, "--stop-after", 3)
    assert_ended_well(lines)
    latest = CheckpointStore(tmp_path / "run").latest()
    assert latest is not None
    assert latest.step == 3
    assert {"state.json", "sharded.metadata.json", "sharded.rank00001.safetensors"} <= set(
        latest.manifest.files
    )
    lines = cluster.run("train", tmp_path / "run", tmp_path, "--total", 6)

    assert_ended_well(lines)
    # Checkpointer.verify() of the sharded job, on every rank: both whole, both fit.
    assert said(lines, 0, "verified") == said(lines, 1, "verified") == ["OK 2/2, errors 0"]
    assert said(lines, 0, "start") == said(lines, 1, "start") == ["3"], lines
    assert said(lines, 0, "final") == said(lines, 1, "final") == [uninterrupted], lines
    assert CheckpointStore(tmp_path / "run").verify().ok


def test_checkpointer_verify_of_another_fsdp2_model_fails_what_its_restore_refuses(
    cluster: Cluster, fsdp2_run: Path, tmp_path: Path
) -> None:
    """A sharded job of a wider model: its Checkpointer.verify() fails both checkpoints,
    whole as they are, from the sharded metadata and the live sharded objects, on every rank;
    its restore refuses both too (DCP's load plan finds the sizes that differ)."""
    run = Path(shutil.copytree(fsdp2_run / "run", tmp_path / "run"))
    lines = cluster.run("train", run, tmp_path, "--total", 6, "--width", 24)

    misfit = "model.0.weight is [32, 16] float32 in the checkpoint, [24, 16] float32 here"
    for rank in (0, 1):
        assert said(lines, rank, "verified") == ["OK 0/2, errors 2"], lines
        failed = said(lines, rank, "failed")
        assert [line.split()[0] for line in failed] == ["2", "3"], lines
        assert all(misfit in line for line in failed), failed
        (error,) = said(lines, rank, "error")
        assert "of step 3 does not fit the state_dict given" in error, lines
        assert said(lines, rank, "start") == [], lines
    assert CheckpointStore(run).verify().summary == "OK 2/2, errors 0"  # both whole


class _CreatesFile:
    """Unpickling this creates a file: what a malicious checkpoint would do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def test_what_two_ranks_saved_loads_whole_into_one_process(saved: tuple[Path, Path]) -> None:
    """DCP reshards on load: the number of ranks may change between save and restore."""
    from safetensors.torch import load_file

    root, expected = saved
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    state = {"model": model.state_dict()}

    loaded = load_sharded(CheckpointStore(root), state)

    assert loaded.step == 3
    want = load_file(str(expected / "step-3.safetensors"))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, want[f"model/{name}"]), name


# -- one rank, no process group ------------------------------------------------------------


def _state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer, {"model": model.state_dict(), "optim": optimizer.state_dict()}


def test_one_rank_saves_and_loads_in_place_without_pickle(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "run")
    _, _, state = _state(seed=0)
    info = save_sharded(store, 7, state, data={"progress": {"epoch": 2}})
    assert sorted(info.manifest.files) == [
        "progress.json",
        "sharded.metadata.json",
        "sharded.rank00000.json",
        "sharded.rank00000.safetensors",
    ]
    _, _, target = _state(seed=1)

    loaded = load_sharded(store, target)

    assert loaded.step == 7
    assert loaded.data == {"progress": {"epoch": 2}}
    assert torch.equal(target["model"]["weight"], state["model"]["weight"])
    assert torch.equal(
        target["optim"]["state"][0]["exp_avg"], state["optim"]["state"][0]["exp_avg"]
    )
    # Non-tensor leaves come back with their types: the betas are a tuple again.
    assert target["optim"]["param_groups"] == state["optim"]["param_groups"]
    assert target["optim"]["param_groups"][0]["betas"] == (0.8, 0.9)


def test_a_pickle_is_never_loaded_even_under_a_matching_manifest(tmp_path: Path) -> None:
    """Whoever rewrites the manifest too gets past the hash check, and still runs no code:
    the metadata is parsed as JSON, never unpickled."""
    store = CheckpointStore(tmp_path / "run")
    _, _, state = _state(seed=0)
    save_sharded(store, 1, state)
    folder = tmp_path / "run" / "000000000001"
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_CreatesFile(str(marker)))
    (folder / "sharded.metadata.json").write_bytes(payload)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    manifest["files"]["sharded.metadata.json"] = {
        "size": len(payload),
        "xxh3-128": xxhash.xxh3_128(payload).hexdigest(),
    }
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    _, _, target = _state(seed=1)
    before = target["model"]["weight"].clone()

    with pytest.raises(NoCheckpointError, match="not valid UTF-8 JSON"):
        load_sharded(store, target)

    assert not marker.exists()
    assert torch.equal(target["model"]["weight"], before)


# -- sharded metadata that lies, its manifest entry resealed -------------------------------------


def edit_metadata(folder: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Change the sharded metadata of the checkpoint ``folder`` and reseal its manifest: the
    hashes match, only what the metadata says betrays it."""
    path = folder / "sharded.metadata.json"
    document = json.loads(path.read_text())
    change(document["items"])
    path.write_text(json.dumps(document, indent=1))
    reseal(folder)


def tensors_of(items: dict[str, Any]) -> dict[str, Any]:
    return {fqn: item for fqn, item in items.items() if item["kind"] == "tensor"}


def drop_rank_1(items: dict[str, Any]) -> None:
    for item in tensors_of(items).values():
        item["chunks"] = [c for c in item["chunks"] if "rank00001" not in c["file"]]


def overlapping_offsets(items: dict[str, Any]) -> None:
    # Rank 1's rows of the first layer's weight said to start at row 8, inside rank 0's.
    [second] = [c for c in items["model.0.weight"]["chunks"] if c["offsets"][0] > 0]
    second["offsets"][0] = 8


def size_doubled(items: dict[str, Any]) -> None:
    items["model.0.weight"]["size"][0] *= 2


def chunk_under_another_tensor(items: dict[str, Any]) -> None:
    # The bias's first chunk pointed at another tensor's chunk of the same file, dtype and
    # shape (its optimizer state): only the key betrays it.
    [chunk] = [c for c in items["model.0.bias"]["chunks"] if c["offsets"] == [0]]
    [other] = [
        c["key"]
        for fqn, item in tensors_of(items).items()
        if fqn != "model.0.bias" and "exp_avg_sq" not in fqn
        for c in item["chunks"]
        if (c["file"], c["sizes"]) == (chunk["file"], chunk["sizes"]) and c["offsets"] == [0]
    ]
    chunk["key"] = other


def swap_shard_files(folder: Path) -> None:
    first, second = (folder / f"sharded.rank0000{r}.safetensors" for r in (0, 1))
    data = first.read_bytes()
    first.write_bytes(second.read_bytes())
    second.write_bytes(data)
    reseal(folder)


def dtype_changed(items: dict[str, Any]) -> None:
    items["model.2.weight"]["dtype"] = "float64"


SHARDED_DAMAGES: dict[str, Callable[[Path], None]] = {
    "a rank's chunks dropped": lambda f: edit_metadata(f, drop_rank_1),
    "two chunks overlapping": lambda f: edit_metadata(f, overlapping_offsets),
    "a tensor's size doubled": lambda f: edit_metadata(f, size_doubled),
    "the two shard files swapped": swap_shard_files,
    "a chunk under another tensor's key": lambda f: edit_metadata(f, chunk_under_another_tensor),
    "a tensor's dtype changed": lambda f: edit_metadata(f, dtype_changed),
}


@pytest.mark.parametrize("damage", list(SHARDED_DAMAGES))
def test_sharded_metadata_that_does_not_match_its_shards_is_refused_by_every_reader(
    cluster: Cluster, saved: tuple[Path, Path], tmp_path: Path, damage: str
) -> None:
    root = copy_of(saved, tmp_path)
    SHARDED_DAMAGES[damage](root / "000000000003")

    report = CheckpointStore(root).verify()
    assert [(r.step, r.ok) for r in report.results] == [(1, True), (2, True), (3, False)]
    problem = report.results[-1].problem
    assert "000000000003/sharded.metadata.json" in problem, problem
    assert "does not match the checkpoint" in problem, problem
    assert "Delete its folder, or put back an intact copy" in problem, problem

    # Both ranks pass over step 3 with the store's warning and load step 2 exactly.
    lines = cluster.run("restore", root, saved[1])
    assert_ended_well(lines)
    assert said(lines, 0, "restored") == said(lines, 1, "restored") == ["2 same"], lines
    for rank in (0, 1):
        [warning] = said(lines, rank, "warning")
        assert warning.startswith("nbresume: skipped 1 newer checkpoint(s) that failed"), warning
        assert "000000000003/sharded.metadata.json" in warning, warning
        assert "Traceback" not in warning, warning
        assert "same layout" not in warning, warning


# -- what two FSDP2 ranks saved, restored by the plain model in one process ----------------------


def plain_model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model of sharded_worker.build, not sharded, with its optimizer."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95))


@pytest.fixture(scope="module")
def fsdp2_run(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Checkpointer's run of an FSDP2 model and optimizer on two ranks, stopped (and saved)
    at step 3; ``final.safetensors`` beside it holds its full state then."""
    base = tmp_path_factory.mktemp("fsdp2")
    lines = cluster.run("train", base / "run", base, "--total", 6, "--stop-after", 3)
    assert_ended_well(lines)
    return base


def test_what_fsdp2_saved_on_two_ranks_restores_whole_into_a_plain_model_in_one_process(
    fsdp2_run: Path, tmp_path: Path
) -> None:
    """A run sharded over two ranks (Kaggle's two T4s), resumed by the unsharded model in one
    process (Colab's one GPU): the shards are gathered, every weight and every optimizer
    state comes back as the two ranks had it, never a step over initial weights."""
    from safetensors.torch import load_file

    from nbresume import Checkpointer

    run = Path(shutil.copytree(fsdp2_run / "run", tmp_path / "run"))
    want = load_file(str(fsdp2_run / "final.safetensors"))
    model, optimizer = plain_model_and_optimizer(seed=12345)
    initial = {k: v.clone() for k, v in model.state_dict().items()}

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing passed over, nothing missing
        ckpt = Checkpointer(run, model=model, optimizer=optimizer, every=2, keep=2, deadline=None)
        assert ckpt.verify().summary == "OK 2/2, errors 0"  # whole, and they fit
        assert ckpt.restore() == 3
    ckpt.close()

    names = [name for name, _ in model.named_parameters()]
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, want[f"model/{name}"]), name
        assert not torch.equal(tensor, initial[name]), name
    state = optimizer.state_dict()["state"]
    assert sorted(state) == list(range(len(names)))
    for index, name in enumerate(names):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[index][key], want[f"optim/state/{name}/{key}"]), (name, key)


def test_a_sharded_checkpoint_that_does_not_fit_the_plain_model_is_refused_before_any_change(
    fsdp2_run: Path, tmp_path: Path
) -> None:
    from nbresume import Checkpointer

    run = Path(shutil.copytree(fsdp2_run / "run", tmp_path / "run"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = Checkpointer(run, model=model, optimizer=optimizer, every=2, keep=2, deadline=None)
    report = ckpt.verify()  # restore's verdict, from the shards' headers: none fits

    with pytest.raises(CheckpointError, match="fits the objects given") as raised:
        ckpt.restore()

    ckpt.close()
    assert report.summary == "OK 0/2, errors 2"
    for result in report.results:
        assert "model.0.weight is [32, 16] float32 in the checkpoint, [24, 16] float32 here" in (
            result.problem
        )
    assert "model.0.weight is [32, 16] float32 in the checkpoint, [24, 16] float32 here" in str(
        raised.value
    )
    assert "Fix: build the model and optimizer exactly as" in str(raised.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not optimizer.state  # not even the zeroed state that would have received it
    assert ckpt.step == 0
