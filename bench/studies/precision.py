"""Which precision to score in on this CPU: ``float32``, ``bfloat16`` (the pure bf16 forward),
``bf16-mixed`` (:func:`icqs_fast.models.to_bf16_mixed`), ``--dtype auto`` (whatever
:func:`icqs_fast.models.choose_dtype` picks here) and torch's dynamic int8 linear layers, side by
side on the same held-out answers.

Data: SST-2 (``../shared/data/sst2/dev.tsv``) and/or the Financial PhraseBank (``--data``)
through the study's data builders (:func:`icqs_fast.evals.study_data.sentiment_data`: 32 + 32
demonstration pools, ``--answers`` test answers per data set, half correct and half incorrect
labels), scored by the embedded model with the default
settings (M+1 = 5, L = 4, N = 8, label-stratified sets, the posterior-mean score). Every variant
loads its own model through :func:`icqs_fast.models.load_model`; ``int8-dynamic`` is the float32
model with the decoder's ``nn.Linear`` layers swapped for
``torch.ao.quantization.quantize_dynamic`` ones (int8 weights, activations quantized per call;
the LM head and embeddings stay float32).

The variants run interleaved, ``--repeats`` rounds, each a fresh engine over all answers
(prefix bank included): the medians of wall and process CPU seconds, the speed ratio to float32,
and each variant's scores against float32's: the fraction of answers whose default score is
within 0.01 (the stability goal is >= 99 %), the largest change, and the same for the per-set
scores.

``echo``: what a user of the server's echo log-probs reads
(:func:`icqs_fast.serve.logprobs.prompt_logprobs`): a 215-token passage (the first SummEval
article) alone and inside one request beside prompts of other lengths, two of which share its
start (so it runs as a suffix of the prefix bank); per variant the largest per-token difference
between the two, and against float32's alone (per token and summed over the passage).

``python -m bench.studies.precision --json --out FILE``; exit 1 when the default (``auto``)
misses its promises (:func:`default_failures`).

``--rounding``: the rounding study instead (:func:`rounding_study`): the echo passage through the
bf16-mixed model with the input activations of chosen linears rounded to bf16 (what a one-pass
bf16 matmul does: "plan B"), against float32 and alone vs inside the request.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time
from typing import Any

import torch

from icqs_fast.io.files import write_whole
from icqs_fast.options import add_json_argument
from icqs_fast.threads import add_threads_argument, apply_threads

VARIANTS = ("float32", "bfloat16", "bf16-mixed", "auto", "int8-dynamic")
DATASETS = ("sst2", "fpb")
# The echo passage: the first SummEval article's first tokens (../shared/data/summeval).
ECHO_TOKENS = 215
# The stability goal a faster precision must keep: the default score within this of float32's
# for at least AGREE_FRACTION of the answers.
SCORE_TOL = 0.01
AGREE_FRACTION = 0.99
# What the default dtype promises (``--dtype``'s help): a row's echo log-probs independent of its
# batch neighbours, and near float32's (bf16 weights alone move the passage ~0.07 nats/token).
ECHO_INVARIANCE_TOL = 1e-3
ECHO_VS_FP32_TOL = 0.08


def load_variant(name: str) -> tuple[Any, Any, str]:
    """``(model, tokenizer, dtype reason)`` of one variant of the embedded model on the CPU."""
    from icqs_fast.models import dtype_choice_of, dtype_name, load_model

    if name == "int8-dynamic":
        from torch.ao.quantization import quantize_dynamic

        model, tok = load_model(None, dtype="float32", device="cpu")
        model = copy.deepcopy(model)
        # The body's linears only: the engine reads the LM head's weight for its fused
        # statistics, and the embeddings are tied to it.
        quantize_dynamic(model.model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
        return model, tok, "float32 weights, decoder linears as dynamic int8 (qint8)"
    model, tok = load_model(None, dtype=name, device="cpu")
    return model, tok, f"{dtype_name(model)}: {dtype_choice_of(model).reason}"


def answers(n: int, seed: int = 0, dataset: str = "sst2"):
    """The demonstration pools and ``n`` held-out answers (half correct, half incorrect) of
    ``dataset`` (``"sst2"`` or ``"fpb"``)."""
    from icqs_fast.evals.study_data import sentiment_data

    data = sentiment_data(dataset, pool=32, limit=(n + 1) // 2, seed=seed)
    resp = [r for pair in zip(data.groups["correct"], data.groups["incorrect"], strict=True)
            for r in pair][:n]
    return data.good, data.bad, [(r.x, r.y) for r in resp]


def _scorer(model, tok, good, bad):
    from icqs_fast.evals.study import StudySettings, make_scorer

    return make_scorer(model, tok, good, bad, 8, StudySettings(stratify=True, score="mean"))


def echo_passage(tok) -> tuple[list[int], list[list[int]]]:
    """The echo check's passage (token ids) and the request beside it: its neighbours of other
    lengths, two sharing its start, and the passage at index 2."""
    from icqs_fast.io.datasets import shared_data_dir

    with open(shared_data_dir() / "summeval" / "summeval.jsonl", encoding="utf-8") as f:
        article = json.loads(f.readline())["article"]
    ids = tok(article)["input_ids"][:ECHO_TOKENS]
    fox = tok("The quick brown fox jumps over the lazy dog. " * 7)["input_ids"]
    return ids, [fox[:9], ids[:40] + fox[:20], ids, fox[:50], ids[:120] + fox[:3]]


def echo_logprobs(model, tok, passage: tuple[list[int], list[list[int]]] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The passage's echo log-probs ``[len(ids) - 1]`` fp32: alone, and inside the request
    (``passage``: ``(ids, request)`` with the passage at index 2; default :func:`echo_passage`)."""
    from icqs_fast.serve.logprobs import prompt_logprobs

    ids, request = passage if passage is not None else echo_passage(tok)
    pad = tok.pad_token_id
    with torch.no_grad():
        alone = prompt_logprobs(model, [ids], pad_id=pad)[0].token_logprobs
        inside = prompt_logprobs(model, request, pad_id=pad)[2].token_logprobs
    return torch.tensor(alone), torch.tensor(inside)


