"""``--ray`` on a multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: a head
and worker nodes, each its own raylet and object store, all on 127.0.0.1), with a tiny random
Llama: actors on distinct nodes, a worker node removed mid-job, a node added mid-job and used,
object stores too small for the run's blocks (they spill), the driver killed and the job
resumed, the output through a pyarrow filesystem URI. Every run ends with the single-process
output: same ids, log-likelihoods within 1e-6 (relative), each record once.

Loopback only: ``tests/conftest.py`` sets ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` before Ray is
imported, so every node takes 127.0.0.1 as its address (checked here for every node, and for
every socket the cluster's processes listen on). One cluster serves the whole module; its nodes
have 1 CPU each and the worker nodes a ``slot`` resource that the actors ask for, so each actor
gets a worker node of its own and the head keeps its CPU for Ray Data's read tasks. Nothing
here waits on a clock: faults are placed with the Ray holds of tests/_faults.py (an actor
announces the block it holds and waits for the test)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
from _faults import ENTRY, hold_runtime_env, worker_path_env
from _helpers import read_jsonl, restore_environ, save_tiny_llama, wait_for_file, write_jsonl
from _ray_cli import build_config, build_parser

ray = pytest.importorskip("ray")

from icqs_fast.cli import main  # noqa: E402
from icqs_fast.jobs.ray_executor import BlockOutput, run_ray  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("one_torch_thread")]

GOOD = [{"x": f"profit rose {i}%", "y": "positive"} for i in range(3)] + [
    {"x": f"loss widened by {i} million", "y": "negative"} for i in range(3)]
BAD = [{"x": x["x"], "y": "negative" if x["y"] == "positive" else "positive"} for x in GOOD]
N = 12
RESPONSES = [{"id": f"r{i}" if i % 4 else i, "x": f"sales up {i}% in quarter {i % 4}",
              "y": ["positive", "negative", "up by far"][i % 3]} for i in range(N)]
KW = ["--num-ratios", "3", "--demos-per-set", "2", "--sets-per-ratio", "2", "--seed", "1",
      "--dtype", "float32", "--device", "cpu", "--backend", "torch"]
SLOT = {"resources": {"slot": 1}}  # one actor per worker node (see the module docstring)
STORE = 75 << 20  # each node's object store: Ray's minimum, so that 100 MB of blocks spill
WAIT_S = 150  # upper bound for a hold to be reached on a loaded 2-core box; never a pass/fail


@dataclass
class LocalCluster:
    """The module's cluster: ``cluster`` (ray.cluster_utils.Cluster), the holds' folder,
    and the worker nodes by name (``node-a``, ...), each with the custom resource of its name."""

    cluster: object
    hold: str
    workers: dict = field(default_factory=dict)
    added: int = 0

    def add_worker(self, **kw):
        """A worker node with 1 CPU, a ``slot`` and a resource of its own name."""
        name = f"node-{'abcdefgh'[self.added]}"
        self.added += 1
        kw.setdefault("num_cpus", 1)
        kw.setdefault("object_store_memory", STORE)
        node = self.cluster.add_node(resources={name: 1, "slot": 1}, **kw)
        self.workers[name] = node
        return name, node

    def remove_worker(self, name):
        self.cluster.remove_node(self.workers.pop(name))

    def ids(self):
        """Node id -> worker name, for the live worker nodes."""
        return {n.node_id: k for k, n in self.workers.items()}


def _loopback_only(c: LocalCluster) -> None:
    """Every live node, and the GCS, is on 127.0.0.1 (not the machine's interface address)."""
    alive = [n for n in ray.nodes() if n["Alive"]]
    assert len(alive) == 1 + len(c.workers)
    assert {n["NodeManagerAddress"] for n in alive} == {"127.0.0.1"}, alive
    assert c.cluster.address.startswith("127.0.0.1:")


@pytest.fixture(scope="module")
def cluster():
    """Head (1 CPU, no slot: the driver and the read tasks) + two worker nodes."""
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    # tests/conftest.py, before Ray was imported (Ray reads it then)
    assert os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0"
    assert ray_constants.ENABLE_RAY_CLUSTER is False
    root = tempfile.mkdtemp(prefix="rayc-")  # short: Ray's socket paths have a length limit
    hold = os.path.join(root, "hold")
    os.mkdir(hold)
    os.mkdir(os.path.join(root, "ray"))
    # RAY_TMPDIR: Cluster writes its address to $RAY_TMPDIR/ray/ray_current_cluster, where a
    # plain ray.init() of another process on this machine would find and join it. PYTHONPATH:
    # the nodes' workers (also of nodes added later) import the hold hook from tests/.
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "RAY_TMPDIR")}
    os.environ.update({**worker_path_env(), "RAY_TMPDIR": root})
    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=1, resources={"head": 1}, include_dashboard=False, object_store_memory=STORE,
        temp_dir=os.path.join(root, "ray")))
    lc = LocalCluster(c, hold)
    try:
        lc.add_worker()
        lc.add_worker()
        ray.init(address=c.address, log_to_driver=False, runtime_env=hold_runtime_env(hold))
        ray.data.DataContext.get_current().enable_progress_bars = False
        yield lc
    finally:
        ray.shutdown()
        c.shutdown()
        restore_environ(saved)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(autouse=True)
