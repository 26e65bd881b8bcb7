"""``icqs-fast bench scaleout``: records/s of ``score --ray`` with 1..n Ray workers against the
single-process ``icqs-fast score`` on the same input, in one run.

    icqs-fast bench scaleout --workers 1,2 --json [--n 200] [--model tiny|embedded]

The input is ``--n`` Financial PhraseBank sentences (``../shared/data``; synthetic sentences
when it is missing) scored with good/bad demonstrations drawn from the same file. The
single-process CLI runs in a subprocess, timed end to end; its own summary gives the scoring
time without start-up and model loading (the prefix bank included). It runs twice: with torch's
default threads (all cores) and with as many threads as one Ray worker has. Then a local Ray
cluster with all cores is started once and ``score --ray`` runs with each worker count
(``--cpus-per-worker`` cores each; Ray sets the actor's torch threads to that), writing JSONL
blocks of ``--block-size`` records. Each Ray output is checked against the single-process
output (max log-likelihood difference, ids and scores equal).

``--cluster K`` adds, after those, the same job on a multi-node Ray cluster on this machine
(``ray.cluster_utils.Cluster``, every node on 127.0.0.1: a head whose CPUs run the read tasks and
``K`` worker nodes with one actor each, each node its own raylet and object store), so every
block is read on the head and crosses to another node's object store, beside a one-node run
with ``K`` workers (same input, same blocks). The record's ``per_block_overhead_s`` compares
them.

Per-block overhead (every Ray run): for each actor, the driver's time between two consecutive
blocks of that actor minus the second block's time inside the actor's call: scheduling, moving
the block to the actor, returning its summary, the driver's loop; the actor keeps up to two
blocks queued, so a block's transfer overlaps the previous block's scoring. ``median`` and
``mean`` over all such pairs.

Figures per run: ``wall_s`` end to end, ``records_per_s`` = n / wall_s; for Ray also
``first_block_s`` (actor start-up + model load + first block) and ``records_per_s_busy`` (the
sum over workers of records / time inside their calls: the rate without start-up or
scheduling, what a long run approaches). On a machine shared with other work the numbers move
with its load, which is recorded (``loadavg_1min`` before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path

from icqs_fast.io.files import write_whole
from icqs_fast.options import add_json_argument

ICQS_ARGS = ["--num-ratios", "3", "--demos-per-set", "4", "--sets-per-ratio", "2", "--seed",
             "0", "--dtype", "float32", "--device", "cpu"]
# The same settings for the Ray job's config (ScoreJobConfig).
ICQS_SCORING = {"num_ratios": 3, "demos_per_set": 4, "sets_per_ratio": 2, "seed": 0}
ICQS_RUNTIME = {"dtype": "float32", "device": "cpu"}


# Correctness: largest |loglik Ray - single process| that passes (same model and settings on the
# same CPU; records ~1e-5); --tolerance overrides it. Ids and scores must be equal.
LOGLIK_TOL = 1e-4


def checks(tolerance: float = LOGLIK_TOL) -> dict:
    """The correctness fields of each Ray run (``record["ray"][i]``) and what each must be."""
    from icqs_fast.benchmarks import at_most, equals

    return {"max_abs_loglik_diff": at_most(tolerance), "ids_and_scores_equal": equals(True)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0].replace("``", "")
    p.add_argument("--workers", default="1,2", help="comma-separated Ray worker counts")
    p.add_argument("--n", type=int, default=200, help="records to score (default 200)")
    p.add_argument("--model", choices=["tiny", "embedded"], default="tiny",
                   help="tiny random Llama (default) or the embedded SmolLM2-135M")
    p.add_argument("--block-size", type=int, default=None,
                   help="records per block (default: n / (4 x max workers), >= 1)")
    p.add_argument("--cpus-per-worker", type=float, default=1.0, help="cores per Ray actor")
    add_json_argument(p, "print the record as one JSON object")
    p.add_argument("--out", default=None, help="also write the JSON record to this file")
    p.add_argument("--cluster", type=int, default=0, metavar="K",
                   help="also run on a local K-worker-node Ray cluster (all on 127.0.0.1), "
                   "beside a one-node run with K workers: the per-block overhead across nodes")
    p.add_argument("--tolerance", type=float, default=LOGLIK_TOL,
                   help="largest max_abs_loglik_diff that passes (default %(default)g); the "
                        "command exits 1, naming the field, on a failure")


def _inputs(d: Path, n: int) -> tuple[Path, Path, Path, str]:
    from icqs_fast.io.datasets import default_fpb_path, fpb_examples

    if default_fpb_path().is_file():
        good, bad, rest = fpb_examples(n_good=16, n_bad=16, seed=0)
        if len(rest) < n:
            raise ValueError(f"--n {n}: Financial PhraseBank has only {len(rest)} sentences left")
        rows = [{"id": f"fpb{r.index}", "x": r.x, "y": r.y} for r in rest[:n]]
        source = "fpb"
    else:
        labels = ("positive", "negative")
        good = [(f"profit rose {i}% in quarter {i % 4}", "positive") for i in range(8)] + [
            (f"loss widened by {i} million", "negative") for i in range(8)]
        bad = [(x, labels[1 - labels.index(y)]) for x, y in good]
        rows = [{"id": f"s{i}", "x": f"sales moved {i % 17}% while costs grew {i % 5} points",
                 "y": labels[i % 2]} for i in range(n)]
        source = "synthetic"

    def write(path: Path, objs) -> Path:
        path.write_text("".join(json.dumps(o) + "\n" for o in objs), encoding="utf-8")
        return path

    g = write(d / "good.jsonl", [{"x": x, "y": y} for x, y in good])
    b = write(d / "bad.jsonl", [{"x": x, "y": y} for x, y in bad])
    return write(d / "in.jsonl", rows), g, b, source


def _tiny_model(d: Path) -> Path:
    """A seeded 2-layer random Llama with the embedded tokenizer (as the tests use)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from icqs_fast import models

    tok = AutoTokenizer.from_pretrained(models.embedded_model_dir())
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, vocab_size=len(tok),
                      max_position_embeddings=2048)
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _read_jsonl(paths) -> dict:
    out = {}
    for p in paths:
        with open(p, encoding="utf-8") as f:
            for line in f:
                r = json.loads(line)
                out[r["index"]] = r
    return out


