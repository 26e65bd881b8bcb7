"""Where the ICQS engine's time goes on this CPU: ``bench icqs``'s workload (its headlines and
settings, the embedded model) with its FLOPs counted, a plain timed run, a run with a timer on
every module and on the fused LM-head statistics
(:func:`module_times`), and this machine's matmul rate on the
model's linear shapes. ``python -m bench.studies.engine_profile --dtypes
float32,bfloat16 --out FILE``; bench/reports/2026-11-27-engine-limit.md ("The engine
against the machine's limit") reads it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from icqs_fast.benchmarks.roofline import count_flops, limit_fields, matmul_probe
from icqs_fast.threads import add_threads_argument, apply_threads


def profile_engine(dtype: str = "float32", n_responses: int = 16,
                   threads: int | None = None) -> dict[str, Any]:
    """Where the ICQS engine's time goes on this machine: ``bench icqs``'s workload (its
    headlines and settings, the embedded model in ``dtype``) counted (:func:`count_flops`),
    then a plain timed run, a run under :func:`module_times` and two matmul probes. Returns the
    distance-to-limit fields, the profile rows in seconds and as shares of the timed run, and
    the time the linear FLOPs would take at the probed rate (``linear_at_limit_s``)."""
    from icqs_fast.benchmarks import environment
    from icqs_fast.benchmarks.icqs import demos, responses, scoring_settings
    from icqs_fast.engine.scorer import ICQSScorer
    from icqs_fast.models import dtype_name, load_model

    def _scorer(model, tok, good, bad, settings=None):
        return ICQSScorer(model, tok, good, bad, scoring_settings(settings))

    if threads is not None:
        apply_threads(threads)
    model, tok = load_model(None, dtype=dtype, device="cpu", attn_implementation="sdpa")
    good, bad = demos()
    resp = responses(n_responses)
    list(_scorer(model, tok, good, bad, dict(num_ratios=2, demos_per_set=1, sets_per_ratio=1,
                                             seed=0)).score(resp[:1]))  # warm-up
    count, _ = count_flops(lambda: list(_scorer(model, tok, good, bad).score(resp)))
    dt = dtype_name(model)  # bf16-mixed: the probe runs the mode the model's linears run
    probes = [matmul_probe(count, dt)]
    t0, c0 = time.perf_counter(), time.process_time()
    list(_scorer(model, tok, good, bad).score(resp))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    rows, _ = module_times(lambda: list(_scorer(model, tok, good, bad).score(resp)), model)
    probes.append(matmul_probe(count, dt))
    fields = limit_fields(count, wall, cpu, probes)
    total = rows["total (wall)"]
    limit = fields["limit_gflops"]
    return {"bench": "engine-profile", "dtype": dt,
            "responses": n_responses, "fast_s": round(wall, 3), "fast_cpu_s": round(cpu, 3),
            **fields,
            "linear_at_limit_s": round(count.linear / (limit * 1e9), 3) if limit else None,
            "profile_s": {k: round(v, 3) for k, v in sorted(rows.items(), key=lambda x: -x[1])},
            "profile_share": {k: round(v / total, 3) for k, v in rows.items()
                              if k != "total (wall)"},
            **environment("cpu")}


# --------------------------------------------------------------------------- where time goes

def _category(mod: torch.nn.Module) -> str:
    """The profile row of a module's own time (its children's excluded)."""
    name = type(mod).__name__
    if isinstance(mod, torch.nn.Linear):
        return "linear layers (matmuls)"
    if name.endswith("RMSNorm") or isinstance(mod, torch.nn.LayerNorm):
        return "norms"
    if name.endswith("Attention"):
        return "attention (rotary, cascade / sdpa attention, reshapes; not its projections)"
    if name.endswith("MLP"):
        return "MLP activation and gating"
    if name.endswith("RotaryEmbedding"):
        return "rotary cos / sin"
    if name.endswith("DecoderLayer"):
        return "decoder-layer glue (residual adds)"
    if isinstance(mod, torch.nn.Embedding):
        return "embeddings"
    return "model glue (masks, position ids, cache objects)"


def module_times(fn: Callable[[], Any], model: torch.nn.Module) -> tuple[dict[str, float], Any]:
    """Run ``fn()`` with wall-clock timers around every forward of ``model``'s modules and
    around :func:`icqs_fast.ops.linear_token_stats`; returns ``({row: seconds}, fn's result)``:
    each module's own time (children excluded) by :func:`_category`, ``"LM-head statistics"``,
    and ``"outside the model"`` (the rest of the wall time: the engine's Python, prompt and
    batch building, the prefix bank's bookkeeping, result assembly). On a CPU each op runs to
    completion before the next, so host timers measure the work (on CUDA they would not)."""
    from torch.nn.modules import module as nn_module

    from icqs_fast import ops

    ours = {id(m) for m in model.modules()}
    stack: list[list[float]] = []  # [start, children's inclusive time]
    rows: dict[str, float] = defaultdict(float)

    def pre(mod, args):
        if id(mod) in ours:
            stack.append([time.perf_counter(), 0.0])

    def post(mod, args, out):
        if id(mod) not in ours or not stack:
            return
        t0, children = stack.pop()
        inclusive = time.perf_counter() - t0
        rows[_category(mod)] += inclusive - children
        if stack:
            stack[-1][1] += inclusive

    real = ops.linear_token_stats

    def timed_head(*a, **k):
        t0 = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            rows["LM-head statistics (linear_token_stats)"] += time.perf_counter() - t0

    hooks = [nn_module.register_module_forward_pre_hook(pre),
             nn_module.register_module_forward_hook(post, always_call=True)]
    ops.linear_token_stats = timed_head
    t0 = time.perf_counter()
    try:
        out = fn()
    finally:
        wall = time.perf_counter() - t0
        ops.linear_token_stats = real
        for h in hooks:
            h.remove()
    rows["outside the model"] = wall - sum(rows.values())
    rows["total (wall)"] = wall
    return dict(rows), out

def main(argv: list[str] | None = None) -> int:
    """``python -m bench.studies.engine_profile``: :func:`profile_engine` per dtype."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m bench.studies.engine_profile",
                                description="where the ICQS engine's time goes on this CPU")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--responses", type=int, default=16)
    add_threads_argument(p)
    p.add_argument("--out", default=None, help="write the JSON records here")
    a = p.parse_args(argv)
    recs = [profile_engine(d, a.responses, a.threads) for d in a.dtypes.split(",")]
    text = json.dumps(recs, indent=1)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
