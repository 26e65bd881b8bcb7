"""Input readers (JSONL/CSV/TSV, field mapping, laziness, errors naming file+line+field), the
flushing JSONL writer, the resume scan and the Financial PhraseBank reader."""

import gzip
import itertools
import json

import pytest
from _faults import install_crash
from _helpers import skip_unless_in_ci

from icqs_fast.io.datasets import fpb_examples, read_fpb, shared_data_dir
from icqs_fast.io.readers import (
    RecordFields,
    count_records,
    read_examples,
    read_json_objects,
    read_records,
)
from icqs_fast.io.records import InputError, RecordError, detect_format, field_of
from icqs_fast.io.results import (
    JsonlWriter,
    ParquetResultWriter,
    read_output_state,
    read_resume_state,
)
from icqs_fast.io.runs import (
    OutputLock,
    OutputLockedError,
    check_run_paths,
    open_results,
    output_policy,
    start_output,
)


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def _jsonl(path, rows):
    return _write(path, "".join(json.dumps(r) + "\n" for r in rows))


# --------------------------------------------------------------------------- formats


def test_jsonl_records_ids_labels_and_blank_lines(tmp_path):
    p = _write(tmp_path / "a.jsonl",
               '{"x": "a", "y": "b", "id": 7, "gold": 1}\n\n   \n'
               '{"x": "", "y": "d", "gold": "neg"}\n')
    recs = list(read_records(p, RecordFields(label_field="gold")))
    assert [(r.index, r.line, r.x, r.y, r.id, r.label) for r in recs] == [
        (0, 1, "a", "b", 7, 1), (1, 4, "", "d", None, "neg")]


def test_csv_quoting_multiline_and_mapping(tmp_path):
    p = _write(tmp_path / "a.csv",
               'uid,question,answer\n'
               '1,"hello, ""world""",pos\n'
               '2,"two\nlines",neg\n'
               '\n'
               '3,plain,"quoted, answer"\n')
    recs = list(read_records(p, RecordFields("question", "answer", "uid")))
    assert [(r.index, r.line, r.x, r.y, r.id) for r in recs] == [
        (0, 2, 'hello, "world"', "pos", "1"),
        (1, 3, "two\nlines", "neg", "2"),
        (2, 6, "plain", "quoted, answer", "3"),
    ]


def test_tsv_is_plain_and_explicit_format(tmp_path):
    # A GLUE-style TSV: quotes are text, not quoting.
    p = _write(tmp_path / "dev.txt", 'sentence\tlabel\n"it \'s great\t1\nbad film\t0\n')
    with pytest.raises(ValueError, match="cannot tell the format"):
        read_records(p)
    recs = list(read_records(p, RecordFields("sentence", "label", label_field="label"),
                             format="tsv"))
    assert [(r.x, r.y, r.label, r.line) for r in recs] == [
        ('"it \'s great', "1", "1", 2), ("bad film", "0", "0", 3)]


def test_gzip_and_dotted_fields(tmp_path):
    p = tmp_path / "a.jsonl.gz"
    with gzip.open(p, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"q": {"turns": ["first", "second"]}, "a": {"text": "ans"}}) + "\n")
    assert detect_format(p) == "jsonl"
    (r,) = read_records(p, RecordFields("q.turns.1", "a.text"))
    assert (r.x, r.y) == ("second", "ans")


def test_detect_format():
    assert detect_format("a.JSONL") == "jsonl"
    assert detect_format("a.ndjson") == "jsonl"
    assert detect_format("a.csv.gz") == "csv"
    assert detect_format("x", "TSV") == "tsv"
    with pytest.raises(ValueError, match="unknown input format"):
        detect_format("a.csv", "xml")


