"""Suite ``restore``: how long until training runs again, against torch.load and safetensors.

For each state size (a model of linear layers and its Adam state, :func:`build_state`), each
loader saves once: ``torch.save`` (restored with ``torch.load(weights_only=True)`` and
``load_state_dict``), safetensors (``load_file`` of two files, mapped copy-on-write, nothing
checked) and nbresume (``Checkpointer.restore()``: every byte hashed and checked). Then, in
fresh processes forked from the zygote, with the loaders interleaved in each round, each
builds the model and optimizer as a resumed script would (and takes one step of a small
throwaway model, so that a process's first-step costs are not the restore's), and is timed
from the start of its restore to the end of the first optimizer step after it: the point
where training runs again (a mapped file's pages are copied when that step first writes
them, so a restore alone would flatter it). **Cold**: the checkpoint's pages dropped from the
page cache first (``posix_fadvise(DONTNEED)`` per file, which needs no privilege); **warm**:
the same restore again with its files in the page cache. Medians of ``reps`` rounds; the
ratio is nbresume's time over the faster of the two others.
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks._common import build_state, evict, state_layout, train_step
from benchmarks.tools import LOADERS
from benchmarks.zygote import Zygote

#: The loaders compared, as :data:`benchmarks.tools.LOADERS` names them.
NAMES = ("torch.save", "safetensors", "nbresume")
#: How the page shows them.
SHOWN = {"torch.save": "torch.load", "safetensors": "safetensors", "nbresume": "nbresume"}


def save_child(args: dict[str, Any]) -> dict[str, Any]:
    tool = LOADERS[args["tool"]]
    tool.import_library()
    folder = Path(args["folder"])
    shutil.rmtree(folder, ignore_errors=True)
    model, optimizer, nbytes = build_state(args["mb"])
    session = tool.open(folder, model, optimizer)
    session.save(1)
    session.wait()
    session.close()
    return {"state_bytes": nbytes}


def load_child(args: dict[str, Any]) -> dict[str, Any]:
    """Build the state as a resumed script does, then time its restore plus the first step."""
    tool = LOADERS[args["tool"]]
    tool.import_library()
    model, optimizer, _ = build_state(args["mb"], seed=1)
    _warm_up()
    session = tool.open(Path(args["folder"]), model, optimizer)
    start = time.perf_counter()
    step = session.restore()
    restored = time.perf_counter()
    train_step(model, optimizer, 1)
    stepped = time.perf_counter()
    session.close()
    if step != 1:
        return {"error": f"restored step {step}, expected 1"}
    return {"restore_s": restored - start, "until_step_s": stepped - start}


def _warm_up() -> None:
    """One optimizer step of a small throwaway model, before the clock starts: what any first
    step in a process pays once (autograd's threads, the allocator's first pages, the kernels'
    dispatch) is paid here, the same for every loader, so that the first step timed is the
    restored state's own (untimed, it varied from 0.07 s to 1.5 s between identical runs)."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    train_step(model, optimizer, 0)


def run(zygote: Zygote, settings: dict[str, Any], scratch: Path, log: Any) -> dict[str, Any]:
    """Every size, every loader: cold and warm restores until the first step, interleaved."""
    sizes: dict[str, Any] = {}
    for mb in settings["sizes"]:
        nbytes = state_layout(mb)[2]
        folders = {name: scratch / "restore" / f"{mb}-{index}" for index, name in
                   enumerate(NAMES)}  # fmt: skip
        tools: dict[str, Any] = {}
        for name in NAMES:
            missing = LOADERS[name].missing()
            if missing:
                tools[name] = {"error": missing}
                continue
            log(f"restore: {SHOWN[name]} saves {nbytes / 1e6:.0f} MB")
            saved = zygote.call("restore-save", {"tool": name, "mb": mb,
                                                 "folder": str(folders[name])})  # fmt: skip
            tools[name] = (
                saved
                if "error" in saved
                else {"cold": [], "warm": [], "cold_restore": [], "warm_restore": []}
            )
        for rep in range(settings["reps"]):
            log(f"restore: {nbytes / 1e6:.0f} MB, round {rep + 1} of {settings['reps']}")
            for name in NAMES:
                if "error" in tools[name]:
                    continue
                args = {"tool": name, "mb": mb, "folder": str(folders[name])}
                evict(folders[name])
                for kind in ("cold", "warm"):
                    answer = zygote.call("restore-load", args)
                    if "error" in answer:
                        tools[name] = answer
                        break
                    tools[name][kind].append(answer["until_step_s"])
                    tools[name][f"{kind}_restore"].append(answer["restore_s"])
        shutil.rmtree(scratch / "restore", ignore_errors=True)
        for item in tools.values():
            for kind in ("cold", "warm", "cold_restore", "warm_restore"):
                if item.get(kind):
                    item[f"{kind}_s"] = statistics.median(item[kind])
        sizes[str(mb)] = {"state_bytes": nbytes, "tools": tools}
    return {"settings": settings, "sizes": sizes}


def render(results: dict[str, Any]) -> str:
    """The page: per size, each loader's cold and warm time until the first step, then the
    restore alone."""
    lines = _table(results, "")
    lines += [
        "",
        "The restore alone (the same runs, without the first step):",
        "",
        *_table(results, "_restore")[4:],
    ]
    return "\n".join(lines) + "\n"


def _table(results: dict[str, Any], suffix: str) -> list[str]:
    lines = [
        "# Restore until training runs again: torch.load, safetensors, nbresume",
        "",
        "From the start of the restore to the end of the first optimizer step after it, in a "
        "fresh process; cold: the files dropped from the page cache first; warm: in it. "
        f"Medians of {results['settings']['reps']} rounds. The last column is nbresume's time "
        "over the faster of torch.load and safetensors (cold / warm).",
        "",
        "| state | "
        + " | ".join(f"{SHOWN[n]} cold | {SHOWN[n]} warm" for n in NAMES)
        + " | nbresume ÷ faster other |",
        "|---" * (2 + 2 * len(NAMES)) + "|",
    ]
    for entry in results["sizes"].values():
        tools = entry["tools"]
        cells = []
        for name in NAMES:
            item = tools.get(name, {})
            if "error" in item:
                cells += [f"failed: {str(item['error'])[:40]}", "–"]
            else:
                cold, warm = item[f"cold{suffix}_s"], item[f"warm{suffix}_s"]
                cells += [f"{cold:.3f} s", f"{warm:.3f} s"]
        ratios = []
        for kind in ("cold", "warm"):
            key = f"{kind}{suffix}_s"
            others = [tools[n].get(key) for n in NAMES[:2] if "error" not in tools[n]]
            ours = tools["nbresume"].get(key)
            known = [o for o in others if o is not None]
            ratios.append(f"{ours / min(known):.2f}x" if ours is not None and known else "–")
        size = f"{entry['state_bytes'] / 1e6:.0f} MB"
        lines.append(f"| {size} | " + " | ".join(cells) + f" | {' / '.join(ratios)} |")
    return lines
