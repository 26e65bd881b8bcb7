"""``icqs-fast score --ray`` / ``icqs-fast features --ray``: the same run on a Ray cluster.

    icqs-fast score responses.parquet -o scores/ --good g.jsonl --bad b.jsonl \\
        --ray [--address auto] --workers 4 --gpus-per-worker 1 [--output-format parquet]

The input (any format the single-process command reads: JSONL/CSV/TSV, Parquet, a datasets
folder; not standard input) is cut into
blocks of ``--block-size`` consecutive records (block ``k`` = records ``[k*B, (k+1)*B)``), read
by Ray Data (one read task per block, :class:`~icqs_fast.jobs.ray_actors.RecordBlocks`) and scored
by ``map_batches`` on a pool of ``--workers`` actors, each holding one model (and, for ICQS, one
prefix bank). Each block is written by the actor that scored it to ``OUT/part-KKKKKK.jsonl``
(or ``.parquet``), to a temporary name first and renamed into place, so a block file exists only
when it is complete. ``--resume`` reruns skip existing block files; the run's settings are in
``OUT/run.meta.json`` and a resumed run with other settings is refused, as the single-process
``--resume`` does. ``OUT.lock`` keeps a second driver off the same output.

Who writes what (:class:`BlockOutput`): the **driver** creates ``OUT``, writes
``OUT/run.meta.json`` (at the start, and again with dtype/device/backend once the first block
reports them), holds ``OUT.lock``, lists the complete blocks and removes stale temporary files
(``--resume``) or old blocks (``--overwrite``); each **worker** (actor) writes only the block
files it scored (``part-KKKKKK.*``; :class:`~icqs_fast.io.blocks.BlockOutput`). On a cluster
``OUT`` must therefore be reachable under the same name from the driver and from every node:
a folder every node mounts at the same path, or a URI of a pyarrow filesystem
(``pyarrow.fs.FileSystem.from_uri``: ``file:///shared/out``, ``s3://bucket/out``, ``gs://``,
``abfs://``; credentials from each node's environment, as pyarrow reads them). On a local or
mounted filesystem a block goes to ``part-KKKKKK.<fmt>.tmp.PID`` (fsynced) and is renamed into
place; on an object store (``s3``, ``gcs``, ``abfs``) it is uploaded under its final name,
since an object becomes visible only when its upload completes (no rename there). An object
store has no lock: ``OUT.lock`` is taken only on a local or mounted filesystem, so run one
driver per object-store output.

Faults: Ray restarts an actor that dies (``max_restarts=-1``) and re-sends its block
(``max_task_retries=-1``); a re-sent block is rewritten whole, so nothing is lost or doubled. A
driver that dies leaves complete block files only; the same command with ``--resume`` does the
rest.

Bad records follow the single-process rules: ``--on-error stop`` stops at a bad record with its
file, line and field (its block is not written; the blocks done are kept for a ``--resume`` run
after the fix); ``--on-error skip`` writes a ``{"index", "line", "error"}`` row in its place.

Block files hold the single-process output's rows: ``cat OUT/part-*.jsonl`` is the
single-process JSONL output, and the Parquet blocks have exactly the schema of a local
``-o X.parquet`` of the same job (:func:`icqs_fast.io.schema.arrow_schema`), so local and
``--ray`` outputs read as one ``pyarrow.dataset``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from icqs_fast.io.blocks import (
    META_NAME,
    OBJECT_STORES,
    BlockOutput,
    block_name,
    block_path,
    is_uri,
)
from icqs_fast.io.readers import count_records
from icqs_fast.io.records import InputError, RecordError, detect_format
from icqs_fast.io.results import skipped_record
from icqs_fast.io.runs import RUNTIME_KEYS, check_run_paths, resume_refusal
from icqs_fast.io.schema import arrow_schema, rows_table
from icqs_fast.jobs.config import (
    DEFAULT_BLOCK_SIZE,
    OUTPUT_FORMATS,
    FeatureJobConfig,
    JobConfig,
    ScoreJobConfig,
)
from icqs_fast.jobs.ray_actors import (
    BlockSpec,
    GlassboxBatchScorer,
    ICQSBatchScorer,
    RecordBlocks,
    items_of_block,
)

__all__ = ["DEFAULT_BLOCK_SIZE", "OUTPUT_FORMATS", "OBJECT_STORES", "run_ray", "block_path",
           "block_name", "is_uri", "BlockOutput"]


# --------------------------------------------------------------------------- actors


def _node_id() -> str:
    """The Ray node this process runs on ("" outside Ray)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001 - a summary field only; never fail a block for it
        return ""


