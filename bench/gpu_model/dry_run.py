"""The dry run: every CUDA code path of the package, run without a GPU.

    python -m bench.gpu_model.dry_run [--paths engine,features] [--json] [--out FILE]


On the fake CUDA device of :mod:`bench.gpu_model.fake_cuda` (``FakeTensorMode``: tensors
with a shape, a dtype and the device ``cuda:0`` but no storage; an op that mixes a CUDA tensor
with a CPU tensor raises as it would on a GPU), :func:`dry_run` runs, on device ``"cuda"``:

* ``bench_gpu``: the inputs and op calls of ``icqs-fast bench gpu`` (:func:`gpu._case_fns` of
  its quick cases: token_stats, linear_token_stats, attention with and without the entropy
  state, the torch sdpa reference);
* ``engine``: :class:`~icqs_fast.engine.scorer.ICQSScorer` on the ``bench icqs`` tiny random
  Llama (``load(cuda, random_weights=True, config="tiny")``, bf16) with cascade attention:
  prefix bank, suffix forwards, fused head statistics;
* ``features``: :func:`icqs_fast.features.extract.glassbox`, all features incl. the fused
  attention-entropy capture, standard and compat modes;
* ``audit``: :class:`~icqs_fast.allure.evaluators.LikelihoodEvaluator` (``evaluate`` and
  ``attention_entropy``) and :class:`~icqs_fast.allure.evaluators.ICQSEvaluator`;
* ``lm_eval``: :class:`~icqs_fast.compat.lm_eval.ICQSFastLM` built with ``device="cuda"``
  (``loglikelihood``, ``loglikelihood_rolling``; not ``generate_until``, whose Hugging Face
  ``generate`` loop stops on token values);
* ``score``: the ``icqs-fast score`` job end to end (:func:`icqs_fast.jobs.run.run_job`: the
  memory plan, the engine's plan in the meta file, the results file), the tiny Llama in place
  of ``load_model``'s checkpoint;
* ``serve``: the :class:`~icqs_fast.serve.app.Server`'s three routes' engine work (echo
  log-probs, greedy generation a token per step, ``/v1/score``'s ICQS), without HTTP;
* ``ray``: a ``--ray`` :class:`~icqs_fast.jobs.ray_executor.BlockActor` built and called in
  this process (its model load, one block and its block file), the actors' GPUs from
  :func:`~icqs_fast.jobs.ray_executor.actor_plan` on an 8-GPU cluster's resources.

Every launch is checked against the device's grid, block and shared-memory limits
(:class:`~bench.gpu_model.fake_cuda.DeviceLimitError` names the kernel).

Every Triton launch is intercepted (``JITFunction.run``): its arguments must all be CUDA
tensors or scalars, its signature, constexprs and 16-divisibility are derived the way Triton's
runtime specialises them, and the kernel is compiled for sm_90 with ``triton.compile`` (each
distinct configuration once, :class:`bench.gpu_model.compiler.Compiler`) instead of launched.
For the ``bench_gpu`` cases the intercepted configurations are compared with the kernels'
``gpu_launches`` descriptions (:mod:`bench.gpu_model.launches`), which the static model
compiles.

Host syncs (``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``, ``.numpy()``, ``nonzero``, a
CUDA -> CPU copy, boolean-mask indexing) on a fake CUDA tensor are recorded with their call
site and count, and answered with a placeholder (1, 1.0, False, zeros, an empty selection),
so the run goes on: the values computed after a sync are not meaningful, only devices, dtypes
and shapes are.

The patches that make the package believe a GPU is present live only in
:class:`bench.gpu_model.fake_cuda.FakeCuda` and are undone when it exits; this module holds
the paths, the sync budgets (:data:`SYNC_BUDGETS`) and the report.

What the dry run CANNOT catch: numerics (NaN/overflow, precision of bf16 paths, wrong results),
kernel correctness on hardware (the compile proves the kernel lowers for sm_90, not that it
computes the right values, nor that its masks keep loads in bounds), timing and throughput,
memory limits (fake tensors have no storage: no out-of-memory, no allocator fragmentation),
races and stream ordering, cuBLAS / cuDNN / SDPA backend selection and their own failures, the
real CUDA driver, NCCL and multi-GPU placement, value-dependent control flow after a host sync
(the placeholder value picks one branch), data-dependent shape checks, and anything the
CPU-only torch decides differently from a CUDA build (e.g. an op that has no CUDA kernel).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

from bench.gpu_model.fake_cuda import CUDA0, FakeCuda, Recorder
from icqs_fast.io.files import write_whole

PATHS = ("bench_gpu", "engine", "features", "audit", "lm_eval", "score", "serve", "ray")


# ----------------------------------------------------------------------------------------------
# The paths


def _path_bench_gpu(rec: Recorder, device: torch.device) -> dict:
    from bench.gpu_model.compiler import compile_key
    from bench.gpu_model.predict import case_launches
    from icqs_fast.benchmarks import gpu

    assert gpu.arch_of(device) == "sm_90"
    mismatches = []
    for op, dt, shape in gpu.QUICK_CASES:
        for variant, fn in gpu._case_fns(op, gpu._DTYPES[dt], shape, device).items():
            launches = case_launches(op, gpu._DTYPES[dt], shape, variant or None)
            n0 = len(rec.launches)
            fn()
            if launches is None:
                continue
            seen = {e["key"] for e in rec.launches[n0:]}
            described = {repr(compile_key(ln, rec.arch)) for ln in launches}
            if seen != described:
                mismatches.append({"case": [op, dt, list(shape), variant],
                                   "launched_not_described": sorted(seen - described),
                                   "described_not_launched": sorted(described - seen)})
    return {"gpu_launches_mismatches": mismatches}


def _tiny(device: torch.device):
    from icqs_fast.benchmarks.icqs import load

    model, tok, _ = load(device, random_weights=True, config="tiny")
    return model, tok


def _path_engine(rec: Recorder, device: torch.device) -> dict:
    from icqs_fast.benchmarks.icqs import demos, responses
    from icqs_fast.data import TEMPLATE
    from icqs_fast.engine.scorer import ICQSScorer

    model, tok = _tiny(device)
    good, bad = demos()
    scorer = ICQSScorer(model, tok, good, bad, template=TEMPLATE, num_ratios=2,
                        demos_per_set=2, sets_per_ratio=2, cascade=True,
                        return_token_stats=True)
    out = list(scorer.score(responses(3)))
    assert len(out) == 3 and scorer.cascade
    return {"responses": len(out), "cascade": scorer.cascade,
            "model_device": str(next(model.parameters()).device),
            "model_dtype": str(next(model.parameters()).dtype)}


def _path_features(rec: Recorder, device: torch.device) -> dict:
    from icqs_fast.features.extract import glassbox

    model, tok = _tiny(device)
    items = [("Say hello.", "Hello there."), ("Add 2 and 3.", "The sum is 5.", "5")]
    n = 0
    for mode in ("standard", "selfeval-compat"):
        rows = glassbox(model, tok, items, mode=mode, batch_size=2)
        n += len(rows)
    return {"rows": n}


def _path_audit(rec: Recorder, device: torch.device) -> dict:
    from icqs_fast.allure.data import AuditRecord, custom_task
    from icqs_fast.allure.evaluators import ICQSEvaluator, LikelihoodEvaluator, make_example
    from icqs_fast.allure.memory import MemoryEntry

    model, tok = _tiny(device)
    spec = custom_task()
    recs = [AuditRecord(f"r{i}", {"task": f"What is {i} + 1?", "response": f"It is {i + 1}."},
                        str(i % 2)) for i in range(3)]
    mem = [MemoryEntry(f"m{i}", 0, "train", "false_positive", r, make_example(spec, r))
           for i, r in enumerate(recs[:2])]
    ev = LikelihoodEvaluator(model, tok, spec)
    js = ev.evaluate(recs, mem)
    ent = ev.attention_entropy(recs, mem)
    icqs = ICQSEvaluator(model, tok, spec, seed_good=[recs[1]], seed_bad=[recs[0]],
                         num_ratios=2, demos_per_set=1, sets_per_ratio=1)
    js2 = icqs.evaluate(recs, mem)
    return {"judgments": len(js) + len(js2), "entropies": len(ent)}


def _path_lm_eval(rec: Recorder, device: torch.device) -> dict:
    from lm_eval.api.instance import Instance

    from icqs_fast.compat.lm_eval import ICQSFastLM

    model, tok = _tiny(device)
    lm = ICQSFastLM(model=model, tokenizer=tok, device="cuda", chunk_size=2)
    assert lm.device.type == "cuda", lm.device
    ll = lm.loglikelihood([Instance("loglikelihood", {}, a, i) for i, a in enumerate(
        [("The sky is", " blue"), ("Two plus two is", " four"), ("", "hello")])],
        disable_tqdm=True)
    rl = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("a b c d",), 0)],
                                  disable_tqdm=True)
    # generate_until is left out: Hugging Face's generate loop stops on token values, which
    # fake tensors do not have (it would run to the model's maximum length).
    return {"loglikelihood": len(ll), "rolling": len(rl), "device": str(lm.device)}


def _job_files(tmp: str) -> tuple[str, str, str]:
    """Demonstration pools and an input of the ``score`` paths, written under ``tmp``."""
    from icqs_fast.benchmarks.icqs import demos, responses

    good, bad = demos()
    paths = []
    for name, rows in (("good", good), ("bad", bad),
                       ("input", [{"x": x, "y": y} for x, y in responses(3)])):
        path = os.path.join(tmp, f"{name}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            for r in rows:
                row = r if isinstance(r, dict) else {"x": r[0], "y": r[1]}
                f.write(json.dumps(row) + "\n")
        paths.append(path)
    return paths[0], paths[1], paths[2]


def _score_config(tmp: str, output: str, **kw: Any) -> Any:
    from icqs_fast.engine.settings import ScoringSettings
    from icqs_fast.jobs.config import ScoreJobConfig, SelfCheckOptions

    good, bad, inp = _job_files(tmp)
    return ScoreJobConfig(input=inp, output=os.path.join(tmp, output), good=good, bad=bad,
                          device="cuda", quiet=True,
                          scoring=ScoringSettings(num_ratios=2, demos_per_set=2,
                                                  sets_per_ratio=2),
                          self_check=SelfCheckOptions(max_heldout=0), **kw)


def _tiny_loader(device: torch.device):
    """A ``load_model`` stand-in giving the tiny random Llama on the fake GPU (the jobs load
    their model by name; the dry run has no checkpoint to load onto fake tensors)."""
    def load(name, **kw):
        return _tiny(device)

    return load


def _path_score(rec: Recorder, device: torch.device) -> dict:
    """``icqs-fast score`` end to end (the job runner, its memory plan, the engine's plan in
    the meta file, the results file) on the fake GPU."""
    import tempfile
    from unittest import mock

    from icqs_fast import models
    from icqs_fast.jobs.run import run_job

    with tempfile.TemporaryDirectory() as tmp, \
            mock.patch.object(models, "load_model", _tiny_loader(device)):
        cfg = _score_config(tmp, "out.jsonl")
        assert run_job(cfg, log=lambda *a: None) == 0
        with open(cfg.output + ".meta.json", encoding="utf-8") as f:
            meta = json.load(f)
        with open(cfg.output, encoding="utf-8") as f:
            lines = sum(1 for _ in f)
    return {"records": lines, "engine": meta["engine"]["path"],
            "backend": meta["engine"]["backend"], "memory_plan": meta["memory_plan"]}


def _path_serve(rec: Recorder, device: torch.device) -> dict:
    """The server's three routes' engine work: echo log-probs (``/v1/completions`` with
    ``echo``), greedy generation (``/v1/completions``) and ``/v1/score``'s ICQS, called on the
    :class:`~icqs_fast.serve.app.Server`'s own objects (no HTTP)."""
    from icqs_fast.benchmarks.icqs import demos, responses
    from icqs_fast.serve.app import Server
    from icqs_fast.serve.generation import GenerationOptions, GreedyGeneration

    model, tok = _tiny(device)
    good, bad = demos()
    server = Server(model, tok, good=good, bad=bad,
                    icqs_options={"num_ratios": 2, "demos_per_set": 2, "sets_per_ratio": 2})
    ids = [tok("The sky is blue.")["input_ids"], tok("Two plus two is four.")["input_ids"]]
    echo = server.run_logprobs(ids, 2)
    # Token values are placeholders on fake tensors: the stop conditions never fire, so the
    # generation runs its max_new steps.
    gen = GreedyGeneration(model, tok, ids[0], GenerationOptions(max_new=3, top_n=1))
    steps = 0
    while not gen.done and steps < 3:
        gen.step()
        steps += 1
    scorer = server.scoring.new_scorer(None, None, {})
    scored = list(scorer.score(responses(2)))
    return {"echo": len(echo), "generated_steps": steps, "scored": len(scored),
            "engine": server.plan["path"], "backend": server.plan["backend"]}


