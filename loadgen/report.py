"""Output of a run: the terminal table, `result.json`, PNG charts and a self-contained HTML report.

A result document (`doc`, the JSON written to DIR/result.json) has `points`: one per setting with `load`,
`summary` (see `loadgen.stats.Summary`), `verdict`, `replica_load`, `tenants`, `prefix_cache` and per-request
`requests` rows; a sweep adds `knee` and `recommendation`, a quality run `quality`. Charts use matplotlib's
object API (`Figure` + Agg canvas, imported on first use, no pyplot state): throughput and TTFT p50/p99 against
load with the knee marked, and TTFT / e2e latency / inter-token latency CDFs. The HTML embeds the PNGs as base64
data URIs.
"""

from __future__ import annotations

import base64
import html
import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadgen.promscrape import PREEMPTIONS

Doc = dict[str, Any]


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def _load_name(doc: Doc) -> str:
    return "rate" if doc.get("arrival") == "poisson" else "conc"


def plan_marker(doc: Doc) -> tuple[float, str] | None:
    """Where the load chart marks the plan's knee, and its label: a concurrency on a concurrency axis; on a rate
    sweep's axis the step (a rate) whose requests in flight it predicts, since the plan counts sequences."""
    plan = doc.get("plan")
    if not plan:
        return None
    if _load_name(doc) == "rate":
        return float(plan["predicted_step"]), f"plan {plan['knee']:g} in flight (at {plan['predicted_step']:g} req/s)"
    return float(plan["knee"]), f"plan {plan['knee']:g}"


def _load_head(doc: Doc) -> str:
    return "rate req/s" if _load_name(doc) == "rate" else "conc"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f}"


def _preemptions(point: dict[str, Any]) -> float | None:
    """Sequences the scraped engines preempted during the setting (vLLM's counter), None when none reports it."""
    per_url = (point.get("prefix_cache") or {}).get("per_url", {})
    found = [u["counters"][PREEMPTIONS] for u in per_url.values() if PREEMPTIONS in u.get("counters", {})]
    return sum(found) if found else None


def _plan_cell(plan: dict[str, Any], point: dict[str, Any], points: list[dict[str, Any]]) -> str:
    """The prediction on the rows it concerns: the predicted knee's step, and the predicted decode ceiling beside
    the best measured throughput."""
    notes = []
    if point["load"] == plan["predicted_step"]:
        notes.append(f"predicted knee {plan['knee']}")
    best = max(points, key=lambda x: x["summary"]["output_tok_per_s"])
    if plan.get("ceiling_tok_s") is not None and point is best:
        notes.append(f"ceiling {plan['ceiling_tok_s']:,.0f} tok/s")
    return "; ".join(notes)


def table_rows(doc: Doc) -> tuple[list[str], list[list[str]]]:
    """One row per point; units in the headers (latencies in ms, shares in %); SLO columns when a point has them,
    a preemption count when the scraped engines report one."""
    knee = (doc.get("knee") or {}).get("load")
    points = doc.get("points", [])
    with_slo = any(p["summary"].get("slo_attainment") is not None for p in points)
    with_preempt = any(_preemptions(p) is not None for p in points)
    head = [_load_head(doc), "out tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "ITL p50 ms",
            "ITL p99 ms", "e2e p50 ms", "e2e p99 ms", "ok %", "refused %", "cached %",
            "hit rate %"]  # fmt: skip
    head += ["SLO met %", "goodput req/s"] if with_slo else []
    head += ["preempted seqs"] if with_preempt else []
    plan = doc.get("plan")
    head += ["plan"] if plan else []
    head.append("verdict")
    rows = []
    for p in points:
        s = p["summary"]
        itl = s.get("itl_s") or {}
        mark = "*" if knee is not None and p["load"] == knee else ""
        row = [
            f"{p['load']:g}{mark}",
            f"{s['output_tok_per_s']:.1f}",
            f"{s['req_per_s']:.2f}",
            _ms(s["ttft_s"]["p50"]),
            _ms(s["ttft_s"]["p99"]),
            _ms(s["tpot_s"]["p50"]),
            _ms(itl.get("p50")),
            _ms(itl.get("p99")),
            _ms(s["e2e_s"]["p50"]),
            _ms(s["e2e_s"]["p99"]),
            _pct(s["success_rate"]),
            _pct(s.get("refused", 0) / s["requests"] if s["requests"] else None),
            _pct(s["cached_fraction"]),
            _pct((p.get("prefix_cache") or {}).get("hit_rate")),
        ]
        if with_slo:
            good = s.get("goodput_req_per_s")
            row += [_pct(s.get("slo_attainment")), "-" if good is None else f"{good:.2f}"]
        if with_preempt:
            preempted = _preemptions(p)
            row.append("-" if preempted is None else f"{preempted:g}")
        if plan:
            row.append(_plan_cell(plan, p, points))
        rows.append([*row, p.get("verdict") or ""])
    return head, rows


