"""Turn the suites' results into a Markdown report, a JSON file, plots and the generated part
of ``docs/benchmarks.md``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from benchmarks.loop import REFERENCE_EVERY

BEGIN = "<!-- side-by-side:begin (written by python -m benchmarks; edit around it) -->"
END = "<!-- side-by-side:end -->"
PLOTS = ("bench-stall.png", "bench-loop.png", "bench-recovery.png")


def _ratio(value: float | None, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}f}x"


def _pct(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "–"
    return f"{100 * value:.2f} %"


def _seconds(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value * 1000:.0f} ms" if abs(value) < 1 else f"{value:.2f} s"


def _with_interval(value: float | None, interval: list[float] | None) -> str:
    """A share with its confidence interval: ``1.20 % [0.40, 2.10]``."""
    if value is None or interval is None:
        return "–"
    low, high = interval
    return f"{100 * value:.2f} % [{100 * low:.2f}, {100 * high:.2f}]"


def header(meta: dict[str, Any]) -> str:
    """The line every page of one run starts with: command, date, machine, file system, load."""
    return (
        f"Run: `{meta['command']}` ({meta['mode']} mode), {meta['date']}, "
        f"{meta['duration_s']:.0f} s in all; machine: {meta['machine']}; scratch on "
        f"{meta['file_system']}; load average (1, 5, 15 min) before the run: "
        f"{meta['load_before']}, after: {meta['load_after']}."
    )


def stamp(page: str, meta: dict[str, Any]) -> str:
    """``page`` with the run's header line right below its title (line 3)."""
    title, _, body = page.partition("\n")
    return f"{title}\n\n{header(meta)}\n\n{body.lstrip(chr(10))}"


def _short(text: str, limit: int = 110) -> str:
    text = " ".join(text.split()).replace("|", "/")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _ok(result: Any) -> bool:
    return isinstance(result, dict) and "error" not in result