class _BlockMixin:
    """What the ``--ray`` actors add to the batch scorers: one block in, its file written
    (temporary name, then renamed), one summary row out."""

    def _setup(self, out_dir: str, out_format: str, path_name: str, on_error: str,
               with_label: bool, expected_runtime: dict | None, old_meta: dict | None) -> None:
        self.out_dir, self.out_format = out_dir, out_format
        self.output = BlockOutput(out_dir)
        self.path_name, self.on_error, self.with_label = path_name, on_error, with_label
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self.node = _node_id()
        self.runtime_error = None
        if expected_runtime is not None and old_meta is not None:
            err = resume_refusal(out_dir, old_meta, self.runtime,
                           [k for k in RUNTIME_KEYS if k in old_meta])
            self.runtime_error = None if err is None else str(err)

    def _lines(self, items: list) -> tuple[list[dict], int]:
        raise NotImplementedError

    def table_schema(self) -> Any:
        raise NotImplementedError

    def __call__(self, batch: Any) -> dict[str, np.ndarray]:
        from icqs_fast.jobs.ray_actors import batch_columns

        t0 = time.perf_counter()
        cols = batch_columns(batch)
        blocks = np.unique(cols["block"])
        if len(blocks) != 1:
            raise RuntimeError(f"a batch holds rows of blocks {blocks.tolist()}; each batch "
                               "must be one whole block (map_batches(batch_size=None))")
        block = int(blocks[0])
        read_s = float(cols["read_s"][0]) if len(cols["read_s"]) else 0.0
        summary = {"block": block, "n": 0, "skipped": 0, "worker": self.worker,
                   "node": self.node, "seconds": 0.0, "read_s": read_s, "error": "",
                   "runtime": json.dumps(self.runtime, sort_keys=True)}
        if self.runtime_error is not None:
            summary["error"] = json.dumps({"settings": self.runtime_error})
            return {k: np.array([v]) for k, v in summary.items()}
        items = items_of_block(cols, self.path_name)
        try:
            rows, skipped = self._lines(items)
        except InputError as exc:  # --on-error stop: nothing of this block is written
            summary["error"] = json.dumps({"path": exc.path, "line": exc.line,
                                           "field": exc.field, "reason": exc.reason,
                                           "index": getattr(exc, "index", None)})
            summary["seconds"] = time.perf_counter() - t0
            return {k: np.array([v]) for k, v in summary.items()}
        self._write(block, rows)
        summary.update(n=len(rows) - skipped, skipped=skipped,
                       seconds=time.perf_counter() - t0)
        return {k: np.array([v]) for k, v in summary.items()}

    def _collect(self, results, items):
        errors: list[RecordError] = []
        on_error = errors.append if self.on_error == "skip" else None
        return results(items, path=self.path_name, on_error=on_error), errors

    def _write(self, block: int, rows: list[dict]) -> None:
        # The worker writes its own block files (the driver never sees the rows): whole or not
        # at all, so a block file exists only once it is complete (BlockOutput.write_bytes).
        name = block_name(block, self.out_format)
        if self.out_format == "jsonl":
            self.output.write_jsonl(name, rows)
        else:  # the declared schema: the same as a local -o X.parquet of the job
            self.output.write_parquet(name, rows_table(rows, self.table_schema()))


def _merge_in_order(results, errors: list[RecordError], line_of) -> list[dict]:
    """Output rows in input order: results interleaved with skipped records, as the
    single-process output has them (JSONL lines or Parquet rows alike)."""
    rows: list[dict] = []
    # score_records / feature_records pass each error to on_error in input order, before the
    # result that follows it; the list grows while results are yielded.
    seen = 0
    for rec, res in results:
        while seen < len(errors) and errors[seen].index < rec.index:
            rows.append(skipped_record(errors[seen]))
            seen += 1
        rows.append(line_of(rec, res))
    rows.extend(skipped_record(err) for err in errors[seen:])
    return rows


