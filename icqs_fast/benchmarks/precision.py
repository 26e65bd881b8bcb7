"""Which precision to score in on this CPU: ``float32``, ``bfloat16``, ``--dtype auto`` (whatever
:func:`icqs_fast.models.choose_dtype` picks here) and torch's dynamic int8 linear layers, side by
side on the same held-out answers.

Data: SST-2 (``../shared/data/sst2/dev.tsv``) through the study's data builder
(:func:`icqs_fast.evals.study_data.sst2_data`: 32 + 32 demonstration pools, ``--answers`` test
answers, half correct and half incorrect labels), scored by the embedded model with the default
settings (M+1 = 5, L = 4, N = 8, label-stratified sets, the posterior-mean score). Every variant
loads its own model through :func:`icqs_fast.models.load_model`; ``int8-dynamic`` is the float32
model with the decoder's ``nn.Linear`` layers swapped for
``torch.ao.quantization.quantize_dynamic`` ones (int8 weights, activations quantized per call;
the LM head and embeddings stay float32).

The variants run interleaved, ``--repeats`` rounds, each a fresh engine over all answers
(prefix bank included): the medians of wall and process CPU seconds, the speed ratio to float32,
and each variant's scores against float32's: the fraction of answers whose default score is
within 0.01 (the stability goal is >= 99 %), the largest change, and the same for the per-set
scores. ``python -m icqs_fast.benchmarks.precision --json --out FILE``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from typing import Any

import torch

VARIANTS = ("float32", "bfloat16", "auto", "int8-dynamic")
# The stability goal a faster precision must keep: the default score within this of float32's
# for at least AGREE_FRACTION of the answers.
SCORE_TOL = 0.01
AGREE_FRACTION = 0.99


def load_variant(name: str) -> tuple[Any, Any, str]:
    """``(model, tokenizer, dtype reason)`` of one variant of the embedded model on the CPU."""
    from icqs_fast.models import dtype_choice_of, load_model

    if name == "int8-dynamic":
        from torch.ao.quantization import quantize_dynamic

        model, tok = load_model(None, dtype="float32", device="cpu")
        model = copy.deepcopy(model)
        # The body's linears only: the engine reads the LM head's weight for its fused
        # statistics, and the embeddings are tied to it.
        quantize_dynamic(model.model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
        return model, tok, "float32 weights, decoder linears as dynamic int8 (qint8)"
    model, tok = load_model(None, dtype=name, device="cpu")
    return model, tok, dtype_choice_of(model).reason


def answers(n: int, seed: int = 0):
    """The demonstration pools and ``n`` held-out answers (half correct, half incorrect)."""
    from icqs_fast.evals.study_data import sst2_data

    data = sst2_data(pool=32, limit=(n + 1) // 2, seed=seed)
    resp = [r for pair in zip(data.groups["correct"], data.groups["incorrect"], strict=True)
            for r in pair][:n]
    return data.good, data.bad, [(r.x, r.y) for r in resp]


def _scorer(model, tok, good, bad):
    from icqs_fast.evals.study import StudySettings, make_scorer

    return make_scorer(model, tok, good, bad, 8, StudySettings(stratify=True, score="mean"))


def bench(n_answers: int = 32, repeats: int = 3, variants=VARIANTS,
          threads: int | None = None) -> dict[str, Any]:
    """The record (see the module docstring)."""
    if threads is not None:
        torch.set_num_threads(threads)
    unknown = set(variants) - set(VARIANTS)
    if unknown or "float32" not in variants:
        raise ValueError(f"variants must include float32 and come from {VARIANTS}")
    good, bad, resp = answers(n_answers)
    loaded = {v: load_variant(v) for v in variants}
    for model, tok, _ in loaded.values():  # warm-up: lazy imports, allocator, capability
        list(_scorer(model, tok, good, bad).score(resp[:1]))
    times: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    scores: dict[str, list] = {}
    for _ in range(repeats):
        for v in variants:
            model, tok, _ = loaded[v]
            t0, c0 = time.perf_counter(), time.process_time()
            got = list(_scorer(model, tok, good, bad).score(resp))
            times[v].append(time.perf_counter() - t0)
            cpu[v].append(time.process_time() - c0)
            scores[v] = [(r.score, list(r.score_per_set)) for r in got]
    base, base_s, base_cpu = scores["float32"], statistics.median(times["float32"]), \
        statistics.median(cpu["float32"])
    out: dict[str, Any] = {"bench": "precision", "model": "SmolLM2-135M-Instruct (embedded)",
                           "data": f"SST-2 dev, {len(resp)} held-out answers (half correct, "
                                   "half incorrect), pools of 32 + 32",
                           "settings": "M+1=5, L=4, N=8, label-stratified, score=mean",
                           "repeats": repeats, "threads": torch.get_num_threads(),
                           "variants": {}}
    for v in variants:
        d = [abs(a[0] - b[0]) for a, b in zip(scores[v], base, strict=True)]
        dset = [abs(x - y) for a, b in zip(scores[v], base, strict=True)
                for x, y in zip(a[1], b[1], strict=True)]
        med, med_cpu = statistics.median(times[v]), statistics.median(cpu[v])
        within = sum(x <= SCORE_TOL for x in d) / len(d)
        out["variants"][v] = {
            "dtype_reason": loaded[v][2], "wall_s": round(med, 2), "cpu_s": round(med_cpu, 2),
            "wall_all_s": [round(t, 2) for t in times[v]],
            "speedup_vs_fp32": round(base_s / med, 3),
            "cpu_speedup_vs_fp32": round(base_cpu / med_cpu, 3),
            "score_within_0.01": round(within, 4), "max_score_change": round(max(d), 5),
            "per_set_within_0.01": round(sum(x <= SCORE_TOL for x in dset) / len(dset), 4),
            "max_per_set_change": round(max(dset), 5),
            "passes_stability": within >= AGREE_FRACTION}
    from icqs_fast.benchmarks import environment

    out.update(environment("cpu"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m icqs_fast.benchmarks.precision",
                                description=__doc__.splitlines()[0])
    p.add_argument("--answers", type=int, default=32, help="held-out answers (default 32)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)} (float32 required)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", action="store_true", help="print the record as JSON")
    p.add_argument("--out", default=None, help="also write the JSON record here")
    a = p.parse_args(argv)
    rec = bench(a.answers, a.repeats, tuple(a.variants.split(",")), a.threads)
    text = json.dumps(rec, indent=1)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    if a.json:
        print(text)
    else:
        for v, r in rec["variants"].items():
            print(f"{v:13s} {r['wall_s']:8.1f} s  x{r['speedup_vs_fp32']:.2f} (cpu "
                  f"x{r['cpu_speedup_vs_fp32']:.2f})  within 0.01: {r['score_within_0.01']:.1%}"
                  f"  max change {r['max_score_change']:.4f}  ({r['dtype_reason']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
