"""``icqs-fast bench lm-eval``: lm-eval's Hugging Face model (``HFLM``) against the
``icqs-fast`` lm-eval model (:class:`icqs_fast.compat.lm_eval.ICQSFastLM`) on one local task,
side by side in one run, on the same model object.

Task: SST-2 (``../shared/data/sst2/dev.tsv``) as a two-choice lm-eval task written to a
temporary folder (YAML over JSONL, no hub): ``Review: <sentence>\\nSentiment:`` with choices
`` negative`` / `` positive``, ``--shots`` few-shot examples taken by lm-eval's ``first_n``
sampler (the same examples, in the same order, for every document), documents from the rows
after the few-shot pool, ``--limit`` of them. Each document sends two ``loglikelihood`` requests
sharing the whole few-shot context.

Fields:

* ``hf_s`` / ``ours_s``: wall seconds inside each model's ``loglikelihood`` (the model work);
  ``speedup = hf_s / ours_s``; ``hf_cpu_s`` / ``ours_cpu_s`` and ``cpu_speedup``: the same in
  process CPU time (all threads), steadier than wall time on a shared machine;
  ``hf_eval_s`` / ``ours_eval_s``: each whole ``simple_evaluate`` call (task building and
  metrics included), ``eval_speedup`` their ratio.
* ``requests``: ``loglikelihood`` requests each side received (``2 x docs``).
* ``hf_tokens_padded``: tokens in ``HFLM``'s forward batches (``rows x padded length``, what it
  computes; it already runs one forward per context for one-token continuations, so both
  answers of a document share one); ``hf_tokens_real``: the same without the right padding;
  ``hf_forward_rows``: its forward rows.
* ``ours_prefix_tokens``: tokens run through prefix-bank forwards (padding included; the trie
  computes each shared context run once per bank chunk); ``ours_suffix_tokens``: tokens in the
  suffix forwards (rows x padded length: each request's last context token and continuation);
  ``ours_tokens = ours_prefix_tokens + ours_suffix_tokens``; ``token_ratio = hf_tokens_padded /
  ours_tokens``.
* ``model_gflop``, ``achieved_gflops``, ``limit_gflops``, ``fraction_of_limit`` (and per CPU
  second, ``*_cpu``): our side's matmul FLOPs (its requests run again, counted, untimed)
  against ``ours_s``, and this machine's matmul rate on the model's linear shapes, dtype and
  threads (:mod:`icqs_fast.benchmarks.roofline`).
* ``max_abs_diff``: largest ``|loglik_ours - loglik_hf|`` over every request (per-sample
  ``resps`` of both runs); ``is_greedy_agreement``: fraction of requests with the same
  is_greedy; ``acc_hf`` / ``acc_ours`` and ``same_predictions`` (every document's argmax
  choice equal).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from icqs_fast.benchmarks import (
    at_most,
    check_fields,
    emit_record,
    environment,
    equals,
    report_failures,
)
from icqs_fast.options import add_json_argument
from icqs_fast.threads import add_threads_argument, apply_threads

if TYPE_CHECKING:
    from transformers import PreTrainedModel

TASK_NAME = "icqs_sst2_local"
# Correctness: largest |loglik ours - HFLM| that passes (fp32 CPU records ~4e-5; --tolerance
# overrides it); is_greedy must agree on every request and every prediction must be the same.
LOGLIK_TOL = 1e-3
# Rows at the top of dev.tsv that form the few-shot pool; documents come after them.
FEWSHOT_POOL = 16


def read_sst2(path: str | Path) -> list[dict[str, Any]]:
    """Rows of an SST-2 TSV (``sentence<TAB>label`` with a header) as ``{"sentence", "label"}``
    dicts (label int 0/1); ValueError naming file and line on a bad row."""
    path = Path(path)
    rows = []
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader, None)
        if header is None or [h.strip() for h in header[:2]] != ["sentence", "label"]:
            raise ValueError(f"{path}:1: expected the header 'sentence<TAB>label', got {header}")
        for line, row in enumerate(reader, start=2):
            if len(row) != 2 or row[1].strip() not in ("0", "1"):
                raise ValueError(f"{path}:{line}: field 'label': expected 'sentence<TAB>0|1', "
                                 f"got {row!r}")
            rows.append({"sentence": row[0].strip(), "label": int(row[1])})
    return rows


def write_sst2_task(folder: str | Path, rows: list[dict[str, Any]], *, shots: int = 5,
                    pool: int = FEWSHOT_POOL, name: str = TASK_NAME) -> str:
    """Write a two-choice lm-eval task over ``rows`` into ``folder`` (``<name>.yaml`` plus
    ``train.jsonl`` = the first ``pool`` rows, the few-shot pool, and ``validation.jsonl`` = the
    rest); returns the task name, for ``TaskManager(include_path=folder)``."""
    if not 0 <= shots <= pool:
        raise ValueError(f"shots must be in [0, {pool}], got {shots}")
    if len(rows) <= pool:
        raise ValueError(f"need more than {pool} rows (few-shot pool + documents), got {len(rows)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for split, part in (("train", rows[:pool]), ("validation", rows[pool:])):
        with (folder / f"{split}.jsonl").open("w", encoding="utf-8") as f:
            for r in part:
                f.write(json.dumps(r) + "\n")
    # JSON is valid YAML: no quoting rules to get wrong for the template strings.
    cfg = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"train": str(folder / "train.jsonl"),
                                          "validation": str(folder / "validation.jsonl")}},
        "output_type": "multiple_choice",
        "training_split": "train",
        "validation_split": "validation",
        "fewshot_split": "train",
        "doc_to_text": "Review: {{sentence}}\nSentiment:",
        "doc_to_target": "label",
        "doc_to_choice": ["negative", "positive"],
        "target_delimiter": " ",
        "fewshot_delimiter": "\n\n",
        "num_fewshot": shots,
        "fewshot_config": {"sampler": "first_n"},
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    }
    (folder / f"{name}.yaml").write_text(json.dumps(cfg, indent=1) + "\n", encoding="utf-8")
    return name


@contextlib.contextmanager
def _count_hf(lm: Any, counts: dict[str, int]) -> Iterator[None]:
    """Count HFLM's forward rows and tokens (padded, and real) while inside."""
    import lm_eval.models.huggingface as hf_mod

    call, pad = lm._model_call, hf_mod.pad_and_concat

    def model_call(inps, *a, **k):
        counts["hf_forward_rows"] += int(inps.shape[0])
        counts["hf_tokens_padded"] += int(inps.numel())
        return call(inps, *a, **k)

    def pad_and_concat(max_length, tensors, *a, **k):
        counts["hf_tokens_real"] += sum(int(t.shape[-1]) for t in tensors)
        return pad(max_length, tensors, *a, **k)

    lm._model_call = model_call
    hf_mod.pad_and_concat = pad_and_concat
    try:
        yield
    finally:
        del lm._model_call
        hf_mod.pad_and_concat = pad


