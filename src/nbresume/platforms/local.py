"""A machine of one's own: a laptop or a workstation, with nothing watching the clock."""

from __future__ import annotations

from pathlib import Path

from nbresume import knobs
from nbresume.platforms.base import DangerClock, Platform


class LocalPlatform(Platform):
    """The fallback when no other platform is recognised."""

    name = "local"
    title = "local machine"

    @classmethod
    def detect(cls) -> bool:
        return True

    def why(self) -> str:
        return "no notebook service, scheduler or SSH session recognised"

    def durable_base(self) -> Path:
        return knobs.home()

    def danger_clocks(self, accelerated: bool) -> list[DangerClock]:
        return [
            DangerClock(
                "sleep, restart or a closed terminal",
                None,
                "the training process and everything in memory",
                "checkpoints are verified on disk; rerunning the same command resumes from "
                "the newest one that verifies",
            )
        ]