class ScoreBlocks(_BlockMixin, ICQSBatchScorer):
    """``--ray`` actor of ``icqs-fast score``: an :class:`ICQSBatchScorer` writing blocks."""

    def __init__(self, scorer_kw: dict, block_kw: dict) -> None:
        ICQSBatchScorer.__init__(self, **scorer_kw)
        self._setup(**block_kw)

    def _lines(self, items: list) -> tuple[list[dict], int]:
        from icqs_fast.jobs.score import result_record

        results, errors = self._collect(self.results, items)
        rows = _merge_in_order(results, errors,
                               lambda rec, res: result_record(rec, res, with_label=self.with_label))
        return rows, len(errors)

    def table_schema(self) -> Any:
        return arrow_schema("icqs")


class FeatureBlocks(_BlockMixin, GlassboxBatchScorer):
    """``--ray`` actor of ``icqs-fast features``: a :class:`GlassboxBatchScorer` writing
    blocks."""

    def __init__(self, scorer_kw: dict, block_kw: dict) -> None:
        GlassboxBatchScorer.__init__(self, **scorer_kw)
        self._setup(**block_kw)

    def _lines(self, items: list) -> tuple[list[dict], int]:
        from icqs_fast.jobs.features import feature_line

        results, errors = self._collect(self.results, items)
        rows = _merge_in_order(results, errors, feature_line)
        return rows, len(errors)

    def table_schema(self) -> Any:
        return arrow_schema("features", self.features)


# --------------------------------------------------------------------------- driver


def _check_config(config: JobConfig) -> None:
    if not isinstance(config, (ScoreJobConfig, FeatureJobConfig)):
        raise TypeError(f"run_ray: a ScoreJobConfig or FeatureJobConfig, got "
                        f"{type(config).__name__}")
    if config.ray is None:
        raise ValueError("run_ray: the config has no RayOptions (config.ray)")
    try:
        import ray.data  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"--ray needs Ray Data ({exc}); install icqs-fast[ray]") from None
    if config.input == "-":
        raise ValueError("--ray reads a file (Ray Data reads it in blocks); standard input is "
                         "not supported")
    if config.shard:
        raise ValueError("--shard and --ray do not go together: --ray spreads the whole input "
                         "over its workers")
    if config.threads is not None:
        raise ValueError("--threads is for a single-process run; with --ray each worker has "
                         "--cpus-per-worker threads (Ray sets its OMP_NUM_THREADS)")
    config.check()
    check_run_paths(config.input, config.resume, config.overwrite, config.format)


def _actor_kw(config: JobConfig) -> dict:
    """The actor's constructor kwargs. A score job sends its one ScoringSettings (as
    ``asdict()``, JSON-able) rather than option keywords, so every option reaches the actors
    as the single-process run uses it."""
    common = dict(model=config.model, dtype=config.dtype, device=config.device,
                  x_field=config.x_field, y_field=config.y_field,
                  load_in_8bit=config.load_in_8bit, load_in_4bit=config.load_in_4bit)
    if isinstance(config, ScoreJobConfig):
        from icqs_fast.jobs.score import scoring_settings

        good: Any = os.path.abspath(config.good)
        bad: Any = os.path.abspath(config.bad)
        if (config.demo_x_field, config.demo_y_field) != (config.x_field, config.y_field):
            from icqs_fast.io.readers import read_examples

            kw = dict(x_field=config.demo_x_field, y_field=config.demo_y_field,
                      encoding=config.encoding)  # other fields: the examples themselves
            good, bad = read_examples(good, **kw), read_examples(bad, **kw)
        return dict(good=good, bad=bad, settings=scoring_settings(config).asdict(),
                    encoding=config.encoding, **common)
    assert isinstance(config, FeatureJobConfig)
    return dict(features=list(config.features), mode=config.mode,
                batch_size=config.batch_size, chunk_size=config.chunk_size,
                system_prompt=config.system_prompt, combo_scale=config.combo_scale,
                deterministic=config.deterministic, backend=config.backend, **common)


