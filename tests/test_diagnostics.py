"""Per-record diagnostics in ``score`` / ``features`` output lines: ``truncated``,
``n_dropped_demos``, ``n_prompt_tokens`` and ``join`` (the answer's first token merges with the
context under whole-text tokenization) - present, right on constructed cases, and every output
field named in docs/scoring_files.md."""

import json
import re
from pathlib import Path

import pytest
from _helpers import read_jsonl, write_jsonl

from icqs_fast.cli import main
from icqs_fast.engine.prompt_tokens import joins_response

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DOCS = Path(__file__).resolve().parent.parent / "docs" / "scoring_files.md"
GOOD = [{"x": f"profit rose {i}%", "y": "positive"} for i in range(3)] + [
    {"x": f"loss widened by {i} million", "y": "negative"} for i in range(3)]
BAD = [{"x": f"profit rose {i}%", "y": "negative"} for i in range(3)] + [
    {"x": f"loss widened by {i} million", "y": "positive"} for i in range(3)]
KW = ["--num-ratios", "3", "--demos-per-set", "2", "--sets-per-ratio", "2", "--seed", "1",
      "--quiet"]
# With a response template without the leading space, ": positive" after the query's
# "Answer:" is tokenized "::" + " positive": the first response token holds the query's ":".
TEMPLATE = {"response": "{y}\n"}
RESPONSES = [
    {"id": "plain", "x": "sales up", "y": "positive"},
    {"id": "join", "x": "sales up", "y": ": positive"},
    {"id": "long", "x": "sales up " + "and up again " * 10, "y": "positive"},
]




@pytest.fixture(scope="module")
def tiny_dir(tiny_llama_dir):
    return tiny_llama_dir()


def _offsets_join(tok, before: str, after: str) -> bool:
    enc = tok(before + after, add_special_tokens=False, return_offsets_mapping=True)
    return joins_response(enc["offset_mapping"], len(before))


def test_joins_response():
    # offsets of "Answer::" + " positive": the token "::" spans (6, 8), the join is at 7.
    assert joins_response([(0, 6), (6, 8), (8, 17)], 7)
    assert not joins_response([(0, 6), (6, 7), (7, 16)], 7)
    assert not joins_response([(0, 7)], 7)  # no response token at all


@pytest.fixture(scope="module")
def score_rows(tiny_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("diag")
    inp = write_jsonl(d / "in.jsonl", RESPONSES)
    g, b = write_jsonl(d / "good.jsonl", GOOD), write_jsonl(d / "bad.jsonl", BAD)
    tpl = d / "template.json"
    tpl.write_text(json.dumps(TEMPLATE), encoding="utf-8")
    out = d / "out.jsonl"
    # max-length 60: the long record's prompts fit only after dropping a demonstration.
    assert main(["score", str(inp), "-o", str(out), "--good", str(g), "--bad", str(b),
                 "--model", str(tiny_dir), "--template", str(tpl), "--max-length", "60",
                 "--drop-oldest-demos", *KW]) == 0
    return read_jsonl(out)


@pytest.mark.slow
def test_score_diagnostics(score_rows, tiny_dir):
    from transformers import AutoTokenizer

    rows = {r["id"]: r for r in score_rows}
    assert all({"truncated", "join", "n_prompt_tokens"} <= set(r) for r in score_rows)
    assert [rows[k]["join"] for k in ("plain", "join", "long")] == [False, True, False]
    # The join flag agrees with the tokenizer's own offsets on the query + response text.
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    for r in RESPONSES:
        assert rows[r["id"]]["join"] == _offsets_join(tok, f"Sentence: {r['x']}\nAnswer:",
                                                      f"{r['y']}\n")
    # Truncation: only the long record dropped demonstrations; the field says so, and
    # n_dropped_demos (written only then, as before) is positive somewhere.
    assert rows["long"]["truncated"] is True
    assert sum(sum(row) for row in rows["long"]["n_dropped_demos"]) > 0
    for k in ("plain", "join"):
        assert rows[k]["truncated"] is False and "n_dropped_demos" not in rows[k]
    for r in score_rows:
        assert max(max(p) for p in r["n_prompt_tokens"]) + r["n_response_tokens"] <= 60


def test_features_diagnostics(tiny_dir, tmp_path):
    from transformers import AutoTokenizer

    from icqs_fast.features.extract import GlassboxItem, encode

    items = [{"id": "plain", "x": "Summarise it", "y": "Sales rose."},
             {"id": "join", "x": "Summarise it", "y": "\n Sales rose."}]
    inp = write_jsonl(tmp_path / "in.jsonl", items)
    out = tmp_path / "out.jsonl"
    assert main(["features", str(inp), "-o", str(out), "--model", str(tiny_dir), "--dtype",
                 "float32", "--device", "cpu", "--features", "sent_logprob", "--quiet"]) == 0
    rows = read_jsonl(out)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    for it, r in zip(items, rows, strict=True):
        enc = encode(tok, GlassboxItem(it["x"], it["y"]))
        assert r["n_prompt_tokens"] == enc.prompt_len and r["truncated"] is False
        assert r["n_tokens"] + r["n_prompt_tokens"] == len(enc.ids)
        assert r["join"] == enc.join
    # The chat template's assistant header ends with "\n"; a response that starts with "\n "
    # merges with it (the header's "\n" and the response's "\n" are one token "\n\n").
    assert [r["join"] for r in rows] == [False, True]


def _documented() -> set[str]:
    return set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", DOCS.read_text(encoding="utf-8")))


def test_every_output_field_is_documented(score_rows, tiny_dir, tmp_path):
    score_fields = {k for r in score_rows for k in r}
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "x": "Summarise it", "y": "Sales rose."}])
    out = tmp_path / "f.jsonl"
    assert main(["features", str(inp), "-o", str(out), "--model", str(tiny_dir), "--dtype",
                 "float32", "--device", "cpu", "--quiet"]) == 0
    feature_fields = set(read_jsonl(out)[0])
    missing = sorted((score_fields | feature_fields) - _documented())
    assert not missing, f"output fields not named in docs/scoring_files.md: {missing}"

