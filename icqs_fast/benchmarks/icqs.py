"""``icqs-fast bench icqs``: the ICQS engine (:class:`icqs_fast.ICQSScorer`) against the naive
method (:func:`icqs_fast.engine.reference.icqs_naive`: one full forward, full-vocabulary logits and
``log_softmax`` per (response, demonstration set)) in one run, on the same responses.

Setting: ``M+1 = 5`` ratios, ``L = 4`` sets per ratio, ``N = 8`` demonstrations per set (20
contexts per response), demonstrations from the built-in financial-news files
(``icqs_fast/data/demo_good.jsonl`` / ``demo_bad.jsonl``) and responses from the short
financial-news headlines below (written for this benchmark; each headline is scored with both
answers), with the ``icqs-fast demo`` prompt template.

Fields:

* ``naive_s``: the naive method over all responses; ``fast_s``: a fresh engine over all
  responses, *including* the computation of its prefix caches (``prefix_s`` of it);
  ``speedup = naive_s / fast_s``.
* ``cold_single_speedup``: a fresh engine scoring one response (prefix caches included) against
  the naive method on that response; each side runs ``cold_repeats`` times, interleaved, and the
  ratio is of the medians (one sample of each swings by 10-20% on a shared machine).
* ``peak_mem_*_mb``: per side in a fresh subprocess, after loading the model and a warm-up, the
  growth of peak RSS (CPU; reset through ``/proc/self/clear_refs``) or of
  ``torch.cuda.max_memory_allocated`` (CUDA) while scoring ``mem_responses`` responses (the
  naive peak is per prompt, so its count does not matter; the engine runs full-size batches).
  ``mem_ratio = peak_mem_naive_mb / peak_mem_fast_mb`` (above 1: the engine needs less, as in
  ``bench attention``); ``prefix_bank_mb`` is the stored prefix KV states alone (every
  context's keys and values, all layers), which the engine keeps for as long as it scores.
* ``max_abs_loglik_diff``: largest ``|loglik_fast - loglik_naive|`` over all responses and
  contexts, and ``max_abs_loglik_diff_per_token`` the same divided by each response's token
  count (fp32 rounding differences add up over the answer's tokens); ``score_agreement``:
  fraction of responses whose ICQS-Epistemic score and per-set ICQS scores agree (identical for
  the argmax and tied scores, within ``SCORE_TOL`` for the posterior mean; ``score_tolerance``:
  for a 16-bit model, whose rounding differs at every layer, ``SCORE_TOL_16BIT`` on the
  ICQS-Epistemic score alone). Both
  sides run with one :class:`~icqs_fast.engine.settings.ScoringSettings` (``scoring_settings``:
  its fingerprint, default ``stratify="auto"``); the command exits 1, naming the field on
  stderr, unless ``score_agreement == 1.0`` and ``max_abs_loglik_diff_per_token <=
  --tolerance`` (default ``LOGLIK_TOL = 1e-4`` per token; ``LOGLIK_TOL_16BIT`` for a 16-bit
  model), after the record is printed and written.

Distance to the machine's limit (:mod:`icqs_fast.benchmarks.roofline`): ``model_gflop`` (the
matmul FLOPs the engine computed in ``fast_s``'s work, counted in a separate untimed pass of the
same work: ``linear_gflop`` in the decoder's projections, ``attention_gflop``, ``head_gflop`` in
the fused LM-head statistics), ``achieved_gflops = model_gflop / fast_s``, ``limit_gflops``: this
machine's ``F.linear`` rate on the model's own linear shapes at the rows the engine used, in the
model's dtype and at the run's thread count (a short probe before and after the timed run, the
better kept), ``fraction_of_limit = achieved_gflops / limit_gflops``; on the CPU the same per
process CPU second (``*_cpu``), steadier on a shared machine.

``--calibrate content_free|pmi`` adds ``calibrated_fast_s`` and
``uncalibrated_fast_s`` (fresh engines, prefix caches included, the two interleaved
``cold_repeats`` times, medians) and ``calibration_overhead`` = their ratio (the target is
<= 1.3), plus ``calibration_rows`` (baseline rows scored; each (query, answer) pair once per
context). Not a pass/fail field: a timing on a shared machine. The calibrated engine's last run
is checked against the reference with the same settings on its first
``CALIBRATION_CHECK_RESPONSES`` responses: ``max_abs_baseline_diff_per_token`` (<=
``--tolerance``) and ``calibrated_score_agreement`` (== 1.0) are pass/fail fields.
``--answers free-text`` scores each headline with a distinct one-sentence answer
(:func:`free_text_answer`) instead of a label, so no baseline is shared between responses: the
calibration's worst case.

``--random-weights --config llama-1b`` uses a ~1.1B-parameter Llama with random weights (bf16 on
CUDA, fp32 on the CPU) and the embedded model's tokenizer, for GPU runs; ``--config tiny`` is a
tiny random Llama (tests). ``mistral-1b`` / ``mistral-tiny`` are the same shapes as Mistral
(sliding-window attention on every layer) with a window shorter than the prompts
(``MISTRAL_WINDOW``: 256 and 64 tokens; the benchmark prompts hold ~400 tokens), so the window
masks do cut keys. For a windowed config the record also times a fresh engine on the same
weights with the window switched off (``no_window_fast_s``, interleaved with ``window_fast_s``,
medians of ``cold_repeats``; ``--config mistral-smol``: the embedded SmolLM2 weights as a
Mistral with a 64-token window, with or without ``--random-weights``):
``window_bank_ratio = window_fast_s / no_window_fast_s`` is what the window-aware prefix bank
costs over the plain one. ``path`` is the capability check's
message for the model (its path: cascade, KV copies or plain).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import torch

from icqs_fast.benchmarks import (
    at_most,
    check_fields,
    emit_record,
    environment,
    equals,
    peak_growth_mb,
    report_failures,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# Short financial-news headlines (written for this benchmark). Each is scored with both answers.
HEADLINES = [
    "Operating profit rose 18% to EUR 42 million in the second quarter",
    "The retailer cut 600 jobs after sales fell for a third year",
    "Net sales increased to EUR 1.2 billion from EUR 1.05 billion",
    "The airline reported a wider loss as fuel costs climbed",
    "The bank raised its dividend by 10% after record earnings",
    "Shares slumped 15% after the profit warning",
    "The shipyard won a EUR 300 million order for two ferries",
    "Quarterly revenue dropped 9% on weak demand in Europe",
    "The group's order backlog reached an all-time high",
    "The mining company suspended production at its largest site",
    "Earnings per share improved to EUR 0.45 from EUR 0.31",
    "The insurer posted a net loss of EUR 80 million",
    "The telecom operator added 120,000 new subscribers",
    "Credit rating agencies downgraded the utility to junk status",
    "The paper maker returned to profit thanks to lower pulp prices",
    "The car maker recalled 400,000 vehicles over faulty brakes",
    "Cash flow from operations doubled to EUR 95 million",
    "The software firm missed analysts' revenue estimates",
    "The brewer expects sales volumes to grow in all markets",
    "The chemicals group closed two plants and wrote down assets",
    "Comparable sales rose 6% in the holiday season",
    "The property developer defaulted on a bond payment",
    "The engineering company signed a five-year service contract",
    "Margins narrowed as raw material costs surged",
    "The lender's bad loans fell to the lowest level in a decade",
    "The drug maker's trial failed to meet its main goal",
    "The utility completed its acquisition ahead of schedule",
    "Exports fell sharply after new tariffs took effect",
    "The startup raised EUR 50 million in a funding round",
    "The steel producer lowered its full-year guidance",
    "Profit before taxes grew to EUR 12.4 million",
    "The fashion chain filed for bankruptcy protection",
]
ANSWERS = ("positive", "negative")
SETTINGS = dict(num_ratios=5, demos_per_set=8, sets_per_ratio=4, seed=0)
# Correctness: engine and reference must give the same scores, and log-likelihoods within this
# per response token (fp32; --tolerance overrides it, e.g. for a bf16 model). Per token because
# the fp32 difference of two summation orders grows with the answer: 2-3e-5 per token measured
# on the CPU, 6.5e-5 for 2-token labels and 4.9e-4 for ~21-token free-text answers.
LOGLIK_TOL = 1e-4
# The same for a 16-bit model (bf16 on CUDA, --dtype bfloat16 / auto on the CPU): measured 0.046
# per token for bf16 on the CPU (8 responses, embedded model), from rounding at every layer.
LOGLIK_TOL_16BIT = 0.1
CONFIGS = ("llama-1b", "tiny", "mistral-1b", "mistral-tiny", "mistral-smol")
# Sliding windows of the Mistral-shaped configs: shorter than the benchmark prompts (Mistral-7B's
# own 4096-token window would never cut a key of a ~400-token prompt).
MISTRAL_WINDOW = {"mistral-1b": 256, "mistral-tiny": 64, "mistral-smol": 64}


ANSWER_KINDS = ("labels", "free-text")
# Calibrated engine results checked against the reference (icqs_naive with the same settings),
# on this many responses: the naive side is the slow one.
CALIBRATION_CHECK_RESPONSES = 4


def free_text_answer(headline: str, answer: str) -> str:
    """A one-sentence rationale (a distinct answer per headline, ~20 tokens), as a judge's or a
    generator's free-text response would be: no two responses share it, so no calibration
    baseline is reused across responses."""
    return f"This is {answer} news, because {headline[0].lower()}{headline[1:]}."


def responses(n: int, answers: str = "labels") -> list[tuple[str, str]]:
    """``n`` (headline, answer) pairs: every headline with each answer, cycled; ``answers=
    "free-text"``: the answer as :func:`free_text_answer`'s sentence."""
    if answers not in ANSWER_KINDS:
        raise ValueError(f"--answers must be one of {ANSWER_KINDS}, got {answers!r}")
    pairs = [(h, a if answers == "labels" else free_text_answer(h, a))
             for a in ANSWERS for h in HEADLINES]
    return [pairs[i % len(pairs)] for i in range(n)]


