"""The static model's predictions beside the measured times of ``icqs-fast bench gpu``.

    python -m bench.gpu_model.predict bench/results/gpu_ops_sm90.json [--out FILE]

``bench gpu`` (installed, run on the GPU) writes ``gpu_ops_<arch>.json``: each op's time end to
end and each CUDA kernel's time by name. This step, on any machine (it compiles, it launches
nothing), describes each case's launches (:func:`case_launches`, the kernels' ``gpu_launches``),
compiles them for the record's arch and asks :mod:`bench.gpu_model.model` for a prediction,
twice: with the model's table figures and with the device's measured copy bandwidth, bf16
matmul rate and SM count from the record (so an H200, whose memory is faster than the table's
H100, is still judged fairly). It writes ``gpu_model_check_<arch>.json`` beside the input (one
record per kernel launch and per op, with ``measured_ms``, ``predicted_ms`` and
``rel_error = predicted / measured - 1``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from bench.gpu_model.compiler import Compiler, analyze, clean_env, interpreting
from bench.gpu_model.launches import Launch
from icqs_fast.io.files import write_whole

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
CHILD_ENV = "ICQS_PREDICT_CHILD"


def case_launches(op: str, dtype: torch.dtype, shape: tuple[int, ...],
                  variant: str | None) -> list[Launch] | None:
    """The Triton launches of one ``bench gpu`` case (:data:`icqs_fast.benchmarks.gpu.CASES`)
    and variant, or None for a torch reference the model does not cover (sdpa)."""
    from bench.gpu_model.launches import attention_entropy as ak
    from bench.gpu_model.launches import linear_token_stats as lk
    from bench.gpu_model.launches import token_stats as tk

    if op == "token_stats":
        return tk.gpu_launches(*shape, dtype)
    if op == "linear_token_stats":
        return lk.gpu_launches(*shape, dtype)
    if op != "attention":
        raise ValueError(f"unknown bench gpu op {op!r}")
    if variant == "sdpa":
        return None
    if variant not in ("entropy", "no_entropy"):
        raise ValueError(f"unknown attention variant {variant!r}")
    b, hq, hk, t, d = shape
    return ak.gpu_launches(b, hq, hk, t, t, d, dtype, True, entropy=variant == "entropy")


def predict_op(rec: dict, compiler, hw_table, hw_measured) -> list[dict]:
    """For one measured op record of ``bench gpu``: one record per Triton launch and the op's
    record with the predictions beside its times (unchanged when the model has no launches for
    it, or when the record holds an error)."""
    if "error" in rec or "measured_ms" not in rec:
        return [rec]
    launches = case_launches(rec["op"], _DTYPES[rec["dtype"]], tuple(rec["shape"]),
                             rec.get("variant"))
    if launches is None:
        return [{k: v for k, v in rec.items() if k not in ("kernel_ms", "kernels_ms")}]
    base = {k: rec[k] for k in ("op", "variant", "dtype", "shape", "arch")}
    measured = rec.get("kernel_ms", {})
    out: list[dict] = []
    pred_sum = pred_sum_meas = kern_ms = 0.0
    for ln in launches:
        compiled = compiler(ln, rec["arch"])
        rec_t = analyze(ln, rec["arch"], compiled, hw_table)
        rec_m = analyze(ln, rec["arch"], compiled, hw_measured)
        p_t, p_m = rec_t.get("predicted_ms"), rec_m.get("predicted_ms")
        m = measured.get(ln.fn.__name__)
        pred_sum += p_t or 0.0
        pred_sum_meas += p_m or 0.0
        kern_ms += m or 0.0
        out.append({**base, "kind": "kernel", "kernel": ln.kernel, "fn": ln.fn.__name__,
                    "config": ln.label, "measured_ms": m, "predicted_ms": p_t,
                    "predicted_ms_measured_hw": p_m, "bound": rec_t.get("bound"),
                    "rel_error": None if not (m and p_t) else p_t / m - 1,
                    "rel_error_measured_hw": None if not (m and p_m) else p_m / m - 1,
                    "regs": rec_t.get("regs"), "spill_bytes": rec_t.get("spill_bytes"),
                    "error": rec_t.get("error")})
    op_ms = rec["measured_ms"]
    extra = {k: v for k, v in rec.items() if k.startswith("ratio_")}
    out.append({**base, "kind": "op", "measured_ms": op_ms, "kernels_ms": kern_ms,
                "predicted_ms": pred_sum, "predicted_ms_measured_hw": pred_sum_meas,
                "rel_error_kernels": pred_sum / kern_ms - 1 if kern_ms else None,
                "rel_error_op": pred_sum / op_ms - 1 if op_ms else None, **extra})
    return out


def predict(doc: dict, compiler=None) -> dict:
    """``gpu_ops_<arch>.json``'s document -> ``gpu_model_check_<arch>.json``'s: the head
    (plus ``model_table``) and the records of :func:`predict_op` for every op record."""
    from bench.gpu_model import model as gpu_model

    arch = doc["arch"]
    hw_table = gpu_model.hardware(arch)
    hw_measured = gpu_model.hardware(arch, sms=doc["sms"], **doc["device_measured"])
    compiler = compiler or Compiler()
    records: list[dict] = []
    for rec in doc["records"]:
        records += predict_op(rec, compiler, hw_table, hw_measured)
    head = {k: v for k, v in doc.items() if k != "records"}
    return {**head, "model_table": hw_table.name, "records": records}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_model.predict",
                                description=__doc__.splitlines()[0])
    p.add_argument("record", help="a gpu_ops_<arch>.json written by icqs-fast bench gpu")
    p.add_argument("--out", default=None,
                   help="where to write (default: gpu_model_check_<arch>.json beside RECORD)")
    args = p.parse_args(argv)
    if not os.environ.get(CHILD_ENV) and interpreting():
        # @triton.jit functions imported under the interpreter cannot be compiled: a child
        # with a clean environment compiles them (as bench.gpu_model.static does).
        env = clean_env()
        env[CHILD_ENV] = "1"
        cmd = [sys.executable, "-m", "bench.gpu_model.predict", str(Path(args.record).resolve())]
        if args.out:
            cmd += ["--out", str(Path(args.out).resolve())]
        return subprocess.run(cmd, env=env, cwd=Path(__file__).resolve().parents[2],
                              check=False).returncode
    src = Path(args.record)
    if not src.is_file():
        p.error(f"{src}: no such file")
    try:
        doc = json.loads(src.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        p.error(f"{src}: line {exc.lineno}: not JSON ({exc.msg})")
    for field in ("arch", "sms", "device_measured", "records"):
        if field not in doc:
            p.error(f"{src}: no field {field!r} (not a gpu_ops record of icqs-fast bench gpu)")
    out = Path(args.out) if args.out else src.with_name(
        f"gpu_model_check_{doc['arch'].replace('_', '')}.json")
    res = predict(doc)
    write_whole(out, json.dumps(res, indent=1) + "\n")
    print(f"predict: wrote {out}")
    for r in res["records"]:
        if r.get("kind") == "op" and "predicted_ms" in r:
            print(f"  {r['op']:19s} {r.get('variant') or '':10s} {r['dtype']} "
                  f"{str(r['shape']):28s} measured {r['measured_ms']:.3f} ms "
                  f"(kernels {r['kernels_ms']:.3f}) predicted {r['predicted_ms']:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
