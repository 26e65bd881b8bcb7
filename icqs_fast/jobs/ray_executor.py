"""``icqs-fast score --ray`` / ``icqs-fast features --ray``: the same run on a Ray cluster.

    icqs-fast score responses.parquet -o scores/ --good g.jsonl --bad b.jsonl \\
        --ray [--address auto] --workers 4 --gpus-per-worker 1 [--output-format parquet]

This is the job runner's second executor (:class:`RayExecutor`; :func:`icqs_fast.jobs.runner.
run_with`): the output policy, lock, metadata, resume rules and self-check step are the
single-process run's (:mod:`icqs_fast.io.runs`, the job's strategy), and only where the forward
runs differs. The input (any format the single-process command reads: JSONL/CSV/TSV, Parquet, a
datasets folder; not standard input) is cut into blocks of ``--block-size`` consecutive records
(block ``k`` = records ``[k*B, (k+1)*B)``); Ray Data hands each block's number and range
(:class:`~icqs_fast.jobs.ray_actors.BlockSpec`) to one of ``--workers`` actors
(:class:`BlockActor`), each holding the job's strategy with its model (and, for ICQS, one prefix
bank). The actor reads the block's records itself with the single-process reader (records never
travel as columns; every record check is the reader's), computes them with the strategy and
writes them with the single-process loop (:func:`icqs_fast.jobs.runner.stream_results`) into one
block writer (:class:`~icqs_fast.io.results.BlockWriter`) whose file ``OUT/part-KKKKKK.jsonl``
(or ``.parquet``) is written to a temporary name first and renamed into place, so a block file
exists only when it is complete. ``--resume`` reruns skip existing block files; the run's
settings are in ``OUT/run.meta.json`` and a resumed run with other settings is refused, as the
single-process ``--resume`` does. ``OUT.lock`` keeps a second driver off the same output.

Who writes what (:class:`BlockOutput`): the **driver** creates ``OUT``, writes
``OUT/run.meta.json`` (at the start, and again with what the workers' models add - dtype,
device, backend - once the first block reports them), holds ``OUT.lock``, lists the complete
blocks and removes stale temporary files (``--resume``) or old blocks (``--overwrite``); each
**worker** (actor) writes only the block files it scored (``part-KKKKKK.*``;
:class:`~icqs_fast.io.blocks.BlockOutput`). On a cluster
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

``score --pairs``: a block holds the pairs whose first record lies in it; the driver merges
the blocks' summaries in input order into the local run's (:mod:`icqs_fast.jobs.pairs`).

Bad records follow the single-process rules: ``--on-error stop`` stops at a bad record with its
file, line and field (its block is not written; the blocks done are kept for a ``--resume`` run
after the fix); ``--on-error skip`` writes a ``{"index", "line", "error"}`` row in its place.

Block files hold the single-process output's rows: ``cat OUT/part-*.jsonl`` is the
single-process JSONL output, and the Parquet blocks have exactly the schema of a local
``-o X.parquet`` of the same job (:func:`icqs_fast.io.schema.arrow_schema`), so local and
``--ray`` outputs read as one ``pyarrow.dataset``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import socket
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from icqs_fast.io.blocks import OBJECT_STORES, BlockOutput, block_name, block_path, is_uri
from icqs_fast.io.readers import count_records
from icqs_fast.io.records import InputError, detect_format
from icqs_fast.io.runs import RUNTIME_KEYS, OutputPolicy, check_runtime, resumed_dtype, start_output
from icqs_fast.jobs.config import DEFAULT_BLOCK_SIZE, OUTPUT_FORMATS, JobConfig
from icqs_fast.jobs.ray_actors import BlockSpec, batch_columns, block_items
from icqs_fast.jobs.runner import (
    JobRun,
    ResultSink,
    record_fields,
    run_with,
    stream_results,
)
from icqs_fast.progress import track

__all__ = ["DEFAULT_BLOCK_SIZE", "OUTPUT_FORMATS", "OBJECT_STORES", "BlockActor", "RayExecutor",
           "run_ray", "block_path", "block_name", "is_uri", "BlockOutput"]


# --------------------------------------------------------------------------- actors


def _node_id() -> str:
    """The Ray node this process runs on ("" outside Ray)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001 - a summary field only; never fail a block for it
        return ""


