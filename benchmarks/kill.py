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
    except Exception as exc:
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


def _wait_for(path: Path, keys: tuple[str, ...], answer: Path) -> dict[str, Any] | None:
    """The first message of the child's log with one of ``keys``; ``None`` if the child ended
    (or two minutes passed) without one."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ended = answer.exists()
        for message in _lines(path):
            if any(key in message for key in keys):
                return message
        if ended:
            return None
        time.sleep(0.01)
    return None


def _end(zygote: Zygote, pid: int, answer: Path) -> str | None:
    """SIGKILL the child unless it has ended by itself (it writes its answer file as it
    ends); reap it through the zygote. The error it ended with, if any."""
    if not answer.exists():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    zygote.join(pid, 60)
    if answer.exists():
        error = json.loads(answer.read_text()).get("error")
        return str(error) if error else None
    return None


def chain(zygote: Zygote, tool: Tool, *, kills: int, settings: dict[str, Any], scratch: Path,
          seed: int) -> dict[str, Any]:  # fmt: skip
    rng = random.Random(seed)
    work = scratch / "kill"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    folder, hashes = work / "checkpoints", work / "hashes.jsonl"
    outcomes: list[dict[str, Any]] = []
    pending: int | None = None  # the last completed step of the child just killed
    lives = killed = 0
    while killed < kills:
        lives += 1
        if lives > 3 * kills + 3:
            break
        log = work / f"life-{lives}.jsonl"
        args = {"tool": tool.name, "folder": str(folder), "hashes": str(hashes),
                "log": str(log), **settings}  # fmt: skip
        pid, answer = zygote.start("kill-life", args)
        resumed = _wait_for(log, ("resume",), answer) or {"resume": "error", "error": "no answer"}
        ready = None
        if resumed["resume"] != "error":
            ready = _wait_for(log, ("ready",), answer)
        if pending is not None:
            ok = resumed["resume"] == "ok" and bool(resumed.get("consistent"))
            outcome: dict[str, Any] = {"last_step": pending, "ok": ok, "resume": resumed["resume"]}
            if resumed["resume"] == "ok":
                outcome.update(step=resumed["step"], consistent=resumed["consistent"])
            if "error" in resumed:
                outcome["error"] = resumed["error"]
            outcome["lost"] = pending - resumed["step"] if ok else pending
            outcomes.append(outcome)
            pending = None
            if not ok:  # a user would start over: wipe and begin a fresh chain
                _end(zygote, pid, answer)
                shutil.rmtree(folder, ignore_errors=True)
                hashes.unlink(missing_ok=True)
                continue
        if ready is None:
            crashed = _end(zygote, pid, answer)
            if crashed:  # the loop itself failed, not the resume: no point going on
                return {"error": f"the training child failed: {crashed}"}
            shutil.rmtree(folder, ignore_errors=True)
            hashes.unlink(missing_ok=True)
            continue
        time.sleep(rng.uniform(0, settings["window"]))
        _end(zygote, pid, answer)
        killed += 1
        steps = [m["step"] for m in _lines(log) if "step" in m and "resume" not in m]
        pending = steps[-1] if steps else int(resumed.get("step", 0))
    if pending is not None:  # the last kill's restart: resume and report only
        log = work / "life-last.jsonl"
        args = {"tool": tool.name, "folder": str(folder), "hashes": str(hashes),
                "log": str(log), **settings}  # fmt: skip
        pid, answer = zygote.start("kill-life", args)
        resumed = _wait_for(log, ("resume",), answer) or {"resume": "error", "error": "no answer"}
        with_step = resumed["resume"] == "ok"
        ok = with_step and bool(resumed.get("consistent"))
        outcome = {"last_step": pending, "ok": ok, "resume": resumed["resume"],
                   "lost": pending - resumed["step"] if ok else pending}  # fmt: skip
        if with_step:
            outcome.update(step=resumed["step"], consistent=resumed["consistent"])
        if "error" in resumed:
            outcome["error"] = resumed["error"]
        outcomes.append(outcome)
        _end(zygote, pid, answer)
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
