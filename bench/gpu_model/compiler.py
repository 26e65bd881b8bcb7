"""Compiling Triton launches for sm_90 / sm_80 without a GPU, and reading what came out.

:func:`compile_launch` compiles one :class:`~bench.gpu_model.launches.Launch` with
``triton.compile`` for a target arch, reads the cubin's resource usage (``cuobjdump
-res-usage``) and SASS (``nvdisasm -c``); :class:`Compiler` does each distinct configuration
(:func:`compile_key`) once per process; :func:`analyze` turns a compiled launch into one record
of the static model (:mod:`bench.gpu_model.model`: registers, spills, shared memory,
occupancy, hot-loop instruction counts, predicted time and bound).

Used by ``bench static`` (:mod:`bench.gpu_model.static`), its peer validation
(:mod:`bench.gpu_model.peer_validation`), ``bench gpu`` and the dry run. Triton's interpreter
must be off (:func:`interpreting`); :func:`clean_env` is the environment of a compiling child.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench.gpu_model import model as gpu_model


def clean_env(cache_dir: str | None = None) -> dict[str, str]:
    """The environment a compiling child needs: no ``TRITON_INTERPRET``, FP fusion pinned on,
    a fresh Triton cache (a new temporary directory unless ``cache_dir`` is given), the
    repository root first on ``PYTHONPATH``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["TRITON_CACHE_DIR"] = cache_dir or tempfile.mkdtemp(prefix="icqs-static-cache-")
    # The child imports bench from the repository root, whatever its working folder or script.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


def interpreting() -> bool:
    """Whether Triton's interpreter is on (``TRITON_INTERPRET`` or, on triton >= 3.4, its
    runtime knob): ``@triton.jit`` functions imported under it cannot be compiled."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return True
    try:
        from triton import knobs  # triton >= 3.4
        return bool(getattr(knobs.runtime, "interpret", False))
    except (ImportError, AttributeError):
        return False


def _tools():
    import triton
    from triton.backends.nvidia.compiler import get_ptxas

    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return bindir / "cuobjdump", bindir / "nvdisasm", get_ptxas


# ----------------------------------------------------------------------------------------------
# Compilation (must run with the interpreter off)

def compile_key(launch, arch: str) -> tuple:
    """What makes two launches the same compiled kernel."""
    fn = launch.fn
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', repr(fn))}"
    div = tuple(sorted(launch.extra.get("divisible_by_16", ())))
    return (name, tuple(launch.signature.items()), tuple(sorted(
        (k, repr(v)) for k, v in launch.constexprs.items())), div, launch.num_warps,
        launch.num_stages, arch)


def _attrs(launch) -> dict:
    names = list(launch.signature)
    return {(names.index(n),): [["tt.divisibility", 16]]
            for n in launch.extra.get("divisible_by_16", ()) if n in names}


def compile_launch(launch, arch: str) -> dict[str, Any]:
    """Compile ``launch`` for ``arch`` (``"sm_90"``/``"sm_80"``); needs Triton's interpreter off.

    Returns ``{"cubin": bytes, "sass": str, "res": {regs, stack, static_smem, local},
    "dynamic_smem": int, "ptxas": str}``.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not hasattr(launch.fn, "arg_names"):
        raise RuntimeError("kernel is not a JIT function (is TRITON_INTERPRET set?)")
    cc = int(arch.removeprefix("sm_"))
    cuobjdump, nvdisasm, get_ptxas = _tools()
    src = ASTSource(launch.fn, dict(launch.signature), constexprs=dict(launch.constexprs),
                    attrs=_attrs(launch))
    k = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                       options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    cubin = k.asm["cubin"]
    with tempfile.TemporaryDirectory(prefix="icqs-static-") as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        res = subprocess.run([str(cuobjdump), "-res-usage", str(path)], capture_output=True,
                             text=True, check=True).stdout
        sass = subprocess.run([str(nvdisasm), "-c", str(path)], capture_output=True, text=True,
                              check=True).stdout
    ptxas = get_ptxas(cc)
    return {"cubin": cubin, "sass": sass, "res": gpu_model.parse_res_usage(res),
            "dynamic_smem": int(k.metadata.shared), "ptxas": getattr(ptxas, "version", "")}