# The decoder's linear layers by name (Llama-style), for the rounding study.
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The rounding study's rows: a label and the linears whose input activations are rounded.
ROUNDING_ROWS = (("none", ()), ("every decoder linear (plan B)", LINEARS),
                 *((f"{n} only", (n,)) for n in LINEARS),
                 ("q + k + v", LINEARS[:3]), ("gate + up", LINEARS[4:6]),
                 ("q + k + v + gate + up", LINEARS[:3] + LINEARS[4:6]))


@contextlib.contextmanager
def rounded_inputs(model, names):
    """Inside: the input activations of ``model``'s ``nn.Linear`` layers whose name ends with one
    of ``names`` are rounded to bf16 values (one rounding, kept fp32), what a one-pass bf16
    matmul does to them ("plan B"); the weights and the product are untouched. Hooks removed
    on exit."""
    def hook(_m, args):
        return (args[0].bfloat16().float(),) + tuple(args[1:])

    hooks = [m.register_forward_pre_hook(hook) for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in names]
    try:
        yield len(hooks)
    finally:
        for h in hooks:
            h.remove()


def rounding_study(fp32, mixed, tok, rows=ROUNDING_ROWS, passage=None) -> list[dict[str, Any]]:
    """Which matmul inputs a bf16 product could round: per row of ``rows`` (label, linear
    names), the echo log-probs of ``mixed`` (a bf16-mixed model) with those linears' input
    activations rounded to bf16 (:func:`rounded_inputs`): the largest per-token difference
    against ``fp32``'s alone, its sum over the passage, and alone vs inside the request (the
    batch-invariance promise, :data:`ECHO_INVARIANCE_TOL`)."""
    ref = echo_logprobs(fp32, tok, passage)[0]
    out = []
    for label, names in rows:
        with rounded_inputs(mixed, names) as n:
            alone, inside = echo_logprobs(mixed, tok, passage)
        out.append({"rounded": label, "linears": n,
                    "echo_vs_fp32_max_per_token": float((alone - ref).abs().max()),
                    "echo_vs_fp32_passage_sum": float((alone - ref).sum()),
                    "echo_alone_vs_request_max_per_token": float((alone - inside).abs().max())})
    return out


