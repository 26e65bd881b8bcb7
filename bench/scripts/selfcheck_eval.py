"""Does the self-check predict the truth? SST-2 and FPB, several seeds, default scoring settings.

    python -m bench.scripts.selfcheck_eval [--datasets sst2 fpb] [--seeds 0 1 2] [--n-test 100]
                                   [--pool 32] [--threads 1] [--out bench/results/selfcheck]

Per (dataset, seed) one raw JSON (``{dataset}_s{seed}.json``: held-out and test scores, timings;
a run whose file exists is not scored again), then ``summary.json`` (one analysed row per run,
means per dataset) and the markdown table on stdout
(:mod:`bench.studies.selfcheck_study`). ``--analyse-only`` refits from the raw files.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

from bench.studies.selfcheck_study import (
    DATASETS,
    analyse,
    markdown,
    run_one,
    stored_runs,
    summarise,
)
from icqs_fast.threads import add_threads_argument, apply_threads


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--pool", type=int, default=32)
    p.add_argument("--n-test", type=int, default=100,
                   help="test sentences per run, each answered right and flipped (2x records)")
    add_threads_argument(p, default=1)
    p.add_argument("--model", default=None)
    p.add_argument("--out", default="bench/results/selfcheck")
    p.add_argument("--analyse-only", action="store_true")
    p.add_argument("--method", default="auto", choices=["auto", "platt", "isotonic"])
    a = p.parse_args()
    model = tok = None

    def score(ds: str, seed: int) -> dict:
        nonlocal model, tok
        if model is None:
            from icqs_fast.models import load_model

            apply_threads(a.threads)
            model, tok = load_model(a.model)
        raw = run_one(model, tok, ds, seed, pool=a.pool, n_test=a.n_test, quiet=False)
        raw["machine"] = {"platform": platform.platform(), "processor": platform.processor(),
                          "cpus": os.cpu_count()}
        return raw

    raws = stored_runs(a.out, a.seeds, a.datasets, score, analyse_only=a.analyse_only)
    rows = [analyse(r, method=a.method) for r in raws]
    summary = {"rows": rows, "per_dataset": summarise(rows), "method": a.method}
    name = "summary.json" if a.method == "auto" else f"summary_{a.method}.json"
    with open(os.path.join(a.out, name), "w") as f:
        json.dump(summary, f, indent=1)
    print(markdown(rows))
    print(json.dumps(summary["per_dataset"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
