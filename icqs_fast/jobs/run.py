"""``run_job``: a ``score`` or ``features`` job on the executor it asks for.

    from icqs_fast.jobs.config import ScoreJobConfig
    from icqs_fast.jobs.run import run_job

    run_job(ScoreJobConfig(input="in.jsonl", output="out.jsonl", good="g.jsonl", bad="b.jsonl"))

Here, above :mod:`icqs_fast.jobs.runner`, because each executor's module builds on the runner
(:mod:`icqs_fast.jobs.ray_executor` uses its loop): the local run is called directly, the
other executors are imported from their registry (:data:`EXECUTOR_RUNS`) when a job asks for
one (Ray only then).
"""

from __future__ import annotations

from collections.abc import Callable

from icqs_fast.jobs.config import EXECUTORS, JobConfig
from icqs_fast.jobs.runner import Log, run_local
from icqs_fast.registry import Registry

# The entry point of each executor but the local one (``JobConfig.executor``), imported when a
# job asks for it: ``(config, *, log, stats) -> exit code``.
EXECUTOR_RUNS: Registry[Callable[..., int]] = Registry("executor")


@EXECUTOR_RUNS.add("ray")
def _ray() -> Callable[..., int]:
    from icqs_fast.jobs.ray_executor import run_ray
    return run_ray


def run_job(config: JobConfig, *, executor: str | None = None, log: Log | None = None,
            stats: dict | None = None) -> int:
    """Run a ``score`` or ``features`` job; the exit code (0; 130 on Ctrl-C).

    ``executor``: ``"local"`` or ``"ray"`` (default: ``config.executor``). ``stats``: the Ray
    executor's run figures (see :func:`icqs_fast.jobs.ray_executor.run_ray`).

    Raises:
        InputError: a bad record with ``on_error="stop"`` (file, line, field), a bad input.
        ValueError / FileNotFoundError: bad options, other settings in a resumed output.
    """
    executor = executor or config.executor
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
    if executor == "local":  # this process: the runner, imported already (a direct call)
        return run_local(config, log=log, stats=stats)
    return EXECUTOR_RUNS.get(executor)(config, log=log, stats=stats)