def _prepare_output(out: BlockOutput, settings: dict, config: JobConfig,
                    log: Callable[..., None]) -> dict | None:
    """Check or start ``OUT`` (the driver's part: the folder, the settings, old blocks); the old
    settings when resuming (None otherwise)."""
    meta = f"{META_NAME}.meta.json"
    kind = out.kind()
    if kind == "file":
        raise ValueError(f"{out.output} exists and is not a folder; a --ray output is a folder "
                         "of block files")
    names = out.names() if kind == "dir" else []
    parts = [p for p in names if p.startswith("part-")]
    if config.resume and meta in names:
        old = json.loads(out.read_text(meta))
        err = resume_refusal(out.output, old, settings, settings)
        if err is not None:
            raise err
        return old
    if parts and not config.resume and not config.overwrite:
        raise ValueError(f"{out.output} holds block files; pass --resume to continue it or "
                         "--overwrite to replace it")
    if parts and config.resume:
        raise ValueError(f"cannot --resume {out.output}: it has block files but no "
                         f"{meta}; use --overwrite")
    out.make()
    for p in parts:
        out.remove(p)
    out.write_meta(settings)
    return None


def _init_ray(address: str | None) -> bool:
    """Connect to (or start) Ray; True when this call started it (and should shut it down)."""
    import ray

    if ray.is_initialized():
        return False
    kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
    if address:
        ray.init(address=address, **kw)
    else:
        ray.init(**kw)
    return True


def run_ray(config: JobConfig, *, stats: dict | None = None,
            actor_options: dict | None = None) -> int:
    """Run a ``score`` (:class:`ScoreJobConfig`) or ``features`` job on Ray Data with
    ``config.ray``'s options: see the module docstring. Returns the exit code (0; 130 on
    Ctrl-C).

    ``config.output`` is a folder (every node must reach it at the same path) or a pyarrow
    filesystem URI (:class:`BlockOutput`).

    ``stats``, if given, is filled with the run's figures: ``wall_s`` (from building the
    dataset to the last block, actor start-up included), ``first_block_s``, ``blocks``,
    ``records``, ``skipped``, ``workers`` (``{worker: {"blocks", "records", "busy_s",
    "read_s", "node"}}``, ``busy_s`` being the time spent in its calls, ``read_s`` in reading
    its blocks, ``node`` the Ray node id it ran on) and ``per_block`` (one dict per block in
    the order the driver got them: ``block``, ``worker``, ``node``, ``seconds`` in the call,
    ``read_s``, ``done_s`` since the start).

    ``actor_options``: more Ray options for the actors (``map_batches``' ``ray_remote_args``:
    ``resources={"big_gpu_node": 1}``, ``scheduling_strategy="SPREAD"``,
    ``accelerator_type``, ``runtime_env``, ...), beside ``num_cpus`` / ``num_gpus`` from the
    options (which they may replace).

    Raises:
        InputError: a bad record with ``--on-error stop`` (file, line, field), a bad input.
        ValueError: other settings in a resumed output, bad options.
    """
    _check_config(config)
    ro = config.ray
    assert ro is not None
    log = (lambda *a: None) if config.quiet else (lambda *a: print(*a, file=sys.stderr))
    out = BlockOutput(config.output)
    fmt_in = detect_format(config.input, config.format)
    settings = config.fingerprint()
    actor_kw = _actor_kw(config)
    n = count_records(config.input, format=fmt_in, encoding=config.encoding)
    if n == 0:
        raise InputError(config.input, None, None, "no records (the input is empty)")
    settings.update(command=config.kind, input=os.path.abspath(config.input), n_records=n,
                    block_size=ro.block_size, output_format=ro.output_format)
    with out.lock():
        old = _prepare_output(out, settings, config, log)
        actor_kw["dtype"] = _actor_dtype(config, old)
        return _run_locked(config, out, settings, old, actor_kw, fmt_in, n, log,
                           stats if stats is not None else {}, actor_options or {})


def _actor_dtype(config: JobConfig, old: dict | None) -> str:
    """The dtype every actor loads its model in, decided once by the driver: ``--dtype`` as
    given, a resumed output's own dtype for ``auto``, else ``auto`` resolved here for CPU
    actors (on a cluster of mixed CPU kinds each actor choosing for itself would disagree, and
    the blocks must share one dtype); GPU actors all choose bf16 and keep ``auto``."""
    if config.dtype != "auto":
        return config.dtype
    if old is not None and isinstance(old.get("dtype"), str):
        return old["dtype"]
    if config.ray.gpus_per_worker or config.device not in ("auto", "cpu"):
        return "auto"
    from icqs_fast.models import choose_dtype

    return str(choose_dtype("auto", "cpu").dtype).removeprefix("torch.")


