"""``icqs-fast bench icqs --inputs long``: the ICQS engine on long prompts, with the cascade's
attention through PyTorch's kernel against the fused kernel, side by side in one run.

Workload: SummEval (``../shared/data/summeval``, read in place through
:func:`icqs_fast.allure.data.load_summeval`; never copied): x = a CNN/DailyMail article, y = a
summary of it. Good demonstrations are articles with their most consistent summary (expert
consistency >= 2.5), bad ones articles with a factually inconsistent summary (< 2.5), each
from another article, the longest articles first; the scored responses are other articles
with one of their summaries (consistent and inconsistent in turn). With
:data:`LONG_SETTINGS` (3 demonstrations per set, 2 ratios, 1 set each: 2 contexts) every prompt
holds 2-5k tokens (``prompt_tokens_min`` / ``_max``), so attention over the prefix sets the
speed: at ~3k keys a scored token costs about as much attention as linear-layer FLOPs in the
embedded model.

Fields (beside the workload's sizes):

* ``torch_attention_s``: a fresh engine over all responses (prefix caches included) with
  :data:`icqs_fast.engine.cascade.ATTENTION_ENV` = ``torch`` (PyTorch's CPU flash kernel or its
  math path); ``fast_s``: the same with ``auto`` (the fused kernel ``ops.attention_lse``
  picks: ``cpp`` on the CPU, ``triton`` on CUDA); the two interleaved ``repeats`` times,
  medians; ``attention_speedup = torch_attention_s / fast_s``.
* The distance to the limit as in ``bench icqs`` (:func:`icqs_fast.benchmarks.roofline.
  limit_fields`: ``model_gflop``, ``attention_gflop``, ``achieved_gflops``, ``limit_gflops``,
  ``fraction_of_limit`` and per CPU second) for ``fast_s``, and
  ``torch_attention_fraction_of_limit`` for ``torch_attention_s`` on the same counted FLOPs.
* Correctness, pass/fail: ``max_abs_loglik_diff_per_token`` (fast against torch attention,
  per scored token; <= ``LOGLIK_TOL`` at fp32, ``LOGLIK_TOL_16BIT`` for a 16-bit model) and
  ``score_agreement`` (== 1.0; scores within ``SCORE_TOL`` / ``SCORE_TOL_16BIT``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from icqs_fast.benchmarks import check_fields, emit_record, environment, report_failures
from icqs_fast.benchmarks import icqs as short

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# 3 demonstrations per set (~700-1000 tokens each from the longest articles), the all-bad and
# all-good ratios, one set each: 2 contexts whose prefixes hold ~2.5-3k tokens, plus the query
# article: prompts of 2-5k tokens, small enough for a few minutes on 2 shared cores.
LONG_SETTINGS = dict(num_ratios=2, demos_per_set=3, sets_per_ratio=1, seed=0)
# Articles kept for the demonstration pools (per pool) and their order: longest first.
POOL_SIZE = 3


def long_template():
    """The prompt template of the long workload (an article, then its summary)."""
    from icqs_fast.engine.prompts import Template

    return Template(system="Summaries of news articles, faithful to the article or not.\n\n",
                    demo="Article: {x}\nSummary: {y}\n", query="Article: {x}\nSummary:",
                    response=" {y}\n", separator="\n")


def summeval_workload(n_queries: int, path: str | None = None
                      ) -> tuple[list[tuple[str, str]], list[tuple[str, str]],
                                 list[tuple[str, str]]]:
    """``(good, bad, responses)`` from SummEval (see the module docstring): :data:`POOL_SIZE`
    good and bad demonstrations and ``n_queries`` responses, each from its own article, the
    longest articles first. Raises FileNotFoundError naming the file when SummEval is absent."""
    from icqs_fast.allure.data import SUMMEVAL_THRESHOLD, load_summeval

    if n_queries < 1:
        raise ValueError(f"--responses must be >= 1, got {n_queries}")
    by_article: dict[str, list] = {}
    for r in load_summeval(path):
        by_article.setdefault(r.id.split("/")[0], []).append(r)
    # Longest articles first (characters: no tokenizer needed); ties by id, so the order is fixed.
    order = sorted(by_article, key=lambda a: (-len(by_article[a][0].fields["article"]), a))
    good: list[tuple[str, str]] = []
    bad: list[tuple[str, str]] = []
    queries: list[tuple[str, str]] = []
    for a in order:
        rows = by_article[a]
        article = rows[0].fields["article"]
        wrong = [r for r in rows if r.truth == "1"]
        if len(bad) < POOL_SIZE and wrong:
            bad.append((article, wrong[0].fields["summary"]))
        elif len(good) < POOL_SIZE:
            best = max(rows, key=lambda r: (r.truth == "0", r.line))
            if best.truth == "0":
                good.append((article, best.fields["summary"]))
        elif len(queries) < n_queries:
            want = "1" if len(queries) % 2 else "0"  # consistent and inconsistent in turn
            pick = next((r for r in rows if r.truth == want), rows[0])
            queries.append((article, pick.fields["summary"]))
        if len(queries) >= n_queries:
            break
    if len(good) < POOL_SIZE or len(bad) < POOL_SIZE or len(queries) < n_queries:
        raise ValueError(f"SummEval gave {len(good)} good / {len(bad)} bad demonstrations and "
                         f"{len(queries)} responses (consistency threshold "
                         f"{SUMMEVAL_THRESHOLD}); need {POOL_SIZE}, {POOL_SIZE}, {n_queries}")
    return good, bad, queries


@contextlib.contextmanager
def cascade_attention(path: str) -> Iterator[None]:
    """The cascade's attention path for the duration (``"torch"`` or ``"auto"``), through
    :data:`icqs_fast.engine.cascade.ATTENTION_ENV` (read at every layer call)."""
    from icqs_fast.engine.cascade import ATTENTION_ENV

    old = os.environ.get(ATTENTION_ENV)
    os.environ[ATTENTION_ENV] = path
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ATTENTION_ENV, None)
        else:
            os.environ[ATTENTION_ENV] = old


def _scorer(model: PreTrainedModel, tok: PreTrainedTokenizerBase, good, bad, settings: dict):
    from icqs_fast.engine.scorer import ICQSScorer
    from icqs_fast.engine.settings import ScoringSettings

    return ICQSScorer(model, tok, good, bad,
                      ScoringSettings(template=long_template(), **settings))


def bench_long(n_queries: int = 2, device: str | torch.device = "auto",
               dtype: str | None = None, settings: dict | None = None, repeats: int = 1,
               model_tok_name: tuple | None = None, data_path: str | None = None) -> dict:
    """The ``--inputs long`` record (fields: the module docstring). ``dtype``: as
    :func:`icqs_fast.benchmarks.icqs.load` (None: fp32 on the CPU); ``settings`` override
    :data:`LONG_SETTINGS`; ``model_tok_name``: a loaded ``(model, tokenizer, name)`` instead of
    the embedded model (tests)."""
    from icqs_fast.benchmarks import roofline

    settings = dict(LONG_SETTINGS, **(settings or {}))
    if repeats < 1:
        raise ValueError(f"--cold-repeats must be >= 1, got {repeats}")
    good, bad, resp = summeval_workload(n_queries, data_path)
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if str(device) == "auto"
                       else str(device))
    if model_tok_name is None:
        model_tok_name = short.load(dev, False, "llama-1b", dtype)
    model, tok, name = model_tok_name
    from icqs_fast.models import dtype_name

    model_dtype = next(model.parameters()).dtype
    # The probe runs the matmuls the model runs (bf16-mixed: fp32 on oneDNN's kernels).
    computes = dtype_name(model)

    # Warm-up of both paths (lazy imports, kernels, allocator) on one response, untimed.
    for path in ("torch", "auto"):
        with cascade_attention(path):
            list(_scorer(model, tok, good, bad, dict(settings, num_ratios=2, demos_per_set=1)
                         ).score(resp[:1]))

    # The FLOPs of the work (counted once: both paths compute the same products), then the
    # matmul probe before and after the timed runs (the better kept).
    with cascade_attention("auto"):
        flops, _ = roofline.count_flops(
            lambda: list(_scorer(model, tok, good, bad, settings).score(resp)))
    probes = [roofline.matmul_probe(flops, computes, dev)]

    walls: dict[str, list[float]] = {"torch": [], "auto": []}
    cpus: dict[str, list[float]] = {"torch": [], "auto": []}
    results: dict[str, list] = {}
    scorer = None
    for _ in range(repeats):
        for path in ("torch", "auto"):
            with cascade_attention(path):
                _sync(dev)
                t0, c0 = time.perf_counter(), time.process_time()
                scorer = _scorer(model, tok, good, bad, settings)
                results[path] = list(scorer.score(resp))
                _sync(dev)
                walls[path].append(time.perf_counter() - t0)
                cpus[path].append(time.process_time() - c0)
    probes.append(roofline.matmul_probe(flops, computes, dev))
    torch_s, fast_s = statistics.median(walls["torch"]), statistics.median(walls["auto"])
    fast_cpu = statistics.median(cpus["auto"])

    exact = model_dtype == torch.float32
    score_tol = short.SCORE_TOL if exact else short.SCORE_TOL_16BIT
    tokens = scorer.tokens
    r_lens, prompt_lens = [], []
    bank = scorer.prefix_bank
    for i, (x, y) in enumerate(resp):
        lay = tokens.layouts(i, x, y, None, False)[0]
        r_lens.append(len(lay.ids) - lay.n_prompt)
        q, _ = tokens.response_parts(i, x, y)
        prompt_lens += [n + len(q) for n in bank.lengths[:scorer.n_contexts]]
    diffs = [float((a.loglik.double() - b.loglik.double()).abs().max())
             for a, b in zip(results["auto"], results["torch"], strict=True)]
    agree = sum(short.scores_agree(a, b, score_tol, per_set=exact)
                for a, b in zip(results["auto"], results["torch"], strict=True)) / len(resp)
    limit = roofline.limit_fields(flops, fast_s, fast_cpu if dev.type == "cpu" else None,
                                  probes)
    torch_fields = roofline.limit_fields(flops, torch_s, None, probes)
    return {
        "inputs": "long",
        "data": "SummEval (../shared/data/summeval)",
        "model": name,
        "device": dev.type,
        "dtype": computes,
        "responses": len(resp),
        "contexts": scorer.n_contexts,
        "demo_tokens_mean": round(sum(bank.lengths[:scorer.n_contexts]) / scorer.n_contexts, 1),
        "prompt_tokens_min": min(prompt_lens),
        "prompt_tokens_max": max(prompt_lens),
        "response_tokens_mean": round(sum(r_lens) / len(r_lens), 2),
        "torch_attention_s": round(torch_s, 4),
        "fast_s": round(fast_s, 4),
        "attention_speedup": round(torch_s / fast_s, 3),
        "times_s": {("fast" if k == "auto" else "torch_attention"): [round(t, 3) for t in v]
                    for k, v in walls.items()},
        "fast_cpu_s": round(fast_cpu, 3),
        "torch_attention_cpu_s": round(statistics.median(cpus["torch"]), 3),
        "max_abs_loglik_diff": max(diffs),
        "max_abs_loglik_diff_per_token": max(d / max(n, 1) for d, n in zip(diffs, r_lens,
                                                                             strict=True)),
        "score_agreement": agree,
        "score_tolerance": score_tol,
        "cascade": scorer.cascade,
        "path": scorer.plan.message,
        "settings": settings,
        "threads": torch.get_num_threads(),
        **limit,
        "torch_attention_achieved_gflops": torch_fields["achieved_gflops"],
        "torch_attention_fraction_of_limit": torch_fields["fraction_of_limit"],
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace) -> int:
    """``bench icqs --inputs long``: the record, printed and written, then its correctness
    fields checked (exit 1 naming a failing one)."""
    from icqs_fast.threads import apply_threads

    if args.random_weights or args.calibrate not in (None, "none") or args.answers != "labels":
        raise ValueError("--inputs long runs the embedded model on SummEval: --random-weights, "
                         "--calibrate and --answers are for --inputs short")
    apply_threads(args.threads)
    t0 = time.perf_counter()
    rec = bench_long(2 if args.responses is None else args.responses, args.device, args.dtype,
                     repeats=1 if args.cold_repeats is None else args.cold_repeats)
    rec["bench_s"] = round(time.perf_counter() - t0, 1)
    rec.update(environment(rec["device"]))
    emit_record(rec, out=args.out, as_json=args.json)
    from icqs_fast.models import MIXED_NAME

    # fp32 activations (float32, bf16-mixed): both attention paths compute fp32 products.
    exact = rec["dtype"] in ("float32", MIXED_NAME)
    default = short.LOGLIK_TOL if exact else short.LOGLIK_TOL_16BIT
    return report_failures("icqs --inputs long", check_fields(
        rec, short.checks(default if args.tolerance is None else args.tolerance)))