@contextlib.contextmanager
def _count_ours(counts: dict[str, int]) -> Iterator[None]:
    """Count the tokens score_continuations runs through prefix-bank and suffix forwards."""
    from icqs_fast.engine import continuations as cm

    bank_cls, suffix, plain = cm.PrefixBank, cm.suffix_hidden, cm.score_plain

    class CountingBank(bank_cls):  # type: ignore[misc, valid-type]
        def add(self, prefixes):
            before = self.forward_tokens
            out = super().add(prefixes)
            counts["ours_prefix_tokens"] += self.forward_tokens - before
            return out

    def suffix_hidden(model: PreTrainedModel, bank, entries, suffixes, *a, **k):
        counts["ours_suffix_tokens"] += len(suffixes) * max(len(s) for s in suffixes)
        return suffix(model, bank, entries, suffixes, *a, **k)

    def score_plain(model: PreTrainedModel, batch, *a, **k):
        counts["ours_suffix_tokens"] += len(batch) * max(len(r[2]) for r in batch)
        return plain(model, batch, *a, **k)

    cm.PrefixBank, cm.suffix_hidden, cm.score_plain = CountingBank, suffix_hidden, score_plain
    try:
        yield
    finally:
        cm.PrefixBank, cm.suffix_hidden, cm.score_plain = bank_cls, suffix, plain


def _timed_loglikelihood(lm: Any, acc: dict[str, float], key: str,
                         seen: list | None = None) -> None:
    """Make ``lm.loglikelihood`` add its wall time and request count to ``acc`` (and each call's
    requests to ``seen``, when given)."""
    inner = lm.loglikelihood

    def loglikelihood(requests, *a, **k):
        if seen is not None:
            seen.append(list(requests))
        t0, c0 = time.perf_counter(), time.process_time()
        out = inner(requests, *a, **k)
        acc[key + "_s"] += time.perf_counter() - t0
        acc[key + "_cpu_s"] += time.process_time() - c0
        acc[key + "_requests"] += len(requests)
        return out

    lm.loglikelihood = loglikelihood


