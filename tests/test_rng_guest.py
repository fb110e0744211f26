"""nbresume never changes the user's random streams, except where ``restore()`` puts back a
checkpoint's.

The streams are the user's: Python's ``random``, NumPy's global generator, torch's CPU
generator, every CUDA device's generator (and any other device's that ``torch.manual_seed``
reaches), and the generators a user hands to a DataLoader. On a CPU-only machine a CUDA
generator cannot be observed, so the guard here watches the *calls*: every call that sets a
generator is recorded while every loop shape of ``train_loop_shapes.py`` runs, stops
mid-epoch, resumes and finishes, and any call that nbresume makes outside ``restore()`` fails
the test. A call that reaches torch's device generators (``torch.manual_seed`` reseeds every
CUDA device) fails wherever it comes from, restore aside.

One exception is part of the design and is checked as strictly: a sample of a wrapped loader
loaded in the training process is drawn under its own seed (its augmentation is then the same
whichever worker, or no worker, loads it), and a sampler that draws from the global streams
is read under the epoch's seed. Both seed the host streams only (torch's CPU generator,
``random``, NumPy), never a device's, and put back the exact states before returning: the
guard compares the states on the way in and on the way out of every such region.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

import nbresume
import train_iterable as streams
import train_loop_shapes as shapes
from nbresume.checkpoint.format import state_document as state_module
from nbresume.checkpoint.state import ResumableLoader
from nbresume.checkpoint.state import data as data_module

NBRESUME_ROOT = str(Path(nbresume.__file__).parent)


def _python_setters() -> dict[CodeType, tuple[str, bool]]:
    """The Python functions of torch that set a generator, by their code objects: (name,
    whether it reaches a device's generators)."""
    import torch.cuda.random as cuda_random
    import torch.random as torch_random

    named: dict[CodeType, tuple[str, bool]] = {}
    cuda_names = ("manual_seed", "manual_seed_all", "seed", "seed_all", "set_rng_state")
    for module, names in (
        (torch_random, ("manual_seed", "seed", "set_rng_state")),
        (cuda_random, (*cuda_names, "set_rng_state_all")),
    ):
        for name in names:
            function = getattr(module, name, None)
            code = getattr(function, "__code__", None)
            if code is not None:
                host_only = module is torch_random and name == "set_rng_state"
                named[code] = (f"{module.__name__}.{name}", not host_only)
    for device in ("mps", "xpu"):
        backend = getattr(torch, device, None)
        for name in ("manual_seed", "manual_seed_all", "seed", "seed_all", "set_rng_state"):
            code = getattr(getattr(backend, name, None), "__code__", None)
            if code is not None:
                named[code] = (f"torch.{device}.{name}", True)
    return named


#: Methods that set a generator's state, on the objects that hold the user's streams.
_C_SETTERS = {"manual_seed", "seed", "set_state", "setstate"}


@dataclass
class Call:
    what: str
    device_wide: bool  # reaches the device generators (CUDA...) or is one of their setters
    by_nbresume: bool
    in_restore: bool
    in_scoped_region: bool
    where: str


@dataclass
class Recorder:
    """Records the calls that set a generator, and the states around nbresume's scoped
    regions, from a profile hook in every thread."""

    calls: list[Call] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    regions: int = 0
    _python: dict[CodeType, tuple[str, bool]] = field(default_factory=_python_setters)
    _restore: CodeType = state_module.restore_rng.__code__
    _scoped: set[CodeType] = field(default_factory=set)
    _entered: dict[int, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for function in data_module.SCOPED_SEEDING:
            self._scoped.add(function.__code__)

    def _target(self, arg: Any) -> tuple[str, bool] | None:
        """(what, device_wide) when ``arg`` (a C function about to run) sets a user stream."""
        name = getattr(arg, "__name__", "")
        owner = getattr(arg, "__self__", None)
        if name not in _C_SETTERS or owner is None:
            return None
        if isinstance(owner, torch.Generator):
            if owner is torch.default_generator:
                return f"torch.default_generator.{name}", False
            if owner.device.type != "cpu":
                return f"torch.Generator({owner.device}).{name}", True
            return None  # a generator of its own (nbresume's, or checked by another test)
        if owner is getattr(random, "_inst", None):
            return f"random.{name}", False
        if owner is np.random.mtrand._rand:
            return f"numpy.random.{name}", False
        return None

    def _record(self, what: str, device_wide: bool, frame: FrameType | None) -> None:
        by_nbresume = in_restore = in_scoped = False
        where = ""
        while frame is not None:
            code = frame.f_code
            if code.co_filename.startswith(NBRESUME_ROOT):
                by_nbresume = True
                if not where:
                    where = f"{Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}"
            in_restore = in_restore or code is self._restore
            in_scoped = in_scoped or code in self._scoped
            frame = frame.f_back
        self.calls.append(Call(what, device_wide, by_nbresume, in_restore, in_scoped, where))

    def hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            if code in self._python:
                self._record(*self._python[code], frame.f_back)
            elif code in self._scoped:
                self.regions += 1
                self._entered[id(frame)] = host_streams()
        elif event == "return":
            entered = self._entered.pop(id(frame), None)
            if entered is not None and not same_streams(entered, host_streams()):
                self.leaks.append(frame.f_code.co_name)
        elif event == "c_call":
            target = self._target(arg)
            if target is not None:
                self._record(*target, frame)

    def violations(self) -> list[Call]:
        """nbresume's calls outside restore: none may reach a device; in a scoped region only
        the host streams, put back on the way out."""
        bad = []
        for call in self.calls:
            if not call.by_nbresume or call.in_restore:
                continue
            if call.device_wide or not call.in_scoped_region:
                bad.append(call)
        return bad


def host_streams() -> tuple[Any, ...]:
    return (torch.get_rng_state(), random.getstate(), np.random.get_state())


def same_streams(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    numpy_a, numpy_b = a[2], b[2]
    return (
        torch.equal(a[0], b[0])
        and a[1] == b[1]
        and numpy_a[0] == numpy_b[0]
        and np.array_equal(numpy_a[1], numpy_b[1])
        and tuple(numpy_a[2:]) == tuple(numpy_b[2:])
    )


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    recording = Recorder()
    sys.setprofile(recording.hook)
    threading.setprofile(recording.hook)
    try:
        yield recording
    finally:
        sys.setprofile(None)
        threading.setprofile(None)


def check(recording: Recorder) -> None:
    bad = recording.violations()
    assert not bad, "nbresume set the user's random streams:\n" + "\n".join(
        f"  {c.what} from {c.where}" for c in bad
    )
    assert not recording.leaks, f"a scoped region left the streams changed: {recording.leaks}"


@pytest.fixture(autouse=True)
def _torch_threads_as_they_were() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("shape", shapes.SHAPES)
def test_no_loop_shape_sets_a_random_stream_outside_restore(
    tmp_path: Path, shape: str, recorder: Recorder
) -> None:
    total = shapes.SHAPES[shape][1]
    stop_after = total // 2 + 1 if (total // 2 + 1) % shapes.EVERY else total // 2 + 2
    shapes.train(tmp_path / "run", shape, stop_after=stop_after)  # runs and stops mid-epoch
    shapes.train(tmp_path / "run", shape)  # resumes and finishes
    assert any(c.in_restore for c in recorder.calls), "the resume restored no RNG state"
    check(recorder)


def test_the_guard_sees_a_device_wide_reseed(recorder: Recorder) -> None:
    """What the guard is for: ``torch.manual_seed`` reaches every CUDA device (on a CPU-only
    machine it is still called); made by nbresume's code, it is a violation."""
    state = torch.get_rng_state()
    exec(  # the call as if a line of nbresume made it
        compile("torch.manual_seed(5)", str(Path(NBRESUME_ROOT) / "checkpoint" / "x.py"), "exec"),
        {"torch": torch},
    )
    torch.set_rng_state(state)
    assert [c.what for c in recorder.violations()][:1] == ["torch.random.manual_seed"]


def numbers(count: int) -> TensorDataset:
    return TensorDataset(torch.arange(count))


def test_a_users_own_generator_on_the_sampler_is_left_as_it_was() -> None:
    """The order of a shuffled epoch comes from nbresume's seed, not from the generator the
    user gave the DataLoader, and that generator's state is never touched."""
    mine = torch.Generator().manual_seed(1234)
    before = mine.get_state()
    loader = ResumableLoader(
        DataLoader(numbers(20), batch_size=4, shuffle=True, generator=mine), seed=5
    )
    first = [b.tolist() for (b,) in loader]
    assert torch.equal(mine.get_state(), before)
    elsewhere = torch.Generator().manual_seed(99)
    other = ResumableLoader(
        DataLoader(numbers(20), batch_size=4, shuffle=True, generator=elsewhere), seed=5
    )
    assert [b.tolist() for (b,) in other] == first, "the order is a function of the seed alone"
    assert sorted(i for batch in first for i in batch) == list(range(20))


class GlobalShuffle(Sampler[int]):
    """A sampler written as many are: it shuffles with Python's and NumPy's global RNGs."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        order = list(range(self.n))
        random.shuffle(order)
        offset = int(np.random.randint(self.n))
        return iter(order[offset:] + order[:offset])


def test_a_sampler_on_the_global_streams_reads_the_epochs_seed_and_leaves_them(
    recorder: Recorder,
) -> None:
    random.seed(7)
    np.random.seed(7)
    before = host_streams()
    dl = DataLoader(numbers(24), batch_size=4, sampler=GlobalShuffle(24))
    first = [b.tolist() for (b,) in ResumableLoader(dl, seed=3)]
    assert same_streams(before, host_streams()), "reading the sampler moved the user's streams"
    random.seed(99)  # whatever the user's streams hold, the order is the epoch's
    np.random.seed(99)
    assert [b.tolist() for (b,) in ResumableLoader(dl, seed=3)] == first
    assert recorder.regions > 0
    check(recorder)


@pytest.mark.parametrize("shape", streams.SHAPES)
def test_a_stream_without_workers_draws_on_streams_of_its_own_and_puts_the_users_back(
    tmp_path: Path, shape: str, recorder: Recorder
) -> None:
    """An IterableDataset iterated in the training process (``num_workers=0``) augments with
    the global generators inside ``__iter__``: each batch is taken with the stream's own states
    swapped in, and the user's put back exactly, through a stop mid-epoch and the resume that
    drops the batches already trained."""
    streams.train(tmp_path / "run", shape, 0, stop_after=6)
    streams.train(tmp_path / "run", shape, 0)
    assert any(c.in_restore for c in recorder.calls), "the resume restored no RNG state"
    assert recorder.regions > streams.TOTAL, "every batch of the stream is a scoped region"
    check(recorder)


def test_a_retried_drive_request_leaves_pythons_random_stream_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Drive client jitters a retry with ``random.random()``; nbresume's Drive calls (the
    durability watcher polls them while training runs) jitter with a generator of their own."""
    pytest.importorskip("googleapiclient", reason="needs google-api-python-client")
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from google.auth.credentials import AnonymousCredentials
    from googleapiclient.discovery import build

    from nbresume.checkpoint.backends.drive import DriveApi

    answers = [(503, b"{}"), (200, b'{"storageQuota": {"limit": "100", "usage": "1"}}')]

    class Drive(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            code, body = answers.pop(0) if answers else (200, b"{}")
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Drive)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(time, "sleep", lambda seconds: None)  # the retry's wait, not its jitter
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/drive/v3/"
        service = build(
            "drive", "v3", credentials=AnonymousCredentials(), static_discovery=True,
            cache_discovery=False, client_options={"api_endpoint": url},
        )  # fmt: skip
        random.seed(7)
        before = random.getstate()
        quota = DriveApi(service)._execute(service.about().get(fields="storageQuota"))
        assert quota["storageQuota"]["limit"] == "100"
        assert not answers  # the 503 was retried
        assert random.getstate() == before
    finally:
        server.shutdown()
        server.server_close()
