"""Cost of the batch-invariant mode: time ``deterministic=True`` against the
default mode on the same responses, interleaved in one run on one machine, and check that both
give the same scores to rounding.

    python -m bench.scripts.deterministic_cost [--model embedded] [--n 24] [--repeats 3]
        [--threads 1]

Prints one JSON object (times per mode, median ratio) and writes it to
bench/results/deterministic_cost.json unless --no-save.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from icqs_fast import ICQSScorer
from icqs_fast.engine.continuations import score_continuations
from icqs_fast.models import load_model
from icqs_fast.threads import add_threads_argument, apply_threads

GOOD = [(f"profit rose {i}% in the quarter", "positive") for i in range(6)] + [
    (f"the loss widened by {i} million", "negative") for i in range(6)]
BAD = [(x, "negative" if y == "positive" else "positive") for x, y in GOOD]


def responses(n: int) -> list[tuple[str, str]]:
    return [(f"sales were up {i}%" + " and margins improved" * (i % 4),
             ["positive", "negative"][i % 2] + " overall" * (i % 3)) for i in range(n)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="embedded")
    p.add_argument("--n", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    add_threads_argument(p, default=1)
    p.add_argument("--no-save", action="store_true")
    a = p.parse_args()
    apply_threads(a.threads)
    model, tok = load_model(None if a.model == "embedded" else a.model, dtype="float32",
                            device="cpu")
    kw = dict(num_ratios=3, demos_per_set=4, sets_per_ratio=2, seed=0)
    resp = responses(a.n)
    scorers = {det: ICQSScorer(model, tok, GOOD, BAD, deterministic=det, **kw)
               for det in (False, True)}
    for s in scorers.values():
        _ = s.prefix_bank  # built once per scorer, outside the timing
    ids = [(tok(f"Question {i // 3}: is this good?" + " really" * (i % 5) + " Answer:")
            ["input_ids"], tok(f" option {i % 3}")["input_ids"]) for i in range(3 * a.n)]
    times: dict[str, list[float]] = {k: [] for k in ("icqs_default", "icqs_deterministic",
                                                      "cont_default", "cont_deterministic")}
    out: dict[str, list] = {}
    for _ in range(a.repeats):  # interleaved: both modes see the same machine load
        for det in (False, True):
            name = "deterministic" if det else "default"
            t0 = time.perf_counter()
            out[f"icqs_{name}"] = list(scorers[det].score(resp))
            times[f"icqs_{name}"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            out[f"cont_{name}"] = score_continuations(model, ids, deterministic=det)
            times[f"cont_{name}"].append(time.perf_counter() - t0)
    diff = max(float((x.loglik - y.loglik).abs().max())
               for x, y in zip(out["icqs_default"], out["icqs_deterministic"], strict=True))
    cdiff = max(abs(x.loglik - y.loglik)
                for x, y in zip(out["cont_default"], out["cont_deterministic"], strict=True))
    med = {k: statistics.median(v) for k, v in times.items()}
    rec = {
        "model": a.model, "threads": a.threads, "repeats": a.repeats,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}",
        "icqs": {"responses": a.n, "contexts": 6, **kw,
                 "default_s": med["icqs_default"], "deterministic_s": med["icqs_deterministic"],
                 "ratio": med["icqs_deterministic"] / med["icqs_default"],
                 "max_abs_loglik_diff": diff},
        "continuations": {"requests": len(ids), "default_s": med["cont_default"],
                          "deterministic_s": med["cont_deterministic"],
                          "ratio": med["cont_deterministic"] / med["cont_default"],
                          "max_abs_loglik_diff": cdiff},
        "times_s": times,
    }
    print(json.dumps(rec, indent=1))
    if not a.no_save:
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results",
                            "deterministic_cost.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(rec, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