def _evaluate(lm: Any, task: str, folder: Path, limit: int | None) -> tuple[dict, float]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    # include_defaults=False: indexing lm-eval's thousands of built-in task files takes ~25 s.
    manager = TaskManager(include_path=str(folder), include_defaults=False)
    out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=manager, limit=limit,
                                  bootstrap_iters=0, log_samples=True, verbosity="ERROR")
    return out, time.perf_counter() - t0


def _per_request(out: dict, task: str) -> tuple[list[tuple[float, bool]], list[int]]:
    """``(loglik, is_greedy)`` of every request in (doc_id, choice) order, and each doc's
    argmax choice."""
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    flat, picks = [], []
    for s in samples:
        lls = [(float(r[0][0]), bool(r[0][1])) for r in s["resps"]]
        flat.extend(lls)
        picks.append(max(range(len(lls)), key=lambda i: lls[i][0]))
    return flat, picks


def bench(limit: int = 60, shots: int = 5, model: str = "embedded", *, data: str | None = None,
          hf_batch_size: int = 8, device: str = "cpu", backend: str = "auto") -> dict[str, Any]:
    """Run the task with ``HFLM`` and with ``ICQSFastLM`` on one loaded model; the record
    described in the module docstring."""
    import torch
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from icqs_fast.compat.lm_eval import ICQSFastLM
    from icqs_fast.io.datasets import shared_data_dir
    from icqs_fast.models import load_model

    if limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    path = Path(data) if data else shared_data_dir() / "sst2" / "dev.tsv"
    if not path.is_file():
        raise FileNotFoundError(f"SST-2 data not found at {path} (pass --data PATH)")
    rows = read_sst2(path)
    m, tok = load_model(None if model in ("embedded", "", None) else model, dtype="float32",
                        device=device)
    with tempfile.TemporaryDirectory(prefix="icqs-lm-eval-") as tmp:
        folder = Path(tmp)
        # Only the documents --limit takes: lm-eval would otherwise build (and this would
        # write) all of them.
        task = write_sst2_task(folder, rows[: FEWSHOT_POOL + limit], shots=shots)
        times: dict[str, float] = dict.fromkeys(
            ("hf_s", "hf_cpu_s", "hf_requests", "ours_s", "ours_cpu_s", "ours_requests"), 0.0)
        counts = dict.fromkeys(("hf_forward_rows", "hf_tokens_padded", "hf_tokens_real",
                                "ours_prefix_tokens", "ours_suffix_tokens"), 0)
        hf = HFLM(pretrained=m, tokenizer=tok, batch_size=hf_batch_size, device=str(device))
        ours = ICQSFastLM(model=m, tokenizer=tok, backend=backend)
        # One request through each first (untimed): lazy imports and first-call set-up would
        # otherwise land on whichever side runs first.
        for lm in (hf, ours):
            lm.loglikelihood([Instance("loglikelihood", {}, ("Review: fine\nSentiment:",
                                                             " positive"), 0)], disable_tqdm=True)
        _timed_loglikelihood(hf, times, "hf")
        with _count_hf(hf, counts):
            out_hf, hf_eval_s = _evaluate(hf, task, folder, limit)
        ours_calls: list = []
        _timed_loglikelihood(ours, times, "ours", ours_calls)
        with _count_ours(counts):
            out_ours, ours_eval_s = _evaluate(ours, task, folder, limit)
        limit_rec = _distance_to_limit(ours, ours_calls, times, m, device)
    a, picks_a = _per_request(out_hf, task)
    b, picks_b = _per_request(out_ours, task)
    if len(a) != len(b):
        raise RuntimeError(f"the two runs logged {len(a)} and {len(b)} requests")
    ours_tokens = counts["ours_prefix_tokens"] + counts["ours_suffix_tokens"]
    return {
        "bench": "lm-eval",
        "task": f"SST-2 two-choice, {shots}-shot, first_n sampler (local YAML over JSONL)",
        "model": model,
        "device": str(device),
        "backend": backend,
        "limit": limit,
        "shots": shots,
        "docs": len(picks_a),
        "requests": int(times["ours_requests"]),
        "hf_requests": int(times["hf_requests"]),
        "hf_batch_size": hf_batch_size,
        "hf_s": round(times["hf_s"], 3),
        "ours_s": round(times["ours_s"], 3),
        "speedup": round(times["hf_s"] / times["ours_s"], 2) if times["ours_s"] > 0 else None,
        "hf_cpu_s": round(times["hf_cpu_s"], 3),
        "ours_cpu_s": round(times["ours_cpu_s"], 3),
        "cpu_speedup": (round(times["hf_cpu_s"] / times["ours_cpu_s"], 2)
                        if times["ours_cpu_s"] > 0 else None),
        "hf_eval_s": round(hf_eval_s, 3),
        "ours_eval_s": round(ours_eval_s, 3),
        "eval_speedup": round(hf_eval_s / ours_eval_s, 2),
        **counts,
        "ours_tokens": ours_tokens,
        "token_ratio": round(counts["hf_tokens_padded"] / ours_tokens, 2) if ours_tokens else None,
        "max_abs_diff": max(abs(x[0] - y[0]) for x, y in zip(a, b, strict=True)),
        "is_greedy_agreement": sum(x[1] == y[1] for x, y in zip(a, b, strict=True)) / len(a),
        "acc_hf": out_hf["results"][task]["acc,none"],
        "acc_ours": out_ours["results"][task]["acc,none"],
        "same_predictions": picks_a == picks_b,
        "torch_threads": torch.get_num_threads(),
        **limit_rec,
    }


