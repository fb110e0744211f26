"""Two things that go wrong on a GPU while the loop runs: memory runs out, and the GPU waits
for data.

**Out of memory.** ``torch.cuda.OutOfMemoryError`` raised by the training step is the
user's exception: it leaves the loop body, so the loop generator never sees it. nbresume
adds what to do to the exception itself (a note, printed after the traceback) where it can
see it go by: in ``with Checkpointer(...)``, in the top-level exception hook of a script,
and in IPython's handler in a notebook. Nothing is saved on the way out: the state in
memory is in the middle of a step, and the newest verified checkpoint stays the one to
resume from.

**Data wait.** A wrapped loader times how long each ``next()`` on the DataLoader takes (the
training waits for the batch) and how long the loop body keeps each batch (the step). The
share of waiting over the last :data:`WINDOW` batches says whether the run is input-bound.
"""

from __future__ import annotations

import re
import sys
import time
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from nbresume.checkpoint import forksafe, hooks

T = TypeVar("T")

#: Batches over which the data-wait share is measured.
WINDOW = 50
#: Batches needed before the share is shown.
MIN_BATCHES = 5
#: Share of step time spent waiting for data above which a run is called input-bound.
INPUT_BOUND_SHARE = 0.3

_NOTE_MARK = "__nbresume_oom_advised__"


# -- out of memory ---------------------------------------------------------------------------


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is CUDA's out-of-memory error (without importing torch)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    candidates = (
        getattr(torch.cuda, "OutOfMemoryError", None),
        getattr(torch, "OutOfMemoryError", None),
    )
    kinds = tuple(k for k in candidates if isinstance(k, type))
    return bool(kinds) and isinstance(exc, kinds)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def peak_text() -> str:
    """The peak this process allocated on each GPU, and the card's size."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return "peak not measured (CUDA did not start in this process)"
    parts = []
    for device in range(torch.cuda.device_count()):
        try:
            peak = torch.cuda.max_memory_allocated(device)
            reserved = torch.cuda.max_memory_reserved(device)
            total = torch.cuda.get_device_properties(device).total_memory
        except Exception:  # noqa: S112 - a device in a bad state after the error: skip it
            continue
        if peak:
            parts.append(
                f"GPU {device}: peak {_gib(peak)} allocated, {_gib(reserved)} reserved, "
                f"of {_gib(total)}"
            )
    return "; ".join(parts) or "no GPU memory was allocated by this process"


def oom_advice(exc: BaseException, ckpt: Any | None) -> str:
    """What to tell the user about an out-of-memory error raised in ``ckpt``'s loop."""
    asked = re.search(r"Tried to allocate ([\d.]+ [KMGT]i?B)", str(exc))
    lines = ["nbresume: CUDA ran out of memory"]
    head = []
    if ckpt is not None:
        head.append(f"at step {ckpt.step:,}")
    if asked:
        head.append(f"asking for {asked.group(1)} more")
    if head:
        lines[0] += " " + ", ".join(head)
    lines[0] += f". {peak_text()}."
    if ckpt is not None:
        try:
            latest = ckpt.latest()
        except Exception:  # the advice must not hide the error
            latest = None
        if latest is not None:
            lines.append(
                f"Nothing was saved after the error: the newest verified checkpoint, step "
                f"{latest.step:,}, is intact, and running the loop again resumes there."
            )
        else:
            lines.append("Nothing was saved after the error (no checkpoint was committed yet).")
    lines.append(
        "To fit: a smaller batch (gradient accumulation keeps the effective batch size: "
        "call optimizer.step() every k batches); mixed precision (torch.autocast); "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True against fragmentation. In a "
        "notebook, memory a crashed cell left behind stays allocated: `del` its tensors and "
        "models, run `gc.collect(); torch.cuda.empty_cache()`, or restart the runtime. "
        "`nbresume doctor` shows other processes holding GPU memory."
    )
    return "\n".join(lines)


def advise_oom(exc: BaseException, ckpt: Any | None = None) -> bool:
    """Add the advice to ``exc`` as a note (once); return whether it is an OOM error."""
    if not is_oom(exc):
        return False
    if getattr(exc, _NOTE_MARK, False):
        return True
    if ckpt is None:
        ckpt = _last_loop()
    advice = oom_advice(exc, ckpt)
    add_note = getattr(exc, "add_note", None)
    if add_note is not None:
        add_note(advice)  # Python 3.11+: printed after the traceback
    else:
        exc.__notes__ = [*getattr(exc, "__notes__", []), advice]  # type: ignore[attr-defined]
    setattr(exc, _NOTE_MARK, True)
    return True


_state: dict[str, Any] = {"ckpt": None, "installed": False}
_lock = forksafe.lock()


def _last_loop() -> Any | None:
    ref = _state["ckpt"]
    return ref() if ref is not None else None


