"""The report page of a scoring run: one self-contained HTML file (``icqs-fast report``).

:func:`write_report` reads a run's output once (:mod:`icqs_fast.report.run_output`: bounded
histograms, samples and top-k tables, whatever the output's size) and its meta file, and
writes a page with the run's settings, model, dtype and throughput; the self-check (AUC with
its interval, the reliability diagram, the threshold, the expected accuracy); the ``score`` and
``p_good_calibrated`` distributions per label; with labels, the confusion at the threshold and
the most confident mistakes; the least certain records (smallest margin, most near ties, widest
per-set spread, closest to the threshold), with their texts when the scored input is given;
and, with a baseline, the drift between the two runs (:mod:`icqs_fast.report.drift`). A
``score --pairs`` output gets a pairs page (:func:`render_pairs_page`): the pairwise accuracy
when the better output is known, the preferred a / b / tie counts, the margin distribution,
and the self-check with its pairwise part.

The page needs no network: the charts are inline SVG (:mod:`icqs_fast.report.svg`), the style is
inline, there is no script, and a content policy (``default-src 'none'``) makes the browser
refuse any fetch. Every text from the output, the meta file or the input is HTML-escaped.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

from icqs_fast.io.files import write_whole
from icqs_fast.report import svg
from icqs_fast.report.drift import Drift, compare_summaries, read_self_check, wilson
from icqs_fast.report.run_output import (
    RunOutput,
    RunSummary,
    Scored,
    label_class,
    open_run,
    record_texts,
    summarise,
)

__all__ = ["PairsSummary", "ReportResult", "is_pairs_run", "render_page", "render_pairs_page",
           "summarise_pairs", "write_report"]

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
TEXT_LIMIT = 160  # characters of a record's prompt / response shown

STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#222;
background:#f6f7f9;line-height:1.4}
main{max-width:1180px;margin:0 auto;padding:18px 24px 40px}
h1{font-size:1.45em;margin:.2em 0 .1em}h2{font-size:1.15em;margin:1.6em 0 .5em;
border-bottom:1px solid #ddd;padding-bottom:.2em}h3{font-size:1em;margin:1em 0 .4em}
.sub{color:#666;font-size:.9em;word-break:break-all}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:12px 0}
.card{background:#fff;border:1px solid #e2e4e8;border-radius:6px;padding:8px 12px;min-width:120px}
.card b{display:block;font-size:1.15em}.card span{color:#666;font-size:.8em}
.charts{display:flex;flex-wrap:wrap;gap:14px}.charts figure{margin:0;background:#fff;
border:1px solid #e2e4e8;border-radius:6px;padding:6px}
figcaption{font-size:.85em;color:#555;padding:2px 6px;max-width:510px}
table{border-collapse:collapse;background:#fff;font-size:.85em;margin:4px 0 8px}
th,td{border:1px solid #e2e4e8;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#eef0f3}td.n{text-align:right;font-variant-numeric:tabular-nums}
td.t{max-width:420px;overflow-wrap:anywhere}td.t i{color:#777;font-style:normal}
.note{color:#555;font-size:.88em}.warn{background:#fff4e5;border:1px solid #f0c36d;
padding:8px 12px;border-radius:6px}.ok{background:#eaf6ec;border:1px solid #9fd3a8;
padding:8px 12px;border-radius:6px}.bad{background:#fdecea;border:1px solid #f1a9a0;
padding:8px 12px;border-radius:6px}
details{margin:6px 0}summary{cursor:pointer;color:#345}
"""


@dataclass
class ReportResult:
    """What :func:`write_report` wrote: the page, its size, the records read, the seconds it
    took, and the drift against the baseline (None without one)."""

    path: Path
    bytes: int
    n: int
    seconds: float
    drift: Drift | None


def _e(v: Any) -> str:
    return escape("" if v is None else v if isinstance(v, str) else json.dumps(v,
                  ensure_ascii=False), quote=True)


def _num(v: Any, spec: str = ".3f") -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return "&ndash;" if v is None else _e(v)
    if isinstance(v, int):
        return f"{v:,}"
    return format(v, spec) if math.isfinite(v) else "n/a"


