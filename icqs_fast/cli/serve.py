"""``icqs-fast serve``: an OpenAI-compatible scoring server (``/v1/completions`` with
``echo=True, max_tokens=0, logprobs=N``; ``/v1/models``; ``/v1/score`` for ICQS and glass-box
features). Binds 127.0.0.1 unless told otherwise; any other address needs ``--api-key``.

    icqs-fast serve --port 8000
"""

from __future__ import annotations

import argparse
import os
import sys

from icqs_fast.cli.options import add_dtype_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    from icqs_fast.serve.config import ServeConfig

    d = ServeConfig()
    p.description = __doc__.split("\n\n")[0].replace("``", "")
    p.add_argument("--model", default=None,
                   help="local Hugging Face model folder (default: the embedded SmolLM2-135M)")
    add_dtype_argument(p)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, ...")
    p.add_argument("--backend", default="auto", help="token-statistics backend of /v1/score")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; any other needs --api-key)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--api-key", default=os.environ.get("ICQS_FAST_API_KEY"),
                   help="bearer token every route requires (default: $ICQS_FAST_API_KEY)")
    p.add_argument("--served-model-name", default=None,
                   help="model id of /v1/models (default: --model, or 'embedded')")
    p.add_argument("--good", default=None, help="good demonstrations (JSONL/CSV/TSV x,y) for ICQS")
    p.add_argument("--bad", default=None, help="bad demonstrations for ICQS")
    p.add_argument("--num-ratios", type=int, default=5, help="/v1/score: M+1 ratios (default 5)")
    p.add_argument("--demos-per-set", type=int, default=8, help="/v1/score: N (default 8)")
    p.add_argument("--sets-per-ratio", type=int, default=4, help="/v1/score: L (default 4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the demonstration sets (default 0)")
    from icqs_fast.cli.options import add_calibration_arguments, add_self_check_arguments

    add_calibration_arguments(p)  # /v1/score's default; a request's icqs_options may change it
    add_self_check_arguments(p)  # with --good / --bad: run once before serving
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help="largest request body; larger: 413 (default %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens,
                   help="longest prompt (or /v1/score record, demonstration) in tokens; "
                   "longer: 400 (default %(default)s)")
    p.add_argument("--max-request-tokens", type=int, default=d.max_request_tokens,
                   help="the price of one request: the tokens it holds (prompts, records, "
                   "demonstrations) and its work, tokens times the forward passes that read "
                   "them (generated tokens, ICQS contexts and calibration baselines, features "
                   "included); more: 413 (default %(default)s)")
    p.add_argument("--max-prompts", type=int, default=d.max_prompts,
                   help="prompts (or /v1/score records) per request (default %(default)s)")
    p.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                   help="largest logprobs=N (top-N alternatives) a request may ask for "
                   "(default %(default)s)")
    p.add_argument("--max-gen-tokens", type=int, default=d.max_gen_tokens,
                   help="largest max_tokens (greedy generation; default %(default)s)")
    p.add_argument("--max-stop", type=int, default=d.max_stop,
                   help="most 'stop' strings per request (default %(default)s)")
    p.add_argument("--max-stop-chars", type=int, default=d.max_stop_chars,
                   help="longest 'stop' string, in characters (default %(default)s)")
    p.add_argument("--max-logit-bias", type=int, default=d.max_logit_bias,
                   help="most 'logit_bias' entries per request (default %(default)s)")
    p.add_argument("--max-num-ratios", type=int, default=d.max_num_ratios,
                   help="/v1/score: largest num_ratios (M+1) (default %(default)s)")
    p.add_argument("--max-sets-per-ratio", type=int, default=d.max_sets_per_ratio,
                   help="/v1/score: largest sets_per_ratio (L) (default %(default)s)")
    p.add_argument("--max-demos-per-set", type=int, default=d.max_demos_per_set,
                   help="/v1/score: largest demos_per_set (N) (default %(default)s)")
    p.add_argument("--max-live-generations", type=int, default=d.max_live_generations,
                   help="generations holding a KV cache at once; others wait for a free one "
                   "(default %(default)s)")
    p.add_argument("--max-queue", type=int, default=d.max_queue,
                   help="prompts admitted and not yet answered; past it: 429")
    p.add_argument("--batch-wait-ms", type=float, default=d.batch_wait_ms,
                   help="how long a request waits for others to share a batch with")
    p.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens,
                   help="the chunk: tokens of work per engine step; larger requests are cut "
                   "into chunks served round-robin with the others, so no request waits for "
                   "more than one chunk of another (default %(default)s)")
    p.add_argument("--prefill-budget", type=int, default=d.prefill_budget,
                   help="prompt tokens (echo, prefill) per worker step beside one token of "
                   "every live generation: bounds the time between generated tokens "
                   "(default %(default)s)")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout,
                   help="seconds a request may take from admission; past it: 504, its running "
                   "work stops at the next forward or generated token and the rest is dropped "
                   "(0: no limit; default %(default)s)")
    p.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help="on SIGTERM / SIGINT, seconds the requests in flight have to finish "
                   "before they get 503 and the server exits (default %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: the cores other processes leave free; "
                   "OMP_NUM_THREADS when set)")
    p.add_argument("--log-level", default=None,
                   help="uvicorn log level (default info; warning with --quiet)")
    p.add_argument("--quiet", action="store_true",
                   help="only errors on stderr: no access log, no start-up lines, no model "
                   "loading or conversion progress")


