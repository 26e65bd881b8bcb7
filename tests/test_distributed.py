"""``--ray`` runs (icqs_fast.jobs.ray_actors) on a local Ray cluster started here (2 CPUs, on
127.0.0.1 only: see tests/conftest.py), with a tiny random Llama: the same output as the
single-process CLI, a worker SIGKILLed mid-run, a driver SIGKILLed and rerun, bad records (skip
and stop), a refused resume; ``score --pairs`` the same (output and summary, a killed driver
resumed). Multi-node clusters: tests/test_ray_cluster.py."""

import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

import numpy as np
import pytest
from _faults import ENTRY, hold_runtime_env, worker_path_env
from _helpers import (
    assert_same_lines,
    read_jsonl,
    restore_environ,
    save_tiny_llama,
    wait_for_file,
    write_jsonl,
)
from _ray_cli import build_config, build_parser

ray = pytest.importorskip("ray")

from icqs_fast.cli import main  # noqa: E402
from icqs_fast.io.records import InputError  # noqa: E402
from icqs_fast.jobs.ray_actors import ICQSBatchScorer, ModelSpec  # noqa: E402
from icqs_fast.jobs.ray_executor import block_path, run_ray  # noqa: E402

pytestmark = pytest.mark.ray

GOOD = [{"x": f"profit rose {i}%", "y": "positive"} for i in range(3)] + [
    {"x": f"loss widened by {i} million", "y": "negative"} for i in range(3)]
BAD = [{"x": f"profit rose {i}%", "y": "negative"} for i in range(3)] + [
    {"x": f"loss widened by {i} million", "y": "positive"} for i in range(3)]
# Record 5 (line 6) has no y: a bad record. Ids of several JSON types.
RESPONSES = [{"id": f"r{i}" if i % 3 else i, "x": f"sales up {i}% in quarter {i % 4}",
              "y": ["positive", "negative", "up by far"][i % 3]} for i in range(5)] + [
    {"id": "bad", "x": "no response here"}] + [
    {"id": f"r{i}", "x": f"costs {i} times the plan", "y": ["negative", "positive"][i % 2]}
    for i in range(6, 11)]
KW = ["--num-ratios", "3", "--demos-per-set", "2", "--sets-per-ratio", "2", "--seed", "1",
      "--dtype", "float32", "--device", "cpu", "--backend", "torch"]




@pytest.fixture(scope="module")
def hold_dir():
    return tempfile.mkdtemp(prefix="icqs-hold-")