def test_read_examples(tmp_path):
    p = _jsonl(tmp_path / "g.jsonl", [{"x": "a", "y": "b"}, {"x": "c", "y": "d"}])
    assert read_examples(p) == [("a", "b"), ("c", "d")]
    empty = _write(tmp_path / "e.jsonl", "\n")
    with pytest.raises(InputError, match=r"e\.jsonl: no examples"):
        read_examples(empty)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_examples(tmp_path / "nope.jsonl")
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(InputError, match=r"dir\.jsonl: is a folder"):
        read_examples(tmp_path / "dir.jsonl")


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("line, field, pattern", [
    ('{"x": "a"}', "y", r"field 'y': missing \(this record's keys: x\)"),
    ('{"x": 3, "y": "b"}', "x", r"field 'x': must be a string, got int 3"),
    ('{"x": "a", "y": null}', "y", r"field 'y': must be a string, got NoneType"),
    ('{"x": "a", "y": "  "}', "y", r"field 'y': whitespace-only response"),
    ('{"x": "a", "y": ""}', "y", r"field 'y': empty response"),
    ('{"x": "a", "y": "b", "id": [1]}', "id", r"field 'id': must be a string or a number"),
    ('{"x": "a", "y" "b"}', None, r"invalid JSON \(Expecting ':' delimiter at column 16\)"),
    ('["a", "b"]', None, r"expected a JSON object, got list"),
])
def test_jsonl_errors_name_file_line_field(tmp_path, line, field, pattern):
    p = _write(tmp_path / "in.jsonl", '{"x": "ok", "y": "ok"}\n\n' + line + "\n")
    it = read_records(p)
    assert next(it).x == "ok"
    with pytest.raises(InputError, match=rf"in\.jsonl:3: {pattern}") as ei:
        next(it)
    err = ei.value
    assert isinstance(err, RecordError) and isinstance(err, ValueError)
    assert (err.path, err.line, err.field, err.index) == (str(p), 3, field, 1)


def test_csv_errors(tmp_path):
    p = _write(tmp_path / "in.csv", "x,y\na,b\nc\nd,e,f\ng,\n")
    errs = []
    recs = list(read_records(p, on_error=errs.append))
    assert [r.x for r in recs] == ["a"]
    msgs = [str(e) for e in errs]
    assert msgs[0].endswith("in.csv:3: field 'y': missing (this record's columns: x)")
    assert msgs[1].endswith("in.csv:4: 3 columns but the header has 2")
    assert msgs[2].endswith("in.csv:5: field 'y': empty response (nothing to score)")
    with pytest.raises(InputError, match=r"in\.csv:1: field 'answer': no such column in the "
                                         r"header \(columns: x, y\)"):
        list(read_records(p, RecordFields(y_field="answer")))


def test_label_field_required(tmp_path):
    p = _jsonl(tmp_path / "in.jsonl", [{"x": "a", "y": "b"}])
    with pytest.raises(InputError, match=r"in\.jsonl:1: field 'gold': missing"):
        list(read_records(p, RecordFields(label_field="gold")))


def test_on_error_goes_on_and_indices_count_bad_rows(tmp_path):
    p = _write(tmp_path / "in.jsonl",
               '{"x": "a", "y": "b"}\nnot json\n{"x": "c"}\n{"x": "d", "y": "e"}\n')
    errs = []
    recs = list(read_records(p, on_error=errs.append))
    assert [(r.index, r.line, r.x) for r in recs] == [(0, 1, "a"), (3, 4, "d")]
    assert [(e.line, e.field) for e in errs] == [(2, None), (3, "y")]


def test_skip_does_not_parse_skipped_rows(tmp_path):
    p = _write(tmp_path / "in.jsonl", 'not json\n{"x": 1}\n{"x": "c", "y": "d"}\n')
    (r,) = read_records(p, skip=2)
    assert (r.index, r.line, r.x) == (2, 3, "c")
    c = _write(tmp_path / "in.csv", 'x,y\n"multi\nline",1\nbad\nc,d\n')
    (r,) = read_records(c, skip=2)
    assert (r.index, r.line, r.x) == (2, 5, "c")


