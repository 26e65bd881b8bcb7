"""``icqs-fast bench attention``: attention-entropy features of the embedded model without the
attention matrices, against eager ``output_attentions=True``.

Both sides run one forward of the embedded model over a ``seq_len``-token input (instruction =
first half, response = second half) and produce the same ``[B, layers, heads, T]`` entropies of
each response row's attention renormalised over the instruction keys:

* ours: :func:`icqs_fast.features.attention.capture_attention_entropy` (``ops.attention_entropy``
  on its ``"auto"`` backend, recorded as ``backend``: the C++ flash kernel on the CPU, the
  Triton kernel on CUDA);
* eager: ``attn_implementation="eager"`` with ``output_attentions=True``, then the entropies from
  the returned ``[B, heads, T, T]`` matrices (fp32, the way a user would write it).

Neither side needs the logits, so both run with ``logits_to_keep=1`` (the LM head would otherwise
dominate time and memory equally on both sides). Times are medians of alternated repeats after a
warm-up. Peak memory is measured per side in a fresh subprocess as the growth of peak RSS over the
measured forward (CPU; the peak is reset through ``/proc/self/clear_refs``), or as
``torch.cuda.max_memory_allocated`` growth on CUDA. ``max_abs_err`` compares our entropies to the
float64 entropies of the eager attention matrices. When ours is not the torch backend, ours is
also timed with the same capture on the torch backend, alternated with the other two in one
loop (``torch_backend_ms``, ``backend_speedup``; ``backend_max_diff``: the largest entropy
difference between the two). On
CUDA the record also times one attention call of the Triton forward-with-entropy against plain
SDPA (``triton_vs_sdpa``).

``--lse`` adds ``attention_lse``: the cascade's CPU attention with log-sum-exp on its prefix-part
shape (``[entries, kv heads, rows, D]`` queries against each entry's padded keys, llama-1b's
4 KV heads x 64, 512 grouped query rows), the cpp backend of :func:`icqs_fast.ops.attention_lse`
(``csrc/attention.cpp``) against the torch path cascade attention otherwise takes (PyTorch's CPU
flash kernel with the additive padding mask, :func:`icqs_fast.engine.cascade.attn_lse`), per
key count of ``--lse-keys``, fp32 and bf16, at each thread count of ``--lse-threads``: medians of
alternated repeats, GFLOP/s (4 x rows x keys x D per head), the speedup and the largest
output / LSE difference between the two (checked: the same attention within the dtype's
rounding).

``--entropy-op`` adds ``attention_entropy_op``: ``ops.attention_entropy`` alone, its cpp backend
against its torch backend (CPU, fp32), on one layer of the capture's shape (9 query / 3 key
heads of 64, causal, the second half of the tokens flagged, the first half the key range) per
token count of ``--entropy-op-tokens`` and thread count of ``--lse-threads``: medians of
alternated repeats and the largest entropy / output difference (checked: within 1e-4).

``--random-weights --config tiny`` runs the same comparison on a tiny random-weight Llama (2
layers; for tests), ``--config llama-1b`` on a ~1.1B-parameter one (the shapes of
``icqs-fast bench icqs``); ``model`` then reads ``random-<config>``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import torch

from icqs_fast import backends
from icqs_fast.benchmarks import at_most, check_fields, environment, peak_growth_mb, report_failures
from icqs_fast.benchmarks.kernels import alternated, side_by_side
from icqs_fast.features.attention import capture_attention_entropy, eager_range_entropy
from icqs_fast.io.files import write_whole

if TYPE_CHECKING:
    from transformers import PreTrainedModel

MODEL = "SmolLM2-135M-Instruct"


def make_inputs(vocab: int, seq_len: int, device: torch.device, seed: int = 0):
    """Deterministic token ids ``[1, seq_len]``; instruction = first half, response = the rest.

    Returns ``(ids, query_mask [1, T] bool, key_range [1, 2] int64)``.
    """
    gen = torch.Generator().manual_seed(seed)
    # Skip the low ids (special tokens in SmolLM2's vocabulary).
    ids = torch.randint(100, vocab, (1, seq_len), generator=gen)
    n_ins = seq_len // 2
    qm = torch.zeros(1, seq_len, dtype=torch.bool)
    qm[:, n_ins:] = True
    kr = torch.tensor([[0, n_ins]], dtype=torch.int64)
    return ids.to(device), qm.to(device), kr


def eager_entropies(attentions, key_range: torch.Tensor, query_mask: torch.Tensor):
    """Baseline: entropies from materialised attention ``[B, H, T, T]`` per layer, in fp32.

    Returns ``[B, layers, H, T]`` fp32.
    """
    per_layer = []
    for a in attentions:
        bsz, h, tq, _ = a.shape
        out = torch.zeros(bsz, h, tq, dtype=torch.float32, device=a.device)
        for b in range(bsz):
            k0, k1 = int(key_range[b, 0]), int(key_range[b, 1])
            rows = query_mask[b].nonzero()[:, 0]
            p = a[b][:, rows, k0:k1].float()
            p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
            out[b][:, rows] = -torch.special.xlogy(p, p).sum(-1)
        per_layer.append(out)
    return torch.stack(per_layer, dim=1)


def run_ours(model: PreTrainedModel, ids, qm, kr, backend: str = "auto") -> torch.Tensor:
    """Our side: one forward inside the capture (on ``backend``); returns ``[B, layers, H, T]``
    fp32."""
    with torch.no_grad(), capture_attention_entropy(model, qm, kr, backend=backend) as cap:
        model(ids, use_cache=False, logits_to_keep=1)
    return cap.entropy


def run_eager(model: PreTrainedModel, ids, qm, kr, prec64: bool = False) -> torch.Tensor:
    """Eager side: ``output_attentions=True`` then entropies from the matrices."""
    prev = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(ids, use_cache=False, logits_to_keep=1, output_attentions=True)
    finally:
        model.set_attn_implementation(prev)
    if prec64:
        return torch.stack([eager_range_entropy(a, kr, qm) for a in out.attentions], dim=1)
    return eager_entropies(out.attentions, kr, qm)


def _load(device: torch.device, random_weights: bool = False, config: str = "tiny"):
    """``(model, name)``: the embedded model (fp32 on the CPU, bf16 on CUDA) or a random-weight
    Llama of ``config`` (see :func:`icqs_fast.benchmarks.icqs.load`), with sdpa attention."""
    if random_weights:
        from icqs_fast.benchmarks.icqs import load

        model, _, name = load(device, True, config)
        return model, name
    from icqs_fast.models import load_model

    model, _ = load_model(dtype="fp32" if device.type == "cpu" else "bf16", device=device,
                          attn_implementation="sdpa")
    return model, MODEL


def measure_peak_child(side: str, seq_len: int, device: str, random_weights: bool = False,
                       config: str = "tiny") -> dict:
    """Run in a fresh process: load the model, warm up on a short input, then measure the peak
    memory growth of one ``seq_len`` forward of ``side`` ("ours" or "eager")."""
    dev = torch.device(device)
    model, _ = _load(dev, random_weights, config)
    vocab = model.config.vocab_size
    fn = run_ours if side == "ours" else run_eager
    ids, qm, kr = make_inputs(vocab, min(32, seq_len), dev)
    fn(model, ids, qm, kr)  # lazy imports and one-time allocations, not part of the peak
    ids, qm, kr = make_inputs(vocab, seq_len, dev)
    peak, _ = peak_growth_mb(lambda: fn(model, ids, qm, kr), dev)
    return {"peak_mb": peak}


def peak_in_fresh_process(side: str, seq_len: int, device: str, random_weights: bool = False,
                        config: str = "tiny") -> float:
    """:func:`measure_peak_child` in a fresh interpreter, the peak in MiB. In a process that has
    run other work, glibc may serve the matrices from pages it already holds, and the reading
    then misses them (a full test run read 12.9 MiB for eager's 72 MiB)."""
    code = ("import json, sys; from icqs_fast.benchmarks.attention import measure_peak_child; "
            f"print(json.dumps(measure_peak_child({side!r}, {seq_len}, {device!r}, "
            f"{random_weights!r}, {config!r})))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False, timeout=1200)
    if res.returncode != 0:
        raise RuntimeError(f"memory measurement of {side!r} failed:\n{res.stderr[-2000:]}")
    return float(json.loads(res.stdout.strip().splitlines()[-1])["peak_mb"])


# Correctness: largest |entropy ours - float64 eager| that passes: fp32 models (CPU records
# ~4e-5 at 1024 tokens), and half-precision ones; --tolerance overrides it.
ERR_TOL = {"float32": 1e-3, "float64": 1e-3}
ERR_TOL_HALF = 5e-2


def checks(dtype: str, tolerance: float | None = None, backends_compared: bool = False) -> dict:
    """The record's correctness fields (for a model of ``dtype``; ``backends_compared``: the
    record has the torch backend's side) and what each must be."""
    tol = at_most(tolerance if tolerance is not None else ERR_TOL.get(dtype, ERR_TOL_HALF))
    return {"max_abs_err": tol} | ({"backend_max_diff": tol} if backends_compared else {})


def triton_vs_sdpa(repeat: int, heads: int, kv_heads: int, t: int, d: int) -> dict:
    """CUDA only: one bf16 attention call, Triton forward-with-entropy vs plain SDPA (causal)."""
    from icqs_fast import ops

    dev = torch.device("cuda")
    q = torch.randn(1, heads, t, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, kv_heads, t, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, kv_heads, t, d, device=dev, dtype=torch.bfloat16)
    qm = torch.zeros(1, t, dtype=torch.bool, device=dev)
    qm[:, t // 2:] = True
    kr = torch.tensor([[0, t // 2]])
    ours = lambda: ops.attention_entropy(q, k, v, key_range=kr, query_mask=qm, backend="triton")
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
    t_ms, s_ms = side_by_side(ours, sdpa, max(repeat, 10), dev)
    return {"shape": [1, heads, kv_heads, t, d], "triton_ms": round(t_ms, 4),
            "sdpa_ms": round(s_ms, 4), "ratio": round(t_ms / s_ms, 3)}


def _cpu_pair(ours, theirs, threads: int, repeat: int) -> tuple[float, float, object, object]:
    """``ours`` and ``theirs`` timed side by side on the CPU at ``threads`` torch threads (the
    previous count restored), then run once more for their results: ``(ours_ms, theirs_ms,
    ours(), theirs())``."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        o_ms, t_ms = side_by_side(ours, theirs, repeat, torch.device("cpu"))
        return o_ms, t_ms, ours(), theirs()
    finally:
        torch.set_num_threads(prev)


def _cpp_kernel(flag: str) -> str:
    """What the cpp backend runs on (``cpp_backend.available``'s text), or a RuntimeError naming
    ``flag``, which needs it."""
    from icqs_fast.backends import cpp_backend

    ok, why = cpp_backend.available()
    if not ok:
        raise RuntimeError(f"{flag} needs the cpp backend: {why}")
    return why


# Largest |cpp - torch path| of attention_lse outputs (values ~N(0, 1)) per input dtype: fp32
# accumulation on both sides; bf16 rounds the probabilities (and, on AVX512_BF16, the products
# are summed in a different order).
LSE_TOL = {"float32": 1e-4, "bfloat16": 3e-2}


def lse_case(keys: int, dtype: torch.dtype, threads: int, repeat: int, *, entries: int = 2,
             kv_heads: int = 4, rows: int = 512, d: int = 64, seed: int = 0) -> dict:
    """One side-by-side timing of the cascade's prefix-part attention (see the module
    docstring): ``entries`` prefixes of ``keys`` slots (the second padded to 90 %)."""
    from icqs_fast import ops
    from icqs_fast.engine.cascade import attn_lse

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(entries, kv_heads, rows, d, generator=g).to(dtype)
    k = torch.randn(entries, kv_heads, keys, d, generator=g).to(dtype)
    v = torch.randn(entries, kv_heads, keys, d, generator=g).to(dtype)
    lens = torch.tensor([keys] + [max(1, keys * 9 // 10)] * (entries - 1))
    key_ok = torch.arange(keys)[None, :] < lens[:, None]
    allow = key_ok[:, None, None, :]
    scale = d ** -0.5
    c_ms, t_ms, (o1, l1), (o2, l2) = _cpu_pair(
        lambda: ops.attention_lse(q, k, v, scale=scale, attention_mask=key_ok, backend="cpp"),
        lambda: attn_lse(q, k, v, allow, scale), threads, repeat)
    flop = 4.0 * entries * kv_heads * rows * d * float(lens.sum()) / entries
    name = str(dtype).removeprefix("torch.")
    return {"keys": keys, "dtype": name, "threads": threads,
            "shape": [entries, kv_heads, rows, keys, d], "cpp_ms": round(c_ms, 3),
            "torch_ms": round(t_ms, 3), "speedup": round(t_ms / c_ms, 3),
            "cpp_gflops": round(flop / c_ms / 1e6, 1),
            "torch_gflops": round(flop / t_ms / 1e6, 1),
            "max_out_diff": float((o1.float() - o2.float()).abs().max()),
            "max_lse_diff": float((l1 - l2).abs().max())}


def lse_section(keys: list[int], threads: list[int], repeat: int) -> dict:
    """The ``attention_lse`` record section: :func:`lse_case` for every key count, dtype and
    thread count, and what the kernel ran on."""
    why = _cpp_kernel("--lse")
    cases = [lse_case(n, dt, t, repeat) for t in threads for dt in (torch.float32, torch.bfloat16)
             for n in keys]
    from icqs_fast import _C

    return {"kernel": why, "bf16_dot_products": bool(_C.attention_bf16_dot()),
            "baseline": "icqs_fast.engine.cascade.attn_lse (torch's CPU flash kernel, additive "
                        "padding mask)", "cases": cases}


def lse_failures(section: dict) -> list[str]:
    """The failed correctness fields of the ``attention_lse`` section's cases (the two sides
    agree within :data:`LSE_TOL` of the dtype), one message each."""
    failed = []
    for i, c in enumerate(section["cases"]):
        tol = at_most(LSE_TOL[c["dtype"]])
        failed += check_fields(c, {"max_out_diff": tol, "max_lse_diff": tol},
                               prefix=f"attention_lse.cases[{i}].")
    return failed


# Largest |cpp - torch| of the entropy-op section (fp32 both sides; entropies of ~1-7 nats).
ENTROPY_OP_TOL = 1e-4


def entropy_op_case(tokens: int, threads: int, repeat: int, *, heads: int = 9,
                    kv_heads: int = 3, d: int = 64, seed: int = 0) -> dict:
    """One side-by-side timing of ``ops.attention_entropy`` itself, cpp against torch, on one
    layer of the capture's shape (the embedded model's 9 query / 3 key heads of 64, causal,
    the second half of ``tokens`` flagged, the first half the key range), fp32, random inputs."""
    from icqs_fast import ops

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, tokens, d, generator=g)
    k = torch.randn(1, kv_heads, tokens, d, generator=g)
    v = torch.randn(1, kv_heads, tokens, d, generator=g)
    qm = torch.zeros(1, tokens, dtype=torch.bool)
    qm[:, tokens // 2:] = True
    kr = torch.tensor([[0, tokens // 2]])
    cpp, ref = (lambda b=b: ops.attention_entropy(q, k, v, key_range=kr, query_mask=qm,
                                                  scale=d ** -0.5, backend=b)
                for b in ("cpp", "torch"))
    c_ms, t_ms, (o1, e1), (o2, e2) = _cpu_pair(cpp, ref, threads, repeat)
    return {"tokens": tokens, "threads": threads, "shape": [1, heads, kv_heads, tokens, d],
            "cpp_ms": round(c_ms, 3), "torch_ms": round(t_ms, 3),
            "speedup": round(t_ms / c_ms, 3),
            "max_entropy_diff": float((e1 - e2).abs().max()),
            "max_out_diff": float((o1 - o2).abs().max())}


def entropy_op_section(tokens: list[int], threads: list[int], repeat: int) -> dict:
    """The ``attention_entropy_op`` record section: :func:`entropy_op_case` per token count and
    thread count, and what the kernel ran on."""
    return {"kernel": _cpp_kernel("--entropy-op"),
            "baseline": "the torch backend (SDPA, then the flagged rows' softmax over the key "
                        "range)",
            "cases": [entropy_op_case(n, t, repeat) for t in threads for n in tokens]}


def entropy_op_failures(section: dict) -> list[str]:
    """The failed correctness fields of the entropy-op section (cpp and torch agree within
    :data:`ENTROPY_OP_TOL`), one message each."""
    failed = []
    tol = at_most(ENTROPY_OP_TOL)
    for i, c in enumerate(section["cases"]):
        failed += check_fields(c, {"max_entropy_diff": tol, "max_out_diff": tol},
                               prefix=f"attention_entropy_op.cases[{i}].")
    return failed


def bench(seq_len: int, repeat: int, device: torch.device, measure_memory: bool = True,
          random_weights: bool = False, config: str = "tiny") -> dict:
    """The benchmark record (see the module docstring for the fields)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    model, name = _load(device, random_weights, config)
    cfg = model.config
    ids, qm, kr = make_inputs(cfg.vocab_size, seq_len, device)
    dtype = next(model.parameters()).dtype
    backend = backends.choose("attention_entropy", "auto", device, dtype)
    # Ours, eager and (off the torch backend) ours on the torch backend, alternated in one loop:
    # every ratio of the record compares times taken under the same load.
    sides = [lambda: run_ours(model, ids, qm, kr), lambda: run_eager(model, ids, qm, kr)]
    if backend != "torch":
        sides.append(lambda: run_ours(model, ids, qm, kr, "torch"))
    t_ms, e_ms, *r_ms = alternated(sides, repeat, device)
    ours = run_ours(model, ids, qm, kr).double().cpu()
    ref = run_eager(model, ids, qm, kr, prec64=True).double().cpu()
    err = float((ours - ref).abs().max())
    rec = {
        "model": name, "device": device.type, "seq_len": seq_len, "backend": backend,
        "time_ms": round(t_ms, 2), "eager_ms": round(e_ms, 2), "speedup": round(e_ms / t_ms, 3),
        "torch_backend_ms": None, "backend_speedup": None, "backend_max_diff": None,
        "peak_mem_mb": None, "eager_peak_mem_mb": None, "mem_ratio": None,
        "max_abs_err": err,
        "instruction_tokens": int(kr[0, 1]), "response_tokens": seq_len - int(kr[0, 1]),
        "layers": cfg.num_hidden_layers, "heads": cfg.num_attention_heads,
        "dtype": str(dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(), "repeat": repeat,
        "note": "both sides skip the LM head (logits_to_keep=1); peak memory = growth over one "
                "forward in a fresh process",
    }
    if r_ms:
        diff = (ours - run_ours(model, ids, qm, kr, "torch").double().cpu()).abs().max()
        rec.update(torch_backend_ms=round(r_ms[0], 2), backend_speedup=round(r_ms[0] / t_ms, 3),
                   backend_max_diff=float(diff))
    if measure_memory:
        dev = str(device)
        p_ours = peak_in_fresh_process("ours", seq_len, dev, random_weights, config)
        p_eager = peak_in_fresh_process("eager", seq_len, dev, random_weights, config)
        rec.update(peak_mem_mb=round(p_ours, 1), eager_peak_mem_mb=round(p_eager, 1),
                   mem_ratio=round(p_eager / max(p_ours, 1e-3), 2))
    if device.type == "cuda":
        d = cfg.hidden_size // cfg.num_attention_heads
        rec["triton_vs_sdpa"] = [
            triton_vs_sdpa(repeat, cfg.num_attention_heads, cfg.num_key_value_heads, seq_len, d),
            triton_vs_sdpa(repeat, 32, 8, 4096, 128),
        ]
    return rec


def run(args: argparse.Namespace) -> int:
    seq_len = 128 if args.quick else args.seq_len
    repeat = 1 if args.quick else args.repeat
    if seq_len < 2:
        raise ValueError(f"--seq-len must be >= 2, got {seq_len}")
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    # The sections' lists are read before anything runs: a bad one costs no measurement.
    lse, entropy_op = getattr(args, "lse", False), getattr(args, "entropy_op", False)
    if lse or entropy_op:
        threads = _int_list(args.lse_threads, "--lse-threads")
    if lse:
        keys = [128] if args.quick else _int_list(args.lse_keys, "--lse-keys")
    if entropy_op:
        tokens = [128] if args.quick else _int_list(args.entropy_op_tokens,
                                                    "--entropy-op-tokens")
    t0 = time.perf_counter()
    rec = bench(seq_len, repeat, device, measure_memory=not args.no_memory,
                random_weights=args.random_weights, config=args.config)
    section_failed: list[str] = []
    if lse:
        rec["attention_lse"] = lse_section(keys, threads, repeat)
        section_failed += lse_failures(rec["attention_lse"])
    if entropy_op:
        rec["attention_entropy_op"] = entropy_op_section(tokens, threads, repeat)
        section_failed += entropy_op_failures(rec["attention_entropy_op"])
    rec["bench_s"] = round(time.perf_counter() - t0, 1)
    rec.update(environment(device))
    text = json.dumps(rec, indent=2)
    if args.out:
        write_whole(args.out, text + "\n")
    if args.json:
        print(text)
    else:
        for key, val in rec.items():
            print(f"{key:>20}: {val}")
    return report_failures("attention", check_fields(
        rec, checks(rec["dtype"], getattr(args, "tolerance", None),
                    rec.get("backend_max_diff") is not None)) + section_failed)


def _int_list(text: str, flag: str) -> list[int]:
    """``"512,2048"`` -> ``[512, 2048]`` (each >= 1), or a ValueError naming ``flag``."""
    try:
        vals = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise ValueError(f"{flag} must be a comma-separated list of ints >= 1, got {text!r}")
    return vals
