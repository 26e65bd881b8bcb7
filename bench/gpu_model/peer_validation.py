"""Validation of the static GPU model against published timings of kernels nobody here wrote.

Each record (``"validation": true``) compiles a peer's kernel (TRL's fused log-prob/entropy
forward, Liger's cross-entropy and fused-linear-cross-entropy forwards from the installed
packages; the Triton fused-attention tutorial and Cut Cross-Entropy re-implemented in
:mod:`bench.gpu_model.peer_shapes`) at the shape of its published H100 / A100 timing, asks
the model for a ``[low, high]`` range and says where the published time falls
(:func:`range_errors`). ``bench static`` appends them to its table records.
"""

from __future__ import annotations

from typing import Any

from bench.gpu_model import model as gpu_model
from bench.gpu_model.compiler import Compiler, analyze

TRL_7244 = {
    "source": "huggingface/trl issue #7244 (H100, bf16, logits [8, 1024, 151936]): fused "
              "log-prob + entropy forward 0.89 ms",
    "published_ms": 0.89, "b": 8, "t": 1024, "v": 151936,
}
LIGER_CSV = ("linkedin/Liger-Kernel benchmark/data/all_benchmark_data.csv: "
             "megatron_cross_entropy, kernel_provider=liger, forward, speed (y_value_50), "
             "gpu_name='NVIDIA H100 80GB HBM3', liger 0.8.0, S=2048, B=4, TP=1, bf16 logits")
# (V, median ms) of those rows.
LIGER_H100_CE = ((4096, 0.1386), (8192, 0.2626), (16384, 0.4158), (32768, 0.8098),
                 (65536, 1.5309), (131072, 2.9675))


def _launch_cls():
    from bench.gpu_model.launches import Launch
    return Launch