def _path_ray(rec: Recorder, device: torch.device) -> dict:
    """A ``--ray`` actor (:class:`~icqs_fast.jobs.ray_executor.BlockActor`, built and called
    in this process: its model load, one block's results and block file) on the fake GPU."""
    import tempfile
    from unittest import mock

    import numpy as np

    from icqs_fast import models
    from icqs_fast.io.blocks import BlockOutput
    from icqs_fast.io.records import detect_format
    from icqs_fast.io.runs import output_policy, start_output
    from icqs_fast.jobs.config import RayOptions
    from icqs_fast.jobs.ray_actors import BlockSpec
    from icqs_fast.jobs.ray_executor import ActorSetup, BlockActor, RayExecutor, actor_plan
    from icqs_fast.jobs.runner import record_fields, strategy_for

    with tempfile.TemporaryDirectory() as tmp, \
            mock.patch.object(models, "load_model", _tiny_loader(device)):
        cfg = _score_config(tmp, "blocks", ray=RayOptions(block_size=8))
        plan = actor_plan(None, "auto", {"CPU": 16.0, "GPU": 8.0})
        strategy = strategy_for(cfg)
        strategy.prepare(lambda *a: None)
        out = BlockOutput(cfg.output)
        ex = RayExecutor()
        meta = {**cfg.resume_key(), **ex.layout_key(cfg)}
        policy = output_policy(out, meta, resume=False, overwrite=False,
                               upgrade=cfg.upgrade_meta, labels=cfg.key_labels())
        start_output(policy, meta, lambda *a: None)  # the block folder, as the driver makes it
        spec = BlockSpec(cfg.input, detect_format(cfg.input, None), 0, 0, 0,
                         fields=record_fields(cfg, labels=strategy.read_labels),
                         encoding=cfg.encoding, name=cfg.input)
        actor = BlockActor(ActorSetup(strategy, policy, None, out.root, spec))
        row = actor({"block": np.array([0]), "start": np.array([0]), "end": np.array([3])})
    assert not row["error"][0], row["error"][0]
    return {"records": int(row["n"][0]), "gpus_per_actor": plan.gpus,
            "runtime": json.loads(str(row["runtime"][0])).get("device")}


