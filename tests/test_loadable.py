"""A checkpoint that verifies is a checkpoint that loads.

A run saves steps 10 and 20; step 20 is then damaged and its manifest resealed, so that sizes
and hashes match the damaged files (as a buggy writer, a tool or a person would leave it).
Restore must pass step 20 over with a warning naming the file and load step 10 exactly;
``nbresume verify`` must fail it with the reason; ``nbresume pull`` must never call the copy
safe to tear down. When no checkpoint is usable, restore raises and every object is as it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

import testkit.cli
from nbresume import Checkpointer, CheckpointStore
from nbresume.checkpoint.format import MANIFEST_NAME, FileEntry, parse_manifest, step_dirname
from nbresume.checkpoint.store.hashing import new_hash
from nbresume.errors import CheckpointError
from nbresume.pull import SAFE_LINE

#: A run's folder and what each of its checkpoints holds.
Run = tuple[Path, dict[int, Any]]
QUIET: dict[str, Any] = {"every": None, "deadline": None, "async_save": False, "keep": None}
INPUTS = torch.randn(32, 8, generator=torch.Generator().manual_seed(7))


def build(seed: int = 0, *, out: int = 4, adamw: bool = False) -> tuple[nn.Module, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, out))
    if adamw:
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train_step(model: nn.Module, optimizer: Any) -> None:
    optimizer.zero_grad()
    model(INPUTS).square().mean().backward()
    optimizer.step()


def tensors_of(model: nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    """Every tensor a restore puts back: weights and optimizer state."""
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"optimizer.{index}.{key}"] = value.detach().clone()
    return out


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


def make_run(folder: Path, *, adamw: bool = False) -> dict[int, dict[str, Any]]:
    """Train 20 steps, saving at 10 and 20; return what each checkpoint holds."""
    model, optimizer = build(adamw=adamw)
    ckpt = Checkpointer(folder, model=model, optimizer=optimizer, **QUIET)
    ckpt["note"] = "start"
    saved = {}
    for step in range(1, 21):
        train_step(model, optimizer)
        if step in (10, 20):
            ckpt["note"] = f"at {step}"
            rng = torch.get_rng_state()
            ckpt.save(step)
            saved[step] = {"tensors": tensors_of(model, optimizer), "rng": rng}
        torch.rand(3)  # the RNG moves on between saves
    ckpt.close()
    return saved


def reseal(folder: Path) -> None:
    """Rewrite the manifest so every file's size and hashes match what is on disk now."""
    path = folder / MANIFEST_NAME
    manifest = parse_manifest(path.read_bytes(), where=str(path))
    files = {}
    for name, entry in manifest.files.items():
        digest, size = new_hash(entry.algorithm), 0
        md5 = hashlib.md5(usedforsecurity=False) if entry.md5 else None
        with open(folder / name, "rb") as handle:
            while chunk := handle.read(8 << 20):
                digest.update(chunk)
                if md5 is not None:
                    md5.update(chunk)
                size += len(chunk)
        files[name] = FileEntry(
            size, digest.hexdigest(), md5 and md5.hexdigest(), algorithm=entry.algorithm
        )
    resealed = type(manifest)(
        step=manifest.step,
        files=files,
        created=manifest.created,
        metrics=manifest.metrics,
        writer=manifest.writer,
    )
    path.write_bytes(resealed.to_bytes())


def edit_state(folder: Path, change: Callable[[dict[str, Any]], None]) -> None:
    path = folder / "state.json"
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))