def watch_oom(ckpt: Any) -> None:
    """Called when a loop of ``ckpt`` starts: the advice names it, and the hooks that add it
    (a script's ``sys.excepthook``, IPython's handler) are installed once per process."""
    _state["ckpt"] = weakref.ref(ckpt)
    with _lock:
        if _state["installed"]:
            return
        _state["installed"] = True
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        advised = advise_oom(value)
        previous(kind, value, tb)
        if advised and sys.version_info < (3, 11):  # no notes in the traceback before 3.11
            print("\n".join(getattr(value, "__notes__", [])), file=sys.stderr)

    sys.excepthook = hook
    _install_ipython()


def _install_ipython() -> None:
    ipython_module = sys.modules.get("IPython")
    if ipython_module is None:
        return
    shell = ipython_module.get_ipython()
    old_ipython = tuple(getattr(ipython_module, "version_info", (0,)))[:2] < (8, 15)
    torch = sys.modules.get("torch")
    if shell is None or torch is None or tuple(getattr(shell, "custom_exceptions", None) or ()):
        return  # another handler is set: it stays (the `with` form still adds the note)

    def handler(self: Any, kind: Any, value: BaseException, tb: Any, tb_offset: Any = None) -> Any:
        advise_oom(value)
        self.showtraceback((kind, value, tb), tb_offset=tb_offset)
        if old_ipython:  # its tracebacks leave notes out (Colab's IPython 7): print them
            print("\n".join(getattr(value, "__notes__", [])), file=sys.stderr)

    shell.set_custom_exc((torch.cuda.OutOfMemoryError,), handler)


# -- data wait -------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataWaitShare:
    """The share of step time spent waiting for batches, over ``batches`` recent batches."""

    share: float
    batches: int
    wait_s: float
    step_s: float
    num_workers: int | None = None
    pin_memory: bool | None = None

    @property
    def input_bound(self) -> bool:
        return self.batches >= MIN_BATCHES and self.share >= INPUT_BOUND_SHARE

    def short(self) -> str:
        """``"data wait 4%"`` or ``"INPUT-BOUND: 62% of step time waits for data"``."""
        percent = f"{self.share:.0%}"
        if self.input_bound:
            return f"INPUT-BOUND: {percent} of step time waits for data"
        return f"data wait {percent}"

    def advice(self) -> str:
        """What to change when the run is input-bound."""

        cpus = hooks.usable_cpus()
        workers = "" if self.num_workers is None else f" (now {self.num_workers})"
        quota = f", at most {max(1, cpus - 1)} here (the CPUs usable less one)" if cpus else ""
        pin = "" if self.pin_memory else "; pin_memory=True"
        return (
            f"the GPU waits for the next batch {self.share:.0%} of the time: raise the "
            f"DataLoader's num_workers{workers}{quota}; persistent_workers=True{pin}; copy the "
            "data to the local disk first (reading it from the Drive mount or a network "
            "folder is slow), and move heavy per-sample transforms to the GPU"
        )


class DataWait:
    """Times a loader's batches: the wait in ``next()`` and the step that uses the batch."""

    def __init__(self, window: int = WINDOW) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)
        self._lock = forksafe.lock()
        self.num_workers: int | None = None
        self.pin_memory: bool | None = None

    def timed(self, batches: Iterable[T]) -> Iterator[T]:
        """Yield ``batches``, timing each wait and each step."""
        iterator = iter(batches)
        handed: float | None = None
        wait = 0.0
        while True:
            asked = time.perf_counter()
            if handed is not None:
                self._record(wait, asked - handed)
            try:
                batch = next(iterator)
            except StopIteration:
                return
            handed = time.perf_counter()
            wait = handed - asked
            yield batch

    def _record(self, wait: float, step: float) -> None:
        with self._lock:
            self._samples.append((wait, step))

    def share(self) -> DataWaitShare | None:
        """The share over the recent batches; ``None`` before any batch was used."""
        with self._lock:
            samples = list(self._samples)
        if not samples:
            return None
        wait = sum(w for w, _ in samples)
        step = sum(s for _, s in samples)
        total = wait + step
        return DataWaitShare(
            share=wait / total if total > 0 else 0.0,
            batches=len(samples),
            wait_s=wait,
            step_s=step,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
        )


def data_wait_of(ckpt: Any) -> DataWaitShare | None:
    """The data-wait share of ``ckpt``'s wrapped loaders (the one waited on most)."""
    shares = []
    for loader in list(getattr(ckpt, "_objects", {}).values()):
        wait = getattr(loader, "data_wait", None)
        if isinstance(wait, DataWait):
            share = wait.share()
            if share is not None:
                shares.append(share)
    if not shares:
        return None
    return max(shares, key=lambda s: s.share)