def _quiet(*_: Any) -> None:
    """An actor's log: the driver reports (a worker's stderr is not the user's terminal)."""


def items_of_block(cols: dict[str, np.ndarray], spec: BlockSpec) -> list:
    """The records of the block a batch row names (``block``, ``start``, ``end`` of the
    input ``spec`` describes), read on the actor by the single-process reader."""
    return block_items(spec.at(int(cols["block"][0]), int(cols["start"][0]),
                               int(cols["end"][0])))


@dataclass
class ActorSetup:
    """What every :class:`BlockActor` is built from (one object, pickled once per actor):
    the job's strategy as the driver prepared it (its config, with the dtype the driver chose;
    for ``score`` the one ScoringSettings, the demonstrations and their sets, sent unchanged),
    the output policy (what a resumed output was written with), the run's self-check (None: a
    kind without one), the output as the actors open it, and the input's block template."""

    strategy: Any
    policy: OutputPolicy
    self_check: dict | None
    output: str
    spec: BlockSpec


class BlockActor:
    """The ``--ray`` actor of every job kind: the job's own strategy (the single-process
    run's model load, results and lines), one block in, its file written, one summary row out.

    A settings problem found when the model loads (a resumed output written with another
    dtype, device or backend) is reported in every summary row instead of raised, so the
    driver stops the run with that message (an exception would only make Ray retry)."""

    def __init__(self, setup: ActorSetup) -> None:
        self.setup = setup
        self.output = BlockOutput(setup.output)
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self.node = _node_id()
        self.strategy = setup.strategy  # prepared by the driver: only the model loads here
        self.added: dict = {}  # what the loaded model adds to the metadata (dtype, ...)
        self.setup_error = ""
        try:
            self.strategy.load(setup.policy, self.added, _quiet)
            check_runtime(setup.policy, self.added)
        except ValueError as exc:
            self.setup_error = str(exc)
            return
        if setup.self_check is not None:
            self.strategy.use_self_check(setup.self_check)

    def __call__(self, batch: Any) -> dict[str, np.ndarray]:
        t0 = time.perf_counter()
        cols = batch_columns(batch)
        if len(cols["block"]) != 1:
            raise RuntimeError(f"a batch holds blocks {cols['block'].tolist()}; each batch "
                               "must be one block (map_batches(batch_size=1))")
        block = int(cols["block"][0])
        summary = {"block": block, "n": 0, "skipped": 0, "worker": self.worker,
                   "node": self.node, "seconds": 0.0, "read_s": 0.0, "error": "",
                   "runtime": json.dumps(self.added, sort_keys=True), "state": ""}
        if self.setup_error:
            summary["error"] = json.dumps({"settings": self.setup_error})
            return {k: np.array([v]) for k, v in summary.items()}
        items = items_of_block(cols, self.setup.spec)
        summary["read_s"] = time.perf_counter() - t0
        strategy = self.strategy
        c = strategy.config
        counts = strategy.summary()
        writer = self.output.open_block(block, c.ray.output_format,
                                        schema=strategy.table_schema())
        try:
            with writer:  # written whole on success, not at all on an error
                stream_results(strategy, items, ResultSink(writer, counts, c.on_error == "skip",
                                                           _quiet))
        except InputError as exc:  # --on-error stop: nothing of this block is written
            summary["error"] = json.dumps({"path": exc.path, "line": exc.line,
                                           "field": exc.field, "reason": exc.reason,
                                           "index": getattr(exc, "index", None)})
        summary.update(n=counts.n, skipped=counts.skipped, seconds=time.perf_counter() - t0)
        if hasattr(counts, "state"):  # a summary the driver merges (pairs: their accuracy)
            summary["state"] = json.dumps(counts.state())
        return {k: np.array([v]) for k, v in summary.items()}


# --------------------------------------------------------------------------- driver