def _diff(a: dict, b: dict) -> tuple[float, float, bool]:
    """Max |loglik| difference, max relative difference, and whether ids/scores agree."""
    import numpy as np

    if a.keys() != b.keys():
        return float("inf"), float("inf"), False
    mabs = mrel = 0.0
    same = True
    for k in a:
        x, y = np.asarray(a[k]["loglik"], float), np.asarray(b[k]["loglik"], float)
        d = np.abs(x - y)
        mabs = max(mabs, float(d.max()))
        mrel = max(mrel, float((d / np.maximum(np.abs(y), 1e-30)).max()))
        same &= a[k].get("id") == b[k].get("id") and a[k]["score"] == b[k]["score"]
    return mabs, mrel, bool(same)


def block_overhead(per_block: list[dict]) -> dict:
    """Per-block overhead of a run (``stats["per_block"]`` of ``run_ray``): per actor, the
    time between two consecutive blocks as the driver saw them minus the second block's time
    in the call. Also the median time in the call (``call_s``)."""
    import statistics

    by_worker: dict[str, list[dict]] = {}
    for b in per_block:
        by_worker.setdefault(b["worker"], []).append(b)
    gaps = []
    for blocks in by_worker.values():
        blocks.sort(key=lambda b: b["done_s"])
        gaps += [b["done_s"] - a["done_s"] - b["seconds"] for a, b in pairwise(blocks)]
    calls = [b["seconds"] for b in per_block]
    return {"pairs": len(gaps),
            "median_s": round(statistics.median(gaps), 4) if gaps else None,
            "mean_s": round(statistics.fmean(gaps), 4) if gaps else None,
            "call_median_s": round(statistics.median(calls), 4) if calls else None,
            "nodes": len({b["node"] for b in per_block})}