@pytest.fixture(scope="module")
def cluster(hold_dir):
    """A local 2-CPU Ray cluster for this module, whose job's actors hold blocks as the files
    in ``hold_dir`` say (tests/_faults.py; its workers find it on their PYTHONPATH)."""
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "RAY_USAGE_STATS_ENABLED")}
    os.environ.update(worker_path_env())  # before the node starts: its workers inherit it
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # no network
    tmp = tempfile.mkdtemp(prefix="rayt-")  # short: Ray's socket paths have a length limit
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=tmp,
             runtime_env=hold_runtime_env(hold_dir))
    ray.data.DataContext.get_current().enable_progress_bars = False
    # Loopback only (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, set in tests/conftest.py).
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
    restore_environ(saved)
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(hold_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Tiny model, demonstrations, input, and the single-process outputs (score with
    ``--on-error skip``; features), computed through the CLI in this process."""
    d = tmp_path_factory.mktemp("dist")
    tiny = save_tiny_llama(d / "tiny")
    g, b = write_jsonl(d / "good.jsonl", GOOD), write_jsonl(d / "bad.jsonl", BAD)
    inp = write_jsonl(d / "in.jsonl", RESPONSES)
    common = ["--good", str(g), "--bad", str(b), "--model", str(tiny), *KW]
    assert main(["score", str(inp), "-o", str(d / "single.jsonl"), *common,
                 "--on-error", "skip", "--quiet"]) == 0
    fkw = ["--model", str(tiny), "--dtype", "float32", "--device", "cpu", "--backend", "torch",
           "--chunk-size", "2", "--batch-size", "2", "--features",
           "sent_logprob,softmax_ent,attn_ent_avg"]
    assert main(["features", str(inp), "-o", str(d / "single_f.jsonl"), *fkw,
                 "--on-error", "skip", "--quiet"]) == 0
    return {"dir": d, "tiny": tiny, "input": inp, "common": common, "fkw": fkw,
            "single": read_jsonl(d / "single.jsonl"), "single_f": read_jsonl(d / "single_f.jsonl")}


def _args(kind, data, out, *extra):
    """The job config of the command line (what run_ray takes)."""
    base = data["common"] if kind == "score" else data["fkw"]
    return build_config(kind, build_parser(kind).parse_args(
        [str(data["input"]), "-o", str(out), *base, "--ray", "--quiet", *extra]))


def _blocks(out, fmt):
    return sorted(p for p in os.listdir(out) if p.startswith("part-") and p.endswith("." + fmt))


def _parquet_rows(out):
    import pyarrow.parquet as pq

    rows = []
    for p in _blocks(out, "parquet"):
        rows += pq.read_table(os.path.join(out, p)).to_pylist()
    return rows


def _close(a, b, rtol=1e-6):
    # Log-likelihoods are fp32 sums (ICQSResult.loglik): a block batches responses differently
    # from the single-process stream, which moves them by a few ulps (2e-6 at |loglik| = 21).
    return np.allclose(np.asarray(a, dtype=float), np.asarray(b, dtype=float), rtol=rtol,
                       atol=1e-9, equal_nan=True)


def _check_score_parquet(out, single):
    """Parquet blocks vs the single-process lines: same records once each, same numbers (a
    skipped record is its error row, in place, as in the single-process output)."""
    rows = _parquet_rows(out)
    bad = sorted((r for r in rows if r["error"] is not None), key=lambda r: r["index"])
    assert [{k: r[k] for k in ("index", "line", "error")} for r in bad] == \
        [r for r in single if "error" in r]
    rows = [r for r in rows if r["error"] is None]
    want = [r for r in single if "error" not in r]
    assert sorted(r["index"] for r in rows) == [r["index"] for r in want]  # none lost/doubled
    rows.sort(key=lambda r: r["index"])
    for got, exp in zip(rows, want, strict=True):
        assert got["line"] == exp["line"]
        assert got["id"] == (exp["id"] if isinstance(exp["id"], str) else json.dumps(exp["id"]))
        # The posterior mean (the default) within fp32 rounding, as in assert_same_scores: a
        # restarted actor, or another CPU kind, rounds the log-likelihoods differently.
        assert got["score"] == pytest.approx(exp["score"], abs=1e-5)
        assert got["score_per_set"] == pytest.approx(exp["score_per_set"], abs=1e-5)
        assert _close(np.reshape(got["loglik"], (3, 2)), exp["loglik"])
        assert np.reshape(got["n_prompt_tokens"], (3, 2)).tolist() == exp["n_prompt_tokens"]
        assert got["n_response_tokens"] == exp["n_response_tokens"]


def test_score_jsonl_equals_single_process(cluster, data, tmp_path):
    out = tmp_path / "out"
    assert run_ray(_args("score", data, out, "--workers", "2", "--block-size", "4",
                                  "--output-format", "jsonl", "--on-error", "skip")) == 0
    assert _blocks(out, "jsonl") == [f"part-{k:06d}.jsonl" for k in range(3)]
    got = []
    for p in _blocks(out, "jsonl"):
        got += read_jsonl(out / p)
    single = data["single"]
    assert [r["index"] for r in got] == list(range(11))
    assert got[5] == single[5] == {"index": 5, "line": 6, "error": {
        "field": "y", "reason": "missing (this record's keys: id, x)"}}
    assert_same_lines(got, single)  # floats within rounding: actors batch other records
    meta = json.loads((out / "run.meta.json").read_text())
    assert meta["n_records"] == 11 and meta["block_size"] == 4
    assert (meta["dtype"], meta["device"], meta["backend"]) == ("float32", "cpu", "torch")


def test_features_parquet_equals_single_process(cluster, data, tmp_path):
    out = tmp_path / "out"
    assert run_ray(_args("features", data, out, "--block-size", "4",
                                     "--on-error", "skip")) == 0
    rows = sorted(_parquet_rows(out), key=lambda r: r["index"])
    # The bad record is its error row, in place, as in the single-process output.
    assert {k: rows[5][k] for k in ("index", "line", "error")} == data["single_f"][5]
    assert rows.pop(5)["n_tokens"] is None
    want = [r for r in data["single_f"] if "error" not in r]
    assert len(rows) == len(want) == 10
    for g, s in zip(rows, want, strict=True):
        assert (g["index"], g["line"], g["n_tokens"]) == (s["index"], s["line"], s["n_tokens"])
        for f in ("sent_logprob", "softmax_ent", "attn_ent_avg"):
            assert _close(g[f], s[f]), f


def test_worker_sigkilled_mid_run_is_restarted(cluster, data, hold_dir, tmp_path):
    """The actor scoring block 1 is SIGKILLed mid-block; Ray restarts it and re-sends the
    block; every record is written exactly once."""
    open(os.path.join(hold_dir, "arm-1"), "w").close()
    held = os.path.join(hold_dir, "held-1")
    killed: list[int] = []

    def killer():
        wait_for_file(held, 120)
        pid = int(open(held).read().split()[0])
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    try:
        out = tmp_path / "out"
        assert run_ray(_args("score", data, out, "--block-size", "3",
                                      "--on-error", "skip")) == 0
    finally:
        os.remove(os.path.join(hold_dir, "arm-1"))
    t.join(5)
    assert killed, "the hold hook never ran: the kill was not exercised"
    assert _blocks(out, "parquet") == [f"part-{k:06d}.parquet" for k in range(4)]
    _check_score_parquet(out, data["single"])
    assert not [p for p in os.listdir(out) if ".tmp." in p]


def test_driver_sigkilled_then_rerun_skips_complete_blocks(cluster, data, hold_dir, tmp_path):
    out = tmp_path / "out"
    argv = [str(data["input"]), "-o", str(out), *data["common"], "--ray", "--address", cluster,
            "--block-size", "3", "--output-format", "jsonl", "--on-error", "skip", "--resume"]
    open(os.path.join(hold_dir, "arm-2"), "w").close()
    try:
        # The driver's own job holds too: tests/_ray_cli.py's main, joined to the
        # cluster with the hold runtime env.
        proc = subprocess.Popen([sys.executable, ENTRY, "ray-hold", hold_dir, "--", "score",
                                 *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            wait_for_file(os.path.join(hold_dir, "held-2"), 150, proc)
            before = {p: os.stat(out / p) for p in _blocks(out, "jsonl")}
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
    finally:
        os.remove(os.path.join(hold_dir, "arm-2"))
    # One actor takes the blocks in order: 0 and 1 are done, 2 was being scored.
    assert sorted(before) == ["part-000000.jsonl", "part-000001.jsonl"]
    args = build_config("score", build_parser("score").parse_args(
        [a for a in argv if a not in ("--address", cluster)]))
    assert run_ray(args) == 0  # the same command, on this process's Ray connection
    for p, st in before.items():  # not redone
        now = os.stat(out / p)
        assert (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    got = []
    for p in _blocks(out, "jsonl"):
        got += read_jsonl(out / p)
    assert [r["index"] for r in got] == list(range(11))
    for g, s in zip(got, data["single"], strict=True):
        assert g.keys() == s.keys() and g.get("id") == s.get("id")
        assert _close(g.get("loglik", 0), s.get("loglik", 0))


def test_bad_record_stops_with_file_line_field(cluster, data, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(InputError) as exc:
        run_ray(_args("score", data, out, "--block-size", "3"))
    e = exc.value
    assert (e.path, e.line, e.field) == (str(data["input"]), 6, "y")
    assert not os.path.exists(block_path(out, 1, "parquet"))  # the bad record's block
    # Another run over the same output needs --resume (or --overwrite) ...
    with pytest.raises(ValueError, match="--resume"):
        run_ray(_args("score", data, out, "--block-size", "3"))


def test_local_and_ray_parquet_read_as_one_dataset(cluster, data, tmp_path):
    """A job scored partly by the single process (``-o X.parquet``) and partly on Ray
    (``--ray``, Parquet blocks) is one dataset: the same Arrow schema (the declared one),
    whatever the ids' types, and ``pyarrow.dataset`` reads both together."""
    import pyarrow.dataset as pds
    import pyarrow.parquet as pq

    from icqs_fast.io.schema import arrow_schema

    shards = tmp_path / "shards"  # the data files alone (no meta / lock files)
    shards.mkdir()
    assert main(["score", str(data["input"]), "-o", str(tmp_path / "local.parquet"),
                 *data["common"], "--shard", "0/2", "--on-error", "skip", "--quiet"]) == 0
    shutil.copy(tmp_path / "local.parquet", shards / "local.parquet")
    ray_out = tmp_path / "ray"
    assert run_ray(_args("score", data, ray_out, "--block-size", "4", "--on-error", "skip")) == 0
    for p in _blocks(ray_out, "parquet"):
        shutil.copy(ray_out / p, shards / f"ray-{p}")
    schemas = {p.name: pq.read_schema(p) for p in shards.iterdir()}
    assert len(schemas) == 4
    for name, sch in schemas.items():
        assert sch.remove_metadata().equals(arrow_schema("icqs")), name
    table = pds.dataset(str(shards), format="parquet").to_table()
    n_local = pq.read_metadata(shards / "local.parquet").num_rows
    assert 0 < n_local < 11 and table.num_rows == n_local + 11  # shard 0 of 2 + all on Ray
    rows = table.to_pylist()
    assert {r["id"] for r in rows if r["error"] is None} >= {"0", "r1", "r2", "3"}


def test_self_check_reaches_the_blocks(cluster, data, tmp_path):
    """With pools large enough for an estimate, the driver runs the self-check once (a Ray
    task with one worker's resources), stores it in run.meta.json and every block row carries
    ``p_good_calibrated`` from that map; a resumed run reuses it."""
    from icqs_fast.engine.selfcheck import SelfCheck

    good = [{"x": f"sales rose {i}%", "y": "positive"} for i in range(12)] + [
        {"x": f"losses grew by {i}", "y": "negative"} for i in range(12)]
    bad = [dict(r, y="negative" if r["y"] == "positive" else "positive") for r in good]
    g, b = write_jsonl(tmp_path / "g.jsonl", good), write_jsonl(tmp_path / "b.jsonl", bad)
    out = tmp_path / "out"
    argv = [str(data["input"]), "-o", str(out), "--good", str(g), "--bad", str(b),
            "--model", str(data["tiny"]), *KW, "--ray", "--quiet", "--block-size", "4",
            "--on-error", "skip", "--self-check-max", "48"]
    assert run_ray(build_config("score", build_parser("score").parse_args(argv))) == 0
    check = SelfCheck.from_dict(json.loads((out / "run.meta.json").read_text())["self_check"])
    assert check.ok
    rows = [r for r in _parquet_rows(out) if r["error"] is None]
    assert len(rows) == 10
    for r in rows:
        assert r["p_good_calibrated"] == pytest.approx(check.record_value(r["score"]), abs=1e-12)
    os.remove(block_path(out, 1, "parquet"))
    meta = (out / "run.meta.json").read_text()
    assert run_ray(build_config("score", build_parser("score").parse_args(
        [*argv, "--resume", "--self-check-seed", "5"]))) == 0
    assert json.loads((out / "run.meta.json").read_text())["self_check"] == \
        json.loads(meta)["self_check"]


def test_score_calibrated_parquet_equals_single_process(cluster, data, tmp_path):
    """``--calibrate content_free --score mean`` reaches the actors: the Parquet blocks hold
    the single-process run's scores, raw loglik and loglik_baseline."""
    opts = ["--calibrate", "content_free", "--score", "mean"]
    single = tmp_path / "single.jsonl"
    assert main(["score", str(data["input"]), "-o", str(single), *data["common"], *opts,
                 "--on-error", "skip", "--quiet"]) == 0
    want = [r for r in read_jsonl(single) if "error" not in r]
    assert all("loglik_baseline" in r for r in want)
    out = tmp_path / "out"
    assert run_ray(_args("score", data, out, *opts, "--workers", "1", "--block-size", "6",
                         "--on-error", "skip")) == 0
    rows = sorted((r for r in _parquet_rows(out) if r["error"] is None),
                  key=lambda r: r["index"])
    assert [r["index"] for r in rows] == [r["index"] for r in want]
    for got, exp in zip(rows, want, strict=True):
        assert _close(np.reshape(got["loglik"], (3, 2)), exp["loglik"])
        assert _close(np.reshape(got["loglik_baseline"], (3, 2)), exp["loglik_baseline"])
        assert abs(got["score"] - exp["score"]) < 1e-6  # a softmax of the fp32 log-likelihoods
        assert got["score_per_set"] == pytest.approx(exp["score_per_set"], abs=1e-6)
    # The mean score is continuous: not only the M+1 ratios.
    assert any(r["score"] not in (0.0, 0.5, 1.0) for r in rows)


def test_actor_gets_the_jobs_one_settings_object(data, tmp_path):
    """The actors get the job's strategy as the driver prepared it (pickled, as Ray sends it):
    the single-process run's ScoringSettings, demonstrations and sets, unchanged, whatever the
    options - also with other demonstration fields, where a keyword path once dropped
    ``deterministic``."""
    import pickle

    from icqs_fast.jobs.ray_executor import ActorSetup
    from icqs_fast.jobs.runner import strategy_for

    for extra in ([], ["--demo-x-field", "x", "--demo-y-field", "y", "--x-field", "x2"]):
        cfg = _args("score", data, tmp_path / "o", "--deterministic", "--calibrate", "pmi",
                    "--score", "mean", "--stratify-field", "none", *extra)
        local = strategy_for(cfg)
        local.prepare(lambda *a: None)
        remote = pickle.loads(pickle.dumps(ActorSetup(local, None, None, "o", None))).strategy
        st = remote.settings
        assert st == local.settings
        assert (st.deterministic, st.calibration, st.score, st.stratify) == (
            True, "pmi", "mean", None)
        got, want = remote.demos, local.demos
        assert (got.good, got.bad, got.sets) == (want.good, want.bad, want.sets)


def test_resume_with_other_settings_is_refused(data, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    meta = {"n_records": 11}
    (out / "run.meta.json").write_text(json.dumps(meta))
    open(block_path(out, 0, "parquet"), "wb").close()
    with pytest.raises(ValueError, match="other settings"):
        run_ray(_args("score", data, out, "--block-size", "3", "--resume"))


def test_batch_scorer_matches_single_process_lines(data):
    """The map_batches class on a plain numpy batch (no Ray): the CLI's numbers; a record the
    scorer rejects gets an error and NaN."""
    sc = ICQSBatchScorer(str(data["dir"] / "good.jsonl"), str(data["dir"] / "bad.jsonl"),
                         model=ModelSpec(str(data["tiny"]), dtype="float32", device="cpu"),
                         backend="torch", num_ratios=3, demos_per_set=2, sets_per_ratio=2,
                         seed=1)
    good = [r for r in RESPONSES if "y" in r]
    batch = {"id": np.array([str(r["id"]) for r in good] + ["empty"], dtype=object),
             "x": np.array([r["x"] for r in good] + ["q"], dtype=object),
             "y": np.array([r["y"] for r in good] + ["   "], dtype=object)}
    res = sc(batch)
    want = [r for r in data["single"] if "error" not in r]
    assert res["loglik"].shape == (11, 3, 2) and res["id"].tolist()[-1] == "empty"
    assert _close(res["loglik"][:10], [r["loglik"] for r in want])
    assert res["score"][:10].tolist() == pytest.approx([r["score"] for r in want], abs=1e-5)
    assert res["error"][:10].tolist() == [None] * 10
    assert res["error"][10] == "y: whitespace-only response (nothing to score)"  # the reader's
    assert np.isnan(res["score"][10])
    assert np.isnan(res["loglik_baseline"]).all()  # declared: NaN when uncalibrated


def test_batch_scorer_settings_object_calibrated(data):
    """``settings=`` (a ScoringSettings' asdict, as the driver sends it) gives the engine's
    calibrated results, the baseline beside the raw loglik."""
    from icqs_fast.engine.scorer import ICQSScorer
    from icqs_fast.engine.settings import ScoringSettings
    from icqs_fast.io.readers import read_examples

    st = ScoringSettings(num_ratios=3, demos_per_set=2, sets_per_ratio=2, seed=1,
                         backend="torch", calibration="content_free", content_free=("N/A",),
                         score="mean")
    sc = ICQSBatchScorer(str(data["dir"] / "good.jsonl"), str(data["dir"] / "bad.jsonl"),
                         st.asdict(), model=ModelSpec(str(data["tiny"]), dtype="float32",
                                                      device="cpu"))
    assert sc.settings == st
    pairs = [(r["x"], r["y"]) for r in RESPONSES[:3]]
    res = sc({"x": np.array([x for x, _ in pairs], dtype=object),
              "y": np.array([y for _, y in pairs], dtype=object)})
    ref = list(ICQSScorer(sc.model, sc.tokenizer, read_examples(data["dir"] / "good.jsonl"),
                     read_examples(data["dir"] / "bad.jsonl"), st).score(pairs))
    assert _close(res["loglik_baseline"], [r.loglik_baseline.tolist() for r in ref])
    assert _close(res["score"], [r.score for r in ref])
    with pytest.raises(TypeError, match="unknown scoring option"):
        ICQSBatchScorer([], [], st.asdict(), calibrate="pmi")


def test_parquet_blocks_read_as_the_jsonl_reader(tmp_path):
    """Parquet input (no Ray needed): block k's records, checks and errors are those the
    single-process reader gives for the same rows as JSONL (line = row number)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from icqs_fast.io.readers import count_records, read_records
    from icqs_fast.io.records import RecordError
    from icqs_fast.jobs.ray_actors import BlockSpec, block_items

    rows = [{"id": str(r["id"]), "x": r["x"], "y": r.get("y")} for r in RESPONSES]
    path = str(tmp_path / "in.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=4)  # blocks cross groups
    jl = write_jsonl(tmp_path / "in.jsonl", rows)
    assert count_records(path) == count_records(jl) == 11
    want = list(read_records(jl, on_error="yield"))
    for start, end in ((0, 3), (3, 6), (6, 11)):
        got = block_items(BlockSpec(path, "parquet", 0, start, end))
        assert [g.index for g in got] == list(range(start, end))
        for g, w in zip(got, want[start:end], strict=True):
            assert type(g) is type(w) and g.line == w.line
            if isinstance(g, RecordError):
                assert (g.field, g.path) == (w.field, path) == ("y", path)
            else:
                assert (g.x, g.y, g.id) == (w.x, w.y, w.id)


@pytest.mark.parametrize("kind", ["score", "features"])
def test_cli_ray_flag_dispatches_to_run_ray(kind, monkeypatch, tmp_path):
    """`icqs-fast score|features --ray ...` hands the job config to run_ray (no Ray start:
    run_ray is replaced), and the module entry point parses the same options."""
    import _ray_cli as rcli

    import icqs_fast.jobs.ray_executor as dcli

    seen = []
    monkeypatch.setattr(dcli, "run_ray", lambda c, **kw: seen.append((c.kind, c)) or 0)
    extra = ["--good", "g.jsonl", "--bad", "b.jsonl"] if kind == "score" else []
    argv = [kind, "in.jsonl", "-o", str(tmp_path / "o"), *extra, "--ray", "--workers", "2",
            "--block-size", "8"]
    assert main(argv) == 0
    assert rcli.main(argv[:1] + [a for a in argv[1:] if a != "--ray"]) == 0
    assert [k for k, _ in seen] == [kind, kind]
    for _, c in seen:
        assert (c.executor, c.ray.workers, c.ray.block_size) == ("ray", 2, 8)


# --------------------------------------------------------------------------- score --pairs

# Pairs of two records by `pid` (a then b) with labels, and a lone record (a bad group) at
# record 4. Blocks of 3 records: pairs p1 (records 2-3) and p2 (5-6) cross a block boundary
# (each goes whole to the block of its first record), block 1 holds the bad group.
_PAIR_YS = [("positive", "negative"), ("negative up", "positive by far"), ("flat", "down")]
PAIR_ROWS = [{"pid": f"p{i}", "x": f"sales up {i}% in quarter {i % 4}", "y": _PAIR_YS[i % 3][k],
              "ok": "good" if k == i % 2 else "bad"} for i in range(5) for k in (0, 1)]
PAIR_ROWS.insert(4, {"pid": "lone", "x": "no pair here", "y": "positive", "ok": "good"})


def _pair_summary(text):
    """The pair summary's lines without its timing (``in S s (R pairs/s)``)."""
    return re.sub(r" in [\d.]+ s \([\d.]+ pairs/s\)", "", text)


@pytest.fixture(scope="module")
def pairs(data):
    """The pair input, its options and the local `score --pairs` run's lines and summary."""
    inp = write_jsonl(data["dir"] / "pairs.jsonl", PAIR_ROWS)
    opts = ["--pairs", str(inp), "--pair-field", "pid", "--label-field", "ok",
            "--no-self-check", "--on-error", "skip", *data["common"]]
    local, err = data["dir"] / "pairs_local.jsonl", io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["score", *opts, "-o", str(local)]) == 0
    summary = err.getvalue()[err.getvalue().index("icqs-fast: judged"):].rstrip("\n")
    return {"opts": opts, "lines": read_jsonl(local), "summary": summary}


def _pair_blocks(out):
    got = []
    for p in _blocks(out, "jsonl"):
        got += read_jsonl(out / p)
    return got


def test_pairs_jsonl_blocks_equal_the_local_run(cluster, pairs, tmp_path):
    """`score --pairs --ray`: no pair split between blocks (nor a block without its pairs'
    second records), `cat OUT/part-*.jsonl` is the local run's output to the bit, the bad
    group's error line in place, and the driver says the local run's pair summary."""
    out, logs = tmp_path / "out", []
    assert run_ray(build_config("score", build_parser("score").parse_args(
        [*pairs["opts"], "-o", str(out), "--ray", "--quiet", "--workers", "2",
         "--block-size", "3", "--output-format", "jsonl"])),
        log=lambda *a: logs.append(" ".join(map(str, a)))) == 0
    assert _blocks(out, "jsonl") == [f"part-{k:06d}.jsonl" for k in range(4)]
    assert [[r["index"] for r in read_jsonl(out / p)] for p in _blocks(out, "jsonl")] == [
        [0, 2], [4, 5], [7], [9]]
    local = pairs["lines"]
    assert _pair_blocks(out) == local  # every field, every bit
    assert local[2]["error"]["field"] == "pid" and len(local) == 6
    said = next(m for m in logs if m.startswith("icqs-fast: judged"))
    text, where = said.rsplit("\n  ", 1)
    assert _pair_summary(text) == _pair_summary(pairs["summary"])
    assert "pairwise accuracy" in text and "1 bad pairs skipped" in text
    assert re.fullmatch(r"on [12] workers \(1 nodes\), 4 blocks", where), where  # as scheduled


def test_pairs_driver_sigkilled_then_resumed(cluster, pairs, tmp_path):
    """A `score --pairs --ray` driver SIGKILLed while block 2 is judged keeps blocks 0-1;
    the same command with --resume judges only blocks 2-3 (its summary over their pairs),
    and the blocks are the local run's output."""
    out, hold = tmp_path / "out", tmp_path / "hold"  # the killed driver's job's own holds
    argv = [*pairs["opts"], "-o", str(out), "--ray", "--address", cluster, "--block-size", "3",
            "--output-format", "jsonl", "--resume"]
    hold.mkdir()
    (hold / "arm-2").touch()
    proc = subprocess.Popen([sys.executable, ENTRY, "ray-hold", str(hold), "--", "score",
                             *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for_file(hold / "held-2", 150, proc)
        before = {p: os.stat(out / p) for p in _blocks(out, "jsonl")}
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert sorted(before) == ["part-000000.jsonl", "part-000001.jsonl"]
    logs = []
    assert run_ray(build_config("score", build_parser("score").parse_args(
        [a for a in argv if a not in ("--address", cluster)])),
        log=lambda *a: logs.append(" ".join(map(str, a)))) == 0
    for p, st in before.items():  # not redone
        now = os.stat(out / p)
        assert (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    assert _pair_blocks(out) == pairs["lines"]
    said = next(m for m in logs if m.startswith("icqs-fast: judged"))
    assert said.startswith("icqs-fast: judged 2 pairs in ")
    assert said.endswith("2 blocks (2 blocks were already complete)")