class RayExecutor:
    """The forward on a pool of Ray actors; the output is a folder of block files (see the
    module docstring). ``actor_options``: more Ray options for the actors (see
    :func:`run_ray`)."""

    def __init__(self, actor_options: dict | None = None) -> None:
        self.actor_options = actor_options or {}
        self.n_records = 0

    def check(self, config: JobConfig) -> None:
        if config.ray is None:
            raise ValueError("run_ray: the config has no RayOptions (config.ray)")
        try:
            import ray.data  # noqa: F401
        except ImportError as exc:
            raise ValueError(f"--ray needs Ray Data ({exc}); install icqs-fast[ray]") from None
        if config.input == "-":
            raise ValueError("--ray reads a file (its workers read it in blocks); standard "
                             "input is not supported")
        if config.shard:
            raise ValueError("--shard and --ray do not go together: --ray spreads the whole "
                             "input over its workers")
        if config.threads is not None:
            raise ValueError("--threads is for a single-process run; with --ray each worker "
                             "has --cpus-per-worker threads (Ray sets its OMP_NUM_THREADS)")
        config.check()

    def target(self, config: JobConfig, log: Callable[..., None]) -> BlockOutput:
        return BlockOutput(config.output)

    def layout_key(self, config: JobConfig) -> dict:
        """The block layout: a resumed run must cut the same input into the same blocks."""
        ro = config.ray
        assert ro is not None
        self.n_records = count_records(config.input, format=config.format,
                                       encoding=config.encoding)
        if self.n_records == 0:
            raise InputError(config.input, None, None, "no records (the input is empty)")
        return dict(command=config.kind, input=os.path.abspath(config.input),
                    n_records=self.n_records, block_size=ro.block_size,
                    output_format=ro.output_format)

    def run(self, job: JobRun) -> int:
        config, policy, log = job.config, job.policy, job.log
        ro = config.ray
        assert ro is not None
        out = policy.target
        start_output(policy, job.meta, log)
        n, B = self.n_records, ro.block_size
        n_blocks = (n + B - 1) // B
        done = set(policy.state.blocks) if policy.state is not None else set()
        pending = [k for k in range(n_blocks) if block_name(k, ro.output_format) not in done]
        if len(pending) < n_blocks:
            log(f"icqs-fast: resuming {out.output}: {n_blocks - len(pending)} of {n_blocks} "
                f"blocks complete, {len(pending)} to do")
        if not pending:
            log(f"icqs-fast: {out.output}: all {n_blocks} blocks complete; nothing to do")
            return 0
        started = _init_ray(ro.address)
        try:
            import ray

            actors = actor_plan(ro.gpus_per_worker, config.device, ray.cluster_resources())
            for line in actors.warnings:
                log(f"icqs-fast: warning: {line}")
            # The prepared strategy goes to the workers with the actors' device and the dtype
            # (a resumed output's for auto; else auto, resolved by each actor on its own device:
            # on the driver's CPU it gave GPU actors a CPU mode. The first block's runtime is
            # the run's, and a worker that differs stops the run naming --dtype).
            prepared = copy.copy(job.strategy)
            prepared.config = dataclasses.replace(config, dtype=resumed_dtype(policy, config.dtype),
                                                  device=actors.device)
            remote = {"num_gpus": actors.gpus or None, "num_cpus": ro.cpus_per_worker,
                      **self.actor_options}
            check = job.strategy.self_check(
                policy, log, run=lambda: _remote_self_check(prepared, policy, remote))
            if check is not None and not policy.append:
                job.meta["self_check"] = check
                out.write_meta(job.meta)
            # The actors get the output as the user gave it (a URI stays a URI; a path is
            # made absolute), and each opens its own filesystem from it: see BlockOutput.
            spec = BlockSpec(os.path.abspath(config.input),
                             detect_format(config.input, config.format), 0, 0, 0,
                             fields=record_fields(config, labels=job.strategy.read_labels),
                             encoding=config.encoding, name=config.input,
                             pairs=getattr(job.strategy, "pair_fields", None))
            setup = ActorSetup(prepared, policy, check,
                               config.output if is_uri(config.output) else out.root, spec)
            blocks = [{"block": k, "start": k * B, "end": min(n, (k + 1) * B)}
                      for k in pending]
            return _drive(job, _dataset(blocks, setup, ro.workers, remote),
                          Progress(len(pending), n_blocks))
        finally:
            if started:
                import ray

                ray.shutdown()