def _run_locked(config, out, settings, old, actor_kw, fmt_in, n, log, stats,
                actor_options) -> int:
    from icqs_fast.progress import track

    ro = config.ray
    names = out.names()
    for stale in (p for p in names if p.startswith("part-") and ".tmp." in p):
        out.remove(stale)  # a block being written when a driver or worker died
    B = ro.block_size
    n_blocks = (n + B - 1) // B
    done = {k for k in range(n_blocks) if block_name(k, ro.output_format) in names}
    pending = [k for k in range(n_blocks) if k not in done]
    if done:
        log(f"icqs-fast: resuming {out.output}: {len(done)} of {n_blocks} blocks complete, "
            f"{len(pending)} to do")
    if not pending:
        log(f"icqs-fast: {out.output}: all {n_blocks} blocks complete; nothing to do")
        return 0
    label_field = config.label_field
    specs = [BlockSpec(os.path.abspath(config.input), fmt_in, k, k * B, min(n, (k + 1) * B),
                       x_field=config.x_field, y_field=config.y_field, id_field=config.id_field,
                       label_field=label_field, encoding=config.encoding) for k in pending]
    # The actors get the output as the user gave it (a URI stays a URI; a path is made
    # absolute), and each opens its own filesystem from it: see BlockOutput.
    block_kw = dict(out_dir=config.output if is_uri(config.output) else out.root,
                    out_format=ro.output_format,
                    path_name=config.input, on_error=config.on_error,
                    with_label=label_field is not None,
                    expected_runtime=None if old is None else
                    {k: old[k] for k in RUNTIME_KEYS if k in old},
                    old_meta=old)
    remote = {"num_gpus": ro.gpus_per_worker or None, "num_cpus": ro.cpus_per_worker,
              **actor_options}
    started = _init_ray(ro.address)
    try:
        import ray
        from ray.data import ActorPoolStrategy, DataContext

        if config.kind == "score":  # once per run, before the blocks: p_good_calibrated
            check = _self_check(config, old, actor_kw, remote, log)
            if old is None:
                settings["self_check"] = check
                out.write_meta(settings)
            actor_kw = {**actor_kw, "self_check": check}

        DataContext.get_current().enable_progress_bars = False  # ours counts blocks
        t0 = time.perf_counter()
        ds = ray.data.read_datasource(RecordBlocks.datasource(specs),
                                      override_num_blocks=len(specs))
        ds = ds.map_batches(
            ScoreBlocks if config.kind == "score" else FeatureBlocks,
            fn_constructor_kwargs={"scorer_kw": actor_kw, "block_kw": block_kw},
            batch_size=None,  # one batch = one whole block
            compute=ActorPoolStrategy(size=ro.workers), batch_format="numpy", **remote,
        )
        return _drive(ds, track, config, out, settings, old, len(pending), n_blocks, t0, log,
                      stats)
    finally:
        if started:
            import ray

            ray.shutdown()


def _self_check_task(actor_kw: dict, kw: dict) -> dict:
    """The self-check on one worker (its resources, its model and prefix bank), as a dict."""
    from icqs_fast.engine.selfcheck import run_self_check

    b = ICQSBatchScorer(**actor_kw)
    return run_self_check(b.scorer, b.good, b.bad, **kw).to_dict()


def _self_check(config: ScoreJobConfig, old: dict | None, actor_kw: dict, remote: dict,
                log: Callable[..., None]) -> dict:
    """The run's self-check (``SelfCheck.to_dict()``): a resumed output's, else computed in a
    Ray task with one worker's resources (nothing scored when the pools are too small or it is
    off)."""
    import ray

    from icqs_fast.engine.selfcheck import DEFAULT_MAX_HELDOUT, SelfCheck, run_self_check
    from icqs_fast.engine.selfcheck import too_small_without_scoring as too_small

    if old is not None:
        return old.get("self_check") or \
            SelfCheck.off("not run (resuming an output written without one)").to_dict()
    kw = dict(config.self_check)
    good, bad = ICQSBatchScorer.pools(actor_kw)
    n = kw.get("max_heldout", DEFAULT_MAX_HELDOUT)
    if n == 0 or too_small(len(good), len(bad), n):
        check = run_self_check(None, good, bad, **kw)  # scores nothing
    else:
        task = ray.remote(**{k: v for k, v in remote.items() if k in ("num_gpus", "num_cpus")})
        check = SelfCheck.from_dict(ray.get(task(_self_check_task).remote(actor_kw, kw)))
    for line in check.lines():
        log(f"icqs-fast: {line}")
    return check.to_dict()


