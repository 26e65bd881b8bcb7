"""``gpu_launches``: the launch of
:func:`icqs_fast.kernels.attention_entropy.launch_attention` on a CUDA device, as
:class:`~bench.gpu_model.launches.Launch` data for the static model. The kernel module's own
launch-settings function picks the configuration, so the description follows the launcher."""

from __future__ import annotations

import torch
import triton
from icqs_fast.kernels.attention_entropy import (
    AttentionSettings,
    _attn_entropy_fwd,
    attention_settings,
)

from bench.gpu_model.launches import Launch, ptr


def _int_type(v: int) -> str:
    # The Triton runtime passes an int argument as i64 once it no longer fits in i32.
    return "i32" if -(2 ** 31) <= v < 2 ** 31 else "i64"


_CONSTEXPRS = ("CAUSAL", "HAS_KEYOK", "HAS_POS", "HAS_WINDOW", "HAS_CHUNK", "HAS_SOFTCAP",
               "HAS_SINKS", "WITH_ENTROPY", "RETURN_LSE", "FP32_DOT", "DOT_BF16", "PRECISION",
               "EVEN_N", "HEAD_DIM", "HEAD_DV", "BLOCK_M", "BLOCK_N", "BLOCK_D", "BLOCK_DV")


def _signature(dtype: torch.dtype, strides: dict[str, int], scalars: dict[str, int]
               ) -> dict[str, str]:
    sig = {"q_ptr": ptr(dtype), "k_ptr": ptr(dtype), "v_ptr": ptr(dtype), "out_ptr": ptr(dtype),
           "ent_ptr": "*fp32", "lse_ptr": "*fp32", "keyok_ptr": "*i8", "qmask_ptr": "*i8",
           "krange_ptr": "*i64", "qpos_ptr": "*i32", "kpos_ptr": "*i32", "sinks_ptr": "*fp32"}
    sig.update({name: _int_type(v) for name, v in strides.items()})
    # The Triton runtime specialises an int argument equal to 1 into a constexpr (GROUP = 1
    # when Hq == Hk), as the launch on a GPU compiles it.
    sig.update({name: "constexpr" if v == 1 else _int_type(v) for name, v in scalars.items()})
    sig["qk_scale"] = "fp32"
    sig["cap_out"] = "fp32"
    for c in _CONSTEXPRS:
        sig[c] = "constexpr"
    return sig


def _allowed_pairs(tq: int, tk: int, causal: bool, window: int | None = None,
                   chunk: int | None = None) -> int:
    """(query, key) pairs a causal / full / sliding-window / chunked attention allows (queries
    at the last tq positions, keys at 0 .. tk - 1)."""
    if window is None and chunk is None:
        # causal: query i sees keys 0 .. tk - tq + i: sum over i of (tk - tq + i + 1)
        return tq * (tk - tq) + tq * (tq + 1) // 2 if causal else tq * tk
    total = 0
    for p in range(tk - tq, tk):  # the queries' default positions
        lo, hi = 0, (min(p, tk - 1) if causal else tk - 1)
        if window is not None:
            lo = max(lo, p - window + 1)
        if chunk is not None:
            if p < 0:
                continue
            lo, hi = max(lo, p - p % chunk), min(hi, p - p % chunk + chunk - 1)
        total += max(hi - lo + 1, 0)
    return total