def trl_launches() -> list:
    """TRL's ``_forward_kernel`` (``trl.kernels.logprob_entropy``, the installed package) at
    the shape of TRL issue 7244, with the arguments its wrapper passes."""
    from trl.kernels import logprob_entropy as m

    Launch = _launch_cls()
    b, t, v = TRL_7244["b"], TRL_7244["t"], TRL_7244["v"]
    n = b * t
    sig = {"logits_ptr": "*bf16", "index_ptr": "*i64", "row_mask_ptr": "*i64",
           "logprobs_ptr": "*fp32", "entropy_ptr": "*fp32", "log_z_ptr": "*fp32",
           "expected_logit_ptr": "*fp32", "logits_batch_stride": "i32",
           "logits_row_stride": "i32", "index_batch_stride": "i32", "index_row_stride": "i32",
           "mask_batch_stride": "i32", "mask_row_stride": "i32", "n_cols": "constexpr",
           "rows_per_batch": "i32", "TEMPERATURE": "constexpr", "HAS_MASK": "constexpr",
           "BLOCK_SIZE": "constexpr"}
    ints = {"logits_batch_stride": t * v, "logits_row_stride": v, "index_batch_stride": t,
            "index_row_stride": 1, "mask_batch_stride": 0, "mask_row_stride": 0,
            "rows_per_batch": t}
    div = [k for k, s in sig.items() if s.startswith("*")]
    div += [k for k, x in ints.items() if x % 16 == 0]
    block = m._BLOCK_SIZE
    return [Launch(
        kernel="trl._forward_kernel", fn=m._forward_kernel, signature=sig,
        constexprs={"n_cols": v, "TEMPERATURE": 1.0, "HAS_MASK": False, "BLOCK_SIZE": block},
        num_warps=4, num_stages=3, grid=(n, 1, 1),
        hbm_bytes=n * v * 2 + n * 8 + 4 * n * 4 + n * 2, elements=n * v,
        loop_iters=float(-(-v // block)), loop_elements=block, label=f"b{block}_w4",
        extra={"divisible_by_16": div})]


def liger_launches(v: int, s: int = 2048, b: int = 4) -> list:
    """Liger's Megatron cross-entropy forward at ``[s, b, v]`` bf16 (TP=1), as its
    ``LigerVocabParallelCEFunction.forward`` runs it: ``x.amax(-1)`` (a torch reduction,
    modelled by bandwidth only, kernel ``torch.amax``) then
    ``liger_vocab_parallel_ce_forward_kernel`` (installed package) with its own block size and
    warps."""
    from liger_kernel.ops import vocab_parallel_cross_entropy as m

    Launch = _launch_cls()
    bt = s * b
    block = m._select_block_size(v)
    warps = m._get_num_warps(block)
    sig = {"X_ptr": "*bf16", "X_stride": "i32", "EXP_ptr": "*fp32", "EXP_stride": "i32",
           "logits_max_ptr": "*fp32", "Y_ptr": "*i64", "pred_ptr": "*fp32",
           "sum_exp_ptr": "*fp32", "vocab_start": "i32", "n_cols": "i32",
           "ignore_index": "i32", "BLOCK_SIZE": "constexpr"}
    div = [k for k, t in sig.items() if t.startswith("*")]
    div += [k for k, x in {"X_stride": v, "EXP_stride": v, "vocab_start": 0,
                           "n_cols": v}.items() if x % 16 == 0]
    kern = Launch(
        kernel="liger_vocab_parallel_ce_forward_kernel",
        fn=m.liger_vocab_parallel_ce_forward_kernel,
        signature=sig, constexprs={"BLOCK_SIZE": block}, num_warps=warps, num_stages=3,
        grid=(bt, 1, 1), hbm_bytes=bt * v * (2 + 4) + bt * (4 + 8 + 4 + 4 + 2),
        elements=bt * v, loop_iters=float(-(-v // block)), loop_elements=block,
        label=f"b{block}_w{warps}", extra={"divisible_by_16": div})
    return [kern]


LIGER_FLCE_CSV = ("linkedin/Liger-Kernel benchmark/data/all_benchmark_data.csv: "
                  "fused_linear_cross_entropy, kernel_provider=liger, forward, speed "
                  "(y_value_50), gpu_name='NVIDIA A100-SXM4-80GB', liger 0.4.2, H=4096, "
                  "V=128256, bf16 (no H100 rows for this kernel in the CSV)")
LIGER_CE_A100_CSV = ("linkedin/Liger-Kernel benchmark/data/all_benchmark_data.csv: "
                     "cross_entropy, kernel_provider=liger, forward, speed (y_value_50), "
                     "gpu_name='NVIDIA A100-SXM4-80GB', liger 0.2.1, B=8, T=2048, fp32 logits")
LIGER_A100_CE = ((4096, 0.5324), (8192, 0.8101), (16384, 1.4321), (32768, 2.8378),
                 (65536, 6.8051), (131072, 15.0094))
# (BT, median ms) of those rows.
LIGER_A100_FLCE = ((4096, 119.5215), (8192, 168.0856), (16384, 274.0734), (32768, 508.4652))


def liger_ce_launch(rows: int, v: int, n_non_ignore: int, dtype: str = "bf16") -> Any:
    """Liger's ``liger_cross_entropy_kernel`` (installed package) on ``[rows, v]`` logits of
    ``dtype`` (``"bf16"``/``"fp32"``), as its cross-entropy and fused-linear-cross-entropy
    forwards launch it (gradient written in place, mean reduction, no weights / softcap /
    z-loss)."""
    from liger_kernel.ops import cross_entropy as m

    Launch = _launch_cls()
    block = min(32768, 1 << (v - 1).bit_length())
    el = 2 if dtype == "bf16" else 4
    sig = {"X_ptr": f"*{dtype}", "X_stride": "i32", "Y_ptr": "*i64", "Y_stride": "i32",
           "weight_ptr": "constexpr", "loss_ptr": "*fp32", "z_loss_ptr": "constexpr",
           "loss_stride": "i32", "token_accuracy_ptr": "constexpr",
           "token_accuracy_stride": "i32", "predicted_tokens_ptr": "constexpr",
           "predicted_tokens_stride": "i32", "n_cols": "i32", "n_non_ignore": "i32",
           "sum_non_ignore_weight": "i32", "weight_sum": "fp32", "ignore_index": "i32",
           "lse_square_scale": "constexpr", "label_smoothing": "constexpr",
           "reduction": "constexpr", "softcap": "constexpr", "RETURN_Z_LOSS": "constexpr",
           "RETURN_TOKEN_ACCURACY": "constexpr", "RETURN_PREDICTED_TOKENS": "constexpr",
           "BLOCK_SIZE": "constexpr", "HAS_WEIGHT": "constexpr", "HAS_SOFTCAPPING": "constexpr",
           "HAS_GRADIENTS": "constexpr"}
    const = {"weight_ptr": None, "z_loss_ptr": None, "token_accuracy_ptr": None,
             "predicted_tokens_ptr": None, "lse_square_scale": 0.0, "label_smoothing": 0.0,
             "reduction": "mean", "softcap": None, "RETURN_Z_LOSS": False,
             "RETURN_TOKEN_ACCURACY": False, "RETURN_PREDICTED_TOKENS": False,
             "BLOCK_SIZE": block, "HAS_WEIGHT": False, "HAS_SOFTCAPPING": False,
             "HAS_GRADIENTS": True}
    ints = {"X_stride": v, "Y_stride": 1, "loss_stride": 1, "token_accuracy_stride": 0,
            "predicted_tokens_stride": 0, "n_cols": v, "n_non_ignore": n_non_ignore,
            "sum_non_ignore_weight": n_non_ignore, "ignore_index": -100}
    div = [k for k, t in sig.items() if t.startswith("*")]
    div += [k for k, x in ints.items() if x % 16 == 0]
    return Launch(
        kernel="liger_cross_entropy_kernel", fn=m.liger_cross_entropy_kernel, signature=sig,
        constexprs=const, num_warps=32, num_stages=3, grid=(rows, 1, 1),
        # Compulsory: logits read once, gradient written once in place; targets, loss.
        hbm_bytes=rows * v * el * 2 + rows * (8 + 4), elements=rows * v,
        loop_iters=float(-(-v // block)), loop_elements=block, label=f"b{block}_w32",
        extra={"divisible_by_16": div})


def matmul_seconds(hw, m: int, n: int, k: int, bytes_: float) -> float:
    """A cuBLAS matmul ``[m, k] @ [k, n]`` modelled at the achievable tensor peak or bandwidth,
    whichever is slower, plus one launch."""
    return max(2 * m * n * k / hw.tensor_bf16_achievable, bytes_ / hw.hbm_achievable) + \
        hw.launch_overhead_s


def flce_seconds(hw, ce_record: dict, bt: int, h: int, v: int) -> tuple[float, int, int]:
    """Liger 0.4.2's fused-linear-cross-entropy forward (which also computes the gradients):
    per chunk of ``c = next_pow2(cdiv(BT, cdiv(V, H)))`` rows, ``logits = x_c W^T``, the CE
    kernel (``ce_record``, the compiled kernel's prediction for one chunk), ``grad = logits *
    alpha``, ``grad_input_c = grad W`` and ``grad_W += grad^T x_c`` (bf16 ``addmm``).
    Returns ``(seconds, chunk rows, chunks)``."""
    inc = -(-v // h)
    c = 1 << (-(-bt // inc) - 1).bit_length()
    chunks = -(-bt // c)
    e = 2  # bf16 bytes
    t = matmul_seconds(hw, c, v, h, (c * h + v * h + c * v) * e)          # logits
    t += ce_record["predicted_ms"] * 1e-3                                  # CE kernel
    t += 2 * c * v * e / hw.hbm_achievable + hw.launch_overhead_s           # grad = logits*a
    t += matmul_seconds(hw, c, h, v, (c * v + v * h + c * h) * e)          # grad_input
    t += matmul_seconds(hw, v, h, c, (c * v + c * h + 2 * v * h) * e)      # grad_W addmm
    return chunks * t, c, chunks


# Small torch launches in LigerVocabParallelCEFunction.forward besides amax and the kernel
# (.float(), log, subtract, ==, zeros_like, where): launch overhead each.
LIGER_SMALL_LAUNCHES = 6


def validation_records(compiler: Compiler, arch: str = "sm_90") -> list[dict]:
    """Predicted vs published H100 times (``"validation": true`` records)."""
    hw = gpu_model.hardware(arch)
    out: list[dict] = []

    def record(kernel, source, shape, published, recs, extra_s=0.0, note=""):
        if any("error" in r for r in recs):
            out.append({"validation": True, "kernel": kernel, "source": source, "shape": shape,
                        "arch": arch, "published_ms": published,
                        "error": "; ".join(r["error"] for r in recs if "error" in r)})
            return
        low = sum(r["predicted_low_ms"] for r in recs) + extra_s * 1e3
        high = sum(r["predicted_high_ms"] for r in recs) + extra_s * 1e3
        out.append({"validation": True, "kernel": kernel, "source": source, "shape": shape,
                    "arch": arch, "published_ms": published, "predicted_ms": low,
                    **range_errors(published, low, high),
                    "bound": recs[0]["bound"], "bound_class": bound_class(recs[0]),
                    "regs": recs[0]["regs"],
                    "spill_bytes": recs[0]["spill_bytes"], "terms_ms": recs[0]["terms_ms"],
                    "config": recs[0]["config"], "note": note})

    out += compute_validation_records(compiler, arch)
    if arch == "sm_80":
        for v, ms in LIGER_A100_CE:
            bt = 8 * 2048
            try:
                ln = liger_ce_launch(bt, v, bt, "fp32")
                recs = [analyze(ln, arch, compiler(ln, arch), hw)]
            except Exception as exc:  # noqa: BLE001
                recs = [{"error": f"{type(exc).__name__}: {exc}"}]
            record("liger cross_entropy forward (liger_cross_entropy_kernel)", LIGER_CE_A100_CSV,
                   {"bt": bt, "v": v, "dtype": "float32"}, ms, recs,
                   extra_s=2 * hw.launch_overhead_s,
                   note="kernel compiled from liger-kernel "
                        f"{_version('liger-kernel')} (published with 0.2.1); bytes = logits read "
                        "once + gradient written once (the kernel's second pass re-reads each "
                        "row: from L2 only while the rows in flight fit in it); + loss "
                        "zeros/sum launches")
        h, v = 4096, 128256
        for bt, ms in LIGER_A100_FLCE:
            inc = -(-v // h)
            c = 1 << (-(-bt // inc) - 1).bit_length()
            try:
                ln = liger_ce_launch(c, v, bt)
                recs = [analyze(ln, arch, compiler(ln, arch), hw)]
            except Exception as exc:  # noqa: BLE001
                recs = [{"error": f"{type(exc).__name__}: {exc}"}]
            if "error" in recs[0]:
                record("liger fused_linear_cross_entropy forward", LIGER_FLCE_CSV,
                       {"bt": bt, "h": h, "v": v, "dtype": "bfloat16"}, ms, recs)
                continue
            secs, c, chunks = flce_seconds(hw, recs[0], bt, h, v)
            record("liger fused_linear_cross_entropy forward", LIGER_FLCE_CSV,
                   {"bt": bt, "h": h, "v": v, "dtype": "bfloat16"}, ms, recs,
                   extra_s=secs - recs[0]["predicted_ms"] * 1e-3,
                   note=f"{chunks} chunks of {c} rows; per chunk 3 cuBLAS matmuls (max of "
                        "FLOPs at the achievable tensor peak and bytes at the achievable "
                        "bandwidth) + liger_cross_entropy_kernel compiled from liger-kernel "
                        f"{_version('liger-kernel')} (published with 0.4.2) + one elementwise "
                        "scale; the compiled kernel's terms are for one chunk")
        return out
    try:
        launches = trl_launches()
        recs = [analyze(ln, arch, compiler(ln, arch), hw) for ln in launches]
    except Exception as exc:  # noqa: BLE001
        recs = [{"error": f"{type(exc).__name__}: {exc}"}]
    record("trl._forward_kernel (logprob_entropy)", TRL_7244["source"],
           {"b": TRL_7244["b"], "t": TRL_7244["t"], "v": TRL_7244["v"], "dtype": "bfloat16"},
           TRL_7244["published_ms"], recs)
    for v, ms in LIGER_H100_CE:
        try:
            launches = liger_launches(v)
            recs = [analyze(ln, arch, compiler(ln, arch), hw) for ln in launches]
        except Exception as exc:  # noqa: BLE001
            recs = [{"error": f"{type(exc).__name__}: {exc}"}]
        bt = 2048 * 4
        amax_s = bt * v * 2 / hw.hbm_achievable + hw.launch_overhead_s
        small_s = LIGER_SMALL_LAUNCHES * hw.launch_overhead_s
        record("liger LigerMegatronCrossEntropy forward (amax + "
               "liger_vocab_parallel_ce_forward_kernel)", LIGER_CSV,
               {"s": 2048, "b": 4, "v": v, "dtype": "bfloat16"}, ms, recs,
               extra_s=amax_s + small_s,
               note=f"kernel compiled from liger-kernel {_version('liger-kernel')} (published "
                    "with 0.8.0); amax modelled as bandwidth + launch, 6 small torch ops as "
                    "launch overhead; host (Python) time not modelled")
    return out


def range_errors(published_ms: float, low_ms: float, high_ms: float) -> dict[str, Any]:
    """How a published time sits against the model's ``[low, high]`` range (all in ms).

    ``rel_error_low`` / ``rel_error_high``: ``(end - published) / published``; ``rel_error``
    keeps its old meaning (the low end); ``rel_error_range``: 0 inside the range, else the
    relative distance to the nearer end; ``overlap_position``: ``(published - low) / (high -
    low)`` (0 = perfect overlap, 1 = no tensor / CUDA-core overlap; None when low = high);
    ``within_35pct``: ``|rel_error_range| <= 0.35``; ``within_35pct_high``: the pessimistic end
    alone within 35%.
    """
    e_low = (low_ms - published_ms) / published_ms
    e_high = (high_ms - published_ms) / published_ms
    if low_ms <= published_ms <= high_ms:
        e_range = 0.0
    else:
        e_range = e_low if abs(e_low) < abs(e_high) else e_high
    span = high_ms - low_ms
    return {"predicted_low_ms": low_ms, "predicted_high_ms": high_ms, "rel_error": e_low,
            "rel_error_low": e_low, "rel_error_high": e_high, "rel_error_range": e_range,
            "overlap_position": (published_ms - low_ms) / span if span > 1e-12 else None,
            "within_35pct": abs(e_range) <= 0.35, "within_35pct_high": abs(e_high) <= 0.35}


def bound_class(rec: dict) -> str:
    """``"compute"`` for a record whose kernel runs tensor-core instructions on real work,
    else ``"memory"`` (hbm-bound) or ``"instruction"`` (issue / MUFU / shuffle-bound)."""
    if rec.get("tensor_cores") and rec.get("terms_ms", {}).get("tensor", 0.0) > 0:
        return "compute"
    return "memory" if rec.get("bound") == "hbm" else "instruction"


# Compute-bound validation: published figures of Triton kernels whose shape
# bench/gpu_model/peer_shapes.py re-implements.
CCE_README = ("apple/ml-cross-entropy README.md, 'Expected output with A100 SMX4, PyTorch 2.4.1, "
              "and CUDA 12.4': cce loss-fw 46.4 ms, test_data gemma2 (benchmark/data: "
              "google/gemma-2-2b-it, M = 8192 tokens, hidden 2304, vocabulary 256000, "
              "final_logit_softcapping 30), bf16")
TUTORIAL_DOCS = ("triton-lang.org/main/getting-started/tutorials/06-fused-attention.html, "
                 "fused-attention-batch4-head32-d64-fwd-causal={causal}, N_CTX=4096, Triton "
                 "[FP16]: {tflops} TFLOP/s (the page does not name its GPU; the FP8 column no "
                 "faster than FP16 and 51% of the 312 TFLOP/s fp16 peak point to an A100)")
FA3_FIGURE = ("Dao-AILab/flash-attention assets/flash3_fp16_fwd.png (FlashAttention-3 paper, "
              "H100 80GB SXM5, fp16 forward, batch x seqlen = 16k tokens, hidden 2048): "
              "'Triton' bar at seqlen 4k, head dim {d}, {mask}: {tflops} TFLOP/s")
# (arch, head dim, causal, published TFLOP/s, source template)
TUTORIAL_POINTS = (
    ("sm_80", 64, True, 150.0, TUTORIAL_DOCS), ("sm_80", 64, False, 160.6, TUTORIAL_DOCS),
    ("sm_90", 64, False, 400.0, FA3_FIGURE), ("sm_90", 64, True, 363.0, FA3_FIGURE),
    ("sm_90", 128, False, 389.0, FA3_FIGURE), ("sm_90", 128, True, 353.0, FA3_FIGURE),
)
# The tutorial's autotuning space at these shapes (4 warps only, see peer_shapes); the model
# stands in for the autotuner by keeping the configuration it predicts fastest (high end).
TUTORIAL_TILES = ((128, 64), (64, 64), (128, 32), (64, 32))
# CCE loss-fw launches besides the LSE kernel: the target-logit gather-dot (reads E and the
# target rows of C), and small ones (LSE / lock / logit-average fills, the loss mean).
CCE_SMALL_LAUNCHES = 4


def compute_validation_records(compiler: Compiler, arch: str, tiles=TUTORIAL_TILES) -> list[dict]:
    """Compute-bound validation records for ``arch``: the tutorial's attention forward at the
    published points of that arch and, on sm_80, Cut Cross-Entropy's forward."""
    from bench.gpu_model import peer_shapes

    hw = gpu_model.hardware(arch)
    out: list[dict] = []

    def add(kernel, source, shape, published_ms, rec, extra_s=0.0, note="", tried=None):
        base = {"validation": True, "kernel": kernel, "source": source, "shape": shape,
                "arch": arch, "published_ms": published_ms, "compute_bound_point": True}
        if "error" in rec:
            out.append({**base, "error": rec["error"]})
            return
        low = rec["predicted_low_ms"] + extra_s * 1e3
        high = rec["predicted_high_ms"] + extra_s * 1e3
        flops = rec["tensor_flops"]
        out.append({**base, "predicted_ms": low, **range_errors(published_ms, low, high),
                    "published_tflops": flops / published_ms / 1e9,
                    "predicted_tflops_low_high": [flops / high / 1e9, flops / low / 1e9],
                    "bound": rec["bound"], "bound_class": bound_class(rec), "regs": rec["regs"],
                    "spill_bytes": rec["spill_bytes"], "terms_ms": rec["terms_ms"],
                    "config": rec["config"], "configs_tried": tried or [], "note": note})

    if arch == "sm_80":
        n, d, v = 8192, 2304, 256000
        try:
            ln = peer_shapes.cce_launch(n, d, v)
            rec = analyze(ln, arch, compiler(ln, arch), hw)
        except Exception as exc:  # noqa: BLE001 - report, continue with the other points
            rec = {"error": f"{type(exc).__name__}: {exc}"}
        gather_s = 2 * n * d * 2 / hw.hbm_achievable + hw.launch_overhead_s
        add("cut cross-entropy forward (cce_lse_forward shape + indexed dot)", CCE_README,
            {"n": n, "d": d, "v": v, "softcap": 30.0, "dtype": "bfloat16"}, 46.4, rec,
            extra_s=gather_s + CCE_SMALL_LAUNCHES * hw.launch_overhead_s,
            note="kernel re-implemented in bench/gpu_model/peer_shapes.py after CCE's "
                 "cce_lse_forward.py (256x128x32 tile, 8 warps, 3 stages, soft-cap, column "
                 "mean atomics, locked LSE merge); target-logit kernel modelled as bandwidth "
                 "+ launch, 4 small launches as launch overhead")
    for p_arch, d, causal, tflops, template in TUTORIAL_POINTS:
        if p_arch != arch:
            continue
        z, h, n = 4, 2048 // d, 4096
        if template is TUTORIAL_DOCS:
            h = 32  # the tutorial's own benchmark: BATCH 4, H 32
        best, tried = None, []
        for bm, bn in tiles:
            try:
                ln = peer_shapes.fa_launch(z, h, n, d, causal, block_m=bm, block_n=bn)
                rec = analyze(ln, arch, compiler(ln, arch), hw)
            except Exception as exc:  # noqa: BLE001
                rec = {"error": f"{type(exc).__name__}: {exc}"}
            if "error" in rec:
                tried.append({"tile": [bm, bn], "error": rec["error"]})
                continue
            tried.append({"tile": [bm, bn], "predicted_low_ms": rec["predicted_low_ms"],
                          "predicted_high_ms": rec["predicted_high_ms"],
                          "spill_bytes": rec["spill_bytes"]})
            # Spills are not priced by the model: a spilling tile is kept only if every
            # tile spills.
            key = (rec["spill_bytes"] > 0, rec["predicted_high_ms"])
            if best is None or key < (best["spill_bytes"] > 0, best["predicted_high_ms"]):
                best = rec
        flops = 4 * z * h * n * n * d // (2 if causal else 1)
        published_ms = flops / (tflops * 1e12) * 1e3
        source = template.format(causal=causal, tflops=tflops, d=d,
                                 mask="causal" if causal else "non-causal")
        add("triton 06-fused-attention forward (re-implemented shape)", source,
            {"z": z, "h": h, "n": n, "d": d, "causal": causal, "dtype": "float16"},
            published_ms, best or {"error": "; ".join(t["error"] for t in tried)},
            tried=tried,
            note="kernel re-implemented in bench/gpu_model/peer_shapes.py after the "
                 "tutorial's non-TMA forward; the model keeps the tile it predicts fastest "
                 "(high end, non-spilling first) among the tutorial's 4-warp choices, as its "
                 "autotuner keeps the fastest measured; published ms = the tutorial's FLOP "
                 "count / TFLOP/s")
    return out


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"
