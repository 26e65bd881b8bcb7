"""One runner for every executor (docs/ARCHITECTURE.md, "Data flow"): the block folder of a
``--ray`` run is decided, refused, resumed and given its metadata by the same code as a local
results file (io/runs.output_policy on a RunTarget); a block is one writer's output (the local
lines and table); the runner and the Ray executor hold no job-kind branches; a score job builds
its demonstration sets once and tokenizes a record's query and response once. No Ray needed.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from _helpers import write_jsonl

from icqs_fast.io.blocks import BlockOutput, block_name
from icqs_fast.io.results import BlockWriter, JsonlWriter, ParquetResultWriter
from icqs_fast.io.runs import check_runtime, output_policy, start_output

ROOT = Path(__file__).resolve().parents[1]
ROWS = [{"index": 0, "line": 1, "id": "a", "n_tokens": 3, "f": 0.5},
        {"index": 1, "line": 2, "error": {"field": "y", "reason": "missing"}},
        {"index": 2, "line": 3, "id": 7, "n_tokens": 2, "f": float("nan"), "x": "é"}]


def _log(*a):
    pass


def test_block_folder_is_planned_like_a_results_file(tmp_path):
    out = BlockOutput(str(tmp_path / "out"))
    settings = {"model": "m", "n_records": 5}
    policy = output_policy(out, settings, resume=False, overwrite=False)
    assert not policy.append and policy.target is out
    start_output(policy, settings, _log)  # a new run: the folder and its metadata
    assert out.read_meta() == settings
    with out.open_block(0, "jsonl") as w:
        w.write(ROWS[0])
    # A second run without --resume / --overwrite is refused, as for a results file.
    with pytest.raises(ValueError, match="holds block files; pass --resume"):
        output_policy(out, settings, resume=False, overwrite=False)
    with pytest.raises(ValueError, match=r"other settings \(model: 'm' there, 'n' now\)"):
        output_policy(out, {**settings, "model": "n"}, resume=True, overwrite=False)
    # Resuming: the complete blocks, the old settings; an unfinished block file is dropped.
    (tmp_path / "out" / (block_name(1, "jsonl") + ".tmp.123")).write_text("{")
    policy = output_policy(out, settings, resume=True, overwrite=False)
    assert policy.append and policy.old == settings
    assert policy.state.blocks == (block_name(0, "jsonl"),)
    start_output(policy, settings, _log)
    assert out.names() == [block_name(0, "jsonl"), "run.meta.json"]
    # The runtime is written after the first block: a resumed folder without it is checked
    # on what it records; a results file (metadata written after the load) on every key.
    check_runtime(policy, {"dtype": "float32", "device": "cpu", "backend": "torch"})
    policy.old = {**settings, "dtype": "bfloat16"}
    with pytest.raises(ValueError, match="dtype: 'bfloat16' there, 'float32' now"):
        check_runtime(policy, {"dtype": "float32", "device": "cpu", "backend": "torch"})
    # --overwrite removes the old blocks and writes the new metadata.
    policy = output_policy(out, {"model": "n"}, resume=False, overwrite=True)
    start_output(policy, {"model": "n"}, _log)
    assert out.names() == ["run.meta.json"] and out.read_meta() == {"model": "n"}


def test_block_files_without_metadata_are_not_resumed(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / block_name(0, "parquet")).write_bytes(b"")
    with pytest.raises(ValueError, match="has block files but no run.meta.json"):
        output_policy(BlockOutput(str(tmp_path / "out")), {}, resume=True, overwrite=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a folder"):
        output_policy(BlockOutput(str(tmp_path / "file")), {}, resume=True, overwrite=False)


def test_a_block_is_one_writers_output(tmp_path):
    """A JSONL block holds the local writer's bytes; a Parquet block the table a local
    Parquet writer commits (the declared schema), both written only when complete."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with JsonlWriter(tmp_path / "local.jsonl") as w:
        for r in ROWS:
            w.write(r)
    got: list[bytes] = []
    with BlockWriter(got.append, "jsonl") as b:
        for r in ROWS:
            b.write(r)
    assert got == [(tmp_path / "local.jsonl").read_bytes()]

    schema = pa.schema([("index", pa.int64()), ("line", pa.int64()), ("id", pa.string()),
                        ("n_tokens", pa.int64()), ("f", pa.float64()),
                        ("error", pa.struct([("field", pa.string()),
                                             ("reason", pa.string())]))])
    with ParquetResultWriter(tmp_path / "local.parquet", schema=schema) as w:
        for r in ROWS:
            w.write(r)
    got.clear()
    with BlockWriter(got.append, "parquet", schema=schema) as b:
        for r in ROWS:
            b.write(r)
    block = pq.read_table(pa.BufferReader(got[0]))
    local = pq.read_table(tmp_path / "local.parquet")
    assert block.schema.remove_metadata().equals(local.schema.remove_metadata())
    assert block.to_pylist()[:2] == local.to_pylist()[:2]
    # A block that fails is not written at all.
    got.clear()
    with pytest.raises(RuntimeError), BlockWriter(got.append, "jsonl") as b:
        b.write(ROWS[0])
        raise RuntimeError("scoring failed")
    assert got == []