def rewrite_header(folder: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Change the JSON header of model.safetensors, keeping its tensor bytes."""
    path = folder / "model.safetensors"
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length :])


# -- the damages ---------------------------------------------------------------------------


def deep_values(folder: Path) -> str:
    def change(document: dict[str, Any]) -> None:
        value: Any = "deep"
        for _ in range(600):
            value = [value]
        document["values"]["note"] = value

    edit_state(folder, change)
    return "state.json"


def unknown_tag(folder: Path) -> str:
    def change(document: dict[str, Any]) -> None:
        document["objects"]["model"]["0.weight"] = {"$t": "pickle", "data": "gASVAAAAAAAAAAB9lC4="}

    edit_state(folder, change)
    return "state.json"


def numpy_position(folder: Path) -> str:
    """NumPy reads a Mersenne Twister's position unchecked: out of range, the first draw after
    the restore reads outside the state (a segfault at every restart)."""

    def change(document: dict[str, Any]) -> None:
        document["rng"]["numpy"]["items"][2] = 10**6

    edit_state(folder, change)
    return "state.json"


def future_version(folder: Path) -> str:
    edit_state(folder, lambda document: document.update(version=999))
    return "state.json"


def other_shapes(folder: Path) -> str:
    path = folder / "model.safetensors"
    tensors = safetensors.torch.load_file(str(path))
    # Listed first so that a loader copying in file order would change the model before
    # meeting the mismatch.
    tensors = {"0.bias": torch.zeros(16), **tensors, "2.weight": torch.zeros(5, 16)}
    safetensors.torch.save_file(tensors, str(path))
    return "model.safetensors"


def missing_tensor(folder: Path) -> str:
    path = folder / "model.safetensors"
    tensors = safetensors.torch.load_file(str(path))
    del tensors["2.bias"]
    safetensors.torch.save_file(tensors, str(path))
    return "model.safetensors"


def manifest_fifo(folder: Path) -> str:
    (folder / MANIFEST_NAME).unlink()
    os.mkfifo(folder / MANIFEST_NAME)
    return MANIFEST_NAME


def manifest_symlink(folder: Path) -> str:
    elsewhere = folder.parent.parent / "manifest-elsewhere.json"
    (folder / MANIFEST_NAME).rename(elsewhere)
    (folder / MANIFEST_NAME).symlink_to(elsewhere)
    return MANIFEST_NAME


def manifest_folder(folder: Path) -> str:
    (folder / MANIFEST_NAME).unlink()
    (folder / MANIFEST_NAME).mkdir()
    return MANIFEST_NAME


def header_change(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], str]:
    def damage(folder: Path) -> str:
        rewrite_header(folder, change)
        return "model.safetensors"

    return damage


def _set(name: str, field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda header: header[name].__setitem__(field, value)


def _overlap(header: dict[str, Any]) -> None:
    start, end = header["2.bias"]["data_offsets"]
    header["2.bias"]["data_offsets"] = [start - 4, end - 4]


def _outside(header: dict[str, Any]) -> None:
    last = max(header.values(), key=lambda e: e["data_offsets"][1] if "dtype" in e else -1)
    last["data_offsets"][1] += 1 << 30


def _header_length(folder: Path) -> str:
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = (len(data) + 100).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    return "model.safetensors"


DAMAGES: dict[str, Callable[[Path], str]] = {
    "values nested 600 deep": deep_values,
    "an unknown tag": unknown_tag,
    "version 999": future_version,
    "numpy RNG position out of range": numpy_position,
    "tensors of other shapes": other_shapes,
    "a tensor missing": missing_tensor,
    "manifest is a FIFO": manifest_fifo,
    "manifest is a symlink": manifest_symlink,
    "manifest is a folder": manifest_folder,
    "header: unknown dtype": header_change(_set("2.bias", "dtype", "F31")),
    "header: shape and bytes disagree": header_change(_set("2.bias", "shape", [5])),
    "header: offsets overlap": header_change(_overlap),
    "header: offsets outside the file": header_change(_outside),
    "header: length beyond the file": _header_length,
    "header: dtype of another size": header_change(_set("2.bias", "dtype", "F64")),
}
#: Damages that leave the files intact to anyone who only checks hashes: the manifest is
#: rewritten to match (a manifest that is not a regular file cannot be).
RESEALED = {name for name in DAMAGES if not name.startswith("manifest")}


@pytest.fixture(scope="module")
def run_template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, Any]]:
    folder = tmp_path_factory.mktemp("template") / "run"
    return folder, make_run(folder)


@pytest.fixture
def run(tmp_path: Path, run_template: tuple[Path, dict[int, Any]]) -> Run:
    template, saved = run_template
    folder = tmp_path / "run"
    shutil.copytree(template, folder)
    return folder, saved


def damage(folder: Path, name: str) -> str:
    victim = DAMAGES[name](folder / step_dirname(20))
    if name in RESEALED:
        reseal(folder / step_dirname(20))
    return victim


def assert_restores_step_10(folder: Path, saved: dict[int, Any], victim: str) -> None:
    model, optimizer = build(seed=1)
    ckpt = Checkpointer(folder, model=model, optimizer=optimizer, **QUIET)
    with pytest.warns(RuntimeWarning) as caught:
        assert ckpt.restore() == 10
    messages = [str(w.message) for w in caught if "skipped" in str(w.message)]
    assert len(messages) == 1
    assert f"{step_dirname(20)}/{victim}" in messages[0]
    assert_same(tensors_of(model, optimizer), saved[10]["tensors"])
    assert ckpt["note"] == "at 10"
    assert torch.equal(torch.get_rng_state(), saved[10]["rng"])
    assert (ckpt.step, ckpt.restored_step) == (10, 10)
    ckpt.close()


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    code, out, err = testkit.cli.run_cli(argv, capsys)
    return code, out + err


def assert_verify_fails(folder: Path, victim: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(["verify", str(folder)], capsys)
    assert code == 1, out
    lines = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert len(lines) == 1, out
    assert step_dirname(20) in lines[0], out
    assert victim in lines[0], out
    assert f"OK    {step_dirname(10)}" in out


def assert_pull_is_not_safe(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = run_cli(["pull", str(folder), str(tmp_path / "pulled")], capsys)
    assert code == 1, out
    assert SAFE_LINE not in out
    assert f"FAIL  {step_dirname(20)}" in out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(DAMAGES))
def test_a_damaged_newest_checkpoint_falls_back_and_fails_verify_and_pull(
    name: str, run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder, saved = run
    victim = damage(folder, name)
    assert_restores_step_10(folder, saved, victim)
    assert_verify_fails(folder, victim, capsys)
    assert_pull_is_not_safe(folder, tmp_path, capsys)
    if victim == MANIFEST_NAME:  # listed as broken, never as a checkpoint or a save cut short
        store = CheckpointStore(folder, keep=None)
        assert [i.step for i in store.list()] == [10]
        assert [(r.step, "not a regular file" in r.problem) for r in store.broken()] == [(20, True)]
        assert not store.verify().uncommitted
        code, out = run_cli(["ls", str(folder)], capsys)
        assert code == 0, out
        assert "BROKEN step 20: " in out, out
        assert "not a regular file" in out, out


def test_a_damaged_only_checkpoint_raises_and_changes_nothing(run: Run) -> None:
    """Nothing usable: restore raises a CheckpointError, and every object is as it was."""
    folder, _ = run
    shutil.rmtree(folder / step_dirname(10))
    damage(folder, "tensors of other shapes")
    model, optimizer = build(seed=1)
    before = tensors_of(model, optimizer)
    rng = torch.get_rng_state()
    ckpt = Checkpointer(folder, model=model, optimizer=optimizer, **QUIET)
    ckpt["note"] = "fresh"
    with pytest.raises(CheckpointError, match=re.escape("000000000020/model.safetensors")):
        ckpt.restore()
    assert_same(tensors_of(model, optimizer), before)
    assert optimizer.state_dict()["state"] == {}
    assert (ckpt.step, ckpt["note"], ckpt.restored_step) == (0, "fresh", None)
    assert torch.equal(torch.get_rng_state(), rng)
    ckpt.close()


# -- a model that matches no checkpoint ----------------------------------------------------


def test_a_changed_model_is_named_and_left_untouched(run: Run) -> None:
    folder, _ = run
    model, optimizer = build(seed=3, out=6)  # the last layer grew from 4 to 6 outputs
    before = tensors_of(model, optimizer)
    rng = torch.get_rng_state()
    ckpt = Checkpointer(folder, model=model, optimizer=optimizer, **QUIET)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one error, no warning about skipped checkpoints
        with pytest.raises(CheckpointError) as caught:
            ckpt.restore()
    message = str(caught.value)
    assert "model.2.weight is [4, 16] float32 in the checkpoint, [6, 16] float32 here" in message
    assert "model.2.bias is [4] float32 in the checkpoint, [6] float32 here" in message
    assert "model.0.weight" not in message
    assert "dir=" in message
    assert "new run" in message
    assert_same(tensors_of(model, optimizer), before)
    assert ckpt.step == 0
    assert torch.equal(torch.get_rng_state(), rng)
    # Asking again gives the same answer: it never starts over silently.
    with pytest.raises(CheckpointError, match=re.escape("[6, 16]")):
        ckpt.restore()
    ckpt.close()


def test_a_model_that_fits_an_older_checkpoint_only_loads_that_one(tmp_path: Path) -> None:
    """The architecture changed between two saves of the same folder: the newest checkpoint
    that fits is loaded, with a warning naming the one that does not."""
    folder = tmp_path / "run"
    saved = make_run(folder)
    wide, wide_optimizer = build(out=6)
    ckpt = Checkpointer(folder, model=wide, optimizer=wide_optimizer, **QUIET)
    with pytest.raises(CheckpointError):
        ckpt.restore()
    ckpt.save(30)
    ckpt.close()
    model, optimizer = build(seed=1)
    ckpt = Checkpointer(folder, model=model, optimizer=optimizer, **QUIET)
    with pytest.warns(RuntimeWarning, match=r"model\.2\.weight is \[6, 16\]"):
        assert ckpt.restore() == 20
    assert_same(tensors_of(model, optimizer), saved[20]["tensors"])
    ckpt.close()


@pytest.mark.parametrize("adamw", [False, True], ids=["sgd-momentum", "adamw"])
@pytest.mark.parametrize("stepped", [False, True], ids=["fresh-optimizer", "stepped-optimizer"])
def test_optimizer_state_matches_before_and_after_the_first_step(
    tmp_path: Path, adamw: bool, stepped: bool
) -> None:
    """An optimizer that has not stepped yet has no state: any saved state fits it; one that
    has stepped must hold the same entries with the same shapes."""
    folder = tmp_path / "run"
    saved = make_run(folder, adamw=adamw)
    model, optimizer = build(seed=1, adamw=adamw)
    if stepped:
        train_step(model, optimizer)
    ckpt = Checkpointer(folder, model=model, optimizer=optimizer, **QUIET)
    assert ckpt.restore() == 20
    assert_same(tensors_of(model, optimizer), saved[20]["tensors"])
    ckpt.close()


def test_optimizer_state_of_another_shape_is_refused(run: Run) -> None:
    folder, _ = run

    def change(document: dict[str, Any]) -> None:
        # The momentum buffers of parameters 2 and 3 (the last layer's) trade places.
        state = document["objects"]["optimizer"]["state"]["items"]
        state[2][1], state[3][1] = state[3][1], state[2][1]

    edit_state(folder / step_dirname(20), change)
    reseal(folder / step_dirname(20))
    assert_restores_step_10(folder, run[1], "optimizer.safetensors")


# -- mutations of a valid checkpoint --------------------------------------------------------


def json_values() -> st.SearchStrategy[Any]:
    leaves = (
        st.none()
        | st.booleans()
        | st.integers(-(2**70), 2**70)
        | st.floats(allow_nan=False)
        | st.text(max_size=8)
        | st.sampled_from(["$t", "tensor", "tuple", "dict", "nan", "0.weight", "state"])
    )
    return st.recursive(
        leaves,
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.dictionaries(
                st.sampled_from(["$t", "key", "items", "value", "x"]), inner, max_size=3
            )
        ),
        max_leaves=8,
    )


def paths(document: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(document, dict):
        for key, value in document.items():
            out += paths(value, (*prefix, key))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            out += paths(value, (*prefix, index))
    return out


def mutate_json(document: Any, data: st.DataObject) -> Any:
    """One random change at a random place: a new value, a deletion, or deep nesting."""
    path = data.draw(st.sampled_from(paths(document)))
    kind = data.draw(st.sampled_from(["replace", "delete", "nest"]))
    if not path:
        return data.draw(json_values())
    parent = document
    for key in path[:-1]:
        parent = parent[key]
    if kind == "delete":
        del parent[path[-1]]
    elif kind == "nest":
        value = parent[path[-1]]
        for _ in range(data.draw(st.integers(1, 700))):
            value = [value]
        parent[path[-1]] = value
    else:
        parent[path[-1]] = data.draw(json_values())
    return document


def mutate_header(header: dict[str, Any], data: st.DataObject) -> None:
    names = sorted(k for k in header if k != "__metadata__")
    name = data.draw(st.sampled_from(names))
    kind = data.draw(st.sampled_from(["dtype", "shape", "offsets", "rename", "delete", "swap"]))
    entry = header[name]
    if kind == "dtype":
        entry["dtype"] = data.draw(st.sampled_from(["F16", "BF16", "I32", "F64", "U8", "X"]))
    elif kind == "shape":
        entry["shape"] = data.draw(st.lists(st.integers(-1, 40), max_size=3))
    elif kind == "offsets":
        entry["data_offsets"] = data.draw(st.lists(st.integers(-8, 5000), min_size=2, max_size=2))
    elif kind == "rename":
        header[data.draw(st.sampled_from(["2.weight", "0.bias", "x", ""]))] = header.pop(name)
    elif kind == "delete":
        del header[name]
    else:
        other = header[data.draw(st.sampled_from(names))]
        entry["data_offsets"], other["data_offsets"] = other["data_offsets"], entry["data_offsets"]


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    data=st.data(),
    target=st.sampled_from(["state.json", "model.safetensors"]),
    alone=st.booleans(),
)
def test_a_mutated_newest_checkpoint_never_half_restores(
    run_template: tuple[Path, dict[int, Any]], data: st.DataObject, target: str, alone: bool
) -> None:
    """Whatever the change, restore gives a whole checkpoint (the good older one, or the
    changed one when the change left it valid and fitting) or, with no older checkpoint, a
    clean CheckpointError with every object as it was: never a mix, never another exception."""
    template, saved = run_template
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "run"
        shutil.copytree(template, folder)
        newest = folder / step_dirname(20)
        if alone:  # no older checkpoint to fall back to
            shutil.rmtree(folder / step_dirname(10))
        if target == "state.json":
            document = json.loads((newest / "state.json").read_text())
            document = mutate_json(document, data)
            (newest / "state.json").write_text(json.dumps(document))
        else:
            rewrite_header(newest, lambda header: mutate_header(header, data))
        reseal(newest)

        model, optimizer = build(seed=1)
        before = tensors_of(model, optimizer)
        random.seed(5)
        rng = (torch.get_rng_state(), random.getstate())
        ckpt = Checkpointer(folder, model=model, optimizer=optimizer, **QUIET)
        ckpt["note"] = "fresh"
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                step = ckpt.restore()
                why = " ".join(str(w.message) for w in seen)
            except CheckpointError as exc:
                assert alone
                step, why = None, str(exc)
        # verify refuses what restore refuses, but for the match with the live objects.
        verified = CheckpointStore(folder, keep=None).verify(20).results[0].ok
        assert verified == (step == 20 or "the objects given" in why), why
        now = tensors_of(model, optimizer)
        event(f"{target}: restored {step}")
        if step is None:
            assert_same(now, before)
            assert (ckpt.step, ckpt["note"]) == (0, "fresh")
            assert torch.equal(torch.get_rng_state(), rng[0])
            assert random.getstate() == rng[1]
        elif torch.equal(now["model.0.weight"], saved[10]["tensors"]["model.0.weight"]):
            assert step == 10
            assert_same(now, saved[10]["tensors"])
            assert ckpt["note"] == "at 10"
            assert torch.equal(torch.get_rng_state(), saved[10]["rng"])
        else:
            # The changed step 20 was valid and fits: all of it, as its files hold it.
            if "holds no state for 'model'" in why:  # the change dropped it: kept as it was
                on_disk = {k.removeprefix("model."): v for k, v in before.items() if "model." in k}
            else:
                on_disk = safetensors.torch.load_file(str(newest / "model.safetensors"))
            for key, value in on_disk.items():
                assert torch.equal(now[f"model.{key}"], value), key
            # Its optimizer state as saved (a change to state.json may validly drop some).
            expected = saved[20]["tensors"]
            for key, value in now.items():
                if key.startswith("optimizer."):
                    assert torch.equal(value, expected[key]), key
        ckpt.close()


# -- memory is bounded by what is valid ------------------------------------------------------

_PEAK = """
import sys, warnings
import torch
from torch import nn
from nbresume import Checkpointer, CheckpointStore
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(1024, 4096), nn.Linear(4096, 1024))
ckpt = Checkpointer(sys.argv[1], model=model, every=None, deadline=None, async_save=False)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    step = ckpt.restore()
# This process's own peak: ru_maxrss would start at the peak of the process that started it.
peak = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(step, peak.split()[1])
"""


def restore_peak(folder: Path) -> tuple[int, int]:
    """(step, peak resident memory) of a fresh process that restores ``folder``."""
    done = subprocess.run(
        [sys.executable, "-c", _PEAK, str(folder)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    step, peak = done.stdout.split()
    return int(step), int(peak)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_sparse_file_of_gigabytes_is_refused_by_its_header(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model.safetensors grown to 3 GiB (sparse, its manifest resealed to match) is refused
    by its header before it is read: restore falls back with no more memory than restoring a
    valid checkpoint takes; verify fails it; pull never copies it."""
    folder = tmp_path / "run"
    torch.manual_seed(0)
    first = nn.Linear(1024, 4096)
    model = nn.Sequential(first, nn.Linear(4096, 1024))  # 32 MiB of weights
    ckpt = Checkpointer(folder, model=model, every=None, deadline=None, async_save=False)
    ckpt.save(10)
    with torch.no_grad():
        first.weight.add_(1)
    ckpt.save(20)
    ckpt.close()
    valid = restore_peak(folder)
    assert valid[0] == 20

    newest = folder / step_dirname(20)
    os.truncate(newest / "model.safetensors", 3 << 30)
    reseal(newest)
    sparse = restore_peak(folder)
    assert sparse[0] == 10
    assert sparse[1] <= 1.2 * valid[1], (sparse, valid)

    restored = nn.Sequential(nn.Linear(1024, 4096), nn.Linear(4096, 1024))
    ckpt = Checkpointer(folder, model=restored, every=None, deadline=None, async_save=False)
    with pytest.warns(RuntimeWarning, match=r"000000000020/model\.safetensors.*bytes after"):
        assert ckpt.restore() == 10
    ckpt.close()
    code, out = run_cli(["verify", str(folder)], capsys)
    assert code == 1, out
    assert "bytes after the last tensor" in out
    assert_pull_is_not_safe(folder, tmp_path, capsys)
    copied = [p for p in (tmp_path / "pulled").rglob("*") if p.is_file()]
    assert copied
    assert all(p.stat().st_size < 1 << 30 for p in copied)  # the 3 GiB file was never copied