def run(args: argparse.Namespace) -> int:
    from icqs_fast.serve.app import ServeConfig, Server
    from icqs_fast.serve.runner import check_bind, serve

    check_bind(args.host, args.api_key)  # before the model loads
    if args.quiet:  # quiet means only errors, transformers' output too (and the GGUF convert)
        from icqs_fast.progress import quiet_transformers

        quiet_transformers()
    from icqs_fast.threads import apply_threads

    apply_threads(args.threads)  # None: the cores actually free
    if (args.good is None) != (args.bad is None):
        raise ValueError("give both --good and --bad, or neither")
    for name in ("max_body_bytes", "max_prompt_tokens", "max_prompts", "max_logprobs",
                 "max_queue", "max_batch_tokens", "prefill_budget", "max_gen_tokens",
                 "max_request_tokens", "max_stop_chars", "max_num_ratios", "max_sets_per_ratio",
                 "max_demos_per_set", "max_live_generations"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("max_stop", "max_logit_bias"):  # 0: the option is refused
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
    if not args.request_timeout >= 0:
        raise ValueError("--request-timeout must be >= 0 (0: no limit)")
    if not 0 <= args.shutdown_timeout < float("inf"):
        raise ValueError("--shutdown-timeout must be a number of seconds >= 0")
    good = bad = None
    if args.good is not None:
        from icqs_fast.io.readers import read_examples

        good, bad = read_examples(args.good), read_examples(args.bad)
    from icqs_fast.models import load_model

    model, tok = load_model(args.model, dtype=args.dtype, device=args.device)
    cfg = ServeConfig(model_name=args.served_model_name or args.model or "embedded",
                      api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                      max_prompt_tokens=args.max_prompt_tokens,
                      max_request_tokens=args.max_request_tokens, max_prompts=args.max_prompts,
                      max_logprobs=args.max_logprobs, max_gen_tokens=args.max_gen_tokens,
                      max_stop=args.max_stop, max_stop_chars=args.max_stop_chars,
                      max_logit_bias=args.max_logit_bias, max_num_ratios=args.max_num_ratios,
                      max_sets_per_ratio=args.max_sets_per_ratio,
                      max_demos_per_set=args.max_demos_per_set,
                      max_live_generations=args.max_live_generations, max_queue=args.max_queue,
                      batch_wait_ms=args.batch_wait_ms, max_batch_tokens=args.max_batch_tokens,
                      prefill_budget=args.prefill_budget, request_timeout=args.request_timeout,
                      shutdown_timeout=args.shutdown_timeout, backend=args.backend)
    server = Server(model, tok, cfg, good=good, bad=bad,
                    icqs_options={"num_ratios": args.num_ratios,
                                  "demos_per_set": args.demos_per_set,
                                  "sets_per_ratio": args.sets_per_ratio, "seed": args.seed,
                                  "calibration": args.calibrate, "score": args.score,
                                  "tie_epsilon": args.tie_epsilon})
    if good is not None:  # before serving: the calibrated probability of the server's pools
        from icqs_fast.cli.options import self_check_kwargs

        check = server.scoring.run_self_check(**self_check_kwargs(args))
        if not args.quiet:
            for line in check.lines():
                print(f"icqs-fast serve: {line}", file=sys.stderr)
    if not args.quiet:
        print(f"icqs-fast serve: model {cfg.model_name!r} on http://{args.host}:{args.port}/v1 "
              f"({'API key required' if args.api_key else 'no API key'}; schema at /openapi.json,"
              " metrics at /metrics)", file=sys.stderr)
    level = args.log_level or ("warning" if args.quiet else "info")
    serve(server, args.host, args.port, log_level=level, access_log=not args.quiet)
    return 0