class Compiler:
    """Compiles each distinct configuration once per process (see :func:`compile_key`)."""

    def __init__(self, keep: str | Path | None = None):
        self.cache: dict[tuple, dict[str, Any]] = {}
        self.keep = Path(keep) if keep else None
        if self.keep:
            self.keep.mkdir(parents=True, exist_ok=True)

    def __call__(self, launch, arch: str) -> dict[str, Any]:
        key = compile_key(launch, arch)
        if key not in self.cache:
            try:
                out = compile_launch(launch, arch)
            except Exception as exc:  # noqa: BLE001 - one failing kernel must not stop the table
                out = {"error": f"{type(exc).__name__}: {exc}"}
            else:
                out["summary"] = gpu_model.summarize(out["sass"])
                if self.keep:
                    tag = hashlib.sha1(repr(key).encode()).hexdigest()[:6]
                    stem = f"{launch.kernel}_{launch.label or 'default'}_{arch}_{tag}"
                    (self.keep / f"{stem}.cubin").write_bytes(out["cubin"])
                    (self.keep / f"{stem}.sass").write_text(out["sass"])
            self.cache[key] = out
        return self.cache[key]


# ----------------------------------------------------------------------------------------------
# Analysis

def _dtype_of(launch) -> str:
    for kind in launch.signature.values():
        if kind in ("*bf16", "*fp16", "*fp32"):
            return {"*bf16": "bfloat16", "*fp16": "float16", "*fp32": "float32"}[kind]
    return "?"


def analyze(launch, arch: str, compiled: dict[str, Any], hw=None) -> dict[str, Any]:
    """One JSON record for ``launch`` compiled for ``arch`` (see the module docstring)."""
    hw = hw or gpu_model.hardware(arch)
    rec: dict[str, Any] = {
        "kernel": launch.kernel, "arch": arch, "device_model": hw.name,
        "dtype": _dtype_of(launch),
        "config": {"label": launch.label, "num_warps": launch.num_warps,
                   "num_stages": launch.num_stages,
                   "constexprs": {k: v if isinstance(v, (int, float, bool, str)) else repr(v)
                                  for k, v in launch.constexprs.items()},
                   "grid": list(launch.grid)},
    }
    if "error" in compiled:
        rec["error"] = compiled["error"]
        return rec
    res, s = compiled["res"], compiled["summary"]
    smem = res["static_smem"] + compiled["dynamic_smem"]
    pred = gpu_model.predict(
        hw, s, num_warps=launch.num_warps, programs=launch.programs,
        loop_iters=launch.loop_iters if s.body else 0.0, hbm_bytes=launch.hbm_bytes,
        tensor_flops=launch.tensor_flops, regs=res["regs"], smem_bytes=smem,
        outer_iters=getattr(launch, "outer_iters", 1.0) if s.body else 1.0,
        outer2_iters=getattr(launch, "outer2_iters", 1.0) if s.body else 1.0)
    rec.update(
        regs=res["regs"], spill_bytes=res["stack"] + res["local"], stack_bytes=res["stack"],
        local_bytes=res["local"], smem_bytes=smem, smem_limit=hw.smem_per_block,
        occupancy=pred["occupancy"], waves=pred["waves"],
        tensor_cores=s.tensor is not None, tensor_instr=s.tensor,
        sass={"instructions": s.total, "loops": s.loops, "hot_loop_body": s.body,
              "hot_loop": s.loop_counts},
    )
    if launch.loop_elements and s.body:
        per = launch.num_warps / launch.loop_elements
        rec["sass_per_element"] = {
            "instructions": s.loop_counts["instructions"] * per,
            "barriers": s.loop_counts["barrier"] * per,
            "shuffles": s.loop_counts["shuffle"] * per,
            "mufu": s.loop_counts["mufu"] * per,
        }
    rec.update(
        predicted_ms=pred["predicted_s"] * 1e3,
        predicted_low_ms=pred["predicted_low_s"] * 1e3,
        predicted_high_ms=pred["predicted_high_s"] * 1e3, bound=pred["bound"],
        terms_ms={k[2:-2]: v * 1e3 for k, v in pred.items()
                  if k.startswith("t_") and k.endswith("_s")},
        hbm_bytes=launch.hbm_bytes, tensor_flops=launch.tensor_flops,
        loop_iters=launch.loop_iters, loop_elements=launch.loop_elements,
    )
    if launch.hbm_bytes:
        rec["predicted_frac_hbm"] = pred["frac_hbm"]
        rec["predicted_frac_hbm_spec"] = pred["frac_hbm_spec"]
        rec["predicted_frac_hbm_high"] = pred["frac_hbm_high"]
    if "frac_tensor" in pred:
        rec["predicted_frac_tensor"] = pred["frac_tensor"]
        rec["predicted_frac_tensor_achievable"] = pred["frac_tensor_achievable"]
        rec["predicted_frac_tensor_high"] = pred["frac_tensor_high"]
    extra = {k: v for k, v in launch.extra.items() if k != "divisible_by_16"}
    if extra:
        rec["extra"] = extra
    return rec