# -- the safety net: an object whose own load fails ------------------------------------------


class Counter:
    def __init__(self, *, refuse: int | None = None) -> None:
        self.count = 0
        self.refuse = refuse

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.count = state["count"]  # changed before it refuses: as careless code does
        if state["count"] == self.refuse:
            raise ValueError(f"cannot take count {self.refuse}")


@pytest.mark.parametrize("alone", [False, True], ids=["older-checkpoint", "only-checkpoint"])
def test_an_object_that_fails_to_load_is_put_back_with_everything_else(
    tmp_path: Path, alone: bool
) -> None:
    folder = tmp_path / "run"
    model, optimizer = build()
    first, picky = Counter(), Counter()
    ckpt = Checkpointer(folder, model=model, optimizer=optimizer, first=first, picky=picky, **QUIET)
    saved = {}
    for step in (10, 20):
        train_step(model, optimizer)
        first.count = picky.count = step
        ckpt.save(step)
        saved[step] = tensors_of(model, optimizer)
    ckpt.close()
    if alone:
        shutil.rmtree(folder / step_dirname(10))

    model, optimizer = build(seed=1)
    before = tensors_of(model, optimizer)
    first, picky = Counter(), Counter(refuse=20)
    rng = torch.get_rng_state()
    ckpt = Checkpointer(folder, model=model, optimizer=optimizer, first=first, picky=picky, **QUIET)
    if alone:
        with pytest.raises(CheckpointError, match="restoring 'picky' failed"):
            ckpt.restore()
        assert (first.count, picky.count, ckpt.step) == (0, 0, 0)
        assert_same(tensors_of(model, optimizer), before)
        assert torch.equal(torch.get_rng_state(), rng)
    else:
        with pytest.warns(RuntimeWarning, match="restoring 'picky' failed"):
            assert ckpt.restore() == 10
        assert (first.count, picky.count) == (10, 10)
        assert_same(tensors_of(model, optimizer), saved[10])
    ckpt.close()
