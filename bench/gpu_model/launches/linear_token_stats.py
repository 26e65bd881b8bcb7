"""``gpu_launches``: the launches of
:func:`icqs_fast.backends.triton_backend.linear_token_stats` on a CUDA device, as
:class:`~bench.gpu_model.launches.Launch` data for the static model. The kernel module's own
launch-settings function picks the configuration, so the description follows the launcher."""

from __future__ import annotations

import torch
import triton
from icqs_fast.kernels.linear_token_stats import (
    TARGET_BLOCK_K,
    TARGET_BLOCK_M,
    TARGET_STAGES,
    TARGET_WARPS,
    _linear_token_stats_kernel,
    _target_logits_kernel,
    launch_settings,
)

from bench.gpu_model.launches import Launch, ptr


def _signature(params: dict[str, str], ints: dict[str, int], consts: dict,
               nospec: tuple[str, ...] = ("N",)) -> tuple[dict[str, str], dict, list[str]]:
    """Signature, constexprs and 16-divisible parameters as Triton's JIT specialises them for
    these argument values: an int equal to 1 becomes a constexpr; pointers (torch allocations
    are 256-byte aligned) and ints that are multiples of 16 get ``tt.divisibility`` 16, which
    lets loads vectorise (pass them as ``attrs`` to ``ASTSource`` to compile the same code).
    A parameter named in ``consts`` too is a constexpr of that value (None: an argument passed
    as None). ``nospec``: the kernels' ``do_not_specialize`` ints (neither)."""
    sig, const, div16 = {}, {}, []
    for name, kind in params.items():
        if name in consts:
            sig[name], const[name] = "constexpr", consts[name]
            continue
        if name in nospec:
            sig[name] = kind
            continue
        if kind == "i32" and ints[name] == 1:
            sig[name], const[name] = "constexpr", 1
            continue
        sig[name] = kind
        if kind.startswith("*") or (kind == "i32" and ints[name] % 16 == 0):
            div16.append(name)
    for name, value in consts.items():
        sig[name], const[name] = "constexpr", value
    return sig, const, div16


