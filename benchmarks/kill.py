"""Suite 3, kill -9 recovery.

Each tool saves in a training loop as its documentation tells a user to (see ``tools.py``),
every ``every`` steps, in a child process; the runner kills the child with SIGKILL at a random
instant (uniform over ``window`` seconds, once a complete checkpoint exists, so many kills
land inside a save), then starts a new child that resumes through the tool's documented
resume path, reports, trains on and is killed in turn.

A restart **recovers automatically** when the resume path raises nothing, resumes from a
checkpoint (not from scratch: one existed before the kill), and the state it loaded is
consistent: the SHA-256 of the model's and the optimizer's tensors equals the one recorded
when that step was saved. **Steps lost**: the last step the killed child completed minus the
step the restart resumed from. After a failed restart the folder is wiped (what a user would
have to do) and the chain starts over; that start counts as no kill.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from benchmarks._common import build_state, state_sha256, train_step
from benchmarks.tools import BY_NAME, Tool
from benchmarks.zygote import Zygote


def life(args: dict[str, Any]) -> dict[str, Any]:
    """One life of the chain: resume, report, train and save until killed."""
    import torch

    torch.set_num_threads(1)
    tool = BY_NAME[args["tool"]]
    tool.import_library()
    out = os.open(args["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    hashes = os.open(args["hashes"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)

    def say(message: dict[str, Any]) -> None:
        os.write(out, (json.dumps(message) + "\n").encode())

    model, optimizer, _ = build_state(args["mb"])
    session = tool.open(Path(args["folder"]), model, optimizer)
    try:
        step = session.restore()
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        say({"resume": "error", "error": f"{type(exc).__name__}: {exc}"[:300]})
        return {}
    if step is None:
        say({"resume": "fresh"})
        step = 0
    else:
        known: set[str] = set()
        with open(args["hashes"]) as handle:
            for line in handle:
                if line.endswith("\n"):
                    entry = json.loads(line)
                    if entry["step"] == step:
                        known.add(entry["sha"])
        say({"resume": "ok", "step": step, "consistent": state_sha256(model, optimizer) in known})
        say({"ready": True})
    durable = step > 0
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        train_step(model, optimizer, step)
        step += 1
        say({"step": step})
        if step % args["every"] == 0:
            entry = {"step": step, "sha": state_sha256(model, optimizer)}
            os.write(hashes, (json.dumps(entry) + "\n").encode())
            session.save(step)
            if not durable:
                session.wait()
                durable = True
                say({"ready": True})
    return {}


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


class _Life:
    """One child of the chain, as the runner sees it."""

    def __init__(self, zygote: Zygote, args: dict[str, Any], log: Path) -> None:
        self.zygote, self.log = zygote, log
        self.pid, self.answer = zygote.start("kill-life", {**args, "log": str(log)})
        self.status: int | None = None

    def ended(self) -> bool:
        return self.status is not None or self.answer.exists() or self.zygote.child_ended()

    def wait_for(self, key: str) -> dict[str, Any] | None:
        """The child's first message with ``key``; ``None`` if it ended (or two minutes
        passed) without one."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            ended = self.ended()
            for message in _lines(self.log):
                if key in message:
                    return message
            if ended:
                return None
            time.sleep(0.01)
        return None

    def resume(self) -> dict[str, Any]:
        message = self.wait_for("resume")
        if message is not None:
            return message
        self.end()
        return {"resume": "error", "error": self.cause()}

    def cause(self) -> str:
        """Why the child ended by itself."""
        if self.answer.exists():
            error = json.loads(self.answer.read_text()).get("error")
            if error:
                return str(error)
        if self.status is not None and self.status < 0:
            return f"the process died of {signal.Signals(-self.status).name}"
        return f"the process ended with status {self.status} and said nothing"

    def end(self) -> None:
        """SIGKILL the child unless it has ended by itself; reap it through the zygote."""
        if self.status is not None:
            return
        if not self.ended():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        self.status = self.zygote.join(self.pid, 60)

    def last_step(self) -> int | None:
        steps = [m["step"] for m in _lines(self.log) if "step" in m and "resume" not in m]
        return steps[-1] if steps else None


def _outcome(last_step: int, resumed: dict[str, Any]) -> dict[str, Any]:
    ok = resumed["resume"] == "ok" and bool(resumed.get("consistent"))
    outcome: dict[str, Any] = {"last_step": last_step, "ok": ok, "resume": resumed["resume"]}
    if resumed["resume"] == "ok":
        outcome.update(step=resumed["step"], consistent=resumed["consistent"])
    if "error" in resumed:
        outcome["error"] = resumed["error"]
    outcome["lost"] = last_step - resumed["step"] if ok else last_step
    return outcome


def chain(zygote: Zygote, tool: Tool, *, kills: int, settings: dict[str, Any], scratch: Path,
          seed: int) -> dict[str, Any]:  # fmt: skip
    rng = random.Random(seed)
    work = scratch / "kill"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    folder, hashes = work / "checkpoints", work / "hashes.jsonl"
    args = {"tool": tool.name, "folder": str(folder), "hashes": str(hashes), **settings}

    def start_over() -> None:  # what a user would have to do: wipe and begin again
        shutil.rmtree(folder, ignore_errors=True)
        hashes.unlink(missing_ok=True)

    outcomes: list[dict[str, Any]] = []
    pending: int | None = None  # the last completed step of the child just killed
    lives = killed = 0
    while killed < kills and lives < 3 * kills + 3:
        lives += 1
        life = _Life(zygote, args, work / f"life-{lives}.jsonl")
        resumed = life.resume()
        if pending is not None:
            outcomes.append(_outcome(pending, resumed))
            pending = None
            if not outcomes[-1]["ok"]:
                life.end()
                start_over()
                continue
        ready = life.wait_for("ready") if resumed["resume"] != "error" else None
        if ready is None:
            life.end()
            if resumed["resume"] != "error":  # the training loop itself failed
                return {"error": f"the training child failed: {life.cause()}"}
            start_over()
            continue
        time.sleep(rng.uniform(0, settings["window"]))
        life.end()
        killed += 1
        pending = life.last_step() or int(resumed.get("step", 0))
    if pending is not None:  # the last kill's restart: resume and report only
        life = _Life(zygote, args, work / "life-last.jsonl")
        outcomes.append(_outcome(pending, life.resume()))
        life.end()
    shutil.rmtree(work, ignore_errors=True)
    recovered = [o for o in outcomes if o["ok"]]
    return {
        "kills": len(outcomes),
        "recovered": len(recovered),
        "recovery_share": len(recovered) / len(outcomes) if outcomes else float("nan"),
        "mean_steps_lost": (sum(o["lost"] for o in recovered) / len(recovered))
        if recovered
        else float("nan"),
        "max_steps_lost": max((o["lost"] for o in recovered), default=0),
        "failures": sorted({o.get("error", o["resume"]) for o in outcomes if not o["ok"]})[:5],
        "outcomes": outcomes,
    }


def run(zygote: Zygote, tools: list[Tool], *, kills: int, settings: dict[str, Any],
        scratch: Path, log: Any) -> dict[str, Any]:  # fmt: skip
    results: dict[str, Any] = {}
    for index, tool in enumerate(tools):
        missing = tool.missing()
        if missing:
            results[tool.name] = {"error": missing}
            continue
        log(f"kill: {tool.name}, {kills} kills")
        results[tool.name] = chain(
            zygote, tool, kills=kills, settings=settings, scratch=scratch, seed=index
        )
    return {"settings": {**settings, "kills": kills}, "tools": results}