def _table(head: list[str], rows: list[list[str]], numeric: set[int] = frozenset()) -> str:
    out = ["<table><tr>" + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr>"]
    for r in rows:
        out.append("<tr>" + "".join(f'<td class="{"n" if i in numeric else ""}">{c}</td>'
                                    for i, c in enumerate(r)) + "</tr>")
    return "".join(out) + "</table>"


def _card(value: str, what: str) -> str:
    return f'<div class="card"><b>{value}</b><span>{escape(what)}</span></div>'


# --------------------------------------------------------------------------- sections


def _throughput(run: RunOutput, summary: RunSummary) -> tuple[str, str]:
    """(records/s as shown, where it comes from): the meta file's figures when it has them,
    else estimated from the files' times (the meta file is written before the first record,
    the output's last file when the last one is written; a resumed run's pause counts too)."""
    m = run.meta
    for key in ("records_per_s", "throughput"):
        if isinstance(m.get(key), (int, float)):
            return f"{m[key]:,.1f}", "from the meta file"
    if isinstance(m.get("elapsed_s"), (int, float)) and m["elapsed_s"] > 0:
        return f"{summary.n / m['elapsed_s']:,.1f}", "from the meta file's elapsed_s"
    if run.meta_file and (run.kind != "blocks" or os.path.isdir(run.path)):  # local files
        try:
            t0 = os.stat(run.meta_file).st_mtime if run.meta_file else None
            t1 = max(os.stat(f).st_mtime for f in run.files) if run.files else None
        except OSError:
            t0 = t1 = None
        if t0 is not None and t1 is not None and t1 > t0 and summary.n:
            return (f"~{summary.n / (t1 - t0):,.1f}",
                    "estimated from the files' times: the meta file is written just before "
                    "the first record, the output's last file after the last one")
    return "n/a", "not recorded"


def _header(run: RunOutput, s: RunSummary) -> str:
    m = run.meta
    thr, thr_how = _throughput(run, s)
    cards = [_card(f"{s.n:,}", "records scored"), _card(_e(m.get("model", "n/a")), "model"),
             _card(_e(m.get("dtype", "n/a")), "dtype"),
             _card(_e(m.get("device", "n/a")), "device"),
             _card(_e(m.get("backend", "n/a")), "backend"),
             _card(escape(thr), "records per second")]
    if s.n_skipped:
        cards.insert(1, _card(f"{s.n_skipped:,}", "bad records skipped"))
    if s.n_nan:
        cards.insert(1, _card(f"{s.n_nan:,}", "records with a NaN score"))
    meta = (f"meta file {escape(run.meta_file)}" if run.meta_file
            else "no meta file found: settings and self-check unknown")
    return (f"<h1>icqs-fast run report</h1><div class=\"sub\">{escape(run.path)} "
            f"({escape(run.kind)}, {len(run.files)} file(s)); {meta}</div>"
            f'<div class="cards">{"".join(cards)}</div>'
            f'<div class="note">throughput: {escape(thr_how)}'
            + (f'; dtype: {_e(m["dtype_reason"])}' if m.get("dtype_reason") else "") + "</div>")


def _settings(run: RunOutput) -> str:
    rows = []
    for k, v in run.meta.items():
        if k == "self_check":
            continue
        t = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
        if len(t) > 120:
            t = t[:119] + "\u2026"
        rows.append([f"<code>{escape(k)}</code>", escape(t)])
    if not rows:
        return "<h2>Settings</h2><p class=\"note\">No meta file: the settings are unknown.</p>"
    return ("<h2>Settings</h2><details><summary>the run's settings from its meta file "
            f"({len(rows)})</summary>" + _table(["setting", "value"], rows) + "</details>")


def _self_check(check: Any) -> str:
    out = ["<h2>Self-check</h2>"]
    if check is None:
        return out[0] + '<p class="note">The meta file holds no self-check.</p>'
    if not check.ok:
        return out[0] + f'<p class="warn">{escape(check.message)}</p>'
    if check.warning:  # the self-check's own words (engine.selfcheck.distrust), said once
        from icqs_fast.engine.selfcheck import DISTRUST, warning_reason

        out.append(f'<p class="warn"><b>{escape(DISTRUST.capitalize())}:</b> '
                   f'{escape(warning_reason(check.warning))}.</p>')
    n = check.n_good + check.n_bad
    lo, hi = wilson(round(check.expected_accuracy * n), n) if n and math.isfinite(
        check.expected_accuracy) else (math.nan, math.nan)
    cards = [
        _card(f"{check.auc:.3f}", f"AUC [{check.auc_lo:.3f}, {check.auc_hi:.3f}] "
              f"({check.level:.0%} bootstrap)"),
        _card(_num(check.brier), f"Brier (a constant 0.5: {check.brier_constant:.3f})"),
        _card(_num(check.ece), f"ECE ({check.ece_bins} bins)"),
        _card(_num(check.threshold, ".4f"), "threshold on score (equal error)"),
        _card(_num(check.p_at_threshold, ".2f"), "p_good_calibrated at the threshold"),
        _card(_num(check.expected_accuracy, ".3f"), f"expected accuracy [{_num(lo)}, "
              f"{_num(hi)}]"),
        _card(f"{check.n_good} + {check.n_bad}", "held-out good + bad items"),
    ]
    out.append(f'<div class="cards">{"".join(cards)}</div>')
    out.append(f'<p class="note">{escape(check.message)}</p>')
    if check.reliability:
        out.append('<div class="charts"><figure>' + svg.reliability(
            check.reliability, title="reliability of the self-check's calibrated probability")
            + "<figcaption>reliability diagram: fraction of good answers against the mean "
            "calibrated probability per bin (held out, out of fold; bars: items per bin)"
            "</figcaption></figure></div>")
    if check.baselines:
        out.append(_baselines(check))
    if check.band is not None:
        out.append(_band(check.band))
    if check.pairwise:
        out.append(_pairwise_check(check.pairwise))
    return "".join(out)


def _pairwise_check(p: dict) -> str:
    """The pairwise self-check (:mod:`icqs_fast.engine.selfcheck_pairs`): ICQS's expected
    pairwise accuracy over held-out pairs beside the baselines', and the band over pairs."""
    def iv(d: dict) -> list[str]:
        return [_num(d["accuracy"]), f"[{_num(d['accuracy_lo'])}, {_num(d['accuracy_hi'])}]"]

    out = [f"<h3>Pairwise: {p['pairs']} held-out pairs of {p['instructions']} instructions "
           "(whole instructions held out)</h3>"]
    if p.get("beaten"):
        out.append(f'<p class="warn"><b>A baseline beats ICQS over pairs:</b> '
                   f"{escape(p['beaten'])}.</p>")
    rows = [["<b>ICQS</b>", *iv(p), "expected pairwise accuracy (the better output scored "
             "higher; a tie counts half)"]]
    rows += [[escape(b["name"]), *iv(b), escape(f"{b['text']}; {b['direction']} is better on "
                                                "the pools (fitted out of fold)")]
             for b in p.get("baselines") or []]
    out.append(_table(["judge", "pairwise accuracy", "interval", "what"], rows, {1}))
    band = p.get("band")
    if band is not None:
        from icqs_fast.engine.abstain import AbstainBand
        from icqs_fast.engine.selfcheck_pairs import pairwise_lines

        b = AbstainBand.from_dict(band)
        if b.reached:
            out.append('<div class="cards">' + "".join([
                _card(_num(b.hi, ".4f"), "tie when |margin| is at most"),
                _card(_num(b.coverage, ".2f"), f"pairs judged [{_num(b.coverage_lo, '.2f')}, "
                      f"{_num(b.coverage_hi, '.2f')}]"),
                _card(_num(b.accuracy, ".2f"), f"accuracy of the judged pairs "
                      f"[{_num(b.accuracy_lo, '.2f')}, {_num(b.accuracy_hi, '.2f')}]"),
            ]) + "</div>")
        line = [t for t in pairwise_lines(p) if t.startswith("pairwise abstain band")]
        out.append(f'<p class="{"note" if b.reached else "warn"}">{escape(line[0])}</p>')
    return "".join(out)


# --------------------------------------------------------------------------- pairs

# The fields of a ``score --pairs`` line the pairs page reads (io/schema.py PAIR_FIELDS).
PAIR_READ = ("index", "label", "preferred", "margin", "p_a_better", "error")
MARGIN_BINS = 24


@dataclass
class PairsSummary:
    """One pass over a ``score --pairs`` output: the pairs judged, the bad ones skipped, the
    ``preferred`` counts, every margin (8 bytes a pair) and label."""

    n: int = 0
    n_skipped: int = 0
    preferred: dict | None = None
    margins: list | None = None
    labels: list | None = None
    judged: list | None = None


def is_pairs_run(run: RunOutput) -> bool:
    """Whether ``run`` is a ``score --pairs`` output (its meta file's ``pairs`` key, else
    its first line's ``preferred``)."""
    if isinstance(run.meta.get("pairs"), dict):
        return True
    for _, row in _pair_rows(run):
        return "preferred" in row
    return False


def _pair_rows(run: RunOutput):
    """``(file, record)`` of every line of a pairs output (JSONL or Parquet files), only
    :data:`PAIR_READ`; an incomplete last JSONL line (a run still writing) is left out."""
    for f in run.files:
        if f.lower().endswith((".parquet", ".pq")):
            import pyarrow.parquet as pq

            t = pq.read_table(f)
            cols = [c for c in PAIR_READ if c in t.column_names]
            for row in t.select(cols).to_pylist():
                yield f, {k: v for k, v in row.items() if v is not None}
            continue
        with open(f, "rb") as fh:
            for lineno, raw in enumerate(fh, start=1):
                if not raw.endswith(b"\n") or not raw.strip():
                    continue
                try:
                    obj = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    obj = None
                if not isinstance(obj, dict):
                    from icqs_fast.io.records import InputError

                    raise InputError(f, lineno, None, "not a result record (a JSON object)")
                yield f, {k: obj[k] for k in PAIR_READ if k in obj}


def summarise_pairs(run: RunOutput) -> PairsSummary:
    """The :class:`PairsSummary` of a pairs output, in one pass."""
    from array import array

    s = PairsSummary(preferred={"a": 0, "b": 0, "tie": 0}, margins=array("d"), labels=[],
                     judged=[])
    for _, r in _pair_rows(run):
        if "preferred" not in r:
            s.n_skipped += int("error" in r)
            continue
        s.n += 1
        pref = str(r["preferred"])
        s.preferred[pref] = s.preferred.get(pref, 0) + 1
        m = r.get("margin")
        s.margins.append(float(m) if isinstance(m, (int, float)) else math.nan)
        if r.get("label") in ("a", "b"):
            s.labels.append(r["label"])
            s.judged.append(pref)
    return s


def _pairs_section(s: PairsSummary, meta: dict) -> str:
    """Pairwise accuracy (when the better output is known), the preferred counts and the
    margin distribution of a pairs output."""
    from icqs_fast.engine.pairs import pairwise_accuracy

    out = ["<h2>Pairwise judgements</h2>"]
    cards = [_card(f"{s.n:,}", "pairs judged")]
    cards += [_card(f"{s.preferred.get(k, 0):,}", f"preferred {k}") for k in ("a", "b", "tie")]
    if s.labels:
        acc, lo, hi = pairwise_accuracy(s.judged, s.labels)
        cards.insert(1, _card(f"{acc:.3f}", f"pairwise accuracy [{lo:.3f}, {hi:.3f}] (95% "
                              f"bootstrap over {len(s.labels):,} labelled pairs; a tie counts "
                              "half)"))
    out.append(f'<div class="cards">{"".join(cards)}</div>')
    if not s.labels:
        out.append('<p class="note">The pairs carry no better output (<code>--label-field'
                   "</code>): no pairwise accuracy.</p>")
    fin = [m for m in s.margins if math.isfinite(m)]
    if fin:
        tie = float((meta.get("pairs") or {}).get("tie_margin") or 0.0)
        top = max(max(abs(m) for m in fin), tie) or 1.0
        top *= 1.0001  # the largest margin inside the last bin
        edges = [-top + 2 * top * i / MARGIN_BINS for i in range(MARGIN_BINS + 1)]

        def counts(ms: list) -> list[int]:
            c = [0] * MARGIN_BINS
            for m in ms:
                c[min(MARGIN_BINS - 1, int((m - edges[0]) / (2 * top) * MARGIN_BINS))] += 1
            return c

        margins = list(s.margins)
        if s.labels and len(s.labels) == s.n:
            series = {f"{k} better": counts([m for m, lab in zip(margins, s.labels,
                                                                  strict=True)
                                             if lab == k and math.isfinite(m)])
                      for k in ("a", "b")}
        else:
            series = {"all pairs": counts(fin)}
        series = {k: v for k, v in series.items() if sum(v)}
        out.append('<div class="charts"><figure>' + svg.histogram(
            series, xlabel="margin = score_a - score_b", title="margin by the better output",
            marker=0.0, marker_label=f"tie within +-{tie:g}" if tie else "0",
            xr=(-top, top))
            + "<figcaption>the pairs' margins (each series' share per bin): right of 0 "
            "ICQS prefers a, left b" + (f"; within +-{tie:g} a tie" if tie else "")
            + "</figcaption></figure></div>")
    return "".join(out)


def render_pairs_page(run: RunOutput, s: PairsSummary, check: Any) -> str:
    """The page of a ``score --pairs`` output: its header, the pairwise judgements, the
    self-check (with its pairwise part) and the settings."""
    m = run.meta
    cards = [_card(f"{s.n:,}", "pairs judged"), _card(_e(m.get("model", "n/a")), "model"),
             _card(_e(m.get("dtype", "n/a")), "dtype"),
             _card(_e(m.get("device", "n/a")), "device")]
    if s.n_skipped:
        cards.insert(1, _card(f"{s.n_skipped:,}", "bad pairs skipped"))
    meta = (f"meta file {escape(run.meta_file)}" if run.meta_file
            else "no meta file found: settings and self-check unknown")
    head = (f"<h1>icqs-fast pairs report</h1><div class=\"sub\">{escape(run.path)} "
            f"({escape(run.kind)}, {len(run.files)} file(s)); {meta}</div>"
            f'<div class="cards">{"".join(cards)}</div>')
    body = [head, _pairs_section(s, m), _self_check(check), _settings(run)]
    return _page(f"icqs-fast pairs report: {_run_name(run)}", body)


def _baselines(check: Any) -> str:
    """The trivial scorers beside ICQS on the same held-out items
    (:mod:`icqs_fast.engine.selfcheck_baselines`), and the sentence when one beats it."""
    def iv(d: dict) -> list[str]:
        return [_num(d["auc"]), f"[{_num(d['auc_lo'])}, {_num(d['auc_hi'])}]"]

    rows = [["<b>ICQS</b>", *iv(check.__dict__), "the score"]]
    lm = check.length_matched
    if lm is not None:
        rows.append(["ICQS within length strata", *iv(lm),
                     f"good / bad pairs of like length only ({lm['strata']} strata)"])
    rows += [[escape(b["name"]), *iv(b), escape(f"{b['text']}; {b['direction']} is good on "
                                                "the pools (fitted out of fold)")]
             for b in check.baselines]
    out = ["<h3>Baselines on the same held-out items</h3>"]
    if check.beaten:
        out.append(f'<p class="warn"><b>A baseline beats ICQS:</b> {escape(check.beaten)}.</p>')
    out.append(_table(["scorer", "AUC", "interval", "what"], rows, {1}))
    return "".join(out)


def _band(b: Any) -> str:
    """The abstain band (:class:`icqs_fast.engine.abstain.AbstainBand`): its cards, its line
    and the coverage-accuracy curve."""
    out = [f"<h3>Abstain band for accuracy {b.target:g}</h3>"]
    if b.reached:
        out.append('<div class="cards">' + "".join([
            _card(_num(b.lo, ".4f") if math.isfinite(b.lo) else "none", "bad below score"),
            _card(_num(b.hi, ".4f") if math.isfinite(b.hi) else "none", "good from score"),
            _card(_num(b.coverage, ".2f"), f"coverage [{_num(b.coverage_lo, '.2f')}, "
                  f"{_num(b.coverage_hi, '.2f')}]"),
            _card(_num(b.accuracy, ".2f"), f"accuracy outside the band "
                  f"[{_num(b.accuracy_lo, '.2f')}, {_num(b.accuracy_hi, '.2f')}]"),
        ]) + "</div>")
    cls = "note" if b.reached else "warn"
    out.append(f'<p class="{cls}">{escape(b.text())}</p>')
    if b.curve:
        point = (b.coverage, b.accuracy, b.accuracy_lo, b.accuracy_hi) if b.reached else None
        out.append('<div class="charts"><figure>' + svg.coverage_accuracy(
            b.curve, title="accuracy outside the abstain band against coverage",
            target=b.target, point=point)
            + "<figcaption>the best accuracy of the verdicts outside a band of scores, for "
            "each share of records given a verdict (held-out items, in sample); dashed: the "
            "target; dot and bar: the chosen band out of fold, with its interval"
            "</figcaption></figure></div>")
    return "".join(out)


def _label_name(label: Any) -> str:
    return "(no label)" if label is None else str(label)


DISPLAY_BINS = 25


def _zoom(series: dict[str, list[int]]) -> tuple[dict[str, list[int]], tuple[float, float]]:
    """The fine histograms (:data:`~icqs_fast.report.run_output.HIST_BINS` over [0, 1]) cut to
    the range the records occupy (the whole of [0, 1] when they spread over most of it) and
    merged into at most :data:`DISPLAY_BINS` bins: ``(series, (lo, hi))``."""
    n = len(next(iter(series.values())))
    used = [i for i in range(n) if any(c[i] for c in series.values())]
    if not used:
        return series, (0.0, 1.0)
    first, last = used[0], used[-1] + 1
    width = max(1, math.ceil((last - first) / DISPLAY_BINS))
    # whole display bins of `width` fine bins, on multiples of `width`, one spare each side
    first = max(0, (first // width - 1) * width)
    last = min(n, (math.ceil(last / width) + 1) * width)
    if (last - first) > 0.6 * n:
        first, last, width = 0, n, max(1, math.ceil(n / DISPLAY_BINS))
    out = {k: [sum(c[j:min(j + width, last)]) for j in range(first, last, width)]
           for k, c in series.items()}
    return out, (first / n, min(last, first + width * len(next(iter(out.values())))) / n)


def _distributions(s: RunSummary, check: Any) -> str:
    out = ["<h2>Distributions</h2>"]
    # Good labels first, then bad, then the rest, each by count (so colours keep their
    # meaning from one report to the next).
    rank = {1: 0, 0: 1, None: 2}
    order = sorted(s.labels, key=lambda k: (rank[label_class(k)], -s.labels[k], str(k)))
    figs = []
    thr = s.threshold if math.isfinite(s.threshold) else None
    # The threshold in probability: the calibrated probability at the score threshold (not
    # 0.5: a map fitted on the held-out items puts the equal-error point where it falls).
    p_thr = (float(check.p_at_threshold) if thr is not None and check is not None
             and check.ok and math.isfinite(check.p_at_threshold) else None)
    for what, name, marker, mlabel in (
            ("score", "score", thr, f"threshold {thr:.3f}" if thr is not None else ""),
            ("p", "p_good_calibrated", p_thr,
             f"threshold {p_thr:.2f}" if p_thr is not None else "")):
        series = {_label_name(k): s.hist[what][k] for k in order if k in s.hist[what]}
        if not series:
            continue
        series, xr = _zoom(series)
        figs.append("<figure>" + svg.histogram(series, xlabel=name, title=f"{name} by label",
                                               marker=marker, marker_label=mlabel, xr=xr)
                    + f"<figcaption>{escape(name)} per label (each label's share of its "
                    "records per bin)</figcaption></figure>")
    if not figs:
        return out[0] + '<p class="note">No scored records.</p>'
    out.append('<div class="charts">' + "".join(figs) + "</div>")
    rows = []
    for k in ["*", *order]:
        ms, mp = s.moments["score"].get(k), s.moments["p"].get(k)
        n = s.n if k == "*" else s.labels[k]
        rows.append([escape("all" if k == "*" else _label_name(k)), f"{n:,}",
                     _num(ms.mean if ms else None), _num(ms.sd if ms else None),
                     _num(mp.mean if mp and mp.n else None)])
    out.append(_table(["label", "records", "mean score", "sd", "mean p_good_calibrated"],
                      rows, {1, 2, 3, 4}))
    if s.verdicts:
        how = ("the records' verdict field" if s.verdict_source == "field" else
               f"score >= the self-check threshold {s.threshold:.4f}"
               if s.verdict_source == "threshold" else s.verdict_source)
        out.append('<p class="note">verdicts (' + escape(how) + "): " + ", ".join(
            f"{escape(k)} {v:,} ({v / s.n:.1%})" for k, v in sorted(s.verdicts.items()))
            + "</p>")
    return "".join(out)


def _confusion(s: RunSummary) -> str:
    if not s.has_labels:
        return ""
    out = ["<h2>Labels against verdicts</h2>"]
    if s.unrecognised_labels:
        out.append('<p class="note">labels read neither as good nor as bad (left out): '
                   + escape(", ".join(sorted(map(str, s.unrecognised_labels)))) + "</p>")
    if not s.confusion:
        out.append('<p class="note">No confusion: it needs good / bad labels and a verdict '
                   "(a self-check threshold or a verdict field).</p>")
        return "".join(out)
    cols = [v for v in ("good", "bad", "abstain") if any(k[1] == v for k in s.confusion)]
    rows = []
    for cls, name in ((1, "good"), (0, "bad")):
        rows.append([f"label {name}"] + [f"{s.confusion.get((cls, v), 0):,}" for v in cols])
    n = sum(c for (_, v), c in s.confusion.items() if v in ("good", "bad"))
    k = s.confusion.get((1, "good"), 0) + s.confusion.get((0, "bad"), 0)
    lo, hi = wilson(k, n)
    out.append(_table(["", *(f"verdict {v}" for v in cols)], rows, set(range(1, 4))))
    if n:
        out.append(f'<p class="note">accuracy {k / n:.3f} [{lo:.3f}, {hi:.3f}] (95% Wilson) '
                   f"over {n:,} records with a good / bad label and verdict</p>")
    return "".join(out)


def _records_table(items: list[Scored], texts: dict[int, tuple[str, str]]) -> str:
    rows = []
    for r in items:
        x, y = texts.get(r.index, (None, None))
        text = "" if x is None else f"<i>x:</i> {escape(x)}<br><i>y:</i> {escape(y)}"
        rows.append([f"{r.index:,}", _e(r.id), _e(r.label), _num(r.score, ".4f"),
                     _num(r.p, ".3f"), _num(r.margin, ".3f"), _num(r.near_ties),
                     _num(r.spread, ".3f"), _e(r.verdict), text])
    head = ["index", "id", "label", "score", "p_cal", "margin", "near ties", "set spread",
            "verdict", "text"]
    t = _table(head, rows, {0, 3, 4, 5, 6, 7})
    return t.replace('<td class="">' + "<i>x:", '<td class="t"><i>x:')


def _records(s: RunSummary, texts: dict, have_input: bool) -> str:
    out = ["<h2>Least certain records</h2>"]
    if not have_input:
        out.append('<p class="note">The output holds no texts: pass <code>--input</code> '
                   "(the scored input file) to show each record's prompt and response.</p>")
    for items, title in ((s.least_margin, "smallest margin (nats between the best two "
                          "mixture ratios)"),
                         (s.most_ties, "most near-tied sets"),
                         (s.widest_spread, "widest spread of the per-set scores"),
                         (s.closest, "closest to the threshold")):
        if items:
            out.append(f"<h3>{escape(title)}</h3>" + _records_table(items, texts))
    if s.has_labels and s.confusion:
        out.append("<h2>Most confident mistakes</h2>")
        if s.mistakes:
            out.append('<p class="note">verdict against the label, furthest from 0.5 in '
                       "p_good_calibrated (or from the threshold in score) first</p>"
                       + _records_table(s.mistakes, texts))
        else:
            out.append('<p class="note">No mistakes at the threshold.</p>')
    return "".join(out)


def _headline(d: Drift) -> str:
    if not d.moved:
        return d.verdict
    k = sum(i.moved for i in d.items)
    return f"drift: {k} of {len(d.items)} comparisons moved beyond noise"


def _drift(d: Drift) -> str:
    cls = "bad" if d.moved else "ok"
    out = ["<h2>Drift against the baseline</h2>",
           f'<p class="sub">baseline {escape(d.baseline)}</p>',
           f'<div class="{cls}"><b>{escape(_headline(d))}</b>'
            + ("<ul>" + "".join(f"<li>{escape(i.text)}</li>" for i in d.items
                                      if i.moved) + "</ul>" if d.moved else "") + "</div>"]
    rows = [[escape(i.name), "<b>moved</b>" if i.moved else "shown" if i.details.get(
        "tested") is False else "within noise", escape(i.text)] for i in d.items]
    out.append(_table(["what", "", "comparison"], rows))
    for n in d.notes:
        out.append(f'<p class="note">{escape(n)}</p>')
    if d.changed:
        rows = [[f"{c['index_baseline']:,}", f"{c['index_new']:,}",
                 _num(c["score_baseline"], ".4f"), _num(c["score_new"], ".4f"),
                 _num(c["change"], "+.4f")] for c in d.changed]
        out.append("<h3>records that changed most</h3>" + _table(
            ["index (baseline)", "index (new)", "score (baseline)", "score (new)", "change"],
            rows, {0, 1, 2, 3, 4}))
    return "".join(out)


def render_page(run: RunOutput, s: RunSummary, check: Any, *, texts: dict | None = None,
                have_input: bool = False, drift: Drift | None = None) -> str:
    """The page's HTML (see the module docstring)."""
    body = [_header(run, s)]
    if drift is not None:
        body.append(_drift(drift))
    body += [_self_check(check), _distributions(s, check), _confusion(s),
             _records(s, texts or {}, have_input), _settings(run)]
    return _page(f"icqs-fast report: {_run_name(run)}", body)


def write_report(output: str | os.PathLike, page: str | os.PathLike, *,
                 baseline: str | os.PathLike | None = None,
                 input: str | os.PathLike | None = None) -> ReportResult:
    """Write the report page of the run at ``output`` (a JSONL / Parquet output or a ``--ray``
    folder) to ``page``; with ``baseline`` (another output), the drift section; with ``input``
    (the scored input file), the shown records' texts.

    Raises:
        FileNotFoundError / InputError: an output, baseline or input that is missing or not
            readable (the file and line named).
    """
    t0 = time.perf_counter()
    run = open_run(output)
    check = read_self_check(run.meta)
    if run.kind != "blocks" and is_pairs_run(run):  # score --pairs (no --ray: no blocks)
        if baseline is not None or input is not None:
            raise ValueError("a pairs output's page has no drift or record texts: leave out "
                             "--baseline and --input")
        ps = summarise_pairs(run)
        data = render_pairs_page(run, ps, check).encode("utf-8")
        p = Path(page)
        p.parent.mkdir(parents=True, exist_ok=True)
        write_whole(p, data)
        return ReportResult(p, len(data), ps.n, time.perf_counter() - t0, None)
    thr = float(check.threshold) if check is not None and check.ok else math.nan
    base = open_run(baseline) if baseline is not None else None
    s = summarise(run, threshold=thr, columns=base is not None)
    drift = None
    if base is not None:
        bcheck = read_self_check(base.meta)
        bthr = float(bcheck.threshold) if bcheck is not None and bcheck.ok else math.nan
        bs = summarise(base, threshold=bthr, columns=True)
        drift = compare_summaries(bs, s, check_a=bcheck, check_b=check,
                                  names=(base.path, run.path))
    texts: dict = {}
    if input is not None:
        shown = {r.index: r.id for lst in (s.least_margin, s.most_ties, s.widest_spread,
                                           s.closest, s.mistakes) for r in lst}
        texts = record_texts(os.fspath(input), run.meta, shown, limit=TEXT_LIMIT)
    html = render_page(run, s, check, texts=texts, have_input=input is not None, drift=drift)
    p = Path(page)
    p.parent.mkdir(parents=True, exist_ok=True)
    data = html.encode("utf-8")
    write_whole(p, data)
    return ReportResult(p, len(data), s.n, time.perf_counter() - t0, drift)


def _run_name(run: Any) -> str:
    return os.path.basename(run.path.rstrip("/")) or run.path


def _page(title: str, body: list[str]) -> str:
    """The page around ``body``'s sections: its title, the strict CSP, the style and the note
    of when it was written (one shell for the records page and the pairs page)."""
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{escape(title)}</title><style>{STYLE}</style></head><body><main>"
            + "".join(body) + '<p class="note">written by icqs-fast report '
            f"on {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}</p></main></body>"
            "</html>\n")
