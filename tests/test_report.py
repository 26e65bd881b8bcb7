"""``icqs-fast report``: the run report page and the drift between two runs
(icqs_fast/report/run_output.py, run_report.py, drift.py, svg.py; cli/report.py).

Outputs are synthetic: records with the declared ICQS fields (io/schema.py ICQS_FIELDS)
written by the project's own writers (JSONL, Parquet, a ``--ray`` block folder), a meta file
with a real self-check fitted by engine/selfcheck.fit_self_check. The browser checks are in
tests/test_report_browser.py.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

from icqs_fast.cli import main
from icqs_fast.engine.selfcheck import fit_self_check
from icqs_fast.io.blocks import BlockOutput
from icqs_fast.io.records import InputError
from icqs_fast.io.results import JsonlWriter, ParquetResultWriter
from icqs_fast.io.runs import write_meta
from icqs_fast.io.schema import ICQS_FIELDS, arrow_schema
from icqs_fast.report.drift import NO_CHANGE, compare_runs, psi, wilson
from icqs_fast.report.run_output import label_class, open_run, summarise
from icqs_fast.report.run_report import CSP, write_report

HOSTILE = ['<script>alert("x")</script>', "it's \"quoted\" & <b>bold</b>",
           "caf\u00e9 \u2014 \u65e5\u672c\u8a9e \U0001f600 \u202eevil"]


def self_check_dict(seed: int = 0, sep: float = 1.2, n: int = 60,
                    target: float | None = None) -> dict:
    """A real self-check (engine/selfcheck.fit_self_check) of ``n`` + ``n`` held-out scores
    whose classes are ``sep`` standard deviations apart, as a meta file holds it (with the
    abstain band for accuracy ``target`` when given)."""
    rng = random.Random(seed)
    scores = [min(1, max(0, 0.5 + 0.1 * (rng.gauss(0, 1) + (sep / 2 if i < n else -sep / 2))))
              for i in range(2 * n)]
    labels = [1] * n + [0] * n
    return fit_self_check(scores, labels, seed=seed, n_boot=200,
                          target_accuracy=target).to_dict()


def make_records(n: int, *, seed: int = 0, shift: float = 0.0, noise: float = 0.0,
                 flip: float = 0.0, ids: bool = True, check: dict | None = None,
                 texts: bool = False) -> list[dict]:
    """``n`` records with every declared ICQS field (M+1 = 5 ratios, L = 3 sets); labels good /
    bad with good records scoring higher; ``shift`` moves every score, ``noise`` adds per-record
    scatter on top of the same base scores (same ``seed``), ``flip`` flips that share of labels.
    """
    rng = random.Random(seed)
    noise_rng = random.Random(seed + 10_000)
    flip_rng = random.Random(seed + 20_000)
    cal = None
    if check is not None:
        from icqs_fast.engine.selfcheck import SelfCheck

        cal = SelfCheck.from_dict(check)
    ratios = [0.0, 0.25, 0.5, 0.75, 1.0]
    out = []
    for i in range(n):
        good = rng.random() < 0.5
        base = 0.5 + 0.1 * (rng.gauss(0, 1) + (0.6 if good else -0.6))
        per_set = [base + rng.gauss(0, 0.05) for _ in range(3)]
        margin = abs(rng.gauss(0, 0.4))
        ties = sum(rng.random() < 0.15 for _ in range(3))
        score = min(1.0, max(0.0, base + shift + (noise_rng.gauss(0, noise) if noise else 0)))
        label = "good" if good else "bad"
        if flip and flip_rng.random() < flip:
            label = "bad" if good else "good"
        r = {"index": i, "line": i + 1}
        if ids:
            r["id"] = f"rec-{i}"
        r.update({
            "label": label, "score": score, "score_per_set": per_set,
            "loglik": [[-rng.random() * 5 for _ in range(3)] for _ in ratios],
            "ratios": ratios, "n_response_tokens": rng.randint(1, 40),
            "n_prompt_tokens": [[rng.randint(50, 90) for _ in range(3)] for _ in ratios],
            "truncated": False, "join": False, "margin": margin,
            "margins": [abs(rng.gauss(0, 0.4)) for _ in range(3)], "near_ties": ties,
            "slope": (score - 0.5) * 4, "p_good": 1 / (1 + math.exp(-(score - 0.5) * 4))})
        if cal is not None:
            r["p_good_calibrated"] = float(cal.apply(score))
        out.append(r)
    assert set(out[0]) <= {f.name for f in ICQS_FIELDS}  # only declared fields
    return out


def meta_for(check: dict | None, dtype: str = "float32") -> dict:
    m = {"model": "embedded:SmolLM2-135M-Instruct", "num_ratios": 5, "demos_per_set": 2,
         "sets_per_ratio": 3, "seed": 0, "score": "mean", "x_field": "x", "y_field": "y",
         "id_field": None, "label_field": "quality", "encoding": "utf-8", "dtype": dtype,
         "device": "cpu", "backend": "cpp", "content_free": ["N/A", "", "[MASK]"]}
    if check is not None:
        m["self_check"] = check
    return m


def write_output(path: Path, records: list[dict], meta: dict, kind: str = "jsonl") -> Path:
    """Write ``records`` as a run's output of ``kind`` (jsonl / parquet / blocks) with the
    project's writers, and its meta file."""
    if kind == "blocks":
        bo = BlockOutput(str(path))
        bo.make()
        bo.write_meta(meta)
        for b in range(0, len(records), 50):
            with bo.open_block(b // 50, "parquet", schema=arrow_schema("icqs")) as w:
                for r in records[b:b + 50]:
                    w.write(r)
        return path
    writer = (ParquetResultWriter(path, schema=arrow_schema("icqs")) if kind == "parquet"
              else JsonlWriter(path))
    write_meta(path, meta)
    with writer:
        for r in records:
            writer.write(r)
    return path


def write_input(path: Path, n: int) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"rec-{i}", "x": HOSTILE[i % 3] + f" question {i}",
                                "y": HOSTILE[(i + 1) % 3] + " answer " + "long " * 80,
                                "quality": "good"}, ensure_ascii=False) + "\n")
    return path