def _fresh_hold(request):
    """No hold file outlives its test (a node's ``held-node-*`` / ``release-node-*``
    would make a later test's hold on the same node pass at once)."""
    yield
    if "cluster" in request.fixturenames:
        hold = request.getfixturevalue("cluster").hold
        for p in os.listdir(hold):
            os.remove(os.path.join(hold, p))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Tiny model, demonstrations, input, and the single-process output (through the CLI)."""
    d = tmp_path_factory.mktemp("cluster")
    tiny = save_tiny_llama(d / "tiny")
    g, b = write_jsonl(d / "good.jsonl", GOOD), write_jsonl(d / "bad.jsonl", BAD)
    inp = write_jsonl(d / "in.jsonl", RESPONSES)
    common = ["--good", str(g), "--bad", str(b), "--model", str(tiny), *KW]
    assert main(["score", str(inp), "-o", str(d / "single.jsonl"), *common, "--quiet"]) == 0
    return {"dir": d, "input": inp, "common": common, "single": read_jsonl(d / "single.jsonl")}


def _config(data, out, *extra, inp=None):
    return build_config("score", build_parser("score").parse_args(
        [str(inp or data["input"]), "-o", str(out), *data["common"], "--ray", "--quiet",
         *extra]))


def _lines(out: BlockOutput) -> list[dict]:
    """The records of a JSONL block output, in block order."""
    rows = []
    for name in out.names():
        if name.startswith("part-") and name.endswith(".jsonl"):
            rows += [json.loads(x) for x in out.read_text(name).splitlines()]
    return rows


def _parquet_lines(out: BlockOutput) -> list[dict]:
    import pyarrow.parquet as pq

    rows = []
    for name in out.names():
        if name.startswith("part-") and name.endswith(".parquet"):
            with out.fs.open_input_file(out.path(name)) as f:
                rows += pq.read_table(f).to_pylist()
    for r in rows:  # as the JSONL lines: ids in their type (Parquet holds them as text)
        r["id"] = json.loads(r["id"]) if r["id"][:1].isdigit() else r["id"]
    return sorted(rows, key=lambda r: r["index"])


def _same_as_single(rows, single) -> None:
    """Each record once, in index order, with the single-process ids, scores and
    log-likelihoods (within 1e-6 relative: the blocks batch responses differently, and the
    default posterior-mean score follows them in its last bits, differently on AVX2 and
    AVX-512 CPUs)."""
    assert [r["index"] for r in rows] == list(range(len(single)))  # none lost or doubled
    for got, want in zip(rows, single, strict=True):
        assert (got["id"], got["line"]) == (want["id"], want["line"])
        assert got["score"] == pytest.approx(want["score"], abs=1e-6)
        np.testing.assert_allclose(got["loglik"], want["loglik"], rtol=1e-6, atol=1e-9)


def _in_thread(fn):
    """Run ``fn`` in a thread; ``join()`` waits for it and re-raises what it raised (a job
    returning an exit code other than 0 fails too)."""
    err: list[BaseException] = []

    def target():
        try:
            assert fn() in (None, 0)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            err.append(exc)

    t = threading.Thread(target=target, daemon=True)
    t.start()

    def join():
        t.join(WAIT_S)
        assert not t.is_alive(), "the fault thread did not finish"
        if err:
            raise err[0]
    return join


def test_loopback_nodes_and_actors_on_distinct_nodes(cluster, data, tmp_path):
    """Three nodes on 127.0.0.1; two actors, each on its own worker node (its node id and the
    custom resource of that node); JSONL blocks equal to the single-process lines."""
    _loopback_only(cluster)
    listening = subprocess.run(["ss", "-Htlnp"], capture_output=True, text=True).stdout
    ray_socks = [ln.split()[3] for ln in listening.splitlines()
                 if any(p in ln for p in ("raylet", "gcs_server", "ray::", "python"))]
    if ray_socks:  # ss shows process names only for this user's processes; check what it shows
        assert all(s.rsplit(":", 1)[0] in ("127.0.0.1", "[::ffff:127.0.0.1]")
                   for s in ray_socks), ray_socks
    by_resource = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    for name, node in cluster.workers.items():
        assert by_resource[node.node_id].get(name) == 1.0
    # Each worker node's actor holds its first block until the other node's actor has one
    # too: both nodes score blocks, whichever actor is ready first.
    hold, nodes = cluster.hold, list(cluster.ids())
    for n in nodes:
        open(os.path.join(hold, f"arm-node-{n}"), "w").close()

    def release_when_both_hold():
        for n in nodes:
            wait_for_file(os.path.join(hold, f"held-node-{n}"), WAIT_S)
        for n in nodes:
            open(os.path.join(hold, f"release-node-{n}"), "w").close()

    join = _in_thread(release_when_both_hold)
    stats = {}
    out = tmp_path / "out"
    try:
        assert run_ray(_config(data, out, "--workers", str(len(nodes)), "--block-size", "2",
                               "--output-format", "jsonl"), stats=stats,
                       actor_options=SLOT) == 0
    finally:
        for n in nodes:
            os.remove(os.path.join(hold, f"arm-node-{n}"))
        join()
    nodes = {b["node"] for b in stats["per_block"]}
    assert nodes == set(cluster.ids()), (nodes, cluster.ids())
    assert len(stats["workers"]) == len(nodes) >= 2
    _same_as_single(_lines(BlockOutput(str(out))), data["single"])
    assert not [p for p in os.listdir(out) if ".tmp." in p]


def test_worker_node_removed_mid_job(cluster, data, tmp_path):
    """Mid-job, the worker node whose actor holds block 3 is removed (its raylet, object store
    and workers killed, no graceful exit): block 3 is scored again on a live node (the other
    actor, or the lost one restarted where a slot frees), each block once. Parquet output
    through a ``file://`` URI. (The job runs in a thread: Ray starts and stops nodes from the
    main thread only.)"""
    hold = cluster.hold
    open(os.path.join(hold, "arm-3"), "w").close()
    out = tmp_path / "out"
    stats = {}
    job = _in_thread(lambda: run_ray(_config(data, out.as_uri(), "--workers", "2",
                                             "--block-size", "2"),
                                     stats=stats, actor_options=SLOT))
    try:
        held = os.path.join(hold, "held-3")
        wait_for_file(held, WAIT_S)
        lost = open(held).read().split()[1]
        cluster.remove_worker(cluster.ids()[lost])
        assert lost not in {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        cluster.add_worker()  # back to two slots, for the lost actor's restart
    finally:
        os.remove(os.path.join(hold, "arm-3"))
        job()
    assert stats["records"] == N
    _loopback_only(cluster)
    done_on = {b["block"]: b["node"] for b in stats["per_block"]}
    assert sorted(b["block"] for b in stats["per_block"]) == list(range(N // 2))  # once each
    assert done_on[3] != lost
    res = BlockOutput(out.as_uri())
    _same_as_single(_parquet_lines(res), data["single"])
    assert not [p for p in res.names() if ".tmp." in p]


def test_node_added_mid_job_is_used(cluster, data, tmp_path):
    """One actor more than worker nodes: the last waits for a slot. The placed actors hold
    their blocks until a node added mid-job has its actor write a block; then they go on."""
    hold, nodes = cluster.hold, list(cluster.ids())
    for n in nodes:
        open(os.path.join(hold, f"arm-node-{n}"), "w").close()
    out = tmp_path / "out"
    stats = {}
    job = _in_thread(lambda: run_ray(_config(data, out, "--workers", str(len(nodes) + 1),
                                             "--block-size", "2", "--output-format", "jsonl"),
                                     stats=stats, actor_options=SLOT))
    try:
        for n in nodes:
            wait_for_file(os.path.join(hold, f"held-node-{n}"), WAIT_S)
        assert not out.exists() or not [p for p in os.listdir(out) if p.endswith(".jsonl")]
        added = cluster.add_worker()[1].node_id
        deadline = time.monotonic() + WAIT_S
        while not [p for p in os.listdir(out) if p.endswith(".jsonl")]:  # only it can write
            assert time.monotonic() < deadline, "the added node's actor wrote no block"
            time.sleep(0.05)
    finally:
        for n in nodes:
            open(os.path.join(hold, f"release-node-{n}"), "w").close()
        job()
        for n in nodes:
            os.remove(os.path.join(hold, f"arm-node-{n}"))
    _loopback_only(cluster)
    assert added in {b["node"] for b in stats["per_block"]}
    assert sorted(b["block"] for b in stats["per_block"]) == list(range(N // 2))
    _same_as_single(_lines(BlockOutput(str(out))), data["single"])


def test_driver_killed_then_resumed(cluster, data, tmp_path):
    """A driver process on the cluster is SIGKILLed while block 2 is in flight; the same
    command with ``--resume`` (this process) does only the missing blocks."""
    out = tmp_path / "out"
    argv = [str(data["input"]), "-o", str(out), *data["common"], "--ray", "--block-size", "2",
            "--output-format", "jsonl", "--resume", "--quiet"]
    hold = cluster.hold
    open(os.path.join(hold, "arm-2"), "w").close()
    try:
        # tests/_ray_cli.py's main, its job joined with the hold runtime env
        proc = subprocess.Popen(
            [sys.executable, ENTRY, "ray-hold", hold, "--", "score", *argv, "--address",
             cluster.cluster.address], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            wait_for_file(os.path.join(hold, "held-2"), WAIT_S, proc)
            before = {p: os.stat(out / p) for p in os.listdir(out)
                      if p.startswith("part-") and ".tmp." not in p}
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
    finally:
        os.remove(os.path.join(hold, "arm-2"))
    # One actor takes the blocks in order and holds at most two: 0 and 1 may be complete.
    assert "part-000002.jsonl" not in before
    stats = {}
    assert run_ray(_config(data, out, "--block-size", "2", "--output-format", "jsonl",
                           "--resume"), stats=stats, actor_options=SLOT) == 0
    for p, st in before.items():  # not redone
        now = os.stat(out / p)
        assert (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    assert sorted(b["block"] for b in stats["per_block"]) == sorted(
        k for k in range(N // 2) if f"part-{k:06d}.jsonl" not in before)
    _same_as_single(_lines(BlockOutput(str(out))), data["single"])
    assert not [p for p in os.listdir(out) if ".tmp." in p]


def _spill_lines(cluster) -> list[str]:
    """The raylets' "Spilled N MiB, M objects" log lines so far (Ray logs each spill there;
    its numeric counters need the dashboard's gRPC client, which is not installed)."""
    import glob
    import re

    logs = os.path.join(cluster.cluster.head_node.get_session_dir_path(), "logs")
    lines = []
    for p in sorted(glob.glob(os.path.join(logs, "raylet*.out"))):
        with open(p, errors="replace") as f:
            lines += [m.group(0) for m in re.finditer(r"Spilled (\d+) MiB, (\d+) objects", f.read())
                      if int(m.group(1)) > 0]
    return lines


