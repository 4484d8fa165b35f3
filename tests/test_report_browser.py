"""The loadgen HTML report as an operator opens it: in headless Chromium (tests/browser.py), a report made by a
sweep against the simulated engine renders its title, its table (a row per point) and both charts, each chart
decoded and drawn with data, with no console error; so does every report kept in docs/loadgen/.

"Drawn with data" counts a chart's saturated pixels (the plotted series; axes, grid and text are gray): a
chart whose series are empty keeps only its legend's samples and the knee marker, 756 and 0 pixels for the two
charts of such a report here, against 4,000 to 12,000 for the reports below.
"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from typing import Any

import pytest

from loadgen import cli
from simengine import SimConfig, run_sim_engine
from tests.browser import CHROMIUM, open_page

DOCS = Path(__file__).resolve().parent.parent / "docs" / "loadgen"
FAST = SimConfig(block_size=16, overhead_ms=0.5, prefill_us_per_token=2.0, decode_ms=0.5, decode_ms_per_seq=0.0)
MIN_DATA_PIXELS = 2000

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (apt-get install chromium)"),
    pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="charts need the report extra"),
]

# per image: its size once decoded, and how many of its pixels are saturated colour (a plotted series)
READ_PAGE = """(async () => {
  const charts = [];
  for (const img of document.images) {
    await img.decode();
    const canvas = document.createElement('canvas');
    canvas.width = img.naturalWidth; canvas.height = img.naturalHeight;
    const g = canvas.getContext('2d');
    g.drawImage(img, 0, 0);
    const px = g.getImageData(0, 0, canvas.width, canvas.height).data;
    let data = 0;
    for (let i = 0; i < px.length; i += 4) {
      if (Math.max(px[i], px[i + 1], px[i + 2]) - Math.min(px[i], px[i + 1], px[i + 2]) > 80) data++;
    }
    charts.push({name: img.alt, width: img.naturalWidth, height: img.naturalHeight, data});
  }
  return {title: document.querySelector('h1').textContent, charts,
          rows: [...document.querySelectorAll('table')[0].rows].map(r => [...r.cells].map(c => c.textContent)),
          height: document.documentElement.scrollHeight};
})()"""


async def read_report(path: Path) -> dict[str, Any]:
    async with open_page(path) as page:
        shown: dict[str, Any] = await page.evaluate(READ_PAGE)
        assert page.errors == [], page.errors
    return shown


def assert_charts_drawn(shown: dict[str, Any]) -> None:
    assert [c["name"].removeprefix("compare_") for c in shown["charts"]] == ["throughput_ttft", "latency_cdf"]
    for chart in shown["charts"]:
        assert chart["width"] >= 1000 and chart["height"] >= 400, chart
        assert chart["data"] >= MIN_DATA_PIXELS, chart


async def test_a_sweeps_report_renders_its_table_and_charts_with_data(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    async with run_sim_engine(FAST) as server:
        argv = ["sweep", "--url", server.url, "--workload", "random", "--input-len", "200:200",
                "--random-output-len", "16:16", "-n", "16", "--concurrencies", "1,2,4", "--out", str(out),
                "--label", "sim"]  # fmt: skip
        assert await asyncio.to_thread(cli.main, argv) == 0
    shown = await read_report(out / "report.html")
    assert shown["title"] == "kvgate loadgen sweep: sim"
    head, *rows = shown["rows"]
    assert head[0] == "conc" and "TTFT p99 ms" in head and [r[0].rstrip("*") for r in rows] == ["1", "2", "4"]
    assert all(float(r[head.index("ok %")]) == 100.0 for r in rows)
    assert_charts_drawn(shown)
    assert shown["height"] > 1000  # laid out: the tables above the charts, not an empty page


@pytest.mark.parametrize("report", sorted(DOCS.glob("*/*.html")), ids=lambda p: p.parent.name)
async def test_the_reports_kept_in_the_docs_render(report: Path) -> None:
    shown = await read_report(report)
    assert len(shown["rows"]) >= 3
    assert_charts_drawn(shown)