def _drive(ds, track, config, out, settings, old, n_pending, n_blocks, t0, log, stats) -> int:
    per_worker: dict[str, list] = defaultdict(lambda: [0, 0, 0.0, 0.0, ""])
    per_block: list[dict] = []
    total = skipped = 0
    runtime = None if old is None else {k: old[k] for k in RUNTIME_KEYS if k in old} or None
    errors: list[dict] = []
    try:
        for row in track(ds.iter_rows(), total=n_pending, desc="icqs-fast blocks",
                         unit="block", quiet=config.quiet):
            err = row["error"]
            if err:
                errors.append(json.loads(err))
                if "settings" in errors[-1] or config.on_error == "stop":
                    break
                continue
            rt = json.loads(row["runtime"])
            if runtime is None:
                runtime = rt  # the first block fixes the run's dtype/device/backend
                out.write_meta({**settings, **rt})
            elif any(runtime.get(k) != rt.get(k) for k in RUNTIME_KEYS):
                raise ValueError(f"worker {row['worker']} runs with {rt}, the run with "
                                 f"{runtime}; every worker must use the same dtype, device "
                                 "and backend")
            done_s = time.perf_counter() - t0
            stats.setdefault("first_block_s", done_s)
            w = per_worker[str(row["worker"])]
            w[0] += 1
            w[1] += int(row["n"]) + int(row["skipped"])
            w[2] += float(row["seconds"])
            w[3] += float(row["read_s"])
            w[4] = str(row["node"])
            per_block.append({"block": int(row["block"]), "worker": str(row["worker"]),
                              "node": str(row["node"]), "seconds": float(row["seconds"]),
                              "read_s": float(row["read_s"]), "done_s": done_s})
            total += int(row["n"])
            skipped += int(row["skipped"])
    except KeyboardInterrupt:
        log(f"icqs-fast: interrupted; complete blocks are in {out.output}; rerun with --resume")
        return 130
    dt = time.perf_counter() - t0
    stats.update(wall_s=dt, blocks=sum(int(w[0]) for w in per_worker.values()), records=total,
                 skipped=skipped, per_block=per_block,
                 workers={k: {"blocks": int(v[0]), "records": int(v[1]), "busy_s": v[2],
                              "read_s": v[3], "node": v[4]} for k, v in per_worker.items()})
    if errors:
        e = errors[0] if "settings" in errors[0] else min(
            errors, key=lambda e: e["index"] if e.get("index") is not None else 1 << 62)
        if "settings" in e:
            raise ValueError(e["settings"])
        log(f"icqs-fast: stopped at a bad record; complete blocks are in {out.output}; fix it "
            "and rerun with --resume, or pass --on-error skip")
        raise InputError(e["path"], e["line"], e["field"], e["reason"])
    nodes = {v[4] for v in per_worker.values()}
    for w, (nb, nr, sec, rd, _node) in sorted(per_worker.items()):
        log(f"icqs-fast:   worker {w}: {nb} blocks, {nr} records in {sec:.1f} s busy "
            f"({nr / sec if sec > 0 else 0.0:.2f} records/s; reading its blocks {rd:.2f} s)")
    log(f"icqs-fast: {'scored' if settings['command'] == 'score' else 'features of'} {total} "
        f"responses in {dt:.1f} s ({total / dt if dt > 0 else 0.0:.2f} responses/s) on "
        f"{len(per_worker)} workers ({len(nodes)} nodes), {n_pending} blocks"
        + (f", {skipped} bad records skipped" if skipped else "")
        + (f" ({n_blocks - n_pending} blocks were already complete)"
           if n_blocks > n_pending else ""))
    return 0