def test_reading_is_lazy(tmp_path):
    """Records come one at a time: the reader never looks past what was asked for (a broken
    tail is not seen) and opens nothing until the first record is requested."""
    p = tmp_path / "big.jsonl"
    with open(p, "w", encoding="utf-8") as f:
        for i in range(200_000):
            f.write(f'{{"x": "q{i}", "y": "a{i}"}}\n')
        f.write("{ broken\n")
    it = read_records(p, RecordFields(id_field=None))
    p.rename(tmp_path / "moved.jsonl")  # not opened yet, so the generator fails on first use
    with pytest.raises(FileNotFoundError):
        next(it)
    it = read_records(tmp_path / "moved.jsonl")
    first = list(itertools.islice(it, 3))
    assert [r.x for r in first] == ["q0", "q1", "q2"]
    it.close()
    # And the whole file streams with a small footprint (a broken last line is still found).
    n = 0
    with pytest.raises(InputError, match=r"moved\.jsonl:200001: invalid JSON"):
        for _ in read_records(tmp_path / "moved.jsonl"):
            n += 1
    assert n == 200_000


@pytest.mark.slow
def test_reader_memory_is_flat(tmp_path):
    import tracemalloc

    p = tmp_path / "big.csv"
    with open(p, "w", encoding="utf-8") as f:
        f.write("x,y\n")
        for i in range(20_000):
            f.write(f"question number {i},answer number {i}\n")
    tracemalloc.start()
    n = sum(1 for _ in read_records(p))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert n == 20_000
    # Holding every record would take several MB (the file alone is ~0.8 MB).
    assert peak < 500_000, peak


# --------------------------------------------------------------------------- results


def test_writer_flushes_each_record(tmp_path):
    p = tmp_path / "sub" / "out.jsonl"
    with JsonlWriter(p) as w:
        w.write({"index": 0, "score": 0.5})
        # Visible to another reader before close.
        assert p.read_text(encoding="utf-8") == '{"index": 0, "score": 0.5}\n'
        w.write({"index": 1, "s": "é"})
    with JsonlWriter(p, append=True) as w:
        w.write({"index": 2})
    assert [json.loads(x)["index"] for x in p.read_text(encoding="utf-8").splitlines()] == [
        0, 1, 2]


def test_resume_state(tmp_path):
    p = _write(tmp_path / "out.jsonl", '{"index": 0}\n{"index": 2, "id": "b"}\n{"index": 3, "sc')
    st = read_resume_state(p)
    assert st.count == 2 and st.last == {"index": 2, "id": "b"}
    assert st.end == len('{"index": 0}\n{"index": 2, "id": "b"}\n')
    assert read_resume_state(_write(tmp_path / "e.jsonl", "")).last is None
    bad = _write(tmp_path / "bad.jsonl", '{"index": 0}\ngarbage\n{"index": 1}\n')
    with pytest.raises(InputError, match=r"bad\.jsonl:2: not a complete result record"):
        read_resume_state(bad)


# --------------------------------------------------------------------------- real data


def test_fpb_reader_on_small_file(tmp_path):
    p = tmp_path / "fpb.txt"
    p.write_bytes("Caf\xe9 sales rose .@positive\nA @ sign inside @ text .@negative\n\n"
                  "Flat .@neutral\n".encode("latin-1"))
    recs = list(read_fpb(p))
    assert [(r.x, r.y, r.line) for r in recs] == [
        ("Café sales rose .", "positive", 1), ("A @ sign inside @ text .", "negative", 2),
        ("Flat .", "neutral", 4)]
    bad = _write(tmp_path / "bad.txt", "fine .@positive\nno label here\n")
    with pytest.raises(InputError, match=r"bad\.txt:2: field 'label': no '@label'"):
        list(read_fpb(bad))
    with pytest.raises(FileNotFoundError):
        read_fpb(tmp_path / "missing.txt")