def _dataset(blocks: list[dict], setup: ActorSetup, workers: int, remote: dict) -> Any:
    """The Ray Data pipeline: one row per pending block, one actor call per row."""
    import ray
    from ray.data import ActorPoolStrategy, DataContext

    DataContext.get_current().enable_progress_bars = False  # ours counts blocks
    ds = ray.data.from_items(blocks, override_num_blocks=len(blocks))
    return ds.map_batches(BlockActor, fn_constructor_kwargs={"setup": setup},
                          batch_size=1, compute=ActorPoolStrategy(size=workers),
                          batch_format="numpy", **remote)


def run_ray(config: JobConfig, *, stats: dict | None = None,
            actor_options: dict | None = None, log: Callable[..., None] | None = None) -> int:
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
    return run_with(config, RayExecutor(actor_options), log=log, stats=stats)


@dataclass(frozen=True)
class ActorPlan:
    """Where the ``--ray`` actors run (:func:`actor_plan`): GPUs per actor, the device each
    loads its model on, and what the user should hear about it."""

    gpus: float
    device: str
    warnings: tuple[str, ...] = ()


def actor_plan(gpus_per_worker: float | None, device: str, resources: dict) -> ActorPlan:
    """GPUs per actor and the actors' device from ``--gpus-per-worker`` (None: 1 when the
    cluster's ``resources`` (``ray.cluster_resources()``) report a GPU and ``--device`` is not
    ``cpu``, else 0) and ``--device``. An actor given no GPU loads on the CPU (``auto`` would
    take ``cuda:0`` of a GPU Ray did not give it); on a cluster with GPUs that is a warning.

    Raises:
        ValueError: GPUs asked for on a cluster that reports none (Ray would wait forever),
            or ``--device cpu`` with GPUs per actor.
    """
    have = float(resources.get("GPU", 0) or 0)
    if gpus_per_worker is None:
        gpus = 1.0 if have > 0 and device != "cpu" else 0.0
    else:
        gpus = float(gpus_per_worker)
    if gpus > 0 and have == 0:
        raise ValueError(f"--gpus-per-worker {gpus:g}: the Ray cluster reports no GPU")
    if gpus > 0 and device == "cpu":
        raise ValueError(f"--gpus-per-worker {gpus:g} with --device cpu: the actors would hold "
                         "GPUs they do not use")
    warnings: list[str] = []
    if gpus == 0:
        if have > 0:
            warnings.append(f"the Ray cluster has {have:g} GPUs but the actors run on the CPU "
                            f"({'--device cpu' if device == 'cpu' else '--gpus-per-worker 0'});"
                            " --gpus-per-worker 1 puts one actor on each GPU")
        return ActorPlan(0.0, "cpu" if device == "auto" else device, tuple(warnings))
    return ActorPlan(gpus, device, tuple(warnings))


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


def _self_check_task(strategy: Any, policy: OutputPolicy) -> dict | None:
    """The job's self-check step on one worker (its resources; the prepared strategy's model
    and engine)."""
    strategy.load(policy, {}, _quiet)
    return strategy.self_check(policy, _quiet)


def _remote_self_check(strategy: Any, policy: OutputPolicy, remote: dict) -> dict | None:
    """:func:`_self_check_task` in a Ray task with one worker's resources."""
    import ray

    task = ray.remote(**{k: v for k, v in remote.items() if k in ("num_gpus", "num_cpus")})
    return ray.get(task(_self_check_task).remote(strategy, policy))


@dataclass
class Progress:
    """The driver's running figures (blocks come back in any order)."""

    n_pending: int
    n_blocks: int
    t0: float = field(default_factory=time.perf_counter)
    # worker -> [blocks, records, busy seconds, read seconds, node]
    per_worker: dict[str, list] = field(
        default_factory=lambda: defaultdict(lambda: [0, 0, 0.0, 0.0, ""]))
    per_block: list[dict] = field(default_factory=list)
    records: int = 0
    skipped: int = 0
    runtime: dict | None = None  # what the first block's worker added to the metadata
    errors: list[dict] = field(default_factory=list)
    states: dict[int, dict] = field(default_factory=dict)  # block -> its summary's state

    def add(self, row: dict, stats: dict) -> None:
        done_s = time.perf_counter() - self.t0
        stats.setdefault("first_block_s", done_s)
        w = self.per_worker[str(row["worker"])]
        w[0] += 1
        w[1] += int(row["n"]) + int(row["skipped"])
        w[2] += float(row["seconds"])
        w[3] += float(row["read_s"])
        w[4] = str(row["node"])
        self.per_block.append({"block": int(row["block"]), "worker": str(row["worker"]),
                               "node": str(row["node"]), "seconds": float(row["seconds"]),
                               "read_s": float(row["read_s"]), "done_s": done_s})
        self.records += int(row["n"])
        self.skipped += int(row["skipped"])
        if row["state"]:
            self.states[int(row["block"])] = json.loads(row["state"])


