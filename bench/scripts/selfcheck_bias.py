"""Is the self-check biased? SST-2, FPB and ChaosNLI, >= 6 seeds, default scoring settings.

    OMP_NUM_THREADS=1 python -m bench.scripts.selfcheck_bias [--datasets sst2 fpb chaosnli]
        [--seeds 0 1 2 3 4 5] [--pool 32] [--n-test 20] [--threads 1] [--dtype auto]
        [--work /tmp/icqs_selfcheck_bias] [--out bench/results/selfcheck_bias_cpu.json]

Per (dataset, seed) one raw JSON in ``--work`` (``{dataset}_s{seed}.json``: held-out and test
scores, log-likelihood matrices, clean-context masks, timings; a run whose file exists is not
scored again, so a cut-short study resumes), then ``--out``: the command, the settings, dtype,
machine and date, every raw run, the analysed row of each run and the per-dataset summary
(:mod:`bench.studies.selfcheck_study`); the bias table and the per-run table on stdout.
``--analyse-only`` refits from the raw files. ``--outside`` also scores each run's held-out
items as outside responses with the next seed's scorer (``outside_run``: the same items without
the cross-fitting), to tell a gap that comes from being in the pool from one that comes from the
items. Runs go seed-major, so a study stopped early
still covers every data set. ``--extra-runs DIR`` adds the raw files of an earlier study
(``bench/results/selfcheck``: same pools and settings, without stored matrices) for the
(dataset, seed) pairs not scored here. Runs with stored matrices are analysed a second time
with the set effects removed (``analyse(adjust=True)``: the correction under test), and
against a permutation null in which held-out items and (matched-context) test responses are
exchanged (``exchange_null`` / ``exchange_summary``: is either group scored differently?).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

from bench.studies.selfcheck_outside import outside_run, outside_summary
from bench.studies.selfcheck_study import (
    DATASETS,
    NULL_CV_REPEATS,
    add_test_responses,
    analyse,
    bias_markdown,
    exchange_markdown,
    exchange_null,
    exchange_summary,
    first_tests,
    markdown,
    run_one,
    shared_inputs,
    simulate_expected_accuracy,
    stored_runs,
    study_pools,
    summarise,
)
from icqs_fast.io.files import write_whole
from icqs_fast.threads import add_threads_argument, apply_threads


def cached_null(work: str, raw: dict) -> dict | None:
    """``exchange_null(raw)``, kept in ``work`` per run and test-set size (it is seeded by the
    run, so the same raw run gives the same null; minutes per run, so a re-analysis reads it)."""
    path = os.path.join(work, f"{raw['dataset']}_s{raw['seed']}_null_n{raw['n_test']}.json")
    if os.path.exists(path):
        with open(path) as f:
            got = json.load(f)
        if got is None or got.get("cv_repeats") == NULL_CV_REPEATS:
            return got
    got = exchange_null(raw)
    write_whole(path, json.dumps(got))
    return got


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4, 5])
    p.add_argument("--pool", type=int, default=32)
    p.add_argument("--n-test", type=int, default=20,
                   help="test responses per class and run (SST-2 / FPB: sentences, each "
                        "answered right and flipped)")
    add_threads_argument(p, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--model", default=None)
    p.add_argument("--work", default="/tmp/icqs_selfcheck_bias")
    p.add_argument("--out", default="bench/results/selfcheck_bias_cpu.json")
    p.add_argument("--analyse-only", action="store_true")
    p.add_argument("--add-test", type=int, default=0, metavar="N",
                   help="score more test responses, up to N per class, for the runs in --work "
                        "with stored matrices (rewrites their raw files; the held-out part is "
                        "kept)")
    p.add_argument("--outside", action="store_true",
                   help="also score each run's held-out items as outside responses with the "
                        "next seed's scorer (--work/{dataset}_s{seed}_outside.json, kept): is "
                        "a self-check / test gap from the cross-fitting or from the items?")
    p.add_argument("--extra-runs", default=None,
                   help="folder of an earlier study's raw files to add (pairs not scored here)")
    a = p.parse_args()
    model = tok = None

    def load() -> None:
        nonlocal model, tok
        if model is None:
            from icqs_fast.models import load_model

            apply_threads(a.threads)
            model, tok = load_model(a.model, dtype=a.dtype)

    def score(ds: str, seed: int) -> dict:
        load()
        t0 = time.perf_counter()
        raw = run_one(model, tok, ds, seed, pool=a.pool, n_test=a.n_test, quiet=True)
        raw["wall_s"] = round(time.perf_counter() - t0, 1)
        return raw

    raws = stored_runs(a.work, a.seeds, a.datasets, score, analyse_only=a.analyse_only)
    for i, r in enumerate(raws):
        have = len(r["test"]["labels"]) // 2
        if a.add_test > have and "loglik" in r["test"]:
            load()
            t0 = time.perf_counter()
            raws[i] = add_test_responses(model, tok, r, a.add_test - have)
            path = os.path.join(a.work, f"{r['dataset']}_s{r['seed']}.json")
            write_whole(path, json.dumps(raws[i]))
            print(f"{r['dataset']} s{r['seed']}: +{2 * (a.add_test - have)} test responses, "
                  f"{time.perf_counter() - t0:.0f} s -> {path}", file=sys.stderr, flush=True)
    have = {(r["dataset"], r["seed"]) for r in raws}
    if a.extra_runs:
        for seed in a.seeds:
            for ds in a.datasets:
                path = os.path.join(a.extra_runs, f"{ds}_s{seed}.json")
                if (ds, seed) not in have and os.path.exists(path):
                    with open(path) as f:
                        raws.append({**json.load(f), "source": path})
    outs = []
    if a.outside:
        for r in raws:
            seeds = sorted(q["seed"] for q in raws if q["dataset"] == r["dataset"])
            if len(seeds) < 2:
                continue
            nxt = seeds[(seeds.index(r["seed"]) + 1) % len(seeds)]
            other = next(q for q in raws if q["dataset"] == r["dataset"] and q["seed"] == nxt)
            path = os.path.join(a.work, f"{r['dataset']}_s{r['seed']}_outside.json")
            if not os.path.exists(path):
                if a.analyse_only:
                    continue
                load()
                write_whole(path, json.dumps(outside_run(model, tok, r, other)))
            with open(path) as f:
                outs.append(json.load(f))
    outside = outside_summary(raws, outs) if outs else None
    rows = [analyse(r) for r in raws]
    per_dataset = summarise(rows)
    adj_rows = [analyse(r, adjust=True) for r in raws if "loglik" in r["heldout"]]
    # The expected accuracy's own bias on binormal scores at the study's pool size.
    sim = [simulate_expected_accuracy(auc, n_per_class=a.pool) for auc in (0.6, 0.7, 0.8)]
    per_dataset_adj = summarise(adj_rows)
    # Are held-out items scored like test responses? A permutation null per run with matrices.
    nulls = [cached_null(a.work, r) for r in raws]
    exchange = exchange_summary(rows, nulls)
    # The same runs with only the test responses scored with them (before --add-test).
    firsts = [first_tests(r) for r in raws if "n_test_scored_first" in r]
    rows_first = [analyse(r) for r in firsts]
    per_dataset_first = summarise(rows_first)
    exchange_first = exchange_summary(rows_first, [cached_null(a.work, r) for r in firsts])
    # Pool items whose input recurs in the pools (the `input` leak rule takes more from them).
    for r, row in zip(raws, rows, strict=True):
        good, bad, _, _ = study_pools(r["dataset"], pool=r.get("pool", a.pool),
                                      n_test=max(1, r["n_test"] // 2), seed=r["seed"])
        row["pool_items_sharing_input"] = shared_inputs(good, bad)
    doc = {
        "command": "OMP_NUM_THREADS=1 python " + " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "note": "shared with other sessions"},
        "model": a.model or "embedded SmolLM2-135M-Instruct",
        "dtype": sorted({r.get("dtype", "?") for r in raws}),
        # The runs' own test-set sizes (--n-test only sizes runs scored by this call).
        "options": {"pool": a.pool, "n_test_per_class": sorted({r["n_test"] // 2 for r in raws}),
                    "threads": a.threads, "seeds": a.seeds, "datasets": a.datasets},
        "per_dataset": per_dataset, "per_dataset_adjusted": per_dataset_adj,
        "first_tests_only": {"per_dataset": per_dataset_first, "exchange_null": exchange_first},
        "exchange_null": {"summary": exchange,
                          "runs": [{"dataset": r["dataset"], "seed": r["seed"], **n}
                                   for r, n in zip(raws, nulls, strict=True) if n]},
        "expected_accuracy_simulation": sim,
        "outside": {"summary": outside, "runs": outs} if outs else None,
        "rows": rows, "rows_adjusted": adj_rows, "runs": raws,
    }
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f)
    print(bias_markdown(per_dataset))
    print("\nset effects removed (runs with stored matrices):")
    print(bias_markdown(per_dataset_adj))
    print("\nexpected accuracy on binormal scores:", json.dumps(sim))
    print("\nheld-out items and test responses exchanged (permutation null, runs with "
          "matrices):")
    print(exchange_markdown(exchange))
    print("\nthe runs' first test responses only (before --add-test):")
    print(bias_markdown(per_dataset_first))
    print(exchange_markdown(exchange_first))
    if outs:
        print("\nheld-out items cross-fitted / as outside responses / the outside scorer's "
              "test AUC:", json.dumps(outside, indent=1))
    print("pool items sharing their input:",
          {f"{r['dataset']} s{r['seed']}": r["pool_items_sharing_input"] for r in rows})
    print()
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
