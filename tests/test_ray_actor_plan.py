"""``--ray`` on GPU nodes (issue 49, item 2), on a fake cluster's resources (no Ray cluster is
started): ``--gpus-per-worker`` defaults to 1 where the cluster reports GPUs, an actor with no
GPU loads on the CPU and says so on a GPU cluster, and ``auto`` is resolved by each actor on
its own device (the driver's CPU gave GPU actors ``bf16-mixed``, a CPU mode)."""

import json

import pytest
from _helpers import write_jsonl

from icqs_fast.jobs import ray_executor
from icqs_fast.jobs.ray_executor import ActorPlan, actor_plan

GPU_NODE = {"CPU": 64.0, "GPU": 8.0, "memory": 1e12}
CPU_NODE = {"CPU": 16.0, "memory": 6e10}


def test_gpus_per_worker_defaults_to_one_on_a_gpu_cluster():
    assert actor_plan(None, "auto", GPU_NODE) == ActorPlan(1.0, "auto")
    assert actor_plan(None, "cuda", GPU_NODE) == ActorPlan(1.0, "cuda")
    assert actor_plan(0.5, "auto", GPU_NODE) == ActorPlan(0.5, "auto")
    assert actor_plan(None, "auto", CPU_NODE) == ActorPlan(0.0, "cpu")


@pytest.mark.parametrize("gpus,device,flag", [(0.0, "auto", "--gpus-per-worker 0"),
                                              (None, "cpu", "--device cpu")])
def test_a_cpu_actor_on_a_gpu_cluster_warns(gpus, device, flag):
    plan = actor_plan(gpus, device, GPU_NODE)
    assert (plan.gpus, plan.device) == (0.0, "cpu")  # not cuda:0 of a GPU Ray did not give it
    (w,) = plan.warnings
    assert "8 GPUs" in w and flag in w and "--gpus-per-worker 1" in w


def test_gpus_on_a_cluster_without_gpus_is_refused():
    with pytest.raises(ValueError, match="--gpus-per-worker 1: the Ray cluster reports no GPU"):
        actor_plan(1.0, "auto", CPU_NODE)
    with pytest.raises(ValueError, match="with --device cpu"):
        actor_plan(1.0, "cpu", GPU_NODE)


@pytest.mark.slow  # builds the demonstration sets and counts the input (~1 s with imports)
def test_the_actors_get_the_plan_and_auto(tmp_path, monkeypatch):
    """The executor's wiring on a fake 8-GPU cluster: one GPU per actor, the actors' config
    keeps --dtype auto (resolved on the actor) and --device auto; the warning reaches the log
    on a CPU-actor run."""
    import ray

    from icqs_fast.engine.settings import ScoringSettings
    from icqs_fast.jobs.config import RayOptions, ScoreJobConfig, SelfCheckOptions
    from icqs_fast.jobs.runner import run_with

    seen = {}
    monkeypatch.setattr(ray_executor, "_init_ray", lambda address: False)
    monkeypatch.setattr(ray, "cluster_resources", lambda: GPU_NODE)
    monkeypatch.setattr(ray_executor, "_dataset", lambda blocks, setup, workers, remote:
                        seen.update(setup=setup, remote=remote))
    monkeypatch.setattr(ray_executor, "_drive", lambda job, ds, p: 0)
    good = [{"x": f"up {i}", "y": "positive"} for i in range(3)] + [
        {"x": f"down {i}", "y": "negative"} for i in range(3)]
    g = write_jsonl(tmp_path / "g.jsonl", good)
    inp = write_jsonl(tmp_path / "in.jsonl", good)
    lines = []
    for gpus, want in ((None, 1.0), (0.0, None)):
        cfg = ScoreJobConfig(input=str(inp), output=str(tmp_path / f"out{gpus}"), good=str(g),
                             bad=str(g), scoring=ScoringSettings(num_ratios=2, demos_per_set=2,
                                                                 sets_per_ratio=1),
                             self_check=SelfCheckOptions(max_heldout=0),
                             ray=RayOptions(gpus_per_worker=gpus), quiet=True)
        assert run_with(cfg, ray_executor.RayExecutor(), log=lambda *a: lines.append(a)) == 0
        actor_cfg = seen["setup"].strategy.config
        assert seen["remote"]["num_gpus"] == want
        assert actor_cfg.dtype == "auto"  # before: bf16-mixed / float32, chosen on this CPU
        assert actor_cfg.device == ("auto" if want else "cpu")
    warned = [a[0] for a in lines if "warning" in a[0]]
    assert len(warned) == 1 and "8 GPUs" in warned[0], json.dumps(lines)