def _key_blocks(cfg: AttentionSettings, tq: int, tk: int, causal: bool,
                window: int | None = None, chunk: int | None = None) -> list[int]:
    """Key blocks each query block visits (the kernel's loop bounds, positions not given)."""
    out = []
    bn = cfg.block_n
    for i in range(triton.cdiv(tq, cfg.block_m)):
        q_lo = tk - tq + i * cfg.block_m
        q_hi = q_lo + cfg.block_m - 1
        stop = max(min(tk, q_hi + 1), 0) if causal else tk
        lo = 0
        if window is not None:
            lo = min(max(q_lo - window + 1, 0) // bn * bn, stop)
        if chunk is not None:
            c_lo = max(q_lo, 0)
            lo = max(lo, min((c_lo - c_lo % chunk) // bn * bn, stop))
            if not causal and q_hi >= 0:
                stop = min(stop, q_hi - q_hi % chunk + chunk)
        out.append(max(triton.cdiv(stop, bn) - lo // bn, 0))
    return out


def gpu_launches(b: int, hq: int, hk: int, tq: int, tk: int, d: int, dtype: torch.dtype,
                 causal: bool, entropy: bool = True, *, lse: bool = False,
                 window: int | None = None, softcap: float | None = None, sinks: bool = False,
                 dv: int | None = None, keyok: bool = False, positions: bool = False,
                 chunk: int | None = None, dot_bf16: bool = False) -> list[Launch]:
    """The launch :func:`launch_attention` issues on a CUDA device for contiguous
    ``q [b, hq, tq, d]``, ``k [b, hk, tk, d]``, ``v [b, hk, tk, dv]`` of ``dtype``, as
    :class:`Launch` data.

    ``entropy=False`` describes the same kernel built without the entropy state
    (``WITH_ENTROPY=False``), the baseline the entropy build is judged against; ``lse``: with
    the log-sum-exp output (:func:`attention_lse`, cascade attention's op). The variants:
    ``window`` (tokens a query sees), ``chunk`` (chunk size), ``softcap`` (the cap ``c``),
    ``sinks`` (one sink logit per query head), ``dv`` (value head size), ``keyok`` (a key
    padding mask), ``positions`` (given query / key positions: the cascade's parts of local
    layers; then every key block is visited, masked); the FLOP counts take the queries at the
    last ``tq`` positions either way. ``dot_bf16``: bf16 products of fp32 inputs.
    ``tensor_flops`` = 2 (d + dv) x the allowed (query, key) pairs (QK^T and PV, exact for
    causal and windows); the kernel's MMAs also run the masked parts of edge blocks, which this
    does not count. ``hbm_bytes`` reads q, k, v once and writes out (and the entropy, lse and
    the small per-row / per-key inputs) once: k/v are re-read by every query block of a head
    and by the ``hq / hk`` heads of a group, served by L2, not counted.
    """
    dv = d if dv is None else dv
    every = keyok or positions or chunk is not None
    cfg = attention_settings(b, hq, tq, tk, d, dtype, causal=causal, has_keyok=every, dv=dv,
                             local=window is not None or chunk is not None,
                             dot_bf16=dot_bf16, softcap=softcap is not None)
    el = torch.empty((), dtype=dtype).element_size()
    pairs = _allowed_pairs(tq, tk, causal, window, chunk)
    hbm = (b * hq * tq * (d + dv) + b * hk * tk * (d + dv)) * el
    if entropy:
        hbm += b * hq * tq * 4 + b * tq + b * 16
    hbm += ((b * hq * tq * 4 if lse else 0) + (b * tk if keyok else 0)
            + (b * (tq + tk) * 4 if positions else 0))
    hbm += hq * 4 if sinks else 0
    blocks = ([triton.cdiv(tk, cfg.block_n)] * triton.cdiv(tq, cfg.block_m) if positions
              else _key_blocks(cfg, tq, tk, causal, window, chunk))
    sq, sk, sv, so = ((hq * tq * d, tq * d, d), (hk * tk * d, tk * d, d),
                      (hk * tk * dv, tk * dv, dv), (hq * tq * dv, tq * dv, dv))
    strides = dict(zip(("stride_qb", "stride_qh", "stride_qm", "stride_kb", "stride_kh",
                        "stride_kn", "stride_vb", "stride_vh", "stride_vn", "stride_ob",
                        "stride_oh", "stride_om"), sq + sk + sv + so, strict=True))
    div16 = ["q_ptr", "k_ptr", "v_ptr", "out_ptr", "ent_ptr", "lse_ptr", "keyok_ptr",
             "qmask_ptr", "krange_ptr", "qpos_ptr", "kpos_ptr", "sinks_ptr"]
    scalars = {"Tq": tq, "Tk": tk, "HQ": hq, "GROUP": hq // hk,
               "window": 0 if window is None else window, "chunk": 0 if chunk is None else chunk}
    # ... and marks the int arguments divisible by 16 (strides and sizes alike).
    div16 += [n for n, v in (strides | scalars).items() if v % 16 == 0]
    ones = {n: 1 for n, v in scalars.items() if v == 1}
    variant = ("entropy" if entropy else "lse" if lse else "no_entropy")
    extras = [name for name, on in (("window", window is not None), ("chunk", chunk is not None),
                                    ("softcap", softcap is not None), ("sinks", sinks),
                                    ("value_dim", dv != d), ("keyok", keyok),
                                    ("positions", positions), ("dot_bf16", dot_bf16)) if on]
    return [Launch(
        kernel="attention_entropy", fn=_attn_entropy_fwd,
        signature=_signature(dtype, strides, scalars),
        constexprs={**ones, "CAUSAL": bool(causal), "HAS_KEYOK": bool(keyok),
                    "HAS_POS": bool(positions), "HAS_WINDOW": window is not None,
                    "HAS_CHUNK": chunk is not None,
                    "HAS_SOFTCAP": softcap is not None, "HAS_SINKS": bool(sinks),
                    "WITH_ENTROPY": bool(entropy), "RETURN_LSE": bool(lse),
                    "FP32_DOT": cfg.fp32_dot, "DOT_BF16": bool(dot_bf16),
                    "PRECISION": cfg.precision,
                    "EVEN_N": cfg.even_n, "HEAD_DIM": d, "HEAD_DV": dv, "BLOCK_M": cfg.block_m,
                    "BLOCK_N": cfg.block_n, "BLOCK_D": cfg.block_d, "BLOCK_DV": cfg.block_dv},
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, grid=cfg.grid, hbm_bytes=hbm,
        tensor_flops=2 * (d + dv) * b * hq * pairs, elements=b * hq * pairs,
        loop_iters=sum(blocks) / len(blocks), loop_elements=cfg.block_m * cfg.block_n,
        label=cfg.label, extra={"variant": "+".join([variant, *extras]),
                                "divisible_by_16": div16},
    )]