def _render(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(head[i]), *(len(r[i]) for r in rows)) if rows else len(head[i]) for i in range(len(head))]
    out = ["  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def findings(doc: Doc) -> list[str]:
    """The sentences under a document's table: recommendation, goodput knee, plan vs measured."""
    return [doc[key]["text"] for key in ("recommendation", "goodput", "plan") if doc.get(key)]


def format_table(doc: Doc) -> str:
    """Compact terminal table (units in the headers); the knee row is marked * and the findings follow."""
    return "\n".join([_render(*table_rows(doc)), *findings(doc)])


def _unit(doc: Doc) -> str:
    return "req/s" if doc.get("arrival") == "poisson" else "concurrent"


def format_compare(docs: Sequence[tuple[str, Doc]]) -> str:
    """Side by side: one row per load (a rate and a concurrency are different loads), per document output tok/s,
    TTFT p50 (ms) and prefix hit rate (the engines' when scraped, else the share of prompt tokens cached)."""
    loads = sorted({(_unit(d), p["load"]) for _, d in docs for p in d.get("points", [])})
    head, seen = ["load"], dict[str, int]()
    for label, _ in docs:
        seen[label] = seen.get(label, 0) + 1
        name = label if seen[label] == 1 else f"{label} ({seen[label]})"  # two documents of one label told apart
        head += [f"{name} tok/s", f"{name} TTFT p50 ms", f"{name} hit %"]
    rows = []
    for unit, load in loads:
        row = [f"{load:g} {unit}"]
        for _, d in docs:
            points = d.get("points", []) if _unit(d) == unit else []
            p = next((x for x in points if x["load"] == load), None)
            if p is None:
                row += ["-", "-", "-"]
                continue
            hit = (p.get("prefix_cache") or {}).get("hit_rate")
            hit = hit if hit is not None else p["summary"]["cached_fraction"]
            row += [f"{p['summary']['output_tok_per_s']:.1f}", _ms(p["summary"]["ttft_s"]["p50"]), _pct(hit)]
        rows.append(row)
    return _render(head, rows)


def write_json(doc: Doc, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "result.json"
    path.write_text(json.dumps(doc, indent=1, allow_nan=False))
    return path


def _new_figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _cdf(ax: Any, values: list[float], label: str) -> None:
    if not values:
        return
    v = sorted(values)
    ax.plot([x * 1e3 for x in v], [(i + 1) / len(v) for i in range(len(v))], label=label)


def _series(doc: Doc, dist: str, key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for p in doc.get("points", []):
        y = p["summary"][dist][key]
        if y is not None:
            xs.append(p["load"])
            ys.append(y * 1e3)
    return xs, ys


def plot_load_chart(docs: Sequence[tuple[str, Doc]], path: Path) -> Path:
    fig = _new_figure(11, 4.2)
    ax1, ax2 = fig.subplots(1, 2)
    for label, d in docs:
        pts = d.get("points", [])
        ax1.plot([p["load"] for p in pts], [p["summary"]["output_tok_per_s"] for p in pts], "o-", label=label)
        ax2.plot(*_series(d, "ttft_s", "p50"), "o-", label=f"{label} p50")
        ax2.plot(*_series(d, "ttft_s", "p99"), "x--", label=f"{label} p99")
        knee = (d.get("knee") or {}).get("load")
        if knee is not None:
            for ax in (ax1, ax2):
                ax.axvline(knee, color="red", linestyle=":", linewidth=1)
            ax1.annotate(f"knee {knee:g}", (knee, 0), xycoords=("data", "axes fraction"), textcoords="offset points",
                         xytext=(4, 6), color="red")  # fmt: skip
        planned = plan_marker(d)
        if planned is not None:
            for ax in (ax1, ax2):
                ax.axvline(planned[0], color="green", linestyle="--", linewidth=1)
            ax1.annotate(planned[1], (planned[0], 0), xycoords=("data", "axes fraction"),
                         textcoords="offset points", xytext=(4, 20), color="green")  # fmt: skip
    xlabel = "request rate (req/s)" if docs and _load_name(docs[0][1]) == "rate" else "concurrency"
    ax1.set(xlabel=xlabel, ylabel="output tokens / s", title="Throughput")
    ax2.set(xlabel=xlabel, ylabel="TTFT (ms)", title="Time to first token")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_cdf_chart(docs: Sequence[tuple[str, Doc]], path: Path) -> Path:
    """One line per point for one document; for several, each document's point at the highest common load."""
    fig = _new_figure(15, 4.2)
    ax1, ax2, ax3 = fig.subplots(1, 3)
    lines: list[tuple[str, dict[str, Any]]] = []
    if len(docs) == 1:
        lines = [(f"{_load_name(docs[0][1])} {p['load']:g}", p) for p in docs[0][1].get("points", [])][:10]
    else:
        common = set.intersection(*({p["load"] for p in d.get("points", [])} for _, d in docs)) if docs else set()
        for label, d in docs:
            pts = d.get("points", [])
            if not pts:
                continue
            pick = max(common) if common else pts[-1]["load"]
            lines.append((f"{label} @ {pick:g}", next(p for p in pts if p["load"] == pick) if common else pts[-1]))
    for name, p in lines:
        ok = [r for r in p.get("requests", []) if r["ok"]]
        _cdf(ax1, [r["ttft_s"] for r in ok if r["ttft_s"] is not None], name)
        _cdf(ax2, [r["e2e_s"] for r in ok], name)
        quantiles = p.get("itl_cdf_s") or []
        if quantiles:  # p0..p100 of every gap between streamed tokens
            ax3.plot([x * 1e3 for x in quantiles], [q / 100 for q in range(len(quantiles))], label=name)
    ax1.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF")
    ax2.set(xlabel="end-to-end latency (ms)", ylabel="fraction of requests", title="Latency CDF")
    ax3.set(xlabel="inter-token latency (ms, log)", ylabel="fraction of token gaps", title="ITL CDF")
    if any(ln.get_xdata().size for ln in ax3.get_lines()):
        ax3.set_xscale("symlog", linthresh=1.0)  # stalls of seconds beside gaps of milliseconds
    for ax in (ax1, ax2, ax3):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a point whose requests all failed draws no line
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path


def write_charts(docs: Sequence[tuple[str, Doc]], out_dir: Path, prefix: str = "") -> list[Path]:
    """The PNG charts; none (with a note on stderr) when matplotlib, the `report` extra, is not installed: the
    tables, JSON and HTML report are written either way."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if importlib.util.find_spec("matplotlib") is None:
        print("kvgate loadgen: no charts (pip install 'kvgate[report]' for them)", file=sys.stderr)
        return []
    return [
        plot_load_chart(docs, out_dir / f"{prefix}throughput_ttft.png"),
        plot_cdf_chart(docs, out_dir / f"{prefix}latency_cdf.png"),
    ]


def _html_table(head: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    trs = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{trs}</table>"


def write_html(
    docs: Sequence[tuple[str, Doc]], charts: Sequence[Path], path: Path, title: str, headline: Sequence[str] = ()
) -> Path:
    """A self-contained page: a headline, per document its table, findings, sustained windows and quality checks,
    then the embedded charts."""
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>"
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}img{max-width:100%}"
        ".headline{background:#f4f6fa;padding:.5em 1em;border-left:4px solid #35c}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    if headline:
        parts.append("<div class='headline'><ul>" + "".join(f"<li>{html.escape(x)}</li>" for x in headline)
                     + "</ul></div>")  # fmt: skip
    for label, d in docs:
        parts.append(f"<h2>{html.escape(label)}</h2><p>{html.escape(d.get('description', ''))}</p>")
        if d.get("points"):
            parts.append(_html_table(*table_rows(d)))
        if d.get("knee"):
            parts.append(f"<p>Knee: {html.escape(d['knee']['reason'])}</p>")
        parts += [f"<p><b>{html.escape(text)}</b></p>" for text in findings(d)]
        if d.get("sustained"):
            w = d["sustained"]
            rows = [[f"{i * w['window_s']:g}-{(i + 1) * w['window_s']:g}", f"{x:.1f}"] for i, x in
                    enumerate(w["tok_per_s"])]  # fmt: skip
            parts.append(_html_table(["window s", "out tok/s"], rows))
        if d.get("quality"):
            rows = [[c["name"], "pass" if c["passed"] else "FAIL", c["detail"]] for c in d["quality"]]
            parts.append(_html_table(["check", "result", "detail"], rows))
    for chart in charts:
        data = base64.b64encode(chart.read_bytes()).decode("ascii")
        parts.append(f"<p><img alt='{html.escape(chart.stem)}' src='data:image/png;base64,{data}'></p>")
    parts.append("</body></html>")
    path.parent.mkdir(parents=True, exist_ok=True)  # with --no-charts nothing else made it
    path.write_text("\n".join(parts))
    return path
