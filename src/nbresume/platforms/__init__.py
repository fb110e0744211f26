"""Where training runs: one module per place, one :class:`Platform` interface.

:func:`detect` looks at environment variables, marker files and ``sys.modules`` (never
importing anything heavy) and returns the first platform that recognises itself, in the
order of :data:`PLATFORMS`. ``NBRESUME_PLATFORM`` overrides detection.
"""

from __future__ import annotations

from nbresume import knobs
from nbresume.errors import UsageError
from nbresume.platforms.base import DangerClock, Platform
from nbresume.platforms.cluster import KubernetesPlatform, SlurmPlatform, SshPlatform
from nbresume.platforms.colab import ColabPlatform
from nbresume.platforms.gpu import accelerator_attached
from nbresume.platforms.kaggle import KaggleBatchPlatform, KagglePlatform
from nbresume.platforms.local import LocalPlatform

#: Detection order: the most specific first; :class:`LocalPlatform` always matches.
PLATFORMS: tuple[type[Platform], ...] = (
    ColabPlatform,
    KaggleBatchPlatform,
    KagglePlatform,
    SlurmPlatform,
    KubernetesPlatform,
    SshPlatform,
    LocalPlatform,
)


def by_name(name: str) -> Platform:
    """The platform called ``name`` (``"kaggle-batch"``, ``"slurm"``, ...)."""
    for cls in PLATFORMS:
        if cls.name == name:
            return cls()
    names = ", ".join(cls.name for cls in PLATFORMS)
    raise UsageError(f"there is no platform called {name!r}", fix=f"use one of: {names}")


def detect() -> Platform:
    """The platform this process runs on."""
    forced = knobs.platform()
    if forced:
        return by_name(forced)
    for cls in PLATFORMS:
        if cls.detect():
            return cls()
    return LocalPlatform()  # unreachable: LocalPlatform.detect() is always true


def session_deadline() -> tuple[float | None, str]:
    """When this platform ends the session (a Unix time) and what that limit is called: what
    ``deadline="auto"`` is given (registered in :mod:`nbresume.checkpoint.hooks`)."""
    return detect().session_deadline(accelerator_attached())


__all__ = ["PLATFORMS", "DangerClock", "Platform", "by_name", "detect", "session_deadline"]