def demos() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    from icqs_fast.data import data_file

    def read(name: str) -> list[tuple[str, str]]:
        with open(data_file(name), encoding="utf-8") as f:
            return [(r["x"], r["y"]) for r in map(json.loads, f) if r]

    return read("demo_good.jsonl"), read("demo_bad.jsonl")


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load(device: torch.device, random_weights: bool = False, config: str = "llama-1b",
         dtype: str | None = None, model: str | None = None):
    """``(model, tokenizer, name)``: the embedded model, or ``model`` (anything ``--model``
    takes: a folder, a GGUF file, a packaged name such as ``gemma3-270m``), fp32 on the CPU,
    bf16 on CUDA, unless ``dtype`` names one (``"auto"`` is
    :func:`icqs_fast.models.choose_dtype`'s choice); or a random-weight Llama of ``config``
    with the embedded model's tokenizer."""
    from icqs_fast.models import choose_dtype, embedded_model_dir, load_model

    if dtype is None:
        # The engine's exactness check runs in fp32 on the CPU.
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    else:
        dtype = choose_dtype(dtype, device)  # with bf16-mixed, which is not a torch dtype
    if config == "mistral-smol":  # the embedded weights (a Llama) as a windowed Mistral
        model, tok = load_model(None, dtype=dtype, device=device, attn_implementation="sdpa")
        return as_mistral(model, MISTRAL_WINDOW[config]), tok, "SmolLM2-135M-as-Mistral-w64"
    if not random_weights:
        name = None if model in (None, "embedded") else model
        m, tok = load_model(name, dtype=dtype, device=device, attn_implementation="sdpa")
        return m, tok, "SmolLM2-135M-Instruct" if name is None else name
    from transformers import AutoTokenizer

    if config not in CONFIGS:
        raise ValueError(f"unknown --config {config!r}; use one of {list(CONFIGS)}")
    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    torch.manual_seed(0)
    choice = None if isinstance(dtype, torch.dtype) else dtype
    dtype = dtype if choice is None else choice.dtype
    model = model_for(config, len(tok), window=True).to(device=device, dtype=dtype).eval()
    return _as_loaded(model, choice), tok, f"random-{config}"