def bench(n_answers: int = 32, repeats: int = 3, variants=VARIANTS,
          threads: int | None = None, datasets=("sst2",)) -> dict[str, Any]:
    """The record (see the module docstring)."""
    if threads is not None:
        apply_threads(threads)
    unknown = set(variants) - set(VARIANTS)
    if unknown or "float32" not in variants:
        raise ValueError(f"variants must include float32 and come from {VARIANTS}")
    if set(datasets) - set(DATASETS) or not datasets:
        raise ValueError(f"datasets must come from {DATASETS}")
    work = {d: answers(n_answers, dataset=d) for d in datasets}
    loaded = {v: load_variant(v) for v in variants}
    for model, tok, _ in loaded.values():  # warm-up: lazy imports, allocator, capability
        good, bad, resp = work[datasets[0]]
        list(_scorer(model, tok, good, bad).score(resp[:1]))
    echo = {v: echo_logprobs(m, t) for v, (m, t, _) in loaded.items()}
    times: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    scores: dict[str, dict[str, list]] = {v: {} for v in variants}
    for _ in range(repeats):
        for v in variants:
            model, tok, _ = loaded[v]
            wall = cpu_s = 0.0
            for d, (good, bad, resp) in work.items():
                t0, c0 = time.perf_counter(), time.process_time()
                got = list(_scorer(model, tok, good, bad).score(resp))
                wall += time.perf_counter() - t0
                cpu_s += time.process_time() - c0
                scores[v][d] = [(r.score, list(r.score_per_set)) for r in got]
            times[v].append(wall)
            cpu[v].append(cpu_s)
    base_s, base_cpu = statistics.median(times["float32"]), statistics.median(cpu["float32"])
    n_total = sum(len(w[2]) for w in work.values())
    out: dict[str, Any] = {"bench": "precision", "model": "SmolLM2-135M-Instruct (embedded)",
                           "data": f"{' + '.join(datasets)}: {n_answers} held-out answers each "
                                   f"({n_total} in all; half correct, half incorrect labels), "
                                   "pools of 32 + 32",
                           "settings": "M+1=5, L=4, N=8, label-stratified, score=mean",
                           "repeats": repeats, "threads": torch.get_num_threads(),
                           "echo_passage": f"the first SummEval article, {ECHO_TOKENS} tokens; "
                                           "the request: 5 prompts of 9-215 tokens, two "
                                           "sharing its first 40 / 120 tokens",
                           "variants": {}}
    for v in variants:
        pairs = [(a, b) for d in datasets
                 for a, b in zip(scores[v][d], scores["float32"][d], strict=True)]
        d_all = [abs(a[0] - b[0]) for a, b in pairs]
        dset = [abs(x - y) for a, b in pairs for x, y in zip(a[1], b[1], strict=True)]
        med, med_cpu = statistics.median(times[v]), statistics.median(cpu[v])
        within = sum(x <= SCORE_TOL for x in d_all) / len(d_all)
        per_data = {}
        for d in datasets:
            dd = [abs(a[0] - b[0]) for a, b in zip(scores[v][d], scores["float32"][d],
                                                    strict=True)]
            per_data[d] = {"score_within_0.01": round(sum(x <= SCORE_TOL for x in dd)
                                                      / len(dd), 4),
                           "max_score_change": round(max(dd), 5)}
        alone, inside = echo[v]
        fp_alone = echo["float32"][0]
        out["variants"][v] = {
            "dtype_reason": loaded[v][2], "wall_s": round(med, 2), "cpu_s": round(med_cpu, 2),
            "wall_all_s": [round(t, 2) for t in times[v]],
            "speedup_vs_fp32": round(base_s / med, 3),
            "cpu_speedup_vs_fp32": round(base_cpu / med_cpu, 3),
            "score_within_0.01": round(within, 4), "max_score_change": round(max(d_all), 5),
            "per_set_within_0.01": round(sum(x <= SCORE_TOL for x in dset) / len(dset), 4),
            "max_per_set_change": round(max(dset), 5),
            "per_dataset": per_data,
            "passes_stability": within >= AGREE_FRACTION,
            "echo_alone_vs_request_max_per_token": float((alone - inside).abs().max()),
            "echo_vs_fp32_max_per_token": float((alone - fp_alone).abs().max()),
            "echo_vs_fp32_passage_sum": float((alone - fp_alone).sum())}
    from icqs_fast.benchmarks import environment

    out.update(environment("cpu"))
    return out


