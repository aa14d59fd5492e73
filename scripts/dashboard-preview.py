#!/usr/bin/env python3
"""Renders dashboards with live query results as HTML pages, laid out on Grafana's grid.

    dashboard-preview.py DATA_DIR OUT_DIR

DATA_DIR holds what tests/it/dashboards.rs writes with FERRITE_DASHBOARD_PREVIEW_DIR set:
each dashboard's JSON with every target's Prometheus range result under `preview`. For each
dashboard this writes OUT_DIR/NAME.html (panels as SVG: time series, stats, heatmaps) and
OUT_DIR/NAME.size ("WIDTH,HEIGHT" for the screenshot). No Grafana runs here; this shows the
layout, the titles and what each query returned from a real Prometheus.
"""

import html
import json
import math
import sys
from pathlib import Path

WIDTH = 1600
ROW_PX = 30  # Grafana's grid row height
COLORS = ["#73bf69", "#f2cc0c", "#5794f2", "#ff9830", "#f2495c", "#b877d9", "#8ab8ff", "#fade2a"]


def fmt(v, unit):
    if v is None or not math.isfinite(v):
        return "–"
    if unit == "percentunit":
        return f"{v * 100:.1f}%"
    if unit == "percent":
        return f"{v:.1f}%"
    if unit == "s":
        return f"{v * 1000:.0f} ms" if abs(v) < 1 else f"{v:.2f} s"
    if unit == "bytes":
        for u in ["B", "KiB", "MiB", "GiB"]:
            if abs(v) < 1024:
                return f"{v:.0f} {u}"
            v /= 1024
        return f"{v:.1f} TiB"
    if unit == "reqps":
        return f"{v:.2f} req/s"
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def legend(fmt_str, metric):
    out = fmt_str or "{{__name__}}"
    for k, v in metric.items():
        out = out.replace("{{" + k + "}}", v)
    return out


def series(panel):
    """(label, [(t, v)]) for every series of every target."""
    out = []
    for t in (panel.get("targets") or []):
        for s in t.get("preview", {}).get("result", []):
            pts = []
            for ts, v in s.get("values", []):
                x = float(v)
                pts.append((float(ts), x if math.isfinite(x) else None))
            out.append((legend(t.get("legendFormat", ""), s.get("metric", {})), pts))
    return out


def time_range(panel):
    for t in (panel.get("targets") or []):
        p = t.get("preview")
        if p:
            return p["from"], p["to"]
    return 0.0, 1.0