def _drive(job: JobRun, ds: Any, p: Progress) -> int:
    """Collect the blocks' summary rows: the first one's runtime into the metadata, every
    worker on the same runtime, the first error raised, the figures into ``job.stats``, the
    blocks' summaries merged (a summary with ``state``: the local run's text)."""
    config, policy, log, out = job.config, job.policy, job.log, job.policy.target
    merged = job.strategy.summary()  # its clock starts with the blocks
    try:
        for row in track(ds.iter_rows(), total=p.n_pending, desc="icqs-fast blocks",
                         unit="block", quiet=config.quiet):
            if row["error"]:
                p.errors.append(json.loads(row["error"]))
                if "settings" in p.errors[-1] or config.on_error == "stop":
                    break
                continue
            rt = json.loads(row["runtime"])
            if p.runtime is None:  # the first block fixes the run's dtype/device/backend
                p.runtime = rt
                out.write_meta({**(policy.old or {}), **job.meta, **rt})
            elif any(p.runtime.get(k) != rt.get(k) for k in RUNTIME_KEYS):
                raise ValueError(f"worker {row['worker']} runs with {rt}, the run with "
                                 f"{p.runtime}; every worker must use the same dtype, device "
                                 "and backend (give --dtype, --device and --backend "
                                 "explicitly on a cluster of mixed nodes)")
            p.add(row, job.stats)
    except KeyboardInterrupt:
        log(f"icqs-fast: interrupted; complete blocks are in {out.output}; rerun with --resume")
        return 130
    dt = time.perf_counter() - p.t0
    job.stats.update(
        wall_s=dt, blocks=sum(int(w[0]) for w in p.per_worker.values()), records=p.records,
        skipped=p.skipped, per_block=p.per_block,
        workers={k: {"blocks": int(v[0]), "records": int(v[1]), "busy_s": v[2],
                     "read_s": v[3], "node": v[4]} for k, v in p.per_worker.items()})
    if p.errors:
        _raise_first(p.errors, out.output, log)
    nodes = {v[4] for v in p.per_worker.values()}
    for w, (nb, nr, sec, rd, _node) in sorted(p.per_worker.items()):
        log(f"icqs-fast:   worker {w}: {nb} blocks, {nr} records in {sec:.1f} s busy "
            f"({nr / sec if sec > 0 else 0.0:.2f} records/s; reading its blocks {rd:.2f} s)")
    where = f"on {len(p.per_worker)} workers ({len(nodes)} nodes), {p.n_pending} blocks"
    before = (f" ({p.n_blocks - p.n_pending} blocks were already complete)"
              if p.n_blocks > p.n_pending else "")
    if p.states:  # the blocks' summaries merged in input order: the local run's summary
        for k in sorted(p.states):
            merged.merge(p.states[k])
        log(f"{merged.text(job.strategy.done_prefix)}\n  {where}{before}")
        return 0
    log(f"icqs-fast: {job.strategy.done_what} {p.records} responses in {dt:.1f} s "
        f"({p.records / dt if dt > 0 else 0.0:.2f} responses/s) {where}"
        + (f", {p.skipped} bad records skipped" if p.skipped else "") + before)
    return 0


def _raise_first(errors: list[dict], output: str, log: Callable[..., None]) -> None:
    """Raise the settings error, else the bad record of the lowest index."""
    e = errors[0] if "settings" in errors[0] else min(
        errors, key=lambda e: e["index"] if e.get("index") is not None else 1 << 62)
    if "settings" in e:
        raise ValueError(e["settings"])
    log(f"icqs-fast: stopped at a bad record; complete blocks are in {output}; fix it "
        "and rerun with --resume, or pass --on-error skip")
    raise InputError(e["path"], e["line"], e["field"], e["reason"])