def _loopback() -> None:
    """Every Ray node this benchmark starts on 127.0.0.1, not the machine's interface address
    (Ray reads the variable when imported, so this process's copy is patched too; the nodes'
    processes inherit the variable)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def _local_cluster(k: int, cpus_per_worker: float, root: str):
    """A head (the driver and read tasks: 1 CPU, no slot) and ``k`` worker nodes with a
    ``slot`` each, all on 127.0.0.1; returns the Cluster (the driver is connected)."""
    import ray
    from ray.cluster_utils import Cluster

    _loopback()
    # The cluster's address file in a folder of our own: no other process's ray.init() joins.
    os.environ["RAY_TMPDIR"] = root
    os.makedirs(os.path.join(root, "ray"), exist_ok=True)
    c = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=1, include_dashboard=False, temp_dir=os.path.join(root, "ray")))
    for _ in range(k):
        c.add_node(num_cpus=max(1, int(cpus_per_worker)), resources={"slot": 1})
    ray.init(address=c.address, log_to_driver=False)
    addrs = {nd["NodeManagerAddress"] for nd in ray.nodes()}
    if addrs != {"127.0.0.1"}:
        raise RuntimeError(f"the local cluster's nodes are not all on 127.0.0.1: {addrs}")
    return c


def bench(n: int, workers: list[int], model: str, block_size: int | None,
          cpus_per_worker: float, cluster: int = 0) -> dict:
    from icqs_fast.engine.settings import ScoringSettings
    from icqs_fast.jobs.config import RayOptions, ScoreJobConfig
    from icqs_fast.jobs.ray_executor import run_ray

    rec: dict = {"bench": "scaleout", "n": n, "model": model, "icqs_args": ICQS_ARGS,
                 "cpus_per_worker": cpus_per_worker, "loadavg_1min_before": os.getloadavg()[0]}
    B = block_size or max(1, n // (4 * max(workers + [cluster])))
    rec["block_size"] = B
    with tempfile.TemporaryDirectory(prefix="icqs-scaleout-") as tmp:
        d = Path(tmp)
        inp, g, b, rec["data"] = _inputs(d, n)
        model_dir = str(_tiny_model(d / "tiny")) if model == "tiny" else None
        model_args = ["--model", model_dir] if model_dir else []
        common = ["--good", str(g), "--bad", str(b), *ICQS_ARGS, *model_args]

        def single_run(threads: int | None) -> dict:
            env = dict(os.environ)
            if threads is not None:  # as many torch threads as one Ray worker has
                env["OMP_NUM_THREADS"] = str(threads)
            out = d / f"single{threads or ''}.jsonl"
            t = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "icqs_fast.cli", "score", str(inp),
                                   "-o", str(out), "--overwrite", *common], capture_output=True,
                                  text=True, check=False, env=env)
            wall = time.perf_counter() - t
            if proc.returncode != 0:
                raise RuntimeError(f"single-process score failed: {proc.stderr[-2000:]}")
            m = re.search(r"scored (\d+) responses in ([\d.]+) s", proc.stderr)
            scoring_s = float(m.group(2)) if m else float("nan")
            return {"wall_s": round(wall, 2), "records_per_s": round(n / wall, 3),
                    "scoring_s": scoring_s, "records_per_s_scoring": round(n / scoring_s, 3),
                    "torch_threads": threads or "default (all cores)"}

        rec["single_process"] = single_run(None)
        threads = max(1, int(cpus_per_worker))
        rec["single_process_worker_threads"] = single_run(threads)
        single = _read_jsonl([d / "single.jsonl"])

        import ray

        saved_loopback = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
        _loopback()
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        t = time.perf_counter()
        ray_tmp = tempfile.mkdtemp(prefix="rayb-")  # short: Ray's socket paths are limited
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 _temp_dir=ray_tmp)
        rec["ray_init_s"] = round(time.perf_counter() - t, 2)
        runs = []

        def ray_run(w: int, tag: str, **kw) -> dict:
            out = d / f"ray{tag}{w}"
            job = ScoreJobConfig(
                input=str(inp), output=str(out), good=str(g), bad=str(b),
                scoring=ScoringSettings(**ICQS_SCORING), model=model_dir, quiet=True,
                **ICQS_RUNTIME,
                ray=RayOptions(workers=w, cpus_per_worker=cpus_per_worker, block_size=B,
                               output_format="jsonl"))
            stats: dict = {}
            t = time.perf_counter()
            run_ray(job, stats=stats, **kw)
            wall = time.perf_counter() - t
            got = _read_jsonl(sorted(out.glob("part-*.jsonl")))
            mabs, mrel, same = _diff(got, single)
            busy = sum(v["records"] / v["busy_s"] for v in stats["workers"].values()
                       if v["busy_s"] > 0)
            return {
                "workers": w, "wall_s": round(wall, 2),
                "records_per_s": round(n / wall, 3),
                "first_block_s": round(stats.get("first_block_s", float("nan")), 2),
                "records_per_s_busy": round(busy, 3),
                "speedup_vs_single_end_to_end": round(
                    (n / wall) / rec["single_process"]["records_per_s"], 3),
                "speedup_vs_single_scoring": round(
                    busy / rec["single_process"]["records_per_s_scoring"], 3),
                "speedup_vs_single_worker_threads_scoring": round(
                    busy / rec["single_process_worker_threads"]["records_per_s_scoring"], 3),
                "per_worker": [{"blocks": v["blocks"], "records": v["records"],
                                "busy_s": round(v["busy_s"], 2),
                                "read_s": round(v["read_s"], 3)}
                               for v in stats["workers"].values()],
                "per_block_overhead_s": block_overhead(stats["per_block"]),
                "max_abs_loglik_diff": mabs, "max_rel_loglik_diff": mrel,
                "ids_and_scores_equal": same,
            }

        try:
            for w in workers + ([cluster] if cluster and cluster not in workers else []):
                runs.append(ray_run(w, ""))
        finally:
            ray.shutdown()
            shutil.rmtree(ray_tmp, ignore_errors=True)
        if cluster:
            root = tempfile.mkdtemp(prefix="rayk-")  # short: Ray's socket paths are limited
            saved = {"RAY_TMPDIR": os.environ.get("RAY_TMPDIR"),
                     "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": saved_loopback}
            t = time.perf_counter()
            c = _local_cluster(cluster, cpus_per_worker, root)
            rec["cluster_start_s"] = round(time.perf_counter() - t, 2)
            try:
                r = ray_run(cluster, "cluster", actor_options={"resources": {"slot": 1}})
                r["nodes"] = f"head + {cluster} worker nodes (127.0.0.1)"
                rec["cluster"] = r
            finally:
                ray.shutdown()
                c.shutdown()
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
                shutil.rmtree(root, ignore_errors=True)
            one = next(x for x in runs if x["workers"] == cluster)
            rec["per_block_overhead_s"] = {
                f"one_node_{cluster}_workers": one["per_block_overhead_s"],
                f"{cluster}_worker_nodes": rec["cluster"]["per_block_overhead_s"]}
    rec["ray"] = runs
    rec["loadavg_1min_after"] = os.getloadavg()[0]
    return rec


def run(args: argparse.Namespace) -> int:
    from icqs_fast.benchmarks import check_fields, environment, report_failures

    try:
        workers = [int(w) for w in args.workers.split(",") if w.strip()]
    except ValueError:
        raise ValueError(f"--workers: comma-separated integers, got {args.workers!r}") from None
    if not workers or min(workers) < 1:
        raise ValueError("--workers: at least one count, each >= 1")
    if args.n < 1:
        raise ValueError("--n must be >= 1")
    t0 = time.perf_counter()
    if args.cluster < 0:
        raise ValueError("--cluster must be >= 0")
    rec = bench(args.n, workers, args.model, args.block_size, args.cpus_per_worker,
                args.cluster)
    rec["bench_s"] = round(time.perf_counter() - t0, 1)
    rec.update(environment("cpu"))
    text = json.dumps(rec, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_whole(args.out, text + "\n")
    if args.json:
        print(text)
    else:
        sp = rec["single_process"]
        print(f"single process: {sp['records_per_s']:.2f} records/s end to end, "
              f"{sp['records_per_s_scoring']:.2f} scoring only")
        for r in rec["ray"] + ([rec["cluster"]] if "cluster" in rec else []):
            where = "local cluster, " if r is rec.get("cluster") else ""
            print(f"ray, {where}{r['workers']} workers: {r['records_per_s']:.2f} records/s end "
                  f"to end, {r['records_per_s_busy']:.2f} in the workers' calls; per-block "
                  f"overhead {r['per_block_overhead_s']['median_s']} s (median); max loglik "
                  f"diff {r['max_abs_loglik_diff']:.2g}")
    want = checks(getattr(args, "tolerance", LOGLIK_TOL))
    bad = [msg for i, r in enumerate(rec["ray"])
           for msg in check_fields(r, want, prefix=f"ray[{i}].")]
    if "cluster" in rec:
        bad += check_fields(rec["cluster"], want, prefix="cluster.")
    return report_failures("scaleout", bad)