def pairs_check_dict(n: int = 40, target: float | None = 0.8) -> dict:
    """A real self-check with its pairwise part (engine/selfcheck.fit_self_check over ``n``
    instructions, each with a good and a bad answer, the good ones shorter), as a pairs
    run's meta file holds it."""
    rng = random.Random(3)
    items = ([(f"q{i}", "g" * (3 + i % 4)) for i in range(n)]
             + [(f"q{i}", "b" * (8 + i % 5)) for i in range(n)])
    labels = [1] * n + [0] * n
    scores = [0.5 + 0.1 * (rng.gauss(0, 1) + (0.8 if lab else -0.8)) for lab in labels]
    values = [{"length_tokens": float(len(y)), "length_chars": float(len(y))}
              for _, y in items]
    return fit_self_check(scores, labels, n_boot=200, target_accuracy=target,
                          baseline_values=values, pair_items=items).to_dict()


def write_pairs_output(path: Path, n: int, check: dict | None, kind: str = "jsonl",
                       tie: float = 0.0) -> Path:
    """A ``score --pairs`` output of ``n`` judged pairs (the declared PAIR_FIELDS, labels a /
    b, ICQS right on about 70 %) and one skipped bad pair, with its meta file."""
    from icqs_fast.io.schema import arrow_schema as schema_of

    rng = random.Random(5)
    rows = []
    for i in range(n):
        better = "a" if i % 2 == 0 else "b"
        m = rng.gauss(0.05 if better == "a" else -0.05, 0.08)
        pref = "tie" if abs(m) <= tie else "a" if m > 0 else "b"
        rows.append({"index": i, "line": i + 1, "id": f"p{i}", "label": better,
                     "score_a": 0.5 + m / 2, "score_b": 0.5 - m / 2, "preferred": pref,
                     "margin": m, "p_a_better": 1 / (1 + math.exp(-10 * m))})
    rows.append({"index": n, "line": n + 1, "error": {"field": "y_b", "reason": "missing"}})
    meta = {**meta_for(check), "pairs": {"y_a_field": "y_a", "y_b_field": "y_b",
                                         "pair_field": None, "tie_margin": tie}}
    writer = (ParquetResultWriter(path, schema=schema_of("pairs")) if kind == "parquet"
              else JsonlWriter(path))
    write_meta(path, meta)
    with writer:
        for r in rows:
            writer.write(r)
    return path


