"""The one declared result schema (icqs_fast/io/schema.py): every writer carries every declared
field, in one layout, and adding a field is one edit there."""

from pathlib import Path

import numpy as np
import pytest
import torch

from icqs_fast.engine.scorer import summarise
from icqs_fast.io import schema
from icqs_fast.io.records import Record
from icqs_fast.io.schema import (
    FEATURE_FIELDS,
    ICQS_FIELDS,
    ResultField,
    arrow_schema,
    column_arrays,
    features_row,
    fill_columns,
    icqs_row,
    markdown_table,
    rows_table,
)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "scoring_files.md"
M1, L = 3, 2


def _result(*, calibrated: bool, dropped: bool):
    g = torch.Generator().manual_seed(0)
    loglik = -torch.rand(M1, L, generator=g, dtype=torch.float64) * 10
    drop = torch.zeros(M1, L, dtype=torch.int64)
    if dropped:
        drop[1, 0] = 2
    base = -torch.rand(M1, L, generator=g, dtype=torch.float64) if calibrated else None
    return summarise(7, loglik, [0.0, 0.5, 1.0], 4, torch.full((M1, L), 30), drop, None,
                     base, calibration="content_free" if calibrated else "none",
                     score_kind="mean", tie_epsilon=0.15)


REC = Record(index=7, line=8, x="q", y="a", id=12, label="good")


def test_json_row_holds_every_declared_field_in_order():
    res = _result(calibrated=True, dropped=True)
    res.p_good_calibrated = 0.7  # what a scorer with a fitted self-check sets
    res.verdict = "good"
    row = icqs_row(REC, res, with_label=True)
    assert list(row) == [f.name for f in ICQS_FIELDS]
    assert row["id"] == 12 and row["label"] == "good"  # JSON keeps the input's types
    assert np.shape(row["loglik"]) == (M1, L) and np.shape(row["ratios"]) == (M1,)
    assert np.shape(row["score_per_set"]) == (L,) and row["truncated"] is True
    # Fields present only sometimes are left out otherwise.
    plain = icqs_row(Record(0, 1, "q", "a"), _result(calibrated=False, dropped=False))
    absent = {f.name for f in ICQS_FIELDS} - set(plain)
    assert absent == {"id", "label", "loglik_baseline", "n_dropped_demos", "p_good_calibrated",
                      "verdict"}
    assert all(f.when for f in ICQS_FIELDS if f.name in absent)


def test_table_is_the_declared_schema_whatever_the_ids():
    rows = [icqs_row(REC, _result(calibrated=True, dropped=True), with_label=True),
            icqs_row(Record(8, 9, "q", "a", id="r8"), _result(calibrated=False, dropped=False)),
            {"index": 9, "line": 10, "error": {"field": "y", "reason": "missing"}}]
    t = rows_table(rows, arrow_schema("icqs"))
    assert t.schema.equals(arrow_schema("icqs"))
    assert t.column_names == [f.name for f in ICQS_FIELDS] + ["error"]
    got = t.to_pylist()
    assert [r["id"] for r in got] == ["12", "r8", None]  # text, any input type
    assert got[0]["loglik"] == rows[0]["loglik"]  # nested [M+1][L], as in the JSON line
    assert got[1]["loglik_baseline"] is None and got[2]["score"] is None
    for f in ICQS_FIELDS:  # nesting depth = declared rank
        typ, depth = t.schema.field(f.name).type, 0
        while hasattr(typ, "value_type"):
            typ, depth = typ.value_type, depth + 1
        assert depth == len(f.shape), f.name


def test_batch_columns_carry_every_result_field():
    res = _result(calibrated=True, dropped=True)
    cols = column_arrays(2, {"M+1": M1, "L": L})
    assert set(cols) == {f.name for f in ICQS_FIELDS if f.source == "result"}
    fill_columns(cols, 1, icqs_row(REC, res))
    assert cols["loglik"].shape == (2, M1, L)
    np.testing.assert_allclose(cols["loglik"][1], res.loglik.double().numpy())
    assert cols["score"][1] == res.score and np.isnan(cols["score"][0])
    assert cols["n_dropped_demos"][1, 1, 0] == 2 and cols["truncated"][1]


def test_features_declaration_everywhere():
    names = ["sent_logprob", "softmax_ent"]
    row = features_row(Record(0, 1, "q", "a", id="x"),
                       {"n_tokens": 3, "softmax_ent": 0.5, "sent_logprob": -1.0,
                        "n_prompt_tokens": 9, "truncated": False, "join": False}, names)
    assert list(row) == ["index", "line", "id", "n_tokens", *names, "n_prompt_tokens",
                         "truncated", "join"]
    sch = arrow_schema("features", names)
    assert sch.names == [*list(row), "error"]
    assert rows_table([row], sch).schema.equals(sch)
    assert set(column_arrays(1, {}, "features", names)) == {
        "n_tokens", *names, "n_prompt_tokens", "truncated", "join"}
    assert any(f.source == "features" for f in FEATURE_FIELDS)


@pytest.mark.parametrize("kind", ["icqs", "features", "pairs"])
def test_docs_field_table_is_the_declaration(kind):
    assert markdown_table(kind) in DOCS.read_text(encoding="utf-8"), (
        f"docs/scoring_files.md lacks the current {kind} field table: paste "
        f"icqs_fast.io.schema.markdown_table({kind!r})")


def test_adding_a_field_is_one_edit(monkeypatch):
    """A new result field declared once reaches the JSON line, the table schema, the batch
    columns, the server's response model and the docs table."""
    extra = ResultField("extra_field", "float", ("L",), "a new per-set number")
    monkeypatch.setattr(schema, "ICQS_FIELDS", (*ICQS_FIELDS, extra))
    res = _result(calibrated=False, dropped=False)
    res.extra_field = [0.25, 0.75]
    row = schema.icqs_row(REC, res)
    assert row["extra_field"] == [0.25, 0.75]
    assert schema.arrow_schema("icqs").field("extra_field").type.value_type.bit_width == 64
    assert schema.column_arrays(1, {"M+1": M1, "L": L})["extra_field"].shape == (1, L)
    assert "| `extra_field` | [L] float |" in schema.markdown_table("icqs")
    serve_schemas = pytest.importorskip("icqs_fast.serve.schemas")
    model = serve_schemas.icqs_score_model()
    assert "extra_field" in model.model_fields
    assert model(**{k: v for k, v in row.items() if k in model.model_fields}).extra_field == \
        [0.25, 0.75]
