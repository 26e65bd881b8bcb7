"""The self-check's expected AUC beside the test AUC, through ``icqs-fast score``, per model.

    python -m bench.scripts.two_models_selfcheck [--dataset sst2] [--n-test 100] [--pool 32]
        [--seed 0]
        [--model embedded --model gemma3-270m] [--threads 1] [--n-boot 1000]
        [--tmp /tmp/two_models_selfcheck] [--out bench/results/two_models/selfcheck_sst2.json]

The data are the study's (:func:`icqs_fast.evals.selfcheck_study.study_pools`, read in place from
the shared data folder): the pools (``--pool`` good sentences with their own label and as many
other ones with the label flipped) from one side of the data, and ``--n-test`` sentences that are
in neither pool, each answered right (``label`` 1) and flipped (``label`` 0). The pools and the
test file are written as JSONL under ``--tmp`` (never into the project), then each model runs
the user's command, in a subprocess, exactly as a user would:

    icqs-fast score TEST -o OUT --good G --bad B --label-field label --model M --threads T

The self-check's AUC and interval come from ``OUT.meta.json`` (cross-fitted held-out pool
members); the test AUC from the output's ``label`` / ``score`` with the same interval
(:func:`icqs_fast.metrics.auc_stratified_ci`, each class resampled on its own, the same seed and
number of resamples). With two models in the record, ``difference`` is the second one's test
AUC minus the first one's on the same responses, with a paired bootstrap interval: whether the
two models separate. A model already in ``--out`` is not run again (one model per call fits a
busy machine's time limits; the record gathers them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from bench.studies.selfcheck_study import study_pools
from icqs_fast.metrics import auc_stratified_ci
from icqs_fast.threads import add_threads_argument

# The self-check's own resamples and seed (icqs_fast.engine.selfcheck.run_self_check defaults).
N_BOOT = 1000
SEED = 0


def fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def build(dataset: str, *, pool: int, n_test: int, seed: int, tmp: Path) -> dict[str, Path]:
    """The pools and the labelled test file of ``dataset`` as JSONL under ``tmp``."""
    good, bad, test, tpl = study_pools(dataset, pool=pool, n_test=n_test, seed=seed)
    if tpl is not None:  # ChaosNLI's own template is not what `score` uses by default
        raise SystemExit(f"{dataset}: needs the study's template; use sst2 or fpb")
    tmp.mkdir(parents=True, exist_ok=True)
    paths = {"good": tmp / f"{dataset}_good.jsonl", "bad": tmp / f"{dataset}_bad.jsonl",
             "test": tmp / f"{dataset}_test.jsonl"}
    write_jsonl(paths["good"], [{"x": x, "y": y} for x, y in good])
    write_jsonl(paths["bad"], [{"x": x, "y": y} for x, y in bad])
    write_jsonl(paths["test"], [{"x": x, "y": y, "label": lab} for x, y, lab in test])
    return paths


def output_path(model: str, paths: dict[str, Path], tmp: Path) -> Path:
    return tmp / f"{paths['test'].stem}_{model.replace('/', '_')}.jsonl"


def read_scores(out: Path) -> tuple[list[int], list[float]]:
    """The ``label`` and ``score`` (ICQS-Epistemic) of every output line, in input order."""
    labels, scores = [], []
    with open(out, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            labels.append(int(row["label"]))
            scores.append(row["score"])
    return labels, scores


def paired_difference(rec: dict, paths: dict[str, Path], tmp: Path, n_boot: int) -> dict:
    """Test AUC of the second model minus the first's on the same test responses (paired:
    each resample draws the same items for both, each class on its own;
    :func:`icqs_fast.evals.calibration_study.auc_difference`)."""
    from icqs_fast.evals.calibration_study import auc_difference

    a, b = list(rec["models"])[:2]
    (la, sa), (lb, sb) = (read_scores(output_path(m, paths, tmp)) for m in (a, b))
    if la != lb:
        raise SystemExit(f"{a} and {b} were scored on different test files")
    pos = [k for k, v in enumerate(la) if v == 1]
    neg = [k for k, v in enumerate(la) if v == 0]
    d = auc_difference([sb[k] for k in pos], [sb[k] for k in neg], [sa[k] for k in pos],
                       [sa[k] for k in neg], n_boot=n_boot, seed=SEED)
    return {"what": f"test AUC {b} - {a}, paired bootstrap 95% interval", **d}


def score_one(model: str, paths: dict[str, Path], *, threads: int, tmp: Path,
              n_boot: int) -> dict:
    """Run ``icqs-fast score`` on the test file with ``model``; its self-check beside the test
    AUC."""
    out = output_path(model, paths, tmp)
    for p in (out, Path(f"{out}.meta.json")):
        p.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "icqs_fast.cli", "score", str(paths["test"]), "-o", str(out),
           "--good", str(paths["good"]), "--bad", str(paths["bad"]), "--label-field", "label",
           "--model", model, "--threads", str(threads)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{model}: score exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    meta = json.loads(Path(f"{out}.meta.json").read_text(encoding="utf-8"))
    sc = meta["self_check"]
    labels, scores = read_scores(out)
    auc, lo, hi = auc_stratified_ci(labels, scores, n_resamples=n_boot, seed=SEED)
    inside = sc["auc_lo"] is not None and sc["auc_lo"] <= auc <= sc["auc_hi"]
    return {
        "command": "icqs-fast " + " ".join(cmd[3:]),
        "seconds": round(seconds, 1),
        "self_check": {k: sc.get(k) for k in ("status", "n_good", "n_bad", "auc", "auc_lo",
                                               "auc_hi", "expected_accuracy", "brier")},
        "test": {"auc": auc, "auc_lo": lo, "auc_hi": hi,
                 "n_right": labels.count(1), "n_flipped": labels.count(0)},
        "test_auc_inside_self_check_interval": inside,
        "summary_line": proc.stderr.strip().splitlines()[-3:],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="sst2", choices=["sst2", "fpb"])
    p.add_argument("--n-test", type=int, default=100,
                   help="test sentences, each answered right and flipped (2x records)")
    p.add_argument("--pool", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="seed of the pools and test draw")
    p.add_argument("--model", action="append", default=None,
                   help="repeatable (default: embedded and gemma3-270m)")
    add_threads_argument(p, default=1)  # passed on to each `icqs-fast score`
    p.add_argument("--n-boot", type=int, default=N_BOOT)
    p.add_argument("--tmp", default="/tmp/two_models_selfcheck")
    p.add_argument("--out", default=None,
                   help="record (default bench/results/two_models/selfcheck_DATASET.json)")
    a = p.parse_args()
    out = Path(a.out or f"bench/results/two_models/selfcheck_{a.dataset}.json")
    rec = json.loads(out.read_text(encoding="utf-8")) if out.is_file() else {
        "dataset": a.dataset, "pool": a.pool, "n_test": a.n_test, "seed": a.seed,
        "threads": a.threads, "n_boot": a.n_boot,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()}, "models": {}}
    same = {k: rec[k] for k in ("dataset", "pool", "n_test", "seed", "threads", "n_boot")}
    want = {"dataset": a.dataset, "pool": a.pool, "n_test": a.n_test, "seed": a.seed,
            "threads": a.threads, "n_boot": a.n_boot}
    if same != want:
        raise SystemExit(f"{out} holds another setting {same}; give another --out")
    paths = build(a.dataset, pool=a.pool, n_test=a.n_test, seed=a.seed, tmp=Path(a.tmp))
    for model in a.model or ["embedded", "gemma3-270m"]:
        if model in rec["models"]:
            continue
        rec["models"][model] = score_one(model, paths, threads=a.threads, tmp=Path(a.tmp),
                                         n_boot=a.n_boot)
        out.write_text(json.dumps(rec, indent=1) + "\n", encoding="utf-8")
        r = rec["models"][model]
        c, t = r["self_check"], r["test"]
        print(f"{model}: self-check ({c['status']}) AUC {fmt(c['auc'])} [{fmt(c['auc_lo'])}, "
              f"{fmt(c['auc_hi'])}], test AUC {fmt(t['auc'])} [{fmt(t['auc_lo'])}, "
              f"{fmt(t['auc_hi'])}] ({r['seconds']:.0f} s)")
    if len(rec["models"]) >= 2:
        rec["difference"] = paired_difference(rec, paths, Path(a.tmp), a.n_boot)
        out.write_text(json.dumps(rec, indent=1) + "\n", encoding="utf-8")
        d = rec["difference"]
        print(f"{d['what']}: {d['value']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