class _Checker(HTMLParser):
    """Collects tags and text; fails on a script tag or a tag that loads something."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.text: list[str] = []
        self.csp = None

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        a = dict(attrs)
        assert tag not in ("script", "link", "iframe", "object", "embed", "img"), tag
        for k, v in a.items():
            assert not k.startswith("on"), (tag, k)
            if k in ("src", "href"):
                assert (v or "").startswith("data:"), (tag, k, v)
        if tag == "meta" and a.get("http-equiv") == "Content-Security-Policy":
            self.csp = a.get("content")

    def handle_data(self, data):
        self.text.append(data)


def parse(html: str) -> _Checker:
    c = _Checker()
    c.feed(html)
    return c


# --------------------------------------------------------------------------- the page


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "blocks"])
def test_page_of_each_output_kind(tmp_path, kind):
    check = self_check_dict()
    recs = make_records(200, check=check)
    out = write_output(tmp_path / ("out" + {"jsonl": ".jsonl", "parquet": ".parquet",
                                            "blocks": ""}[kind]), recs, meta_for(check), kind)
    res = write_report(out, tmp_path / "r.html", input=write_input(tmp_path / "in.jsonl", 200))
    html = res.path.read_text(encoding="utf-8")
    assert res.n == 200
    c = parse(html)
    assert c.csp == CSP
    assert c.tags.count("svg") == 3  # reliability, score and p_good_calibrated histograms
    text = "".join(c.text)
    for needle in ("embedded:SmolLM2-135M-Instruct", "float32", "Self-check", "AUC",
                   "expected accuracy", "Least certain records", "Most confident mistakes",
                   "label good", "verdict bad"):
        assert needle in text, needle
    chk = open_run(out)
    assert chk.kind == kind and chk.meta["dtype"] == "float32"
    # The confusion's cells add up to the labelled records.
    s = summarise(chk, threshold=check["threshold"])
    assert sum(s.confusion.values()) == 200
    # Hostile texts are escaped: they come back as text, never as markup.
    assert "<script>" not in html and '<b>bold</b>' not in html
    assert '&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;' in html
    assert "\u65e5\u672c\u8a9e" in text and "\U0001f600" in text
    assert "long long" in text and "\u2026" in text  # cut to a readable length
    assert "\u202e" not in html and "&lt;U+202E&gt;" in html  # a bidi override shown, not applied


def test_summary_is_exact_on_known_records(tmp_path):
    recs = make_records(300, check=None)
    out = write_output(tmp_path / "o.jsonl", recs, meta_for(None))
    s = summarise(open_run(out), threshold=0.5, k=5)
    assert s.n == 300 and s.labels == {"good": sum(r["label"] == "good" for r in recs),
                                       "bad": sum(r["label"] == "bad" for r in recs)}
    margins = sorted(r["margin"] for r in recs)[:5]
    assert [x.margin for x in s.least_margin] == margins
    spreads = sorted((max(r["score_per_set"]) - min(r["score_per_set"]) for r in recs),
                     reverse=True)[:5]
    assert [x.spread for x in s.widest_spread] == pytest.approx(spreads)
    tp = sum(r["label"] == "good" and r["score"] >= 0.5 for r in recs)
    assert s.confusion[(1, "good")] == tp
    assert sum(sum(h) for h in s.hist["score"].values()) == 300
    wrong = [r for r in recs if (r["score"] >= 0.5) != (r["label"] == "good")]
    top = sorted(wrong, key=lambda r: -abs(r["score"] - 0.5))[:5]
    assert [x.index for x in s.mistakes] == [r["index"] for r in top]


def test_verdict_field_used_when_present(tmp_path):
    recs = make_records(40)
    for r in recs:
        r["verdict"] = "abstain" if r["index"] % 4 == 0 else "good"
    out = write_output(tmp_path / "o.jsonl", recs, meta_for(None))
    s = summarise(open_run(out), threshold=0.5)
    assert s.verdicts == {"abstain": 10, "good": 30} and s.verdict_source == "field"


def test_no_meta_no_labels_no_self_check(tmp_path):
    recs = make_records(30, ids=False)
    for r in recs:
        del r["label"]
    out = tmp_path / "o.jsonl"
    with JsonlWriter(out) as w:
        for r in recs:
            w.write(r)
    html = write_report(out, tmp_path / "r.html").path.read_text(encoding="utf-8")
    assert "no meta file found" in html and "Labels against verdicts" not in html
    assert "pass <code>--input</code>" in html


def test_skipped_and_nan_records_counted(tmp_path):
    recs = make_records(10)
    recs[3] = {"index": 3, "line": 4, "error": {"field": "y", "reason": "empty"}}
    recs[5]["score"] = float("nan")
    out = write_output(tmp_path / "o.jsonl", recs, meta_for(None))
    s = summarise(open_run(out))
    assert (s.n, s.n_skipped, s.n_nan) == (8, 1, 1)


def test_label_class():
    assert [label_class(v) for v in ("good", "BAD", True, 0, "1", "maybe", None)] == \
        [1, 0, 1, 0, 1, None, None]


def test_weak_self_check_says_so(tmp_path):
    check = self_check_dict(sep=0.0)
    out = write_output(tmp_path / "o.jsonl", make_records(20, check=check), meta_for(check))
    html = write_report(out, tmp_path / "r.html").path.read_text(encoding="utf-8")
    assert "Do not trust these scores on this task" in html and "does not separate" in html
    assert "--model" in html and "--demos-per-set" in html


def test_abstain_band_and_its_curve_on_the_page(tmp_path):
    scores = [0.5 + 0.01 * v for v in (list(range(-10, 20)) + list(range(-20, 10)))]
    chk = fit_self_check(scores, [1] * 30 + [0] * 30, n_boot=200, target_accuracy=0.9).to_dict()
    assert chk["band"]["reached"]
    out = write_output(tmp_path / "o.jsonl", make_records(20, check=chk), meta_for(chk))
    html = write_report(out, tmp_path / "r.html").path.read_text(encoding="utf-8")
    assert "Abstain band for accuracy 0.9" in html and "coverage [" in html
    assert 'aria-label="accuracy outside the abstain band against coverage"' in html


# --------------------------------------------------------------------------- bad input


def test_bad_inputs_exit_2(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "r.html")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"index": 0, "score": 0.5}\nnot json\n{"index": 2, "score": 0.1}\n')
    assert main(["report", str(bad), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2" in err or ("bad.jsonl" in err and "line 2" in err), err
    good = write_output(tmp_path / "g.jsonl", make_records(5), meta_for(None))
    Path(f"{good}.meta.json").write_text("{not json")
    assert main(["report", str(good), "-o", str(tmp_path / "r.html")]) == 2
    assert "meta.json" in capsys.readouterr().err
    pq = tmp_path / "x.parquet"
    pq.write_bytes(b"PAR1 not parquet")
    assert main(["report", str(pq), "-o", str(tmp_path / "r.html")]) == 2
    assert "x.parquet" in capsys.readouterr().err
    assert main(["report", str(good), "--fail-on-drift"]) == 2
    folder = tmp_path / "empty"
    folder.mkdir()
    assert main(["report", str(folder), "-o", str(tmp_path / "r.html")]) == 2
    assert "not a --ray output" in capsys.readouterr().err


def test_input_that_is_not_the_scored_one_is_refused(tmp_path, capsys):
    out = write_output(tmp_path / "o.jsonl", make_records(30), meta_for(None))
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"id": f"x-{i}", "x": "q", "y": "a"}) + "\n"
                             for i in range(30)))
    assert main(["report", str(out), "-o", str(tmp_path / "r.html"), "--input",
                 str(other)]) == 2
    err = capsys.readouterr().err
    assert "other.jsonl" in err and "not the scored input" in err, err


def test_features_output_is_refused(tmp_path, capsys):
    out = tmp_path / "f.jsonl"
    with JsonlWriter(out) as w:
        for i in range(3):
            w.write({"index": i, "line": i + 1, "n_tokens": 4, "sent_logprob": -1.0})
    assert main(["report", str(out), "-o", str(tmp_path / "r.html")]) == 2
    assert "not the output of icqs-fast score" in capsys.readouterr().err


def test_incomplete_last_line_left_out(tmp_path):
    out = write_output(tmp_path / "o.jsonl", make_records(5), meta_for(None))
    with open(out, "a") as f:
        f.write('{"index": 5, "sco')
    assert summarise(open_run(out)).n == 5
    with pytest.raises(InputError):
        with open(out, "a") as f:
            f.write('\n{"index": 6, "score": 0.1}\n')
        summarise(open_run(out))


# --------------------------------------------------------------------------- drift


def test_psi_and_wilson_known_values():
    import numpy as np

    a = np.linspace(0, 1, 1000)
    assert psi(a, a) == pytest.approx(0.0, abs=1e-12)
    assert psi(a, a + 0.3) > 0.25
    lo, hi = wilson(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-3) and hi == pytest.approx(0.5962, abs=1e-3)


def test_tiny_noise_is_no_change(tmp_path):
    check = self_check_dict()
    a = write_output(tmp_path / "a.jsonl", make_records(400, check=check), meta_for(check))
    b = write_output(tmp_path / "b.parquet", make_records(400, check=check, noise=0.003),
                     meta_for(check, "bfloat16"), "parquet")
    d = compare_runs(a, b)
    assert d.verdict == NO_CHANGE, d.verdict
    assert not d.moved
    names = {i.name for i in d.items}
    assert {"score_distribution", "p_good_calibrated_distribution", "self_check_auc",
            "record_scores", "verdict_flips", "labels"} <= names


def test_changed_pool_and_flipped_labels_are_named(tmp_path):
    check = self_check_dict()
    a = write_output(tmp_path / "a.jsonl", make_records(400, check=check), meta_for(check))
    other = self_check_dict(seed=3, sep=0.0)  # another pool: a self-check that separates less
    b = write_output(tmp_path / "b.jsonl", make_records(400, check=other, shift=0.08,
                                                        noise=0.05), meta_for(other))
    d = compare_runs(a, b)
    moved = {i.name for i in d.items if i.moved}
    assert {"score_distribution", "record_scores", "self_check_auc"} <= moved, d.verdict
    assert d.verdict.startswith("drift: ") and "score distribution: mean" in d.verdict
    c = write_output(tmp_path / "c.jsonl", make_records(400, check=check, flip=0.5),
                     meta_for(check))
    d = compare_runs(a, c)
    moved = {i.name for i in d.items if i.moved}
    assert moved == {"labels", "label_accuracy"}, d.verdict
    assert "labels changed on" in d.verdict


def test_matched_by_index_without_ids(tmp_path):
    check = self_check_dict()
    a = write_output(tmp_path / "a.jsonl", make_records(50, check=check, ids=False),
                     meta_for(check))
    b = write_output(tmp_path / "b", make_records(50, check=check, ids=False),
                     meta_for(check), "blocks")
    d = compare_runs(a, b.resolve().as_uri())  # a --ray folder named by a pyarrow URI
    assert d.verdict == NO_CHANGE
    assert any("matched by index" in n and n.startswith("50 records") for n in d.notes)


def test_exit_codes_fail_on_drift(tmp_path, capsys):
    check = self_check_dict()
    a = write_output(tmp_path / "a.jsonl", make_records(300, check=check), meta_for(check))
    same = write_output(tmp_path / "s.jsonl", make_records(300, check=check, noise=0.002),
                        meta_for(check))
    moved = write_output(tmp_path / "m.jsonl", make_records(300, check=check, shift=0.1),
                         meta_for(check))
    page = str(tmp_path / "r.html")
    assert main(["report", str(same), "-o", page, "--baseline", str(a), "--fail-on-drift"]) == 0
    assert NO_CHANGE in capsys.readouterr().out
    assert main(["report", str(moved), "-o", page, "--baseline", str(a), "--fail-on-drift"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("drift: ") and "score distribution" in out
    assert main(["report", str(moved), "-o", page, "--baseline", str(a)]) == 0
    capsys.readouterr()
    html = Path(page).read_text(encoding="utf-8")
    assert "Drift against the baseline" in html and "records that changed most" in html
    assert main(["report", str(moved), "-o", page, "--baseline", str(tmp_path / "nope.jsonl"),
                 "--fail-on-drift"]) == 2
    assert main(["report", str(moved), "-o", page, "--baseline", str(a), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["drift"]["moved"] is True and doc["records"] == 300


# --------------------------------------------------------------------------- size and speed


@pytest.mark.slow
def test_100k_record_page_is_small(tmp_path):
    """The done-when: a 100k-record output's page in < 30 s and < 5 MB (the time is printed
    for the record, not asserted: the shared machine is noisy)."""
    check = self_check_dict()
    recs = make_records(100_000, check=check)
    out = write_output(tmp_path / "big.jsonl", recs, meta_for(check))
    base = write_output(tmp_path / "base.jsonl", make_records(100_000, check=check, noise=0.002),
                        meta_for(check))
    del recs
    t = time.perf_counter()
    res = write_report(out, tmp_path / "r.html")
    alone = time.perf_counter() - t
    t = time.perf_counter()
    res2 = write_report(out, tmp_path / "r2.html", baseline=base)
    both = time.perf_counter() - t
    print(f"\n100k records ({out.stat().st_size / 1e6:.0f} MB JSONL): page {res.bytes / 1e3:.0f} "
          f"kB in {alone:.1f} s; with a 100k baseline {res2.bytes / 1e3:.0f} kB in {both:.1f} s")
    assert res.n == 100_000 and res.bytes < 5_000_000 and res2.bytes < 5_000_000
    assert res2.drift is not None and res2.drift.verdict == NO_CHANGE


@pytest.mark.slow
@pytest.mark.embedded
def test_real_runs_dtype_is_noise_and_swapped_pools_drift(tmp_path, capsys):
    """Three real runs of the embedded model on the built-in financial answers: float32, the
    same job in bfloat16 (no change beyond noise), and the pools swapped (good <-> bad: a
    changed demonstration pool, named as drift); --fail-on-drift gives 0 and 1."""
    from icqs_fast.data import __file__ as data_init

    data = Path(data_init).parent
    good, bad = str(data / "demo_good.jsonl"), str(data / "demo_bad.jsonl")
    inp = str(data / "demo_financial.jsonl")

    def score(out: Path, dtype: str, g: str, b: str) -> Path:
        assert main(["score", inp, "-o", str(out), "--good", g, "--bad", b, "--label-field",
                     "quality", "--num-ratios", "3", "--sets-per-ratio", "2",
                     "--demos-per-set", "2", "--self-check-max", "40", "--dtype", dtype,
                     "--threads", "1", "--quiet"]) == 0
        return out

    fp32 = score(tmp_path / "fp32.jsonl", "float32", good, bad)
    bf16 = score(tmp_path / "bf16.parquet", "bfloat16", good, bad)
    swapped = score(tmp_path / "swapped.jsonl", "float32", bad, good)
    capsys.readouterr()
    page = str(tmp_path / "r.html")
    assert main(["report", str(bf16), "-o", page, "--baseline", str(fp32), "--input", inp,
                 "--fail-on-drift"]) == 0
    assert capsys.readouterr().out.startswith(NO_CHANGE)
    assert "fin-01" in Path(page).read_text(encoding="utf-8")
    assert main(["report", str(swapped), "-o", page, "--baseline", str(fp32),
                 "--fail-on-drift"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("drift: ") and "per-record score change" in out, out


def test_histogram_zooms_into_the_occupied_range():
    from icqs_fast.report.run_output import HIST_BINS
    from icqs_fast.report.run_report import DISPLAY_BINS, _zoom

    fine = [0] * HIST_BINS
    for v in (0.45, 0.47, 0.5, 0.52, 0.55):
        fine[int(v * HIST_BINS)] += 2
    out, (lo, hi) = _zoom({"a": fine, "b": fine[::-1]})
    assert 0.4 < lo < 0.45 and 0.55 < hi < 0.6, (lo, hi)
    assert sum(out["a"]) == 10 and sum(out["b"]) == 10 and len(out["a"]) <= DISPLAY_BINS + 2
    spread = [1] * HIST_BINS  # records everywhere: the whole of [0, 1]
    out, xr = _zoom({"a": spread})
    assert xr == (0.0, 1.0) and sum(out["a"]) == HIST_BINS and len(out["a"]) <= DISPLAY_BINS


# --------------------------------------------------------------------------- wording and marks


def test_do_not_trust_is_said_once(tmp_path):
    check = self_check_dict(sep=0.0)
    assert check["warning"].startswith("do not trust these scores on this task")
    out = write_output(tmp_path / "o.jsonl", make_records(20, check=check), meta_for(check))
    html = write_report(out, tmp_path / "r.html").path.read_text(encoding="utf-8")
    assert html.lower().count("do not trust these scores on this task") == 1, html
    assert "<b>Do not trust these scores on this task:</b> the scorer does not separate" in html


def test_probability_histogram_marks_the_real_threshold(tmp_path):
    # Good scores spread wider than bad ones: the equal-error point is not where P(good) is 0.5.
    rng = random.Random(0)
    scores = ([min(1, max(0, rng.gauss(0.6, 0.1))) for _ in range(60)]
              + [min(1, max(0, rng.gauss(0.45, 0.03))) for _ in range(60)])
    check = fit_self_check(scores, [1] * 60 + [0] * 60, n_boot=200).to_dict()
    p_thr = f"{check['p_at_threshold']:.2f}"
    assert p_thr != "0.50"  # else the test could not tell the two marks apart
    out = write_output(tmp_path / "o.jsonl", make_records(400, check=check), meta_for(check))
    html = write_report(out, tmp_path / "r.html").path.read_text(encoding="utf-8")
    assert f">threshold {p_thr}</text>" in html, html
    assert 'fill="#c00">0.5</text>' not in html  # the old mark


def test_a_psi_within_noise_is_not_called_moderate_or_major(tmp_path):
    check = self_check_dict()
    a = write_output(tmp_path / "a.jsonl", make_records(20, seed=0, check=check),
                     meta_for(check))
    b = write_output(tmp_path / "b.jsonl", make_records(20, seed=1, check=check),
                     meta_for(check))
    item = {i.name: i for i in compare_runs(a, b).items}["score_distribution"]
    assert not item.moved and item.details["psi_band"] != "stable"  # the case in question
    assert f"({item.details['psi_band']}" not in item.text, item.text
    assert "PSI" in item.text and "within noise" in item.text, item.text
    html = write_report(a, tmp_path / "r.html", baseline=b).path.read_text(encoding="utf-8")
    assert "within noise: KS p" in html


def test_baselines_beside_icqs_and_the_sentence_when_one_beats_it(tmp_path):
    rng = random.Random(1)
    scores = [0.5 + 0.1 * rng.gauss(0, 1) for _ in range(80)]  # ICQS: chance
    labels = [1] * 40 + [0] * 40
    values = [{"length_tokens": float(i % 5 + (0 if i < 40 else 10)),
               "length_chars": float(i % 7)} for i in range(80)]  # good: shorter
    check = fit_self_check(scores, labels, n_boot=200, baseline_values=values).to_dict()
    assert check["beaten"].startswith("response length in tokens beats ICQS")
    out = write_output(tmp_path / "o.jsonl", make_records(20, check=check), meta_for(check))
    html = write_report(out, tmp_path / "r.html").path.read_text(encoding="utf-8")
    assert "Baselines on the same held-out items" in html
    assert "A baseline beats ICQS:</b> response length in tokens beats ICQS" in html
    assert ">length_chars<" in html and ">ICQS within length strata<" not in html  # no stratum


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_pairs_page(tmp_path, kind):
    """A `score --pairs` output's page: pairwise accuracy with its interval (the lines'
    own), the preferred a / b / tie counts, the margin histogram, the self-check's pairwise
    numbers (ICQS and the baselines over held-out pairs, the band over pairs)."""
    from icqs_fast.engine.pairs import pairwise_accuracy

    check = pairs_check_dict()
    out = write_pairs_output(tmp_path / f"p.{kind}", 60, check, kind, tie=0.01)
    res = write_report(out, tmp_path / "r.html")
    html = res.path.read_text(encoding="utf-8")
    page = parse(html)
    text = " ".join(page.text)
    assert res.n == 60 and page.csp == CSP and "script" not in page.tags
    assert "icqs-fast pairs report" in text and "Pairwise judgements" in text
    lines = [json.loads(x) for x in out.read_text().splitlines()] if kind == "jsonl" else None
    if lines is not None:
        judged = [r for r in lines if "preferred" in r]
        acc, lo, hi = pairwise_accuracy([r["preferred"] for r in judged],
                                        [r["label"] for r in judged])
        assert f"pairwise accuracy [{lo:.3f}, {hi:.3f}]" in text and f"{acc:.3f}" in text
        for k in ("a", "b", "tie"):
            n = sum(r["preferred"] == k for r in judged)
            assert re.search(rf"{n}\s*preferred {k}", text), (k, n)
    assert "1 bad pairs skipped" in text
    # the margin histogram, the reliability diagram, the pointwise band's coverage curve
    assert page.tags.count("svg") == 3
    assert "tie within +-0.01" in text
    pw = check["pairwise"]
    assert f"Pairwise: {pw['pairs']} held-out pairs of {pw['instructions']} instructions" in text
    assert f"{pw['accuracy']:.3f}" in text and "length_chars" in text
    assert "tie when |margin| is at most" in text or "no margin band reaches" in text
    with pytest.raises(ValueError, match="leave out --baseline"):
        write_report(out, tmp_path / "r2.html", baseline=out)