def _as_loaded(model: PreTrainedModel, choice=None):
    """A model built here computing as :func:`icqs_fast.models.load_model` would have it:
    bf16-mixed / bf16-products by ``choice`` (a DtypeChoice), batch-invariant linear layers
    on the CPU."""
    from icqs_fast.invariant_linears import use_invariant_linears
    from icqs_fast.models import to_bf16_mixed

    if choice is not None and choice.mixed:
        return to_bf16_mixed(model, bf16_products=choice.bf16_products)
    p = next(model.parameters())
    if p.device.type == "cpu":
        use_invariant_linears(model, "bf16" if p.dtype == torch.bfloat16 else "fp32")
    return model


def model_for(config: str, vocab: int, *, window: bool = True):
    """A random-weight model of ``config`` (``window=False``: a Mistral config with its sliding
    window switched off, the same shapes and parameter names)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    big = config.endswith("-1b")
    if big:  # ~1.1B parameters (TinyLlama-like shape)
        dims = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                    num_attention_heads=32, num_key_value_heads=4, vocab_size=vocab,
                    max_position_embeddings=2048, tie_word_embeddings=False)
    else:
        dims = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                    max_position_embeddings=2048)
    if config.startswith("mistral"):
        cfg = MistralConfig(**dims, sliding_window=MISTRAL_WINDOW[config] if window else None)
        cls = MistralForCausalLM
    else:
        cfg, cls = LlamaConfig(**dims), LlamaForCausalLM
    cfg._attn_implementation = "sdpa"
    return cls(cfg)


def as_mistral(model: PreTrainedModel, window: int | None):
    """The Llama ``model``'s weights in a Mistral with sliding window ``window`` (None: none):
    the two share every parameter name, so with no window it computes what the Llama does."""
    from transformers import MistralConfig, MistralForCausalLM

    from icqs_fast.models import DtypeChoice, is_bf16_mixed, uses_bf16_products

    d = model.config.to_dict()
    for k in ("architectures", "model_type", "transformers_version", "_name_or_path"):
        d.pop(k, None)
    cfg = MistralConfig(**d)
    cfg.sliding_window = window
    cfg._attn_implementation = "sdpa"
    out = MistralForCausalLM(cfg)
    out.load_state_dict(model.state_dict())
    p = next(model.parameters())
    out = out.to(device=p.device, dtype=p.dtype).eval()
    choice = (DtypeChoice(torch.float32, "as the Llama", "as the Llama", mixed=True,
                          bf16_products=uses_bf16_products(model))
              if is_bf16_mixed(model) else None)
    return _as_loaded(out, choice)


def window_timing(model: PreTrainedModel, tok: PreTrainedTokenizerBase, good, bad, resp,
                  settings: dict, repeats: int,
                  dev: torch.device, config: str) -> dict:
    """Fresh engines on ``model`` (windowed) and on the same weights without the window,
    interleaved ``repeats`` times: medians and their ratio."""
    plain = as_mistral(model, None)
    times: dict[str, list[float]] = {"window": [], "no_window": []}
    for _ in range(repeats):
        for kind, m in (("window", model), ("no_window", plain)):
            _sync(dev)
            t0 = time.perf_counter()
            list(_scorer(m, tok, good, bad, settings).score(resp))
            _sync(dev)
            times[kind].append(time.perf_counter() - t0)
    w, nw = statistics.median(times["window"]), statistics.median(times["no_window"])
    return {"window": MISTRAL_WINDOW[config], "window_fast_s": round(w, 6),
            "no_window_fast_s": round(nw, 6), "window_bank_ratio": round(w / nw, 3),
            "window_times_s": {k: [round(t, 4) for t in v] for k, v in times.items()}}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def scoring_settings(settings: dict | None = None):
    """The one :class:`~icqs_fast.engine.settings.ScoringSettings` both sides run with: the
    ``icqs-fast demo`` template and ``settings`` (the benchmark's ``SETTINGS`` if None; every
    other option at its default, so ``stratify="auto"`` as in the engine)."""
    from icqs_fast.data import TEMPLATE
    from icqs_fast.engine.settings import ScoringSettings

    return ScoringSettings(template=TEMPLATE, **(settings or SETTINGS))


def _scorer(model: PreTrainedModel, tok: PreTrainedTokenizerBase, good, bad, settings=None):
    from icqs_fast.engine.scorer import ICQSScorer

    return ICQSScorer(model, tok, good, bad, scoring_settings(settings))


def _naive(model: PreTrainedModel, tok: PreTrainedTokenizerBase, good, bad, resp, settings=None):
    from icqs_fast.engine.reference import icqs_naive

    return icqs_naive(model, tok, good, bad, resp, scoring_settings(settings))


# --------------------------------------------------------------------------- memory


def measure_peak_child(side: str, n: int, device: str, random_weights: bool,
                       config: str, settings: dict | None = None,
                       dtype: str | None = None, model_name: str | None = None) -> dict:
    """Run in a fresh process: load the model, warm up (one response, tiny settings), then the
    peak memory growth of scoring ``n`` responses with ``side`` ("fast" or "naive") under
    ``settings`` (ICQS settings; the benchmark's ``SETTINGS`` if None)."""
    dev = torch.device(device)
    model, tok, _ = load(dev, random_weights, config, dtype, model_name)
    good, bad = demos()
    resp = responses(n)
    from icqs_fast.data import TEMPLATE
    from icqs_fast.engine.reference import icqs_naive
    from icqs_fast.engine.scorer import ICQSScorer

    warm = dict(num_ratios=2, demos_per_set=1, sets_per_ratio=1)
    list(ICQSScorer(model, tok, good, bad, template=TEMPLATE, **warm).score(resp[:1]))
    icqs_naive(model, tok, good, bad, resp[:1], template=TEMPLATE, **warm)

    def work():
        if side == "fast":
            return list(_scorer(model, tok, good, bad, settings).score(resp))
        return _naive(model, tok, good, bad, resp, settings)

    peak, _ = peak_growth_mb(work, dev)
    return {"peak_mb": peak}


def _dtype_name(dtype: str | torch.dtype | None) -> str | None:
    """``dtype`` as the name :func:`load` takes (``torch.float32`` -> ``"float32"``; a name or
    None unchanged): what a child process can be told without importing anything."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return dtype


# The child reads its parameters as one JSON argument: never code built from a repr (a
# ``torch.float32`` repr'd into the code named ``torch``, which the child had not imported).
_CHILD_CODE = ("import json, sys; from icqs_fast.benchmarks.icqs import measure_peak_child; "
               "print(json.dumps(measure_peak_child(**json.loads(sys.argv[1]))))")


def _peak_in_subprocess(side: str, n: int, device: str, random_weights: bool,
                        config: str, dtype: str | torch.dtype | None = None,
                        model_name: str | None = None) -> float:
    """:func:`measure_peak_child` in a fresh interpreter (its own peak RSS); the peak in MiB."""
    params = {"side": side, "n": int(n), "device": str(device),
              "random_weights": bool(random_weights), "config": config,
              "dtype": _dtype_name(dtype), "model_name": model_name}
    res = subprocess.run([sys.executable, "-c", _CHILD_CODE, json.dumps(params)],
                         capture_output=True, text=True, check=False, timeout=3600)
    if res.returncode != 0:
        raise RuntimeError(f"memory measurement of {side!r} failed:\n{res.stderr[-2000:]}")
    return float(json.loads(res.stdout.strip().splitlines()[-1])["peak_mb"])


# --------------------------------------------------------------------------- the record


def bench(n_responses: int = 64, device: str | torch.device = "auto",
          random_weights: bool = False, config: str = "llama-1b",
          measure_memory: bool = True, mem_responses: int = 16,
          settings: dict | None = None, cold_repeats: int = 3,
          calibrate: str | None = None, answers: str = "labels",
          dtype: str | None = None, model: str | None = None) -> dict:
    """The benchmark record (fields: see the module docstring). ``settings`` overrides the
    ICQS settings (``num_ratios``, ``demos_per_set``, ``sets_per_ratio``, ``seed``; tests use
    small ones); the memory subprocesses always use the default settings. ``answers``:
    "labels" (positive / negative) or "free-text" (:func:`free_text_answer`). ``dtype``: the
    model's (None: fp32 on the CPU, bf16 on CUDA; see :func:`load`). ``model``: what
    ``--model`` names (None: the embedded model)."""
    settings = dict(SETTINGS, **(settings or {}))
    if n_responses < 1:
        raise ValueError(f"--responses must be >= 1, got {n_responses}")
    if cold_repeats < 1:
        raise ValueError(f"--cold-repeats must be >= 1, got {cold_repeats}")
    dev = _resolve_device(str(device))
    model_name = model
    model, tok, name = load(dev, random_weights, config, dtype, model_name)
    good, bad = demos()
    resp = responses(n_responses, answers)

    # Warm-up (lazy imports, allocator, kernels), not timed.
    from icqs_fast.data import TEMPLATE
    from icqs_fast.engine.reference import icqs_naive
    from icqs_fast.engine.scorer import ICQSScorer

    warm = dict(num_ratios=2, demos_per_set=1, sets_per_ratio=1)
    list(ICQSScorer(model, tok, good, bad, template=TEMPLATE, **warm).score(resp[:1]))
    icqs_naive(model, tok, good, bad, resp[:1], template=TEMPLATE, **warm)

    # Cold single response: a fresh engine (prefix caches included) vs naive on that response,
    # interleaved, medians.
    cold_fast_all, cold_naive_all = [], []
    for _ in range(cold_repeats):
        _sync(dev)
        t0 = time.perf_counter()
        _scorer(model, tok, good, bad, settings).score_one(*resp[0])
        _sync(dev)
        cold_fast_all.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        _naive(model, tok, good, bad, resp[:1], settings)
        _sync(dev)
        cold_naive_all.append(time.perf_counter() - t0)
    cold_fast, cold_naive = statistics.median(cold_fast_all), statistics.median(cold_naive_all)

    # Naive, one response at a time.
    ref, naive_times = [], []
    for r in resp:
        _sync(dev)
        t0 = time.perf_counter()
        ref.extend(_naive(model, tok, good, bad, [r], settings))
        _sync(dev)
        naive_times.append(time.perf_counter() - t0)
    naive_s = sum(naive_times)

    # The model FLOPs the engine computes over all responses (a fresh scorer, as timed below:
    # the same forwards), then this machine's matmul rate on those linear shapes before and
    # after the timed run (the limit: the better of the two).
    from icqs_fast.benchmarks import roofline
    from icqs_fast.models import FAST_NAME, dtype_name

    flops, _ = roofline.count_flops(lambda: list(_scorer(model, tok, good, bad,
                                                         settings).score(resp)))
    # The model's dtype (``dtype``, the argument, stays what the memory children load).
    model_dtype = next(model.parameters()).dtype
    # The probe runs the matmuls the model runs (bf16-mixed: fp32 on oneDNN's kernels).
    computes = dtype_name(model)
    probes = [roofline.matmul_probe(flops, computes, dev)]

    # Engine over all responses, from a fresh scorer (prefix caches included).
    _sync(dev)
    t0, c0 = time.perf_counter(), time.process_time()
    scorer = _scorer(model, tok, good, bad, settings)
    bank = scorer.prefix_bank
    _sync(dev)
    prefix_s = time.perf_counter() - t0
    got = list(scorer.score(resp))
    _sync(dev)
    fast_s, fast_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    probes.append(roofline.matmul_probe(flops, computes, dev))

    diffs = [float((a.loglik.double() - b.loglik.double()).abs().max())
             for a, b in zip(got, ref, strict=True)]
    # bf16-products rounds the linear layers' inputs: a 16-bit precision, checked as one.
    exact = model_dtype == torch.float32 and computes != FAST_NAME
    score_tol = SCORE_TOL if exact else SCORE_TOL_16BIT
    agree = sum(scores_agree(a, b, score_tol, per_set=exact)
                for a, b in zip(got, ref, strict=True)) / len(got)
    tokens = scorer.tokens
    q_lens, r_lens = [], []
    for i, (x, y) in enumerate(resp):
        q, _ = tokens.response_parts(i, x, y)
        q_lens.append(len(q))  # the query tokenized alone
        lay = tokens.layouts(i, x, y, None, False)[0]  # the scored (whole-text) response tokens
        r_lens.append(len(lay.ids) - lay.n_prompt)
    rec = {
        "model": name,
        "device": dev.type,
        "dtype": computes,
        "responses": n_responses,
        "contexts": scorer.n_contexts,
        "demo_tokens_mean": round(sum(bank.lengths[:scorer.n_contexts]) / scorer.n_contexts, 1),
        "response_tokens_mean": round(sum(r_lens) / len(r_lens), 2),
        "answers": answers,
        "naive_s": round(naive_s, 6),
        "fast_s": round(fast_s, 6),
        "speedup": round(naive_s / fast_s, 2),
        "cold_single_speedup": round(cold_naive / cold_fast, 2),
        "peak_mem_naive_mb": None,
        "peak_mem_fast_mb": None,
        "max_abs_loglik_diff": max(diffs),
        "max_abs_loglik_diff_per_token": max(d / max(n, 1) for d, n in zip(diffs, r_lens,
                                                                             strict=True)),
        "score_agreement": agree,
        "score_tolerance": score_tol,
        # extras
        "query_tokens_mean": round(sum(q_lens) / len(q_lens), 2),
        "prefix_s": round(prefix_s, 3),
        "cold_single_fast_s": round(cold_fast, 6),
        "cold_single_naive_s": round(cold_naive, 6),
        "cold_single_fast_all_s": [round(t, 6) for t in cold_fast_all],
        "cold_single_naive_all_s": [round(t, 6) for t in cold_naive_all],
        "prefix_forward_tokens": bank.forward_tokens,
        "prefix_bank_mb": round(sum(t.numel() * t.element_size()
                                    for t in (*bank.keys, *bank.values)) / 2**20, 1),
        "prefix_tokens_total": sum(bank.lengths[:scorer.n_contexts]),
        "mem_ratio": None,
        "mem_responses": None,
        "cascade": scorer.cascade,
        "path": scorer.plan.message,
        "settings": settings,
        "scoring_settings": scorer.settings.fingerprint(),
        "threads": torch.get_num_threads(),
        "fast_cpu_s": round(fast_cpu_s, 3),
        # Distance to the limit: model FLOPs / fast_s against the probed matmul rate.
        **roofline.limit_fields(flops, fast_s, fast_cpu_s if dev.type == "cpu" else None,
                                probes),
    }
    if calibrate and calibrate != "none":
        timing, cal_got = calibration_timing(model, tok, good, bad, resp, settings, calibrate,
                                             cold_repeats, dev)
        rec.update(timing)
        # The calibrated engine against the reference with the same settings: its baseline
        # rows and the scores made from them.
        k = min(len(resp), CALIBRATION_CHECK_RESPONSES)
        cal_ref = _naive(model, tok, good, bad, resp[:k], dict(settings, calibration=calibrate))
        bdiffs = [float((a.loglik_baseline.double() - b.loglik_baseline.double()).abs().max())
                  for a, b in zip(cal_got[:k], cal_ref, strict=True)]
        rec["max_abs_baseline_diff"] = max(bdiffs)
        # The baseline scores the same answer tokens (after another query).
        rec["max_abs_baseline_diff_per_token"] = max(
            d / max(n, 1) for d, n in zip(bdiffs, r_lens[:k], strict=True))
        rec["calibrated_score_agreement"] = sum(
            scores_agree(a, b, score_tol, per_set=exact)
            for a, b in zip(cal_got[:k], cal_ref, strict=True)) / k
        rec["calibration_checked_responses"] = k
    if config in MISTRAL_WINDOW and (random_weights or config == "mistral-smol"):
        rec.update(window_timing(model, tok, good, bad, resp, settings, cold_repeats, dev,
                                 config))
    if measure_memory:
        m = min(n_responses, mem_responses)
        pf = _peak_in_subprocess("fast", m, str(dev), random_weights, config, dtype,
                                 model_name)
        pn = _peak_in_subprocess("naive", min(m, 2), str(dev), random_weights, config, dtype,
                                 model_name)
        rec.update(peak_mem_fast_mb=round(pf, 1), peak_mem_naive_mb=round(pn, 1),
                   mem_ratio=round(pn / pf, 3) if pf > 0 else None,
                   mem_responses={"fast": m, "naive": min(m, 2)})
    return rec


# Two continuous (posterior-mean) scores agree when they differ by at most this: the engine's and
# the reference's log-likelihoods differ by fp32 rounding, which moves a posterior mean by
# ~1e-7; discrete scores (argmax, tied) must be equal.
SCORE_TOL = 1e-5
# The same for a 16-bit model (bf16 on CUDA, --dtype bfloat16 / auto where it picks bf16): the
# engine and the reference round differently at every layer, so the check is the stability goal
# instead: the ICQS-Epistemic score within 0.01 (a per-set score, the mean of one set's four
# ratios, moves by up to ~0.02 between two bf16 rounding orders: not checked then).
SCORE_TOL_16BIT = 0.01


def scores_agree(a, b, tol: float = SCORE_TOL, per_set: bool = True) -> bool:
    """Whether two results' ICQS-Epistemic and (``per_set``) per-set scores agree (equal for
    the argmax and tied scores, within ``tol`` (:data:`SCORE_TOL`) for the posterior mean)."""
    tol = tol if a.score_kind == "mean" else 0.0
    return abs(a.score - b.score) <= tol and (not per_set or all(
        abs(x - y) <= tol for x, y in zip(a.score_per_set, b.score_per_set, strict=True)))


def calibration_timing(model: PreTrainedModel, tok: PreTrainedTokenizerBase, good, bad, resp,
                       settings: dict, calibrate: str,
                       repeats: int, dev: torch.device) -> tuple[dict, list]:
    """Fresh engines without and with ``calibrate`` over ``resp``, interleaved ``repeats``
    times: the medians and their ratio (see the module docstring), and the last calibrated
    run's results."""
    times: dict[str, list[float]] = {"none": [], calibrate: []}
    rows = 0
    got: list = []
    for _ in range(repeats):
        for cal in ("none", calibrate):
            _sync(dev)
            t0 = time.perf_counter()
            sc = _scorer(model, tok, good, bad, dict(settings, calibration=cal))
            got = list(sc.score(resp))
            _sync(dev)
            times[cal].append(time.perf_counter() - t0)
            rows = max(rows, sc.calibration_rows)
    un, ca = statistics.median(times["none"]), statistics.median(times[calibrate])
    return {"calibration": calibrate, "uncalibrated_fast_s": round(un, 6),
            "calibrated_fast_s": round(ca, 6), "calibration_overhead": round(ca / un, 3),
            "calibration_rows": rows, "response_rows": len(resp) * sc.n_contexts,
            "calibration_times_s": {k: [round(t, 4) for t in v] for k, v in times.items()}}, got


