"""dpro report on big runs: how long the page takes to make, how big it is, and how long Chromium takes to show it.

Writes run directories of ``--ranks`` ranks whose steps hold ``--layers`` layers (a forward and a backward op each,
plus an allreduce per 25 layers: ~1,000 ops per rank and step at the default 500), then, ``--repeat`` rounds,
alternating the sizes: ``dpro report`` in its own process (wall, CPU, peak RSS; what-if curves and the optimizer
included), the page's size, and headless Chromium loading the page from a file (the page's own time to its first
frame after load, ``data-render-ms``, and the whole browser process's wall time, which includes starting it).

    python bench/report_page.py [--layers 100,500] [--ranks 8] [--repeat 3]
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from measured import measured_argv, median_range, read_measurement  # noqa: E402
from run_builder import make_wide_run  # noqa: E402

BROWSER_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--virtual-time-budget=5000", "--dump-dom"]


def make_report(run_dir: Path, scratch: Path) -> dict:
    out = scratch / "measured.json"
    argv = measured_argv(sys.executable, out, [sys.executable, "-m", "dpro", "-q", "report", str(run_dir)])
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    measured = read_measurement(out)
    if measured is None or measured["status"] != 0:
        raise SystemExit(f"dpro report {run_dir} failed: {proc.stderr[-2000:]}")
    page = run_dir / "analysis" / "report.html"
    measured["page_mb"] = page.stat().st_size / 1e6
    return measured


def render(browser: str, page: Path, profile: Path) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run([browser, *BROWSER_FLAGS, f"--user-data-dir={profile}", page.as_uri()],
                          capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - t0
    found = re.search(r'data-render-ms="(\d+)"', proc.stdout)
    if proc.returncode != 0 or not found:
        raise SystemExit(f"chromium could not render {page}: {proc.stderr[-2000:]}")
    return {"render_s": int(found.group(1)) / 1000.0, "browser_wall_s": wall}



def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", default="100,500", help="layers per model (each a FW and a BW op)")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3, help="rounds (each makes and renders every size once)")
    args = parser.parse_args()
    browser = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)),
                   None)
    if browser is None:
        raise SystemExit("no Chromium here (apt-get install chromium)")
    sizes = [int(n) for n in args.layers.split(",")]
    results: dict[int, list[dict]] = {n: [] for n in sizes}
    with tempfile.TemporaryDirectory(prefix="dpro-report-") as tmp:
        work = Path(tmp)
        runs = {n: make_wide_run(work / f"run-{n}", world_size=args.ranks, layers=n) for n in sizes}
        for round_ in range(args.repeat):
            for n in sizes if round_ % 2 == 0 else reversed(sizes):
                row = make_report(runs[n], work)
                row.update(render(browser, runs[n] / "analysis" / "report.html", work / "profile"))
                results[n].append(row)
                print(f"# round {round_ + 1}: {n} layers: report {row['wall_s']:.1f} s, page {row['page_mb']:.2f} "
                      f"MB, render {row['render_s']:.2f} s", file=sys.stderr)
    print(f"dpro report, {args.ranks} ranks, {args.repeat} rounds (median [min..max])")
    print(f"{'ops/rank':>8} {'report wall s':>18} {'report CPU s':>18} {'peak RSS MB':>16} {'page MB':>8} "
          f"{'render s':>18} {'browser wall s':>18}")
    for n in sizes:
        rows = results[n]
        wall, cpu, rss, shown, browser = (median_range(rows, k, f) for k, f in (
            ("wall_s", ".1f"), ("cpu_s", ".1f"), ("rss_mb", ".0f"), ("render_s", ".2f"), ("browser_wall_s", ".2f")))
        print(f"{2 * n + -(-n // 25) + 2:8d} {wall:>18} {cpu:>18} {rss:>16} "
              f"{statistics.median(r['page_mb'] for r in rows):8.2f} {shown:>18} {browser:>18}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