FPB = shared_data_dir() / "fpb" / "Sentences_AllAgree.txt"


def test_fpb_real_data():
    if not FPB.is_file():
        skip_unless_in_ci(f"real data not available at {FPB} (../shared/data is not part of "
                          "the repository)")
    recs = list(read_fpb())
    assert len(recs) == 2264
    counts = {lab: sum(r.y == lab for r in recs) for lab in ("positive", "negative", "neutral")}
    assert counts == {"positive": 570, "negative": 303, "neutral": 1391}
    good, bad, rest = fpb_examples(n_good=16, n_bad=16, seed=3)
    assert len(good) == len(bad) == 16 and len(rest) == 2264 - 32
    truth = {r.x: r.y for r in recs}
    assert all(truth[x] == y for x, y in good)  # right labels
    assert all(truth[x] != y and y != "neutral" for x, y in bad)  # flipped labels
    assert {y for _, y in good} == {"positive", "negative"}
    assert not {x for x, _ in good} & {x for x, _ in bad}
    assert fpb_examples(n_good=16, n_bad=16, seed=3)[0] == good  # seeded


def test_output_lock_refuses_a_second_holder(tmp_path):
    import os

    out = tmp_path / "out.jsonl"
    with OutputLock(out) as held:
        assert (tmp_path / "out.jsonl.lock").read_text() == f"{os.getpid()}\n"
        # flock conflicts between two open descriptions, even within one process.
        with pytest.raises(OutputLockedError, match=rf"{out} is being written by another "
                                                    rf"icqs-fast process \(pid {os.getpid()};"):
            OutputLock(out).acquire()
        assert held.path == f"{out}.lock"
    with OutputLock(out):  # released on exit
        pass


def test_json_objects_and_field_of(tmp_path):
    p = _write(tmp_path / "q.jsonl", '{"a": {"b": [1, "x"]}, "n": true}\n\n{"a": 2}\n')
    got = list(read_json_objects(p))
    assert [line for line, _ in got] == [1, 3]
    obj = got[0][1]
    assert field_of(obj, "a.b.1", str, path=p, line=1, index=0) == "x"
    with pytest.raises(RecordError, match=r"q\.jsonl:1: field 'n': must be int, got bool true"):
        field_of(obj, "n", int, path=p, line=1, index=0)
    with pytest.raises(RecordError, match=r"q\.jsonl:1: field 'a.c': missing \(this record's "
                                          r"keys: a, n\)") as ei:
        field_of(obj, "a.c", int, path=p, line=1, index=0)
    assert (ei.value.line, ei.value.field, ei.value.index) == (1, "a.c", 0)
    with pytest.raises(RecordError, match=r"r\.jsonl:2: expected a JSON object, got list"):
        list(read_json_objects(_write(tmp_path / "r.jsonl", '{"a": 1}\n[1]\n')))
    with pytest.raises(InputError, match=r"e\.jsonl: no records"):
        list(read_json_objects(_write(tmp_path / "e.jsonl", "\n")))


# --------------------------------------------------------------------------- Parquet / datasets

ROWS = [{"id": i, "x": f"question {i}", "y": f"answer {i}", "gold": ["a", "b"][i % 2],
         "meta": {"turns": [f"t{i}", f"u{i}"]}} for i in range(7)]