def default_failures(rec: dict[str, Any]) -> list[str]:
    """The default dtype's (``auto``) promises its variant in ``rec`` misses: score stability,
    echo batch invariance, echo distance to float32. Empty: kept, or ``auto`` not measured."""
    r = rec["variants"].get("auto")
    if r is None:
        return []
    bad = []
    if not r["passes_stability"]:
        bad.append(f"auto: {r['score_within_0.01']:.1%} of scores within {SCORE_TOL} of "
                   f"float32 (< {AGREE_FRACTION:.0%})")
    if r["echo_alone_vs_request_max_per_token"] > ECHO_INVARIANCE_TOL:
        bad.append(f"auto: echo alone vs inside a request differs by "
                   f"{r['echo_alone_vs_request_max_per_token']:.3g} nats/token "
                   f"(> {ECHO_INVARIANCE_TOL})")
    if r["echo_vs_fp32_max_per_token"] > ECHO_VS_FP32_TOL:
        bad.append(f"auto: echo is {r['echo_vs_fp32_max_per_token']:.3g} nats/token from "
                   f"float32 (> {ECHO_VS_FP32_TOL})")
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.studies.precision",
                                description=__doc__.splitlines()[0])
    p.add_argument("--answers", type=int, default=32,
                   help="held-out answers per data set (default 32)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)} (float32 required)")
    p.add_argument("--data", default="sst2",
                   help=f"comma-separated subset of {','.join(DATASETS)} (default sst2)")
    add_threads_argument(p)
    add_json_argument(p, "print the record as JSON")
    p.add_argument("--out", default=None, help="also write the JSON record here")
    p.add_argument("--rounding", action="store_true",
                   help="instead: the rounding study (rounding_study: which linears' inputs "
                        "a one-pass bf16 matmul could round, on the echo passage)")
    a = p.parse_args(argv)
    if a.rounding:
        apply_threads(a.threads)
        fp32, tok, _ = load_variant("float32")
        mixed, _, _ = load_variant("bf16-mixed")
        rows = rounding_study(fp32, mixed, tok)
        from icqs_fast.benchmarks import environment

        text = json.dumps({"bench": "precision-rounding", "echo_passage": ECHO_TOKENS, "rows": rows,
                           **environment("cpu")}, indent=1)
        if a.out:
            write_whole(a.out, text + "\n")
        for r in rows:
            print(f"{r['rounded']:32s} vs fp32 {r['echo_vs_fp32_max_per_token']:.4f}/token "
                  f"(sum {r['echo_vs_fp32_passage_sum']:+.3f})  alone vs request "
                  f"{r['echo_alone_vs_request_max_per_token']:.2e}")
        return 0
    rec = bench(a.answers, a.repeats, tuple(a.variants.split(",")), a.threads,
                tuple(a.data.split(",")))
    text = json.dumps(rec, indent=1)
    if a.out:
        write_whole(a.out, text + "\n")
    if a.json:
        print(text)
    else:
        for v, r in rec["variants"].items():
            print(f"{v:13s} {r['wall_s']:8.1f} s  x{r['speedup_vs_fp32']:.2f} (cpu "
                  f"x{r['cpu_speedup_vs_fp32']:.2f})  within 0.01: {r['score_within_0.01']:.1%}"
                  f"  max change {r['max_score_change']:.4f}  echo: alone vs request "
                  f"{r['echo_alone_vs_request_max_per_token']:.2g}, vs fp32 "
                  f"{r['echo_vs_fp32_max_per_token']:.3f}/token  ({r['dtype_reason']})")
    failures = default_failures(rec)
    for line in failures:
        print(f"FAILED {line}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