def summary_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per tool, plain numbers (also the JSON's ``summary``)."""
    rows = []
    stall = results.get("stall", {}).get("sizes", [])
    largest = stall[-1] if stall else None
    for name in results["tools"]:
        row: dict[str, Any] = {"tool": name, "is_async": results["tools"][name]["is_async"],
                               "fsync": results["tools"][name]["fsync"]}  # fmt: skip
        errors = []
        if largest is not None:
            cal, item = largest["calibration"], largest["tools"].get(name)
            row["stall_state_mb"] = largest["state_bytes"] / 1e6
            if _ok(item):
                row["blocked_over_raw_write"] = item["blocked_s"] / cal["write_fsync_s"]
                row["done_over_raw_write"] = item["done_s"] / cal["write_fsync_s"]
                row["blocked_over_memcpy"] = item["blocked_s"] / cal["memcpy_s"]
                row["written_over_state"] = item["written_bytes"] / item["state_bytes"]
                row["extra_memory_over_state"] = item["extra_peak_bytes"] / item["state_bytes"]
            elif item:
                errors.append(f"stall: {item['error']}")
        for suite, keys in (
            (
                "loop",
                (
                    "overhead_at_200",
                    "overhead_at_200_interval",
                    "resolution_at_200",
                    "smallest_every_under_1pct",
                ),
            ),
            ("kill", ("recovery_share", "mean_steps_lost", "max_steps_lost")),
            ("resume", ("bit_exact",)),
        ):
            item = results.get(suite, {}).get("tools", {}).get(name)
            if _ok(item):
                row.update({key: item[key] for key in keys if key in item})
            elif item:
                errors.append(f"{suite}: {item['error']}")
        resume = results.get("resume", {})
        item = resume.get("tools", {}).get(name)
        if _ok(item) and "restore_s" in item:
            row["restore_over_raw_read"] = item["restore_s"] / resume["calibration"]["cold_read_s"]
        if errors:
            row["errors"] = errors
        rows.append(row)
    return rows


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    out = [
        "# Side by side: torch.save, DCP, Lightning, Accelerate, nbresume",
        "",
        header(meta),
        "",
        f"- Software: {meta['software']}",
        "- Seconds per suite: "
        + ", ".join(f"{name} {seconds:.0f}" for name, seconds in meta.get("suite_s", {}).items()),
        "",
        "Ratios divide by the machine's own limits for the same bytes, measured on the same "
        "file system just before each suite: **raw write+fsync** (one file, fsynced, with its "
        "folder), **memory copy** (into an existing buffer), **raw cold read** (after dropping "
        "the file's cached pages). How each tool is used and what each column times: "
        "`benchmarks/README.md`.",
        "",
        "## Summary",
        "",
    ]
    out += summary_table(results)
    if results.get("loop"):
        out += ["", resolution_line(results["loop"])]
    out += ["", "## 1. Stall and durability", ""]
    for size in results.get("stall", {}).get("sizes", []):
        cal = size["calibration"]
        out += [
            f"### State of {size['state_bytes'] / 1e6:.0f} MB (model + Adam)",
            "",
            f"Raw write+fsync {_seconds(cal['write_fsync_s'])} "
            f"({size['state_bytes'] / 1e6 / cal['write_fsync_s']:.0f} MB/s), memory copy "
            f"{_seconds(cal['memcpy_s'])}, raw cold read {_seconds(cal['cold_read_s'])}.",
            "",
        ]
        rows = []
        for name, item in size["tools"].items():
            if not _ok(item):
                rows.append([name, item["error"], *["–"] * 7])
                continue
            fsynced = results["tools"][name]["fsync"]
            done_label = "durable" if fsynced else "written, not fsynced"
            rows.append([
                name,
                _seconds(item["blocked_s"]),
                _ratio(item["blocked_s"] / cal["write_fsync_s"]),
                _ratio(item["blocked_s"] / cal["memcpy_s"], 1)
                if results["tools"][name]["is_async"] else "–",
                f"{_seconds(item['done_s'])} ({done_label})",
                _ratio(item["done_s"] / cal["write_fsync_s"]),
                _ratio(item["written_bytes"] / item["state_bytes"]),
                _ratio(item["extra_peak_bytes"] / item["state_bytes"]),
                ", ".join(_seconds(x) for x in item["done_all"]),
            ])  # fmt: skip
        out += _table(
            ["Tool", "Blocked", "Blocked / raw write", "Blocked / memory copy", "Done",
             "Done / raw write", "Written / state", "Extra peak memory / state",
             "Every save (done)"],
            rows,
        )  # fmt: skip
        out.append("")
    if skipped := results.get("stall_skipped"):
        out += [skipped, ""]
    loop = results.get("loop")
    if loop:
        out += loop_section(loop)
    kill = results.get("kill")
    if kill:
        s = kill["settings"]
        out += ["## 3. kill -9 recovery", "",
                f"{s['kills']} SIGKILLs per tool at random instants (uniform over "
                f"{s['window']} s), saving every {s['every']} steps a state of "
                f"{s['mb']:.0f} MB.", ""]  # fmt: skip
        rows = []
        for name, item in kill["tools"].items():
            if not _ok(item):
                rows.append([name, item["error"], "–", "–", "–"])
                continue
            rows.append([
                name, f"{item['recovered']}/{item['kills']} ({100 * item['recovery_share']:.0f} %)",
                f"{item['mean_steps_lost']:.1f}" if item["recovered"] else "–",
                str(item["max_steps_lost"]) if item["recovered"] else "–",
                "; ".join(_short(f) for f in item["failures"]) or "–",
            ])  # fmt: skip
        out += _table(["Tool", "Recovered automatically", "Steps lost (mean)",
                       "Steps lost (max)", "Failures"], rows)  # fmt: skip
        out.append("")
    resume = results.get("resume")
    if resume:
        s, cal = resume["settings"], resume["calibration"]
        out += ["## 4. Resume", "",
                f"State of {cal['bytes'] / 1e6:.0f} MB; raw cold read "
                f"{_seconds(cal['cold_read_s'])}. Trained {s['steps']} steps, saved, "
                f"{s['more']} more steps compared with a fresh process's restore + the same "
                f"steps. Restore: the median of {s.get('reps', 1)} fresh processes per tool, "
                "tools interleaved; bit-exact in every one of them or not.", ""]  # fmt: skip
        out += ["**Until full speed**: the restore plus what the first training step after it "
                "takes beyond the second (a mapped file's pages are copied when the optimizer "
                "first writes them); the last column divides it by the fastest other tool's.",
                ""]  # fmt: skip
        resumed = {n: i["resumed_s"] for n, i in resume["tools"].items()
                   if _ok(i) and "resumed_s" in i and "same_as" not in i}  # fmt: skip
        rows = []
        for name, item in resume["tools"].items():
            if not _ok(item):
                rows.append([name, item["error"], "–", "–", "–", "–", "–"])
                continue
            same = f" (same code as {item['same_as']})" if "same_as" in item else ""
            each = ", ".join(_seconds(t) for t in item.get("restore_all", [item["restore_s"]]))
            until, over = "–", "–"
            if "resumed_s" in item:
                until = _seconds(item["resumed_s"])
                others = [v for n, v in resumed.items() if n not in (name, item.get("same_as"))]
                over = _ratio(item["resumed_s"] / min(others)) if others else "–"
            rows.append([name + same, _seconds(item["restore_s"]),
                         _ratio(item["restore_s"] / cal["cold_read_s"]), each, until, over,
                         "yes" if item["bit_exact"] else "no"])  # fmt: skip
        out += _table(["Tool", "Restore", "Restore / raw cold read", "Each restore",
                       "Until full speed", "/ fastest other", "Bit-exact"], rows)  # fmt: skip
        out.append("")
    out += ["## Every page of this run", "", *suite_lines(results, ""), ""]
    return "\n".join(out) + "\n"


def loop_section(loop: dict[str, Any]) -> list[str]:
    s = loop["settings"]
    tools = loop["tools"]
    fine = [item for item in tools.values() if _ok(item)]
    confidence = f"{100 * fine[0]['confidence']:.0f} %" if fine else "95 %"
    out = ["## 2. Throughput in the reference loop", "",
           f"MLP {s['depth']} x {s['width']} (ReLU) + 10-way output, Adam, batch {s['batch']}, "
           f"synthetic data, {s['threads']} torch thread(s). Per tool, {s['pairs']} pairs of "
           f"segments of {s['every']} steps: one plain, one that starts with a save, next to "
           "each other in alternating order, each ending with `wait()`. Extra per save: the "
           f"median of the pairs' differences, in brackets its {confidence} confidence "
           "interval (order statistics, no assumption on the noise). Overhead at a save every "
           f"{REFERENCE_EVERY} steps = extra per save / ({REFERENCE_EVERY} x step time), valid "
           f"for intervals of at least {s['every']} steps. An interval that contains 0 means "
           "the cost could not be told from zero. Smallest N under 1 %: from the interval's "
           "upper bound.", ""]  # fmt: skip
    if fine:
        out += [resolution_line(loop), ""]
    rows = []
    for name, item in tools.items():
        if not _ok(item):
            rows.append([name, item["error"], *["–"] * 5])
            continue
        low, high = item["extra_per_save_interval_s"]
        rows.append([
            name, f"{item['state_bytes'] / 1e6:.0f} MB", _seconds(item["step_s"]),
            f"{_seconds(item['extra_per_save_s'])} [{_seconds(low)}, {_seconds(high)}]",
            _with_interval(item["overhead_at_200"], item["overhead_at_200_interval"]),
            f"{100 * item['resolution_at_200']:.2f} %",
            str(item["smallest_every_under_1pct"]),
        ])  # fmt: skip
    out += _table(["Tool", "State", "Step", f"Extra per save [{confidence} interval]",
                   f"Overhead, save every {REFERENCE_EVERY} [interval]",
                   "Cannot resolve below", "Smallest N under 1 %"], rows)  # fmt: skip
    out.append("")
    return out


def resolution_line(loop: dict[str, Any]) -> str:
    """What the loop suite could not resolve in this run, in words."""
    fine = [item for item in loop["tools"].values() if _ok(item)]
    if not fine:
        return ""
    worst = max(item["resolution_at_200"] for item in fine)
    best = min(item["resolution_at_200"] for item in fine)
    unresolved = [name for name, item in loop["tools"].items()
                  if _ok(item) and not item["resolved_from_zero"]]  # fmt: skip
    return (
        f"**Resolution of the loop suite in this run**: an overhead below {100 * best:.2f} % to "
        f"{100 * worst:.2f} % (depending on the tool) at a save every {REFERENCE_EVERY} steps "
        "cannot be resolved on this machine under this load (the half-width of each interval, "
        "from the measured spread of the pairs). "
        + (f"Not told apart from zero: {', '.join(unresolved)}." if unresolved else "")
    ).strip()


def suite_lines(results: dict[str, Any], prefix: str) -> list[str]:
    """One line per suite: its page (``prefix`` + name), or why it has none in this run."""
    lines = []
    for name, item in results.get("suites", {}).items():
        if not prefix and item.get("page") == "side-by-side.md":
            lines.append(f"- {name}: this page")
        elif "page" in item:
            lines.append(f"- {name}: `{prefix}{item['page']}`")
        else:
            lines.append(f"- {name}: {item['status']}")
    return lines


def summary_table(results: dict[str, Any]) -> list[str]:
    rows = []
    for row in results["summary"]:
        if row.get("errors") and all("not installed" in e for e in row["errors"]):
            rows.append([row["tool"], "not installed", *["–"] * 9])
            continue
        lost = row.get("mean_steps_lost")
        rows.append([
            row["tool"],
            _ratio(row.get("blocked_over_raw_write")),
            _ratio(row.get("done_over_raw_write"))
            + ("" if row["fsync"] else " (no fsync)"),
            _ratio(row.get("blocked_over_memcpy"), 1) if row["is_async"] else "–",
            _ratio(row.get("extra_memory_over_state")),
            _with_interval(row.get("overhead_at_200"), row.get("overhead_at_200_interval")),
            str(row.get("smallest_every_under_1pct", "–")),
            _pct(row.get("recovery_share")).replace(".00 %", " %"),
            "–" if lost is None or math.isnan(lost) else f"{lost:.1f}",
            _ratio(row.get("restore_over_raw_read")),
            {True: "yes", False: "no"}.get(row.get("bit_exact"), "–"),  # type: ignore[arg-type]
        ])  # fmt: skip
    mb = results["summary"][0].get("stall_state_mb") if results["summary"] else None
    size = f" ({mb:.0f} MB)" if mb else ""
    return _table(
        ["Tool", f"Blocked / raw write{size}", f"Done / raw write{size}",
         "Async blocked / memory copy", "Extra memory / state",
         "Loop overhead, every 200 [confidence interval]",
         "Smallest N under 1 %", "Recovered after kill -9", "Steps lost", "Restore / raw read",
         "Bit-exact resume"],
        rows,
    )  # fmt: skip


# -- plots --------------------------------------------------------------------------------


def plots(results: dict[str, Any], folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    names = list(results["tools"])
    written = []

    sizes = results.get("stall", {}).get("sizes", [])
    if sizes:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
        width = 0.8 / len(sizes)
        for column, (key, title) in enumerate(
            (
                ("blocked_s", "training blocked per save"),
                ("done_s", "until done (durable if fsynced)"),
            )
        ):
            ax = axes[column]
            for index, size in enumerate(sizes):
                values = [
                    size["tools"][n][key] / size["calibration"]["write_fsync_s"]
                    if _ok(size["tools"].get(n)) else 0.0
                    for n in names
                ]  # fmt: skip
                ax.barh([i + index * width for i in range(len(names))], values, height=width,
                        label=f"{size['state_bytes'] / 1e6:.0f} MB")  # fmt: skip
            ax.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
            ax.set_xscale("log")
            _readable_log_axis(ax.xaxis, "x")
            ax.set_title(title)
            ax.set_xlabel("x raw write+fsync of the same bytes (log)")
        axes[0].set_yticks([i + width * (len(sizes) - 1) / 2 for i in range(len(names))], names)
        axes[0].invert_yaxis()
        axes[1].legend(title="state")
        fig.tight_layout()
        written.append(_save(fig, folder / PLOTS[0]))

    loop = results.get("loop", {}).get("tools", {})
    if loop:
        # one point per tool with its interval: the figure never shows more than was resolved
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        shown = [n for n in names if _ok(loop.get(n))]
        for row, name in enumerate(shown):
            item = loop[name]
            value = 100 * item["overhead_at_200"]
            low, high = (100 * x for x in item["overhead_at_200_interval"])
            color = "tab:blue" if item["resolved_from_zero"] else "tab:grey"
            ax.errorbar(value, row, xerr=[[value - low], [high - value]], fmt="o", color=color,
                        capsize=3)  # fmt: skip
        ax.axvline(0.0, color="black", linewidth=0.8)
        ax.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_yticks(range(len(shown)), shown)
        ax.invert_yaxis()
        ax.set_xlabel(f"training time added by a save every {REFERENCE_EVERY} steps (%)")
        ax.set_title("median and confidence interval (grey: not told apart from 0)")
        fig.tight_layout()
        written.append(_save(fig, folder / PLOTS[1]))

    kill = results.get("kill", {}).get("tools", {})
    resume = results.get("resume", {})
    if kill or resume:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        shares = [100 * kill[n]["recovery_share"] if _ok(kill.get(n)) else 0.0 for n in names]
        axes[0].barh(names, shares, color=["tab:green" if s == 100 else "tab:red" for s in shares])
        axes[0].set_xlim(0, 100)
        axes[0].set_title("restarts that resumed automatically after kill -9")
        axes[0].set_xlabel("%")
        axes[0].invert_yaxis()
        tools = resume.get("tools", {})
        ratios = [
            tools[n]["restore_s"] / resume["calibration"]["cold_read_s"] if _ok(tools.get(n)) else 0
            for n in names
        ]
        colors = ["tab:green" if _ok(tools.get(n)) and tools[n]["bit_exact"] else "tab:orange"
                  for n in names]  # fmt: skip
        axes[1].barh(names, ratios, color=colors)
        axes[1].axvline(1.0, color="black", linewidth=0.8, linestyle="--")
        axes[1].set_title("restore time (green: bit-exact resume)")
        axes[1].set_xlabel("x raw cold read of the same bytes")
        axes[1].invert_yaxis()
        fig.tight_layout()
        written.append(_save(fig, folder / PLOTS[2]))
    return written


def _readable_log_axis(axis: Any, suffix: str = "") -> None:
    """Label a log axis at 1, 2 and 5 times each power of ten, as plain numbers, and leave the
    other minor ticks unlabelled (matplotlib's default labels them too, and they overlap)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}{suffix}"))
    axis.set_minor_formatter(NullFormatter())


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path


# -- files --------------------------------------------------------------------------------


def write(results: dict[str, Any], out: Path, images: Path) -> tuple[Path, Path, list[Path]]:
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / "side-by-side.md", out / "side-by-side.json"
    md.write_text(markdown(results))
    js.write_text(json.dumps(results, indent=1, sort_keys=False, default=str) + "\n")
    return md, js, plots(results, images)


def update_docs(results: dict[str, Any], page: Path) -> None:
    """Rewrite the part of ``page`` between the two markers; the rest is hand-written."""
    text = page.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{page}: the markers {BEGIN!r} and {END!r} are missing")
    meta = results["meta"]
    generated = [
        BEGIN,
        "",
        header(meta),
        "",
        f"Software: {meta['software']}.",
        "",
        *summary_table(results),
        "",
        *([resolution_line(results["loop"]), ""] if results.get("loop") else []),
        *(f"![{name}](img/{name})" for name in PLOTS),
        "",
        'Every page of this run (each starts with the "Run:" line above):',
        "",
        *suite_lines(results, "benchmarks/results/"),
        "",
        END,
    ]
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    page.write_text(head + "\n".join(generated) + tail)