def _parquet(path, rows, row_group_size=3):
    """rows: a list of dicts, or a dict of columns (for a table without rows)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = pa.table(rows) if isinstance(rows, dict) else pa.Table.from_pylist(rows)
    pq.write_table(t, path, row_group_size=row_group_size)
    return path


def test_parquet_input_matches_jsonl(tmp_path):
    pq_path = _parquet(tmp_path / "d.parquet", ROWS)
    js_path = _jsonl(tmp_path / "d.jsonl", ROWS)
    assert detect_format(pq_path) == "parquet" and detect_format("a.PQ") == "parquet"
    kw = dict(fields=RecordFields(label_field="gold"))
    # Same records as the JSONL file (JSONL line numbers = Parquet row numbers here).
    assert list(read_records(pq_path, **kw)) == list(read_records(js_path, **kw))
    assert [r.x for r in read_records(pq_path, RecordFields("meta.turns.1"))] == \
        [f"u{i}" for i in range(7)]
    # skip crosses row-group boundaries (groups of 3: rows 0-2, 3-5, 6), stop ends early.
    assert [r.index for r in read_records(pq_path, skip=4)] == [4, 5, 6]
    assert [r.index for r in read_records(pq_path, skip=2, stop=5)] == [2, 3, 4]
    assert [r.line for r in read_records(pq_path, skip=6)] == [7]
    assert count_records(pq_path) == 7


def test_parquet_bad_rows_name_row_and_field(tmp_path):
    import pyarrow as pa

    rows = [dict(r) for r in ROWS[:4]]
    rows[1]["y"] = None
    rows[2]["y"] = "   "
    p = _parquet(tmp_path / "bad.parquet", rows)
    got = list(read_records(p, on_error="yield"))
    assert [type(g).__name__ for g in got] == ["Record", "RecordError", "RecordError", "Record"]
    assert str(got[1]) == f"{p}: row 2: field 'y': missing (null)"
    assert got[1].index == 1 and got[1].line == 2 and got[1].field == "y"
    assert str(got[2]) == f"{p}: row 3: field 'y': whitespace-only response (nothing to score)"
    with pytest.raises(RecordError, match=r"bad\.parquet: row 2: field 'y'"):
        list(read_records(p))
    wrong = _parquet(tmp_path / "wrong.parquet", [{"x": "q", "y": 5}])
    with pytest.raises(RecordError, match=r"row 1: field 'y': must be a string, got int 5"):
        list(read_records(wrong))
    with pytest.raises(InputError, match=r"field 'answer': no such column \(columns: id, x, "):
        list(read_records(p, RecordFields(y_field="answer")))
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(InputError, match=r"junk\.parquet: not a readable Parquet file"):
        list(read_records(tmp_path / "junk.parquet"))
    empty = _parquet(tmp_path / "empty.parquet", {"x": pa.array([], pa.string()),
                                                  "y": pa.array([], pa.string())})
    with pytest.raises(InputError, match=r"no records \(no rows\)"):
        list(read_records(empty, allow_empty=False))


def test_datasets_folder_input(tmp_path):
    datasets = pytest.importorskip("datasets")
    cols = {k: [r[k] for r in ROWS] for k in ("id", "x", "y", "gold")}
    ds = datasets.Dataset.from_dict(cols)
    ds.save_to_disk(str(tmp_path / "ds"), num_shards=3)  # several Arrow files
    assert len(list((tmp_path / "ds").glob("*.arrow"))) > 1
    assert detect_format(tmp_path / "ds") == "datasets"
    js = _jsonl(tmp_path / "d.jsonl", [{k: r[k] for k in cols} for r in ROWS])
    assert list(read_records(tmp_path / "ds", RecordFields(label_field="gold"))) == \
        list(read_records(js, RecordFields(label_field="gold")))
    assert [r.index for r in read_records(tmp_path / "ds", skip=3, stop=6)] == [3, 4, 5]
    assert count_records(tmp_path / "ds") == 7
    # A selection is saved flattened: rows in the selected order.
    ds.select([5, 1]).save_to_disk(str(tmp_path / "sel"))
    assert [r.id for r in read_records(tmp_path / "sel")] == [5, 1]
    datasets.DatasetDict(train=ds, test=ds).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(InputError, match=r"DatasetDict folder \(splits: train, test\)"):
        read_records(tmp_path / "dd")
    (tmp_path / "plain").mkdir()
    with pytest.raises(InputError, match=r"plain: is a folder, not an input file"):
        read_records(tmp_path / "plain")
    # The commands' early check takes a dataset folder, not another folder.
    check_run_paths(str(tmp_path / "ds"), False, False)
    with pytest.raises(InputError, match="is a folder"):
        check_run_paths(str(tmp_path / "plain"), False, False)
    with pytest.raises(InputError, match="is a folder"):
        check_run_paths(str(tmp_path / "ds"), False, False, "jsonl")


def test_parquet_reading_memory_is_flat(tmp_path):
    """16k rows of ~2.4 KB (~38 MB of text) in ONE row group: the reader holds one batch, not the
    file - Python allocations (tracemalloc) and Arrow's (its memory pool) stay a few MB."""
    import tracemalloc

    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 16_000
    filler = "lorem ipsum dolor sit amet " * 44
    t = pa.table({"x": pa.array([f"q{i} {filler}" for i in range(n)]),
                  "y": pa.array([f"a{i} {filler}" for i in range(n)]),
                  "id": pa.array(range(n))})
    text_bytes = t.column("x").nbytes + t.column("y").nbytes
    pq.write_table(t, tmp_path / "big.parquet", row_group_size=n, compression="zstd")
    del t
    pool = pa.default_memory_pool()
    base = pa.total_allocated_bytes()
    arrow_peak = 0
    tracemalloc.start()
    count = 0
    last = None
    for rec in read_records(tmp_path / "big.parquet"):
        count, last = count + 1, rec
        if count % 500 == 0:
            arrow_peak = max(arrow_peak, pa.total_allocated_bytes() - base)
    _, py_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    pool.release_unused()
    assert count == n and last.id == n - 1
    assert text_bytes > 35e6
    assert py_peak < 10e6, py_peak  # a batch of 1024 rows of ~2.4 KB as Python objects
    assert arrow_peak < 12e6, arrow_peak


