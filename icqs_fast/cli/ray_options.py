"""The ``--ray`` options shared by ``score`` and ``features`` (Ray is imported only when used).
"""

from __future__ import annotations

import argparse
from typing import Any

from icqs_fast.jobs.config import DEFAULT_BLOCK_SIZE, OUTPUT_FORMATS, RayOptions


def add_ray_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--ray`` options, added to the ``score`` and ``features`` parsers."""
    g = p.add_argument_group("Ray (scale-out; OUTPUT is then a folder of block files)")
    g.add_argument("--ray", action="store_true",
                   help="run on a Ray cluster with Ray Data (icqs-fast[ray])")
    g.add_argument("--address", default=None,
                   help="Ray cluster: 'auto', ray://host:10001, host:6379 (default: start a "
                   "local one)")
    g.add_argument("--workers", type=int, default=1,
                   help="actors, each with its own model (default 1; one per GPU)")
    g.add_argument("--gpus-per-worker", type=float, default=None,
                   help="GPUs per actor (1 = one actor per GPU; default: 1 when the cluster "
                   "reports GPUs and --device is not cpu, else 0)")
    g.add_argument("--cpus-per-worker", type=float, default=1.0,
                   help="CPU cores per actor (default 1; Ray sets its OMP_NUM_THREADS to this)")
    g.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                   help=f"records per input block and output file (default {DEFAULT_BLOCK_SIZE}"
                   "; features: a multiple of --chunk-size)")
    g.add_argument("--output-format", choices=OUTPUT_FORMATS, default="parquet",
                   help="block files: parquet (default) or jsonl (the single-process lines)")


def ray_options(args: argparse.Namespace) -> RayOptions | None:
    """The :class:`RayOptions` of ``--ray`` (None without it)."""
    if not getattr(args, "ray", False):
        return None
    return RayOptions(address=args.address, workers=args.workers,
                      gpus_per_worker=args.gpus_per_worker, cpus_per_worker=args.cpus_per_worker,
                      block_size=args.block_size, output_format=args.output_format)


def add_job_arguments(p: argparse.ArgumentParser) -> None:
    """Options every job has besides its own (after the command's options)."""
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: the cores other processes leave free, "
                   "re-fitted while the job runs; OMP_NUM_THREADS when set)")


def job_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~icqs_fast.jobs.config.JobConfig` fields ``score`` and ``features`` share."""
    return dict(input=args.input, output=args.output, format=args.format,
                x_field=args.x_field, y_field=args.y_field, id_field=args.id_field,
                label_field=getattr(args, "label_field", None), encoding=args.encoding,
                shard=args.shard, on_error=args.on_error, resume=args.resume,
                overwrite=args.overwrite, model=args.model, dtype=args.dtype,
                device=args.device, backend=args.backend, threads=args.threads,
                quiet=args.quiet, ray=ray_options(args))
