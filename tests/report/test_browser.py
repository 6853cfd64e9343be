"""The report page in a real headless Chromium: it renders with no console error, its charts are there, its
headline equals dpro analyze --json, and a screenshot is written (the README's picture comes from this test:
DPRO_REPORT_SCREENSHOT=docs/report.png). Skipped, saying so, where no Chromium is installed (make test installs
Debian's chromium when the machine lets it)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from jobrunner import run_job, torchrun
from run_builder import make_run

DATA = Path(__file__).resolve().parents[1] / "data"
BROWSER = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no Chromium here (make test installs Debian's chromium "
                                                        "when it can): the report's browser tests are skipped")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


def chromium(page: Path, profile: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([BROWSER, *FLAGS, f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
                           *args, page.resolve().as_uri()], capture_output=True, text=True, timeout=120)


def check_page(page: Path, tmp_path: Path, headline: dict, *, charts: int) -> Path:
    """Load ``page``: no console message, the script ran, ``charts`` charts or more, the headline as given;
    returns the screenshot."""
    proc = chromium(page, tmp_path / "profile", "--virtual-time-budget=3000", "--dump-dom")
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, console
    dom = proc.stdout
    assert 'data-ready="1"' in dom, "the page's script ran"
    assert dom.count('<svg class="chart"') >= charts
    for key, html_id in (("measured_step_ms", "measured-step"), ("predicted_step_ms", "predicted-step"),
                         ("error_pct", "error-pct")):
        shown = re.search(rf'id="{html_id}" data-value="([^"]+)"', dom)
        assert shown and float(shown.group(1)) == pytest.approx(headline[key], abs=1e-9), key
    shot = tmp_path / "report.png"
    proc = chromium(page, tmp_path / "profile", "--window-size=1280,1500", f"--screenshot={shot}")
    assert shot.exists() and shot.stat().st_size > 20_000, proc.stderr[-2000:]
    return shot


def analyze_json(*sources: str) -> dict:
    return json.loads(run_job([sys.executable, "-m", "dpro", "analyze", *sources, "--json"]).stdout)


@pytest.mark.slow
def test_report_of_a_recorded_ddp_job_renders_in_chromium(tmp_path):
    run_dir = tmp_path / "run"
    torchrun("ddp_job.py", "--model", "transformer", "--steps", "12", "--profile", "3:11", "--run-dir", str(run_dir),
             "--bucket-cap-mb", "1")
    run_job([sys.executable, "-m", "dpro", "-q", "report", str(run_dir)])
    page = run_dir / "analysis" / "report.html"
    shot = check_page(page, tmp_path, analyze_json(str(run_dir)), charts=6)
    if os.environ.get("DPRO_REPORT_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["DPRO_REPORT_SCREENSHOT"])


def test_report_of_a_kineto_trace_renders_in_chromium(tmp_path):
    trace = str(DATA / "kineto" / "ddp2_rank0_nccl.json.gz")
    page = tmp_path / "kineto.html"
    run_job([sys.executable, "-m", "dpro", "-q", "report", trace, "-o", str(page)])
    check_page(page, tmp_path, analyze_json(trace), charts=3)


def test_compare_page_renders_in_chromium(tmp_path):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    page = tmp_path / "compare.html"
    run_job([sys.executable, "-m", "dpro", "compare", str(a), str(b), "-o", str(page)])
    proc = chromium(page, tmp_path / "profile", "--virtual-time-budget=3000", "--dump-dom")
    assert not [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    assert 'data-ready="1"' in proc.stdout and proc.stdout.count('<svg class="chart"') >= 1
