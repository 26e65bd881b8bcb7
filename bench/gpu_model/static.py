"""``python -m bench.gpu_model.static``: compile every Triton kernel for sm_90 / sm_80 without a
GPU and predict its time with :mod:`bench.gpu_model.model`.

For each shape of :func:`shape_table` the kernel modules describe their CUDA launches
(``gpu_launches(...) -> list[Launch]``, built from the same settings function their launchers
use); each distinct ``(fn, signature, constexprs, 16-divisible arguments, warps, stages, arch)``
is compiled once with ``triton.compile`` (fresh ``TRITON_CACHE_DIR``,
``TRITON_DEFAULT_FP_FUSION=1``), its cubin read with ``cuobjdump -res-usage`` and
``nvdisasm -c``, and one JSON record written per launch and arch.

Validation records (``"validation": true``, :mod:`bench.gpu_model.peer_validation`) compile
kernels nobody here wrote, from the installed packages (TRL's fused log-prob/entropy forward,
Liger's cross-entropy forward) at the shapes of their published H100 timings, and compare.
The compiling and the SASS reading are :mod:`bench.gpu_model.compiler`'s; this module holds
the shape table, the per-shape records and the command line.

Triton's interpreter (``TRITON_INTERPRET=1`` at import time, as the test suite sets it) turns
``@triton.jit`` functions into objects that cannot be compiled, so :func:`run` re-executes this
module in a child process with a clean environment when it finds the interpreter on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.gpu_model.compiler import Compiler, analyze, clean_env, interpreting
from bench.gpu_model.peer_validation import validation_records
from icqs_fast.options import add_json_argument

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
ARCHS = ("sm_90", "sm_80")


# ----------------------------------------------------------------------------------------------
# Shape table

TOKEN_V = (32000, 49152, 128256, 151936)
TOKEN_N = (1, 64, 1024, 8192, 65536)
LINEAR_H = (2048, 4096, 8192)
LINEAR_V = (151936, 128256)
LINEAR_N = (16, 512, 8192)
# The soft-cap epilogue (HAS_SOFTCAP) next to the default variant: bf16 at one table shape and at
# a Gemma-2-9B head (final_logit_softcapping 30, H = 3584, V = 256000).
SOFTCAP_HV = ((4096, 151936), (3584, 256000))
# attention_lse (cascade attention's kernel) with each layer variant, bf16, causal unless said,
# beside the plain build of the same shape (``base``): (name, shape, variant options).
_LLAMA = {"b": 1, "hq": 32, "hk": 8, "tq": 4096, "tk": 4096, "d": 128}
_PREFIX = {"b": 1, "hq": 32, "hk": 8, "tq": 2048, "tk": 4096, "d": 128}  # stacked suffix rows
LSE_VARIANTS = (
    ("base", _LLAMA, {}),
    ("window", _LLAMA, {"window": 1024}),  # Mistral / Gemma-style sliding layers
    ("softcap", _LLAMA, {"softcap": 50.0}),  # Gemma 2
    ("chunk", _LLAMA, {"chunk": 1024}),  # Llama 4 chunked layers
    ("bf16_products", {**_LLAMA, "dtype": "float32"}, {"dot_bf16": True}),
    ("base", {**_PREFIX, "causal": False}, {}),
    ("prefix_padded", {**_PREFIX, "causal": False}, {"keyok": True}),
    ("prefix_positions_window", _PREFIX, {"positions": True, "window": 1024}),
    ("base", {"b": 1, "hq": 64, "hk": 8, "tq": 4096, "tk": 4096, "d": 64}, {}),
    ("gpt_oss_window_sinks", {"b": 1, "hq": 64, "hk": 8, "tq": 4096, "tk": 4096, "d": 64},
     {"window": 128, "sinks": True}),
    ("mla_value_dim", {"b": 1, "hq": 16, "hk": 16, "tq": 4096, "tk": 4096, "d": 192},
     {"dv": 128}),
    ("base", {"b": 1, "hq": 16, "hk": 8, "tq": 8192, "tk": 8192, "d": 256}, {}),
    ("gemma2_window_softcap", {"b": 1, "hq": 16, "hk": 8, "tq": 8192, "tk": 8192, "d": 256},
     {"window": 4096, "softcap": 50.0}),
)


def shape_table(quick: bool = False) -> list[tuple[str, str, dict[str, Any]]]:
    """``(op, module of bench.gpu_model.launches, kwargs of its gpu_launches)`` for every
    headline shape: the sizes of the models users score with (vocabularies of 32k-152k, head
    dims 64/128).

    token_stats: fp32/fp16/bf16 x V in {32000, 49152, 128256, 151936} x N in
    {1, 64, 1024, 8192, 65536}; linear_token_stats: bf16/fp16, H in {2048, 4096, 8192} x
    V in {151936, 128256} x N in {16, 512, 8192}, and the soft-cap variant (``softcap: True``)
    in bf16 at (H, V) of :data:`SOFTCAP_HV` x the same N, with the default variant beside it
    where the table above lacks that shape; attention entropy: bf16/fp16, head dim 64/128,
    hq/hk 32/8 (GQA) and 32/32, causal and not, T = 1024 / 4096, with and without the entropy
    state; attention_lse: the layer variants of :data:`LSE_VARIANTS` beside the plain build.
    ``quick`` keeps one shape per op and dtype (for tests of the command).
    """
    import torch

    rows: list[tuple[str, str, dict[str, Any]]] = []
    lts = "bench.gpu_model.launches.linear_token_stats"
    dts = (torch.float32, torch.float16, torch.bfloat16)
    for dt in dts:
        for v in (TOKEN_V[-1:] if quick else TOKEN_V):
            for n in ((8192,) if quick else TOKEN_N):
                rows.append(("token_stats", "bench.gpu_model.launches.token_stats",
                             {"n": n, "v": v, "dtype": dt}))
    for dt in ((torch.bfloat16,) if quick else (torch.bfloat16, torch.float16)):
        for h in ((4096,) if quick else LINEAR_H):
            for v in (LINEAR_V[:1] if quick else LINEAR_V):
                for n in ((16, 8192) if quick else LINEAR_N):
                    rows.append(("linear_token_stats", lts,
                                 {"n": n, "h": h, "v": v, "dtype": dt}))
    for h, v in (SOFTCAP_HV[:1] if quick else SOFTCAP_HV):
        for n in ((16, 8192) if quick else LINEAR_N):
            kw = {"n": n, "h": h, "v": v, "dtype": torch.bfloat16}
            if h not in LINEAR_H or v not in LINEAR_V:
                rows.append(("linear_token_stats", lts, kw))
            rows.append(("linear_token_stats", lts, {**kw, "softcap": True}))
    for dt in ((torch.bfloat16,) if quick else (torch.bfloat16, torch.float16)):
        for d in ((128,) if quick else (64, 128)):
            for hq, hk in ((32, 8),) if quick else ((32, 8), (32, 32)):
                for causal in ((True,) if quick else (True, False)):
                    for t in ((4096,) if quick else (1024, 4096)):
                        for ent in (True, False):
                            rows.append(("attention_entropy",
                                         "bench.gpu_model.launches.attention_entropy",
                                         {"b": 1, "hq": hq, "hk": hk, "tq": t, "tk": t, "d": d,
                                          "dtype": dt, "causal": causal, "entropy": ent}))
    for _name, shape, opts in (LSE_VARIANTS[:2] if quick else LSE_VARIANTS):
        shape = {"causal": True, **shape}
        dt = torch.float32 if shape.pop("dtype", None) == "float32" else torch.bfloat16
        rows.append(("attention_lse", "bench.gpu_model.launches.attention_entropy",
                     {**shape, "dtype": dt, "entropy": False, "lse": True, **opts}))
    return rows


def _jsonable(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: (str(v).split(".")[-1] if k == "dtype" else v) for k, v in kwargs.items()}


def table_records(archs: tuple[str, ...], quick: bool, compiler: Compiler) -> list[dict]:
    """Records of every shape of :func:`shape_table` for ``archs``."""
    import importlib

    records: list[dict] = []
    for op, modname, kwargs in shape_table(quick):
        shape = _jsonable(kwargs)
        try:
            launches = importlib.import_module(modname).gpu_launches(**kwargs)
        except Exception as exc:  # noqa: BLE001 - report the op, continue with the others
            for arch in archs:
                records.append({"kernel": op, "arch": arch, "shape": shape,
                                "error": f"gpu_launches: {type(exc).__name__}: {exc}"})
            continue
        for arch in archs:
            recs = [analyze(ln, arch, compiler(ln, arch)) for ln in launches]
            total = sum(r.get("predicted_ms", float("nan")) for r in recs)
            high = sum(r.get("predicted_high_ms", float("nan")) for r in recs)
            for r in recs:
                r["op"] = op
                r["shape"] = shape
                r["dtype"] = shape.get("dtype", r["dtype"])
                r["op_launches"] = len(recs)
                r["op_predicted_ms"] = total
                r["op_predicted_low_ms"] = total
                r["op_predicted_high_ms"] = high
            records.extend(recs)
    _entropy_ratios(records)
    _softcap_costs(records)
    _variant_costs(records)
    return records


_VARIANT_KEYS = ("window", "softcap", "chunk", "sinks", "dv", "keyok", "positions", "dot_bf16")


def _variant_costs(records: list[dict]) -> None:
    """On the attention_lse records with a layer variant, ``predicted_ratio_vs_base`` (low
    end) and ``predicted_ratio_vs_base_high``: against the plain build of the same shape (bf16,
    no variant), where the table has one."""
    def key(r):
        s = {k: v for k, v in r["shape"].items() if k not in _VARIANT_KEYS and k != "dtype"}
        return (r["arch"], json.dumps(s, sort_keys=True))

    lse = [r for r in records if r.get("op") == "attention_lse" and "predicted_ms" in r]
    base = {key(r): r for r in lse
            if not any(k in r["shape"] for k in _VARIANT_KEYS) and r["dtype"] == "bfloat16"}
    for r in lse:
        b = base.get(key(r))
        if b is not None and b is not r:
            r["predicted_ratio_vs_base"] = r["predicted_ms"] / b["predicted_ms"]
            r["predicted_ratio_vs_base_high"] = r["predicted_high_ms"] / b["predicted_high_ms"]


def _entropy_ratios(records: list[dict]) -> None:
    """``predicted_ratio_vs_no_entropy`` (low end) and ``predicted_ratio_vs_no_entropy_high``
    (both builds at the pessimistic end) on attention records: with / without entropy state."""
    def key(r):
        s = {k: v for k, v in r["shape"].items() if k != "entropy"}
        return (r["arch"], json.dumps(s, sort_keys=True))

    base = {key(r): r for r in records
            if r.get("op") == "attention_entropy" and r["shape"].get("entropy") is False
            and "predicted_ms" in r}
    for r in records:
        if r.get("op") == "attention_entropy" and r["shape"].get("entropy") and "predicted_ms" in r:
            b = base.get(key(r))
            if b:
                r["predicted_ratio_vs_no_entropy"] = r["predicted_ms"] / b["predicted_ms"]
                r["predicted_ratio_vs_no_entropy_high"] = (r["predicted_high_ms"]
                                                           / b["predicted_high_ms"])


def _softcap_costs(records: list[dict]) -> None:
    """On the soft-cap records of the fused linear kernel (``extra.variant == "softcap"``), the
    predicted cost of the tanh epilogue against the default variant of the same shape and arch:
    ``predicted_ratio_vs_no_softcap`` (low end), ``predicted_ratio_vs_no_softcap_high`` (high
    end), ``softcap_extra_ms_high`` (high end, ms) and ``bound_class`` (the default variant's
    bound: ``"memory"`` (hbm), ``"compute"`` (tensor) or ``"instruction"``)."""
    def key(r):
        s = {k: v for k, v in r["shape"].items() if k != "softcap"}
        return (r["arch"], r["kernel"], json.dumps(s, sort_keys=True))

    base = {key(r): r for r in records
            if r.get("op") == "linear_token_stats" and not r["shape"].get("softcap")
            and "predicted_ms" in r}
    for r in records:
        if not (r.get("op") == "linear_token_stats" and r["shape"].get("softcap")
                and "predicted_ms" in r):
            continue
        b = base.get(key(r))
        if b:
            r["predicted_ratio_vs_no_softcap"] = r["predicted_ms"] / b["predicted_ms"]
            r["predicted_ratio_vs_no_softcap_high"] = (r["predicted_high_ms"]
                                                       / b["predicted_high_ms"])
            r["softcap_extra_ms_high"] = r["predicted_high_ms"] - b["predicted_high_ms"]
            # Which resource the default variant is predicted to wait on at this shape.
            r["bound_class"] = {"hbm": "memory", "tensor": "compute"}.get(b["bound"],
                                                                         "instruction")


# ----------------------------------------------------------------------------------------------
# Command line

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", default="all", choices=("sm_90", "sm_80", "all"),
                   help="target architecture (default: both)")
    add_json_argument(p, "print the records as a JSON list")
    p.add_argument("--out", default=None,
                   help="write the JSON records here (one arch) or to FILE with _sm90/_sm80 "
                        "inserted before the suffix (--arch all); default: print only")
    p.add_argument("--results", action="store_true",
                   help="write bench/results/static_sm90.json and static_sm80.json")
    p.add_argument("--keep", default=None, help="write each compiled cubin and its SASS here")
    p.add_argument("--quick", action="store_true", help="one shape per op and dtype")
    p.add_argument("--no-validation", action="store_true", help="skip the validation records")
    p.add_argument("--e2e", action="store_true",
                   help="print the on-paper ICQS throughput of a 7B Llama on one H100 (prefix "
                        "bank vs naive; no compilation) and exit")


def _argv(args: argparse.Namespace) -> list[str]:
    argv = ["--arch", args.arch]
    for flag in ("json", "quick", "no_validation", "results"):
        if getattr(args, flag, False):
            argv.append("--" + flag.replace("_", "-"))
    for opt in ("out", "keep"):
        if getattr(args, opt, None):
            argv += ["--" + opt, str(Path(getattr(args, opt)).resolve())]
    return argv


def collect(archs: tuple[str, ...], quick: bool, keep: str | None,
            validation: bool) -> dict[str, list[dict]]:
    """Records per arch (table + validation), each stamped with commit, date, versions."""
    import triton

    from icqs_fast.benchmarks import environment

    env = environment()
    stamp = {"commit": env["commit"], "date": env["date"], "triton": triton.__version__,
             "torch": env["torch"], "kernels_modified": _modified_kernels()}
    compiler = Compiler(keep)
    out: dict[str, list[dict]] = {}
    for arch in archs:
        recs = table_records((arch,), quick, compiler)
        if validation:
            recs += validation_records(compiler, arch)
        for r in recs:
            r.update(stamp)
        out[arch] = recs
    return out


def _modified_kernels() -> list[str] | None:
    """Kernel files that differ from the recorded commit (uncommitted edits), or None when
    there is no git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "kernels"],
                             capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return sorted(line[3:] for line in out.stdout.splitlines() if line.strip())


