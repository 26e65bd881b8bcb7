"""The engine's distance to the machine's limit: the model FLOPs a piece of work actually computed,
and this machine's matmul rate on the same linear shapes, dtype and thread count.

:func:`count_flops` runs a function under a ``TorchDispatchMode`` that counts every matmul the
work dispatches (untimed: counting costs Python per op, so the timed run is a separate one of the
same work, which computes the same FLOPs):

* ``linear``: ``mm`` / ``addmm`` inside a module's forward (the decoder's projections, the MLP),
  ``2 M K N`` each, by weight shape ``(K, N)`` with the rows ``M`` of each call;
* ``attention``: ``bmm`` / ``baddbmm`` and CPU / CUDA scaled-dot-product attention (``4 B H Tq Tk
  D``: scores and values, the full rectangle: a causal kernel may skip up to half of it);
* ``head``: ``mm`` / ``addmm`` outside any module (the engine's fused LM-head statistics,
  ``linear_token_stats``, which reads the head weight directly);
* ``attention`` also: every :func:`icqs_fast.ops.attention_lse` call (the cascade's fused
  kernel, whose C++ / Triton work the dispatcher never sees), ``2 B Hq Tq Tk (D + Dv)``, the
  full rectangle like SDPA's; the ops it dispatches itself (its torch backend) are not
  counted again.

:func:`matmul_probe` times ``torch.nn.functional.linear`` on ``[M, K] x [N, K]`` for each counted
weight shape at the FLOP-weighted median ``M`` the work used, and :func:`limit_fields` gives the
record's fields: ``model_gflop``, ``achieved_gflops`` (all model FLOPs / wall seconds),
``limit_gflops`` (the probe's FLOP-weighted rate over the linear shapes, i.e. the time the
linear FLOPs alone would take at the probed rate), ``fraction_of_limit`` and the same per CPU
second (steadier on a shared machine).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Seconds each weight shape is timed for by the probe (after one warm-up call): long enough for
# a stable median of a few hundred calls on a 2-core CPU, short enough for a benchmark's side.
PROBE_SECONDS = 0.25

_A = torch.ops.aten
_MM = {_A.mm.default, _A.addmm.default}
_BMM = {_A.bmm.default, _A.baddbmm.default}
# A linear layer with a weight prepacked in oneDNN's layout (counted as a linear).
_PACKED_LINEAR = ({torch.ops.mkldnn._linear_pointwise.default}
                  if hasattr(torch.ops.mkldnn, "_linear_pointwise") else set())
_SDPA = {getattr(_A, n).default for n in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    if hasattr(_A, n)}


@dataclass
class FlopCount:
    """Matmul FLOPs of a piece of work, by kind (see the module docstring)."""

    linear: int = 0
    attention: int = 0
    head: int = 0
    # (K, N) of a linear weight -> the rows M of each call.
    linear_rows: dict[tuple[int, int], list[int]] = field(
        default_factory=lambda: defaultdict(list))

    @property
    def total(self) -> int:
        return self.linear + self.attention + self.head

    def as_dict(self) -> dict[str, Any]:
        return {"model_gflop": round(self.total / 1e9, 3),
                "linear_gflop": round(self.linear / 1e9, 3),
                "attention_gflop": round(self.attention / 1e9, 3),
                "head_gflop": round(self.head / 1e9, 3),
                "linear_calls": sum(len(v) for v in self.linear_rows.values())}


class _Counter(TorchDispatchMode):
    def __init__(self, count: FlopCount, depth: list[int]):
        super().__init__()
        self.count, self.depth = count, depth

    def _matmul(self, m: int, k: int, n: int) -> None:
        """An ``[m, k] x [k, n]`` product: a linear layer's inside a module, else the head's."""
        flops = 2 * m * k * n
        if self.depth[0] > 0:
            self.count.linear += flops
            self.count.linear_rows[(int(k), int(n))].append(int(m))
        else:
            self.count.head += flops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.depth[1] > 0:  # inside an attention_lse call, already counted whole
            return out
        if func in _MM:
            a, b = (args[0], args[1]) if func is _A.mm.default else (args[1], args[2])
            self._matmul(*a.shape, b.shape[1])
        elif func in _PACKED_LINEAR:
            k = args[0].shape[-1]
            self._matmul(args[0].numel() // max(k, 1), k, out.shape[-1])
        elif func in _BMM:
            a, b = (args[0], args[1]) if func is _A.bmm.default else (args[1], args[2])
            bs, m, k = a.shape
            self.count.attention += 2 * bs * m * k * b.shape[2]
        elif func in _SDPA:
            q, k = args[0], args[1]
            b, h, tq, d = q.shape
            self.count.attention += 4 * b * h * tq * k.shape[-2] * d
        return out


def count_flops(fn: Callable[[], Any]) -> tuple[FlopCount, Any]:
    """Run ``fn()`` counting its matmul FLOPs; returns ``(FlopCount, fn's result)``."""
    from torch.nn.modules import module as nn_module

    from icqs_fast import ops

    count, depth = FlopCount(), [0, 0]  # module depth, attention_lse depth

    def pre(mod, args):
        depth[0] += 1

    def post(mod, args, out):
        depth[0] -= 1

    real = ops.attention_lse
    real_linear = ops.linear

    def counted_linear(x, weight, bias=None, **kw):
        # The batch-invariant linear (models.use_invariant_linears, the cpp head) runs outside
        # torch's dispatcher: counted here, as a linear inside a module, else as the head. A
        # gated product (``up``: the MLP's gate and up projections) counts as the two; a
        # residual added to the output is no product.
        k, n = weight.in_features, weight.out_features
        products = 1 if kw.get("up") is None else 2
        flops = 2 * (x.numel() // max(k, 1)) * k * n
        if depth[0] > 0:
            count.linear += products * flops
            count.linear_rows[(int(k), int(n))].extend([int(x.numel() // max(k, 1))] * products)
        else:
            count.head += products * flops
        return real_linear(x, weight, bias, **kw)

    def counted_attention_lse(q, k, v, *a, **kw):
        b, hq, tq, d = q.shape
        if depth[1] == 0:
            count.attention += 2 * b * hq * tq * k.shape[-2] * (d + v.shape[-1])
        depth[1] += 1
        try:
            return real(q, k, v, *a, **kw)
        finally:
            depth[1] -= 1

    hooks = [nn_module.register_module_forward_pre_hook(pre),
             nn_module.register_module_forward_hook(post, always_call=True)]
    ops.attention_lse = counted_attention_lse
    ops.linear = counted_linear
    try:
        with _Counter(count, depth):
            out = fn()
    finally:
        ops.attention_lse = real
        ops.linear = real_linear
        for h in hooks:
            h.remove()
    return count, out


def weighted_median_rows(rows: dict[tuple[int, int], list[int]]) -> int:
    """The FLOP-weighted median of the rows per linear call (what most linear FLOPs ran at)."""
    pairs = sorted((m, m * k * n) for (k, n), ms in rows.items() for m in ms)
    if not pairs:
        return 0
    half, acc = sum(w for _, w in pairs) / 2, 0
    for m, w in pairs:
        acc += w
        if acc >= half:
            return m
    return pairs[-1][0]


def matmul_probe(count: FlopCount, dtype: torch.dtype | str, device: torch.device | str = "cpu",
                 rows: int | None = None, seconds: float = PROBE_SECONDS) -> dict[str, Any]:
    """This machine's ``F.linear`` rate on ``count``'s weight shapes, in ``dtype`` on ``device``
    with the current thread count, at ``rows`` rows (the FLOP-weighted median of the counted
    calls if None). ``dtype`` is a torch dtype or how a model computes by name
    (:func:`icqs_fast.models.dtype_name`): ``"bf16-mixed"`` probes the mode that model's linear
    layers run in (fp32 operands, bf16-valued weights, oneDNN's fp32 kernels:
    :func:`icqs_fast.models.bf16_matmuls`), so its limit is the rate of the matmuls it actually
    runs. Returns ``{"limit_gflops", "limit_gflops_cpu", "probe_rows",
    "probe_shapes": [{"k", "n", "share", "gflops"}]}``: the rates are the FLOP-weighted harmonic
    mean over the shapes (the time the counted linear FLOPs would take at the probed rates), by
    wall and by process CPU time."""
    from icqs_fast.models import DTYPE_NAMES, FAST_NAMES, MIXED_NAMES, bf16_matmuls

    mixed = isinstance(dtype, str) and dtype in MIXED_NAMES
    if isinstance(dtype, str):
        # bf16-products: the limit of bf16 products is the library's bf16 rate.
        dtype = (torch.float32 if mixed else torch.bfloat16 if dtype in FAST_NAMES
                 else DTYPE_NAMES[dtype])
    mode = bf16_matmuls if mixed else contextlib.nullcontext
    dev = torch.device(device)
    m = rows or weighted_median_rows(count.linear_rows)
    if not count.linear_rows or m < 1:
        return {"limit_gflops": None, "limit_gflops_cpu": None, "probe_rows": m,
                "probe_shapes": []}
    shares = {kn: sum(ms) * kn[0] * kn[1] for kn, ms in count.linear_rows.items()}
    total = sum(shares.values())
    gen = torch.Generator(device="cpu").manual_seed(0)
    wall_t = cpu_t = 0.0
    shapes = []
    for (k, n), w in sorted(shares.items()):
        x = torch.randn(m, k, generator=gen).to(dev, dtype)
        wt = torch.randn(n, k, generator=gen).to(dev, dtype) / k ** 0.5
        if mixed:
            wt = wt.to(torch.bfloat16).to(dtype)  # the model's weights are bf16 values
        with torch.inference_mode(), mode():
            torch.nn.functional.linear(x, wt)  # warm-up: allocation, kernel selection
            walls, cpus = [], []
            stop = time.perf_counter() + seconds
            while time.perf_counter() < stop or len(walls) < 3:
                _sync(dev)
                t0, c0 = time.perf_counter(), time.process_time()
                torch.nn.functional.linear(x, wt)
                _sync(dev)
                walls.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
        flops = 2 * m * k * n
        wall, cpu = statistics.median(walls), statistics.median(cpus)
        wall_t += (w / total) / (flops / wall)
        cpu_t += (w / total) / (flops / max(cpu, 1e-9))
        shapes.append({"k": k, "n": n, "share": round(w / total, 3),
                       "gflops": round(flops / wall / 1e9, 1)})
    return {"limit_gflops": round(1 / wall_t / 1e9, 1),
            "limit_gflops_cpu": round(1 / cpu_t / 1e9, 1), "probe_rows": m,
            "probe_shapes": shapes}


def limit_fields(count: FlopCount, wall_s: float, cpu_s: float | None,
                 probes: list[dict[str, Any]]) -> dict[str, Any]:
    """The record's fields: the FLOP counts, ``achieved_gflops`` (model FLOPs / ``wall_s``),
    ``achieved_linear_gflops``, the limit (the best of ``probes``, each a
    :func:`matmul_probe` result: the machine can do at least that), ``fraction_of_limit`` =
    achieved / limit, and per CPU second (``cpu_s``: the work's process CPU time, which on one
    thread leaves out the time other processes held the core)."""
    out = count.as_dict()
    out["achieved_gflops"] = round(count.total / wall_s / 1e9, 2) if wall_s > 0 else None
    out["achieved_linear_gflops"] = round(count.linear / wall_s / 1e9, 2) if wall_s > 0 else None
    ok = [p for p in probes if p.get("limit_gflops")]
    best = max(ok, key=lambda p: p["limit_gflops"]) if ok else None
    out["limit_gflops"] = best["limit_gflops"] if best else None
    out["limit_probes_gflops"] = [p.get("limit_gflops") for p in probes]
    out["fraction_of_limit"] = (round(out["achieved_gflops"] / best["limit_gflops"], 3)
                                if best and out["achieved_gflops"] else None)
    if cpu_s:
        out["achieved_gflops_cpu"] = round(count.total / cpu_s / 1e9, 2)
        cpu_best = max((p["limit_gflops_cpu"] for p in ok), default=None)
        out["limit_gflops_cpu"] = cpu_best
        out["fraction_of_limit_cpu"] = (round(out["achieved_gflops_cpu"] / cpu_best, 3)
                                        if cpu_best else None)
    if best:
        out["probe_rows"] = best["probe_rows"]
        out["probe_shapes"] = best["probe_shapes"]
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
