"""Flash-attention forward that also returns the attention entropy of flagged query rows over a
key range, without materialising ``[heads, Tq, Tk]``.

One program handles one (batch, query head, query block). It loops over key blocks with the usual
online softmax for the output (all allowed keys), and, for key blocks that overlap the row's key
range ``[k0, k1)``, keeps a second shifted state (m, l, t) restricted to that range:
``l = sum e^{s-m}``, ``t = sum e^{s-m} (s-m)``, so that ``H = log l - t / l``. When the running
max grows from m to m', both are rescaled by ``a = e^{m-m'}``: ``l <- a l``,
``t <- a (t + l (m - m'))``.

A row with no allowed key in the range gets entropy 0; a row with no allowed key at all gets
output 0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import Launch, ptr


@triton.jit
def _attn_entropy_fwd(
    Q, K, V, OUT, ENT, KEYOK, QMASK, KR,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    sob, soh, som, sod,
    Tq, Tk, D, HQ, GROUP, scale,
    CAUSAL: tl.constexpr, HAS_KEYOK: tl.constexpr, FP32_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    hk = h // GROUP

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n0 = tl.arange(0, BLOCK_N)
    row_ok = offs_m < Tq
    d_ok = offs_d < D

    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)

    k0 = tl.load(KR + b * 2)
    k1 = tl.load(KR + b * 2 + 1)
    flag = tl.load(QMASK + b * Tq + offs_m, mask=row_ok, other=0) != 0
    any_flag = tl.max(flag.to(tl.int32), axis=0) > 0

    # Absolute position of query i is Tk - Tq + i (queries are the last Tq positions).
    qpos = Tk - Tq + offs_m
    n_end = Tk
    if CAUSAL:
        n_end = tl.minimum(Tk, Tk - Tq + (pid_m + 1) * BLOCK_M)

    neg_inf = float("-inf")
    m_i = tl.full([BLOCK_M], neg_inf, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    me = tl.full([BLOCK_M], neg_inf, tl.float32)
    le = tl.zeros([BLOCK_M], tl.float32)
    te = tl.zeros([BLOCK_M], tl.float32)

    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    for n0 in range(0, n_end, BLOCK_N):
        offs_n = n0 + offs_n0
        n_ok = offs_n < Tk
        kt = tl.load(k_base + offs_n[None, :] * skn + offs_d[:, None] * skd,
                     mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        vb = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :] * svd,
                     mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if FP32_DOT:
            kt = kt.to(tl.float32)
            vb = vb.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PRECISION) * scale
        allowed = n_ok[None, :] & row_ok[:, None]
        if HAS_KEYOK:
            kok = tl.load(KEYOK + b * Tk + offs_n, mask=n_ok, other=0) != 0
            allowed = allowed & kok[None, :]
        if CAUSAL:
            allowed = allowed & (offs_n[None, :] <= qpos[:, None])
        s = tl.where(allowed, s, neg_inf)

        # Output: online softmax over every allowed key.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == neg_inf, 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if FP32_DOT:
            acc += tl.dot(p, vb, input_precision=PRECISION)
        else:
            acc += tl.dot(p.to(vb.dtype), vb)
        m_i = m_new

        # Entropy state, only for blocks that overlap [k0, k1) when some row is flagged.
        if any_flag & (n0 < k1) & (n0 + BLOCK_N > k0):
            in_r = (offs_n >= k0) & (offs_n < k1)
            se = tl.where(in_r[None, :], s, neg_inf)
            me_new = tl.maximum(me, tl.max(se, axis=1))
            me_safe = tl.where(me_new == neg_inf, 0.0, me_new)
            a = tl.exp(me - me_safe)
            # l == 0 while m == -inf: use m' there so l * (m - m') is 0 * 0, not 0 * -inf.
            te = a * (te + le * (tl.where(le > 0, me, me_safe) - me_safe))
            le = a * le
            pe = tl.exp(se - me_safe[:, None])
            diff = tl.where(in_r[None, :] & allowed, se - me_safe[:, None], 0.0)
            le += tl.sum(pe, axis=1)
            te += tl.sum(pe * diff, axis=1)
            me = me_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(OUT + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod,
             out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    ent = tl.where(le > 0, tl.log(tl.where(le > 0, le, 1.0)) - te / tl.where(le > 0, le, 1.0),
                   0.0)
    ent = tl.where(flag, tl.maximum(ent, 0.0), 0.0)
    tl.store(ENT + pid_bh * Tq + offs_m, ent, mask=row_ok)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class AttentionSettings:
    """Launch settings of :func:`attention_entropy` for one shape (chosen in one place)."""

    block_m: int
    block_n: int
    block_d: int
    num_warps: int
    num_stages: int
    fp32_dot: bool
    precision: str
    grid: tuple[int, int, int]

    @property
    def label(self) -> str:
        return (f"bm{self.block_m}_bn{self.block_n}_bd{self.block_d}_w{self.num_warps}"
                f"_s{self.num_stages}")


def attention_settings(b: int, hq: int, tq: int, tk: int, d: int, dtype: torch.dtype,
                       interpret: bool = False) -> AttentionSettings:
    """Tiles, warps, stages and grid for ``q [b, hq, tq, d]`` against ``tk`` keys of ``dtype``.

    ``interpret``: the CPU interpreter's settings (small tiles, fp32 dots: it has no bf16/fp16
    ``tl.dot``); :func:`gpu_launches` always describes the CUDA path (``interpret=False``).
    """
    block_d = max(16, triton.next_power_of_2(d))
    block_m = 16 if interpret else (64 if block_d <= 64 else 32)
    block_n = 16 if interpret else (64 if block_d <= 128 else 32)
    # fp32 dots run in full precision ("ieee"), not Triton's default TF32 (10-bit mantissa on
    # Ampere/Hopper), as in kernels/linear_token_stats.py; 16-bit inputs ignore the setting.
    fp32_dot = interpret or dtype == torch.float32
    return AttentionSettings(block_m=block_m, block_n=block_n, block_d=block_d, num_warps=4,
                             num_stages=2, fp32_dot=fp32_dot,
                             precision="ieee" if fp32_dot else "tf32",
                             grid=(triton.cdiv(tq, block_m), b * hq, 1))


def _signature(dtype: torch.dtype) -> dict[str, str]:
    sig = {"Q": ptr(dtype), "K": ptr(dtype), "V": ptr(dtype), "OUT": ptr(dtype), "ENT": "*fp32",
           "KEYOK": "*i8", "QMASK": "*i8", "KR": "*i64"}
    for t in "qkvo":
        for dim in "bhmd" if t in "qo" else "bhnd":
            sig[f"s{t}{dim}"] = "i32"
    sig.update({"Tq": "i32", "Tk": "i32", "D": "i32", "HQ": "i32", "GROUP": "i32",
                "scale": "fp32"})
    for c in ("CAUSAL", "HAS_KEYOK", "FP32_DOT", "PRECISION", "BLOCK_M", "BLOCK_N", "BLOCK_D"):
        sig[c] = "constexpr"
    return sig


def _allowed_pairs(tq: int, tk: int, causal: bool) -> int:
    """(query, key) pairs a causal / full attention allows (queries at the last tq positions)."""
    if not causal:
        return tq * tk
    # query i sees keys 0 .. tk - tq + i: sum over i of (tk - tq + i + 1)
    return tq * (tk - tq) + tq * (tq + 1) // 2


def gpu_launches(b: int, hq: int, hk: int, tq: int, tk: int, d: int, dtype: torch.dtype,
                 causal: bool, entropy: bool = True) -> list[Launch]:
    """The launch :func:`attention_entropy` issues on a CUDA device for ``q [b, hq, tq, d]``,
    ``k/v [b, hk, tk, d]`` of ``dtype`` (contiguous), as :class:`~.launch.Launch` data.

    ``tensor_flops`` = 4 d x the allowed (query, key) pairs (QK^T and PV); ``hbm_bytes`` reads
    q, k, v once and writes out and the entropy once (k/v are re-read by every query block of a
    head, served by L2, not counted); no padding mask. ``entropy=False`` is not yet a separate
    build of this kernel (the entropy state is always compiled in).
    """
    cfg = attention_settings(b, hq, tq, tk, d, dtype)
    el = torch.empty((), dtype=dtype).element_size()
    pairs = _allowed_pairs(tq, tk, causal)
    hbm = (2 * b * hq * tq * d + 2 * b * hk * tk * d) * el + b * hq * tq * 4 + b * tq + b * 16
    iters = [triton.cdiv(min(tk, tk - tq + (i + 1) * cfg.block_m) if causal else tk, cfg.block_n)
             for i in range(cfg.grid[0])]
    return [Launch(
        kernel="attention_entropy", fn=_attn_entropy_fwd, signature=_signature(dtype),
        constexprs={"CAUSAL": bool(causal), "HAS_KEYOK": False, "FP32_DOT": cfg.fp32_dot,
                    "PRECISION": cfg.precision, "BLOCK_M": cfg.block_m,
                    "BLOCK_N": cfg.block_n, "BLOCK_D": cfg.block_d},
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, grid=cfg.grid, hbm_bytes=hbm,
        tensor_flops=4 * d * b * hq * pairs, elements=b * hq * pairs,
        loop_iters=sum(iters) / len(iters), loop_elements=cfg.block_m * cfg.block_n,
        label=cfg.label, extra={"variant": "entropy" if entropy else "no_entropy",
                                "divisible_by_16": ["Q", "K", "V", "OUT", "ENT", "KEYOK",
                                                    "QMASK", "KR"]},
    )]


def attention_entropy(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_range: torch.Tensor,
    query_mask: torch.Tensor,
    attention_mask: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton forward with entropy (inputs already validated by ``icqs_fast.ops``).

    Args:
        q: ``[B, Hq, Tq, D]``; k, v: ``[B, Hk, Tk, D]`` (any strides), same float dtype.
        key_range: ``[B, 2]`` int64 ``(start, end)``; query_mask: ``[B, Tq]`` bool;
        attention_mask: ``[B, Tk]`` bool (True = real key) or None.
        causal: query i sits at absolute position ``Tk - Tq + i``; scale: score multiplier.

    Returns:
        ``out [B, Hq, Tq, D]`` in q's dtype and ``entropy [B, Hq, Tq]`` fp32.
    """
    bsz, hq, tq, d = q.shape
    hk, tk = k.shape[1], k.shape[2]
    out = torch.empty(bsz, hq, tq, d, device=q.device, dtype=q.dtype)
    ent = torch.empty(bsz, hq, tq, device=q.device, dtype=torch.float32)
    if bsz * hq * tq == 0:
        return out, ent
    kr = key_range.to(device=q.device, dtype=torch.int64).contiguous()
    qm = query_mask.to(device=q.device, dtype=torch.int8).contiguous()
    keyok = (attention_mask.to(device=q.device, dtype=torch.int8).contiguous()
             if attention_mask is not None else qm)  # unused placeholder pointer when None
    cfg = attention_settings(bsz, hq, tq, tk, d, q.dtype, interpret=_interpreting())
    grid = cfg.grid[:2]
    _attn_entropy_fwd[grid](
        q, k, v, out, ent, keyok, qm, kr,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        tq, tk, d, hq, hq // hk, float(scale),
        CAUSAL=bool(causal), HAS_KEYOK=attention_mask is not None, FP32_DOT=cfg.fp32_dot,
        PRECISION=cfg.precision,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, ent
