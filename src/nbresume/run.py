"""``nbresume.init``: the first cell of a notebook, or the top of ``train.py``.

It detects the platform, runs the preflight (raising in a Kaggle batch run when an
expectation is not met, warning elsewhere), resolves the durable folder (mounting Drive on
Colab, seeding from the previous version's output on Kaggle) and returns a :class:`Run`.
The last run made by :func:`init` is remembered (:func:`current_run`), so that notebook magics
find it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nbresume import knobs
from nbresume.checkpoint.loop import Checkpointer
from nbresume.checkpoint.state import apply_determinism
from nbresume.platforms import Platform, detect
from nbresume.platforms.base import check_run_name
from nbresume.preflight_checks import (
    Report,
    check_durable,
    preflight,
    raise_if_failed,
    resolve_strict,
)

if TYPE_CHECKING:
    from nbresume.checkpoint.loop import Checkpointer
    from nbresume.checkpoint.store import CheckpointInfo


@dataclass
class Run:
    """One training run on one platform: where its checkpoints go and what the preflight saw.

    Attributes:
        name: the run's name (its durable folder's name).
        platform: the detected :class:`~nbresume.platforms.Platform`.
        dir: the durable folder, a path or an fsspec URL.
        report: the preflight :class:`~nbresume.preflight_checks.Report`.
        keep: how many checkpoints :meth:`checkpointer` keeps by default.
        seeded: the checkpoint copied in from an earlier run's output (Kaggle), if any.
    """

    name: str
    platform: Platform
    dir: str
    report: Report
    keep: int | None = 3
    seeded: CheckpointInfo | None = None

    def checkpointer(self, **kwargs: Any) -> Checkpointer:
        """A :class:`~nbresume.Checkpointer` on this run's folder.

        Defaults: ``keep`` as given to :func:`init`, ``deadline="auto"`` (the platform's
        session cap) and, for ``every="auto"``, the platform's expected time between
        interruptions in the Young/Daly interval. Any keyword overrides them.
        """
        kwargs.setdefault("keep", self.keep)
        kwargs.setdefault("deadline", "auto")
        ckpt = Checkpointer(self.dir, **kwargs)
        ckpt.cadence.mtbf_s = self.platform.mtbf_s
        return ckpt

    def hf_callback(self, **kwargs: Any) -> Any:
        """A :class:`nbresume.hf.Callback` for a Hugging Face Trainer, stopping before the
        platform's session cap (``deadline="auto"``); give the Trainer
        ``output_dir=run.dir``. Any keyword overrides the defaults."""
        from nbresume.hf import Callback

        kwargs.setdefault("deadline", "auto")
        return Callback(**kwargs)

    def summary(self) -> str:
        """A few lines: the platform, the folder, and each check that is not ok."""
        lines = self.report.summary_lines()
        lines.insert(1, f"  run {self.name!r}: checkpoints in {self.dir}")
        if self.seeded is not None:
            lines.insert(2, f"  continued from step {self.seeded.step} of an attached input")
        return "\n".join(lines)


class _Latest:
    """The run of the last :func:`init` in this process."""

    run: Run | None = None


def current_run() -> Run | None:
    """The run of the last :func:`init` in this process (``None`` before the first)."""
    return _Latest.run


def init(
    name: str,
    accelerator: str | None = None,
    internet: bool | None = None,
    dir: str | os.PathLike[str] | None = None,
    keep: int | None = 3,
    *,
    expected_bytes: int | None = None,
    strict: bool | None = None,
    quiet: bool = False,
    deterministic: bool = False,
) -> Run:
    """Detect the platform, check the machine, and prepare the run's durable folder.

    Args:
        name: the run's name; its checkpoints go to a folder of that name.
        accelerator: ``"gpu"``, ``"gpu:N"``, ``"tpu"``, ``"cpu"`` or ``None``.
        internet: ``True``/``False`` when the run needs internet on/off; ``None``: no check.
        dir: a folder or fsspec URL instead of the platform's default durable folder.
        keep: how many checkpoints to keep.
        expected_bytes: the size of one checkpoint, when known (space is checked).
        strict: whether a failed check raises :class:`~nbresume.errors.PreflightError`.
            ``None``: in a Kaggle batch run (or as NBRESUME_STRICT says); elsewhere a failed
            check is a RuntimeWarning and the run carries on.
        quiet: print nothing (the report is still in ``run.report``).
        deterministic: make PyTorch's CUDA kernels repeatable, so that a resumed run
            continues bit for bit on a GPU too (slower; see
            :func:`nbresume.checkpoint.state.determinism.enable`). Call ``init`` before any CUDA
            work for it to cover cuBLAS.
    """
    check_run_name(name)
    apply_determinism(deterministic, "nbresume.init")  # before the preflight, which reports it
    sandbox = knobs.check_dir(name if dir is None else dir)  # `nbresume check`'s own folder
    if sandbox is not None:
        dir = sandbox
    here = detect()
    target = str(dir) if dir is not None else here.default_root(name)
    strict_now = resolve_strict(strict, here)
    # Fail fast, before a Drive mount or a seed copy can take minutes.
    report = preflight(
        accelerator,
        internet,
        target,
        expected_bytes=expected_bytes,
        keep=keep,
        strict=strict_now,
        platform=here,
    )
    seeded = None
    if dir is None:
        target = here.prepare_root(name)
        seeded = here.seeded
        report = report.with_check(check_durable(target, here, expected_bytes, keep))
        if strict_now:
            raise_if_failed(report)
    for check in report.failures:
        warnings.warn(
            f"nbresume preflight: {check.name}: {check.seen}. Fix: {check.fix}",
            RuntimeWarning,
            stacklevel=2,
        )
    run = Run(name=name, platform=here, dir=target, report=report, keep=keep, seeded=seeded)
    _Latest.run = run
    if not quiet:
        if _DISPLAY:
            _DISPLAY[0](run)
        else:
            print(run.summary())
    return run


#: How a new run is shown where it runs (the setup panel and the training panel in a notebook,
#: the status line elsewhere), provided by ``nbresume/__init__.py``: the notebook layer sits
#: above this module, which therefore does not import it. Without it, the summary is printed.
_DISPLAY: list[Callable[[Run], None]] = []


def provide_display(display: Callable[[Run], None]) -> None:
    """Set how :func:`init` shows a new run (see :data:`_DISPLAY`)."""
    _DISPLAY[:] = [display]