def test_small_object_store_spills_and_output_is_complete(cluster, data, tmp_path):
    """Blocks of 16 MB (each record carries an 8 MB label, which the output keeps) and object
    stores of 75 MB: while both actors hold their first block, the driver fills the head's store
    with 64 MB objects until Ray has spilled (its raylet log says "Spilled N MiB"). The records
    never pass through the object store (each actor reads its own blocks), so a store under
    pressure costs the run nothing: the output is the single-process output, labels included.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    # (Parquet columns have one type: the ids as strings here.)
    big = [{**r, "id": str(r["id"]), "label": f"{i:02d}" * (4 << 20)}
           for i, r in enumerate(RESPONSES)]
    inp = tmp_path / "in.parquet"  # JSONL lines are limited to 1 MB; Parquet values are not
    pq.write_table(pa.Table.from_pylist(big), inp, row_group_size=2)
    hold, nodes = cluster.hold, list(cluster.ids())
    for n in nodes:
        open(os.path.join(hold, f"arm-node-{n}"), "w").close()
    before = len(_spill_lines(cluster))
    assert len(nodes) >= 2
    out = tmp_path / "out"
    job = _in_thread(lambda: run_ray(_config(data, out, "--workers", "2", "--block-size", "2",
                                             "--output-format", "jsonl", "--label-field",
                                             "label", inp=inp), actor_options=SLOT))
    try:
        deadline = time.monotonic() + WAIT_S
        while len([p for p in os.listdir(hold) if p.startswith("held-node-")]) < 2:
            assert time.monotonic() < deadline, "the two actors did not start"
            time.sleep(0.05)
        fillers = []  # held until Ray spills some: the head's store holds 75 MB
        while len(_spill_lines(cluster)) == before:
            assert time.monotonic() < deadline, "no object was spilled"
            fillers.append(ray.put(np.zeros(64 << 20, dtype=np.uint8)))
            time.sleep(0.2)
        del fillers
    finally:
        for n in nodes:
            open(os.path.join(hold, f"release-node-{n}"), "w").close()
        job()
    rows = _lines(BlockOutput(str(out)))
    _same_as_single(rows, [{**r, "id": str(r["id"])} for r in data["single"]])
    assert [r["label"] == b["label"] for r, b in zip(rows, big, strict=True)] == [True] * N


def test_object_store_output_writes_in_place(tmp_path):
    """The object-store path of BlockOutput (``by_rename=False``: no temporary name, as on
    S3) on pyarrow's local filesystem through a ``file://`` URI: the driver's and the workers'
    operations (folder, listing, settings, blocks, removal)."""
    import pyarrow.fs as pafs

    uri = (tmp_path / "o").as_uri()
    out = BlockOutput(uri, by_rename=False)
    assert isinstance(out.fs, pafs.LocalFileSystem) and not out.by_rename
    assert out.kind() == "missing" and out.names() == []
    out.make()
    assert out.kind() == "dir"
    out.write_meta({"a": 1})
    with out.open_block(0, "jsonl") as w:  # the block writer: the local JSONL lines
        w.write({"index": 0, "x": "é", "v": float("nan")})
    assert out.names() == ["part-000000.jsonl", "run.meta.json"]
    assert out.read_text("part-000000.jsonl") == '{"index": 0, "x": "é", "v": NaN}\n'
    assert json.loads(out.read_text("run.meta.json")) == {"a": 1}
    out.remove("part-000000.jsonl")
    assert not out.exists("part-000000.jsonl")
    # The default on a local filesystem: a temporary name, then a rename.
    assert BlockOutput(uri).by_rename and BlockOutput(str(tmp_path / "o")).by_rename