def test_count_records_text_formats(tmp_path):
    p = _write(tmp_path / "c.jsonl", '{"x": "a", "y": "b"}\n\nnot json\n{"x": "c", "y": "d"}\n')
    assert count_records(p) == 3  # bad lines count, blank lines do not
    c = _write(tmp_path / "c.csv", 'x,y\n"multi\nline",b\nc,d\n')
    assert count_records(c) == 2 == len(list(read_records(c)))
    with pytest.raises(ValueError, match="standard input"):
        count_records("-")


def test_shard_ranges_partition_in_order():
    from icqs_fast.io.records import parse_shard, shard_range

    for total in (0, 1, 5, 10, 11, 128):
        for n in (1, 2, 3, 7):
            for align in (1, 4):
                ranges = [shard_range(total, i, n, align) for i in range(n)]
                covered = [j for lo, hi in ranges for j in range(lo, hi)]
                assert covered == list(range(total)), (total, n, align, ranges)
                assert all(lo % align == 0 for lo, hi in ranges if hi > lo)
    assert shard_range(10, 0, 3) == (0, 3) and shard_range(10, 2, 3) == (6, 10)
    assert shard_range(10, 1, 2, align=4) == (4, 10)  # blocks [0,4) [4,8) [8,10): 1 + 2
    assert parse_shard("1/4") == (1, 4)
    for bad in ("4/4", "-1/2", "1", "a/b", "0/0"):
        with pytest.raises(ValueError, match="--shard"):
            parse_shard(bad)


# --------------------------------------------------------------------------- Parquet results


def _results(n, start=0):
    out = []
    for i in range(start, start + n):
        if i % 5 == 3:  # a skipped bad record's line
            out.append({"index": i, "line": i + 1, "error": {"field": None, "reason": "bad"}})
        else:
            out.append({"index": i, "line": i + 1, "id": f"r{i}", "score": i / 7,
                        "loglik": [[-1.5 * i, float("nan")], [0.25, -float(i)]]}
                       | ({"n_dropped_demos": [[1, 0]]} if i == 6 else {}))
    return out


