"""The side-by-side benchmark runner runs end to end (``python -m benchmarks --tiny``, a few
MB, one kill per tool) and its results hold together. Nothing here is timed: speed lives in
the results the runner writes, not in assertions."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from benchmarks import loop, report, stall
from benchmarks.__main__ import PAGES
from benchmarks.tools import TOOLS, Tool

from testkit.paths import ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("bench-out")
    scratch = tmp_path_factory.mktemp("bench-scratch")
    results_dir = ROOT / "benchmarks" / "results"
    names = ["side-by-side.md", "side-by-side.json", *PAGES.values()]
    watched = [ROOT / "docs" / "benchmarks.md",
               *(results_dir / n for n in names if (results_dir / n).exists())]  # fmt: skip
    before = {path: path.read_bytes() for path in watched}
    images = {p: p.stat().st_mtime_ns for p in (ROOT / "docs" / "img").glob("bench-*.png")}
    (out / "hf.md").write_text("# a page of an earlier run\n")  # tiny mode does not run hf
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--tiny", "--out", str(out), "--dir", str(scratch)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    # --out leaves the committed results, the documentation and its plots alone
    assert {path: path.read_bytes() for path in watched} == before
    assert {p: p.stat().st_mtime_ns for p in (ROOT / "docs" / "img").glob("bench-*.png")} == images
    assert list(scratch.iterdir()) == []  # the scratch folder is cleaned up
    results = json.loads((out / "side-by-side.json").read_text())
    return results, out


def test_tiny_run_has_a_row_per_tool_with_sane_values(tiny: tuple[dict[str, Any], Path]) -> None:
    results, out = tiny
    rows = {row["tool"]: row for row in results["summary"]}
    assert list(rows) == [tool.name for tool in TOOLS]
    for name, row in rows.items():
        assert "errors" not in row, (name, row.get("errors"))
        for key in ("blocked_over_raw_write", "done_over_raw_write", "written_over_state"):
            assert row[key] > 0, (name, key)
        assert row["done_over_raw_write"] >= row["blocked_over_raw_write"] * 0.999, name
        assert row["written_over_state"] > 0.5, name  # a checkpoint holds the whole state
        assert row["extra_memory_over_state"] >= 0, name
        assert row["restore_over_raw_read"] > 0, name
        assert row["smallest_every_under_1pct"] >= 1, name
        assert 0 <= row["recovery_share"] <= 1, name
        if row["is_async"]:
            assert row["blocked_over_memcpy"] > 0, name
    for name in ("nbresume", "nbresume async"):
        assert rows[name]["recovery_share"] == 1.0
        assert rows[name]["bit_exact"] is True
        kill = results["kill"]["tools"][name]
        assert kill["kills"] >= 1
        assert all(o["consistent"] and o["lost"] >= 0 for o in kill["outcomes"])
    table = (out / "side-by-side.md").read_text()
    for tool in TOOLS:
        assert f"| {tool.name} |" in table
    for plot in report.PLOTS:
        assert (out / "img" / plot).read_bytes().startswith(b"\x89PNG")


def test_every_page_of_a_run_starts_with_the_same_header(
    tiny: tuple[dict[str, Any], Path],
) -> None:
    results, out = tiny
    pages = sorted(out.glob("*.md"))
    assert [p.name for p in pages] == [
        "io.md", "lightning.md", "preflight.md", "restore.md", "side-by-side.md", "trainable.md"
    ]  # fmt: skip
    assert not (out / "hf.md").exists()  # an earlier run's page is removed, not left beside
    assert results["suites"]["hf"] == {"status": "not run in this mode"}
    line = report.header(results["meta"])
    assert "--tiny" in line
    assert results["meta"]["load_after"] in line
    for page in pages:
        assert page.read_text().splitlines()[2] == line, page.name
    assert "- hf: not run in this mode" in (out / "side-by-side.md").read_text()
    assert results["preflight"]["target_met"] in (True, False)
    assert set(results["trainable"]["sizes"]) == {"full", "trainable-only"}


def test_the_resume_suite_also_times_until_training_runs_at_full_speed_against_safetensors(
    tiny: tuple[dict[str, Any], Path],
) -> None:
    """Besides the checkpointers, the resume suite restores with safetensors (whose mapped
    pages are paid for in the first step after the restore), and reports for each tool the
    restore plus what that first step takes beyond the second."""
    results, out = tiny
    resumed = results["resume"]["tools"]
    assert list(resumed) == [*(tool.name for tool in TOOLS), "safetensors"]
    for name, item in resumed.items():
        assert "error" not in item, (name, item)
        assert len(item["resumed_all"]) == len(item["restore_all"]) >= 1, name
        # The restore, plus the first step's excess over the second: at this size the steps
        # take about a millisecond and either may be the slower one.
        assert math.isfinite(item["resumed_s"]), name
        assert item["resumed_s"] > item["restore_s"] - 0.5, name
    assert resumed["safetensors"]["bit_exact"] is False  # no RNG state: dropout draws anew
    assert resumed["nbresume"]["bit_exact"] is True
    assert "| safetensors |" in (out / "side-by-side.md").read_text()
    assert "safetensors" not in {row["tool"] for row in results["summary"]}  # a loader only


def test_the_loop_overhead_comes_with_its_interval(tiny: tuple[dict[str, Any], Path]) -> None:
    results, _ = tiny
    for name, item in results["loop"]["tools"].items():
        low, high = item["extra_per_save_interval_s"]
        assert low <= item["extra_per_save_s"] <= high, name
        assert item["pairs"] == len(item["plain_segments_s"]) == len(item["saving_segments_s"])
        assert 0 < item["confidence"] < 1
        assert item["resolution_at_200"] >= 0
        assert item["resolved_from_zero"] == (low > 0)


def test_a_partial_run_cannot_overwrite_the_published_results() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--suites", "loop"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "need --out" in proc.stderr


def test_the_median_interval_covers_what_its_confidence_says() -> None:
    values = [float(v) for v in range(12)]
    low, high, confidence = loop.median_interval(values)
    assert (low, high) == (2.0, 9.0)  # the 3rd smallest and the 3rd largest of 12
    assert confidence >= 0.95
    low, high, confidence = loop.median_interval([1.0, 2.0])
    assert (low, high, confidence) == (1.0, 2.0, 0.5)


def _never_opened(folder: Path, model: Any, optimizer: Any) -> Any:
    raise AssertionError("a tool whose library is missing must not be run")


def test_a_tool_whose_library_is_missing_is_reported_not_run(tmp_path: Path) -> None:
    absent = Tool("absent", "nbresume_bench_no_such_library", False, True, _never_opened)
    zygote: Any = None  # never needed: nothing is run
    results = stall.run(zygote, [absent], sizes=[1], reps=1, scratch=tmp_path, log=print)
    assert results["sizes"][0]["tools"] == {"absent": {"error": "not installed"}}
    summary = {"tools": {"absent": {"is_async": False, "fsync": True}}, "stall": results}
    summary["summary"] = report.summary_rows(summary)
    assert "| absent | not installed |" in "\n".join(report.summary_table(summary))


def test_the_gpu_suite_without_a_gpu_is_a_dry_run(tmp_path: Path) -> None:
    """``python -m benchmarks --gpu`` where torch sees no CUDA device: it says so, measures
    and writes nothing, and exits 0."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("NBRESUME_GPU_BENCH_DEVICE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--gpu", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no CUDA GPU found" in proc.stdout
    assert "nothing measured" in proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_the_gpu_suites_run_line_names_the_settings_it_ran_under(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A shortened GPU run (fewer repetitions, a smaller budget) says so in its first line, so
    that its figures are never read as those of the full run."""
    from benchmarks import gpu

    monkeypatch.setenv("NBRESUME_GPU_BENCH_REPS", "2")
    monkeypatch.setenv("NBRESUME_GPU_BENCH_BUDGET_S", "220")
    assert gpu.with_settings("python -m benchmarks --gpu") == (
        "NBRESUME_GPU_BENCH_BUDGET_S=220 NBRESUME_GPU_BENCH_REPS=2 python -m benchmarks --gpu"
    )
    monkeypatch.delenv("NBRESUME_GPU_BENCH_REPS")
    monkeypatch.delenv("NBRESUME_GPU_BENCH_BUDGET_S")
    assert gpu.with_settings("python -m benchmarks --gpu") == "python -m benchmarks --gpu"
