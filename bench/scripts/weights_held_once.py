"""Memory of the decoder's weights with the batch-invariant linear layers holding them once
(packed only) against holding the layer's own copy beside the packed one, per dtype: the
weights' bytes, and the process's RSS / USS after loading, each in a fresh interpreter. The
log-probs of one prompt are checked to be the same bits both ways.

    python -m bench.scripts.weights_held_once [--dtypes auto,float32]
        [--out bench/results/invariant/weights_held_once_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CHILD = r"""
import functools, gc, json, sys
import psutil, torch
from icqs_fast import invariant_linears
import icqs_fast.models as M
dtype, keep = sys.argv[1], sys.argv[2] == "keep"
if keep:  # the layers' own weights stay beside the packed copies
    M.use_invariant_linears = functools.partial(invariant_linears.use_invariant_linears,
                                                hold_once=False)
model, tok = M.load_model(None, dtype=dtype, device="cpu")
gc.collect()
ids = tok("The capital of Germany is Berlin and the capital of France is", return_tensors="pt")
with torch.inference_mode():
    lp = torch.log_softmax(model(ids.input_ids).logits.float(), -1)
mem = psutil.Process().memory_full_info()
print(json.dumps({"dtype": M.dtype_name(model), "held": "beside" if keep else "once",
                  "weights_mb": round(invariant_linears.weight_bytes(model) / 2**20, 1),
                  "rss_mb": round(mem.rss / 2**20), "uss_mb": round(mem.uss / 2**20),
                  "logprob_sum": float(lp.double().sum())}))
"""


def main(argv: list[str] | None = None) -> int:
    """Both ways per dtype, each in its own process; exit 1 when the log-probs differ."""
    p = argparse.ArgumentParser(prog="python -m bench.scripts.weights_held_once")
    p.add_argument("--dtypes", default="auto,float32")
    p.add_argument("--out", default="bench/results/invariant/weights_held_once_cpu.json")
    a = p.parse_args(argv)
    rows = []
    for dtype in a.dtypes.split(","):
        for held in ("keep", "once"):
            out = subprocess.run([sys.executable, "-c", _CHILD, dtype, held], check=True,
                                 capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    same = all(r["logprob_sum"] == rows[i - i % 2]["logprob_sum"] for i, r in enumerate(rows))
    rec = {"bench": "weights-held-once", "rows": rows, "same_logprobs": same}
    from icqs_fast.benchmarks import environment

    rec.update(environment("cpu"))
    text = json.dumps(rec, indent=1)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
