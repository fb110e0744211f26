"""The warm-fork server (testkit.warmfork) stands in for ``python script.py``: the tests moved to
it prove what they prove only if its child is what a fresh interpreter would be."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from testkit import warmfork

#: Prints, as JSON, what a test of a child can observe of the interpreter it runs in.
PROBE = textwrap.dedent(
    """
    import json, os, pickle, random, signal, sys, threading
    import numpy as np
    import torch

    class Local:
        pass

    handlers = {}
    for name in ("SIGINT", "SIGTERM", "SIGCHLD", "SIGPIPE", "SIGUSR1", "SIGHUP"):
        handler = signal.getsignal(getattr(signal, name))
        handlers[name] = getattr(handler, "__name__", str(handler))
    print(json.dumps({
        "argv": sys.argv,
        "path0": sys.path[0],
        "cwd": os.getcwd(),
        "env": os.environ.get("PROBE_VALUE"),
        "umask": os.umask(0o022),
        "handlers": handlers,
        "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "threads": threading.active_count(),
        "tasks": len(os.listdir("/proc/self/task")),
        "main": sys.modules["__main__"].__dict__ is globals(),
        "pickled": type(pickle.loads(pickle.dumps(Local()))).__module__,
        "torch_threads": torch.get_num_threads(),
        "seeds": [torch.initial_seed(), random.random(), float(np.random.random())],
        "suite_modules": sorted(m for m in sys.modules if m.startswith("testkit")),
        "streams": [(s.line_buffering, s.write_through, type(s.buffer).__name__)
                    for s in (sys.stdin, sys.stdout, sys.stderr)],
    }))
    sys.exit(int(sys.argv[1]))
    """
)


def probe(tmp_path: Path, run: object, unbuffered: bool = True) -> dict[str, object]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {**os.environ, "PROBE_VALUE": "seen", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONUNBUFFERED", None)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    done = run(  # type: ignore[operator]
        [sys.executable, str(script), "3"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    answer: dict[str, object] = json.loads(done.stdout)
    return answer


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "unbuffered"])
def test_a_forked_child_sees_what_a_fresh_interpreter_sees(
    tmp_path: Path, unbuffered: bool
) -> None:
    fresh = probe(tmp_path, subprocess.run, unbuffered)
    warm = probe(tmp_path, warmfork.run, unbuffered)
    again = probe(tmp_path, warmfork.run, unbuffered)
    different = {"seeds", "tasks"}  # drawn at each start; math libraries' threads, started lazily
    assert {k: v for k, v in warm.items() if k not in different} == {
        k: v for k, v in fresh.items() if k not in different
    }
    assert warm["tasks"] == 1
    seeds = [fresh["seeds"], warm["seeds"], again["seeds"]]
    for i, each in enumerate(seeds):  # every stream drawn anew, in every child
        for other in seeds[i + 1 :]:
            assert all(a != b for a, b in zip(each, other, strict=True)), seeds  # type: ignore[call-overload]


def test_signals_the_test_process_ignores_stay_ignored_in_the_child(tmp_path: Path) -> None:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        fresh = probe(tmp_path, subprocess.run)
        warm = probe(tmp_path, warmfork.run)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert fresh["handlers"] == warm["handlers"]
    assert warm["handlers"]["SIGINT"] == str(int(signal.SIG_IGN))  # type: ignore[index]


def test_exit_statuses_and_what_atexit_sees_are_those_of_a_real_process(tmp_path: Path) -> None:
    # atexit's functions run, and see the exception that ended the script in sys.last_value
    # (nbresume's own tells a script that ended by an error from one that finished).
    at_exit = "import atexit, sys; atexit.register(lambda: print(repr(sys.last_value)))\n"
    for code, expected in [
        ("sys.last_value = None", 0),
        ("raise SystemExit(7)", 7),
        ("raise ValueError('bad shape')", 1),
        ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -signal.SIGTERM),
        ("raise KeyboardInterrupt", -signal.SIGINT),
    ]:
        argv = [sys.executable, "-c", at_exit + code]
        fresh = subprocess.run(argv, capture_output=True, text=True)
        warm = warmfork.run(argv, capture_output=True, text=True)
        assert (warm.returncode, fresh.returncode) == (expected, expected), code
        assert warm.stdout == fresh.stdout, code
        assert warm.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:], code


def test_the_test_kills_the_child_and_what_it_started_by_its_group(tmp_path: Path) -> None:
    started = tmp_path / "grandchild"
    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen(['sleep', '300'])\n"
        f"open({str(started)!r}, 'w').write(str(p.pid))\n"
        "print('ready', flush=True)\n"
        "time.sleep(300)\n"
    )
    proc = warmfork.popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline() == "ready\n"
        assert proc.poll() is None
        grandchild = int(started.read_text())
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
        deadline = time.monotonic() + 30
        while Path(f"/proc/{grandchild}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # reaped by init once killed
        assert (
            not Path(f"/proc/{grandchild}").exists()
            or " Z " in Path(f"/proc/{grandchild}/stat").read_text()
        )
    finally:
        proc.close()


def test_stdin_is_fed_and_a_timeout_kills_the_child() -> None:
    echoed = warmfork.run(
        [sys.executable, "-c", "import sys; print(sys.stdin.read().upper())"],
        input="step 3", capture_output=True, text=True,
    )  # fmt: skip
    assert echoed.stdout == "STEP 3\n"
    with pytest.raises(subprocess.TimeoutExpired):
        warmfork.run([sys.executable, "-c", "import time; time.sleep(300)"], timeout=1)


def test_what_a_fork_cannot_give_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="interpreter options"):
        warmfork.popen([sys.executable, "-X", "dev", "-c", "pass"])
    (tmp_path / "numpy").mkdir()  # a stand-in the server's own numpy would hide
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    with pytest.raises(ValueError, match="the server has imported"):
        warmfork.popen([sys.executable, "-c", "import numpy"], env=env)