def _fmt(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(records: list[dict]) -> None:
    """Human-readable summary of records."""
    head = (f"{'arch':6} {'kernel':34} {'dtype':9} {'shape':44} {'regs':>4} {'spill':>5} "
            f"{'smem':>6} {'TC':5} {'instr/el':>8} {'ms':>9} {'bound':8} {'fracHBM':>7} "
            f"{'fracTC':>6}")
    print(head)
    for r in records:
        if r.get("validation"):
            continue
        shape = ",".join(f"{k}={v}" for k, v in r.get("shape", {}).items() if k != "dtype")
        if "error" in r:
            print(f"{r['arch']:6} {r['kernel'][:34]:34} {'':9} {shape[:44]:44} ERROR {r['error']}")
            continue
        spe = r.get("sass_per_element", {}).get("instructions")
        print(f"{r['arch']:6} {r['kernel'][:34]:34} {r['dtype'][:9]:9} {shape[:44]:44} "
              f"{r['regs']:>4} {r['spill_bytes']:>5} {r['smem_bytes']:>6} "
              f"{str(r['tensor_instr'] or '-'):5} {_fmt(spe, '.2f'):>8} "
              f"{r['predicted_ms']:>9.4f} {r['bound']:8} "
              f"{_fmt(r.get('predicted_frac_hbm'), '.2f'):>7} "
              f"{_fmt(r.get('predicted_frac_tensor'), '.2f'):>6}")
    vals = [r for r in records if r.get("validation")]
    if vals:
        print("\nvalidation (published vs predicted)")
        for r in vals:
            shape = ",".join(f"{k}={v}" for k, v in r["shape"].items())
            if "error" in r:
                print(f"  {r['kernel'][:60]:60} {shape:34} ERROR {r['error']}")
                continue
            print(f"  {r['kernel'][:60]:60} {shape:34} published {r['published_ms']:.4f} ms "
                  f"predicted {r['predicted_ms']:.4f} ms ({r['rel_error']:+.0%}, {r['bound']})")


CHILD_ENV = "ICQS_STATIC_CHILD"


def run(args: argparse.Namespace) -> int:
    if getattr(args, "e2e", False):
        # Pure arithmetic on the model's figures: no compiler, no child process.
        from bench.gpu_model import e2e

        res = e2e.icqs_throughput()
        if args.json:
            print(json.dumps(res, indent=1))
        else:
            e2e.print_e2e(res)
        return 0
    if not os.environ.get(CHILD_ENV) or interpreting():
        # Every run compiles in a child: a fresh Triton cache and FP fusion pinned from the
        # start, and no interpreter (@triton.jit functions imported under TRITON_INTERPRET=1
        # cannot be compiled).
        cmd = [sys.executable, "-m", "bench.gpu_model.static", *_argv(args)]
        env = clean_env()
        env[CHILD_ENV] = "1"
        # From the repository root: the child imports bench.
        return subprocess.run(cmd, env=env, check=False,
                              cwd=Path(__file__).resolve().parents[2]).returncode
    archs = ARCHS if args.arch == "all" else (args.arch,)
    by_arch = collect(archs, args.quick, args.keep, not args.no_validation)
    outs: dict[str, Path] = {}
    if args.results:
        outs = {a: RESULTS / f"static_{a.replace('_', '')}.json" for a in archs}
    elif args.out:
        base = Path(args.out)
        outs = ({archs[0]: base} if len(archs) == 1 else
                {a: base.with_name(f"{base.stem}_{a.replace('_', '')}{base.suffix}")
                 for a in archs})
    for arch, path in outs.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(by_arch[arch], indent=1) + "\n")
    records = [r for a in archs for r in by_arch[a]]
    if args.json:
        print(json.dumps(records, indent=1))
    else:
        print_table(records)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m bench.gpu_model.static`` (the child :func:`run` starts)."""
    p = argparse.ArgumentParser(prog="python -m bench.gpu_model.static",
                                description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