def _source(rel: str) -> ast.Module:
    return ast.parse((ROOT / rel).read_text(encoding="utf-8"))


@pytest.mark.parametrize("rel", ["icqs_fast/jobs/runner.py", "icqs_fast/jobs/ray_executor.py"])
def test_no_job_kind_branches(rel):
    """The runner and the Ray executor name no job kind: no job config class (isinstance),
    no comparison of a ``.kind`` - a kind is its strategy (found once, in STRATEGIES)."""
    kinds = {"ScoreJobConfig", "FeatureJobConfig", "ScoreStrategy", "FeatureStrategy"}
    for node in ast.walk(_source(rel)):
        if isinstance(node, ast.Name):
            assert node.id not in kinds, f"{rel}:{node.lineno} names {node.id}"
        if isinstance(node, ast.Compare):
            kind = [c for c in [node.left, *node.comparators]
                    if isinstance(c, ast.Attribute) and c.attr == "kind"]
            assert not kind, f"{rel}:{node.lineno} compares a job kind"


def test_ray_executor_has_no_resume_or_metadata_logic_of_its_own():
    """The Ray executor policies, refuses and resumes through io/runs (output_policy, start_output,
    check_runtime): it neither reads metadata nor compares settings itself."""
    names = {n.attr if isinstance(n, ast.Attribute) else n.id
             for n in ast.walk(_source("icqs_fast/jobs/ray_executor.py"))
             if isinstance(n, (ast.Attribute, ast.Name))}
    assert not names & {"resume_refusal", "read_meta", "read_text", "resume_state", "META_FILE",
                        "META_NAME"}
    assert {"start_output", "check_runtime", "run_with"} <= names


@pytest.fixture
def demo_files(tmp_path):
    good = [{"x": f"profit rose {i}%", "y": "positive"} for i in range(3)] + [
        {"x": f"loss widened by {i} million", "y": "negative"} for i in range(3)]
    bad = [dict(r, y="negative" if r["y"] == "positive" else "positive") for r in good]
    return write_jsonl(tmp_path / "g.jsonl", good), write_jsonl(tmp_path / "b.jsonl", bad)


@pytest.mark.slow  # loads a tiny model (~2 s here)
def test_score_job_builds_its_sets_once_and_tokenizes_a_record_once(
        demo_files, tiny_llama_dir, monkeypatch):
    import icqs_fast.engine.prompts as prompts
    import icqs_fast.engine.scorer as scorer_mod
    from icqs_fast.engine.settings import ScoringSettings
    from icqs_fast.io.records import Record
    from icqs_fast.jobs.config import ScoreJobConfig, SelfCheckOptions
    from icqs_fast.jobs.runner import strategy_for

    built = []
    real = prompts.build_demo_sets

    def counting(*a, **kw):
        built.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(prompts, "build_demo_sets", counting)
    monkeypatch.setattr(scorer_mod, "build_demo_sets", counting)
    g, b = demo_files
    cfg = ScoreJobConfig(input="-", output="o.jsonl", good=str(g), bad=str(b),
                         model=str(tiny_llama_dir()), dtype="float32", device="cpu",
                         scoring=ScoringSettings(num_ratios=3, demos_per_set=2,
                                                 sets_per_ratio=2, backend="torch"),
                         self_check=SelfCheckOptions(max_heldout=0))
    strategy = strategy_for(cfg)
    strategy.prepare(_log)
    strategy.load(None, {}, _log)
    assert built == [1]  # prepare's sets are the scorer's
    tokens = strategy.scorer.tokens
    seen: list[str] = []
    encode = tokens.encode
    monkeypatch.setattr(tokens, "encode", lambda text: seen.append(text) or encode(text))
    rec = Record(index=0, line=1, x="sales up 3%", y="positive")
    (got,) = strategy.results([rec], write_from=0, on_error=None)
    assert got[0] is rec and json.dumps(strategy.line(*got))
    q, r = tokens.template.format_query(rec.x), tokens.template.format_response(rec.y)
    assert seen.count(q) == 1 and seen.count(r) == 1  # the job's check and the engine