def _distance_to_limit(ours: Any, calls: list, times: dict[str, float], model: PreTrainedModel,
                       device: str) -> dict[str, Any]:
    """The FLOPs of our side's ``loglikelihood`` work (the same requests again, counted, untimed)
    against ``ours_s``, and this machine's matmul rate on the model's linear shapes
    (:mod:`icqs_fast.benchmarks.roofline`; probes before and after the counting pass)."""
    import torch

    from icqs_fast.benchmarks import roofline

    inner = type(ours).loglikelihood

    def work():
        for reqs in calls:
            inner(ours, reqs, disable_tqdm=True)

    flops, _ = roofline.count_flops(work)
    dtype = next(model.parameters()).dtype
    dev = torch.device(device)
    probes = [roofline.matmul_probe(flops, dtype, dev), roofline.matmul_probe(flops, dtype, dev)]
    return roofline.limit_fields(flops, times["ours_s"],
                                 times["ours_cpu_s"] if dev.type == "cpu" else None, probes)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0].replace("``", "").replace(":class:", "")
    add_json_argument(p, "print the record as one JSON object")
    p.add_argument("--limit", type=int, default=60, help="documents (default 60; 2 requests each)")
    p.add_argument("--shots", type=int, default=5, help="few-shot examples (default 5)")
    p.add_argument("--model", default="embedded",
                   help="'embedded' (default) or a local Hugging Face model folder")
    p.add_argument("--data", default=None,
                   help="SST-2 TSV (sentence<TAB>label); default ../shared/data/sst2/dev.tsv")
    p.add_argument("--hf-batch-size", type=int, default=8, help="HFLM's batch size (default 8)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--backend", default="auto", help="token-statistics backend of ours")
    add_threads_argument(p)
    p.add_argument("--out", default=None, help="also write the JSON record to this file")
    p.add_argument("--tolerance", type=float, default=LOGLIK_TOL,
                   help="largest max_abs_diff that passes (default %(default)g); the command "
                        "exits 1, naming the field, on a failure")


def checks(tolerance: float = LOGLIK_TOL) -> dict:
    """The record's correctness fields and what each must be."""
    return {"max_abs_diff": at_most(tolerance), "is_greedy_agreement": equals(1.0),
            "same_predictions": equals(True)}


def run(args: argparse.Namespace) -> int:
    apply_threads(args.threads)
    t0 = time.perf_counter()
    rec = bench(args.limit, args.shots, args.model, data=args.data,
                hf_batch_size=args.hf_batch_size, device=args.device, backend=args.backend)
    rec["bench_s"] = round(time.perf_counter() - t0, 1)
    rec.update(environment(args.device))
    emit_record(rec, out=args.out, as_json=args.json)
    return report_failures("lm-eval", check_fields(
        rec, checks(getattr(args, "tolerance", LOGLIK_TOL))))
