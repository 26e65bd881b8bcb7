"""What the self-check costs a score job: held-out pool members against records, interleaved.

    python -m bench.scripts.selfcheck_cost [--dataset sst2] [--chunks 4] [--chunk 16] [--threads 1]

One scorer at the default settings on the study's pools (seed 0; the prefix bank built first,
outside the timing, as a job builds it before its records). The self-check's held-out items and
as many test records are scored in alternating chunks of ``--chunk`` items, so both see the same
machine load; CPU time of this process (``time.process_time``, one torch thread: what the work
costs whatever else runs on the machine) and wall time per item. Then the fit
(:func:`icqs_fast.engine.selfcheck.fit_self_check`: bootstrap, folds, map) is timed on the
cross-fitted scores. Prints one JSON object and writes it to
``bench/results/selfcheck/cost_cpu.json`` unless ``--no-save``: the cost of a self-check of
``DEFAULT_MAX_HELDOUT`` items as a share of a 10,000-record job.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from bench.studies.selfcheck_study import JOB_RECORDS, study_pools
from icqs_fast.engine.scorer import ICQSScorer
from icqs_fast.engine.selfcheck import (
    DEFAULT_MAX_HELDOUT,
    clean_contexts,
    crossfit_score,
    fit_self_check,
    select_heldout,
)
from icqs_fast.engine.settings import ScoringSettings
from icqs_fast.models import load_model
from icqs_fast.threads import add_threads_argument, apply_threads


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="sst2", choices=["sst2", "fpb"])
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--chunk", type=int, default=16)
    add_threads_argument(p, default=1)
    p.add_argument("--no-save", action="store_true")
    a = p.parse_args()
    apply_threads(a.threads)
    model, tok = load_model(None)
    good, bad, test = study_pools(a.dataset, pool=32, n_test=200, seed=0)
    sc = ICQSScorer(model, tok, good, bad, ScoringSettings(seed=0))
    _ = sc.prefix_bank
    ig, ib = select_heldout(len(good), len(bad), DEFAULT_MAX_HELDOUT, 0)
    held = [good[i] for i in ig] + [bad[i] for i in ib]
    labels = [1] * len(ig) + [0] * len(ib)
    order = list(range(len(held)))
    order = order[0::2] + order[1::2]  # good and bad items in every chunk
    recs = [(x, y) for x, y, _ in test[0::2] + test[1::2]]
    n = a.chunk
    t = {"heldout": {"cpu": [], "wall": []}, "record": {"cpu": [], "wall": []}}
    scores: dict[int, float] = {}
    for c in range(a.chunks):
        idx = order[c * n:(c + 1) * n]
        c0, w0 = time.process_time(), time.perf_counter()
        for i, res in zip(idx, sc.score([held[i] for i in idx]), strict=True):
            scores[i] = crossfit_score(res, clean_contexts(sc.sets, held[i]))
        c1, w1 = time.process_time(), time.perf_counter()
        list(sc.score(recs[c * n:(c + 1) * n]))
        c2, w2 = time.process_time(), time.perf_counter()
        t["heldout"]["cpu"].append((c1 - c0) / len(idx))
        t["heldout"]["wall"].append((w1 - w0) / len(idx))
        t["record"]["cpu"].append((c2 - c1) / n)
        t["record"]["wall"].append((w2 - w1) / n)
        print(f"chunk {c}: held out {t['heldout']['cpu'][-1]:.2f} s CPU/item, records "
              f"{t['record']['cpu'][-1]:.2f} s CPU/item", flush=True)
    done = sorted(scores)
    f0 = time.process_time()
    fit_self_check([scores[i] for i in done], [labels[i] for i in done])
    fit_cpu = time.process_time() - f0
    med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in t.items()}
    ratio = med["heldout"]["cpu"] / med["record"]["cpu"]
    out = {
        "dataset": a.dataset, "chunks": a.chunks, "chunk": n, "torch_threads": a.threads,
        "seconds_per_item_median": med, "raw": t, "heldout_per_record_cpu": ratio,
        "fit_cpu_seconds": fit_cpu,
        "self_check_pct_of_10k_job": 100.0 * (DEFAULT_MAX_HELDOUT * med["heldout"]["cpu"]
                                              + fit_cpu) / (JOB_RECORDS
                                                            * med["record"]["cpu"]),
        "max_heldout": DEFAULT_MAX_HELDOUT,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch": torch.__version__},
    }
    print(json.dumps(out, indent=1))
    if not a.no_save:
        os.makedirs("bench/results/selfcheck", exist_ok=True)
        with open("bench/results/selfcheck/cost_cpu.json", "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
