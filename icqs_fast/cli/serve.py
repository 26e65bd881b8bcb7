"""``icqs-fast serve``: an OpenAI-compatible scoring server (``/v1/completions`` with
``echo=True, max_tokens=0, logprobs=N``; ``/v1/models``; ``/v1/score`` for ICQS and glass-box
features). Binds 127.0.0.1 unless told otherwise; any other address needs ``--api-key``.

    icqs-fast serve --port 8000
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from icqs_fast.cli.options import (
    add_device_map_argument,
    add_dtype_argument,
    add_model_arguments,
    add_quantization_argument,
    add_quiet_argument,
)
from icqs_fast.threads import add_threads_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    from icqs_fast.cli.options import add_declared, add_self_check_arguments
    from icqs_fast.engine.settings import ScoringSettings
    from icqs_fast.serve.config import ServeConfig

    p.description = __doc__.split("\n\n")[0].replace("``", "")
    add_model_arguments(p)
    add_dtype_argument(p)
    add_quantization_argument(p)
    add_device_map_argument(p)
    add_model_arguments(p, ("device",))
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; any other needs --api-key)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--good", default=None, help="good demonstrations (JSONL/CSV/TSV x,y) for ICQS")
    p.add_argument("--bad", default=None, help="bad demonstrations for ICQS")
    icqs = p.add_argument_group("/v1/score's ICQS settings (a request's icqs_options may "
                                "change them)")
    add_declared(icqs, ScoringSettings, names=served_options())
    add_self_check_arguments(p.add_argument_group(
        "the self-check (with --good / --bad: run once before serving)"))
    add_declared(p.add_argument_group("the server (limits, scheduling)"), ServeConfig,
                 defaults={"model_name": None})  # None: --model, or 'embedded'
    add_threads_argument(p)
    p.add_argument("--log-level", default=None,
                   help="uvicorn log level (default info; warning with --quiet)")
    add_quiet_argument(p, "only errors on stderr: no access log, no start-up lines, no model "
                       "loading or conversion progress")


def served_options() -> tuple[str, ...]:
    """The ScoringSettings options a ``/v1/score`` request may set (declared ``request``):
    ``serve`` takes them as the server's defaults."""
    from icqs_fast.engine.settings import ScoringSettings
    from icqs_fast.options import declared

    return tuple(d.name for d in declared(ScoringSettings) if d.option.request)


def serve_config(args: argparse.Namespace) -> Any:
    """The :class:`~icqs_fast.serve.config.ServeConfig` of parsed ``serve`` options (the API
    key from ``$ICQS_FAST_API_KEY`` when not given; the model id from ``--model``, else
    'embedded'); ValueError naming the flag of a value out of its bounds."""
    from icqs_fast.cli.options import declared_values
    from icqs_fast.serve.config import ServeConfig

    values = declared_values(args, ServeConfig)
    values["api_key"] = values["api_key"] or os.environ.get("ICQS_FAST_API_KEY") or None
    values["model_name"] = values["model_name"] or args.model or "embedded"
    return ServeConfig(**values)


def served_settings(args: argparse.Namespace) -> Any:
    """The server's :class:`~icqs_fast.engine.settings.ScoringSettings` from parsed ``serve``
    options (the :func:`served_options`; the rest at their defaults); ValueError naming the
    flag."""
    from icqs_fast.cli.options import declared_values
    from icqs_fast.engine.settings import ScoringSettings

    return ScoringSettings(**declared_values(args, ScoringSettings, names=served_options()))


def run(args: argparse.Namespace) -> int:
    from icqs_fast.cli.options import self_check_kwargs
    from icqs_fast.serve.app import Server
    from icqs_fast.serve.runner import check_bind, serve

    # Every option checked before the model loads (ValueError naming the flag: exit 2).
    cfg = serve_config(args)
    settings = served_settings(args)
    check_options = self_check_kwargs(args)
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    check_bind(args.host, cfg.api_key)
    if (args.good is None) != (args.bad is None):
        raise ValueError("give both --good and --bad, or neither")
    from icqs_fast.models import device_map_kwargs, load_model, quantization_kwargs

    quant = quantization_kwargs(args.quantization, args.device)
    quant.update(device_map_kwargs(args.device_map, args.device))  # a split model: CUDA too
    if args.quiet:  # quiet means only errors, transformers' output too (and the GGUF convert)
        from icqs_fast.progress import quiet_transformers

        quiet_transformers()
    from icqs_fast.threads import apply_threads

    apply_threads(args.threads)  # None: the cores actually free
    good = bad = None
    if args.good is not None:
        from icqs_fast.io.readers import read_examples

        good, bad = read_examples(args.good), read_examples(args.bad)
    model, tok = load_model(args.model, dtype=args.dtype, device=args.device, **quant)
    server = Server(model, tok, cfg, good=good, bad=bad, icqs_options=settings)
    if good is not None:  # before serving: the calibrated probability of the server's pools
        check = server.scoring.run_self_check(**check_options)
        if not args.quiet:
            for line in check.lines():
                print(f"icqs-fast serve: {line}", file=sys.stderr)
    if not args.quiet:
        print(f"icqs-fast serve: model {cfg.model_name!r} on http://{args.host}:{args.port}/v1 "
              f"({'API key required' if cfg.api_key else 'no API key'}; schema at /openapi.json,"
              " metrics at /metrics)", file=sys.stderr)
    level = args.log_level or ("warning" if args.quiet else "info")
    serve(server, args.host, args.port, log_level=level, access_log=not args.quiet)
    return 0