_RUNNERS = {"bench_gpu": _path_bench_gpu, "engine": _path_engine, "features": _path_features,
            "audit": _path_audit, "lm_eval": _path_lm_eval, "score": _path_score,
            "serve": _path_serve, "ray": _path_ray}


def dry_run(paths=PATHS, *, arch: str = "sm_90", compile: bool = True) -> dict:
    """Run ``paths`` (names of :data:`PATHS`) on fake CUDA tensors; returns the report:
    ``{"paths": {name: {"status": "ok"|"error", "error", "launches", "compiles", ...}},
    "kernels": [...distinct compiled configurations...], "host_syncs": [...], "ok": bool}``.

    Needs Triton's interpreter off (``TRITON_INTERPRET`` unset when triton was imported);
    :func:`dry_run_in_child` takes care of that."""
    from bench.gpu_model.compiler import Compiler
    from icqs_fast.backends import triton_interpreting

    if compile and triton_interpreting():
        raise RuntimeError("the dry run compiles Triton kernels: TRITON_INTERPRET must be off "
                           "(use dry_run_in_child)")
    unknown = set(paths) - set(PATHS)
    if unknown:
        raise ValueError(f"unknown dry-run paths {sorted(unknown)}; choose from {PATHS}")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # as bench static compiles
    rec = Recorder(arch=arch, compile=compile, compiler=Compiler())
    report: dict[str, Any] = {"arch": arch, "device": "cuda (fake)", "paths": {}}
    for name in paths:
        rec.path = name
        n0 = len(rec.launches)
        t0 = time.perf_counter()
        entry: dict[str, Any] = {}
        try:
            with FakeCuda(rec), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor")
                entry.update(_RUNNERS[name](rec, CUDA0))
            entry["status"] = "ok"
        except Exception as exc:  # noqa: BLE001 - a failing path is the finding
            entry["status"] = "error"
            entry["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            entry["traceback"] = traceback.format_exc()[-4000:]
        mine = rec.launches[n0:]
        entry["launches"] = len(mine)
        entry["kernels"] = sorted({e["kernel"] for e in mine})
        entry["compiles_ok"] = len({e["key"] for e in mine if e.get("compiled")})
        entry["compile_errors"] = sorted({e["compile_error"] for e in mine
                                          if e.get("compile_error")})
        entry["seconds"] = round(time.perf_counter() - t0, 2)
        entry.update(_accounting(rec, name, mine))
        if entry["status"] == "ok" and entry["compile_errors"]:
            entry["status"] = "error"
        report["paths"][name] = entry
    kernels = {}
    for e in rec.launches:
        if e["key"] not in kernels:
            kernels[e["key"]] = {k: e.get(k) for k in (
                "kernel", "signature", "constexprs", "num_warps", "num_stages", "compiled",
                "compile_error", "regs", "spill_bytes")}
            kernels[e["key"]].update(grid_example=e["grid"], paths=set())
        kernels[e["key"]]["paths"].add(e["path"])
    report["kernels"] = [{**v, "paths": sorted(v["paths"])} for v in kernels.values()]
    report["compiles"] = sum(1 for v in kernels.values() if v.get("compiled"))
    report["host_syncs"] = [{"path": p, "phase": ph, "op": op, "site": s, "count": c}
                            for (p, ph, op, s), c in sorted(rec.syncs.items())]
    report["ok"] = all(e["status"] == "ok" and e["sync_budget"]["ok"]
                       for e in report["paths"].values())
    return report


# Host syncs allowed per path (a sync stalls the GPU pipeline), outside the once-per-model setup,
# per batch forward (a top-level forward of the model or of the decoder body the engine calls; the
# bench_gpu path runs op calls only, no forward, and may not sync at all). At most one per batch
# where a result must reach the host; none in the ops or the per-layer code (HOT_FILES).
SYNC_BUDGETS = {
    "bench_gpu": 0.0,
    # 1 per batch (1 prefix-bank + 1 suffix forward here): engine/scorer.py reads the batch's
    # log-likelihoods (and statistics) in one TokenStats.to_host copy.
    "engine": 0.5,
    "features": 1.0,
    "audit": 1.0,
    "lm_eval": 1.0,
    # the score job and a --ray actor: the engine's one read per batch, and the results' lines
    "score": 1.0,
    "ray": 1.0,
    # echo log-probs read per segment, a generated token per step, the ICQS batch's read
    "serve": 2.0,
}
# Once per model (the capability check's probes: 11; the capture's mask causality: 1).
SETUP_SYNC_BUDGET = 12
# Code that runs per layer, per op call or per token: no sync there at all.
HOT_FILES = ("icqs_fast/features/attention.py", "icqs_fast/ops/", "icqs_fast/backends/",
             "icqs_fast/engine/cascade.py", "icqs_fast/engine/batching.py", "kernels/")


def _accounting(rec: Recorder, name: str, mine: list[dict]) -> dict:
    """A path's host syncs, forwards and kernel launches, setup (once per model) apart, and
    its sync budget (:data:`SYNC_BUDGETS`, :data:`SETUP_SYNC_BUDGET`, :data:`HOT_FILES`)."""
    syncs = {"setup": 0, "batch": 0}
    hot = []
    for (p, phase, op, site), c in rec.syncs.items():
        if p == name:
            syncs[phase] += c
            if phase == "batch" and site.split(" < ")[0].startswith(HOT_FILES):
                hot.append(f"{c} x {op} at {site}")
    triton = {"setup": 0, "batch": 0}
    for e in mine:
        triton[e["phase"]] += 1
    fwd = rec.forwards[name]
    budget = SYNC_BUDGETS[name]
    per_fwd = syncs["batch"] / fwd if fwd else float(syncs["batch"])
    problems = list(hot)
    if per_fwd > budget:
        problems.append(f"{syncs['batch']} host syncs in {fwd} batch forwards: {per_fwd:.2f} per "
                        f"forward, budget {budget}")
    if syncs["setup"] > SETUP_SYNC_BUDGET:
        problems.append(f"{syncs['setup']} host syncs in the once-per-model setup, budget "
                        f"{SETUP_SYNC_BUDGET}")
    launches = rec.aten_launches[(name, "batch")] + triton["batch"]
    layers = rec.layer_calls[name]
    return {"syncs_setup": syncs["setup"], "syncs_batch": syncs["batch"], "forwards": fwd,
            "syncs_per_forward": round(per_fwd, 3),
            "sync_budget": {"per_forward": budget, "setup": SETUP_SYNC_BUDGET,
                            "ok": not problems, "problems": problems},
            "launches_batch": {"aten": rec.aten_launches[(name, "batch")],
                               "triton": triton["batch"], "total": launches,
                               "in_layers": rec.layer_launches[name], "layer_calls": layers,
                               "per_forward": round(launches / fwd, 1) if fwd else None,
                               "per_layer": round(rec.layer_launches[name] / layers, 1)
                               if layers else None},
            "launches_setup": {"aten": rec.aten_launches[(name, "setup")],
                               "triton": triton["setup"]}}


def dry_run_in_child(paths=PATHS, *, arch: str = "sm_90", compile: bool = True,
                     timeout: float = 900) -> dict:
    """:func:`dry_run` in a fresh interpreter with ``TRITON_INTERPRET`` removed (the test
    suite's interpreter makes ``@triton.jit`` functions uncompilable); Triton's own on-disk
    cache is kept, so a second run recompiles nothing."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    code = ("import json, sys; from bench.gpu_model.dry_run import dry_run; "
            f"r = dry_run({tuple(paths)!r}, arch={arch!r}, compile={compile!r}); "
            "sys.stdout.write('\\n@@REPORT@@' + json.dumps(r))")
    # From the repository root: the child imports bench.
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=timeout, check=False, cwd=Path(__file__).resolve().parents[2])
    if "@@REPORT@@" not in p.stdout:
        raise RuntimeError(f"dry run child exited {p.returncode}: {p.stderr[-3000:]}")
    return json.loads(p.stdout.rsplit("@@REPORT@@", 1)[1])


def _key_diff(m: dict) -> str:
    """The parts of the launched compile keys that the described ones lack."""
    import ast

    def parts(keys):
        out = set()
        for k in keys:
            name, sig, const, div, warps, stages, _ = ast.literal_eval(k)
            out |= {f"{a}:{b}" for a, b in sig} | {f"{a}={b}" for a, b in const}
            out |= {f"div16({d})" for d in div} | {f"warps={warps}", f"stages={stages}"}
        return out

    la, de = parts(m["launched_not_described"]), parts(m["described_not_launched"])
    return f"{sorted(la - de)} where described {sorted(de - la)}"


def print_report(r: dict, file=sys.stdout) -> None:
    print(f"dry run: fake CUDA device, Triton launches compiled for {r['arch']}",
          file=file)
    for name, e in r["paths"].items():
        print(f"  {name:10s} {e['status']:5s} {e['launches']:4d} launches, "
              f"{e['compiles_ok']} kernels compiled ({', '.join(e['kernels'])}) "
              f"{e['seconds']} s", file=file)
        if e["status"] != "ok":
            print(f"      error: {e.get('error') or e.get('compile_errors')}", file=file)
        b, ln = e["sync_budget"], e["launches_batch"]
        print(f"      host syncs: {e['syncs_batch']} in {e['forwards']} batch forwards "
              f"({e['syncs_per_forward']} per forward, budget {b['per_forward']}), "
              f"{e['syncs_setup']} once per model (budget {b['setup']}): "
              f"{'ok' if b['ok'] else 'OVER BUDGET'}; launches per forward {ln['per_forward']}"
              f" ({ln['per_layer']} per decoder layer)", file=file)
        for prob in b["problems"]:
            print(f"      over budget: {prob}", file=file)
        for m in e.get("gpu_launches_mismatches", []):
            print(f"      finding: the launch of {m['case']} is not the configuration its "
                  f"gpu_launches() describes (what the static model compiles): launched "
                  f"{_key_diff(m)}", file=file)
    print(f"  distinct kernel configurations compiled: {r['compiles']}", file=file)
    e = r.get("gpu_run_expected")
    if e:
        parts = ", ".join(f"{k} {v:.0f} s" for k, v in e["sections_s"].items())
        print(f"  expected duration of the real run (bench gpu on a fresh H100): about "
              f"{e['expected_s'] / 60:.1f} min ({parts}); budget {e['budget_s']:.0f} s, "
              f"sections that no longer fit are skipped ({e['basis']})", file=file)
    if r["host_syncs"]:
        print("  host syncs on CUDA tensors (count per run, call site):", file=file)
        for s in r["host_syncs"]:
            print(f"    {s['path']:10s} {s['phase']:5s} {s['count']:4d} x {s['op']:22s} "
                  f"{s['site']}", file=file)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--paths", default=None,
                   help=f"comma-separated subset of {','.join(PATHS)} (default: all)")
    p.add_argument("--json", action="store_true", help="print the JSON report")
    p.add_argument("--out", default=None, help="also write the JSON report here")


def run(args: argparse.Namespace) -> int:
    from icqs_fast.backends import triton_interpreting
    from icqs_fast.benchmarks.gpu import expected_duration

    paths = tuple(x for x in (args.paths or ",".join(PATHS)).split(",") if x)
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        raise ValueError(f"--paths: unknown {', '.join(unknown)} (known: {', '.join(PATHS)})")
    r = dry_run_in_child(paths) if triton_interpreting() else dry_run(paths)
    # What the real run (make bench-gpu) should take on a fresh GPU machine.
    r["gpu_run_expected"] = expected_duration()
    if args.out:
        write_whole(args.out, json.dumps(r, indent=1) + "\n")
    if args.json:
        print(json.dumps(r, indent=1))
    else:
        print_report(r)
    return 0 if r["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.gpu_model.dry_run``: no GPU needed. It runs the CUDA code paths
    (bench gpu's cases, the ICQS engine with cascade attention, features, audit, lm-eval, the
    score job, the server, a Ray actor) on fake CUDA tensors, compiles every Triton launch for
    sm_90 instead of running it, and reports device/dtype errors and host syncs; exit 1 when a
    path fails. It cannot catch numerics, kernel correctness on hardware, timing, memory limits
    or races (docs/GPU_MODEL.md)."""
    p = argparse.ArgumentParser(prog="python -m bench.gpu_model.dry_run",
                                description=main.__doc__.split("\n\n")[0].replace("\n", " "))
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except ValueError as exc:
        p.error(str(exc))


if __name__ == "__main__":
    sys.exit(main())
