"""What sharing the query saves in pairwise scoring: ``score_pairs`` with the query's states
computed once per pair and context (``share_query=True``, the default) against each output's
prompt run whole after the prefix bank (``share_query=False``), on LLMBar Natural pairs with the
embedded model, interleaved in one run on one machine; both must give the same bits.

    python -m bench.scripts.query_once [--pairs 6] [--repeats 3] [--threads 1]

Prints one JSON object (median times, suffix tokens forwarded, ratio) and writes it to
bench/results/query_once.json unless --no-save.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from icqs_fast import ICQSScorer
from icqs_fast.engine.pairs import score_pairs
from icqs_fast.models import load_model
from icqs_fast.threads import add_threads_argument, apply_threads

LLMBAR = Path(__file__).resolve().parents[3] / "shared" / "data" / "llmbar" / "natural.json"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    add_threads_argument(p, default=1)
    p.add_argument("--no-save", action="store_true")
    a = p.parse_args()
    apply_threads(a.threads)
    rows = json.loads(LLMBAR.read_text(encoding="utf-8"))
    pairs = [(r["input"], r["output_1"], r["output_2"]) for r in rows]
    better = [int(r["label"]) for r in rows]
    # Demonstrations from the first 20 pairs (good: the better output), pairs judged from 60 on.
    good = [(pairs[i][0], pairs[i][better[i]]) for i in range(20)]
    bad = [(pairs[i][0], pairs[i][3 - better[i]]) for i in range(20)]
    test = pairs[60:60 + a.pairs]
    model, tok = load_model(None, dtype="float32", device="cpu")
    kw = dict(num_ratios=3, demos_per_set=1, sets_per_ratio=2, seed=0, drop_oldest_demos=True)
    times: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, int] = {}
    out: dict[bool, list] = {}
    for _ in range(a.repeats):  # interleaved: both ways see the same machine load
        for share in (True, False):
            sc = ICQSScorer(model, tok, good, bad, **kw)
            _ = sc.prefix_bank  # built outside the timing (the same for both)
            t0 = time.perf_counter()
            out[share] = list(score_pairs(sc, test, share_query=share))
            times[share].append(time.perf_counter() - t0)
            tokens[share] = sc.suffix_tokens
    same = all(torch.equal(getattr(x, r).loglik, getattr(y, r).loglik)
               for x, y in zip(out[True], out[False], strict=True)
               for r in ("result_a", "result_b"))
    med = {k: statistics.median(v) for k, v in times.items()}
    q = [len(tok(x, add_special_tokens=False).input_ids) for x, _, _ in test]
    y = [len(tok(v, add_special_tokens=False).input_ids) for _, ya, yb in test for v in (ya, yb)]
    rec = {
        "model": "embedded", "dtype": "float32", "threads": a.threads, "repeats": a.repeats,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}",
        "pairs": a.pairs, "contexts": 6, **kw,
        "query_tokens_mean": statistics.mean(q), "output_tokens_mean": statistics.mean(y),
        "shared_s": med[True], "whole_s": med[False], "speedup": med[False] / med[True],
        "shared_s_all": times[True], "whole_s_all": times[False],
        "suffix_tokens_shared": tokens[True], "suffix_tokens_whole": tokens[False],
        "same_bits": same,
    }
    print(json.dumps(rec, indent=2))
    if not a.no_save:
        dest = Path(__file__).resolve().parents[1] / "results" / "query_once.json"
        dest.write_text(json.dumps(rec, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
