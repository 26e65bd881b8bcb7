"""``gpu_launches``: the launches of
:func:`icqs_fast.kernels.token_stats.launch_token_stats` on a CUDA device, as
:class:`~bench.gpu_model.launches.Launch` data for the static model. The kernel module's own
launch-settings function picks the configuration, so the description follows the launcher."""

from __future__ import annotations

import torch
from icqs_fast.kernels.token_stats import (
    STATE_WIDTH,
    _bf16_pairs,
    _token_stats_kernel,
    token_stats_settings,
)

from bench.gpu_model.launches import Launch, ptr


def _signature(dtype: torch.dtype) -> dict[str, str]:
    return {"z_ptr": ptr(dtype), "targets_ptr": "*i64", "z_target_ptr": "*fp32",
            "state_ptr": "*fp32", "counts_ptr": "*i64", "n_rows": "i32", "V": "i32",
            "stride_row": "i32", "chunk": "i32", "inv_temp": "fp32", "inv_temp_lo": "fp32",
            "BLOCK_V": "constexpr", "R": "constexpr", "SLOW_BLOCK": "constexpr",
            "BF16_PAIRS": "constexpr"}


def gpu_launches(n: int, v: int, dtype: torch.dtype) -> list[Launch]:
    """The launches :func:`launch_token_stats` issues on a CUDA device for contiguous
    ``logits [n, v]`` of ``dtype`` (fp32/fp16/bf16), as :class:`Launch` data.

    ``extra["divisible_by_16"]`` names the arguments the Triton runtime specialises as
    multiples of 16 (aligned pointers; integers that are multiples of 16), so a static compile
    sees the same alignment (vector loads) as the real launch. With ``splits > 1`` the caller
    also merges ``[splits, n, 7]`` partial states in float64 in torch (a few small kernels over
    ``44 * splits * n`` bytes; not a Triton launch).
    """
    cfg = token_stats_settings(n, v, dtype)
    elsize = torch.empty((), dtype=dtype).element_size()
    # Compulsory traffic: logits once; targets and z_t in; (partial) states and counts out.
    hbm = n * v * elsize + n * (8 + 4) + cfg.splits * n * (STATE_WIDTH * 4 + 2 * 8)
    div16 = ["z_ptr", "targets_ptr", "z_target_ptr", "state_ptr", "counts_ptr"]
    div16 += [name for name, val in (("n_rows", n), ("V", v), ("stride_row", v),
                                     ("chunk", cfg.chunk)) if val % 16 == 0]
    # Hot-loop trips per program: whole tiles of its chunk (a partial tail tile runs once,
    # outside the loop), averaged over the splits.
    full = sum((min(cfg.chunk, v - s * cfg.chunk)) // cfg.block_v for s in range(cfg.splits))
    return [Launch(
        kernel="token_stats", fn=_token_stats_kernel, signature=_signature(dtype),
        constexprs={"BLOCK_V": cfg.block_v, "R": cfg.lane, "SLOW_BLOCK": cfg.slow_block,
                    "BF16_PAIRS": _bf16_pairs(dtype, v, 0)},
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, grid=cfg.grid, hbm_bytes=hbm, elements=n * v,
        loop_iters=full / cfg.splits, loop_elements=cfg.block_v, label=cfg.label,
        extra={"divisible_by_16": div16, "splits": cfg.splits},
    )]