def timeseries_svg(panel, w, h):
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
    data = series(panel)
    t0, t1 = time_range(panel)
    values = [v for _, pts in data for _, v in pts if v is not None]
    if not values:
        return no_data(w, h, panel)
    lo = min(0.0, min(values))
    hi = max(values)
    if hi == lo:
        hi = lo + 1
    left, right, top, bottom = 64, 8, 6, 20 + 16 * min(len(data), 3)
    pw, ph = w - left - right, h - top - bottom
    sx = lambda t: left + (t - t0) / max(t1 - t0, 1e-9) * pw  # noqa: E731
    sy = lambda v: top + ph - (v - lo) / (hi - lo) * ph  # noqa: E731
    parts = []
    for i in range(5):
        v = lo + (hi - lo) * i / 4
        y = sy(v)
        parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#2c3235"/>')
        parts.append(f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end" class="ax">{html.escape(fmt(v, unit))}</text>')
    bars = panel.get("fieldConfig", {}).get("defaults", {}).get("custom", {}).get("drawStyle") == "bars"
    for n, (_, pts) in enumerate(data):
        c = COLORS[n % len(COLORS)]
        if bars:
            for t, v in pts:
                if v:
                    parts.append(f'<rect x="{sx(t) - 2:.1f}" y="{sy(v):.1f}" width="4" height="{sy(lo) - sy(v):.1f}" fill="{c}"/>')
            continue
        path, pen = [], "M"
        for t, v in pts:
            if v is None:
                pen = "M"
                continue
            path.append(f"{pen}{sx(t):.1f},{sy(v):.1f}")
            pen = "L"
        parts.append(f'<path d="{" ".join(path)}" fill="none" stroke="{c}" stroke-width="1.5"/>')
    ly = top + ph + 16
    cols = 2 if len(data) > 3 else 1
    shown = data[: 3 * cols]
    for n, (label, pts) in enumerate(shown):
        last = next((v for _, v in reversed(pts) if v is not None), None)
        peak = max((v for _, v in pts if v is not None), default=None)
        c = COLORS[n % len(COLORS)]
        x, y = left + (n // 3) * (pw // cols), ly + (n % 3) * 16
        parts.append(f'<rect x="{x}" y="{y - 9}" width="10" height="3" fill="{c}"/>')
        parts.append(
            f'<text x="{x + 14}" y="{y}" class="lg">{html.escape(label)}  '
            f"(last {html.escape(fmt(last, unit))}, max {html.escape(fmt(peak, unit))})</text>"
        )
    if len(data) > len(shown):
        parts.append(f'<text x="{w - 8}" y="{ly}" text-anchor="end" class="lg">+{len(data) - len(shown)} more series</text>')
    return f'<svg width="{w}" height="{h}">{"".join(parts)}</svg>'


def heatmap_svg(panel, w, h):
    data = []
    for label, pts in series(panel):
        le = math.inf if label in ("+Inf", "Inf") else float(label)
        data.append((le, pts))
    data.sort(key=lambda x: x[0])
    if not data or not data[0][1]:
        return no_data(w, h, panel)
    # Cumulative buckets to per-bucket counts.
    times = [t for t, _ in data[0][1]]
    rows = []
    prev = [0.0] * len(times)
    for le, pts in data:
        cur = [v or 0.0 for _, v in pts][: len(times)]
        cur += [0.0] * (len(times) - len(cur))
        rows.append((le, [max(c - p, 0.0) for c, p in zip(cur, prev)]))
        prev = cur
    used = [i for i, (_, r) in enumerate(rows) if any(r)]
    if not used:
        return no_data(w, h, panel)
    rows = rows[max(used[0] - 1, 0) : used[-1] + 2]
    peak = max(max(r) for _, r in rows) or 1
    left, top, bottom = 64, 6, 22
    pw, ph = w - left - 8, h - top - bottom
    cw, rh = pw / len(times), ph / len(rows)
    unit = panel.get("options", {}).get("yAxis", {}).get("unit", "short")
    parts = []
    for j, (le, r) in enumerate(rows):
        y = top + ph - (j + 1) * rh
        parts.append(f'<text x="{left - 4}" y="{y + rh / 2 + 4:.1f}" text-anchor="end" class="ax">≤ {html.escape(fmt(le, unit) if math.isfinite(le) else "+Inf")}</text>')
        for i, v in enumerate(r):
            if v <= 0:
                continue
            a = 0.15 + 0.85 * (v / peak) ** 0.5
            parts.append(f'<rect x="{left + i * cw:.1f}" y="{y:.1f}" width="{cw + 0.3:.1f}" height="{rh - 1:.1f}" fill="rgba(255,152,48,{a:.2f})"/>')
    total = sum(sum(r) for _, r in rows)
    parts.append(f'<text x="{left}" y="{h - 6}" class="lg">{total:.0f} observations over the run (per-bucket increases)</text>')
    return f'<svg width="{w}" height="{h}">{"".join(parts)}</svg>'


def stat_html(panel, w, h):
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
    data = series(panel)
    last = None
    for _, pts in data:
        last = next((v for _, v in reversed(pts) if v is not None), last)
    peak = max((v for _, pts in data for _, v in pts if v is not None), default=None)
    return (
        f'<div class="stat"><div class="big">{html.escape(fmt(last, unit))}</div>'
        f'<div class="lg">max over the run {html.escape(fmt(peak, unit))}</div></div>'
    )


def no_data(w, h, panel):
    gpu = any("DCGM_" in t.get("expr", "") for t in (panel.get("targets") or []))
    text = "No data: DCGM exporter metrics (GPU only; skipped on CPU)" if gpu else "No data"
    return f'<svg width="{w}" height="{h}"><text x="{w / 2}" y="{h / 2}" text-anchor="middle" class="nd">{text}</text></svg>'


def render(d):
    col = WIDTH / 24
    bottom = 0
    boxes = []
    for p in d["panels"]:
        g = p["gridPos"]
        x, y, w, h = g["x"] * col, g["y"] * ROW_PX, g["w"] * col, g["h"] * ROW_PX
        bottom = max(bottom, y + h)
        if p["type"] == "row":
            boxes.append(f'<div class="row" style="left:{x}px;top:{y}px;width:{w}px;height:{h}px">{html.escape(p["title"])}</div>')
            continue
        iw, ih = int(w - 12), int(h - 34)
        body = {"timeseries": timeseries_svg, "heatmap": heatmap_svg, "stat": stat_html}[p["type"]](p, iw, ih)
        boxes.append(
            f'<div class="panel" style="left:{x + 3}px;top:{y + 3}px;width:{w - 6}px;height:{h - 6}px">'
            f'<div class="title">{html.escape(p["title"])}</div>{body}</div>'
        )
    header = 64
    variables = "  ".join(
        f'{html.escape(v.get("label", v["name"]))}: <b>{html.escape(str(v.get("current", {}).get("text", "")))}</b>'
        for v in d["templating"]["list"]
    )
    t0 = t1 = None
    for p in d["panels"]:
        for t in p.get("targets") or []:
            if "preview" in t:
                t0, t1 = t["preview"]["from"], t["preview"]["to"]
    span = f"{t1 - t0:.0f} s of a live run (test Prometheus, 1 s scrapes)" if t0 else ""
    page = f"""<!doctype html><html><head><meta charset="utf-8"><style>
body {{ margin:0; background:#111217; color:#ccccdc; font:13px Inter, Helvetica, Arial, sans-serif; }}
.hdr {{ height:{header}px; padding:10px 16px; box-sizing:border-box; border-bottom:1px solid #2c3235; }}
.hdr h1 {{ margin:0 0 6px; font-size:18px; color:#fff; }}
.grid {{ position:relative; height:{bottom}px; }}
.panel {{ position:absolute; background:#181b1f; border:1px solid #2c3235; border-radius:2px; box-sizing:border-box; padding:4px 6px; overflow:hidden; }}
.row {{ position:absolute; font-size:15px; font-weight:600; color:#fff; padding:4px 8px; box-sizing:border-box; }}
.title {{ font-weight:600; color:#fff; height:22px; }}
.ax {{ fill:#8e8e8e; font-size:10px; }} .lg {{ fill:#ccccdc; color:#ccccdc; font-size:11px; }}
.nd {{ fill:#8e8e8e; font-size:12px; }}
.stat {{ text-align:center; padding-top:4px; }} .big {{ font-size:34px; color:#73bf69; font-weight:600; }}
</style></head><body><div class="hdr"><h1>{html.escape(d["title"])}</h1>
<div class="lg">{variables} · {span}</div></div>
<div class="grid">{"".join(boxes)}</div></body></html>"""
    return page, bottom + header + 8


def main():
    data_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in sorted(data_dir.glob("*.json")):
        d = json.loads(f.read_text())
        # The variables as the test set them.
        for v in d["templating"]["list"]:
            v["current"] = {
                "datasource": {"text": "Prometheus"},
                "namespace": {"text": "ml"},
                "model_name": {"text": "smol"},
                "inferenceservice": {"text": "chat"},
                "pod": {"text": "All"},
            }.get(v["name"], v.get("current", {}))
        page, height = render(d)
        (out_dir / f"{f.stem}.html").write_text(page)
        (out_dir / f"{f.stem}.size").write_text(f"{WIDTH},{int(height)}")
        print(f"{f.stem}: {WIDTH}x{int(height)}")


if __name__ == "__main__":
    main()