def gpu_launches(n: int, h: int, v: int, dtype: torch.dtype, has_bias: bool = False,
                 softcap: bool = False) -> list[Launch]:
    """The launches :func:`icqs_fast.backends.triton_backend.linear_token_stats` issues on a
    CUDA device for contiguous ``hidden [N, H]`` and ``weight [V, H]`` of ``dtype``: the
    target-logits kernel, then the fused kernel (settings from :func:`launch_settings`);
    ``softcap``: the ``HAS_SOFTCAP`` variants (``extra["variant"] = "softcap"``).

    ``loop_iters`` of the fused launch counts its innermost (K) loop per program
    (``tiles * cdiv(H, BLOCK_K)``), ``outer_iters`` its tile loop (``tiles``: the
    unmasked epilogue runs once per tile) and ``outer2_iters`` the loop around it (1 + the
    masked folds per program, ``extra["cold_tiles"]``: one per row of the block with its target
    in this chunk, each in a tile of its own, plus the partial last tile); ``loop_elements``
    is the logits finished per K iteration on average (``BLOCK_M * BLOCK_N / cdiv(H,
    BLOCK_K)``, rounded). ``extra`` has the exact tile figures and ``divisible_by_16`` (the
    parameters the JIT marks 16-divisible).
    """
    s = torch.empty(0, dtype=dtype).element_size()
    p = ptr(dtype)
    ints = {"N": n, "V": v, "H": h, "s_hn": h, "s_hh": 1, "s_wv": h, "s_wh": 1}
    strides = {"s_hn": "i32", "s_hh": "i32", "s_wv": "i32", "s_wh": "i32"}
    # The default variant passes None for the soft-cap arguments (constexprs, no parameters).
    variant = {"variant": "softcap"} if softcap else {}
    off = {} if softcap else {"ZRAW": None, "tanh_scale": None}
    tsig, tconst, tdiv = _signature(
        {"HID": p, "W": p, "BIAS": p, "T": "*i64", "ZT": "*fp32", "ZRAW": "*fp32", "N": "i32",
         "H": "i32",
         **strides, "tanh_scale": "fp32"},
        ints, {**off, "HAS_BIAS": has_bias, "HAS_SOFTCAP": softcap, "BLOCK_M": TARGET_BLOCK_M,
               "BLOCK_K": TARGET_BLOCK_K})
    target = Launch(
        kernel="linear_token_stats.target_logits", fn=_target_logits_kernel,
        signature=tsig, constexprs=tconst, num_warps=TARGET_WARPS, num_stages=TARGET_STAGES,
        grid=(triton.cdiv(n, TARGET_BLOCK_M), 1, 1),
        hbm_bytes=2 * n * h * s + n * (8 + 4) + (n * s if has_bias else 0),
        elements=n, loop_iters=triton.cdiv(h, TARGET_BLOCK_K),
        loop_elements=TARGET_BLOCK_M * TARGET_BLOCK_K,
        label=f"m{TARGET_BLOCK_M}_k{TARGET_BLOCK_K}_w{TARGET_WARPS}" + ("_sc" if softcap else ""),
        extra={"divisible_by_16": tdiv, **variant},
    )
    cfg = launch_settings(n, h, v, dtype)
    mints = {"N": n, "V": v, "H": h, "stride_hn": h, "stride_hh": 1, "stride_wv": h,
             "stride_wh": 1}
    msig, mconst, mdiv = _signature(
        {"hid_ptr": p, "w_ptr": p, "bias_ptr": p, "target_ptr": "*i64", "zt_ptr": "*fp32",
         "zraw_ptr": "*fp32", "pstate_ptr": "*fp32", "pcounts_ptr": "*i64", "N": "i32",
         "V": "i32", "H": "i32",
         "stride_hn": "i32", "stride_hh": "i32", "stride_wv": "i32", "stride_wh": "i32",
         "scale": "fp32", "tanh_scale": "fp32"},
        mints, {**({} if softcap else {"zraw_ptr": None, "tanh_scale": None}),
                "HAS_BIAS": has_bias, "HAS_SOFTCAP": softcap, "FP32_DOT": cfg.fp32_dot,
                "PRECISION": cfg.precision, "EVEN_K": cfg.even_k, "BLOCK_M": cfg.block_m,
                "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "TILES": cfg.tiles,
                "GROUP_M": cfg.group_m})
    k_iters = triton.cdiv(h, cfg.block_k)
    # Masked folds per program (the cold path outside the tile loop): each of the block's rows
    # with its target in a tile of its own (targets spread evenly over the vocabulary chunks),
    # plus the partial last tile in every program; tiles made non-easy by non-finite logits are
    # not counted.
    vocab_tiles = triton.cdiv(v, cfg.block_n)
    cold = (min(cfg.tiles, triton.cdiv(min(n, cfg.block_m) * cfg.tiles, max(vocab_tiles, 1)))
            + (1 if v % cfg.block_n else 0))
    main = Launch(
        kernel="linear_token_stats", fn=_linear_token_stats_kernel,
        signature=msig, constexprs=mconst, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        grid=cfg.grid,
        hbm_bytes=((n + v) * h * s + (v * s if has_bias else 0) + n * (8 + 4)
                   + cfg.chunks * n * (28 + 16)),
        tensor_flops=2 * n * v * h, elements=n * v,
        loop_iters=cfg.tiles * k_iters, outer_iters=cfg.tiles, outer2_iters=1 + cold,
        loop_elements=round(cfg.block_m * cfg.block_n / k_iters),
        label=cfg.label + ("_sc" if softcap else ""),
        extra={"tiles": cfg.tiles, "k_iters_per_tile": k_iters,
               "tile_elements": cfg.block_m * cfg.block_n, "chunks": cfg.chunks,
               "cold_tiles": cold,
               "divisible_by_16": mdiv, **variant},
    )
    return [target, main]