def _as_json(rows):
    """Rows read back from Parquet, null fields dropped (absent keys in JSONL), as JSON text."""
    return [json.dumps({k: v for k, v in r.items() if v is not None}) for r in rows]


def test_parquet_results_round_trip(tmp_path):
    import pyarrow.parquet as pq

    out = tmp_path / "o.parquet"
    recs = _results(23)
    with ParquetResultWriter(out, part_rows=4, row_group_rows=10) as w:
        for r in recs:
            w.write(r)
        assert len(list((tmp_path / "o.parquet.parts").iterdir())) == 5  # 5 parts of 4 so far
    assert not (tmp_path / "o.parquet.parts").exists()
    t = pq.read_table(out)
    assert _as_json(t.to_pylist()) == [json.dumps(r) for r in recs]
    assert pq.ParquetFile(out).metadata.num_row_groups == 3  # 10 + 10 + 3 rows
    assert str(t.schema.field("error").type) == "struct<field: string, reason: string>"
    st = read_output_state(out)
    assert st.count == 23 and json.dumps(st.last) == json.dumps(recs[-1])
    # A column that changes type cannot be one Parquet file: a clear error, nothing corrupted.
    w = ParquetResultWriter(tmp_path / "t.parquet", part_rows=1)
    w.write({"index": 0, "line": 1, "id": 1})
    with pytest.raises(ValueError, match="change type"):
        w.write({"index": 1, "line": 2, "id": "one"})
    with pytest.raises(ValueError, match="increasing integer indices"):
        w.write({"index": 0, "line": 2})


def _killed_writer(out, recs, crash, part_rows):
    import os

    install_crash(crash)  # this forked child only: it SIGKILLs itself at the chosen record
    w = ParquetResultWriter(out, part_rows=part_rows, append=True)
    for r in recs:
        w.write(r)
    w.close()
    os._exit(0)  # not reached when the crash patch kills the process


@pytest.mark.parametrize("crash", ["before:9", "mid:9"])
def test_parquet_results_survive_sigkill_and_resume(tmp_path, crash):
    """A writer process SIGKILLed at record 9 (parts of 4 records): the committed parts (records
    0-7) survive, an unfinished part is dropped, and a resume from the state's last index ends
    with exactly the records of an uninterrupted run."""
    import multiprocessing
    import signal

    import pyarrow.parquet as pq

    out = tmp_path / "o.parquet"
    recs = _results(14)
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=_killed_writer, args=(out, recs, crash, 4))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    assert not out.exists()
    tmps = [p.name for p in (tmp_path / "o.parquet.parts").iterdir() if p.name.endswith(".tmp")]
    assert tmps == ([".part-000000000008.parquet.tmp"] if crash.startswith("mid") else [])
    st = read_output_state(out)
    assert st.count == 8 and st.last["index"] == 7
    policy = output_policy(out, {}, resume=True, overwrite=False)
    assert policy.append and policy.start == 8
    start_output(policy, {}, lambda *a: None)  # drops the unfinished part
    with open_results(policy) as w:
        for r in recs[policy.start:]:
            w.write(r)
    assert _as_json(pq.read_table(out).to_pylist()) == [json.dumps(r) for r in recs]
    # A crash after the merged file was renamed but before the parts were removed: the stale
    # part is recognised by its index, not counted twice, and removed on resume.
    parts = tmp_path / "o.parquet.parts"
    parts.mkdir()
    with ParquetResultWriter(tmp_path / "other.parquet") as w:
        for r in recs[10:12]:
            w.write(r)
    (tmp_path / "other.parquet").rename(parts / "part-000000000010.parquet")
    st = read_output_state(out)
    assert st.count == 14 and st.last["index"] == 13
    policy = output_policy(out, {}, resume=True, overwrite=False)
    start_output(policy, {}, lambda *a: None)
    assert not list(parts.iterdir())
    with pytest.raises(ValueError, match="exists; pass --resume"):
        output_policy(out, {}, resume=False, overwrite=False)
