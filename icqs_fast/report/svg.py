"""Small inline SVG charts for the run report (no script, no font, no network: a page that
holds them renders the same offline and under a ``default-src 'none'`` content policy).

Every function returns one ``<svg>`` element as text; every label in it is XML-escaped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

__all__ = ["coverage_accuracy", "histogram", "reliability", "PALETTE"]

# Colour-blind-safe (Okabe-Ito) series colours.
PALETTE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#555555")
W, H = 520, 230
ML, MR, MT, MB = 56, 12, 26, 40  # margins: left, right, top, bottom


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def _nice(v: float) -> float:
    """The smallest 1 / 2 / 4 / 6 / 8 x 10^k at least ``v`` (an axis top whose quarters are
    round)."""
    if v <= 0:
        return 1.0
    e = 10 ** math.floor(math.log10(v))
    return next(m * e for m in (1, 2, 4, 6, 8, 10) if m * e >= v * (1 - 1e-9))


def _axes(xlabel: str, ylabel: str, ymax: float, ylabels: Sequence[str] | None = None,
          xr: tuple[float, float] = (0.0, 1.0)) -> list[str]:
    pw, ph = W - ML - MR, H - MT - MB
    out = [f'<rect x="{ML}" y="{MT}" width="{pw}" height="{ph}" fill="#fff" stroke="#bbb"/>']
    lo, hi = xr
    dec = 1 if hi - lo >= 0.5 else 2 if hi - lo >= 0.05 else 3
    for i in range(6):  # x ticks: five equal steps over the range
        x = ML + pw * i / 5
        out.append(f'<line x1="{x:.1f}" y1="{MT + ph}" x2="{x:.1f}" y2="{MT + ph + 4}" '
                   'stroke="#888"/>')
        out.append(f'<text x="{x:.1f}" y="{MT + ph + 16}" text-anchor="middle">'
                   f'{lo + (hi - lo) * i / 5:.{dec}f}</text>')
    for i in range(5):  # y ticks
        y = MT + ph - ph * i / 4
        lab = ylabels[i] if ylabels else _fmt(ymax * i / 4) if ymax > 1 else \
            f"{ymax * i / 4 * 100:.3g}%"
        out.append(f'<line x1="{ML - 4}" y1="{y:.1f}" x2="{ML + pw}" y2="{y:.1f}" '
                   'stroke="#eee"/>')
        out.append(f'<text x="{ML - 6}" y="{y + 4:.1f}" text-anchor="end">{escape(lab)}</text>')
    out.append(f'<text x="{ML + pw / 2}" y="{H - 6}" text-anchor="middle">{escape(xlabel)}</text>')
    out.append(f'<text x="12" y="{MT + ph / 2}" text-anchor="middle" '
               f'transform="rotate(-90 12 {MT + ph / 2})">{escape(ylabel)}</text>')
    return out


def _svg(body: list[str], title: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" width="{W}" '
            f'height="{H}" role="img" aria-label="{escape(title)}" font-family="sans-serif" '
            f'font-size="11" fill="#222"><title>{escape(title)}</title>' + "".join(body)
            + "</svg>")


def _legend(names: Sequence[str]) -> list[str]:
    out = []
    x = ML + 8
    for i, name in enumerate(names):
        c = PALETTE[i % len(PALETTE)]
        out.append(f'<rect x="{x}" y="{MT - 19}" width="10" height="10" fill="{c}" '
                   'fill-opacity="0.6"/>')  # above the plot: never over a bar
        out.append(f'<text x="{x + 14}" y="{MT - 10}">{escape(name)}</text>')
        x += 24 + 7 * len(name)
    return out


def histogram(series: dict[str, Sequence[int]], *, xlabel: str, title: str,
              marker: float | None = None, marker_label: str = "", density: bool = True,
              xr: tuple[float, float] = (0.0, 1.0)) -> str:
    """Step histograms over ``xr`` (default [0, 1]) of equal-width bin counts, one per series
    (``{name: counts}``, all the same number of bins), each as a share of its own total when
    ``density`` (series of different sizes compare); a dashed vertical line at ``marker``
    (when inside ``xr``)."""
    names = list(series)
    nb = len(next(iter(series.values()))) if series else 1
    rows = []
    for name in names:
        c = list(series[name])
        tot = sum(c) or 1
        rows.append([v / tot for v in c] if density else [float(v) for v in c])
    ymax = _nice(max([max(r) for r in rows if r] + [1e-9]) * 1.05)
    pw, ph = W - ML - MR, H - MT - MB
    body = _axes(xlabel, "share of records" if density else "records", ymax, xr=xr)
    for i, r in enumerate(rows):
        c = PALETTE[i % len(PALETTE)]
        pts = [f"{ML:.1f},{MT + ph:.1f}"]
        for b, v in enumerate(r):
            x0, x1 = ML + pw * b / nb, ML + pw * (b + 1) / nb
            y = MT + ph - ph * v / ymax
            pts += [f"{x0:.1f},{y:.1f}", f"{x1:.1f},{y:.1f}"]
        pts.append(f"{ML + pw:.1f},{MT + ph:.1f}")
        body.append(f'<polygon points="{" ".join(pts)}" fill="{c}" fill-opacity="0.18" '
                    f'stroke="{c}" stroke-width="1.5"/>')
    lo, hi = xr
    if marker is not None and math.isfinite(marker) and lo <= marker <= hi:
        marker = (marker - lo) / (hi - lo)  # as a share of the axis from here on
        x = ML + pw * marker
        body.append(f'<line x1="{x:.1f}" y1="{MT}" x2="{x:.1f}" y2="{MT + ph}" stroke="#c00" '
                    'stroke-dasharray="4 3"/>')
        if marker_label:  # at the top of the plot
            anchor, dx = ("end", -4) if marker > 0.75 else ("start", 4)
            y = MT + 12
            body.append(f'<text x="{x + dx:.1f}" y="{y}" text-anchor="{anchor}" '
                        f'fill="#c00">{escape(marker_label)}</text>')
    body += _legend(names)
    return _svg(body, title)


def reliability(bins: Sequence[dict], *, title: str) -> str:
    """The reliability diagram of the self-check's bins (``{"lo", "hi", "count", "mean_p",
    "frac_pos"}``): fraction good against mean calibrated probability per non-empty bin, the
    diagonal (perfect calibration) and the items per bin as grey bars."""
    pw, ph = W - ML - MR, H - MT - MB
    body = _axes("calibrated P(good)", "fraction good", 1.0,
                 ["0", "0.25", "0.5", "0.75", "1"])
    cmax = max([b.get("count") or 0 for b in bins] + [1])
    for b in bins:
        n = b.get("count") or 0
        if not n:
            continue
        x0, x1 = ML + pw * b["lo"], ML + pw * b["hi"]
        h = ph * 0.35 * n / cmax
        body.append(f'<rect x="{x0 + 1:.1f}" y="{MT + ph - h:.1f}" width="{x1 - x0 - 2:.1f}" '
                    f'height="{h:.1f}" fill="#999" fill-opacity="0.25"><title>{n} items'
                    '</title></rect>')
    body.append(f'<line x1="{ML}" y1="{MT + ph}" x2="{ML + pw}" y2="{MT}" stroke="#888" '
                'stroke-dasharray="5 4"/>')
    pts = []
    for b in bins:
        mp, fp = b.get("mean_p"), b.get("frac_pos")
        if not b.get("count") or mp is None or fp is None or not (math.isfinite(mp)
                                                                  and math.isfinite(fp)):
            continue
        pts.append((ML + pw * mp, MT + ph - ph * fp, b))
    if pts:
        body.append('<polyline points="' + " ".join(f"{x:.1f},{y:.1f}" for x, y, _ in pts)
                    + f'" fill="none" stroke="{PALETTE[0]}" stroke-width="2"/>')
    for x, y, b in pts:
        body.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{PALETTE[0]}"><title>'
                    f'{b["lo"]:.1f}-{b["hi"]:.1f}: {b["count"]} items, mean p '
                    f'{b["mean_p"]:.2f}, fraction good {b["frac_pos"]:.2f}</title></circle>')
    body += _legend(["held out, out of fold"])
    return _svg(body, title)


def coverage_accuracy(curve: Sequence[Sequence[float]], *, title: str,
                      target: float | None = None,
                      point: tuple[float, float, float, float] | None = None) -> str:
    """The abstain band's trade-off: the best accuracy outside a band against its coverage
    (``curve``: ``(coverage, accuracy)`` pairs by rising coverage, in [0, 1]); a dashed line
    at the ``target`` accuracy; ``point``: the chosen band's ``(coverage, accuracy,
    accuracy_lo, accuracy_hi)`` with its interval as a vertical bar."""
    pw, ph = W - ML - MR, H - MT - MB
    pts = [(c, a) for c, a in curve if math.isfinite(c) and math.isfinite(a)]
    # The y axis from the lowest accuracy shown (rounded down to 0.1) to 1.
    floor = min([a for _, a in pts] + ([target] if target else []) + [1.0])
    if point is not None and math.isfinite(point[2]):
        floor = min(floor, point[2])
    y0 = max(0.0, math.floor(floor * 10 - 1e-9) / 10)
    y0 = min(y0, 0.9)

    def xy(c: float, a: float) -> tuple[float, float]:
        return ML + pw * c, MT + ph - ph * (a - y0) / (1.0 - y0)

    body = _axes("coverage (share of records given a verdict)", "accuracy outside the band",
                 1.0, [f"{y0 + (1 - y0) * i / 4:.3g}" for i in range(5)])
    if pts:
        body.append('<polyline points="' + " ".join(
            "{:.1f},{:.1f}".format(*xy(c, a)) for c, a in pts)
            + f'" fill="none" stroke="{PALETTE[0]}" stroke-width="2"/>')
    names = ["best band, held-out items (in sample)"]
    if target is not None and math.isfinite(target):
        _, y = xy(0.0, target)
        body.append(f'<line x1="{ML}" y1="{y:.1f}" x2="{ML + pw}" y2="{y:.1f}" stroke="#c00" '
                    f'stroke-dasharray="4 3"><title>target accuracy {target:g}</title></line>')
    if point is not None and all(math.isfinite(v) for v in point[:2]):
        c, a, lo, hi = point
        x, y = xy(c, a)
        if math.isfinite(lo) and math.isfinite(hi):
            _, ylo = xy(c, lo)
            _, yhi = xy(c, hi)
            body.append(f'<line x1="{x:.1f}" y1="{ylo:.1f}" x2="{x:.1f}" y2="{yhi:.1f}" '
                        f'stroke="{PALETTE[1]}" stroke-width="2"/>')
        body.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{PALETTE[1]}"><title>'
                    f'chosen band: coverage {c:.2f}, accuracy {a:.2f} (out of fold)</title>'
                    '</circle>')
        names.append("chosen band, out of fold")
    body += _legend(names)
    return _svg(body, title)

