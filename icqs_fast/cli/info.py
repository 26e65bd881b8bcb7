"""``icqs-fast info``: versions, device and available backends.
"""

from __future__ import annotations

import argparse
import json

from icqs_fast.info import collect


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for k, v in info.items():
        if k == "backends":
            print("backends:")
            for name, b in v.items():
                mark = "yes" if b["available"] else "no "
                print(f"  {name:7s} {mark}  {b['reason']}")
        else:
            print(f"{k}: {v}")
    return 0