def run(args: argparse.Namespace) -> int:
    from icqs_fast.threads import apply_threads

    apply_threads(getattr(args, "threads", None))
    t0 = time.perf_counter()
    rec = bench(_or(args.responses, 64), args.device, args.random_weights, args.config,
                measure_memory=not args.no_memory, mem_responses=args.mem_responses,
                cold_repeats=_or(args.cold_repeats, 3), calibrate=getattr(args, "calibrate", None),
                answers=getattr(args, "answers", "labels"), dtype=getattr(args, "dtype", None),
                settings=(None if getattr(args, "token_budget", None) is None
                          else {"token_budget": args.token_budget}),
                model=getattr(args, "model", None))
    rec["bench_s"] = round(time.perf_counter() - t0, 1)
    rec.update(environment(rec["device"]))
    emit_record(rec, out=args.out, as_json=args.json)
    default = LOGLIK_TOL if rec.get("dtype", "float32") == "float32" else LOGLIK_TOL_16BIT
    return report_failures("icqs", check_fields(
        rec, checks(default if args.tolerance is None else args.tolerance,
                    calibrated="calibrated_score_agreement" in rec)))


def checks(tolerance: float = LOGLIK_TOL, calibrated: bool = False) -> dict:
    """The record's correctness fields and what each must be (``calibrated``: also those of
    the calibrated engine against the reference)."""
    out = {"score_agreement": equals(1.0), "max_abs_loglik_diff_per_token": at_most(tolerance)}
    if calibrated:
        out.update(calibrated_score_agreement=equals(1.0),
                   max_abs_baseline_diff_per_token=at_most(tolerance))
    return out


def _or(value, default):
    """``value`` unless it is None (a flag left at its default, which depends on --inputs)."""
    return default if value is None else value
