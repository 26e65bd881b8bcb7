"""``icqs-fast models``: the models loadable by name (installed or not, converted or not) and
what the model cache holds, with sizes."""

from __future__ import annotations

import argparse
import json

from icqs_fast.options import add_json_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("the packaged models --model takes by name (installed or not, converted "
                     "or not) and the model cache's contents, with sizes")
    add_json_argument(p)


def _mb(n: int) -> str:
    return f"{n / 2 ** 20:,.0f} MiB"


def run(args: argparse.Namespace) -> int:
    from icqs_fast import models  # torch: only when run

    packaged, cached = models.packaged_status(), models.cached_models()
    if args.json:
        print(json.dumps({"packaged": packaged, "cache_dir": str(models.cache_dir()),
                          "cache": cached}, indent=2))
        return 0
    print("packaged models (--model NAME):")
    width = max(len(m["name"]) for m in packaged)
    for m in packaged:
        state = ("installed, converted" if m["converted"] else "installed") if m["installed"] \
            else "not installed"
        print(f"  {m['name']:{width}s}  {state:20s}  {m['title']}")
        if not m["installed"]:
            print(f"  {'':{width}s}  to install: {m['install']}")
    print(f"model cache ({models.cache_dir()}): "
          + (f"{len(cached)} entries, {_mb(sum(c['bytes'] for c in cached))}" if cached
             else "empty"))
    for c in cached:
        src = f"  from {c['gguf']}" if c["kind"] != "gguf" and c["gguf"] else ""
        sha = f" (sha256 {c['sha256'][:16]})" if c["sha256"] else ""
        print(f"  {_mb(c['bytes']):>10s}  {c['kind']:9s}  {c['path']}{src}{sha}")
    return 0
